"""pykvcache: entropy-guided KV-cache policies running natively inside llama.cpp.

Import pykvcache before llama_cpp: it points llama_cpp at its patched libllama.
"""

from pathlib import Path as _Path

if not (_Path(__file__).parent / "_models").is_dir():
    # the repository's pykvcache/ lacks what the build installs beside it (the model registry, the cffi bindings)
    raise ImportError(f"{_Path(__file__).parent} is pykvcache's source folder, not the installed package: run Python "
                      "from another folder (bash scripts/setup.sh installs the package)")

from ._native import NativeLibraryError  # noqa: E402
from .llama import Llama, default_model_path
from .policies import Composed, KVPolicy, Policy, PolicyError, Stage, Stages, parse_policy, policy_help
from .presets import H2O, EntropyLayerBudget, Freeze, FullCache, Observe, Pyramid, RetentionPolicy, SinkRecent, SnapKV
from .stages import (
    AccumulatedScore,
    DensePrefill,
    DropFate,
    SummariseFate,
    EntropyBudget,
    EverySchedule,
    FreezeSchedule,
    HostFate,
    LatentSchedule,
    PromptSchedule,
    PyramidBudget,
    RecencyScore,
    SparsePrefill,
    UniformBudget,
    WindowScore,
)
from .recovery import RecoveryEvent
from .telemetry import (HostTelemetry, KVLayer, KVMemory, KVPerf, KVStats, KVTelemetry, LayerBudget, LayerStats,
                        SparseTelemetry, SummaryTelemetry)
from .threads import ConcurrentUseError

__version__ = "0.1.0"

__all__ = [
    "Llama",
    "Policy",
    "KVPolicy",
    "Stage",
    "Stages",
    "Composed",
    "FullCache",
    "Observe",
    "RetentionPolicy",
    "SinkRecent",
    "SnapKV",
    "H2O",
    "Pyramid",
    "EntropyLayerBudget",
    "Freeze",
    "UniformBudget",
    "PyramidBudget",
    "EntropyBudget",
    "RecencyScore",
    "WindowScore",
    "AccumulatedScore",
    "PromptSchedule",
    "EverySchedule",
    "FreezeSchedule",
    "LatentSchedule",
    "DropFate",
    "SummariseFate",
    "HostFate",
    "DensePrefill",
    "SparsePrefill",
    "PolicyError",
    "NativeLibraryError",
    "ConcurrentUseError",
    "RPCError",
    "parse_policy",
    "policy_help",
    "default_model_path",
    "KVStats",
    "KVTelemetry",
    "HostTelemetry",
    "SparseTelemetry",
    "SummaryTelemetry",
    "KVLayer",
    "RecoveryEvent",
    "LayerStats",
    "KVMemory",
    "KVPerf",
    "LayerBudget",
]


def __getattr__(name: str) -> object:
    """RPCError from pykvcache.rpc on first use (imported here, `python -m pykvcache.rpc` would warn that it ran twice)."""
    if name == "RPCError":
        from .rpc import RPCError

        return RPCError
    raise AttributeError(f"module 'pykvcache' has no attribute {name!r}")
