// llama-kvp-preset.h - named policies (presets): a composition of stages with its defaults and exposed keys.
#pragma once

#include "llama-kvp-stage.h"

#include <string>
#include <vector>

struct llama_kvp_preset {
    int32_t      type; // enum llama_kvp_policy_type
    const char * name;
    const char * keys; // the keys a spec may give the preset part, comma-separated
    const char * help;

    void (*make)  (llama_kvp_policy & p); // its stages and defaults (on top of the base defaults)
    void (*derive)(llama_kvp_policy & p); // values that follow from the exposed keys (after they are set)
};

const llama_kvp_preset * llama_kvp_preset_by_type(int32_t type);
const llama_kvp_preset * llama_kvp_preset_by_name(const std::string & name);
std::vector<const llama_kvp_preset *> llama_kvp_preset_all();
