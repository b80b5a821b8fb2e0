"""Score stage `window` (native/engine/stages/score-window.cpp)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from ..policies import Stage


@dataclass(frozen=True)
class WindowScore(Stage):
    """Attention of the last `window` queries, decayed by `decay` per observation and pooled over `pool` positions.

    A `pool_max` share of the top-k goes to whole spans around the best-attended tokens (max pooling over
    `span_pool` positions, 0: `pool`), the rest by average pooling (0: SnapKV's average, 1: max everywhere), in the
    last `span_share` of the layers (the others average only); in the last `fill_share` of the layers a hole of up to
    `fill` tokens between two better-scored tokens also ranks with the weaker of the two (a number is not cut in the
    middle); with `vnorm` > 0 a token's mass is first weighted by the norm of its value vectors to that power (VATP);
    with `fresh` > 0 the tokens outside the spans rank by that share of the last observation alone and the rest of the
    decayed sum (which alone ranks the spans);
    keeps `n_sink` sinks, the top `topk_share` of the rest and the most recent tokens (at least `n_recent`).
    """

    name: ClassVar[str] = "window"
    slot: ClassVar[str] = "score"

    window: Optional[int] = None
    pool: Optional[int] = None
    pool_max: Optional[float] = None
    span_pool: Optional[int] = None
    span_share: Optional[float] = None
    fill: Optional[int] = None
    fill_share: Optional[float] = None
    vnorm: Optional[float] = None
    fresh: Optional[float] = None
    decay: Optional[float] = None
    n_sink: Optional[int] = None
    n_recent: Optional[int] = None
    topk_share: Optional[float] = None
