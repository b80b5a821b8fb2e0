"""pykvcache: entropy-guided KV-cache policies running natively inside llama.cpp.

Import pykvcache before llama_cpp: it points llama_cpp at its patched libllama.
"""

from ._native import NativeLibraryError
from .llama import Llama, default_model_path
from .policies import FullCache, KVPolicy, Observe, PolicyError, parse_policy
from .telemetry import KVStats, KVTelemetry, LayerStats

__version__ = "0.1.0"

__all__ = [
    "Llama",
    "KVPolicy",
    "FullCache",
    "Observe",
    "PolicyError",
    "NativeLibraryError",
    "parse_policy",
    "default_model_path",
    "KVStats",
    "KVTelemetry",
    "LayerStats",
]
