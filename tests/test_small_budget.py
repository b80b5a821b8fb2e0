"""Retrieval at a small budget (10% of a 1k-token prompt, ~100 tokens per layer): the entropy preset (whole spans around
the best-attended tokens, late layers at the mean budget) keeps facts that SnapKV's average pooling cuts, against the
full cache on the same needle prompts."""

from __future__ import annotations

import pytest

from pykvcache.evaluate import EvalConfig, Runner, eval_texts, needle_cases, needle_hits, policy_spec



@pytest.fixture(scope="module")
def cases_and_full(model_path):
    cfg = EvalConfig(needle_lengths=[1024], depths=[0.2, 0.4, 0.6, 0.8], needles="varied", kl_tokens=1024,
                     stream=64, model_path=model_path)
    full = Runner(None, cfg)
    try:
        _, hay = eval_texts(cfg, full.llm)
        cases = needle_cases(full.llm, hay, 1024, cfg.depths, cfg.seed, cfg.needles)
        hits = needle_hits(full, cases)
    finally:
        full.close()
    return cfg, cases, hits


def hits_of(cfg, cases, name):
    r = Runner(policy_spec(name, 102), cfg)
    try:
        assert r.llm.kv_policy.retains
        return needle_hits(r, cases)
    finally:
        r.close()


def test_entropy_keeps_needles_at_ten_percent(cases_and_full):
    cfg, cases, full = cases_and_full
    assert sum(full) >= 3  # the full cache answers (almost) every case
    ent = hits_of(cfg, cases, "entropy")
    snapkv = hits_of(cfg, cases, "snapkv")
    assert sum(ent) >= sum(full) - 1
    assert sum(ent) >= sum(snapkv)


def test_value_norm_weighting_keeps_the_needles(cases_and_full):
    # the mass weighted by each token's value norm (read from the cache by the memory) keeps what the full cache finds
    cfg, cases, full = cases_and_full
    assert sum(hits_of(cfg, cases, "entropy:vnorm=1")) >= sum(full) - 1
