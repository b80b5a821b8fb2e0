// budget-entropy.cpp - budget stage `entropy` (Kim & Jung): the total budget is split over layers in proportion to
// the mean head entropy observed on the prompt, each layer within [min_layer, max_layer]. Until the first prompt
// observation every layer has the mean budget; every observed prompt ubatch refines the split (the entropy is the
// mean over the prompt observations so far); decode-step observations refresh scores, not budgets.

#include "llama-kvp-stage.h"

#include <algorithm>
#include <cstdio>

struct llama_kvp_budget_entropy : llama_kvp_budget_stage {
    llama_kvp_budget_entropy() : llama_kvp_budget_stage(LLAMA_KVP_BUDGET_ENTROPY, LLAMA_KVP_SLOT_BUDGET, "entropy", "budget,min_layer,max_layer,split_share",
            "layer budgets in proportion to the prompt's mean head entropy, within [min_layer, max_layer] (0: budget/4, 2*budget), "
            "over the first split_share of the layers (the others keep the mean)") {}

    void defaults(llama_kvp_policy & p) const override {
        p.budget    = 0.25f;
        p.min_layer = 0;
        p.max_layer = 0;
        p.split_share = 0.5f;
    }

    std::string check(const llama_kvp_policy & p) const override {
        std::string err = llama_kvp_check_budget(p);
        if (!err.empty()) {
            return err;
        }
        char buf[256];
        if (p.min_layer < 0) {
            snprintf(buf, sizeof(buf), "min_layer must be >= 0 (got %d; 0 = budget/4)", p.min_layer);
            return buf;
        }
        if (p.max_layer < 0) {
            snprintf(buf, sizeof(buf), "max_layer must be >= 0 (got %d; 0 = 2*budget)", p.max_layer);
            return buf;
        }
        err = llama_kvp_check_layer_share("split_share", p.split_share);
        if (!err.empty()) {
            return err;
        }
        if (p.min_layer > 0 && p.max_layer > 0 && p.min_layer > p.max_layer) {
            snprintf(buf, sizeof(buf), "min_layer (%d) is larger than max_layer (%d)", p.min_layer, p.max_layer);
            return buf;
        }
        if (p.budget >= 1.0f && p.min_layer > 0 && (float) p.min_layer > p.budget) {
            snprintf(buf, sizeof(buf), "min_layer (%d) is larger than the budget (%g)", p.min_layer, (double) p.budget);
            return buf;
        }
        if (p.budget >= 1.0f && p.max_layer > 0 && (float) p.max_layer < p.budget) {
            snprintf(buf, sizeof(buf), "max_layer (%d) is smaller than the budget (%g)", p.max_layer, (double) p.budget);
            return buf;
        }
        return "";
    }

    bool uses_entropy() const override { return true; }

    bool from_entropy(const llama_kvp_policy & p, const float * entropy, int32_t n_layer, uint32_t mean,
                      uint32_t lo, uint32_t hi, std::vector<uint32_t> & out) const override {
        const int32_t lo_l = p.min_layer > 0 ? p.min_layer : std::max<int32_t>(lo, mean/4);
        const int32_t hi_l = p.max_layer > 0 ? p.max_layer : (int32_t) std::min<uint32_t>(2*mean, hi);
        const int32_t n_split = llama_kvp_layer_share_count(p.split_share, n_layer);
        std::vector<int32_t> res(n_layer, (int32_t) mean);
        if (llama_kvp_allocate_budgets(entropy, n_split, (int64_t) mean*n_split, std::min<int32_t>(lo_l, mean),
                    std::max<int32_t>(hi_l, mean), res.data()) != 0) {
            return false;
        }
        out.assign(res.begin(), res.end());
        return true;
    }
};

const llama_kvp_stage * llama_kvp_stage_budget_entropy() {
    static const llama_kvp_budget_entropy stage;
    return &stage;
}
