// score-window.cpp - score stage `window` (SnapKV): a token's score is the attention the last `window` queries pay
// it (mass averaged over heads and window queries; with decay > 0 older observations still count), pooled over
// `pool` neighbouring positions: the average (SnapKV), or with pool_max the maximum, which keeps a whole span (a
// number, a name) around a token the window attends to. Kept: n_sink sinks, the top `topk_share` of the rest of the
// layer budget by score, the most recent tokens for what is left (at least n_recent).

#include "llama-kvp-stage.h"

#include <algorithm>
#include <cstdio>

struct llama_kvp_score_window : llama_kvp_score_stage {
    llama_kvp_score_window() : llama_kvp_score_stage(LLAMA_KVP_SCORE_WINDOW, LLAMA_KVP_SLOT_SCORE, "window",
            "window,pool,pool_max,decay,n_sink,n_recent,topk_share",
            "attention of the last `window` queries, pooled over `pool` positions (max with pool_max=1)") {}

    void defaults(llama_kvp_policy & p) const override {
        p.window     = 32;
        p.pool       = 5;
        p.pool_max   = 0;
        p.decay      = 0.0f;
        p.n_sink     = 0;
        p.n_recent   = 32;
        p.topk_share = 1.0f;
    }

    std::string check(const llama_kvp_policy & p) const override {
        const std::string err = llama_kvp_check_observed_score(p);
        if (!err.empty()) {
            return err;
        }
        char buf[128];
        if (p.pool < 1 || p.pool % 2 == 0) {
            snprintf(buf, sizeof(buf), "pool must be an odd width >= 1 (got %d)", p.pool);
            return buf;
        }
        if (p.pool_max != 0 && p.pool_max != 1) {
            snprintf(buf, sizeof(buf), "pool_max must be 0 or 1 (got %d)", p.pool_max);
            return buf;
        }
        return "";
    }

    bool observes() const override { return true; }

    void score(const llama_kvp_policy & p, std::vector<llama_kvp_cell> & cells) const override {
        const int32_t n = (int32_t) cells.size();
        if (p.pool <= 1 || n == 0) {
            return;
        }
        const bool    use_max = p.pool_max != 0;
        const int32_t r = p.pool/2;
        std::vector<float> pooled(n);
        for (int32_t j = 0; j < n; ++j) {
            const int32_t a = std::max<int32_t>(0, j - r);
            const int32_t b = std::min<int32_t>(n - 1, j + r);
            float s = 0.0f;
            for (int32_t k = a; k <= b; ++k) {
                s = use_max ? std::max(s, cells[k].score) : s + cells[k].score;
            }
            pooled[j] = use_max ? s : s/(b - a + 1);
        }
        for (int32_t j = 0; j < n; ++j) {
            cells[j].score = pooled[j];
        }
    }
};

const llama_kvp_stage * llama_kvp_stage_score_window() {
    static const llama_kvp_score_window stage;
    return &stage;
}
