"""Schedule stage `freeze` (native/engine/stages/schedule-freeze.cpp)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, List, Optional

from .._native import last_error, native
from ..policies import PolicyError, Stage
from ..recovery import RecoveryEvent

if TYPE_CHECKING:
    from ..llama import Llama


@dataclass(frozen=True)
class FreezeSchedule(Stage):
    """Soft freeze (ASR-KF): tokens of low attention freeze into the host tier, then thaw.

    Every `every`-th decode step observes; a token whose head-mean attention is below tau/n (n: tokens attended) on c
    observations of the last `hist` steps freezes into the host tier for floor(sqrt(c)/k) observation periods, then
    thaws (ASR-KF soft freeze). With `z` > 0, the entropy recovery ladder: a generated token whose distribution's
    entropy is above its running mean + z sd climbs one level (Soft Reset, Window Reset of the last `span` steps, Full
    Reset, Rewalk of the last `rewalk` tokens) and thaws accordingly.
    With `gap` >= 0 (-1: off), the latent re-ranking of `LatentSchedule` too, so that frozen, evicted and active tokens
    compete together: `SnapKV(budget=0.1) + HostFate() + FreezeSchedule(gap=0)`.
    Needs the host fate: `H2O(budget=0.1) + HostFate() + FreezeSchedule()` (the host tier first)."""

    name: ClassVar[str] = "freeze"
    slot: ClassVar[str] = "schedule"

    tau: Optional[float] = None
    k: Optional[int] = None
    hist: Optional[int] = None
    every: Optional[int] = None
    z: Optional[float] = None
    rewalk: Optional[int] = None
    span: Optional[int] = None
    gap: Optional[int] = None
    repeat: Optional[int] = None


def read_recovery_events(llm: "Llama") -> List[RecoveryEvent]:
    """Events of the recovery ladder in a context so far: decode step, level and the entropy that set it off."""
    ffi, lib = native()
    ctx = llm._native_ctx()
    n = lib.llama_kvp_recover_events(ctx, ffi.NULL, ffi.NULL, ffi.NULL, 0)
    if n < 0:
        raise PolicyError(last_error())
    step, level, ent = ffi.new("int32_t[]", max(n, 1)), ffi.new("int32_t[]", max(n, 1)), ffi.new("float[]", max(n, 1))
    lib.llama_kvp_recover_events(ctx, step, level, ent, n)
    return [RecoveryEvent(int(step[i]), int(level[i]), float(ent[i])) for i in range(n)]
