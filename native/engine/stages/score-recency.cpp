// score-recency.cpp - score stage `recency` (StreamingLLM): a layer keeps its first n_sink and last n_recent
// tokens; nothing is observed and nothing is chosen by score.

#include "llama-kvp-stage.h"

struct llama_kvp_score_recency : llama_kvp_score_stage {
    llama_kvp_score_recency() : llama_kvp_score_stage(LLAMA_KVP_SCORE_RECENCY, LLAMA_KVP_SLOT_SCORE, "recency", "n_sink,n_recent",
            "keep the first n_sink and the last n_recent tokens; no observation") {}

    void defaults(llama_kvp_policy & p) const override {
        p.n_sink   = 4;
        p.n_recent = 252;
    }

    std::string check(const llama_kvp_policy & p) const override {
        return llama_kvp_check_protect(p, 1);
    }

    bool observes() const override { return false; }

    bool protected_only() const override { return true; }

    void protect(const llama_kvp_policy & p, uint32_t budget, uint32_t & n_sink, uint32_t & n_recent) const override {
        (void) budget;
        n_sink   = (uint32_t) p.n_sink;
        n_recent = (uint32_t) p.n_recent;
    }

    // score(): all middle tokens score 0, and ties keep the newer token, so the newest are kept
};

const llama_kvp_stage * llama_kvp_stage_score_recency() {
    static const llama_kvp_score_recency stage;
    return &stage;
}
