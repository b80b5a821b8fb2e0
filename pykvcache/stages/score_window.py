"""Score stage `window` (native/engine/stages/score-window.cpp)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from ..policies import Stage


@dataclass(frozen=True)
class WindowScore(Stage):
    """Attention of the last `window` queries, decayed by `decay` per observation and pooled over `pool` positions.

    Pooling is an average, or a max with pool_max=1; keeps `n_sink` sinks, the top `topk_share` of the rest and the
    most recent tokens (at least `n_recent`) (SnapKV).
    """

    name: ClassVar[str] = "window"
    slot: ClassVar[str] = "score"

    window: Optional[int] = None
    pool: Optional[int] = None
    pool_max: Optional[bool] = None
    decay: Optional[float] = None
    n_sink: Optional[int] = None
    n_recent: Optional[int] = None
    topk_share: Optional[float] = None
