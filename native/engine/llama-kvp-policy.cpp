// llama-kvp-policy.cpp - policy parameters: defaults, the spec parser shared by Python, the CLI and kvbench,
// validation and the canonical spec string.

#include "llama-kvp-impl.h"

#include <cerrno>
#include <cstddef>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static thread_local std::string g_last_error;

void llama_kvp_set_error(const std::string & msg) {
    g_last_error = msg;
}

const char * llama_kvp_last_error(void) {
    return g_last_error.c_str();
}

void llama_kvp_clear_error(void) {
    g_last_error.clear();
}

int32_t llama_kvp_api_version(void) {
    return LLAMA_KVP_API_VERSION;
}

//
// policy types and their keys
//

struct llama_kvp_type_info {
    int32_t      type;
    const char * name;
    const char * keys; // accepted keys, comma-separated
};

static const llama_kvp_type_info k_types[] = {
    { LLAMA_KVP_POLICY_NONE,        "none",        ""                                                                  },
    { LLAMA_KVP_POLICY_OBSERVE,     "observe",     "window,every,decay"                                                },
    { LLAMA_KVP_POLICY_SINK_RECENT, "sink_recent", "n_sink,n_recent,chunk"                                             },
    { LLAMA_KVP_POLICY_SNAPKV,      "snapkv",      "budget,window,pool,every,chunk,guide"                              },
    { LLAMA_KVP_POLICY_H2O,         "h2o",         "budget,n_recent,every,chunk"                                       },
    { LLAMA_KVP_POLICY_PYRAMID,     "pyramid",     "budget,slope,window,pool,every,chunk,guide"                        },
    { LLAMA_KVP_POLICY_ENTROPY,     "entropy",     "budget,min_layer,max_layer,n_sink,n_recent,topk_share,window,pool,every,decay,chunk,guide" },
};

// the keys, where they live in the struct, and their kind
struct llama_kvp_key_info {
    const char * name;
    bool         is_float;
    size_t       offset;
};

static const llama_kvp_key_info k_keys[] = {
    { "window",     false, offsetof(llama_kvp_policy, window)     },
    { "every",      false, offsetof(llama_kvp_policy, every)      },
    { "decay",      true,  offsetof(llama_kvp_policy, decay)      },
    { "budget",     true,  offsetof(llama_kvp_policy, budget)     },
    { "n_sink",     false, offsetof(llama_kvp_policy, n_sink)     },
    { "n_recent",   false, offsetof(llama_kvp_policy, n_recent)   },
    { "min_layer",  false, offsetof(llama_kvp_policy, min_layer)  },
    { "max_layer",  false, offsetof(llama_kvp_policy, max_layer)  },
    { "topk_share", true,  offsetof(llama_kvp_policy, topk_share) },
    { "pool",       false, offsetof(llama_kvp_policy, pool)       },
    { "slope",      true,  offsetof(llama_kvp_policy, slope)      },
    { "chunk",      false, offsetof(llama_kvp_policy, chunk)      },
    { "guide",      false, offsetof(llama_kvp_policy, guide)      },
};

static const llama_kvp_type_info * llama_kvp_type_find(int32_t type) {
    for (const auto & t : k_types) {
        if (t.type == type) {
            return &t;
        }
    }
    return nullptr;
}

static bool llama_kvp_type_has_key(const llama_kvp_type_info & t, const std::string & key) {
    const std::string keys = std::string(",") + t.keys + ",";
    return !key.empty() && keys.find("," + key + ",") != std::string::npos;
}

const char * llama_kvp_policy_type_name(int32_t type) {
    const auto * t = llama_kvp_type_find(type);
    return t ? t->name : "unknown";
}

bool llama_kvp_policy_is_retention(int32_t type) {
    return type >= LLAMA_KVP_POLICY_SINK_RECENT && type <= LLAMA_KVP_POLICY_ENTROPY;
}

static std::string llama_kvp_type_names() {
    std::string res;
    for (const auto & t : k_types) {
        res += res.empty() ? "" : ", ";
        res += t.name;
    }
    return res;
}

struct llama_kvp_policy llama_kvp_policy_default(int32_t type) {
    llama_kvp_policy res = {};
    res.type       = type;
    res.window     = 32;
    res.every      = 0;
    res.decay      = 1.0f;
    res.budget     = 0.0f;
    res.n_sink     = 0;
    res.n_recent   = 0;
    res.min_layer  = 0;
    res.max_layer  = 0;
    res.topk_share = 0.5f;
    res.pool       = 1;
    res.slope      = 0.5f;
    res.chunk      = 128;
    res.guide      = 0;
    switch (type) {
        case LLAMA_KVP_POLICY_SINK_RECENT:
            res.n_sink   = 4;
            res.n_recent = 252;
            break;
        case LLAMA_KVP_POLICY_SNAPKV:
        case LLAMA_KVP_POLICY_PYRAMID:
            res.budget = 0.25f;
            res.pool   = 5;
            res.every  = 16;
            res.decay  = 0.0f;
            res.guide  = 1;
            break;
        case LLAMA_KVP_POLICY_H2O:
            res.budget   = 0.25f;
            res.window   = 1;
            res.every    = 1;
            res.n_recent = 32;
            break;
        case LLAMA_KVP_POLICY_ENTROPY:
            res.budget   = 0.25f;
            res.n_sink   = 4;
            res.n_recent = 16;
            res.every    = 16;
            res.decay    = 0.5f;
            res.pool     = 9;
            res.guide    = 1;
            break;
        default:
            break;
    }
    return res;
}

// the retained tokens a policy always protects (sinks + recent window)
int32_t llama_kvp_policy_n_protected(const llama_kvp_policy & p) {
    switch (p.type) {
        case LLAMA_KVP_POLICY_SNAPKV:
        case LLAMA_KVP_POLICY_PYRAMID:
            return p.window;
        case LLAMA_KVP_POLICY_H2O:
            return p.n_recent;
        default:
            return p.n_sink + p.n_recent;
    }
}

std::string llama_kvp_policy_check(const llama_kvp_policy & p) {
    char buf[256];
    const auto * info = llama_kvp_type_find(p.type);
    if (!info) {
        snprintf(buf, sizeof(buf), "unknown policy type %d (accepted: %s)", p.type, llama_kvp_type_names().c_str());
        return buf;
    }
    const char * name = info->name;
    auto has = [&](const char * key) { return llama_kvp_type_has_key(*info, key); };

    if (has("window") && p.window < 1) {
        snprintf(buf, sizeof(buf), "%s: window must be >= 1 (got %d)", name, p.window);
        return buf;
    }
    if (has("every") && p.every < 0) {
        snprintf(buf, sizeof(buf), "%s: every must be >= 0 (got %d; 0 observes prompt batches only)", name, p.every);
        return buf;
    }
    if (has("decay") && !(p.decay >= 0.0f && p.decay <= 1.0f)) {
        snprintf(buf, sizeof(buf), "%s: decay must be in [0, 1] (got %g)", name, (double) p.decay);
        return buf;
    }
    if (has("budget")) {
        if (!std::isfinite(p.budget) || p.budget <= 0.0f) {
            snprintf(buf, sizeof(buf), "%s: budget must be a token count >= 1 or a fraction of the prompt in (0, 1) (got %g)", name, (double) p.budget);
            return buf;
        }
        if (p.budget >= 1.0f && p.budget != std::floor(p.budget)) {
            snprintf(buf, sizeof(buf), "%s: a budget >= 1 is a token count and must be a whole number (got %g)", name, (double) p.budget);
            return buf;
        }
        if (p.budget > 1.0e8f) {
            snprintf(buf, sizeof(buf), "%s: budget %g is too large", name, (double) p.budget);
            return buf;
        }
    }
    if (has("n_sink") && p.n_sink < 0) {
        snprintf(buf, sizeof(buf), "%s: n_sink must be >= 0 (got %d)", name, p.n_sink);
        return buf;
    }
    if (has("n_recent") && (p.n_recent < (p.type == LLAMA_KVP_POLICY_SINK_RECENT ? 1 : 0))) {
        snprintf(buf, sizeof(buf), "%s: n_recent must be >= %d (got %d)", name, p.type == LLAMA_KVP_POLICY_SINK_RECENT ? 1 : 0, p.n_recent);
        return buf;
    }
    if (has("min_layer") && p.min_layer < 0) {
        snprintf(buf, sizeof(buf), "%s: min_layer must be >= 0 (got %d; 0 = budget/4)", name, p.min_layer);
        return buf;
    }
    if (has("max_layer") && p.max_layer < 0) {
        snprintf(buf, sizeof(buf), "%s: max_layer must be >= 0 (got %d; 0 = 2*budget)", name, p.max_layer);
        return buf;
    }
    if (has("max_layer") && p.min_layer > 0 && p.max_layer > 0 && p.min_layer > p.max_layer) {
        snprintf(buf, sizeof(buf), "%s: min_layer (%d) is larger than max_layer (%d)", name, p.min_layer, p.max_layer);
        return buf;
    }
    if (has("topk_share") && !(p.topk_share >= 0.0f && p.topk_share <= 1.0f)) {
        snprintf(buf, sizeof(buf), "%s: topk_share must be in [0, 1] (got %g)", name, (double) p.topk_share);
        return buf;
    }
    if (has("pool") && (p.pool < 1 || p.pool % 2 == 0)) {
        snprintf(buf, sizeof(buf), "%s: pool must be an odd width >= 1 (got %d)", name, p.pool);
        return buf;
    }
    if (has("slope") && !(p.slope >= 0.0f && p.slope < 1.0f)) {
        snprintf(buf, sizeof(buf), "%s: slope must be in [0, 1) (got %g)", name, (double) p.slope);
        return buf;
    }
    if (has("guide") && p.guide != 0 && p.guide != 1) {
        snprintf(buf, sizeof(buf), "%s: guide must be 0 or 1 (got %d)", name, p.guide);
        return buf;
    }
    if (has("chunk") && p.chunk < 1) {
        snprintf(buf, sizeof(buf), "%s: chunk must be >= 1 (got %d)", name, p.chunk);
        return buf;
    }
    if (has("budget") && p.budget >= 1.0f) {
        const int32_t n_prot = llama_kvp_policy_n_protected(p);
        if ((float) n_prot >= p.budget) {
            snprintf(buf, sizeof(buf), "%s: budget (%g) must be larger than the tokens always kept (%d: sinks + recent window)",
                    name, (double) p.budget, n_prot);
            return buf;
        }
        if (has("min_layer") && p.min_layer > 0 && (float) p.min_layer > p.budget) {
            snprintf(buf, sizeof(buf), "%s: min_layer (%d) is larger than the budget (%g)", name, p.min_layer, (double) p.budget);
            return buf;
        }
        if (has("max_layer") && p.max_layer > 0 && (float) p.max_layer < p.budget) {
            snprintf(buf, sizeof(buf), "%s: max_layer (%d) is smaller than the budget (%g)", name, p.max_layer, (double) p.budget);
            return buf;
        }
    }
    return "";
}

int32_t llama_kvp_policy_validate(const struct llama_kvp_policy * policy) {
    if (!policy) {
        llama_kvp_set_error("policy is NULL");
        return -1;
    }
    const std::string err = llama_kvp_policy_check(*policy);
    if (!err.empty()) {
        llama_kvp_set_error(err);
        return -1;
    }
    return 0;
}

//
// parser: "name" or "name:key=value,key=value"
//

static std::string llama_kvp_trim(const std::string & s) {
    size_t b = 0;
    size_t e = s.size();
    while (b < e && isspace((unsigned char) s[b]))     { b++; }
    while (e > b && isspace((unsigned char) s[e - 1])) { e--; }
    return s.substr(b, e - b);
}

static bool llama_kvp_parse_int(const std::string & v, int32_t & out) {
    if (v.empty()) {
        return false;
    }
    char * end = nullptr;
    errno = 0;
    const long x = strtol(v.c_str(), &end, 10);
    if (errno != 0 || *end != '\0' || x < INT32_MIN || x > INT32_MAX) {
        return false;
    }
    out = (int32_t) x;
    return true;
}

static bool llama_kvp_parse_float(const std::string & v, float & out) {
    if (v.empty()) {
        return false;
    }
    char * end = nullptr;
    errno = 0;
    const double x = strtod(v.c_str(), &end);
    if (errno != 0 || *end != '\0' || !std::isfinite(x)) {
        return false;
    }
    out = (float) x;
    return true;
}

int32_t llama_kvp_policy_parse(const char * spec, struct llama_kvp_policy * out) {
    if (!spec || !out) {
        llama_kvp_set_error("policy spec is NULL");
        return -1;
    }
    const std::string s = spec;
    const size_t colon = s.find(':');
    const std::string name = llama_kvp_trim(s.substr(0, colon));

    const llama_kvp_type_info * info = nullptr;
    for (const auto & t : k_types) {
        if (name == t.name) {
            info = &t;
        }
    }
    if (!info) {
        llama_kvp_set_error("unknown policy '" + name + "' (accepted: " + llama_kvp_type_names() + ")");
        return -1;
    }

    llama_kvp_policy p = llama_kvp_policy_default(info->type);

    const std::string accepted = *info->keys ? info->keys : "none";
    std::string rest = colon == std::string::npos ? "" : s.substr(colon + 1);
    size_t start = 0;
    while (colon != std::string::npos && start <= rest.size()) {
        size_t comma = rest.find(',', start);
        if (comma == std::string::npos) {
            comma = rest.size();
        }
        const std::string item = llama_kvp_trim(rest.substr(start, comma - start));
        start = comma + 1;
        if (item.empty()) {
            if (comma == rest.size()) {
                break;
            }
            continue;
        }
        const size_t eq = item.find('=');
        const std::string key = llama_kvp_trim(item.substr(0, eq));
        const std::string val = eq == std::string::npos ? "" : llama_kvp_trim(item.substr(eq + 1));

        const llama_kvp_key_info * kinfo = nullptr;
        if (llama_kvp_type_has_key(*info, key)) {
            for (const auto & k : k_keys) {
                if (key == k.name) {
                    kinfo = &k;
                }
            }
        }
        const bool key_ok = kinfo != nullptr;
        bool val_ok = false;
        const char * expect = "";
        if (kinfo) {
            char * field = (char *) &p + kinfo->offset;
            expect = kinfo->is_float ? "a number" : "an integer";
            val_ok = kinfo->is_float ? llama_kvp_parse_float(val, *(float *) field) : llama_kvp_parse_int(val, *(int32_t *) field);
        }
        if (!key_ok) {
            llama_kvp_set_error("unknown key '" + key + "' for policy '" + name + "' (accepted: " + accepted + ")");
            return -1;
        }
        if (eq == std::string::npos || !val_ok) {
            llama_kvp_set_error("bad value for '" + key + "' in policy '" + name + "': '" + val + "' is not " + expect);
            return -1;
        }
        if (comma == rest.size()) {
            break;
        }
    }

    if (llama_kvp_policy_validate(&p) != 0) {
        return -1;
    }
    *out = p;
    return 0;
}

int32_t llama_kvp_policy_to_string(const struct llama_kvp_policy * policy, char * buf, size_t size) {
    if (!policy) {
        llama_kvp_set_error("policy is NULL");
        return -1;
    }
    const auto * info = llama_kvp_type_find(policy->type);
    std::string s = llama_kvp_policy_type_name(policy->type);
    if (info) {
        char sep = ':';
        for (const auto & k : k_keys) {
            if (!llama_kvp_type_has_key(*info, k.name)) {
                continue;
            }
            const char * field = (const char *) policy + k.offset;
            char tmp[64];
            if (k.is_float) {
                snprintf(tmp, sizeof(tmp), "%c%s=%g", sep, k.name, (double) *(const float *) field);
            } else {
                snprintf(tmp, sizeof(tmp), "%c%s=%d", sep, k.name, *(const int32_t *) field);
            }
            s += tmp;
            sep = ',';
        }
    }
    if (buf && size > 0) {
        snprintf(buf, size, "%s", s.c_str());
    }
    return (int32_t) s.size();
}
