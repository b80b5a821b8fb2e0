"""KV-cache policies: presets and stages as small dataclasses that compose, with one spec grammar.

A policy is a composition of stages, one per slot (budget, score, schedule, fate, prefill). The presets (`SnapKV`,
`EntropyLayerBudget`, ...) are named compositions; `preset + stage` replaces the preset's stage in that slot:

    SnapKV(budget=0.1) + EntropyBudget(min_layer=64)    # spec "snapkv:budget=0.1+entropy:min_layer=64"
    SnapKV(budget=0.1) + (LatentSchedule() + HostFate())  # stages that need each other, added together

The spec grammar is parsed and validated by the native engine (shared with the CLI and kvbench); `spec()` returns
the canonical string, which parses back to an equal policy (a float key at the float32 precision the engine holds:
`SnapKV(budget=1/3).spec()` says 0.33333334).
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any, ClassVar, Dict, List, Optional, Tuple, Type

import numpy as np

from ._native import last_error, native

SLOTS = ("budget", "score", "schedule", "fate", "prefill")


class PolicyError(ValueError):
    """A policy has invalid parameters, or cannot run on the given model or context."""


def _check_field_types(owner: str, obj: Any) -> None:
    for f in fields(obj):
        value = getattr(obj, f.name)
        kind = str(f.type)
        if value is None and "Optional" in kind:
            continue
        if "int" in kind and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
            raise PolicyError(f"{owner}: {f.name} must be an integer (got {value!r})")
        if "float" in kind and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise PolicyError(f"{owner}: {f.name} must be a number (got {value!r})")
        if "bool" in kind and not (_is_bool(value) or (isinstance(value, numbers.Integral) and value in (0, 1))):
            raise PolicyError(f"{owner}: {f.name} must be True or False (got {value!r})")


def _is_bool(value: Any) -> bool:
    return isinstance(value, (bool, np.bool_))


def _format_value(value: Any) -> str:
    if _is_bool(value):
        return "1" if value else "0"
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):  # numpy's too
        return repr(float(value) + 0.0) if math.isfinite(value) else str(float(value))  # -0.0 prints as 0.0
    return str(value)


def _part(name: str, obj: Any) -> str:
    items = [f"{f.name}={_format_value(getattr(obj, f.name))}" for f in fields(obj) if getattr(obj, f.name) is not None]
    return name + (":" + ",".join(items) if items else "")


def _native_parse(spec: str) -> Any:
    ffi, lib = native()
    p = ffi.new("struct llama_kvp_policy *")
    if lib.llama_kvp_policy_parse(spec.encode(), p) != 0:
        raise PolicyError(last_error())
    return p


def _native_str(p: Any) -> str:
    ffi, lib = native()
    n = lib.llama_kvp_policy_to_string(p, ffi.NULL, 0)
    buf = ffi.new("char[]", n + 1)
    lib.llama_kvp_policy_to_string(p, buf, n + 1)
    return ffi.string(buf).decode()


class Policy:
    """What every policy (a preset, or a preset with replaced stages) offers."""

    def raw_spec(self) -> str:
        """Return the spec of this object as written (not yet canonical)."""
        raise NotImplementedError

    def to_native(self) -> Any:
        """Return the native `struct llama_kvp_policy` of this policy (validated)."""
        return _native_parse(self.raw_spec())

    def spec(self) -> str:
        """Return the canonical spec string, e.g. `observe:window=32,every=0,decay=1`."""
        return _native_str(self.to_native())

    def __str__(self) -> str:
        """The canonical spec (as `spec()`), so that a logged policy can be given to `parse_policy` or `--policy`."""
        return self.spec()

    def describe(self) -> Dict[str, Any]:
        """Return the preset, the stage of each slot and the observes/retains/guides flags."""
        return dict(self._desc, stages=dict(self._desc["stages"]))

    @cached_property
    def _desc(self) -> Dict[str, Any]:
        # once per (immutable) policy object: Llama.eval reads the flags at every call
        ffi, lib = native()
        d = ffi.new("struct llama_kvp_policy_desc *")
        if lib.llama_kvp_policy_describe(self.to_native(), d) != 0:
            raise PolicyError(last_error())
        stages = {slot: ffi.string(d.stage[i]).decode() or None for i, slot in enumerate(SLOTS)}
        return dict(preset=ffi.string(d.preset).decode(), stages=stages, observes=bool(d.observes),
                    retains=bool(d.retains), guides=bool(d.guides), sparse=bool(d.sparse),
                    rerank_at_end=bool(d.rerank_at_end))

    @property
    def observes(self) -> bool:
        """Whether the policy computes in-graph attention observations (telemetry)."""
        return self._desc["observes"]

    @property
    def retains(self) -> bool:
        """Whether the policy keeps one budgeted KV cache per layer (evicts tokens)."""
        return self._desc["retains"]

    @property
    def sparse(self) -> bool:
        """Whether prompt ubatches run block-sparse attention (prefill stage `sparse`)."""
        return self._desc["sparse"]

    @property
    def summarises(self) -> bool:
        """Whether leaving tokens are replaced by fitted centroid cells (fate stage `summarise`)."""
        return self._desc["stages"].get("fate") == "summarise"

    @property
    def guides(self) -> bool:
        """Whether prompt chunks are scored by the prompt's end run behind them (guided prefill)."""
        return self._desc["guides"]

    def __add__(self, stage: "Stage | Stages") -> "Policy":
        """This policy with the stage(s) replacing its own in their slots (validated)."""
        if isinstance(stage, Stage):
            added: Tuple[Stage, ...] = (stage,)
        elif isinstance(stage, Stages):
            added = stage.stages
        else:
            return NotImplemented
        try:
            composed = Composed(self._base(), self._stages() + added)
        except PolicyError as e:
            if isinstance(stage, Stage) and re.search(r" needs (a|the) [a-z ]*(stage|fate|schedule|policy)", str(e)):
                # stages that need each other validate together: `a + b + c` adds b alone first (not for a key's
                # own condition, e.g. lam's window)
                raise PolicyError(f"{e}; to add stages that need each other, add them together: "
                                  f"policy + ({type(stage).__name__}(...) + ...)") from None
            raise
        return _build(composed.spec())

    def _base(self) -> "KVPolicy":
        raise NotImplementedError

    def _stages(self) -> Tuple["Stage", ...]:
        return ()


@dataclass(frozen=True)
class KVPolicy(Policy):
    """Base of the presets: `name` is the spec name, the fields are the keys the preset exposes."""

    name: ClassVar[str] = ""
    type_id: ClassVar[int] = 0

    def __post_init__(self) -> None:
        _check_field_types(self.name, self)
        self.to_native()  # the native engine validates the values

    def raw_spec(self) -> str:
        return _part(self.name, self)

    def _base(self) -> "KVPolicy":
        return self


@dataclass(frozen=True)
class Stage:
    """Base of the stages.

    `name` is the spec name, `slot` the slot it fills; unset keys (None) keep the preset's value where the preset
    exposes the key, else the stage's default."""

    name: ClassVar[str] = ""
    slot: ClassVar[str] = ""

    def __post_init__(self) -> None:
        _check_field_types(self.name, self)

    def raw_spec(self) -> str:
        """Return this stage's part of a spec, e.g. `entropy:min_layer=64`."""
        return _part(self.name, self)

    @classmethod
    def server_stats(cls, llm: Any) -> Optional[Dict[str, Any]]:
        """What `pykvcache serve`'s KV stats show of this stage's state in a context (None: nothing)."""
        return None

    @classmethod
    def server_stats_total(cls, blocks: List[Dict[str, Any]]) -> Dict[str, Any]:
        """The server_stats of several sequences as one: each count added up."""
        return {k: sum(b[k] for b in blocks) for k in blocks[0]} if blocks else {}

    def __add__(self, other: "Stage | Stages") -> "Stages":
        """This stage and the other(s), to be added to a policy together."""
        if isinstance(other, Stage):
            return Stages((self, other))
        if isinstance(other, Stages):
            return Stages((self,) + other.stages)
        return NotImplemented


@dataclass(frozen=True)
class Stages:
    """Stages added together (`LatentSchedule() + HostFate()`), validated as one when added to a policy.

    This is so that stages that need each other compose: `SnapKV() + (LatentSchedule(gap=0) + HostFate())`."""

    stages: Tuple[Stage, ...]

    def __post_init__(self) -> None:
        for s in self.stages:
            if not isinstance(s, Stage):
                raise PolicyError(f"only stages can be added together (got {type(s).__name__})")

    def __add__(self, other: "Stage | Stages") -> "Stages":
        """These stages and the other(s), to be added to a policy together."""
        if isinstance(other, Stage):
            return Stages(self.stages + (other,))
        if isinstance(other, Stages):
            return Stages(self.stages + other.stages)
        return NotImplemented

    def raw_spec(self) -> str:
        """Return the stages' part of a spec, e.g. `latent:gap=0+host`."""
        return "+".join(s.raw_spec() for s in self.stages)


@dataclass(frozen=True)
class Composed(Policy):
    """A preset whose stages are replaced in some slots; kept in canonical form (the stages that differ)."""

    preset: KVPolicy
    stages: Tuple[Stage, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.preset, KVPolicy):
            raise PolicyError(f"a composition starts from a preset (got {type(self.preset).__name__})")
        for s in self.stages:
            if not isinstance(s, Stage):
                raise PolicyError(f"only stages can be added to a policy (got {type(s).__name__})")
        canonical = _native_str(_native_parse(self.raw_spec()))
        preset, stages = _from_canonical(canonical)
        object.__setattr__(self, "preset", preset)
        object.__setattr__(self, "stages", stages)

    def raw_spec(self) -> str:
        return "+".join([self.preset.raw_spec()] + [s.raw_spec() for s in self.stages])

    def _base(self) -> KVPolicy:
        return self.preset

    def _stages(self) -> Tuple[Stage, ...]:
        return self.stages


def _kwargs(cls: Type[Any], items: str) -> Dict[str, Any]:
    kinds = {f.name: str(f.type) for f in fields(cls)}
    res: Dict[str, Any] = {}
    for item in filter(None, items.split(",")):
        key, value = item.split("=", 1)
        kind = kinds[key]
        if "bool" in kind:
            res[key] = value != "0"
        elif "float" in kind:
            x = float(value)
            res[key] = int(x) if key == "budget" and x >= 1 else x
        else:
            res[key] = int(value)
    return res


def _from_canonical(spec: str) -> Tuple[KVPolicy, Tuple[Stage, ...]]:
    from .presets import PRESETS
    from .stages import STAGES

    parts = spec.split("+")
    name, _, items = parts[0].partition(":")
    cls = PRESETS[name]
    preset = cls(**_kwargs(cls, items))
    stages = []
    for part in parts[1:]:
        name, _, items = part.partition(":")
        scls = STAGES[name]
        stages.append(scls(**_kwargs(scls, items)))
    return preset, tuple(stages)


def _build(spec: str) -> Policy:
    preset, stages = _from_canonical(spec)
    return Composed(preset, stages) if stages else preset


def from_native(p: Any) -> Policy:
    """Build the policy object of a native `struct llama_kvp_policy`."""
    return _build(_native_str(p))


def parse_policy(spec: str) -> Policy:
    """Parse a policy spec such as `observe:window=32,every=4` or `snapkv:budget=0.1+entropy` (the native parser)."""
    if not isinstance(spec, str):
        raise PolicyError(f"a policy spec must be a string (got {type(spec).__name__})")
    return from_native(_native_parse(spec))


def as_policy(policy: "Policy | str | None") -> "Policy | None":
    """Accept a policy object, a spec string or None."""
    if policy is None or isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        return parse_policy(policy)
    raise PolicyError(f"kv_policy must be a KVPolicy, a spec string or None (got {type(policy).__name__})")


def policy_help() -> str:
    """Return the listing of the presets and stages with their keys (as `--help` prints it)."""
    ffi, lib = native()
    n = lib.llama_kvp_policy_help(ffi.NULL, 0)
    buf = ffi.new("char[]", n + 1)
    lib.llama_kvp_policy_help(buf, n + 1)
    return ffi.string(buf).decode()
