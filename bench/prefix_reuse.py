"""What a follow-up call costs with each policy: llama-cpp-python reuses the cached prompt prefix; over a pruned cache
pykvcache keeps only the exact part of it (docs/ENGINE.md §7, prefix reuse) and evaluates the rest again.

    python bench/prefix_reuse.py                      # 2,048-token prompt, then the same prompt + 128 tokens
    python bench/prefix_reuse.py -p 4096 -e 256 -b 0.25 -o json

For every policy (and the full cache) one context answers the prompt, then the extended prompt; the second call's
evaluated tokens and time are reported against the full cache's, and its answer against a fresh context's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import pykvcache  # before llama_cpp
from pykvcache import Llama, corpus
from pykvcache.checks import MAX_THREADS
from pykvcache.policies import PolicyError, parse_policy

from make_results import machine


def run(policy, tokens_a, tokens_b, n_ctx, n_gen, threads):
    """Two calls on one context; returns (tokens evaluated by the second, its seconds, its answer)."""
    llm = Llama(n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False, kv_policy=policy)
    evaluated = []
    inner = llm.eval

    def ev(tokens):
        evaluated.append(len(tokens))
        inner(tokens)

    llm.eval = ev
    llm.create_completion(tokens_a, max_tokens=n_gen, temperature=0.0)
    evaluated.clear()
    t0 = time.perf_counter()
    out = llm.create_completion(tokens_b, max_tokens=n_gen, temperature=0.0)["choices"][0]["text"]
    dt = time.perf_counter() - t0
    llm.close()
    return evaluated[0] if evaluated else 0, dt, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-p", "--n-prompt", type=int, default=2048, help="tokens of the first prompt (default 2048)")
    ap.add_argument("-e", "--n-extend", type=int, default=128, help="tokens the second prompt adds (default 128)")
    ap.add_argument("-n", "--n-gen", type=int, default=8, help="tokens generated per call (default 8)")
    ap.add_argument("-b", "--budget", type=float, default=0.1, help="budget of the policies (default 0.1)")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count(), help="threads (default: all)")
    ap.add_argument("-o", "--output", choices=("md", "json"), default="md", help="output format (default: md)")
    args = ap.parse_args(argv)
    if args.n_prompt < 1 or args.n_extend < 0 or args.n_gen < 1:
        ap.error(f"-p and -n must be >= 1 and -e >= 0 (got {args.n_prompt}, {args.n_gen}, {args.n_extend})")
    if not 1 <= args.threads <= MAX_THREADS:
        ap.error(f"-t must be 1 to {MAX_THREADS} (got {args.threads})")
    b = args.budget
    policies = ["none", f"sink_recent:n_sink=4,n_recent={max(8, round(b * args.n_prompt) - 4)}", f"snapkv:budget={b:g}",
                f"h2o:budget={b:g}", f"pyramid:budget={b:g}", f"entropy:budget={b:g}"]
    for pol in policies:
        try:
            parse_policy(pol)
        except PolicyError as exc:
            ap.error(f"-b {b:g}: {exc}")

    text = corpus.essays()
    probe = Llama(n_ctx=64, verbose=False, vocab_only=True)
    toks = probe.tokenize(" ".join(text).encode())
    if len(toks) < args.n_prompt + args.n_extend:
        ap.error(f"the corpus has {len(toks)} tokens, fewer than {args.n_prompt + args.n_extend}")
    tokens_a = toks[: args.n_prompt]
    tokens_b = toks[: args.n_prompt + args.n_extend]
    n_ctx = args.n_prompt + args.n_extend + 2 * args.n_gen + 64

    rows = []
    for pol in policies:
        print(f"prefix_reuse: {pol} ...", file=sys.stderr, flush=True)
        n_eval, dt, out = run(pol, tokens_a, tokens_b, n_ctx, args.n_gen, args.threads)
        fresh = Llama(n_ctx=n_ctx, n_threads=args.threads, n_threads_batch=args.threads, verbose=False, kv_policy=pol)
        same = fresh.create_completion(tokens_b, max_tokens=args.n_gen, temperature=0.0)["choices"][0]["text"] == out
        fresh.close()
        rows.append({"policy": pol, "evaluated": n_eval, "seconds": dt, "same_as_fresh": same})
    base = rows[0]["seconds"]
    for r in rows:
        r["x_full"] = r["seconds"] / base

    if args.output == "json":
        print(json.dumps({"machine": machine(), "n_prompt": args.n_prompt, "n_extend": args.n_extend,
                          "n_gen": args.n_gen, "threads": args.threads, "rows": rows}, indent=2))
        return 0
    print(f"machine: {machine()}; first prompt {args.n_prompt} tokens, second = first + {args.n_extend}, "
          f"{args.n_gen} generated per call, {args.threads} threads\n")
    print("| policy | second call: tokens evaluated | seconds | x full cache | answer = fresh context |")
    print("|---|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['evaluated']} | {r['seconds']:.2f} | {r['x_full']:.1f} | "
              f"{'yes' if r['same_as_fresh'] else 'NO'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
