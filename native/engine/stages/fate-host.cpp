// fate-host.cpp - fate stage `host` (ASR-KF-EGR's off-accelerator store): a token leaving a layer's cache moves into a
// host-memory tier of that layer instead of being dropped, and can come back into a free cell unchanged.
//
// What moves is the raw bytes of the token's K row and V elements, in the cache's own type (keys are stored after
// RoPE and positions never change, so a token that comes back is bit for bit the token that left). A token sent by
// the budget's eviction is cold: it stays until it is thawed by name (llama_kvp_host_tier_thaw; latent re-ranking and
// the recovery ladder will). A token frozen by the `freeze` schedule carries a timer and thaws by itself. The tier
// holds at most `limit` tokens per layer (0: the context size); past it the coldest are dropped for good: cold tokens
// before frozen ones, each by lowest score.
//
// Moves are batched per layer and call, never one backend call per token: from a cache in host memory the bytes are
// copied in place; from device memory one read (and for a thaw one write) covers the span of cells involved (the
// whole tensor for a transposed V).

#include "llama-kvp-impl.h"
#include "llama-kvp-memory.h"
#include "llama-kvp-stage.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <numeric>
#include <stdexcept>

//
// the per-layer tier
//

struct llama_kvp_host_state : llama_kvp_layer_state {
    std::vector<llama_pos> pos;
    std::vector<float>     score; // accumulated attention mass when it left (restored when it comes back)
    std::vector<int32_t>   timer; // 0: cold; > 0: decode steps until it thaws
    std::vector<int32_t>   t_in;  // the decode step it came in (mem.n_steps_total)
    std::vector<uint8_t>   k;     // row_k bytes per token
    std::vector<uint8_t>   v;     // row_v bytes per token

    size_t row_k = 0;
    size_t row_v = 0;

    int64_t n_freeze  = 0;
    int64_t n_thaw    = 0;
    int64_t n_evict   = 0;
    int64_t n_dropped = 0;
    int64_t n_promote = 0;
    double  t_ms      = 0.0;

    size_t  size()  const { return pos.size(); }
    int64_t bytes() const { return (int64_t) (k.size() + v.size()); }
};

static llama_kvp_host_state & llama_kvp_host_of(llama_kvp_memory & mem, int32_t ikv) {
    auto & L = mem.layers[ikv];
    if (!L.fate) {
        auto S = std::make_unique<llama_kvp_host_state>();
        const bool v_trans = !mem.cparams.flash_attn; // as the memory made its caches
        S->row_k = llama_kvp_cell_bytes(llama_kvp_kv_access::layer_k(*L.kv, 0), false);
        S->row_v = llama_kvp_cell_bytes(llama_kvp_kv_access::layer_v(*L.kv, 0), v_trans);
        L.fate = std::move(S);
    }
    return static_cast<llama_kvp_host_state &>(*L.fate);
}

// removes the entries at `which` (any order) by moving the last entries into their places
static void llama_kvp_host_remove(llama_kvp_memory & mem, llama_kvp_host_state & S, std::vector<size_t> which) {
    std::sort(which.begin(), which.end(), std::greater<size_t>());
    for (size_t i : which) {
        const size_t last = S.size() - 1;
        if (i != last) {
            S.pos[i]   = S.pos[last];
            S.score[i] = S.score[last];
            S.timer[i] = S.timer[last];
            S.t_in[i]  = S.t_in[last];
            memcpy(S.k.data() + i*S.row_k, S.k.data() + last*S.row_k, S.row_k);
            memcpy(S.v.data() + i*S.row_v, S.v.data() + last*S.row_v, S.row_v);
        }
        S.pos.pop_back();
        S.score.pop_back();
        S.timer.pop_back();
        S.t_in.pop_back();
        S.k.resize(last*S.row_k);
        S.v.resize(last*S.row_v);
        mem.host_bytes -= (int64_t) (S.row_k + S.row_v);
    }
}

// past the limit, the coldest tokens are dropped for good: cold before frozen, lowest score first
static void llama_kvp_host_trim(llama_kvp_memory & mem, llama_kvp_host_state & S) {
    const size_t limit = mem.policy.limit > 0 ? (size_t) mem.policy.limit : (size_t) mem.cparams.n_ctx_seq;
    if (S.size() <= limit) {
        return;
    }
    std::vector<size_t> ord(S.size());
    std::iota(ord.begin(), ord.end(), 0);
    const size_t n_drop = S.size() - limit;
    std::partial_sort(ord.begin(), ord.begin() + n_drop, ord.end(), [&](size_t a, size_t b) {
        if ((S.timer[a] == 0) != (S.timer[b] == 0)) {
            return S.timer[a] == 0;
        }
        return S.score[a] != S.score[b] ? S.score[a] < S.score[b] : S.pos[a] < S.pos[b];
    });
    ord.resize(n_drop);
    S.n_dropped += (int64_t) n_drop;
    llama_kvp_host_remove(mem, S, ord);
}

// the entries `which` go back into free cells of KV layer ikv (as many as there are); returns how many did
static uint32_t llama_kvp_host_restore(llama_kvp_memory & mem, int32_t ikv, llama_kvp_host_state & S, const std::vector<size_t> & which) {
    if (which.empty()) {
        return 0;
    }
    auto & L = mem.layers[ikv];
    std::vector<llama_pos> pos(which.size());
    for (size_t i = 0; i < which.size(); ++i) {
        pos[i] = S.pos[which[i]];
    }
    std::vector<int32_t> cell;
    mem.cells_restore(ikv, pos, cell);

    size_t n_done = 0;
    for (size_t i = 0; i < which.size(); ++i) {
        n_done += cell[i] >= 0;
    }
    std::vector<uint32_t>  idx(n_done);
    std::vector<size_t>    done(n_done);
    std::vector<uint8_t>   kb(n_done*S.row_k);
    std::vector<uint8_t>   vb(n_done*S.row_v);
    std::vector<llama_pos> back_pos(n_done);
    std::vector<float>     back_score(n_done);
    for (size_t i = 0, j = 0; i < which.size(); ++i) {
        if (cell[i] < 0) {
            continue;
        }
        const size_t e = which[i];
        idx[j]        = (uint32_t) cell[i];
        done[j]       = e;
        back_pos[j]   = S.pos[e];
        back_score[j] = S.score[e];
        memcpy(kb.data() + j*S.row_k, S.k.data() + e*S.row_k, S.row_k);
        memcpy(vb.data() + j*S.row_v, S.v.data() + e*S.row_v, S.row_v);
        j++;
    }
    if (mem.st) {
        llama_kvp_obs_cells_set_score(mem.st, ikv, idx.data(), back_pos.data(), back_score.data(), idx.size());
    }
    const uint32_t size = L.kv->get_size();
    llama_kvp_cells_write(llama_kvp_kv_access::layer_k(*L.kv, 0), false, size, idx, kb.data());
    llama_kvp_cells_write(llama_kvp_kv_access::layer_v(*L.kv, 0), !mem.cparams.flash_attn, size, idx, vb.data());
    S.n_thaw += (int64_t) done.size();
    llama_kvp_host_remove(mem, S, done);
    return (uint32_t) done.size();
}

void llama_kvp_host_freeze(llama_kvp_memory & mem, int32_t ikv, const std::vector<llama_kvp_cell> & cells, const std::vector<int32_t> & timers) {
    if (cells.empty()) {
        return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    auto & L = mem.layers[ikv];
    auto & S = llama_kvp_host_of(mem, ikv);
    const uint32_t size = L.kv->get_size();

    std::vector<uint32_t> idx(cells.size());
    llama_pos p_min = cells[0].pos;
    for (size_t i = 0; i < cells.size(); ++i) {
        idx[i] = cells[i].idx;
        p_min  = std::min(p_min, cells[i].pos);
    }
    const size_t n0 = S.size();
    S.k.resize((n0 + cells.size())*S.row_k);
    S.v.resize((n0 + cells.size())*S.row_v);
    llama_kvp_cells_read(llama_kvp_kv_access::layer_k(*L.kv, 0), false, size, idx, S.k.data() + n0*S.row_k);
    llama_kvp_cells_read(llama_kvp_kv_access::layer_v(*L.kv, 0), !mem.cparams.flash_attn, size, idx, S.v.data() + n0*S.row_v);
    for (size_t i = 0; i < cells.size(); ++i) {
        S.pos.push_back(cells[i].pos);
        S.score.push_back(cells[i].score);
        S.timer.push_back(std::max(0, timers[i]));
        S.t_in.push_back(mem.n_steps_total);
        (timers[i] > 0 ? S.n_freeze : S.n_evict)++;
        mem.cell_free(ikv, cells[i].idx);
    }
    mem.host_bytes += (int64_t) (cells.size()*(S.row_k + S.row_v));
    mem.host_bytes_peak = std::max(mem.host_bytes_peak, mem.host_bytes);
    // tokens computed from now on do not see these: the exact prefix ends here (as with an eviction)
    mem.pos_exact = std::min({ mem.pos_exact, mem.pos_end, p_min });
    llama_kvp_host_trim(mem, S);
    S.t_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

uint32_t llama_kvp_host_tick(llama_kvp_memory & mem, int32_t ikv, uint32_t n_room) {
    auto & L = mem.layers[ikv];
    if (!L.fate) {
        return 0;
    }
    const auto t0 = std::chrono::steady_clock::now();
    auto & S = static_cast<llama_kvp_host_state &>(*L.fate);
    std::vector<size_t> due; // timers that reach 0 now; they keep 1 while no cell is free for them
    for (size_t i = 0; i < S.size(); ++i) {
        if (S.timer[i] == 1) {
            due.push_back(i);
        } else if (S.timer[i] > 1) {
            S.timer[i]--;
        }
    }
    std::sort(due.begin(), due.end(), [&](size_t a, size_t b) { return S.score[a] > S.score[b]; });
    due.resize(std::min<size_t>(due.size(), n_room));
    const uint32_t res = llama_kvp_host_restore(mem, ikv, S, due);
    S.t_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    return res;
}

void llama_kvp_host_keys(llama_kvp_memory & mem, int32_t ikv, std::vector<llama_pos> & pos, std::vector<float> & k) {
    auto & L = mem.layers[ikv];
    pos.clear();
    k.clear();
    if (!L.fate) {
        return;
    }
    const auto & S = static_cast<const llama_kvp_host_state &>(*L.fate);
    const ggml_tensor * kt = llama_kvp_kv_access::layer_k(*L.kv, 0);
    const int64_t n_embd_k = kt->ne[0];
    pos = S.pos;
    k.resize(S.size()*n_embd_k);
    for (size_t i = 0; i < S.size(); ++i) {
        llama_kvp_row_to_f32(kt->type, S.k.data() + i*S.row_k, k.data() + i*n_embd_k, n_embd_k);
    }
}

uint32_t llama_kvp_host_thaw_pos(llama_kvp_memory & mem, int32_t ikv, const std::vector<llama_pos> & pos,
                                 const std::vector<float> & score, uint32_t n_room) {
    auto & L = mem.layers[ikv];
    if (!L.fate || pos.empty()) {
        return 0;
    }
    auto & S = static_cast<llama_kvp_host_state &>(*L.fate);
    std::map<llama_pos, float> want;
    for (size_t i = 0; i < pos.size(); ++i) {
        want[pos[i]] = score[i];
    }
    std::vector<size_t> which;
    for (size_t i = 0; i < S.size() && which.size() < n_room; ++i) {
        const auto it = want.find(S.pos[i]);
        if (it != want.end()) {
            S.score[i] = it->second;
            which.push_back(i);
        }
    }
    const uint32_t res = llama_kvp_host_restore(mem, ikv, S, which);
    S.n_promote += res;
    return res;
}

uint32_t llama_kvp_host_thaw_frozen(llama_kvp_memory & mem, int32_t ikv, int32_t min_timer, int32_t since_step, uint32_t n_room) {
    auto & L = mem.layers[ikv];
    if (!L.fate) {
        return 0;
    }
    auto & S = static_cast<llama_kvp_host_state &>(*L.fate);
    std::vector<size_t> which;
    for (size_t i = 0; i < S.size(); ++i) {
        if (S.timer[i] > 0 && S.timer[i] >= min_timer && S.t_in[i] >= since_step) {
            which.push_back(i);
        }
    }
    std::sort(which.begin(), which.end(), [&](size_t a, size_t b) { return S.score[a] > S.score[b]; });
    which.resize(std::min<size_t>(which.size(), n_room));
    return llama_kvp_host_restore(mem, ikv, S, which);
}

uint32_t llama_kvp_host_tier_thaw(llama_kvp_memory & mem, int32_t ikv, uint32_t n_room) {
    auto & L = mem.layers[ikv];
    if (!L.fate) {
        return 0;
    }
    auto & S = static_cast<llama_kvp_host_state &>(*L.fate);
    std::vector<size_t> ord(S.size());
    std::iota(ord.begin(), ord.end(), 0);
    std::sort(ord.begin(), ord.end(), [&](size_t a, size_t b) {
        if ((S.timer[a] > 0) != (S.timer[b] > 0)) {
            return S.timer[a] > 0;
        }
        return S.score[a] > S.score[b];
    });
    ord.resize(std::min<size_t>(ord.size(), n_room));
    return llama_kvp_host_restore(mem, ikv, S, ord);
}

// adds the host-tier counters of KV layer ikv (and its active tokens) to out (false if the layer has no host tier);
// appends its host positions and timers when not null
static bool llama_kvp_host_layer_stats(const llama_kvp_memory & mem, int32_t ikv, llama_kvp_host_stats & out,
                                std::vector<llama_pos> * pos, std::vector<int32_t> * timer) {
    const auto & L = mem.layers[ikv];
    out.n_active += (int32_t) llama_kvp_kv_access::n_used(*L.kv);
    if (!L.fate) {
        return false;
    }
    const auto & S = static_cast<const llama_kvp_host_state &>(*L.fate);
    out.n_host     += (int32_t) S.size();
    out.n_frozen   += (int32_t) std::count_if(S.timer.begin(), S.timer.end(), [](int32_t t) { return t > 0; });
    out.host_bytes += S.bytes();
    out.n_freeze   += S.n_freeze;
    out.n_thaw     += S.n_thaw;
    out.n_evict    += S.n_evict;
    out.n_dropped  += S.n_dropped;
    out.n_promote  += S.n_promote;
    out.t_ms       += S.t_ms;
    if (pos) {
        pos->insert(pos->end(), S.pos.begin(), S.pos.end());
    }
    if (timer) {
        timer->insert(timer->end(), S.timer.begin(), S.timer.end());
    }
    return true;
}

//
// the stage
//

struct llama_kvp_fate_host : llama_kvp_fate_stage {
    llama_kvp_fate_host() : llama_kvp_fate_stage(LLAMA_KVP_FATE_HOST, LLAMA_KVP_SLOT_FATE, "host", "limit",
            "leaving tokens move to a host-memory tier of at most `limit` tokens per layer (0: the context), from which they can come back") {}

    void defaults(llama_kvp_policy & p) const override {
        p.limit = 0;
    }

    std::string check(const llama_kvp_policy & p) const override {
        char buf[192];
        if (!llama_kvp_budget_of(p)) {
            return "host needs a retention policy (a budget stage): without one no token leaves the cache";
        }
        if (p.limit < 0) {
            snprintf(buf, sizeof(buf), "limit must be >= 0 tokens per layer (got %d; 0 = the context size)", p.limit);
            return buf;
        }
        if (p.limit > 0 && p.budget >= 1.0f && p.budget != LLAMA_KVP_BUDGET_ALL && (float) p.limit < p.budget) {
            snprintf(buf, sizeof(buf), "limit (%d) must be 0 (the context size) or at least the budget (%g tokens): "
                    "the host tier must be able to hold a layer's frozen tokens", p.limit, (double) p.budget);
            return buf;
        }
        return "";
    }

    void leave(llama_kvp_memory & mem, int32_t ikv, const std::vector<llama_kvp_cell> & leaving) const override {
        llama_kvp_host_freeze(mem, ikv, leaving, std::vector<int32_t>(leaving.size(), 0));
    }

    // n, bytes per K and V token, then per token (pos, score, timer), then the K and the V bytes
    void state_write(const llama_kvp_memory & mem, int32_t ikv, std::vector<uint8_t> & out) const override {
        const auto & L = mem.layers[ikv];
        if (!L.fate) {
            return;
        }
        const auto & S = static_cast<const llama_kvp_host_state &>(*L.fate);
        const uint32_t hdr[3] = { (uint32_t) S.size(), (uint32_t) S.row_k, (uint32_t) S.row_v };
        auto put = [&](const void * x, size_t n) { llama_kvp_state_put(out, x, n); };
        put(hdr, sizeof(hdr));
        for (size_t i = 0; i < S.size(); ++i) {
            put(&S.pos[i],   sizeof(int32_t));
            put(&S.score[i], sizeof(float));
            put(&S.timer[i], sizeof(int32_t));
        }
        put(S.k.data(), S.k.size());
        put(S.v.data(), S.v.size());
    }

    void state_read(llama_kvp_memory & mem, int32_t ikv, const std::vector<uint8_t> & in) const override {
        if (in.empty()) {
            return;
        }
        auto & S = llama_kvp_host_of(mem, ikv);
        uint32_t hdr[3] = {};
        if (in.size() < sizeof(hdr)) {
            throw std::runtime_error("pykvcache: corrupt host tier in the state");
        }
        memcpy(hdr, in.data(), sizeof(hdr));
        if (hdr[1] != S.row_k || hdr[2] != S.row_v) {
            throw std::runtime_error("pykvcache: the host tier in this state was saved with other K/V types or sizes");
        }
        const size_t n = hdr[0];
        if (in.size() != sizeof(hdr) + n*(12 + S.row_k + S.row_v)) {
            throw std::runtime_error("pykvcache: corrupt host tier in the state");
        }
        const uint8_t * x = in.data() + sizeof(hdr);
        S.pos.resize(n);
        S.score.resize(n);
        S.timer.resize(n);
        S.t_in.assign(n, mem.n_steps_total);
        for (size_t i = 0; i < n; ++i, x += 12) {
            memcpy(&S.pos[i],   x,     4);
            memcpy(&S.score[i], x + 4, 4);
            memcpy(&S.timer[i], x + 8, 4);
            if (S.pos[i] < 0 || S.timer[i] < 0) {
                throw std::runtime_error("pykvcache: corrupt host tier in the state");
            }
        }
        S.k.assign(x, x + n*S.row_k);
        x += n*S.row_k;
        S.v.assign(x, x + n*S.row_v);
        mem.host_bytes += S.bytes();
        mem.host_bytes_peak = std::max(mem.host_bytes_peak, mem.host_bytes);
    }

    void forget(llama_kvp_memory & mem, llama_pos p0, llama_pos p1) const override {
        for (int32_t ikv = 0; ikv < (int32_t) mem.layers.size(); ++ikv) {
            auto & L = mem.layers[ikv];
            if (!L.fate) {
                continue;
            }
            auto & S = static_cast<llama_kvp_host_state &>(*L.fate);
            std::vector<size_t> gone;
            for (size_t i = 0; i < S.size(); ++i) {
                if (S.pos[i] >= p0 && (p1 < 0 || S.pos[i] < p1)) {
                    gone.push_back(i);
                }
            }
            llama_kvp_host_remove(mem, S, gone);
        }
    }
};

const llama_kvp_stage * llama_kvp_stage_fate_host() {
    static const llama_kvp_fate_host stage;
    return &stage;
}

//
// C API (llama-kvp.h): the host tier of a context
//

llama_kvp_memory * llama_kvp_host_mem(struct llama_context * ctx) {
    return llama_kvp_mem_with_fate(ctx, LLAMA_KVP_FATE_HOST, "the context's policy has no host tier (fate stage 'host')");
}

int32_t llama_kvp_host(struct llama_context * ctx, struct llama_kvp_host_stats * out) {
    llama_kvp_memory * mem = llama_kvp_host_mem(ctx);
    if (!mem || !llama_kvp_check_out(out)) {
        return -1;
    }
    *out = {};
    for (int32_t i = 0; i < (int32_t) mem->layers.size(); ++i) {
        llama_kvp_host_layer_stats(*mem, i, *out, nullptr, nullptr);
    }
    out->host_bytes_peak = mem->host_bytes_peak;
    out->n_steps  = mem->st ? mem->st->n_decode : 0;
    out->n_rerank = mem->n_rerank;
    llama_kvp_freeze_ladder(*mem, out->n_recover, nullptr, nullptr, nullptr);
    return 0;
}

int32_t llama_kvp_layer_host(struct llama_context * ctx, int32_t ikv, int32_t * pos, int32_t * timer, int32_t n_max) {
    llama_kvp_memory * mem = llama_kvp_host_mem(ctx);
    if (!mem || !llama_kvp_check_layer(mem, ikv)) {
        return -1;
    }
    llama_kvp_host_stats tmp = {};
    std::vector<llama_pos> p;
    std::vector<int32_t>   t;
    llama_kvp_host_layer_stats(*mem, ikv, tmp, &p, &t);
    for (int32_t i = 0; i < (int32_t) p.size() && i < n_max; ++i) {
        if (pos) {
            pos[i] = p[i];
        }
        if (timer) {
            timer[i] = t[i];
        }
    }
    return (int32_t) p.size();
}

int32_t llama_kvp_host_thaw_all(struct llama_context * ctx) {
    llama_kvp_memory * mem = llama_kvp_host_mem(ctx);
    if (!mem) {
        return -1;
    }
    llama_synchronize(ctx);
    int32_t res = 0;
    for (int32_t i = 0; i < (int32_t) mem->layers.size(); ++i) {
        res += (int32_t) llama_kvp_host_tier_thaw(*mem, i, mem->n_room(i, 1));
    }
    if (mem->stage_schedule) {
        mem->stage_schedule->forget(*mem, 0, -1); // the counts start again
    }
    return res;
}
