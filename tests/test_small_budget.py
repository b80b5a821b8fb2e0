"""Retrieval at a small budget (10% of a 1k-token prompt, ~100 tokens per layer): the entropy preset (whole spans around
the best-attended tokens, late layers at the mean budget) keeps facts that SnapKV's average pooling cuts, against the
full cache on the same needle prompts; and its streamed KL at 10% of a 2k-token text."""

from __future__ import annotations

import pytest

from pykvcache.evaluate import (EvalConfig, Runner, compare_logprobs, eval_texts, needle_cases, needle_hits, policy_spec,
                                 stream_logprobs)



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



def test_streamed_kl_at_ten_percent_follows_the_last_observation(model_path):
    # 10% of the essays' 2k-token KL text (179 tokens per layer), streamed in 16-token chunks as `pykvcache eval`
    # does: ranking the tokens outside the spans by the last observation (the default, fresh=1) follows the text
    # better than ranking them by the decayed sum of every chunk's observation (fresh=0), and better than SnapKV
    cfg = EvalConfig(kl_tokens=2048, stream=256, needle_lengths=[0], model_path=model_path)
    full = Runner(None, cfg)
    try:
        tokens, _ = eval_texts(cfg, full.llm)
        ref = stream_logprobs(full, tokens, cfg.stream, cfg.stream_chunk)
    finally:
        full.close()

    def kl(name):
        r = Runner(policy_spec(name, 179), cfg)
        try:
            return compare_logprobs(ref, stream_logprobs(r, tokens, cfg.stream, cfg.stream_chunk))["kl_mean"]
        finally:
            r.close()

    ent = kl("entropy")
    assert 0 < ent < kl("entropy:fresh=0")
    assert ent <= kl("snapkv")
