"""Fate stage `summarise` (native/engine/stages/fate-summarise.cpp)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from ..policies import Stage


@dataclass(frozen=True)
class SummariseFate(Stage):
    """Leaving tokens go to a bin of `bin` tokens per layer (768); a full bin becomes `rank` (12) fitted centroid cells.

    Per KV head, the centroids' keys fit the log attention mass of groups of similar keys and their values the
    bin's attention output, for the observation window's queries (HAE/SRC); the centroids count against the budget.
    When a prompt ends (and at decode steps) a bin's rest worth two or more centroids is fitted too, in proportion.
    """

    name: ClassVar[str] = "summarise"
    slot: ClassVar[str] = "fate"

    bin: Optional[int] = None
    rank: Optional[int] = None
