// budget-pyramid.cpp - budget stage `pyramid` (PyramidKV): fixed layer budgets decreasing linearly from
// budget*(1+slope) at the first layer to budget*(1-slope) at the last, with the same total.

#include "llama-kvp-stage.h"

#include <algorithm>
#include <cstdio>

struct llama_kvp_budget_pyramid : llama_kvp_budget_stage {
    llama_kvp_budget_pyramid() : llama_kvp_budget_stage(LLAMA_KVP_BUDGET_PYRAMID, LLAMA_KVP_SLOT_BUDGET, "pyramid", "budget,slope",
            "layer budgets decreasing linearly from budget*(1+slope) to budget*(1-slope)") {}

    void defaults(llama_kvp_policy & p) const override {
        p.budget = 0.25f;
        p.slope  = 0.5f;
    }

    std::string check(const llama_kvp_policy & p) const override {
        const std::string err = llama_kvp_check_budget(p);
        if (!err.empty()) {
            return err;
        }
        if (!(p.slope >= 0.0f && p.slope < 1.0f)) {
            char buf[128];
            snprintf(buf, sizeof(buf), "slope must be in [0, 1) (got %g)", (double) p.slope);
            return buf;
        }
        return "";
    }

    std::vector<uint32_t> initial(const llama_kvp_policy & p, uint32_t mean, int32_t n_layer, uint32_t lo, uint32_t hi) const override {
        std::vector<uint32_t> res(std::max<int32_t>(n_layer, 0), mean);
        if (n_layer < 2) {
            return res;
        }
        std::vector<float>   w(n_layer);
        std::vector<int32_t> out(n_layer);
        for (int32_t l = 0; l < n_layer; ++l) {
            w[l] = 1.0f + p.slope*(1.0f - 2.0f*l/(n_layer - 1));
        }
        const int32_t lo_l = std::min<int32_t>(mean, lo);
        const int32_t hi_l = std::max<int32_t>(hi, mean);
        if (llama_kvp_allocate_budgets(w.data(), n_layer, (int64_t) mean*n_layer, lo_l, hi_l, out.data()) == 0) {
            for (int32_t l = 0; l < n_layer; ++l) {
                res[l] = (uint32_t) out[l];
            }
        }
        return res;
    }
};

const llama_kvp_stage * llama_kvp_stage_budget_pyramid() {
    static const llama_kvp_budget_pyramid stage;
    return &stage;
}
