// score-window.cpp - score stage `window` (SnapKV): a token's score is the attention the last `window` queries pay
// it (mass averaged over heads and window queries; with decay > 0 older observations still count), pooled over
// neighbouring positions. The average over `pool` positions (SnapKV) smooths the scores; the maximum over
// `span_pool` positions (0: pool) keeps a whole span (a number, a name) around a token the window attends to, at the
// price of the budget the span's weaker neighbours take. `pool_max` is the share of the top-k that goes to such
// spans: the middle tokens whose max-pooled score is among the best pool_max*n_topk rank first (by that score), the
// others follow by their average-pooled score; 0 is SnapKV's average, 1 the max everywhere. Spans are formed only in
// the last `span_share` of the layers, the others average only (measured: spans in the late half alone cost less
// streamed KL, but hold a chat's early fact in fewer layers; docs/NOTES.md). With `fill`, the scores of the last
// `fill_share` of the layers are then closed: a hole of up to `fill` tokens between two better-scored tokens ranks
// with the weaker of the two, so the digits in the middle of a number whose ends are attended stay with them (max
// pooling widens every peak instead; filled holes in every layer cost 13% of the essays' streamed KL at 10%, in the
// late half 3%). With `vnorm`, a token's mass is first weighted by the norm of its value vectors to that power
// (VATP: attention to a token whose value is near zero, a sink or a punctuation mark, moves the output little; the
// norm is the mean over the KV heads, as the mass is the mean over the heads). With `fresh` > 0 the decay counts in
// full for the spans alone: they rank by the decayed sum of the observations (a fact the prompt's question attended
// in every chunk stays), every other token by fresh x the last observation + (1 - fresh) x the sum, so that the rest
// of the top-k follows a text as it goes on. Measured: the sum is what keeps the needles, the last observation what
// follows a streamed text (docs/NOTES.md). Kept: n_sink sinks, the top
// `topk_share` of the rest of the layer budget by score, the most recent tokens for what is left (at least n_recent).

#include "llama-kvp-stage.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>

struct llama_kvp_score_window : llama_kvp_score_stage {
    llama_kvp_score_window() : llama_kvp_score_stage(LLAMA_KVP_SCORE_WINDOW, LLAMA_KVP_SLOT_SCORE, "window",
            "window,pool,pool_max,span_pool,span_share,fill,fill_share,vnorm,fresh,decay,n_sink,n_recent,topk_share",
            "attention of the last `window` queries, times the value norm to the power vnorm, pooled over `pool` "
            "positions (a pool_max share of the top-k as whole spans, in the last span_share of the layers; holes of "
            "up to `fill` tokens closed in the last fill_share; the top-k outside the spans by a `fresh` share of the "
            "last observation)") {}

    void defaults(llama_kvp_policy & p) const override {
        p.window     = 32;
        p.pool       = 5;
        p.pool_max   = 0.0f;
        p.span_pool  = 0;
        p.span_share = 1.0f;
        p.fill       = 0;
        p.fill_share = 0.5f;
        p.vnorm      = 0.0f;
        p.fresh      = 0.0f;
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
        if (p.span_pool < 0 || (p.span_pool > 0 && p.span_pool % 2 == 0)) {
            snprintf(buf, sizeof(buf), "span_pool must be an odd width >= 1, or 0 for pool's (got %d)", p.span_pool);
            return buf;
        }
        if (!(p.pool_max >= 0.0f && p.pool_max <= 1.0f)) {
            snprintf(buf, sizeof(buf), "pool_max must be in [0, 1] (got %g)", (double) p.pool_max);
            return buf;
        }
        std::string e = llama_kvp_check_layer_share("span_share", p.span_share);
        if (!e.empty()) {
            return e;
        }
        if (p.fill < 0 || p.fill > 64) {
            snprintf(buf, sizeof(buf), "fill must be in [0, 64] tokens (got %d)", p.fill);
            return buf;
        }
        if (!(p.vnorm >= 0.0f && p.vnorm <= 4.0f)) {
            snprintf(buf, sizeof(buf), "vnorm must be in [0, 4] (got %g)", (double) p.vnorm);
            return buf;
        }
        if (!(p.fresh >= 0.0f && p.fresh <= 1.0f)) {
            snprintf(buf, sizeof(buf), "fresh must be in [0, 1] (got %g)", (double) p.fresh);
            return buf;
        }
        return llama_kvp_check_layer_share("fill_share", p.fill_share);
    }

    bool observes() const override { return true; }

    bool uses_values(const llama_kvp_policy & p) const override { return p.vnorm > 0.0f; }

    bool uses_last(const llama_kvp_policy & p) const override { return p.fresh > 0.0f; }

    void score(const llama_kvp_policy & p, int32_t il, int32_t n_layer, uint32_t i0, uint32_t i1, uint32_t n_topk,
               std::vector<llama_kvp_cell> & cells) const override {
        // spans in the last span_share of the layers, filled holes in the last fill_share (each at least the last layer)
        const int32_t n_span_layers = llama_kvp_layer_share_count(p.span_share, n_layer);
        const int32_t n_fill_layers = llama_kvp_layer_share_count(p.fill_share, n_layer);
        const float   pool_max      = il >= n_layer - n_span_layers ? p.pool_max : 0.0f;
        const int32_t fill          = il >= n_layer - n_fill_layers ? p.fill : 0;

        const int32_t n  = (int32_t) cells.size();
        if (p.vnorm > 0.0f) {
            for (auto & c : cells) {
                const float w = p.vnorm == 1.0f ? c.value : std::pow(c.value, p.vnorm);
                c.score *= w;
                c.last  *= w;
            }
        }
        // what the average ranks: the decayed sum, and with fresh a share of the last observation alone
        std::vector<float> base(n);
        for (int32_t j = 0; j < n; ++j) {
            base[j] = p.fresh > 0.0f ? p.fresh*cells[j].last + (1.0f - p.fresh)*cells[j].score : cells[j].score;
        }
        const int32_t ra = p.pool/2;                                  // radius of the average
        const int32_t rm = (p.span_pool > 0 ? p.span_pool : p.pool)/2; // radius of the max (the spans)
        if (n == 0 || (ra == 0 && rm == 0)) {
            for (int32_t j = 0; j < n && pool_max < 1.0f; ++j) {
                cells[j].score = base[j];
            }
            llama_kvp_score_fill(fill, cells);
            return;
        }
        // each pooling only where it is used (this runs at every eviction of every layer)
        const bool use_avg = pool_max < 1.0f;
        const bool use_max = pool_max > 0.0f;
        std::vector<float> avg(n, 0.0f);
        std::vector<float> mx(n, 0.0f);
        for (int32_t j = 0; j < n; ++j) {
            if (use_avg) {
                const int32_t a = std::max<int32_t>(0, j - ra);
                const int32_t b = std::min<int32_t>(n - 1, j + ra);
                float s = 0.0f;
                for (int32_t k = a; k <= b; ++k) {
                    s += base[k];
                }
                avg[j] = s/(b - a + 1);
            }
            if (use_max) {
                float m = 0.0f;
                for (int32_t k = std::max<int32_t>(0, j - rm); k <= std::min<int32_t>(n - 1, j + rm); ++k) {
                    m = std::max(m, cells[k].score);
                }
                mx[j] = m;
            }
        }
        // the spans: middle tokens whose max-pooled score reaches the n_span-th best of the middle; they rank above
        // every other token
        const uint32_t n_mid  = i1 > i0 ? i1 - i0 : 0;
        const uint32_t n_span = std::min(n_mid, (uint32_t) (pool_max*n_topk + 0.5f));
        float t = INFINITY;
        if (use_max && use_avg && n_span > 0) {
            std::vector<float> best(mx.begin() + i0, mx.begin() + i1);
            std::nth_element(best.begin(), best.begin() + (n_span - 1), best.end(), std::greater<float>());
            t = best[n_span - 1];
        }
        float top = 0.0f;
        if (t < INFINITY) {
            top = *std::max_element(avg.begin(), avg.end());
        }
        for (int32_t j = 0; j < n; ++j) {
            cells[j].score = !use_avg ? mx[j] : (mx[j] >= t && mx[j] > 0.0f) ? top + mx[j] : avg[j];
        }
        llama_kvp_score_fill(fill, cells);
    }

    // closing of the scores with a window of fill + 1 tokens: the max over each window, then at each token the min of
    // those over the windows that hold it (scores are >= 0 and count as 0 past either end, so an end is no side); a
    // hole of up to `fill` tokens rises to the weaker of its two sides, every other score (an edge, a peak, a longer
    // valley) stays
    static void llama_kvp_score_fill(int32_t fill, std::vector<llama_kvp_cell> & cells) {
        const int32_t n = (int32_t) cells.size();
        const int32_t w = fill + 1;
        if (fill <= 0 || n == 0) {
            return;
        }
        // dil[k + w - 1]: the max over the window [k, k + w) for k in [1 - w, n)
        std::vector<float> dil(n + w - 1);
        for (int32_t k = 1 - w; k < n; ++k) {
            float m = 0.0f;
            for (int32_t i = std::max<int32_t>(0, k); i < std::min<int32_t>(n, k + w); ++i) {
                m = std::max(m, cells[i].score);
            }
            dil[k + w - 1] = m;
        }
        for (int32_t j = 0; j < n; ++j) {
            float c = INFINITY;
            for (int32_t k = j - w + 1; k <= j; ++k) {
                c = std::min(c, dil[k + w - 1]);
            }
            cells[j].score = std::max(cells[j].score, c);
        }
    }
};

const llama_kvp_stage * llama_kvp_stage_score_window() {
    static const llama_kvp_score_window stage;
    return &stage;
}
