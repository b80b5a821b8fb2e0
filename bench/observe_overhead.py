"""Overhead of attention observation against the full cache, measured in one run on the same tokens.

    python bench/observe_overhead.py [-m MODEL] [-c 4096] [--prompt-tokens 1024] [-n 64] [-r 3] [--policies "none;observe"]

Prints prefill and decode tokens/s per policy and the ratio to the full cache (mean of the repetitions).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import pykvcache
from pykvcache import Llama

TEXT = (
    "The history of astronomy spans thousands of years, from the first star charts carved in bone to the space "
    "telescopes that now image galaxies at the edge of the observable universe. "
)


def last_logits(llm) -> np.ndarray:
    """Logits of the last evaluated token."""
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))


def run(model, policy, n_ctx, prompt, n_gen, reps, flash_attn):
    llm = Llama(model, n_ctx=n_ctx, n_batch=512, n_ubatch=512, verbose=False, kv_policy=policy, flash_attn=flash_attn)
    pp, tg = [], []
    for _ in range(reps):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        tok = int(np.argmax(last_logits(llm)))
        for _ in range(n_gen):
            llm.eval([tok])
            tok = int(np.argmax(last_logits(llm)))
        t2 = time.perf_counter()
        pp.append(len(prompt) / (t1 - t0))
        tg.append(n_gen / (t2 - t1))
    return statistics.mean(pp), statistics.stdev(pp) if reps > 1 else 0.0, statistics.mean(tg), \
        statistics.stdev(tg) if reps > 1 else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None, help="GGUF model (default: the embedded SmolLM2-135M)")
    ap.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size (default 4096)")
    ap.add_argument("--prompt-tokens", type=int, default=1024,
                    help="prompt tokens before the timed decode (default 1024)")
    ap.add_argument("-n", "--n-gen", type=int, default=64, help="tokens decoded per repetition (default 64)")
    ap.add_argument("-r", "--reps", type=int, default=3, help="repetitions per policy (default 3)")
    ap.add_argument("-fa", "--flash-attn", choices=["on", "off"], default="on", help="flash attention (default: on)")
    ap.add_argument("--policies", default="none;observe:window=32;observe:window=32,every=1",
                    help="semicolon-separated policy specs; the first is the baseline of the ratios")
    args = ap.parse_args()
    model = args.model or pykvcache.default_model_path()
    specs = [s.strip() for s in args.policies.split(";") if s.strip()]
    probe = Llama(model, n_ctx=args.ctx_size, verbose=False)
    prompt = (probe.tokenize(TEXT.encode()) * (args.prompt_tokens // 30 + 2))[: args.prompt_tokens]
    del probe
    base = None
    print("| policy | prefill tok/s | decode tok/s | prefill ratio | decode ratio |")
    print("|---|---|---|---|---|")
    for spec in specs:
        pp, pp_sd, tg, tg_sd = run(model, spec, args.ctx_size, prompt, args.n_gen, args.reps, args.flash_attn == "on")
        if base is None:
            base = (pp, tg)
        print(f"| {spec} | {pp:.1f} ± {pp_sd:.1f} | {tg:.1f} ± {tg_sd:.1f} | {pp / base[0]:.3f} | {tg / base[1]:.3f} |",
              flush=True)


if __name__ == "__main__":
    main()
