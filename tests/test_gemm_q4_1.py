"""The tiled Q4_1 matmul of prompt ubatches (native/kernels/gemm-q4_1-cpu.cpp): the installed gemm-q4_1-check binary
runs GGML_OP_MUL_MAT with Q4_1 weights on random shapes through the CPU backend and compares every value with ggml's
own vec_dot, bit for bit, and the kernel's call counter shows the matmul really went through it (with the kernel off,
or were patch 0006's dispatch lost, both sides would be vec_dot and agree); the default model's prompt logits do not
depend on whether the kernel is on."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import numpy as np
import pytest

from native_tools import run_tool

# the kernel is AVX2 code: on x86-64 (the default build's AVX2/FMA/F16C) it must be the path that runs
X86_64 = platform.machine().lower() in ("x86_64", "amd64")


def check(*args, env=None):
    return run_tool("gemm-q4_1-check", *args, env=env)


@pytest.mark.parametrize("cases, seed", [(60, 1), (40, 7)])
def test_tiled_q4_1_matmul_equals_vec_dot_bit_for_bit(cases, seed):
    p = check("--cases", str(cases), "--seed", str(seed), "--threads", "3")
    out = json.loads(p.stdout)
    assert out["tiled"] is X86_64
    assert out["cases"] == cases and out["values"] > 0
    assert out["fail"] == 0 and out["differ"] == 0, out["failures"]
    assert p.returncode == 0, p.stderr[-2000:]
    # the matmul side really ran the kernel (one call per product, every case), the vec_dot reference never did
    calls = out["kernel_calls"]
    assert calls["reference"] == 0
    if X86_64:
        assert calls["mul_mat"] >= cases > 0 and out["cases_in_kernel"] == cases, out
    else:
        assert calls["mul_mat"] == 0 and out["cases_in_kernel"] == 0, out


def test_q4_1_matmul_with_the_kernel_off_is_vec_dot_and_never_enters_it():
    p = check("--cases", "12", "--seed", "3", "--threads", "2", env={"GGML_CPU_TILED_MM": "0"})
    out = json.loads(p.stdout)
    assert out["tiled"] is False
    assert out["fail"] == 0 and out["differ"] == 0, out["failures"]
    assert p.returncode == 0, p.stderr[-2000:]
    assert out["kernel_calls"] == {"mul_mat": 0, "reference": 0} and out["cases_in_kernel"] == 0


def test_gemm_check_help_bench_and_bad_arguments():
    p = check("--help")
    assert p.returncode == 0
    for flag in ("--cases", "--seed", "--threads", "--bench"):
        assert flag in p.stdout
    p = check("--cases", "zero")
    assert p.returncode == 2 and "--cases" in p.stderr
    # the bench runs both paths (no timing asserted: figures live in benchmarks)
    for mm, tiled in (("1", X86_64), ("0", False)):
        out = json.loads(check("--bench", "--threads", "1", env={"GGML_CPU_TILED_MM": mm}).stdout)
        assert out["tiled"] is tiled
        # every shape's runs went through the kernel when it is on, none when it is off
        assert (out["calls"] >= 5) if tiled else (out["calls"] == 0), out
        assert [s["name"] for s in out["shapes"]] == ["attn_q", "attn_k", "attn_out", "ffn_up", "ffn_down"]
        assert all(s["ms"] > 0 for s in out["shapes"])


PROBE = r"""
import sys
import numpy as np
from pykvcache import Llama, default_model_path
llm = Llama(default_model_path(), n_ctx=512, n_batch=128, logits_all=True, verbose=False, n_threads=2)
toks = llm.tokenize(b"The lighthouse keeper wrote the date of every storm in a ledger by the window.")
llm.eval(toks)
np.save(sys.argv[1], np.asarray(llm.scores[: len(toks)], dtype=np.float32))
"""


def test_default_model_prompt_logits_do_not_depend_on_the_kernel(tmp_path):
    # the default model is Q4_1: a prompt's matmuls go through the kernel, or through vec_dot with it turned off
    runs = {}
    for mm in ("1", "0"):
        out = tmp_path / f"logits-{mm}.npy"
        p = subprocess.run([sys.executable, "-c", PROBE, str(out)], capture_output=True, text=True, timeout=300,
                           cwd=str(tmp_path), env={**os.environ, "GGML_CPU_TILED_MM": mm})
        assert p.returncode == 0, p.stderr[-2000:]
        runs[mm] = np.load(out)
    assert runs["1"].shape[0] > 10 and np.isfinite(runs["1"]).all()
    assert np.array_equal(runs["1"], runs["0"])
