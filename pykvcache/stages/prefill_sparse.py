"""Prefill stage `sparse` (native/engine/stages/prefill-sparse.cpp)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from ..policies import Stage


@dataclass(frozen=True)
class SparsePrefill(Stage):
    """Per-head entropy-guided block-sparse attention in prompt ubatches (EntropyInfer).

    Queries in segments of `segment` tokens, cells in blocks of `block`; a head stays Rigid (`base` tokens per
    segment) while its normalised block entropy is below `e_t`, then follows the entropy's fluctuation up to
    3*base (`alpha`, `delta_t`). Dense below `threshold` cells and in the first `skip` layers; `per_head=False`
    gives every head the layer's largest budget. `chunk` and `guide` work as in the dense stage.
    """

    name: ClassVar[str] = "sparse"
    slot: ClassVar[str] = "prefill"

    segment: Optional[int] = None
    block: Optional[int] = None
    base: Optional[int] = None
    e_t: Optional[float] = None
    alpha: Optional[float] = None
    delta_t: Optional[float] = None
    threshold: Optional[int] = None
    skip: Optional[int] = None
    per_head: Optional[bool] = None
    chunk: Optional[int] = None
    guide: Optional[bool] = None
