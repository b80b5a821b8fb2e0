"""Token-level telemetry of a context: attention entropy per layer x head, mass per layer x position, KV bytes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import numpy as np

PLOT_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg")  # a plot's format is its path's suffix


@dataclass(frozen=True)
class LayerStats:
    """KV cache of one layer, as allocated in the real ggml buffers."""

    layer: int
    n_cells: int
    n_used: int
    k_bytes: int
    v_bytes: int
    on_device: bool

    def row(self) -> Dict[str, Any]:
        """The layer's entry in the server's KV stats (JSON-ready)."""
        return {"layer": self.layer, "n_cells": self.n_cells, "n_used": self.n_used,
                "bytes": self.k_bytes + self.v_bytes, "on_device": self.on_device}


@dataclass(frozen=True)
class KVStats:
    """KV-cache memory of a context: per layer and in total."""

    layers: List[LayerStats]

    @property
    def k_bytes(self) -> int:
        """Bytes of all K tensors."""
        return sum(s.k_bytes for s in self.layers)

    @property
    def v_bytes(self) -> int:
        """Bytes of all V tensors."""
        return sum(s.v_bytes for s in self.layers)

    @property
    def total_bytes(self) -> int:
        """Bytes of all K and V tensors."""
        return self.k_bytes + self.v_bytes

    @property
    def n_cells(self) -> int:
        """Cells summed over layers."""
        return sum(s.n_cells for s in self.layers)

    @property
    def n_used(self) -> int:
        """Used cells summed over layers."""
        return sum(s.n_used for s in self.layers)

    def to_dict(self) -> Dict[str, Any]:
        """Plain-data form (for JSON)."""
        return {
            "layers": [s.__dict__ for s in self.layers],
            "k_bytes": self.k_bytes,
            "v_bytes": self.v_bytes,
            "total_bytes": self.total_bytes,
        }

    def summary(self) -> str:
        """One line: layers, cells used, K + V bytes."""
        mib = 1024.0 * 1024.0
        caps = sorted({s.n_cells for s in self.layers})
        if len(caps) <= 1:
            cap = caps[0] if caps else 0
            used = sorted({s.n_used for s in self.layers})
            each = f"{used[0]} used" if len(used) <= 1 else f"{used[0]}-{used[-1]} used, {self.n_used} in all"
            cells = f"{len(self.layers)} layers x {cap} cells ({each if used else '0 used'})"
        else:
            cells = f"{len(self.layers)} layers, {caps[0]}-{caps[-1]} cells each ({self.n_used} used in all)"
        return (
            f"KV cache: {cells}, "
            f"K {self.k_bytes / mib:.2f} MiB + V {self.v_bytes / mib:.2f} MiB = {self.total_bytes / mib:.2f} MiB"
        )


@dataclass(frozen=True)
class LayerBudget:
    """Budget of one layer under a retention policy."""

    layer: int
    budget: int
    capacity: int
    n_used: int
    entropy: float
    n_evicted: int


@dataclass(frozen=True)
class KVMemory:
    """KV memory of a context now and at its peak (bytes of the real ggml buffers), with per-layer budgets.

    `host_bytes` / `host_bytes_peak`: the fate stage's host memory, not in `bytes` (the host tier's tokens, or
    summarise's pending bins as allocated)."""

    bytes: int
    bytes_peak: int
    per_layer: bool
    budget: int
    n_prompt: int
    chunk: int
    n_evicted: int
    n_resize: int
    n_budget: int
    layers: List[LayerBudget]
    host_bytes: int = 0
    host_bytes_peak: int = 0
    n_active: int = 0  # cells in use, all layers of the current sequence (no retention policy: of llama.cpp's cache)
    seq: int = 0  # the current sequence (of n_seq_max; the one whose tokens were decoded last, or selected)

    @property
    def budgets(self) -> List[int]:
        """Tokens kept per layer."""
        return [b.budget for b in self.layers]

    def to_dict(self) -> Dict[str, Any]:
        """Plain-data form (for JSON)."""
        d = dict(self.__dict__)
        d["layers"] = [b.__dict__ for b in self.layers]
        return d


@dataclass(frozen=True, eq=False)
class SparseTelemetry:
    """Sparse prefill of the sequence's prompt (prefill stage `sparse`), per layer with a KV cache.

    density[n_layer]               key blocks computed / key blocks dense attention computes, over the prompt
                                   ubatches that ran sparse (1.0 for a layer that stayed dense)
    n_ubatch[n_layer]              prompt ubatches that ran sparse
    dynamic[n_layer, n_head]       True for a Dynamic head, False for a Rigid one
    budgets[n_layer, n_seg, n_head] tokens per segment and head (0 for segments that ran dense)
    entropy[n_layer, n_seg, n_head] normalised block entropy per segment and head
    """

    layers: np.ndarray
    density: np.ndarray
    n_ubatch: np.ndarray
    n_computed: np.ndarray
    n_visible: np.ndarray
    dynamic: np.ndarray
    budgets: np.ndarray
    entropy: np.ndarray
    segment: int
    block: int

    @property
    def total_density(self) -> float:
        """Key blocks computed / key blocks of dense attention, all sparse layers together (1.0 if none)."""
        vis = float(self.n_visible.sum())
        return float(self.n_computed.sum()) / vis if vis > 0 else 1.0

    def to_dict(self) -> Dict[str, Any]:
        """Plain-data form (for JSON)."""
        return {
            "layers": self.layers.tolist(),
            "density": self.density.tolist(),
            "total_density": self.total_density,
            "n_ubatch": self.n_ubatch.tolist(),
            "dynamic": self.dynamic.astype(int).tolist(),
            "budgets": self.budgets.tolist(),
            "entropy": self.entropy.tolist(),
            "segment": self.segment,
            "block": self.block,
        }

    def line(self) -> str:
        """One line: the key blocks computed, the layers that ran sparse and the Dynamic heads."""
        n_sparse = int((self.n_ubatch > 0).sum())
        if n_sparse == 0:
            return ("sparse prefill: every prompt ubatch ran dense (below the threshold, too short, or without flash "
                    "attention)")
        heads = self.dynamic[self.n_ubatch > 0]
        return (f"sparse prefill: key blocks computed {self.total_density:.3f} of dense attention's, over "
                f"{int(self.n_ubatch.sum())} prompt ubatches x layers in {n_sparse} of {len(self.layers)} layers (the "
                f"others dense); Dynamic heads {int(heads.sum())} of their {heads.size}")

    def plot_axes(self, ax_heads: Any, ax_budget: Any, ax_density: Any, fig: Any) -> None:
        """Draw Rigid/Dynamic heads, mean budget per layer x segment and density per layer on three axes."""
        ax_heads.imshow(self.dynamic.astype(float), aspect="auto", cmap="coolwarm", origin="lower", vmin=0, vmax=1)
        ax_heads.set_title("sparse prefill heads (red: Dynamic, blue: Rigid)")
        ax_heads.set_xlabel("head")
        ax_heads.set_ylabel("layer")
        im = ax_budget.imshow(self.budgets.mean(axis=2), aspect="auto", cmap="viridis", origin="lower", interpolation="nearest")
        ax_budget.set_title(f"budget per segment of {self.segment} tokens (tokens, head mean)")
        ax_budget.set_xlabel("segment")
        ax_budget.set_ylabel("layer")
        fig.colorbar(im, ax=ax_budget)
        ax_density.barh(np.arange(len(self.density)), self.density, color="tab:green")
        ax_density.set_xlim(0, 1)
        ax_density.set_title(f"key blocks computed (all: {self.total_density:.2f})")
        ax_density.set_xlabel("density")
        ax_density.set_ylabel("layer")


def _plot_title(policy: str) -> str:
    """A plot's title: the policy's canonical spec, wrapped (it names every key)."""
    import textwrap

    return "\n".join(textwrap.wrap(f"pykvcache telemetry  [{policy}]", 150))


def _plot_state_map(ax: Any, fig: Any, state: np.ndarray, colors: List[str], labels: List[str], title: str) -> None:
    """Draw a layer x position map of small integer states (0..len(colors)-1) with a labelled colour bar."""
    from matplotlib.colors import ListedColormap

    n = len(colors)
    im = ax.imshow(state, aspect="auto", cmap=ListedColormap(colors), vmin=-0.5, vmax=n - 0.5, origin="lower",
                   interpolation="nearest")
    ax.set_title(title)
    ax.set_xlabel("position")
    ax.set_ylabel("layer")
    bar = fig.colorbar(im, ax=ax, ticks=list(range(n)))
    bar.ax.set_yticklabels(labels)


@dataclass(frozen=True)
class KVPerf:
    """Host time the policy spent around llama.cpp's graphs (ms).

    Summed since the context was created or kv_perf_reset(): before each ubatch deciding and evicting (`t_prepare_ms`,
    the fate stage's work included) and placing its cells (`t_slot_ms`), setting the graph inputs it adds
    (`t_input_ms`), and settling a prompt's end (`t_settle_ms`). Apart (`t_wait_ms`, not in those): the time it waited
    in them for a GPU to finish earlier graphs before reading what they wrote; ~0 on the CPU (over RPC the wait stays
    in the parts: ggml-rpc's synchronize does not wait for the server)."""

    t_prepare_ms: float
    t_slot_ms: float
    t_input_ms: float
    t_settle_ms: float
    n_ubatch: int
    t_wait_ms: float = 0.0

    @property
    def t_ms(self) -> float:
        """All of the policy's own host time (the waits apart)."""
        return self.t_prepare_ms + self.t_slot_ms + self.t_input_ms + self.t_settle_ms

    def to_dict(self) -> Dict[str, Any]:
        """Plain-data form (for JSON)."""
        return dict(self.__dict__, t_ms=self.t_ms)


@dataclass(frozen=True, eq=False)
class SummaryTelemetry:
    """The summarise fate (fate stage `summarise`): bins of leaving tokens replaced by fitted centroid cells.

    state[n_layer, n_pos]  per layer and position: 0 dropped (its bin's centroids all left, or its fit failed),
                           1 kept, 2 summarised (its bin became centroids and one of them is held), 3 a centroid cell
                           sits there (at one of its bin's last `rank` positions), 4 pending (waiting in the bin, in
                           host memory)
    `n_dropped`: centroid cells dropped (evicted in turn, or no cell left for them when their bin was fitted).
    """

    state: np.ndarray
    n_bins: int
    n_fallback: int
    n_tokens: int
    n_pending: int
    n_centroids: int
    pending_bytes: int
    fit_err: float
    fit_lse_err: float
    t_ms: float
    n_dropped: int = 0

    DROPPED: ClassVar[int] = 0
    KEPT: ClassVar[int] = 1
    SUMMARISED: ClassVar[int] = 2
    CENTROID: ClassVar[int] = 3
    PENDING: ClassVar[int] = 4

    def to_dict(self) -> Dict[str, Any]:
        """Plain-data form (for JSON)."""
        d = {k: v for k, v in self.__dict__.items() if k != "state"}
        d["state"] = self.state.astype(int).tolist()
        return d

    def line(self) -> str:
        """One line of the counters."""
        return (f"summarise: {self.n_bins} bins fitted ({self.n_tokens} tokens, {self.n_fallback} dropped for a failed "
                f"fit), {self.n_centroids} centroids held, {self.n_dropped} centroids dropped, {self.n_pending} tokens "
                f"pending; fit error {self.fit_err:.3f} (log mass {self.fit_lse_err:.3f} nats), {self.t_ms:.1f} ms")

    def plot_axes(self, ax: Any, fig: Any) -> None:
        """Draw the layer x position map of dropped, kept, summarised, centroid and pending tokens on one axis."""
        _plot_state_map(ax, fig, self.state, ["#d9d9d9", "#1f77b4", "#a1d99b", "#d62728", "#fdae6b"],
                        ["dropped", "kept", "summarised", "centroid", "pending"],
                        f"summarise: {self.n_bins} bins, {self.n_centroids} centroids held, {self.n_dropped} dropped, "
                        f"fit error {self.fit_err:.2f}")


@dataclass(frozen=True, eq=False)
class KVLayer:
    """The cells of one KV layer as they are now.

    pos[n_cells] (-1: empty), bias[n_cells] (the attention mask's bias: log of the tokens a centroid cell stands for, 0
    for a token's own cell), k[n_cells, n_head_kv, d] and v[n_cells, n_head_kv, dv] (float32)."""

    pos: np.ndarray
    bias: np.ndarray
    k: np.ndarray
    v: np.ndarray

    def held(self, below: Optional[int] = None) -> np.ndarray:
        """Which cells hold a token (at a position < below)."""
        return (self.pos >= 0) & (self.pos < below) if below is not None else self.pos >= 0

    def probs(self, q: np.ndarray, scale: float, below: Optional[int] = None,
              q_pos: Optional[np.ndarray] = None) -> np.ndarray:
        """Attention probabilities [n_q, n_head, n_held] of queries q[n_q, n_head, d] over the held cells (self.held).

        Each query sees positions up to its own (q_pos, when given)."""
        held = self.held(below)
        g = q.shape[1] // self.k.shape[1]  # query heads per KV head (GQA: query head h reads KV head h // g)
        k = np.repeat(self.k[held].astype(np.float64), g, axis=1)
        logits = np.einsum("qhd,nhd->qhn", q.astype(np.float64), k) * scale + self.bias[held].astype(np.float64)
        if q_pos is not None:
            logits = np.where(self.pos[held][None, None, :] <= np.asarray(q_pos)[:, None, None], logits, -np.inf)
        p = np.exp(logits - logits.max(axis=-1, keepdims=True))
        return p / p.sum(axis=-1, keepdims=True)

    def attend(self, q: np.ndarray, scale: float, below: Optional[int] = None,
               q_pos: Optional[np.ndarray] = None) -> np.ndarray:
        """Attention output [n_q, n_head, dv] of queries q[n_q, n_head, d] over the held cells (as probs)."""
        g = q.shape[1] // self.v.shape[1]
        v = np.repeat(self.v[self.held(below)].astype(np.float64), g, axis=1)
        return np.einsum("qhn,nhd->qhd", self.probs(q, scale, below, q_pos), v)


@dataclass(frozen=True, eq=False)
class HostTelemetry:
    """The host tier (fate stage `host`, schedule stage `freeze`).

    Tokens moved out of the layer caches into host memory and back.

    state[n_layer, n_pos]  per layer and position: 0 dropped (gone for good), 1 active (in the layer's cache),
                           2 frozen (in the host tier with a timer), 3 cold (in the host tier, sent by the budget)
    """

    state: np.ndarray
    n_active: int
    n_host: int
    n_frozen: int
    host_bytes: int
    host_bytes_peak: int
    n_freeze: int
    n_thaw: int
    n_evict: int
    n_dropped: int
    n_steps: int
    t_ms: float
    n_rerank: int = 0
    n_promote: int = 0
    n_recover: Tuple[int, int, int, int] = (0, 0, 0, 0)

    DROPPED: ClassVar[int] = 0
    ACTIVE: ClassVar[int] = 1
    FROZEN: ClassVar[int] = 2
    COLD: ClassVar[int] = 3

    def to_dict(self) -> Dict[str, Any]:
        """Plain-data form (for JSON)."""
        d = {k: v for k, v in self.__dict__.items() if k != "state"}
        d["state"] = self.state.astype(int).tolist()
        return d

    def plot_axes(self, ax: Any, fig: Any) -> None:
        """Draw the layer x position map of active, frozen, cold and dropped tokens on one axis."""
        _plot_state_map(ax, fig, self.state, ["#d9d9d9", "#1f77b4", "#9ecae1", "#fdae6b"],
                        ["dropped", "active", "frozen", "cold"],
                        f"host tier: {self.n_active} active, {self.n_frozen} frozen, "
                        f"{self.n_host - self.n_frozen} cold tokens")


@dataclass(eq=False)
class KVTelemetry:
    """Attention observation of the last `window` queries, with positions in ascending order.

    entropy[n_layer, n_head]      mean entropy (nats) of each query head's attention over the window queries
    mass[n_layer, n_pos]          mean attention mass per position (averaged over heads and window queries); only
                                  the positions still held, so where decode steps observed and the policy evicted
                                  since, what earlier window queries gave the evicted ones is missing (sum below 1);
                                  a token thawed from the host tier since carries the mass it had when it froze
                                  (the score stage's), so between observations a layer can sum above 1
    mass_acc[n_layer, n_pos]      accumulated (decayed) head-mean mass over all observations so far
    mass_per_head[n_layer, n_head, n_pos]  only when asked for (per_head=True)
    pos                           the last query position of the observation behind mass (-1: none yet)
    entropy_pos                   the same for entropy: below pos where the policy's decode observations score by the
                                  head-mean mass alone (snapkv, pyramid, entropy), so the entropy is an earlier one's
    retained[n_layer, n_tokens]   True where a layer still holds a position (retention policies)
    """

    layers: np.ndarray
    positions: np.ndarray
    entropy: np.ndarray
    mass: np.ndarray
    mass_acc: np.ndarray
    window: int
    n_queries: int
    n_obs: int
    mass_per_head: Optional[np.ndarray] = None
    policy: str = ""
    kv_bytes: List[int] = field(default_factory=list)
    budgets: Optional[List[int]] = None
    retained: Optional[np.ndarray] = None
    sparse: Optional[SparseTelemetry] = None
    summary: Optional[SummaryTelemetry] = None
    host: Optional[HostTelemetry] = None
    pos: int = -1
    entropy_pos: int = -1

    @property
    def n_layer(self) -> int:
        """Observed layers."""
        return int(self.entropy.shape[0])

    @property
    def n_head(self) -> int:
        """Query heads per layer."""
        return int(self.entropy.shape[1])

    def to_dict(self) -> Dict[str, Any]:
        """Plain-data form of all arrays and scalars."""
        d: Dict[str, Any] = {
            "policy": self.policy,
            "window": self.window,
            "n_queries": self.n_queries,
            "n_obs": self.n_obs,
            "pos": self.pos,
            "entropy_pos": self.entropy_pos,
            "layers": self.layers.tolist(),
            "positions": self.positions.tolist(),
            "entropy": self.entropy.tolist(),
            "mass": self.mass.tolist(),
            "mass_acc": self.mass_acc.tolist(),
            "kv_bytes": list(self.kv_bytes),
        }
        if self.mass_per_head is not None:
            d["mass_per_head"] = self.mass_per_head.tolist()
        if self.budgets is not None:
            d["budgets"] = list(self.budgets)
        if self.retained is not None:
            d["retained"] = self.retained.astype(int).tolist()
        if self.sparse is not None:
            d["sparse"] = self.sparse.to_dict()
        if self.summary is not None:
            d["summary"] = self.summary.to_dict()
        if self.host is not None:
            d["host"] = self.host.to_dict()
        return d

    def to_json(self, path: "str | Path | None" = None) -> str:
        """Return the telemetry as JSON, also writing it to `path` if given."""
        text = json.dumps(self.to_dict())
        if path is not None:
            Path(path).write_text(text)
        return text

    def mass_by_position(self) -> np.ndarray:
        """mass[n_layer, last position + 1]: column p is position p, NaN where no layer holds it any more."""
        n_pos = int(self.positions[-1]) + 1 if len(self.positions) > 0 else 0
        res = np.full((self.n_layer, n_pos), np.nan)
        res[:, self.positions] = self.mass
        return res

    def plot(self, path: "str | Path") -> Path:
        """Write a PNG: layer x head entropy heatmap and layer x position mass map."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = Path(path)
        if path.is_dir() or path.suffix.lower() not in PLOT_SUFFIXES:  # matplotlib would write another file
            raise ValueError(f"plot path '{path}' needs a file name with one of the suffixes {', '.join(PLOT_SUFFIXES)}")
        if self.entropy.size == 0 and self.sparse is not None:  # sparse prefill only, nothing observed
            fig, axes = plt.subplots(1, 3, figsize=(17, 5), gridspec_kw={"width_ratios": [1, 2.2, 1]})
            self.sparse.plot_axes(axes[0], axes[1], axes[2], fig)
            fig.suptitle(_plot_title(self.policy))
            fig.tight_layout()
            fig.savefig(path, dpi=110)
            plt.close(fig)
            return path
        if self.sparse is not None:
            fig, grid = plt.subplots(2, 3, figsize=(17, 10), gridspec_kw={"width_ratios": [1, 2.2, 1]})
            ax0, ax1, ax2 = grid[0]
            self.sparse.plot_axes(grid[1][0], grid[1][1], grid[1][2], fig)
            if self.budgets is not None:
                layer_ids = np.arange(len(self.budgets))
                ax2.barh(layer_ids, self.budgets, color="tab:blue")
                ax2.set_title("budget per layer")
                ax2.set_xlabel("budget (tokens)")
                ax2.set_ylabel("layer")
            else:
                ax2.axis("off")
        elif self.host is not None or self.summary is not None:  # the fate stage's map instead of the budgets
            fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(20, 5), gridspec_kw={"width_ratios": [1, 2.2, 2.2]})
            (self.host or self.summary).plot_axes(ax2, fig)
        elif self.budgets is not None:
            fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(17, 5), gridspec_kw={"width_ratios": [1, 2.2, 1]})
            layer_ids = np.arange(len(self.budgets))
            ax2.barh(layer_ids, self.budgets, color="tab:blue")
            ax2.set_title("budget per layer")
            ax2.set_xlabel("budget (tokens)")
            ax2.set_ylabel("layer")
            ax2.set_ylim(-0.5, len(self.budgets) - 0.5)
        else:
            fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1, 2.2]})
        if self.entropy.size > 0:
            im0 = ax0.imshow(self.entropy, aspect="auto", cmap="viridis", origin="lower")
            fig.colorbar(im0, ax=ax0)
        else:  # a policy that observes nothing, or nothing observed yet
            ax0.text(0.5, 0.5, "nothing observed", ha="center", va="center", transform=ax0.transAxes)
        ax0.set_title("attention entropy (nats)" + (f", queries up to position {self.entropy_pos}"
                                                     if 0 <= self.entropy_pos < self.pos else ""))
        ax0.set_xlabel("head")
        ax0.set_ylabel("layer")

        if len(self.positions) > 0:
            # one column per position, so that x is the token's position (and lines up with the host tier's map):
            # positions that no layer holds any more are left blank
            by_pos = self.mass_by_position()
            if self.retained is not None:  # a position this layer evicted is not a token of no attention
                n = min(by_pos.shape[1], self.retained.shape[1])
                by_pos[:, :n] = np.where(self.retained[:, :n], by_pos[:, :n], np.nan)
            mass = np.log10(np.maximum(by_pos, 1e-6))
            cmap = matplotlib.colormaps["magma"].with_extremes(bad="#d9d9d9")
            im1 = ax1.imshow(mass, aspect="auto", cmap=cmap, origin="lower", interpolation="nearest",
                             extent=(-0.5, mass.shape[1] - 0.5, -0.5, self.n_layer - 0.5))
            ax1.set_title(f"attention mass of the last {self.n_queries} queries, up to position {self.pos} (log10, head "
                          "mean; grey: not held by the layer)")
            fig.colorbar(im1, ax=ax1)
        elif self.retained is not None and self.retained.size > 0:  # a policy that observes nothing: what it keeps
            ax1.imshow(self.retained, aspect="auto", cmap=matplotlib.colors.ListedColormap(["#d9d9d9", "#1f77b4"]),
                       origin="lower", interpolation="nearest", vmin=0, vmax=1)
            ax1.set_title("positions held per layer (blue; no attention observed)")
        else:
            ax1.text(0.5, 0.5, "nothing observed yet", ha="center", va="center", transform=ax1.transAxes)
            ax1.set_title("attention mass")
        ax1.set_xlabel("position")
        ax1.set_ylabel("layer")
        fig.suptitle(_plot_title(self.policy))
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path
