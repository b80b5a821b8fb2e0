"""One thread at a time in a `Llama`: a second thread's call while another runs is an error, not a crash.

llama.cpp's context is not thread-safe: two threads decoding in one context abort the process (a GGML_ASSERT in the
CPU backend) or corrupt the cache, and llama-cpp-python's `Llama` leaves that to its caller. A `Llama` of pykvcache
marks the thread running one of its methods (nested calls of that thread go on); a call from another thread meanwhile
raises `ConcurrentUseError`. Only the running steps count: a stream that is paused between two tokens holds nothing,
so a stream may be consumed from worker threads one token at a time (as web servers do). A generation paused while
another call changed the cache (a generation, eval, generate_batch, load_state or embed) is refused when it resumes
(`Llama.generate`), so interleaved calls never mix their tokens. A `Llama` and its sequence views share one context
and one `Turns` (pykvcache/parallel.py): each call of the `Llama`, and each step of its generator methods, waits for
the context's turn unless its thread holds it already, as the views' decodes and reads do, so the `Llama` and its views
may run in threads of their own.
"""

from __future__ import annotations

import functools
import inspect
import threading
from typing import Any, Callable, Generator, Optional, Protocol, Tuple, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class ConcurrentUseError(RuntimeError):
    """A `Llama` was called from a second thread while another thread's call was running in it."""


class SharedTurns(Protocol):
    """The turns on a context that several objects share (pykvcache.parallel.Turns)."""

    def take(self, token: object) -> None: ...

    def give(self, token: object) -> None: ...

    def held_here(self) -> bool: ...


class Exclusive:
    """Which thread runs in an object now, with the depth of its nested calls; with `turns`, each outermost call also
    holds the shared context's turn (under a token of its own) unless its thread holds it already."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: Optional[int] = None
        self._depth = 0
        self.turns: Optional[SharedTurns] = None  # set by pykvcache.parallel.sequence_views on the Llama
        self._held: Optional[Tuple[SharedTurns, object]] = None  # given back when the outermost call ends

    def enter(self, what: str) -> None:
        """Mark the calling thread as running, or raise ConcurrentUseError if another thread runs; with `turns`, the
        outermost call first waits for the context's turn (a call of another thread holding it ends first)."""
        me = threading.get_ident()
        token = None
        if self.turns is not None and not self.turns.held_here():
            token = object()  # this call's own: a token shared by two threads would let both through
            self.turns.take(token)
        with self._lock:
            if self._thread is not None and self._thread != me:
                if token is not None:
                    self.turns.give(token)  # type: ignore[union-attr]
                raise ConcurrentUseError(
                    f"{what}: this Llama is running a call of another thread; a llama.cpp context is not thread-safe, "
                    "so use one Llama per thread, serialise the calls with a lock, or give concurrent requests "
                    "sequence views (pykvcache.parallel.sequence_views, as `pykvcache serve --n_parallel` does)")
            self._thread = me
            self._depth += 1
            if token is not None:
                self._held = (self.turns, token)  # type: ignore[assignment]

    def hold(self, turns: SharedTurns, token: object) -> bool:
        """Take `turns` under `token` until the calling thread's outermost call ends (False: no call of it runs)."""
        with self._lock:
            if self._depth == 0 or self._thread != threading.get_ident():
                return False
        turns.take(token)
        self._held = (turns, token)
        return True

    def leave(self) -> None:
        """End the calling thread's innermost call."""
        with self._lock:
            self._depth -= 1
            held = None
            if self._depth == 0:
                self._thread = None
                held, self._held = self._held, None
        if held is not None:
            held[0].give(held[1])


def _guard(obj: Any) -> Exclusive:
    # made by the constructor; a Llama whose construction failed before it (closed by __del__) gets one here
    g = obj.__dict__.get("_exclusive")
    return g if g is not None else obj.__dict__.setdefault("_exclusive", Exclusive())


def exclusive(method: F) -> F:
    """Run `method` (a generator function: each of its steps) as the only thread in its object."""
    what = method.__name__
    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def steps(self: Any, *args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
            guard = _guard(self)
            inner = method(self, *args, **kwargs)
            resume: Callable[[], Any] = functools.partial(next, inner)
            while True:
                guard.enter(what)
                try:
                    item = resume()
                except StopIteration as stop:
                    return stop.value
                finally:
                    guard.leave()
                try:
                    sent = yield item
                except GeneratorExit:
                    inner.close()  # its cleanup is Python's own; a stream dropped by another thread closes too
                    raise
                except BaseException as exc:
                    resume = functools.partial(inner.throw, exc)
                else:
                    resume = functools.partial(inner.send, sent)

        return steps  # type: ignore[return-value]

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        guard = _guard(self)
        guard.enter(what)
        try:
            return method(self, *args, **kwargs)
        finally:
            guard.leave()

    return call  # type: ignore[return-value]
