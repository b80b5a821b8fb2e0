// llama-kvp-policy.cpp - policy parameters: defaults, the spec parser shared by Python, the CLI and kvbench,
// validation and the canonical spec string.

#include "llama-kvp-impl.h"

#include <cerrno>
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
    { LLAMA_KVP_POLICY_NONE,    "none",    ""                   },
    { LLAMA_KVP_POLICY_OBSERVE, "observe", "window,every,decay" },
};

const char * llama_kvp_policy_type_name(int32_t type) {
    for (const auto & t : k_types) {
        if (t.type == type) {
            return t.name;
        }
    }
    return "unknown";
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
    res.type   = type;
    res.window = 32;
    res.every  = 0;
    res.decay  = 1.0f;
    return res;
}

std::string llama_kvp_policy_check(const llama_kvp_policy & p) {
    char buf[256];
    bool known = false;
    for (const auto & t : k_types) {
        known = known || t.type == p.type;
    }
    if (!known) {
        snprintf(buf, sizeof(buf), "unknown policy type %d (accepted: %s)", p.type, llama_kvp_type_names().c_str());
        return buf;
    }
    if (p.type == LLAMA_KVP_POLICY_OBSERVE) {
        if (p.window < 1) {
            snprintf(buf, sizeof(buf), "observe: window must be >= 1 (got %d)", p.window);
            return buf;
        }
        if (p.every < 0) {
            snprintf(buf, sizeof(buf), "observe: every must be >= 0 (got %d; 0 observes prompt batches only)", p.every);
            return buf;
        }
        if (!(p.decay >= 0.0f && p.decay <= 1.0f)) {
            snprintf(buf, sizeof(buf), "observe: decay must be in [0, 1] (got %g)", (double) p.decay);
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

        bool key_ok = false;
        bool val_ok = false;
        const char * expect = "";
        if (info->type == LLAMA_KVP_POLICY_OBSERVE) {
            if (key == "window") { key_ok = true; expect = "an integer"; val_ok = llama_kvp_parse_int  (val, p.window); }
            if (key == "every")  { key_ok = true; expect = "an integer"; val_ok = llama_kvp_parse_int  (val, p.every);  }
            if (key == "decay")  { key_ok = true; expect = "a number";   val_ok = llama_kvp_parse_float(val, p.decay);  }
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
    std::string s = llama_kvp_policy_type_name(policy->type);
    if (policy->type == LLAMA_KVP_POLICY_OBSERVE) {
        char tmp[128];
        snprintf(tmp, sizeof(tmp), ":window=%d,every=%d,decay=%g", policy->window, policy->every, (double) policy->decay);
        s += tmp;
    }
    if (buf && size > 0) {
        snprintf(buf, size, "%s", s.c_str());
    }
    return (int32_t) s.size();
}
