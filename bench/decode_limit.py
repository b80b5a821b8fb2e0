"""Decode speed of retention policies against their physical limit, with the steps of every context interleaved.

    python bench/decode_limit.py [-m MODEL] [-p 8192] [-n 256] [-t 2] [--policies "snapkv:budget=0.1;entropy:budget=0.1"]

kvbench alternates the decode steps of each policy with those of its limit, but measures the policies one after the
other. Here every policy context gets the prompt (the essays' tokens), the limit context of each policy (the full
cache prefilled with as many tokens as the policy's mean layer budget) is prefilled too, and then decode step i runs
in every context in turn, with the same token: a slow moment costs all of them alike, so the rows compare too.
Prints per context the mean and median step time, tokens/s and `x limit` (its limit's mean step time over its own;
the median ratio beside it).
"""

from __future__ import annotations

import argparse
import time
from typing import Dict, List

import numpy as np

import pykvcache
from pykvcache import Llama, corpus
from pykvcache.checks import MAX_THREADS
from pykvcache.policies import PolicyError, parse_policy

import llama_cpp  # noqa: E402  (after pykvcache, which points it at the patched libllama)


def step(ctx, batch, tok: int, pos: int) -> float:
    """One single-token decode step; its wall time in seconds."""
    batch.n_tokens = 1
    batch.token[0] = tok
    batch.pos[0] = pos
    batch.n_seq_id[0] = 1
    batch.seq_id[0][0] = 0
    batch.logits[0] = 1
    t0 = time.perf_counter()
    if llama_cpp.llama_decode(ctx, batch) != 0:
        raise RuntimeError(f"llama_decode failed at position {pos}")
    llama_cpp.llama_synchronize(ctx)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None, help="GGUF model (default: the embedded SmolLM2)")
    ap.add_argument("-p", "--n-prompt", type=int, default=8192, help="prompt tokens of each policy (default: 8192)")
    ap.add_argument("-n", "--n-gen", type=int, default=256, help="decode steps, interleaved (default: 256)")
    ap.add_argument("-t", "--threads", type=int, default=2, help="CPU threads (default: 2)")
    ap.add_argument("--policies", default=None,
                    help="semicolon-separated policy specs (default: sink_recent with 10%% of -p, and snapkv, h2o, "
                         "pyramid and entropy at budget=0.1)")
    args = ap.parse_args()
    if args.n_prompt < 1 or args.n_gen < 1:
        ap.error(f"-p and -n must be >= 1 (got {args.n_prompt}, {args.n_gen})")
    if not 1 <= args.threads <= MAX_THREADS:
        ap.error(f"-t must be 1 to {MAX_THREADS} (got {args.threads})")
    if args.policies is None:  # sink_recent at the others' 10%: its 4 sinks and the rest recent
        args.policies = (f"sink_recent:n_sink=4,n_recent={max(round(0.1 * args.n_prompt) - 4, 1)};snapkv:budget=0.1;"
                         "h2o:budget=0.1;pyramid:budget=0.1;entropy:budget=0.1")
    specs = [s.strip() for s in args.policies.split(";") if s.strip()]
    if not specs:
        ap.error("--policies: no policy given")
    for spec in specs:
        try:
            parse_policy(spec)
        except PolicyError as exc:
            ap.error(f"--policies {spec}: {exc}")
    model = args.model or pykvcache.default_model_path()
    n_ctx = args.n_prompt + args.n_gen + 256

    def make(spec):
        return Llama(model, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=args.threads, n_threads_batch=args.threads, flash_attn=True,
                     verbose=False, kv_policy=spec)

    text = "\n\n".join(corpus.essays())
    ctxs: List[tuple] = []  # (label, llm, position of the first decode step, limit label)
    limits: Dict[int, Llama] = {}
    for spec in specs:
        llm = make(spec)
        tokens = llm.tokenize(text.encode())
        if len(tokens) < args.n_prompt + args.n_gen:
            raise SystemExit(f"the essays hold {len(tokens)} tokens, fewer than -p + -n")
        print(f"decode_limit: prefill {spec} ({args.n_prompt} tokens)", flush=True)
        llm.eval(tokens[: args.n_prompt])
        b = llm.kv_memory().budget
        if not b:  # a policy without a budget (the full cache, the freeze): no depth to compare with
            ctxs.append((spec, llm, args.n_prompt, None))
            continue
        if b not in limits:
            lim = make(None)
            lim.eval(tokens[:b])
            limits[b] = lim
        ctxs.append((spec, llm, args.n_prompt, f"limit:d={b}"))
    for b, lim in limits.items():
        ctxs.append((f"limit:d={b}", lim, b, None))

    batch = llama_cpp.llama_batch_init(1, 0, 1)
    times = np.zeros((len(ctxs), args.n_gen))
    try:
        for i in range(args.n_gen):
            tok = tokens[args.n_prompt + i]
            for j, (_, llm, pos0, _) in enumerate(ctxs):
                times[j, i] = step(llm._ctx.ctx, batch, tok, pos0 + i)
    finally:
        llama_cpp.llama_batch_free(batch)

    by_label = {c[0]: j for j, c in enumerate(ctxs)}
    print(f"\n{args.n_prompt} prompt tokens, {args.n_gen} decode steps interleaved, {args.threads} threads\n")
    print("| context | mean step ms | median step ms | decode t/s | x limit (mean) | x limit (median) |")
    print("|---|---:|---:|---:|---:|---:|")
    for j, (label, _, _, lim_label) in enumerate(ctxs):
        t = times[j]
        if lim_label is not None:
            tl = times[by_label[lim_label]]
            ratio = f"{tl.mean() / t.mean():.3f} | {np.median(tl) / np.median(t):.3f}"
        elif label.startswith("limit:"):
            ratio = "1.000 | 1.000"
        else:
            ratio = "- | -"
        print(f"| {label} | {1e3 * t.mean():.2f} | {1e3 * np.median(t):.2f} | {1 / t.mean():.1f} | {ratio} |")


if __name__ == "__main__":
    main()
