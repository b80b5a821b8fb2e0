// prefill-sparse.cpp - prefill stage `sparse`: per-head entropy-guided block-sparse attention for prompt ubatches
// (EntropyInfer, Algorithms 1-3), on GGML_OP_SPARSE_ATTN_EXT (native/kernels/).
//
// Per layer and prompt ubatch, in the graph (no host round trip):
//   1. the ubatch's queries are cut into segments of `segment` tokens and the layer's cells into blocks of `block`
//      cells; each segment is pooled into its max and min query, each block into its max and min key, and the
//      observation matrix of a head is S = [q_max; q_min] . [k_max; k_min] * scale (one score per segment x block);
//   2. a softmax over the blocks a segment can see (block-causal, from the token mask) gives per head and segment
//      the block entropy H, normalised by log(visible blocks) so that it lies in [0, 1];
//   3. a head stays Rigid while H < e_t in every segment so far (it gets `base` tokens per segment); from the first
//      segment with H >= e_t it is Dynamic and its budget follows the fluctuation of H:
//        r_s = clamp((H_s - H_{s-1}) / H_{s-1}, 0, 1 + delta_t)
//        B_s = clamp(B_{s-1} + alpha*base*(r_s - delta_t), base, 3*base)
//      The previous segment's H and B and the Dynamic flags carry over from one ubatch to the next (state tensors,
//      reset when a sequence starts at position 0). With per_head=0 every head of a layer gets the layer's largest
//      budget (what EntropyInfer's released code does);
//   4. each head ranks the blocks by S, with the sink block (position 0) and the local blocks (the segment's own
//      tokens and one block before) first, and computes the top ceil(B_s/block) of them.
// Dense attention stays where sparsity cannot pay or cannot run: decode steps, contexts below `threshold` cells,
// the first `skip` layers, no flash attention (V transposed), K and V of two types, or a backend without the op
// (logged once).

#include "llama-kvp-stage.h"
#include "llama-kvp-impl.h"

#include "ggml-sparse-attn.h"

#include "llama-context.h"
#include "llama-graph.h"
#include "llama-impl.h"
#include "llama-kv-cache.h"
#include "llama-kvp-memory.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

// the state and telemetry of a layer (one buffer beside the layer's K cache), per sequence
struct llama_kvp_sparse_state : llama_kvp_layer_state {
    ggml_context_ptr        ctx;
    ggml_backend_buffer_ptr buf;
    ggml_tensor * state   = nullptr; // F32 [n_head, 3]         entropy and budget of the last segment, Dynamic flag
    ggml_tensor * budget  = nullptr; // F32 [n_head, n_seg_max] budget (tokens) of each segment of the sequence
    ggml_tensor * entropy = nullptr; // F32 [n_head, n_seg_max] normalised block entropy of each segment
    ggml_tensor * count   = nullptr; // F32 [3]                 blocks computed, blocks visible, sparse ubatches
    int32_t n_seg_max = 0;
};

// the state of KV layer ikv (nullptr: none)
static llama_kvp_sparse_state * llama_kvp_sparse_state_of(const llama_kvp_context * st, int32_t ikv) {
    if (!st || ikv < 0 || ikv >= (int32_t) st->layers.size()) {
        return nullptr;
    }
    return dynamic_cast<llama_kvp_sparse_state *>(st->layers[ikv].prefill_state.get());
}

static void llama_kvp_sparse_alloc(llama_kvp_context * st, int32_t ikv, int32_t n_ctx);

// does the ubatch start its sequence (its first token at position 0): the state restarts from zeros
static bool llama_kvp_sparse_starts(const llama_ubatch & ubatch) {
    return ubatch.pos && ubatch.n_tokens > 0 && ubatch.pos[0] == 0;
}
static void llama_kvp_sparse_state_write(const llama_kvp_context * st, int32_t ikv, std::vector<uint8_t> & out);
static void llama_kvp_sparse_state_read (llama_kvp_context * st, int32_t ikv, const std::vector<uint8_t> & in);
// the graph input of the graph built on this thread (made by its first sparse layer; graph_begin forgets it)
class llama_kvp_sparse_input;
static thread_local llama_kvp_sparse_input * g_sp_inp = nullptr;
// the graph's restart input (made by its first layer with a sparse state; graph_begin forgets it)
class llama_kvp_sparse_restart;
static thread_local llama_kvp_sparse_restart * g_sp_restart = nullptr;

static ggml_tensor * llama_kvp_sparse_graph_attn(llama_kvp_context * st, const llm_graph_context & gctx, ggml_tensor * q,
        ggml_tensor * k, ggml_tensor * v, ggml_tensor * kq_mask, ggml_tensor * sinks, float kq_scale, int il);
static void llama_kvp_sparse_restart_layer(llama_kvp_context * st, const llm_graph_context & gctx, int il, bool dense);

struct llama_kvp_prefill_sparse : llama_kvp_prefill_stage {
    llama_kvp_prefill_sparse() : llama_kvp_prefill_stage(LLAMA_KVP_PREFILL_SPARSE, LLAMA_KVP_SLOT_PREFILL, "sparse",
            "segment,block,base,e_t,alpha,delta_t,threshold,skip,per_head,chunk,guide",
            "per-head entropy-guided block-sparse attention in prompt ubatches (EntropyInfer); chunks as dense") {}

    void defaults(llama_kvp_policy & p) const override {
        p.segment   = 32;   // 32/32 found every needle dense found (20 cases at 8k), 64/64 missed one (docs/NOTES.md)
        p.block     = 32;
        p.base      = 512;  // 2.15x dense at 8k on 2 cores, KL 0.0072 (docs/RESULTS.md); 1024 with 64/64 blocks: 1.9x, KL 0.002
        p.e_t       = 0.5f;
        p.alpha     = 1.0f;
        p.delta_t   = 0.1f;
        p.threshold = 2048;
        p.skip      = 1;
        p.per_head  = 1;
        p.chunk     = 128;
        p.guide     = 0;
    }

    std::string check(const llama_kvp_policy & p) const override {
        char buf[192];
        if (p.block < 16 || p.block > 256 || 256 % p.block != 0) {
            snprintf(buf, sizeof(buf), "block must divide 256 and be >= 16 (16, 32, 64, 128 or 256; got %d)", p.block);
            return buf;
        }
        if (p.segment < 1 || p.segment > 128) {
            snprintf(buf, sizeof(buf), "segment must be in [1, 128] (got %d)", p.segment);
            return buf;
        }
        if (p.segment % p.block != 0 && p.block % p.segment != 0) {
            snprintf(buf, sizeof(buf), "block (%d) must divide segment (%d) or segment divide block", p.block, p.segment);
            return buf;
        }
        if (p.base < p.block) {
            snprintf(buf, sizeof(buf), "base must be >= block (%d) (got %d)", p.block, p.base);
            return buf;
        }
        if (!(p.e_t >= 0.0f && p.e_t <= 1.0f)) {
            snprintf(buf, sizeof(buf), "e_t must be in [0, 1] (a normalised entropy; got %g)", (double) p.e_t);
            return buf;
        }
        if (!(p.alpha >= 0.0f && p.alpha <= 16.0f)) {
            snprintf(buf, sizeof(buf), "alpha must be in [0, 16] (got %g)", (double) p.alpha);
            return buf;
        }
        if (!(p.delta_t >= 0.0f && p.delta_t <= 1.0f)) {
            snprintf(buf, sizeof(buf), "delta_t must be in [0, 1] (got %g)", (double) p.delta_t);
            return buf;
        }
        if (p.threshold < 0) {
            snprintf(buf, sizeof(buf), "threshold must be >= 0 (got %d)", p.threshold);
            return buf;
        }
        if (p.skip < 0) {
            snprintf(buf, sizeof(buf), "skip must be >= 0 (got %d)", p.skip);
            return buf;
        }
        if (p.per_head != 0 && p.per_head != 1) {
            snprintf(buf, sizeof(buf), "per_head must be 0 or 1 (got %d)", p.per_head);
            return buf;
        }
        return llama_kvp_check_chunk(p);
    }

    uint32_t n_guide(const llama_kvp_policy & p, uint32_t n_ubatch) const override {
        return llama_kvp_prefill_n_guide(p, n_ubatch);
    }

    // the op attends to whole key blocks: a layer whose cells are not a whole number of blocks would run dense
    uint32_t cell_align(const llama_kvp_policy & p) const override { return (uint32_t) p.block; }

    bool computes_attention() const override { return true; }

    void alloc(llama_kvp_context * st, int32_t ikv, int32_t n_ctx_seq) const override {
        llama_kvp_sparse_alloc(st, ikv, n_ctx_seq);
    }

    void state_write(const llama_kvp_context * st, int32_t ikv, std::vector<uint8_t> & out) const override {
        llama_kvp_sparse_state_write(st, ikv, out);
    }

    void state_read(llama_kvp_context * st, int32_t ikv, const std::vector<uint8_t> & in) const override {
        llama_kvp_sparse_state_read(st, ikv, in);
    }

    uint32_t n_graph_nodes(const llama_kvp_policy & p, uint32_t n_ubatch) const override {
        // selection: ~80 nodes + ~20 per segment of a ubatch (the budget rule runs segment by segment); a dense
        // layer's restart: 4
        return 104 + 24*((n_ubatch + p.segment - 1)/p.segment);
    }

    void graph_begin(llama_kvp_context * st) const override {
        (void) st;
        g_sp_inp     = nullptr;
        g_sp_restart = nullptr;
    }

    ggml_tensor * graph_attn(llama_kvp_context * st, const llm_graph_context & gctx, ggml_tensor * q, ggml_tensor * k,
                             ggml_tensor * v, ggml_tensor * kq_mask, ggml_tensor * sinks, float kq_scale, int il) const override {
        ggml_tensor * out = llama_kvp_sparse_graph_attn(st, gctx, q, k, v, kq_mask, sinks, kq_scale, il);
        if (st && !gctx.cparams.training) {
            llama_kvp_sparse_restart_layer(st, gctx, il, out == nullptr); // a dense layer at a sequence's start
        }
        return out;
    }
};

const llama_kvp_stage * llama_kvp_stage_prefill_sparse() {
    static const llama_kvp_prefill_sparse stage;
    return &stage;
}

//
// state tensors (one buffer per layer, beside the layer's K cache)
//

static void llama_kvp_sparse_alloc(llama_kvp_context * st, int32_t ikv, int32_t n_ctx) {
    auto & L = st->layers[ikv];
    auto S = std::make_unique<llama_kvp_sparse_state>();
    ggml_context * ctx = llama_kvp_layer_ctx(4, "sparse prefill state");
    S->ctx.reset(ctx);
    const int64_t n_seg = (n_ctx + st->policy.segment - 1)/st->policy.segment + 1;
    S->state   = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, st->n_head, 3);
    S->budget  = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, st->n_head, n_seg);
    S->entropy = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, st->n_head, n_seg);
    S->count   = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 3);
    ggml_format_name(S->state,   "kvp_sp_state-%d",   L.il);
    ggml_format_name(S->budget,  "kvp_sp_budget-%d",  L.il);
    ggml_format_name(S->entropy, "kvp_sp_entropy-%d", L.il);
    ggml_format_name(S->count,   "kvp_sp_count-%d",   L.il);

    S->buf.reset(llama_kvp_layer_alloc(st, ikv, ctx, "sparse prefill state"));
    S->n_seg_max = (int32_t) n_seg;
    L.prefill_state = std::move(S);
}

// a saved state holds the tensors whole: the previous segment's entropy and budget and the Dynamic flags, which the
// next prompt ubatch starts from, and the telemetry by segment
static std::vector<ggml_tensor *> llama_kvp_sparse_tensors(const llama_kvp_sparse_state & S) {
    return { S.state, S.budget, S.entropy, S.count };
}

static void llama_kvp_sparse_state_write(const llama_kvp_context * st, int32_t ikv, std::vector<uint8_t> & out) {
    const llama_kvp_sparse_state * S = llama_kvp_sparse_state_of(st, ikv);
    if (!S) {
        return;
    }
    llama_kvp_sync(const_cast<llama_kvp_context *>(st));
    const int32_t hdr[2] = { st->n_head, S->n_seg_max };
    llama_kvp_state_put(out, hdr, sizeof(hdr));
    for (ggml_tensor * t : llama_kvp_sparse_tensors(*S)) {
        const size_t o = out.size();
        out.resize(o + ggml_nbytes(t));
        ggml_backend_tensor_get(t, out.data() + o, 0, ggml_nbytes(t));
    }
}

static void llama_kvp_sparse_state_read(llama_kvp_context * st, int32_t ikv, const std::vector<uint8_t> & in) {
    llama_kvp_sparse_state * S = llama_kvp_sparse_state_of(st, ikv);
    if (!S) {
        return;
    }
    const char * what = "sparse prefill state";
    int32_t hdr[2] = {};
    size_t  off    = 0;
    llama_kvp_state_get(in, off, hdr, sizeof(hdr), what);
    if (hdr[0] != st->n_head || hdr[1] != S->n_seg_max) {
        throw std::runtime_error("pykvcache: the sparse prefill state was saved for " + std::to_string(hdr[1]) +
                " segments of " + std::to_string(hdr[0]) + " heads, this context has " + std::to_string(S->n_seg_max) +
                " of " + std::to_string(st->n_head));
    }
    llama_kvp_sync(st);
    std::vector<uint8_t> buf;
    for (ggml_tensor * t : llama_kvp_sparse_tensors(*S)) {
        buf.resize(ggml_nbytes(t));
        llama_kvp_state_get(in, off, buf.data(), buf.size(), what);
        ggml_backend_tensor_set(t, buf.data(), 0, buf.size());
    }
}

//
// graph input: sequence start, segment rows, and per cell set the blocks every head computes
//

static constexpr float LLAMA_KVP_SPARSE_BIG = 1.0e20f; // rank bonus of the sink and local blocks

class llama_kvp_sparse_input : public llm_graph_input_i {
public:
    llama_kvp_sparse_input(llama_kvp_context * st, int64_t n_tokens) : st(st), n_tokens(n_tokens) {}

    void set_input(const llama_ubatch * ubatch) override;

    // the forced-block input of the cells of KV layer ikv (one per cache: shared by all layers of a unified cache)
    ggml_tensor * forced_for(ggml_context * ctx0, int32_t ikv, int64_t n_blk, int64_t n_seg);

    // the in-use input of the first n_kv cells of KV layer ikv (one per cache, as above)
    ggml_tensor * used_for(ggml_context * ctx0, int32_t ikv, int64_t n_kv);

    llama_kvp_context * st;
    const int64_t n_tokens;
    int32_t n_seg_max = 1; // rows of the layers' telemetry (the sequence's segments)

    ggml_tensor * keep     = nullptr; // F32 [1]      0 when the ubatch starts the sequence (state reset), else 1
    ggml_tensor * seg_rows = nullptr; // I64 [n_seg]  segment index of each segment in the sequence (telemetry rows)
    ggml_tensor * out_seg  = nullptr; // F32 [1, n_seg] 1 for a segment holding a token whose logits are read, else 0

    struct forced_set {
        const llama_kv_cache * kv;
        int64_t       n_blk;
        ggml_tensor * t;   // F32 [n_blk, n_seg] BIG for blocks every head computes, else 0
    };
    std::vector<forced_set> forced;

    struct used_set {
        const llama_kv_cache * kv;
        int64_t       n_kv;
        ggml_tensor * t;   // F32 [1, n_kv] 1 for a cell in use, 0 for a free one
    };
    std::vector<used_set> used;

    // block visibility of a token mask (the layers of a cache share one mask)
    struct vis_set {
        const ggml_tensor * mask;
        int64_t       n_kv;
        ggml_tensor * bmask; // F32 [n_blk, n_seg] 0 where some query of the segment sees some cell of the block, else -1e30
        ggml_tensor * n_vis; // F32 [1, n_seg]     visible blocks
        ggml_tensor * lognv; // F32 [1, n_seg]     log(max(2, visible blocks)), the entropy's normaliser
    };
    std::vector<vis_set> vis;

    const vis_set & visibility_for(ggml_context * ctx0, ggml_tensor * kq_mask, int64_t n_kv, int64_t seg, int64_t blk, bool on_cpu);
};

const llama_kvp_sparse_input::vis_set & llama_kvp_sparse_input::visibility_for(
        ggml_context * ctx0, ggml_tensor * kq_mask, int64_t n_kv, int64_t seg, int64_t blk, bool on_cpu) {
    for (const auto & v : vis) {
        if (v.mask == kq_mask && v.n_kv == n_kv) {
            return v;
        }
    }
    const int64_t n_seg = (n_tokens + seg - 1)/seg;
    ggml_tensor * m = ggml_view_2d(ctx0, kq_mask, n_kv, n_tokens, kq_mask->nb[1], 0);
    ggml_tensor * seen; // F32 [n_blk, n_seg] 1 where visible, else 0
    if (n_seg*seg == n_tokens) {
        // the max of a window is 0 (or an ALiBi bias) if a cell is visible, else -inf or -FLT_MAX
        if (!on_cpu || m->type != GGML_TYPE_F16) {
            m = ggml_cast(ctx0, m, GGML_TYPE_F32);
        }
        ggml_tensor * mx = ggml_pool_2d(ctx0, m, GGML_OP_POOL_MAX, (int) blk, (int) seg, (int) blk, (int) seg, 0, 0);
        seen = ggml_step(ctx0, ggml_scale_bias(ctx0, mx, 1.0e-30f, 0.5f));
    } else {
        // a partial last segment: visible cells 1, masked -inf, padding rows 0
        m = ggml_scale_bias(ctx0, ggml_cast(ctx0, m, GGML_TYPE_F32), 1.0e-30f, 1.0f);
        m = ggml_pad(ctx0, m, 0, (int) (n_seg*seg - n_tokens), 0, 0);
        ggml_tensor * mx = ggml_pool_2d(ctx0, m, GGML_OP_POOL_MAX, (int) blk, (int) seg, (int) blk, (int) seg, 0, 0);
        seen = ggml_step(ctx0, ggml_scale_bias(ctx0, mx, 1.0f, -0.5f));
    }
    vis_set v;
    v.mask  = kq_mask;
    v.n_kv  = n_kv;
    v.bmask = ggml_scale_bias(ctx0, seen, 1.0e30f, -1.0e30f);
    v.n_vis = ggml_sum_rows(ctx0, seen);
    v.lognv = ggml_log(ctx0, ggml_clamp(ctx0, v.n_vis, 2.0f, 1.0e9f));
    vis.push_back(v);
    return vis.back();
}

ggml_tensor * llama_kvp_sparse_input::forced_for(ggml_context * ctx0, int32_t ikv, int64_t n_blk, int64_t n_seg) {
    const llama_kv_cache * kv = st->layer_kv(ikv);
    for (const auto & f : forced) {
        if (f.kv == kv && f.n_blk == n_blk) {
            return f.t;
        }
    }
    ggml_tensor * t = ggml_new_tensor_2d(ctx0, GGML_TYPE_F32, n_blk, n_seg);
    ggml_set_input(t);
    forced.push_back({ kv, n_blk, t });
    return t;
}

ggml_tensor * llama_kvp_sparse_input::used_for(ggml_context * ctx0, int32_t ikv, int64_t n_kv) {
    const llama_kv_cache * kv = st->layer_kv(ikv);
    for (const auto & u : used) {
        if (u.kv == kv && u.n_kv == n_kv) {
            return u.t;
        }
    }
    ggml_tensor * t = ggml_new_tensor_2d(ctx0, GGML_TYPE_F32, 1, n_kv);
    ggml_set_input(t);
    used.push_back({ kv, n_kv, t });
    return t;
}

void llama_kvp_sparse_input::set_input(const llama_ubatch * ubatch) {
    const auto & p = st->policy;
    const int64_t seg   = p.segment;
    const int64_t blk   = p.block;
    const int64_t n_seg = (n_tokens + seg - 1)/seg;

    // position range of each segment
    std::vector<llama_pos> lo(n_seg, INT32_MAX);
    std::vector<llama_pos> hi(n_seg, -1);
    for (int64_t i = 0; i < n_tokens; ++i) {
        const int64_t s = i/seg;
        lo[s] = std::min(lo[s], ubatch->pos[i]);
        hi[s] = std::max(hi[s], ubatch->pos[i]);
    }

    if (keep) {
        const float v = llama_kvp_sparse_starts(*ubatch) ? 0.0f : 1.0f;
        ggml_backend_tensor_set(keep, &v, 0, sizeof(v));
    }
    if (out_seg) {
        std::vector<float> o(n_seg, 0.0f);
        for (int64_t i = 0; i < n_tokens; ++i) {
            if (llama_kvp_reads_logits(st, *ubatch, (uint32_t) i)) {
                o[i/seg] = 1.0f;
            }
        }
        ggml_backend_tensor_set(out_seg, o.data(), 0, n_seg*sizeof(float));
    }
    if (seg_rows) {
        std::vector<int64_t> rows(n_seg);
        for (int64_t s = 0; s < n_seg; ++s) {
            rows[s] = std::min<int64_t>(std::max<llama_pos>(lo[s], 0)/seg, n_seg_max - 1);
        }
        ggml_backend_tensor_set(seg_rows, rows.data(), 0, n_seg*sizeof(int64_t));
    }

    // sink: the block holding position 0; local: blocks holding the segment's positions and the `block` before them
    std::vector<float> buf;
    for (const auto & f : forced) {
        buf.assign(f.n_blk*n_seg, 0.0f);
        const int64_t n_cells = std::min<int64_t>(f.n_blk*blk, f.kv->get_size());
        for (int64_t c = 0; c < n_cells; ++c) {
            const llama_pos pos = llama_kvp_kv_access::cell_pos(*f.kv, (uint32_t) c);
            if (pos < 0) {
                continue;
            }
            const int64_t b = c/blk;
            for (int64_t s = 0; s < n_seg; ++s) {
                if (pos == 0 || (pos >= lo[s] - blk && pos <= hi[s])) {
                    buf[s*f.n_blk + b] = LLAMA_KVP_SPARSE_BIG;
                }
            }
        }
        ggml_backend_tensor_set(f.t, buf.data(), 0, buf.size()*sizeof(float));
    }
    for (const auto & u : used) {
        buf.assign(u.n_kv, 0.0f);
        const int64_t n_cells = std::min<int64_t>(u.n_kv, u.kv->get_size());
        for (int64_t c = 0; c < n_cells; ++c) {
            buf[c] = llama_kvp_kv_access::cell_pos(*u.kv, (uint32_t) c) >= 0 ? 1.0f : 0.0f;
        }
        ggml_backend_tensor_set(u.t, buf.data(), 0, buf.size()*sizeof(float));
    }
}

// cells of KV layer ikv's cache in use among the first n_kv (the tokens a ubatch attends; llama.cpp pads n_kv)
static int64_t llama_kvp_sparse_n_used(const llama_kvp_context * st, int32_t ikv, int64_t n_kv) {
    const llama_kv_cache * kv = st->layer_kv(ikv);
    const int64_t n_cells = std::min<int64_t>(n_kv, kv->get_size());
    int64_t n_used = 0;
    for (int64_t c = 0; c < n_cells; ++c) {
        n_used += llama_kvp_kv_access::cell_pos(*kv, (uint32_t) c) >= 0;
    }
    return n_used;
}

//
// graph hook
//

// the buffer holding the layer's K (a view of the cache has none of its own while the graph is built)
static ggml_backend_buffer_t llama_kvp_sparse_k_buffer(const ggml_tensor * k) {
    return k->view_src ? k->view_src->buffer : k->buffer;
}

// whether the layer's K lives in host memory (its pooling then runs on the CPU backend, which pools f16 as it is)
static bool llama_kvp_sparse_on_cpu(const ggml_tensor * k) {
    ggml_backend_buffer_t buf = llama_kvp_sparse_k_buffer(k);
    return buf && ggml_backend_buffer_is_host(buf);
}

// why a layer cannot run sparse on this backend ("" if it can)
static std::string llama_kvp_sparse_unsupported(ggml_tensor * node, ggml_tensor * k) {
    ggml_backend_buffer_t buf = llama_kvp_sparse_k_buffer(k);
    if (!buf) {
        return "";
    }
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(buf));
    if (dev && !ggml_backend_dev_supports_op(dev, node)) {
        return std::string("the ") + ggml_backend_dev_name(dev) + " backend cannot run it for K type " + ggml_type_name(k->type);
    }
    return "";
}

//
// restart: the state a sequence starts from
//

// A sequence that starts again at position 0 starts from a zero state, as in a new context. A sparse layer does so in
// its graph (the `keep` input); a layer that runs dense in that ubatch (below the threshold, a retention policy's
// chunk) zeroes the state and telemetry itself, so that a later sparse ubatch does not start from the previous
// prompt's entropies, budgets and Dynamic flags. The graph of such a ubatch serves no other ubatch, and no graph serves
// a ubatch that starts a sequence.
class llama_kvp_sparse_restart : public llm_graph_input_i {
public:
    explicit llama_kvp_sparse_restart(bool at_start) : at_start(at_start) {}

    void set_input(const llama_ubatch * ubatch) override { (void) ubatch; }

    bool can_reuse(const llm_graph_params & params) override {
        return !at_start && !llama_kvp_sparse_starts(params.ubatch);
    }

    const bool at_start;
};

static void llama_kvp_sparse_restart_layer(llama_kvp_context * st, const llm_graph_context & gctx, int il, bool dense) {
    if (il < 0 || il >= (int) st->layer_of_il.size() || st->layer_of_il[il] < 0) {
        return;
    }
    llama_kvp_sparse_state * S = llama_kvp_sparse_state_of(st, st->layer_of_il[il]);
    if (!S) {
        return;
    }
    if (!g_sp_restart) {
        g_sp_restart = (llama_kvp_sparse_restart *) gctx.res->add_input(
                std::make_unique<llama_kvp_sparse_restart>(llama_kvp_sparse_starts(gctx.ubatch)));
    }
    if (g_sp_restart->at_start && dense) {
        for (ggml_tensor * t : llama_kvp_sparse_tensors(*S)) {
            ggml_build_forward_expand(gctx.gf, ggml_fill_inplace(gctx.ctx0, t, 0.0f));
        }
    }
}

// block-sparse attention of a prompt ubatch where the layer qualifies; else nullptr (dense)
static ggml_tensor * llama_kvp_sparse_graph_attn(
      llama_kvp_context * st,
        const llm_graph_context & gctx,
                    ggml_tensor * q,
                    ggml_tensor * k,
                    ggml_tensor * v,
                    ggml_tensor * kq_mask,
                    ggml_tensor * sinks,
                          float   kq_scale,
                            int   il) {
    if (!st || gctx.cparams.training) {
        return nullptr;
    }
    if (il < 0 || il >= (int) st->layer_of_il.size() || st->layer_of_il[il] < 0) {
        return nullptr;
    }
    const auto & p = st->policy;
    const int32_t ikv = st->layer_of_il[il];
    llama_kvp_sparse_state * S = llama_kvp_sparse_state_of(st, ikv);

    const int64_t n_tokens = q->ne[2];
    const int64_t n_kv     = k->ne[2];
    if (n_tokens < 2 || il < p.skip || !S || n_kv % p.block != 0) {
        return nullptr; // decode step, an early layer or cells not in whole blocks: dense
    }
    // the threshold is on the cells in use (the ubatch's own are placed before its graph is built), not on n_kv,
    // which llama.cpp pads to 256; a graph reserved before any cell is in use is sized as the largest, by n_kv
    const int64_t n_used = llama_kvp_sparse_n_used(st, ikv, n_kv);
    if ((n_used > 0 ? n_used : n_kv) < p.threshold) {
        return nullptr; // a short context: dense
    }
    if (!gctx.cparams.flash_attn || v->nb[1] > v->nb[2] || k->ne[3] != 1 || kq_mask == nullptr) {
        if (!st->sparse_warned) {
            LLAMA_LOG_WARN("%s: pykvcache sparse prefill needs flash attention (V not transposed): prefill stays dense\n", __func__);
            st->sparse_warned = true;
        }
        return nullptr;
    }
    if (k->type != v->type) { // the op reads K and V of one type (e.g. -ctk q8_0 alone leaves V f16)
        if (!st->sparse_warned) {
            LLAMA_LOG_WARN("%s: pykvcache sparse prefill needs K and V of one type (K %s, V %s): prefill stays dense\n",
                    __func__, ggml_type_name(k->type), ggml_type_name(v->type));
            st->sparse_warned = true;
        }
        return nullptr;
    }

    ggml_context * ctx0 = gctx.ctx0;
    ggml_cgraph  * gf   = gctx.gf;
    const auto & hparams = gctx.hparams;

    const int64_t d      = q->ne[0];
    const int64_t n_head = q->ne[1];
    const int64_t n_hkv  = k->ne[1];
    const int64_t seg    = p.segment;
    const int64_t blk    = p.block;
    const int64_t n_seg  = (n_tokens + seg - 1)/seg;
    const int64_t n_blk  = (n_kv + blk - 1)/blk;
    const int64_t n_list = n_blk; // a segment holding an output token lists every block
    const float   base   = (float) p.base;

    // the op itself first: if the backend of this layer cannot run it, nothing else is added
    ggml_tensor * qp = ggml_permute(ctx0, q, 0, 2, 1, 3);   // [d, n_tokens, n_head]
    ggml_tensor * kp = ggml_permute(ctx0, k, 0, 2, 1, 3);   // [d, n_kv, n_hkv]
    ggml_tensor * vp = ggml_permute(ctx0, v, 0, 2, 1, 3);
    ggml_tensor * blocks_proto = ggml_new_tensor_3d(ctx0, GGML_TYPE_I32, n_list, n_seg, n_head);
    ggml_tensor * counts_proto = ggml_new_tensor_2d(ctx0, GGML_TYPE_I32, n_seg, n_head);
    const float softcap = hparams.attn_soft_cap ? hparams.f_attn_logit_softcapping : 0.0f;
    {
        ggml_tensor * proto = ggml_sparse_attn_ext(ctx0, qp, kp, vp, kq_mask, blocks_proto, counts_proto, kq_scale,
                hparams.f_max_alibi_bias, softcap, (int32_t) seg, (int32_t) blk);
        const std::string why = llama_kvp_sparse_unsupported(proto, k);
        if (!why.empty()) {
            if (!st->sparse_warned) {
                LLAMA_LOG_WARN("%s: pykvcache sparse prefill: %s; prefill stays dense\n", __func__, why.c_str());
                st->sparse_warned = true;
            }
            return nullptr;
        }
    }

    // one input object per graph, shared by the layers
    if (!g_sp_inp || g_sp_inp->n_tokens != n_tokens) {
        auto inp = std::make_unique<llama_kvp_sparse_input>(st, n_tokens);
        inp->n_seg_max = S->n_seg_max;
        inp->keep = ggml_new_tensor_1d(ctx0, GGML_TYPE_F32, 1);
        ggml_set_input(inp->keep);
        inp->seg_rows = ggml_new_tensor_1d(ctx0, GGML_TYPE_I64, n_seg);
        ggml_set_input(inp->seg_rows);
        inp->out_seg = ggml_new_tensor_2d(ctx0, GGML_TYPE_F32, 1, n_seg);
        ggml_set_input(inp->out_seg);
        g_sp_inp = (llama_kvp_sparse_input *) gctx.res->add_input(std::move(inp));
    }
    llama_kvp_sparse_input * inp = g_sp_inp;
    ggml_tensor * forced = inp->forced_for(ctx0, ikv, n_blk, n_seg);

    // 1. pooled queries [2d, n_seg, n_head] and keys [2d, n_blk, n_hkv]: max and min over the rows of a segment or a
    //    block, pooled along the token/cell dimension of the 2-D views (no transposes); F16 keys pool as they are on
    //    the CPU, other types and other backends pool an f32 copy
    auto pool_pair = [&](ggml_tensor * x2, int64_t width, int64_t n_h) { // x2 [d*n_h, rows] -> [2d, rows/width, n_h]
        ggml_tensor * mx = ggml_pool_2d(ctx0, x2,               GGML_OP_POOL_MAX, 1, (int) width, 1, (int) width, 0, 0);
        ggml_tensor * mn = ggml_neg(ctx0, ggml_pool_2d(ctx0, ggml_neg(ctx0, x2), GGML_OP_POOL_MAX, 1, (int) width, 1, (int) width, 0, 0));
        auto arrange = [&](ggml_tensor * t) {                             // [d*n_h, n_out] -> [d, n_out, n_h]
            t = ggml_reshape_3d(ctx0, t, d, n_h, t->ne[1]);
            return ggml_cont(ctx0, ggml_permute(ctx0, t, 0, 2, 1, 3));
        };
        return ggml_concat(ctx0, arrange(mx), arrange(mn), 0);
    };
    ggml_tensor * q2 = ggml_reshape_2d(ctx0, ggml_is_contiguous(q) ? q : ggml_cont(ctx0, q), d*n_head, n_tokens);
    if (n_seg*seg != n_tokens) {
        q2 = ggml_pad(ctx0, q2, 0, (int) (n_seg*seg - n_tokens), 0, 0);
    }
    ggml_tensor * q_pool = pool_pair(q2, seg, n_head);
    const bool on_cpu = llama_kvp_sparse_on_cpu(k);
    ggml_tensor * k2 = (on_cpu && k->type == GGML_TYPE_F16) || k->type == GGML_TYPE_F32 ? k : ggml_cast(ctx0, k, GGML_TYPE_F32);
    k2 = ggml_reshape_2d(ctx0, ggml_is_contiguous(k2) ? k2 : ggml_cont(ctx0, k2), d*n_hkv, n_kv);
    // a free cell holds whatever it held last (an evicted token's key, a removed token's), which a fresh or loaded
    // context holds as zeros: its key pools as zero, so that the block scores depend on the cells in use alone
    k2 = ggml_mul(ctx0, k2, inp->used_for(ctx0, ikv, n_kv));
    ggml_tensor * k_pool = pool_pair(k2, blk, n_hkv);

    ggml_tensor * s = ggml_mul_mat(ctx0, k_pool, q_pool);                 // [n_blk, n_seg, n_head]
    ggml_prec_set_acc(s, GGML_PREC_F32);

    // block visibility from the token mask (the same for the layers that share it: once per graph)
    const auto & vset  = inp->visibility_for(ctx0, kq_mask, n_kv, seg, blk, on_cpu);
    ggml_tensor * bmask = vset.bmask;
    ggml_tensor * n_vis = vset.n_vis;
    ggml_tensor * lognv = vset.lognv;

    // 2. normalised block entropy per segment and head
    ggml_tensor * prob = ggml_soft_max_ext(ctx0, s, bmask, kq_scale, 0.0f);
    ggml_tensor * ent  = ggml_sum_rows(ctx0, ggml_mul(ctx0, prob, ggml_log(ctx0, ggml_scale_bias(ctx0, prob, 1.0f, 1e-30f)))); // [1, n_seg, n_head]
    ent = ggml_reshape_2d(ctx0, ent, n_seg, n_head);
    ent = ggml_div(ctx0, ent, ggml_reshape_2d(ctx0, lognv, n_seg, 1));
    ent = ggml_scale(ctx0, ent, -1.0f);                                                              // [n_seg, n_head]
    ggml_tensor * ent_t = ggml_cont(ctx0, ggml_transpose(ctx0, ent));                                // [n_head, n_seg]

    // 3. Rigid/Dynamic and the budget of each segment, carried over from the previous ubatch
    auto col = [&](ggml_tensor * t, int64_t j) {
        return ggml_view_1d(ctx0, t, t->ne[0], j*t->nb[1]);
    };
    auto blend = [&](ggml_tensor * kept, ggml_tensor * fresh) { // keep ? kept : fresh
        return ggml_add(ctx0, fresh, ggml_mul(ctx0, ggml_sub(ctx0, kept, fresh), inp->keep));
    };
    ggml_tensor * h0        = col(ent_t, 0);
    ggml_tensor * h_prev    = blend(col(S->state, 0), h0);
    ggml_tensor * b_prev    = blend(col(S->state, 1), ggml_scale_bias(ctx0, h0, 0.0f, base));
    ggml_tensor * dyn       = ggml_mul(ctx0, col(S->state, 2), inp->keep);
    ggml_tensor * budgets   = nullptr;                                                               // [n_head, n_seg]
    for (int64_t js = 0; js < n_seg; ++js) {
        ggml_tensor * h = col(ent_t, js);
        ggml_tensor * above = ggml_step(ctx0, ggml_scale_bias(ctx0, h, 1.0f, -p.e_t + 1e-7f));
        dyn = ggml_sub(ctx0, ggml_add(ctx0, dyn, above), ggml_mul(ctx0, dyn, above));              // dyn or above
        ggml_tensor * r = ggml_div(ctx0, ggml_sub(ctx0, h, h_prev), ggml_clamp(ctx0, h_prev, 1e-6f, 1.0e9f));
        r = ggml_clamp(ctx0, r, 0.0f, 1.0f + p.delta_t);
        ggml_tensor * b = ggml_add(ctx0, b_prev, ggml_scale_bias(ctx0, r, p.alpha*base, -p.alpha*base*p.delta_t));
        b = ggml_clamp(ctx0, b, base, 3.0f*base);
        b = ggml_add(ctx0, ggml_scale_bias(ctx0, dyn, 0.0f, base), ggml_mul(ctx0, dyn, ggml_scale_bias(ctx0, b, 1.0f, -base))); // Rigid: base
        b_prev  = b;
        h_prev  = h;
        budgets = budgets ? ggml_concat(ctx0, budgets, ggml_reshape_2d(ctx0, b, n_head, 1), 1) : ggml_reshape_2d(ctx0, b, n_head, 1);
    }
    if (!p.per_head) {
        ggml_tensor * bmax = ggml_pool_2d(ctx0, budgets, GGML_OP_POOL_MAX, (int) n_head, 1, (int) n_head, 1, 0, 0); // [1, n_seg]
        budgets = ggml_repeat(ctx0, bmax, budgets);
    }
    ggml_build_forward_expand(gf, ggml_cpy(ctx0, ggml_concat(ctx0, ggml_concat(ctx0,
            ggml_reshape_2d(ctx0, h_prev, n_head, 1), ggml_reshape_2d(ctx0, b_prev, n_head, 1), 1),
            ggml_reshape_2d(ctx0, dyn, n_head, 1), 1), S->state));

    // 4. blocks per head and segment: sink and local blocks first, then by pooled score
    // a segment holding a token whose logits are read (the prompt's last) computes every visible block: what the
    // model predicts from the prompt sees all of it, in every layer
    ggml_tensor * n_blocks = ggml_ceil(ctx0, ggml_scale(ctx0, budgets, 1.0f/(float) blk));        // [n_head, n_seg]
    n_blocks = ggml_add(ctx0, n_blocks, ggml_scale(ctx0, inp->out_seg, (float) n_blk));
    ggml_tensor * counts   = ggml_cast(ctx0, ggml_cont(ctx0, ggml_transpose(ctx0, n_blocks)), GGML_TYPE_I32); // [n_seg, n_head]
    ggml_tensor * rank     = ggml_add(ctx0, ggml_add(ctx0, s, bmask), forced);
    ggml_tensor * blocks   = ggml_cont(ctx0, ggml_argsort_top_k(ctx0, rank, (int) n_list));        // [n_list, n_seg, n_head]

    ggml_tensor * cur = ggml_sparse_attn_ext(ctx0, qp, kp, vp, kq_mask, blocks, counts, kq_scale,
            hparams.f_max_alibi_bias, softcap, (int32_t) seg, (int32_t) blk);
    ggml_sparse_attn_ext_add_sinks(cur, sinks);
    ggml_format_name(cur, "kvp_sparse_attn-%d", il);

    // telemetry: budgets and entropies by segment of the sequence, blocks computed and visible
    ggml_build_forward_expand(gf, ggml_set_rows(ctx0, S->budget, budgets, inp->seg_rows));
    ggml_build_forward_expand(gf, ggml_set_rows(ctx0, S->entropy, ent_t,   inp->seg_rows));
    ggml_tensor * nv_row = ggml_reshape_2d(ctx0, n_vis, 1, n_seg);
    ggml_tensor * done   = ggml_sub(ctx0, n_blocks, ggml_relu(ctx0, ggml_sub(ctx0, n_blocks, nv_row))); // min(count, visible)
    ggml_tensor * tally  = ggml_concat(ctx0, ggml_concat(ctx0, ggml_sum(ctx0, done), ggml_scale(ctx0, ggml_sum(ctx0, n_vis), (float) n_head), 0),
            ggml_scale_bias(ctx0, ggml_sum(ctx0, n_vis), 0.0f, 1.0f), 0);                          // [3]
    ggml_tensor * acc    = ggml_add(ctx0, ggml_mul(ctx0, S->count, inp->keep), tally);
    ggml_build_forward_expand(gf, ggml_cpy(ctx0, acc, S->count));

    return ggml_reshape_2d(ctx0, cur, cur->ne[0]*cur->ne[1], cur->ne[2]);
}

//
// telemetry
//

static int32_t llama_kvp_sparse_read(llama_kvp_context * st, int32_t ikv, float * count3, float * dyn, float * budgets, float * entropy, int32_t n_seg) {
    const llama_kvp_sparse_state * S = llama_kvp_sparse_state_of(st, ikv);
    if (!S) {
        return -1;
    }
    if (st->lctx) {
        ggml_backend_sched_synchronize(st->lctx->get_sched());
    }
    const int64_t nh = st->n_head;
    if (count3) {
        ggml_backend_tensor_get(S->count, count3, 0, 3*sizeof(float));
    }
    if (dyn) {
        ggml_backend_tensor_get(S->state, dyn, 2*nh*sizeof(float), nh*sizeof(float));
    }
    const int64_t n = std::min<int64_t>(n_seg, S->n_seg_max);
    if (budgets && n > 0) {
        ggml_backend_tensor_get(S->budget, budgets, 0, n*nh*sizeof(float));
    }
    if (entropy && n > 0) {
        ggml_backend_tensor_get(S->entropy, entropy, 0, n*nh*sizeof(float));
    }
    return (int32_t) n;
}

//
// C API (llama-kvp.h): sparse prefill's telemetry
//

static llama_kvp_context * llama_kvp_sparse_ctx(llama_context * ctx) {
    if (!llama_kvp_check_ctx(ctx)) {
        return nullptr;
    }
    llama_kvp_context * st = ctx->get_kvp();
    if (!st || !llama_kvp_policy_sparse(st->policy)) {
        llama_kvp_set_error("this context has no sparse prefill (create it with a policy that has the stage '+sparse')");
        return nullptr;
    }
    return st;
}

int32_t llama_kvp_sparse_info(struct llama_context * ctx, struct llama_kvp_sparse_info * out) {
    llama_kvp_context * st = llama_kvp_sparse_ctx(ctx);
    if (!st || !llama_kvp_check_out(out)) {
        return -1;
    }
    const llama_pos p_max = llama_memory_seq_pos_max(llama_get_memory(ctx), st->mem ? st->mem->seq_cur : 0);
    const llama_kvp_sparse_state * S = llama_kvp_sparse_state_of(st, 0);
    out->n_layer = (int32_t) st->layers.size();
    out->n_head  = st->n_head;
    out->n_seg   = p_max < 0 ? 0 : std::min<int32_t>((p_max + st->policy.segment)/st->policy.segment, S ? S->n_seg_max : 0);
    out->segment = st->policy.segment;
    out->block   = st->policy.block;
    return 0;
}

int32_t llama_kvp_sparse_telemetry(struct llama_context * ctx, float * counts, float * dynamic, float * budgets, float * entropy, int32_t n_seg) {
    llama_kvp_context * st = llama_kvp_sparse_ctx(ctx);
    if (!st) {
        return -1;
    }
    if (n_seg < 0) {
        llama_kvp_set_error("sparse_telemetry: n_seg must be >= 0 (got " + std::to_string(n_seg) + ")");
        return -1;
    }
    const int32_t nh = st->n_head;
    for (int32_t ikv = 0; ikv < (int32_t) st->layers.size(); ++ikv) {
        if (llama_kvp_sparse_read(st, ikv, counts ? counts + 3*ikv : nullptr, dynamic ? dynamic + nh*ikv : nullptr,
                budgets ? budgets + (size_t) nh*n_seg*ikv : nullptr, entropy ? entropy + (size_t) nh*n_seg*ikv : nullptr, n_seg) < 0) {
            llama_kvp_set_error("no sparse prefill state in layer " + std::to_string(st->layers[ikv].il));
            return -1;
        }
    }
    return (int32_t) st->layers.size();
}
