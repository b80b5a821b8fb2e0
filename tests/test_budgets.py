"""Layer budget allocation (the pure function behind the entropy policy) and retention policy parameters."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pykvcache import H2O, EntropyLayerBudget, PolicyError, Pyramid, SinkRecent, SnapKV, parse_policy
from pykvcache._native import last_error, native


def allocate(entropy, total, lo, hi):
    ffi, lib = native()
    ent = np.asarray(entropy, dtype=np.float32)
    out = np.zeros(len(ent), dtype=np.int32)
    rc = lib.llama_kvp_allocate_budgets(ffi.cast("float *", ffi.from_buffer(ent)), len(ent), total, lo, hi,
                                        ffi.cast("int32_t *", ffi.from_buffer(out)))
    if rc != 0:
        raise ValueError(last_error())
    return out


def test_sum_is_preserved_and_proportional():
    ent = [1.0, 2.0, 3.0, 4.0]
    out = allocate(ent, 1000, 0, 1000)
    assert out.sum() == 1000
    assert list(out) == sorted(out)  # more entropy, more budget
    np.testing.assert_allclose(out, [100, 200, 300, 400], atol=1)


def test_clamps_and_redistribution():
    ent = [0.01, 1.0, 1.0, 10.0]
    out = allocate(ent, 400, 50, 150)
    assert out.sum() == 400
    assert out.min() >= 50 and out.max() <= 150
    assert out[0] == 50 and out[3] == 150
    assert out[1] == out[2] == 100  # the rest is re-split over the free layers


def test_all_equal_entropies_give_uniform_budgets():
    out = allocate([2.5] * 30, 30 * 257 + 7, 10, 1000)
    assert out.sum() == 30 * 257 + 7
    assert out.max() - out.min() <= 1


def test_zero_or_invalid_entropies_fall_back_to_uniform():
    out = allocate([0.0, 0.0, 0.0], 99, 0, 99)
    assert list(out) == [33, 33, 33]
    out = allocate([math.nan, 1.0, -1.0], 90, 10, 90)
    assert out.sum() == 90 and out[1] == 70 and out[0] == out[2] == 10


def test_one_layer_gets_everything():
    assert list(allocate([0.7], 512, 0, 512)) == [512]


def test_impossible_bounds_are_reported():
    with pytest.raises(ValueError, match="cannot be split"):
        allocate([1.0, 1.0], 1000, 0, 100)
    with pytest.raises(ValueError, match="min_layer <= max_layer"):
        allocate([1.0, 1.0], 100, 60, 50)


def test_policy_specs_round_trip():
    for pol in (SinkRecent(n_sink=2, n_recent=100), SnapKV(budget=300, window=16, pool=3), H2O(budget=0.1),
                Pyramid(budget=200, slope=0.3), EntropyLayerBudget(budget=0.25, min_layer=32, max_layer=512),
                EntropyLayerBudget(budget=0.1, split_share=0.5),
                SnapKV(budget=64, guide=False), EntropyLayerBudget(budget=100, pool=1, guide=False)):
        assert parse_policy(pol.spec()) == pol
    assert parse_policy("entropy:budget=512").budget == 512
    assert parse_policy("snapkv").budget == 0.25


@pytest.mark.parametrize("kwargs, reason", [
    (dict(budget=0), "budget must be a token count >= 1 or a fraction"),
    (dict(budget=-5), "budget must be a token count >= 1 or a fraction"),
    (dict(budget=float("nan")), "budget must be a token count >= 1 or a fraction"),
    (dict(budget=12.5), "must be a whole number"),
    (dict(budget=10), "must be larger than the tokens always kept"),
    (dict(budget=512, min_layer=300, max_layer=200), r"min_layer \(300\) is larger than max_layer \(200\)"),
    (dict(budget=512, min_layer=600), "min_layer .* is larger than the budget"),
    (dict(budget=512, topk_share=1.5), r"topk_share must be in \[0, 1\]"),
    (dict(budget=512, chunk=0), "chunk must be >= 1"),
    (dict(budget=512, guide=2), "guide must be True or False"),
    (dict(budget=512, pool=4), "pool must be an odd width"),
    (dict(budget=512, split_share=0), r"split_share must be in \(0, 1\]"),
    (dict(budget=512, split_share=1.5), r"split_share must be in \(0, 1\]"),
])
def test_invalid_entropy_parameters(kwargs, reason):
    with pytest.raises(ValueError, match=reason):
        EntropyLayerBudget(**kwargs)


def test_invalid_baseline_parameters():
    with pytest.raises(PolicyError, match="a budget of 1 is one token, a fraction of the prompt is below 1"):
        SnapKV(budget=1.0)  # "the whole prompt" reads as one token
    with pytest.raises(PolicyError, match=r"sink_recent: its 256 tokens \(n_sink \+ n_recent\) leave no room"):
        parse_policy("sink_recent+window")
    with pytest.raises(PolicyError, match="pool must be an odd width"):
        SnapKV(budget=256, pool=4)
    with pytest.raises(PolicyError, match=r"slope must be in \[0, 1\)"):
        Pyramid(budget=256, slope=1.0)
    with pytest.raises(PolicyError, match="n_recent must be >= 1"):
        SinkRecent(n_recent=0)
    with pytest.raises(PolicyError, match="unknown key 'window' for policy 'h2o'"):
        parse_policy("h2o:window=4")
    with pytest.raises(PolicyError, match="bad value for 'budget'"):
        parse_policy("entropy:budget=lots")
    with pytest.raises(PolicyError, match="guide must be 0 or 1"):
        parse_policy("snapkv:guide=3")
    with pytest.raises(PolicyError, match="unknown key 'guide' for policy 'h2o'"):
        parse_policy("h2o:guide=1")
    assert parse_policy("entropy:guide=0").guide is False and EntropyLayerBudget().guide is True


def test_a_budget_a_float_cannot_hold_is_refused():
    """Token counts are held as float: above 2^24 another count than the one given would run (and print)."""
    assert SnapKV(budget=16777215).spec().count("budget=16777215") == 1
    for spec in ("snapkv:budget=16777218", "snapkv:budget=100000001"):
        with pytest.raises(PolicyError, match="at most 16777215 tokens"):
            parse_policy(spec)
    with pytest.raises(PolicyError, match="at most 16777215 tokens"):
        SnapKV(budget=16777219)
    assert parse_policy("freeze").spec().startswith("freeze:")  # its own budget, the whole context, is not a count
