"""A saved state continues exactly as the context it was saved from (llama-cpp-python's save_state / load_state):
the same next logits and greedy tokens, loaded into a new context or into the one that went on past the save, and
the same policy state (budgets, layer entropies, eviction counts, observation counters). Before the state held the
cells' layout, the observation and the step counters, a load changed the next tokens: the window queries, prompt
entropies and freeze counts restarted, and a quantized cache attended its cells in another order."""

from __future__ import annotations

import numpy as np
import pytest

from pykvcache import Llama
from pykvcache.corpus import essays_file

Q8_0, F16 = 8, 1


def logits(llm: Llama) -> np.ndarray:
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy()


def go_on(llm: Llama, first: int, n: int):
    """Evaluate `first`, then n greedy tokens: the tokens and every step's logits."""
    llm.eval([first])
    toks, rows = [], []
    for _ in range(n):
        rows.append(logits(llm))
        toks.append(int(np.argmax(rows[-1])))
        llm.eval([toks[-1]])
    return toks, np.stack(rows)


def policy_state(llm: Llama):
    mem = llm.kv_memory()
    layers = [(lb.budget, lb.capacity, lb.n_used, lb.entropy, lb.n_evicted) for lb in mem.layers]
    obs = llm.kv_telemetry() if llm.kv_policy.observes else None
    return layers, (obs.n_obs, obs.n_queries, obs.entropy.tolist()) if obs is not None else None


@pytest.mark.parametrize("spec, tk", [
    ("h2o:budget=0.25", F16), ("h2o:budget=0.25", Q8_0), ("entropy:budget=0.1", F16),
    ("snapkv:budget=0.1+summarise", Q8_0), ("snapkv:budget=0.25+host+latent", F16), ("freeze", F16),
])
def test_a_loaded_state_goes_on_as_the_saved_context(model_path, spec, tk):
    def make() -> Llama:
        return Llama(model_path, n_ctx=1024, n_threads=2, verbose=False, kv_policy=spec, type_k=tk, type_v=tk,
                     flash_attn=True)

    llm = make()
    llm.eval(llm.tokenize(essays_file().read_text()[5000:9000].encode())[:700])
    for _ in range(20):  # decode steps before the save: evictions scatter the cells
        llm.eval([int(np.argmax(logits(llm)))])
    first = int(np.argmax(logits(llm)))
    state = llm.save_state()
    saved = policy_state(llm)
    toks, rows = go_on(llm, first, 12)

    llm.load_state(state)  # into the context that went on past the save
    assert policy_state(llm) == saved
    again, rows_again = go_on(llm, first, 12)
    fresh = make()
    fresh.load_state(state)
    assert policy_state(fresh) == saved
    new, rows_new = go_on(fresh, first, 12)
    assert again == toks and new == toks
    np.testing.assert_array_equal(rows_again, rows)  # to the last bit: the same cells in the same order
    np.testing.assert_array_equal(rows_new, rows)
