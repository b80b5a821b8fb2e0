"""Sparse prefill against dense flash attention, in one run: prefill time, next-token KL and top-1 after the prompt
(and over the tokens that follow it, teacher-forced), density, needles over depths.

    python bench/sparse_prefill.py --lengths 4096,8192 --policies none+sparse --needle-lengths 4096 -o sparse.json

Speed with repetitions and sd comes from kvbench (`kvbench -p 8192 --policy full --policy none+sparse`); this
script measures quality on the same contexts and reports its own single-run prefill ratio.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from typing import Any, Dict, List, Optional

import numpy as np

from pykvcache import Llama
from pykvcache.checks import MAX_THREADS
from pykvcache.cli import check_output_path, read_text_file
from pykvcache.corpus import essays
from pykvcache.evaluate import answer_in, compare_logprobs, haystack_tokens, log_softmax, needle_cases
from pykvcache.policies import PolicyError, parse_policy

N_FOLLOW = 32  # tokens teacher-forced after the prompt (decoded dense: only the prefill differs)


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (else what platform knows)."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def make(spec: Optional[str], n_ctx: int, threads: int) -> Llama:
    return Llama(n_ctx=n_ctx, kv_policy=spec, n_batch=512, n_ubatch=512, n_threads=threads, n_threads_batch=threads,
                 flash_attn=True, verbose=False)


def run_prompt(spec: Optional[str], tokens: List[int], follow: List[int], threads: int) -> Dict[str, Any]:
    llm = make(spec, len(tokens) + len(follow) + 64, threads)
    t0 = time.perf_counter()
    llm.eval(tokens)
    dt = time.perf_counter() - t0
    first = log_softmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy())
    n_past = llm.n_tokens
    llm._batch.set_batch(batch=follow, n_past=n_past, logits_all=True)
    llm._ctx.decode(llm._batch)
    rest = log_softmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(len(follow), llm.n_vocab())).copy())
    res: Dict[str, Any] = {"seconds": dt, "logprobs": [first[None, :], rest]}
    if spec is not None:
        sp = llm.kv_sparse()
        res["density"] = sp.total_density
        res["dynamic_share"] = float(sp.dynamic[sp.n_ubatch > 0].mean()) if (sp.n_ubatch > 0).any() else 0.0
    llm.close()
    return res


def needles(spec: Optional[str], cases: List[Dict[str, Any]], threads: int) -> List[bool]:
    hits = []
    for c in cases:
        llm = make(spec, len(c["tokens"]) + 16, threads)
        llm.eval(c["tokens"])
        out = []
        for _ in range(c["n_answer"]):
            tok = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))
            out.append(tok)
            llm.eval([tok])
        hits.append(answer_in(c["answer"], llm.detokenize(out).decode("utf-8", errors="replace")))
        llm.close()
    return hits


def markdown(results: Dict[str, Any]) -> str:
    """The rows (prefill time, ratio, density, KL) as a markdown table, then the needle scores."""
    lines = ["| policy | prompt | prefill s | x dense | density | Dynamic heads | KL after prompt | top-1 | KL next 32 |"
             " top-1 next 32 |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results["rows"]:
        if r["policy"] == "dense":
            lines.append(f"| dense | {r['n_prompt']} | {r['seconds']:.1f} | 1.00 | 1.00 | - | - | - | - | - |")
        else:
            lines.append(f"| {r['policy']} | {r['n_prompt']} | {r['seconds']:.1f} | {r['x_dense']:.2f} | "
                         f"{r['density']:.2f} | {r['dynamic_share']:.2f} | {r['kl_after_prompt']:.4f} | "
                         f"{r['top1_after_prompt']:.0f} | {r['kl_follow']:.4f} | {r['top1_follow']:.2f} |")
    if results["needles"]:
        lines += ["", "| needles | prompt | hits |", "|---|---:|---:|"]
        lines += [f"| {r['policy']} | {r['n_prompt']} | {r['hits']}/{r['of']} |" for r in results["needles"]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="4096,8192", help="comma-separated prompt lengths (tokens)")
    ap.add_argument("--policies", default="none+sparse", help="'|'-separated sparse policies (specs)")
    ap.add_argument("--needle-lengths", default="4096", help="comma-separated needle prompt lengths ('' for none)")
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9", help="comma-separated needle depths")
    ap.add_argument("--seed", type=int, default=1234, help="seed of the needles' values (default: 1234)")
    ap.add_argument("--needles", choices=("classic", "varied"), default="classic",
                    help="needle kind, as in `pykvcache eval` (default: classic)")
    ap.add_argument("-f", "--file", default=None, help="UTF-8 text whose first tokens are the prompts and the needles' "
                                                       "haystack (default: the essays)")
    ap.add_argument("-t", "--threads", type=int, default=2, help="threads (default 2)")
    ap.add_argument("-o", "--output", default=None, help="JSON file for the results")
    args = ap.parse_args()

    specs = [s for s in args.policies.split("|") if s]
    try:  # before the runs, which take minutes
        check_output_path(args.output, "-o/--output")
        if not specs:
            raise ValueError("--policies: no policy given")
        for spec in specs:
            if not parse_policy(spec).sparse:
                raise ValueError(f"--policies {spec}: no sparse prefill stage (add +sparse)")
        if any(int(x) < 1 for x in args.lengths.split(",") if x):
            raise ValueError(f"--lengths must be >= 1 (got {args.lengths})")
        if any(int(x) < 128 for x in args.needle_lengths.split(",") if x):
            raise ValueError(f"--needle-lengths must be >= 128 tokens (got {args.needle_lengths})")
        if any(not 0.0 <= float(x) <= 1.0 for x in args.depths.split(",") if x):
            raise ValueError(f"--depths are in [0, 1] (got {args.depths})")
        if not 1 <= args.threads <= MAX_THREADS:
            raise ValueError(f"-t must be 1 to {MAX_THREADS} (got {args.threads})")
        text = read_text_file(args.file) if args.file else " ".join(essays())
    except (ValueError, PolicyError) as exc:
        ap.error(str(exc))
    tok = make(None, 256, args.threads)
    all_tokens = tok.tokenize(text.encode())
    longest = max([int(x) for x in args.lengths.split(",") if x], default=0) + N_FOLLOW
    if len(all_tokens) < longest:
        ap.error(f"-f/--file {args.file} has {len(all_tokens)} tokens: the longest prompt and the {N_FOLLOW} tokens "
                 f"after it need {longest}")
    longest = max([int(x) for x in args.needle_lengths.split(",") if x], default=0)
    n_hay = len(haystack_tokens(tok, text))
    if n_hay < longest:
        ap.error(f"-f/--file {args.file} has {n_hay} tokens with whitespace collapsed: the longest needle prompt needs "
                 f"{longest}")
    results: Dict[str, Any] = {"cpu": cpu_name(), "threads": args.threads, "command": shlex.join(sys.argv[1:]),
                               "text": args.file or "essays",
                               "date": time.strftime("%Y-%m-%d"), "rows": [], "needles": []}
    for n in [int(x) for x in args.lengths.split(",") if x]:
        tokens, follow = all_tokens[:n], all_tokens[n:n + N_FOLLOW]
        print(f"sparse_prefill: {n} tokens, dense", flush=True)
        ref = run_prompt(None, tokens, follow, args.threads)
        results["rows"].append({"policy": "dense", "n_prompt": n, "seconds": ref["seconds"], "x_dense": 1.0})
        for spec in specs:
            print(f"sparse_prefill: {n} tokens, {spec}", flush=True)
            got = run_prompt(spec, tokens, follow, args.threads)
            after = compare_logprobs(ref["logprobs"][:1], got["logprobs"][:1])
            follow_q = compare_logprobs(ref["logprobs"][1:], got["logprobs"][1:])
            results["rows"].append({
                "policy": spec, "n_prompt": n, "seconds": got["seconds"], "x_dense": ref["seconds"] / got["seconds"],
                "density": got["density"], "dynamic_share": got["dynamic_share"], "kl_after_prompt": after["kl_mean"],
                "top1_after_prompt": after["top1"], "kl_follow": follow_q["kl_mean"], "top1_follow": follow_q["top1"]})
            print("  " + json.dumps(results["rows"][-1]), flush=True)
    depths = [float(x) for x in args.depths.split(",") if x]
    for n in [int(x) for x in args.needle_lengths.split(",") if x]:
        cases = needle_cases(tok, text, n, depths, seed=args.seed, kind=args.needles)
        for spec in [None] + specs:
            print(f"sparse_prefill: needles {n} tokens, {spec or 'dense'}", flush=True)
            hits = needles(spec, cases, args.threads)
            results["needles"].append({"policy": spec or "dense", "n_prompt": n, "hits": sum(hits), "of": len(hits),
                                       "hit_list": [bool(h) for h in hits]})
    tok.close()

    print(markdown(results))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
