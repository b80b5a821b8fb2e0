// prefill-dense.cpp - prefill stage `dense`: the prompt runs with dense attention in chunks of `chunk` tokens, with
// eviction between chunks. With guide=1 the prompt's last `window` tokens (the question) run behind every chunk and
// are removed after it (llama_kvp_prefill_guided), so each chunk is scored by the end of the prompt.

#include "llama-kvp-stage.h"

#include <cstdio>

struct llama_kvp_prefill_dense : llama_kvp_prefill_stage {
    llama_kvp_prefill_dense() : llama_kvp_prefill_stage(LLAMA_KVP_PREFILL_DENSE, LLAMA_KVP_SLOT_PREFILL, "dense", "chunk,guide",
            "dense attention, prompt in chunks of `chunk` tokens, guided by the prompt's end with guide=1") {}

    void defaults(llama_kvp_policy & p) const override {
        p.chunk = 128;
        p.guide = 0;
    }

    std::string check(const llama_kvp_policy & p) const override {
        return llama_kvp_check_chunk(p);
    }

    uint32_t n_guide(const llama_kvp_policy & p, uint32_t n_ubatch) const override {
        return llama_kvp_prefill_n_guide(p, n_ubatch);
    }
};

const llama_kvp_stage * llama_kvp_stage_prefill_dense() {
    static const llama_kvp_prefill_dense stage;
    return &stage;
}
