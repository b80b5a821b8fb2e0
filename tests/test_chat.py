"""Long multi-turn chats with a retention policy: more than 20 turns of a conversation several times longer than the
physical cache, with bounded memory, in both reuse modes (issue 15)."""

from __future__ import annotations

import pytest

from pykvcache import Llama

FACT = "Remember this: my locker code is 4817 and my cat is called Pixel."
QUESTIONS = [
    "What colour is the sky?", "Name a fruit.", "What is 2 plus 3?", "Say hello in French.", "Name a planet.",
    "What do bees make?", "Name a big city.", "What is ice made of?", "Name a musical instrument.",
    "What season is cold?", "Name an ocean.", "What do cows drink?", "Name a shape.", "What is the opposite of up?",
    "Name a vegetable.", "How many legs has a spider?", "Name a bird.", "What do we breathe?", "Name a metal.",
    "Name a colour of a flower.",
]
BUDGET = 128


def chat(llm, turns):
    """Run the conversation; returns (messages, KV bytes after each turn)."""
    msgs, sizes = [], []
    for q in turns:
        msgs.append({"role": "user", "content": q})
        r = llm.create_chat_completion(messages=msgs, max_tokens=12, temperature=0)
        msgs.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
        sizes.append(llm.kv_memory().bytes)
    return msgs, sizes


@pytest.mark.parametrize("reuse", ["exact", "continue"])
def test_twenty_turns_past_the_physical_cache(model_path, reuse):
    llm = Llama(model_path, n_ctx=2048, verbose=False, kv_policy=f"entropy:budget={BUDGET}", kv_reuse=reuse)
    msgs, sizes = chat(llm, [FACT] + QUESTIONS)
    assert len(msgs) // 2 >= 21 and llm.n_tokens > 4 * BUDGET
    # bounded: the buffers do not grow with the conversation once it is past the budget
    assert max(sizes[5:]) <= 1.1 * max(sizes[:5])
    mem = llm.kv_memory()
    # entropy evicts at the decode step after each refresh of its scores (every 16): up to 15 newer tokens beside
    # the budget, plus the token being decoded
    assert max(b.n_used for b in mem.layers) <= max(b.budget for b in mem.layers) + 16

    # the question about the first turn: the policy keeps the fact's tokens in more layers than the small talk
    ask = msgs + [{"role": "user", "content": "What is my locker code?"}]
    llm.create_chat_completion(messages=ask, max_tokens=1, temperature=0)
    ids = llm.input_ids[: llm.n_tokens].tolist()
    digits = set(llm.tokenize(b"4817", add_bos=False))
    fact_pos = [i for i in range(60) if ids[i] in digits]
    held = llm.kv_retained().mean(axis=0)
    assert len(fact_pos) == 4 and held[fact_pos].mean() > 0.2
    small_talk = held[fact_pos[-1] + 1: len(ids) - 200]  # the older turns, before the last 200 tokens
    assert held[fact_pos].mean() > 2 * small_talk.mean()


def test_exact_reuse_answers_as_a_fresh_context(model_path):
    turns = [FACT] + QUESTIONS[:6]
    llm = Llama(model_path, n_ctx=1024, verbose=False, kv_policy=f"snapkv:budget={BUDGET // 2}")
    msgs, _ = chat(llm, turns)
    ask = msgs + [{"role": "user", "content": "What is my cat called?"}]
    ours = llm.create_chat_completion(messages=ask, max_tokens=8, temperature=0)["choices"][0]["message"]["content"]
    fresh = Llama(model_path, n_ctx=1024, verbose=False, kv_policy=f"snapkv:budget={BUDGET // 2}")
    ref = fresh.create_chat_completion(messages=ask, max_tokens=8, temperature=0)["choices"][0]["message"]["content"]
    assert ours == ref
