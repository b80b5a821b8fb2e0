"""Schedule stage `prompt` (native/engine/stages/schedule-prompt.cpp)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..policies import Stage


@dataclass(frozen=True)
class PromptSchedule(Stage):
    """Scores come from the prompt batches only (decode steps observe when asked)."""

    name: ClassVar[str] = "prompt"
    slot: ClassVar[str] = "schedule"
