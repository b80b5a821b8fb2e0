"""Attention observation against an independent numpy forward pass of the same GGUF (tests/reference_llama.py).

Tolerances: llama.cpp computes with a float16 K cache and 8-bit quantized activations in the Q4_1 matmuls, the
reference in float64; on these prompts the measured gaps are ~0.03 nats (max) / 0.005 (mean) of entropy and ~0.013
of L1 distance between per-head mass distributions. The bounds below are about 3x those.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import PROSE, last_logits
from pykvcache import Llama, Observe, PolicyError
from reference_llama import reference_attention

ENTROPY_MAX = 0.1  # nats
ENTROPY_MEAN = 0.02
MASS_L1_MEAN = 0.04  # L1 distance between per-head mass distributions, mean over layers x heads
MASS_L1_MAX = 0.15


def kl_logits(p_logits, q_logits) -> float:
    """KL(p || q) of the next-token distributions of two logit vectors."""
    p = np.exp(p_logits - p_logits.max())
    q = np.exp(q_logits - q_logits.max())
    p, q = p/p.sum(), q/q.sum()
    return float((p*(np.log(p + 1e-30) - np.log(q + 1e-30))).sum())


def assert_matches_reference(tel, ref, n_tokens):
    np.testing.assert_array_equal(tel.positions, np.arange(n_tokens))
    e_ref = ref.entropy()
    assert tel.entropy.shape == e_ref.shape
    de = np.abs(tel.entropy - e_ref)
    assert de.max() < ENTROPY_MAX, de.max()
    assert de.mean() < ENTROPY_MEAN, de.mean()
    m_ref = ref.mass()
    assert tel.mass_per_head.shape == m_ref.shape
    l1 = np.abs(tel.mass_per_head - m_ref).sum(axis=-1)
    assert l1.mean() < MASS_L1_MEAN, l1.mean()
    assert l1.max() < MASS_L1_MAX, l1.max()
    np.testing.assert_allclose(tel.mass, m_ref.mean(axis=1), atol=0.05)


@pytest.fixture(scope="module")
def prose_reference(model_path):
    llm = Llama(model_path, n_ctx=128, verbose=False)
    tokens = llm.tokenize(PROSE.encode())
    return tokens, {w: reference_attention(model_path, tokens, w) for w in (16, 20)}


@pytest.mark.parametrize("flash_attn", [True, False])
def test_prompt_observation_matches_reference(model_path, prose_reference, flash_attn):
    tokens, refs = prose_reference
    llm = Llama(model_path, n_ctx=512, flash_attn=flash_attn, verbose=False, kv_policy=Observe(window=16))
    llm.eval(tokens)
    tel = llm.kv_telemetry(per_head=True)
    assert tel.n_queries == 16 and tel.window == 16 and tel.n_obs == 1
    assert tel.entropy.shape == (30, 9)
    assert_matches_reference(tel, refs[16], len(tokens))
    np.testing.assert_allclose(tel.mass_per_head.sum(axis=-1), 1.0, atol=1e-4)


def test_window_spans_several_ubatches(model_path, prose_reference):
    tokens, refs = prose_reference
    llm = Llama(model_path, n_ctx=512, n_batch=8, n_ubatch=8, verbose=False, kv_policy=Observe(window=20))
    llm.eval(tokens)
    tel = llm.kv_telemetry(per_head=True)
    assert tel.n_queries == 20
    assert tel.n_obs == -(-len(tokens) // 8)  # every prompt ubatch observes
    assert_matches_reference(tel, refs[20], len(tokens))


def test_flash_attention_on_and_off_agree(model_path, prose_reference):
    tokens, _ = prose_reference
    tels = []
    for fa in (True, False):
        llm = Llama(model_path, n_ctx=512, flash_attn=fa, verbose=False, kv_policy=Observe(window=16))
        llm.eval(tokens)
        tels.append(llm.kv_telemetry())
    assert np.abs(tels[0].entropy - tels[1].entropy).max() < 0.05
    assert np.abs(tels[0].mass - tels[1].mass).max() < 0.02


def test_decode_steps_observe_with_the_ring_of_past_queries(model_path):
    llm = Llama(model_path, n_ctx=256, verbose=False, kv_policy=Observe(window=8, every=1))
    tokens = llm.tokenize(b"The three primary colors are red,")
    llm.eval(tokens)
    for _ in range(5):
        tok = int(np.argmax(last_logits(llm)))
        tokens.append(tok)
        llm.eval([tok])
    tel = llm.kv_telemetry(per_head=True)
    assert tel.n_obs == 6 and tel.n_queries == 8
    assert len(set(tokens[-5:])) > 1  # real greedy continuation
    ref = reference_attention(model_path, tokens, 8)
    assert_matches_reference(tel, ref, len(tokens))
    # decay 1: the accumulated head-mean mass holds one unit per observation
    np.testing.assert_allclose(tel.mass_acc.sum(axis=-1), 6.0, rtol=1e-4)


@pytest.mark.parametrize("flash_attn", [True, False])
def test_decode_step_attention_gives_its_probabilities(model_path, flash_attn):
    """With a window of one query a decode step's attention keeps its probabilities for the observation (no second
    K.Q): they match the reference, and the step computes what the full cache computes. Without flash attention it
    runs the same ops as the full cache; with it, the sparse-attention op in F32 where flash attention accumulates V
    in F16: their logits differ by about what flash attention on and off differ by (KL ~5e-3 on these tokens)."""
    full = Llama(model_path, n_ctx=256, verbose=False, flash_attn=flash_attn)
    obs = Llama(model_path, n_ctx=256, verbose=False, flash_attn=flash_attn, kv_policy=Observe(window=1, every=1))
    tokens = full.tokenize(b"The three primary colors are red,")
    full.eval(tokens)
    obs.eval(tokens)
    for _ in range(6):
        ref_logits, logits = last_logits(full), last_logits(obs)
        if flash_attn:
            assert kl_logits(ref_logits, logits) < 2e-2 and np.argmax(logits) == np.argmax(ref_logits)
        else:
            np.testing.assert_allclose(logits, ref_logits, atol=2e-3, rtol=0)
        tok = int(np.argmax(ref_logits))
        tokens.append(tok)
        full.eval([tok])
        obs.eval([tok])
    tel = obs.kv_telemetry(per_head=True)
    assert tel.n_obs == 7 and tel.n_queries == 1
    assert_matches_reference(tel, reference_attention(model_path, tokens, 1), len(tokens))
    np.testing.assert_allclose(tel.mass_acc.sum(axis=-1), 7.0, rtol=1e-4)  # one unit per observation


def test_every_and_request_schedule(model_path):
    llm = Llama(model_path, n_ctx=256, verbose=False, kv_policy="observe:window=4,every=3")
    toks = llm.tokenize(b"Counting: one two three")
    llm.eval(toks)
    assert llm.kv_telemetry().n_obs == 1
    for i in range(6):
        llm.eval([toks[-1]])
    assert llm.kv_telemetry().n_obs == 3  # decode steps 3 and 6
    llm.kv_observe_next()
    llm.eval([toks[-1]])
    assert llm.kv_telemetry().n_obs == 4
    llm.eval([toks[-1]])
    assert llm.kv_telemetry().n_obs == 4


def test_new_prompt_after_reset_uses_only_its_own_queries(model_path, prose_reference):
    tokens, refs = prose_reference
    llm = Llama(model_path, n_ctx=512, verbose=False, kv_policy=Observe(window=16))
    llm.eval(llm.tokenize(b"An unrelated first prompt about gardening, soil, water and sunlight in spring."))
    llm.reset()
    llm.eval(tokens)
    assert_matches_reference(llm.kv_telemetry(per_head=True), refs[16], len(tokens))


def test_short_prompt_uses_every_query(model_path):
    llm = Llama(model_path, n_ctx=256, verbose=False, kv_policy=Observe(window=64))
    toks = llm.tokenize(b"Hello world")
    llm.eval(toks)
    tel = llm.kv_telemetry()
    assert tel.n_queries == len(toks)
    np.testing.assert_array_equal(tel.positions, np.arange(len(toks)))


def test_telemetry_json_and_plot(model_path, tmp_path):
    import json

    llm = Llama(model_path, n_ctx=256, verbose=False, kv_policy=Observe(window=8))
    llm.eval(llm.tokenize(b"A short prompt for a telemetry plot."))
    tel = llm.kv_telemetry()
    data = json.loads(tel.to_json(tmp_path / "t.json"))
    assert data["policy"] == "observe:window=8,every=0,decay=1"
    assert np.array(data["entropy"]).shape == (30, 9)
    assert np.array(data["mass"]).shape == (30, len(tel.positions))
    png = tel.plot(tmp_path / "t.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000


def test_the_mass_map_is_drawn_at_the_tokens_positions(model_path, tmp_path):
    """After eviction the held positions have gaps: the map gives column p to position p (blank where no layer holds
    it), so the plot's x axis is the position; a context that observed nothing yet plots without a warning."""
    import warnings

    llm = Llama(model_path, n_ctx=1024, verbose=False, kv_policy="snapkv:budget=64,chunk=64")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        llm.kv_telemetry().plot(tmp_path / "empty.png")
    # found by an audit: a path without an image suffix, or a folder, had matplotlib write `fig.png` while plot()
    # returned `fig` (a user's file of that name, untouched); the CLI checked this, the API did not
    (tmp_path / "fig").write_text("mine")
    for bad in (tmp_path / "fig", tmp_path, tmp_path / "t.txt"):
        with pytest.raises(ValueError, match="needs a file name with one of the suffixes .png"):
            llm.kv_telemetry().plot(bad)
    assert not (tmp_path / "fig.png").exists() and (tmp_path / "fig").read_text() == "mine"
    llm.eval(llm.tokenize(b"The lighthouse keeper counted the ships that passed the rocks each night. " * 30))
    tel = llm.kv_telemetry()
    gaps = np.setdiff1d(np.arange(tel.positions[-1] + 1), tel.positions)
    assert len(gaps) > 100  # the policy evicted in every layer
    m = tel.mass_by_position()
    assert m.shape == (30, tel.positions[-1] + 1)
    np.testing.assert_array_equal(m[:, tel.positions], tel.mass)
    assert np.isnan(m[:, gaps]).all()
    assert tel.plot(tmp_path / "t.png").stat().st_size > 10_000


@pytest.mark.parametrize("flash_attn", [True, False])
def test_exported_queries_keys_and_values_are_the_models(model_path, prose_reference, flash_attn):
    """kv_queries and kv_layer give the window's post-RoPE queries and the cache's K and V (V transposed in the cache
    without flash attention): their softmax is the in-graph observation's (same f16 keys, same scale) and the
    reference forward pass's, and the value norms are the reference's."""
    tokens, refs = prose_reference
    llm = Llama(model_path, n_ctx=512, flash_attn=flash_attn, verbose=False, kv_policy=Observe(window=16))
    llm.eval(tokens)
    tel = llm.kv_telemetry(per_head=True)
    for il in range(30):
        q_pos, q, scale = llm.kv_queries(il)
        np.testing.assert_array_equal(q_pos, np.arange(len(tokens) - 16, len(tokens)))
        assert q.shape == (16, 9, 64) and scale == pytest.approx(1 / 8)
        layer = llm.kv_layer(il)
        held = layer.held()
        assert held.sum() == len(tokens) and layer.k.shape[1:] == (3, 64) and not layer.bias.any()
        order = np.argsort(layer.pos[held])
        probs = layer.probs(q, scale, q_pos=q_pos)[:, :, order]  # [query, head, position]
        np.testing.assert_allclose(probs.mean(axis=0), tel.mass_per_head[il], atol=1e-3)
        l1 = np.abs(probs.transpose(1, 0, 2) - refs[16].probs[il]).sum(axis=-1)
        assert l1.mean() < MASS_L1_MEAN and l1.max() < 2 * MASS_L1_MAX, (il, l1.mean(), l1.max())
        norms = np.linalg.norm(layer.v[held][order], axis=-1).mean(axis=-1)
        np.testing.assert_allclose(norms, refs[16].value_norms[il], rtol=0.05)


def test_attention_output_over_the_cache_is_a_weighted_sum_of_its_values():
    """KVLayer.attend on random matrices equals the plain loop over heads (GQA: query head h reads KV head h // g),
    with a centroid cell's log-count bias counting as that many copies of its key and value."""
    from pykvcache.telemetry import KVLayer

    rng = np.random.default_rng(3)
    n, d = 7, 4
    k, v = rng.normal(size=(n, 2, d)), rng.normal(size=(n, 2, d))
    pos = np.array([0, 1, 2, -1, 4, 5, 6], dtype=np.int32)
    layer = KVLayer(pos=pos, bias=np.zeros(n), k=k, v=v)
    q = rng.normal(size=(3, 6, d))
    out = layer.attend(q, 0.5, below=6)
    for i in range(3):
        for h in range(6):
            cells = [0, 1, 2, 4, 5]  # held: a token, at a position below 6
            s = np.array([0.5 * q[i, h] @ k[c, h // 3] for c in cells])
            p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
            np.testing.assert_allclose(out[i, h], sum(p[j] * v[c, h // 3] for j, c in enumerate(cells)), atol=1e-12)
    # one cell with bias log 3 attends like three copies of it
    copies = KVLayer(pos=np.array([0, 1, 1, 1]), bias=np.zeros(4), k=k[[0, 1, 1, 1]], v=v[[0, 1, 1, 1]])
    cell = KVLayer(pos=np.array([0, 1]), bias=np.array([0.0, np.log(3.0)]), k=k[[0, 1]], v=v[[0, 1]])
    np.testing.assert_allclose(cell.attend(q, 0.5), copies.attend(q, 0.5), atol=1e-12)


def test_exports_refuse_a_layer_or_a_context_they_do_not_have(model_path):
    """Bad input to kv_layer / kv_queries is a clear error, not a crash."""
    from pykvcache import PolicyError

    full = Llama(model_path, n_ctx=128, verbose=False)
    full.eval(full.tokenize(b"A short prompt."))
    assert full.kv_layer(0).held().sum() == len(full.tokenize(b"A short prompt."))
    with pytest.raises(PolicyError, match=r"no KV layer 30 in this context \(it has 30\)"):
        full.kv_layer(30)
    two = Llama(model_path, n_ctx=256, n_seq_max=2, verbose=False)
    with pytest.raises(PolicyError, match="cache of 2 sequence streams"):  # it read as a bad index
        two.kv_layer(0)
    two.close()
    # the same kind of error for every per-layer export (kv_cell_bytes raised RuntimeError)
    with pytest.raises(PolicyError, match="no retention policy"):
        full.kv_cell_bytes(0, 0)
    kept = Llama(model_path, n_ctx=128, verbose=False, kv_policy="snapkv:budget=64")
    kept.eval(kept.tokenize(b"A short prompt."))
    with pytest.raises(PolicyError, match=r"KV layer -1 out of range \[0, 30\)"):
        kept.kv_cell_bytes(-1, 0)
    with pytest.raises(PolicyError, match="no observing policy"):
        full.kv_queries(0)
    obs = Llama(model_path, n_ctx=128, verbose=False, kv_policy=Observe(window=4))
    obs.eval(obs.tokenize(b"A short prompt."))
    with pytest.raises(PolicyError, match="no observed KV layer -1"):
        obs.kv_queries(-1)
    with pytest.raises(PolicyError, match="retention policy observing a window of 2 or more"):
        obs.kv_query_entropy(0)


def test_decode_telemetry_is_of_the_last_window_or_says_whose_it_is(model_path):
    """The decode observations of snapkv, pyramid and entropy keep the head-mean mass only: the telemetry's mass was
    the prompt's after generation (generated positions at 0), mapped through cells reused since; the entropy was the
    prompt's under no label. Now the mass is the last window's (the softmax of kv_queries over kv_layer), the entropy
    says whose it is, kv_observe_next() makes a step compute both, and one query's entropy (h2o) is its mass's."""
    prompt = Llama(model_path, n_ctx=64, verbose=False).tokenize(PROSE.encode())
    llm = Llama(model_path, n_ctx=512, verbose=False, kv_policy="snapkv:budget=400,every=1")
    llm.eval(prompt)
    prompt_entropy = llm.kv_telemetry().entropy.copy()
    for step in range(6):
        if step == 5:
            llm.kv_observe_next()
        llm.eval([int(np.argmax(last_logits(llm)))])
        tel = llm.kv_telemetry(per_head=step == 5)
        assert tel.pos == llm.n_tokens - 1
        for il in (0, 14, 29):
            q_pos, q, scale = llm.kv_queries(il)
            layer = llm.kv_layer(il)
            probs = layer.probs(q, scale, q_pos=q_pos)[:, :, np.argsort(layer.pos[layer.held()])]
            np.testing.assert_allclose(tel.mass[il], probs.mean(axis=(0, 1)), atol=2e-3)
            if step == 5:  # the requested observation: entropy and per-head mass of this window
                ent = -(probs * np.log(np.where(probs > 0, probs, 1))).sum(-1).mean(0)
                np.testing.assert_allclose(tel.entropy[il], ent, atol=0.02)
                np.testing.assert_allclose(tel.mass_per_head[il], probs.mean(0), atol=2e-3)
        if step < 5:
            assert tel.entropy_pos == len(prompt) - 1 and np.array_equal(tel.entropy, prompt_entropy)
            with pytest.raises(PolicyError, match="kv_observe_next"):
                llm.kv_telemetry(per_head=True)
    assert tel.entropy_pos == tel.pos

    h2o = Llama(model_path, n_ctx=512, verbose=False, kv_policy="h2o:budget=400")
    h2o.eval(prompt + [int(np.argmax(last_logits(llm)))])
    for _ in range(2):
        h2o.eval([int(np.argmax(last_logits(h2o)))])
    tel = h2o.kv_telemetry(per_head=True)
    p = tel.mass_per_head
    np.testing.assert_allclose(tel.entropy, -(p * np.log(np.where(p > 0, p, 1))).sum(-1), atol=1e-4)
    assert tel.entropy_pos == tel.pos == h2o.n_tokens - 1


def test_a_window_query_older_than_every_held_token_gives_no_nan(model_path):
    """With a layer budget of one token (entropy:min_layer=1) a window query can be older than every token its layer
    still holds: its attention row was all -inf, so the layer's entropy and mass were NaN, and the entropy split then
    gave that layer a budget of 1 (found by fuzzing: 54 NaN entropies in 6 layers)."""
    rng = np.random.default_rng(1048)
    prompt = [int(x) for x in rng.integers(0, 49152, 114)]
    llm = Llama(model_path, kv_policy="entropy:min_layer=1", n_ctx=300, n_batch=32, n_ubatch=1, verbose=False)
    llm.eval(prompt)
    tel = llm.kv_telemetry()
    assert np.isfinite(tel.entropy).all() and np.isfinite(tel.mass).all() and np.isfinite(tel.mass_acc).all()
    budgets = llm.kv_memory().budgets
    assert min(budgets) > 1, budgets
