"""Several sequences in one context: greedy generation of many prompts decoded together, each in caches of its own."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, List, Sequence

import numpy as np

from ._native import import_llama_cpp, last_error, native
from .checks import check_token_ids
from .policies import PolicyError

llama_cpp = import_llama_cpp()

_params_lock = threading.Lock()


@contextlib.contextmanager
def context_params_with(n_seq_max: int, embedding: bool = False) -> Iterator[None]:
    """While active, contexts llama-cpp-python creates hold n_seq_max sequences.

    Its Llama has no such argument. With `embedding`, also those it makes for embeddings (its own choice there: one per
    batched input, up to 256)."""
    import llama_cpp.llama_cpp as lib

    if n_seq_max == 1 and not embedding:
        yield
        return
    with _params_lock:
        orig = lib.llama_context_default_params
        orig_max = lib.llama_max_parallel_sequences

        def params() -> Any:
            p = orig()
            p.n_seq_max = n_seq_max
            return p

        lib.llama_context_default_params = params
        if embedding:
            lib.llama_max_parallel_sequences = lambda: n_seq_max
        try:
            yield
        finally:
            lib.llama_context_default_params = orig
            lib.llama_max_parallel_sequences = orig_max


def generate_batch(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int) -> List[List[int]]:
    """Greedy continuations of several prompts, decoded together in sequences 0..n-1 of `llm`'s context."""
    n_seq = int(llama_cpp.llama_n_seq_max(llm._ctx.ctx))
    if not prompts or len(prompts) > n_seq:
        raise ValueError(f"generate_batch takes 1 to n_seq_max={n_seq} prompts, got {len(prompts)}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("generate_batch: every prompt needs at least one token")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    for p in prompts:  # before any sequence is cleared (a bad id failed in llama_decode, "see the log")
        check_token_ids(p, llm.n_vocab())
    n_ctx_seq = int(llama_cpp.llama_n_ctx(llm._ctx.ctx)) // n_seq  # the context's (a view's n_ctx() is its sequence's)
    longest = max(len(p) for p in prompts) + max_tokens
    if longest > n_ctx_seq:
        raise ValueError(f"a prompt and its {max_tokens} tokens need {longest} positions, each sequence has "
                         f"n_ctx/n_seq_max = {n_ctx_seq}")

    ctx = llm._ctx.ctx
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)  # every sequence (kv_cache_seq_rm(-1) is 0's)
    llm.n_tokens = 0  # llama-cpp-python's own record of sequence 0 no longer holds
    llm._sequence_changed(None)  # nor the records of the context's other users (pykvcache.parallel)
    pol = getattr(llm, "kv_policy", None)
    if pol is not None and pol.retains:
        _, lib = native()
        nctx = llm._native_ctx()
        for s, p in enumerate(prompts):  # a fractional budget is resolved against each sequence's own prompt
            if lib.llama_kvp_seq_select(nctx, s) != 0 or lib.llama_kvp_set_prompt_len(nctx, len(p)) != 0:
                raise PolicyError(last_error())

    n_batch = llm.n_batch
    batch = llama_cpp.llama_batch_init(max(n_batch, n_seq), 0, 1)
    try:
        cur = {}
        if pol is not None and (pol.retains or pol.sparse):
            # what eval() does to a prompt (its chunks evicted as they come, guided, the prompt's end, a latent
            # re-rank), sequence by sequence: interleaved, a batch's chunks mix the prompts
            for s, p in enumerate(prompts):
                cur[s] = _prefill_one(llm, batch, s, p)
        else:
            # the prompts, n_batch tokens per decode call in sequence order; each prompt's last token gives logits
            pending = [(s, i, t) for s, p in enumerate(prompts) for i, t in enumerate(p)]
            for i0 in range(0, len(pending), n_batch):
                part = [(s, i, t, i == len(prompts[s]) - 1) for s, i, t in pending[i0 : i0 + n_batch]]
                _fill(batch, [(t, i, s, last) for s, i, t, last in part])
                _decode(ctx, batch)
                cur.update({s: _argmax(ctx, j, llm.n_vocab()) for j, (s, _, _, last) in enumerate(part) if last})
        # then one token per live sequence per decode call
        out: List[List[int]] = [[cur[s]] for s in range(len(prompts))]
        pos = [len(p) for p in prompts]
        eos = llm.token_eos()
        live = [s for s in range(len(prompts)) if cur[s] != eos and max_tokens > 1]
        while live:
            _fill(batch, [(cur[s], pos[s], s, True) for s in live])
            _decode(ctx, batch)
            for j, s in enumerate(live):
                pos[s] += 1
                cur[s] = _argmax(ctx, j, llm.n_vocab())
                out[s].append(cur[s])
            live = [s for s in live if cur[s] != eos and len(out[s]) < max_tokens]
        return out
    finally:
        llama_cpp.llama_batch_free(batch)
        if pol is not None and pol.retains:  # llama_cpp's methods and eval act on sequence 0, the native calls on the
            native()[1].llama_kvp_seq_select(llm._native_ctx(), 0)  # selected one: it was left at the last prompt's


def _prefill_one(llm: Any, batch: Any, s: int, p: Sequence[int]) -> int:
    """Prompt p into sequence s as Llama.eval evaluates a prompt in a context of its own; returns its greedy token."""
    ffi, lib = native()
    nctx, ctx, n_batch = llm._native_ctx(), llm._ctx.ctx, llm.n_batch
    if llm.kv_policy.retains and lib.llama_kvp_seq_select(nctx, s) != 0:  # sparse alone: llama.cpp's cache, one sequence
        raise PolicyError(last_error())
    evicted0 = llm._n_evicted(nctx) if llm._latent_at_end else 0  # nctx: sequence s stays selected
    k = 0
    if llm.kv_policy.guides and len(p) > 1:  # question-guided chunks, scored by the prompt's end run behind them
        k = lib.llama_kvp_prefill_guided(nctx, list(p), len(p), 0)
        if k < 0:
            raise RuntimeError(last_error())
    rest = list(range(k, len(p)))
    if llm.kv_policy.observes and len(rest) > 1 and len(rest) % n_batch == 1:
        lib.llama_kvp_obs_request(nctx)  # a prompt's last chunk observes even if it is one token
    for i0 in range(0, len(rest), n_batch):  # only the prompt's last token gives logits (its end, for summarise)
        _fill(batch, [(p[i], i, s, i == len(p) - 1) for i in rest[i0 : i0 + n_batch]])
        _decode(ctx, batch)
    if llm._latent_at_end and len(p) > 1:
        # re-ranked by the prompt's end, its last tokens evaluated again (stages/schedule-latent.cpp), as in Llama.eval
        pruned = llm._n_evicted(nctx) > evicted0
        if lib.llama_kvp_latent_prompt_end(nctx, list(p), len(p), 0, pruned, ffi.NULL) < 0:
            raise RuntimeError(last_error())
        return _argmax(ctx, -1, llm.n_vocab())
    return _argmax(ctx, batch.n_tokens - 1, llm.n_vocab())


def _fill(batch: Any, items: Sequence[tuple]) -> None:
    # items: (token, position, sequence, wants logits)
    batch.n_tokens = len(items)
    for j, (t, p, s, logits) in enumerate(items):
        batch.token[j] = t
        batch.pos[j] = p
        batch.n_seq_id[j] = 1
        batch.seq_id[j][0] = s
        batch.logits[j] = logits


def _decode(ctx: Any, batch: Any) -> None:
    ret = llama_cpp.llama_decode(ctx, batch)
    if ret != 0:
        raise RuntimeError(f"llama_decode failed ({ret}): {last_error() or 'see the log'}")


def _argmax(ctx: Any, j: int, n_vocab: int) -> int:
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, j), shape=(n_vocab,))
    return int(np.argmax(logits))
