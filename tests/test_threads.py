"""One Llama used from several threads: a clear error where llama.cpp would crash, streams that may change threads."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
import threading

import pytest

from pykvcache import ConcurrentUseError, Llama

PROMPTS = ["Story one: once upon a time", "Story two: the lighthouse keeper"]
SPECS = [None, "snapkv:budget=0.5"]


def _text(llm: Llama, prompt: str, **kwargs) -> str:
    return llm(prompt, max_tokens=16, temperature=0, **kwargs)["choices"][0]["text"]


@pytest.mark.parametrize("spec", SPECS)
def test_a_second_thread_gets_an_error_while_a_call_runs_and_the_first_finishes_alike(model_path, spec):
    llm = Llama(model_path, n_ctx=512, n_threads=1, verbose=False, kv_policy=spec)
    ref = [_text(llm, p) for p in PROMPTS]
    inside, go_on = threading.Event(), threading.Event()

    def hold(input_ids, scores):  # runs inside the first thread's sampling: the Llama is busy there
        inside.set()
        go_on.wait(60)
        return scores

    first: list = []
    t = threading.Thread(target=lambda: first.append(_text(llm, PROMPTS[0], logits_processor=[hold])))
    t.start()
    assert inside.wait(60)
    with pytest.raises(ConcurrentUseError, match="another thread"):
        _text(llm, PROMPTS[1])
    with pytest.raises(ConcurrentUseError):
        llm.kv_memory()
    go_on.set()
    t.join(60)
    assert first == [ref[0]]  # the refused call left the running one alone
    assert _text(llm, PROMPTS[1]) == ref[1]
    llm.close()


def test_a_stream_consumed_from_changing_threads_gives_its_text(model_path):
    llm = Llama(model_path, n_ctx=512, n_threads=1, verbose=False, kv_policy="snapkv:budget=0.5")
    ref = _text(llm, PROMPTS[0])
    stream = llm(PROMPTS[0], max_tokens=16, temperature=0, stream=True)
    parts: list = []

    def step() -> None:
        for chunk in stream:
            parts.append(chunk["choices"][0]["text"])
            return

    for _ in range(40):  # a web server's worker threads take turns on one stream
        t = threading.Thread(target=step)
        t.start()
        t.join(60)
    assert "".join(parts) == ref
    llm.close()


def test_a_stream_interrupted_by_another_generation_is_refused_when_it_resumes(model_path):
    llm = Llama(model_path, n_ctx=512, n_threads=1, verbose=False, kv_policy="snapkv:budget=0.5")
    ref = [_text(llm, p) for p in PROMPTS]
    first = llm(PROMPTS[0], max_tokens=16, temperature=0, stream=True)
    next(first)
    assert _text(llm, PROMPTS[1]) == ref[1]
    with pytest.raises(ConcurrentUseError, match="interrupted by another call"):
        next(first)
    assert _text(llm, PROMPTS[0]) == ref[0]
    llm.close()


@pytest.mark.parametrize("call", ["eval", "generate_batch", "load_state"])
def test_a_stream_is_refused_after_a_call_that_changed_the_cache_in_between(model_path, call):
    # before: generate_batch or eval gave the stream other text silently, load_state aborted the process
    llm = Llama(model_path, n_ctx=512, n_threads=1, verbose=False, kv_policy="snapkv:budget=0.5")
    ref = _text(llm, PROMPTS[0])
    state = llm.save_state()
    first = llm(PROMPTS[0], max_tokens=16, temperature=0, stream=True)
    next(first)
    other = llm.tokenize(PROMPTS[1].encode())
    {"eval": lambda: llm.eval(other), "generate_batch": lambda: llm.generate_batch([other], max_tokens=2),
     "load_state": lambda: llm.load_state(state)}[call]()
    with pytest.raises(ConcurrentUseError, match="interrupted by another call"):
        next(first)
    assert _text(llm, PROMPTS[0]) == ref
    llm.close()


def test_a_refused_state_load_leaves_a_paused_stream_going_on(model_path):
    llm = Llama(model_path, n_ctx=512, n_threads=1, verbose=False, kv_policy="snapkv:budget=0.5")
    ref = _text(llm, PROMPTS[0])
    other = Llama(model_path, n_ctx=512, n_threads=1, verbose=False, kv_policy="snapkv:budget=0.25")
    _text(other, PROMPTS[1])
    foreign = other.save_state()
    other.close()
    stream = llm(PROMPTS[0], max_tokens=16, temperature=0, stream=True)
    first = next(stream)["choices"][0]["text"]
    with pytest.raises(RuntimeError, match="cannot be loaded here"):
        llm.load_state(foreign)  # the context is unchanged: the stream may go on
    assert first + "".join(c["choices"][0]["text"] for c in stream) == ref
    llm.close()


def test_two_threads_hammering_one_llama_never_crash_the_process(model_path, tmp_path):
    # llama.cpp aborts the process (GGML_ASSERT) when two threads decode in one context: run it in a child
    script = tmp_path / "hammer.py"
    script.write_text(textwrap.dedent(f"""
        import threading
        from pykvcache import ConcurrentUseError, Llama
        llm = Llama({model_path!r}, n_ctx=512, n_threads=1, verbose=False)
        prompts = {PROMPTS!r}
        ref = [llm(p, max_tokens=16, temperature=0)["choices"][0]["text"] for p in prompts]
        res = []
        def run(i):
            for _ in range(4):
                try:
                    res.append(llm(prompts[i], max_tokens=16, temperature=0)["choices"][0]["text"] == ref[i])
                except ConcurrentUseError:
                    res.append("refused")
        ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        print("RESULTS", sorted(map(str, res)))
        print("AFTER", llm(prompts[0], max_tokens=16, temperature=0)["choices"][0]["text"] == ref[0])
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    results = ast.literal_eval(out.stdout.split("RESULTS", 1)[1].splitlines()[0])
    assert len(results) == 8 and set(results) <= {"True", "refused"}, results  # every answer right or refused
    assert "AFTER True" in out.stdout


@pytest.mark.parametrize("spec", [None, "snapkv:budget=0.5+summarise"])
def test_a_llama_and_its_sequence_views_in_threads_of_their_own_take_turns(model_path, tmp_path, spec):
    # before: the Llama's decodes and a view's ran at once in the shared context (a segfault or a GGML_ASSERT abort)
    stdout = _views_child(tmp_path, model_path, """
        ref = [text(llm, prompts[0]), text(views[1], prompts[1])]
        res = []
        def run(f):
            for _ in range(4):
                try:
                    res.append(str(f()))
                except Exception as e:
                    res.append(type(e).__name__)
        jobs = [lambda: text(llm, prompts[0]) == ref[0], lambda: text(views[1], prompts[1]) == ref[1],
                lambda: spec is None or views[0].kv_memory().n_active > 0]
        ts = [threading.Thread(target=run, args=(f,)) for f in jobs]
        [t.start() for t in ts]
        [t.join() for t in ts]
        print("RESULTS", sorted(res))
        print("AFTER", text(llm, prompts[0]) == ref[0], text(views[1], prompts[1]) == ref[1])
    """, spec=spec, n_ctx=1024, n_seq=2)
    results = ast.literal_eval(stdout.split("RESULTS", 1)[1].splitlines()[0])
    assert results == ["True"] * 12, results  # every answer right, none refused: they waited for their turns
    assert "AFTER True True" in stdout


def test_turns_pass_from_token_to_token_within_a_thread_and_wait_across_threads():
    from pykvcache.parallel import Turns

    turns, a, b = Turns(), object(), object()
    turns.take(a)
    assert turns.held_here()
    turns.take(b)  # the same thread: passed on, not a deadlock (a view's read, then its generation's own token)
    assert turns.holder is b
    turns.give(a)  # no longer a's: nothing happens
    assert turns.holder is b and turns.held_here()
    got = []
    t = threading.Thread(target=lambda: (turns.take(a), got.append(turns.held_here()), turns.give(a)))
    t.start()
    t.join(0.3)
    assert t.is_alive() and not got  # another thread waits for the turn
    turns.give(b)
    t.join(10)
    assert got == [True] and turns.holder is None and not turns.held_here()


def test_a_paused_view_stream_its_telemetry_and_a_state_load_beside_the_llama(model_path, tmp_path):
    # before: reading a view's telemetry while its stream was paused kept the turn under the stream's token, so the
    # stream's thread and the reader's Llama call decoded at once (a segfault) or the others hung; a state load through
    # the Llama left the views' token records stale (wrong text); a view's save_state took no turn
    stdout = _views_child(tmp_path, model_path, """
        empty = llm.save_state()
        ref = [text(llm, prompts[0]), text(views[1], prompts[1])]
        llm.load_state(empty)
        print("STALE", views[1].n_tokens, text(views[1], prompts[1]) == ref[1])
        out = {}
        for _ in range(3):
            paused, read = threading.Event(), threading.Event()
            def a():
                it = views[1](prompts[1], max_tokens=16, temperature=0, stream=True)
                parts = [next(it)["choices"][0]["text"]]
                paused.set()
                read.wait(120)  # then goes on beside b's completion
                out["a"] = out.get("a", True) and "".join(parts + [c["choices"][0]["text"] for c in it]) == ref[1]
            def b():
                paused.wait(120)
                views[1].kv_stats()  # the stream is paused: nothing of it runs now
                read.set()
                out["b"] = out.get("b", True) and text(llm, prompts[0]) == ref[0]
            ts = [threading.Thread(target=f) for f in (a, b)]
            [t.start() for t in ts]
            [t.join(200) for t in ts]
        print("PAUSED", dict(sorted(out.items())))
        turns, held = llm._exclusive.turns, threading.Event()
        def hold():
            tok = object()
            turns.take(tok)
            held.set()
            time.sleep(1.0)
            turns.give(tok)
        h = threading.Thread(target=hold)
        h.start()
        held.wait(60)
        t0 = time.time()
        views[2].save_state()
        print("WAITED", time.time() - t0 > 0.5)
        h.join()
    """, spec="snapkv:budget=0.5", n_ctx=1536, n_seq=3)
    assert "STALE 0 True" in stdout  # the view's record restarted with the load, and its answer is right
    assert "PAUSED {'a': True, 'b': True}" in stdout
    assert "WAITED True" in stdout


def test_sequence_stats_beside_the_llama_and_a_stream_refused_cleanly_after_a_state_load(model_path, tmp_path):
    # before: sequence_stats raised ConcurrentUseError while the Llama streamed in another thread (its next step had
    # marked itself running while it waited for its turn), and a view's step that waited for its turn while another
    # view loaded a state decoded on the loaded cache and yielded one wrong token before it was refused
    stdout = _views_child(tmp_path, model_path, """
        assert sequence_views(llm) == views  # the same views again
        empty = views[2].save_state()
        def stream(who, p):
            parts = []
            try:
                for c in who(p, max_tokens=16, temperature=0, stream=True):
                    parts.append(c["choices"][0]["text"])
            except ConcurrentUseError:
                return "".join(parts), True
            return "".join(parts), False
        ref = [stream(llm, prompts[0])[0], stream(views[1], prompts[1])[0]]
        done, errors, n_stats = threading.Event(), [], [0]
        def stats():
            while not done.is_set():
                try:
                    sequence_stats(llm, views)
                    n_stats[0] += 1
                except Exception as e:
                    errors.append(type(e).__name__)
        t = threading.Thread(target=stats)
        t.start()
        same = [stream(llm, prompts[0]) == (ref[0], False) for _ in range(3)]
        done.set()
        t.join(60)
        print("STATS", same, errors, n_stats[0] > 0)
        done.clear()
        def loads():
            while not done.is_set():
                views[2].load_state(empty)
                time.sleep(0.02)
        t = threading.Thread(target=loads)
        t.start()
        got = [stream(views[1], prompts[1]) for _ in range(4)]
        done.set()
        t.join(60)
        print("LOADS", all(ref[1].startswith(text) and (refused or text == ref[1]) for text, refused in got),
              sum(refused for _, refused in got))
    """, spec="snapkv:budget=0.5", n_ctx=1536, n_seq=3)
    assert "STATS [True, True, True] [] True" in stdout, stdout
    assert "LOADS True" in stdout, stdout  # every stream's text is the reference or a prefix of it


def _views_child(tmp_path, model_path, body: str, spec=None, n_ctx=1536, n_seq=3) -> str:
    """Runs `body` in a child process after making `llm` (the Llama), `views` (its sequence views), `prompts` and
    `text(who, prompt)`; a crash or a hang (its stacks after 240 s) fails the test. Returns the child's stdout."""
    script = tmp_path / "views.py"
    script.write_text(textwrap.dedent(f"""
        import faulthandler, threading, time
        faulthandler.dump_traceback_later(240, exit=True)
        from pykvcache import ConcurrentUseError, Llama
        from pykvcache.parallel import sequence_stats, sequence_views
        spec, prompts = {spec!r}, {PROMPTS!r}
        llm = Llama({model_path!r}, n_ctx={n_ctx}, n_seq_max={n_seq}, n_threads=1, verbose=False, kv_policy=spec)
        views = sequence_views(llm)
        text = lambda who, p: who(p, max_tokens=16, temperature=0)["choices"][0]["text"]
    """) + textwrap.dedent(body))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout
