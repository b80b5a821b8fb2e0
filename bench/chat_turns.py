"""A long chat with each policy and reuse mode: time of the whole conversation and the KV memory it needed.

    python bench/chat_turns.py                 # 40 turns, budget 128 tokens per layer
    python bench/chat_turns.py -n 20 -b 256

Every configuration runs the same conversation (a fact, then small talk, then a question about the fact; greedy, 16
tokens per answer) on one context; the answers of the last question are printed beside.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import pykvcache  # noqa: F401  (before llama_cpp)
from pykvcache import Llama
from pykvcache.checks import MAX_THREADS
from pykvcache.policies import PolicyError, parse_policy

from make_results import machine

FACT = "Remember this: my locker code is 4817 and my cat is called Pixel."
SMALL_TALK = ["What colour is the sky?", "Name a fruit.", "What is 2 plus 3?", "Say hello in French.",
              "Name a planet.", "What do bees make?", "Name a big city.", "What is ice made of?",
              "Name a musical instrument.", "What season is cold?"]


def run(policy, reuse, n_turns, threads):
    """The conversation on one context: (seconds, tokens at the end, peak KV bytes, last answer)."""
    llm = Llama(n_ctx=4096, n_threads=threads, n_threads_batch=threads, verbose=False, kv_policy=policy,
                kv_reuse=reuse)
    msgs = []
    peak = 0
    t0 = time.perf_counter()
    turns = [FACT] + [SMALL_TALK[i % len(SMALL_TALK)] for i in range(n_turns - 2)] + ["What is my locker code?"]
    for q in turns:
        msgs.append({"role": "user", "content": q})
        r = llm.create_chat_completion(messages=msgs, max_tokens=16, temperature=0)
        msgs.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
        peak = max(peak, llm.kv_memory().bytes_peak if policy else llm.kv_stats().total_bytes)
    dt = time.perf_counter() - t0
    n = int(llm.n_tokens)
    llm.close()
    return dt, n, peak, msgs[-1]["content"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--turns", type=int, default=40, help="user turns (default 40)")
    ap.add_argument("-b", "--budget", type=int, default=128, help="tokens per layer of the policies (default 128)")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count(), help="threads (default: all)")
    args = ap.parse_args(argv)
    if args.turns < 2:
        ap.error(f"-n: the conversation has at least 2 turns, the fact and the question (got {args.turns})")
    if not 1 <= args.threads <= MAX_THREADS:
        ap.error(f"-t must be 1 to {MAX_THREADS} (got {args.threads})")
    b = args.budget
    configs = [(None, "exact")]
    for pol in (f"sink_recent:n_sink=4,n_recent={b - 4}", f"snapkv:budget={b}", f"entropy:budget={b}"):
        try:
            parse_policy(pol)
        except PolicyError as exc:
            ap.error(f"-b {b}: {exc}")
        configs += [(pol, "exact"), (pol, "continue")]
    print(f"machine: {machine()}; {args.turns} turns, {args.threads} threads\n")
    print("| policy | kv_reuse | seconds | x full | tokens | peak KV MiB | last answer |")
    print("|---|---|---:|---:|---:|---:|---|")
    base = None
    for pol, reuse in configs:
        print(f"chat_turns: {pol or 'none'} {reuse} ...", file=sys.stderr, flush=True)
        dt, n, peak, ans = run(pol, reuse, args.turns, args.threads)
        base = base or dt
        print(f"| {pol or 'none'} | {reuse if pol else '-'} | {dt:.1f} | {dt / base:.1f} | {n} | {peak / 2**20:.1f} | "
              f"{ans.strip()[:40]!r} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
