"""Policies as compositions of stages: one grammar (native, shared by Python, the CLI and kvbench), canonical strings
that round-trip, one-line errors, Python `+`, and compositions that run on the real model."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest
from conftest import PROSE

from pykvcache import EntropyLayerBudget, H2O, Llama, PolicyError, Pyramid, SinkRecent, SnapKV, parse_policy
from pykvcache.stages import (STAGES, AccumulatedScore, DensePrefill, DropFate, SummariseFate, SparsePrefill, EntropyBudget, EverySchedule,
                              FreezeSchedule, HostFate, LatentSchedule, PromptSchedule, PyramidBudget, RecencyScore, UniformBudget, WindowScore)

N_LAYER = 30

COMPOSITIONS = [
    "snapkv:budget=0.1+entropy",
    "snapkv:budget=0.1+entropy:min_layer=64,max_layer=400",
    "entropy:budget=0.1+accumulated",
    "entropy:budget=200+uniform",
    "h2o:budget=512+window:pool=3",
    "sink_recent+pyramid:budget=300,slope=0.25",
    "snapkv:budget=0.2+prompt",
    "pyramid:budget=0.1+every:every=4",
    "observe:window=16+uniform:budget=128",
    "none+uniform:budget=64+recency:n_sink=2,n_recent=30",
    "entropy:budget=0.1+dense:guide=0",
]


@pytest.mark.parametrize("spec", COMPOSITIONS)
def test_canonical_string_round_trips(spec):
    pol = parse_policy(spec)
    canonical = pol.spec()
    assert parse_policy(canonical) == pol
    assert parse_policy(canonical).spec() == canonical
    # a slot whose stage differs from the preset's stays visible in the canonical string
    stages = parse_policy(canonical.split("+")[0]).describe()["stages"]
    assert ("+" in canonical) == (stages != pol.describe()["stages"])


def test_presets_keep_their_spec_strings():
    assert SnapKV(budget=0.1).spec() == "snapkv:window=32,every=16,budget=0.1,pool=5,chunk=128,guide=1"
    assert H2O(budget=512).spec() == "h2o:every=1,budget=512,n_recent=32,chunk=128"
    assert SinkRecent().spec() == "sink_recent:n_sink=4,n_recent=252,chunk=128"
    assert parse_policy("pyramid:budget=0.1") == Pyramid(budget=0.1, slope=0.5)
    assert parse_policy("entropy:budget=0.1") == EntropyLayerBudget(budget=0.1)


@pytest.mark.parametrize(
    "spec, preset",
    [
        ("snapkv:budget=0.1+uniform+window+every+drop+dense", SnapKV(budget=0.1)),
        ("entropy:budget=0.1+entropy+window+every+drop+dense", EntropyLayerBudget(budget=0.1)),
        ("h2o:budget=512+uniform+accumulated+every+drop+dense", H2O(budget=512)),
        ("sink_recent+uniform+recency+drop+dense", SinkRecent()),
        ("pyramid:budget=0.1+pyramid+window+every+drop+dense", Pyramid(budget=0.1)),
        ("entropy:budget=0.1+window:pool=3", EntropyLayerBudget(budget=0.1, pool=3)),
    ],
)
def test_naming_a_presets_own_stages_changes_nothing(spec, preset):
    assert parse_policy(spec) == preset
    assert parse_policy(spec).spec() == preset.spec()


def test_python_composes_like_the_grammar():
    pol = SnapKV(budget=0.1) + EntropyBudget(min_layer=64)
    assert pol == parse_policy("snapkv:budget=0.1+entropy:min_layer=64")
    assert pol.spec() == "snapkv:window=32,every=16,budget=0.1,pool=5,chunk=128,guide=1+entropy:min_layer=64,max_layer=0,split_share=0.5"
    assert pol.describe()["stages"] == {"budget": "entropy", "score": "window", "schedule": "every", "fate": "drop",
                                        "prefill": "dense"}
    assert (pol + AccumulatedScore()).describe()["stages"]["score"] == "accumulated"
    # a preset's own stage adds nothing: the result is the preset itself
    assert SnapKV(budget=0.1) + UniformBudget() == SnapKV(budget=0.1)
    assert isinstance(SnapKV(budget=0.1) + UniformBudget(), SnapKV)
    with pytest.raises(TypeError):
        SnapKV(budget=0.1) + 3  # type: ignore[operator]


def test_every_stage_has_a_python_dataclass_and_a_help_line():
    from pykvcache import policy_help

    text = policy_help()
    classes = [UniformBudget, PyramidBudget, EntropyBudget, RecencyScore, WindowScore, AccumulatedScore,
               PromptSchedule, EverySchedule, FreezeSchedule, LatentSchedule, DropFate, SummariseFate, HostFate, DensePrefill,
               SparsePrefill]
    assert sorted(c.name for c in classes) == sorted(STAGES)
    for c in classes:
        assert f"  {c.name} " in text
        # the dataclass fields are the stage's keys in the native help
        line = next(x for x in text.splitlines() if x.startswith(f"  {c.name} ") and "(keys:" in x)
        keys = line.rsplit("(keys: ", 1)[1].rstrip(")")
        assert sorted(f.name for f in fields(c)) == sorted(k.split("=")[0] for k in keys.split(",") if k != "none")
        # each key at the stage's default, as the dataclass has it (None there: the native default, or the preset's)
        shown = {k.split("=")[0]: float(k.split("=")[1]) for k in keys.split(",") if k != "none"}
        assert all(shown[f.name] == float(f.default) for f in fields(c) if f.default is not None), (c.name, shown)


@pytest.mark.parametrize(
    "spec, words",
    [
        ("snapkv+foo", ["unknown stage 'foo'", "uniform, pyramid, entropy"]),
        ("snapkv+entropy+pyramid", ["two stages for the budget slot", "'entropy'", "'pyramid'"]),
        ("snapkv+entropy:bogus=1", ["unknown key 'bogus'", "stage 'entropy'", "budget,min_layer,max_layer"]),
        ("snapkv:budget=0.1+", ["empty stage", "accepted"]),
        ("snapkv+window:pool=0", ["pool must be an odd width"]),
        ("snapkv+entropy:min_layer=abc", ["'min_layer'", "'abc'", "integer"]),
        ("sink_recent+pyramid:slope=2", ["slope"]),
        ("h2o:budget=20+accumulated:n_recent=32", ["budget (20)", "always kept"]),
        ("snapkv+entropy:budget=nan", ["budget"]),
        ("none+prompt", ["schedule stage 'prompt'", "needs a score stage"]),
        ("snapkv:budget=0.1,budget=0.2", ["key 'budget' given twice", "policy 'snapkv'"]),
        # a preset's key that only the replaced stage read would do nothing
        ("pyramid:slope=0.3+entropy", ["key 'slope'", "policy 'pyramid'", "no effect", "'+entropy' replaces"]),
        ("snapkv:window=16+recency", ["key 'window'", "score stage 'window'", "recency reads: n_sink,n_recent"]),
        ("freeze:tau=0.2+every", ["key 'tau'", "schedule stage 'freeze'"]),
    ],
)
def test_composition_errors_name_the_stage_or_key(spec, words):
    with pytest.raises(PolicyError) as exc:
        parse_policy(spec)
    msg = str(exc.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize("spec", ["freeze:gap=5", "snapkv:decay=0.5", "h2o:window=4", "snapkv+host:gap=1"])
def test_a_key_of_a_stage_given_to_the_preset_says_how_to_give_it(spec):
    """A preset does not take every key its stages read; the error names the stage and a spec that does take it."""
    with pytest.raises(PolicyError) as exc:
        parse_policy(spec)
    msg = str(exc.value)
    key = spec.rsplit(":", 1)[1].split("=")[0]
    assert f"unknown key '{key}'" in msg and f"'{key}' is a key of the stage" in msg, msg
    fix = msg.rsplit("add it as '", 1)[1].rstrip("'")
    fixed = spec.rsplit(":", 1)[0] + fix  # the part without the key, then the stage that takes it
    assert f"{key}=" in parse_policy(fixed).spec()
    with pytest.raises(PolicyError) as exc:
        parse_policy("snapkv:foo=1")
    assert "is a key of" not in str(exc.value)  # no stage reads it: no hint


def test_full_names_the_full_cache_as_in_kvbench():
    """kvbench labels its reference `full`; the spec it prints parses in Python and the CLI too."""
    assert parse_policy("full").spec() == "none"
    assert parse_policy("full+sparse").spec() == parse_policy("none+sparse").spec()


def test_a_preset_key_the_new_stage_reads_or_left_at_its_value_is_fine():
    """Only a changed value of a key nothing reads any more is refused: the new stage's own keys, a key another stage
    still reads, and the canonical string (every preset key at its value) parse."""
    assert parse_policy("pyramid:budget=0.1+entropy").preset.budget == 0.1
    assert parse_policy("entropy:window=16+accumulated").preset.window == 16
    assert parse_policy("snapkv:every=0").every == 0
    pol = parse_policy("pyramid+entropy")
    assert "slope=" in pol.spec() and parse_policy(pol.spec()) == pol


@pytest.mark.parametrize("spec, canonical", [
    ("snapkv:budget=1000000", "budget=1000000"),
    ("snapkv:budget=1e+6", "budget=1000000"),
    ("freeze:tau=1e6", "tau=1000000"),
    ("snapkv:budget=0.1234567", "budget=0.1234567"),
    ("freeze:tau=2.5e-7", "tau=2.5e-07"),
])
def test_numbers_keep_their_value_through_the_canonical_string(spec, canonical):
    """Large numbers, exponents and seven digits: the canonical string holds the value exactly and has no '+' but
    between stages."""
    pol = parse_policy(spec)
    assert canonical in pol.spec().replace(":", ",").split(",") and "+" not in pol.spec()
    assert parse_policy(pol.spec()) == pol


def test_numpy_numbers_are_numbers():
    assert SnapKV(budget=np.float32(0.1), window=np.int64(16)).spec() == SnapKV(budget=0.1, window=16).spec()
    assert SnapKV(budget=np.float64(0.25)).spec() == SnapKV(budget=0.25).spec()


def test_stage_values_are_typed_in_python():
    with pytest.raises(PolicyError, match="min_layer must be an integer"):
        EntropyBudget(min_layer=2.5)  # type: ignore[arg-type]
    with pytest.raises(PolicyError, match="pool must be an odd width"):
        SnapKV(budget=0.1) + WindowScore(pool=4)


def test_stages_that_need_each_other_are_added_together():
    """`a + b + c` adds b alone first: a schedule that needs the host fate fails there, with a line that says how to
    add both; added together they validate as one, equal to the spec string."""
    with pytest.raises(PolicyError, match=r"needs the host fate.*add them together"):
        SnapKV(budget=0.1) + LatentSchedule(gap=0) + HostFate()
    pol = SnapKV(budget=0.1) + (LatentSchedule(gap=0) + HostFate())
    assert pol == parse_policy("snapkv:budget=0.1+latent:gap=0+host")
    assert pol == SnapKV(budget=0.1) + HostFate() + LatentSchedule(gap=0)
    assert SnapKV(budget=0.1) + (LatentSchedule(gap=0) + (HostFate() + DensePrefill())) == pol + DensePrefill()
    with pytest.raises(PolicyError, match="two stages for the schedule slot"):
        H2O(budget=0.1) + (FreezeSchedule() + LatentSchedule())
    with pytest.raises(TypeError):
        LatentSchedule() + SnapKV()  # type: ignore[operator]


def test_a_composition_runs_with_the_stage_it_names(model_path):
    """SnapKV with entropy layer budgets allocates like the entropy preset; restating sink_recent as stages retains
    exactly what the preset retains."""
    prompt = PROSE * 6
    snap = Llama(model_path, n_ctx=1024, verbose=False, kv_policy=SnapKV(budget=96, chunk=64))
    mixed = Llama(model_path, n_ctx=1024, verbose=False, kv_policy="snapkv:budget=96,chunk=64+entropy")
    tokens = snap.tokenize(prompt.encode())
    assert len(tokens) > 300
    for llm in (snap, mixed):
        llm.eval(tokens)
    assert snap.kv_memory().budgets == [96] * N_LAYER
    b = mixed.kv_memory().budgets
    # the entropy stage's split (split_share 0.5): the early half of the layers share their total by their entropy,
    # within [budget/4, 2 budget], as the allocator gives it; the late half keep the mean
    half = N_LAYER // 2
    assert sum(b) == 96 * N_LAYER and b[half:] == [96] * (N_LAYER - half) and len(set(b[:half])) > 1
    from test_budgets import allocate

    entropy = [lb.entropy for lb in mixed.kv_memory().layers[:half]]
    assert list(b[:half]) == list(allocate(entropy, 96 * half, 24, 192))
    # each layer's cache holds its budget and the last chunk, placed after the eviction
    used = [s.n_used for s in mixed.kv_stats().layers]
    assert len({u - x for u, x in zip(used, b)}) == 1

    preset = Llama(model_path, n_ctx=1024, verbose=False, kv_policy=SinkRecent(n_sink=4, n_recent=60, chunk=64))
    staged = Llama(model_path, n_ctx=1024, verbose=False,
                   kv_policy="none+uniform:budget=64+recency:n_sink=4,n_recent=60+dense:chunk=64")
    for llm in (preset, staged):
        llm.eval(tokens)
    assert np.array_equal(preset.kv_retained(), staged.kv_retained())
    assert preset.kv_memory().bytes == staged.kv_memory().bytes
