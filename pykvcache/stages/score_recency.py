"""Score stage `recency` (native/engine/stages/score-recency.cpp)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from ..policies import Stage


@dataclass(frozen=True)
class RecencyScore(Stage):
    """Keep the first `n_sink` and the last `n_recent` tokens; nothing is observed (StreamingLLM)."""

    name: ClassVar[str] = "recency"
    slot: ClassVar[str] = "score"

    n_sink: Optional[int] = None
    n_recent: Optional[int] = None
