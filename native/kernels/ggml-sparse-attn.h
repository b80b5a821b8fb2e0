// ggml-sparse-attn.h - GGML_OP_SPARSE_ATTN_EXT: block-sparse attention for prefill (pykvcache).
//
// The op computes what ggml_flash_attn_ext computes, but each (query block, head) only visits the key blocks it
// lists. Queries are grouped in blocks of `q_block` consecutive rows, keys (KV cells) in blocks of `k_block`
// consecutive cells. Inside a visited block the token-level mask applies as in flash attention (causality, other
// sequences, padding); a listed block whose mask is -inf everywhere for the query block is skipped.
//
//   q      [DK, n_q, n_head, 1]        F32 (rows contiguous; a permuted view, as for flash attention)
//   k      [DK, n_kv, n_head_kv, 1]    F32, F16 or a quantized type with to_float (q8_0, q4_0, ...)
//   v      [DV, n_kv, n_head_kv, 1]    same type as k, not transposed
//   mask   [n_kv, n_q_pad, 1, 1]       F16 (n_q_pad >= n_q), or NULL
//   blocks [n_list, n_qb, n_head]      I32 key-block ids per (query block, head), best first; n_qb = ceil(n_q/q_block)
//   counts [n_qb, n_head]              I32 how many of the listed blocks to visit (clamped to [0, n_list]); ids
//                                      outside [0, ceil(n_kv/k_block)) are skipped
//   result [DV, n_head, n_q, 1]        F32, the layout of ggml_flash_attn_ext
//
// Heads of one KV group may list different blocks. With every block listed the result equals flash attention's.
//
// ggml_sparse_attn_ext_probs: every block, and the attention probabilities as well (what an observation of the
// attention needs, without computing K·Q twice). The result is then [DV, n_head, n_q, 1 + ceil(n_kv/DV)]: slice 0
// of dim 3 is the attention output above, the slices after it hold the probabilities as F32 [n_kv, n_q, n_head]
// (contiguous, from byte nb[3]; softmax over the cells with mask, softcap, ALiBi and sinks, a sink's share not
// among the cells); ggml_sparse_attn_ext_out and ggml_sparse_attn_ext_probs_view take the two views. CPU only.
#pragma once

#include "ggml.h"

#ifdef __cplusplus
extern "C" {
#endif

// op params: scale, max_bias, logit_softcap (floats, as flash attention), then q_block, k_block (int32)
GGML_API struct ggml_tensor * ggml_sparse_attn_ext(
        struct ggml_context * ctx,
        struct ggml_tensor  * q,
        struct ggml_tensor  * k,
        struct ggml_tensor  * v,
        struct ggml_tensor  * mask,
        struct ggml_tensor  * blocks,
        struct ggml_tensor  * counts,
        float                 scale,
        float                 max_bias,
        float                 logit_softcap,
        int32_t               q_block,
        int32_t               k_block);

// every key block of every query (blocks of k_block cells), with the probabilities in the result (see above)
GGML_API struct ggml_tensor * ggml_sparse_attn_ext_probs(
        struct ggml_context * ctx,
        struct ggml_tensor  * q,
        struct ggml_tensor  * k,
        struct ggml_tensor  * v,
        struct ggml_tensor  * mask,
        float                 scale,
        float                 max_bias,
        float                 logit_softcap,
        int32_t               q_block,
        int32_t               k_block);

// whether a GGML_OP_SPARSE_ATTN_EXT node writes the probabilities
GGML_API bool ggml_sparse_attn_ext_has_probs(const struct ggml_tensor * a);

// views of a ggml_sparse_attn_ext_probs node: the attention output [DV, n_head, n_q] and the probabilities
// [n_kv, n_q, n_head]
GGML_API struct ggml_tensor * ggml_sparse_attn_ext_out       (struct ggml_context * ctx, struct ggml_tensor * a);
GGML_API struct ggml_tensor * ggml_sparse_attn_ext_probs_view(struct ggml_context * ctx, struct ggml_tensor * a);

// attention sinks per head (F32 [n_head]), as ggml_flash_attn_ext_add_sinks
GGML_API void ggml_sparse_attn_ext_add_sinks(struct ggml_tensor * a, struct ggml_tensor * sinks);

// the scale, ALiBi max bias and logit softcap of a GGML_OP_SPARSE_ATTN_EXT node (its first three op params)
GGML_API void ggml_sparse_attn_ext_get_params(const struct ggml_tensor * a, float * scale, float * max_bias, float * logit_softcap);

// the query and key block sizes of a GGML_OP_SPARSE_ATTN_EXT node
GGML_API int32_t ggml_sparse_attn_ext_q_block(const struct ggml_tensor * a);
GGML_API int32_t ggml_sparse_attn_ext_k_block(const struct ggml_tensor * a);

#ifdef __cplusplus
}
#endif
