"""Budget stage `uniform` (native/engine/stages/budget-uniform.cpp)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from ..policies import Stage


@dataclass(frozen=True)
class UniformBudget(Stage):
    """Every layer keeps `budget` tokens (a count, or a fraction of the prompt)."""

    name: ClassVar[str] = "uniform"
    slot: ClassVar[str] = "budget"

    budget: Optional[float] = None
