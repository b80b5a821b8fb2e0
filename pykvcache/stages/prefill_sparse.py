"""Prefill stage `sparse` (native/engine/stages/prefill-sparse.cpp)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Dict, List, Optional

import numpy as np

from .._native import last_error, native
from ..policies import PolicyError, Stage
from ..telemetry import SparseTelemetry

if TYPE_CHECKING:
    from ..llama import Llama


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

    @classmethod
    def server_stats(cls, llm: "Llama") -> Dict[str, Any]:
        """The prompt's key blocks computed against dense attention's, and the Dynamic heads, for the server's KV stats."""
        t = read_telemetry(llm)
        return {"n_ubatch": int(t.n_ubatch.sum()), "n_computed": int(t.n_computed.sum()),
                "n_visible": int(t.n_visible.sum()), "n_dynamic": int(t.dynamic.sum()), "density": t.total_density}

    @classmethod
    def server_stats_total(cls, blocks: List[Dict[str, Any]]) -> Dict[str, Any]:
        """The counts of several sequences added up, the density of their blocks together."""
        res = {k: sum(b[k] for b in blocks) for k in blocks[0] if k != "density"} if blocks else {}
        res["density"] = res["n_computed"]/res["n_visible"] if res.get("n_visible") else 1.0
        return res


def never_sparse(llm: "Llama") -> Optional[str]:
    """Why sparse prefill can never run sparse in this context (None if it can)."""
    pol = llm.kv_policy
    if pol is None or not pol.sparse:
        return None
    threshold = int(pol.to_native().threshold)
    n_ctx = llm._n_ctx  # a sequence's positions: no prompt has more cells in use
    if not pol.retains:
        # llama.cpp's own cache: a prompt's cells in use are its tokens; a completion's prompt leaves a position free
        if n_ctx > threshold:
            return None
        reach = (f"below sparse's threshold={threshold}" if n_ctx < threshold else
                 f"only a prompt of all {n_ctx} reaches sparse's threshold={threshold} (a completion's leaves room for "
                 f"its answer)")
        return (f"kv_policy 'none' with +sparse: this context holds at most n_ctx={n_ctx} tokens, {reach}, so its "
                f"prompts run dense (give a larger n_ctx, or a lower threshold)")
    # under a retention policy a prompt runs in chunks over its layers' cells: the budget, a prompt chunk and the
    # window; entropy's layer budgets move within [min_layer, max_layer] (max_layer 0: twice the mean) as prompts come
    layers = llm.kv_memory().layers
    head = max((layer.capacity - layer.budget for layer in layers), default=0)
    top = max((layer.budget for layer in layers), default=0)
    what = "the budget, a prompt chunk and the window"
    if pol.describe()["stages"].get("budget") == "entropy":
        n = pol.to_native()
        mean = n.budget if n.budget >= 1.0 else n.budget * n_ctx  # a fraction is of the prompt, at most n_ctx
        top = max(top, n.max_layer if n.max_layer > 0 else 2 * mean)
        what = "the largest layer budget, a prompt chunk and the window"
    most = int(min(top + head, n_ctx))
    if most >= threshold:
        return None
    name = pol.describe()["preset"]
    return (f"kv_policy {name!r} with +sparse: its layers hold at most {most} cells in this context ({what}), below "
            f"sparse's threshold={threshold}, so every prompt runs dense (sparse prefill pays over long attention "
            f"spans, as none+sparse has)")


def read_telemetry(llm: "Llama") -> SparseTelemetry:
    """Sparse prefill telemetry of a context: Rigid/Dynamic heads, budgets per segment, density per layer."""
    ffi, lib = native()
    ctx = llm._native_ctx()
    info = ffi.new("struct llama_kvp_sparse_info *")
    if lib.llama_kvp_sparse_info(ctx, info) != 0:
        raise PolicyError(last_error())
    n_layer, n_head, n_seg = int(info.n_layer), int(info.n_head), int(info.n_seg)
    counts = np.zeros((n_layer, 3), dtype=np.float32)
    dynamic = np.zeros((n_layer, n_head), dtype=np.float32)
    budgets = np.zeros((n_layer, n_seg, n_head), dtype=np.float32)
    entropy = np.zeros((n_layer, n_seg, n_head), dtype=np.float32)

    def ptr(a: np.ndarray) -> Any:
        return ffi.cast("float *", ffi.from_buffer(a))

    if lib.llama_kvp_sparse_telemetry(ctx, ptr(counts), ptr(dynamic), ptr(budgets), ptr(entropy), n_seg) < 0:
        raise RuntimeError(last_error())
    computed, visible = counts[:, 0].astype(np.float64), counts[:, 1].astype(np.float64)
    density = np.where(visible > 0, computed / np.maximum(visible, 1.0), 1.0)
    return SparseTelemetry(
        layers=np.array([s.layer for s in llm.kv_stats().layers], dtype=np.int32), density=density,
        n_ubatch=counts[:, 2].astype(np.int64), n_computed=computed, n_visible=visible,
        dynamic=dynamic > 0.5, budgets=budgets, entropy=entropy, segment=int(info.segment), block=int(info.block))
