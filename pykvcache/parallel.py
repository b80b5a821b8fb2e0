"""Parallel requests on one context: a view of a `Llama` per sequence, taking turns on the shared context.

A context created with `n_seq_max=N` holds N sequences (each with caches of its own under a retention policy). A
`SequenceView` is the `Llama` seen through one sequence: llama-cpp-python's whole completion path (chat templates,
sampling, stop strings, streaming) runs on it unchanged, while its decode calls and cache edits go to its sequence.
Views take turns: a view holds the context from a decode until it has sampled from that decode's logits (the
sampler reads the context's last logits), so requests on different views advance token by token, interleaved. The
`Llama` they came from takes the same turns, one per call (pykvcache/threads.py), so it can run beside them in another
thread; a view's call that reads or edits its caches outside a generation holds a turn until it ends.
"""

from __future__ import annotations

import collections
import copy
import threading
import weakref
from typing import Any, Deque, Generator, List, Optional, Sequence

import numpy as np

from .llama import Llama
from .stages import server_stats
from .threads import ConcurrentUseError, Exclusive, exclusive


class Turns:
    """Who may use the shared context now: held by one turn token at a time, given in the order they asked (a thread
    that asks again at once waits behind the others); any thread may give a token's turn back."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: Deque[object] = collections.deque()
        self.holder: Optional[object] = None
        self.holder_thread: Optional[int] = None

    def take(self, token: object) -> None:
        """Wait for the context unless `token` holds it already; a thread that holds it under another token passes
        it to `token` (a view's call that read its caches, then starts a generation with a token of its own)."""
        me = threading.get_ident()
        with self._cond:
            if self.holder is token:
                self.holder_thread = me  # a stream's steps may move between threads
                return
            if self.holder is not None and self.holder_thread == me:
                self.holder = token
                return
            ticket = object()
            self._queue.append(ticket)
            while self.holder is not None or self._queue[0] is not ticket:
                self._cond.wait()
            self._queue.popleft()
            self.holder, self.holder_thread = token, me

    def give(self, token: object) -> None:
        """Release the context if `token` holds it."""
        with self._cond:
            if self.holder is token:
                self.holder, self.holder_thread = None, None
                self._cond.notify_all()

    def held_here(self) -> bool:
        """Whether the calling thread holds the context."""
        return self.holder is not None and self.holder_thread == threading.get_ident()


class _SequenceContext:
    """llama-cpp-python's LlamaContext as one sequence sees it: decodes and cache edits go to that sequence."""

    def __init__(self, inner: Any, view: "SequenceView", n_ctx_seq: int) -> None:
        self._inner = inner
        self._view = view
        self._n_ctx_seq = n_ctx_seq

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def n_ctx(self) -> int:
        return self._n_ctx_seq

    def kv_cache_seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        self._view._take()
        return self._inner.kv_cache_seq_rm(self._view.seq, p0, p1)

    def kv_cache_clear(self) -> None:
        self.kv_cache_seq_rm(self._view.seq, -1, -1)

    def decode(self, batch: Any) -> None:
        self._view._take()
        b = batch.batch
        for i in range(b.n_tokens):
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = self._view.seq
        self._inner.decode(batch)


class SequenceView(Llama):
    """A `Llama` bound to one sequence of another `Llama`'s context (created by `sequence_views`)."""

    seq: int
    _turns: Turns
    _whole_context = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # pragma: no cover - views are made by sequence_views
        raise TypeError("SequenceView is made by pykvcache.parallel.sequence_views(llm)")

    def close(self) -> None:
        """A view owns nothing: closing the `Llama` it came from frees the model and context."""

    def __getstate__(self) -> Any:
        raise TypeError("a sequence view cannot be pickled (it is one sequence of another Llama's context): pickle "
                        "the Llama it came from, and make its views again with sequence_views")

    def embed(self, input: Any, *args: Any, **kwargs: Any) -> Any:
        """Embeddings of text in this view's sequence (llama_cpp.Llama.embed), one text per call."""
        if isinstance(input, list) and len(input) > 1 and self.context_params.embeddings:
            # llama-cpp-python puts each text of a batch in a sequence of its own; a view has one (without
            # embedding=True, llama-cpp-python's own error comes first, as for one text)
            raise ValueError(f"a sequence view embeds one text per call ({len(input)} given): embed them one at a "
                             f"time")
        return super().embed(input, *args, **kwargs)

    def __del__(self) -> None:
        pass

    def _take(self) -> None:
        # the turn for a decode, a cache edit or a read: a step of this view's generation holds it under the
        # generation's token until it samples; any other call of the view holds it until the call ends
        if self._generating and self._gen_stepping:
            self._turns.take(self._turn)
            if self.__dict__.get("_record_stale"):  # its sequence changed while this step waited: decode nothing
                raise ConcurrentUseError("this generation was interrupted: while it waited for its turn, its sequence's "
                                         "cache was changed through another user of the context (a state loaded or "
                                         "a batch run into every sequence, or the Llama running sequence 0, which "
                                         "it shares with its view of sequence 0)")
        elif not self._turns.held_here() and not self._exclusive.hold(self._turns, object()):
            self._turns.take(self._turn)  # not inside a call of the view (not expected)

    def _give(self) -> None:
        self._turns.give(self._turn)

    @property
    def _own_seq(self) -> int:  # type: ignore[override]
        return self.seq

    def _native_ctx(self) -> Any:
        # the native calls (budget, guided prefill, prefix reuse, telemetry) act on the selected sequence, which the
        # Llama's _native_ctx selects (this view's, a member of the Llama's family) once the view holds its turn
        self._take()
        return super()._native_ctx()

    @exclusive
    def eval(self, tokens: Sequence[int]) -> None:
        """Evaluate tokens in this view's sequence (it keeps the context until it samples, inside `generate`)."""
        self._take()
        super().eval(tokens)

    @exclusive
    def save_state(self) -> "llama_cpp.llama.LlamaState":
        """The whole context's state, every sequence's (as the `Llama`'s own save_state), taken in this view's turn."""
        self._take()
        return super().save_state()

    @exclusive
    def load_state(self, state: "llama_cpp.llama.LlamaState") -> None:
        """Restore the whole context's state (every sequence) in this view's turn; the others' token records restart."""
        self._take()
        super().load_state(state)

    def sample(self, *args: Any, **kwargs: Any) -> int:
        """Sample from this view's last decode, then let the other views have the context."""
        try:
            return super().sample(*args, **kwargs)
        finally:
            self._give()

    def generate(self, tokens: Sequence[int], *args: Any, **kwargs: Any) -> Generator[int, Optional[Sequence[int]], None]:
        """Generate tokens (llama_cpp.Llama.generate) in this view's sequence."""
        turn = object()  # this call's turn token: a generator left behind by an earlier request never releases ours
        self._turn = turn
        self._generating = True
        try:
            return (yield from super().generate(tokens, *args, **kwargs))
        finally:
            if self._turn is turn:
                self._generating = False
            self._turns.give(turn)

def sequence_views(llm: Llama) -> List[SequenceView]:
    """One view per sequence of `llm`'s context (n_seq_max of them), sharing its model, context and turns; the same
    views on every call (two views of one sequence would each keep a token record of it)."""
    import llama_cpp

    if llm.__dict__.get("_views"):
        return list(llm._views)

    n_seq = int(llama_cpp.llama_n_seq_max(llm._ctx.ctx))
    n_ctx_seq = llm.n_ctx() // n_seq
    # one Turns per context, shared by the Llama (a turn per call) and its views (made once: the early return above)
    turns = llm._exclusive.turns = Turns()
    llm._family = weakref.WeakSet([llm])  # a state load through one of them restarts the others' token records
    views = []
    for s in range(n_seq):
        # the same attributes, not a copy.copy: llama-cpp-python's __setstate__ would load the model and build a context
        # again for each view
        v = SequenceView.__new__(SequenceView)
        v.__dict__.update(llm.__dict__)
        v.seq = s
        v._exclusive = Exclusive()  # views run in threads of their own, taking turns on the context
        v._gen_owner, v._gen_evals, v._gen_stepping = None, -1, 0
        v._completing, v._completion_cut = False, False
        v._turns = turns
        v._turn = object()
        v._generating = False
        v._ctx = _SequenceContext(llm._ctx, v, n_ctx_seq)
        v._n_ctx = n_ctx_seq
        v.n_tokens = 0
        v.input_ids = np.ndarray((n_ctx_seq,), dtype=np.intc)
        v.scores = np.ndarray((n_ctx_seq if llm._logits_all else llm.n_batch, llm._n_vocab), dtype=np.single)
        v._mirostat_mu = copy.copy(llm._mirostat_mu)
        views.append(v)
        llm._family.add(v)
    llm._views = views
    return list(views)


def sequence_stats(llm: Llama, views: List[SequenceView], turn: Optional[object] = None) -> List[dict]:
    """Each sequence's tokens, budget, active cells, per-layer caches and its stages' counters.

    Read between two decode steps of the views (within `turn` when the caller holds the context already)."""
    pol = llm.kv_policy
    own = turn is None
    turn = object() if turn is None else turn
    views[0]._turns.take(turn)
    try:
        res = []
        for v in views:
            # sequence 0 is the Llama's too: of the two token records, the one not restarted by the other's last run
            n_tokens = max(int(v.n_tokens), int(llm.n_tokens)) if v.seq == llm._own_seq else int(v.n_tokens)
            row: dict = {"seq": v.seq, "n_tokens": n_tokens, "n_ctx": v._n_ctx}
            if pol is not None and pol.retains:
                llm._reading_seq = v.seq  # the Llama's reads select this sequence instead of its own
                try:
                    mem = llm.kv_memory()
                    stats = llm.kv_stats()
                    shown = server_stats(llm)  # its stages' state (summarise's bins, the host tier's tokens)
                finally:
                    del llm._reading_seq
                row.update(budget=mem.budget, n_active=mem.n_active, kv_bytes=stats.total_bytes,
                           n_evicted=sum(b.n_evicted for b in mem.layers))
                row["layers"] = [dict(s.row(), budget=b.budget, entropy=b.entropy, n_evicted=b.n_evicted)
                                 for s, b in zip(stats.layers, mem.layers)]
                row.update(shown)
            res.append(row)
        return res  # the selected sequence is the last read's: every user selects its own before its native calls
    finally:
        if own:
            views[0]._turns.give(turn)
