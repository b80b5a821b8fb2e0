"""Schedule stage `every` (native/engine/stages/schedule-every.cpp)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from ..policies import Stage


@dataclass(frozen=True)
class EverySchedule(Stage):
    """Besides the prompt batches, every `every`-th decode step observes and refreshes the scores."""

    name: ClassVar[str] = "every"
    slot: ClassVar[str] = "schedule"

    every: Optional[int] = None
