"""KV caches of other types than f16 (llama.cpp's -ctk / -ctv, llama-cpp-python's type_k / type_v) under the policies:
quantized, and K and V of two types (`-ctk q8_0` alone leaves V f16), which aborted the process in the paths that
run pykvcache's own attention op (h2o's and freeze's observed decode steps, sparse prefill)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pykvcache import cli

Q8_0, F16, F32 = 8, 1, 0

# each case in a process of its own: a GGML_ASSERT aborts the process, not only the test
SCRIPT = r"""
import json, sys
import numpy as np
from pykvcache import Llama
spec, tk, tv = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = Llama(n_ctx=1024, n_threads=2, verbose=False, kv_policy=spec, type_k=tk, type_v=tv, flash_attn=True)
text = "The lighthouse keeper counted the ships that passed the rocks each night, and wrote their names down. " * 30
out = llm.create_completion(text, max_tokens=24, temperature=0)
layers = llm.kv_stats().layers
res = {"text": out["choices"][0]["text"], "n_tokens": out["usage"]["completion_tokens"],
       "k_bytes": layers[0].k_bytes, "v_bytes": layers[0].v_bytes, "n_cells": layers[0].n_cells,
       "n_used": [s.n_used for s in layers]}
if llm.kv_policy.sparse:
    res["density"] = llm.kv_sparse().total_density
if llm.kv_policy.describe()["stages"]["fate"] == "host":
    h = llm.kv_host()
    res.update(host_steps=h.n_steps, n_rerank=h.n_rerank)
if llm.kv_policy.summarises:
    res["n_bins"] = llm.kv_summary().n_bins
kv = llm.kv_layer(0)  # the cache's rows as f32, read on the host
res["kv_layer"] = [int(kv.k.shape[0]), bool(np.isfinite(kv.k).all() and np.isfinite(kv.v).all())]
print(json.dumps(res))
"""


def run_case(spec: str, tk: int, tv: int) -> dict:
    p = subprocess.run([sys.executable, "-c", SCRIPT, spec, str(tk), str(tv)], capture_output=True, text=True,
                       timeout=300, cwd="/")
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("spec", ["h2o:budget=0.25", "freeze", "none+sparse:threshold=512",
                                  "snapkv:budget=0.25+sparse:threshold=512", "snapkv:budget=0.1+summarise",
                                  "snapkv:budget=0.25+host+latent"])
@pytest.mark.parametrize("tk, tv", [(Q8_0, F16), (F16, Q8_0)])
def test_k_and_v_of_two_types_run_every_path(spec, tk, tv):
    r = run_case(spec, tk, tv)
    assert r["n_tokens"] == 24 and r["text"].strip()
    # a q8_0 row of 3 KV heads x 64 dims is 6 blocks of 34 bytes, an f16 row 384 bytes
    row = {Q8_0: 6 * 34, F16: 384}
    assert r["k_bytes"] == r["n_cells"] * row[tk] and r["v_bytes"] == r["n_cells"] * row[tv]
    if "sparse" in spec:
        assert r["density"] == 1.0  # the op reads K and V of one type: the prompt ran dense, and said so
    if spec.startswith(("h2o", "snapkv")):
        assert max(r["n_used"]) < 1024 // 2  # the policy kept its budget: its observation ran
    # the paths named above ran: freeze's observed decode steps, the latent re-ranking, summarise's fits
    if spec == "freeze":
        assert r["host_steps"] > 0
    if "latent" in spec:
        assert r["n_rerank"] > 0
    if "summarise" in spec:
        assert r["n_bins"] > 0


@pytest.mark.parametrize("spec", ["snapkv:budget=0.1+summarise", "snapkv:budget=0.25+host+latent", "freeze",
                                  "entropy:budget=0.1"])
def test_an_f32_cache_runs_the_paths_that_read_its_rows(spec):
    """Found by an audit: ggml's f32 type has no to_float, and summarise's leavers, the host tier's keys at a re-rank,
    the value norms and kv_layer() converted cache rows with it: a segfault with -ctk f32 -ctv f32 (llama.cpp runs
    f32 caches; they are in -ctk's choices)."""
    r = run_case(spec, F32, F32)
    assert 0 < r["n_tokens"] <= 24 and r["text"].strip()  # entropy's answer ends early
    assert r["k_bytes"] == r["v_bytes"] == r["n_cells"] * 192 * 4  # 3 KV heads x 64 dims of 4 bytes
    assert r["kv_layer"][1] and r["kv_layer"][0] > 0
    if "summarise" in spec:
        assert r["n_bins"] > 0
    if "latent" in spec:
        assert r["n_rerank"] > 0


def test_a_quantized_cache_keeps_the_same_tokens_as_f16_mostly():
    """q8_0 K and V change the attention a little: SnapKV at 25% still decodes the same first tokens."""
    f16 = run_case("snapkv:budget=0.25", F16, F16)
    q8 = run_case("snapkv:budget=0.25", Q8_0, Q8_0)
    assert q8["text"][:16] == f16["text"][:16]
    assert q8["k_bytes"] * 384 == f16["k_bytes"] * 6 * 34


def test_kvbench_cache_types_are_tests_of_their_own(model_path):
    p = subprocess.run([str(cli.kvbench_path()), "--no-progress", "-m", model_path, "-p", "128", "-n", "2", "-r", "1",
                        "-t", "2", "--no-limit", "-o", "json", "-ctk", "f16,q8_0", "--policy", "h2o:budget=0.25"],
                       capture_output=True, text=True, timeout=300, cwd="/")
    assert p.returncode == 0, p.stderr
    rows = {(r["label"], r["type_k"], r["type_v"]): r for r in json.loads(p.stdout)["results"]}
    assert set(rows) == {(lbl, tk, "f16") for lbl in ("full", "h2o:budget=0.25") for tk in ("f16", "q8_0")}
    full16, full8 = rows[("full", "f16", "f16")], rows[("full", "q8_0", "f16")]
    assert full8["kv_bytes"] * 2 * 384 == full16["kv_bytes"] * (384 + 6 * 34)
    h2o8 = rows[("h2o:budget=0.25", "q8_0", "f16")]
    assert h2o8["kv_ratio"] == pytest.approx(h2o8["kv_bytes"] / full8["kv_bytes"], abs=1e-4)  # against its own types
    bad = subprocess.run([str(cli.kvbench_path()), "-ctv", "q8_0", "-fa", "off", "-m", model_path], capture_output=True,
                         text=True, timeout=60, cwd="/")
    assert bad.returncode == 1 and "a quantized V cache needs flash attention" in bad.stderr
    bad = subprocess.run([str(cli.kvbench_path()), "-ctk", "q3_k"], capture_output=True, text=True, timeout=60, cwd="/")
    assert bad.returncode == 1 and "unknown KV cache type 'q3_k'" in bad.stderr


def test_a_state_of_other_cache_types_is_refused_naming_them(model_path):
    from pykvcache import Llama

    with pytest.raises(ValueError, match="a quantized V cache needs flash_attn=True"):  # llama.cpp: no context
        Llama(model_path, n_ctx=256, verbose=False, type_v=Q8_0)
    a = Llama(model_path, n_ctx=256, verbose=False, kv_policy="snapkv:budget=64", type_k=Q8_0, type_v=Q8_0,
              flash_attn=True)
    a.eval(a.tokenize(b"The lighthouse keeper counted the ships."))
    state = a.save_state()
    b = Llama(model_path, n_ctx=256, verbose=False, kv_policy="snapkv:budget=64")
    with pytest.raises(RuntimeError, match=r"or KV cache types \(this one: .* K/V f16/f16\); the context is unchanged"):
        b.load_state(state)


def test_exports_of_a_quantized_cache_are_in_the_models_basis(model_path):
    """llama.cpp rotates a quantized cache's K, Q and V rows (a Walsh-Hadamard matrix per 64 values); kv_layer() and
    kv_queries() undo it, so their vectors and attend() agree with an f16 cache's up to the rounding of q8_0."""
    import numpy as np

    from pykvcache import Llama
    from pykvcache.corpus import essays_file

    text = essays_file().read_text()[:3000].encode()
    got = {}
    for tk, tv in [(F16, F16), (Q8_0, Q8_0), (Q8_0, F16)]:
        llm = Llama(model_path, n_ctx=1024, n_threads=2, verbose=False, kv_policy="snapkv:budget=0.5", type_k=tk,
                    type_v=tv, flash_attn=True)
        llm.eval(llm.tokenize(text)[:600])
        layer = llm.kv_layer(3)
        _, q, scale = llm.kv_queries(3)
        got[tk, tv] = (layer, q, layer.attend(q, scale))
    ref_layer, ref_q, ref_out = got[F16, F16]

    def rows(layer, common):  # K and V of the cells holding those positions
        at = {int(p): i for i, p in enumerate(layer.pos) if p >= 0}
        idx = [at[int(p)] for p in common]
        return layer.k[idx], layer.v[idx]

    def rel(a, b):
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    for key in [(Q8_0, Q8_0), (Q8_0, F16)]:
        layer, q, out = got[key]
        common = np.intersect1d(layer.pos[layer.pos >= 0], ref_layer.pos[ref_layer.pos >= 0])
        assert len(common) > 0.9 * (layer.pos >= 0).sum(), key  # nearly the same tokens kept
        (k, v), (ref_k, ref_v) = rows(layer, common), rows(ref_layer, common)
        # rotated, K was ~130% off; q8_0 rounding alone is ~1-2%
        assert rel(k, ref_k) < 0.05 and rel(v, ref_v) < 0.05, key
        assert rel(q, ref_q) < 0.05, key
        assert rel(out, ref_out) < 0.05, key


def test_a_cache_type_llama_cpp_does_not_take_is_refused_naming_the_types(model_path):
    """Found by an audit: an id past ggml's types aborted the process (GGML_ASSERT), q2_K or q4_K (no whole blocks in
    a 64-wide head) failed without a reason; llama.cpp's tools take nine types."""
    from pykvcache import Llama

    for key, bad in (("type_k", 99), ("type_v", 10), ("type_k", 12), ("type_v", "q8_0"), ("type_k", -1)):
        with pytest.raises(ValueError, match=f"{key}={bad!r}: not a KV cache type llama.cpp takes .*q8_0=8"):
            Llama(model_path, n_ctx=256, verbose=False, flash_attn=True, **{key: bad})
    import numpy as np

    llm = Llama(model_path, n_ctx=256, verbose=False, flash_attn=True, type_k=np.int64(Q8_0))  # any integer
    assert llm.kv_stats().layers[0].k_bytes == llm.kv_stats().layers[0].n_cells * 6 * 34
