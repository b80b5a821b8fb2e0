"""Budget stage `pyramid` (native/engine/stages/budget-pyramid.cpp)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from ..policies import Stage


@dataclass(frozen=True)
class PyramidBudget(Stage):
    """Layer budgets decreasing linearly from budget*(1+slope) at the first layer to budget*(1-slope) at the last."""

    name: ClassVar[str] = "pyramid"
    slot: ClassVar[str] = "budget"

    budget: Optional[float] = None
    slope: Optional[float] = None
