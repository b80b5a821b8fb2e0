// budget-uniform.cpp - budget stage `uniform`: every layer keeps the same number of tokens (SnapKV, H2O).

#include "llama-kvp-stage.h"

struct llama_kvp_budget_uniform : llama_kvp_budget_stage {
    llama_kvp_budget_uniform() : llama_kvp_budget_stage(LLAMA_KVP_BUDGET_UNIFORM, LLAMA_KVP_SLOT_BUDGET, "uniform", "budget",
            "every layer keeps `budget` tokens (a count, or a fraction of the prompt)") {}

    void defaults(llama_kvp_policy & p) const override {
        p.budget = 0.25f;
    }

    std::string check(const llama_kvp_policy & p) const override {
        return llama_kvp_check_budget(p);
    }

    // initial(): the uniform split of the base interface
};

const llama_kvp_stage * llama_kvp_stage_budget_uniform() {
    static const llama_kvp_budget_uniform stage;
    return &stage;
}
