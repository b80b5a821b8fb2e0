"""`pykvcache serve`: llama-cpp-python's OpenAI-compatible server running pykvcache's `Llama` with a KV policy.

Everything of `python -m llama_cpp.server` works as there (its flags, its config file, chat and text completions,
streaming, chat templates); added are `--kv-policy SPEC` (and a `kv_policy` key per model in the config file) and
`GET /v1/kv/stats`, the KV memory and a telemetry summary of the loaded model, and `--n_parallel N`: N requests
served at once, each in a sequence of its own (n_ctx/N positions, the policy's caches and budgets per sequence).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import threading
from typing import Any, AsyncIterator, Dict, List, Literal, Optional

from . import _native  # noqa: F401  (before llama_cpp: points it at the patched libllama)
from .cache_types import CACHE_TYPES, cache_type_id, cache_type_name, is_quantized
from .llama import Llama, default_model_path
from .policies import PolicyError, as_policy
from .rpc import RPCError
from .stages import server_stats as stage_server_stats, server_stats_total

try:
    import llama_cpp
    import llama_cpp.server.app as server_app
    import anyio
    import uvicorn
    from fastapi import Depends
    from llama_cpp.server.cli import add_args_from_model, parse_model_from_args
    from llama_cpp.server.model import LlamaProxy
    from llama_cpp.server.settings import ModelSettings, ServerSettings
    from pydantic import Field, ValidationError, field_validator, model_validator
    from . import server_errors
    from .server_errors import REQUEST_BODY, JSONBodyGuard, install_error_mapping
except ImportError as exc:  # pragma: no cover - depends on the extra
    raise ImportError(f"pykvcache serve needs the server extra: pip install 'pykvcache[server]' ({exc})") from exc


class KVModelSettings(ModelSettings):
    """llama-cpp-python's model settings plus the KV policy (the model defaults to the embedded SmolLM2)."""

    model: str = Field(default_factory=default_model_path, description="Path to the GGUF model (default: the "
                       "embedded SmolLM2-135M-Instruct Q4_1).")
    kv_policy: Optional[str] = Field(default=None, description="KV-cache policy spec, e.g. 'entropy:budget=512' or "
                                     "'snapkv:budget=512+entropy' (default: llama.cpp's own cache; also "
                                     "--kv-policy); `pykvcache policies` lists them. A budget in tokens keeps every "
                                     "request's cache the same size; a fraction is of each request's prompt (with "
                                     "--kv_reuse continue, of the prompt that filled the cache first: the cache is "
                                     "not emptied between requests, so give long chats a budget in tokens). A "
                                     "+sparse policy turns flash attention on unless --flash_attn is given.")

    kv_reuse: Literal["exact", "continue"] = Field(default="exact", description="What a new request keeps of a "
                                                   "cache the policy pruned: 'exact' (the result of a fresh evaluation; "
                                                   "re-evaluates) or 'continue' (the common prefix as the policy left "
                                                   "it; cheaper for long chats; a fractional budget stays that of "
                                                   "the first prompt).")

    n_parallel: int = Field(default=1, ge=1, le=64, description="Requests served at once, each in a sequence of its "
                            "own with n_ctx/n_parallel positions, rounded up to a multiple of 256 by llama.cpp (and, "
                            "with a policy, caches and budgets of its own); llama-server's --parallel. 1: one request "
                            "at a time, as llama-cpp-python's server (a new request cuts a running stream short "
                            "unless --interrupt_requests false).")

    @field_validator("kv_policy")
    @classmethod
    def _check_policy(cls, v: Optional[str]) -> Optional[str]:
        return None if v is None or v.strip().lower() in ("", "none", "full") else as_policy(v).spec()

    @field_validator("type_k", "type_v", mode="before")
    @classmethod
    def _cache_type_by_name(cls, v: Any) -> Any:
        # llama.cpp's names (q8_0) beside llama-cpp-python's ggml type ids (8), on the command line and in config files
        return v if v is None else cache_type_id(v)

    @model_validator(mode="after")
    def _check_cache_types(self) -> "KVModelSettings":
        # at startup, in the server's own words, for every model of a config file (not at a request that loads it)
        if self.kv_policy is not None and as_policy(self.kv_policy).sparse and "flash_attn" not in self.model_fields_set:
            # sparse prefill runs in place of flash attention: on unless asked off, as a Llama given no flash_attn
            # (llama-cpp-python's server passes its default, False; found by an audit: prompts ran dense)
            self.flash_attn = True
        if self.type_v in CACHE_TYPES.values() and is_quantized(self.type_v) and not self.flash_attn:
            raise ValueError(f"type_v {self.type_v} ({cache_type_name(self.type_v)}): a quantized V cache needs "
                             "flash attention (--flash_attn true, or flash_attn: true in a config file; llama.cpp's "
                             "rule)")
        return self


class KVSettings(ServerSettings, KVModelSettings):
    """Server and model settings of `pykvcache serve`."""


class KVConfigFileSettings(ServerSettings):
    """The config file of `pykvcache serve`: llama-cpp-python's, with `kv_policy` accepted per model."""

    models: List[KVModelSettings] = Field(default=[], description="Model configs")


class KVLlamaProxy(LlamaProxy):
    """llama-cpp-python's model proxy, loading pykvcache's `Llama` with each model's policy."""

    @staticmethod
    def load_llama_from_model_settings(settings: ModelSettings) -> llama_cpp.Llama:
        """Load one model as llama-cpp-python's server does, as a pykvcache `Llama` with the model's policy."""
        if settings.hf_model_repo_id is not None:
            raise ValueError("pykvcache serve loads local GGUF files: hf_model_repo_id is not supported")
        saved = llama_cpp.Llama
        llama_cpp.Llama = functools.partial(Llama, kv_policy=getattr(settings, "kv_policy", None),
                                            kv_reuse=getattr(settings, "kv_reuse", "exact"),
                                            n_seq_max=getattr(settings, "n_parallel", 1))
        try:
            llama = LlamaProxy.load_llama_from_model_settings(settings)
        finally:
            llama_cpp.Llama = saved
        from .parallel import Turns

        # each call, and each step of a stream, takes the context's turn: /v1/kv/stats reads between two steps
        llama._exclusive.turns = Turns()
        return llama


def kv_stats_of(llama: Llama) -> Dict[str, Any]:
    """KV memory (now, peak, per layer) and a telemetry summary of one loaded model, as JSON-ready values."""
    pol = llama.kv_policy
    stats = llama.kv_stats()
    res: Dict[str, Any] = {
        "policy": pol.spec() if pol is not None else None,
        # the rule a new request follows: kv_reuse under a retention policy, always a fresh evaluation under sparse
        # prefill on llama.cpp's cache, llama-cpp-python's own prefix reuse (null) without either
        "kv_reuse": (llama._kv_reuse if pol is not None and pol.retains else
                     "exact" if pol is not None and pol.sparse else None),
        "n_ctx": llama.n_ctx(),
        "n_tokens": int(llama.n_tokens),
        "kv_bytes": stats.total_bytes,
        # on_device: the layer's cache is in the GPU's (or an RPC server's) memory, not the host's
        "layers": [s.row() for s in stats.layers],
    }
    if pol is not None and pol.retains:
        mem = llama.kv_memory()
        res["kv_bytes_peak"] = mem.bytes_peak
        res["budget"] = mem.budget
        res["n_evicted"] = mem.n_evicted
        # host memory beside the cache (not in kv_bytes): the host tier's tokens or summarise's pending bins
        res["host_bytes"] = mem.host_bytes
        res["host_bytes_peak"] = mem.host_bytes_peak
        res.update(stage_server_stats(llama))  # what a stage shows of its own state (host, summarise)
        for row, b in zip(res["layers"], mem.layers):
            row["budget"] = b.budget
            row["entropy"] = b.entropy
            row["n_evicted"] = b.n_evicted
    elif pol is not None and pol.sparse:
        res.update(stage_server_stats(llama))  # sparse prefill on llama.cpp's cache: its blocks (found by an audit)
    if pol is not None and pol.observes:
        tel = llama.kv_telemetry()
        ent = tel.entropy  # no head has an entropy before the first observation: null per layer (JSON has no NaN)
        per_layer = [float(x) for x in ent.mean(axis=1)] if ent.shape[1] else [None] * ent.shape[0]
        res["telemetry"] = {"n_obs": tel.n_obs, "window": tel.window, "entropy_per_layer": per_layer}
    return res


class ViewPool:
    """The sequence views of the loaded model: a request takes a free one for its duration (--n_parallel > 1)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.views: List[Any] = []
        self.free: List[Any] = []  # in the order they were given back
        self.last: Dict[int, str] = {}  # by view: the text of the last request it served
        self.llama: Optional[Llama] = None
        self._sem: Optional[anyio.Semaphore] = None
        self._load = threading.Lock()

    def _views_of(self, llama: Llama) -> None:
        from .parallel import sequence_views

        with self._load:
            if self.llama is not llama:
                self.llama = llama
                self.views = sequence_views(llama)
                self.free = list(self.views)

    async def take(self, proxy: LlamaProxy, text: str = "") -> "PoolProxy":
        """Wait for a free sequence: the best match for this request's text, else the one free the longest.

        The best match is the one whose last request's text this one's starts with the most (half of it at least: a
        chat's next turn finds its conversation). This is llama-server's choice of a slot by prompt similarity, then
        least recently used."""
        if self._sem is None:
            self._sem = anyio.Semaphore(self.n)
        await self._sem.acquire()
        try:
            self._views_of(proxy(None))

            def similarity(i: int) -> tuple:
                last = self.last.get(id(self.free[i]), "")
                n = _common_start(last, text)
                return (n if n > 0 and 2 * n >= len(last) else 0, -i)

            best = max(range(len(self.free)), key=similarity)
            view = self.free.pop(best)
            self.last[id(view)] = text
            return PoolProxy(proxy, self, view)
        except BaseException:
            self._sem.release()
            raise

    def give(self, view: Any) -> None:
        """The request on `view` is over."""
        self.free.append(view)
        assert self._sem is not None
        self._sem.release()


def _common_start(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def request_text(body: Any) -> str:
    """The text a completion or chat request starts from (its prompt, or its messages' contents in order)."""
    if not isinstance(body, dict):
        return ""
    if isinstance(body.get("prompt"), str):
        return body["prompt"]
    parts = []
    for m in body.get("messages") or []:
        if isinstance(m, dict):
            parts.append(f"{m.get('role', '')}\x00{m.get('content') if isinstance(m.get('content'), str) else ''}\x00")
    return "".join(parts)


class PoolProxy:
    """What a request sees as llama-cpp-python's model proxy: calling it gives the request's sequence view."""

    def __init__(self, proxy: LlamaProxy, pool: ViewPool, view: Any) -> None:
        self._proxy = proxy
        self._pool = pool
        self.view = view

    def __call__(self, model: Optional[str] = None) -> Any:
        return self.view

    def __iter__(self) -> Any:
        return iter(self._proxy)

    def __getitem__(self, model: str) -> Any:
        return self._proxy[model]


def use_view_pool(app: Any, n_parallel: int) -> ViewPool:
    """Serve each request on a sequence view of its own instead of under the server's one-request lock."""
    pool = ViewPool(n_parallel)
    upstream = server_app.get_llama_proxy

    async def get_llama_proxy() -> AsyncIterator[Any]:
        if server_app._llama_proxy is None:
            yield None
            return
        proxy = await pool.take(server_app._llama_proxy, request_text(REQUEST_BODY.get()))
        try:
            yield proxy
        finally:
            pool.give(proxy.view)

    # the routes call the module's function by name, the others reach it through Depends
    server_app.get_llama_proxy = get_llama_proxy
    app.dependency_overrides[upstream] = get_llama_proxy
    app.state.kv_pool = pool
    return pool


def add_kv_routes(app: Any) -> None:
    """Add `GET /v1/kv/stats` to a llama-cpp-python server app."""

    pool: Optional[ViewPool] = getattr(app.state, "kv_pool", None)
    if pool is not None:
        @app.get("/v1/kv/stats", summary="KV cache stats", tags=["pykvcache"],
                 dependencies=[Depends(server_app.authenticate)])
        async def kv_stats_parallel() -> Dict[str, Any]:
            return {"object": "list", "data": [await anyio.to_thread.run_sync(pool_stats, pool, server_app._llama_proxy)]}
        return

    # read between two steps of whatever runs (each call and stream step of a served Llama takes its context's turn),
    # not under llama-cpp-python's request lock: a waiter there tells a running stream to stop (a stats poll cut
    # streams short), and a queue of completions holds it for their whole length
    @app.get("/v1/kv/stats", summary="KV cache stats", tags=["pykvcache"],
             dependencies=[Depends(server_app.authenticate)])
    async def kv_stats() -> Dict[str, Any]:
        return {"object": "list", "data": await anyio.to_thread.run_sync(models_stats, server_app._llama_proxy)}


def models_stats(llama_proxy: Any) -> List[Dict[str, Any]]:
    """Each model's entry of /v1/kv/stats: the loaded one's KV stats, read in its context's turn."""
    models = []
    for alias in llama_proxy:
        llama = llama_proxy._current_model if alias == llama_proxy._current_model_alias else None
        entry: Dict[str, Any] = {"model": alias, "loaded": False}
        if llama is not None:
            turns, turn = llama._exclusive.turns, object()  # set by KVLlamaProxy on every model it loads
            turns.take(turn)  # no step of the context runs while this is held (close() waits for it too)
            try:
                # a request swapping the model may have closed it meanwhile (under the request lock, not this turn)
                if llama_proxy._current_model is llama and llama._ctx.ctx is not None:
                    entry.update(loaded=True, **kv_stats_of(llama))
            finally:
                turns.give(turn)
        if not entry["loaded"]:
            entry["policy"] = llama_proxy[alias].get("kv_policy")
        models.append(entry)
    return models


def pool_stats(pool: ViewPool, llama_proxy: Any) -> Dict[str, Any]:
    """The KV stats of the model the pool serves, with each sequence's budget and cells, read between decode steps."""
    alias = next(iter(llama_proxy))
    if pool.llama is None and llama_proxy is not None:
        pool._views_of(llama_proxy(None))  # loaded at start; the views are made by the first request or here
    if pool.llama is None:
        return {"model": alias, "loaded": False, "policy": llama_proxy[alias].get("kv_policy")}
    from .parallel import sequence_stats

    turn = object()
    pool.views[0]._turns.take(turn)
    try:  # one snapshot: no decode step between the layers and the sequences
        entry = {"model": alias, "loaded": True, "n_parallel": pool.n, **kv_stats_of(pool.llama)}
        rows = sequence_stats(pool.llama, pool.views, turn)
    finally:
        pool.views[0]._turns.give(turn)
    entry["n_ctx_seq"] = pool.views[0]._n_ctx
    entry["sequences"] = [dict(row, busy=v not in pool.free) for v, row in zip(pool.views, rows)]
    entry["n_tokens"] = sum(row["n_tokens"] for row in entry["sequences"])
    if pool.llama.kv_policy is not None and pool.llama.kv_policy.retains:
        # a policy's caches are per sequence: each sequence row has its layers and budget; the top level
        # adds them up per layer (llama.cpp's own cache is one, its layers already count every sequence)
        seqs = entry["sequences"]
        entry["layers"] = [{"layer": rows_l[0]["layer"], "on_device": rows_l[0]["on_device"],
                            **{k: sum(r[k] for r in rows_l) for k in ("n_cells", "n_used", "bytes", "n_evicted")}}
                           for rows_l in zip(*(r["layers"] for r in seqs))]
        entry["kv_bytes"] = sum(r["kv_bytes"] for r in seqs)  # kv_bytes_peak stays the memory's, of all sequences
        entry["n_evicted"] = sum(r["n_evicted"] for r in seqs)
        for name in pool.llama.kv_policy.describe()["stages"].values():  # the stages' counters too (summarise's,
            if name in seqs[0]:                                            # the host tier's)
                entry[name] = server_stats_total(name, [r[name] for r in seqs])
        for key in ("budget", "telemetry"):
            entry.pop(key, None)
    return entry


def _loaded_model() -> Optional[Any]:
    proxy = server_app._llama_proxy
    return getattr(proxy, "_current_model", None) if proxy is not None else None


def set_request_limits(model_settings: List[KVModelSettings]) -> None:
    """Set what the request guard checks against the loaded model.

    Its vocabulary (logit_bias ids) and the largest body worth reading (256 bytes a context position, at least 4 MiB: no
    longer prompt fits)."""
    n_ctx_set = max(m.n_ctx for m in model_settings)

    def vocab_size() -> Optional[int]:
        model = _loaded_model()
        return int(model.n_vocab()) if model is not None else None

    def max_body() -> Optional[int]:
        model = _loaded_model()
        n_ctx = max(n_ctx_set, int(model.n_ctx()) if model is not None else 0)
        return max(4 << 20, 256 * n_ctx)

    server_errors.VOCAB_SIZE = vocab_size
    server_errors.MAX_BODY = max_body


def create_app(server_settings: ServerSettings, model_settings: List[KVModelSettings]) -> Any:
    """The llama-cpp-python server app on pykvcache: every model loaded with its KV policy, plus /v1/kv/stats."""
    n_parallel = max(getattr(m, "n_parallel", 1) for m in model_settings)
    if n_parallel > 1 and len(model_settings) > 1:
        raise ValueError("n_parallel > 1 serves one model: give the config file one model, or n_parallel 1")
    if n_parallel > 1 and any(getattr(m, "embedding", False) for m in model_settings):
        # llama-cpp-python embeds a request's inputs as sequences of their own, the sequences --n_parallel gives to
        # requests
        raise ValueError("--embedding serves one request at a time: leave --n_parallel at 1")
    server_app.LlamaProxy = KVLlamaProxy
    install_error_mapping()
    set_request_limits(model_settings)
    app = server_app.create_app(server_settings=server_settings, model_settings=model_settings)
    app.add_middleware(JSONBodyGuard)
    if n_parallel > 1:
        use_view_pool(app, n_parallel)
    add_kv_routes(app)
    return app


def load_settings(args: argparse.Namespace) -> tuple:
    """Server and model settings from the command line or from the config file it names."""
    config_file = os.environ.get("CONFIG_FILE", args.config_file)
    if config_file:
        if not os.path.exists(config_file):
            raise ValueError(f"config file {config_file} not found")
        if os.path.isdir(config_file):
            raise ValueError(f"config file {config_file} is a folder, not a JSON or YAML file")
        with open(config_file, "rb") as f:
            if config_file.endswith((".yaml", ".yml")):
                import json

                import yaml

                try:
                    data = json.dumps(yaml.safe_load(f))
                except (yaml.YAMLError, UnicodeDecodeError, TypeError, ValueError) as exc:  # a date is no JSON value
                    raise ValueError(f"config file {config_file}: not a YAML settings file "
                                     f"({' '.join(str(exc).split())})") from None
                cfg = KVConfigFileSettings.model_validate_json(data)
            else:
                cfg = KVConfigFileSettings.model_validate_json(f.read())
        return ServerSettings.model_validate(cfg), cfg.models or [KVModelSettings()]
    return parse_model_from_args(ServerSettings, args), [parse_model_from_args(KVModelSettings, args)]


def check_listen_settings(server_settings: ServerSettings, port: str) -> None:
    """Where the server listens: a port uvicorn can bind, certificate files that exist (its tracebacks otherwise)."""
    if not port.isdigit() or int(port) > 65535:
        raise ValueError(f"port {port}: give 0 to 65535")
    for flag in ("ssl_keyfile", "ssl_certfile"):
        path = getattr(server_settings, flag)
        if path and not os.path.isfile(path):
            raise ValueError(f"--{flag} {path}: no such file")


def _cache_type_arg(text: str) -> int:
    try:
        return cache_type_id(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    """The flags of llama-cpp-python's server, `--kv-policy` and `--config_file`."""
    parser = argparse.ArgumentParser(
        prog="pykvcache serve",
        description="OpenAI-compatible server (llama-cpp-python's) on pykvcache: chat and text completions with a KV "
                    "policy, plus GET /v1/kv/stats. Flags as `python -m llama_cpp.server`.",
    )
    add_args_from_model(parser, KVSettings)
    for action in parser._actions:
        if action.dest == "model" and action.help:
            action.help = action.help.replace(" (default: PydanticUndefined)", "")  # a default_factory's placeholder
        if action.dest in ("type_k", "type_v"):  # llama.cpp's names too, where llama-cpp-python takes ids alone
            action.type = _cache_type_arg
            action.metavar = "TYPE"
            action.help = (f"KV cache type of the {'keys' if action.dest == 'type_k' else 'values'}: "
                           f"{', '.join(CACHE_TYPES)} or a ggml type id (default: f16)")
    parser.add_argument("--kv-policy", dest="kv_policy", type=str, help=argparse.SUPPRESS)
    parser.add_argument("--config_file", type=str, help="a llama-cpp-python server config file (JSON or YAML); "
                        "each model may have a kv_policy key")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Run the server until interrupted."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        server_settings, model_settings = load_settings(args)
        port = os.getenv("PORT", str(server_settings.port))
        check_listen_settings(server_settings, port)  # before the model loads
        app = create_app(server_settings, model_settings)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()))
        msg = str(err.get("msg", exc)).removeprefix("Value error, ")
        print(f"pykvcache serve: error: {where}: {msg}" if where else f"pykvcache serve: error: {msg}", file=sys.stderr)
        return 2
    except (PolicyError, ValueError, FileNotFoundError, IsADirectoryError, RPCError) as exc:
        print(f"pykvcache serve: error: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=os.getenv("HOST", server_settings.host), port=int(port),
                ssl_keyfile=server_settings.ssl_keyfile, ssl_certfile=server_settings.ssl_certfile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
