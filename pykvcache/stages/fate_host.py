"""Fate stage `host` (native/engine/stages/fate-host.cpp)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Dict, List, Optional

import numpy as np

from .._native import last_error, native
from ..policies import PolicyError, Stage
from ..telemetry import HostTelemetry

if TYPE_CHECKING:
    from ..llama import Llama


@dataclass(frozen=True)
class HostFate(Stage):
    """Leaving tokens move, as their raw K/V bytes, to a host-memory tier from which they come back unchanged.

    The tier holds at most `limit` tokens per layer (0: the context size); past the limit the coldest are dropped for
    good."""

    name: ClassVar[str] = "host"
    slot: ClassVar[str] = "fate"

    limit: Optional[int] = None

    @classmethod
    def server_stats(cls, llm: "Llama") -> Dict[str, Any]:
        """The host tier's token counts and moves and the recovery ladder's events by level, for the server's stats."""
        out = _read_stats(llm)  # the counts alone, not each layer's positions
        res: Dict[str, Any] = {k: int(getattr(out, k)) for k in ("n_host", "n_frozen", "n_freeze", "n_thaw", "n_evict",
                                                                 "n_dropped", "n_rerank", "n_promote")}
        res["n_recover"] = [int(out.n_recover[i]) for i in range(4)]  # Soft, Window, Full Reset, Rewalk
        return res

    @classmethod
    def server_stats_total(cls, blocks: List[Dict[str, Any]]) -> Dict[str, Any]:
        """The counts of several sequences added up, the ladder's level by level."""
        if not blocks:
            return {}
        res = {k: sum(b[k] for b in blocks) for k in blocks[0] if k != "n_recover"}
        res["n_recover"] = [sum(b["n_recover"][i] for b in blocks) for i in range(4)]
        return res


def _read_stats(llm: "Llama") -> Any:
    ffi, lib = native()
    out = ffi.new("struct llama_kvp_host_stats *")
    if lib.llama_kvp_host(llm._native_ctx(), out) != 0:
        raise PolicyError(last_error())
    return out


def read_telemetry(llm: "Llama") -> HostTelemetry:
    """Host tier telemetry of a context: tokens and bytes, freeze/thaw counts, and each layer's positions' state."""
    out = _read_stats(llm)
    ffi, lib = native()
    ctx = llm._native_ctx()
    layers = llm.kv_stats().layers
    per_layer = []
    for s, layer in enumerate(layers):
        n = lib.llama_kvp_layer_host(ctx, s, ffi.NULL, ffi.NULL, 0)
        hpos = np.zeros(max(n, 1), dtype=np.int32)
        timer = np.zeros(max(n, 1), dtype=np.int32)
        pos = np.zeros(layer.n_cells, dtype=np.int32)
        if (n < 0 or lib.llama_kvp_layer_host(ctx, s, ffi.cast("int32_t *", ffi.from_buffer(hpos)),
                                              ffi.cast("int32_t *", ffi.from_buffer(timer)), n) < 0
                or lib.llama_kvp_layer_cell_pos(ctx, s, ffi.cast("int32_t *", ffi.from_buffer(pos)), pos.size) < 0):
            raise RuntimeError(last_error())
        per_layer.append((hpos[:n], timer[:n], pos))
    # as wide as the sequence (after a batch of sequences n_tokens is 0: as wide as what the layers hold)
    n_pos = max([int(llm.n_tokens), 1] + [int(a.max()) + 1 for h, _, p in per_layer for a in (h, p) if a.size])
    state = np.zeros((len(layers), n_pos), dtype=np.int8)
    for s, (hpos, timer, pos) in enumerate(per_layer):
        ok = hpos >= 0
        state[s, hpos[ok & (timer > 0)]] = HostTelemetry.FROZEN
        state[s, hpos[ok & (timer == 0)]] = HostTelemetry.COLD
        state[s, pos[pos >= 0]] = HostTelemetry.ACTIVE
    return HostTelemetry(
        state=state, n_active=int(out.n_active), n_host=int(out.n_host), n_frozen=int(out.n_frozen),
        host_bytes=int(out.host_bytes), host_bytes_peak=int(out.host_bytes_peak), n_freeze=int(out.n_freeze),
        n_thaw=int(out.n_thaw), n_evict=int(out.n_evict), n_dropped=int(out.n_dropped), n_steps=int(out.n_steps),
        t_ms=float(out.t_ms), n_rerank=int(out.n_rerank), n_promote=int(out.n_promote),
        n_recover=tuple(int(out.n_recover[i]) for i in range(4)))
