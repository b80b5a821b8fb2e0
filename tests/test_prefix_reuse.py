"""Prefix reuse over a pruned cache: every call sequence gives what fresh contexts give, the cache is reused where that
is exact, a truncation into evicted positions keeps them consistent, and states round-trip (issue 17)."""

from __future__ import annotations

import inspect

import llama_cpp
import numpy as np
import pytest
from conftest import PROSE, last_logits

from pykvcache import Llama

# small budgets: the prompts below are longer than every budget, so every policy evicts
POLICIES = [
    "sink_recent:n_sink=4,n_recent=12",
    "snapkv:budget=16,window=8",
    "h2o:budget=16,n_recent=8",
    "pyramid:budget=16,window=8",
    "entropy:budget=16,n_recent=8",
]

FOX = "The quick brown fox jumps over the lazy dog. The quick brown fox"
CALLS = [
    (FOX, 6),
    (FOX, 6),                                                    # the same prompt again (issue 17, second failure)
    ("The capital of france is paris, 'true' or 'false'?:\n", 4),
    ("The capital of france is par", 4),                         # a prefix of the previous prompt (first failure)
    (PROSE, 6),
    (PROSE + " The mission was", 6),                             # extends the previous prompt
    ("The capital of france is", 3),
]


def completion(llm, prompt, n):
    return llm.create_completion(prompt, max_tokens=n, temperature=0.0)["choices"][0]["text"]


def counting(llm):
    """Wrap llm.eval to record how many tokens each call evaluates."""
    counts = []
    inner = llm.eval

    def ev(tokens):
        counts.append(len(tokens))
        inner(tokens)

    llm.eval = ev
    return counts


@pytest.mark.parametrize("policy", POLICIES)
def test_call_sequence_equals_fresh_contexts(model_path, policy):
    llm = Llama(model_path, n_ctx=128, n_batch=128, verbose=False, kv_policy=policy)
    for prompt, n in CALLS:
        fresh = Llama(model_path, n_ctx=128, n_batch=128, verbose=False, kv_policy=policy)
        assert completion(llm, prompt, n) == completion(fresh, prompt, n), (policy, prompt)
        fresh.close()
    assert llm.kv_memory().n_evicted > 0


@pytest.mark.parametrize("policy", ["sink_recent:n_sink=4,n_recent=60", "snapkv:budget=64,window=8",
                                    "entropy:budget=64,n_recent=8"])
def test_exact_prefix_is_reused(model_path, policy):
    llm = Llama(model_path, n_ctx=128, n_batch=128, verbose=False, kv_policy=policy)
    first = completion(llm, FOX, 4)
    assert llm.kv_memory().n_evicted == 0
    counts = counting(llm)
    prompt = FOX + " jumps over"
    n_prompt = len(llm.tokenize(prompt.encode()))
    out = completion(llm, prompt, 4)
    assert counts[0] < n_prompt  # a prefix was kept: llama-cpp-python's reuse, on a cache nothing was evicted from
    fresh = Llama(model_path, n_ctx=128, n_batch=128, verbose=False, kv_policy=policy)
    assert completion(fresh, FOX, 4) == first
    assert completion(fresh, prompt, 4) == out  # a fresh context after the same calls
    fresh2 = Llama(model_path, n_ctx=128, n_batch=128, verbose=False, kv_policy=policy)
    assert completion(fresh2, prompt, 4) == out  # a fresh context with this prompt alone


def test_pruned_prefix_is_evaluated_again(model_path):
    llm = Llama(model_path, n_ctx=128, n_batch=128, verbose=False, kv_policy="snapkv:budget=16,window=8")
    completion(llm, PROSE, 6)
    assert llm.kv_memory().n_evicted > 0
    counts = counting(llm)
    prompt = PROSE + " The mission was"
    completion(llm, prompt, 2)
    assert counts[0] == len(llm.tokenize(prompt.encode()))


def test_truncation_into_evicted_positions_continues(model_path):
    llm = Llama(model_path, n_ctx=64, n_batch=8, verbose=False, kv_policy="sink_recent:n_sink=4,n_recent=12")
    tokens = llm.tokenize(PROSE.encode())[:40]
    llm.eval(tokens)
    mem = llama_cpp.llama_get_memory(llm._ctx.ctx)
    assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == 39
    held = llm.kv_retained().any(axis=0)
    p = next(p for p in range(5, 40) if not held[p - 1])  # a truncation point just past an evicted position
    assert llama_cpp.llama_memory_seq_rm(mem, 0, p, -1)
    assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == p - 1  # the sequence's end, not the last cell held
    llm.n_tokens = p
    llm.eval(tokens[p:p + 10])  # llama.cpp checks that the batch starts at the sequence's end
    assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == p + 9


def snapshot(llm):
    """What a state holds of the cache: the retained map, each layer's budget and cells in use, the tokens (the
    logits of the next step tell the rest; llama-cpp-python's load_state leaves llama.cpp's last logits as they were)."""
    mem = llm.kv_memory()
    return (llm.kv_retained().tolist(), [(b.budget, b.n_used, b.n_evicted) for b in mem.layers], llm.n_tokens)


def next_logits(llm, tok):
    llm.eval([tok])
    return last_logits(llm).tolist()


@pytest.mark.parametrize("policy", POLICIES)
def test_state_round_trips_through_the_same_calls(model_path, policy):
    llm = Llama(model_path, n_ctx=128, n_batch=128, verbose=False, kv_policy=policy)
    completion(llm, PROSE, 8)
    state = llm.save_state()
    saved = snapshot(llm)
    tok = int(llm.tokenize(b" mission", add_bos=False)[0])
    went_on = next_logits(llm, tok)  # the pruned cache as it was saved, one step further
    llm.load_state(state)
    assert snapshot(llm) == saved and next_logits(llm, tok) == went_on
    fresh = Llama(model_path, n_ctx=128, n_batch=128, verbose=False, kv_policy=policy)
    fresh.load_state(state)
    assert snapshot(fresh) == saved and next_logits(fresh, tok) == went_on  # bit for bit in another context
    assert any(not all(row) for row in saved[0])  # the state holds a pruned cache
    llm.load_state(state)
    follow = PROSE + " The mission was"
    x = [completion(llm, follow, 6), completion(llm, FOX, 4)]
    llm.load_state(state)
    y = [completion(llm, follow, 6), completion(llm, FOX, 4)]
    other = Llama(model_path, n_ctx=128, n_batch=128, verbose=False, kv_policy=policy)
    other.load_state(state)
    z = [completion(other, follow, 6), completion(other, FOX, 4)]
    assert x == y == z


@pytest.mark.parametrize("policy", ["entropy:budget=0.25", "snapkv:budget=0.25+entropy"])
def test_a_prompt_evaluated_again_gives_a_fresh_contexts_logits(model_path, policy):
    """Entropy decides each layer's budget during a prompt; the next prompt, even the same one, starts again from the
    fixed budgets a fresh context starts with (they were kept once the emptied cache forgot who had decided them)."""
    prompt = PROSE * 5 + " In one sentence, the mission was"

    def evaluated(llm):
        llm.reset()
        llm.eval(llm.tokenize(prompt.encode()))
        return last_logits(llm)

    llm = Llama(model_path, n_ctx=1024, verbose=False, kv_policy=policy)
    first = evaluated(llm)
    decided = llm.kv_memory().budgets
    assert len(set(decided)) > 1  # entropy decided unequal budgets
    again = evaluated(llm)
    fresh = Llama(model_path, n_ctx=1024, verbose=False, kv_policy=policy)
    assert (again == first).all() and (evaluated(fresh) == first).all()
    assert llm.kv_memory().budgets == decided


def test_reset_false_continues_by_keyword_and_by_position(model_path):
    """generate(tokens, ..., reset=False) appends to what the context holds, whether reset is named or is its 8th
    argument (by position the pruned cache's prefix rule had run and dropped the earlier tokens)."""
    names = list(inspect.signature(llama_cpp.Llama.generate).parameters)[2:]
    defaults = [inspect.signature(llama_cpp.Llama.generate).parameters[n].default for n in names]
    positional = [False if n == "reset" else d for n, d in zip(names, defaults)]
    held = []
    for how in ("keyword", "position"):
        llm = Llama(model_path, n_ctx=256, verbose=False, kv_policy=POLICIES[0])
        first = llm.tokenize(FOX.encode())
        for _ in zip(range(3), llm.generate(first, top_k=1)):
            pass
        n_before = llm.n_tokens
        more = llm.tokenize(b" and runs away.", add_bos=False)
        gen = llm.generate(more, top_k=1, reset=False) if how == "keyword" else llm.generate(more, *positional)
        for _ in zip(range(2), gen):
            pass
        held.append((n_before, llm.n_tokens))
    assert held[0] == held[1] and held[0][1] > held[0][0] + len(more), held


@pytest.mark.parametrize("policy", ["sink_recent:n_sink=4,n_recent=252", "h2o:budget=128", "snapkv:budget=256",
                                    "freeze"])
def test_a_follow_up_under_the_budget_gives_a_fresh_contexts_logits(model_path, policy):
    """Found by an audit: before any eviction a follow-up kept tokens computed alone (the answer's decode steps; a
    repeated prompt's last token, evaluated again alone), whose values round otherwise than a prompt batch's (logits
    up to ~0.6 apart): greedy answers differed from a fresh context's, which kv_reuse='exact' promises."""
    prompt = "Alice has three apples and buys five more. Bob has two pears. Tell a short story about them.\n"

    def make():
        return Llama(model_path, n_ctx=512, verbose=False, kv_policy=policy)

    for follow_up in ("extend", "repeat"):
        llm = make()
        answer = completion(llm, prompt, 24)
        second = prompt + answer + "\nThen" if follow_up == "extend" else prompt
        counts = counting(llm)
        completion(llm, second, 1)
        assert llm.kv_memory().n_evicted == 0
        if follow_up == "extend":
            # the first prompt's part was kept (but its last token or two, where the answer's first joins it)
            assert counts[0] <= len(llm.tokenize(second.encode())) - len(llm.tokenize(prompt.encode())) + 2
        fresh = make()
        completion(fresh, second, 1)
        np.testing.assert_array_equal(last_logits(llm), last_logits(fresh), err_msg=f"{policy} {follow_up}")
        llm.close()
        fresh.close()


def test_an_interrupt_stops_a_guided_prompt_between_two_chunks(model_path):
    """Found by an audit: a guided prompt (SnapKV, entropy, pyramid) ran all its chunks but the last in one native
    call, so Ctrl-C waited for the prompt's end (16 s on 3k tokens at 1 thread) and the chunks done were lost. A
    chunk per call now: it stops after the chunk it is in, the chunks done kept, and the Llama goes on as a fresh one."""
    import signal

    policy = "snapkv:budget=0.25"
    llm = Llama(model_path, n_ctx=4096, verbose=False, kv_policy=policy)
    prompt = llm.tokenize((PROSE + " ").encode()) * 40
    prompt = prompt[:3000]
    before = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            llm.eval(prompt)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
    chunk = llm.kv_memory().chunk
    assert 0 < llm.n_tokens < len(prompt) - chunk  # stopped early, where a chunk ends (the first takes the rest)
    assert (llm.n_tokens - (len(prompt) - chunk) % chunk) % chunk == 0
    assert list(llm.input_ids[: llm.n_tokens]) == prompt[: llm.n_tokens]
    fresh = Llama(model_path, n_ctx=4096, verbose=False, kv_policy=policy)
    assert completion(llm, FOX, 8) == completion(fresh, FOX, 8)
    fresh.close()
    llm.close()
