// ggml-sparse-attn.c - the constructor of GGML_OP_SPARSE_ATTN_EXT (compiled into ggml-base). Kernels:
// sparse-attn-cpu.cpp (CPU), sparse-attn.cu (CUDA).

#include "ggml-sparse-attn.h"

#include "ggml-impl.h"

#include <string.h>

static struct ggml_tensor * ggml_sparse_attn_ext_impl(
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
        int32_t               k_block,
        bool                  probs) {
    GGML_ASSERT(q_block > 0 && k_block > 0);
    GGML_ASSERT(q->type == GGML_TYPE_F32);
    GGML_ASSERT(k->type == v->type);
    GGML_ASSERT(q->ne[0] == k->ne[0]);
    GGML_ASSERT(k->ne[1] == v->ne[1]);
    GGML_ASSERT(q->ne[2] % k->ne[2] == 0 && q->ne[2] % v->ne[2] == 0);
    GGML_ASSERT(q->ne[3] == 1 && k->ne[3] == 1 && v->ne[3] == 1);

    const int64_t n_qb = (q->ne[1] + q_block - 1)/q_block;
    GGML_ASSERT((blocks == NULL) == (counts == NULL));
    if (blocks) {
        GGML_ASSERT(blocks->type == GGML_TYPE_I32 && counts->type == GGML_TYPE_I32);
        GGML_ASSERT(ggml_is_contiguous(blocks) && ggml_is_contiguous(counts));
        GGML_ASSERT(blocks->ne[1] == n_qb && blocks->ne[2] == q->ne[2] && blocks->ne[3] == 1);
        GGML_ASSERT(counts->ne[0] == n_qb && counts->ne[1] == q->ne[2] && counts->ne[2] == 1 && counts->ne[3] == 1);
    }

    if (mask) {
        GGML_ASSERT(mask->type == GGML_TYPE_F16);
        GGML_ASSERT(ggml_is_contiguous(mask));
        GGML_ASSERT(mask->ne[0] == k->ne[1] && mask->ne[1] >= q->ne[1]);
        GGML_ASSERT(mask->ne[2] == 1 && mask->ne[3] == 1);
    }
    if (max_bias > 0.0f) {
        GGML_ASSERT(mask);
    }

    // with the probabilities: [n_kv, n_q, n_head] floats in whole slices of [DV, n_head, n_q] after the output
    const int64_t n_probs = probs ? (k->ne[1] + v->ne[0] - 1)/v->ne[0] : 0;
    const int64_t ne[4] = { v->ne[0], q->ne[2], q->ne[1], 1 + n_probs };
    struct ggml_tensor * result = ggml_new_tensor(ctx, GGML_TYPE_F32, 4, ne);

    const float params_f[3] = { scale, max_bias, logit_softcap };
    ggml_set_op_params(result, params_f, sizeof(params_f));
    ggml_set_op_params_i32(result, 3, q_block);
    ggml_set_op_params_i32(result, 4, k_block);
    ggml_set_op_params_i32(result, 5, probs ? 1 : 0);

    result->op     = GGML_OP_SPARSE_ATTN_EXT;
    result->src[0] = q;
    result->src[1] = k;
    result->src[2] = v;
    result->src[3] = mask;
    result->src[4] = blocks;
    result->src[5] = counts;

    return result;
}

struct ggml_tensor * ggml_sparse_attn_ext(
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
        int32_t               k_block) {
    GGML_ASSERT(blocks && counts);
    return ggml_sparse_attn_ext_impl(ctx, q, k, v, mask, blocks, counts, scale, max_bias, logit_softcap, q_block, k_block, false);
}

struct ggml_tensor * ggml_sparse_attn_ext_probs(
        struct ggml_context * ctx,
        struct ggml_tensor  * q,
        struct ggml_tensor  * k,
        struct ggml_tensor  * v,
        struct ggml_tensor  * mask,
        float                 scale,
        float                 max_bias,
        float                 logit_softcap,
        int32_t               q_block,
        int32_t               k_block) {
    return ggml_sparse_attn_ext_impl(ctx, q, k, v, mask, NULL, NULL, scale, max_bias, logit_softcap, q_block, k_block, true);
}

bool ggml_sparse_attn_ext_has_probs(const struct ggml_tensor * a) {
    GGML_ASSERT(a->op == GGML_OP_SPARSE_ATTN_EXT);
    return ggml_get_op_params_i32(a, 5) != 0;
}

struct ggml_tensor * ggml_sparse_attn_ext_out(struct ggml_context * ctx, struct ggml_tensor * a) {
    GGML_ASSERT(ggml_sparse_attn_ext_has_probs(a));
    return ggml_view_3d(ctx, a, a->ne[0], a->ne[1], a->ne[2], a->nb[1], a->nb[2], 0);
}

struct ggml_tensor * ggml_sparse_attn_ext_probs_view(struct ggml_context * ctx, struct ggml_tensor * a) {
    GGML_ASSERT(ggml_sparse_attn_ext_has_probs(a));
    const int64_t n_kv = a->src[1]->ne[1];
    const int64_t n_q  = a->ne[2];
    return ggml_view_3d(ctx, a, n_kv, n_q, a->ne[1], n_kv*sizeof(float), n_kv*n_q*sizeof(float), a->nb[3]);
}

void ggml_sparse_attn_ext_add_sinks(struct ggml_tensor * a, struct ggml_tensor * sinks) {
    GGML_ASSERT(a->op == GGML_OP_SPARSE_ATTN_EXT);
    if (!sinks) {
        a->src[6] = NULL;
        return;
    }
    GGML_ASSERT(sinks->type == GGML_TYPE_F32);
    GGML_ASSERT(sinks->ne[0] == a->ne[1]);
    a->src[6] = sinks;
}

void ggml_sparse_attn_ext_get_params(const struct ggml_tensor * a, float * scale, float * max_bias, float * logit_softcap) {
    GGML_ASSERT(a->op == GGML_OP_SPARSE_ATTN_EXT);
    *scale         = ggml_get_op_params_f32(a, 0);
    *max_bias      = ggml_get_op_params_f32(a, 1);
    *logit_softcap = ggml_get_op_params_f32(a, 2);
}

int32_t ggml_sparse_attn_ext_q_block(const struct ggml_tensor * a) {
    GGML_ASSERT(a->op == GGML_OP_SPARSE_ATTN_EXT);
    return ggml_get_op_params_i32(a, 3);
}

int32_t ggml_sparse_attn_ext_k_block(const struct ggml_tensor * a) {
    GGML_ASSERT(a->op == GGML_OP_SPARSE_ATTN_EXT);
    return ggml_get_op_params_i32(a, 4);
}
