"""The presets: named compositions of stages, with the keys each exposes in a spec (`snapkv:budget=0.1`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Dict, Type

from .policies import KVPolicy


@dataclass(frozen=True)
class FullCache(KVPolicy):
    """The full KV cache of llama.cpp, untouched (the baseline every policy is compared against)."""

    name: ClassVar[str] = "none"
    type_id: ClassVar[int] = 0


@dataclass(frozen=True)
class Observe(KVPolicy):
    """Full cache plus in-graph attention observation of the last `window` queries (score stage `window`, no budget).

    window: queries observed (the last `window` positions of the sequence)
    every:  also observe every `every` single-token decode steps (0: prompt batches only)
    decay:  factor of the accumulated mass at each observation (1: plain sum)
    """

    name: ClassVar[str] = "observe"
    type_id: ClassVar[int] = 1

    window: int = 32
    every: int = 0
    decay: float = 1.0


@dataclass(frozen=True)
class RetentionPolicy(KVPolicy):
    """Base of the presets that give each layer its own KV cache sized to a budget and evict tokens from it.

    `budget` is the mean number of tokens each layer keeps (sinks and recent window included): a count >= 1, or a
    fraction in (0, 1) of the prompt (of n_ctx before the first prompt). `chunk` is the number of prompt tokens
    processed per step: each layer's cache holds budget + chunk cells, so long prompts run in bounded memory.
    """


@dataclass(frozen=True)
class SinkRecent(RetentionPolicy):
    """StreamingLLM (uniform + recency + drop + dense).

    Every layer keeps the first `n_sink` and the last `n_recent` tokens."""

    name: ClassVar[str] = "sink_recent"
    type_id: ClassVar[int] = 2

    n_sink: int = 4
    n_recent: int = 252
    chunk: int = 128


@dataclass(frozen=True)
class SnapKV(RetentionPolicy):
    """SnapKV (uniform + window + every + drop + dense).

    A uniform budget; top-k by the attention of the last `window` queries, average-pooled over `pool` neighbouring
    positions; the window itself is kept. Scores are refreshed every `every` decode steps. With `guide`, each prompt
    chunk is scored by the prompt's last `window` tokens run behind it (as SnapKV scores a whole prompt by its end), not
    by the chunk's own end."""

    name: ClassVar[str] = "snapkv"
    type_id: ClassVar[int] = 3

    budget: float = 0.25
    window: int = 32
    pool: int = 5
    every: int = 16
    chunk: int = 128
    guide: bool = True


@dataclass(frozen=True)
class H2O(RetentionPolicy):
    """H2O (uniform + accumulated + every + drop + dense).

    A uniform budget; heavy hitters by attention accumulated over every step, plus `n_recent`."""

    name: ClassVar[str] = "h2o"
    type_id: ClassVar[int] = 4

    budget: float = 0.25
    n_recent: int = 32
    every: int = 1
    chunk: int = 128


@dataclass(frozen=True)
class Pyramid(RetentionPolicy):
    """PyramidKV (pyramid + window + every + drop + dense).

    Fixed layer budgets decreasing linearly from budget*(1+slope) to budget*(1-slope), with SnapKV scores (prompt chunks
    guided by the prompt's end)."""

    name: ClassVar[str] = "pyramid"
    type_id: ClassVar[int] = 5

    budget: float = 0.25
    slope: float = 0.5
    window: int = 32
    pool: int = 5
    every: int = 16
    chunk: int = 128
    guide: bool = True


@dataclass(frozen=True)
class EntropyLayerBudget(RetentionPolicy):
    """Entropy-guided layer budgets (entropy + window + every + drop + dense).

    The total budget of the first `split_share` of the layers is split across them in proportion to the mean per-head
    attention entropy observed on the prompt, each within [min_layer, max_layer] (0: budget/4 and 2*budget); the other
    layers, where retrieval reads, keep the mean budget. Each layer keeps one token set shared by its heads: `n_sink`
    sinks, the top `topk_share` of the rest by attention mass (heads and window queries aggregated, decayed by `decay`
    per observation), and the most recent tokens (at least `n_recent`). In the last `span_share` of the layers a
    `pool_max` share of the top-k goes to whole spans of `span_pool` tokens around the best-attended tokens (a number, a
    name), the rest of the top-k, and all of it in the other layers, by the average over `pool` positions; in the last
    `fill_share` of the layers holes of up to `fill` tokens between better-scored tokens are filled. The spans rank by
    the decayed sum of the observations, the other tokens by a `fresh` share of the last observation alone; each token's
    mass is weighted by the norm of its value vectors to the power `vnorm`. With `guide`, prompt chunks are scored by
    the prompt's last `window` tokens (see `SnapKV`)."""

    name: ClassVar[str] = "entropy"
    type_id: ClassVar[int] = 6

    budget: float = 0.25
    min_layer: int = 0
    max_layer: int = 0
    split_share: float = 0.5
    n_sink: int = 4
    n_recent: int = 16
    topk_share: float = 1.0
    window: int = 32
    pool: int = 1
    pool_max: float = 0.5
    span_pool: int = 9
    span_share: float = 1.0
    fill: int = 4
    fill_share: float = 0.5
    vnorm: float = 1.0
    fresh: float = 1.0
    every: int = 16
    decay: float = 0.5
    chunk: int = 128
    guide: bool = True


@dataclass(frozen=True)
class Freeze(RetentionPolicy):
    """ASR-KF soft rolling freeze (uniform + accumulated + freeze + host + dense).

    Every token is kept (the budget is the context), but at each decode step a token whose attention stays below `tau`/n
    freezes into the host tier for floor(sqrt(c)/`k`) observation periods of `every` steps, c its low observations among
    the last `hist` steps; the last `n_recent` tokens never freeze. The host tier holds at most `limit` tokens per layer
    (0: the context size). With `z` > 0 the entropy recovery ladder watches each generated token (see
    `FreezeSchedule`)."""

    name: ClassVar[str] = "freeze"
    type_id: ClassVar[int] = 7

    n_recent: int = 32
    tau: float = 0.1
    k: int = 2
    hist: int = 128
    every: int = 4
    z: float = 0.0
    rewalk: int = 0
    span: int = 16
    limit: int = 0
    chunk: int = 128


PRESETS: Dict[str, Type[KVPolicy]] = {
    cls.name: cls for cls in (FullCache, Observe, SinkRecent, SnapKV, H2O, Pyramid, EntropyLayerBudget, Freeze)
}
