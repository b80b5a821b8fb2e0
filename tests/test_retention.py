"""Retention policies on the real model: per-layer memory that really shrinks, chunked prefill, decode-time
budget, equivalence with the full cache when nothing is evicted, needle retrieval, state save/load."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import llama_cpp
import numpy as np
import pytest
from conftest import PROSE, last_logits

from pykvcache import (EntropyLayerBudget, FullCache, H2O, Llama, PolicyError, Pyramid, SinkRecent, SnapKV, corpus,
                       parse_policy)

# bytes of one cached token in one layer of SmolLM2-135M with an f16 cache: (K + V) * 3 KV heads * 64 dims * 2 bytes
TOKEN_LAYER_BYTES = 2 * 3 * 64 * 2
N_LAYER = 30


def greedy(llm, tokens, n):
    """A fresh prompt, then n greedy tokens."""
    llm.reset()
    return greedy_continue(llm, tokens, n)


@pytest.fixture(scope="module")
def essays():
    return corpus.essays()


def test_memory_follows_the_budget(model_path):
    full = Llama(model_path, n_ctx=2048, verbose=False)
    snap = Llama(model_path, n_ctx=2048, verbose=False, kv_policy=SnapKV(budget=256, chunk=64))
    fs, ss = full.kv_stats(), snap.kv_stats()
    assert fs.total_bytes == N_LAYER * 2048 * TOKEN_LAYER_BYTES
    # each layer: PAD(budget + chunk + window, 32) cells in its own buffers (the window: guided prompt chunks)
    assert [s.n_cells for s in ss.layers] == [352] * N_LAYER
    assert ss.total_bytes == N_LAYER * 352 * TOKEN_LAYER_BYTES
    unguided = Llama(model_path, n_ctx=2048, verbose=False, kv_policy=SnapKV(budget=256, chunk=64, guide=False))
    assert [s.n_cells for s in unguided.kv_stats().layers] == [320] * N_LAYER
    mem = snap.kv_memory()
    assert mem.per_layer and mem.bytes == ss.total_bytes and mem.budgets == [256] * N_LAYER
    assert full.kv_memory().bytes == fs.total_bytes

    pyr = Llama(model_path, n_ctx=2048, verbose=False, kv_policy=Pyramid(budget=256, slope=0.5, chunk=64))
    b = pyr.kv_memory().budgets
    assert sum(b) == 256 * N_LAYER and b[0] > b[-1] and b == sorted(b, reverse=True)
    cells = [s.n_cells for s in pyr.kv_stats().layers]
    assert cells[0] > cells[-1]  # the buffers follow the budgets


def test_nothing_evicted_means_the_full_cache(model_path):
    """With a budget as large as the context, the per-layer memory computes what the unified cache computes."""
    prompt = PROSE * 3
    full = Llama(model_path, n_ctx=512, verbose=False)
    tokens = full.tokenize(prompt.encode())
    ref = greedy(full, tokens, 16)
    ref_logits = last_logits(full)
    for pol in (SnapKV(budget=512), EntropyLayerBudget(budget=512), SinkRecent(n_sink=4, n_recent=508)):
        llm = Llama(model_path, n_ctx=512, verbose=False, kv_policy=pol)
        assert greedy(llm, tokens, 16) == ref, pol
        np.testing.assert_allclose(last_logits(llm), ref_logits, atol=2e-3, rtol=0)
        assert llm.kv_memory().n_evicted == 0


@pytest.mark.parametrize("flash_attn", [True, False])
def test_decode_observations_sum_the_rows_of_the_window(model_path, flash_attn):
    """A window policy's decode steps keep each step's attention row; an observing step scores by the rows of the
    window's queries (prompt rows first, then decode rows) instead of computing K.Q again. With nothing evicted that
    is exactly the window's attention: it matches the float64 reference (same bound as test_observe's)."""
    from reference_llama import reference_attention

    llm = Llama(model_path, n_ctx=256, verbose=False, flash_attn=flash_attn,
                kv_policy=SnapKV(budget=256, window=8, every=4, pool=1))
    tokens = llm.tokenize(b"The three primary colors are red, blue and")
    llm.eval(tokens)
    for n_obs in (2, 3):  # after 4 decode steps the window holds 4 prompt rows, after 8 only decode rows
        for _ in range(4):
            tokens.append(int(np.argmax(last_logits(llm))))
            llm.eval(tokens[-1:])
        tel = llm.kv_telemetry()
        assert tel.n_obs == n_obs and llm.kv_memory().n_evicted == 0
        ref = reference_attention(model_path, tokens, 8).mass().mean(axis=1)
        np.testing.assert_allclose(tel.mass_acc, ref, atol=0.03)
        np.testing.assert_allclose(tel.mass_acc.sum(axis=-1), 1.0, rtol=1e-4)


def jaccard(a, b) -> float:
    a, b = set(a), set(b)
    return len(a & b) / len(a | b)


@pytest.mark.parametrize("flash_attn", [True, False])
def test_value_norms_weight_the_eviction_by_the_tokens_values(model_path, essays, flash_attn):
    """With vnorm an eviction ranks each token by its attention mass times the norm of its value vectors; the
    observation computes the norms beside the mass, from the cache as the attention reads it (rows per cell with
    flash attention, transposed without). The kept tokens are a float64 reference's top-k of mass x value norm, not
    of the mass alone; a state loaded into a new context (no norms known until its next observation) keeps the same
    tokens at its first eviction, with the norms the host computes from the cache."""
    from reference_llama import reference_attention
    from test_selection import select

    spec = "snapkv:budget=48,window=8,pool=1,chunk=256,guide=0+window:vnorm=1"
    llm = Llama(model_path, n_ctx=512, verbose=False, flash_attn=flash_attn, kv_policy=spec)
    tokens = llm.tokenize(essays[5].encode())[:200]
    llm.eval(tokens)
    state = llm.save_state()
    llm.eval(tokens[-1:])  # the cache holds budget + chunk cells: the eviction comes before the next token
    kept = llm.kv_retained()[:, : len(tokens)]
    assert (kept.sum(axis=1) == 48).all()

    ref = reference_attention(model_path, tokens, 8)
    mass = ref.mass().mean(axis=1)
    policy = parse_policy(spec)
    with_norms = [jaccard(np.flatnonzero(kept[il]), select(policy, mass[il], 48, il, N_LAYER, value=ref.value_norms[il]))
                  for il in range(N_LAYER)]
    mass_only = [jaccard(np.flatnonzero(kept[il]), select(policy, mass[il], 48, il, N_LAYER)) for il in range(N_LAYER)]
    assert np.mean(with_norms) >= 0.93, np.round(with_norms, 2)
    assert np.mean(with_norms) >= np.mean(mass_only) + 0.05, (np.mean(with_norms), np.mean(mass_only))

    restored = Llama(model_path, n_ctx=512, verbose=False, flash_attn=flash_attn, kv_policy=spec)
    restored.load_state(state)
    restored.eval(tokens[-1:])
    again = restored.kv_retained()[:, : len(tokens)]
    assert min(jaccard(np.flatnonzero(kept[il]), np.flatnonzero(again[il])) for il in range(N_LAYER)) >= 0.95


def test_guided_prefill_leaves_no_trace_without_eviction(model_path, essays):
    """Guided chunks run the prompt's end behind each chunk and then remove it: with nothing evicted, the cache holds
    exactly the prompt and the model answers as with the full cache."""
    full = Llama(model_path, n_ctx=1024, verbose=False)
    tokens = full.tokenize(essays[3].encode())[:450]
    ref = greedy(full, tokens, 12)
    for guide in (True, False):
        llm = Llama(model_path, n_ctx=1024, verbose=False, kv_policy=EntropyLayerBudget(budget=600, guide=guide))
        llm.reset()
        llm.eval(tokens)
        assert [b.n_used for b in llm.kv_memory().layers] == [len(tokens)] * N_LAYER
        assert llm.kv_retained().all()
        assert greedy(llm, tokens, 12) == ref, guide


def test_entropy_split_over_the_early_layers_leaves_the_late_ones_at_the_mean(model_path, essays):
    text = "\n\n".join(essays[:10])
    tokens = None
    budgets = {}
    for share in (1.0, 0.5):
        llm = Llama(model_path, n_ctx=2048, verbose=False, kv_policy=EntropyLayerBudget(budget=64, chunk=64, split_share=share))
        tokens = tokens or llm.tokenize(text.encode())[:800]
        llm.eval(tokens)
        budgets[share] = llm.kv_memory().budgets
        assert sum(budgets[share]) == 64 * N_LAYER
        for b in llm.kv_memory().layers:
            assert b.n_used <= b.budget + 64
    half = N_LAYER // 2
    assert budgets[0.5][half:] == [64] * (N_LAYER - half)  # the late layers keep the mean
    assert len(set(budgets[0.5][:half])) > 1  # the early ones still follow entropy
    assert min(budgets[1.0][half:]) < 64  # a split over every layer gives some late layer less than the mean


def test_chunked_prefill_of_a_prompt_ten_times_the_budget(model_path, essays):
    text = "\n\n".join(essays[:10])
    pol = EntropyLayerBudget(budget=64, chunk=32)
    llm = Llama(model_path, n_ctx=2048, verbose=False, kv_policy=pol)
    tokens = llm.tokenize(text.encode())[:1000]
    llm.eval(tokens)
    mem = llm.kv_memory()
    assert mem.n_evicted > 0 and mem.n_budget > 0
    assert sum(mem.budgets) == 64 * N_LAYER
    assert len(set(mem.budgets)) > 1  # entropy budgets differ between layers
    for b in mem.layers:
        assert b.n_used <= b.budget + 32 <= b.capacity
    # peak bytes stay near the budgets: far below the 1000 tokens of the prompt
    full_bytes = N_LAYER * 1000 * TOKEN_LAYER_BYTES
    assert mem.bytes_peak < 0.25 * full_bytes
    assert mem.bytes_peak >= mem.bytes == llm.kv_stats().total_bytes
    # the model still predicts what the full cache predicts after the compressed prompt: its top token among ours
    full = Llama(model_path, n_ctx=2048, verbose=False)
    full.eval(tokens)
    assert int(np.argmax(last_logits(full))) in np.argsort(last_logits(llm))[-5:]
    full.close()
    # telemetry: budgets, entropies and the retained map
    tel = llm.kv_telemetry()
    assert tel.budgets == mem.budgets
    assert tel.retained.shape == (N_LAYER, 1000)
    assert list(tel.retained.sum(axis=1)) == [b.n_used for b in mem.layers]
    assert tel.retained[:, :4].all()  # the sinks
    assert tel.retained[:, -16:].all()  # the recent window


def test_generation_far_past_the_capacity_stays_flat(model_path):
    pol = SinkRecent(n_sink=4, n_recent=60, chunk=32)
    llm = Llama(model_path, n_ctx=1024, verbose=False, kv_policy=pol)
    cap = llm.kv_stats().layers[0].n_cells
    assert cap == 96
    tokens = llm.tokenize(PROSE.encode())
    llm.eval(tokens)
    before = llm.kv_memory().bytes
    sizes = []
    for _ in range(300):
        llm.eval([int(np.argmax(last_logits(llm)))])
        m = llm.kv_memory()
        sizes.append((m.bytes, m.layers[0].n_used))
    assert llm.n_tokens == len(tokens) + 300 > 3 * cap
    assert {s[0] for s in sizes} == {before}
    assert max(s[1] for s in sizes) <= 64 + 1
    assert llm.kv_memory().bytes_peak == before
    held = llm.kv_retained()
    assert held[:, :4].all() and held[:, -60:].all() and held.sum(axis=1).max() <= 65


def test_a_fractional_budgets_peak_counts_from_the_first_prompt(model_path):
    # before a prompt, a fraction's buffers are sized for n_ctx (8192 here): a placeholder that was the "peak" of a
    # 200-token run, 4.5x what it held
    llm = Llama(model_path, n_ctx=8192, verbose=False, kv_policy=SnapKV(budget=0.1))
    before = llm.kv_memory().bytes
    tokens = llm.tokenize((PROSE * 4).encode())[:200]
    assert len(tokens) == 200
    llm.eval(tokens)
    for _ in range(4):
        llm.eval([int(np.argmax(last_logits(llm)))])
    mem = llm.kv_memory()
    assert mem.bytes < before / 3 and mem.bytes_peak == mem.bytes == llm.kv_stats().total_bytes
    # a later prompt keeps counting the peak
    llm.reset()
    llm.eval(llm.tokenize((PROSE * 12).encode())[:600])
    assert llm.kv_memory().bytes_peak >= llm.kv_memory().bytes >= mem.bytes


def test_h2o_budget_holds_during_decode(model_path):
    llm = Llama(model_path, n_ctx=1024, verbose=False, kv_policy=H2O(budget=48, n_recent=8, chunk=16))
    tokens = llm.tokenize((PROSE * 2).encode())
    out = greedy(llm, tokens, 40)
    assert len(out) == 40
    for b in llm.kv_memory().layers:
        assert b.n_used <= 48 + 1


def test_window_policies_evict_once_per_refresh_of_the_scores(model_path):
    """snapkv with every=4: decode steps 0, 4, 8, ... (each one after an observing step) evict down to the budget,
    the three steps between keep their new tokens beside it; the memory's buffers never grow."""
    llm = Llama(model_path, n_ctx=1024, verbose=False, kv_policy=SnapKV(budget=48, every=4, chunk=16))
    llm.eval(llm.tokenize((PROSE * 2).encode()))
    before = llm.kv_memory()
    used, evicted = [], []
    for _ in range(12):
        llm.eval([int(np.argmax(last_logits(llm)))])
        m = llm.kv_memory()
        used.append(max(b.n_used for b in m.layers))
        evicted.append(m.n_evicted)
        assert m.bytes == before.bytes
    # step k holds the budget, then its token and those of the steps since the last eviction
    assert used == [48 + 1 + k % 4 for k in range(12)]
    # every layer evicts its excess at steps 4 and 8 (3 tokens + the one the step adds), nothing in between
    steps = np.diff(evicted)
    assert all(steps[k - 1] == 0 for k in range(1, 12) if k % 4 != 0)
    assert steps[3] == steps[7] == N_LAYER * 4


def needle_prompt(llm, essays, n_tokens, depth, number):
    needle = f"The special magic number for Lisbon is {number}."
    question = "\n\nWhat is the special magic number for Lisbon? The special magic number for Lisbon is"
    sentences = [s.strip() + "." for s in " ".join(essays[20:30]).replace("\n", " ").split(". ") if s.strip()]
    body, n = [], 0
    for s in sentences:
        t = len(llm.tokenize((" " + s).encode(), add_bos=False))
        if n + t > n_tokens:
            break
        body.append(s)
        n += t
    k = int(depth * len(body))
    return llm.tokenize(" ".join(body[:k] + [needle] + body[k:]).encode() + question.encode())


def test_needle_at_25_percent_entropy_budget(model_path, essays):
    depth = 0.3
    full = Llama(model_path, n_ctx=1024, verbose=False)
    tokens = needle_prompt(full, essays, 700, depth, 7351)
    answer = full.detokenize(greedy(full, tokens, 6)).decode()
    assert "7351" in answer  # the full cache succeeds on this case
    pol = EntropyLayerBudget(budget=0.25, chunk=64)
    llm = Llama(model_path, n_ctx=1024, verbose=False, kv_policy=pol)
    answer = llm.detokenize(greedy(llm, tokens, 6)).decode()
    mem = llm.kv_memory()
    assert mem.n_prompt == len(tokens) and mem.budget == round(0.25 * len(tokens))
    assert mem.n_evicted > 0
    assert "7351" in answer


def test_state_round_trip_and_foreign_state(model_path):
    pol = SnapKV(budget=64, chunk=32)
    llm = Llama(model_path, n_ctx=512, verbose=False, kv_policy=pol)
    tokens = llm.tokenize((PROSE * 2).encode())
    llm.eval(tokens)
    state = llm.save_state()
    nxt = llm.tokenize(b" The", add_bos=False)
    llm.eval(nxt)
    ref = last_logits(llm)
    first = greedy_continue(llm, [], 4)
    other = Llama(model_path, n_ctx=512, verbose=False, kv_policy=pol)
    other.load_state(state)
    assert other.kv_memory().budgets == llm.kv_memory().budgets
    assert other.kv_memory().n_prompt == llm.kv_memory().n_prompt
    other.eval(nxt)
    # same tokens and scores in the same cells (tests/test_state.py: later steps too)
    np.testing.assert_array_equal(last_logits(other), ref)
    assert greedy_continue(other, [], 4) == first

    full = Llama(model_path, n_ctx=512, verbose=False)
    full.eval(tokens)
    with pytest.raises(RuntimeError):
        other.load_state(full.save_state())
    with pytest.raises(RuntimeError):
        full.load_state(state)


def greedy_continue(llm, start, n):
    """Evaluate `start`, then n greedy tokens; returns the tokens chosen."""
    if start:
        llm.eval(start)
    out = []
    for _ in range(n):
        tok = int(np.argmax(last_logits(llm)))
        out.append(tok)
        llm.eval([tok])
    return out


def test_position_shift_is_refused_cleanly(model_path):
    llm = Llama(model_path, n_ctx=512, verbose=False, kv_policy=SnapKV(budget=64, chunk=32))
    llm.eval(llm.tokenize(PROSE.encode()))
    mem = llama_cpp.llama_get_memory(llm._ctx.ctx)
    assert not llama_cpp.llama_memory_can_shift(mem)
    p_max = llama_cpp.llama_memory_seq_pos_max(mem, 0)
    llama_cpp.llama_memory_seq_add(mem, 0, 0, -1, -10)  # refused: logged, nothing changes
    assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == p_max
    assert llama_cpp.llama_memory_seq_rm(mem, 0, p_max - 4, -1)
    assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == p_max - 5


def test_budget_larger_than_the_context(model_path):
    with pytest.raises(PolicyError, match=r"budget=4096 is larger than the context \(n_ctx=1024\)"):
        Llama(model_path, n_ctx=1024, verbose=False, kv_policy=EntropyLayerBudget(budget=4096))
    # nothing the user had is lost: a context made before still works
    ok = Llama(model_path, n_ctx=256, verbose=False, kv_policy=FullCache())
    ok.eval(ok.tokenize(b"Hello"))
    assert ok.kv_policy is None  # FullCache() is kv_policy=None, as the README's table says


def test_a_fraction_below_the_protected_tokens_is_said_once(model_path, capsys):
    """A fractional budget of a short prompt is raised to the tokens the policy always keeps (the budget rule); with
    verbose=True llama.cpp's log says so, once per context."""
    llm = Llama(model_path, n_ctx=256, verbose=True, kv_policy=SnapKV(budget=0.1))
    for text in (b"hello world " * 30, b"another world " * 30):
        llm.reset()
        llm.eval(llm.tokenize(text))
    said = [line for line in capsys.readouterr().err.splitlines() if "fewer than the policy always keeps" in line]
    assert len(said) == 1 and "raised to 33 per layer" in said[0]
    assert llm.kv_memory().budgets == [33] * 30


def test_resizing_the_layers_does_not_flood_the_log(model_path, essays, capsys):
    """The entropy split resizes the layers' caches, and every llama_kv_cache constructor logged its ~30 filtered
    layers and buffers: 1500 lines in one prompt with verbose=True, each through llama-cpp-python's Python log
    callback, where a Ctrl-C got lost."""
    llm = Llama(model_path, n_ctx=1024, verbose=True, kv_policy=EntropyLayerBudget(budget=0.25))
    capsys.readouterr()
    llm.eval(llm.tokenize(" ".join(essays[0].split()[:560]).encode())[:744])
    assert len(set(llm.kv_memory().budgets)) > 1  # the layers were resized
    lines = [line for line in capsys.readouterr().err.splitlines() if "llama_kv_cache" in line]
    assert len(lines) < 10, (len(lines), lines[:5])


def test_unsupported_architecture_is_named(tiny_gemma3):
    with pytest.raises(PolicyError, match=r"does not support architecture 'gemma3'.*sliding-window"):
        Llama(tiny_gemma3, n_ctx=256, verbose=False, kv_policy=EntropyLayerBudget(budget=64))


def test_a_pickled_llama_keeps_its_policy(model_path):
    """llama_cpp.Llama pickles its constructor's arguments; the KV policy, the reuse mode and n_seq_max are among
    them (an unpickled copy ran the full cache)."""
    import pickle

    llm = Llama(model_path, n_ctx=512, verbose=False, kv_policy="snapkv:budget=64", kv_reuse="continue", n_seq_max=2)
    copy = pickle.loads(pickle.dumps(llm))
    assert copy.kv_policy == llm.kv_policy and copy._kv_reuse == "continue"
    assert copy.kv_memory().bytes == llm.kv_memory().bytes  # two sequences' caches
    prompt = PROSE * 2
    assert copy(prompt, max_tokens=6, temperature=0)["choices"] == llm(prompt, max_tokens=6, temperature=0)["choices"]


@pytest.mark.parametrize("spec", ["entropy:budget=0.25", "snapkv:budget=0.1+summarise:bin=64,rank=4",
                                  "snapkv:budget=0.1+host+latent:gap=0", "snapkv:budget=0.25+sparse:threshold=64"])
def test_logits_for_every_token_change_nothing_else(model_path, spec):
    """logits_all=True (llama-cpp-python's logprobs, a draft model) skipped the guided prefill and treated every
    chunk as a prompt's end: the same policy generated another text. Now the same cache and logits, and the guided
    chunks' logits kept for every prompt token."""
    prompt = PROSE * 5 + " In one sentence, the mission was"
    got = []
    for logits_all in (False, True):
        llm = Llama(model_path, n_ctx=1024, n_batch=128, verbose=False, kv_policy=spec, logits_all=logits_all)
        llm.eval(llm.tokenize(prompt.encode()))
        last = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        got.append((np.ctypeslib.as_array(last, shape=(llm.n_vocab(),)).copy(), llm.kv_retained()))
        if logits_all:
            rows = llm.scores[: llm.n_tokens]
            assert np.isfinite(rows).all() and (np.abs(rows).max(axis=1) > 0).all()  # every prompt token's logits
            assert (rows[-1] == got[-1][0]).all()
            out = llm.create_completion(prompt, max_tokens=4, temperature=0, logprobs=2, echo=True)
            assert len(out["choices"][0]["logprobs"]["token_logprobs"]) >= llm.n_tokens - 1
        llm.close()
    assert (got[0][0] == got[1][0]).all() and (got[0][1] == got[1][1]).all()


def test_the_per_layer_masks_are_llama_cpps(model_path, tmp_path):
    """The per-layer memory writes its causal masks itself (fast path); a debug switch compares each with llama.cpp's."""
    script = tmp_path / "masks.py"
    script.write_text(textwrap.dedent(f"""
        from pykvcache import Llama, corpus
        from pykvcache.parallel import sequence_views
        toks = None
        for spec, fa in (("snapkv:budget=0.2+summarise", True), ("entropy:budget=0.2", False), ("sink_recent", True)):
            llm = Llama({model_path!r}, n_ctx=2048, n_seq_max=2, n_threads=1, flash_attn=fa, verbose=False,
                        kv_policy=spec)
            toks = toks or llm.tokenize(corpus.essays_file().read_bytes()[:6000])[:900]
            a, b = sequence_views(llm)
            a.eval(toks)  # prompt chunks, evictions, centroids with their bias
            out_a = a.create_completion(toks[:700], max_tokens=24, temperature=0)  # a reused prefix, then decode
            out_b = b.create_completion(toks[100:400], max_tokens=24, temperature=0)  # the other sequence
            print(spec, len(out_a["choices"][0]["text"]), len(out_b["choices"][0]["text"]))
    """))
    env = dict(os.environ, LLAMA_KVP_CHECK_MASKS="1")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "every per-layer mask is checked against llama.cpp's" in out.stderr
    assert len(out.stdout.splitlines()) == 3
