"""Host tier and soft freeze (fate stage `host`, schedule stage `freeze`, preset `freeze`): bad input, tokens that
leave and come back bit for bit, bounded host memory, eviction into the host tier, telemetry that adds up, and a
saved state that holds both tiers; all on the real model."""

import numpy as np
import pytest

from conftest import PROSE

from pykvcache import H2O, Composed, FreezeSchedule, HostFate, HostTelemetry, Llama, PolicyError, parse_policy
from pykvcache.corpus import essays

N_CTX = 1024
PROMPT = ("Write a long and detailed story about a lighthouse keeper who finds a message in a bottle, "
          "and what she does in the weeks after.")


def make(model_path, policy, flash_attn=True, n_ctx=N_CTX):
    return Llama(model_path, n_ctx=n_ctx, n_batch=512, n_ubatch=512, kv_policy=policy, flash_attn=flash_attn,
                 verbose=False)


def generate(llm, n, prompt=PROMPT):
    """Greedy decode of n tokens after the prompt, one decode step per token; returns the tokens."""
    llm.eval(llm.tokenize(prompt.encode()))
    out = []
    for _ in range(n):
        tok = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))
        out.append(tok)
        llm.eval([tok])
    return out


def row_bytes(llm):
    """K+V bytes of one token in each layer's cache."""
    return [(s.k_bytes + s.v_bytes) // s.n_cells for s in llm.kv_stats().layers]


@pytest.mark.parametrize("spec,msg", [
    ("h2o+freeze", "freeze needs the host fate (+host)"),
    ("freeze+drop", "freeze needs the host fate (+host)"),
    ("freeze:tau=-1", "tau must be >= 0"),
    ("freeze:k=0", "k must be >= 1"),
    ("freeze:hist=100", "hist must be a multiple of 64"),
    ("freeze:limit=-1", "limit must be >= 0"),
    ("h2o:budget=200+host:limit=50", "limit (50) must be 0 (the context size) or at least the budget"),
    ("sink_recent+freeze+host", "needs a score stage that observes"),
    ("freeze:budget=0.1", "unknown key 'budget'"),
    ("freeze:z=0.3,rewalk=65", "rewalk must be in .0, 64. and span >= 1 .got rewalk=65"),
])
def test_bad_specs(spec, msg):
    with pytest.raises(PolicyError, match=msg.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        parse_policy(spec)


def test_composition_round_trips():
    p = parse_policy("freeze")
    assert p.spec() == "freeze:every=4,n_recent=32,chunk=128,tau=0.1,k=2,hist=128,limit=0,z=0,rewalk=0,span=16"
    # a stage is added to a policy that can run it: the host tier first, then the freeze that needs it
    composed = H2O(budget=0.1) + HostFate(limit=4096) + FreezeSchedule(tau=1.0)
    assert Composed(H2O(budget=0.1), (FreezeSchedule(tau=1.0), HostFate(limit=4096))).spec() == composed.spec()
    with pytest.raises(PolicyError, match="needs the host fate"):
        H2O(budget=0.1) + FreezeSchedule()
    q = parse_policy(composed.spec())
    assert q.spec() == composed.spec()
    assert q.describe()["stages"] == {"budget": "uniform", "score": "accumulated", "schedule": "freeze",
                                      "fate": "host", "prefill": "dense"}
    assert parse_policy(q.spec()).spec() == q.spec()


@pytest.mark.parametrize("flash_attn", [True, False])
def test_frozen_tokens_come_back_unchanged(model_path, flash_attn):
    llm = make(model_path, "freeze:tau=2,k=1", flash_attn=flash_attn)
    prompt = llm.tokenize(PROMPT.encode())
    llm.eval(prompt)
    layers = [0, 11, 29]
    before = {(s, p): llm.kv_cell_bytes(s, p) for s in layers for p in range(4, len(prompt) - 1)}
    assert all(v is not None for v in before.values())
    ever_frozen = np.zeros((30, len(prompt)), bool)
    for _ in range(60):
        tok = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))
        llm.eval([tok])
        ever_frozen |= llm.kv_host().state[:, :len(prompt)] == HostTelemetry.FROZEN
    # the test can fail: prompt tokens of the checked layers did leave their caches
    assert ever_frozen[layers].sum() > 20
    h = llm.kv_host()
    assert h.n_freeze > 0 and h.n_thaw > 0 and h.n_dropped == 0
    n_host = h.n_host
    assert n_host > 0
    assert llm.kv_thaw_all() == n_host
    assert llm.kv_host().n_host == 0
    assert llm.kv_memory().n_active == 30 * llm.n_tokens  # every token of every layer is back
    for key, (k, v) in before.items():
        assert llm.kv_cell_bytes(*key) == (k, v), key


def test_freeze_cuts_active_tokens_and_accounts_for_every_token(model_path):
    llm = make(model_path, "freeze")
    generate(llm, 120)
    h = llm.kv_host()
    mem = llm.kv_memory()
    n_tok = llm.n_tokens
    n_layer = h.state.shape[0]
    assert h.n_active == mem.n_active
    assert h.n_active + h.n_host == n_layer * n_tok  # nothing dropped: every token is active or frozen
    assert h.n_active < 0.8 * n_layer * n_tok
    assert h.n_frozen == h.n_host and h.n_evict == 0
    assert h.host_bytes == mem.host_bytes > 0
    assert mem.host_bytes_peak >= mem.host_bytes
    # host bytes are the frozen tokens' raw cache bytes
    counts = [(h.state[s] == HostTelemetry.FROZEN).sum() for s in range(n_layer)]
    assert h.host_bytes == sum(c * b for c, b in zip(counts, row_bytes(llm)))
    assert (h.state == HostTelemetry.ACTIVE).sum() == h.n_active
    # the recent window never freezes
    assert (h.state[:, n_tok - 32:] == HostTelemetry.ACTIVE).all()


def test_host_limit_drops_the_coldest(model_path):
    llm = make(model_path, "freeze:tau=2,k=1,limit=48")
    generate(llm, 60)
    h = llm.kv_host()
    assert h.n_dropped > 0
    per_layer = [(h.state[s] >= HostTelemetry.FROZEN).sum() for s in range(h.state.shape[0])]
    assert max(per_layer) <= 48
    assert (h.state == HostTelemetry.DROPPED).sum() > 0


def test_host_limit_drops_cold_tokens_before_frozen_ones(model_path):
    # the budget sends tokens cold into the host tier, the freeze sends others there with a timer: past the limit a
    # layer drops its cold tokens first, and a frozen one only once no cold one is left
    llm = make(model_path, "h2o:budget=48+host:limit=64+freeze:tau=0.5,k=1")
    llm.eval(llm.tokenize(PROMPT.encode()))
    prev = llm.kv_host().state
    cold_first = frozen_over_cold = 0
    for _ in range(120):
        llm.eval([int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))])
        state = llm.kv_host().state
        cur = state[:, :prev.shape[1]]
        dropped = (cur == HostTelemetry.DROPPED) & (prev != HostTelemetry.DROPPED)
        for s in range(state.shape[0]):
            kept_frozen = ((prev[s] == HostTelemetry.FROZEN) & (cur[s] == HostTelemetry.FROZEN)).any()
            kept_cold = ((prev[s] == HostTelemetry.COLD) & (cur[s] == HostTelemetry.COLD)).any()
            cold_first += int((dropped[s] & (prev[s] == HostTelemetry.COLD)).any() and kept_frozen)
            frozen_over_cold += int((dropped[s] & (prev[s] == HostTelemetry.FROZEN)).any() and kept_cold)
        prev = state
    assert cold_first > 0          # the case arose: a layer dropped cold tokens while it held frozen ones
    assert frozen_over_cold == 0   # and never dropped a frozen token while a cold one stayed


def test_eviction_into_the_host_tier_changes_nothing_else(model_path):
    text = " ".join(essays()[0].split())
    toks = None
    logits = []
    for spec in ("h2o:budget=96", "h2o:budget=96+host"):
        llm = make(model_path, spec)
        toks = toks or llm.tokenize(text.encode())[:400]
        llm.eval(toks)
        out = [np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy()]
        for t in toks[:8]:
            llm.eval([t])
            out.append(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy())
        logits.append(np.stack(out))
        if spec.endswith("+host"):
            h = llm.kv_host()
            assert h.n_evict == llm.kv_memory().n_evicted > 0
            assert h.n_host == h.n_evict and h.n_frozen == 0
            assert (h.state == HostTelemetry.COLD).sum() == h.n_host
            assert llm.kv_memory().host_bytes == h.host_bytes > 0
    np.testing.assert_array_equal(logits[0], logits[1])


def test_state_holds_both_tiers(model_path):
    llm = make(model_path, "freeze:tau=2,k=1")
    generate(llm, 40)
    h = llm.kv_host()
    assert h.n_host > 0
    data = llm.save_state()
    other = make(model_path, "freeze:tau=2,k=1")
    other.load_state(data)
    g = other.kv_host()
    assert g.n_host == h.n_host and g.host_bytes == h.host_bytes
    np.testing.assert_array_equal(g.state, h.state)
    assert other.kv_thaw_all() == llm.kv_thaw_all() == h.n_host
    for s in (0, 29):
        for p in range(0, llm.n_tokens, 7):
            assert other.kv_cell_bytes(s, p) == llm.kv_cell_bytes(s, p)


def test_host_telemetry_needs_a_host_tier(model_path):
    llm = make(model_path, "h2o:budget=96")
    with pytest.raises(PolicyError, match="no host tier"):
        llm.kv_host()


@pytest.mark.parametrize("spec,msg", [
    ("snapkv:budget=64+latent", "latent needs the host fate (+host)"),
    ("snapkv:budget=64+host+latent:gap=-1", "gap must be >= 0"),
    ("snapkv:budget=64+host+latent:repeat=2", "repeat must be 0"),
])
def test_bad_latent_specs(spec, msg):
    with pytest.raises(PolicyError, match=msg.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        parse_policy(spec)


def test_latent_reranking_brings_back_what_the_question_needs(model_path):
    """A fact compressed away before its question exists comes back when the question's turn re-ranks."""
    text = " ".join(essays()[1].split())
    fact = " The code of the blue locker is 4817."
    question = "\n\nWhat is the code of the blue locker? The code of the blue locker is"
    held, answer = {}, {}
    base = "snapkv:budget=96,guide=0+host"
    for spec in (base, base + "+latent:gap=1", base + "+latent:gap=0", base + "+freeze:gap=0"):
        llm = make(model_path, spec)
        body = llm.tokenize(text.encode())[:500]
        f = llm.tokenize(fact.encode(), add_bos=False)
        doc = body[:200] + f + body[200:]
        llm.eval(doc)                                   # turn 1: the document, compressed to 96 tokens per layer
        fpos = np.arange(200, 200 + len(f))
        llm.eval(llm.tokenize(question.encode(), add_bos=False))   # turn 2: the question
        out = []
        for _ in range(6):                              # the first decode step re-ranks (gap=1; gap=0: the question's end)
            out.append(int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)))))
            llm.eval([out[-1]])
        answer[spec] = llm.detokenize(out).decode(errors="replace")
        assert llm.n_tokens == len(doc) + len(llm.tokenize(question.encode(), add_bos=False)) + 6
        h = llm.kv_host()
        n_layer = h.state.shape[0]
        held[spec] = (h.state[:, fpos] == HostTelemetry.ACTIVE).sum()
        mem = llm.kv_memory()
        assert all(b.n_used <= b.budget + 16 for b in mem.layers)  # snapkv evicts once per 16 decode steps
        assert h.n_active + h.n_host == n_layer * llm.n_tokens  # nothing dropped
        if "gap=0" in spec:  # twice at the end of each prompt (the document's and the question's)
            assert h.n_rerank == 4 * n_layer and h.n_promote > 0
        elif "latent" in spec:
            assert h.n_rerank == n_layer and h.n_promote > 0
        else:
            assert h.n_rerank == 0 and h.n_promote == 0
    for spec in held:
        if spec != base:
            assert held[spec] > held[base], (spec, held)
    # re-ranked by the question itself, the answer is the fact's (the full cache answers 4817 too)
    assert "4817" in answer[base + "+latent:gap=0"] and "4817" in answer[base + "+freeze:gap=0"], answer


def test_a_rerank_at_the_prompt_end_keeps_what_the_prompt_saw(model_path, monkeypatch):
    """gap=0 on a prompt just above the budget: the first token (the attention sink) keeps its place in most layers
    against the tokens after it that inherit its mass, and a prompt no eviction reached keeps the window's K/V computed over the
    whole prompt (only its last token is evaluated again); a chat with h2o's re-rank answered '' and SnapKV's a later
    turn in garbage before."""
    import llama_cpp

    import pykvcache.llama

    evaluated, rerun = [], []
    inner = llama_cpp.Llama.eval
    monkeypatch.setattr(llama_cpp.Llama, "eval", lambda self, tokens: (evaluated.append(len(tokens)), inner(self, tokens)))
    native = pykvcache.llama.native

    class CountingLib:  # the tokens the prompt's end evaluates again (returned by llama_kvp_latent_prompt_end)
        def __getattr__(self, name):
            return getattr(native()[1], name)

        def llama_kvp_latent_prompt_end(self, *args):
            rerun.append(native()[1].llama_kvp_latent_prompt_end(*args))
            return rerun[-1]

    monkeypatch.setattr(pykvcache.llama, "native", lambda: (native()[0], CountingLib()))
    prompt = ("<|im_start|>system\nYou are a helpful assistant. The secret code is 4417. Remember it.<|im_end|>\n"
              "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    for spec, k_window in (("h2o:budget=36+host+latent:gap=0", 1), ("snapkv:budget=36,guide=0+host+latent:gap=0", 32)):
        llm = make(model_path, spec)
        tokens = llm.tokenize(prompt.encode(), special=True)
        assert 36 < len(tokens) < 64
        evaluated.clear()
        rerun.clear()
        llm.eval(tokens)
        assert evaluated == [len(tokens)] and rerun == [1], (spec, evaluated, rerun)  # its last token after each re-rank
        state = llm.kv_host().state  # a few first layers do without the sink, as their eviction alone decides
        assert (state[:, 0] == HostTelemetry.ACTIVE).sum() >= 2 * state.shape[0] // 3, (spec, state[:, :8])
        out = llm.create_completion(tokens, max_tokens=8, temperature=0.0)["choices"][0]["text"]
        assert "4" in out, (spec, out)
        # a prompt evicted from while it was evaluated (chunks): the window's tokens are evaluated again
        long = llm.tokenize((" ".join(essays()[2].split()[:500]) + " What is this about?").encode())[:600]
        llm.reset()
        rerun.clear()
        llm.eval(long)
        assert llm.kv_memory().n_evicted > 0 and rerun == [k_window], (spec, rerun)


def test_a_rerank_at_the_prompt_end_under_a_budget_that_never_binds_is_the_full_cache(model_path):
    """Nothing evicted, nothing moved between the tiers: the prompt's own logits stand (its last token evaluated again
    alone gave other rounding, up to 0.6 in a logit, and other greedy text from the 13th token)."""
    text = " ".join(essays()[1].split())
    out = []
    for spec in (None, "snapkv:budget=1024+host+latent:gap=0"):
        llm = make(model_path, spec, flash_attn=False)  # on the CPU flash attention rounds by the cache's size
        toks = llm.tokenize(text.encode())[:500]
        llm.eval(toks)
        out.append([np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy()])
        for _ in range(24):
            llm.eval([int(np.argmax(out[-1][-1]))])
            out[-1].append(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy())
        if spec:
            assert llm.kv_memory().n_evicted == 0
    np.testing.assert_array_equal(np.stack(out[0]), np.stack(out[1]))


@pytest.mark.parametrize("spec", ["freeze:z=1,rewalk=4", "h2o:budget=128+host+freeze"])
def test_a_prefix_kept_from_a_short_request_starts_the_freeze_afresh(model_path, spec):
    """kv_reuse=exact keeps a prefix only where it is what a fresh evaluation reaches; the freeze's counts and the
    ladder's statistics of the earlier request's decode steps stayed with it, and the repeated request answered other
    text than a fresh context (a server audit: after a request cut short or of max_tokens 3)."""
    msgs = [{"role": "user", "content": "Tell me a long story about a dragon."}]
    fresh = make(model_path, spec).create_chat_completion(msgs, max_tokens=24, temperature=0.0)
    llm = make(model_path, spec)
    llm.create_chat_completion(msgs, max_tokens=3, temperature=0.0)
    again = llm.create_chat_completion(msgs, max_tokens=24, temperature=0.0)
    assert again["choices"][0]["message"]["content"] == fresh["choices"][0]["message"]["content"]


def test_the_ladder_of_sequence_views_reads_each_ones_own_logits(model_path):
    """A view gives the context back once it has sampled; the ladder then read the context's last logits, by then
    another view's, and two requests served at once (--n_parallel 2) answered otherwise than alone."""
    import threading

    from pykvcache.parallel import sequence_views

    spec = "freeze:z=1,rewalk=4"
    prompts = [" ".join(essays()[0].split()[:300]) + "\nSummary:", " ".join(essays()[1].split()[:250]) + "\nIn short,"]
    alone = [make(model_path, spec).create_completion(p, max_tokens=40, temperature=0.0)["choices"][0]["text"]
             for p in prompts]
    llm = Llama(model_path, n_ctx=2 * N_CTX, n_seq_max=2, kv_policy=spec, verbose=False)
    views = sequence_views(llm)
    out = [None, None]

    def run(i):
        out[i] = views[i].create_completion(prompts[i], max_tokens=40, temperature=0.0)["choices"][0]["text"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == alone


def test_freeze_composes_with_latent_reranking():
    spec = "snapkv:budget=0.1+host+freeze:gap=0"
    pol = parse_policy(spec)
    assert parse_policy(pol.spec()).spec() == pol.spec()
    assert "gap=0" in pol.spec() and pol.describe()["stages"]["schedule"] == "freeze"
    assert int(parse_policy("freeze").to_native().gap) == -1  # the preset does not re-rank
    with pytest.raises(PolicyError, match="gap must be >= -1"):
        parse_policy("snapkv:budget=0.1+host+freeze:gap=-2")


LADDER = "freeze:tau=2,k=1,every=1,z=0.3,rewalk=3,span=4"


def test_recovery_ladder_is_off_unless_asked(model_path):
    from pykvcache._native import native
    from pykvcache.recovery import ladder_of

    llm = make(model_path, "freeze")
    assert ladder_of(llm) is None
    ffi, lib = native()
    logits = ffi.new("float[]", llm.n_vocab())
    assert lib.llama_kvp_recover_step(llm._native_ctx(), logits, llm.n_vocab()) == -1
    assert "needs the freeze schedule with z > 0" in ffi.string(lib.llama_kvp_last_error()).decode()
    with pytest.raises(PolicyError, match="z must be >= 0"):
        parse_policy("freeze:z=-1")
    assert llm.kv_recovery_events() == []
    with pytest.raises(PolicyError, match=r"no recovery ladder \(the freeze schedule's with z > 0"):
        make(model_path, "snapkv:budget=64").kv_recovery_events()  # it said: no host tier (fate stage 'host')


def test_recovery_ladder_reads_masked_logits_and_skips_a_nan(model_path):
    """-inf logits (a grammar's or a logit bias's masked tokens) have probability 0: the ladder still warms up and sees a
    spike; a NaN step is left out. One -inf used to make every later entropy NaN, and the ladder never acted again."""
    import numpy as np

    from pykvcache._native import native

    llm = make(model_path, "freeze:z=2,span=4")
    ffi, lib = native()
    ctx, n = llm._native_ctx(), llm.n_vocab()
    calm = np.full(n, -np.inf, dtype=np.float32)
    calm[:4] = [10.0, 0.0, 0.0, 0.0]  # nearly certain: entropy ~0.002 nats
    flat = np.where(np.arange(n) < 1000, 0.0, -np.inf).astype(np.float32)  # log(1000) nats
    step = lambda x: lib.llama_kvp_recover_step(ctx, ffi.cast("float *", ffi.from_buffer(x)), n)  # noqa: E731
    for i in range(12):
        calm[1] = 0.5 * (i % 2)  # a little variance for the running statistics
        assert step(calm) == 0
    assert step(np.full(n, np.nan, dtype=np.float32)) == 0  # left out
    assert step(flat) == 1  # a spike: level 1
    (ev,) = llm.kv_recovery_events()
    assert ev.level == 1 and abs(ev.entropy - np.log(1000)) < 1e-3


def test_recovery_ladder_climbs_acts_and_streams_the_same_text(model_path):
    texts = []
    for stream in (False, True):
        llm = make(model_path, LADDER)
        out = llm.create_completion(PROMPT + "\n\nOnce upon a time,", max_tokens=96, temperature=0.0, stream=stream)
        texts.append("".join(c["choices"][0]["text"] for c in out) if stream else out["choices"][0]["text"])
        ev = llm.kv_recovery_events()
        h = llm.kv_host()
        assert len(ev) > 0 and all(1 <= e.level <= 4 for e in ev)
        assert list(h.n_recover) == [sum(e.level == lv for e in ev) for lv in (1, 2, 3, 4)]
        # a spike climbs one level from where the last one left it (calm spells bring it down, a Rewalk restarts)
        for a, b in zip(ev, ev[1:]):
            assert b.level == 1 or b.level == a.level + 1 or b.step - a.step >= 4
        assert h.n_recover[3] > 0 and h.n_thaw > 0
        # the server's KV stats show the ladder's events by level (not shown until the 35th session)
        from pykvcache.server import kv_stats_of
        shown = kv_stats_of(llm)["host"]
        assert shown["n_recover"] == list(h.n_recover) and shown["n_promote"] == h.n_promote
        assert len(llm.tokenize(texts[-1].encode(), add_bos=False)) >= 90  # max_tokens honoured, nothing lost
    assert texts[0] == texts[1]


def test_a_rewalk_generates_again_from_the_prefix_it_rolled_back_to(model_path, monkeypatch):
    """After a roll-back the prefix's last token is evaluated again before the first token is sampled: llama-cpp-python
    took the prefix as cached and sampled from the logits of before the roll-back, so the rolled-back tokens vanished
    from the text ("don't like." became "don."; found by an audit)."""
    import llama_cpp

    import pykvcache.recovery as recovery

    llm = make(model_path, LADDER)
    evals, restarts = [], []
    eval_orig, generate_orig = llm.eval, recovery.llama_cpp.Llama.generate

    def eval_logged(tokens):
        evals.append((llm.n_tokens, len(tokens)))
        return eval_orig(tokens)

    def generate_logged(self, tokens, *args, **kwargs):
        restarts.append((len(tokens), len(evals)))
        return generate_orig(self, tokens, *args, **kwargs)

    monkeypatch.setattr(llm, "eval", eval_logged)
    monkeypatch.setattr(recovery.llama_cpp.Llama, "generate", generate_logged)
    llm.create_completion(PROMPT + "\n\nOnce upon a time,", max_tokens=96, temperature=0.0)
    rewalks = restarts[1:]  # the first is the prompt's
    assert len(rewalks) == llm.kv_host().n_recover[3] > 0
    for p0, i in rewalks:
        assert evals[i] == (p0 - 1, 1)  # the prefix's last token, again, before anything is sampled
    assert llama_cpp  # the module patched is llama-cpp-python's


def test_a_ladder_stops_at_the_context_end(model_path):
    """Held tokens are generated past max_tokens; at n_ctx the held ones are final (it ran on past n_ctx)."""
    llm = Llama(model_path, n_ctx=256, verbose=False, kv_policy="freeze:tau=2,k=1,every=1,z=0.3,rewalk=64,span=4")
    prompt = llm.tokenize(b"Once upon a time, in a land far away,")
    out = llm.create_completion(prompt, max_tokens=256 - len(prompt), temperature=0.0)
    assert llm.n_tokens <= 256 and out["usage"]["completion_tokens"] <= 256 - len(prompt)
    # a retention policy's cache has room past n_ctx, the context's positions not (the token record was cut silently)
    plain = Llama(model_path, n_ctx=256, verbose=False, kv_policy="snapkv:budget=64")
    plain.eval(list(range(1000, 1200)))
    with pytest.raises(RuntimeError, match="n_ctx=256 positions are used"):
        plain.eval(list(range(2000, 2100)))


def test_kvbench_counts_the_ladder(model_path):
    import json
    import subprocess

    from pykvcache import cli

    cmd = [str(cli.kvbench_path()), "--no-progress", "--no-limit", "-p", "64", "-n", "48", "-r", "1", "-t", "2",
           "--policy", LADDER, "-o", "json", "-m", model_path]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd="/")
    assert out.returncode == 0, out.stderr
    rows = {r["label"]: r for r in json.loads(out.stdout)["results"]}
    n = rows[LADDER]["n_recover"]
    # every climb passes level 1 before level 2, and level 2 before the upper ones (quiet steps reset it to 0)
    assert len(n) == 4 and n[0] > 0 and n[0] >= n[1] and (n[2] + n[3] == 0 or n[1] > 0)
    assert rows["full"]["n_recover"] == [0, 0, 0, 0]


def test_kvbench_reports_the_host_tier(model_path):
    import json
    import subprocess

    from pykvcache import cli

    spec = "snapkv:budget=64,guide=0+host+latent:gap=0"
    base = [str(cli.kvbench_path()), "--no-progress", "--no-limit", "-p", "256", "-n", "16", "-r", "1", "-t", "2",
            "--policy", spec, "-m", model_path]
    out = subprocess.run(base + ["-o", "json"], capture_output=True, text=True, timeout=300, cwd="/")
    assert out.returncode == 0, out.stderr
    rows = {r["label"]: r for r in json.loads(out.stdout)["results"]}
    r, full = rows[spec], rows["full"]
    n_layer = len(r["kv_layer_bytes"])
    assert r["host"] and not full["host"]
    assert r["n_rerank"] == 2 * n_layer and r["n_promote"] > 0   # gap=0: twice at the end of the prompt
    assert r["n_host_evict"] >= n_layer * (256 - 64) and r["n_dropped"] == 0
    assert r["host_bytes_peak"] > 0
    md = subprocess.run(base, capture_output=True, text=True, timeout=300, cwd="/").stdout
    assert "| host peak MiB |" in md and md.count(f"| {spec} |") == 3  # the rows, the host tier, the policy host time


def test_speculative_decoding_with_the_latent_rerank(model_path):
    """A draft model's tokens are evaluated in one batch during decoding; they were taken for a prompt's end and
    re-ranked, which removed the logits generate() samples them with (the process aborted in llama.cpp)."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    spec = "snapkv:budget=0.1+host+latent:gap=0"
    prompt = (PROSE + " ") * 3 + "In one sentence, the mission was"
    texts = []
    for kwargs in ({"draft_model": LlamaPromptLookupDecoding(num_pred_tokens=4)}, {"logits_all": True}):
        llm = Llama(model_path, n_ctx=1024, verbose=False, kv_policy=spec, **kwargs)
        texts.append(llm(prompt, max_tokens=16, temperature=0)["choices"][0]["text"])
        llm.close()
    # the same answer; not to the last token: the draft's batch is scored as a prompt chunk (other rounding, and
    # the memory's schedule restarts as after a chunk)
    assert texts[0].strip() and texts[0][:40] == texts[1][:40]
