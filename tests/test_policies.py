"""Unit tests of the pure pieces: policy specs, parameter validation, the cffi declarations."""

from __future__ import annotations

import pytest

import pykvcache
from pykvcache import FullCache, Observe, PolicyError, parse_policy


def test_parse_defaults_and_keys():
    assert parse_policy("observe") == Observe(window=32, every=0, decay=1.0)
    assert parse_policy("observe:window=8,every=4") == Observe(window=8, every=4)
    assert parse_policy(" observe : window = 16 , decay = 0.5 ") == Observe(window=16, decay=0.5)
    assert parse_policy("none") == FullCache()


def test_spec_round_trip():
    pol = Observe(window=7, every=3, decay=0.25)
    assert pol.spec() == "observe:window=7,every=3,decay=0.25"
    assert parse_policy(pol.spec()) == pol


@pytest.mark.parametrize(
    "spec, words",
    [
        ("obsrve", ["unknown policy 'obsrve'", "none, observe"]),
        ("observe:windw=3", ["unknown key 'windw'", "window,every,decay"]),
        ("observe:window=abc", ["'window'", "'abc'", "integer"]),
        ("observe:window", ["'window'", "integer"]),
        ("observe:decay=fast", ["'decay'", "number"]),
        ("observe:window=0", ["window must be >= 1", "got 0"]),
        ("observe:window=-5", ["window must be >= 1"]),
        ("observe:every=-1", ["every must be >= 0"]),
        ("observe:decay=1.5", ["decay must be in [0, 1]"]),
        ("none:window=3", ["unknown key 'window'", "accepted: none"]),
    ],
)
def test_parse_errors_name_the_problem(spec, words):
    with pytest.raises(PolicyError) as exc:
        parse_policy(spec)
    msg = str(exc.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(window=0), "window must be >= 1"),
        (dict(window=-1), "window must be >= 1"),
        (dict(window=2.5), "window must be an integer"),
        (dict(window=True), "window must be an integer"),
        (dict(every=-2), "every must be >= 0"),
        (dict(decay=-0.1), "decay must be in [0, 1]"),
        (dict(decay="1"), "decay must be a number"),
    ],
)
def test_dataclass_validation(kwargs, words):
    with pytest.raises(PolicyError, match=words.replace("[", r"\[").replace("]", r"\]")):
        Observe(**kwargs)


def test_parse_rejects_non_strings():
    with pytest.raises(PolicyError):
        parse_policy(32)  # type: ignore[arg-type]


def test_cdef_comes_from_the_header():
    from pykvcache._bindings.llama_kvp_ffi import cdef_from_header
    from pykvcache._native import HEADER

    cdef = cdef_from_header(HEADER.read_text())
    assert "llama_kvp_policy_parse" in cdef
    assert "#" not in cdef
    with pytest.raises(ValueError):
        cdef_from_header("int f(void);")


def test_policy_error_is_a_value_error():
    assert issubclass(pykvcache.PolicyError, ValueError)


def test_str_is_the_spec_and_flags_take_numpy_bools():
    import numpy as np

    p = pykvcache.SnapKV(budget=0.25) + pykvcache.EntropyBudget()
    assert str(p) == p.spec() and parse_policy(str(p)) == p  # a logged policy can be given back
    assert pykvcache.SnapKV(guide=np.bool_(False)).spec() == pykvcache.SnapKV(guide=False).spec()
    with pytest.raises(PolicyError, match="guide must be True or False"):
        pykvcache.SnapKV(guide=1.0)


def test_threads_that_parse_policies_at_once_in_a_fresh_process():
    """Two threads that first used the native library at the same moment each opened it, and a struct of one ffi
    instance was handed to the other ("mixing up different ffi instances"), 5 times in 5 runs."""
    import subprocess
    import sys

    script = ("import threading\nfrom pykvcache import parse_policy\nb = threading.Barrier(2); out = []\n"
              "def w(s):\n    b.wait()\n    out.append(parse_policy(s).spec())\n"
              "ts = [threading.Thread(target=w, args=(s,)) for s in ('snapkv:budget=64', 'entropy:budget=0.25')]\n"
              "[t.start() for t in ts]; [t.join() for t in ts]\nassert len(out) == 2, out\n")
    for _ in range(3):
        p = subprocess.run([sys.executable, "-c", script], cwd="/", capture_output=True, text=True, timeout=120)
        assert p.returncode == 0 and "Exception" not in p.stderr, p.stderr
