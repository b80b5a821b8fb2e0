"""Writes tiny GGUF models with random weights (the tokenizer of the default model), for tests of architectures
that no registry package ships small enough."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _copy_tokenizer(writer, source: Path) -> int:
    import gguf

    from pykvcache._models.gguf_copy import copy_fields

    reader = gguf.GGUFReader(str(source))
    copy_fields(writer, reader, lambda key: key.startswith("tokenizer."))
    return len(reader.fields["tokenizer.ggml.tokens"].data)


class _TinyWriter:
    """A GGUF writer of a tiny model with random weights: the shared hyperparameters, tensors and layer weights."""

    def __init__(self, path: Path, arch: str, tokenizer_source: Path, n_layer: int, n_embd: int, n_head: int,
                 n_head_kv: int, head_dim: int, n_ff: int) -> None:
        import gguf

        self.rng = np.random.default_rng(0)
        self.w = gguf.GGUFWriter(str(path), arch)
        self.n_vocab = _copy_tokenizer(self.w, tokenizer_source)
        self.n_embd, self.n_head, self.n_head_kv, self.head_dim, self.n_ff = n_embd, n_head, n_head_kv, head_dim, n_ff
        w = self.w
        w.add_block_count(n_layer)
        w.add_context_length(2048)
        w.add_embedding_length(n_embd)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)

    def random(self, name: str, *shape: int, scale: float) -> None:
        self.w.add_tensor(name, (self.rng.standard_normal(shape) * scale).astype(np.float32))

    def ones(self, name: str, n: int) -> None:
        self.w.add_tensor(name, np.ones(n, dtype=np.float32))

    def embeddings(self, scale: float) -> None:
        self.w.add_tensor("token_embd.weight",
                          (self.rng.standard_normal((self.n_vocab, self.n_embd)) * scale).astype(np.float16))
        self.ones("output_norm.weight", self.n_embd)

    def layer(self, i: int, scale: float) -> None:
        """Layer i's attention and feed-forward matrices (its norms are the architecture's)."""
        e, hd = self.n_embd, self.head_dim
        self.random(f"blk.{i}.attn_q.weight", self.n_head * hd, e, scale=scale)
        self.random(f"blk.{i}.attn_k.weight", self.n_head_kv * hd, e, scale=scale)
        self.random(f"blk.{i}.attn_v.weight", self.n_head_kv * hd, e, scale=scale)
        self.random(f"blk.{i}.attn_output.weight", e, self.n_head * hd, scale=scale)
        self.random(f"blk.{i}.ffn_gate.weight", self.n_ff, e, scale=scale)
        self.random(f"blk.{i}.ffn_up.weight", self.n_ff, e, scale=scale)
        self.random(f"blk.{i}.ffn_down.weight", e, self.n_ff, scale=scale)

    def close(self, path: Path) -> Path:
        self.w.write_header_to_file()
        self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file()
        self.w.close()
        return path


def write_tiny_gemma3(path: Path, tokenizer_source: Path, n_layer: int = 2, sliding_window: int = 64) -> Path:
    """A 2-layer Gemma 3 with sliding-window layers (an iSWA KV cache), random weights."""
    m = _TinyWriter(path, "gemma3", tokenizer_source, n_layer, n_embd=64, n_head=2, n_head_kv=1, head_dim=32, n_ff=128)
    m.w.add_key_length(m.head_dim)
    m.w.add_value_length(m.head_dim)
    m.w.add_layer_norm_rms_eps(1e-6)
    m.w.add_sliding_window(sliding_window)
    m.embeddings(0.02)
    for i in range(n_layer):
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            m.ones(f"blk.{i}.{norm}.weight", m.n_embd)
        m.ones(f"blk.{i}.attn_q_norm.weight", m.head_dim)
        m.ones(f"blk.{i}.attn_k_norm.weight", m.head_dim)
        m.layer(i, 0.02)
    return m.close(path)


def write_tiny_llama(path: Path, tokenizer_source: Path, n_layer: int = 2) -> Path:
    """A 2-layer Llama (4 query heads, 2 KV heads of 64), random weights: every policy runs on it, ~100x faster."""
    m = _TinyWriter(path, "llama", tokenizer_source, n_layer, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=256)
    m.w.add_layer_norm_rms_eps(1e-5)
    m.w.add_rope_dimension_count(m.head_dim)
    m.embeddings(0.05)
    for i in range(n_layer):
        m.ones(f"blk.{i}.attn_norm.weight", m.n_embd)
        m.ones(f"blk.{i}.ffn_norm.weight", m.n_embd)
        m.layer(i, 0.05)
    return m.close(path)
