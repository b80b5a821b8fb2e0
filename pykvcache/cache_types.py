"""The KV cache types llama.cpp's tools take by name (-ctk / -ctv), as llama-cpp-python's type_k / type_v ids."""

from __future__ import annotations

# name -> ggml type id (common/arg.cpp's list of KV cache types)
CACHE_TYPES = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2, "q4_1": 3, "iq4_nl": 20, "q5_0": 6, "q5_1": 7}


def cache_type_name(type_id: int) -> str:
    """The name of a ggml type id among the KV cache types (its number otherwise)."""
    return next((name for name, t in CACHE_TYPES.items() if t == int(type_id)), str(int(type_id)))


def is_quantized(type_id: int) -> bool:
    """Whether a KV cache type is quantized (llama.cpp then needs flash attention for V)."""
    return cache_type_name(type_id) not in ("f32", "f16", "bf16")


def cache_type_id(value: "int | str") -> int:
    """A KV cache type given by name (q8_0) or by ggml type id (8), as its id."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip()
    if text.lstrip("-").isdigit():
        return int(text)
    if text.lower() in CACHE_TYPES:
        return CACHE_TYPES[text.lower()]
    raise ValueError(f"unknown KV cache type {value!r}: give one of {', '.join(CACHE_TYPES)} or a ggml type id")
