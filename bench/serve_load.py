"""A bounded load run of `pykvcache serve`: N concurrent streaming clients (the `openai` package) for a fixed time,
reporting throughput, latency, KV memory and errors.

    python bench/serve_load.py                                   # 4 clients, 60 s, entropy:budget=256
    python bench/serve_load.py -c 8 -d 120 --kv-policy snapkv:budget=512 --kv-policy none
    python bench/serve_load.py -c 4 --n-parallel 1,4              # requests one at a time, then 4 at once

The server is started on 127.0.0.1 for each (policy, n_parallel) and stopped after its run. With n_parallel 1
requests queue on it (`--interrupt_requests false`); with N > 1 up to N are served at once, each in a sequence of
its own (the server's n_ctx is N times --n-ctx, so every sequence has --n-ctx positions).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from make_results import machine

PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle works.",
           "List five uses of a paperclip.", "Describe a rainy afternoon in a city.",
           "What makes a good friend? Answer in a paragraph.", "Summarise the water cycle."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(policy, n_ctx, threads, n_parallel=1):
    port = free_port()
    args = [sys.executable, "-m", "pykvcache.server", "--host", "127.0.0.1", "--port", str(port), "--n_ctx",
            str(n_ctx * n_parallel), "--interrupt_requests", "false", "--n_threads", str(threads), "--n_threads_batch", str(threads),
            "--n_parallel", str(n_parallel)]
    if policy != "none":
        args += ["--kv-policy", policy]
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(args, cwd="/", stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"the server exited:\n{log.read().decode()[-2000:]}")
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=2)
            return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not start")


def run(policy, clients, duration, max_tokens, n_ctx, threads, n_parallel=1):
    """One load run against a fresh server; returns its figures."""
    import openai

    proc, url = start_server(policy, n_ctx, threads, n_parallel)
    # one request before the timed window: the first one pays the server's and the client's warm-up (seconds)
    openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hello"}], max_tokens=4)
    errors, tokens, latencies, first = [], [], [], []
    lock = threading.Lock()
    end = time.time() + duration

    def worker(i):
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        k = i
        while time.time() < end:
            msgs = [{"role": "user", "content": PROMPTS[k % len(PROMPTS)]}]
            k += clients
            t0 = time.time()
            t_first, n = None, 0
            try:
                for ch in c.chat.completions.create(model="m", messages=msgs, max_tokens=max_tokens, stream=True,
                                                    temperature=0.7, seed=k):
                    if ch.choices and ch.choices[0].delta.content:
                        n += 1
                        t_first = t_first or time.time()
            except Exception as exc:  # noqa: BLE001 - every failure is reported
                with lock:
                    errors.append(repr(exc)[:200])
                continue
            with lock:
                tokens.append(n)
                latencies.append(time.time() - t0)
                if t_first:
                    first.append(t_first - t0)

    t_start = time.time()
    threads_ = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads_:
        t.start()
    for t in threads_:
        t.join()
    wall = time.time() - t_start
    stats = json.load(urllib.request.urlopen(url + "/v1/kv/stats", timeout=60))["data"][0]
    proc.terminate()
    proc.wait(timeout=30)
    return {
        "policy": policy, "n_parallel": n_parallel, "clients": clients, "seconds": wall, "requests": len(tokens), "errors": len(errors),
        "error_samples": errors[:3], "tokens": sum(tokens), "tokens_per_s": sum(tokens) / wall,
        "latency_p50": statistics.median(latencies) if latencies else None,
        "first_token_p50": statistics.median(first) if first else None,
        "kv_bytes": stats["kv_bytes"], "kv_bytes_peak": stats.get("kv_bytes_peak", stats["kv_bytes"]),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-policy", action="append", help="policy to serve (repeatable; 'none': the full cache); "
                    "default: entropy:budget=256")
    ap.add_argument("-c", "--clients", type=int, default=4, help="concurrent streaming clients (default 4)")
    ap.add_argument("-d", "--duration", type=float, default=60, help="seconds of load per policy (default 60)")
    ap.add_argument("-n", "--max-tokens", type=int, default=64, help="tokens per answer (default 64)")
    ap.add_argument("--n-ctx", type=int, default=2048, help="context per sequence (default 2048)")
    ap.add_argument("--n-parallel", default="1", help="comma-separated sequences served at once (default 1)")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count(), help="server threads (default: all)")
    ap.add_argument("-o", "--output", choices=("md", "json"), default="md", help="output format (default: md)")
    args = ap.parse_args(argv)
    rows = []
    for pol in args.kv_policy or ["entropy:budget=256"]:
        for n_par in (int(x) for x in args.n_parallel.split(",")):
            print(f"serve_load: {pol}, n_parallel {n_par}, {args.clients} clients, {args.duration:.0f} s ...",
                  file=sys.stderr, flush=True)
            rows.append(run(pol, args.clients, args.duration, args.max_tokens, args.n_ctx, args.threads, n_par))
    if args.output == "json":
        print(json.dumps({"machine": machine(), "rows": rows}, indent=2))
        return 0
    print(f"machine: {machine()}; {args.clients} streaming clients, {args.duration:.0f} s per policy, "
          f"{args.max_tokens} tokens per answer\n")
    print("| policy | n_parallel | requests | errors | tokens/s | latency p50 s | first token p50 s | KV MiB (peak) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['policy']} | {r['n_parallel']} | {r['requests']} | {r['errors']} | {r['tokens_per_s']:.1f} | "
              f"{r['latency_p50'] or 0:.2f} | {r['first_token_p50'] or 0:.2f} | {r['kv_bytes_peak'] / 2**20:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
