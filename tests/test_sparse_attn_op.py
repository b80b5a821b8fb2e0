"""GGML_OP_SPARSE_ATTN_EXT (native/kernels): the installed sparse-attn-check binary cross-checks the op against
ggml_flash_attn_ext with every block listed, against a double-precision host reference with random block subsets, and
(where one is present and supports the op) a non-CPU backend against the CPU backend; every case must pass, and with
its counts corrupted the check must fail."""

from __future__ import annotations

import json

import pytest

from native_tools import run_tool


def sparse_attn_check(*args):
    return run_tool("sparse-attn-check", *args)


def parse(p):
    assert p.stdout.strip(), f"no output (rc={p.returncode}): {p.stderr[-2000:]}"
    return json.loads(p.stdout)


@pytest.mark.parametrize("cases, seed", [(60, 1), (40, 7)])
def test_sparse_attn_op_matches_flash_attention_and_reference(cases, seed):
    p = sparse_attn_check("--cases", str(cases), "--seed", str(seed))
    out = parse(p)
    assert out["cases"] == cases
    assert out["fail"] == 0, json.dumps(out["failures"], indent=1)
    assert p.returncode == 0, p.stderr[-2000:]
    assert out["max_nmse_vs_flash"] is not None and out["max_nmse_vs_flash"] <= out["nmse_threshold"]
    assert out["max_nmse_vs_ref"] is not None and out["max_nmse_vs_ref"] <= out["nmse_threshold"]
    # the subsets really exercised what the op must skip
    sub = out["subsets"]
    assert sub["out_of_range_ids"] > 0 and sub["clamped_counts"] > 0 and sub["ids_past_count"] > 0
    assert 0 < sub["rows_seeing_nothing"] < sub["rows"]
    # the CPU backend computed the op in every case (counted by the tool, not echoed), and the probabilities mode (d)
    # ran in every case as well (its comparisons are skipped where it did not)
    assert out["backends"]["CPU"]["ran"] == cases
    assert out["probs"]["ran"] == cases > 0
    assert out["probs"]["max_nmse_vs_ref"] is not None and out["probs"]["max_nmse_vs_ref"] <= out["nmse_threshold"]
    for name, b in out["backends"].items():
        if name != "CPU":
            assert b["fail"] == 0, (name, b)


def test_sparse_attn_check_fails_with_corrupt_counts():
    # the checker checked: the op gets (b) counts one off from the reference's, so (b) must fail (and nothing else)
    cases = 12
    p = sparse_attn_check("--cases", str(cases), "--seed", "1", "--threads", "2", "--corrupt-counts")
    out = parse(p)
    assert p.returncode == 1, (p.returncode, p.stderr[-2000:])
    assert out["corrupt_counts"] is True and out["cases"] == cases
    assert out["backends"]["CPU"]["ran"] == cases  # the op did run: the failures are the comparisons'
    assert 0 < out["fail"] <= cases and sum(out["fail_by_type"].values()) == out["fail"]
    assert out["failures"] and all("(b) " in f for f in out["failures"]), out["failures"]
    assert any("(b) CPU vs reference" in f for f in out["failures"]), out["failures"]
    assert not any(tag in f for f in out["failures"] for tag in ("(a) ", "(c) ", "(d) ")), out["failures"]
    assert out["max_nmse_vs_ref"] is None or out["max_nmse_vs_ref"] > out["nmse_threshold"]


def test_sparse_attn_check_help_and_bad_arguments():
    p = sparse_attn_check("--help")
    assert p.returncode == 0
    for flag in ("--cases", "--seed", "--threads", "--help"):
        assert flag in p.stdout
    p = sparse_attn_check("--cases", "zero")
    assert p.returncode == 2 and "--cases" in p.stderr


def test_sparse_attn_perf_times_the_op_against_flash_attention():
    # the benchmark binary beside it: one flash row and one sparse row per density, on every backend; listing fewer
    # blocks lists a smaller share of the visible ones (no timing asserted: targets live in benchmarks)
    p = run_tool("sparse-attn-perf", "--n-kv", "1024", "--n-q", "128", "--density", "0.25,1", "-r", "1", "-t", "2",
                 timeout=300)
    assert p.returncode == 0, p.stderr
    rows = [r.split("|")[1:-1] for r in p.stdout.splitlines() if r.startswith("| CPU")]
    assert [r[1].strip() for r in rows] == ["flash_attn_ext", "sparse_attn_ext", "sparse_attn_ext"]
    listed = [float(r[2]) for r in rows]
    assert listed[0] == 1.0 and 0.2 <= listed[1] < 0.5 and listed[2] == 1.0
    assert all(float(r[3]) > 0.0 for r in rows)
    bad = run_tool("sparse-attn-perf", "--density", "0", timeout=60)
    assert bad.returncode == 2 and "--density" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
