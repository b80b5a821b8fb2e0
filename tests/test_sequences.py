"""Several sequences in one context (n_seq_max > 1): each sequence behaves as in a context of its own."""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np
import pytest

from pykvcache import Llama, PolicyError
from pykvcache._native import last_error, native

TEXTS = [
    "The capital of France is Paris. " * 20 + "Q: What is the capital of France? A:",
    "def add(a, b):\n    return a + b\n" * 15 + "# the function above",
    "Once upon a time there was a lighthouse keeper named Ada. " * 12 + "The keeper was called",
]
N_CTX_SEQ = 512


def _single_runs(model_path, spec, prompts, n):
    """Tokens of each prompt in a context of its own, and the KV bytes of those contexts."""
    res, n_bytes = [], 0
    for p in prompts:
        llm = Llama(model_path, n_ctx=N_CTX_SEQ, verbose=False, kv_policy=spec)
        res.append(llm.generate_batch([p], n)[0])
        n_bytes += llm.kv_memory().bytes
        llm.close()
    return res, n_bytes


@pytest.mark.parametrize("spec", ["snapkv:budget=64", "entropy:budget=64", "h2o:budget=64",
                                  "sink_recent:n_sink=4,n_recent=60", "snapkv:budget=0.3+summarise", None])
def test_batched_sequences_generate_what_single_contexts_do(model_path, spec):
    llm = Llama(model_path, n_ctx=3*N_CTX_SEQ, n_seq_max=3, verbose=False, kv_policy=spec)
    prompts = [llm.tokenize(t.encode()) for t in TEXTS]
    out = llm.generate_batch(prompts, 24)
    ref, ref_bytes = _single_runs(model_path, spec, prompts, 24)
    assert out == ref
    n_held = sum(len(p) + 23 for p in prompts)  # each sequence's prompt and generated tokens but the last
    for layer in llm.kv_stats().layers:  # one cache per layer, as many cells as its bytes hold, every sequence's
        assert layer.n_used <= layer.n_cells and (spec is not None or layer.n_used == n_held)
        assert layer.k_bytes % layer.n_cells == 0
    if spec is None:
        assert {layer.n_cells for layer in llm.kv_stats().layers} == {3 * N_CTX_SEQ}
    if spec is not None:
        # every sequence kept its own budgets: the memory is that of three single contexts
        mem = llm.kv_memory()
        assert mem.n_evicted > 0
        assert mem.bytes == ref_bytes
    llm.close()


@pytest.mark.parametrize("spec", ["snapkv:budget=0.25", "snapkv:budget=0.2+summarise:bin=32,rank=4",
                                  "snapkv:budget=0.25+host+latent", "freeze", "h2o:budget=0.1+host+freeze"])
def test_batched_sequences_generate_what_generate_does(model_path, spec):
    """A prompt's own treatment in eval() (question-guided chunks, its end settled for summarise, the latent re-rank
    at its end) applies in a batch too: the batch's prefill skipped it, so SnapKV's text differed from generate()."""
    llm = Llama(model_path, n_ctx=3 * N_CTX_SEQ, n_seq_max=3, verbose=False, kv_policy=spec)
    prompts = [llm.tokenize(t.encode()) for t in TEXTS]
    out = llm.generate_batch(prompts, 8)
    for p, got in zip(prompts, out):
        single = Llama(model_path, n_ctx=N_CTX_SEQ, verbose=False, kv_policy=spec)
        ref = []
        for t in single.generate(p, temp=0.0):
            ref.append(t)
            if len(ref) == 8:
                break
        single.close()
        assert got == ref
    llm.close()


def test_prompts_longer_than_a_batch_together_generate_what_single_contexts_do(model_path):
    """300 + 250 prompt tokens, more than n_batch (512): interleaved, one batch held the first prompt and the start of
    the second, so the freeze schedule saw the second's chunks differently (found by an audit)."""
    from pykvcache.corpus import essays

    llm = Llama(model_path, n_ctx=2048, n_seq_max=2, verbose=False, kv_policy="freeze")
    t = llm.tokenize(" ".join(essays()[:2]).encode())
    prompts = [t[:300], t[300:550]]
    out = llm.generate_batch(prompts, 40)
    llm.close()
    for p, got in zip(prompts, out):
        single = Llama(model_path, n_ctx=1024, verbose=False, kv_policy="freeze")
        assert single.generate_batch([p], 40)[0] == got
        single.close()


def test_each_sequence_resolves_its_own_budget(model_path):
    llm = Llama(model_path, n_ctx=2*N_CTX_SEQ, n_seq_max=2, verbose=False, kv_policy="snapkv:budget=0.25")
    prompts = [llm.tokenize(t.encode()) for t in TEXTS[:2]]
    first = llm.generate_batch(prompts, 4)
    _, lib = native()
    assert llm.generate_batch(prompts, 4) == first and llm.generate_batch(prompts, 4) == first  # each call starts afresh
    for s, p in enumerate(prompts):
        assert lib.llama_kvp_seq_select(llm._native_ctx(), s) == 0
        mem = llm.kv_memory()
        assert mem.n_prompt == len(p)
        assert mem.budget == round(0.25*len(p))
        assert all(layer.n_used <= layer.budget + 16 for layer in mem.layers)  # eviction once per 16 decode steps
    assert lib.llama_kvp_seq_select(llm._native_ctx(), 2) != 0
    assert "out of range" in last_error()
    llm.close()


def _decode_steps(llm, seqs, cur, pos, n):
    """n greedy steps of the given sequences together, from their current tokens and positions."""
    ctx = llm._ctx.ctx
    batch = llama_cpp.llama_batch_init(len(seqs), 0, 1)
    out = {s: [] for s in seqs}
    try:
        for _ in range(n):
            batch.n_tokens = len(seqs)
            for j, s in enumerate(seqs):
                batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.logits[j] = cur[s], pos[s], 1, True
                batch.seq_id[j][0] = s
            assert llama_cpp.llama_decode(ctx, batch) == 0
            for j, s in enumerate(seqs):
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, j), shape=(llm.n_vocab(),))
                cur[s] = int(np.argmax(logits))
                pos[s] += 1
                out[s].append(cur[s])
    finally:
        llama_cpp.llama_batch_free(batch)
    return out


def test_a_sequence_saved_and_loaded_into_another_continues_alike(model_path):
    llm = Llama(model_path, n_ctx=2*N_CTX_SEQ, n_seq_max=2, verbose=False, kv_policy="sink_recent:n_sink=4,n_recent=60")
    prompts = [llm.tokenize(t.encode()) for t in TEXTS[:2]]
    first = llm.generate_batch(prompts, 8)
    ctx = llm._ctx.ctx
    n = llama_cpp.llama_state_seq_get_size(ctx, 1)
    buf = (ctypes.c_uint8 * n)()
    assert llama_cpp.llama_state_seq_get_data(ctx, buf, n, 1) == n

    # sequence 1 goes on; then its saved state replaces sequence 0 and goes on from the same point
    pos = {1: len(prompts[1]) + 7, 0: len(prompts[1]) + 7}
    expect = _decode_steps(llm, [1], {1: first[1][-1]}, dict(pos), 8)[1]
    assert llama_cpp.llama_state_seq_set_data(ctx, buf, n, 0) == n
    got = _decode_steps(llm, [0], {0: first[1][-1]}, dict(pos), 8)[0]
    assert got == expect
    llm.close()


def test_the_whole_state_holds_every_sequence(model_path):
    llm = Llama(model_path, n_ctx=2*N_CTX_SEQ, n_seq_max=2, verbose=False, kv_policy="h2o:budget=64")
    prompts = [llm.tokenize(t.encode()) for t in TEXTS[:2]]
    first = llm.generate_batch(prompts, 8)
    state = llm.save_state()
    pos = {s: len(p) + 7 for s, p in enumerate(prompts)}
    cur = {s: first[s][-1] for s in (0, 1)}
    expect = _decode_steps(llm, [0, 1], dict(cur), dict(pos), 8)
    llm.load_state(state)
    assert _decode_steps(llm, [0, 1], dict(cur), dict(pos), 8) == expect

    # a context holding one sequence refuses it (the log names both counts)
    one = Llama(model_path, n_ctx=N_CTX_SEQ, verbose=False, kv_policy="h2o:budget=64")
    with pytest.raises(RuntimeError):
        one.load_state(state)
    one.close()
    llm.close()


def test_a_token_in_two_sequences_is_refused(model_path):
    llm = Llama(model_path, n_ctx=2*N_CTX_SEQ, n_seq_max=2, verbose=False, kv_policy="snapkv:budget=64")
    batch = llama_cpp.llama_batch_init(4, 0, 2)
    try:
        batch.n_tokens = 1
        batch.token[0], batch.pos[0], batch.n_seq_id[0], batch.logits[0] = 1, 0, 2, True
        batch.seq_id[0][0], batch.seq_id[0][1] = 0, 1
        assert llama_cpp.llama_decode(llm._ctx.ctx, batch) != 0
        assert "exactly one sequence" in last_error()
    finally:
        llama_cpp.llama_batch_free(batch)
    # the context still works
    assert len(llm.generate_batch([llm.tokenize(b"Hello")], 2)[0]) == 2
    llm.close()


def test_bad_arguments(model_path):
    with pytest.raises(ValueError, match="n_seq_max must be an integer >= 1"):
        Llama(model_path, n_ctx=N_CTX_SEQ, n_seq_max=0, verbose=False)
    with pytest.raises(PolicyError, match="one sequence per context"):
        Llama(model_path, n_ctx=2*N_CTX_SEQ, n_seq_max=2, verbose=False, kv_policy="observe")
    llm = Llama(model_path, n_ctx=2*N_CTX_SEQ, n_seq_max=2, verbose=False, kv_policy="snapkv:budget=64")
    with pytest.raises(ValueError, match="1 to n_seq_max=2 prompts"):
        llm.generate_batch([[1], [2], [3]], 4)
    with pytest.raises(ValueError, match="n_ctx/n_seq_max = 512"):
        llm.generate_batch([[1] * 500], 16)
    llm.close()


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


def test_sequence_views_share_the_model_and_the_context(model_path):
    """The server's --n_parallel views: no view loads the model or builds a context again (a copy.copy of a
    llama-cpp-python Llama would: its __setstate__ runs __init__)."""
    from pykvcache.parallel import sequence_views

    llm = Llama(model_path, n_ctx=4*N_CTX_SEQ, n_seq_max=4, verbose=False, kv_policy="snapkv:budget=64")
    before = _rss_mib()
    views = sequence_views(llm)
    assert len(views) == 4 and _rss_mib() - before < 20  # the model alone is ~100 MiB, each context more
    assert all(v._model is llm._model and v._ctx._inner is llm._ctx for v in views)
    assert views[1].create_completion("The capital of France is", max_tokens=4, temperature=0)["choices"][0]["text"]
    llm.close()


@pytest.mark.parametrize("spec", ["snapkv:budget=0.5", "entropy:budget=64"])
def test_embeddings_under_a_retention_policy_hold_one_sequence(model_path, spec):
    """llama-cpp-python gives an embedding context 256 sequences (one per batched input); a retention policy has caches
    of its own per sequence, so there it holds n_seq_max (1) and embeds one input per batch, with the same vectors."""
    texts = ["hello world", "the cat sat on the mat", "KV caches bound the context a laptop can hold"]
    llm = Llama(model_path, n_ctx=N_CTX_SEQ, verbose=False, embedding=True, kv_policy=spec)
    assert llama_cpp.llama_n_seq_max(llm._ctx.ctx) == 1 and llm.context_params.n_seq_max == 1
    assert llm.kv_memory().bytes < 30 * 2**20  # 256 sequences' caches were ~4 GiB at n_ctx 2048
    got = llm.embed(texts)
    llm.close()
    ref = Llama(model_path, n_ctx=N_CTX_SEQ, verbose=False, embedding=True)
    assert llama_cpp.llama_n_seq_max(ref._ctx.ctx) > 1  # llama-cpp-python's own choice stays without a policy
    for text, g in zip(texts, got):  # each alone: llama-cpp-python 0.3.36 misreads the token vectors of a batch's
        assert np.array_equal(np.array(g), np.array(ref.embed(text)))  # later inputs when pooling is none
    ref.close()


@pytest.mark.parametrize("spec", [None, "snapkv:budget=64"])
def test_the_llama_methods_after_a_batch_run_sequence_0_in_its_own_positions(model_path, spec):
    """After generate_batch of two prompts a retention policy left the last sequence selected: every llm(...) then
    failed ('the prompt length can only be set while the cache is empty'). And llama_cpp's methods, which run
    sequence 0, checked prompts against the whole context: a prompt past n_ctx/n_seq_max failed in llama_decode (or,
    under a policy, ran past the sequence's positions)."""
    llm = Llama(model_path, n_ctx=2 * N_CTX_SEQ, n_seq_max=2, verbose=False, kv_policy=spec)
    one = Llama(model_path, n_ctx=N_CTX_SEQ, verbose=False, kv_policy=spec)
    prompts = [llm.tokenize(t.encode()) for t in TEXTS[:2]]
    llm.generate_batch(prompts, 4)
    question = "The capital of France is"
    assert llm(question, max_tokens=6, temperature=0)["choices"] == one(question, max_tokens=6, temperature=0)["choices"]
    long = llm.tokenize((TEXTS[2] * 6).encode())
    with pytest.raises(ValueError, match=f"exceed context window of {N_CTX_SEQ}"):
        llm.create_completion(long[:N_CTX_SEQ + 50], max_tokens=4)
    out = llm.create_completion(long[:N_CTX_SEQ - 12], max_tokens=30, temperature=0)
    assert out["usage"]["total_tokens"] == N_CTX_SEQ and out["choices"][0]["finish_reason"] == "length"
    with pytest.raises(ValueError, match="token id 99999999 is outside the vocabulary"):  # "see the log", no log
        llm.generate_batch([prompts[0], [1, 99999999]], 2)


@pytest.mark.parametrize("spec", ["snapkv:budget=64", "h2o:budget=128"])
def test_the_llama_methods_after_a_sequence_view_run_sequence_0(model_path, spec):
    """Found by a fuzzer: once a sequence view of sequence 1 had run, the parent's own calls (budget, guided prefill,
    prefix reuse) acted on sequence 1: its next prompt failed ('the prompt length can only be set while the cache is
    empty'), or a continuation of its earlier prompt changed (snapkv: '... not just a company that is' became
    '... not just a software company.'). The telemetry reads the sequence selected last (llama_kvp_seq_select)."""
    from pykvcache import corpus
    from pykvcache.parallel import sequence_stats, sequence_views

    text, other = corpus.essays()[2][:600], corpus.essays()[9][:300]

    def run(with_view):
        llm = Llama(model_path, n_ctx=2 * N_CTX_SEQ, n_seq_max=2, n_threads=1, n_threads_batch=1, verbose=False,
                    kv_policy=spec)
        views = sequence_views(llm)
        if with_view:
            views[1].create_completion(other, max_tokens=4, temperature=0)
        first = llm.create_completion(text, max_tokens=8, temperature=0)["choices"][0]["text"]
        if with_view:
            views[1].create_completion(other, max_tokens=8, temperature=0)
            rows = sequence_stats(llm, views)
            assert rows[1]["n_active"] > 0 and rows[1]["budget"] > 0
        then = llm.create_completion(text + first + " So", max_tokens=12, temperature=0)["choices"][0]["text"]
        llm.close()
        return first, then

    assert run(True) == run(False)


@pytest.mark.parametrize("spec", [None, "snapkv:budget=0.5"])
def test_the_llama_and_its_view_of_sequence_0_share_it_without_stale_records(model_path, spec):
    """The Llama and its view of sequence 0 run the same sequence, each with a token record of its own: the Llama's
    repeated prompt after the view had run another was answered from the view's cache ('Spain is' -> 'le. He had a
    special way of being able to fly', a dragon's story). Each call that changes a sequence's cache now restarts the
    records of the context's other users of it (and a batch run, of every sequence), and a paused stream of theirs is
    refused when it resumes."""
    from pykvcache import ConcurrentUseError
    from pykvcache.parallel import sequence_stats, sequence_views

    a = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
    b = "Once upon a time, in a land far away, there lived a dragon who loved to eat apples and"
    kw = dict(max_tokens=12, temperature=0)

    def text(who, prompt):
        return who.create_completion(prompt, **kw)["choices"][0]["text"]

    fresh = Llama(model_path, n_ctx=2 * N_CTX_SEQ, n_seq_max=2, verbose=False, kv_policy=spec)
    want_a, want_b = text(fresh, a), text(fresh, b)
    fresh.close()
    llm = Llama(model_path, n_ctx=2 * N_CTX_SEQ, n_seq_max=2, verbose=False, kv_policy=spec)
    v0, v1 = sequence_views(llm)
    assert [text(llm, a), text(v0, b), text(llm, a), text(v0, b)] == [want_a, want_b, want_a, want_b]
    assert text(v1, b) == want_b
    llm.generate_batch([llm.tokenize(b.encode())], 4)  # every sequence cleared, sequence 0 holds b now
    assert [text(v1, b), text(v0, a), text(llm, b)] == [want_b, want_a, want_b]
    stream = llm.create_completion(a, stream=True, **kw)
    next(stream)
    assert text(v0, b) == want_b
    with pytest.raises(ConcurrentUseError, match="sequence 0"):
        list(stream)
    assert text(llm, a) == want_a
    # the context keeps the logits of its last decode, whoever ran it: a prompt evaluated, then another sequence's
    # decode, then that prompt's completion or a sample from it ('Spain is' -> ' them.', the dragon's next word)
    ta, tb = llm.tokenize(a.encode()), llm.tokenize(b.encode())
    first_a, first_b = llm.tokenize(want_a.encode(), add_bos=False)[0], llm.tokenize(want_b.encode(), add_bos=False)[0]
    llm.reset()
    llm.eval(ta)
    assert text(v1, b) == want_b
    # its last token evaluated again alone, beside sequence 1 in the full cache's cells: the same first token, the
    # last digits of the logits may differ from the prompt's batch (as a repeated prompt's, README)
    assert llm.create_completion(a, max_tokens=1, temperature=0)["choices"][0]["text"] == llm.detokenize([first_a]).decode()
    llm.reset()
    llm.eval(ta)
    v1.create_completion(b, max_tokens=2, temperature=0)
    held = [row.get("n_active") for row in sequence_stats(llm, [v0, v1])]
    assert llm.sample(temp=0) == first_a
    assert [row.get("n_active") for row in sequence_stats(llm, [v0, v1])][1] == held[1]  # sequence 1 untouched
    assert text(v1, b) == want_b
    v1.reset()
    v1.eval(tb)
    text(llm, a)
    assert v1.sample(temp=0) == first_b
    llm.close()


def test_a_llama_and_its_views_read_and_load_their_own_sequences(model_path):
    """Found by an audit: a state saved through one user of the context and loaded through another gave the loader
    the saver's token record over other caches ('The capital of France is' -> ' the primary color...'); a sample after
    another user restarted the record raised a bare AssertionError (with python -O: a token of the other's logits);
    the Llama's cache reads described whichever sequence a view ran last; sequence_stats gave sequence 0 no tokens
    after the Llama ran it; generate_batch through a view allowed half a sequence's positions; a view's embed of
    several texts failed in llama_decode, and a pickled view did not unpickle."""
    import pickle

    from pykvcache import ConcurrentUseError
    from pykvcache.parallel import sequence_stats, sequence_views

    a, b = "The capital of France is", "The three primary colors are"
    kw = dict(max_tokens=10, temperature=0)

    def text(who, prompt):
        return who.create_completion(prompt, **kw)["choices"][0]["text"]

    spec = "snapkv:budget=0.5"
    fresh = Llama(model_path, n_ctx=2 * N_CTX_SEQ, n_seq_max=2, verbose=False, kv_policy=spec)
    want_a, want_b = text(fresh, a), text(fresh, b)
    fresh.close()
    llm = Llama(model_path, n_ctx=2 * N_CTX_SEQ, n_seq_max=2, verbose=False, kv_policy=spec)
    v0, v1 = sequence_views(llm)
    assert [text(llm, a), text(v1, b)] == [want_a, want_b]
    state = llm.save_state()
    v1.load_state(state)  # sequence 1 holds b: the record of a that the state carries is sequence 0's
    assert [text(v1, a), text(v1, b)] == [want_a, want_b]
    llm.load_state(pickle.loads(pickle.dumps(v1.save_state())))
    assert text(llm, b) == want_b
    # the Llama's reads are of sequence 0, whichever view ran last; sequence_stats counts the Llama's tokens there
    assert text(v1, a) == want_a and llm.kv_memory().seq == 0 and v1.kv_memory().seq == 1
    assert sequence_stats(llm, [v0, v1])[0]["n_tokens"] == llm.n_tokens > 0
    llm.reset()
    llm.eval(llm.tokenize(a.encode()))
    text(v0, b)
    with pytest.raises(ConcurrentUseError, match="nothing of this sequence to sample from"):
        llm.sample(temp=0)
    out = v1.generate_batch([v1.tokenize(b.encode())], N_CTX_SEQ - len(v1.tokenize(b.encode())))
    assert len(out[0]) > 0
    with pytest.raises(TypeError, match="pickle the Llama it came from"):
        pickle.dumps(v1)
    with pytest.raises(RuntimeError, match="embedding=True"):  # llama-cpp-python's error first, as for one text
        v1.embed(["one", "two"])
    llm.close()
    llm = Llama(model_path, n_ctx=2 * N_CTX_SEQ, n_seq_max=2, verbose=False, kv_policy=spec, embedding=True)
    v0, v1 = sequence_views(llm)
    with pytest.raises(ValueError, match="one text per call"):
        v1.embed(["one", "two"])
    llm.close()


def test_a_batch_beside_sequence_views_runs_each_prompt_in_its_own_sequence(model_path):
    """generate_batch selects each prompt's sequence for the native prefill steps; beside sequence views the Llama's
    native calls select its own sequence, and a count read in between (the latent re-ranking's) switched the guided
    prefill to sequence 0: 'prefill_guided: llama_decode failed (-1)'."""
    from pykvcache import corpus
    from pykvcache.parallel import sequence_views

    spec = "snapkv:budget=0.25+host+latent:gap=0"
    outs = []
    for views in (False, True):
        llm = Llama(model_path, n_ctx=2 * N_CTX_SEQ, n_seq_max=2, verbose=False, kv_policy=spec)
        if views:
            sequence_views(llm)[1].create_completion("Hello there", max_tokens=3)
        prompts = [llm.tokenize(t[:1500].encode())[:300] for t in corpus.essays()[:2]]
        outs.append(llm.generate_batch(prompts, 8))
        llm.close()
    assert outs[0] == outs[1]


def test_views_taking_turns_step_by_step_go_on_as_alone(model_path):
    """Found by an audit: a view's sample() after another view's decode evaluated its last token again, which over a
    pruned cache in exact reuse is its whole record (400 tokens at every step), and the text left the one of the
    sequence alone at its 3rd token. Its last logits are now kept aside when another user decodes."""
    from pykvcache.corpus import essays
    from pykvcache.parallel import sequence_views

    spec = "snapkv:budget=128"

    def steps(who, n):
        out = []
        for _ in range(n):
            out.append(int(who.sample(temp=0)))
            who.eval([out[-1]])
        return out

    ref = Llama(model_path, n_ctx=N_CTX_SEQ, verbose=False, kv_policy=spec)
    text = essays()
    p1 = ref.tokenize(text[0].encode())[:400]
    p0 = ref.tokenize(text[1].encode())[:300]
    ref.eval(p1)
    want = steps(ref, 10)
    ref.close()
    llm = Llama(model_path, n_ctx=2 * N_CTX_SEQ, n_seq_max=2, verbose=False, kv_policy=spec)
    v0, v1 = sequence_views(llm)
    v1.eval(p1)
    v0.eval(p0)
    got = []
    for _ in range(10):
        got += steps(v1, 1)
        steps(v0, 1)
        assert v1.n_tokens == len(p1) + len(got)
    assert got == want
    llm.close()
