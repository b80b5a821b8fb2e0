"""Which tokens a layer keeps for given attention masses (the pure selection behind every retention policy): sinks,
recent tokens, and the top-k by the score stage's pooled scores, with whole spans around the best-attended tokens."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pykvcache import H2O, PolicyError, SinkRecent, SnapKV, parse_policy
from pykvcache._native import last_error, native


def select(policy, mass, n_keep, il=0, n_layer=1, value=None, last=None):
    """Cells kept by layer il of n_layer (the only layer by default), with the value norms of the tokens (all 1) and
    the mass of the last observation alone (the same as mass)."""
    ffi, lib = native()
    m = np.ascontiguousarray(mass, dtype=np.float32)
    # the float32 copies stay referenced until the call returns (a pointer into a freed temporary reads garbage)
    value32 = None if value is None else np.ascontiguousarray(value, dtype=np.float32)
    last32 = None if last is None else np.ascontiguousarray(last, dtype=np.float32)
    v = ffi.NULL if value32 is None else ffi.cast("float *", ffi.from_buffer(value32))
    lm = ffi.NULL if last32 is None else ffi.cast("float *", ffi.from_buffer(last32))
    keep = np.zeros(len(m), dtype=np.int32)
    rc = lib.llama_kvp_select_tokens(policy.to_native(), il, n_layer, ffi.cast("float *", ffi.from_buffer(m)), lm, v,
                                     len(m), n_keep, ffi.cast("int32_t *", ffi.from_buffer(keep)))
    if rc != 0:
        raise PolicyError(last_error())
    return np.flatnonzero(keep)


def select_reference(mass, n_keep, n_sink, n_recent, topk_share, pool, pool_max, span_pool, fill=0, last=None,
                     fresh=1.0):
    """numpy twin of the window score stage's selection (float32 as the engine computes it); with `last` the average
    ranks fresh x the last observation + (1 - fresh) x the decayed sum, the spans the sum."""
    mass = np.asarray(mass, dtype=np.float32)
    base = mass if last is None else (np.float32(fresh) * np.asarray(last, dtype=np.float32)
                                      + np.float32(1 - fresh) * mass).astype(np.float32)
    n = len(mass)
    if n <= n_keep:
        return np.arange(n)
    rest = n_keep - n_sink
    n_recent = max(n_recent, rest - min(rest, math.floor(topk_share * rest + 0.5)))
    n_recent = max(1, min(n_recent, n_keep))
    n_sink = min(n_sink, n_keep - n_recent)
    i0, i1, n_topk = n_sink, n - n_recent, n_keep - n_sink - n_recent
    ra, rm = pool // 2, (span_pool or pool) // 2
    avg = np.zeros(n, dtype=np.float32)
    mx = np.zeros(n, dtype=np.float32)
    for j in range(n):
        a, b = max(0, j - ra), min(n - 1, j + ra)
        s = np.float32(0)
        for k in range(a, b + 1):
            s = np.float32(s + base[k])
        avg[j] = np.float32(s / np.float32(b - a + 1))
        mx[j] = max(np.float32(0), mass[max(0, j - rm):j + rm + 1].max())
    if ra == 0 and rm == 0:
        score = base
    elif pool_max >= 1:
        score = mx
    else:
        n_span = min(i1 - i0, int(pool_max * n_topk + 0.5))
        t = np.sort(mx[i0:i1])[::-1][n_span - 1] if n_span > 0 else np.inf
        score = np.where((mx >= t) & (mx > 0), np.float32(avg.max()) + mx, avg).astype(np.float32)
    if fill > 0:
        score = np.maximum(score, close_gaps(score, fill))
    mid = sorted(range(i0, i1), key=lambda j: (-score[j], -j))[:n_topk]
    return np.array(sorted(list(range(n_sink)) + mid + list(range(i1, n))))


def close_gaps(score, fill):
    """Each token's highest score h such that a run of at most `fill` tokens holding it has h or more on both sides."""
    n = len(score)
    out = np.zeros(n, dtype=np.float32)
    for a in range(n):
        for b in range(a + 2, min(n, a + fill + 2)):  # sides a and b, the hole between them
            out[a + 1:b] = np.maximum(out[a + 1:b], min(score[a], score[b]))
    return out


def spiky_mass(n, spikes, base=1 / 1024):
    m = np.full(n, base, dtype=np.float32)
    for pos, value in spikes.items():
        m[pos] = value
    return m


def test_max_pooling_keeps_the_span_around_an_attended_token():
    # one token attended strongly, one weakly: with max pooling over 9 the strong one's span of 9 is kept whole
    mass = spiky_mass(400, {100: 0.5, 300: 0.05})
    kept = select(parse_policy("snapkv:pool=9+window:pool_max=1,n_recent=1"), mass, 16)
    assert set(range(96, 105)) <= set(kept)
    assert len(set(range(296, 305)) & set(kept)) == 6  # the rest of the 15 chosen: the weak span's newest


def test_mixed_pooling_gives_spans_to_the_best_and_averages_the_rest():
    # three attended tokens; a span share of 0.5 of 24 top-k tokens covers the strongest one's 9 (and the next's),
    # the rest of the budget goes by the average, which favours a dense region over a lone weak spike
    mass = spiky_mass(600, {100: 0.6, 250: 0.3, 450: 0.02})
    mass[500:520] = 0.01  # a dense region of moderate attention
    pol = parse_policy("snapkv:pool=9+window:pool_max=0.5,n_recent=1")
    kept = set(select(pol, mass, 25))
    assert set(range(96, 105)) <= kept and set(range(246, 255)) <= kept
    assert 450 not in kept
    assert len(kept & set(range(500, 520))) >= 5
    # the max everywhere spends the budget on whole spans of the three spikes instead
    kept_max = set(select(parse_policy("snapkv:pool=9+window:pool_max=1,n_recent=1"), mass, 25))
    assert 450 in kept_max


@pytest.mark.parametrize("pool,pool_max,span_pool,topk_share,n_sink,n_recent,fill", [
    (1, 0.0, 0, 1.0, 0, 32, 0), (5, 0.0, 0, 1.0, 0, 32, 0), (9, 1.0, 0, 0.5, 4, 16, 0), (9, 0.25, 0, 1.0, 4, 16, 0),
    (5, 0.5, 9, 0.8, 2, 8, 0), (7, 0.75, 3, 1.0, 0, 1, 0), (1, 0.5, 9, 1.0, 4, 16, 0), (5, 1.0, 9, 1.0, 0, 32, 0),
    (1, 0.0, 0, 1.0, 0, 32, 3), (5, 0.25, 9, 1.0, 4, 16, 6), (9, 1.0, 0, 0.5, 4, 16, 1),
])
def test_selection_matches_numpy(pool, pool_max, span_pool, topk_share, n_sink, n_recent, fill):
    rng = np.random.default_rng(pool * 100 + int(pool_max * 10) + span_pool + fill)
    spec = (f"snapkv:pool={pool}+window:pool_max={pool_max},span_pool={span_pool},topk_share={topk_share},"
            f"n_sink={n_sink},n_recent={n_recent},fill={fill}")
    pol = parse_policy(spec)
    # many leave (a prompt's chunk), or a few (a decode step: 1 to 16, ranked in one pass), or none
    for n, n_keep in ((300, 40), (1000, 100), (64, 64), (50, 70), (257, 33), (300, 299), (120, 116), (257, 241), (100, 83)):
        # masses on a grid of 1/1024 so that sums are exact and both sides order ties the same way
        mass = (rng.integers(0, 64, n) * (rng.random(n) < 0.3)).astype(np.float32) / 1024
        got = select(pol, mass, n_keep)
        want = select_reference(mass, n_keep, n_sink, n_recent, topk_share, pool, pool_max, span_pool, fill)
        assert got.tolist() == want.tolist(), (spec, n, n_keep)
        assert len(got) == min(n, n_keep)


def test_spans_only_in_the_last_span_share_of_the_layers():
    # span_share=0.5 of 30 layers: layers 15-29 keep the strong token's span whole, layers 0-14 choose by the average
    # (the same as pool_max=0 there), so a dense region wins over the span's weak neighbours in the early layers
    mass = spiky_mass(600, {100: 0.6, 250: 0.3})
    mass[500:520] = 0.01
    pol = parse_policy("snapkv:pool=5+window:pool_max=0.5,span_pool=9,span_share=0.5,n_recent=1")
    avg = parse_policy("snapkv:pool=5+window:pool_max=0,n_recent=1")
    spans = parse_policy("snapkv:pool=5+window:pool_max=0.5,span_pool=9,n_recent=1")
    for il in (0, 14):
        assert select(pol, mass, 25, il, 30).tolist() == select(avg, mass, 25).tolist()
    for il in (15, 29):
        assert select(pol, mass, 25, il, 30).tolist() == select(spans, mass, 25).tolist()
    assert set(range(96, 105)) <= set(select(pol, mass, 25, 20, 30))
    assert not set(range(96, 105)) <= set(select(pol, mass, 25, 10, 30))
    # one layer of one: its spans are never switched off, whatever the share
    assert select(pol, mass, 25, 0, 1).tolist() == select(spans, mass, 25).tolist()


def test_fill_keeps_the_middle_of_a_number_whose_ends_are_attended():
    # a 7-digit number: its first digit and the word after it are attended, the middle five digits are not; SnapKV's
    # top-k (no pooling) keeps the ends and loses the middle to lone weak tokens, fill=5 keeps the number whole and
    # gives up the weakest lone tokens instead, fill=4 is too short for the hole and changes nothing
    mass = spiky_mass(300, {100: 0.3, 106: 0.2, 30: 0.01, 60: 0.011, 150: 0.012, 200: 0.013, 250: 0.014})
    plain = set(select(parse_policy("snapkv:pool=1+window:n_recent=1"), mass, 8))
    assert {100, 106} <= plain and not set(range(101, 106)) & plain
    whole = set(select(parse_policy("snapkv:pool=1+window:fill=5,n_recent=1"), mass, 8))
    assert set(range(100, 107)) <= whole and 299 in whole
    assert select(parse_policy("snapkv:pool=1+window:fill=4,n_recent=1"), mass, 8).tolist() == sorted(plain)
    # nothing is widened past an end: the tokens around the number keep their own ranks
    assert not {98, 99, 107, 108} & set(select(parse_policy("snapkv:pool=1+window:fill=5,n_recent=1"), mass, 12))
    # holes are filled only in the last fill_share of the layers (half by default), whatever the layers of the spans
    half = parse_policy("snapkv:pool=1+window:fill=5,n_recent=1")
    assert set(select(half, mass, 8, 0, 2)) == plain and set(select(half, mass, 8, 1, 2)) == whole
    late = parse_policy("snapkv:pool=1+window:fill=5,fill_share=0.25,span_share=1,n_recent=1")
    assert [set(select(late, mass, 8, il, 8)) == whole for il in range(8)] == [False] * 6 + [True] * 2
    every = parse_policy("snapkv:pool=1+window:fill=5,fill_share=1,span_share=0.25,n_recent=1")
    assert all(set(select(every, mass, 8, il, 8)) == whole for il in range(8))


def test_value_norms_discount_attention_to_near_zero_values():
    # two tokens with the same attention: with vnorm the one whose value vectors are long is kept, the one whose
    # values are near zero (a sink-like token: attended, but moving the output little) leaves; without it they tie
    # and the newer one wins
    mass = spiky_mass(200, {50: 0.2, 120: 0.2})
    value = np.ones(200, dtype=np.float32)
    value[120] = 0.05
    plain = parse_policy("snapkv:pool=1+window:n_recent=1")
    weighted = parse_policy("snapkv:pool=1+window:vnorm=1,n_recent=1")
    assert set(select(plain, mass, 2, value=value)) == {120, 199}
    assert set(select(weighted, mass, 2, value=value)) == {50, 199}
    assert set(select(weighted, mass, 2)) == {120, 199}  # no norms given: all 1, the same as without vnorm
    # the weighting is the score's first step: the pooled, spanned scores are those of mass * value**vnorm
    rng = np.random.default_rng(7)
    mass = (rng.integers(0, 64, 500) * (rng.random(500) < 0.3)).astype(np.float32) / 1024
    value = rng.integers(1, 16, 500).astype(np.float32) / 4
    for vnorm in (1, 2):
        pol = parse_policy(f"entropy:vnorm={vnorm},pool=5,pool_max=0.25")
        got = select(pol, mass, 60, 29, 30, value=value)
        want = select_reference(mass * value**vnorm, 60, 4, 16, 1.0, 5, 0.25, 9, fill=4)
        assert got.tolist() == want.tolist()


def test_fresh_ranks_spans_by_the_sum_and_the_rest_by_the_last_observation():
    # the decayed sum remembers a fact (50) the prompt's question attended and old tokens (100-107) the text has moved
    # on from; the last observation attends the fact no more and newer tokens (150-157) instead. With fresh the span
    # around the fact stays (the sum ranks spans) and the rest of the top-k follows the last observation
    mass = spiky_mass(200, {50: 0.5, **{p: 0.05 for p in range(100, 108)}, **{p: 0.02 for p in range(150, 158)}})
    last = spiky_mass(200, {**{p: 0.05 for p in range(150, 158)}})
    last[100:108] = 0.0
    fact = set(range(48, 53))
    summed = parse_policy("snapkv:pool=1+window:n_recent=1,pool_max=0.3,span_pool=5")
    fresh = parse_policy("snapkv:pool=1+window:n_recent=1,pool_max=0.3,span_pool=5,fresh=1")
    kept_sum = set(select(summed, mass, 14, last=last))
    kept_fresh = set(select(fresh, mass, 14, last=last))
    assert fact <= kept_sum and set(range(100, 108)) <= kept_sum and not kept_sum & set(range(150, 158))
    assert fact <= kept_fresh and set(range(150, 158)) <= kept_fresh and not kept_fresh & set(range(100, 108))
    assert set(select(fresh, mass, 14)) == kept_sum  # no last observation given: the same as the sum
    # against the numpy twin on random scores, with the preset's spans and filled holes
    rng = np.random.default_rng(11)
    for pool, fresh, pool_max in ((1, 1.0, 0.5), (3, 0.5, 0.25), (5, 1.0, 0.5)):
        mass = (rng.integers(0, 64, 500) * (rng.random(500) < 0.3)).astype(np.float32) / 1024
        last = (rng.integers(0, 64, 500) * (rng.random(500) < 0.3)).astype(np.float32) / 1024
        pol = parse_policy(f"entropy:fresh={fresh},pool={pool},pool_max={pool_max}")
        got = select(pol, mass, 60, 29, 30, last=last)
        want = select_reference(mass, 60, 4, 16, 1.0, pool, pool_max, 9, fill=4, last=last, fresh=fresh)
        assert got.tolist() == want.tolist()


def test_baselines_select_what_they_promise():
    mass = spiky_mass(200, {50: 0.5})
    kept = select(SinkRecent(n_sink=4, n_recent=20), mass, 24)
    assert kept.tolist() == list(range(4)) + list(range(180, 200))
    kept = select(H2O(budget=40), mass, 40)  # h2o: top-k by accumulated mass as it is, and the last 32
    assert 50 in kept and set(range(168, 200)) <= set(kept)


def test_bad_selection_input():
    with pytest.raises(PolicyError, match="n_keep >= 1"):
        select(SnapKV(budget=0.1), np.zeros(10), 0)
    with pytest.raises(PolicyError, match="keeps every token"):
        select(parse_policy("observe"), np.zeros(10), 5)
    with pytest.raises(PolicyError, match=r"pool_max must be in \[0, 1\]"):
        parse_policy("entropy+window:pool_max=2")
    with pytest.raises(PolicyError, match="span_pool must be an odd width"):
        parse_policy("snapkv+window:span_pool=4")
    for bad in ("0", "1.5", "-0.5"):
        with pytest.raises(PolicyError, match=r"span_share must be in \(0, 1\]"):
            parse_policy(f"entropy:span_share={bad}")
    with pytest.raises(PolicyError, match=r"fill must be in \[0, 64\]"):
        parse_policy("snapkv+window:fill=-1")
    for bad in ("0", "2"):
        with pytest.raises(PolicyError, match=r"fill_share must be in \(0, 1\]"):
            parse_policy(f"entropy:fill_share={bad}")
    for bad in ("-1", "5"):
        with pytest.raises(PolicyError, match=r"vnorm must be in \[0, 4\]"):
            parse_policy(f"entropy:vnorm={bad}")
    for bad in ("-0.5", "2"):
        with pytest.raises(PolicyError, match=r"fresh must be in \[0, 1\]"):
            parse_policy(f"entropy:fresh={bad}")
    with pytest.raises(PolicyError, match="0 <= il < n_layer"):
        select(SnapKV(budget=0.1), np.zeros(10), 5, il=3, n_layer=3)
