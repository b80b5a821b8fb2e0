// llama-kvp-stages.cpp - the registry of stages, the default behaviour of each slot interface, the checks of key
// values that several stages share, and the threads the host work between two graphs shares out. The stages
// themselves live in stages/, one file each.

#include "llama-kvp-stage.h"
#include "llama-kvp-impl.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <system_error>
#include <thread>

const std::vector<const llama_kvp_stage *> & llama_kvp_stage_all() {
    static const std::vector<const llama_kvp_stage *> all = {
        llama_kvp_stage_budget_uniform(),
        llama_kvp_stage_budget_pyramid(),
        llama_kvp_stage_budget_entropy(),
        llama_kvp_stage_score_recency(),
        llama_kvp_stage_score_window(),
        llama_kvp_stage_score_accumulated(),
        llama_kvp_stage_schedule_prompt(),
        llama_kvp_stage_schedule_every(),
        llama_kvp_stage_schedule_freeze(),
        llama_kvp_stage_schedule_latent(),
        llama_kvp_stage_fate_drop(),
        llama_kvp_stage_fate_summarise(),
        llama_kvp_stage_fate_host(),
        llama_kvp_stage_prefill_dense(),
        llama_kvp_stage_prefill_sparse(),
    };
    return all;
}

const llama_kvp_stage * llama_kvp_stage_by_id(int32_t id) {
    for (const auto * s : llama_kvp_stage_all()) {
        if (s->id == id) {
            return s;
        }
    }
    return nullptr;
}

const llama_kvp_stage * llama_kvp_stage_by_name(const std::string & name) {
    for (const auto * s : llama_kvp_stage_all()) {
        if (name == s->name) {
            return s;
        }
    }
    return nullptr;
}

const char * llama_kvp_slot_name(int32_t slot) {
    switch (slot) {
        case LLAMA_KVP_SLOT_BUDGET:   return "budget";
        case LLAMA_KVP_SLOT_SCORE:    return "score";
        case LLAMA_KVP_SLOT_SCHEDULE: return "schedule";
        case LLAMA_KVP_SLOT_FATE:     return "fate";
        case LLAMA_KVP_SLOT_PREFILL:  return "prefill";
        default:                      return "unknown";
    }
}

template <typename T>
static const T * llama_kvp_stage_in(const llama_kvp_policy & p, int32_t slot) {
    const llama_kvp_stage * s = llama_kvp_stage_by_id(p.stage[slot]);
    return s && s->slot == slot ? static_cast<const T *>(s) : nullptr;
}

const llama_kvp_budget_stage   * llama_kvp_budget_of  (const llama_kvp_policy & p) { return llama_kvp_stage_in<llama_kvp_budget_stage>  (p, LLAMA_KVP_SLOT_BUDGET);   }
const llama_kvp_score_stage    * llama_kvp_score_of   (const llama_kvp_policy & p) { return llama_kvp_stage_in<llama_kvp_score_stage>   (p, LLAMA_KVP_SLOT_SCORE);    }
const llama_kvp_schedule_stage * llama_kvp_schedule_of(const llama_kvp_policy & p) { return llama_kvp_stage_in<llama_kvp_schedule_stage>(p, LLAMA_KVP_SLOT_SCHEDULE); }
const llama_kvp_fate_stage     * llama_kvp_fate_of    (const llama_kvp_policy & p) { return llama_kvp_stage_in<llama_kvp_fate_stage>    (p, LLAMA_KVP_SLOT_FATE);     }
const llama_kvp_prefill_stage  * llama_kvp_prefill_of (const llama_kvp_policy & p) { return llama_kvp_stage_in<llama_kvp_prefill_stage> (p, LLAMA_KVP_SLOT_PREFILL);  }

//
// default behaviour of the slot interfaces
//

std::vector<uint32_t> llama_kvp_budget_stage::initial(const llama_kvp_policy & p, uint32_t mean, int32_t n_layer, uint32_t lo, uint32_t hi) const {
    (void) p; (void) lo; (void) hi;
    return std::vector<uint32_t>(std::max<int32_t>(n_layer, 0), mean);
}

bool llama_kvp_budget_stage::from_entropy(const llama_kvp_policy & p, const float * entropy, int32_t n_layer, uint32_t mean,
                                          uint32_t lo, uint32_t hi, std::vector<uint32_t> & out) const {
    (void) p; (void) entropy; (void) n_layer; (void) mean; (void) lo; (void) hi; (void) out;
    return false;
}

// sinks first, then the top-k share of the rest by score; what the top-k share leaves goes to the recent window
void llama_kvp_score_stage::protect(const llama_kvp_policy & p, uint32_t budget, uint32_t & n_sink, uint32_t & n_recent) const {
    n_sink = (uint32_t) p.n_sink;
    const uint32_t rest = budget > n_sink ? budget - n_sink : 0;
    const uint32_t topk = (uint32_t) std::lround(p.topk_share*rest);
    n_recent = std::max<uint32_t>((uint32_t) p.n_recent, rest - std::min(rest, topk));
}

uint32_t llama_kvp_prefill_stage::chunk(const llama_kvp_policy & p, uint32_t n_ubatch) const {
    const uint32_t n_g = n_guide(p, n_ubatch);
    return std::max<uint32_t>(1, std::min<uint32_t>((uint32_t) p.chunk, n_ubatch - n_g));
}

//
// shared checks
//

std::string llama_kvp_check_budget(const llama_kvp_policy & p) {
    char buf[256];
    if (!std::isfinite(p.budget) || p.budget <= 0.0f) {
        snprintf(buf, sizeof(buf), "budget must be a token count >= 1 or a fraction of the prompt in (0, 1) (got %g)", (double) p.budget);
        return buf;
    }
    if (p.budget >= 1.0f && p.budget != std::floor(p.budget)) {
        snprintf(buf, sizeof(buf), "a budget >= 1 is a token count and must be a whole number (got %g)", (double) p.budget);
        return buf;
    }
    if (p.budget >= 16777216.0f && p.budget != LLAMA_KVP_BUDGET_ALL) { // past 2^24 a float holds another count
        snprintf(buf, sizeof(buf), "budget %.0f is too large (at most 16777215 tokens)", (double) p.budget);
        return buf;
    }
    return "";
}

std::string llama_kvp_check_protect(const llama_kvp_policy & p, int32_t min_recent) {
    char buf[256];
    if (p.n_sink < 0) {
        snprintf(buf, sizeof(buf), "n_sink must be >= 0 (got %d)", p.n_sink);
        return buf;
    }
    if (p.n_recent < min_recent) {
        snprintf(buf, sizeof(buf), "n_recent must be >= %d (got %d)", min_recent, p.n_recent);
        return buf;
    }
    return "";
}

std::string llama_kvp_check_window(const llama_kvp_policy & p) {
    char buf[256];
    if (p.window < 1) {
        snprintf(buf, sizeof(buf), "window must be >= 1 (got %d)", p.window);
        return buf;
    }
    return "";
}

std::string llama_kvp_check_decay(const llama_kvp_policy & p) {
    char buf[256];
    if (!(p.decay >= 0.0f && p.decay <= 1.0f)) {
        snprintf(buf, sizeof(buf), "decay must be in [0, 1] (got %g)", (double) p.decay);
        return buf;
    }
    return "";
}

std::string llama_kvp_check_layer_share(const char * key, float share) {
    char buf[128];
    if (!(share > 0.0f && share <= 1.0f)) {
        snprintf(buf, sizeof(buf), "%s must be in (0, 1] (got %g)", key, (double) share);
        return buf;
    }
    return "";
}

int32_t llama_kvp_layer_share_count(float share, int32_t n_layer) {
    return std::max<int32_t>(1, (int32_t) (share*n_layer + 0.5f));
}

std::string llama_kvp_check_chunk(const llama_kvp_policy & p) {
    char buf[128];
    if (p.guide != 0 && p.guide != 1) {
        snprintf(buf, sizeof(buf), "guide must be 0 or 1 (got %d)", p.guide);
        return buf;
    }
    if (p.chunk < 1) {
        snprintf(buf, sizeof(buf), "chunk must be >= 1 (got %d)", p.chunk);
        return buf;
    }
    return "";
}

// the prompt's end runs behind a chunk where a ubatch holds it and a chunk at least as long: a smaller ubatch would
// cut the prompt into chunks of a few tokens (n_ubatch = window + 1: one token each, 10x the time) and stays unguided
uint32_t llama_kvp_prefill_n_guide(const llama_kvp_policy & p, uint32_t n_ubatch) {
    return p.guide && p.window > 0 && n_ubatch >= 2*(uint32_t) p.window ? (uint32_t) p.window : 0;
}

std::string llama_kvp_check_observed_score(const llama_kvp_policy & p) {
    std::string err = llama_kvp_check_window(p);
    if (err.empty()) { err = llama_kvp_check_decay(p); }
    if (err.empty()) { err = llama_kvp_check_protect(p, 0); }
    if (err.empty() && !(p.topk_share >= 0.0f && p.topk_share <= 1.0f)) {
        char buf[128];
        snprintf(buf, sizeof(buf), "topk_share must be in [0, 1] (got %g)", (double) p.topk_share);
        err = buf;
    }
    return err;
}

//
// selection (pure): which tokens a full layer keeps
//

void llama_kvp_clamp_protected(uint32_t n_keep, uint32_t & n_sink, uint32_t & n_recent) {
    n_recent = std::max<uint32_t>(1, std::min(n_recent, n_keep));
    n_sink   = std::min(n_sink, n_keep - n_recent);
}

std::vector<uint32_t> llama_kvp_rank_middle(const std::vector<llama_kvp_cell> & cells, uint32_t i0, uint32_t i1, uint32_t n_topk) {
    // a before b: the better score, the newer token on ties (a strict order, so the leavers are one set)
    const auto better = [&](uint32_t a, uint32_t b) {
        return cells[a].score != cells[b].score ? cells[a].score > cells[b].score : cells[a].pos > cells[b].pos;
    };
    const uint32_t n_mid = i1 > i0 ? i1 - i0 : 0;
    std::vector<uint32_t> mid(n_mid);
    for (uint32_t j = 0; j < n_mid; ++j) {
        mid[j] = i0 + j;
    }
    if (n_topk >= n_mid) {
        return mid;
    }
    const uint32_t n_leave = n_mid - n_topk;
    if (n_leave > 16) {
        std::nth_element(mid.begin(), mid.begin() + n_topk, mid.end(), better);
        std::sort(mid.begin() + n_topk, mid.end());
        return mid;
    }
    // few leave (a decode step): one pass that keeps the n_leave worst, the best of them first
    std::vector<uint32_t> worst;
    worst.reserve(n_leave + 1);
    for (uint32_t j = i0; j < i1; ++j) {
        if (worst.size() == n_leave && !better(worst[0], j)) {
            continue;
        }
        if (worst.size() == n_leave) {
            worst.erase(worst.begin());
        }
        auto it = worst.begin();
        while (it != worst.end() && better(*it, j)) {
            ++it;
        }
        worst.insert(it, j);
    }
    std::sort(worst.begin(), worst.end());
    uint32_t k = 0;
    uint32_t w = 0;
    for (uint32_t j = i0; j < i1; ++j) {
        if (w < n_leave && worst[w] == j) {
            w++;
        } else {
            mid[k++] = j;
        }
    }
    std::copy(worst.begin(), worst.end(), mid.begin() + n_topk);
    return mid;
}

int32_t llama_kvp_select_tokens(const struct llama_kvp_policy * p, int32_t il, int32_t n_layer, const float * mass,
                                const float * last, const float * value, int32_t n, int32_t n_keep, int32_t * keep) {
    if (!p || !mass || !keep || n < 0 || n_keep < 1 || n_layer < 1 || il < 0 || il >= n_layer) {
        llama_kvp_set_error("select_tokens: need a policy, non-NULL arrays, 0 <= il < n_layer, n >= 0 and n_keep >= 1");
        return -1;
    }
    if (llama_kvp_policy_validate(p) != 0) {
        return -1;
    }
    const llama_kvp_score_stage * stage = llama_kvp_score_of(*p);
    if (!stage || !llama_kvp_budget_of(*p)) {
        llama_kvp_set_error("select_tokens: the policy has no score stage (it keeps every token)");
        return -1;
    }
    for (int32_t j = 0; j < n; ++j) {
        if (!std::isfinite(mass[j]) || (last && !std::isfinite(last[j])) || (value && !std::isfinite(value[j]))) {
            llama_kvp_set_error("select_tokens: mass, last and value must be finite (token " + std::to_string(j) + ")");
            return -1;
        }
        keep[j] = 1;
    }
    if (n <= n_keep) {
        return 0;
    }
    uint32_t n_sink   = 0;
    uint32_t n_recent = 0;
    stage->protect(*p, (uint32_t) n_keep, n_sink, n_recent);
    llama_kvp_clamp_protected((uint32_t) n_keep, n_sink, n_recent);
    std::vector<llama_kvp_cell> cells(n);
    for (int32_t j = 0; j < n; ++j) {
        const float m = stage->observes() ? mass[j] : 0.0f;
        cells[j] = { (llama_pos) j, (uint32_t) j, m, value ? value[j] : 1.0f, last && stage->observes() ? last[j] : m };
    }
    const uint32_t i0     = n_sink;
    const uint32_t i1     = n - n_recent;
    const uint32_t n_topk = n_keep - n_sink - n_recent;
    if (stage->observes() && i1 > i0 && n_topk > 0) {
        stage->score(*p, il, n_layer, i0, i1, n_topk, cells);
    }
    const std::vector<uint32_t> mid = llama_kvp_rank_middle(cells, i0, i1, n_topk);
    for (size_t j = n_topk; j < mid.size(); ++j) {
        keep[mid[j]] = 0;
    }
    return 0;
}

//
// budget allocation (pure): proportional to weights, clamped, summing to the total exactly
//

int32_t llama_kvp_allocate_budgets(const float * entropy, int32_t n_layer, int64_t total,
                                   int32_t min_layer, int32_t max_layer, int32_t * out) {
    if (!entropy || !out || n_layer <= 0) {
        llama_kvp_set_error("allocate_budgets: need at least one layer and non-NULL arrays");
        return -1;
    }
    if (min_layer < 0 || max_layer < min_layer) {
        llama_kvp_set_error("allocate_budgets: need 0 <= min_layer <= max_layer (got " + std::to_string(min_layer) + ", " + std::to_string(max_layer) + ")");
        return -1;
    }
    if (total < (int64_t) min_layer*n_layer || total > (int64_t) max_layer*n_layer) {
        llama_kvp_set_error("allocate_budgets: a total of " + std::to_string(total) + " tokens cannot be split over " +
                std::to_string(n_layer) + " layers within [" + std::to_string(min_layer) + ", " + std::to_string(max_layer) + "]");
        return -1;
    }

    // weights: non-finite or negative entropies count as 0; all zero -> uniform
    std::vector<double> w(n_layer);
    double w_sum = 0.0;
    for (int32_t l = 0; l < n_layer; ++l) {
        w[l] = std::isfinite(entropy[l]) && entropy[l] > 0.0f ? entropy[l] : 0.0;
        w_sum += w[l];
    }
    if (w_sum <= 0.0) {
        std::fill(w.begin(), w.end(), 1.0);
    }

    // proportional shares with clamping: layers that hit a bound are fixed there and the rest is re-split
    std::vector<double> share(n_layer, 0.0);
    std::vector<bool>   fixed(n_layer, false);
    for (int32_t iter = 0; iter <= n_layer; ++iter) {
        double rest  = (double) total;
        double w_free = 0.0;
        for (int32_t l = 0; l < n_layer; ++l) {
            if (fixed[l]) {
                rest -= share[l];
            } else {
                w_free += w[l];
            }
        }
        bool changed = false;
        for (int32_t l = 0; l < n_layer; ++l) {
            if (fixed[l]) {
                continue;
            }
            share[l] = w_free > 0.0 ? rest*w[l]/w_free : 0.0;
        }
        // fix the worst violations of one side per round (all lows if the lows weigh more, else all highs)
        double lo = 0.0;
        double hi = 0.0;
        for (int32_t l = 0; l < n_layer; ++l) {
            if (!fixed[l] && share[l] < min_layer) { lo += min_layer - share[l]; }
            if (!fixed[l] && share[l] > max_layer) { hi += share[l] - max_layer; }
        }
        for (int32_t l = 0; l < n_layer; ++l) {
            if (fixed[l]) {
                continue;
            }
            if (lo >= hi && lo > 0.0 && share[l] < min_layer) { share[l] = min_layer; fixed[l] = true; changed = true; }
            if (hi >  lo && share[l] > max_layer)             { share[l] = max_layer; fixed[l] = true; changed = true; }
        }
        if (!changed) {
            break;
        }
    }

    // integer budgets: floors, then the largest remainders get the leftover tokens
    int64_t sum = 0;
    std::vector<std::pair<double, int32_t>> rem(n_layer);
    for (int32_t l = 0; l < n_layer; ++l) {
        const double s = std::min<double>(max_layer, std::max<double>(min_layer, share[l]));
        out[l] = (int32_t) std::floor(s);
        sum += out[l];
        rem[l] = { s - out[l], l };
    }
    std::sort(rem.begin(), rem.end(), [](const auto & a, const auto & b) {
        return a.first != b.first ? a.first > b.first : a.second < b.second;
    });
    for (size_t i = 0; sum < total && i < 4*rem.size() + 4; ++i) {
        const int32_t l = rem[i % rem.size()].second;
        if (out[l] < max_layer) {
            out[l]++;
            sum++;
        }
    }
    for (size_t i = 0; sum > total && i < 4*rem.size() + 4; ++i) {
        const int32_t l = rem[rem.size() - 1 - i % rem.size()].second;
        if (out[l] > min_layer) {
            out[l]--;
            sum--;
        }
    }
    return 0;
}


void llama_kvp_run_tasks(int32_t n_tasks, int32_t n_threads, const std::function<void(int32_t, int32_t)> & fn) {
    const int32_t n_thr = std::max(1, std::min(n_tasks, n_threads));
    std::atomic<int32_t> next(0);
    auto work = [&](int32_t thread) {
        for (int32_t t = next++; t < n_tasks; t = next++) {
            fn(t, thread);
        }
    };
    std::vector<std::thread> workers;
    for (int32_t t = 1; t < n_thr; ++t) {
        try {
            workers.emplace_back(work, t);
        } catch (const std::system_error &) {
            break; // no more threads: the others (this one at least) take the tasks
        }
    }
    work(0);
    for (auto & w : workers) {
        w.join();
    }
}
