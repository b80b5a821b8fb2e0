"""Budget stage `entropy` (native/engine/stages/budget-entropy.cpp)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from ..policies import Stage


@dataclass(frozen=True)
class EntropyBudget(Stage):
    """Layer budgets in proportion to the mean head entropy of the prompt.

    Within [min_layer, max_layer] (0: budget/4, 2*budget), over the first `split_share` of the layers (the others keep
    the mean budget)."""

    name: ClassVar[str] = "entropy"
    slot: ClassVar[str] = "budget"

    budget: Optional[float] = None
    min_layer: Optional[int] = None
    max_layer: Optional[int] = None
    split_share: Optional[float] = None
