// score-accumulated.cpp - score stage `accumulated` (H2O heavy hitters): a token's score is the attention mass it
// received, summed over every observation (decayed by `decay` per observation; the observation window is the
// current query with window=1). Kept: n_sink sinks, the top `topk_share` of the rest by score, the most recent
// tokens for what is left (at least n_recent).

#include "llama-kvp-stage.h"

struct llama_kvp_score_accumulated : llama_kvp_score_stage {
    llama_kvp_score_accumulated() : llama_kvp_score_stage(LLAMA_KVP_SCORE_ACCUMULATED, LLAMA_KVP_SLOT_SCORE, "accumulated",
            "window,decay,n_sink,n_recent,topk_share",
            "attention mass accumulated over every observation (heavy hitters)") {}

    void defaults(llama_kvp_policy & p) const override {
        p.window     = 1;
        p.decay      = 1.0f;
        p.n_sink     = 0;
        p.n_recent   = 32;
        p.topk_share = 1.0f;
    }

    std::string check(const llama_kvp_policy & p) const override {
        return llama_kvp_check_observed_score(p);
    }

    bool observes() const override { return true; }

    // score(): the accumulated mass as it is
};

const llama_kvp_stage * llama_kvp_stage_score_accumulated() {
    static const llama_kvp_score_accumulated stage;
    return &stage;
}
