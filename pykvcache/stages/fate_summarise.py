"""Fate stage `summarise` (native/engine/stages/fate-summarise.cpp)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from ..policies import Stage


@dataclass(frozen=True)
class SummariseFate(Stage):
    """Leaving tokens go to a bin of `bin` tokens per layer (768); a full bin becomes `rank` (12) fitted centroid cells.

    Per KV head, the bin is split into groups of similar keys and values; the centroids' keys fit the groups' log
    attention mass and their values the bin's attention output, for the observation window's queries (HAE/SRC); the
    centroids count against the budget.
    When a prompt ends (and at decode steps) a bin's rest worth two or more centroids is fitted too, in proportion.
    The middle tokens leave by log(score) - `lam`*H (the seed's score - lambda*entropy), H the entropy of a token's
    attention over the window's queries, in [0, 1] (`Llama.kv_query_entropy`): tokens attended evenly go to bins first.
    `lam` -1 (default): 2 with a window of two or more queries, 0 (the retention policy's order) with one (H2O).
    """

    name: ClassVar[str] = "summarise"
    slot: ClassVar[str] = "fate"

    bin: Optional[int] = None
    rank: Optional[int] = None
    lam: Optional[float] = None
