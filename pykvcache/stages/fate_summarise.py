"""Fate stage `summarise` (native/engine/stages/fate-summarise.cpp)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Dict, List, Optional

import numpy as np

from .._native import last_error, native
from ..policies import PolicyError, Stage
from ..telemetry import SummaryTelemetry

if TYPE_CHECKING:
    from ..llama import Llama


@dataclass(frozen=True)
class SummariseFate(Stage):
    """Leaving tokens go to a bin of `bin` tokens per layer (768); a full bin becomes `rank` (12) fitted centroid cells.

    Per KV head, the bin is split into groups of similar keys and values; the centroids' keys fit the groups' log
    attention mass and their values the bin's attention output, for the observation window's queries (HAE/SRC); the
    centroids count against the budget.
    When a prompt ends (and at decode steps) a bin's rest worth two or more centroids is fitted too, in proportion.
    The middle tokens leave by log(score) - `lam`*H (the seed's score - lambda*entropy), H the entropy of a token's
    attention over the window's queries, in [0, 1] (`Llama.kv_query_entropy`): tokens attended evenly go to bins first.
    `lam` -1 (default): 2 with a window of two or more queries, 0 (the retention policy's order) with one (H2O).
    """

    name: ClassVar[str] = "summarise"
    slot: ClassVar[str] = "fate"

    bin: Optional[int] = None
    rank: Optional[int] = None
    lam: Optional[float] = None

    @classmethod
    def server_stats(cls, llm: "Llama") -> Dict[str, Any]:
        """The bins, centroids, pending tokens' host bytes and fit errors so far, for the server's KV stats."""
        out = _read_stats(llm)  # the counts alone, not each layer's positions
        res: Dict[str, Any] = {k: int(getattr(out, k)) for k in ("n_bins", "n_centroids", "n_pending", "n_fallback",
                                                                 "n_dropped", "pending_bytes")}
        for k in _FIT_ERRORS:
            res[k] = float(getattr(out, k))
        return res

    @classmethod
    def server_stats_total(cls, blocks: List[Dict[str, Any]]) -> Dict[str, Any]:
        """The counts of several sequences added up, the fit errors their means over the bins fitted."""
        res = {k: sum(b[k] for b in blocks) for k in blocks[0] if k not in _FIT_ERRORS} if blocks else {}
        fitted = [max(b["n_bins"] - b["n_fallback"], 0) for b in blocks]
        for k in _FIT_ERRORS:
            res[k] = sum(b[k]*n for b, n in zip(blocks, fitted))/sum(fitted) if sum(fitted) else 0.0
        return res


_FIT_ERRORS = ("fit_err", "fit_lse_err")  # means over the bins fitted, not counts


def _read_stats(llm: "Llama") -> Any:
    ffi, lib = native()
    out = ffi.new("struct llama_kvp_summary_stats *")
    if lib.llama_kvp_summary(llm._native_ctx(), out) != 0:
        raise PolicyError(last_error())
    return out


def read_telemetry(llm: "Llama") -> SummaryTelemetry:
    """Summarise telemetry of a context: bins, centroids, fit errors, per layer x position kept/summarised/dropped."""
    out = _read_stats(llm)
    ffi, lib = native()
    ctx = llm._native_ctx()
    layers = llm.kv_stats().layers

    def positions(fn: Any, s: int) -> np.ndarray:
        n = fn(ctx, s, ffi.NULL, 0)
        buf = np.zeros(max(n, 1), dtype=np.int32)
        if n < 0 or fn(ctx, s, ffi.cast("int32_t *", ffi.from_buffer(buf)), n) < 0:
            raise RuntimeError(last_error())
        return buf[:n]

    per_layer = []
    for s, layer in enumerate(layers):
        pos = np.zeros(layer.n_cells, dtype=np.int32)
        bias = np.zeros(layer.n_cells, dtype=np.float32)
        if (lib.llama_kvp_layer_cell_pos(ctx, s, ffi.cast("int32_t *", ffi.from_buffer(pos)), pos.size) < 0
                or lib.llama_kvp_layer_cell_bias(ctx, s, ffi.cast("float *", ffi.from_buffer(bias)), bias.size) < 0):
            raise RuntimeError(last_error())
        per_layer.append((positions(lib.llama_kvp_layer_summarised, s), positions(lib.llama_kvp_layer_pending, s),
                          pos, bias))
    # as wide as the sequence (after a batch of sequences n_tokens is 0: as wide as what the layers hold)
    n_pos = max([int(llm.n_tokens), 1] + [int(a.max()) + 1 for layer in per_layer for a in layer[:3] if a.size])
    state = np.zeros((len(layers), n_pos), dtype=np.int8)
    for s, (done, pending, pos, bias) in enumerate(per_layer):
        state[s, done[done >= 0]] = SummaryTelemetry.SUMMARISED
        state[s, pending[pending >= 0]] = SummaryTelemetry.PENDING
        held = pos >= 0
        state[s, pos[held & (bias == 0)]] = SummaryTelemetry.KEPT
        state[s, pos[held & (bias != 0)]] = SummaryTelemetry.CENTROID
    return SummaryTelemetry(
        state=state, n_bins=int(out.n_bins), n_fallback=int(out.n_fallback), n_tokens=int(out.n_tokens),
        n_pending=int(out.n_pending), n_centroids=int(out.n_centroids), pending_bytes=int(out.pending_bytes),
        fit_err=float(out.fit_err), fit_lse_err=float(out.fit_lse_err), t_ms=float(out.t_ms),
        n_dropped=int(out.n_dropped))
