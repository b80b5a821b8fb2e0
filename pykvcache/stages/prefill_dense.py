"""Prefill stage `dense` (native/engine/stages/prefill-dense.cpp)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from ..policies import Stage


@dataclass(frozen=True)
class DensePrefill(Stage):
    """Dense attention, the prompt in chunks of `chunk` tokens; with `guide`, each chunk is scored by the prompt's end run behind it."""

    name: ClassVar[str] = "dense"
    slot: ClassVar[str] = "prefill"

    chunk: Optional[int] = None
    guide: Optional[bool] = None
