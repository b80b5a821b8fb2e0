"""Fate stage `drop` (native/engine/stages/fate-drop.cpp)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..policies import Stage


@dataclass(frozen=True)
class DropFate(Stage):
    """A token leaving a layer's cache is gone."""

    name: ClassVar[str] = "drop"
    slot: ClassVar[str] = "fate"
