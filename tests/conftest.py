"""Shared fixtures: the default model, an independent reference forward pass, tiny models of other architectures."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

import pykvcache  # noqa: E402  (must be imported before llama_cpp)

PROSE = (
    "In 1969, Neil Armstrong became the first person to walk on the Moon. The mission, Apollo 11, launched from "
    "Florida and landed in the Sea of Tranquility. Millions watched the broadcast live on television around the "
    "world, and the famous words about one small step were heard in every language."
)


@pytest.fixture(scope="session")
def model_path() -> str:
    return pykvcache.default_model_path()


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory, model_path) -> str:
    from tiny_models import write_tiny_gemma3

    return str(write_tiny_gemma3(tmp_path_factory.mktemp("models") / "tiny-gemma3.gguf", Path(model_path)))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, model_path) -> str:
    from tiny_models import write_tiny_llama

    return str(write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama.gguf", Path(model_path)))


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Log-probabilities of logits along the last axis."""
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def last_logits(llm) -> np.ndarray:
    """Logits of the last evaluated token, straight from llama.cpp (llama-cpp-python keeps none without logits_all)."""
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy()
