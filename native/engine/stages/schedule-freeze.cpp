// schedule-freeze.cpp - schedule stage `freeze` (ASR-KF-EGR §3.2-3.5, the soft rolling freeze): every `every`-th
// decode step observes (1: every step, as the paper), and before the next step each layer freezes the tokens of
// persistently low relevance into its host tier for a time that grows as the square root of how often they were
// found low (d observation periods of `every` steps).
//
// For each token a layer holds, outside the tokens the score stage protects (sinks and recent window: the paper's
// K = 32 is H2O's n_recent), the relevance is its head-mean attention probability for the step's query (the
// observation's mass; with the window-1 scoring of `h2o` and `freeze` that is the current query). The paper uses
// mean_h |q.k_j|; the probability is what the observation computes anyway (no second pass over K), it is what
// decides a token's share of the attention output, and with tau relative to the uniform share 1/n it needs no
// per-layer scale: a token is low when its mass < tau/n, n the tokens the query attended. A low step adds one to
// its count c_j, counted over the last `hist` decode steps; a low token with d_j = floor(sqrt(c_j)/k) > 0 freezes
// for d_j steps (its cell is freed, its K/V wait in the host tier) and thaws by itself when its timer runs out.
// The count is not refreshed while a token is frozen, so a token that stays irrelevant spends d/(d+1) of its time
// frozen, d growing slowly.
//
// The entropy recovery ladder (§3.6, which its authors left unimplemented), on with z > 0: after each generated token
// the caller passes the logits it was sampled from (llama_kvp_recover_step). Their entropy H is compared with an
// exponential running mean and sd (weight 1/16, after 8 warm-up steps); H > mean + z*sd is a spike. Each spike
// climbs one level and acts on every layer: 1 Soft Reset thaws the tokens with more than one step left, 2 Window
// Reset thaws everything frozen in the last `span` steps, 3 Full Reset thaws everything and clears the counts, 4
// Rewalk (with rewalk > 0) does a Full Reset and asks the caller to roll back its last `rewalk` tokens and generate
// them again, then the ladder starts from the bottom. `span` steps without a spike bring it back down.
//
// With gap >= 0 the latent re-ranking of the `latent` schedule (schedule-latent.cpp) runs too, `gap` steps after each
// prompt (0: at its end; repeat=1: every `gap` steps): frozen tokens compete with the active and evicted ones.

#include "llama-kvp-impl.h"
#include "llama-kvp-memory.h"
#include "llama-kvp-stage.h"

#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>

struct llama_kvp_freeze_state : llama_kvp_layer_state {
    std::vector<int32_t>  t_last; // by position: the step of its last count update (-1: none)
    std::vector<uint64_t> bits;   // by position: hist/64 words; bit t % hist is set if it was low at step t
    int32_t n_words = 0;
    int32_t n_obs   = -1; // the observation the last step used (each is used once)
    int32_t n_steps = 0;  // decode steps so far

    // the count of low steps of position p in (t - hist, t], after recording step t as low or not
    int32_t update(llama_pos p, int32_t t, bool low, int32_t hist) {
        if ((size_t) p >= t_last.size()) {
            t_last.resize((size_t) p + 1, -1);
            bits.resize(t_last.size()*n_words, 0);
        }
        uint64_t * w = bits.data() + (size_t) p*n_words;
        const int32_t t0 = t_last[p];
        if (t0 < 0 || t - t0 >= hist) {
            std::fill(w, w + n_words, 0);
        } else {
            for (int32_t s = t0 + 1; s <= t; ++s) { // the steps it was not observed (frozen) count as not low
                w[(s % hist)/64] &= ~(1ULL << ((s % hist) % 64));
            }
        }
        if (low) {
            w[(t % hist)/64] |= 1ULL << ((t % hist) % 64);
        }
        t_last[p] = t;
        int32_t c = 0;
        for (int32_t i = 0; i < n_words; ++i) {
            c += __builtin_popcountll(w[i]);
        }
        return c;
    }
};

static llama_kvp_freeze_state & llama_kvp_freeze_of(llama_kvp_mem_layer & L, int32_t hist) {
    if (!L.sched) {
        auto S = std::make_unique<llama_kvp_freeze_state>();
        S->n_words = hist/64;
        L.sched = std::move(S);
    }
    return static_cast<llama_kvp_freeze_state &>(*L.sched);
}

// the recovery ladder of the memory
struct llama_kvp_ladder_state : llama_kvp_layer_state {
    double  mean  = 0.0;
    double  var   = 0.0;
    int32_t n     = 0;
    int32_t level = 0;
    int32_t calm  = 0;
    int32_t n_level[4] = { 0, 0, 0, 0 };
    std::vector<int32_t> ev_step;
    std::vector<int32_t> ev_level;
    std::vector<float>   ev_entropy;
};

static constexpr int32_t LLAMA_KVP_LADDER_WARMUP = 8;
static constexpr double  LLAMA_KVP_LADDER_ALPHA  = 1.0/16.0;
static constexpr int32_t LLAMA_KVP_REWALK_MAX    = 64; // tokens a Rewalk rolls back at most

static llama_kvp_ladder_state & llama_kvp_ladder_of(llama_kvp_memory & mem) {
    if (!mem.sched_state) {
        mem.sched_state = std::make_unique<llama_kvp_ladder_state>();
    }
    return static_cast<llama_kvp_ladder_state &>(*mem.sched_state);
}

struct llama_kvp_schedule_freeze : llama_kvp_schedule_stage {
    llama_kvp_schedule_freeze() : llama_kvp_schedule_stage(LLAMA_KVP_SCHEDULE_FREEZE, LLAMA_KVP_SLOT_SCHEDULE, "freeze", "tau,k,hist,every,z,rewalk,span,gap,repeat",
            "observe every `every` decode steps; a token whose attention stays below tau/n freezes into the host tier for floor(sqrt(c)/k) observation periods; gap >= 0: also re-ranked with the host tier as `latent`") {}

    void defaults(llama_kvp_policy & p) const override {
        p.tau  = 0.1f;
        p.k    = 2;
        p.hist   = 128;
        p.every  = 4;
        p.z      = 0.0f;
        p.rewalk = 0;
        p.span   = 16;
        p.gap    = -1; // no latent re-ranking
        p.repeat = 0;
    }

    std::string check(const llama_kvp_policy & p) const override {
        char buf[192];
        if (!std::isfinite(p.tau) || p.tau < 0.0f) {
            snprintf(buf, sizeof(buf), "tau must be >= 0 (got %g; a token is low when its attention is below tau/n)", (double) p.tau);
            return buf;
        }
        if (p.k < 1) {
            snprintf(buf, sizeof(buf), "k must be >= 1 (got %d; a token freezes for floor(sqrt(c)/k) steps)", p.k);
            return buf;
        }
        if (p.hist < 64 || p.hist > 4096 || p.hist % 64 != 0) {
            snprintf(buf, sizeof(buf), "hist must be a multiple of 64 in [64, 4096] decode steps (got %d)", p.hist);
            return buf;
        }
        if (!std::isfinite(p.z) || p.z < 0.0f) {
            snprintf(buf, sizeof(buf), "z must be >= 0 (got %g; 0 turns the recovery ladder off)", (double) p.z);
            return buf;
        }
        if (p.rewalk < 0 || p.rewalk > LLAMA_KVP_REWALK_MAX || p.span < 1) {
            // the stream runs `rewalk` tokens behind the model, and a call generates that many past its max_tokens
            snprintf(buf, sizeof(buf), "rewalk must be in [0, %d] and span >= 1 (got rewalk=%d, span=%d)",
                    LLAMA_KVP_REWALK_MAX, p.rewalk, p.span);
            return buf;
        }
        if (p.every < 1) {
            snprintf(buf, sizeof(buf), "every must be >= 1 decode step for freeze (got %d)", p.every);
            return buf;
        }
        if (p.gap < -1 || (p.repeat != 0 && p.repeat != 1)) {
            snprintf(buf, sizeof(buf), "gap must be >= -1 (-1: no latent re-ranking, 0: at the end of each prompt) and repeat 0 or 1 (got gap=%d, repeat=%d)", p.gap, p.repeat);
            return buf;
        }
        const auto * fate = llama_kvp_fate_of(p);
        if (!fate || fate->id != LLAMA_KVP_FATE_HOST) {
            return std::string("freeze needs the host fate (+host): frozen tokens wait in the host tier (fate here: ") +
                   (fate ? fate->name : "none") + ")";
        }
        return "";
    }

    bool observe_step(const llama_kvp_policy & p, int32_t n_decode) const override {
        return p.every <= 1 || (n_decode + 1) % p.every == 0;
    }

    void before_step(llama_kvp_memory & mem) const override {
        llama_kvp_context * st = mem.st;
        if (!st) {
            return;
        }
        llama_kvp_sync(st); // the caches are read and written below
        const llama_kvp_policy & p = mem.policy;
        if (p.gap >= 0) {
            llama_kvp_latent_before_step(mem); // frozen, evicted and active tokens re-ranked together when due
        }
        std::vector<float> mass;
        std::vector<float> acc;
        std::vector<llama_pos> obs_pos;
        std::vector<llama_pos> acc_pos;
        std::vector<llama_kvp_cell> cells;
        std::vector<int32_t> timers;
        for (int32_t ikv = 0; ikv < (int32_t) mem.layers.size(); ++ikv) {
            auto & L = mem.layers[ikv];
            auto & S = llama_kvp_freeze_of(L, p.hist);
            const int32_t t = S.n_steps++;

            // a step passes for the frozen tokens: those due thaw into the cells the budget allows
            llama_kvp_host_tick(mem, ikv, mem.n_room(ikv, 1));

            // the last observation, once: the relevance of each token it saw
            if (S.n_obs == st->n_obs) {
                continue;
            }
            S.n_obs = st->n_obs;
            const int32_t n_kv = llama_kvp_obs_layer_mass(st, ikv, mass, obs_pos);
            int32_t n_seen = 0;
            for (int32_t j = 0; j < n_kv; ++j) {
                n_seen += obs_pos[j] >= 0;
            }
            if (n_seen == 0) {
                continue;
            }
            uint32_t n_sink   = 0;
            uint32_t n_recent = 0;
            mem.stage_score->protect(p, L.budget, n_sink, n_recent);
            const llama_pos p_recent = mem.pos_end - (llama_pos) n_recent;
            const float thr = p.tau/(float) n_seen;

            cells.clear();
            timers.clear();
            for (int32_t j = 0; j < n_kv; ++j) {
                const llama_pos pj = llama_kvp_kv_access::cell_pos(*L.kv, (uint32_t) j);
                if (pj < 0 || pj != obs_pos[j] || pj < (llama_pos) n_sink || pj >= p_recent) {
                    continue; // empty, a different token since, or protected
                }
                const bool    low = mass[j] < thr;
                const int32_t c   = S.update(pj, t, low, p.hist);
                const int32_t d   = (int32_t) std::floor(std::sqrt((double) c)/p.k);
                if (low && d > 0) {
                    cells.push_back({ pj, (uint32_t) j, 0.0f });
                    timers.push_back(d*std::max(1, p.every)); // d observation periods
                }
            }
            if (cells.empty()) {
                continue;
            }
            // the scores they take to the host tier (restored when they thaw): read only when something freezes
            llama_kvp_obs_layer_scores(st, ikv, acc, acc_pos);
            for (auto & c : cells) {
                c.score = acc_pos[c.idx] == c.pos ? acc[c.idx] : 0.0f;
            }
            llama_kvp_host_freeze(mem, ikv, cells, timers);
            mem.compact(ikv); // the attention spans the active tokens only
        }
    }

    // the counts of the layer's positions, so that a loaded context freezes and thaws as this one: n_words, the last
    // observation used, the steps, then t_last and bits (a vector each: length, elements)
    void state_write(const llama_kvp_memory & mem, int32_t ikv, std::vector<uint8_t> & out) const override {
        const auto & L = mem.layers[ikv];
        if (!L.sched) {
            return;
        }
        const auto & S = static_cast<const llama_kvp_freeze_state &>(*L.sched);
        const int32_t hdr[3] = { S.n_words, S.n_obs, S.n_steps };
        llama_kvp_state_put(out, hdr, sizeof(hdr));
        llama_kvp_state_put_vec(out, S.t_last);
        llama_kvp_state_put_vec(out, S.bits);
    }

    void state_read(llama_kvp_memory & mem, int32_t ikv, const std::vector<uint8_t> & in) const override {
        if (in.empty()) {
            return;
        }
        const char * what = "freeze counts";
        int32_t hdr[3] = {};
        size_t  off    = 0;
        std::vector<int32_t>  t_last;
        std::vector<uint64_t> bits;
        llama_kvp_state_get(in, off, hdr, sizeof(hdr), what);
        llama_kvp_state_get_vec(in, off, t_last, what);
        llama_kvp_state_get_vec(in, off, bits, what);
        if (hdr[0] != mem.policy.hist/64 || bits.size() != t_last.size()*(size_t) hdr[0] || off != in.size()) {
            throw std::runtime_error("pykvcache: corrupt freeze counts in the state");
        }
        auto & S = llama_kvp_freeze_of(mem.layers[ikv], mem.policy.hist);
        S.n_obs   = hdr[1];
        S.n_steps = hdr[2];
        S.t_last  = std::move(t_last);
        S.bits    = std::move(bits);
    }

    void forget(llama_kvp_memory & mem, llama_pos p0, llama_pos p1) const override {
        for (auto & L : mem.layers) {
            if (!L.sched) {
                continue;
            }
            auto & S = static_cast<llama_kvp_freeze_state &>(*L.sched);
            const size_t n  = S.t_last.size();
            const size_t a  = (size_t) std::max<llama_pos>(p0, 0);
            const size_t b  = p1 < 0 ? n : std::min(n, (size_t) p1);
            for (size_t i = a; i < b; ++i) {
                S.t_last[i] = -1;
            }
            if (p0 <= 0 && p1 < 0) {
                S.t_last.clear();
                S.bits.clear();
                S.n_steps = 0;
                S.n_obs   = -1;
            }
        }
        if (p0 <= 0 && p1 < 0) {
            mem.sched_state.reset(); // a new sequence: the ladder's statistics and events start again
        }
    }

    // the ladder's step (see the top of the file); returns the level acted on
    int32_t recover(llama_kvp_memory & mem, const float * logits, int32_t n_vocab) const {
        const llama_kvp_policy & p = mem.policy;
        // -inf (a token masked by a grammar or a logit bias) has probability 0; +inf tokens share all of it; a NaN
        // leaves the step out (no entropy to compare, the statistics untouched)
        double mx = -INFINITY;
        int32_t n_pinf = 0;
        for (int32_t i = 0; i < n_vocab; ++i) {
            const float x = logits[i];
            if (std::isnan(x)) {
                return 0;
            }
            n_pinf += x == INFINITY ? 1 : 0;
            if (std::isfinite(x)) {
                mx = std::max(mx, (double) x);
            }
        }
        if (n_pinf == 0 && mx == -INFINITY) {
            return 0;
        }
        double h = std::log((double) std::max(n_pinf, 1)); // entropy of softmax(logits), nats
        if (n_pinf == 0) {
            double z = 0.0;
            double s1 = 0.0;
            for (int32_t i = 0; i < n_vocab; ++i) {
                if (std::isfinite(logits[i])) {
                    const double e = std::exp((double) logits[i] - mx);
                    z  += e;
                    s1 += e*((double) logits[i] - mx);
                }
            }
            h = std::log(z) - s1/z;
        }

        auto & D = llama_kvp_ladder_of(mem);
        const bool spike = D.n >= LLAMA_KVP_LADDER_WARMUP && h > D.mean + p.z*std::sqrt(std::max(D.var, 0.0));
        if (D.n < LLAMA_KVP_LADDER_WARMUP) { // plain mean and variance while warming up
            const double d = h - D.mean;
            D.mean += d/(D.n + 1);
            D.var  += (d*(h - D.mean) - D.var)/(D.n + 1);
        } else {
            const double d = h - D.mean;
            D.mean += LLAMA_KVP_LADDER_ALPHA*d;
            D.var   = (1.0 - LLAMA_KVP_LADDER_ALPHA)*(D.var + LLAMA_KVP_LADDER_ALPHA*d*d);
        }
        D.n++;
        if (!spike) {
            if (++D.calm >= p.span) {
                D.level = 0;
            }
            return 0;
        }
        D.calm  = 0;
        D.level = std::min(D.level + 1, p.rewalk > 0 ? 4 : 3);
        const int32_t level = D.level;
        D.n_level[level - 1]++;
        D.ev_step.push_back(mem.n_steps_total);
        D.ev_level.push_back(level);
        D.ev_entropy.push_back((float) h);

        if (mem.st) {
            llama_kvp_sync(mem.st);
        }
        for (int32_t ikv = 0; ikv < (int32_t) mem.layers.size(); ++ikv) {
            const uint32_t room = mem.n_room(ikv, 1);
            if (level == 1) {
                llama_kvp_host_thaw_frozen(mem, ikv, 2, INT_MIN, room);
            } else if (level == 2) {
                llama_kvp_host_thaw_frozen(mem, ikv, 1, mem.n_steps_total - p.span, room);
            } else {
                llama_kvp_host_tier_thaw(mem, ikv, room);
            }
        }
        if (level >= 3) { // the counts start again; the ladder's own statistics stay
            auto ladder = std::move(mem.sched_state);
            forget(mem, 0, -1);
            mem.sched_state = std::move(ladder);
        }
        if (level == 4) {
            D.level = 0;
        }
        return level;
    }
};

int32_t llama_kvp_freeze_recover(llama_kvp_memory & mem, const float * logits, int32_t n_vocab) {
    return static_cast<const llama_kvp_schedule_freeze *>(llama_kvp_stage_schedule_freeze())->recover(mem, logits, n_vocab);
}

void llama_kvp_freeze_ladder(llama_kvp_memory & mem, int32_t * n_level, std::vector<int32_t> * step,
                             std::vector<int32_t> * level, std::vector<float> * entropy) {
    if (!mem.sched_state) {
        return;
    }
    const auto & D = llama_kvp_ladder_of(mem);
    for (int32_t i = 0; i < 4 && n_level; ++i) {
        n_level[i] = D.n_level[i];
    }
    if (step) {
        *step = D.ev_step;
    }
    if (level) {
        *level = D.ev_level;
    }
    if (entropy) {
        *entropy = D.ev_entropy;
    }
}

const llama_kvp_stage * llama_kvp_stage_schedule_freeze() {
    static const llama_kvp_schedule_freeze stage;
    return &stage;
}

//
// C API (llama-kvp.h): the recovery ladder
//

int32_t llama_kvp_recover_step(struct llama_context * ctx, const float * logits, int32_t n_vocab) {
    llama_kvp_memory * mem = llama_kvp_host_mem(ctx);
    if (!mem) {
        return -1;
    }
    if (mem->policy.stage[LLAMA_KVP_SLOT_SCHEDULE] != LLAMA_KVP_SCHEDULE_FREEZE || !(mem->policy.z > 0.0f)) {
        llama_kvp_set_error("the recovery ladder needs the freeze schedule with z > 0 (e.g. freeze:z=2)");
        return -1;
    }
    if (!logits || n_vocab <= 0) {
        llama_kvp_set_error("recover_step: no logits");
        return -1;
    }
    return llama_kvp_freeze_recover(*mem, logits, n_vocab);
}

int32_t llama_kvp_recover_events(struct llama_context * ctx, int32_t * step, int32_t * level, float * entropy, int32_t n_max) {
    llama_kvp_memory * mem = llama_kvp_host_mem(ctx);
    if (!mem) {
        if (llama_kvp_check_ctx(ctx)) {
            llama_kvp_set_error("the context's policy has no recovery ladder (the freeze schedule's with z > 0, over the "
                                "host tier: e.g. freeze:z=1 or snapkv:budget=0.1+host+freeze:z=1)");
        }
        return -1;
    }
    std::vector<int32_t> s;
    std::vector<int32_t> l;
    std::vector<float>   e;
    llama_kvp_freeze_ladder(*mem, nullptr, &s, &l, &e);
    for (int32_t i = 0; i < (int32_t) s.size() && i < n_max; ++i) {
        if (step)    { step[i]    = s[i]; }
        if (level)   { level[i]   = l[i]; }
        if (entropy) { entropy[i] = e[i]; }
    }
    return (int32_t) s.size();
}
