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


def write_tiny_gemma3(path: Path, tokenizer_source: Path, n_layer: int = 2, sliding_window: int = 64) -> Path:
    """A 2-layer Gemma 3 with sliding-window layers (an iSWA KV cache), random weights."""
    import gguf

    n_embd, n_head, n_head_kv, head_dim, n_ff = 64, 2, 1, 32, 128
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "gemma3")
    n_vocab = _copy_tokenizer(w, tokenizer_source)
    w.add_block_count(n_layer)
    w.add_context_length(2048)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(sliding_window)

    def t(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    w.add_tensor("token_embd.weight", (rng.standard_normal((n_vocab, n_embd)) * 0.02).astype(np.float16))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    for i in range(n_layer):
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(head_dim, dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(head_dim, dtype=np.float32))
        t(f"blk.{i}.attn_q.weight", n_head * head_dim, n_embd)
        t(f"blk.{i}.attn_k.weight", n_head_kv * head_dim, n_embd)
        t(f"blk.{i}.attn_v.weight", n_head_kv * head_dim, n_embd)
        t(f"blk.{i}.attn_output.weight", n_embd, n_head * head_dim)
        t(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        t(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        t(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
