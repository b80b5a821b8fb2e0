"""Sparse prefill (prefill stage `sparse`) on the real model: close to dense attention, telemetry that adds up,
composition with retention policies, dense fallback, and one-line errors for bad keys."""

import json
import warnings

import numpy as np
import pytest
from conftest import log_softmax

from pykvcache import EntropyLayerBudget, FullCache, Llama, PolicyError, SparsePrefill, parse_policy
from pykvcache.corpus import essays

N_PROMPT = 1500
SPARSE = "none+sparse:threshold=256,base=128"


def kl(ref: np.ndarray, got: np.ndarray) -> float:
    a, b = log_softmax(ref), log_softmax(got)
    return float((np.exp(a) * (a - b)).sum())


@pytest.fixture(scope="module")
def prompt(model_path):
    llm = Llama(model_path, n_ctx=256, verbose=False)
    toks = llm.tokenize(" ".join(essays()).encode())[:N_PROMPT]
    llm.close()
    return toks


def last_logits(model_path, toks, policy, **kw):
    llm = Llama(model_path, n_ctx=2048, n_batch=512, n_ubatch=512, kv_policy=policy, verbose=False, **kw)
    llm.eval(toks)
    return llm, np.array(llm._ctx.get_logits()[: llm.n_vocab()])


@pytest.fixture(scope="module")
def dense(model_path, prompt):
    llm, logits = last_logits(model_path, prompt, None, flash_attn=True)
    llm.close()
    return logits


def test_sparse_prefill_is_close_to_dense_and_computes_fewer_blocks(model_path, prompt, dense):
    llm, logits = last_logits(model_path, prompt, SPARSE)
    assert llm.kv_policy.sparse and not llm.kv_policy.observes and not llm.kv_policy.retains
    assert kl(dense, logits) < 0.05
    assert logits.argmax() == dense.argmax()

    sp = llm.kv_sparse()
    n_layer, n_head = sp.dynamic.shape
    assert n_layer == 30 and n_head == 9
    # layer 0 stays dense (skip=1); the others ran every ubatch (512 cells or more, above the threshold) sparse
    assert sp.n_ubatch[0] == 0 and sp.density[0] == 1.0
    assert (sp.n_ubatch[1:] == 3).all()
    assert (sp.density[1:] > 0.05).all() and (sp.density[1:] < 1.0).all()
    assert 0.0 < sp.total_density < 1.0
    # budgets of the segments that ran sparse lie in [base, 3*base]; Rigid heads keep base everywhere
    used = sp.budgets[1:]
    segment = next(s.segment for s in parse_policy(SPARSE).stages if isinstance(s, SparsePrefill))
    assert used.shape[1] == -(-N_PROMPT // segment)
    assert ((used >= 128) & (used <= 384)).all()
    rigid = np.broadcast_to(~sp.dynamic[1:, None, :], used.shape)
    assert (used[rigid] == 128).all() and sp.dynamic[1:].any() and rigid.any()
    assert ((sp.entropy[1:] >= 0.0) & (sp.entropy[1:] <= 1.0 + 1e-5)).all()

    tel = llm.kv_telemetry()
    assert tel.sparse is not None and "sparse" in tel.to_dict()
    llm.close()


def test_the_segment_whose_logits_are_read_attends_to_every_block(model_path, prompt):
    # pykvcache's eval asks for the prompt's last logits only; llama_cpp's asks for every chunk's last token, and
    # each segment holding such a token computes all its visible blocks: more blocks
    import llama_cpp

    llm, _ = last_logits(model_path, prompt, SPARSE)
    d_last = llm.kv_sparse().total_density
    llm.close()
    llm = Llama(model_path, n_ctx=2048, n_batch=512, n_ubatch=512, kv_policy=SPARSE, verbose=False)
    llama_cpp.Llama.eval(llm, prompt)
    d_every = llm.kv_sparse().total_density
    llm.close()
    assert 0.0 < d_last < d_every < 1.0


def test_larger_budgets_compute_more_and_stay_closer(model_path, prompt, dense):
    small, l_small = last_logits(model_path, prompt, "none+sparse:threshold=256,base=64")
    large, l_large = last_logits(model_path, prompt, "none+sparse:threshold=256,base=512")
    assert small.kv_sparse().total_density < large.kv_sparse().total_density
    assert kl(dense, l_large) <= kl(dense, l_small)
    small.close()
    large.close()


def test_per_head_zero_gives_every_head_the_layers_largest_budget(model_path, prompt):
    llm, _ = last_logits(model_path, prompt, "none+sparse:threshold=256,base=128,per_head=0")
    b = llm.kv_sparse().budgets[1:]
    assert (b == b.max(axis=2, keepdims=True)).all()
    llm.close()


def test_composes_with_a_retention_policy(model_path, prompt):
    pol = EntropyLayerBudget(budget=0.5) + SparsePrefill(threshold=128, base=64, block=32, segment=32)
    assert pol.spec() == parse_policy(pol.spec()).spec()
    assert pol.describe()["stages"]["prefill"] == "sparse" and pol.retains
    llm = Llama(model_path, n_ctx=2048, kv_policy=pol, verbose=False)
    out = llm(llm.detokenize(prompt[:900]).decode(errors="ignore") + "\nSummary:", max_tokens=8, temperature=0.0)
    assert len(out["choices"][0]["text"]) > 0
    sp = llm.kv_sparse()
    assert sp.n_ubatch[1:].sum() > 0 and 0.0 < sp.total_density < 1.0
    llm.close()


def test_a_repeated_prompt_gives_the_same_logits_with_a_retention_policy(model_path, prompt):
    """Guided chunks evict between ubatches, so the cells a prompt lands in depend on what the cache held before;
    the block-sparse pooling groups cells by index: a cleared cache must be a fresh one (it was not: logits moved by
    up to 2 between two evaluations of one prompt)."""
    llm = Llama(model_path, n_ctx=1024, verbose=False, kv_policy="snapkv:budget=64+sparse:threshold=0,base=32")
    toks = list(prompt[:400])
    logits = []
    for _ in range(2):
        llm.reset()
        llm._ctx.kv_cache_seq_rm(-1, 0, -1)  # what a new prompt under kv_reuse=exact does when nothing can be kept
        llm.eval(toks)
        logits.append(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy())
    fresh = Llama(model_path, n_ctx=1024, verbose=False, kv_policy="snapkv:budget=64+sparse:threshold=0,base=32")
    fresh.eval(toks)
    assert np.array_equal(logits[0], logits[1])
    assert np.array_equal(logits[1], np.ctypeslib.as_array(fresh._ctx.get_logits(), shape=(fresh.n_vocab(),)))
    llm.close()
    fresh.close()


def test_logits_all_does_not_change_a_guided_sparse_prefill(model_path, prompt):
    """With logits_all every guided chunk's tokens give logits, and each of them counted as a token whose logits are
    read, so every segment attended to every block: a nearly dense prefill and other greedy text than without it."""
    spec = "snapkv:budget=128+sparse:threshold=256,base=128"
    outs, densities = [], []
    for logits_all in (False, True):
        llm = Llama(model_path, n_ctx=1024, verbose=False, kv_policy=spec, logits_all=logits_all)
        outs.append(llm.create_completion(list(prompt[:900]), max_tokens=12, temperature=0.0)["choices"][0]["text"])
        densities.append(llm.kv_sparse().density)
        llm.close()
    assert outs[0] == outs[1]
    np.testing.assert_array_equal(densities[0], densities[1])
    assert densities[0][1:].min() < 0.95


def test_without_flash_attention_prefill_stays_dense(model_path, prompt, dense):
    with pytest.warns(UserWarning, match="prompts run dense"):
        llm, logits = last_logits(model_path, prompt, SPARSE, flash_attn=False)
    assert (llm.kv_sparse().n_ubatch == 0).all()
    assert kl(dense, logits) < 0.02  # dense attention, without flash attention (f16 accumulation differs)
    llm.close()


def warns_and_runs_dense(model_path, tokens, spec, n_ctx, says):
    """A Llama that warns at construction that its prompts run dense, and does: no sparse ubatch over `tokens`."""
    with pytest.warns(UserWarning, match=says):
        llm = Llama(model_path, n_ctx=n_ctx, kv_policy=spec, verbose=False)
    llm.eval(tokens)
    assert (llm.kv_sparse().n_ubatch == 0).all()  # as it said
    llm.close()


def test_a_budget_whose_layers_never_reach_the_threshold_says_its_prompts_run_dense(model_path, prompt):
    """Found by an audit: entropy:budget=0.25+sparse ran its prompts dense, silently, with density 1.0 in every
    telemetry. A uniform budget's layers hold the budget, a chunk and the window (snapkv:budget=0.25: 1184 cells at
    n_ctx 4096, below threshold=2048). Entropy's layers grow to max_layer (twice the mean) as a prompt comes: a later
    audit saw entropy:budget=0.4+sparse warn at 1824 cells, then run sparse in layers of 2080-3040 cells."""
    warns_and_runs_dense(model_path, prompt[:800], "snapkv:budget=0.25+sparse", 4096,
                         r"kv_policy 'snapkv' with \+sparse: its layers hold at most 1184 cells .*"
                         r"below sparse's threshold=2048, so every prompt runs dense")
    with pytest.warns(UserWarning, match=r"kv_policy 'entropy' with \+sparse: its layers hold at most 985 cells .*"
                                         r"\(the largest layer budget, a prompt chunk and the window\)"):
        Llama(model_path, n_ctx=4096, kv_policy="entropy:budget=0.1+sparse", verbose=False).close()  # 2*409.6 + 166
    with warnings.catch_warnings():  # layers that may reach the threshold, or no budget: no warning
        warnings.simplefilter("error")
        llm = Llama(model_path, n_ctx=4096, kv_policy="entropy:budget=0.25+sparse:threshold=512", verbose=False)
        llm.eval(prompt)
        assert llm.kv_sparse().n_ubatch.sum() > 0
        llm.close()
        Llama(model_path, n_ctx=4096, kv_policy="entropy:budget=0.4+sparse", verbose=False).close()
        Llama(model_path, n_ctx=4096, kv_policy="none+sparse", verbose=False).close()


def test_a_context_smaller_than_the_threshold_says_its_prompts_run_dense(model_path, prompt):
    """Found by an audit: none+sparse at llama-cpp-python's default n_ctx=512, or 1024 or 2048, never ran sparse (the
    cells in use never reach threshold=2048), silently, with density 1.0. At n_ctx 2048 only a prompt of all 2048
    tokens reaches it: a completion's prompt leaves a position free for its answer."""
    warns_and_runs_dense(model_path, prompt[:1000], "none+sparse", 1024,
                         r"kv_policy 'none' with \+sparse: this context holds at most n_ctx=1024 tokens, below "
                         r"sparse's threshold=2048, so its prompts run dense")
    with pytest.warns(UserWarning, match=r"at most n_ctx=2048 tokens, only a prompt of all 2048 reaches sparse's "
                                         r"threshold=2048"):
        Llama(model_path, n_ctx=2048, kv_policy="none+sparse", verbose=False).close()


@pytest.mark.parametrize("block", [64, 128])
def test_a_block_larger_than_the_caches_padding_still_runs_sparse(model_path, prompt, block):
    """Found by an audit: a layer's cache was a whole number of 32 cells (416 for snapkv:budget=256), and the op
    attends to whole blocks, so with block=64 or 128 every layer ran dense, silently (density 1.0 everywhere)."""
    llm = Llama(model_path, n_ctx=2048, kv_policy=f"snapkv:budget=256+sparse:block={block},threshold=256,base={block}",
                verbose=False)
    llm.eval(prompt)
    assert all(s.n_cells % block == 0 for s in llm.kv_stats().layers)
    sp = llm.kv_sparse()
    assert (sp.n_ubatch[1:] > 0).all() and sp.total_density < 0.9
    llm.close()


@pytest.mark.parametrize("spec, key", [
    ("none+sparse:block=48", "block"),
    ("none+sparse:base=16", "base"),
    ("none+sparse:e_t=-1", "e_t"),
    ("none+sparse:per_head=2", "per_head"),
    ("none+sparse:segment=0", "segment"),
    ("none+sparse:alpha=-1", "alpha"),
    ("none+sparse:threshold=-5", "threshold"),
    ("none+sparse:budget=0.1", "budget"),
])
def test_bad_keys_fail_with_one_line_naming_the_key(spec, key):
    with pytest.raises(PolicyError) as e:
        parse_policy(spec)
    msg = str(e.value)
    assert key in msg and "\n" not in msg


@pytest.mark.parametrize("spec", ["none+sparse:skip=30", "snapkv:budget=64+sparse:skip=999"])
def test_a_skip_past_the_models_layers_is_refused(model_path, spec):
    """skip >= n_layer left every layer dense: a sparse prefill that never ran, without a word."""
    with pytest.raises(PolicyError, match=r"stage 'sparse': skip=\d+ leaves no layer sparse \(the model has 30 layers\)"):
        Llama(model_path, n_ctx=512, kv_policy=spec, flash_attn=True, verbose=False)
    Llama(model_path, n_ctx=512, kv_policy=spec.split(":skip")[0] + ":skip=29,threshold=0", flash_attn=True, verbose=False)


def test_the_threshold_counts_the_cells_in_use_not_llama_cpps_padded_length(model_path, prompt):
    """llama.cpp pads a ubatch's n_kv to 256, and the threshold was checked against it: a 200-token prompt ran sparse
    under threshold=256 (density 0.82, logits 9.7 from dense), an 1800-token one under the default 2048 (found by an
    audit). Below the threshold the prompt now runs llama.cpp's own attention, to the bit."""
    for n, spec in ((200, "none+sparse:threshold=256,base=64"), (1400, "none+sparse:threshold=1500,base=64")):
        llm, got = last_logits(model_path, prompt[:n], spec)
        ref, want = last_logits(model_path, prompt[:n], None, flash_attn=True)
        assert llm.kv_sparse().total_density == 1.0 and (llm.kv_sparse().n_ubatch == 0).all(), n
        np.testing.assert_array_equal(got, want)
        llm.close()
        ref.close()
    llm, _ = last_logits(model_path, prompt[:300], "none+sparse:threshold=256,base=64")  # past it: sparse
    assert llm.kv_sparse().total_density < 1.0
    llm.close()


def test_generate_batch_runs_sparse_prefill_on_llama_cpps_cache(model_path, prompt):
    """It raised "this context has no retention policy" for none+sparse, one prompt (found by an audit)."""
    spec = "none+sparse:threshold=256,base=64"
    llm = Llama(model_path, n_ctx=1024, kv_policy=spec, verbose=False)
    got = llm.generate_batch([prompt[:600]], 8)[0]
    assert llm.kv_sparse().total_density < 1.0
    fresh = Llama(model_path, n_ctx=1024, kv_policy=spec, verbose=False)
    want = []
    for t in fresh.generate(prompt[:600], top_k=1, temp=0.0):
        want.append(t)
        if len(want) == 8:
            break
    assert got == want
    llm.close()
    fresh.close()


@pytest.mark.parametrize("spec", ["none+sparse:threshold=600,base=64", "snapkv:budget=1024+sparse:threshold=256,base=64"])
def test_a_prompt_from_position_0_again_starts_from_a_fresh_state(model_path, prompt, spec):
    """The carried entropies, budgets and Dynamic flags were reset only by a sparse ubatch at position 0: where the
    first ubatch ran dense (below the threshold; every chunk of a retention policy), a context's next prompt started
    from the previous prompt's state (logits 0.35-2.6 from a fresh context's, every stage), and the telemetry summed
    the prompts (found by an audit)."""
    llm, first = last_logits(model_path, prompt, spec)
    density = llm.kv_sparse().total_density
    assert density < 1.0
    for p in (prompt[300:900], prompt):  # another prompt, then the first again
        llm.reset()
        llm.eval(p)
    np.testing.assert_array_equal(np.array(llm._ctx.get_logits()[: llm.n_vocab()]), first)
    assert llm.kv_sparse().total_density == density
    llm.close()
    # kvbench's density is the last repetition's prompt, as it says (it summed the repetitions)
    from test_bench import kvbench

    rows = [kvbench("-p", "1024", "-n", "1", "-r", r, "-t", "2", "--no-limit", "--policy", spec, "-o", "jsonl",
                    model_path=model_path) for r in ("1", "2")]
    assert all(p.returncode == 0 for p in rows), [p.stderr for p in rows]
    densities = [json.loads(p.stdout.splitlines()[-1])["density"] for p in rows]
    assert densities[0] == densities[1] < 1.0


def test_full_cache_plus_sparse_in_python():
    pol = FullCache() + SparsePrefill(base=512)
    assert pol.spec().startswith("none+sparse:") and "base=512" in pol.spec()
    assert pol.sparse


def test_a_new_call_gives_what_a_fresh_llama_does(model_path):
    """Sparse prefill on llama.cpp's own cache: llama-cpp-python's prefix reuse gave other text than a fresh Llama for
    a repeated prompt and for a chat's next turn (found by an audit); the prompt is now evaluated afresh."""
    spec = "none+sparse:threshold=64,base=64"
    llm = Llama(model_path, kv_policy=spec, n_ctx=1024, verbose=False)
    p1 = llm.detokenize(llm.tokenize(essays()[1].encode())[:300]).decode(errors="ignore")
    p1 += "\nQuestion: what is this about?\nAnswer:"
    first = llm(p1, max_tokens=16, temperature=0)["choices"][0]["text"]
    again = llm(p1, max_tokens=16, temperature=0)["choices"][0]["text"]
    p2 = p1 + first + "\nQuestion: and then?\nAnswer:"
    turn = llm(p2, max_tokens=16, temperature=0)["choices"][0]["text"]
    for prompt, got in ((p1, first), (p1, again), (p2, turn)):
        fresh = Llama(model_path, kv_policy=spec, n_ctx=1024, verbose=False)
        assert fresh(prompt, max_tokens=16, temperature=0)["choices"][0]["text"] == got
        fresh.close()
