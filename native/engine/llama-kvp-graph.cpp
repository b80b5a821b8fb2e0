// llama-kvp-graph.cpp - attention inputs for the per-layer KV memory.
//
// The model files call build_attn_inp_kv() once and build_attn(inp, ..., il) per layer. With the per-layer memory,
// build_attn_inp_kv() returns an llama_kvp_attn_input: it holds one ordinary llm_graph_input_attn_kv per layer (cell
// indices, mask and the layer's cache context), and build_attn() swaps in the one of its layer, so the upstream
// attention code runs unchanged on that layer's own cache.

#include "llama-kvp-impl.h"
#include "llama-kvp-memory.h"

#include "llama-graph.h"

class llama_kvp_attn_input : public llm_graph_input_attn_kv {
public:
    llama_kvp_attn_input(const llama_hparams & hparams, const llama_cparams & cparams, const llama_kv_cache_context * mctx0) :
        llm_graph_input_attn_kv(hparams, cparams, mctx0) {}

    void set_input(const llama_ubatch * ubatch) override {
        for (size_t ikv = 0; ikv < per_layer.size(); ++ikv) {
            auto & inp = per_layer[ikv];
            inp->set_input(ubatch);
            // cells that stand for several tokens (a fate stage's) weigh as many in the softmax
            ggml_tensor * m = inp->self_kq_mask;
            mem->mask_add_bias((int32_t) ikv, m->data, m->type == GGML_TYPE_F16, m->ne[0], ggml_nrows(m));
        }
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

    std::vector<std::unique_ptr<llm_graph_input_attn_kv>> per_layer; // by KV layer
    std::vector<int32_t> layer_of_il;                                // model layer -> KV layer
};

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

    for (size_t ikv = 0; ikv < mem->layers.size(); ++ikv) {
        const llama_kv_cache_context * lctx = pctx->layer_ctx((int32_t) ikv);
        auto li = std::make_unique<llm_graph_input_attn_kv>(gctx.hparams, gctx.cparams, lctx);

        li->self_k_idxs = lctx->build_input_k_idxs(ctx0, ubatch);
        li->self_v_idxs = lctx->build_input_v_idxs(ctx0, ubatch);

        li->self_kq_mask = ggml_new_tensor_4d(ctx0, mask_type, lctx->get_n_kv(), ubatch.n_tokens, 1, 1);
        ggml_set_input(li->self_kq_mask);
        ggml_format_name(li->self_kq_mask, "attn_inp_kq_mask-%d", mem->layers[ikv].il);
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
    if (ggml_tensor * cur = llama_kvp_graph_sparse_attn(gctx, q, k, v, kq_mask, sinks, kq_scale, il)) {
        return cur; // a prompt ubatch with sparse prefill
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
