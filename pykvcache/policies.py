"""KV-cache policies: plain dataclasses, validated by the native engine, parsed from specs like `observe:window=32`."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Dict, Type

from ._native import last_error, native


class PolicyError(ValueError):
    """A policy has invalid parameters, or cannot run on the given model or context."""


@dataclass(frozen=True)
class KVPolicy:
    """Base of all policies: `name` is the spec name, the fields are the spec keys."""

    name: ClassVar[str] = ""
    type_id: ClassVar[int] = 0
    observes: ClassVar[bool] = False  # records attention telemetry
    retains: ClassVar[bool] = False   # keeps one budgeted KV cache per layer (evicts tokens)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", int) and (isinstance(value, bool) or not isinstance(value, int)):
                raise PolicyError(f"{self.name}: {f.name} must be an integer (got {value!r})")
            if f.type in ("float", float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise PolicyError(f"{self.name}: {f.name} must be a number (got {value!r})")
            if f.type in ("bool", bool) and value not in (True, False):
                raise PolicyError(f"{self.name}: {f.name} must be True or False (got {value!r})")
        self.to_native()  # the native engine validates the values

    def to_native(self) -> Any:
        """Return the native `struct llama_kvp_policy` of this policy (validated)."""
        ffi, lib = native()
        p = ffi.new("struct llama_kvp_policy *", lib.llama_kvp_policy_default(self.type_id))
        for f in fields(self):
            value = getattr(self, f.name)
            setattr(p, f.name, int(value) if isinstance(value, bool) else value)
        if lib.llama_kvp_policy_validate(p) != 0:
            raise PolicyError(last_error())
        return p

    def spec(self) -> str:
        """Return the canonical spec string, e.g. `observe:window=32,every=0,decay=1`."""
        ffi, lib = native()
        buf = ffi.new("char[]", 512)
        lib.llama_kvp_policy_to_string(self.to_native(), buf, 512)
        return ffi.string(buf).decode()



@dataclass(frozen=True)
class FullCache(KVPolicy):
    """The full KV cache of llama.cpp, untouched (the baseline every policy is compared against)."""

    name: ClassVar[str] = "none"
    type_id: ClassVar[int] = 0


@dataclass(frozen=True)
class Observe(KVPolicy):
    """Full cache plus in-graph attention observation of the last `window` queries.

    window: queries observed (the last `window` positions of the sequence)
    every:  also observe every `every` single-token decode steps (0: prompt batches only)
    decay:  factor of the accumulated mass at each observation (1: plain sum)
    """

    name: ClassVar[str] = "observe"
    type_id: ClassVar[int] = 1

    window: int = 32
    every: int = 0
    decay: float = 1.0

    observes: ClassVar[bool] = True


@dataclass(frozen=True)
class RetentionPolicy(KVPolicy):
    """Base of the policies that give each layer its own KV cache sized to a budget and evict tokens from it.

    `budget` is the mean number of tokens each layer keeps (sinks and recent window included): a count >= 1, or a
    fraction in (0, 1) of the prompt (of n_ctx before the first prompt). `chunk` is the number of prompt tokens
    processed per step: each layer's cache holds budget + chunk cells, so long prompts run in bounded memory.
    """

    observes: ClassVar[bool] = True
    retains: ClassVar[bool] = True


@dataclass(frozen=True)
class SinkRecent(RetentionPolicy):
    """StreamingLLM: every layer keeps the first `n_sink` and the last `n_recent` tokens."""

    name: ClassVar[str] = "sink_recent"
    type_id: ClassVar[int] = 2

    n_sink: int = 4
    n_recent: int = 252
    chunk: int = 128

    observes: ClassVar[bool] = False


@dataclass(frozen=True)
class SnapKV(RetentionPolicy):
    """SnapKV-style: a uniform budget; top-k by the attention of the last `window` queries, average-pooled over
    `pool` neighbouring positions; the window itself is kept. Scores are refreshed every `every` decode steps. With
    `guide`, each prompt chunk is scored by the prompt's last `window` tokens run behind it (as SnapKV scores a whole
    prompt by its end), not by the chunk's own end."""

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
    """H2O-style: a uniform budget; heavy hitters by attention accumulated over every step, plus `n_recent`."""

    name: ClassVar[str] = "h2o"
    type_id: ClassVar[int] = 4

    budget: float = 0.25
    n_recent: int = 32
    every: int = 1
    chunk: int = 128


@dataclass(frozen=True)
class Pyramid(RetentionPolicy):
    """PyramidKV-style: fixed layer budgets decreasing linearly from budget*(1+slope) to budget*(1-slope), with
    SnapKV scores (prompt chunks guided by the prompt's end, see `SnapKV`)."""

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
    """Entropy-guided layer budgets: the total budget is split across layers in proportion to the mean per-head
    attention entropy observed on the prompt, each layer within [min_layer, max_layer] (0: budget/4 and 2*budget).
    Each layer keeps one token set shared by its heads: `n_sink` sinks, the top `topk_share` of the rest by attention
    mass (heads and window queries aggregated, decayed by `decay` per observation, max-pooled over `pool` neighbouring
    positions so that a whole span such as a number is kept), and the most recent tokens (at least `n_recent`).
    With `guide`, prompt chunks are scored by the prompt's last `window` tokens (see `SnapKV`)."""

    name: ClassVar[str] = "entropy"
    type_id: ClassVar[int] = 6

    budget: float = 0.25
    min_layer: int = 0
    max_layer: int = 0
    n_sink: int = 4
    n_recent: int = 16
    topk_share: float = 0.5
    window: int = 32
    pool: int = 9
    every: int = 16
    decay: float = 0.5
    chunk: int = 128
    guide: bool = True


POLICIES: Dict[int, Type[KVPolicy]] = {
    cls.type_id: cls for cls in (FullCache, Observe, SinkRecent, SnapKV, H2O, Pyramid, EntropyLayerBudget)
}


def from_native(p: Any) -> KVPolicy:
    """Build the dataclass of a native `struct llama_kvp_policy`."""
    cls = POLICIES.get(int(p.type))
    if cls is None:
        raise PolicyError(f"unknown native policy type {p.type}")
    kwargs = {f.name: getattr(p, f.name) for f in fields(cls)}
    for f in fields(cls):
        if f.type in ("bool", bool):
            kwargs[f.name] = bool(kwargs[f.name])
        if f.type in ("float", float):
            x = round(float(kwargs[f.name]), 6)
            kwargs[f.name] = int(x) if f.name == "budget" and x >= 1 else x
    return cls(**kwargs)


def parse_policy(spec: str) -> KVPolicy:
    """Parse a policy spec such as `observe:window=32,every=4` (the parser is the native one, shared with kvbench)."""
    if not isinstance(spec, str):
        raise PolicyError(f"a policy spec must be a string (got {type(spec).__name__})")
    ffi, lib = native()
    p = ffi.new("struct llama_kvp_policy *")
    if lib.llama_kvp_policy_parse(spec.encode(), p) != 0:
        raise PolicyError(last_error())
    return from_native(p)


def as_policy(policy: "KVPolicy | str | None") -> "KVPolicy | None":
    """Accept a policy object, a spec string or None."""
    if policy is None or isinstance(policy, KVPolicy):
        return policy
    if isinstance(policy, str):
        return parse_policy(policy)
    raise PolicyError(f"kv_policy must be a KVPolicy, a spec string or None (got {type(policy).__name__})")
