"""Errors of `pykvcache serve` as a client expects them: a bad request gets an OpenAI-style error with status 400,
never a 500, a bare-text answer, a stream that ends in silence, or a crash of the server.

llama-cpp-python's server (which `pykvcache serve` runs) answers a body that is not JSON with a plain-text 500 (its
error handler reads the body again outside its own try), every field that fails validation with a 500 holding
pydantic's dump, and an error raised once a stream has started with an empty 200 stream. Here: a guard in front of
the app checks the JSON body, the route's error mapping gives 400 to validation and `ValueError`s, and a stream's
error becomes an `{"error": ...}` event before `[DONE]`, as OpenAI's API sends it.
"""

from __future__ import annotations

import contextvars
import json
import sys
import traceback
from typing import Any, Awaitable, Callable, Dict, Iterator, Optional, Tuple

from fastapi.exceptions import RequestValidationError
import llama_cpp.server.app as server_app
from llama_cpp.server.errors import RouteErrorHandler

# the routes whose body is a JSON object (llama-cpp-python's server)
JSON_ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/v1/engines/copilot-codex/completions",
    "/extras/tokenize",
    "/extras/tokenize/count",
    "/extras/detokenize",
)


# the JSON body of the request being served (the guard parsed it), for what needs it outside the route's arguments
REQUEST_BODY: contextvars.ContextVar[Any] = contextvars.ContextVar("pykvcache_request_body", default=None)


def error_body(message: str, param: Optional[str] = None, code: Optional[str] = None,
               kind: str = "invalid_request_error") -> Dict[str, Any]:
    """An OpenAI-style error object."""
    return {"message": message, "type": kind, "param": param, "code": code}


# the most alternatives per token `logprobs` / `top_logprobs` may ask (OpenAI's API: 5 and 20)
MAX_LOGPROBS = 20

# the loaded model's vocabulary size and the largest request body taken (bytes), set by the server (None: unknown)
VOCAB_SIZE: Callable[[], Optional[int]] = lambda: None
MAX_BODY: Callable[[], Optional[int]] = lambda: None


def _lax_int(value: Any) -> Optional[int]:
    """The int pydantic's lax mode makes of a request field (100000, 100000.0, "100000"), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None


def parse_body(body: bytes) -> Tuple[Optional[str], Any, bool]:
    """Parse a request body that should be a JSON object.

    Returns what is wrong with it (None: nothing), the object, and whether it changed: chat contents given as lists of
    text parts (OpenAI's other form) joined into their text."""
    try:
        obj = json.loads(body)
    except RecursionError:
        return "the request body is nested too deeply", None, False
    except ValueError as exc:
        return f"the request body is not valid JSON: {exc}", None, False
    if not isinstance(obj, dict):
        return f"the request body must be a JSON object, not {type(obj).__name__}", None, False
    for key in ("n", "best_of"):  # llama-cpp-python answers one choice whatever they ask
        value = _lax_int(obj.get(key))
        if value is not None and value > 1:
            return f"{key}={obj[key]}: this server answers one choice per request (n and best_of 1)", obj, False
    for key in ("logprobs", "top_logprobs"):  # unbounded, a response grows by the vocabulary per token
        value = _lax_int(obj.get(key))
        if value is not None and value > MAX_LOGPROBS:
            return f"{key}={obj[key]}: at most {MAX_LOGPROBS} alternatives per token", obj, False
    prompt = obj.get("prompt")
    if isinstance(prompt, list) and any(not isinstance(p, str) for p in prompt):  # llama-cpp-python: str or [str]
        return "prompt: give the prompt as text (this server takes no token ids)", obj, False
    if isinstance(prompt, list) and len(prompt) > 1:  # llama-cpp-python asserts one
        return f"prompt: one prompt per request (got a list of {len(prompt)})", obj, False
    stop = obj.get("stop")
    if stop == "" or (isinstance(stop, list) and "" in stop):  # it would end every completion before its first token
        return "stop: an empty stop string would end the completion at once", obj, False
    changed = False
    for i, m in enumerate(obj.get("messages") if isinstance(obj.get("messages"), list) else []):
        content = m.get("content", "") if isinstance(m, dict) else ""
        if content is None and not (m.get("tool_calls") or m.get("function_call")):
            return f"messages[{i}].content is null: give the message's text", obj, False
        if isinstance(content, list):
            texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                kinds = sorted({str(p.get("type")) for p in content if isinstance(p, dict)} - {"text"}) or ["not a part"]
                return f"messages[{i}].content: this server takes text parts only (got {', '.join(kinds)})", obj, False
            m["content"] = "\n".join(texts)
            changed = True
    bias = obj.get("logit_bias")
    if isinstance(bias, dict) and obj.get("logit_bias_type") != "tokens":
        n_vocab = VOCAB_SIZE()
        for key in bias:
            ok = isinstance(key, str) and key.strip().isdigit() and (n_vocab is None or int(key) < n_vocab)
            if not ok:
                return (f"logit_bias: {key!r} is not a token id of this model (0 to "
                        f"{n_vocab - 1 if n_vocab else 'its vocabulary size - 1'})"), obj, False
    return None, obj, changed


class JSONBodyGuard:
    """ASGI middleware: a POST to a JSON route whose body is not a JSON object gets a 400 error object."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Dict[str, Any], receive: Callable[[], Awaitable[Dict[str, Any]]],
                       send: Callable[[Dict[str, Any]], Awaitable[None]]) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in JSON_ROUTES:
            await self.app(scope, receive, send)
            return
        chunks = []
        size, cap = 0, MAX_BODY()
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if cap is not None and size > cap:  # no prompt that long fits the context: not read nor tokenized
                await self._error(send, 413, f"the request body is larger than this server takes ({cap} bytes, "
                                             "from its context size)")
                return
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        problem, obj, changed = parse_body(body)
        if problem is not None:
            await self._error(send, 400, problem)
            return
        if changed:
            body = json.dumps(obj).encode()
        REQUEST_BODY.set(obj)
        replayed = False

        async def replay() -> Dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then the client's disconnect, which a stream watches for

        await self.app(scope, replay, send)

    @staticmethod
    async def _error(send: Callable[[Dict[str, Any]], Awaitable[None]], status: int, message: str) -> None:
        payload = json.dumps({"error": error_body(message)}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})


def validation_message(exc: RequestValidationError) -> Tuple[str, Optional[str]]:
    """One line per invalid field ("max_tokens: Input should be a valid integer"), and the first field's name."""
    lines, first = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        first = first or (loc[0] if loc else None)
        lines.append(f"{where}: {err.get('msg', '')}" if where else str(err.get("msg", "")))
    return "; ".join(lines) or "invalid request", first


def _maps_to_400(route: RouteErrorHandler, error: Exception) -> bool:
    # a ValueError is the caller's (a bad argument); one that llama-cpp-python formats itself keeps its own answer
    return isinstance(error, ValueError) and not any(p.search(str(error)) for p in route.pattern_and_formatters)


def _names_the_prompt(formatter: Callable[..., Tuple[int, Any]]) -> Callable[..., Tuple[int, Any]]:
    # llama-cpp-python names `messages` as the too-long field of a text completion too, which has a `prompt`
    def names_the_prompt(request: Any, match: Any) -> Tuple[int, Any]:
        status, err = formatter(request, match)
        if not hasattr(request, "messages") and err.get("param") == "messages":
            err = dict(err, param="prompt")
        return status, err

    return names_the_prompt


def install_error_mapping() -> None:
    """Make llama-cpp-python's route errors answer 400 for invalid fields and bad arguments (idempotent)."""
    original = RouteErrorHandler.error_message_wrapper
    if getattr(original, "_pykvcache", False):
        return

    def error_message_wrapper(self: RouteErrorHandler, error: Exception, body: Any = None) -> Tuple[int, Any]:
        if isinstance(error, RequestValidationError):
            message, param = validation_message(error)
            return 400, error_body(message, param=param)
        if _maps_to_400(self, error):
            return 400, error_body(str(error))
        if "embedding=True" in str(error):  # llama-cpp-python's RuntimeError for a model loaded without embeddings
            return 400, error_body("this server computes no embeddings: start it with --embedding true")
        return original(self, error, body)

    error_message_wrapper._pykvcache = True  # type: ignore[attr-defined]
    RouteErrorHandler.error_message_wrapper = error_message_wrapper  # type: ignore[method-assign]
    formatters = RouteErrorHandler.pattern_and_formatters
    for pattern, formatter in list(formatters.items()):
        if "exceed context window" in pattern.pattern:
            formatters[pattern] = _names_the_prompt(formatter)

    publisher = server_app.get_event_publisher

    async def get_event_publisher(**kwargs: Any) -> None:
        kwargs["llama_call"] = errors_as_events(kwargs["llama_call"], kwargs.get("body"))
        await publisher(**kwargs)

    server_app.get_event_publisher = get_event_publisher


def stream_error(exc: Exception, body: Any = None) -> Dict[str, Any]:
    """The event that ends a stream whose generation raised.

    It is the error object the request would have had unstreamed (llama-cpp-python's own wording and code for a prompt
    too long for the context)."""
    if isinstance(exc, ValueError):
        for pattern, formatter in RouteErrorHandler.pattern_and_formatters.items():
            match = pattern.search(str(exc))
            if match and body is not None:
                return {"error": dict(formatter(body, match)[1])}
        return {"error": error_body(str(exc))}
    print(f"Exception: {exc}", file=sys.stderr)
    traceback.print_exception(exc, file=sys.stderr)
    return {"error": error_body(str(exc) or type(exc).__name__, kind="server_error")}


def errors_as_events(call: Callable[..., Iterator[Any]], body: Any = None) -> Callable[..., Iterator[Any]]:
    """A streaming call whose error, at its start or later, is yielded as an error event instead of raised."""

    def run(llama: Any, **kwargs: Any) -> Iterator[Any]:
        try:
            chunks = call(llama, **kwargs)
        except Exception as exc:  # noqa: BLE001 - reported to the client as the stream's last event
            return iter([stream_error(exc, body)])

        def events() -> Iterator[Any]:
            try:
                yield from chunks
            except Exception as exc:  # noqa: BLE001
                yield stream_error(exc, body)

        return events()

    return run
