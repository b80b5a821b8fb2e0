"""An independent numpy forward pass of a llama-architecture GGUF model (no llama.cpp code involved).

Used as the reference of the attention observation: it dequantizes the weights with the `gguf` package, runs the
transformer in float64 and returns, per layer, the softmax attention probabilities of the last queries.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

import numpy as np


@dataclass
class ReferenceAttention:
    """Attention of the last `window` queries: probs[layer] has shape [n_head, window, n_tokens]."""

    probs: List[np.ndarray]
    logits: np.ndarray  # [n_tokens, n_vocab] of the last layer
    value_norms: np.ndarray  # [n_layer, n_tokens]: per token, the mean over the KV heads of its value vector's norm

    def entropy(self) -> np.ndarray:
        """Mean entropy (nats) per layer and head, averaged over the window queries: [n_layer, n_head]."""
        out = []
        for p in self.probs:
            plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
            out.append(-plogp.sum(axis=-1).mean(axis=-1))
        return np.array(out)

    def mass(self) -> np.ndarray:
        """Mean attention mass per layer, head and position, averaged over the window queries."""
        return np.array([p.mean(axis=1) for p in self.probs])


def _field(reader, key: str):
    f = reader.fields[key]
    return f.parts[f.data[0]][0] if len(f.data) == 1 else [f.parts[i][0] for i in f.data]


def load_weights(path: "str | Path") -> (Dict[str, np.ndarray], Dict[str, float]):
    """Dequantize every tensor of a GGUF file and read the llama hyper-parameters."""
    import gguf
    from gguf import quants

    reader = gguf.GGUFReader(str(path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    if arch != "llama":
        raise ValueError(f"the reference forward pass implements the llama architecture, not {arch}")
    hp = {
        "n_layer": int(_field(reader, "llama.block_count")),
        "n_head": int(_field(reader, "llama.attention.head_count")),
        "n_head_kv": int(_field(reader, "llama.attention.head_count_kv")),
        "eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_base": float(_field(reader, "llama.rope.freq_base")),
    }
    weights = {}
    for t in reader.tensors:
        w = quants.dequantize(t.data, t.tensor_type)
        weights[t.name] = np.asarray(w, dtype=np.float64).reshape([int(x) for x in reversed(t.shape)])
    return weights, hp


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w


def _rope_norm(x: np.ndarray, pos: np.ndarray, base: float) -> np.ndarray:
    # llama.cpp's "normal" rope: rotate adjacent pairs (x[2i], x[2i+1]) by pos * base^(-2i/d)
    d = x.shape[-1]
    theta = pos[:, None] * base ** (-np.arange(0, d, 2) / d)  # [n, d/2]
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


def reference_attention(path: "str | Path", tokens: List[int], window: int) -> ReferenceAttention:
    """Run the model over `tokens` and return the attention of the last `window` queries of every layer."""
    weights, hp = load_weights(path)
    n = len(tokens)
    n_head, n_head_kv = hp["n_head"], hp["n_head_kv"]
    emb = weights["token_embd.weight"]
    x = emb[np.asarray(tokens)]
    d_head = x.shape[1] // n_head
    pos = np.arange(n, dtype=np.float64)
    causal = np.triu(np.full((n, n), -np.inf), k=1)
    w0 = max(0, n - window)

    probs = []
    value_norms = []
    for il in range(hp["n_layer"]):
        blk = f"blk.{il}."
        h = _rms_norm(x, weights[blk + "attn_norm.weight"], hp["eps"])
        q = (h @ weights[blk + "attn_q.weight"].T).reshape(n, n_head, d_head)
        k = (h @ weights[blk + "attn_k.weight"].T).reshape(n, n_head_kv, d_head)
        v = (h @ weights[blk + "attn_v.weight"].T).reshape(n, n_head_kv, d_head)
        value_norms.append(np.linalg.norm(v, axis=-1).mean(axis=-1))
        q = _rope_norm(q, pos, hp["rope_base"])
        k = _rope_norm(k, pos, hp["rope_base"])
        rep = n_head // n_head_kv
        k = np.repeat(k, rep, axis=1)
        v = np.repeat(v, rep, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d_head) + causal
        s = s - s.max(axis=-1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=-1, keepdims=True)
        probs.append(p[:, w0:, :])
        o = np.einsum("hqk,khd->qhd", p, v).reshape(n, n_head * d_head)
        x = x + o @ weights[blk + "attn_output.weight"].T
        h = _rms_norm(x, weights[blk + "ffn_norm.weight"], hp["eps"])
        g = h @ weights[blk + "ffn_gate.weight"].T
        u = h @ weights[blk + "ffn_up.weight"].T
        x = x + (g / (1.0 + np.exp(-g)) * u) @ weights[blk + "ffn_down.weight"].T
    x = _rms_norm(x, weights["output_norm.weight"], hp["eps"])
    out_w = weights.get("output.weight", emb)
    return ReferenceAttention(probs=probs, logits=x @ out_w.T, value_norms=np.array(value_norms))
