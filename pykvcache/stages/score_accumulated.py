"""Score stage `accumulated` (native/engine/stages/score-accumulated.cpp)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from ..policies import Stage


@dataclass(frozen=True)
class AccumulatedScore(Stage):
    """Attention mass accumulated over every observation (heavy hitters, H2O); same keeping rule as `WindowScore`, no pooling."""

    name: ClassVar[str] = "accumulated"
    slot: ClassVar[str] = "score"

    window: Optional[int] = None
    decay: Optional[float] = None
    n_sink: Optional[int] = None
    n_recent: Optional[int] = None
    topk_share: Optional[float] = None
