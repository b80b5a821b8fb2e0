// schedule-every.cpp - schedule stage `every`: besides the prompt batches, every `every`-th decode step observes
// and refreshes the scores. Decode steps evict down to the budgets once per refresh, at the step after it: between
// refreshes the scores stay the same, and evicting at every step cost ~9% of a decode step in host work (sorting,
// pooling and ranking each layer's ~1k cells to drop one of them; measured in docs/NOTES.md, issue 11). A layer
// then holds up to every - 1 tokens beyond its budget, all of them newer than any token the eviction ranks.

#include "llama-kvp-stage.h"

#include <cstdio>

struct llama_kvp_schedule_every : llama_kvp_schedule_stage {
    llama_kvp_schedule_every() : llama_kvp_schedule_stage(LLAMA_KVP_SCHEDULE_EVERY, LLAMA_KVP_SLOT_SCHEDULE, "every", "every",
            "also observe every `every` decode steps, and evict at the step after each") {}

    void defaults(llama_kvp_policy & p) const override {
        p.every = 16;
    }

    std::string check(const llama_kvp_policy & p) const override {
        if (p.every < 0) {
            char buf[128];
            snprintf(buf, sizeof(buf), "every must be >= 0 (got %d; 0 observes prompt batches only)", p.every);
            return buf;
        }
        return "";
    }

    bool observe_step(const llama_kvp_policy & p, int32_t n_decode) const override {
        return p.every > 0 && (n_decode + 1) % p.every == 0;
    }

    bool evict_step(const llama_kvp_policy & p, int32_t n_decode) const override {
        return p.every <= 1 || n_decode % p.every == 0;
    }
};

const llama_kvp_stage * llama_kvp_stage_schedule_every() {
    static const llama_kvp_schedule_every stage;
    return &stage;
}
