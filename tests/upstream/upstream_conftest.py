"""conftest.py for llama-cpp-python 0.3.36's own tests, run on pykvcache (copied next to them by tests/test_upstream.py).

It changes what the tests run on, never what they assert: `llama_cpp.Llama` becomes `pykvcache.Llama` with the policy
of $PYKVCACHE_TEST_POLICY ("none": no policy), and the hub downloads become the embedded SmolLM2 model for the
transformer fixtures and a skip, with its reason, for the model kinds pykvcache does not embed. The model-specific
expected strings are edited by tests/upstream/llama-cpp-python-0.3.36.patch.
"""

from __future__ import annotations

import json
import os
import sys
import types
import weakref

import pykvcache  # before llama_cpp: points it at the patched libllama

import llama_cpp
import pytest

POLICY = os.environ.get("PYKVCACHE_TEST_POLICY", "none")

# repo_id/filename of the hub models the tests ask for -> None (the embedded model) or the reason to skip
HUB_MODELS = {
    "lmstudio-community/Qwen3.5-0.8B-GGUF/Qwen3.5-0.8B-Q8_0.gguf": None,
    "ggml-org/models/tinyllamas/stories15M-q4_0.gguf": None,
    "CompendiumLabs/bge-small-en-v1.5-gguf/bge-small-en-v1.5-q4_k_m.gguf":
        "needs an embedding model (BERT) from the hub: pykvcache's tests download nothing and embed SmolLM2 only",
    "QuantFactory/mamba-130m-hf-GGUF/mamba-130m-hf.Q2_K.gguf":
        "needs a recurrent model (Mamba) from the hub: pykvcache's tests download nothing (and its policies refuse "
        "recurrent memory)",
    "tiiuae/Falcon-H1-Tiny-90M-Instruct-GGUF/Falcon-H1-Tiny-90M-Instruct-Q2_K.gguf":
        "needs a hybrid model (Falcon-H1) from the hub: pykvcache's tests download nothing (and its policies refuse "
        "hybrid memory)",
}


def hf_hub_download(repo_id: str, filename: str, *args, **kwargs) -> str:
    """The embedded model instead of a hub download (no network), or a skip for a model kind not embedded."""
    key = f"{repo_id}/{filename}"
    if key not in HUB_MODELS:
        pytest.fail(f"the upstream tests ask for a hub model this harness does not know: {key}")
    reason = HUB_MODELS[key]
    if reason is not None:
        pytest.skip(reason)
    return pykvcache.default_model_path()


hub = types.ModuleType("huggingface_hub")
hub.hf_hub_download = hf_hub_download
sys.modules["huggingface_hub"] = hub


# what the policy under test did in the suite's contexts, written at the end for tests/test_upstream.py: how many
# contexts ran it and the tokens its layers evicted (a suite that ran without it would show none)
RECORD = {"policy": POLICY, "contexts": 0, "evicted": 0}
_OPEN = weakref.WeakSet()


def _count(llm) -> None:
    if llm in _OPEN and llm._ctx.ctx is not None:
        _OPEN.discard(llm)
        RECORD["evicted"] += llm.kv_memory().n_evicted


class PolicyLlama(pykvcache.Llama):
    """pykvcache.Llama with the policy under test unless the caller names one."""

    def __init__(self, *args, **kwargs):
        if POLICY != "none" and not kwargs.get("vocab_only", False):
            kwargs.setdefault("kv_policy", POLICY)
        super().__init__(*args, **kwargs)
        if self.kv_policy is not None and self.kv_policy.spec() == pykvcache.parse_policy(POLICY).spec():
            RECORD["contexts"] += 1
            _OPEN.add(self)

    def close(self) -> None:
        if "_ctx" in self.__dict__:
            _count(self)
        super().close()


def pytest_sessionfinish(session, exitstatus):
    for llm in list(_OPEN):
        _count(llm)
    out = os.environ.get("PYKVCACHE_TEST_RECORD")
    if out:
        with open(out, "w") as f:
            json.dump(RECORD, f)


llama_cpp.Llama = PolicyLlama
llama_cpp.llama.Llama = PolicyLlama
