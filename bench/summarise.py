"""Summarise against plain eviction by the same policy, in one run: streamed next-token KL and top-1 against the full
cache at equal KV bytes (REAL: the same budget, centroids inside it) and at equal real tokens (FAIR: eviction with
the budget minus summarise's centroid cells), the attention output per layer against the full cache's for held-out
queries, needles, time per summarised bin and per generated token.

    python bench/summarise.py --policies snapkv,entropy --budgets 0.25,0.1 -o summarise.json

Text: essays 0-19 of the needle-haystack corpus (KL) and the rest (needles), as `pykvcache eval`; `-f FILE` takes
the user's text instead.

Held-out queries (REAL and FAIR alike): the full cache's post-RoPE queries of the first --attn-queries streamed tokens,
which no fit saw (a fit uses queries of tokens before it). Each layer's attention output for them over the prompt's
part of the cache (centroid cells with their mask bias) is compared with the full cache's over the whole prompt
(relative squared error and cosine, averaged over queries and heads), after the first streamed chunk, when the
prompt's last bins are fitted.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from pykvcache.cli import check_output_path
from pykvcache.evaluate import (NEEDLE_SETS, EvalConfig, Runner, compare_logprobs, eval_texts, load_needles, needle_cases,
                                needle_hits, policy_spec, split_policies, stream_logprobs)
from pykvcache.policies import PolicyError, parse_policy

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from sparse_prefill import cpu_name  # noqa: E402


def held_out_outputs(cfg: EvalConfig, tokens: List[int], n_prompt: int, n_q: int) -> List[Tuple[np.ndarray, float, np.ndarray]]:
    """Per KV layer: the full cache's queries of the n_q tokens after the prompt, the attention scale and their
    attention output over the prompt."""
    r = Runner(f"observe:window={n_q}", cfg)
    r.prefill(tokens[:n_prompt + n_q])
    res = []
    for il in range(len(r.llm.kv_stats().layers)):
        _, q, scale = r.llm.kv_queries(il)
        res.append((q, scale, r.llm.kv_layer(il).attend(q, scale, below=n_prompt)))
    r.close()
    return res


def attention_fidelity(llm: Any, held: List[Tuple[np.ndarray, float, np.ndarray]], n_prompt: int) -> Dict[str, List[float]]:
    """Per KV layer: relative squared error and cosine of the policy cache's attention output over the prompt against
    the full cache's, for the held-out queries."""
    mse, cos = [], []
    for il, (q, scale, o_full) in enumerate(held):
        o = llm.kv_layer(il).attend(q, scale, below=n_prompt)
        mse.append(float(((o - o_full) ** 2).sum(-1).mean() / (o_full ** 2).sum(-1).mean()))
        norm = np.linalg.norm(o, axis=-1) * np.linalg.norm(o_full, axis=-1)
        cos.append(float(((o * o_full).sum(-1) / np.maximum(norm, 1e-30)).mean()))
    return {"attn_mse": mse, "attn_cos": cos}


def cells_in_use(llm: Any) -> Dict[str, Any]:
    """The cells in use (real tokens and centroids) per layer and their KV bytes: the equal bytes REAL compares.

    Read after the timed tokens: after a prompt or a streamed chunk eviction waits for the next step, where summarise
    evicts at once."""
    layers = llm.kv_stats().layers
    return {"cells_per_layer": float(np.mean([s.n_used for s in layers])),
            "kv_bytes_used": int(sum(s.n_used * (s.k_bytes + s.v_bytes) // max(s.n_cells, 1) for s in layers))}


def run(cfg: EvalConfig, spec: str, tokens: List[int], ref: List[np.ndarray], n_gen: int,
        held: List[Tuple[np.ndarray, float, np.ndarray]]) -> Dict[str, Any]:
    """Streamed KL/top-1 against the full cache, attention fidelity per layer, KV bytes, summarise telemetry and
    decode time of one policy."""
    r = Runner(spec, cfg)
    row: Dict[str, Any] = {"spec": r.llm.kv_policy.spec()}
    n_prompt = len(tokens) - cfg.stream

    def first_chunk(i: int) -> None:
        if i == 0:
            row.update(attention_fidelity(r.llm, held, n_prompt))

    got = stream_logprobs(r, tokens, cfg.stream, cfg.stream_chunk, first_chunk)
    row.update(compare_logprobs(ref, got))
    mem = r.llm.kv_memory()
    row["bytes"], row["bytes_peak"] = mem.bytes, mem.bytes_peak
    row["host_bytes_peak"] = mem.host_bytes_peak  # summarise's pending bins, not in the KV bytes
    summ = "+summarise" in row["spec"]
    t_prev = 0.0
    if summ:
        s = r.llm.kv_summary()
        row.update(n_bins=s.n_bins, n_fallback=s.n_fallback, centroids_per_layer=s.n_centroids / len(mem.layers),
                   fit_err=s.fit_err, fit_lse_err=s.fit_lse_err, ms_per_bin=s.t_ms / max(s.n_bins + s.n_fallback, 1))
        t_prev = s.t_ms
    t0 = time.perf_counter()
    r.greedy(n_gen)
    row["ms_per_token"] = 1e3 * (time.perf_counter() - t0) / n_gen
    row.update(cells_in_use(r.llm))
    if summ:
        row["summarise_ms_per_token"] = (r.llm.kv_summary().t_ms - t_prev) / n_gen
    r.close()
    return row


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="snapkv,entropy", help="retention presets, comma-separated")
    ap.add_argument("--budgets", default="0.25,0.1", help="fractions of the prompt, comma-separated")
    ap.add_argument("--summarise", default="summarise", help="the fate stage spec added (e.g. summarise:bin=32,rank=4)")
    ap.add_argument("--kl-tokens", type=int, default=2048,
                    help="tokens of the KL text: the prompt and the streamed part (default 2048)")
    ap.add_argument("--stream", type=int, default=256,
                    help="the KL text's last tokens, streamed and scored against the full cache (default 256)")
    ap.add_argument("--needle-lengths", default="2048", help="needle prompt lengths (tokens), comma-separated")
    ap.add_argument("--needle-budget", type=float, default=None,
                    help="the budget at which needles run, one of --budgets (default: the smallest)")
    ap.add_argument("--needles", default="classic",
                    help="needle sets, comma-separated: classic (a 4-digit magic number), varied (other facts and "
                         "values), or a JSON file of your own as `pykvcache eval --needles` takes")
    ap.add_argument("--needle-seeds", default=str(EvalConfig.seed),
                    help="seeds of the needles' values (and the varied set's places), comma-separated: each gives a fact "
                         "per depth and length in the same haystack positions")
    ap.add_argument("--n-gen", type=int, default=32, help="greedy tokens timed after the streamed text")
    ap.add_argument("--attn-queries", type=int, default=32,
                    help="held-out queries (the first streamed tokens) for the attention output per layer")
    ap.add_argument("-t", "--threads", type=int, default=2, help="threads (default 2)")
    ap.add_argument("-f", "--file", default=None, help="the user's text instead of the essays")
    ap.add_argument("-o", "--output", default=None, help="write the results as JSON")
    a = ap.parse_args(argv)

    if a.n_gen < 1:
        ap.error("--n-gen must be >= 1")
    if not 1 <= a.attn_queries <= a.stream:
        ap.error("--attn-queries must be in [1, --stream]")
    try:  # every setting before the runs, which take minutes: the policies with their fate stage at every budget too
        check_output_path(a.output, "-o/--output")
        # the context holds the streamed text and the greedy tokens timed after it
        cfg = EvalConfig(policies=split_policies(a.policies), budgets=[float(x) for x in a.budgets.split(",")],
                         kl_tokens=a.kl_tokens, stream=a.stream,
                         needle_lengths=[int(x) for x in a.needle_lengths.split(",")],
                         threads=a.threads, text_file=a.file, n_agree=max(EvalConfig.n_agree, a.n_gen))
        cfg.validate()
        for name in cfg.policies:
            for frac in cfg.budgets:
                pol = parse_policy(policy_spec(name, int(round(frac * (cfg.kl_tokens - cfg.stream)))) + "+" + a.summarise)
                if pol.describe()["stages"].get("fate") != "summarise":
                    raise ValueError(f"--summarise takes the summarise stage with its keys (e.g. summarise:bin=32,rank=4), "
                                     f"got {a.summarise!r}")
        if a.needle_budget is None:
            a.needle_budget = min(cfg.budgets)
        elif not any(abs(f - a.needle_budget) < 1e-9 for f in cfg.budgets):
            raise ValueError(f"--needle-budget {a.needle_budget:g} is not one of --budgets ({a.budgets}): the needles run "
                             f"at one of them")
        kinds = a.needles.split(",")
        if any(k not in NEEDLE_SETS and not Path(k).is_file() for k in kinds) or len(set(kinds)) < len(kinds):
            raise ValueError(f"--needles takes classic, varied and/or JSON needle files, comma-separated, each once "
                             f"(got {a.needles!r})")
        for k in kinds:
            if k not in NEEDLE_SETS:
                load_needles(k)  # one line naming the file and the entry that is wrong
        try:
            seeds = [int(x) for x in a.needle_seeds.split(",")]
        except ValueError:
            raise ValueError(f"--needle-seeds takes integers, comma-separated (got {a.needle_seeds!r})") from None
        if len(set(seeds)) < len(seeds):
            raise ValueError(f"--needle-seeds: each seed once (got {a.needle_seeds!r})")
    except (ValueError, PolicyError) as exc:
        ap.error(str(exc))
    full = Runner(None, cfg)
    try:  # the texts, and what only the model can check of the specs (rank against the head size), before the runs
        tokens, hay = eval_texts(cfg, full.llm)
        # a needle file's facts do not depend on the seed: one seed each (others would repeat its cases)
        cases = [dict(c, kind=kind, seed=seed) for kind in kinds for seed in (seeds if kind in NEEDLE_SETS else seeds[:1])
                 for n in cfg.needle_lengths
                 for c in needle_cases(full.llm, hay, n, cfg.depths, seed, kind=kind)]
        for name in cfg.policies:
            for frac in cfg.budgets:
                Runner(policy_spec(name, int(round(frac * (cfg.kl_tokens - cfg.stream)))) + "+" + a.summarise,
                       cfg).close()
    except (ValueError, PolicyError) as exc:
        full.close()
        ap.error(str(exc))
    ref = stream_logprobs(full, tokens, cfg.stream, cfg.stream_chunk)
    t0 = time.perf_counter()
    full.greedy(a.n_gen)
    full_ms = 1e3 * (time.perf_counter() - t0) / a.n_gen
    full_used = cells_in_use(full.llm)
    full_hits = needle_hits(full, cases)
    full.close()
    held = held_out_outputs(cfg, tokens, len(tokens) - cfg.stream, a.attn_queries)
    rows: List[Dict[str, Any]] = [{"spec": "full", "kl_mean": 0.0, "top1": 1.0, "ms_per_token": full_ms,
                                   "needle_hits": full_hits, **full_used}]
    print(f"full: {full_ms:.1f} ms/token, needles {sum(full_hits)}/{len(full_hits)}", file=sys.stderr, flush=True)

    n_prefix = cfg.kl_tokens - cfg.stream
    for frac in cfg.budgets:
        for name in cfg.policies:
            b = int(round(frac * n_prefix))
            needles = abs(frac - a.needle_budget) < 1e-9

            def at(budget_frac: float, extra: str = "", minus_cells: float = 0.0) -> Any:
                # for an n-token needle prompt: the budget's share of it, less the KL prompt's centroid cells scaled to n
                return lambda n: (policy_spec(name, int(round(budget_frac * n - minus_cells * n / n_prefix))) or "") + extra

            drop = run(cfg, policy_spec(name, b), tokens, ref, a.n_gen, held)
            summ = run(cfg, policy_spec(name, b) + "+" + a.summarise, tokens, ref, a.n_gen, held)
            c = summ["centroids_per_layer"]
            b_fair = max(int(round(b - c)), 1)
            fair = run(cfg, policy_spec(name, b_fair), tokens, ref, a.n_gen, held)
            if needles:
                for row, spec_of in ((drop, at(frac)), (summ, at(frac, "+" + a.summarise)), (fair, at(frac, "", c))):
                    hits: List[Optional[bool]] = [None] * len(cases)  # in the cases' order, as the full cache's
                    for n in cfg.needle_lengths:
                        idx = [i for i, x in enumerate(cases) if x["length"] == n]
                        rn = Runner(spec_of(n), cfg)
                        for i, hit in zip(idx, needle_hits(rn, [cases[i] for i in idx])):
                            hits[i] = hit
                        rn.close()
                    row["needle_hits"] = hits
            for row, kind, budget in ((drop, "drop", b), (summ, "summarise", b), (fair, "drop, FAIR", b_fair)):
                row.update(policy=name, budget_frac=frac, budget=budget, kind=kind)
                rows.append(row)
                nh = row.get("needle_hits")
                print(f"{row['spec']} [{kind}]: KL {row['kl_mean']:.4f} top-1 {row['top1']:.3f} attention output "
                      f"rel. error {np.mean(row['attn_mse']):.3f} cosine {np.mean(row['attn_cos']):.3f}, "
                      f"{row['ms_per_token']:.1f} ms/token" + (f", needles {sum(nh)}/{len(nh)}" if nh else ""),
                      file=sys.stderr, flush=True)

    res = {"command": "python bench/summarise.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:])),
           "date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "threads": a.threads, "kl_tokens": cfg.kl_tokens,
           "stream": cfg.stream, "attn_queries": a.attn_queries, "needle_lengths": cfg.needle_lengths, "needles": kinds,
           "needle_seeds": seeds, "needle_cases": [{k: c[k] for k in ("kind", "seed", "length", "depth", "answer")} for c in cases],
           "rows": rows}
    print(markdown(res))
    if a.output:
        with open(a.output, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def markdown(res: Dict[str, Any]) -> str:
    """The results as a markdown table."""
    n_thr = res["threads"]
    lines = [f"{res['date']}, {res['cpu']}, {n_thr} thread{'s' if n_thr != 1 else ''}: `{res['command']}`", "",
             "| policy | budget | fate | KL mean | KL x drop | top-1 | attn err | attn cos | KV MiB used | centroids/layer | "
             "fit err | ms/bin | bins' host MiB | ms/token | ms x drop | needles |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    drop: Dict[Any, Dict[str, Any]] = {}
    for r in res["rows"]:
        if r["spec"] == "full":
            nh = r["needle_hits"]
            lines.append(f"| full | - | - | 0 | - | 1.000 | 0 | 1 | {used_mib(r)} | - | - | - | - | {r['ms_per_token']:.1f} | - "
                         f"| {sum(nh)}/{len(nh)} |")
            continue
        key = (r["policy"], r["budget_frac"])
        if r["kind"] == "drop":
            drop[key] = r
        d = drop[key]
        nh = r.get("needle_hits")
        summ = r["kind"] == "summarise"
        attn = (f"{np.mean(r['attn_mse']):.3f} | {np.mean(r['attn_cos']):.3f} | " if "attn_mse" in r else "- | - | ")
        attn += f"{used_mib(r)} | "
        lines.append(
            f"| {r['policy']} | {r['budget_frac']:g} ({r['budget']}) | {r['kind']} | {r['kl_mean']:.4f} | "
            f"{r['kl_mean'] / max(d['kl_mean'], 1e-12):.2f} | {r['top1']:.3f} | {attn}"
            f"{r['centroids_per_layer']:.1f} | {r['fit_err']:.2f} | {r['ms_per_bin']:.2f} | {host_mib(r)} | " if summ else
            f"| {r['policy']} | {r['budget_frac']:g} ({r['budget']}) | {r['kind']} | {r['kl_mean']:.4f} | "
            f"{r['kl_mean'] / max(d['kl_mean'], 1e-12):.2f} | {r['top1']:.3f} | {attn}- | - | - | - | ")
        lines[-1] += (f"{r['ms_per_token']:.1f} | {r['ms_per_token'] / d['ms_per_token']:.2f} | "
                      + (f"{sum(nh)}/{len(nh)} |" if nh else "- |"))
    lines += ["", "drop: eviction at the budget (tokens per layer); summarise: the same budget, its centroid cells inside "
              "it (equal KV bytes: REAL); drop, FAIR: eviction at the budget less summarise's centroid cells per layer "
              "(equal real tokens: FAIR). KL against the full cache on the same tokens; KL x drop and ms x drop: against "
              "the drop row of the same policy and budget (ms: time per generated token). KV MiB used: the cells in use "
              "after the timed tokens; bins' host MiB: summarise's pending bins, host memory beside the cache."]
    return "\n".join(lines + layers_markdown(res))


def used_mib(r: Dict[str, Any]) -> str:
    """The KV bytes of the cells in use at the end in MiB ('-' in results from before it was recorded)."""
    return f"{r['kv_bytes_used'] / 2**20:.2f}" if "kv_bytes_used" in r else "-"


def host_mib(r: Dict[str, Any]) -> str:
    """The pending bins' peak host memory in MiB ('-' in results from before it was recorded)."""
    return f"{r['host_bytes_peak'] / 2**20:.1f}" if "host_bytes_peak" in r else "-"


def layers_markdown(res: Dict[str, Any]) -> List[str]:
    """The attention output's relative error per layer (means over groups of layers), drop against summarise."""
    cols = [r for r in res["rows"] if r.get("kind") in ("drop", "summarise") and "attn_mse" in r]
    if not cols:
        return []
    n = len(cols[0]["attn_mse"])
    step = 5 if n > 10 else 1
    lines = ["", f"Attention output per layer: relative error against the full cache for {res.get('attn_queries')} "
             "held-out queries (mean over the layers of each row).", "",
             "| layers | " + " | ".join(f"{r['policy']} {r['budget_frac']:g} {r['kind']}" for r in cols) + " |",
             "|---|" + "---:|" * len(cols)]
    for l0 in range(0, n, step):
        l1 = min(l0 + step, n)
        lines.append(f"| {l0}-{l1 - 1} | " + " | ".join(f"{np.mean(r['attn_mse'][l0:l1]):.3f}" for r in cols) + " |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
