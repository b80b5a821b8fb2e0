"""The installed kvp-backend-check binary runs policies on the CPU and with every layer on a GPU backend over the same
tokens and compares logits and the layers' positions. Without a GPU both sides run on the CPU: the results must then be
identical, and a side given less budget must fail the bars (the checker checks something). With a GPU present (the
device sessions run it through scripts/gpu-session.sh) every policy must be within the bars."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from native_tools import run_tool
from pykvcache.corpus import essays_file
from pykvcache.llama import default_model_path

POLICIES = ("full", "snapkv:budget=0.25", "entropy:budget=0.1", "snapkv:budget=0.1+summarise")


def backend_check(*args: str):
    p = run_tool("kvp-backend-check", "-m", str(default_model_path()), "-f", str(essays_file()),
                 "-p", "512", "-n", "4", "-t", "2", *args)
    assert p.stdout.strip(), f"no output (rc={p.returncode}): {p.stderr[-2000:]}"
    return p.returncode, json.loads(p.stdout)


def test_backend_check_compares_every_policy():
    rc, out = backend_check(*[a for s in POLICIES for a in ("--policy", s)])
    assert [r["policy"].split(":")[0] for r in out["policies"]] == ["none", "snapkv", "entropy", "snapkv"]
    assert rc == 0 and out["pass"], json.dumps(out, indent=1)
    for r in out["policies"]:
        assert "error" not in r, r
        assert r["kl_mean"] <= out["max_kl"] and r["jaccard_end_mean"] >= out["min_jaccard"]
        if out["gpu"] is None:
            # one backend on both sides: the same arithmetic, the same tokens kept
            assert r["kl_max"] == 0 and r["top1"] == 1 and r["jaccard_prompt_min"] == 1 and r["jaccard_end_min"] == 1
    # per-layer caches for the retention policies, the shared cache for the full one
    assert [r["n_layers"] for r in out["policies"]] == [1, 30, 30, 30]


def test_backend_check_catches_a_different_selection():
    # a fraction and a token count alike (a token budget passed unperturbed before); the full cache has no budget
    rc, out = backend_check("--policy", "snapkv:budget=0.25", "--policy", "entropy:budget=64", "--policy", "full",
                            "--perturb")
    fraction, tokens, full = out["policies"]
    assert rc == 1 and not out["pass"]
    for r in (fraction, tokens):
        assert r["perturbed"] and not r["pass"], r
        assert r["kl_mean"] > out["max_kl"] or min(r["jaccard_prompt_mean"], r["jaccard_end_mean"]) < out["min_jaccard"]
        assert r["jaccard_prompt_mean"] < 1 and r["kl_max"] > 0
    assert not full["perturbed"] and full["pass"]


def test_backend_check_help_and_bad_arguments():
    p = run_tool("kvp-backend-check", "--help")
    assert p.returncode == 0 and "--perturb" in p.stdout
    p = run_tool("kvp-backend-check", "-m", str(default_model_path()), "--policy", "snapkv:budgt=0.1")
    assert p.returncode == 1 and "budgt" in p.stderr
    p = run_tool("kvp-backend-check", "-p", "0")
    assert p.returncode == 1 and "-p" in p.stderr
    # a folder as the model: one line before llama.cpp's loader (which printed its own lines first)
    folder = Path(default_model_path()).parent
    p = run_tool("kvp-backend-check", "-m", str(folder))
    assert p.returncode == 1 and p.stderr == f"kvp-backend-check: -m: {folder} is a folder, not a GGUF file\n", p.stderr


def test_pykvcache_backend_check_wraps_the_tool():
    # the embedded model and the essays by default, as `pykvcache bench`
    p = subprocess.run([sys.executable, "-m", "pykvcache.cli", "backend-check", "-p", "256", "-n", "2", "-t", "2",
                        "--policy", "sink_recent:n_recent=60"], capture_output=True, text=True, timeout=300, cwd="/")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["n_prompt"] == 256 and out["pass"]
    assert [r["policy"].split(":")[0] for r in out["policies"]] == ["sink_recent"]
    p = subprocess.run([sys.executable, "-m", "pykvcache.cli", "backend-check", "--help"], capture_output=True,
                       text=True, timeout=60, cwd="/")
    assert p.returncode == 0 and "--min-jaccard" in p.stdout
