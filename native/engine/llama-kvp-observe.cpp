// llama-kvp-observe.cpp - in-graph attention observation.
//
// Every layer with a KV cache keeps a ring of its last `window` post-RoPE queries (slot = pos % window). When a graph
// observes, each layer computes softmax(Q_ring K^T * scale + mask) over its cells with the model's scale, softcap,
// ALiBi and sinks, then reduces it on the device to
//   - the per-head entropy of the attention rows, averaged over the valid window queries,
//   - the per-head, per-cell attention mass, averaged over the valid window queries,
//   - a decayed accumulation of the head-mean mass per cell.
// Results stay in device buffers (one per buffer type of the KV cache) until llama_kvp_obs_* reads them.
// Only standard ggml ops are used, so the subgraph runs on every backend that runs the model (CPU, CUDA).

#include "llama-kvp-impl.h"

#include "ggml-sparse-attn.h"

#include "llama-arch.h"
#include "llama-batch.h"
#include "llama-context.h"
#include "llama-cparams.h"
#include "llama-graph.h"
#include "llama-impl.h"
#include "llama-kv-cache.h"
#include "llama-kv-cache-iswa.h"
#include "llama-kvp-memory.h"
#include "llama-kvp-stage.h"
#include "llama-model.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <typeinfo>

// nodes added per layer: ring write (~4) + observation (~30), rounded up
static constexpr uint32_t LLAMA_KVP_NODES_PER_LAYER = 48;

//
// llama_kvp_kv_access
//

int32_t llama_kvp_kv_access::n_layers(const llama_kv_cache & kv) {
    return (int32_t) kv.layers.size();
}

int32_t llama_kvp_kv_access::layer_il(const llama_kv_cache & kv, int32_t ikv) {
    return (int32_t) kv.layers[ikv].il;
}

ggml_tensor * llama_kvp_kv_access::layer_k(const llama_kv_cache & kv, int32_t ikv) {
    return kv.layers[ikv].k;
}

ggml_tensor * llama_kvp_kv_access::layer_v(const llama_kv_cache & kv, int32_t ikv) {
    return kv.layers[ikv].v;
}

uint32_t llama_kvp_kv_access::n_stream(const llama_kv_cache & kv) {
    return kv.n_stream;
}

bool llama_kvp_kv_access::v_trans(const llama_kv_cache & kv) {
    return kv.v_trans;
}

uint32_t llama_kvp_kv_access::n_used(const llama_kv_cache & kv) {
    uint32_t res = 0;
    for (const auto & cells : kv.v_cells) {
        res += cells.get_used();
    }
    return res;
}

llama_pos llama_kvp_kv_access::cell_pos(const llama_kv_cache & kv, uint32_t i) {
    return kv.v_cells[0].is_empty(i) ? -1 : kv.v_cells[0].pos_get(i);
}

void llama_kvp_kv_access::cell_positions(const llama_kv_cache & kv, uint32_t n, llama_pos * out) {
    const auto & cells = kv.v_cells[0];
    for (uint32_t i = 0; i < n; ++i) {
        out[i] = cells.is_empty(i) ? -1 : cells.pos_get(i);
    }
}

void llama_kvp_kv_access::cell_positions_of_seq(const llama_kv_cache & kv, uint32_t n, llama_seq_id seq, llama_pos * out) {
    const auto & cells = kv.v_cells[0];
    for (uint32_t i = 0; i < n; ++i) {
        out[i] = cells.is_empty(i) || !cells.seq_has(i, seq) ? -1 : cells.pos_get(i);
    }
}

void llama_kvp_kv_access::cell_rm(llama_kv_cache & kv, uint32_t i) {
    auto & cells = kv.v_cells[0];
    if (cells.seq_count(i) == 1) {
        cells.seq_rm(i, cells.seq_get(i)); // the same as rm() for a cell of one sequence, without its loop over all
        return;                            // LLAMA_MAX_SEQ sequences (freeze and thaw call this for every move)
    }
    cells.rm(i);
}

void llama_kvp_kv_access::cell_set(llama_kv_cache & kv, uint32_t i, llama_pos pos, llama_seq_id seq) {
    kv.v_cells[0].pos_set(i, pos);
    kv.v_cells[0].seq_add(i, seq);
}

uint32_t llama_kvp_kv_access::head(const llama_kv_cache & kv) {
    return kv.v_heads[0];
}

void llama_kvp_kv_access::head_set(llama_kv_cache & kv, uint32_t h) {
    kv.v_heads[0] = h < kv.get_size() ? h : 0;
}

const float * llama_kvp_kv_access::rot(const llama_kv_cache & kv, bool v, int32_t & n) {
    n = 0;
    if (!(v ? kv.attn_rot_v : kv.attn_rot_k)) {
        return nullptr;
    }
    // V in chunks of 64, K in the largest power of two (from 64) that divides the head size, as llama.cpp does
    int32_t nrot = 64;
    if (!v) {
        do {
            nrot *= 2;
        } while (kv.n_embd_head_k_all % nrot == 0);
        nrot /= 2;
    }
    const auto it = kv.attn_rot_hadamard.find(nrot);
    GGML_ASSERT(it != kv.attn_rot_hadamard.end());
    n = nrot;
    return it->second.data();
}

size_t llama_kvp_kv_access::n_ubatches(const llama_memory_context_i * mctx) {
    if (const auto * kctx = dynamic_cast<const llama_kv_cache_context *>(mctx)) {
        return kctx->ubatches.size();
    }
    if (const auto * pctx = dynamic_cast<const llama_kvp_memory_context *>(mctx)) {
        return pctx->n_ubatches();
    }
    return 1;
}

llama_kv_cache * llama_kvp_context::layer_kv(int32_t ikv) const {
    return mem ? mem->layers[ikv].kv.get() : kv;
}

//
// pending policy (set by the caller before llama_init_from_model on the same thread)
//

static thread_local bool             g_pending_set = false;
static thread_local llama_kvp_policy g_pending     = {};

int32_t llama_kvp_set_pending(const struct llama_kvp_policy * policy) {
    if (!policy) {
        g_pending_set = false;
        return 0;
    }
    if (llama_kvp_policy_validate(policy) != 0) {
        return -1;
    }
    g_pending     = *policy;
    g_pending_set = true;
    return 0;
}

void llama_kvp_clear_pending(void) {
    g_pending_set = false;
}

bool llama_kvp_pending_peek(llama_kvp_policy & out) {
    if (g_pending_set) {
        out = g_pending;
    }
    return g_pending_set;
}

//
// context init
//

static std::runtime_error llama_kvp_fail(const std::string & msg) {
    llama_kvp_set_error(msg);
    return std::runtime_error("pykvcache: " + msg);
}

ggml_context * llama_kvp_layer_ctx(int32_t n_tensors, const char * what) {
    ggml_init_params params = {
        /*.mem_size   =*/ size_t(n_tensors*ggml_tensor_overhead()),
        /*.mem_buffer =*/ NULL,
        /*.no_alloc   =*/ true,
    };
    ggml_context * ctx = ggml_init(params);
    if (!ctx) {
        throw llama_kvp_fail(std::string("failed to create a ggml context for the ") + what);
    }
    return ctx;
}

ggml_backend_buffer_t llama_kvp_layer_alloc(llama_kvp_context * st, int32_t ikv, ggml_context * ctx, const char * what) {
    ggml_tensor * k = llama_kvp_kv_access::layer_k(*st->layer_kv(ikv), st->mem ? 0 : ikv);
    ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(k->buffer);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
    if (!buf) {
        throw llama_kvp_fail(std::string("failed to allocate the ") + what + " in " + ggml_backend_buft_name(buft));
    }
    ggml_backend_buffer_clear(buf, 0);
    return buf;
}

// (re)allocates the observation tensors of one layer for n_cells cells, in the buffer type of the layer's K cache
static void llama_kvp_obs_alloc(llama_kvp_context * st, int32_t ikv, int32_t n_cells) {
    auto & L = st->layers[ikv];
    ggml_context * ctx = llama_kvp_layer_ctx(5, "observation buffers");
    L.ctx.reset(ctx);
    L.q_ring   = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, (int64_t) st->n_embd_head*st->n_head, st->policy.window);
    L.mass     = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_cells, st->n_head);
    L.mass_acc = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_cells, 3);
    L.entropy  = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, st->n_head);
    ggml_format_name(L.q_ring,   "kvp_q_ring-%d",   L.il);
    ggml_format_name(L.mass,     "kvp_mass-%d",     L.il);
    ggml_format_name(L.mass_acc, "kvp_mass_acc-%d", L.il);
    ggml_format_name(L.entropy,  "kvp_entropy-%d",  L.il);
    L.mass_rows = nullptr;
    if (st->mem && st->policy.window > 1) {
        L.mass_rows = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_cells, st->policy.window);
        ggml_format_name(L.mass_rows, "kvp_mass_rows-%d", L.il);
    }

    L.buf.reset(llama_kvp_layer_alloc(st, ikv, ctx, "observation buffer"));
    L.n_cells  = n_cells;
    L.n_kv_obs = 0;
    L.cell_pos_obs.assign(n_cells, -2);
    L.row_step.assign(L.mass_rows ? st->policy.window : 0, -1);
    L.cell_step.assign(L.mass_rows ? n_cells : 0, 0);
    L.cell_pos_row.assign(L.mass_rows ? n_cells : 0, -2);
}

static void llama_kvp_update_n_cells(llama_kvp_context * st) {
    st->n_cells = 0;
    for (const auto & L : st->layers) {
        st->n_cells = std::max(st->n_cells, L.n_cells);
    }
}

static std::string llama_kvp_memory_kind(const llama_memory_i * memory) {
    return !memory ? "no KV cache" :
        dynamic_cast<const llama_kv_cache_iswa *>(memory) ? "a sliding-window (iSWA) KV cache" :
        dynamic_cast<const llama_kv_cache *>(memory) ? "a KV cache variant" :
        "a recurrent or hybrid memory";
}

llama_memory_i * llama_kvp_create_memory(
        const llama_model         & model,
        const llama_memory_params & params,
        const llama_cparams       & cparams) {
    llama_kvp_policy policy;
    if (!llama_kvp_pending_peek(policy) || !llama_kvp_policy_retains(policy)) {
        return model.create_memory(params, cparams);
    }

    const std::string pname = llama_kvp_policy_type_name(policy.type);
    const std::string arch  = llm_arch_name(model.arch);
    auto fail = [&](const std::string & msg) {
        g_pending_set = false; // consumed, also on failure
        return llama_kvp_fail(msg);
    };
    {
        const std::string err = llama_kvp_policy_check(policy);
        if (!err.empty()) {
            throw fail(err);
        }
    }
    if (model.hparams.is_mla()) {
        throw fail("policy '" + pname + "' does not support architecture '" + arch + "': multi-head latent attention (MLA) keeps no per-head keys");
    }
    if (const auto * fate = llama_kvp_fate_of(policy)) {
        const std::string err = fate->check_model(policy, (int32_t) model.hparams.n_embd_head_k(), cparams.n_ctx_seq);
        if (!err.empty()) {
            throw fail("policy '" + pname + "', stage '" + fate->name + "': " + err);
        }
    }
    if (policy.budget >= 1.0f && policy.budget > (float) cparams.n_ctx_seq && policy.budget != LLAMA_KVP_BUDGET_ALL) {
        char buf[256];
        snprintf(buf, sizeof(buf), "policy '%s': budget=%g is larger than the context (n_ctx=%u)", pname.c_str(), (double) policy.budget, cparams.n_ctx_seq);
        throw fail(buf);
    }
    if ((uint32_t) llama_kvp_policy_n_protected(policy) > cparams.n_ctx_seq) {
        throw fail("policy '" + pname + "': the tokens always kept (" + std::to_string(llama_kvp_policy_n_protected(policy)) +
                ") do not fit the context (n_ctx=" + std::to_string(cparams.n_ctx_seq) + ")");
    }

    // the model must use one plain KV cache: probe with a small one
    {
        llama_cparams cp = cparams;
        cp.n_ctx     = 256;
        cp.n_ctx_seq = 256;
        std::unique_ptr<llama_memory_i> probe(model.create_memory(params, cp));
        llama_memory_i * m = probe.get();
        if (!m || typeid(*m) != typeid(llama_kv_cache)) {
            throw fail("policy '" + pname + "' does not support architecture '" + arch + "': it needs one plain KV cache for all "
                    "attention layers, and this model uses " + llama_kvp_memory_kind(m));
        }
    }
    return new llama_kvp_memory(model, params, cparams, policy);
}

std::unique_ptr<llama_kvp_context> llama_kvp_context_init(
        llama_context       * lctx,
        const llama_model   & model,
        const llama_cparams & cparams,
        llama_memory_i      * memory) {
    if (!g_pending_set) {
        return nullptr;
    }
    const llama_kvp_policy policy = g_pending;
    g_pending_set = false; // consumed, also on failure

    if (!llama_kvp_policy_observes(policy) && !llama_kvp_policy_retains(policy) && !llama_kvp_policy_sparse(policy)) {
        return nullptr; // the full cache, nothing observed
    }

    const std::string pname = llama_kvp_policy_type_name(policy.type);
    const std::string arch  = llm_arch_name(model.arch);
    const auto & hparams = model.hparams;

    {
        const std::string err = llama_kvp_policy_check(policy);
        if (!err.empty()) {
            throw llama_kvp_fail(err);
        }
    }

    auto * mem = dynamic_cast<llama_kvp_memory *>(memory);
    auto * kv  = dynamic_cast<llama_kv_cache *>(memory);
    if (llama_kvp_policy_retains(policy) && !mem) {
        throw llama_kvp_fail("policy '" + pname + "' needs the per-layer KV memory, and this context has " + llama_kvp_memory_kind(memory));
    }
    if (!mem && !kv) {
        throw llama_kvp_fail("policy '" + pname + "' does not support architecture '" + arch + "': it needs one unified "
                "KV cache for all attention layers, and this model uses " + llama_kvp_memory_kind(memory));
    }
    if (hparams.is_mla()) {
        throw llama_kvp_fail("policy '" + pname + "' does not support architecture '" + arch + "': multi-head latent attention (MLA) keeps no per-head keys");
    }
    if (kv && (llama_kvp_kv_access::n_stream(*kv) != 1 || cparams.n_seq_max != 1)) {
        throw llama_kvp_fail("policy '" + pname + "' runs on llama.cpp's own cache, which it supports with one sequence per context "
                "(n_seq_max=1; a server's --n_parallel), got " + std::to_string(cparams.n_seq_max) + "; retention policies take several");
    }
    if ((uint32_t) policy.window > cparams.n_ctx_seq) {
        throw llama_kvp_fail("policy '" + pname + "': window=" + std::to_string(policy.window) +
                " is larger than the context (n_ctx=" + std::to_string(cparams.n_ctx_seq) + ")");
    }
    if (policy.stage[LLAMA_KVP_SLOT_PREFILL] == LLAMA_KVP_PREFILL_SPARSE && policy.skip >= (int32_t) hparams.n_layer()) {
        throw llama_kvp_fail("policy '" + pname + "', stage 'sparse': skip=" + std::to_string(policy.skip) +
                " leaves no layer sparse (the model has " + std::to_string(hparams.n_layer()) + " layers)");
    }

    auto st = std::make_unique<llama_kvp_context>(model);
    st->policy      = policy;
    st->obs_on      = llama_kvp_policy_observes(policy);
    st->lctx        = lctx;
    st->kv          = mem ? nullptr : kv;
    st->mem         = mem;
    st->causal_attn = cparams.causal_attn;
    st->n_ubatch    = cparams.n_ubatch;

    std::vector<int32_t> ils;
    if (mem) {
        for (const auto & L : mem->layers) {
            ils.push_back(L.il);
        }
    } else {
        for (int32_t ikv = 0; ikv < llama_kvp_kv_access::n_layers(*kv); ++ikv) {
            ils.push_back(llama_kvp_kv_access::layer_il(*kv, ikv));
        }
    }
    const int32_t n_kv_layers = (int32_t) ils.size();
    if (n_kv_layers == 0) {
        throw llama_kvp_fail("policy '" + pname + "' does not support architecture '" + arch + "': it has no attention layer with a KV cache");
    }

    // all attention layers must share one head layout (the telemetry arrays are [n_layer, n_head])
    for (int32_t ikv = 0; ikv < n_kv_layers; ++ikv) {
        const uint32_t il = ils[ikv];
        const int32_t n_head      = hparams.n_head(il);
        const int32_t n_head_kv   = hparams.n_head_kv(il);
        const int32_t n_embd_head = hparams.n_embd_head_k(il);
        if (ikv == 0) {
            st->n_head      = n_head;
            st->n_head_kv   = n_head_kv;
            st->n_embd_head = n_embd_head;
        } else if (n_head != st->n_head || n_head_kv != st->n_head_kv || n_embd_head != st->n_embd_head) {
            throw llama_kvp_fail("policy '" + pname + "' does not support architecture '" + arch + "': attention layers differ in head count or size");
        }
    }
    if (st->n_head <= 0 || st->n_head_kv <= 0 || st->n_head % st->n_head_kv != 0) {
        throw llama_kvp_fail("policy '" + pname + "' does not support architecture '" + arch + "': unsupported head layout");
    }

    st->layer_of_il.assign(hparams.n_layer(), -1);
    for (int32_t ikv = 0; ikv < n_kv_layers; ++ikv) {
        if (ils[ikv] >= 0 && ils[ikv] < (int32_t) st->layer_of_il.size()) {
            st->layer_of_il[ils[ikv]] = ikv;
        }
    }

    // the observation state of each sequence, allocated while it is the memory's current one
    const uint32_t n_seq = mem ? mem->n_seq() : 1;
    st->seqs.resize(n_seq);
    if (mem) {
        mem->st = st.get();
    }
    size_t total = 0;
    for (uint32_t s = 0; s < n_seq; ++s) {
        if (mem) {
            mem->seq_use((llama_seq_id) s);
        }
        st->layers.resize(n_kv_layers);
        for (int32_t ikv = 0; ikv < n_kv_layers; ++ikv) {
            auto & L = st->layers[ikv];
            L.il = ils[ikv];
            // device-resident results, next to each layer's K cache (sink_recent observes nothing: only the bookkeeping)
            if (st->observing()) {
                llama_kvp_obs_alloc(st.get(), ikv, (int32_t) st->layer_kv(ikv)->get_size());
            } else {
                L.n_cells = (int32_t) st->layer_kv(ikv)->get_size();
            }
            if (const auto * prefill = llama_kvp_prefill_of(policy)) {
                prefill->alloc(st.get(), ikv, (int32_t) cparams.n_ctx_seq); // its own state, if any
            }
            total += L.buf ? ggml_backend_buffer_get_size(L.buf.get()) : 0;
        }
        llama_kvp_update_n_cells(st.get());
        st->slot_pos.assign(policy.window, -1);
        st->ent_sum.assign(n_kv_layers, 0.0);
    }
    if (mem) {
        mem->seq_use(0);
    }

    char desc[512];
    llama_kvp_policy_to_string(&policy, desc, sizeof(desc));
    LLAMA_LOG_INFO("%s: pykvcache policy %s on %d layers x %d heads, up to %d cells per layer, observation buffers %.2f MiB\n",
            __func__, desc, n_kv_layers, st->n_head, st->n_cells, total/1024.0/1024.0);

    return st;
}

void llama_kvp_context_check(llama_kvp_context * kvp) {
    if (!kvp) {
        return;
    }
    for (const auto & L : kvp->layers) {
        if (!L.seen) {
            throw llama_kvp_fail(std::string("policy '") + llama_kvp_policy_type_name(kvp->policy.type) +
                    "' does not support architecture '" + llm_arch_name(kvp->model.arch) + "': layer " + std::to_string(L.il) +
                    " computes attention through a path the policy cannot observe");
        }
    }
}

uint32_t llama_kvp_graph_n_nodes(const llama_kvp_context * kvp) {
    if (!kvp) {
        return 0;
    }
    uint32_t per_layer = LLAMA_KVP_NODES_PER_LAYER;
    if (const auto * prefill = llama_kvp_prefill_of(kvp->policy)) {
        per_layer += prefill->n_graph_nodes(kvp->policy, kvp->n_ubatch);
    }
    return per_layer*(uint32_t) kvp->layers.size() + 16;
}

bool llama_kvp_context::want_obs(const llama_ubatch & ubatch, size_t n_ubatches) const {
    if (!observing()) {
        return false;
    }
    if (ubatch.n_tokens > 1 || n_ubatches > 1) {
        return true; // prompt batches always observe
    }
    if (obs_requested) {
        return true; // a single-token step that was asked to observe
    }
    const auto * schedule = llama_kvp_schedule_of(policy);
    return schedule && schedule->observe_step(policy, n_decode);
}

bool llama_kvp_context::want_entropy(bool obs, const llama_ubatch & ubatch, size_t n_ubatches) const {
    // budgets and telemetry need it; the decode steps of a retention policy only refresh the scores (the mass),
    // unless an observation was asked for; a guided chunk too, unless the budgets follow the entropy: telemetry
    // reads the prompt's last ubatch's, which is never a guided chunk
    if (mem && mem->guiding && !(mem->stage_budget && mem->stage_budget->uses_entropy())) {
        return false;
    }
    return obs && (!mem || ubatch.n_tokens > 1 || n_ubatches > 1 || obs_requested);
}

//
// graph input: ring slots to write, observation masks, query weights and accumulation factors
//

// the cells one observation mask covers: one set for the unified cache, one per layer for the per-layer memory
struct llama_kvp_obs_cells {
    llama_kv_cache * kv   = nullptr;
    int64_t          n_kv = 0;
    ggml_tensor    * mask = nullptr; // F32 [n_kv, window]  0 / -INF (or ALiBi distance) per window query
    ggml_tensor    * keep = nullptr; // F32 [n_kv]          decay where the cell still holds the same token, else 0
    ggml_tensor    * rsel = nullptr; // F32 [n_kv, window]  1 where a row counts for a cell (it held its token then)
    std::vector<int32_t> layers;     // KV layers using this set
};

// the sets of the per-layer memory, one per layer, as views of one graph input per kind (see llama-kvp-graph.cpp: the
// scheduler uploads each input of an offloaded split on its own): each layer's part of each, and the inputs
struct llama_kvp_obs_packed {
    std::vector<int64_t> n_kv;     // by KV layer, as planned when the graph was built
    std::vector<size_t>  off_keep; // bytes into keep
    std::vector<size_t>  off_rows; // bytes into mask and rsel
    ggml_tensor * keep = nullptr;  // host inputs
    ggml_tensor * mask = nullptr;
    ggml_tensor * rsel = nullptr;
    ggml_tensor * keep_src = nullptr; // what the views are cut from: the inputs, or their device copies
    ggml_tensor * mask_src = nullptr;
    ggml_tensor * rsel_src = nullptr;
};

class llama_kvp_obs_input : public llm_graph_input_i {
public:
    llama_kvp_obs_input(llama_kvp_context * st, bool obs, bool ent, int64_t n_tokens) :
        st(st), obs(obs), ent(ent), rows(st->rows_mode() && n_tokens == 1 && !ent), n_tokens(n_tokens) {}

    void set_input(const llama_ubatch * ubatch) override;
    bool can_reuse(const llm_graph_params & params) override;

    // the set of layer ikv's cache; its mask is made when a layer of the set computes its own probabilities, its
    // row selection when a layer of the set sums its rows
    llama_kvp_obs_cells & cells_for(ggml_context * ctx0, int32_t ikv, int64_t n_kv, bool need_mask, bool need_rows = false);

    llama_kvp_context * st;

    const bool    obs;
    const bool    ent;  // the observation computes the entropy (not needed by the decode steps of a retention policy)
    const bool    rows; // a decode step that keeps its attention rows (llama_kvp_obs_layer::mass_rows)
    const int64_t n_tokens;

    std::vector<int32_t> rows_one; // layers that wrote the row of this step's slot
    std::vector<int32_t> rows_all; // layers that wrote the rows of every slot (an observation of the ring's queries)

    ggml_tensor * ring_idx  = nullptr; // I64 [n_write]           ring slots of the last n_write tokens
    ggml_tensor * weights   = nullptr; // F32 [window, 1]         1/n_valid for valid window queries, else 0
    ggml_tensor * weights_h = nullptr; // F32 [1, window, n_head] the same weights, repeated per head
    ggml_tensor * head_w    = nullptr; // F32 [1, n_head]         1/n_head (head mean of the mass)

    std::vector<llama_kvp_obs_cells> sets;
    llama_kvp_obs_packed             packed; // the per-layer memory's (empty otherwise)

    // the host data of set c's part of a packed input (or of its own input)
    float * host_part(const llama_kvp_obs_cells & c, ggml_tensor * view, ggml_tensor * all, bool rows) const;
};

llama_kvp_obs_cells & llama_kvp_obs_input::cells_for(ggml_context * ctx0, int32_t ikv, int64_t n_kv, bool need_mask, bool need_rows) {
    llama_kv_cache * kv = st->layer_kv(ikv);
    llama_kvp_obs_cells * set = nullptr;
    for (auto & c : sets) {
        if (c.kv == kv) {
            GGML_ASSERT(c.n_kv == n_kv);
            set = &c;
            break;
        }
    }
    const int64_t W    = st->policy.window;
    const bool    pack = packed.keep != nullptr;
    GGML_ASSERT(!pack || packed.n_kv[ikv] == n_kv);
    if (!set) {
        sets.emplace_back();
        set = &sets.back();
        set->kv   = kv;
        set->n_kv = n_kv;
        if (pack) {
            set->keep = ggml_view_1d(ctx0, packed.keep_src, n_kv, packed.off_keep[ikv]);
        } else {
            set->keep = ggml_new_tensor_1d(ctx0, GGML_TYPE_F32, n_kv);
            ggml_set_input(set->keep);
        }
    }
    if (need_mask && !set->mask) {
        if (pack) {
            set->mask = ggml_view_2d(ctx0, packed.mask_src, n_kv, W, n_kv*sizeof(float), packed.off_rows[ikv]);
        } else {
            set->mask = ggml_new_tensor_2d(ctx0, GGML_TYPE_F32, n_kv, W);
            ggml_set_input(set->mask);
        }
    }
    if (need_rows && !set->rsel) {
        if (pack) {
            set->rsel = ggml_view_2d(ctx0, packed.rsel_src, n_kv, W, n_kv*sizeof(float), packed.off_rows[ikv]);
        } else {
            set->rsel = ggml_new_tensor_2d(ctx0, GGML_TYPE_F32, n_kv, W);
            ggml_set_input(set->rsel);
        }
    }
    set->layers.push_back(ikv);
    return *set;
}

bool llama_kvp_obs_input::can_reuse(const llm_graph_params & params) {
    const size_t n_ubatches = llama_kvp_kv_access::n_ubatches(params.mctx);
    const bool obs_now = st->want_obs(params.ubatch, n_ubatches);
    if (params.ubatch.n_tokens != n_tokens || obs_now != obs || st->want_entropy(obs_now, params.ubatch, n_ubatches) != ent) {
        return false;
    }
    // every set must cover as many cells of the same cache (the per-layer memory's input checks reallocations)
    const auto * pctx = dynamic_cast<const llama_kvp_memory_context *>(params.mctx);
    for (const auto & c : sets) {
        const int32_t ikv = c.layers[0];
        const llama_kv_cache_context * kctx = pctx ? pctx->layer_ctx(ikv) : static_cast<const llama_kv_cache_context *>(params.mctx);
        if (c.kv != st->layer_kv(ikv) || (int64_t) kctx->get_n_kv() != c.n_kv) {
            return false;
        }
    }
    st->n_steps_call = n_ubatches;
    return true;
}

// the host data of an input tensor, or nullptr where the graph has no node reading it: the scheduler allocates no
// such input (e.g. the head weights of a decode step on a backend that declines the observed attention, CUDA)
static float * llama_kvp_input_f32(ggml_tensor * t) {
    return t && t->buffer ? (float *) t->data : nullptr;
}

float * llama_kvp_obs_input::host_part(const llama_kvp_obs_cells & c, ggml_tensor * view, ggml_tensor * all, bool rows) const {
    if (!packed.keep) {
        return llama_kvp_input_f32(view);
    }
    if (!view || !all->buffer) {
        return nullptr;
    }
    const int32_t ikv = c.layers[0];
    return (float *) ((char *) all->data + (rows ? packed.off_rows[ikv] : packed.off_keep[ikv]));
}

// a window query is valid when its ring slot holds one of the last W positions up to p_max (-1: an empty slot)
static bool llama_kvp_slot_valid(llama_pos p, llama_pos p_max, int32_t W) {
    return p >= 0 && p <= p_max && p > p_max - W;
}

void llama_kvp_obs_input::set_input(const llama_ubatch * ubatch) {
    llama_kvp_perf_scope t(st, &llama_kvp_perf_data::t_input_ms);
    const int32_t W = st->policy.window;

    // ring slots of the last n_write tokens
    {
        const int64_t n_write = ring_idx->ne[0];
        int64_t * data = (int64_t *) ring_idx->data;
        for (int64_t i = 0; i < n_write; ++i) {
            const llama_pos p = ubatch->pos[n_tokens - n_write + i];
            const int32_t   s = (int32_t) (p % W);
            data[i] = s;
            st->slot_pos[s] = p;
        }
    }

    st->n_steps++;
    if (ubatch->n_tokens == 1) {
        st->n_decode++;
    }

    // rows written by this step, and the step from which each cell of those layers holds its token
    if (!rows_one.empty() || !rows_all.empty()) {
        std::vector<llama_pos> pos_now;
        const int32_t now  = st->n_steps;
        const int32_t slot = (int32_t) (ubatch->pos[n_tokens - 1] % W);
        for (const auto * list : { &rows_one, &rows_all }) {
            for (int32_t ikv : *list) {
                auto & L = st->layers[ikv];
                if (list == &rows_one) {
                    L.row_step[slot] = now;
                } else {
                    std::fill(L.row_step.begin(), L.row_step.end(), now);
                }
                const llama_kv_cache * kv = st->layer_kv(ikv);
                const uint32_t size = std::min<uint32_t>(kv->get_size(), (uint32_t) L.n_cells);
                pos_now.resize(size);
                llama_kvp_kv_access::cell_positions(*kv, size, pos_now.data());
                for (uint32_t j = 0; j < size; ++j) {
                    if (pos_now[j] != L.cell_pos_row[j]) {
                        L.cell_pos_row[j] = pos_now[j];
                        L.cell_step[j]    = now;
                    }
                }
            }
        }
    }
    if (float * hw = llama_kvp_input_f32(head_w)) {
        std::fill(hw, hw + st->n_head, 1.0f/st->n_head);
    }

    if (!obs) {
        return;
    }

    llama_pos p_max = ubatch->pos[0];
    for (uint32_t i = 0; i < ubatch->n_tokens; ++i) {
        p_max = std::max(p_max, ubatch->pos[i]);
    }

    // valid window queries: the slots holding positions (p_max - W, p_max]
    int32_t n_valid = 0;
    std::vector<bool> valid(W, false);
    for (int32_t s = 0; s < W; ++s) {
        const llama_pos p = st->slot_pos[s];
        valid[s] = llama_kvp_slot_valid(p, p_max, W);
        n_valid += valid[s] ? 1 : 0;
    }

    std::vector<float> w(W);
    for (int32_t s = 0; s < W; ++s) {
        w[s] = valid[s] ? 1.0f/n_valid : 0.0f;
    }
    if (float * wq = ent ? llama_kvp_input_f32(weights) : nullptr) {
        std::copy(w.begin(), w.end(), wq); // only the entropy reads the per-query weights
    }
    if (float * wh = llama_kvp_input_f32(weights_h)) {
        for (int32_t h = 0; h < st->n_head; ++h) {
            std::copy(w.begin(), w.end(), wh + (int64_t) h*W);
        }
    }
    const bool alibi = st->model.hparams.use_alibi;

    std::vector<llama_pos> pos;
    for (auto & c : sets) {
        const int64_t n_kv = c.n_kv;

        // positions of the cells, read once (-1: empty)
        pos.resize(n_kv);
        llama_kvp_kv_access::cell_positions(*c.kv, (uint32_t) n_kv, pos.data());
        int64_t j_any = -1; // a non-empty cell, the single visible cell of the invalid (weight 0) rows
        for (int64_t j = 0; j < n_kv && j_any < 0; ++j) {
            if (pos[j] >= 0) {
                j_any = j;
            }
        }
        if (j_any < 0) {
            j_any = 0;
        }

        float * m = host_part(c, c.mask, packed.mask, true);
        for (int32_t s = 0; m && s < W; ++s) {
            float * row = m + (int64_t) s*n_kv;
            if (!valid[s]) {
                std::fill(row, row + n_kv, -INFINITY);
                row[j_any] = 0.0f;
                continue;
            }
            const llama_pos p1 = st->slot_pos[s];
            bool any = false;
            for (int64_t j = 0; j < n_kv; ++j) {
                const llama_pos p0 = pos[j];
                const bool visible = p0 >= 0 && (!st->causal_attn || p0 <= p1);
                row[j] = visible ? (alibi ? -(float) std::abs(p0 - p1) : 0.0f) : -INFINITY;
                any = any || visible;
            }
            if (!any) {
                // a window query older than every token the layer still holds (a budget of a few tokens): its row
                // would be all -inf, a NaN softmax that makes the layer's entropy and mass NaN (and its budget
                // collapse); it attends to the held tokens alike, the most uncertain attention there is
                for (int64_t j = 0; j < n_kv; ++j) {
                    row[j] = pos[j] >= 0 ? 0.0f : -INFINITY;
                }
                row[j_any] = 0.0f;
            }
        }
        if (st->mem && m) {
            st->mem->mask_add_bias(c.layers[0], m, false, n_kv, W); // as in the attention the model computes
        }

        // accumulation: carry a cell's score only while it holds the token it held at the last observation
        // (the layers of one set share their cells, so their bookkeeping is the same)
        auto & ref = st->layers[c.layers[0]].cell_pos_obs;
        float * kp = host_part(c, c.keep, packed.keep, false);
        for (int64_t j = 0; kp && j < n_kv; ++j) {
            kp[j] = (pos[j] >= 0 && pos[j] == ref[j]) ? st->policy.decay : 0.0f;
        }

        // rows that count for a cell: a valid slot's row written while the cell held its present token
        if (float * rs = host_part(c, c.rsel, packed.rsel, true)) {
            const auto & L = st->layers[c.layers[0]];
            for (int32_t s = 0; s < W; ++s) {
                for (int64_t j = 0; j < n_kv; ++j) {
                    rs[(int64_t) s*n_kv + j] = valid[s] && pos[j] >= 0 && L.row_step[s] >= L.cell_step[j] ? 1.0f : 0.0f;
                }
            }
        }
        for (int32_t ikv : c.layers) {
            auto & L = st->layers[ikv];
            for (int64_t j = 0; j < n_kv; ++j) {
                L.cell_pos_obs[j] = pos[j];
            }
            for (int64_t j = n_kv; j < L.n_cells; ++j) {
                L.cell_pos_obs[j] = -2;
            }
            L.n_kv_obs = (int32_t) n_kv;
        }
    }

    st->n_obs++;
    if (ubatch->n_tokens > 1 || st->n_steps_call > 1) {
        st->n_obs_prompt++;
    }
    st->n_kv_obs      = (int32_t) sets.empty() ? 0 : (int32_t) sets[0].n_kv;
    st->n_queries_obs = n_valid;
    st->pos_obs       = p_max;
    if (!rows) {
        st->n_obs_heads = st->n_obs;
    }
    if (ent) {
        st->n_obs_ent = st->n_obs;
        st->pos_ent   = p_max;
    }
    if (ubatch->n_tokens == 1) {
        st->obs_requested = false;
    }
}

//
// graph hooks
//

static thread_local llama_kvp_context   * g_graph_st  = nullptr;
static thread_local llama_kvp_obs_input * g_graph_inp = nullptr;
// per model layer: the probabilities [n_kv, 1, n_head] of the decode step's attention when it was computed by
// llama_kvp_graph_observed_attn, which the observation then takes instead of computing K·Q a second time
static thread_local std::vector<ggml_tensor *> g_graph_probs;

void llama_kvp_graph_begin(llama_kvp_context * kvp) {
    g_graph_st  = kvp;
    g_graph_inp = nullptr;
    g_graph_probs.clear();
    if (const auto * prefill = kvp ? llama_kvp_prefill_of(kvp->policy) : nullptr) {
        prefill->graph_begin(kvp);
    }
}

llama_kvp_context * llama_kvp_graph_ctx() {
    return g_graph_st;
}

// the graph's observation input, made by the first layer that needs it
static llama_kvp_obs_input * llama_kvp_graph_obs_input(const llm_graph_context & gctx, llama_kvp_context * st, int64_t n_tokens) {
    if (g_graph_inp && g_graph_inp->n_tokens == n_tokens) {
        return g_graph_inp;
    }
    ggml_context * ctx0 = gctx.ctx0;

    const int64_t W      = st->policy.window;
    const int64_t n_head = st->n_head;

    st->n_steps_call = llama_kvp_kv_access::n_ubatches(gctx.mctx);
    const bool obs = st->want_obs(gctx.ubatch, st->n_steps_call);
    auto inp = std::make_unique<llama_kvp_obs_input>(st, obs, st->want_entropy(obs, gctx.ubatch, st->n_steps_call), n_tokens);

    const int64_t n_write = std::min<int64_t>(W, n_tokens);
    inp->ring_idx = ggml_new_tensor_1d(ctx0, GGML_TYPE_I64, n_write);
    ggml_set_input(inp->ring_idx);
    if (inp->obs) {
        inp->weights   = ggml_new_tensor_2d(ctx0, GGML_TYPE_F32, W, 1);
        inp->weights_h = ggml_new_tensor_3d(ctx0, GGML_TYPE_F32, 1, W, n_head);
        ggml_set_input(inp->weights);
        ggml_set_input(inp->weights_h);
    }
    if (inp->obs || inp->rows) {
        inp->head_w = ggml_new_tensor_2d(ctx0, GGML_TYPE_F32, 1, n_head);
        ggml_set_input(inp->head_w);
    }
    const auto * pctx = dynamic_cast<const llama_kvp_memory_context *>(gctx.mctx);
    if (inp->obs && st->mem && pctx) {
        // the per-layer memory's sets: each layer's part of one input per kind, each part starting on 256 bytes
        auto & pk = inp->packed;
        size_t n_keep = 0;
        size_t n_rows = 0;
        for (size_t ikv = 0; ikv < pctx->n_layers(); ++ikv) {
            const int64_t n_kv = pctx->layer_ctx((int32_t) ikv)->get_n_kv();
            pk.n_kv.push_back(n_kv);
            pk.off_keep.push_back(n_keep);
            pk.off_rows.push_back(n_rows);
            n_keep += GGML_PAD(n_kv*sizeof(float), 256);
            n_rows += GGML_PAD(n_kv*W*sizeof(float), 256);
        }
        // offloaded: the views are cut from device copies (an input or copy that nothing reads is not in the graph)
        const bool off = st->mem->off_host();
        pk.keep = llama_kvp_packed_input(ctx0, GGML_TYPE_F32, n_keep, "kvp_obs_keep-all", off, &pk.keep_src);
        pk.mask = llama_kvp_packed_input(ctx0, GGML_TYPE_F32, n_rows, "kvp_obs_mask-all", off, &pk.mask_src);
        pk.rsel = llama_kvp_packed_input(ctx0, GGML_TYPE_F32, n_rows, "kvp_obs_rsel-all", off, &pk.rsel_src);
    }
    g_graph_inp = (llama_kvp_obs_input *) gctx.res->add_input(std::move(inp));
    return g_graph_inp;
}

// softmax of attention scores as build_attn_mha takes it: logit softcap, scale, mask (ALiBi), sinks
static ggml_tensor * llama_kvp_graph_softmax(ggml_context * ctx0, const llama_hparams & hparams, ggml_tensor * kq,
        ggml_tensor * mask, ggml_tensor * sinks, float kq_scale) {
    ggml_prec_set_acc(kq, GGML_PREC_F32);
    if (hparams.attn_soft_cap) {
        kq = ggml_scale(ctx0, kq, kq_scale / hparams.f_attn_logit_softcapping);
        kq = ggml_tanh (ctx0, kq);
        kq = ggml_scale(ctx0, kq, hparams.f_attn_logit_softcapping);
        kq_scale = 1.0f;
    }
    ggml_tensor * probs = ggml_soft_max_ext(ctx0, kq, mask, kq_scale, hparams.f_max_alibi_bias);
    ggml_soft_max_add_sinks(probs, sinks);
    return probs;
}

ggml_tensor * llama_kvp_graph_observed_attn(
        const llm_graph_context & gctx,
                    ggml_tensor * q,
                    ggml_tensor * k,
                    ggml_tensor * v,
                    ggml_tensor * kq_mask,
                    ggml_tensor * sinks,
                          float   kq_scale,
                            int   il) {
    llama_kvp_context * st = g_graph_st;
    if (!st || !st->observing() || (st->policy.window != 1 && !st->rows_mode()) || gctx.cparams.training || kq_mask == nullptr) {
        return nullptr;
    }
    if (il < 0 || il >= (int) st->layer_of_il.size() || st->layer_of_il[il] < 0) {
        return nullptr;
    }
    const int64_t n_tokens = q->ne[2];
    if (n_tokens != 1 || q->ne[1] != st->n_head || k->ne[3] != 1) {
        return nullptr; // a prompt ubatch
    }
    const bool v_trans = v->nb[1] > v->nb[2];
    if (!v_trans) {
        // flash attention's layout: the op that also writes the probabilities, on the CPU only, with F16 K and V (its
        // row path split over the threads by cells); other types keep flash attention, and the observation computes
        // its own K·Q, as on a GPU: the op would convert their blocks one query at a time
        if (kq_mask->type != GGML_TYPE_F16 || !ggml_is_contiguous(kq_mask) || kq_mask->ne[2] != 1 || kq_mask->ne[3] != 1 ||
            k->type != GGML_TYPE_F16 || v->type != GGML_TYPE_F16) {
            return nullptr;
        }
        for (const ggml_tensor * t : { k, v }) {
            ggml_backend_buffer_t buf = t->view_src ? t->view_src->buffer : t->buffer;
            if (!buf || !ggml_backend_buffer_is_host(buf)) {
                return nullptr;
            }
        }
    }
    llama_kvp_obs_input * inp = llama_kvp_graph_obs_input(gctx, st, n_tokens);
    if (!inp->rows && !(inp->obs && st->policy.window == 1)) {
        return nullptr; // nothing observes this step's own query
    }

    ggml_context * ctx0 = gctx.ctx0;
    const auto & hparams = gctx.hparams;

    ggml_tensor * qp = ggml_permute(ctx0, q, 0, 2, 1, 3);                  // [d, 1, n_head]
    ggml_tensor * kp = ggml_permute(ctx0, k, 0, 2, 1, 3);                  // [d, n_kv, n_head_kv]
    ggml_tensor * vp = ggml_permute(ctx0, v, 0, 2, 1, 3);
    ggml_tensor * probs;                                                   // [n_kv, 1, n_head]
    ggml_tensor * cur;
    if (v_trans) {
        // as build_attn_mha computes it without flash attention, keeping the softmax
        probs = llama_kvp_graph_softmax(ctx0, hparams, ggml_mul_mat(ctx0, kp, qp), kq_mask, sinks, kq_scale);
        ggml_tensor * kqv = ggml_mul_mat(ctx0, vp, probs);                  // [d_v, 1, n_head]
        cur = ggml_cont_2d(ctx0, ggml_permute(ctx0, kqv, 0, 2, 1, 3), kqv->ne[0]*kqv->ne[2], 1);
    } else {
        ggml_tensor * res = ggml_sparse_attn_ext_probs(ctx0, qp, kp, vp, kq_mask, kq_scale, hparams.f_max_alibi_bias,
                hparams.attn_soft_cap ? hparams.f_attn_logit_softcapping : 0.0f, 1, 64);
        ggml_sparse_attn_ext_add_sinks(res, sinks);
        ggml_format_name(res, "kvp_observed_attn-%d", il);
        probs = ggml_sparse_attn_ext_probs_view(ctx0, res);
        cur   = ggml_sparse_attn_ext_out(ctx0, res);                        // [d_v, n_head, 1], contiguous
        cur   = ggml_reshape_2d(ctx0, cur, cur->ne[0]*cur->ne[1], 1);
    }
    ggml_format_name(probs, "kvp_attn_probs-%d", il);

    if (g_graph_probs.size() < st->layer_of_il.size()) {
        g_graph_probs.assign(st->layer_of_il.size(), nullptr);
    }
    g_graph_probs[il] = probs;
    return cur;
}

// the value norm of the token in each of the first n_kv cells of KV layer ikv, F32 [n_kv]: the mean over the KV heads
// of |v_h|, from the layer's V cache as the attention reads it (a score stage's vnorm; computed here, with the
// observation, so that an eviction reads it beside the mass instead of reading V back from the device)
static ggml_tensor * llama_kvp_graph_value_norms(const llm_graph_context & gctx, llama_kvp_context * st, int32_t ikv,
                                                 int il, int64_t n_kv) {
    ggml_context * ctx0 = gctx.ctx0;
    ggml_tensor  * vc   = llama_kvp_kv_access::layer_v(*st->layer_kv(ikv), st->mem ? 0 : ikv);
    const int64_t n_head_kv = std::max<int64_t>(1, gctx.hparams.n_head_kv(il));
    const int64_t d_v       = gctx.hparams.n_embd_head_v(il);
    ggml_tensor * v = nullptr;
    if (!llama_kvp_kv_access::v_trans(*st->layer_kv(ikv))) { // a row per cell (made with flash attention on or auto)
        v = ggml_cast(ctx0, ggml_view_2d(ctx0, vc, d_v*n_head_kv, n_kv, vc->nb[1], 0), GGML_TYPE_F32);
    } else { // transposed: a row per dimension, the cache's size long
        v = ggml_view_2d(ctx0, vc, n_kv, d_v*n_head_kv, ggml_row_size(vc->type, vc->ne[1]), 0);
        v = ggml_cont(ctx0, ggml_transpose(ctx0, ggml_cast(ctx0, v, GGML_TYPE_F32)));
    }
    v = ggml_reshape_3d(ctx0, v, d_v, n_head_kv, n_kv);
    ggml_tensor * norms = ggml_sqrt(ctx0, ggml_sum_rows(ctx0, ggml_sqr(ctx0, v)));        // [1, n_head_kv, n_kv]
    norms = ggml_sum_rows(ctx0, ggml_reshape_2d(ctx0, norms, n_head_kv, n_kv));           // [1, n_kv]
    return ggml_scale(ctx0, ggml_reshape_1d(ctx0, norms, n_kv), 1.0f/(float) n_head_kv);
}

// an observation of the n_kv first cells (head-mean mass m [n_kv]): the decayed sum in row 0 of mass_acc (keep: the
// decay where a cell still holds its token, else 0), the observation itself in row 1 and, where given, the value
// norms vn [n_kv] in row 2
static void llama_kvp_obs_accumulate(ggml_context * ctx0, ggml_cgraph * gf, llama_kvp_obs_layer & L, int64_t n_kv,
                                     ggml_tensor * keep, ggml_tensor * m, ggml_tensor * vn) {
    ggml_tensor * acc_dst  = ggml_view_1d(ctx0, L.mass_acc, n_kv, 0);
    ggml_tensor * last_dst = ggml_view_1d(ctx0, L.mass_acc, n_kv, L.mass_acc->nb[1]);
    ggml_tensor * acc      = ggml_add(ctx0, ggml_mul(ctx0, acc_dst, keep), m);
    ggml_build_forward_expand(gf, ggml_cpy(ctx0, acc, acc_dst));
    ggml_build_forward_expand(gf, ggml_cpy(ctx0, m, last_dst));
    if (vn) {
        ggml_build_forward_expand(gf, ggml_cpy(ctx0, vn, ggml_view_1d(ctx0, L.mass_acc, n_kv, 2*L.mass_acc->nb[1])));
    }
}

void llama_kvp_graph_observe(
        const llm_graph_context & gctx,
                    ggml_tensor * q,
                    ggml_tensor * k,
                    ggml_tensor * sinks,
                          float   kq_scale,
                            int   il) {
    llama_kvp_context * st = g_graph_st;
    if (!st || gctx.cparams.training) {
        return;
    }
    if (il < 0 || il >= (int) st->layer_of_il.size() || st->layer_of_il[il] < 0) {
        return;
    }
    const int32_t ikv = st->layer_of_il[il];
    auto & L = st->layers[ikv];
    L.seen     = true;
    L.kq_scale = kq_scale;

    if (!st->observing()) {
        return;
    }

    ggml_context * ctx0 = gctx.ctx0;
    ggml_cgraph  * gf   = gctx.gf;

    const int64_t W        = st->policy.window;
    const int64_t n_tokens = q->ne[2];
    const int64_t n_kv     = k->ne[2];
    const int64_t n_head   = st->n_head;
    const int64_t d        = st->n_embd_head;

    GGML_ASSERT(q->ne[0] == d && q->ne[1] == n_head);
    GGML_ASSERT(k->ne[3] == 1);

    // one input object per graph, shared by the layers
    llama_kvp_obs_input * inp = llama_kvp_graph_obs_input(gctx, st, n_tokens);

    // write the last queries of the ubatch into the ring
    ggml_tensor * q2 = ggml_is_contiguous(q) ? q : ggml_cont(ctx0, q);
    q2 = ggml_reshape_2d(ctx0, q2, d*n_head, n_tokens);
    const int64_t n_write = inp->ring_idx->ne[0];
    ggml_tensor * q_new = ggml_view_2d(ctx0, q2, d*n_head, n_write, q2->nb[1], (n_tokens - n_write)*q2->nb[1]);
    ggml_tensor * ring  = ggml_set_rows(ctx0, L.q_ring, q_new, inp->ring_idx);
    ggml_build_forward_expand(gf, ring);

    GGML_ASSERT(n_kv <= L.n_cells);
    // the value norms of the cells, for a score stage that weights the mass by them
    const llama_kvp_score_stage * score = llama_kvp_score_of(st->policy);
    auto vn = [&]() { return score && score->uses_values(st->policy) ? llama_kvp_graph_value_norms(gctx, st, ikv, il, n_kv) : nullptr; };
    ggml_tensor * probs_attn = il < (int) g_graph_probs.size() ? g_graph_probs[il] : nullptr;

    // a decode step keeping its attention row: the head mean of its probabilities into the row of its ring slot;
    // an observing step then scores by the rows of the window's queries that saw each cell's present token
    if (inp->rows && probs_attn && L.mass_rows) {
        ggml_tensor * mh = ggml_out_prod(ctx0, ggml_reshape_2d(ctx0, probs_attn, n_kv, n_head), inp->head_w); // [n_kv, 1]
        ggml_tensor * rows = ggml_view_2d(ctx0, L.mass_rows, n_kv, W, L.mass_rows->nb[1], 0);
        rows = ggml_set_rows(ctx0, rows, mh, inp->ring_idx);
        ggml_build_forward_expand(gf, rows);
        inp->rows_one.push_back(ikv);
        if (!inp->obs) {
            return;
        }
        const auto & cells = inp->cells_for(ctx0, ikv, n_kv, false, true);
        ggml_tensor * w  = ggml_view_2d(ctx0, inp->weights_h, 1, W, inp->weights_h->nb[1], 0);    // [1, W]
        ggml_tensor * mw = ggml_out_prod(ctx0, ggml_mul(ctx0, rows, cells.rsel), w);            // [n_kv, 1]
        mw = ggml_reshape_1d(ctx0, mw, n_kv);
        llama_kvp_obs_accumulate(ctx0, gf, L, n_kv, cells.keep, mw, vn());
        return;
    }
    if (!inp->obs) {
        return;
    }
    const auto & cells = inp->cells_for(ctx0, ikv, n_kv, probs_attn == nullptr);

    const auto & hparams = gctx.hparams;

    // attention of the window queries over the layer's cells: the step's own when its attention computed them
    ggml_tensor * probs = probs_attn;
    if (!probs) {
        ggml_tensor * qo = ggml_reshape_3d(ctx0, ring, d, n_head, W);
        qo = ggml_permute(ctx0, qo, 0, 2, 1, 3);                    // [d, W, n_head]
        ggml_tensor * kk = ggml_permute(ctx0, k, 0, 2, 1, 3);       // [d, n_kv, n_head_kv]

        probs = llama_kvp_graph_softmax(ctx0, hparams, ggml_mul_mat(ctx0, kk, qo), cells.mask, sinks, kq_scale); // [n_kv, W, n_head]
        ggml_format_name(probs, "kvp_probs-%d", il);
    }
    GGML_ASSERT(probs->ne[0] == n_kv && probs->ne[1] == W && probs->ne[2] == n_head);

    // with decode-step rows, an observation of the ring's queries (re)writes every row
    if (L.mass_rows && !probs_attn) {
        ggml_tensor * mh = ggml_out_prod(ctx0, ggml_reshape_2d(ctx0, probs, n_kv*W, n_head), inp->head_w); // [n_kv*W, 1]
        ggml_tensor * rows = ggml_view_2d(ctx0, L.mass_rows, n_kv, W, L.mass_rows->nb[1], 0);
        ggml_build_forward_expand(gf, ggml_cpy(ctx0, ggml_reshape_2d(ctx0, mh, n_kv, W), rows));
        inp->rows_all.push_back(ikv);
    }

    // entropy per head: -sum_j p log p, averaged over the valid window queries
    if (inp->ent) {
        ggml_tensor * lp  = ggml_log(ctx0, ggml_scale_bias(ctx0, probs, 1.0f, 1e-30f));
        ggml_tensor * plp = ggml_mul(ctx0, probs, lp);
        ggml_tensor * h   = ggml_sum_rows(ctx0, plp);               // [1, W, n_head]
        h = ggml_reshape_2d(ctx0, h, W, n_head);
        ggml_tensor * ent = ggml_mul_mat(ctx0, inp->weights, h);    // [1, n_head]
        ent = ggml_scale(ctx0, ggml_reshape_1d(ctx0, ent, n_head), -1.0f);
        ggml_build_forward_expand(gf, ggml_cpy(ctx0, ent, L.entropy));
    }

    // mass per head and cell, averaged over the valid window queries (out_prod contracts over the queries)
    ggml_tensor * mass = ggml_out_prod(ctx0, probs, inp->weights_h);            // [n_kv, 1, n_head]
    mass = ggml_reshape_2d(ctx0, mass, n_kv, n_head);
    ggml_tensor * mass_dst = ggml_view_2d(ctx0, L.mass, n_kv, n_head, L.mass->nb[1], 0);
    ggml_build_forward_expand(gf, ggml_cpy(ctx0, mass, mass_dst));

    // decayed accumulation of the head-mean mass
    ggml_tensor * mh = ggml_out_prod(ctx0, mass, inp->head_w);                 // [n_kv, 1]
    mh = ggml_reshape_1d(ctx0, mh, n_kv);
    llama_kvp_obs_accumulate(ctx0, gf, L, n_kv, cells.keep, mh, vn());
}

//
// results used by the per-layer memory
//

void llama_kvp_sync(llama_kvp_context * st) {
    if (st->lctx) {
        const int64_t t0 = ggml_time_us();
        ggml_backend_sched_synchronize(st->lctx->get_sched());
        st->t_sync_us += ggml_time_us() - t0;
    }
}

llama_kvp_perf_scope::llama_kvp_perf_scope(llama_kvp_context * st, double llama_kvp_perf_data::* part) :
        st(st), part(part), t0(st ? ggml_time_us() : 0) {
    if (st) {
        wait0 = st->t_sync_us;
        st->perf_depth++;
    }
}

llama_kvp_perf_scope::~llama_kvp_perf_scope() {
    if (!st) {
        return;
    }
    const int64_t wait = st->t_sync_us - wait0;
    st->perf.*part += 1e-3*(double) (ggml_time_us() - t0 - wait);
    if (--st->perf_depth == 0) {
        st->perf.t_wait_ms += 1e-3*(double) wait;
    }
}

bool llama_kvp_obs_take_prompt_entropy(llama_kvp_context * st, float * out) {
    if (!st->observing() || st->n_obs_prompt <= st->n_obs_folded) {
        return false;
    }
    llama_kvp_sync(st);
    std::vector<float> e(st->n_head);
    for (size_t l = 0; l < st->layers.size(); ++l) {
        ggml_backend_tensor_get(st->layers[l].entropy, e.data(), 0, e.size()*sizeof(float));
        double m = 0.0;
        for (float x : e) {
            m += x;
        }
        st->ent_sum[l] += m/st->n_head;
    }
    st->n_ent++;
    st->n_obs_folded = st->n_obs_prompt;
    for (size_t l = 0; l < st->layers.size(); ++l) {
        out[l] = (float) (st->ent_sum[l]/st->n_ent);
    }
    return true;
}

void llama_kvp_obs_prefetch(llama_kvp_context * st, const std::vector<int32_t> & ikvs, int32_t n_rows, bool rows) {
    if (!st->observing()) {
        return;
    }
    llama_kvp_gather g;
    for (int32_t ikv : ikvs) {
        auto & L = st->layers[ikv];
        if (L.n_kv_obs <= 0 || !L.mass_acc->buffer || ggml_backend_buffer_is_host(L.mass_acc->buffer)) {
            continue;
        }
        // the spans the readers read: from the first row's start to the last row's n_kv_obs-th cell
        L.pre_acc.resize((size_t) (n_rows - 1)*L.n_cells + L.n_kv_obs);
        g.add_f32(L.mass_acc, 0, L.pre_acc.size(), L.pre_acc.data());
        if (rows && L.mass_rows) {
            const size_t row_stride = L.mass_rows->nb[1]/sizeof(float);
            L.pre_rows.resize((size_t) (st->policy.window - 1)*row_stride + L.n_kv_obs);
            g.add_f32(L.mass_rows, 0, L.pre_rows.size(), L.pre_rows.data());
        }
    }
    g.run(st);
}

void llama_kvp_obs_prefetch_clear(llama_kvp_context * st) {
    for (auto & L : st->layers) {
        L.pre_acc  = {}; // not held between passes (~130 KB a layer with decode rows)
        L.pre_rows = {};
    }
}

void llama_kvp_obs_layer_scores(llama_kvp_context * st, int32_t ikv, std::vector<float> & acc, std::vector<llama_pos> & obs_pos,
                                std::vector<float> * last, std::vector<float> * value) {
    const auto & L = st->layers[ikv];
    acc.assign(L.n_cells, 0.0f);
    obs_pos.assign(L.n_cells, -2);
    std::vector<float> * rows[3] = { &acc, last, value };
    for (auto * r : rows) {
        if (r) {
            r->assign(L.n_cells, 0.0f);
        }
    }
    if (!st->observing() || L.n_kv_obs <= 0) {
        return;
    }
    llama_kvp_sync(st);
    // the rows asked for, in one read from the first row's start to the last one's n_kv_obs-th cell
    const int32_t n_rows = value ? 3 : last ? 2 : 1;
    const size_t  n_buf  = (size_t) (n_rows - 1)*L.n_cells + L.n_kv_obs;
    std::vector<float> buf;
    if (L.pre_acc.size() >= n_buf) { // read by llama_kvp_obs_prefetch
        buf.assign(L.pre_acc.begin(), L.pre_acc.begin() + n_buf);
    } else {
        buf.resize(n_buf);
        ggml_backend_tensor_get(L.mass_acc, buf.data(), 0, buf.size()*sizeof(float));
    }
    for (int32_t r = 0; r < n_rows; ++r) {
        if (rows[r]) {
            std::copy_n(buf.begin() + (size_t) r*L.n_cells, L.n_kv_obs, rows[r]->begin());
        }
    }
    for (int32_t j = 0; j < L.n_kv_obs; ++j) {
        obs_pos[j] = L.cell_pos_obs[j];
    }
}

int32_t llama_kvp_obs_layer_mass(llama_kvp_context * st, int32_t ikv, std::vector<float> & mass, std::vector<llama_pos> & obs_pos) {
    const auto & L = st->layers[ikv];
    const int32_t n_kv = st->observing() ? L.n_kv_obs : 0;
    mass.assign(n_kv, 0.0f);
    obs_pos.assign(n_kv, -2);
    if (n_kv <= 0) {
        return 0;
    }
    llama_kvp_sync(st);
    // every head's row in one read (one transfer where the mass lives in device memory)
    const size_t row_stride = L.mass->nb[1]/sizeof(float);
    std::vector<float> rows((size_t) (st->n_head - 1)*row_stride + n_kv);
    ggml_backend_tensor_get(L.mass, rows.data(), 0, rows.size()*sizeof(float));
    for (int32_t h = 0; h < st->n_head; ++h) {
        const float * row = rows.data() + (size_t) h*row_stride;
        for (int32_t j = 0; j < n_kv; ++j) {
            mass[j] += row[j];
        }
    }
    for (int32_t j = 0; j < n_kv; ++j) {
        mass[j] /= (float) st->n_head;
        obs_pos[j] = L.cell_pos_obs[j];
    }
    return n_kv;
}

// the query entropies of KV layer ikv from its decode rows (W rows of row_stride floats, read from the device or not);
// touches nothing shared, so layers can run on threads of their own
static void llama_kvp_obs_query_entropy_rows(const llama_kvp_context * st, int32_t ikv, const float * rows, std::vector<float> & ent,
                                             std::vector<llama_pos> & pos) {
    const auto & L = st->layers[ikv];
    const int32_t n_kv = (int32_t) ent.size();
    const int32_t W = st->policy.window;
    const size_t  row_stride = L.mass_rows->nb[1]/sizeof(float);
    // the window's valid queries: the slots holding the last W positions, written since the last reset
    llama_pos p_max = -1;
    for (llama_pos p : st->slot_pos) {
        p_max = std::max(p_max, p);
    }
    std::vector<int32_t> slots;
    for (int32_t s = 0; s < W; ++s) {
        if (llama_kvp_slot_valid(st->slot_pos[s], p_max, W) && L.row_step[s] >= 0) {
            slots.push_back(s);
        }
    }
    const llama_kv_cache * kv = st->layer_kv(ikv);
    llama_kvp_kv_access::cell_positions(*kv, (uint32_t) std::min<int64_t>(n_kv, kv->get_size()), pos.data());
    std::vector<float> p(W);
    for (int32_t j = 0; j < n_kv; ++j) {
        const llama_pos pj = pos[j];
        if (pj < 0 || j >= (int32_t) L.cell_pos_row.size() || L.cell_pos_row[j] != pj) {
            continue;
        }
        // the queries at or after the token that wrote their row while its cell held it
        int32_t n   = 0;
        double  sum = 0.0;
        for (int32_t s : slots) {
            if (st->slot_pos[s] < pj || L.row_step[s] < L.cell_step[j]) {
                continue;
            }
            const float x = rows[(size_t) s*row_stride + j];
            p[n] = x > 0.0f && std::isfinite(x) ? x : 0.0f;
            sum += p[n];
            n++;
        }
        if (n < 2 || !(sum > 0.0)) {
            continue;
        }
        // H = log(sum) - sum_i x_i log(x_i) / sum
        double xlx = 0.0;
        for (int32_t i = 0; i < n; ++i) {
            if (p[i] > 0.0f) {
                xlx += (double) p[i]*std::log(p[i]);
            }
        }
        const double h = std::log(sum) - xlx/sum;
        ent[j] = (float) std::min(1.0, std::max(0.0, h/std::log((double) n)));
    }
}

// the decode rows of KV layer ikv as the host sees them: the prefetched copy, the tensor itself in host memory, or a
// read into buf; nullptr where the layer keeps none (synchronize first)
static const float * llama_kvp_obs_rows_host(llama_kvp_context * st, int32_t ikv, int32_t n_kv, std::vector<float> & buf) {
    const auto & L = st->layers[ikv];
    const size_t row_stride = L.mass_rows->nb[1]/sizeof(float);
    const size_t n_rows = (size_t) (st->policy.window - 1)*row_stride + n_kv;
    if (L.pre_rows.size() == n_rows) { // read by llama_kvp_obs_prefetch
        return L.pre_rows.data();
    }
    if (L.mass_rows->buffer && ggml_backend_buffer_is_host(L.mass_rows->buffer) && L.mass_rows->data) {
        return (const float *) L.mass_rows->data;
    }
    buf.resize(n_rows);
    ggml_backend_tensor_get(L.mass_rows, buf.data(), 0, buf.size()*sizeof(float));
    return buf.data();
}

static int32_t llama_kvp_obs_query_entropy_n_kv(const llama_kvp_context * st, int32_t ikv) {
    const auto & L = st->layers[ikv];
    return st->observing() && L.mass_rows ? std::max(L.n_kv_obs, 0) : 0;
}

int32_t llama_kvp_obs_layer_query_entropy(llama_kvp_context * st, int32_t ikv, std::vector<float> & ent, std::vector<llama_pos> & pos) {
    const int32_t n_kv = llama_kvp_obs_query_entropy_n_kv(st, ikv);
    ent.assign(n_kv, -1.0f);
    pos.assign(n_kv, -1);
    if (n_kv <= 0) {
        return 0;
    }
    llama_kvp_sync(st);
    std::vector<float> buf;
    llama_kvp_obs_query_entropy_rows(st, ikv, llama_kvp_obs_rows_host(st, ikv, n_kv, buf), ent, pos);
    return n_kv;
}

int32_t llama_kvp_obs_layer_query_entropy_at_obs(llama_kvp_context * st, int32_t ikv, const std::vector<float> ** ent,
                                                 const std::vector<llama_pos> ** pos) {
    auto & L = st->layers[ikv];
    llama_kvp_obs_query_entropy_layers(st, { ikv }, 1); // computes it only if not yet for this observation
    *ent = &L.q_ent;
    *pos = &L.q_ent_pos;
    return (int32_t) L.q_ent.size();
}

void llama_kvp_obs_query_entropy_layers(llama_kvp_context * st, const std::vector<int32_t> & ikvs, int32_t n_threads) {
    std::vector<int32_t>            todo;
    std::vector<const float *>      rows;
    std::vector<std::vector<float>> bufs;
    bufs.reserve(ikvs.size());
    bool synced = false; // the graphs waited for once, and only where some layer is computed
    for (int32_t ikv : ikvs) {
        auto & L = st->layers[ikv];
        if (L.q_ent_obs == st->n_obs) {
            continue;
        }
        if (!synced) {
            llama_kvp_sync(st);
            synced = true;
        }
        const int32_t n_kv = llama_kvp_obs_query_entropy_n_kv(st, ikv);
        L.q_ent.assign(n_kv, -1.0f);
        L.q_ent_pos.assign(n_kv, -1);
        L.q_ent_obs = st->n_obs;
        if (n_kv > 0) {
            // the reads stay on this thread (a device's transfers), the sums go to the threads
            bufs.emplace_back();
            rows.push_back(llama_kvp_obs_rows_host(st, ikv, n_kv, bufs.back()));
            todo.push_back(ikv);
        }
    }
    llama_kvp_run_tasks((int32_t) todo.size(), n_threads, [&](int32_t t, int32_t) {
        auto & L = st->layers[todo[t]];
        llama_kvp_obs_query_entropy_rows(st, todo[t], rows[t], L.q_ent, L.q_ent_pos);
    });
}

void llama_kvp_obs_layer_resize(llama_kvp_context * st, int32_t ikv, uint32_t n_cells, const std::vector<int32_t> & remap) {
    auto & L = st->layers[ikv];
    if (!st->observing()) {
        L.n_cells = (int32_t) n_cells;
        llama_kvp_update_n_cells(st);
        return;
    }
    llama_kvp_sync(st);

    // keep the query ring, the entropy and the scores of the moved cells
    std::vector<float> ring(ggml_nelements(L.q_ring));
    std::vector<float> ent(ggml_nelements(L.entropy));
    std::vector<float> acc(3*(size_t) L.n_cells); // every row: the decayed sum, the last observation, the value norm
    ggml_backend_tensor_get(L.q_ring,   ring.data(), 0, ring.size()*sizeof(float));
    ggml_backend_tensor_get(L.entropy,  ent.data(),  0, ent.size()*sizeof(float));
    ggml_backend_tensor_get(L.mass_acc, acc.data(),  0, acc.size()*sizeof(float));
    const std::vector<llama_pos> old_pos = L.cell_pos_obs;
    const int32_t old_n_kv = L.n_kv_obs;

    // the decode-step rows follow their cells
    const int32_t old_n_cells = L.n_cells;
    std::vector<float> rows(L.mass_rows ? ggml_nelements(L.mass_rows) : 0);
    if (L.mass_rows) {
        ggml_backend_tensor_get(L.mass_rows, rows.data(), 0, rows.size()*sizeof(float));
    }
    const std::vector<int32_t>   old_row_step     = L.row_step;
    const std::vector<int32_t>   old_cell_step    = L.cell_step;
    const std::vector<llama_pos> old_cell_pos_row = L.cell_pos_row;

    llama_kvp_obs_alloc(st, ikv, (int32_t) n_cells);

    if (L.mass_rows && !rows.empty()) {
        const int32_t W = st->policy.window;
        std::vector<float> rows_new((size_t) n_cells*W, 0.0f);
        for (uint32_t j = 0; j < n_cells && j < remap.size(); ++j) {
            const int32_t o = remap[j];
            if (o < 0 || o >= old_n_cells) {
                continue;
            }
            for (int32_t r = 0; r < W; ++r) {
                rows_new[(size_t) r*n_cells + j] = rows[(size_t) r*old_n_cells + o];
            }
            L.cell_step[j]    = old_cell_step[o];
            L.cell_pos_row[j] = old_cell_pos_row[o];
        }
        L.row_step  = old_row_step;
        L.q_ent_obs = -1;
        ggml_backend_tensor_set(L.mass_rows, rows_new.data(), 0, rows_new.size()*sizeof(float));
    }

    std::vector<float> acc_new(3*(size_t) n_cells, 0.0f);
    int32_t n_kv_new = 0;
    for (uint32_t j = 0; j < n_cells && j < remap.size(); ++j) {
        const int32_t o = remap[j];
        if (o >= 0 && o < old_n_kv) {
            for (size_t r = 0; r < 3; ++r) {
                acc_new[r*n_cells + j] = acc[r*old_n_cells + o];
            }
            L.cell_pos_obs[j] = old_pos[o];
            n_kv_new = (int32_t) j + 1;
        }
    }
    L.n_kv_obs = n_kv_new;
    ggml_backend_tensor_set(L.q_ring,   ring.data(),    0, ring.size()*sizeof(float));
    ggml_backend_tensor_set(L.entropy,  ent.data(),     0, ent.size()*sizeof(float));
    ggml_backend_tensor_set(L.mass_acc, acc_new.data(), 0, acc_new.size()*sizeof(float));
    llama_kvp_update_n_cells(st);
}

static constexpr uint32_t LLAMA_KVP_PREFILL_STATE_MAGIC = 0x5050564bu; // "KVPP"

// does the context's prefill state go into the context's state beside llama.cpp's own cache
static bool llama_kvp_prefill_state_saved(const llama_kvp_context * st, const llama_memory_i * memory) {
    if (!st || dynamic_cast<const llama_kvp_memory *>(memory)) {
        return false;
    }
    for (const auto & L : st->layers) {
        if (L.prefill_state) {
            return true;
        }
    }
    return false;
}

void llama_kvp_context_state_write(const llama_kvp_context * st, const llama_memory_i * memory, llama_io_write_i & io) {
    if (!llama_kvp_prefill_state_saved(st, memory)) {
        return;
    }
    const auto * prefill = llama_kvp_prefill_of(st->policy);
    const uint32_t hdr[2] = { LLAMA_KVP_PREFILL_STATE_MAGIC, (uint32_t) st->layers.size() };
    io.write(hdr, sizeof(hdr));
    // the whole policy: a state decided under other keys (another base, segment, block) is refused
    const std::string spec = llama_kvp_policy_str(st->policy);
    llama_kvp_memory::state_write_blob(io, std::vector<uint8_t>(spec.begin(), spec.end()));
    std::vector<uint8_t> blob;
    for (size_t i = 0; i < st->layers.size(); ++i) {
        blob.clear();
        prefill->state_write(st, (int32_t) i, blob);
        llama_kvp_memory::state_write_blob(io, blob);
    }
}

void llama_kvp_context_state_read(llama_kvp_context * st, const llama_memory_i * memory, llama_io_read_i & io) {
    if (!llama_kvp_prefill_state_saved(st, memory)) {
        return;
    }
    try {
        const auto * prefill = llama_kvp_prefill_of(st->policy);
        uint32_t hdr[2] = {};
        try {
            io.read(hdr, sizeof(hdr));
        } catch (const std::exception &) { // llama.cpp's cache ended the state: "unexpectedly reached end of buffer"
            hdr[0] = 0;
        }
        if (hdr[0] != LLAMA_KVP_PREFILL_STATE_MAGIC || hdr[1] != (uint32_t) st->layers.size()) {
            throw std::runtime_error("pykvcache: this state holds no sparse prefill state for this context's " +
                    std::to_string(st->layers.size()) + " layers (saved by a context without +sparse?)");
        }
        const std::vector<uint8_t> saved = llama_kvp_memory::state_read_blob(io, "policy");
        const std::string spec = llama_kvp_policy_str(st->policy);
        if (std::string(saved.begin(), saved.end()) != spec) {
            throw std::runtime_error("pykvcache: this state was saved with the policy '" +
                    std::string(saved.begin(), saved.end()) + "', this context has '" + spec + "'");
        }
        for (size_t i = 0; i < st->layers.size(); ++i) {
            prefill->state_read(st, (int32_t) i, llama_kvp_memory::state_read_blob(io, "prefill-stage data"));
        }
    } catch (const std::exception & e) {
        llama_kvp_set_error(e.what()); // llama.cpp logs it and returns 0: the caller's error names it
        throw;
    }
}

void llama_kvp_obs_state_write(const llama_kvp_context * st, std::vector<uint8_t> & out) {
    const int32_t n[12] = { st->n_ent, st->n_obs_prompt, st->n_obs_folded, st->n_decode, st->n_obs, st->n_kv_obs,
                            st->n_queries_obs, st->n_steps, st->n_obs_heads, st->n_obs_ent, st->pos_obs, st->pos_ent };
    llama_kvp_state_put(out, n, sizeof(n));
    llama_kvp_state_put_vec(out, st->slot_pos);
    llama_kvp_state_put_vec(out, st->ent_sum);
}

void llama_kvp_obs_state_read(llama_kvp_context * st, const std::vector<uint8_t> & in, size_t & off) {
    const char * what = "observation state";
    int32_t n[12] = {};
    llama_kvp_state_get(in, off, n, sizeof(n), what);
    std::vector<llama_pos> slot_pos;
    std::vector<double>    ent_sum;
    llama_kvp_state_get_vec(in, off, slot_pos, what);
    llama_kvp_state_get_vec(in, off, ent_sum, what);
    if (slot_pos.size() != st->slot_pos.size() || ent_sum.size() != st->ent_sum.size()) {
        throw std::runtime_error("pykvcache: the observation state was saved with another window or layer count");
    }
    st->n_ent         = n[0];
    st->n_obs_prompt  = n[1];
    st->n_obs_folded  = n[2];
    st->n_decode      = n[3];
    st->n_obs         = n[4];
    st->n_kv_obs      = n[5];
    st->n_queries_obs = n[6];
    st->n_steps       = n[7];
    st->n_obs_heads   = n[8];
    st->n_obs_ent     = n[9];
    st->pos_obs       = n[10];
    st->pos_ent       = n[11];
    st->obs_requested = false;
    st->slot_pos      = std::move(slot_pos);
    st->ent_sum       = std::move(ent_sum);
}

// the layer's observation tensors, in the order they are saved (mass_rows: nullptr without decode rows)
static std::vector<ggml_tensor *> llama_kvp_obs_layer_tensors(const llama_kvp_obs_layer & L) {
    return { L.q_ring, L.mass, L.mass_acc, L.entropy, L.mass_rows };
}

void llama_kvp_obs_layer_state_write(llama_kvp_context * st, int32_t ikv, std::vector<uint8_t> & out) {
    const auto & L = st->layers[ikv];
    llama_kvp_sync(st);
    const int32_t hdr[4] = { L.n_cells, L.n_kv_obs, L.q_ent_obs, L.mass_rows ? 1 : 0 };
    llama_kvp_state_put(out, hdr, sizeof(hdr));
    for (ggml_tensor * t : llama_kvp_obs_layer_tensors(L)) {
        if (t) {
            const size_t o = out.size();
            out.resize(o + ggml_nbytes(t));
            ggml_backend_tensor_get(t, out.data() + o, 0, ggml_nbytes(t));
        }
    }
    llama_kvp_state_put_vec(out, L.cell_pos_obs);
    llama_kvp_state_put_vec(out, L.row_step);
    llama_kvp_state_put_vec(out, L.cell_step);
    llama_kvp_state_put_vec(out, L.cell_pos_row);
    llama_kvp_state_put_vec(out, L.q_ent);
    llama_kvp_state_put_vec(out, L.q_ent_pos);
}

void llama_kvp_obs_layer_state_read(llama_kvp_context * st, int32_t ikv, const std::vector<uint8_t> & in, size_t & off) {
    const char * what = "layer observation";
    auto & L = st->layers[ikv];
    int32_t hdr[4] = {};
    llama_kvp_state_get(in, off, hdr, sizeof(hdr), what);
    if (hdr[0] != L.n_cells || hdr[3] != (L.mass_rows ? 1 : 0)) {
        throw std::runtime_error("pykvcache: the observation of layer " + std::to_string(ikv) + " was saved for " +
                std::to_string(hdr[0]) + " cells, this context's layer has " + std::to_string(L.n_cells));
    }
    llama_kvp_sync(st);
    std::vector<uint8_t> buf;
    for (ggml_tensor * t : llama_kvp_obs_layer_tensors(L)) {
        if (t) {
            buf.resize(ggml_nbytes(t));
            llama_kvp_state_get(in, off, buf.data(), buf.size(), what);
            ggml_backend_tensor_set(t, buf.data(), 0, buf.size());
        }
    }
    llama_kvp_state_get_vec(in, off, L.cell_pos_obs, what);
    llama_kvp_state_get_vec(in, off, L.row_step, what);
    llama_kvp_state_get_vec(in, off, L.cell_step, what);
    llama_kvp_state_get_vec(in, off, L.cell_pos_row, what);
    llama_kvp_state_get_vec(in, off, L.q_ent, what);
    llama_kvp_state_get_vec(in, off, L.q_ent_pos, what);
    if (L.cell_pos_obs.size() != (size_t) L.n_cells || L.q_ent.size() != L.q_ent_pos.size() ||
        L.cell_step.size() != L.cell_pos_row.size() || hdr[1] < 0 || hdr[1] > L.n_cells) {
        throw std::runtime_error("pykvcache: corrupt layer observation in the state");
    }
    L.n_kv_obs  = hdr[1];
    L.q_ent_obs = hdr[2];
}

void llama_kvp_obs_seq_swap(llama_kvp_context * st, llama_kvp_obs_seq & o) {
    std::swap(st->layers,        o.layers);
    std::swap(st->slot_pos,      o.slot_pos);
    std::swap(st->ent_sum,       o.ent_sum);
    std::swap(st->n_cells,       o.n_cells);
    std::swap(st->n_ent,         o.n_ent);
    std::swap(st->n_obs_prompt,  o.n_obs_prompt);
    std::swap(st->n_obs_folded,  o.n_obs_folded);
    std::swap(st->n_decode,      o.n_decode);
    std::swap(st->n_obs,         o.n_obs);
    std::swap(st->n_kv_obs,      o.n_kv_obs);
    std::swap(st->n_queries_obs, o.n_queries_obs);
    std::swap(st->n_obs_heads,   o.n_obs_heads);
    std::swap(st->n_obs_ent,     o.n_obs_ent);
    std::swap(st->pos_obs,       o.pos_obs);
    std::swap(st->pos_ent,       o.pos_ent);
}

void llama_kvp_obs_reset(llama_kvp_context * st) {
    std::fill(st->ent_sum.begin(), st->ent_sum.end(), 0.0);
    st->n_ent         = 0;
    st->n_obs_folded  = st->n_obs_prompt;
    st->n_decode      = 0; // the `every` schedule counts from the prompt, as in a new context
    st->obs_requested = false;
    for (auto & L : st->layers) {
        std::fill(L.cell_pos_obs.begin(), L.cell_pos_obs.end(), -2);
        L.n_kv_obs  = 0;
        L.q_ent_obs = -1;
    }
}

int32_t llama_kvp_obs_layer_queries(llama_kvp_context * st, int32_t ikv, std::vector<float> & q, std::vector<llama_pos> * qpos) {
    const auto & L = st->layers[ikv];
    q.clear();
    if (qpos) {
        qpos->clear();
    }
    if (!st->observing() || !L.q_ring) {
        return 0;
    }
    llama_kvp_sync(st);
    const int64_t row = L.q_ring->ne[0];
    // the whole ring in one read (one transfer where it lives in device memory), then its filled slots
    std::vector<float> ring((size_t) row*L.q_ring->ne[1]);
    ggml_backend_tensor_get(L.q_ring, ring.data(), 0, ring.size()*sizeof(float));
    int32_t n = 0;
    for (int32_t s = 0; s < (int32_t) st->slot_pos.size(); ++s) {
        if (st->slot_pos[s] < 0) {
            continue;
        }
        q.resize((size_t) (n + 1)*row);
        std::copy_n(ring.data() + (size_t) s*row, row, q.data() + (size_t) n*row);
        if (qpos) {
            qpos->push_back(st->slot_pos[s]);
        }
        n++;
    }
    return n;
}

void llama_kvp_obs_cells_set_score(llama_kvp_context * st, int32_t ikv, const uint32_t * idx, const llama_pos * pos,
                                   const float * score, size_t n, const float * last, const float * value) {
    auto & L = st->layers[ikv];
    if (!st->observing() || !L.mass_acc) {
        return;
    }
    uint32_t lo = UINT32_MAX;
    uint32_t hi = 0;
    for (size_t i = 0; i < n; ++i) {
        if ((int32_t) idx[i] < L.n_cells) {
            lo = std::min(lo, idx[i]);
            hi = std::max(hi, idx[i]);
        }
    }
    if (lo > hi) {
        return;
    }
    // the rows a policy reads: the last observation where it is given or a score stage ranks by it (`fresh`), the
    // value norm where a score stage weights by it (`vnorm`); all of them in one read and one write of the span from
    // the first row's cell lo to the last row's cell hi (transfers where the scores live in device memory)
    const llama_kvp_score_stage * stage = llama_kvp_score_of(st->policy);
    const bool    row_last  = last || (stage && stage->uses_last(st->policy));
    const bool    row_value = stage && stage->uses_values(st->policy);
    const int32_t n_rows    = row_value ? 3 : row_last ? 2 : 1;
    const size_t  nc        = (size_t) L.n_cells;
    llama_kvp_sync(st);
    std::vector<float> span((n_rows - 1)*nc + hi - lo + 1);
    ggml_backend_tensor_get(L.mass_acc, span.data(), (size_t) lo*sizeof(float), span.size()*sizeof(float));
    for (size_t i = 0; i < n; ++i) {
        if ((int32_t) idx[i] >= L.n_cells) {
            continue;
        }
        const size_t j = idx[i] - lo;
        span[j] = score[i];
        if (row_last) {
            span[nc + j] = last ? last[i] : score[i];
        }
        if (row_value) {
            span[2*nc + j] = value ? value[i] : NAN;
        }
        L.cell_pos_obs[idx[i]] = pos[i];
        L.n_kv_obs = std::max<int32_t>(L.n_kv_obs, (int32_t) idx[i] + 1);
    }
    ggml_backend_tensor_set(L.mass_acc, span.data(), (size_t) lo*sizeof(float), span.size()*sizeof(float));
}

bool llama_kvp_reads_logits(const llama_kvp_context * st, const llama_ubatch & ubatch, uint32_t i) {
    if (st && st->mem && st->mem->guiding) {
        return false; // a guided chunk never holds the prompt's last token (with logits_all its logits are kept, not read)
    }
    if (st && st->prompt_end >= 0) {
        return ubatch.pos[i] == st->prompt_end;
    }
    return ubatch.output && ubatch.output[i];
}

void llama_kvp_obs_layer_forget(llama_kvp_context * st, int32_t ikv, llama_pos p0, llama_pos p1) {
    auto & L = st->layers[ikv];
    if (p0 < 0) {
        p0 = 0;
    }
    if (p1 < 0) {
        p1 = std::numeric_limits<llama_pos>::max();
    }
    for (auto & p : L.cell_pos_obs) {
        if (p >= p0 && p < p1) {
            p = -2;
        }
    }
}
