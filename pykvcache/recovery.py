"""The entropy recovery ladder of the freeze schedule, in generation: after each token, the native ladder sees the
distribution it was sampled from (llama_kvp_recover_step) and thaws frozen tokens at levels 1-3; at level 4 (Rewalk,
`rewalk` > 0) the last `rewalk` tokens are generated again with everything thawed.

Tokens already streamed are never taken back: with Rewalk on, each token is held back until `rewalk` newer ones
exist (the stream runs `rewalk` tokens behind the model), so only held tokens are rolled back. A token that ends the
generation (end of generation, or the last one before the generator is closed) flushes what is held.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Generator, List, Optional, Sequence, Tuple

from ._native import import_llama_cpp, last_error, native

if TYPE_CHECKING:
    from .llama import Llama

llama_cpp = import_llama_cpp()

# rewalks per generate() call at most (a ladder that keeps spiking cannot loop forever)
MAX_REWALKS = 16


@dataclass(frozen=True)
class RecoveryEvent:
    """One step of the ladder: the decode step, the level it reached and the entropy (nats) that set it off."""

    step: int
    level: int
    entropy: float


class Ladder:
    """Drives one Llama's generation with the native ladder (built by `ladder_of`)."""

    def __init__(self, llm: "Llama", rewalk: int) -> None:
        self.llm = llm
        self.rewalk = rewalk

    def step(self) -> int:
        """Pass the logits the last token was sampled from to the native ladder; returns the level it acted on."""
        ffi, lib = native()
        llm = self.llm
        # the turn first (a sequence view gives it back once it has sampled): another sequence that decoded since
        # kept this one's logits aside before (_decodes_in_context), and none decodes while they are read
        ctx = llm._native_ctx()
        loaded = llm.__dict__.get("_kept_logits")  # the token was sampled from kept logits (sample())
        if loaded is not None:
            logits = ffi.cast("float *", ffi.from_buffer(loaded))
        else:
            ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
            logits = ffi.cast("float *", ctypes.cast(ptr, ctypes.c_void_p).value)
        level = lib.llama_kvp_recover_step(ctx, logits, llm.n_vocab())
        if level < 0:
            raise RuntimeError(last_error())
        return int(level)

    def generate(self, tokens: Sequence[int], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Generator[int, Optional[Sequence[int]], None]:
        """llama_cpp.Llama.generate with the ladder watching every token."""
        llm = self.llm
        inner = llama_cpp.Llama.generate(llm, tokens, *args, **kwargs)
        held: List[int] = []
        n_rewalk = 0
        try:
            while True:
                if held and llm.n_tokens >= llm._n_ctx:
                    break  # every position of the context is used: what is held is final (not generated again)
                try:
                    tok = next(inner)
                except StopIteration:
                    break
                level = self.step()
                n_back = min(self.rewalk, len(held))
                if level == 4 and n_back > 0 and n_rewalk < MAX_REWALKS:
                    # everything is thawed: the held tokens are generated again from where they began
                    n_rewalk += 1
                    inner.close()
                    p0 = llm.n_tokens - n_back
                    del held[-n_back:]
                    prefix = list(llm._input_ids[:p0])
                    llm.n_tokens = p0
                    # the prefix's last token evaluated again: llama-cpp-python would take the whole prefix as cached
                    # and sample from the logits before the roll-back (the held tokens then vanished from the text)
                    llm._requires_eval = True
                    again = dict(kwargs, reset=True)
                    inner = llama_cpp.Llama.generate(llm, prefix, *args, **again)
                    continue
                held.append(tok)
                if llama_cpp.llama_vocab_is_eog(llm._model.vocab, tok):
                    while held:
                        yield held.pop(0)
                    continue
                while len(held) > self.rewalk:
                    yield held.pop(0)
            while held:
                yield held.pop(0)
        finally:
            inner.close()


def ladder_of(llm: "Llama") -> Optional[Ladder]:
    """The ladder of a Llama whose policy has the freeze schedule with z > 0 (None otherwise)."""
    pol = llm.kv_policy
    if pol is None or pol.describe()["stages"]["schedule"] != "freeze":
        return None
    p = pol.to_native()
    if not p.z > 0:
        return None
    return Ladder(llm, int(p.rewalk))
