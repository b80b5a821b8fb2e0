// llama-kvp.cpp - the extern "C" API of llama-kvp.h: policy of a context, KV-cache stats from the real ggml buffers,
// and read-out of the observation results. A stage's own API (sparse prefill's telemetry, the summaries, the host
// tier, the recovery ladder, latent re-ranking) sits at the end of its file in stages/.

#include "llama-kvp-impl.h"

#include "llama-context.h"
#include "llama-kv-cache.h"
#include "llama-kv-cache-iswa.h"
#include "llama-kvp-memory.h"

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

// the KV caches of a context: one for a plain cache, two (base, swa) for an iSWA cache, one per layer for the
// per-layer memory of a retention policy
static std::vector<llama_kv_cache *> llama_kvp_caches(llama_context * ctx) {
    std::vector<llama_kv_cache *> res;
    llama_memory_i * mem = ctx->get_memory();
    if (auto * kv = dynamic_cast<llama_kv_cache *>(mem)) {
        res.push_back(kv);
    } else if (auto * iswa = dynamic_cast<llama_kv_cache_iswa *>(mem)) {
        res.push_back(iswa->get_base());
        res.push_back(iswa->get_swa());
    } else if (auto * pmem = dynamic_cast<llama_kvp_memory *>(mem)) {
        for (auto & L : pmem->layers) {
            res.push_back(L.kv.get());
        }
    }
    return res;
}

llama_kvp_memory * llama_kvp_mem(llama_context * ctx) {
    auto * mem = dynamic_cast<llama_kvp_memory *>(ctx->get_memory());
    if (!mem) {
        llama_kvp_set_error("this context has no retention policy (one KV cache per layer)");
    }
    return mem;
}

bool llama_kvp_check_ctx(llama_context * ctx) {
    if (!ctx) {
        llama_kvp_set_error("context is NULL");
        return false;
    }
    return true;
}

bool llama_kvp_check_out(const void * out) {
    if (!out) {
        llama_kvp_set_error("output is NULL");
        return false;
    }
    return true;
}

bool llama_kvp_check_layer(const llama_kvp_memory * mem, int32_t ikv) {
    if (ikv < 0 || ikv >= (int32_t) mem->layers.size()) {
        llama_kvp_set_error("KV layer " + std::to_string(ikv) + " out of range [0, " + std::to_string(mem->layers.size()) + ")");
        return false;
    }
    return true;
}

llama_kvp_memory * llama_kvp_mem_with_fate(llama_context * ctx, int32_t fate, const char * err) {
    if (!llama_kvp_check_ctx(ctx)) {
        return nullptr;
    }
    llama_kvp_memory * mem = llama_kvp_mem(ctx);
    if (!mem || mem->policy.stage[LLAMA_KVP_SLOT_FATE] != fate) {
        llama_kvp_set_error(err);
        return nullptr;
    }
    return mem;
}

static llama_kvp_context * llama_kvp_obs_ctx(llama_context * ctx) {
    if (!llama_kvp_check_ctx(ctx)) {
        return nullptr;
    }
    llama_kvp_context * st = ctx->get_kvp();
    if (!st || !st->observing()) {
        llama_kvp_set_error("this context has no observing policy (create it with kv_policy=Observe(...))");
        return nullptr;
    }
    return st;
}

int32_t llama_kvp_get_policy(struct llama_context * ctx, struct llama_kvp_policy * out) {
    if (!llama_kvp_check_ctx(ctx) || !llama_kvp_check_out(out)) {
        return -1;
    }
    llama_kvp_context * st = ctx->get_kvp();
    *out = st ? st->policy : llama_kvp_policy_default(LLAMA_KVP_POLICY_NONE);
    return 0;
}

int32_t llama_kvp_n_layers(struct llama_context * ctx) {
    if (!llama_kvp_check_ctx(ctx)) {
        return -1;
    }
    const auto caches = llama_kvp_caches(ctx);
    if (caches.empty()) {
        llama_kvp_set_error("the memory of this context is not a KV cache (recurrent or hybrid model)");
        return -1;
    }
    int32_t n = 0;
    for (auto * kv : caches) {
        n += llama_kvp_kv_access::n_layers(*kv);
    }
    return n;
}

int32_t llama_kvp_get_layer_stats(struct llama_context * ctx, struct llama_kvp_layer_stats * out, int32_t n_max) {
    const int32_t n = llama_kvp_n_layers(ctx);
    if (n < 0) {
        return -1;
    }
    if (!out || n_max < n) {
        llama_kvp_set_error("layer stats buffer too small: need " + std::to_string(n) + " entries");
        return -1;
    }
    int32_t i = 0;
    for (auto * kv : llama_kvp_caches(ctx)) {
        const uint32_t n_used = llama_kvp_kv_access::n_used(*kv);
        for (int32_t ikv = 0; ikv < llama_kvp_kv_access::n_layers(*kv); ++ikv) {
            ggml_tensor * k = llama_kvp_kv_access::layer_k(*kv, ikv);
            ggml_tensor * v = llama_kvp_kv_access::layer_v(*kv, ikv);
            llama_kvp_layer_stats & s = out[i++];
            s.il        = llama_kvp_kv_access::layer_il(*kv, ikv);
            s.n_cells   = (int32_t) (kv->get_size()*llama_kvp_kv_access::n_stream(*kv)); // every stream, as n_used and the bytes
            s.n_used    = (int32_t) n_used;
            s.k_bytes   = k ? (int64_t) ggml_backend_buffer_get_alloc_size(k->buffer, k) : 0;
            s.v_bytes   = v ? (int64_t) ggml_backend_buffer_get_alloc_size(v->buffer, v) : 0;
            s.on_device = (k && k->buffer && !ggml_backend_buffer_is_host(k->buffer)) ? 1 : 0;
        }
    }
    return n;
}

// positions held by the cells of a single-stream cache (-1: empty)
static int32_t llama_kvp_fill_cell_pos(const llama_kv_cache & kv, int32_t * out, int32_t n_max) {
    const int32_t n = (int32_t) kv.get_size();
    if (!out || n_max < n) {
        llama_kvp_set_error("cell position buffer too small: need " + std::to_string(n) + " entries");
        return -1;
    }
    for (int32_t i = 0; i < n; ++i) {
        out[i] = llama_kvp_kv_access::cell_pos(kv, (uint32_t) i);
    }
    return n;
}

int32_t llama_kvp_cell_pos(struct llama_context * ctx, int32_t * out, int32_t n_max) {
    if (!llama_kvp_check_ctx(ctx)) {
        return -1;
    }
    auto * kv = dynamic_cast<llama_kv_cache *>(ctx->get_memory());
    if (!kv || llama_kvp_kv_access::n_stream(*kv) != 1) {
        llama_kvp_set_error("cell positions need a single-stream unified KV cache");
        return -1;
    }
    return llama_kvp_fill_cell_pos(*kv, out, n_max);
}

int32_t llama_kvp_obs_cell_pos(struct llama_context * ctx, int32_t * out, int32_t n_max) {
    llama_kvp_context * st = llama_kvp_obs_ctx(ctx);
    if (!st) {
        return -1;
    }
    const int32_t need = (int32_t) st->layers.size()*st->n_cells;
    if (!out || n_max < need) {
        llama_kvp_set_error("cell position buffer too small: need " + std::to_string(need) + " entries");
        return -1;
    }
    for (size_t l = 0; l < st->layers.size(); ++l) {
        const auto & L = st->layers[l];
        for (int32_t j = 0; j < st->n_cells; ++j) {
            const llama_pos p = j < L.n_kv_obs ? L.cell_pos_obs[j] : -1;
            out[l*st->n_cells + j] = p < 0 ? -1 : p;
        }
    }
    return need;
}

int32_t llama_kvp_obs_info(struct llama_context * ctx, struct llama_kvp_obs_info * out) {
    llama_kvp_context * st = llama_kvp_obs_ctx(ctx);
    if (!st || !llama_kvp_check_out(out)) {
        return -1;
    }
    ctx->synchronize();
    out->n_layer   = (int32_t) st->layers.size();
    out->n_head    = st->n_head;
    out->n_head_kv = st->n_head_kv;
    out->n_cells   = st->n_cells;
    out->n_kv      = st->n_kv_obs;
    out->window    = st->policy.window;
    out->n_queries = st->n_queries_obs;
    out->n_obs     = st->n_obs;
    out->n_steps   = st->n_steps;
    out->n_obs_heads   = st->n_obs_heads;
    out->n_obs_entropy = st->n_obs_ent;
    out->pos_last      = st->pos_obs;
    out->pos_entropy   = st->pos_ent;
    return 0;
}

// copies one result tensor of every layer into out (layer-major), zeroing the cells past the last observation
static int32_t llama_kvp_obs_read(
        llama_context * ctx, llama_kvp_context * st, float * out, int32_t n_max, ggml_tensor * llama_kvp_obs_layer::* member,
        int64_t per_layer, int64_t n_rows, int64_t row_len, bool by_cell, int64_t row0 = 0) {
    const size_t need = st->layers.size()*(size_t) per_layer;
    if (!out || n_max < 0 || (size_t) n_max < need) {
        llama_kvp_set_error("output buffer too small: need " + std::to_string(need) + " floats");
        return -1;
    }
    ctx->synchronize();
    for (size_t l = 0; l < st->layers.size(); ++l) {
        const int64_t n_valid = by_cell ? std::min<int64_t>(st->layers[l].n_kv_obs, row_len) : row_len;
        ggml_tensor * t = st->layers[l].*member;
        float * dst = out + l*per_layer;
        for (int64_t r = 0; r < n_rows; ++r) {
            float * row = dst + r*row_len;
            if (n_valid > 0) {
                ggml_backend_tensor_get(t, row, (row0 + r)*t->nb[1], n_valid*sizeof(float));
            }
            for (int64_t j = n_valid; j < row_len; ++j) {
                row[j] = 0.0f;
            }
        }
    }
    return (int32_t) need;
}

int32_t llama_kvp_obs_entropy(struct llama_context * ctx, float * out, int32_t n_max) {
    llama_kvp_context * st = llama_kvp_obs_ctx(ctx);
    if (!st) {
        return -1;
    }
    return llama_kvp_obs_read(ctx, st, out, n_max, &llama_kvp_obs_layer::entropy, st->n_head, 1, st->n_head, false);
}

int32_t llama_kvp_obs_mass(struct llama_context * ctx, float * out, int32_t n_max) {
    llama_kvp_context * st = llama_kvp_obs_ctx(ctx);
    if (!st) {
        return -1;
    }
    return llama_kvp_obs_read(ctx, st, out, n_max, &llama_kvp_obs_layer::mass, (int64_t) st->n_head*st->n_cells, st->n_head, st->n_cells, true);
}

int32_t llama_kvp_obs_mass_last(struct llama_context * ctx, float * out, int32_t n_max) {
    llama_kvp_context * st = llama_kvp_obs_ctx(ctx);
    if (!st) {
        return -1;
    }
    // the second of mass_acc's rows
    return llama_kvp_obs_read(ctx, st, out, n_max, &llama_kvp_obs_layer::mass_acc, st->n_cells, 1, st->n_cells, true, 1);
}

int32_t llama_kvp_obs_mass_acc(struct llama_context * ctx, float * out, int32_t n_max) {
    llama_kvp_context * st = llama_kvp_obs_ctx(ctx);
    if (!st) {
        return -1;
    }
    return llama_kvp_obs_read(ctx, st, out, n_max, &llama_kvp_obs_layer::mass_acc, st->n_cells, 1, st->n_cells, true);
}

int32_t llama_kvp_obs_request(struct llama_context * ctx) {
    llama_kvp_context * st = llama_kvp_obs_ctx(ctx);
    if (!st) {
        return -1;
    }
    st->obs_requested = true;
    return 0;
}

//
// retention policies
//

int32_t llama_kvp_set_prompt_len(struct llama_context * ctx, int32_t n_prompt) {
    if (!llama_kvp_check_ctx(ctx)) {
        return -1;
    }
    llama_kvp_memory * mem = llama_kvp_mem(ctx);
    if (!mem) {
        return -1;
    }
    if (n_prompt < 0) {
        llama_kvp_set_error("prompt length must be >= 0");
        return -1;
    }
    ctx->synchronize();
    if (!mem->set_prompt_len(n_prompt)) {
        llama_kvp_set_error("the prompt length can only be set while the cache is empty");
        return -1;
    }
    return 0;
}

int32_t llama_kvp_prompt_reuse(struct llama_context * ctx, int32_t n_prompt, int32_t n_want) {
    if (!llama_kvp_check_ctx(ctx)) {
        return -1;
    }
    llama_kvp_memory * mem = llama_kvp_mem(ctx);
    if (!mem) {
        return -1;
    }
    if (n_prompt < 0 || n_want < 0) {
        llama_kvp_set_error("prompt_reuse: need n_prompt >= 0 and n_want >= 0");
        return -1;
    }
    ctx->synchronize();
    return mem->reuse_prefix(n_prompt, n_want);
}

int32_t llama_kvp_prefill_guided(struct llama_context * ctx, const int32_t * tokens, int32_t n_tokens, int32_t pos0) {
    return llama_kvp_prefill_guided_logits(ctx, tokens, n_tokens, pos0, nullptr);
}

int32_t llama_kvp_prefill_guided_logits(struct llama_context * ctx, const int32_t * tokens, int32_t n_tokens, int32_t pos0,
                                        float * logits) {
    int32_t i0 = 0;
    while (true) {
        const int32_t next = llama_kvp_prefill_guided_next(ctx, tokens, n_tokens, pos0, i0, logits);
        if (next < 0 || next == i0) {
            return next; // -1: an error; else k, where the guided chunks end (0: nothing to guide)
        }
        i0 = next;
    }
}

int32_t llama_kvp_prefill_guided_next(struct llama_context * ctx, const int32_t * tokens, int32_t n_tokens, int32_t pos0,
                                      int32_t i0, float * logits) {
    if (!llama_kvp_check_ctx(ctx)) {
        return -1;
    }
    llama_kvp_memory * mem = llama_kvp_mem(ctx);
    if (!mem) {
        return -1;
    }
    if (!tokens || n_tokens < 0 || pos0 < 0 || i0 < 0) {
        llama_kvp_set_error("prefill_guided: need a token array, n_tokens >= 0, pos0 >= 0 and i0 >= 0");
        return -1;
    }
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
    if (i0 == 0) {
        for (int32_t i = 0; i < n_tokens; ++i) {
            if (tokens[i] < 0 || tokens[i] >= n_vocab) {
                llama_kvp_set_error("prefill_guided: token " + std::to_string(i) + " (id " + std::to_string(tokens[i]) +
                        ") is outside the vocabulary of " + std::to_string(n_vocab) + " tokens");
                return -1;
            }
        }
    }
    const int32_t chunk = (int32_t) mem->chunk;
    const int32_t n_g   = (int32_t) mem->n_guide;
    // the caller's last chunk holds the prompt's end itself; nothing to guide if that is all there is
    if (n_g == 0 || chunk < n_g || n_tokens <= chunk) {
        return i0 == 0 ? 0 : -1;
    }
    const int32_t k = n_tokens - chunk;
    if (i0 == k) {
        return k; // done
    }
    // the first chunk takes the remainder, so that all later ones are full
    if (i0 > k || (i0 > 0 && (i0 - k % chunk) % chunk != 0)) {
        llama_kvp_set_error("prefill_guided: i0 = " + std::to_string(i0) + " is not where a chunk starts");
        return -1;
    }
    const int32_t n = (i0 == 0 && k % chunk != 0) ? k % chunk : chunk;
    const llama_token * tail = tokens + n_tokens - n_g;

    llama_batch batch = llama_batch_init(n + n_g, 0, 1);
    batch.n_tokens = n + n_g;
    for (int32_t j = 0; j < n + n_g; ++j) {
        batch.token[j]     = j < n ? tokens[i0 + j] : tail[j - n];
        batch.pos[j]       = pos0 + i0 + j;
        batch.n_seq_id[j]  = 1;
        batch.seq_id[j][0] = mem->seq_cur;
        batch.logits[j]    = logits && j < n; // the chunk's own tokens: the guide after them does not change theirs
    }
    mem->guiding = true;
    const int32_t ret = llama_decode(ctx, batch);
    mem->guiding = false;
    for (int32_t j = 0; ret == 0 && logits && j < n; ++j) {
        std::copy_n(llama_get_logits_ith(ctx, j), n_vocab, logits + (size_t) (i0 + j)*n_vocab);
    }
    // the prompt-end tokens were only there to score the cache: their positions go to the next chunk
    llama_memory_seq_rm(llama_get_memory(ctx), mem->seq_cur, pos0 + i0 + n, -1);
    llama_batch_free(batch);
    if (ret != 0) {
        llama_kvp_set_error("prefill_guided: llama_decode failed (" + std::to_string(ret) + ") at token " + std::to_string(i0));
        return -1;
    }
    return i0 + n;
}

// the policy state of a context (an error naming `what` and nullptr for a context without a KV policy)
static llama_kvp_context * llama_kvp_policy_state(struct llama_context * ctx, const char * what) {
    if (!llama_kvp_check_ctx(ctx)) {
        return nullptr;
    }
    llama_kvp_context * st = ctx->get_kvp();
    if (!st) {
        llama_kvp_set_error(std::string(what) + ": the context has no KV policy");
    }
    return st;
}

int32_t llama_kvp_set_prompt_end(struct llama_context * ctx, int32_t pos) {
    llama_kvp_context * st = llama_kvp_policy_state(ctx, "set_prompt_end");
    if (!st) {
        return -1;
    }
    st->prompt_end = pos < 0 ? -1 : pos;
    return 0;
}

int32_t llama_kvp_reset_peak(struct llama_context * ctx) {
    if (!llama_kvp_check_ctx(ctx)) {
        return -1;
    }
    if (auto * mem = dynamic_cast<llama_kvp_memory *>(ctx->get_memory())) {
        mem->bytes_peak      = mem->bytes();
        mem->host_bytes_peak = mem->host_bytes;
    }
    return 0;
}

int32_t llama_kvp_perf(struct llama_context * ctx, struct llama_kvp_perf_data * out) {
    const llama_kvp_context * st = llama_kvp_check_out(out) ? llama_kvp_policy_state(ctx, "perf") : nullptr;
    if (!st) {
        return -1;
    }
    *out = st->perf;
    return 0;
}

int32_t llama_kvp_perf_reset(struct llama_context * ctx) {
    llama_kvp_context * st = llama_kvp_policy_state(ctx, "perf_reset");
    if (!st) {
        return -1;
    }
    st->perf = {};
    return 0;
}

int32_t llama_kvp_memory_info(struct llama_context * ctx, struct llama_kvp_memory_info * out) {
    if (!llama_kvp_check_ctx(ctx) || !llama_kvp_check_out(out)) {
        return -1;
    }
    *out = {};
    auto * mem = dynamic_cast<llama_kvp_memory *>(ctx->get_memory());
    if (!mem) {
        int64_t bytes = 0;
        for (const auto & [buft, size] : ctx->get_memory() ? ctx->get_memory()->memory_breakdown() : std::map<ggml_backend_buffer_type_t, size_t>{}) {
            bytes += (int64_t) size;
        }
        out->bytes      = bytes;
        out->bytes_peak = bytes;
        for (auto * kv : llama_kvp_caches(ctx)) { // llama.cpp's own cache: its cells in use, in every layer
            out->n_active += (int32_t) llama_kvp_kv_access::n_used(*kv)*llama_kvp_kv_access::n_layers(*kv);
        }
        out->n_seq = (int32_t) llama_n_seq_max(ctx);
        return 0;
    }
    out->per_layer  = 1;
    out->budget     = (int32_t) mem->budget;
    out->n_prompt   = mem->n_prompt;
    out->chunk      = (int32_t) mem->chunk;
    out->bytes      = mem->bytes();
    out->bytes_peak = mem->bytes_peak;
    out->n_evicted  = mem->n_evicted;
    out->n_resize   = mem->n_resize;
    out->n_budget   = mem->n_budget;
    out->host_bytes      = mem->host_bytes;
    out->host_bytes_peak = mem->host_bytes_peak;
    for (const auto & L : mem->layers) {
        out->n_active += (int32_t) llama_kvp_kv_access::n_used(*L.kv);
    }
    out->n_seq = (int32_t) mem->n_seq();
    out->seq   = mem->seq_cur;
    return 0;
}

int32_t llama_kvp_seq_select(struct llama_context * ctx, int32_t seq_id) {
    if (!llama_kvp_check_ctx(ctx)) {
        return -1;
    }
    auto * mem = llama_kvp_mem(ctx);
    if (!mem) {
        return -1;
    }
    if (seq_id < 0 || (uint32_t) seq_id >= mem->n_seq()) {
        llama_kvp_set_error("seq_select: sequence id " + std::to_string(seq_id) + " is out of range: this context holds " +
                std::to_string(mem->n_seq()) + " sequences (n_seq_max)");
        return -1;
    }
    if (mem->seq_cur == seq_id) {
        return 0; // already the current one: nothing to swap, nor to wait for (a Llama selects its own at every eval)
    }
    ctx->synchronize();
    mem->seq_use(seq_id);
    return 0;
}

int32_t llama_kvp_get_budgets(struct llama_context * ctx, struct llama_kvp_layer_budget * out, int32_t n_max) {
    if (!llama_kvp_check_ctx(ctx)) {
        return -1;
    }
    llama_kvp_memory * mem = llama_kvp_mem(ctx);
    if (!mem) {
        return -1;
    }
    const int32_t n = (int32_t) mem->layers.size();
    if (!out || n_max < n) {
        llama_kvp_set_error("budget buffer too small: need " + std::to_string(n) + " entries");
        return -1;
    }
    for (int32_t i = 0; i < n; ++i) {
        const auto & L = mem->layers[i];
        out[i].il        = L.il;
        out[i].budget    = (int32_t) L.budget;
        out[i].capacity  = (int32_t) L.capacity;
        out[i].n_used    = (int32_t) llama_kvp_kv_access::n_used(*L.kv);
        out[i].entropy   = L.entropy;
        out[i].n_evicted = L.n_evicted;
    }
    return n;
}

// the cache that holds KV layer ikv of the context (the per-layer memory's, or llama.cpp's own) and the layer's index
// in it; nullptr (with the error set) if there is no single-stream one
static llama_kv_cache * llama_kvp_layer_cache(llama_context * ctx, int32_t ikv, int32_t & local) {
    int32_t base = 0;
    for (auto * c : llama_kvp_caches(ctx)) {
        const int32_t nl = llama_kvp_kv_access::n_layers(*c);
        if (ikv >= base && ikv < base + nl) {
            if (llama_kvp_kv_access::n_stream(*c) != 1) {
                llama_kvp_set_error("KV layer " + std::to_string(ikv) + " is in llama.cpp's cache of " +
                        std::to_string(llama_kvp_kv_access::n_stream(*c)) + " sequence streams (n_seq_max > 1): its "
                        "cells are read with one sequence, or with a retention policy (a cache per sequence)");
                return nullptr;
            }
            local = ikv - base;
            return c;
        }
        base += nl;
    }
    llama_kvp_set_error("no KV layer " + std::to_string(ikv) + " in this context (it has " + std::to_string(base) + ")");
    return nullptr;
}

int32_t llama_kvp_layer_cell_pos(struct llama_context * ctx, int32_t ikv, int32_t * out, int32_t n_max) {
    if (!llama_kvp_check_ctx(ctx)) {
        return -1;
    }
    int32_t local = 0;
    llama_kv_cache * kv = llama_kvp_layer_cache(ctx, ikv, local);
    return kv ? llama_kvp_fill_cell_pos(*kv, out, n_max) : -1;
}

// undoes llama.cpp's rotation of a quantized cache's K (and queries) or V rows (llama_kvp_kv_access::rot), in place:
// rows [n_rows][n_embd]; the normalised Walsh-Hadamard matrix is symmetric and its own inverse
static void llama_kvp_unrotate(const llama_kv_cache & kv, bool v, float * rows, int64_t n_rows, int64_t n_embd) {
    int32_t n = 0;
    const float * h = llama_kvp_kv_access::rot(kv, v, n);
    if (!h) {
        return;
    }
    GGML_ASSERT(n_embd % n == 0);
    std::vector<float> y(n);
    for (int64_t c = 0; c < n_rows*n_embd; c += n) {
        float * x = rows + c;
        for (int32_t i = 0; i < n; ++i) {
            float sum = 0.0f;
            for (int32_t j = 0; j < n; ++j) {
                sum += h[(size_t) i*n + j]*x[j];
            }
            y[i] = sum;
        }
        std::copy(y.begin(), y.end(), x);
    }
}

int32_t llama_kvp_layer_kv(struct llama_context * ctx, int32_t ikv, float * k_out, float * v_out, int32_t n_max,
                           int32_t * n_embd_k, int32_t * n_embd_v) {
    if (!llama_kvp_check_ctx(ctx)) {
        return -1;
    }
    int32_t local = 0;
    llama_kv_cache * kv = llama_kvp_layer_cache(ctx, ikv, local);
    if (!kv) {
        return -1;
    }
    ggml_tensor * kt = llama_kvp_kv_access::layer_k(*kv, local);
    ggml_tensor * vt = llama_kvp_kv_access::layer_v(*kv, local);
    const int32_t size = (int32_t) kv->get_size();
    if (n_embd_k) {
        *n_embd_k = (int32_t) kt->ne[0];
    }
    if (n_embd_v) {
        *n_embd_v = (int32_t) vt->ne[0];
    }
    if (!k_out && !v_out) {
        return size;
    }
    if (n_max < size) {
        llama_kvp_set_error("K/V buffers too small: need " + std::to_string(size) + " rows");
        return -1;
    }
    llama_synchronize(ctx);
    std::vector<uint32_t> idx(size);
    std::iota(idx.begin(), idx.end(), 0u);
    const bool v_trans = llama_kvp_kv_access::v_trans(*kv); // as the cache was made (flash attention off: transposed)
    std::vector<uint8_t> raw;
    if (k_out) {
        const size_t nb = ggml_row_size(kt->type, kt->ne[0]);
        raw.resize((size_t) size*nb);
        llama_kvp_cells_read(kt, false, (uint32_t) size, idx, raw.data());
        for (int32_t i = 0; i < size; ++i) {
            llama_kvp_row_to_f32(kt->type, raw.data() + (size_t) i*nb, k_out + (size_t) i*kt->ne[0], kt->ne[0]);
        }
        llama_kvp_unrotate(*kv, false, k_out, size, kt->ne[0]);
    }
    if (v_out) {
        const size_t nb = v_trans ? (size_t) vt->ne[0]*ggml_type_size(vt->type) : ggml_row_size(vt->type, vt->ne[0]);
        raw.resize((size_t) size*nb);
        llama_kvp_cells_read(vt, v_trans, (uint32_t) size, idx, raw.data());
        for (int32_t i = 0; i < size; ++i) {
            llama_kvp_row_to_f32(vt->type, raw.data() + (size_t) i*nb, v_out + (size_t) i*vt->ne[0], vt->ne[0]);
        }
        llama_kvp_unrotate(*kv, true, v_out, size, vt->ne[0]);
    }
    return size;
}

// the observing context of ctx if it has KV layer ikv (else nullptr, with the error set)
static llama_kvp_context * llama_kvp_obs_layer_ctx(llama_context * ctx, int32_t ikv) {
    llama_kvp_context * st = llama_kvp_obs_ctx(ctx);
    if (st && (ikv < 0 || ikv >= (int32_t) st->layers.size())) {
        llama_kvp_set_error("no observed KV layer " + std::to_string(ikv) + " (" + std::to_string(st->layers.size()) + " layers)");
        return nullptr;
    }
    return st;
}

int32_t llama_kvp_obs_queries(struct llama_context * ctx, int32_t ikv, float * q_out, int32_t * pos_out, int32_t n_max,
                              int32_t * n_embd_q, float * scale) {
    llama_kvp_context * st = llama_kvp_obs_layer_ctx(ctx, ikv);
    if (!st) {
        return -1;
    }
    std::vector<float>     q;
    std::vector<llama_pos> qpos;
    const int32_t n = llama_kvp_obs_layer_queries(st, ikv, q, &qpos);
    const int32_t row = st->n_head*st->n_embd_head;
    if (n_embd_q) {
        *n_embd_q = row;
    }
    if (scale) {
        *scale = st->layers[ikv].kq_scale;
    }
    if ((q_out || pos_out) && n_max < n) {
        llama_kvp_set_error("query buffers too small: need " + std::to_string(n) + " rows");
        return -1;
    }
    if (q_out) {
        std::copy(q.begin(), q.end(), q_out);
        llama_kvp_unrotate(*st->layer_kv(ikv), false, q_out, n, row); // the queries were rotated as the layer's K
    }
    for (int32_t i = 0; pos_out && i < n; ++i) {
        pos_out[i] = qpos[i];
    }
    return n;
}

int32_t llama_kvp_obs_query_entropy(struct llama_context * ctx, int32_t ikv, float * ent_out, int32_t * pos_out, int32_t n_max) {
    llama_kvp_context * st = llama_kvp_obs_layer_ctx(ctx, ikv);
    if (!st) {
        return -1;
    }
    if (!st->rows_mode()) {
        llama_kvp_set_error("the query entropy needs a retention policy observing a window of 2 or more queries");
        return -1;
    }
    std::vector<float>     ent;
    std::vector<llama_pos> pos;
    const int32_t n = llama_kvp_obs_layer_query_entropy(st, ikv, ent, pos);
    if ((ent_out || pos_out) && n_max < n) {
        llama_kvp_set_error("entropy buffers too small: need " + std::to_string(n) + " cells");
        return -1;
    }
    for (int32_t i = 0; i < n; ++i) {
        if (ent_out) {
            ent_out[i] = ent[i];
        }
        if (pos_out) {
            pos_out[i] = pos[i];
        }
    }
    return n;
}

//
// cells of a layer
//

int32_t llama_kvp_layer_cell_bias(struct llama_context * ctx, int32_t ikv, float * out, int32_t n_max) {
    if (!llama_kvp_check_ctx(ctx)) {
        return -1;
    }
    llama_kvp_memory * mem = llama_kvp_mem(ctx);
    if (!mem) {
        llama_kvp_set_error("cell biases need a retention policy (one KV cache per layer)");
        return -1;
    }
    if (!llama_kvp_check_layer(mem, ikv)) {
        return -1;
    }
    const auto & L = mem->layers[ikv];
    const int32_t n = (int32_t) L.kv->get_size();
    if (!out || n_max < n) {
        llama_kvp_set_error("cell bias buffer too small: need " + std::to_string(n) + " entries");
        return -1;
    }
    for (int32_t i = 0; i < n; ++i) {
        const llama_pos p = llama_kvp_kv_access::cell_pos(*L.kv, (uint32_t) i);
        const auto it = p >= 0 ? L.bias.find(p) : L.bias.end();
        out[i] = it != L.bias.end() ? it->second : 0.0f;
    }
    return n;
}

int64_t llama_kvp_layer_cell_kv(struct llama_context * ctx, int32_t ikv, int32_t pos, void * k_out, void * v_out) {
    if (!llama_kvp_check_ctx(ctx)) {
        return -1;
    }
    llama_kvp_memory * mem = llama_kvp_mem(ctx);
    if (!mem || !llama_kvp_check_layer(mem, ikv)) {
        return -1;
    }
    if (pos < 0) { // an empty cell's position
        llama_kvp_set_error("no position " + std::to_string(pos) + ": positions are >= 0");
        return -1;
    }
    llama_synchronize(ctx);
    const auto & L = mem->layers[ikv];
    const uint32_t size = L.kv->get_size();
    for (uint32_t i = 0; i < size; ++i) {
        if (llama_kvp_kv_access::cell_pos(*L.kv, i) != pos) {
            continue;
        }
        ggml_tensor * kt = llama_kvp_kv_access::layer_k(*L.kv, 0);
        ggml_tensor * vt = llama_kvp_kv_access::layer_v(*L.kv, 0);
        const bool v_trans = !mem->cparams.flash_attn;
        const std::vector<uint32_t> idx = { i };
        if (k_out) {
            llama_kvp_cells_read(kt, false, size, idx, (uint8_t *) k_out);
        }
        if (v_out) {
            llama_kvp_cells_read(vt, v_trans, size, idx, (uint8_t *) v_out);
        }
        const size_t nk = ggml_row_size(kt->type, kt->ne[0]);
        const size_t nv = v_trans ? (size_t) vt->ne[0]*ggml_type_size(vt->type) : ggml_row_size(vt->type, vt->ne[0]);
        return (int64_t) (nk + nv);
    }
    return 0;
}
