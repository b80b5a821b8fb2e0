"""Schedule stage `latent` (native/engine/stages/schedule-latent.cpp)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from ..policies import Stage


@dataclass(frozen=True)
class LatentSchedule(Stage):
    """Latent decoding (EntropyInfer): each layer re-ranks its active and host-tier tokens together.

    `gap` decode steps after each prompt (or chat turn), each layer re-ranks its active and host-tier tokens together by
    the observation window's queries and keeps the best within its budget (`repeat=1`: again every `gap` steps); scores
    are refreshed every `every` steps in between. `gap=0` re-ranks at the end of each prompt (for a question in a new
    chat turn), then `Llama.eval` evaluates the question's tokens again so that they see what came back (where a token
    was evicted or moved between the tiers: otherwise the prompt's own logits stand). Needs the host
    fate: `SnapKV(budget=0.1) + HostFate() + LatentSchedule(gap=0)`."""

    name: ClassVar[str] = "latent"
    slot: ClassVar[str] = "schedule"

    gap: Optional[int] = None
    repeat: Optional[int] = None
    every: Optional[int] = None
