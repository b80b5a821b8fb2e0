// fate-drop.cpp - fate stage `drop`: a token leaving a layer's cache is gone (its cell is freed for reuse).

#include "llama-kvp-stage.h"
#include "llama-kvp-impl.h"

struct llama_kvp_fate_drop : llama_kvp_fate_stage {
    llama_kvp_fate_drop() : llama_kvp_fate_stage(LLAMA_KVP_FATE_DROP, LLAMA_KVP_SLOT_FATE, "drop", "",
            "leaving tokens are dropped") {}

    void leave(llama_kv_cache & kv, const std::vector<uint32_t> & idx) const override {
        for (uint32_t i : idx) {
            llama_kvp_kv_access::cell_rm(kv, i);
        }
    }
};

const llama_kvp_stage * llama_kvp_stage_fate_drop() {
    static const llama_kvp_fate_drop stage;
    return &stage;
}
