"""kvbench and the fidelity harness: a tiny run of each emits every field; the full cache against itself is exact;
bad arguments fail with a message."""

from __future__ import annotations

import csv as csv_module
import json
import subprocess
import sys

import numpy as np
import pytest

from pykvcache import cli, corpus
from pykvcache import Llama
from pykvcache.evaluate import (EvalConfig, EvalError, agreement, compare_logprobs, evaluate, markdown, needle_cases,
                                policy_spec, split_policies, write_outputs, x_full_bytes)

RESULT_FIELDS = {
    "policy", "label", "spec", "n_prompt", "n_gen", "n_depth", "pp_ts", "pp_ts_sd", "pp_samples", "tg_ts", "tg_ts_sd",
    "tg_samples", "kv_bytes", "kv_bytes_peak", "kv_layer_bytes", "kv_layer_cells", "n_evicted", "obs_overhead",
    "n_obs_steps", "pp_ratio", "tg_ratio", "kv_ratio", "kv_peak_ratio", "density", "host_ms_pp", "host_ms_tg",
    "host_ms_tg_parts", "host_wait_ms_pp", "host_wait_ms_tg",
}


def kvbench(*args, model_path=None):
    cmd = [str(cli.kvbench_path()), "--no-progress", *args]
    if model_path:
        cmd += ["-m", model_path]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd="/")


def test_kvbench_tiny_run_emits_valid_json_with_every_field(model_path):
    p = kvbench("-p", "96", "-n", "4", "-d", "0,64", "-r", "2", "-t", "2", "--policy", "entropy:budget=48,chunk=32",
                "--policy", "sink_recent:n_sink=4,n_recent=28", "-o", "json", model_path=model_path)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["repetitions"] == 2 and out["n_threads"] == 2
    rows = out["results"]
    # full is added first, as the reference; one row per policy and depth
    assert [r["label"] for r in rows] == ["full", "full", "entropy:budget=48,chunk=32", "entropy:budget=48,chunk=32",
                                          "sink_recent:n_sink=4,n_recent=28", "sink_recent:n_sink=4,n_recent=28"]
    for r in rows:
        assert RESULT_FIELDS <= set(r), RESULT_FIELDS - set(r)
        assert len(r["pp_samples"]) == 2 and len(r["tg_samples"]) == 2
        assert r["pp_ts"] > 0 and r["tg_ts"] > 0
        assert len(r["kv_layer_bytes"]) == 30 and sum(r["kv_layer_bytes"]) == r["kv_bytes"]
        assert r["kv_bytes_peak"] >= r["kv_bytes"]
    full = rows[0]
    assert full["kv_ratio"] == 1.0 and full["pp_ratio"] == 1.0 and full["n_evicted"] == 0
    # the policy's own host time: none for llama.cpp's cache; by part (prepare, slots, inputs, settle) for a policy
    assert full["host_ms_pp"] is None and full["host_ms_tg"] is None and full["host_ms_tg_parts"] is None
    assert full["host_wait_ms_pp"] is None and full["host_wait_ms_tg"] is None
    for r in rows[2:]:
        assert r["host_ms_pp"] > 0 and r["host_ms_tg"] > 0
        # waits for earlier graphs, apart: the CPU backend has finished each graph when llama_decode goes on
        assert 0 <= r["host_wait_ms_pp"] < 0.2 * r["host_ms_pp"] and 0 <= r["host_wait_ms_tg"] < 0.2 * r["host_ms_tg"]
        assert sum(r["host_ms_tg_parts"]) == pytest.approx(r["host_ms_tg"], abs=2e-3)
        assert r["host_ms_tg"] < r["n_gen"] * 1e3 / min(r["tg_samples"])  # a part of the decode steps' time
    ent = rows[3]  # depth 64: 160 tokens on a budget of 48
    assert ent["n_evicted"] > 0 and ent["kv_ratio"] < 1.0
    assert ent["kv_ratio"] == pytest.approx(ent["kv_bytes"] / rows[1]["kv_bytes"], abs=1e-4)
    # per repetition: the first decode step evicts the prompt down to the budget; the next three keep their tokens
    # beyond it (entropy's scores are refreshed every 16 steps, and it evicts at the step after a refresh)
    assert rows[2]["n_evicted"] == 30 * (96 - 48)
    assert rows[5]["kv_layer_cells"] == [160] * 30  # PAD(n_sink + n_recent + chunk, 32)


def test_kvbench_measures_the_physical_limit(model_path):
    """The full cache at the depth of each policy's mean layer budget, its steps alternating with the policy's, and x
    limit in every format."""
    args = ["-p", "128", "-n", "4", "-r", "1", "-t", "2", "--policy", "sink_recent:n_sink=4,n_recent=60",
            "--policy", "snapkv:budget=64,chunk=32+entropy", "--policy", "h2o:budget=0.5,n_recent=8,chunk=32"]
    out = json.loads(kvbench(*args, "-o", "json", model_path=model_path).stdout)
    rows = {r["label"]: r for r in out["results"]}
    assert sorted(x["n_depth"] for x in out["limits"]) == [64]  # 64 tokens each; h2o: half of the 128-token prompt
    lim = out["limits"][0]
    assert lim["policy"] == "full" and lim["n_gen"] == 4 and lim["tg_ts"] > 0
    assert lim["n_gen_steps"] == 3 * 4  # the three policies' limit steps, pooled (it said 0)
    assert lim["n_ctx"] == rows["full"]["n_ctx"] and lim["kv_bytes"] is None  # the full cache's context (was null)
    assert rows["full"]["tg_limit_ratio"] is None and rows["full"]["limit_depth"] is None  # not measured: null
    for label in ("sink_recent:n_sink=4,n_recent=60", "snapkv:budget=64,chunk=32+entropy",
                  "h2o:budget=0.5,n_recent=8,chunk=32"):
        r = rows[label]
        assert r["limit_depth"] == 64
        # its own limit steps, one figure per repetition; from the unrounded samples: on a loaded machine t/s can be
        # small enough for the printed means to round
        assert len(r["limit_tg_samples"]) == 1 and r["limit_tg_samples"][0] > 0
        assert r["tg_limit_ratio"] == pytest.approx(np.mean(r["tg_samples"]) / np.mean(r["limit_tg_samples"]), rel=1e-3)
    # the limit row pools the policies' limit steps at its depth
    assert sorted(lim["tg_samples"]) == sorted(s for r in out["results"] for s in r["limit_tg_samples"])
    assert rows["h2o:budget=0.5,n_recent=8,chunk=32"]["n_obs_steps"] == 4  # every step observes

    md = kvbench(*args, model_path=model_path).stdout
    assert "| x limit |" in md and "| limit:d=64 |" in md
    # the caption names what llama-bench's columns do: the model, its size and parameters, the backend, the threads
    assert md.startswith("kvbench: llama ") and " MiB, 134.5M params, CPU, 2 threads," in md.splitlines()[0]
    assert "| policy host ms, prompt | per decoded token: ms | prepare | slots | inputs | x step |" in md
    csv = kvbench(*args, "-o", "csv", model_path=model_path).stdout.splitlines()
    assert "limit_depth,limit_tg_ts,tg_limit_ratio,density," in csv[0]
    assert csv[0].endswith("n_promote,n_ctx,type_k,type_v,sum_bins,sum_ms_pp,sum_ms_tg,host_ms_pp,host_ms_tg,host_wait_ms_pp,host_wait_ms_tg,n_threads,flash_attn,n_gpu_layers")
    assert len(csv) == 5 and all(len(row) == csv[0].count(",") + 1 for row in csv_module.reader(csv[1:]))
    none = json.loads(kvbench(*args, "-o", "json", "--no-limit", model_path=model_path).stdout)
    assert none["limits"] == [] and all(r["tg_limit_ratio"] is None for r in none["results"])
    assert lim["kv_ratio"] is None and lim["kv_bytes"] is None and lim["tg_ratio"] is None  # a limit row has no memory


@pytest.mark.parametrize("args, message", [
    (["--bogus"], "unknown argument: --bogus"),
    (["--policy", "snapkv+bogus"], "unknown stage 'bogus'"),
    (["-p", "abc"], "-p: expected integers"),
    (["-r", "0"], "-r: expected an integer >= 1"),
    (["-o", "xml"], "expected md, json, jsonl or csv"),
    (["--policy", "snapkv:budget=0"], "budget must be"),
    (["--policy", "nope"], "nope"),
    (["-m", "/no/such/model.gguf"], "model file not found"),
    (["-p", "512", "-c", "256"], "exceeds the context size"),
    (["-p", "2147483647", "-n", "1"], "is too large"),  # the sum wrapped: a 1-token list read past its end
    (["-p", "0", "-n", "0"], "-p 0 with -n 0 measures nothing"),
    (["-p", "0", "-n", "0", "-pg", "0,0"], "-p 0 with -n 0 measures nothing"),
    (["--no-limit=1"], "--no-limit: takes no value"),
    (["-o", "sql"], "expected md, json, jsonl or csv"),
    (["-p", "32-16"], "-p: range 32-16 ends before it starts"),
    (["-p", "1-8*1"], "-p: range 1-8*1 does not advance"),
    (["-n", "0-64*2"], "-n: range 0-64*2 does not advance"),
    (["-d", "1-100000"], "-d: more than 4096 values"),
    (["-p", "16-"], "-p: expected integers >= 0 or ranges"),
    (["-pg", "16"], "-pg: expected pp,tg"),
    (["-pg", "16-32,2"], "-pg pp: expected an integer >= 0, got '16-32'"),
    (["-pg", "-1,2"], "-pg pp: expected an integer >= 0, got '-1'"),
    (["-p", "1,2,"], "-p: expected integers >= 0 or ranges"),
    (["-p", "1- 5"], "-p: expected integers >= 0 or ranges"),
    (["-p", "-0-3"], "-p: expected integers >= 0 or ranges"),
    (["-r", "2-2"], "-r: expected an integer >= 1, got '2-2'"),
    (["-t", "0,1"], "-t: expected integers >= 1"),
    (["-d", "0-4095", "-p", "0-4095", "-n", "1-2"], "more than 100000"),
    (["-fa", "maybe"], "-fa: expected on, off or auto"),
    (["-fa", "on,maybe"], "-fa: expected on, off or auto (or a comma-separated list of them), got 'on,maybe'"),
    (["-fa", "on,"], "-fa: expected on, off or auto"),
    (["-ngl", "0,x"], "-ngl: expected integers >= 0 or ranges"),
    (["-fa", "off", "-ctv", "q8_0"], "a quantized V cache needs flash attention"),
    (["-fa", "on,off", "-ctv", "q8_0"], "a quantized V cache needs flash attention"),
])
def test_kvbench_bad_arguments_fail_with_a_message(args, message):
    p = kvbench(*args)
    assert p.returncode != 0
    assert message in p.stderr


def test_kvbench_says_what_is_wrong_with_its_files_before_the_model_loads(tmp_path):
    """An empty -m or -f was the embedded model or random tokens; a folder, a binary or a Latin-1 file, a
    tokenizer's message without the file."""
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\u00e9 au lait".encode("latin-1"))
    cases = [
        (["-m", ""], "-m: an empty path"),
        (["-m", str(tmp_path)], f"-m: {tmp_path} is a folder, not a GGUF file"),
        (["-f", ""], "-f: an empty path"),
        (["-f", str(tmp_path)], f"-f: {tmp_path} is a folder"),
        (["-f", str(cli.kvbench_path())], f"-f: {cli.kvbench_path()} is not UTF-8 text"),
        (["-f", str(latin1)], f"-f: {latin1} is not UTF-8 text"),
        (["-f", str(tmp_path / "none.txt")], f"-f: cannot read {tmp_path / 'none.txt'}: No such file"),
    ]
    for args, message in cases:
        p = kvbench("-p", "16", "-n", "4", "-r", "1", *args)
        assert p.returncode == 1 and p.stdout == "", args
        assert len(p.stderr.strip().splitlines()) == 1 and message in p.stderr, (args, p.stderr)


def test_kvbench_says_when_a_budgets_sparse_prefill_runs_dense(model_path):
    """Its density column said 1 for a retention policy's sparse prefill that could never engage (the Llama warns)."""
    p = kvbench("-p", "64", "-n", "1", "-r", "1", "-t", "2", "--no-limit", "--policy", "entropy:budget=0.25+sparse",
                "--policy", "none+sparse", "--policy", "snapkv:budget=0.25+sparse:threshold=16", model_path=model_path)
    assert p.returncode == 0, p.stderr
    said = [x for x in p.stderr.splitlines() if "below sparse's threshold" in x]
    assert len(said) == 1 and said[0].startswith("kvbench: entropy:budget=0.25+sparse: its layers hold at most ")
    assert said[0].endswith("at p=64 n=1 d=0, below sparse's threshold=2048: its prompts run dense")


def test_kvbench_interrupted_prints_the_tests_measured_before(model_path):
    """Found by an audit: Ctrl-C ended kvbench with nothing on stdout, the rows measured before lost (-o jsonl too)."""
    import signal

    cmd = [str(cli.kvbench_path()), "-m", model_path, "-p", "512", "-n", "32", "-r", "4", "-t", "2", "--no-limit",
           "-o", "jsonl", "--policy", "snapkv:budget=0.25"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:  # progress: the second policy's first repetition has begun
        if "snapkv" in line:
            proc.send_signal(signal.SIGINT)
            break
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    rows = [json.loads(x) for x in out.splitlines()]
    assert [r["policy"] for r in rows] == ["full"] and rows[0]["tg_ts"] > 0
    assert err.strip().splitlines()[-1] == "kvbench: interrupted, the 1 test(s) measured before it follow"


@pytest.mark.parametrize("policy, message", [
    ("snapkv:budget=0.1+summarise:bin=128,rank=65", "stage 'summarise': rank must be <= the head size 64 (got 65)"),
    ("snapkv:budget=0.1+summarise:bin=1000000000", "stage 'summarise': bin=1000000000 never fills in this context"),
])
def test_kvbench_says_what_the_model_refuses_before_any_test(model_path, policy, message):
    """Errors that need the model or the context's size: one line before any test (not after the full cache's run,
    with llama.cpp's own error lines and a partial table)."""
    p = kvbench("-p", "64", "-n", "4", "-r", "1", "-t", "2", "--policy", policy, model_path=model_path)
    assert p.returncode == 1 and p.stdout == ""
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvbench: {policy}: cannot create the context"), lines
    assert f"policy 'snapkv', {message}" in lines[0]


def test_kvbench_lists_with_an_empty_pair_paths_with_tabs_and_a_failed_write(model_path, tmp_path):
    """-p 0,32 -n 0,2 aborted on its one pair that measures nothing (llama-bench runs such lists); a tab in the text
    file's path made the JSON invalid; the results written to a full disk ended with exit 0 and no message."""
    text = tmp_path / "a\tb.txt"
    text.write_text("A plain text about rivers and hills, said once and then again. " * 40)
    p = kvbench("-p", "0,32", "-n", "0,2", "-r", "1", "-t", "1", "-o", "json", "-f", str(text),
                "--policy", "full", model_path=model_path)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["tokens"] == str(text)
    assert sorted((r["n_prompt"], r["n_gen"]) for r in doc["results"] if r["label"] == "full") == [(0, 2), (32, 0), (32, 2)]
    prompt_only = [r for r in doc["results"] if r["n_gen"] == 0]
    assert prompt_only and all(r["obs_overhead"] is None and r["host_ms_tg"] is None for r in prompt_only)  # not 0
    with open("/dev/full", "w") as full:
        p = subprocess.run([str(cli.kvbench_path()), "--no-progress", "-p", "32", "-n", "2", "-r", "1", "-t", "1",
                            "--policy", "full", "-m", model_path], stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    assert p.returncode == 1 and "writing the results failed" in p.stderr


def test_kvbench_sizes_each_test_as_llama_bench(model_path):
    """Each (depth, prompt, gen) runs in a context of its own size, so a row's KV x is against the full cache that test
    needs, whatever else is in the sweep; a budget in tokens raises its policy's context."""
    def rows(*args):
        p = kvbench("-n", "2", "-r", "1", "-t", "2", "--no-limit", "-o", "json", *args, model_path=model_path)
        assert p.returncode == 0, p.stderr
        return {(r["label"], r["n_prompt"]): r for r in json.loads(p.stdout)["results"]}

    alone = rows("-p", "64", "--policy", "snapkv:budget=0.25")
    # --flag=value too, and a list flag given twice adds its values, as llama-bench's (-p 64 -p 600 = -p 64,600)
    sweep = rows("-p", "64", "-p", "600", "--policy", "snapkv:budget=0.25", "--policy=snapkv:budget=512")
    assert sweep[("full", 64)]["n_ctx"] == 256 and sweep[("full", 600)]["n_ctx"] == 768
    assert sweep[("full", 64)]["kv_bytes"] == alone[("full", 64)]["kv_bytes"] == 30 * 256 * 768
    assert sweep[("snapkv:budget=0.25", 64)]["kv_ratio"] == alone[("snapkv:budget=0.25", 64)]["kv_ratio"]
    assert sweep[("snapkv:budget=512", 64)]["n_ctx"] == 512  # its budget, not the 66 tokens of the test


def test_kvbench_takes_llama_bench_ranges_pairs_ubatch_and_flash_attn_auto(model_path):
    """llama-bench's int ranges (first-last+step, first-last*factor), -pg pairs beside the -p x -n tests (a pair
    already among them runs once), a list of threads, -ub apart from -b and -fa auto (llama.cpp's choice; on for the
    CPU), here with a retention policy."""
    p = kvbench("-p", "16-32+16", "-n", "1-2*2", "-pg", "16,2", "-pg", "32,0", "-r", "1", "-t", "1-2",
                "-fa", "auto", "--no-limit", "-o", "json", "--policy", "h2o:budget=16,n_recent=8,chunk=16",
                model_path=model_path)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["flash_attn"] == "auto"
    tests = [(r["n_depth"], r["n_prompt"], r["n_gen"], r["n_threads"]) for r in doc["results"] if r["label"] == "full"]
    assert tests == [(0, pp, tg, t) for pp, tg in ((16, 1), (16, 2), (32, 1), (32, 2), (32, 0)) for t in (1, 2)], tests
    # each row's ratios are against the full cache of its own test, threads included
    full = {(r["n_prompt"], r["n_gen"], r["n_threads"]): r for r in doc["results"] if r["label"] == "full"}
    for r in doc["results"]:
        f = full[(r["n_prompt"], r["n_gen"], r["n_threads"])]
        if r["n_prompt"] > 0:
            assert r["pp_ratio"] == pytest.approx(r["pp_ts"] / f["pp_ts"], rel=1e-3)
    assert doc["n_batch"] == doc["n_ubatch"] == 512
    md = kvbench("-p", "16", "-n", "2", "-r", "1", "-t", "1", "-fa", "auto", "-b", "64", "-ub", "16", "--no-limit",
                 "--policy", "full", model_path=model_path)
    assert md.returncode == 0 and "n_batch 64, n_ubatch 16, flash attention auto" in md.stdout.splitlines()[0]
    assert doc["n_threads"] == 1  # the run's: the first of the list


def test_kvbench_runs_each_flash_attention_of_a_list_against_the_full_cache_with_it(model_path):
    """-fa off,on as llama-bench's list: a test per value, each row's ratios and physical limit against the full
    cache with the same flash attention; the md label and the CSV say which."""
    args = ("-p", "64", "-n", "4", "-r", "1", "-t", "1", "-fa", "off,on", "--policy", "snapkv:budget=48,chunk=32")
    doc = json.loads(kvbench(*args, "-o", "json", model_path=model_path).stdout)
    assert doc["flash_attn"] is False  # the run's: the first of the list
    rows = {(r["label"], r["flash_attn"]): r for r in doc["results"]}
    assert sorted(rows) == [("full", False), ("full", True), ("snapkv:budget=48,chunk=32", False),
                            ("snapkv:budget=48,chunk=32", True)]
    for fa in (False, True):
        r, f = rows[("snapkv:budget=48,chunk=32", fa)], rows[("full", fa)]
        assert r["tg_ratio"] == pytest.approx(r["tg_ts"] / f["tg_ts"], rel=1e-3)
        assert r["kv_ratio"] == pytest.approx(r["kv_bytes"] / f["kv_bytes"], rel=1e-3)
    assert sorted(l["flash_attn"] for l in doc["limits"]) == [False, True]
    assert all(r["tg_limit_ratio"] is not None for (label, _), r in rows.items() if label != "full")
    md = kvbench(*args, "--no-limit", model_path=model_path).stdout
    assert "flash attention off,on" in md.splitlines()[0]
    assert "| snapkv:budget=48,chunk=32 [fa off] |" in md and "| full [fa on] |" in md
    csv = list(csv_module.reader(kvbench(*args, "--no-limit", "-o", "csv", model_path=model_path).stdout.splitlines()))
    assert [row[-2] for row in csv[1:]] == ["off", "on", "off", "on"]  # the column before n_gpu_layers
    for line in kvbench(*args, "--no-limit", "-o", "jsonl", model_path=model_path).stdout.splitlines():
        keys = [k for k, _ in json.loads(line, object_pairs_hook=list)]
        assert len(keys) == len(set(keys)), keys  # a row's own settings only once (strict parsers refuse duplicates)


def test_kvbench_loads_the_model_once_per_ngl_of_a_list(model_path):
    """-ngl 0,4 as llama-bench's list: a test per value, each against the full cache with the same layers offloaded;
    on a machine without a GPU it says that nothing is offloaded."""
    args = ("-p", "64", "-n", "2", "-r", "1", "-t", "1", "-ngl", "0,4", "--no-limit", "--policy", "snapkv:budget=48,chunk=32")
    p = kvbench(*args, "-o", "json", model_path=model_path)
    doc = json.loads(p.stdout)
    assert doc["n_gpu_layers"] == 0
    rows = {(r["label"], r["n_gpu_layers"]): r for r in doc["results"]}
    assert sorted(rows) == [("full", 0), ("full", 4), ("snapkv:budget=48,chunk=32", 0), ("snapkv:budget=48,chunk=32", 4)]
    for ngl in (0, 4):
        r, f = rows[("snapkv:budget=48,chunk=32", ngl)], rows[("full", ngl)]
        assert r["pp_ratio"] == pytest.approx(r["pp_ts"] / f["pp_ts"], rel=1e-3)
    if "no GPU device" in p.stderr:
        assert "-ngl offloads nothing" in p.stderr
    md = kvbench(*args, model_path=model_path).stdout
    assert "| full [ngl 4] |" in md and "| snapkv:budget=48,chunk=32 [ngl 0] |" in md


def test_kvbench_refuses_a_context_before_measuring_any_row(model_path):
    """A policy the context cannot hold (a budget above -c) ends the run before the first test, in one line, rather
    than after the tests before it (a failure during a test still prints the rows measured before it)."""
    p = kvbench("-p", "64", "-n", "2", "-r", "1", "-t", "2", "-c", "256", "--no-limit", "-o", "jsonl",
                "--policy", "snapkv:budget=0.25", "--policy", "snapkv:budget=512", model_path=model_path)
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.splitlines() == ["kvbench: snapkv:budget=512: cannot create the context (n_ctx 256): policy 'snapkv': "
                                     "budget=512 is larger than the context (n_ctx=256)"]


def test_kvbench_says_when_sparse_prefill_cannot_run(model_path):
    p = kvbench("-p", "64", "-n", "1", "-r", "1", "-t", "2", "-fa", "off", "--policy", "none+sparse",
                model_path=model_path)
    assert p.returncode == 0 and "sparse prefill needs flash attention" in p.stderr


def test_kvbench_help_documents_every_flag():
    p = kvbench("--help")
    assert p.returncode == 0
    for flag in ("-m", "--policy", "-p", "-n", "-pg", "-d", "-r", "-t", "-ngl", "-o", "-f", "-c", "-b", "-ub", "-fa"):
        assert f"  {flag}" in p.stdout or f", {flag}" in p.stdout, flag


def test_pykvcache_bench_wraps_kvbench(model_path):
    p = subprocess.run([sys.executable, "-m", "pykvcache.cli", "bench", "-p", "32", "-n", "2", "-r", "1", "-t", "1",
                        "--policy", "h2o:budget=16,n_recent=8,chunk=16", "-o", "csv", "--random", "--no-progress", "-m",
                        model_path], capture_output=True, text=True, timeout=300, cwd="/")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert lines[0].startswith("policy,label,spec,") and len(lines) == 3
    assert lines[2].startswith("h2o,")
    # its help is kvbench's under the name it is run by, with what the wrapper adds (the essays, --random)
    p = subprocess.run([sys.executable, "-m", "pykvcache.cli", "bench", "--help"], capture_output=True, text=True,
                       timeout=60, cwd="/")
    assert p.returncode == 0 and p.stdout.startswith("usage: pykvcache bench [options]")
    assert "without -f the essays" in p.stdout and "--random" in p.stdout
    p = subprocess.run([sys.executable, "-m", "pykvcache.cli", "backend-check", "--help"], capture_output=True,
                       text=True, timeout=60, cwd="/")
    assert p.returncode == 0 and p.stdout.startswith("usage: pykvcache backend-check [options]")


def test_harness_full_cache_against_itself_is_exact(model_path, tmp_path, monkeypatch):
    cfg = EvalConfig(policies=["sink_recent"], budgets=[0.5], kl_tokens=192, stream=32, needle_lengths=[160],
                     depths=[0.5], n_agree=8, threads=2, model_path=model_path)
    res = evaluate(cfg, quiet=True)
    full, sr = res["runs"]
    assert full["kl_mean"] == 0.0 and full["kl_p95"] == 0.0 and full["top1"] == 1.0 and full["agree"] == 8
    assert full["n_scored"] == 32
    assert sr["policy"] == "sink_recent" and sr["kl_mean"] > 0.0 and 0.0 < sr["top1"] < 1.0
    assert len(sr["bytes_trace"]) == 8 and sr["bytes"] < full["bytes"]
    paths = write_outputs(res, tmp_path)
    assert all(p.is_file() and p.stat().st_size > 0 for p in paths)
    # a Ctrl-C while they are written leaves no empty or half-written folder, and the earlier outputs whole
    import pykvcache.evaluate as ev

    def interrupted(results, out_dir):
        (out_dir / "fidelity_vs_budget.png").write_bytes(b"half")
        raise KeyboardInterrupt

    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    monkeypatch.setattr(ev, "plot", interrupted)
    for out in (tmp_path / "new", tmp_path):
        with pytest.raises(KeyboardInterrupt):
            write_outputs(res, out)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert "| full | - | 0.0000 |" in markdown(res)


def test_harness_greedy_agreement_continues_from_the_last_token(model_path):
    """The greedy continuation of the agreement column starts from the streamed text's last token, not from the first
    token of its last chunk (the row llama_get_logits gives after a chunk with every token's logits)."""
    from pykvcache import corpus
    from pykvcache.evaluate import Runner

    cfg = EvalConfig(threads=1, model_path=model_path)
    r = Runner(None, cfg, reference=True, n_ctx=512)
    try:
        tokens = r.llm.tokenize(corpus.essays()[0].encode())[:240]
        r.reset()
        r.prefill(tokens[:-16])
        rows = r.logits_chunk(tokens[-16:])
        assert np.argmax(rows[-1]) != np.argmax(rows[0])  # the text tells the two rows apart
        assert r.greedy(1) == [int(np.argmax(rows[-1]))]
    finally:
        r.close()


def test_harness_with_a_prefill_mode(model_path):
    # every policy but the full cache gets the sparse prefill stage, and the full cache with it alone is one more row
    cfg = EvalConfig(policies=["sink_recent"], budgets=[0.5], kl_tokens=192, stream=32, needle_lengths=[160],
                     depths=[0.5], n_agree=8, threads=2, model_path=model_path,
                     prefill="sparse:threshold=0,skip=0,segment=16,block=16,base=32")
    res = evaluate(cfg, quiet=True)
    full, none, sr = res["runs"]
    assert full["policy"] == "full" and full["kl_mean"] == 0.0
    assert none["policy"] == "none" and none["budget_frac"] is None and none["spec"].startswith("none+sparse:")
    assert 0.0 < none["density"] < 1.0 and none["kl_mean"] > 0.0 and none["bytes"] == full["bytes"]
    assert sr["spec"].startswith("sink_recent:") and "+sparse:" in sr["spec"] and 0.0 < sr["density"] <= 1.0
    md = markdown(res)
    assert md.startswith("prefill mode of every row but full: sparse:")
    # the row of the full cache with the stage is named so, and the table has the share of key blocks computed
    assert f"| none+{cfg.prefill} | - |" in md and "key blocks computed |" in md
    assert f" {none['density']:.2f} |" in md.splitlines()[-2]


def test_harness_on_quantized_caches(model_path, tmp_path):
    # -ctk / -ctv: the reference stays the f16 full cache; the full cache on those types is one more row, and every
    # policy runs on them, its bytes against the f16 reference
    cfg = EvalConfig(policies=["sink_recent"], budgets=[0.5], kl_tokens=192, stream=32, needle_lengths=[160],
                     depths=[0.5], n_agree=8, threads=2, model_path=model_path, type_k="q8_0", type_v="q8_0")
    res = evaluate(cfg, quiet=True)
    full, full8, sr = res["runs"]
    # a quantized V cache needs flash attention, so the reference runs it too: a row differs by its types alone
    assert full["flash_attn"] and full8["flash_attn"] and sr["flash_attn"]
    assert full["kl_mean"] == 0.0 and full8["policy"] == "full" and full8["spec"] == "full"
    assert 0.0 < full8["kl_mean"] < 0.05  # q8_0 alone: small but not nothing
    # a q8_0 row of 3 KV heads x 64 dims: 6 blocks of 34 bytes against f16's 384 bytes
    assert full8["bytes"] * 384 == pytest.approx(full["bytes"] * 6 * 34, rel=0.01)
    assert sr["kl_mean"] > full8["kl_mean"] and sr["bytes"] < full8["bytes"]
    md = markdown(res)
    assert md.startswith("KV cache types of every row but the first (the reference, f16): K q8_0, V q8_0")
    assert "all rows with flash attention" in md.splitlines()[0]
    assert "| full [q8_0/q8_0] | - |" in md and "| sink_recent [q8_0/q8_0] | 50% |" in md
    with pytest.raises(SystemExit):  # not a KV cache type: argparse's usage line
        cli.main(["eval", "-ctv", "q3_k", "-o", str(tmp_path / "out"), "-q"])
    with pytest.raises(EvalError, match="-ctk q3_k: not a KV cache type"):
        EvalConfig(type_k="q3_k").validate()


def _stdlib_text(n_modules: int) -> str:
    import argparse, collections, json, pathlib, subprocess as sp, textwrap, zipfile  # noqa: E401 - prose, not code
    mods = [argparse, collections, json, pathlib, sp, textwrap, zipfile][:n_modules]
    return "\n\n".join(m.__doc__ or "" for m in mods)


def test_harness_on_the_users_text(model_path, tmp_path):
    # -f FILE: the KL text is the file's first kl_tokens tokens and the haystack the rest, never overlapping
    f = tmp_path / "docs.txt"
    f.write_text(_stdlib_text(7), encoding="utf-8")
    cfg = EvalConfig(policies=["snapkv"], budgets=[0.5], kl_tokens=192, stream=32, needle_lengths=[160],
                     depths=[0.5], n_agree=4, threads=2, model_path=model_path, text_file=str(f))
    res = evaluate(cfg, quiet=True)
    full, snap = res["runs"]
    assert full["kl_mean"] == 0.0 and snap["kl_mean"] > 0.0 and len(snap["needle_hits"]) == 1
    assert res["config"]["text_file"] == str(f) and markdown(res).startswith(f"text: {f}")
    assert cli.main(["eval", "-f", str(f), "--policies", "snapkv", "--budgets", "0.5", "--kl-tokens", "192",
                     "--stream", "32", "--needle-lengths", "4000", "--depths", "0.5", "-m", model_path,
                     "-o", str(tmp_path / "out"), "-q"]) == 2  # too short for a 4000-token haystack: one clear line


def test_harness_text_file_errors(model_path, tmp_path):
    with pytest.raises(EvalError, match="text file not found"):
        EvalConfig(text_file=str(tmp_path / "missing.txt")).validate()
    with pytest.raises(EvalError, match="is a folder"):
        EvalConfig(text_file=str(tmp_path)).validate()
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("Caf\xe9 au lait. ".encode("latin-1") * 50)
    with pytest.raises(EvalError, match="is not UTF-8 text"):  # `generate -f` refuses it too; it was read with U+FFFD
        EvalConfig(text_file=str(latin)).validate()
    short = tmp_path / "short.txt"
    short.write_text("Too short to measure anything.", encoding="utf-8")
    cfg = EvalConfig(policies=["snapkv"], budgets=[0.5], kl_tokens=192, stream=32, needle_lengths=[160],
                     depths=[0.5], n_agree=4, threads=2, model_path=model_path, text_file=str(short))
    with pytest.raises(EvalError, match=r"has \d+ tokens: the KL text takes the first 192"):
        evaluate(cfg, quiet=True)
    # a source file long enough by its tokens, not by its haystack once whitespace is collapsed (an audit's case:
    # the check counted the indentation that needle_cases drops, and needle_cases failed later)
    code = tmp_path / "code.py"
    code.write_text("".join(f"def f{i}(x):\n" + " " * 32 + f"return x + {i}\n" for i in range(40)), encoding="utf-8")
    cfg.text_file, cfg.kl_tokens, cfg.needle_lengths = str(code), 128, [420]  # 580 tokens, a haystack of 391
    with pytest.raises(EvalError, match=r"needs 420 tokens with whitespace collapsed \(the longest needle prompt\) and has"):
        evaluate(cfg, quiet=True)


def test_eval_shows_the_host_memory_beside_the_cache(model_path):
    """Summarise's pending bins are host memory the KV bytes leave out (an audit: eval showed summarise and eviction
    at the same 'x full' while the bins held more than the cache)."""
    cfg = EvalConfig(policies=["snapkv", "snapkv+summarise:bin=32,rank=4"], budgets=[0.25], kl_tokens=192, stream=32,
                     needle_lengths=[160], depths=[0.5], n_agree=4, threads=2, model_path=model_path)
    res = evaluate(cfg, quiet=True)
    _, drop, summ = res["runs"]
    assert drop["host_bytes_peak"] == 0 < summ["host_bytes_peak"]
    rows = markdown(res).splitlines()
    assert "host bytes, peak (x full KV)" in rows[0]
    assert rows[-1].split("|")[-2].strip() == f"{summ['host_bytes_peak'] / res['runs'][0]['bytes']:.3f}"


def test_harness_pieces():
    a = np.log(np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]], dtype=np.float32))
    b = np.log(np.array([[0.6, 0.3, 0.1], [0.5, 0.1, 0.4]], dtype=np.float32))
    r = compare_logprobs([a], [b])
    assert r["top1"] == 0.5
    expected = np.mean([(np.exp(a[i]) * (a[i] - b[i])).sum() for i in range(2)])
    assert r["kl_mean"] == pytest.approx(expected, rel=1e-5)
    assert compare_logprobs([a], [a])["kl_mean"] == 0.0
    assert agreement([1, 2, 3, 4], [1, 2, 5, 4]) == 2
    assert agreement([1, 2], [1, 2]) == 2


@pytest.mark.parametrize("kwargs, message", [
    ({"policies": ["lru"]}, "unknown policy 'lru'"),
    ({"policies": ["entropy:bogus=1"]}, "policy 'entropy:bogus=1': unknown key 'bogus'"),
    ({"budgets": [1.5]}, "budgets are fractions"),
    ({"depths": [2.0]}, "depths are in [0, 1]"),
    ({"stream": 4096}, "stream < kl_tokens"),
    ({"needle_lengths": [50]}, "needle lengths must be >= 128"),
    ({"prefill": "sparse:foo=1"}, "unknown key 'foo' for stage 'sparse'"),
    ({"prefill": "sparse+dense"}, "two stages for the prefill slot"),
    ({"prefill": "window"}, "one prefill stage"),
    ({"policies": ["snapkv+sparse"], "prefill": "sparse"},
     "policy 'snapkv.sparse' with --prefill sparse: two stages for the prefill slot"),
    ({"threads": 100000}, "-t/--threads must be 1 to 512"),
    # a budget given to a stage ran every row at it, under the sweep's labels; a key without a value too
    ({"policies": ["snapkv+entropy:budget=100"]}, "sets its own budget"),
    ({"policies": ["snapkv+uniform:budget=0.2"]}, "sets its own budget"),
    ({"policies": ["snapkv:budget"]}, "sets its own budget"),
])
def test_harness_invalid_settings(kwargs, message):
    with pytest.raises(EvalError, match=message.replace("[", r"\[").replace("]", r"\]")):
        EvalConfig(**kwargs).validate()


def test_eval_cli_invalid_argument_is_a_clear_error(capsys, tmp_path):
    assert cli.main(["eval", "--budgets", "0,0.1"]) == 2
    assert "budgets are fractions" in capsys.readouterr().err
    # an output folder whose parent is missing: one line before any work, and nothing made on the way
    out = tmp_path / "missing" / "out"
    assert cli.main(["eval", "-o", str(out), "-q"]) == 2
    assert f"the folder {out.parent} does not exist" in capsys.readouterr().err and not out.parent.exists()


def test_harness_kv_bytes_are_against_the_full_cache_of_the_kl_run(model_path):
    # "x full" compares a policy's KV bytes at peak with the full cache holding the KL run (its text and greedy
    # continuation), whatever the needle prompts' lengths: it used to be the needles' context when they were longer
    ratios = []
    for n in (160, 700):
        cfg = EvalConfig(policies=["sink_recent"], budgets=[0.5], kl_tokens=192, stream=32, needle_lengths=[n],
                         depths=[0.5], n_agree=4, threads=2, model_path=model_path)
        res = evaluate(cfg, quiet=True)
        full, sr = res["runs"]
        assert full["n_ctx"] == cfg.n_ctx_kl == 256 and x_full_bytes(res, full) == 1.0
        ratios.append(x_full_bytes(res, sr))
        assert f"| {ratios[-1]:.3f} |" in markdown(res).splitlines()[-1]
    assert ratios[0] == ratios[1] and 0.0 < ratios[0] < 1.0


def test_eval_policies_take_their_own_keys():
    assert policy_spec("entropy:pool=5,topk_share=0.9", 100) == "entropy:budget=100,pool=5,topk_share=0.9"
    assert policy_spec("snapkv+window:pool_max=0.5", 100) == "snapkv:budget=100+window:pool_max=0.5"
    assert policy_spec("entropy:pool=5+uniform", 100, "sparse") == "entropy:budget=100,pool=5+uniform+sparse"
    assert policy_spec("sink_recent:chunk=64", 100) == "sink_recent:n_sink=4,n_recent=96,chunk=64"
    EvalConfig(policies=["snapkv", "entropy:pool=5,topk_share=0.9", "snapkv+window:pool_max=0.5"]).validate()
    assert split_policies("snapkv, entropy:pool=5,topk_share=0.9,h2o") == ["snapkv", "entropy:pool=5,topk_share=0.9", "h2o"]
    assert split_policies("entropy:topk_share=1,pool=5+window:pool_max=0+uniform,snapkv") == [
        "entropy:topk_share=1,pool=5+window:pool_max=0+uniform", "snapkv"]


def test_numpy_docs_corpus_is_long_documentation_in_a_stable_order():
    from pykvcache import corpus

    texts = corpus.numpy_docs()
    assert len(texts) > 200 and sum(len(t) for t in texts) > 500_000
    assert texts == corpus.numpy_docs()
    assert texts[0].startswith("numpy.") and "Parameters" in "".join(texts[:20])
    assert "numpy" in corpus.describe("numpy-docs") and "BSD" in corpus.describe("numpy-docs")
    with pytest.raises(ValueError, match="unknown corpus 'poems'"):
        corpus.texts("poems")


def test_a_needle_lands_at_its_depth_in_a_text_without_full_stops(model_path):
    """Found by an audit: the needle went after the next token ending in '.', so in a text without one (Chinese
    sentences end in U+3002, records one per line) every depth put it just before the question, and a recent window
    found every needle; and a decimal point was a sentence end ("version 1.| fact |7.0")."""
    llm = Llama(model_path, n_ctx=256, verbose=False)
    texts = {"cjk": "".join(f"\u7b2c{i}\u6bb5\u6587\u5b57\u5185\u5bb9\u5728\u8fd9\u91cc\u3002" for i in range(600)),
             "records": " ".join(f"record {i} value {i * 7 % 13}" for i in range(800)),
             "essays": " ".join(corpus.essays()[20:30]),
             "decimals": " ".join(f"Version 1.{i}.0 costs 3.{i}5 units" for i in range(900))}
    for name, hay in texts.items():
        for c in needle_cases(llm, hay, 1024, [0.1, 0.5, 0.9], seed=0):
            text = llm.detokenize(c["tokens"]).decode("utf-8", errors="replace")
            i = text.index(" The special magic number")
            at = i / text.index("\n\nWhat is the special magic number")
            assert abs(at - c["depth"]) < 0.08, (name, c["depth"], at)
            after = text[text.index(".", i) + 1 :]
            assert not (text[i - 2].isdigit() and text[i - 1] == "." and after[:1].isdigit()), (name, text[i - 20 : i + 80])
            assert name not in ("decimals", "records") or after[:1].isspace(), (name, text[i - 20 : i + 80])  # a word's end
    llm.close()


def test_own_needles_from_a_json_file(model_path, tmp_path):
    """Reviewers bring needles of their own (found by an audit: only the two built-in sets could be measured)."""
    import json as json_module

    from pykvcache.evaluate import load_needles

    f = tmp_path / "needles.json"
    own = [{"fact": "The ferry to Vigo leaves at 7:40.", "question": "When does the ferry to Vigo leave? It leaves at",
            "answer": "7:40"},
           {"fact": "Marta's cat is called Pimienta.", "question": "What is Marta's cat called? It is called",
            "answer": "Pimienta"}]
    f.write_text(json_module.dumps(own), encoding="utf-8")
    llm = Llama(model_path, n_ctx=256, verbose=False)
    cases = needle_cases(llm, " ".join(corpus.essays()[20:24]), 512, [0.2, 0.8], seed=0, kind=str(f))
    assert sorted(c["answer"] for c in cases) == ["7:40", "Pimienta"]  # each entry once, in turn
    for c in cases:
        e = next(e for e in own if e["answer"] == c["answer"])
        text = llm.detokenize(c["tokens"]).decode("utf-8", errors="replace")
        assert e["fact"] in text and text.endswith(e["question"])
    llm.close()
    EvalConfig(needles=str(f)).validate()
    for bad, says in (("[]", "give a JSON list"), ("{", "is not UTF-8 JSON"),
                      ('[{"fact": "x is 1.", "question": "x?"}]', "entry 0 needs non-empty strings"),
                      ('[{"fact": "x is 1.", "question": "x is", "answer": "2"}]', "entry 0's fact does not hold its answer")):
        f.write_text(bad, encoding="utf-8")
        with pytest.raises(EvalError, match=says):
            load_needles(str(f))
    with pytest.raises(EvalError, match="unknown needle set 'odd' .*or a JSON file"):
        EvalConfig(needles="odd").validate()


def test_a_long_text_file_gives_the_tokens_of_its_whole(model_path, tmp_path):
    """Found by an audit: eval tokenized a long -f file whole, several times (149 s for 8.4 MB, ~1k tokens used); it
    is cut far past the tokens it uses now, which are those of the whole file."""
    from pykvcache.evaluate import eval_texts

    f = tmp_path / "long.txt"
    text = "\n\n".join(corpus.essays()[:12])
    f.write_text(text, encoding="utf-8")
    cfg = EvalConfig(text_file=str(f), kl_tokens=512, stream=64, needle_lengths=[512])
    llm = Llama(model_path, n_ctx=256, verbose=False)
    tokens, hay = eval_texts(cfg, llm)
    every = llm.tokenize(text.encode())
    assert len(text) > 4 * (16*(512 + 512) + 4096)  # long enough to be cut
    assert tokens == every[:512]
    whole = llm.detokenize(every[512:]).decode("utf-8", errors="replace")
    assert needle_cases(llm, hay, 512, [0.5, 0.9], seed=0) == needle_cases(llm, whole, 512, [0.5, 0.9], seed=0)
    llm.close()


def test_a_needle_counts_only_as_a_whole_word_or_number():
    """Found by an audit: a hit was a substring, so " 20781" answered 2078 and "Ana Lima" answered "Ana Li"."""
    from pykvcache.evaluate import answer_in

    assert answer_in("2078", " 2078.") and answer_in("2078", "is 2078") and answer_in("Ana Li", "It is Ana Li.")
    assert answer_in("blue car", " a blue car,")
    assert not answer_in("2078", " 20781") and not answer_in("2078", " 12078") and not answer_in("Ana Li", "Ana Lima")
    # in any case; CJK characters end a word; a number inside a decimal or a time is not it; Cyrillic words are words
    assert answer_in("gentle lantern", '"Gentle Lantern"') and answer_in("1311", "1311\u53f7") and answer_in("7:40", "at 7:40.")
    assert answer_in("$12.50", "It costs US$12.50.") and answer_in("2078", "2078, then")
    assert not answer_in("12", "It costs 12.50.") and not answer_in("7", "at 7:40") and not answer_in("2078", "2078.5")
    assert not answer_in("\u0418\u0432\u0430\u043d", "\u0418\u0432\u0430\u043d\u043e\u0432.")


def test_varied_needles_vary_in_wording_value_and_length(model_path):
    llm = Llama(model_path, n_ctx=256, verbose=False)
    from pykvcache import corpus

    hay = "\n\n".join(corpus.numpy_docs()[100:])
    cases = [c for n in (1024, 2048, 4096) for c in needle_cases(llm, hay, n, [0.2, 0.4, 0.6, 0.8], 1234, "varied")]
    assert len(cases) == 12
    answers = [c["answer"] for c in cases]
    numbers = [a for a in answers if a.isdigit()]
    words = [a for a in answers if not a.isdigit()]
    assert numbers and {len(a) for a in numbers} <= {4, 5, 6, 7}
    names = [a for a in words if all(w[0].isupper() for w in a.split())]
    phrases = [a for a in words if a.islower()]
    assert names and phrases and len(names) + len(phrases) == len(words)
    questions = set()
    for c in cases:
        assert len(c["tokens"]) == c["length"]
        text = llm.detokenize(c["tokens"]).decode("utf-8", errors="replace")
        assert text.count(c["answer"]) == 1  # once in the fact, and the question ends where the value starts
        questions.add(text.rsplit("\n\n", 1)[1].split("?")[0])
        assert c["n_answer"] >= len(llm.tokenize((" " + c["answer"]).encode(), add_bos=False))
    assert len(questions) >= 3
    with pytest.raises(EvalError, match="a 20-token needle prompt is shorter than its fact and question"):
        needle_cases(llm, hay, 20, [0.5], 1234)
    llm.close()


def test_harness_on_the_second_corpus_with_varied_needles(model_path):
    cfg = EvalConfig(policies=["snapkv"], budgets=[0.5], kl_tokens=192, stream=32, needle_lengths=[256],
                     depths=[0.3, 0.7], n_agree=4, threads=2, model_path=model_path, corpus="numpy-docs",
                     needles="varied")
    res = evaluate(cfg, quiet=True)
    full, snap = res["runs"]
    assert full["kl_mean"] == 0.0 and snap["kl_mean"] > 0.0 and len(snap["needle_hits"]) == 2
    assert "numpy" in res["source"] and markdown(res).startswith("text: numpy's docstrings")
    for kwargs, message in (({"corpus": "poems"}, "unknown corpus 'poems'"), ({"needles": "odd"}, "unknown needle set")):
        with pytest.raises(EvalError, match=message):
            EvalConfig(**kwargs).validate()


@pytest.mark.parametrize("script, args, message", [
    ("summarise.py", ["--policies", "sink_recent"], "summarise needs a score stage that observes"),
    ("summarise.py", ["--policies", "snapkv", "-o", "/nonexistent-dir/x.json"], "the folder /nonexistent-dir does not exist"),
    ("summarise.py", ["--needles", "classic,odd"], "--needles takes classic, varied and/or JSON needle files"),
    ("summarise.py", ["--needles", "varied,varied"], "each once"),
    ("summarise.py", ["--needle-seeds", "1,x"], "--needle-seeds takes integers"),
    ("summarise.py", ["--needle-seeds", "7,7"], "--needle-seeds: each seed once"),
    ("summarise.py", ["--summarise", "host"], "--summarise takes the summarise stage"),
    ("summarise.py", ["--needle-budget", "0.3"], "--needle-budget 0.3 is not one of --budgets"),
    ("decode_limit.py", ["--policies", ""], "--policies: no policy given"),
    ("decode_limit.py", ["-n", "0"], "-p and -n must be >= 1"),
    ("prefix_reuse.py", ["-b", "2.5"], "-b 2.5: snapkv: a budget >= 1 is a token count"),
    ("chat_turns.py", ["-n", "1"], "at least 2 turns"),
    ("freeze.py", ["--needle-lengths", "20"], "must be >= 128 tokens"),
    ("sparse_prefill.py", ["--policies", "snapkv:budget=0.5"], "no sparse prefill stage"),
    # they took no text of the user's (found by an audit): now -f, checked before the runs
    ("freeze.py", ["-f", "/nonexistent-dir/t.txt"], "-f/--file /nonexistent-dir/t.txt: No such file"),
    ("sparse_prefill.py", ["-f", "/nonexistent-dir/t.txt"], "-f/--file /nonexistent-dir/t.txt: No such file"),
    ("sparse_prefill.py", ["-f", __file__, "--lengths", "100000"], "the longest prompt and the 32 tokens after it"),
])
def test_bench_scripts_refuse_bad_settings_before_any_run(script, args, message):
    # one usage error line and exit status 2 before a model is loaded, not a traceback after minutes of work
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / script
    p = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_summarise_bench_refuses_a_short_text_and_a_rank_above_the_head_size_before_its_runs(tmp_path):
    """Found by an audit: a text too short ended in a traceback, and a rank above the head size (which only the model
    can check) in one after the full cache's and eviction's runs."""
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "summarise.py"
    short = tmp_path / "short.txt"
    short.write_text("Too short to measure anything.", encoding="utf-8")
    small = ["--policies", "snapkv", "--budgets", "0.25", "--kl-tokens", "256", "--stream", "32", "--needle-lengths",
             "256", "-t", "1"]  # the needles at the smallest budget
    for args, message in ((["-f", str(short)], "the KL text takes the first 256"),
                          (["--summarise", "summarise:rank=70,bin=2000"], "rank must be <= the head size 64")):
        p = subprocess.run([sys.executable, str(path), *small, *args], capture_output=True, text=True, timeout=300)
        assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert "KL mean" not in p.stdout


def test_summarise_bench_table_names_its_rows_and_ratios():
    """The table says which row is REAL and which FAIR, at the FAIR row's own budget, with the KV bytes in use."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_summarise",
                                                  Path(__file__).resolve().parent.parent / "bench" / "summarise.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    common = dict(policy="snapkv", budget_frac=0.1, top1=0.9, ms_per_token=10.0)
    rows = [{"spec": "full", "kl_mean": 0.0, "top1": 1.0, "ms_per_token": 20.0, "needle_hits": [True],
             "kv_bytes_used": 2**21},
            dict(common, spec="snapkv:budget=179", kind="drop", budget=179, kl_mean=0.05, kv_bytes_used=2**20),
            dict(common, spec="snapkv:budget=179+summarise", kind="summarise", budget=179, kl_mean=0.03,
                 kv_bytes_used=2**20, centroids_per_layer=14.0, fit_err=0.4, ms_per_bin=5.0, host_bytes_peak=2**22),
            dict(common, spec="snapkv:budget=165", kind="drop, FAIR", budget=165, kl_mean=0.055,
                 kv_bytes_used=15 * 2**16)]
    text = mod.markdown({"date": "d", "cpu": "c", "threads": 1, "command": "x", "rows": rows})
    lines = text.splitlines()
    assert lines[0].startswith("d, c, 1 thread:")
    assert "| KL x drop |" in lines[2] and "| ms x drop |" in lines[2] and "| KV MiB used |" in lines[2]
    assert "| 0.1 (165) | drop, FAIR | 0.0550 | 1.10 |" in text and "| 0.1 (179) | summarise | 0.0300 | 0.60 |" in text
    assert "equal KV bytes: REAL" in text and "equal real tokens: FAIR" in text
    assert "| 1.00 | 14.0 |" in text and "| 0.94 | - |" in text  # KV MiB used of summarise and FAIR


BENCH_SCRIPTS = ("chat_turns", "decode_limit", "freeze", "make_results", "observe_overhead", "prefix_reuse",
                 "serve_load", "sparse_prefill", "summarise")


@pytest.mark.parametrize("name", BENCH_SCRIPTS)
def test_bench_script_help_describes_every_option(name, monkeypatch):
    import argparse
    import importlib.util
    from pathlib import Path

    class Parsed(Exception):
        pass

    def check(self, args=None, namespace=None):
        bare = [a.option_strings[-1] for a in self._actions if a.option_strings and not a.help]
        assert not bare, f"bench/{name}.py: options without help: {bare}"
        raise Parsed

    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    monkeypatch.syspath_prepend(str(path.parent))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", check)
    monkeypatch.setattr(sys, "argv", [str(path)])
    with pytest.raises(Parsed):
        mod.main()
