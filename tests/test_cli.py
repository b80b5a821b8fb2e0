"""The `pykvcache` command: generate, telemetry, errors and help."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

PROMPT = "The capital of France is"

# the console script installed next to this interpreter, run outside the source tree
SCRIPT = Path(sys.executable).parent / "pykvcache"


def run(*args: str, cwd=None):
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, cwd=cwd or tempfile.gettempdir(),
                          timeout=300)


def test_help():
    out = run("--help")
    assert out.returncode == 0
    assert "generate" in out.stdout and "telemetry" in out.stdout
    out = run("generate", "--help")
    assert "--policy" in out.stdout and "+stage" in out.stdout and "pykvcache policies" in out.stdout


@pytest.mark.parametrize("args", [("bench", "--help"), ("--help",), ("policies",)])
def test_output_into_a_closed_pipe_ends_quietly(args):
    # `pykvcache bench --help | head -1`: the reader goes before the writer is done
    proc = subprocess.Popen([str(SCRIPT), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=tempfile.gettempdir())
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) in (0, 141)
    assert "Traceback" not in err and "BrokenPipe" not in err and "killed by" not in err, err


def test_policies_lists_presets_and_stages():
    out = run("policies")
    assert out.returncode == 0
    for name in ("snapkv", "entropy", "h2o", "sink_recent", "pyramid", "uniform", "window", "accumulated", "every",
                 "drop", "dense"):
        assert f"  {name} " in out.stdout
    assert "keys: budget=0.25,min_layer=0,max_layer=0" in out.stdout  # each key at its default


def test_generate_with_a_composed_policy(tmp_path):
    out = run("generate", "-p", PROMPT * 20, "-n", "8", "-c", "512", "--policy", "snapkv:budget=64,chunk=32+entropy",
              cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    # the KV line names the composed policy, whose entropy stage gives the layers budgets of their own
    kv = next(line for line in out.stderr.splitlines() if line.startswith("KV cache"))
    assert "policy snapkv:" in kv and "+entropy" in kv, kv


def test_generate_prints_text_and_kv_line(tmp_path):
    out = run("generate", "-p", PROMPT, "-n", "8", "-c", "256", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    kv = [ln for ln in out.stderr.splitlines() if ln.startswith("KV cache:")]
    assert len(kv) == 1
    assert "30 layers x 256 cells" in kv[0] and "MiB" in kv[0] and "policy none" in kv[0]


def test_generate_shows_summarises_host_memory_beside_the_cache(tmp_path):
    """Summarise's pending bins are host memory, not cache: the KV line names them (eviction alone has none)."""
    for policy, shown in (("snapkv:budget=48+summarise:bin=32,rank=4", True), ("snapkv:budget=48", False)):
        out = run("generate", "-p", PROMPT * 20, "-n", "8", "-c", "512", "--policy", policy, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        kv = [ln for ln in out.stderr.splitlines() if ln.startswith("KV cache:")]
        assert len(kv) == 1 and ("| host memory " in kv[0] and "MiB (peak " in kv[0]) == shown, kv


def test_generate_with_observe_writes_a_plot(tmp_path):
    png = tmp_path / "kv.png"
    out = run("generate", "-p", PROMPT, "-n", "4", "-c", "256", "--policy", "observe:window=8", "--plot", str(png))
    assert out.returncode == 0, out.stderr
    assert "policy observe:window=8,every=0,decay=1" in out.stderr
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_telemetry_summary_and_json(tmp_path):
    js = tmp_path / "t.json"
    out = run("telemetry", "-p", "Alice gave Bob a book. Bob thanked Alice.", "-c", "256", "--json", str(js))
    assert out.returncode == 0, out.stderr
    assert "mean attention entropy per layer" in out.stdout
    assert "most attended positions" in out.stdout
    assert js.stat().st_size > 100


def test_telemetry_and_generate_print_the_summarise_counters(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"item {i} is {i * 7 % 13}." for i in range(80)))
    for cmd in (["telemetry"], ["generate", "-n", "2"]):
        out = run(*cmd, "-f", str(text), "-c", "1024", "--policy", "h2o:budget=64+summarise:bin=32,rank=4")
        assert out.returncode == 0, out.stderr
        assert re.search(r"summarise: [1-9]\d* bins fitted", out.stdout + out.stderr), (out.stdout, out.stderr)


def test_telemetry_and_generate_print_sparse_prefills_blocks(tmp_path):
    """Found by an audit: `telemetry --policy none+sparse` was refused, and with an observing policy +sparse neither
    command said how many key blocks the prompt computed (only --json and --plot had it)."""
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"item {i} is {i * 7 % 13}." for i in range(120)))
    for cmd, spec in ((["telemetry"], "none+sparse:threshold=256,base=64"),
                      (["telemetry"], "snapkv:budget=256+sparse:threshold=256,base=64"),
                      (["generate", "-n", "2"], "none+sparse:threshold=256,base=64")):
        out = run(*cmd, "-f", str(text), "-c", "2048", "--policy", spec)
        assert out.returncode == 0, out.stderr
        m = re.search(r"sparse prefill: key blocks computed (0\.\d+) of dense attention's, over [1-9]\d* prompt ubatches x layers",
                      out.stdout + out.stderr)
        assert m and float(m.group(1)) < 1.0, (cmd, spec, out.stdout, out.stderr)


def test_bad_policy_spec_is_one_line_naming_the_key():
    out = run("generate", "-p", PROMPT, "--policy", "observe:windw=8")
    assert out.returncode == 2
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert lines == ["pykvcache: error: unknown key 'windw' for policy 'observe' (accepted: window,every,decay)"]


def test_missing_model_file(tmp_path):
    out = run("generate", "-p", PROMPT, "-m", str(tmp_path / "missing.gguf"))
    assert out.returncode == 2
    assert "model file not found" in out.stderr


def test_demo_compares_a_policy_with_the_full_cache(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(f"Line {i} of a plain document about rivers and hills." for i in range(200)))
    out = run("demo", "-f", str(doc), "-p", "600", "--policy", "entropy:budget=0.25", "--plot", "t.png", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "| full cache |" in out.stdout and "| entropy:" in out.stdout
    assert "of the full cache's KV memory" in out.stdout and (tmp_path / "t.png").stat().st_size > 10_000
    bad = run("demo", "--policy", "observe")
    assert bad.returncode == 2 and "keeps every token" in bad.stderr


def test_serve_help_names_the_policy_flag():
    out = run("serve", "--help")
    assert out.returncode == 0 and "--kv-policy" in out.stdout and "--n_ctx" in out.stdout


@pytest.mark.parametrize("args, says", [
    (["generate", "-p", "hi", "-b", "-3"], "-b/--batch-size must be >= 1"),       # segfaulted in llama_batch_init
    (["generate", "-p", "hi", "-t", "99999"], "-t/--threads must be in 1..512"),  # segfaulted in OpenMP
    (["generate", "-p", ""], "the prompt is empty"),                             # an AssertionError traceback
    (["generate", "-f", "/nonexistent/prompt.txt"], "-f/--file /nonexistent/prompt.txt"),  # was taken for -fa
    (["generate", "-p", "hi", "--plot", "noext"], "needs one of the suffixes"),  # wrote noext.png
    (["generate", "-p", "hi", "--plot", "x.png"], "need a policy that observes attention"),  # after generating
    (["generate", "-p", "hi", "-s", "-2"], "-s/--seed must be in 0..4294967295"),  # the same text as -s 2
    (["demo", "--policy", "sink_recent", "--plot", "x.png"], "--plot needs a policy that observes"),  # wrote nothing
    (["demo", "-f", "."], "Is a directory"),                                     # a traceback
    (["demo", "-t", "0"], "-t/--threads must be in 1..512"),                     # taken as the default
    (["demo", "-f", "/bin/true"], "-f/--file /bin/true is not UTF-8 text"),      # a report on replacement marks
    (["generate", "-p", "hi", "--temp", "nan"], "--temp must be a number >= 0"),
    (["telemetry", "-p", "hi", "--policy", "none"], "needs a policy that observes attention or prefills sparse"),
    (["eval", "--budgets", ""], "no budget to evaluate"),
    (["eval", "--policies", "snapkv:budget=0.5"], "sets its own budget"),        # silently replaced the sweep
    (["eval", "--policies", "sink_recent,h2o", "--budgets", "0.1", "--kl-tokens", "512", "--stream", "256",
      "--needle-lengths", "256"], "policy 'h2o' at budget 0.1 of a 256-token prompt"),  # failed after the first ran
    (["bench", "-t", "99999"], "at most 512 threads"),                           # segfaulted
    (["bench", "-p"], "-p: missing value"),                                      # took the model path as its value
    (["generate", "-p", "hi", "-ctv", "q8_0", "-fa", "off"], "a quantized V cache needs flash attention"),
    # an empty path was the working folder: "--json  is a folder", "model path is a folder", eval wrote into it
    (["generate", "-p", "hi", "--policy", "observe", "--json", ""], "--json is an empty path"),
    (["generate", "-p", "hi", "-m", ""], "model path is empty"),
    (["eval", "-o", ""], "-o/--output is an empty path"),
    (["generate", "-p", "hi", "--policy", "observe", "--json", "/bin/true/t.json"],  # said the folder does not exist
     "--json /bin/true/t.json: /bin/true is a file, not a folder"),
    (["eval", "-o", "/bin/true/out"], "-o/--output /bin/true/out: /bin/true is a file, not a folder"),
])
def test_bad_arguments_stop_at_once_with_one_line(args, says, tmp_path):
    out = run(*args, cwd=tmp_path)
    assert out.returncode in (1, 2) and says in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_generate_writes_the_telemetry_of_its_last_step(tmp_path):
    """The JSON of `generate --policy snapkv` held the prompt's mass and entropy (every generated position at 0): the
    last step now observes in full."""
    js = tmp_path / "t.json"
    out = run("generate", "-p", PROMPT * 8, "-n", "6", "-c", "256", "--policy", "snapkv:budget=0.5", "--json", str(js))
    assert out.returncode == 0, out.stderr
    doc = json.loads(js.read_text())
    n_prompt = len(doc["retained"][0]) - 5  # the sixth token is sampled, not evaluated
    assert doc["pos"] == doc["entropy_pos"] == max(doc["positions"]) == n_prompt + 4
    mass = np.array(doc["mass"])
    assert (mass[:, np.array(doc["positions"]) >= n_prompt].sum(axis=1) > 0).all()
    np.testing.assert_allclose(mass.sum(axis=1), 1.0, atol=1e-3)


def test_generate_says_when_the_context_ends_its_run(tmp_path):
    """-n past the context's room stopped early with no word of why."""
    prompt = tmp_path / "p.txt"
    prompt.write_text("Rivers run to the sea and hills stand still. " * 18)
    out = run("generate", "-f", str(prompt), "-n", "200", "-c", "256", "--policy", "snapkv:budget=64", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert re.search(r"stopped after \d+ of 200 tokens: the context's 256 positions are used", out.stderr), out.stderr


def test_a_write_that_fails_at_the_end_is_one_line(tmp_path):
    out = run("generate", "-p", PROMPT, "-n", "2", "-c", "256", "--policy", "observe", "--json", "/dev/full")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    # the flag and the file named (it said "[Errno 28] No space left on device" alone)
    assert out.stderr.strip().splitlines()[-1] == "pykvcache: error: --json /dev/full: No space left on device", \
        out.stderr


def test_generate_counts_the_tokens_it_generated(tmp_path):
    out = run("generate", "-p", PROMPT, "-n", "8", "-c", "256", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "| 8 tokens in " in out.stderr, out.stderr
    # a stream chunk may carry several tokens (llama-cpp-python holds back a character's first bytes): the count is
    # of tokens, not chunks (this prompt's 16 tokens came in 10 chunks)
    out = run("generate", "-p", "日本語の文章を書いてください：猫が好きです。", "-n", "16", "-c", "256", "--temp", "0",
              cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert int(re.search(r"\| (\d+) tokens in ", out.stderr)[1]) >= 16, out.stderr


def test_eval_prints_its_results_before_a_write_that_fails(tmp_path):
    """Found by an audit: eval wrote its files before printing, so a last write that failed (eval.json a folder, a
    full disk) lost the whole run's results; they are printed first now."""
    (tmp_path / "out" / "eval.json").mkdir(parents=True)
    out = run("eval", "--policies", "snapkv", "--budgets", "0.5", "--needle-lengths", "128", "--depths", "0.5",
              "--kl-tokens", "160", "--stream", "16", "-t", "1", "-q", "-o", "out", cwd=tmp_path)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "snapkv" in out.stdout and "|" in out.stdout  # the results table
