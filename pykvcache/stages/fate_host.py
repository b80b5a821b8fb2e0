"""Fate stage `host` (native/engine/stages/fate-host.cpp)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from ..policies import Stage


@dataclass(frozen=True)
class HostFate(Stage):
    """Leaving tokens move, as their raw K/V bytes, to a host-memory tier from which they come back unchanged.

    The tier holds at most `limit` tokens per layer (0: the context size); past the limit the coldest are dropped for
    good."""

    name: ClassVar[str] = "host"
    slot: ClassVar[str] = "fate"

    limit: Optional[int] = None
