// schedule-prompt.cpp - schedule stage `prompt`: scores come from the prompt batches only; decode steps observe
// only when asked (llama_kvp_obs_request).

#include "llama-kvp-stage.h"

struct llama_kvp_schedule_prompt : llama_kvp_schedule_stage {
    llama_kvp_schedule_prompt() : llama_kvp_schedule_stage(LLAMA_KVP_SCHEDULE_PROMPT, LLAMA_KVP_SLOT_SCHEDULE, "prompt", "",
            "observe prompt batches only") {}

    bool observe_step(const llama_kvp_policy & p, int32_t n_decode) const override {
        (void) p; (void) n_decode;
        return false;
    }
};

const llama_kvp_stage * llama_kvp_stage_schedule_prompt() {
    static const llama_kvp_schedule_prompt stage;
    return &stage;
}
