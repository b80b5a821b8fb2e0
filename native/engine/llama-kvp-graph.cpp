// llama-kvp-graph.cpp - attention inputs for the per-layer KV memory.
//
// The model files call build_attn_inp_kv() once and build_attn(inp, ..., il) per layer. With the per-layer memory,
// build_attn_inp_kv() returns an llama_kvp_attn_input: it holds one ordinary llm_graph_input_attn_kv per layer (cell
// indices, mask and the layer's cache context), and build_attn() swaps in the one of its layer, so the upstream
// attention code runs unchanged on that layer's own cache.
//
// The layers' cell indices and masks are views of three graph inputs, one per kind, not inputs of their own: the
// scheduler uploads each input of an offloaded split on its own, after a synchronisation (~13 us on a GPU, a round
// trip over RPC), so three inputs per layer cost ~1.2 ms per decode step on 30 layers. A view of a host input stays
// on the host (it would be uploaded view by view), so when a layer's cache is off the host the views are cut from a
// copy of each input (ggml_cont) that runs on the device: one upload per kind.

#include "llama-kvp-impl.h"
#include "llama-kvp-memory.h"

#include "llama-graph.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

class llama_kvp_attn_input : public llm_graph_input_attn_kv {
public:
    llama_kvp_attn_input(const llama_hparams & hparams, const llama_cparams & cparams, const llama_kv_cache_context * mctx0) :
        llm_graph_input_attn_kv(hparams, cparams, mctx0) {}

    void set_input(const llama_ubatch * ubatch) override {
        llama_kvp_perf_scope t(mem ? mem->st : nullptr, &llama_kvp_perf_data::t_input_ms);
        for (size_t ikv = 0; ikv < per_layer.size(); ++ikv) {
            auto & inp = per_layer[ikv];
            // the upstream setters write a layer's part of each packed input through a host tensor shaped as its view
            ggml_tensor k_idxs = llama_kvp_host_part(inp->self_k_idxs,  k_idxs_all, off_k_idxs[ikv]);
            ggml_tensor v_idxs = llama_kvp_host_part(inp->self_v_idxs,  v_idxs_all, off_v_idxs[ikv]);
            ggml_tensor mask   = llama_kvp_host_part(inp->self_kq_mask, mask_all,   off_mask[ikv]);
            ggml_tensor * views[3] = { inp->self_k_idxs, inp->self_v_idxs, inp->self_kq_mask };
            const bool own_mask = mask.data && llama_kvp_mask_causal(*mem->layers[ikv].kv, *ubatch, mask, cell_pos);
            inp->self_k_idxs  = &k_idxs;
            inp->self_v_idxs  = &v_idxs;
            inp->self_kq_mask = own_mask ? nullptr : &mask;
            inp->set_input(ubatch);
            if (own_mask && llama_kvp_check_masks()) {
                llama_kvp_mask_check(*inp, *ubatch, mask, ikv);
            }
            inp->self_k_idxs  = views[0];
            inp->self_v_idxs  = views[1];
            inp->self_kq_mask = views[2];
            if (device_copy) {
                llama_kvp_zero_gap(k_idxs_all, off_k_idxs, ikv, ggml_nbytes(&k_idxs));
                llama_kvp_zero_gap(v_idxs_all, off_v_idxs, ikv, ggml_nbytes(&v_idxs));
                llama_kvp_zero_gap(mask_all,   off_mask,   ikv, ggml_nbytes(&mask));
            }
            // cells that stand for several tokens (a fate stage's) weigh as many in the softmax
            if (mask.data) {
                mem->mask_add_bias((int32_t) ikv, mask.data, mask.type == GGML_TYPE_F16, mask.ne[0], ggml_nrows(&mask));
            }
        }
    }

    // the causal mask of a layer's cache for a ubatch of one sequence, as llama_kv_cache::set_input_kq_mask writes it
    // (0 where the cell holds a token of the sequence at or before the row's position, -inf elsewhere), in one pass
    // over the cells and a plain loop per row instead of that builder's bookkeeping for rows of several sequences (the
    // largest host symbol of a decode step under perf; a third of a 4k prompt's host time); false where it needs that
    // builder (several sequences in the ubatch, M-RoPE positions, ALiBi, non-causal attention)
    bool llama_kvp_mask_causal(const llama_kv_cache & kv, const llama_ubatch & ub, ggml_tensor & mask, std::vector<llama_pos> & pos) const {
        if (!cparams.causal_attn || hparams.use_alibi || ub.is_pos_2d() || ub.n_tokens == 0 || mask.ne[1] != (int64_t) ub.n_tokens ||
            mask.ne[2] != 1 || mask.ne[3] != 1 || (mask.type != GGML_TYPE_F16 && mask.type != GGML_TYPE_F32)) {
            return false;
        }
        const llama_seq_id seq = ub.seq_id[0][0];
        for (uint32_t i = 1; i < ub.n_tokens; ++i) {
            if (ub.seq_id[i][0] != seq) {
                return false;
            }
        }
        const int64_t n_kv = mask.ne[0];
        if (n_kv > (int64_t) kv.get_size()) {
            return false;
        }
        pos.resize(n_kv);
        llama_kvp_kv_access::cell_positions_of_seq(kv, (uint32_t) n_kv, seq, pos.data());
        const bool f16 = mask.type == GGML_TYPE_F16;
        const ggml_fp16_t keep16 = ggml_fp32_to_fp16(0.0f);
        const ggml_fp16_t drop16 = ggml_fp32_to_fp16(-INFINITY);
        for (uint32_t i = 0; i < ub.n_tokens; ++i) {
            const llama_pos p1 = ub.pos[i];
            if (f16) {
                ggml_fp16_t * row = (ggml_fp16_t *) mask.data + (size_t) i*n_kv;
                for (int64_t j = 0; j < n_kv; ++j) {
                    row[j] = pos[j] >= 0 && pos[j] <= p1 ? keep16 : drop16;
                }
            } else {
                float * row = (float *) mask.data + (size_t) i*n_kv;
                for (int64_t j = 0; j < n_kv; ++j) {
                    row[j] = pos[j] >= 0 && pos[j] <= p1 ? 0.0f : -INFINITY;
                }
            }
        }
        return true;
    }

    // LLAMA_KVP_CHECK_MASKS=1 (a debug switch, read once): every mask llama_kvp_mask_causal writes is compared with the
    // one llama.cpp's builder writes for the same cache and ubatch, and a difference aborts naming the layer
    static bool llama_kvp_check_masks() {
        static const bool on = [] {
            const char * e = getenv("LLAMA_KVP_CHECK_MASKS");
            const bool res = e && *e && strcmp(e, "0") != 0;
            if (res) {
                fprintf(stderr, "pykvcache: LLAMA_KVP_CHECK_MASKS: every per-layer mask is checked against llama.cpp's\n");
            }
            return res;
        }();
        return on;
    }

    void llama_kvp_mask_check(const llm_graph_input_attn_kv & inp, const llama_ubatch & ub, const ggml_tensor & mask, size_t ikv) const {
        std::vector<uint8_t> ref(ggml_nbytes(&mask));
        ggml_tensor t = mask;
        t.data = ref.data();
        inp.mctx->set_input_kq_mask(&t, &ub, cparams.causal_attn);
        if (memcmp(ref.data(), mask.data, ref.size()) != 0) {
            fprintf(stderr, "pykvcache: LLAMA_KVP_CHECK_MASKS: the mask of KV layer %zu (%lld cells, %lld rows) differs from llama.cpp's\n",
                    ikv, (long long) mask.ne[0], (long long) mask.ne[1]);
            abort();
        }
    }

    // zeroes the bytes between a layer's part of a packed input (n bytes from offs[ikv]) and the next part: the
    // input is copied whole to an offloaded cache's device, and uninitialised host memory must not travel there
    // (to an RPC server, over the network)
    static void llama_kvp_zero_gap(const ggml_tensor * all, const std::vector<size_t> & offs, size_t ikv, size_t n) {
        const size_t end = ikv + 1 < offs.size() ? offs[ikv + 1] : ggml_nbytes(all);
        if (all->data && offs[ikv] + n < end) {
            memset((char *) all->data + offs[ikv] + n, 0, end - offs[ikv] - n);
        }
    }

    // a layer's view, placed on its bytes of the packed host input
    static ggml_tensor llama_kvp_host_part(const ggml_tensor * view, const ggml_tensor * all, size_t offs) {
        ggml_tensor t = *view;
        t.op       = GGML_OP_NONE;
        t.view_src = nullptr;
        t.buffer   = all->buffer;
        t.data     = all->data ? (char *) all->data + offs : nullptr;
        return t;
    }

    // a graph is reused while no layer cache was reallocated, its sequence is the current one (each has caches of its
    // own) and every layer covers as many cells as when it was built (n_kv is padded to 256 cells, so decode steps
    // that fill the cells freed by eviction keep it)
    bool can_reuse(const llm_graph_params & params) override {
        const auto * pctx = dynamic_cast<const llama_kvp_memory_context *>(params.mctx);
        if (!pctx || pctx->mem != mem || mem->n_resize != n_resize || mem->seq_cur != seq || pctx->n_layers() != per_layer.size()) {
            return false;
        }
        bool res = true;
        llm_graph_params lp = params; // one copy, pointed at each layer's context in turn
        for (size_t ikv = 0; ikv < per_layer.size(); ++ikv) {
            lp.mctx = pctx->layer_ctx((int32_t) ikv);
            res = per_layer[ikv]->can_reuse(lp) && res; // also points the layer input at the layer's new context
        }
        mctx = pctx->layer_ctx(0);
        return res;
    }

    const llama_kvp_memory * mem = nullptr;
    int32_t n_resize = 0; // reallocations of the memory when the graph was built
    llama_seq_id seq = 0; // the sequence whose caches the graph attends to
    bool device_copy = false; // the packed inputs are copied whole to a device (a layer's cache off the host)

    std::vector<std::unique_ptr<llm_graph_input_attn_kv>> per_layer; // by KV layer

    // the packed host inputs, and where each layer's part starts in them (bytes)
    ggml_tensor * k_idxs_all = nullptr;
    ggml_tensor * v_idxs_all = nullptr;
    ggml_tensor * mask_all   = nullptr;
    std::vector<size_t> off_k_idxs;
    std::vector<size_t> off_v_idxs;
    std::vector<size_t> off_mask;
    std::vector<int32_t> layer_of_il;                                // model layer -> KV layer
    std::vector<llama_pos> cell_pos;                                 // scratch of llama_kvp_mask_causal
};

ggml_tensor * llama_kvp_packed_input(ggml_context * ctx, ggml_type type, size_t n_bytes, const char * name,
                                     bool device_copy, ggml_tensor ** src) {
    GGML_ASSERT(n_bytes % ggml_type_size(type) == 0);
    ggml_tensor * t = ggml_new_tensor_1d(ctx, type, (int64_t) (n_bytes/ggml_type_size(type)));
    ggml_set_input(t);
    ggml_set_name(t, name);
    *src = device_copy ? ggml_cont(ctx, t) : t;
    return t;
}

llm_graph_input_attn_kv * llama_kvp_build_attn_inp_kv(const llm_graph_context & gctx) {
    const auto * pctx = dynamic_cast<const llama_kvp_memory_context *>(gctx.mctx);
    if (!pctx) {
        return nullptr;
    }
    const llama_kvp_memory * mem = pctx->mem;
    GGML_ASSERT(gctx.hparams.swa_type == LLAMA_SWA_TYPE_NONE);

    auto inp = std::make_unique<llama_kvp_attn_input>(gctx.hparams, gctx.cparams, pctx->layer_ctx(0));
    inp->layer_of_il = mem->layer_of_il;
    inp->mem         = mem;
    inp->n_resize    = mem->n_resize;
    inp->seq         = mem->seq_cur;

    ggml_context * ctx0 = gctx.ctx0;
    const auto & ubatch = gctx.ubatch;

    // flash attention takes an f16 mask
    const ggml_type mask_type = gctx.cparams.flash_attn ? GGML_TYPE_F16 : GGML_TYPE_F32;
    const size_t    n_layers  = mem->layers.size();

    // each layer's shapes (of the upstream builders' tensors, which only lend them) and its parts of the packed
    // inputs, each starting on 256 bytes
    std::vector<ggml_tensor *> k_shape(n_layers);
    std::vector<ggml_tensor *> v_shape(n_layers);
    std::vector<int64_t>       n_kv(n_layers);
    size_t n_k_idxs = 0;
    size_t n_v_idxs = 0;
    size_t n_mask   = 0;
    for (size_t ikv = 0; ikv < n_layers; ++ikv) {
        const llama_kv_cache_context * lctx = pctx->layer_ctx((int32_t) ikv);
        k_shape[ikv] = lctx->build_input_k_idxs(ctx0, ubatch);
        v_shape[ikv] = lctx->build_input_v_idxs(ctx0, ubatch);
        n_kv[ikv]    = lctx->get_n_kv();
        inp->off_k_idxs.push_back(n_k_idxs);
        inp->off_v_idxs.push_back(n_v_idxs);
        inp->off_mask.push_back(n_mask);
        n_k_idxs += GGML_PAD(ggml_nbytes(k_shape[ikv]), 256);
        n_v_idxs += GGML_PAD(ggml_nbytes(v_shape[ikv]), 256);
        n_mask   += GGML_PAD(n_kv[ikv]*ubatch.n_tokens*ggml_type_size(mask_type), 256);
    }
    // with a layer's cache off the host, the views are cut from a device copy of each input
    const ggml_type idx_type  = k_shape[0]->type;
    const bool      offloaded = mem->off_host();
    inp->device_copy = offloaded;
    ggml_tensor * k_idxs_src = nullptr;
    ggml_tensor * v_idxs_src = nullptr;
    ggml_tensor * mask_src   = nullptr;
    inp->k_idxs_all = llama_kvp_packed_input(ctx0, idx_type,  n_k_idxs, "attn_inp_k_idxs-all",  offloaded, &k_idxs_src);
    inp->v_idxs_all = llama_kvp_packed_input(ctx0, idx_type,  n_v_idxs, "attn_inp_v_idxs-all",  offloaded, &v_idxs_src);
    inp->mask_all   = llama_kvp_packed_input(ctx0, mask_type, n_mask,   "attn_inp_kq_mask-all", offloaded, &mask_src);

    for (size_t ikv = 0; ikv < n_layers; ++ikv) {
        const llama_kv_cache_context * lctx = pctx->layer_ctx((int32_t) ikv);
        auto li = std::make_unique<llm_graph_input_attn_kv>(gctx.hparams, gctx.cparams, lctx);
        const int32_t il = mem->layers[ikv].il;

        li->self_k_idxs  = ggml_view_1d(ctx0, k_idxs_src, ggml_nelements(k_shape[ikv]), inp->off_k_idxs[ikv]);
        li->self_v_idxs  = ggml_view_1d(ctx0, v_idxs_src, ggml_nelements(v_shape[ikv]), inp->off_v_idxs[ikv]);
        li->self_kq_mask = ggml_view_2d(ctx0, mask_src, n_kv[ikv], ubatch.n_tokens,
                                        n_kv[ikv]*ggml_type_size(mask_type), inp->off_mask[ikv]);
        ggml_format_name(li->self_k_idxs,  "attn_inp_k_idxs-%d",  il);
        ggml_format_name(li->self_v_idxs,  "attn_inp_v_idxs-%d",  il);
        ggml_format_name(li->self_kq_mask, "attn_inp_kq_mask-%d", il);
        li->self_kq_mask_cnv = li->self_kq_mask;

        li->self_k_rot = lctx->build_input_k_rot(ctx0);
        li->self_v_rot = lctx->build_input_v_rot(ctx0);

        inp->per_layer.push_back(std::move(li));
    }

    // the base members point at layer 0, for code that reads them without a layer
    const auto & l0 = inp->per_layer[0];
    inp->self_k_idxs      = l0->self_k_idxs;
    inp->self_v_idxs      = l0->self_v_idxs;
    inp->self_kq_mask     = l0->self_kq_mask;
    inp->self_kq_mask_cnv = l0->self_kq_mask_cnv;
    inp->self_k_rot       = l0->self_k_rot;
    inp->self_v_rot       = l0->self_v_rot;

    return (llm_graph_input_attn_kv *) gctx.res->add_input(std::move(inp));
}

ggml_tensor * llama_kvp_graph_attn(
        const llm_graph_context & gctx,
                    ggml_tensor * q,
                    ggml_tensor * k,
                    ggml_tensor * v,
                    ggml_tensor * kq_mask,
                    ggml_tensor * sinks,
                          float   kq_scale,
                            int   il) {
    llama_kvp_context * st = llama_kvp_graph_ctx();
    if (const auto * prefill = st ? llama_kvp_prefill_of(st->policy) : nullptr) {
        if (ggml_tensor * cur = prefill->graph_attn(st, gctx, q, k, v, kq_mask, sinks, kq_scale, il)) {
            return cur; // a prompt ubatch whose attention the prefill stage computes (sparse)
        }
    }
    return llama_kvp_graph_observed_attn(gctx, q, k, v, kq_mask, sinks, kq_scale, il); // an observed decode step
}

llm_graph_input_attn_kv * llama_kvp_attn_inp_layer(llm_graph_input_attn_kv * inp, int il) {
    auto * pinp = dynamic_cast<llama_kvp_attn_input *>(inp);
    if (!pinp) {
        return inp;
    }
    GGML_ASSERT(il >= 0 && il < (int) pinp->layer_of_il.size() && pinp->layer_of_il[il] >= 0);
    return pinp->per_layer[pinp->layer_of_il[il]].get();
}
