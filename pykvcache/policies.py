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

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", int) and (isinstance(value, bool) or not isinstance(value, int)):
                raise PolicyError(f"{self.name}: {f.name} must be an integer (got {value!r})")
            if f.type in ("float", float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise PolicyError(f"{self.name}: {f.name} must be a number (got {value!r})")
        self.to_native()  # the native engine validates the values

    def to_native(self) -> Any:
        """Return the native `struct llama_kvp_policy` of this policy (validated)."""
        ffi, lib = native()
        p = ffi.new("struct llama_kvp_policy *", lib.llama_kvp_policy_default(self.type_id))
        for f in fields(self):
            setattr(p, f.name, getattr(self, f.name))
        if lib.llama_kvp_policy_validate(p) != 0:
            raise PolicyError(last_error())
        return p

    def spec(self) -> str:
        """Return the canonical spec string, e.g. `observe:window=32,every=0,decay=1`."""
        ffi, lib = native()
        buf = ffi.new("char[]", 512)
        lib.llama_kvp_policy_to_string(self.to_native(), buf, 512)
        return ffi.string(buf).decode()

    @property
    def observes(self) -> bool:
        """True if the policy records attention telemetry."""
        return False


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

    @property
    def observes(self) -> bool:
        """True if the policy records attention telemetry."""
        return True


POLICIES: Dict[int, Type[KVPolicy]] = {cls.type_id: cls for cls in (FullCache, Observe)}


def from_native(p: Any) -> KVPolicy:
    """Build the dataclass of a native `struct llama_kvp_policy`."""
    cls = POLICIES.get(int(p.type))
    if cls is None:
        raise PolicyError(f"unknown native policy type {p.type}")
    kwargs = {f.name: getattr(p, f.name) for f in fields(cls)}
    for f in fields(cls):
        if f.type in ("float", float):
            kwargs[f.name] = round(float(kwargs[f.name]), 6)
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
