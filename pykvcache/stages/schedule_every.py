"""Schedule stage `every` (native/engine/stages/schedule-every.cpp)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from ..policies import Stage


@dataclass(frozen=True)
class EverySchedule(Stage):
    """Besides the prompt batches, every `every`-th decode step observes and refreshes the scores.

    Decode steps evict down to the budgets at the step after each refresh (a layer holds up to every - 1 newer tokens
    beside it)."""

    name: ClassVar[str] = "every"
    slot: ClassVar[str] = "schedule"

    every: Optional[int] = None
