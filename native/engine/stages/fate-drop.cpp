// fate-drop.cpp - fate stage `drop`: a token leaving a layer's cache is gone (its cell is freed for reuse).

#include "llama-kvp-stage.h"
#include "llama-kvp-memory.h"

struct llama_kvp_fate_drop : llama_kvp_fate_stage {
    llama_kvp_fate_drop() : llama_kvp_fate_stage(LLAMA_KVP_FATE_DROP, LLAMA_KVP_SLOT_FATE, "drop", "",
            "leaving tokens are dropped") {}

    void leave(llama_kvp_memory & mem, int32_t ikv, const std::vector<llama_kvp_cell> & leaving) const override {
        for (const auto & c : leaving) {
            mem.cell_free(ikv, c.idx);
        }
    }
};

const llama_kvp_stage * llama_kvp_stage_fate_drop() {
    static const llama_kvp_fate_drop stage;
    return &stage;
}
