// llama-kvp-memory.cpp - per-layer KV memory of the retention policies (see llama-kvp-memory.h).
//
// Each attention layer owns a llama_kv_cache with capacity PAD(budget + chunk, n_pad). Eviction only frees cells
// (keys are stored after RoPE, positions are never rewritten). A layer whose budget changes is reallocated and its
// tokens are moved with the cache's own state serialisation.

#include "llama-kvp-memory.h"
#include "llama-kvp-stage.h"

#include "llama-arch.h"
#include "llama-impl.h"
#include "llama-io.h"
#include "llama-model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>
#include <stdexcept>

static constexpr uint32_t LLAMA_KVP_STATE_MAGIC   = 0x4d50564b; // "KVPM"
static constexpr uint32_t LLAMA_KVP_STATE_VERSION = 9; // 2: the stages of the policy follow the header; 3: pos_end, pos_exact; 4: mask biases; 5: the fate stage's tokens;
                                                      // 6: the cells' layout, the observation state, the step counters;
                                                      // 7: summarise's bins apart, its dropped centroids; 8: the policy's spec;
                                                      // 9: the prefill stage's state

//
// byte-vector io for moving a layer's tokens between two caches and for the state header
//

class llama_kvp_io_write : public llama_io_write_i {
public:
    explicit llama_kvp_io_write(std::vector<uint8_t> & buf) : buf(buf) {}

    void write(const void * src, size_t size) override {
        const uint8_t * p = (const uint8_t *) src;
        buf.insert(buf.end(), p, p + size);
    }

    void write_tensor(ggml_tensor * tensor, size_t offset, size_t size) override {
        const size_t n0 = buf.size();
        buf.resize(n0 + size);
        ggml_backend_tensor_get(tensor, buf.data() + n0, offset, size);
    }

    size_t n_bytes() override { return buf.size(); }

    std::vector<uint8_t> & buf;
};

class llama_kvp_io_read : public llama_io_read_i {
public:
    explicit llama_kvp_io_read(const std::vector<uint8_t> & buf) : buf(buf) {}

    void read(void * dst, size_t size) override {
        if (pos + size > buf.size()) {
            throw std::runtime_error("pykvcache: unexpected end of a layer's KV data");
        }
        memcpy(dst, buf.data() + pos, size);
        pos += size;
    }

    void read_tensor(ggml_tensor * tensor, size_t offset, size_t size) override {
        if (pos + size > buf.size()) {
            throw std::runtime_error("pykvcache: unexpected end of a layer's KV data");
        }
        ggml_backend_tensor_set(tensor, buf.data() + pos, offset, size);
        pos += size;
    }

    size_t n_bytes() override { return pos; }

    const std::vector<uint8_t> & buf;
    size_t pos = 0;
};

//
// batched access to the cells of a layer cache
//

// bytes one token takes in a cache tensor (its K row, its V row, or its elements of a transposed V)
size_t llama_kvp_cell_bytes(const ggml_tensor * t, bool trans) {
    return trans ? (size_t) t->ne[0]*ggml_type_size(t->type) : ggml_row_size(t->type, t->ne[0]);
}

void llama_kvp_row_to_f32(ggml_type t, const void * src, float * dst, int64_t n) {
    if (t == GGML_TYPE_F32) {
        memcpy(dst, src, (size_t) n*sizeof(float));
        return;
    }
    ggml_get_type_traits(t)->to_float(src, dst, n);
}

// the span of bytes of a tensor that covers cells [lo, hi] (the whole tensor when transposed)
static void llama_kvp_cell_span(const ggml_tensor * t, bool trans, uint32_t lo, uint32_t hi, size_t & off, size_t & len) {
    if (trans) {
        off = 0;
        len = ggml_nbytes(t);
    } else {
        off = (size_t) lo*t->nb[1];
        len = (size_t) (hi - lo)*t->nb[1] + ggml_row_size(t->type, t->ne[0]);
    }
}

// copies token idx's row between a tensor image `base` (which starts at byte `off` of the tensor) and `tok`
static void llama_kvp_cell_copy(const ggml_tensor * t, uint8_t * base, size_t off, uint32_t idx, uint8_t * tok, bool to_tensor) {
    uint8_t * row = base + (size_t) idx*t->nb[1] - off;
    const size_t nb = ggml_row_size(t->type, t->ne[0]);
    to_tensor ? memcpy(row, tok, nb) : memcpy(tok, row, nb);
}

// copies the tokens idx of a transposed V image `base` (starting at byte `off` of the tensor) to or from toks (token
// i's elements contiguous at i*ne[0]), one row of the tensor (one element of every token) at a time: token by token,
// each element lands in another row (size cells apart), and the freeze's moves took most of a decode step in them
static void llama_kvp_cells_copy_trans(const ggml_tensor * t, uint32_t size, uint8_t * base, size_t off,
                                       const std::vector<uint32_t> & idx, uint8_t * toks, bool to_tensor) {
    const size_t  es = ggml_type_size(t->type);
    const size_t  nb = (size_t) t->ne[0]*es;
    const size_t  n  = idx.size();
    for (int64_t e = 0; e < t->ne[0]; ++e) {
        uint8_t * row = base + (size_t) e*size*es - off;
        uint8_t * tok = toks + (size_t) e*es;
        if (es == 2) {
            for (size_t i = 0; i < n; ++i) {
                to_tensor ? memcpy(row + (size_t) idx[i]*2, tok + i*nb, 2) : memcpy(tok + i*nb, row + (size_t) idx[i]*2, 2);
            }
        } else {
            for (size_t i = 0; i < n; ++i) {
                to_tensor ? memcpy(row + (size_t) idx[i]*es, tok + i*nb, es) : memcpy(tok + i*nb, row + (size_t) idx[i]*es, es);
            }
        }
    }
}

// the cells idx of a tensor in device memory, in runs: cells at most a few rows apart share one transfer (the rows
// between cost less than another transfer), so that scattered cells (an eviction's leavers across a layer) are not
// read with the whole span between them; each run [i0, i1) of `order` (idx sorted) gets fn(order, i0, i1, off, len),
// with the bytes [off, off + len) of the tensor that the run covers
template <typename F>
static void llama_kvp_cell_runs(const ggml_tensor * t, const std::vector<uint32_t> & idx, F fn) {
    std::vector<uint32_t> order(idx.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return idx[a] < idx[b]; });
    const uint32_t gap = (uint32_t) std::max<size_t>(1, (64*1024)/t->nb[1]);
    size_t i0 = 0;
    while (i0 < order.size()) {
        size_t i1 = i0 + 1;
        while (i1 < order.size() && idx[order[i1]] - idx[order[i1 - 1]] <= gap) {
            i1++;
        }
        size_t off = 0;
        size_t len = 0;
        llama_kvp_cell_span(t, false, idx[order[i0]], idx[order[i1 - 1]], off, len);
        fn(order, i0, i1, off, len);
        i0 = i1;
    }
}

void llama_kvp_cells_read(ggml_tensor * t, bool trans, uint32_t size, const std::vector<uint32_t> & idx, uint8_t * out) {
    if (idx.empty()) {
        return;
    }
    const size_t nb = llama_kvp_cell_bytes(t, trans);
    if (!trans && !(t->buffer && ggml_backend_buffer_is_host(t->buffer))) {
        std::vector<uint8_t> buf;
        llama_kvp_cell_runs(t, idx, [&](const std::vector<uint32_t> & order, size_t i0, size_t i1, size_t off, size_t len) {
            buf.resize(len);
            ggml_backend_tensor_get(t, buf.data(), off, len);
            for (size_t i = i0; i < i1; ++i) {
                llama_kvp_cell_copy(t, buf.data(), off, idx[order[i]], out + order[i]*nb, false);
            }
        });
        return;
    }
    const auto [lo, hi] = std::minmax_element(idx.begin(), idx.end());
    size_t off = 0;
    size_t len = 0;
    std::vector<uint8_t> buf;
    uint8_t * base = (uint8_t *) t->data;
    if (!(t->buffer && ggml_backend_buffer_is_host(t->buffer))) {
        llama_kvp_cell_span(t, trans, *lo, *hi, off, len);
        buf.resize(len);
        ggml_backend_tensor_get(t, buf.data(), off, len);
        base = buf.data();
    }
    if (trans) {
        llama_kvp_cells_copy_trans(t, size, base, off, idx, out, false);
        return;
    }
    for (size_t i = 0; i < idx.size(); ++i) {
        llama_kvp_cell_copy(t, base, off, idx[i], out + i*nb, false);
    }
}

void llama_kvp_cells_write(ggml_tensor * t, bool trans, uint32_t size, const std::vector<uint32_t> & idx, const uint8_t * src) {
    if (idx.empty()) {
        return;
    }
    const size_t nb = llama_kvp_cell_bytes(t, trans);
    const bool host = t->buffer && ggml_backend_buffer_is_host(t->buffer);
    if (!trans && !host) { // read-modify-write of each run's span: the cells between hold their own bytes again
        std::vector<uint8_t> buf;
        llama_kvp_cell_runs(t, idx, [&](const std::vector<uint32_t> & order, size_t i0, size_t i1, size_t off, size_t len) {
            buf.resize(len);
            if (i1 - i0 > 1) {
                ggml_backend_tensor_get(t, buf.data(), off, len);
            }
            for (size_t i = i0; i < i1; ++i) {
                llama_kvp_cell_copy(t, buf.data(), off, idx[order[i]], (uint8_t *) src + order[i]*nb, true);
            }
            ggml_backend_tensor_set(t, buf.data(), off, len);
        });
        return;
    }
    const auto [lo, hi] = std::minmax_element(idx.begin(), idx.end());
    size_t off = 0;
    size_t len = 0;
    std::vector<uint8_t> buf;
    uint8_t * base = (uint8_t *) t->data;
    if (!host) { // read-modify-write of the span: the cells between hold their own bytes again
        llama_kvp_cell_span(t, trans, *lo, *hi, off, len);
        buf.resize(len);
        ggml_backend_tensor_get(t, buf.data(), off, len);
        base = buf.data();
    }
    if (trans) {
        llama_kvp_cells_copy_trans(t, size, base, off, idx, (uint8_t *) src, true);
    } else {
        for (size_t i = 0; i < idx.size(); ++i) {
            llama_kvp_cell_copy(t, base, off, idx[i], (uint8_t *) src + i*nb, true);
        }
    }
    if (!host) {
        ggml_backend_tensor_set(t, buf.data(), off, len);
    }
}

//
// llama_kvp_memory
//

llama_kvp_memory::llama_kvp_memory(
        const llama_model         & model,
        const llama_memory_params & params,
        const llama_cparams       & cparams,
        const llama_kvp_policy    & policy) : model(model), cparams(cparams), policy(policy), params(params) {
    const auto & hparams = model.hparams;

    layer_of_il.assign(hparams.n_layer(), -1);
    for (uint32_t il = 0; il < hparams.n_layer(); ++il) {
        if (!hparams.has_kv(il)) {
            continue;
        }
        layer_of_il[il] = (int32_t) layers.size();
        llama_kvp_mem_layer L;
        L.il = (int32_t) il;
        layers.push_back(std::move(L));

        // caches on an accelerator are padded to 256 cells, which keeps the CUDA flash-attention kernels eligible
        ggml_backend_dev_t dev = model.dev_layer((int) il);
        if (cparams.offload_kqv && dev && ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
            n_pad = 256;
        }
    }

    // the stages this memory runs (a retention policy has all four; checked by llama_kvp_policy_check)
    stage_budget  = llama_kvp_budget_of(policy);
    stage_score   = llama_kvp_score_of(policy);
    stage_fate    = llama_kvp_fate_of(policy);
    stage_schedule = llama_kvp_schedule_of(policy);
    stage_prefill = llama_kvp_prefill_of(policy);
    GGML_ASSERT(stage_budget && stage_score && stage_fate && stage_prefill);
    n_pad = std::max(n_pad, stage_prefill->cell_align(policy)); // e.g. sparse prefill's key blocks

    // a guided chunk and the prompt-end tokens behind it form one ubatch
    n_guide = stage_prefill->n_guide(policy, cparams.n_ubatch);
    chunk   = stage_prefill->chunk(policy, cparams.n_ubatch);
    budget = resolve_budget(0);

    const auto b = fixed_budgets(budget);
    for (size_t i = 0; i < layers.size(); ++i) {
        layers[i].budget   = b[i];
        layers[i].capacity = capacity_for(b[i]);
        layers[i].kv       = make_cache(layers[i].il, layers[i].capacity);
    }
    seqs.resize(std::max<uint32_t>(1, cparams.n_seq_max));
    for (size_t s = 1; s < seqs.size(); ++s) {
        seq_init(seqs[s]);
    }
    note_bytes(0);
}

void llama_kvp_memory::seq_init(llama_kvp_mem_seq & o) const {
    o.layers.clear();
    for (const auto & L : layers) {
        llama_kvp_mem_layer l;
        l.il       = L.il;
        l.budget   = L.budget;
        l.capacity = L.capacity;
        l.kv       = make_cache(l.il, l.capacity);
        o.layers.push_back(std::move(l));
    }
    o.budget = budget;
}

void llama_kvp_memory::seq_swap(llama_kvp_mem_seq & o) {
    std::swap(layers,         o.layers);
    std::swap(sched_state,    o.sched_state);
    std::swap(budget,         o.budget);
    std::swap(n_prompt,       o.n_prompt);
    std::swap(n_since_prompt, o.n_since_prompt);
    std::swap(n_steps_total,  o.n_steps_total);
    std::swap(budgets_set,    o.budgets_set);
    std::swap(pos_end,        o.pos_end);
    std::swap(pos_exact,      o.pos_exact);
}

void llama_kvp_memory::seq_use(llama_seq_id s) {
    GGML_ASSERT(s >= 0 && (size_t) s < seqs.size());
    if (s == seq_cur) {
        return;
    }
    // park the current sequence in its own slot (which held nothing), then take s's state out of its slot
    seq_swap(seqs[seq_cur]);
    seq_swap(seqs[s]);
    if (st) {
        llama_kvp_obs_seq_swap(st, st->seqs[seq_cur]);
        llama_kvp_obs_seq_swap(st, st->seqs[s]);
    }
    seq_cur = s;
}

uint32_t llama_kvp_memory::resolve_budget(int32_t n_prompt) const {
    const uint32_t n_ctx = cparams.n_ctx_seq;
    const double b = policy.budget >= 1.0f ? (double) policy.budget :
        std::round((double) policy.budget*(n_prompt > 0 ? n_prompt : (int32_t) n_ctx));
    // a budget of protected tokens only is exactly those; the others need room for at least one scored token
    const double b_min = llama_kvp_policy_n_protected(policy) + (stage_score->protected_only() ? 0 : 1);
    return (uint32_t) std::min<double>(n_ctx, std::max(b, b_min));
}

std::vector<uint32_t> llama_kvp_memory::fixed_budgets(uint32_t mean) const {
    return stage_budget->initial(policy, mean, (int32_t) layers.size(), layer_lo(), cparams.n_ctx_seq);
}

uint32_t llama_kvp_memory::layer_lo() const {
    return (uint32_t) llama_kvp_policy_n_protected(policy) + 1;
}

uint32_t llama_kvp_memory::capacity_for(uint32_t layer_budget) const {
    const uint32_t max_cap = GGML_PAD(cparams.n_ctx_seq, n_pad);
    return std::min<uint32_t>(max_cap, GGML_PAD(layer_budget + chunk + n_guide, n_pad));
}

// llama.cpp's log while the memory makes a layer's cache: each llama_kv_cache constructor logs a line per model layer
// it filters out and its buffers, and a resize makes one per layer whose budget moved (1500 lines in one prompt under
// `entropy`, each through llama-cpp-python's Python log callback, where a Ctrl-C got lost); warnings and errors still
// pass. One filter for the process, however many contexts make caches at once (llama.cpp's log is global)
static std::mutex        g_kvp_quiet_mutex;
static int32_t           g_kvp_quiet_depth = 0;
static ggml_log_callback g_kvp_quiet_cb    = nullptr;
static void *            g_kvp_quiet_ud    = nullptr;

static void llama_kvp_quiet_log_cb(ggml_log_level level, const char * text, void * user_data) {
    (void) user_data;
    if ((level == GGML_LOG_LEVEL_WARN || level == GGML_LOG_LEVEL_ERROR) && g_kvp_quiet_cb) {
        g_kvp_quiet_cb(level, text, g_kvp_quiet_ud);
    }
}

struct llama_kvp_quiet_log {
    llama_kvp_quiet_log() {
        std::lock_guard<std::mutex> lock(g_kvp_quiet_mutex);
        if (g_kvp_quiet_depth++ == 0) {
            llama_log_get(&g_kvp_quiet_cb, &g_kvp_quiet_ud);
            llama_log_set(llama_kvp_quiet_log_cb, nullptr);
        }
    }
    ~llama_kvp_quiet_log() {
        std::lock_guard<std::mutex> lock(g_kvp_quiet_mutex);
        if (--g_kvp_quiet_depth == 0) {
            llama_log_set(g_kvp_quiet_cb, g_kvp_quiet_ud);
        }
    }
};

std::unique_ptr<llama_kv_cache> llama_kvp_memory::make_cache(int32_t il, uint32_t size) const {
    const auto & hparams = model.hparams;
    llama_memory_i::layer_filter_cb filter = [il](int32_t i) { return i == il; };
    const std::string tag = "l" + std::to_string(il);
    llama_kvp_quiet_log quiet;
    return std::make_unique<llama_kv_cache>(
            model, hparams, params.type_k, params.type_v,
            !cparams.flash_attn, cparams.offload_kqv, /*unified: one stream, one sequence in it*/ true,
            size, cparams.n_seq_max, 1, hparams.n_swa, hparams.swa_type,
            nullptr, filter, nullptr, nullptr, tag.c_str());
}

int64_t llama_kvp_memory::bytes() const {
    int64_t res = 0;
    for (const auto & [buft, size] : memory_breakdown()) {
        res += (int64_t) size;
    }
    return res;
}

void llama_kvp_memory::note_bytes(int64_t extra) {
    bytes_peak = std::max(bytes_peak, bytes() + extra);
}

bool llama_kvp_memory::set_prompt_len(int32_t n) {
    for (const auto & L : layers) {
        if (llama_kvp_kv_access::n_used(*L.kv) > 0) {
            return false;
        }
    }
    restart_budgets(n);
    if (!prompt_seen) {
        // a fractional budget's buffers before the first prompt are sized for n_ctx, a placeholder: the peak counts from
        // the first prompt's
        prompt_seen = true;
        bytes_peak  = bytes();
    }
    return true;
}

void llama_kvp_memory::restart_budgets(int32_t n) {
    n_prompt = n;
    const uint32_t b_new = resolve_budget(n);
    if (policy.budget < 1.0f && n > 0 && !budget_raised_said && (double) b_new > std::round((double) policy.budget*n)) {
        // the documented budget rule, said once per context with verbose=True (llama-cpp-python prints llama.cpp's warnings
        // whatever its verbose): a short prompt's fraction is below the protected tokens
        LLAMA_LOG_INFO("%s: pykvcache: budget=%g of a %d-token prompt is %.0f tokens, fewer than the policy always keeps "
                       "(sinks, recent window): raised to %u per layer\n", __func__, (double) policy.budget, n,
                       std::round((double) policy.budget*n), b_new);
        budget_raised_said = true;
    }
    // every layer back to the budget a fresh context starts the prompt with, whatever decided the last prompt's: an
    // emptied cache has already forgotten that entropy had decided them (budgets_set), so the budgets themselves count
    budget      = b_new;
    budgets_set = false;
    const auto b = fixed_budgets(budget);
    for (size_t i = 0; i < layers.size(); ++i) {
        layers[i].budget = b[i];
        if (capacity_for(b[i]) != layers[i].capacity) {
            resize((int32_t) i, capacity_for(b[i]));
        }
    }
}

void llama_kvp_memory::decide_budgets() {
    const int32_t n = (int32_t) layers.size();

    // budgets decided from the attention entropy: (re)decided whenever a prompt ubatch was observed, from the mean
    // entropy of the prompt observations so far (decode-step observations refresh scores, not budgets)
    if (stage_budget->uses_entropy() && st) {
        std::vector<float> ent(n);
        std::vector<uint32_t> out;
        if (llama_kvp_obs_take_prompt_entropy(st, ent.data()) &&
            stage_budget->from_entropy(policy, ent.data(), n, budget, layer_lo(), cparams.n_ctx_seq, out)) {
            for (int32_t i = 0; i < n; ++i) {
                layers[i].budget  = out[i];
                layers[i].entropy = ent[i];
            }
            budgets_set = true;
            n_budget++;
        }
    }
}

void llama_kvp_memory::prepare_ubatch(uint32_t n_tokens) {
    n_ubatch_cur = n_tokens;
    decide_budgets();

    // a decode step: the schedule may move tokens between the caches and the host tier first, and says whether the
    // step evicts down to the budgets (the first step after a prompt always does)
    bool evict_all = true;
    if (n_tokens > 1 || guiding) {
        n_since_prompt = 0;
    } else {
        if (stage_schedule && st && n_since_prompt > 0) {
            evict_all = stage_schedule->evict_step(policy, st->n_decode);
        }
        if (stage_schedule) {
            stage_schedule->before_step(*this);
        }
        n_since_prompt++;
        n_steps_total++;
    }
    evict_layers(n_tokens, evict_all);
}

void llama_kvp_memory::evict_layers(uint32_t n_tokens, bool evict_all) {
    const int32_t n = (int32_t) layers.size();
    std::vector<uint32_t> n_keep(n);
    std::vector<uint32_t> cap(n);
    std::vector<int32_t>  evicting;
    for (int32_t i = 0; i < n; ++i) {
        const auto & L = layers[i];
        const uint32_t n_used = llama_kvp_kv_access::n_used(*L.kv);
        cap[i]    = capacity_for(L.budget);
        n_keep[i] = std::min<uint32_t>(L.budget, (cap[i] > n_tokens ? cap[i] - n_tokens : 0));
        if (n_used > n_keep[i] && (evict_all || n_used + n_tokens > cap[i])) {
            evicting.push_back(i);
        }
    }
    // what the evictions read of the observations, for every layer at once (one transfer from device memory); the
    // copies live for this pass
    const bool prefetch = st && !evicting.empty() && stage_score->observes();
    if (prefetch) {
        const int32_t n_rows = stage_score->uses_values(policy) ? 3 : stage_score->uses_last(policy) ? 2 : 1;
        llama_kvp_obs_prefetch(st, evicting, n_rows, stage_fate->uses_query_entropy(policy));
        if (stage_fate->uses_query_entropy(policy)) {
            llama_kvp_obs_query_entropy_layers(st, evicting, (int32_t) (n_tokens > 1 ? cparams.n_threads_batch : cparams.n_threads));
        }
    }
    for (int32_t i : evicting) {
        evict(i, n_keep[i]);
    }
    if (prefetch) {
        llama_kvp_obs_prefetch_clear(st);
    }
    for (int32_t i = 0; i < n; ++i) {
        if (cap[i] != layers[i].capacity) {
            resize(i, cap[i]);
        }
    }
    stage_fate->after_evictions(*this);
}

void llama_kvp_memory::ubatch_done(const llama_ubatch & ubatch) {
    const bool ends = ubatch.n_tokens > 1 && llama_kvp_reads_logits(st, ubatch, ubatch.n_tokens - 1); // a prompt's end
    if (!ends || guiding || !stage_fate->settles_prompt_end()) {
        return;
    }
    // what the next step's preparation would do first, with the same budgets and observations (a decode step or a
    // chunk then finds nothing to evict)
    llama_kvp_perf_scope t(st, &llama_kvp_perf_data::t_settle_ms);
    decide_budgets();
    ubatch_ends = true;
    evict_layers(1, true);
    ubatch_ends = false;
}

void llama_kvp_memory::cells_in_order(int32_t ikv, std::vector<llama_kvp_cell> & cells) {
    auto & L = layers[ikv];
    const llama_kv_cache & kv = *L.kv;
    const uint32_t size = kv.get_size();
    if (L.order_pos.size() != size) {
        L.order.clear();
        L.order_pos.assign(size, -1);
    }
    const auto by_pos = [](const llama_kvp_cell & a, const llama_kvp_cell & b) { return a.pos < b.pos; };

    // the cells' positions, read once
    std::vector<llama_pos> pos(size);
    llama_kvp_kv_access::cell_positions(kv, size, pos.data());

    // the cells whose token has no entry: placed since the last eviction (or moved, or reloaded)
    std::vector<llama_kvp_cell> fresh;
    uint32_t n_known = 0;
    for (uint32_t i = 0; i < size; ++i) {
        if (pos[i] < 0) {
            continue;
        }
        if (L.order_pos[i] == pos[i]) {
            n_known++;
        } else {
            fresh.push_back({ pos[i], i, 0.0f });
        }
    }
    // the entries still held, in their order; the others are dropped
    cells.resize(n_known + fresh.size());
    size_t n_held = 0;
    for (const auto & c : L.order) {
        if (pos[c.idx] == c.pos) {
            if (n_held < n_known) {
                cells[n_held] = { c.pos, c.idx, 0.0f };
            }
            n_held++;
        } else if (L.order_pos[c.idx] == c.pos) {
            L.order_pos[c.idx] = -1;
        }
    }
    if (n_held == n_known) {
        std::sort(fresh.begin(), fresh.end(), by_pos);
        std::copy(fresh.begin(), fresh.end(), cells.begin() + n_known);
        std::inplace_merge(cells.begin(), cells.begin() + n_known, cells.end(), by_pos);
    } else {
        // entries out of step with the cells (not expected): sort the layer afresh
        cells.clear();
        for (uint32_t i = 0; i < size; ++i) {
            if (pos[i] >= 0) {
                cells.push_back({ pos[i], i, 0.0f });
            }
        }
        std::sort(cells.begin(), cells.end(), by_pos);
        L.order_pos.assign(size, -1);
    }
    for (const auto & c : cells) {
        L.order_pos[c.idx] = c.pos;
    }
    L.order = cells;
}

void llama_kvp_memory::evict(int32_t ikv, uint32_t n_keep) {
    auto & L = layers[ikv];
    llama_kv_cache & kv = *L.kv;

    // the layer's tokens in position order
    std::vector<llama_kvp_cell> cells;
    cells_in_order(ikv, cells);
    const uint32_t n = (uint32_t) cells.size();
    if (n <= n_keep) {
        return;
    }

    // protected tokens: the first n_sink and the last n_recent (the score stage decides how many)
    uint32_t n_sink   = 0;
    uint32_t n_recent = 0;
    stage_score->protect(policy, L.budget, n_sink, n_recent);

    // room for the cells the fate stage adds back (they count against the budget): the smallest n_keep whose
    // leavers' additions fit, never below the protected tokens
    const uint32_t n_keep0    = n_keep;
    const uint32_t n_keep_min = std::min(n_keep, std::max<uint32_t>(1, n_sink + n_recent));
    for (int iter = 0; iter < 8; ++iter) {
        const uint32_t add = stage_fate->n_added(*this, ikv, n - n_keep);
        const uint32_t k   = std::max(n_keep_min, n_keep0 > add ? n_keep0 - add : 0);
        if (k >= n_keep) {
            break;
        }
        n_keep = k;
    }

    llama_kvp_clamp_protected(n_keep, n_sink, n_recent);

    // scores of the middle tokens: the score stage's view of the accumulated observed mass (0 for a token not
    // observed yet)
    const uint32_t i0 = n_sink;
    const uint32_t i1 = n - n_recent;
    const uint32_t n_topk = n_keep - n_sink - n_recent;
    if (n_topk > 0 && st && stage_score->observes()) {
        std::vector<float> acc;
        std::vector<float> last;
        std::vector<float> value;
        std::vector<llama_pos> obs_pos;
        const bool use_last   = stage_score->uses_last(policy);
        const bool use_values = stage_score->uses_values(policy);
        llama_kvp_obs_layer_scores(st, ikv, acc, obs_pos, use_last ? &last : nullptr, use_values ? &value : nullptr);
        for (auto & c : cells) {
            const bool seen = c.idx < acc.size() && obs_pos[c.idx] == c.pos;
            c.score = seen ? acc[c.idx] : 0.0f;
            c.last  = seen && use_last ? last[c.idx] : c.score;
            c.value = seen && use_values ? value[c.idx] : 0.0f; // a token not observed scores 0 whatever its norm
        }
        if (use_values) {
            value_norms(ikv, cells);
        }
        if (i1 > i0) {
            stage_score->score(policy, ikv, (int32_t) layers.size(), i0, i1, n_topk, cells);
            stage_fate->rescore(*this, ikv, i0, i1, cells);
        }
    }

    // keep the n_topk best of the middle (ties: the newer token); the others leave the layer (the fate stage)
    const std::vector<uint32_t> mid = llama_kvp_rank_middle(cells, i0, i1, n_topk);
    if (n_topk < mid.size()) {
        std::vector<llama_kvp_cell> leaving;
        for (size_t j = n_topk; j < mid.size(); ++j) {
            leaving.push_back(cells[mid[j]]);
        }
        // the exact prefix ends at the first position that leaves
        pos_exact = std::min({ pos_exact, pos_end, leaving[0].pos });
        stage_fate->leave(*this, ikv, leaving);
        L.n_evicted += (int64_t) leaving.size();
        n_evicted   += (int64_t) leaving.size();
    }
}

void llama_kvp_memory::value_norms(int32_t ikv, std::vector<llama_kvp_cell> & cells) {
    auto & L = layers[ikv];
    std::vector<uint32_t> miss;
    std::vector<size_t>   miss_cell;
    for (size_t i = 0; i < cells.size(); ++i) {
        if (!std::isfinite(cells[i].value)) {
            miss.push_back(cells[i].idx);
            miss_cell.push_back(i);
        }
    }
    if (miss.empty()) {
        return;
    }
    const uint32_t size    = L.kv->get_size();
    ggml_tensor  * vt      = llama_kvp_kv_access::layer_v(*L.kv, 0);
    const bool     v_trans = !cparams.flash_attn; // as the memory made its caches
    const int64_t  n_embd  = vt->ne[0];
    const int64_t  n_head  = std::max<int64_t>(1, model.hparams.n_head_kv(L.il));
    const int64_t  d       = n_embd/n_head;
    const size_t   nb      = llama_kvp_cell_bytes(vt, v_trans);
    std::vector<uint8_t> raw(miss.size()*nb);
    llama_kvp_cells_read(vt, v_trans, size, miss, raw.data());
    std::vector<float> row(n_embd);
    for (size_t i = 0; i < miss.size(); ++i) {
        llama_kvp_row_to_f32(vt->type, raw.data() + i*nb, row.data(), n_embd);
        double sum = 0.0;
        for (int64_t h = 0; h < n_head; ++h) {
            double s2 = 0.0;
            for (int64_t e = h*d; e < (h + 1)*d; ++e) {
                s2 += (double) row[e]*row[e];
            }
            sum += std::sqrt(s2);
        }
        cells[miss_cell[i]].value = std::isfinite(sum) ? (float) (sum/n_head) : 0.0f;
    }
}

void llama_kvp_memory::cell_free(int32_t ikv, uint32_t idx) {
    auto & L = layers[ikv];
    const llama_pos p = llama_kvp_kv_access::cell_pos(*L.kv, idx);
    if (p < 0) {
        return;
    }
    if (L.bias.erase(p) > 0) {
        L.bias_cells.clear();
    }
    llama_kvp_kv_access::cell_rm(*L.kv, idx);
}

int32_t llama_kvp_memory::cell_place(int32_t ikv, llama_pos pos, float bias) {
    auto & L = layers[ikv];
    const uint32_t size = L.kv->get_size();
    for (uint32_t i = 0; i < size; ++i) {
        if (llama_kvp_kv_access::cell_pos(*L.kv, i) < 0) {
            llama_kvp_kv_access::cell_set(*L.kv, i, pos, seq_cur);
            L.bias[pos] = bias;
            L.bias_cells.clear();
            if (st) {
                llama_kvp_obs_layer_forget(st, ikv, pos, pos + 1); // a new token in this cell: not observed yet
            }
            return (int32_t) i;
        }
    }
    return -1;
}

void llama_kvp_memory::cells_restore(int32_t ikv, const std::vector<llama_pos> & pos, std::vector<int32_t> & idx) {
    auto & L = layers[ikv];
    const uint32_t size = L.kv->get_size();
    idx.assign(pos.size(), -1);
    uint32_t j = 0;
    for (size_t i = 0; i < pos.size(); ++i) {
        while (j < size && llama_kvp_kv_access::cell_pos(*L.kv, j) >= 0) {
            j++;
        }
        if (j == size) {
            break;
        }
        llama_kvp_kv_access::cell_set(*L.kv, j, pos[i], seq_cur);
        idx[i] = (int32_t) j++;
    }
}

uint32_t llama_kvp_memory::n_room(int32_t ikv, uint32_t n_tokens) const {
    const auto & L = layers[ikv];
    const uint32_t n_used = llama_kvp_kv_access::n_used(*L.kv);
    const uint32_t cap    = L.kv->get_size();
    const uint32_t n_keep = std::min<uint32_t>(L.budget, cap > n_tokens ? cap - n_tokens : 0);
    return n_keep > n_used ? n_keep - n_used : 0;
}

void llama_kvp_memory::compact(int32_t ikv) {
    auto & L = layers[ikv];
    const uint32_t size = L.kv->get_size();
    std::vector<uint32_t> from;
    std::vector<uint32_t> to;
    from.reserve(size/2); // at most half the cells move
    to.reserve(size/2);
    uint32_t lo = 0;
    uint32_t hi = size;
    while (true) {
        while (lo < size && llama_kvp_kv_access::cell_pos(*L.kv, lo) >= 0) {
            lo++;
        }
        while (hi > 0 && llama_kvp_kv_access::cell_pos(*L.kv, hi - 1) < 0) {
            hi--;
        }
        if (hi == 0 || lo >= hi - 1) {
            break;
        }
        from.push_back(--hi);
        to.push_back(lo++);
    }
    if (from.empty()) {
        return;
    }
    ggml_tensor * kt = llama_kvp_kv_access::layer_k(*L.kv, 0);
    ggml_tensor * vt = llama_kvp_kv_access::layer_v(*L.kv, 0);
    const bool v_trans = !cparams.flash_attn;
    std::vector<uint8_t> kb(from.size()*llama_kvp_cell_bytes(kt, false));
    std::vector<uint8_t> vb(from.size()*llama_kvp_cell_bytes(vt, v_trans));
    llama_kvp_cells_read(kt, false,   size, from, kb.data());
    llama_kvp_cells_read(vt, v_trans, size, from, vb.data());
    llama_kvp_cells_write(kt, false,   size, to, kb.data());
    llama_kvp_cells_write(vt, v_trans, size, to, vb.data());

    std::vector<float>     acc;
    std::vector<float>     last;
    std::vector<float>     value;
    std::vector<llama_pos> obs_pos;
    const bool use_last   = stage_score && stage_score->uses_last(policy);
    const bool use_values = stage_score && stage_score->uses_values(policy);
    if (st) {
        llama_kvp_obs_layer_scores(st, ikv, acc, obs_pos, use_last ? &last : nullptr, use_values ? &value : nullptr);
    }
    std::vector<llama_pos> to_pos(from.size());
    std::vector<float>     to_score(from.size());
    std::vector<float>     to_last(from.size());
    std::vector<float>     to_value(from.size());
    for (size_t i = 0; i < from.size(); ++i) {
        const llama_pos p = llama_kvp_kv_access::cell_pos(*L.kv, from[i]);
        llama_kvp_kv_access::cell_rm(*L.kv, from[i]);
        llama_kvp_kv_access::cell_set(*L.kv, to[i], p, seq_cur);
        const bool seen = from[i] < acc.size() && obs_pos[from[i]] == p;
        to_pos[i]   = p;
        to_score[i] = seen ? acc[from[i]]  : 0.0f;
        to_last[i]  = seen && use_last ? last[from[i]] : 0.0f;
        to_value[i] = seen && use_values ? value[from[i]] : 0.0f; // a token not observed scores 0 whatever its norm
    }
    if (st) {
        llama_kvp_obs_cells_set_score(st, ikv, to.data(), to_pos.data(), to_score.data(), to.size(),
                                      use_last ? to_last.data() : nullptr, use_values ? to_value.data() : nullptr);
    }
}

bool llama_kvp_memory::off_host() const {
    for (const auto & L : layers) {
        const ggml_tensor * k = llama_kvp_kv_access::layer_k(*L.kv, 0);
        if (k && k->buffer && !ggml_backend_buffer_is_host(k->buffer)) {
            return true;
        }
    }
    return false;
}

void llama_kvp_memory::mask_add_bias(int32_t ikv, void * data, bool f16, int64_t n_kv, int64_t n_rows) const {
    const auto & L = layers[ikv];
    if (L.bias.empty()) {
        return;
    }
    // the cells of the biased positions: the last ones found while they still hold them, else a scan (every change
    // of `bias` empties bias_cells, so only the cells can have moved: a resize, a compaction, a state load)
    bool valid = L.bias_cells.size() == L.bias.size();
    for (size_t i = 0; valid && i < L.bias_cells.size(); ++i) {
        const auto & c = L.bias_cells[i];
        valid = llama_kvp_kv_access::cell_pos(*L.kv, c.idx) == c.pos;
    }
    if (!valid) {
        L.bias_cells.clear();
        const uint32_t size = L.kv->get_size();
        for (uint32_t j = 0; j < size; ++j) {
            const llama_pos p = llama_kvp_kv_access::cell_pos(*L.kv, j);
            const auto it = p >= 0 ? L.bias.find(p) : L.bias.end();
            if (it != L.bias.end()) {
                L.bias_cells.push_back({ j, p, it->second });
            }
        }
    }
    for (const auto & c : L.bias_cells) {
        if ((int64_t) c.idx >= n_kv) {
            continue;
        }
        for (int64_t r = 0; r < n_rows; ++r) {
            if (f16) {
                ggml_fp16_t * m = (ggml_fp16_t *) data + r*n_kv + c.idx;
                const float x = ggml_fp16_to_fp32(*m);
                if (std::isfinite(x)) {
                    *m = ggml_fp32_to_fp16(x + c.bias);
                }
            } else {
                float * m = (float *) data + r*n_kv + c.idx;
                if (std::isfinite(*m)) {
                    *m += c.bias;
                }
            }
        }
    }
}

void llama_kvp_memory::resize(int32_t ikv, uint32_t size) {
    stage_fate->before_resize(*this, ikv);
    auto & L = layers[ikv];
    auto kv_new = make_cache(L.il, size);

    // both caches exist for a moment: that is the peak of a resize
    int64_t new_bytes = 0;
    for (const auto & [buft, sz] : kv_new->memory_breakdown()) {
        new_bytes += (int64_t) sz;
    }
    note_bytes(new_bytes);

    // where each old cell's token lands (by position: one sequence, positions are unique)
    std::map<llama_pos, uint32_t> old_idx;
    const uint32_t old_size = L.kv->get_size();
    for (uint32_t i = 0; i < old_size; ++i) {
        const llama_pos p = llama_kvp_kv_access::cell_pos(*L.kv, i);
        if (p >= 0) {
            old_idx[p] = i;
        }
    }
    if (!old_idx.empty()) {
        std::vector<uint8_t> buf;
        llama_kvp_io_write w(buf);
        L.kv->state_write(w, -1, 0);
        llama_kvp_io_read r(buf);
        kv_new->state_read(r, -1, 0);
    }
    std::vector<int32_t> remap(size, -1); // new cell -> old cell
    for (uint32_t j = 0; j < size; ++j) {
        const llama_pos p = llama_kvp_kv_access::cell_pos(*kv_new, j);
        auto it = p >= 0 ? old_idx.find(p) : old_idx.end();
        if (it != old_idx.end()) {
            remap[j] = (int32_t) it->second;
        }
    }

    L.kv       = std::move(kv_new);
    L.capacity = size;
    n_resize++;

    if (st) {
        llama_kvp_obs_layer_resize(st, ikv, size, remap);
    }
}

//
// llama_memory_i
//

llama_memory_context_ptr llama_kvp_memory::init_batch(llama_batch_allocr & balloc, uint32_t n_ubatch, bool embd_all) {
    GGML_UNUSED(embd_all);

    // each token in one sequence: a ubatch is placed into the caches of the one sequence its tokens belong to
    const llama_batch & batch = balloc.get_batch();
    for (int32_t i = 0; n_seq() > 1 && i < batch.n_tokens; ++i) {
        if (batch.n_seq_id && batch.n_seq_id[i] != 1) {
            llama_kvp_set_error("a retention policy with several sequences places each token in exactly one sequence (token " +
                    std::to_string(i) + " is in " + std::to_string(batch.n_seq_id[i]) + ")");
            LLAMA_LOG_ERROR("%s: pykvcache: token %d of the batch is in %d sequences; with a retention policy each token is in one\n",
                    __func__, i, batch.n_seq_id[i]);
            return std::make_unique<llama_kvp_memory_context>(LLAMA_MEMORY_STATUS_FAILED_PREPARE);
        }
        if (batch.seq_id && (batch.seq_id[i][0] < 0 || (uint32_t) batch.seq_id[i][0] >= n_seq())) {
            llama_kvp_set_error("sequence id " + std::to_string(batch.seq_id[i][0]) + " is out of range: this context holds " +
                    std::to_string(n_seq()) + " sequences (n_seq_max)");
            LLAMA_LOG_ERROR("%s: pykvcache: sequence id %d of token %d is out of range (n_seq_max = %u)\n",
                    __func__, batch.seq_id[i][0], i, n_seq());
            return std::make_unique<llama_kvp_memory_context>(LLAMA_MEMORY_STATUS_FAILED_PREPARE);
        }
    }

    balloc.split_reset();
    std::vector<llama_ubatch> ubatches;
    const uint32_t n_split = std::max<uint32_t>(1, std::min(n_ubatch, chunk + (guiding ? n_guide : 0)));
    while (true) {
        auto ubatch = n_seq() > 1 ? balloc.split_seq(n_split) : balloc.split_simple(n_split);
        if (ubatch.n_tokens == 0) {
            break;
        }
        ubatches.push_back(std::move(ubatch)); // NOLINT
    }
    if (ubatches.empty() || balloc.get_n_used() < balloc.get_n_tokens()) {
        return std::make_unique<llama_kvp_memory_context>(LLAMA_MEMORY_STATUS_FAILED_PREPARE);
    }
    return std::make_unique<llama_kvp_memory_context>(this, std::move(ubatches));
}

llama_memory_context_ptr llama_kvp_memory::init_full() {
    return std::make_unique<llama_kvp_memory_context>(this);
}

llama_memory_context_ptr llama_kvp_memory::init_update(llama_context * lctx, bool optimize) {
    GGML_UNUSED(lctx);
    GGML_UNUSED(optimize);
    return std::make_unique<llama_kvp_memory_context>(LLAMA_MEMORY_STATUS_NO_UPDATE);
}

bool llama_kvp_memory::get_can_shift() const {
    return false;
}

// makes a sequence current for a scope, then the one that was
struct llama_kvp_seq_scope {
    llama_kvp_seq_scope(llama_kvp_memory & mem, llama_seq_id s) : mem(mem), prev(mem.seq_cur) { mem.seq_use(s); }
    ~llama_kvp_seq_scope() { mem.seq_use(prev); }

    llama_kvp_memory & mem;
    llama_seq_id       prev;
};

void llama_kvp_memory::clear(bool data) {
    for (uint32_t s = 0; s < n_seq(); ++s) {
        llama_kvp_seq_scope scope(*this, (llama_seq_id) s);
        clear_cur(data);
    }
}

void llama_kvp_memory::clear_cur(bool data) {
    for (auto & L : layers) {
        L.kv->clear(data);
        L.bias.clear();
        L.bias_cells.clear();
    }
    stage_fate->forget(*this, 0, -1);
    if (stage_schedule) {
        stage_schedule->forget(*this, 0, -1);
    }
    pos_end   = 0;
    pos_exact = LLAMA_KVP_POS_ALL;
    budgets_set = false;
    if (st) {
        llama_kvp_obs_reset(st);
    }
}

bool llama_kvp_memory::seq_rm(llama_seq_id seq_id, llama_pos p0, llama_pos p1) {
    bool res = true;
    for (uint32_t s = 0; s < n_seq(); ++s) {
        if (seq_id < 0 || (llama_seq_id) s == seq_id) {
            llama_kvp_seq_scope scope(*this, (llama_seq_id) s);
            res = seq_rm_cur(p0, p1) && res;
        }
    }
    return res;
}

bool llama_kvp_memory::seq_rm_cur(llama_pos p0, llama_pos p1) {
    bool res = true;
    for (size_t i = 0; i < layers.size(); ++i) {
        if (st) {
            llama_kvp_obs_layer_forget(st, (int32_t) i, p0, p1); // a later token in the same cell starts unscored
        }
        if (p0 <= 0 && p1 < 0) {
            // the current sequence's caches hold only its tokens: emptied as a fresh context's (cells from the
            // first, K/V zeroed), so that a prompt repeated gives the same result: block-sparse prefill pools the
            // keys of blocks of cells by index, empty cells included
            layers[i].kv->clear(true);
        } else {
            res = layers[i].kv->seq_rm(-1, p0, p1) && res;
        }
        auto & bias = layers[i].bias;
        for (auto it = bias.lower_bound(std::max<llama_pos>(p0, 0)); it != bias.end() && (p1 < 0 || it->first < p1); ) {
            it = bias.erase(it);
            layers[i].bias_cells.clear();
        }
    }
    stage_fate->forget(*this, p0, p1);
    if (stage_schedule) {
        stage_schedule->forget(*this, p0, p1);
    }
    // a truncation moves the logical end back; removing a middle range leaves a hole in the exact prefix
    const llama_pos a = std::max<llama_pos>(p0, 0);
    if (p1 < 0 || p1 >= pos_end) {
        pos_end   = std::min(pos_end, a);
        pos_exact = pos_exact >= a ? LLAMA_KVP_POS_ALL : pos_exact;
    } else if (a < p1) {
        pos_exact = std::min(pos_exact, a);
    }
    if (pos_end <= 0) {
        budgets_set = false;
        if (st) {
            llama_kvp_obs_reset(st);
        }
    }
    return res;
}

void llama_kvp_memory::seq_cp(llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1) {
    GGML_UNUSED(p0);
    GGML_UNUSED(p1);
    if (seq_id_src == seq_id_dst) {
        return;
    }
    llama_kvp_set_error("a retention policy keeps each sequence's tokens in caches of its own: seq_cp is not supported");
    LLAMA_LOG_ERROR("%s: pykvcache: a retention policy keeps each sequence's tokens in caches of its own, seq_cp(%d -> %d) ignored\n", __func__, seq_id_src, seq_id_dst);
}

void llama_kvp_memory::seq_keep(llama_seq_id seq_id) {
    for (uint32_t s = 0; s < n_seq(); ++s) {
        if ((llama_seq_id) s != seq_id) {
            llama_kvp_seq_scope scope(*this, (llama_seq_id) s);
            clear_cur(true);
        }
    }
}

void llama_kvp_memory::seq_add(llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos shift) {
    if (shift == 0) {
        return;
    }
    llama_kvp_set_error("a pruned KV cache cannot shift positions (seq_add): the keys are stored after RoPE");
    LLAMA_LOG_ERROR("%s: pykvcache: a pruned KV cache cannot shift positions, seq_add(%d, %d, %d, %d) ignored\n", __func__, seq_id, p0, p1, shift);
}

void llama_kvp_memory::seq_div(llama_seq_id seq_id, llama_pos p0, llama_pos p1, int d) {
    if (d == 1) {
        return;
    }
    llama_kvp_set_error("a pruned KV cache cannot divide positions (seq_div): the keys are stored after RoPE");
    LLAMA_LOG_ERROR("%s: pykvcache: a pruned KV cache cannot divide positions, seq_div(%d, %d, %d, %d) ignored\n", __func__, seq_id, p0, p1, d);
}

llama_pos llama_kvp_memory::seq_pos_min(llama_seq_id seq_id) const {
    llama_pos res = -1;
    if (n_seq() > 1 && (seq_id < 0 || seq_id >= (llama_seq_id) n_seq())) {
        return res;
    }
    for (const auto & L : layers_of(n_seq() > 1 ? seq_id : seq_cur)) {
        const llama_pos p = L.kv->seq_pos_min(seq_id);
        if (p >= 0) {
            res = res < 0 ? p : std::min(res, p);
        }
    }
    return res;
}

llama_pos llama_kvp_memory::seq_pos_max(llama_seq_id seq_id) const {
    // the logical end, not the last cell held: the next token goes at pos_end whatever the policy evicted
    if (n_seq() == 1 || seq_id == seq_cur) {
        return pos_end - 1;
    }
    return seq_id >= 0 && seq_id < (llama_seq_id) n_seq() ? seqs[seq_id].pos_end - 1 : -1;
}

std::map<ggml_backend_buffer_type_t, size_t> llama_kvp_memory::memory_breakdown() const {
    std::map<ggml_backend_buffer_type_t, size_t> res;
    for (size_t s = 0; s < std::max<size_t>(1, seqs.size()); ++s) {
        for (const auto & L : layers_of((llama_seq_id) s)) {
            if (!L.kv) {
                continue;
            }
            for (const auto & [buft, size] : L.kv->memory_breakdown()) {
                res[buft] += size;
            }
        }
    }
    return res;
}

// the state of a whole context of several sequences: this magic, the sequence count, then each sequence's state
static constexpr uint32_t LLAMA_KVP_STATE_MAGIC_SEQS = 0x5350564b; // "KVPS"

void llama_kvp_memory::state_write(llama_io_write_i & io, llama_seq_id seq_id, llama_state_seq_flags flags) const {
    if (n_seq() == 1) {
        state_write_cur(io, seq_id, flags);
        return;
    }
    // writing visits each sequence's state through the current one, and leaves the current one as it was
    auto * self = const_cast<llama_kvp_memory *>(this);
    if (seq_id >= 0) {
        GGML_ASSERT(seq_id < (llama_seq_id) n_seq());
        llama_kvp_seq_scope scope(*self, seq_id);
        state_write_cur(io, seq_id, flags);
        return;
    }
    const uint32_t hdr[2] = { LLAMA_KVP_STATE_MAGIC_SEQS, n_seq() };
    io.write(hdr, sizeof(hdr));
    for (uint32_t s = 0; s < n_seq(); ++s) {
        llama_kvp_seq_scope scope(*self, (llama_seq_id) s);
        state_write_cur(io, -1, flags);
    }
}

void llama_kvp_memory::state_read(llama_io_read_i & io, llama_seq_id seq_id, llama_state_seq_flags flags) {
    // llama.cpp logs the reason and returns a failure; our reason is also kept for the caller (llama_kvp_last_error)
    llama_kvp_clear_error();
    try {
        if (n_seq() == 1) {
            state_read_cur(io, seq_id, flags);
            return;
        }
        if (seq_id >= 0) {
            if (seq_id >= (llama_seq_id) n_seq()) {
                throw std::runtime_error("pykvcache: sequence id " + std::to_string(seq_id) + " is out of range: this context holds " +
                        std::to_string(n_seq()) + " sequences");
            }
            llama_kvp_seq_scope scope(*this, seq_id);
            state_read_cur(io, seq_id, flags);
            return;
        }
        uint32_t hdr[2] = {};
        io.read(hdr, sizeof(hdr));
        if (hdr[0] != LLAMA_KVP_STATE_MAGIC_SEQS && hdr[0] != LLAMA_KVP_STATE_MAGIC) {
            throw std::runtime_error("pykvcache: this state was not saved by a context with a retention policy (per-layer KV cache)");
        }
        if (hdr[0] != LLAMA_KVP_STATE_MAGIC_SEQS || hdr[1] != n_seq()) {
            throw std::runtime_error("pykvcache: this state holds " + std::string(hdr[0] == LLAMA_KVP_STATE_MAGIC_SEQS ? std::to_string(hdr[1]) : "1") +
                    " sequence(s), this context holds " + std::to_string(n_seq()) + " (n_seq_max)");
        }
        for (uint32_t s = 0; s < n_seq(); ++s) {
            llama_kvp_seq_scope scope(*this, (llama_seq_id) s);
            state_read_cur(io, -1, flags);
        }
    } catch (const std::exception & e) {
        if (strncmp(e.what(), "pykvcache: ", 11) == 0) { // ours; llama.cpp's own ("failed to restore kv cache") say less
            llama_kvp_set_error(e.what());
        }
        throw;
    }
}

void llama_kvp_memory::state_write_cur(llama_io_write_i & io, llama_seq_id seq_id, llama_state_seq_flags flags) const {
    const uint32_t hdr[6] = { LLAMA_KVP_STATE_MAGIC, LLAMA_KVP_STATE_VERSION, (uint32_t) policy.type, (uint32_t) layers.size(),
                              budget, (uint32_t) n_prompt };
    io.write(hdr, sizeof(hdr));
    uint32_t stages[LLAMA_KVP_SLOT_COUNT];
    for (int32_t slot = 0; slot < LLAMA_KVP_SLOT_COUNT; ++slot) {
        stages[slot] = (uint32_t) policy.stage[slot];
    }
    io.write(stages, sizeof(stages));
    // the whole policy: a state decided under other keys (another budget, bin, limit) is refused
    const std::string spec = llama_kvp_policy_str(policy);
    const uint32_t n_spec = (uint32_t) spec.size();
    io.write(&n_spec, sizeof(n_spec));
    io.write(spec.data(), n_spec);
    const llama_pos ends[2] = { pos_end, pos_exact };
    io.write(ends, sizeof(ends));
    const int32_t steps[2] = { n_since_prompt, n_steps_total };
    io.write(steps, sizeof(steps));
    for (const auto & L : layers) {
        const uint32_t lb[2] = { L.budget, L.capacity };
        io.write(lb, sizeof(lb));
    }
    // the observation state (window queries, prompt entropies, counters), so that a loaded context decides as this one
    std::vector<uint8_t> blob;
    const bool obs = st && st->observing();
    if (obs) {
        llama_kvp_obs_state_write(st, blob);
    }
    state_write_blob(io, blob);
    for (size_t i = 0; i < layers.size(); ++i) {
        const auto & L = layers[i];

        // the cells' layout (llama.cpp's own load places a cache's cells from cell 0): loaded where they were, the
        // cells are attended in the same order (a quantized cache rounds the same), the next tokens land in the same
        // cells, and the per-cell observation state below applies as it is
        std::vector<uint32_t> used;
        for (uint32_t j = 0; j < L.kv->get_size(); ++j) {
            if (llama_kvp_kv_access::cell_pos(*L.kv, j) >= 0) {
                used.push_back(j);
            }
        }
        const uint32_t lay[2] = { llama_kvp_kv_access::head(*L.kv), (uint32_t) used.size() };
        io.write(lay, sizeof(lay));
        io.write(used.data(), used.size()*sizeof(uint32_t));
        L.kv->state_write(io, seq_id, flags);
        io.write(&L.entropy, sizeof(L.entropy));
        io.write(&L.n_evicted, sizeof(L.n_evicted));

        blob.clear();
        if (obs) {
            llama_kvp_obs_layer_state_write(st, (int32_t) i, blob);
        }
        state_write_blob(io, blob);

        // the mask biases of the fate stage's cells, by position
        const uint32_t nb = (uint32_t) layers[i].bias.size();
        io.write(&nb, sizeof(nb));
        for (const auto & [p, b] : layers[i].bias) {
            io.write(&p, sizeof(p));
            io.write(&b, sizeof(b));
        }

        // the fate stage's tokens of the layer (the host tier)
        blob.clear();
        stage_fate->state_write(*this, (int32_t) i, blob);
        state_write_blob(io, blob);

        // the schedule stage's state of the layer (the freeze's counts)
        blob.clear();
        if (stage_schedule) {
            stage_schedule->state_write(*this, (int32_t) i, blob);
        }
        state_write_blob(io, blob);

        // the prefill stage's state of the layer (sparse prefill's entropies and budgets, which a prompt's next
        // ubatch starts from)
        blob.clear();
        if (st) {
            stage_prefill->state_write(st, (int32_t) i, blob);
        }
        state_write_blob(io, blob);
    }
}

void llama_kvp_memory::state_write_blob(llama_io_write_i & io, const std::vector<uint8_t> & blob) {
    const uint64_t n = blob.size();
    io.write(&n, sizeof(n));
    if (n > 0) {
        io.write(blob.data(), blob.size());
    }
}

std::vector<uint8_t> llama_kvp_memory::state_read_blob(llama_io_read_i & io, const char * what) {
    uint64_t n = 0;
    io.read(&n, sizeof(n));
    if (n > ((uint64_t) 1 << 40)) {
        throw std::runtime_error(std::string("pykvcache: corrupt ") + what + " in the state");
    }
    std::vector<uint8_t> blob(n);
    if (n > 0) {
        io.read(blob.data(), blob.size());
    }
    return blob;
}

void llama_kvp_memory::state_read_cur(llama_io_read_i & io, llama_seq_id seq_id, llama_state_seq_flags flags) {
    uint32_t hdr[6] = {};
    io.read(hdr, 4*sizeof(uint32_t));
    if (hdr[0] == LLAMA_KVP_STATE_MAGIC_SEQS) {
        throw std::runtime_error("pykvcache: this state holds " + std::to_string(hdr[1]) + " sequences (n_seq_max), load it into a context "
                "with as many, or load one sequence's state");
    }
    if (hdr[0] != LLAMA_KVP_STATE_MAGIC) {
        throw std::runtime_error("pykvcache: this state was not saved by a context with a retention policy (per-layer KV cache)");
    }
    if (hdr[1] != LLAMA_KVP_STATE_VERSION) {
        throw std::runtime_error("pykvcache: unsupported state version " + std::to_string(hdr[1]));
    }
    if (hdr[2] != (uint32_t) policy.type || hdr[3] != layers.size()) {
        throw std::runtime_error(std::string("pykvcache: this state was saved with policy '") + llama_kvp_policy_type_name((int32_t) hdr[2]) +
                "' on " + std::to_string(hdr[3]) + " layers, this context has '" + llama_kvp_policy_type_name(policy.type) +
                "' on " + std::to_string(layers.size()) + " layers");
    }
    io.read(hdr + 4, 2*sizeof(uint32_t));
    uint32_t stages[LLAMA_KVP_SLOT_COUNT];
    io.read(stages, sizeof(stages));
    for (int32_t slot = 0; slot < LLAMA_KVP_SLOT_COUNT; ++slot) {
        if (stages[slot] != (uint32_t) policy.stage[slot]) {
            const llama_kvp_stage * saved = llama_kvp_stage_by_id((int32_t) stages[slot]);
            const llama_kvp_stage * ours  = llama_kvp_stage_by_id(policy.stage[slot]);
            throw std::runtime_error(std::string("pykvcache: this state was saved with the ") + llama_kvp_slot_name(slot) + " stage '" +
                    (saved ? saved->name : "none") + "', this context has '" + (ours ? ours->name : "none") + "'");
        }
    }
    uint32_t n_spec = 0;
    io.read(&n_spec, sizeof(n_spec));
    if (n_spec > 65536) {
        throw std::runtime_error("pykvcache: corrupt policy in the state");
    }
    std::string spec(n_spec, '\0');
    io.read(spec.data(), n_spec);
    if (spec != llama_kvp_policy_str(policy)) {
        throw std::runtime_error("pykvcache: this state was saved with the policy '" + spec + "', this context has '" +
                llama_kvp_policy_str(policy) + "'");
    }
    if (hdr[4] == 0 || hdr[4] > cparams.n_ctx_seq) {
        throw std::runtime_error("pykvcache: the saved budget " + std::to_string(hdr[4]) + " does not fit this context");
    }
    llama_pos ends[2] = {};
    io.read(ends, sizeof(ends));
    if (ends[0] < 0 || ends[1] < 0) {
        throw std::runtime_error("pykvcache: corrupt sequence end in the state");
    }
    if ((uint32_t) ends[0] > cparams.n_ctx_seq) {
        throw std::runtime_error("pykvcache: the state holds " + std::to_string(ends[0]) + " positions, more than this context's " +
                std::to_string(cparams.n_ctx_seq) + " (n_ctx per sequence)");
    }
    int32_t steps[2] = {};
    io.read(steps, sizeof(steps));
    budget    = hdr[4];
    n_prompt  = (int32_t) hdr[5];
    pos_end   = ends[0];
    pos_exact = ends[1];
    std::vector<uint32_t> lb(2*layers.size());
    io.read(lb.data(), lb.size()*sizeof(uint32_t));
    for (size_t i = 0; i < layers.size(); ++i) {
        if (lb[2*i + 1] > GGML_PAD(cparams.n_ctx_seq, n_pad) || lb[2*i + 1] == 0) {
            throw std::runtime_error("pykvcache: the saved layer capacity " + std::to_string(lb[2*i + 1]) + " does not fit this context");
        }
    }
    n_since_prompt = steps[0];
    n_steps_total  = steps[1];
    const bool obs = st && st->observing();
    std::vector<uint8_t> blob = state_read_blob(io, "observation state");
    if (obs != !blob.empty()) {
        throw std::runtime_error("pykvcache: corrupt observation state in the state");
    }
    if (obs) {
        llama_kvp_obs_reset(st);
        size_t off = 0;
        llama_kvp_obs_state_read(st, blob, off);
    }
    // the stages' own state, from the state below (the fate stage's pending bins or host tier, the freeze's counts);
    // the freeze's recovery ladder restarts its statistics
    stage_fate->forget(*this, 0, -1);
    if (stage_schedule) {
        stage_schedule->forget(*this, 0, -1);
    }
    for (size_t i = 0; i < layers.size(); ++i) {
        auto & L = layers[i];
        L.budget = lb[2*i];
        if (L.capacity != lb[2*i + 1]) {
            L.kv->clear(true);
            resize((int32_t) i, lb[2*i + 1]);
        }
        uint32_t lay[2] = {};
        io.read(lay, sizeof(lay));
        if (lay[1] > L.capacity || lay[0] > L.capacity) {
            throw std::runtime_error("pykvcache: corrupt cell layout in the state");
        }
        llama_kv_cache::slot_info_vec_t sinfos(1);
        sinfos[0].resize(1);
        sinfos[0].idxs[0].resize(lay[1]);
        io.read(sinfos[0].idxs[0].data(), lay[1]*sizeof(uint32_t));
        for (uint32_t k = 0; k < lay[1]; ++k) {
            if (sinfos[0].idxs[0][k] >= L.capacity || (k > 0 && sinfos[0].idxs[0][k] <= sinfos[0].idxs[0][k - 1])) {
                throw std::runtime_error("pykvcache: corrupt cell layout in the state");
            }
        }
        // loaded as one sequence's cells into the cells they held (llama.cpp's restore of a sequence into a given layout)
        L.kv->clear(true);
        L.kv->state_read_sinfo(io, seq_cur, flags, nullptr, lay[1] > 0 ? &sinfos : nullptr);
        llama_kvp_kv_access::head_set(*L.kv, lay[0]);
        L.order.clear();
        L.order_pos.clear();
        io.read(&L.entropy, sizeof(L.entropy));
        const int64_t n_evicted_was = L.n_evicted;
        io.read(&L.n_evicted, sizeof(L.n_evicted));
        n_evicted += L.n_evicted - n_evicted_was; // the memory's count stays the sum of its layers'

        blob = state_read_blob(io, "layer observation");
        if (obs != !blob.empty()) {
            throw std::runtime_error("pykvcache: corrupt layer observation in the state");
        }
        if (obs) {
            size_t off = 0;
            llama_kvp_obs_layer_state_read(st, (int32_t) i, blob, off);
        }

        uint32_t nb = 0;
        io.read(&nb, sizeof(nb));
        if (nb > L.capacity) {
            throw std::runtime_error("pykvcache: corrupt mask biases in the state");
        }
        L.bias.clear();
        L.bias_cells.clear();
        for (uint32_t j = 0; j < nb; ++j) {
            llama_pos p = 0;
            float     b = 0.0f;
            io.read(&p, sizeof(p));
            io.read(&b, sizeof(b));
            if (!std::isfinite(b)) {
                throw std::runtime_error("pykvcache: corrupt mask biases in the state");
            }
            L.bias[p] = b;
        }

        blob = state_read_blob(io, "fate-stage data");
        stage_fate->state_read(*this, (int32_t) i, blob);

        blob = state_read_blob(io, "schedule-stage data");
        if (!blob.empty() && !stage_schedule) {
            throw std::runtime_error("pykvcache: corrupt schedule-stage data in the state");
        }
        if (stage_schedule) {
            stage_schedule->state_read(*this, (int32_t) i, blob);
        }

        blob = state_read_blob(io, "prefill-stage data");
        if (st) {
            stage_prefill->state_read(st, (int32_t) i, blob);
        }
    }
    budgets_set = stage_budget->uses_entropy();
}

//
// llama_kvp_memory_context
//

llama_kvp_memory_context::llama_kvp_memory_context(llama_memory_status status) : status(status) {}

llama_kvp_memory_context::llama_kvp_memory_context(llama_kvp_memory * mem) : mem(mem), status(LLAMA_MEMORY_STATUS_SUCCESS) {
    for (auto & L : mem->layers) {
        ctxs.push_back(std::make_unique<llama_kv_cache_context>(L.kv.get()));
    }
}

llama_kvp_memory_context::llama_kvp_memory_context(llama_kvp_memory * mem, std::vector<llama_ubatch> ubatches) :
    mem(mem), status(LLAMA_MEMORY_STATUS_SUCCESS), ubatches(std::move(ubatches)) {
}

bool llama_kvp_memory_context::next() {
    ctxs.clear();
    if (i_cur < ubatches.size()) {
        mem->ubatch_done(ubatches[i_cur]);
    }
    return ++i_cur < ubatches.size();
}

bool llama_kvp_memory_context::apply() {
    if (ubatches.empty()) {
        return true;
    }
    const llama_ubatch & ubatch = ubatches[i_cur];

    mem->seq_use(mem->n_seq() > 1 && ubatch.n_tokens > 0 ? ubatch.seq_id[0][0] : 0);
    {
        llama_kvp_perf_scope t(mem->st, &llama_kvp_perf_data::t_prepare_ms);
        mem->prepare_ubatch(ubatch.n_tokens);
    }
    llama_kvp_perf_scope t(mem->st, &llama_kvp_perf_data::t_slot_ms);
    if (mem->st) {
        mem->st->perf.n_ubatch++;
    }
    ctxs.clear();
    for (auto & L : mem->layers) {
        auto sinfo = L.kv->find_slot(ubatch, false);
        if (sinfo.empty()) {
            LLAMA_LOG_ERROR("%s: pykvcache: no room for %u tokens in the cache of layer %d (%u cells)\n",
                    __func__, ubatch.n_tokens, L.il, L.kv->get_size());
            return false;
        }
        llama_kv_cache::slot_info_vec_t sinfos = { sinfo };
        std::vector<llama_ubatch> ubs = { ubatch };
        auto ctx = std::make_unique<llama_kv_cache_context>(L.kv.get(), std::move(sinfos), std::move(ubs));
        ctx->apply();
        ctxs.push_back(std::move(ctx));
    }
    for (uint32_t i = 0; i < ubatch.n_tokens; ++i) {
        mem->pos_end = std::max(mem->pos_end, ubatch.pos[i] + 1);
    }
    if (ubatch.n_tokens == 1) {
        // a token computed alone (a decode step) rounds otherwise than in a prompt's batch (the CPU's matrix-vector
        // kernels): not what a fresh evaluation of a prompt through it holds (llama-kvp-reuse.cpp)
        mem->pos_exact = std::min(mem->pos_exact, ubatch.pos[0]);
    }
    return true;
}

size_t llama_kvp_memory_context::n_ubatches() const {
    if (ubatches.empty() || !mem || mem->n_seq() == 1) {
        return ubatches.size();
    }
    const llama_seq_id s = ubatches[i_cur].seq_id[0][0];
    size_t res = 0;
    for (const auto & ub : ubatches) {
        res += ub.n_tokens > 0 && ub.seq_id[0][0] == s ? 1 : 0;
    }
    return res;
}

llama_memory_status llama_kvp_memory_context::get_status() const {
    return status;
}

const llama_ubatch & llama_kvp_memory_context::get_ubatch() const {
    return ubatches[i_cur];
}
