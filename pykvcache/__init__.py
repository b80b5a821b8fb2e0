"""pykvcache: entropy-guided KV-cache policies running natively inside llama.cpp.

Import pykvcache before llama_cpp: it points llama_cpp at its patched libllama.
"""

from ._native import NativeLibraryError
from .llama import Llama, default_model_path
from .policies import (
    H2O,
    EntropyLayerBudget,
    FullCache,
    KVPolicy,
    Observe,
    PolicyError,
    Pyramid,
    RetentionPolicy,
    SinkRecent,
    SnapKV,
    parse_policy,
)
from .telemetry import KVMemory, KVStats, KVTelemetry, LayerBudget, LayerStats

__version__ = "0.1.0"

__all__ = [
    "Llama",
    "KVPolicy",
    "FullCache",
    "Observe",
    "RetentionPolicy",
    "SinkRecent",
    "SnapKV",
    "H2O",
    "Pyramid",
    "EntropyLayerBudget",
    "PolicyError",
    "NativeLibraryError",
    "parse_policy",
    "default_model_path",
    "KVStats",
    "KVTelemetry",
    "LayerStats",
    "KVMemory",
    "LayerBudget",
]
