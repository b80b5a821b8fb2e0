"""Argument checks that turn input llama.cpp would crash on into a clear `ValueError`."""

from __future__ import annotations

from typing import Any, Dict, Sequence

import numpy as np

from ._native import import_llama_cpp

llama_cpp = import_llama_cpp()

# llama.cpp's limit on compute threads (GGML_MAX_N_THREADS): OpenMP crashes far above it
MAX_THREADS = 512


def check_sizes(kwargs: Dict[str, Any], n_seq_max: int = 1) -> None:
    """Check the sizes among llama_cpp.Llama's keyword arguments.

    n_ctx >= 0, n_batch and n_ubatch >= 1 (n_batch >= n_seq_max), threads (None: llama-cpp-python's default) 1 to
    MAX_THREADS."""
    for name, lo, hi in (("n_ctx", 0, None), ("n_batch", 1, None), ("n_ubatch", 1, None),
                         ("n_threads", 1, MAX_THREADS), ("n_threads_batch", 1, MAX_THREADS)):
        if name not in kwargs or (kwargs[name] is None and name.startswith("n_threads")):
            continue
        value = kwargs[name]
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo or (hi and value > hi):
            raise ValueError(f"{name} must be an integer >= {lo}" + (f" and <= {hi}" if hi else "") + f", not {value!r}")
    n_batch = kwargs.get("n_batch", 512)  # llama_cpp.Llama's default
    if n_batch < n_seq_max:
        # llama.cpp reserves its graphs for a batch of one token per sequence: it aborted the process
        raise ValueError(f"n_batch={n_batch} is smaller than n_seq_max={n_seq_max}: a batch must be able to hold "
                         "one token of each sequence")


def check_token_ids(tokens: Sequence[int], n_vocab: int) -> None:
    """Check that every token id is in the vocabulary."""
    ids = np.asarray(tokens)
    if ids.size == 0:
        return
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token ids must be integers, not {ids.dtype}")
    bad = ids[(ids < 0) | (ids >= n_vocab)]
    if bad.size:
        raise ValueError(f"token id {int(bad[0])} is outside the vocabulary (0..{n_vocab - 1})")


def check_grammar(llm: Any, grammar: Any) -> None:
    """Check that llama.cpp parses a LlamaGrammar for this model's vocabulary (it logs where it fails)."""
    if grammar is None:
        return
    text, root = getattr(grammar, "_grammar", None), getattr(grammar, "_root", "root")
    if not isinstance(text, str):
        raise ValueError(f"grammar must be a llama_cpp.LlamaGrammar, not {type(grammar).__name__}")
    sampler = llama_cpp.llama_sampler_init_grammar(llm._model.vocab, text.encode("utf-8"), root.encode("utf-8"))
    if not sampler:
        raise ValueError("the grammar does not parse as GBNF (llama.cpp's log says where)")
    llama_cpp.llama_sampler_free(sampler)
