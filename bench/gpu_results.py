"""The GPU section of docs/RESULTS.md, from what scripts/gpu-session.sh wrote on a device machine.

    python bench/gpu_results.py DIR     # prints the section (markdown) for the session outputs in DIR

A GPU session's $OUT files are copied into docs/results/gpu/ (gpu-session.log, sparse-attn-check.json,
kvp-backend-check.json, sparse-attn-perf.md, kvbench-*.json); bench/make_results.py includes this section whenever that
folder exists. Nothing here is measured on this machine.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional


def _json(path: Path) -> Optional[Dict[str, Any]]:
    """A step's JSON output, or None when the step did not run or was cut off."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _device(log: str) -> str:
    """The GPU and CUDA version lines of the session log."""
    gpu = re.search(r"^GPU 0: (.+?)(?: \(UUID.*)?$", log, re.M)
    cuda = re.search(r"release ([0-9.]+)", log) or re.search(r"Build cuda_([0-9.]+)\.r", log)
    return f"{gpu.group(1) if gpu else 'an NVIDIA GPU'}, CUDA {cuda.group(1) if cuda else '?'}"


def _check_line(res: Optional[Dict[str, Any]]) -> str:
    if res is None:
        return "- **sparse-attn-check**: no result (the step did not finish)."
    backends = ", ".join(f"{name}: {b.get('ran', 0)} ran, {b.get('fail', 0)} failed"
                         for name, b in res.get("backends", {}).items())
    return (f"- **sparse-attn-check** (`--cases {res.get('cases')}`): {res.get('cases', 0) - res.get('fail', 0)} of "
            f"{res.get('cases')} cases pass ({backends}); NMSE threshold {res.get('nmse_threshold')}.")


def _backend_table(res: Optional[Dict[str, Any]]) -> str:
    if res is None:
        return "kvp-backend-check: no result (the step did not finish)."
    ngl = res.get("n_gpu_layers", 999)
    where = "every layer" if ngl >= 999 else f"{ngl} layers"
    lines = [f"`kvp-backend-check -p {res['n_prompt']} -n {res['n_gen']}{'' if ngl >= 999 else f' -ngl {ngl}'}`: every "
             f"policy on the CPU against {where} on {res['gpu'] or 'the CPU (no GPU found)'}, same tokens; bars: mean "
             f"KL <= {res['max_kl']:g}, mean "
             f"Jaccard >= {res['min_jaccard']:g}.", "",
             "| policy | KL after prompt | KL mean | KL max | top-1 | Jaccard after prompt (mean / min) | "
             "Jaccard at end (mean / min) | pass |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in res["policies"]:
        name = "+".join(part.split(":")[0] for part in r["policy"].split("+"))
        if "error" in r:
            lines.append(f"| {name} | error: {r['error']} | | | | | | no |")
            continue
        lines.append(f"| {name} | {r['kl_prompt']:.2e} | {r['kl_mean']:.2e} | {r['kl_max']:.2e} | {r['top1']:.2f} | "
                     f"{r['jaccard_prompt_mean']:.3f} / {r['jaccard_prompt_min']:.3f} | "
                     f"{r['jaccard_end_mean']:.3f} / {r['jaccard_end_min']:.3f} | {'yes' if r['pass'] else '**no**'} |")
    for r in res["policies"]:
        if "summary_cpu" in r:
            a, b = r["summary_cpu"], r["summary_other"]
            lines.append(f"\nSummarise, CPU / GPU side: bins {a['n_bins']} / {b['n_bins']}, fallbacks {a['n_fallback']} / "
                         f"{b['n_fallback']}, centroid cells at the end {a['n_centroids']} / {b['n_centroids']}, fit error "
                         f"{a['fit_err']:.4f} / {b['fit_err']:.4f}, fit time {a['t_ms']:.0f} / {b['t_ms']:.0f} ms.")
    return "\n".join(lines)


def _kvbench_table(res: Optional[Dict[str, Any]], what: str) -> str:
    if res is None:
        return f"kvbench ({what}): no result (the step did not finish)."
    lines = ["| policy | prompt | prefill t/s | prefill x full | decode t/s | decode x full | decode x limit | "
             "KV MiB | density |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["results"] + res.get("limits", []):
        lim = f"{r['tg_limit_ratio']:.2f}" if r.get("tg_limit_ratio") else "-"
        types = (r.get("type_k", "f16"), r.get("type_v", "f16"))
        label = r["label"] if types == ("f16", "f16") else f"{r['label']} [{types[0]}/{types[1]}]"
        if r["n_prompt"] == 0:  # a physical-limit row: the full cache decoding at that depth
            lines.append(f"| {label} | - | - | - | {r['tg_ts']:.0f} ± {r['tg_ts_sd']:.0f} | - | 1.00 | - | - |")
            continue
        lines.append(f"| {label} | {r['n_prompt']} | {r['pp_ts']:.0f} ± {r['pp_ts_sd']:.0f} | {r['pp_ratio']:.2f} | "
                     f"{r['tg_ts']:.0f} ± {r['tg_ts_sd']:.0f} | {r['tg_ratio']:.2f} | {lim} | "
                     f"{r['kv_bytes'] / 2**20:.1f} | {r.get('density', 1.0):.2f} |")
    sums = [r for r in res["results"] if r.get("sum_bins") is not None]
    if sums:  # summarise's own host time (reading leavers, fitting, writing centroids), per repetition
        lines += ["", "| policy | bins | summarise ms, prompt | summarise ms per decoded token |", "|---|---:|---:|---:|"]
        lines += [f"| {r['label']} | {r['sum_bins']:.0f} | {r['sum_ms_pp']:.0f} | {r['sum_ms_tg'] / max(r['n_gen'], 1):.3f} |"
                  for r in sums]
    perf = [r for r in res["results"] if r.get("host_ms_tg") is not None and r.get("tg_ts")]
    if perf:  # the policy's own host time around the graphs per decoded token (llama_kvp_perf), by part
        # and apart, the time it waited in them for the device's earlier graphs (runs before the field: '-')
        lines += ["", "| policy | host ms per decoded token | prepare | slots | inputs | x step | wait ms per decoded token |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for r in perf:
            n = max(r["n_gen"], 1)
            parts = r["host_ms_tg_parts"]
            wait = r.get("host_wait_ms_tg")
            lines.append(f"| {r['label']} | {r['host_ms_tg'] / n:.3f} | {parts[0] / n:.3f} | {parts[1] / n:.3f} | "
                         f"{parts[2] / n:.3f} | {r['host_ms_tg'] / n * r['tg_ts'] / 1000:.3f} | "
                         f"{'-' if wait is None else f'{wait / n:.3f}'} |")
    return "\n".join(lines)


def _whole_model(d: Path) -> str:
    """The latest whole-model run (a session folder with *full-kvbench-policies.json); '' when there is none."""
    runs = sorted(p for p in d.glob("session*/*full-kvbench-policies.json"))
    if not runs:
        return ""
    pol = runs[-1]
    pre = pol.name[: -len("full-kvbench-policies.json")]
    run = pol.parent
    logs = "\n".join(p.read_text(errors="replace") for p in sorted(run.glob(f"{pre}*.log")))
    device = _device(logs)
    parts = [f"""
### The whole model (30 layers): {run.name}

SmolLM2-135M Q4_1, every layer offloaded unless the table says otherwise, on {device}; 8k-token prompts from the
essays, 64 decode steps (`{run.name}/full-model-run.sh`; raw outputs beside it). The limit is the full cache decoding at
the depth of the budget.

{_backend_table(_json(run / f"{pre}full-kvp-backend-check.json"))}

Retention policies at 8k / 10%:

{_kvbench_table(_json(pol), 'retention policies')}

Fates that move K/V between the GPU and the host:

{_kvbench_table(_json(run / f"{pre}full-kvbench-fates.json"), 'fates')}
"""]
    for n in (64, 512):
        later = _json(run / f"{pre}summarise-kvbench-n{n}.json")
        if later is not None:
            parts.append(f"""
Summarise, rerun after its fits became one parallel pass over every layer's closed bins (later, on another H100,
`{run.name}/summarise-run.sh`), {n} decode steps:

{_kvbench_table(later, 'summarise')}
""")
    split = _json(run / f"{pre}full-kvbench-ngl15.json")
    if split is not None:
        parts.append(f"""
Half the layers on the GPU (`-ngl 15` of 30):

{_kvbench_table(split, 'split caches')}
""")
    return "".join(parts)


# the fourth run's tables (session4/run.sh, run2.sh): file, caption
RUN4 = [
    ("kvbench-f16.json", "Retention policies and summarise at 8k / 10%, f16 caches, 64 decode steps:"),
    ("kvbench-q8.json", "The same with q8_0 K and V, and with q8_0 K and f16 V (each against the full cache of its types):"),
    ("kvbench-gpu-n512.json", "Summarise's decode over 512 steps (`run2.sh`), with its own host time per decoded token:"),
    ("kvbench-gpu-n256.json", "Its transfer cost: 4k prompt, 256 steps, every layer on the GPU:"),
    ("kvbench-cpu16-n256.json", "... and the same on the device machine's CPU (`-ngl 0`, 16 threads):"),
    ("kvbench-lam.json", "Summarise's ordering of the leavers (`run3.sh`: `lam=0` orders by score alone), 4k prompt, 256 "
                         "steps, 2 repetitions:"),
    ("kvbench-lam-r3.json", "The same on another H200, 3 repetitions (`run4.sh`):"),
    ("kvbench-lam-threads.json", "And on a third, with an uncommitted change (the entropies of all layers computed "
                                 "on 16 threads; no gain, not kept; `run5.sh`):"),
]


def _run4(d: Path) -> str:
    """The fourth GPU run (session4): cache types on CUDA, summarise's host time; '' when it is not there."""
    run = d / "session4"
    if not (run / "run.log").is_file():
        return ""
    device = _device((run / "run.log").read_text(errors="replace"))
    parts = [f"""
### The whole model (30 layers), fourth run: session4

SmolLM2-135M Q4_1, every layer offloaded unless a table says otherwise, on {device}; prompts from the essays
(`session4/run.sh`, `session4/run2.sh`; raw outputs beside them).

{_backend_table(_json(run / "kvp-backend-check.json"))}
"""]
    for name, caption in RUN4:
        parts.append(f"\n{caption}\n\n{_kvbench_table(_json(run / name), name)}\n")
    return "".join(parts)


def markdown(d: Path) -> str:
    """The section for the session outputs in folder d ('' when it holds none)."""
    log_path = d / "gpu-session.log"
    if not log_path.is_file():
        return ""
    log = log_path.read_text(errors="replace")
    perf = (d / "sparse-attn-perf.md").read_text() if (d / "sparse-attn-perf.md").is_file() else "no result\n"
    perf = perf.replace("\nn_q=", "\n\nn_q=")  # one table per call, appended
    note = (d / "NOTE.md").read_text().strip() if (d / "NOTE.md").is_file() else ""
    parts: List[str] = [f"""
## On a GPU (CUDA, every layer offloaded)

Run by `bash scripts/gpu-session.sh` on a device machine ({_device(log)}), with the libraries and tools built here for
sm_90 (`bash scripts/check-cuda.sh --full --arch 90`, then `bash scripts/gpu-kit.sh --prebuilt`), on the kit's model:
SmolLM2-135M Q4_1 cut to its first 8 layers (real weights; its output is not a language model's, so these rows say
nothing of fidelity), prompts from the essays. Raw outputs and the session log: [results/gpu/](results/gpu/).
{(chr(10) + note + chr(10)) if note else ''}
### Cross-backend checks

{_check_line(_json(d / 'sparse-attn-check.json'))}

{_backend_table(_json(d / 'kvp-backend-check.json'))}

### The sparse-attention op against flash attention (CUDA)

{perf.strip()}

### kvbench -ngl 99: sparse prefill at long prompts

{_kvbench_table(_json(d / 'kvbench-sparse.json'), 'sparse prefill')}

### kvbench -ngl 99: retention policies at 8k / 10%

{_kvbench_table(_json(d / 'kvbench-policies.json'), 'retention policies')}

### kvbench -ngl 99: fates that move K/V between the GPU and the host

{_kvbench_table(_json(d / 'kvbench-fates.json'), 'fates')}
""", _whole_model(d), _run4(d)]
    split = _json(d / "kvp-backend-check-ngl4.json")
    if split is not None:
        parts.append(f"""
### Half the layers on the GPU (-ngl 4 of 8): caches split between the GPU and the host

{_backend_table(split)}

{_kvbench_table(_json(d / 'kvbench-ngl4.json'), 'split caches')}
""")
    return "".join(parts)


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        sys.exit(0)
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        print("usage: " + __doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        if len(sys.argv) == 2:
            print(f"gpu_results.py: error: {sys.argv[1]} is not a folder", file=sys.stderr)
        sys.exit(2)
    print(markdown(Path(sys.argv[1])))
