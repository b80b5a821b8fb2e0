"""kv_stats reads the real ggml buffers: the sizes follow from the model shape and the cache type."""

from __future__ import annotations

import time

import pytest

from pykvcache import Llama, Observe, PolicyError

# SmolLM2-135M: 30 layers, 3 KV heads x 64 dims
N_LAYER = 30
N_EMBD_KV = 3 * 64


@pytest.mark.parametrize("n_ctx", [256, 1024])
def test_f16_cache_bytes(model_path, n_ctx):
    llm = Llama(model_path, n_ctx=n_ctx, verbose=False)
    st = llm.kv_stats()
    assert len(st.layers) == N_LAYER
    assert [s.layer for s in st.layers] == list(range(N_LAYER))
    for s in st.layers:
        assert s.n_cells == n_ctx
        assert s.k_bytes == n_ctx * N_EMBD_KV * 2
        assert s.v_bytes == n_ctx * N_EMBD_KV * 2
        assert not s.on_device
    assert st.total_bytes == 2 * N_LAYER * n_ctx * N_EMBD_KV * 2
    assert f"{st.total_bytes / 2**20:.2f} MiB" in st.summary()


def test_q8_0_cache_bytes(model_path):
    llm = Llama(model_path, n_ctx=512, type_k=8, type_v=8, flash_attn=True, verbose=False)  # GGML_TYPE_Q8_0
    for s in llm.kv_stats().layers:
        assert s.k_bytes == 512 * N_EMBD_KV // 32 * 34


def test_used_cells_follow_the_tokens(model_path):
    llm = Llama(model_path, n_ctx=256, verbose=False, kv_policy=Observe())
    assert llm.kv_stats().n_used == 0
    toks = llm.tokenize(b"one two three four five six")
    llm.eval(toks)
    assert all(s.n_used == len(toks) for s in llm.kv_stats().layers)
    assert llm.kv_memory().n_active == 30 * len(toks)  # llama.cpp's own cache too, as a retention policy's


def test_the_full_cache_counts_its_active_cells(model_path):
    llm = Llama(model_path, n_ctx=256, verbose=False)
    toks = llm.tokenize(b"one two three four five six")
    llm.eval(toks)
    assert llm.kv_memory().n_active == sum(s.n_used for s in llm.kv_stats().layers) == 30 * len(toks)


def test_stats_of_a_sliding_window_model(tiny_gemma3):
    llm = Llama(tiny_gemma3, n_ctx=256, verbose=False)
    st = llm.kv_stats()
    assert len(st.layers) == 2
    assert all(s.k_bytes == 256 * 32 * 2 for s in st.layers)


def test_the_policys_host_time_by_part(model_path):
    text = " ".join(f"item {i} is {i * 7 % 13}." for i in range(60))
    times = {}
    for spec in ["h2o:budget=64,chunk=64", "h2o:budget=64,chunk=64+summarise:bin=32,rank=4"]:
        llm = Llama(model_path, n_ctx=1024, verbose=False, kv_policy=spec)
        toks = llm.tokenize(text.encode())[:300]
        assert len(toks) == 300
        t0 = time.perf_counter()
        llm.eval(toks)
        wall = (time.perf_counter() - t0) * 1e3
        p = llm.kv_perf()
        assert p.n_ubatch == 5  # 300 tokens in chunks of 64
        assert p.t_prepare_ms > 0 and p.t_slot_ms > 0 and p.t_input_ms > 0
        assert p.t_ms == pytest.approx(p.t_prepare_ms + p.t_slot_ms + p.t_input_ms + p.t_settle_ms)
        assert p.t_ms < wall
        # the CPU backend computes each graph before llama_decode goes on: the policy's reads find nothing to wait for
        assert 0 <= p.t_wait_ms < 0.2 * p.t_ms
        times[spec] = p
        llm.eval([1, 2, 3])
        llm.eval([4])
        assert llm.kv_perf().n_ubatch == 7 and llm.kv_perf().t_ms > p.t_ms
        llm.kv_perf_reset()
        assert llm.kv_perf().t_ms == 0 and llm.kv_perf().n_ubatch == 0 and llm.kv_perf().t_wait_ms == 0
        assert llm.kv_perf().to_dict()["t_ms"] == 0
    # only a fate stage that settles a prompt's end (summarise) works after the prompt's last ubatch
    assert times["h2o:budget=64,chunk=64"].t_settle_ms == 0
    assert times["h2o:budget=64,chunk=64+summarise:bin=32,rank=4"].t_settle_ms > 0


def test_host_time_needs_a_policy(model_path):
    llm = Llama(model_path, n_ctx=256, verbose=False)
    with pytest.raises(PolicyError, match="no KV policy"):
        llm.kv_perf()
    with pytest.raises(PolicyError, match="no KV policy"):
        llm.kv_perf_reset()
