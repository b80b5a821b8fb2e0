"""The host tier and the soft freeze against the full cache, in one run.

(a) ASR-KF-EGR's setting: a long greedy generation from an open prompt. The full cache generates it; every policy is
then fed the same tokens one decode step at a time (teacher forcing, the work of a generation): active KV tokens and
bytes (mean over the steps and at the end), host-tier bytes, wall time against the full cache, streamed next-token
KL and top-1 against it, and the policy's own free greedy run (tokens equal to the full cache's).
(b) Passkeys (needles in the essays, or `-f`'s text) at `--needle-lengths`: the full cache, plain eviction at a 10%
budget, and the freeze preset.
(c) Needles whose question arrives in a second turn, after the document was compressed and a first answer generated
(the compression cannot know the question): each `--turn-policies` policy alone, with `+host+latent:gap=1` (re-ranked
at the question's first decode step), `+host+latent:gap=0` (re-ranked by the question itself, at its end) and
`+host+freeze:gap=0` (the soft freeze with the same re-ranking), against the full cache.
(d) With `--long N`: an N-token greedy generation under a bounded policy (`--long-policy`: a budget, the host tier
with a limit, the freeze): process RSS, active and host bytes every `--long-every` tokens; RSS must stay flat.

    python bench/freeze.py -n 500 -o docs/results/freeze.json
    python bench/freeze.py --skip-open --needle-lengths '' --long 20000 -o docs/results/freeze_turn.json  # (c), (d)
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

from pykvcache import Llama
from pykvcache._native import native
from pykvcache.checks import MAX_THREADS
from pykvcache.cli import check_output_path, read_text_file
from pykvcache.corpus import essays
from pykvcache.evaluate import answer_in, haystack_tokens, log_softmax, needle_cases, needle_text
from pykvcache.policies import PolicyError, parse_policy
from pykvcache.recovery import ladder_of

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sparse_prefill import cpu_name  # noqa: E402

PROMPT = ("Write a long, detailed story about a lighthouse keeper on a remote island who finds a message in a bottle. "
          "Describe the island, the storms, the people she writes to, and how the message changes her life.\n\n")


def make_llama(model: Optional[str], spec: Optional[str], n_ctx: int, threads: int) -> Llama:
    """A context for one policy, as every part of the benchmark makes it (flash attention, 512-token batches)."""
    kw: Dict[str, Any] = {"model_path": model} if model else {}
    return Llama(n_ctx=n_ctx, kv_policy=spec, n_batch=512, n_ubatch=512, n_threads=threads, n_threads_batch=threads,
                 flash_attn=True, verbose=False, **kw)


def logits(llm: Llama) -> np.ndarray:
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy()


def active_tokens(llm: Llama) -> int:
    """Tokens the layer caches hold now (for the full cache: tokens x layers)."""
    ffi, lib = native()
    info = ffi.new("struct llama_kvp_memory_info *")
    lib.llama_kvp_memory_info(llm._native_ctx(), info)
    return int(info.n_active) if info.per_layer else llm.n_tokens * len(llm.kv_stats().layers)


def open_generation(model: Optional[str], spec: Optional[str], n_ctx: int, threads: int, prompt: List[int],
                    ref: Optional[List[int]], n_gen: int) -> Dict[str, Any]:
    """Teacher-forced pass over ref (or a greedy run when ref is None): log-probs, active tokens per step, time."""
    llm = make_llama(model, spec, n_ctx, threads)
    t0 = time.perf_counter()
    llm.eval(prompt)
    t_prompt = time.perf_counter() - t0
    lp, active, toks = [], [], []
    ladder = ladder_of(llm)  # the freeze schedule's recovery ladder (levels 1-3 here: the tokens are given)
    t0 = time.perf_counter()
    for i in range(n_gen):
        x = logits(llm)
        lp.append(log_softmax(x).astype(np.float32))
        if ladder is not None:
            ladder.step()
        tok = int(np.argmax(x)) if ref is None else ref[i]
        toks.append(tok)
        llm.eval([tok])
        active.append(active_tokens(llm))
    t_gen = time.perf_counter() - t0
    stats = llm.kv_stats()
    per_tok = [(s.k_bytes + s.v_bytes) // max(s.n_cells, 1) for s in stats.layers]
    mem = llm.kv_memory()
    row: Dict[str, Any] = {
        "spec": llm.kv_policy.spec() if llm.kv_policy is not None else "none",
        "prompt_s": t_prompt, "gen_s": t_gen, "ms_per_token": 1e3 * t_gen / n_gen,
        "active_mean": float(np.mean(active)), "active_final": int(active[-1]),
        "tokens_final": llm.n_tokens * len(stats.layers),
        "active_bytes_final": int(active[-1] * np.mean(per_tok)),
        "allocated_bytes": int(mem.bytes), "host_bytes_final": int(mem.host_bytes),
        "host_bytes_peak": int(mem.host_bytes_peak),
        "active_trace": active,
    }
    if spec and "freeze" in row["spec"]:
        h = llm.kv_host()
        row.update(n_freeze=h.n_freeze, n_thaw=h.n_thaw, n_dropped=h.n_dropped, host_ms=h.t_ms,
                   n_recover=list(h.n_recover))
    llm.close()
    return {"row": row, "logprobs": lp, "tokens": toks}


def timed(model: Optional[str], spec: Optional[str], n_ctx: int, threads: int, prompt: List[int], ref: List[int]) -> float:
    """Seconds of the decode steps of a teacher-forced pass over ref (the work of a generation), nothing recorded."""
    llm = make_llama(model, spec, n_ctx, threads)
    llm.eval(prompt)
    ladder = ladder_of(llm)
    t0 = time.perf_counter()
    for tok in ref:
        logits(llm)
        if ladder is not None:
            ladder.step()
        llm.eval([tok])
    dt = time.perf_counter() - t0
    llm.close()
    return dt


def compare(ref: List[np.ndarray], got: List[np.ndarray]) -> Dict[str, float]:
    a = np.stack(ref).astype(np.float64)
    b = np.stack(got).astype(np.float64)
    kl = (np.exp(a) * (a - b)).sum(axis=-1)
    return {"kl_mean": float(max(kl.mean(), 0.0)), "kl_p95": float(max(np.percentile(kl, 95), 0.0)),
            "top1": float((a.argmax(-1) == b.argmax(-1)).mean())}


def greedy_answer(llm: Llama, n: int) -> str:
    """The text of n greedy tokens after what the context holds."""
    out = []
    for _ in range(n):
        tok = int(np.argmax(logits(llm)))
        out.append(tok)
        llm.eval([tok])
    return llm.detokenize(out).decode("utf-8", errors="replace")


def passkeys(model: Optional[str], spec: Optional[str], n_ctx: int, threads: int, cases: List[Dict[str, Any]]) -> Dict[str, Any]:
    llm = make_llama(model, spec, n_ctx, threads)
    hits, active = [], []
    for c in cases:
        llm.reset()
        llm._ctx.kv_cache_seq_rm(-1, 0, -1)
        llm.eval(c["tokens"])
        hits.append(answer_in(c["answer"], greedy_answer(llm, c["n_answer"])))
        active.append(active_tokens(llm) / (llm.n_tokens * len(llm.kv_stats().layers)))
    llm.close()
    return {"spec": spec or "none", "hits": hits, "n_hit": int(sum(hits)), "active_share": float(np.mean(active))}


def turn_cases(llm: Llama, hay: str, n_tokens: int, depths: List[float], seed: int) -> List[Dict[str, Any]]:
    """Documents of about n_tokens tokens with a fact at each depth, a first turn's instruction, the question."""
    import random
    rng = random.Random(seed + n_tokens)
    body_all = haystack_tokens(llm, hay)
    first = llm.tokenize(b"\n\nSummarise the text above in one sentence.\n", add_bos=False)
    cases = []
    for i, depth in enumerate(depths):
        fact, ask, answer = needle_text("classic", i, n_tokens, rng)
        needle = llm.tokenize(fact.encode(), add_bos=False)
        body = body_all[:n_tokens - 1 - len(needle) - len(first)]
        k = int(depth * len(body))
        while 0 < k < len(body) and not llm.detokenize([body[k - 1]]).endswith(b"."):
            k += 1
        cases.append({"doc": [llm.token_bos()] + body[:k] + needle + body[k:] + first, "depth": depth,
                      "question": llm.tokenize(ask.encode(), add_bos=False), "answer": answer})
    return cases


def second_turn(model: Optional[str], spec: Optional[str], n_ctx: int, threads: int, cases: List[Dict[str, Any]],
                n_first: int = 8) -> Dict[str, Any]:
    llm = make_llama(model, spec, n_ctx, threads)
    hits, promoted = [], []
    for c in cases:
        llm.reset()
        llm._ctx.kv_cache_seq_rm(-1, 0, -1)
        llm.eval(c["doc"])
        for _ in range(n_first):  # the first turn's answer
            llm.eval([int(np.argmax(logits(llm)))])
        llm.eval(c["question"])
        hits.append(answer_in(c["answer"], greedy_answer(llm, 6)))
        if spec and "+host" in llm.kv_policy.spec():
            promoted.append(llm.kv_host().n_promote)
    llm.close()
    return {"spec": spec or "none", "hits": hits, "n_hit": int(sum(hits)),
            "promoted": promoted}


def rss_mib() -> float:
    """Resident set size of this process now (MiB, Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def long_generation(model: Optional[str], spec: str, threads: int, prompt: List[int], n_gen: int,
                    every: int) -> Dict[str, Any]:
    """n_gen greedy tokens under spec: RSS, active and host bytes every `every` tokens."""
    llm = make_llama(model, spec, len(prompt) + n_gen + 64, threads)
    llm.eval(prompt)
    samples = []
    t0 = time.perf_counter()
    for i in range(1, n_gen + 1):
        llm.eval([int(np.argmax(logits(llm)))])
        if i % every == 0 or i == n_gen:
            mem = llm.kv_memory()
            samples.append({"step": i, "rss_mib": rss_mib(), "kv_bytes": int(mem.bytes),
                            "active": active_tokens(llm), "host_bytes": int(mem.host_bytes), "s": time.perf_counter() - t0})
            print(f"(d) {i}/{n_gen}: RSS {samples[-1]['rss_mib']:.0f} MiB, active {samples[-1]['active']} token-layers, "
                  f"host {samples[-1]['host_bytes'] / 2**20:.1f} MiB, {samples[-1]['s']:.0f} s", file=sys.stderr)
    h = llm.kv_host()
    row = {"spec": llm.kv_policy.spec(), "n_gen": n_gen, "samples": samples,
           "kv_bytes_peak": int(llm.kv_memory().bytes_peak), "host_bytes_peak": int(h.host_bytes_peak),
           "n_freeze": h.n_freeze, "n_thaw": h.n_thaw, "n_evict": h.n_evict, "n_dropped": h.n_dropped}
    llm.close()
    # growth after the host tier has filled: from the sample at a quarter of the run to the last
    q = samples[len(samples) // 4]
    row["rss_growth_mib"] = samples[-1]["rss_mib"] - q["rss_mib"]
    row["rss_growth_from_step"] = q["step"]
    return row


def plot_active(res: Dict[str, Any], path: Path) -> Path:
    """Active KV tokens (all layers) at each step of (a)'s generation, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for r in res["open"]:
        ax.plot(np.arange(1, len(r["active_trace"]) + 1), r["active_trace"], label=r["spec"].replace(",chunk=128", "").replace(",limit=0", ""))
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("active KV tokens (all layers)")
    ax.set_title(f"active KV tokens over a {res['n_gen']}-token generation ({res['cpu']}, {res['threads']} threads)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown(res: Dict[str, Any]) -> str:
    """The three tables of a run."""
    out = []
    if res.get("open"):
        out += [f"(a) {res['n_gen']} tokens generated after an open prompt (ASR-KF-EGR's setting); time: median of "
                f"{len(res['open'][0].get('gen_s_runs', [])) or 1} interleaved passes.", "",
                "| policy | active tokens (mean) | fewer active | active final | active MiB (mean / final) | host MiB (peak) | s | x full | KL | top-1 | first greedy divergence |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in res["open"]:
            per_tok = r["active_bytes_final"] / max(r["active_final"], 1) / 2**20
            out.append(f"| `{r['spec']}` | {r['active_mean']:.0f} | {100 * r['active_cut']:.0f}% | {r['active_final']} | "
                       f"{r['active_mean'] * per_tok:.2f} / {r['active_final'] * per_tok:.2f} | "
                       f"{r['host_bytes_peak'] / 2**20:.2f} | {r.get('gen_s_median', r['gen_s']):.2f} | {r.get('x_time', 1.0):.2f} | "
                       f"{r['kl_mean']:.4f} | {r['top1']:.3f} | {r.get('greedy_prefix', res['n_gen'])} |")
        out.append("")
    if res.get("passkey"):
        out += [f"(b) Passkeys ({res.get('text', 'essays')}, 5 depths), 10% active budget for the retention policies; "
                "active share: the layers' active tokens over all tokens after the answer.", "",
                "| prompt | policy | found | active share |", "|---:|---|---:|---:|"]
        for r in res["passkey"]:
            out.append(f"| {r['length']} | `{r['spec']}` | {r['n_hit']}/{len(r['hits'])} | {r['active_share']:.2f} |")
        out.append("")
    if res.get("turn"):
        out += ["(c) The question in a second turn: the document (10% budget), 8 tokens of a first answer, then the "
                "question; `+host+latent:gap=1` re-ranks active and host tokens at the question's first decode step, "
                "`gap=0` at the question's end (then its tokens are evaluated again); `+host+freeze:gap=0` adds the "
                "soft freeze to the same re-ranking.", "",
                "| document | policy | found | host tokens brought back (running total over the cases, all layers) |", "|---:|---|---:|---|"]
        for r in res["turn"]:
            out.append(f"| {r['length']} | `{r['spec']}` | {r['n_hit']}/{len(r['hits'])} | "
                       f"{', '.join(str(x) for x in r['promoted']) or '-'} |")
        out.append("")
    if res.get("long"):
        r = res["long"]
        rss = ", ".join(f"{x['rss_mib']:.0f}" for x in r["samples"])
        out += [f"(d) A {r['n_gen']}-token greedy generation, `{r['spec']}`: RSS {r['samples'][0]['rss_mib']:.0f} MiB at "
                f"step {r['samples'][0]['step']}, {r['samples'][-1]['rss_mib']:.0f} MiB at the end (growth from step "
                f"{r['rss_growth_from_step']}: {r['rss_growth_mib']:+.1f} MiB); cache peak {r['kv_bytes_peak'] / 2**20:.1f} MiB, "
                f"host peak {r['host_bytes_peak'] / 2**20:.1f} MiB; {r['n_freeze']} frozen, {r['n_evict']} evicted to host, "
                f"{r['n_thaw']} thawed, {r['n_dropped']} dropped for good (token-layers). RSS (MiB) every "
                f"{r['samples'][0]['step']} steps: {rss}.", ""]
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None, help="GGUF model (default: the embedded SmolLM2)")
    ap.add_argument("-n", "--n-gen", type=int, default=500, help="tokens generated in (a)")
    ap.add_argument("--policy", action="append", default=None,
                    help="policy spec for (a), repeatable (default: freeze and h2o:budget=<context> without freeze)")
    ap.add_argument("--needle-lengths", default="1536,4096", help="passkey prompt lengths, comma-separated ('' skips b)")
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9", help="needle depths of (b), comma-separated")
    ap.add_argument("--turn-lengths", default="1536,4096", help="second-turn needle document lengths ('' skips c)")
    ap.add_argument("--turn-policies", default="snapkv:budget=0.1,entropy:budget=0.1",
                    help="retention policies of (c), each also run with +host+latent:gap=1, gap=0 and +host+freeze:gap=0")
    ap.add_argument("--skip-open", action="store_true", help="skip (a)")
    ap.add_argument("--long", type=int, default=0, help="tokens of (d)'s long generation (0: skip d)")
    ap.add_argument("--long-policy", default="h2o:budget=2048+host:limit=2048+freeze",
                    help="the bounded policy of (d): a budget, a host limit, the freeze")
    ap.add_argument("--long-every", type=int, default=1000, help="tokens between (d)'s samples")
    ap.add_argument("-r", "--reps", type=int, default=3, help="timed passes per policy, interleaved (median)")
    ap.add_argument("-f", "--file", default=None, help="UTF-8 text of the needles' haystack in (b) and (c) (default: the "
                                                       "essays)")
    ap.add_argument("-t", "--threads", type=int, default=None, help="threads (default: all cores)")
    ap.add_argument("-o", "--output", default=None, help="JSON results")
    ap.add_argument("--plot", default=None, help="PNG of the active tokens over (a)'s generation, one line per policy")
    args = ap.parse_args(argv)
    import os
    threads = args.threads or os.cpu_count() or 2
    if args.n_gen < 1 or args.reps < 1 or args.long < 0 or args.long_every < 1:
        ap.error("-n, -r and --long-every must be >= 1, --long >= 0")
    if not 1 <= threads <= MAX_THREADS:
        ap.error(f"-t must be 1 to {MAX_THREADS} (got {threads})")
    try:  # before the runs, which take minutes
        check_output_path(args.output, "-o/--output")
        check_output_path(args.plot, "--plot", (".png",))
        for spec in (args.policy or []) + [args.long_policy] + [
                pol + more for pol in args.turn_policies.split(",") for more in ("", "+host+latent:gap=0")]:
            parse_policy(spec)
        for x in [args.needle_lengths, args.turn_lengths]:
            if any(int(n) < 128 for n in x.split(",") if n.strip()):
                raise ValueError(f"needle and turn lengths must be >= 128 tokens (got {x})")
        if any(not 0.0 <= float(d) <= 1.0 for d in args.depths.split(",")):
            raise ValueError(f"--depths are in [0, 1] (got {args.depths})")
        hay = read_text_file(args.file) if args.file else " ".join(essays())
    except (ValueError, PolicyError) as exc:
        ap.error(str(exc))

    res: Dict[str, Any] = {"command": "python bench/freeze.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
                           "cpu": cpu_name(), "threads": threads, "n_gen": args.n_gen, "text": args.file or "essays",
                           "open": [], "passkey": []}
    depths = [float(x) for x in args.depths.split(",")]
    tok_llm = Llama(n_ctx=64, verbose=False, **({"model_path": args.model} if args.model else {}))
    prompt = tok_llm.tokenize(PROMPT.encode())
    longest = max([int(x) for x in (args.needle_lengths + "," + args.turn_lengths).split(",") if x.strip()], default=0)
    n_hay = len(haystack_tokens(tok_llm, hay))
    tok_llm.close()
    if n_hay < longest:  # before (a), which takes minutes
        ap.error(f"-f/--file {args.file} has {n_hay} tokens with whitespace collapsed: the longest needle prompt needs "
                 f"{longest}")
    n_ctx = len(prompt) + args.n_gen + 64
    if not args.skip_open:
        print(f"(a) open generation: {len(prompt)}-token prompt, {args.n_gen} tokens, {res['cpu']}, {threads} threads",
              file=sys.stderr)
        full = open_generation(args.model, None, n_ctx, threads, prompt, None, args.n_gen)
        ref_lp, ref_tok = full["logprobs"], full["tokens"]
        full["row"].update(kl_mean=0.0, kl_p95=0.0, top1=1.0, active_cut=0.0, greedy_equal=args.n_gen)
        res["open"].append(full["row"])
        for spec in args.policy or ["freeze", f"h2o:budget={n_ctx}"]:
            run = open_generation(args.model, spec, n_ctx, threads, prompt, ref_tok, args.n_gen)
            row = run["row"]
            row.update(compare(ref_lp, run["logprobs"]))
            row["active_cut"] = 1.0 - row["active_mean"] / full["row"]["active_mean"]
            free = open_generation(args.model, spec, n_ctx, threads, prompt, None, args.n_gen)
            same = [a == b for a, b in zip(free["tokens"], ref_tok)]
            row["greedy_equal"] = int(sum(same))
            row["greedy_prefix"] = int(same.index(False)) if False in same else len(same)
            res["open"].append(row)
            print(f"  {row['spec']}: active -{100 * row['active_cut']:.0f}%, "
                  f"KL {row['kl_mean']:.4f}, top-1 {row['top1']:.3f}, greedy {row['greedy_equal']}/{args.n_gen} (first {row['greedy_prefix']} equal)",
                  file=sys.stderr)

        # wall time: interleaved passes of every policy, medians (this machine's noise is +-20% run to run)
        specs: List[Optional[str]] = [None] + list(args.policy or ["freeze", f"h2o:budget={n_ctx}"])
        times: Dict[int, List[float]] = {i: [] for i in range(len(specs))}
        for r in range(args.reps):
            for i, spec in enumerate(specs):
                times[i].append(timed(args.model, spec, n_ctx, threads, prompt, ref_tok))
        for i, row in enumerate(res["open"]):
            row["gen_s_runs"] = times[i]
            row["gen_s_median"] = float(np.median(times[i]))
            row["x_time"] = row["gen_s_median"] / float(np.median(times[0]))
            print(f"  {row['spec']}: median {row['gen_s_median']:.2f} s over {args.reps} passes, {row['x_time']:.2f}x the full cache",
                  file=sys.stderr)

    lengths = [int(x) for x in args.needle_lengths.split(",") if x.strip()]
    for n in lengths:
        nl = Llama(n_ctx=64, verbose=False, **({"model_path": args.model} if args.model else {}))
        cases = needle_cases(nl, hay, n, depths, seed=7)
        nl.close()
        b = max(1, int(round(0.1 * n)))
        for spec in (None, f"h2o:budget={b}", "freeze"):
            r = passkeys(args.model, spec, n + 64, threads, cases)
            r["length"] = n
            res["passkey"].append(r)
            print(f"(b) {n} tokens {r['spec']}: {r['n_hit']}/{len(cases)}, active share {r['active_share']:.2f}",
                  file=sys.stderr)

    res["turn"] = []
    for n in [int(x) for x in args.turn_lengths.split(",") if x.strip()]:
        nl = Llama(n_ctx=64, verbose=False, **({"model_path": args.model} if args.model else {}))
        cases = turn_cases(nl, hay, n, depths, seed=11)
        nl.close()
        specs = [None]
        for pol in args.turn_policies.split(","):
            specs += [pol, pol + "+host+latent:gap=1", pol + "+host+latent:gap=0", pol + "+host+freeze:gap=0"]
        for spec in specs:
            r = second_turn(args.model, spec, n + 128, threads, cases)
            r["length"] = n
            res["turn"].append(r)
            print(f"(c) {n} tokens {r['spec']}: {r['n_hit']}/{len(cases)}, promoted {r['promoted']}", file=sys.stderr)

    if args.long > 0:
        res["long"] = long_generation(args.model, args.long_policy, threads, prompt, args.long, args.long_every)
        r = res["long"]
        print(f"(d) RSS growth from step {r['rss_growth_from_step']} to {args.long}: {r['rss_growth_mib']:+.1f} MiB",
              file=sys.stderr)

    if args.plot and res["open"]:
        plot_active(res, Path(args.plot))

    text = json.dumps(res, indent=1)
    if args.output:
        Path(args.output).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
