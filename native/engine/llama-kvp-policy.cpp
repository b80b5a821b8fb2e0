// llama-kvp-policy.cpp - a policy as a composition of stages: defaults, the spec grammar shared by Python, the CLI
// and kvbench (parser and canonical string), validation of the composition and its description.

#include "llama-kvp-impl.h"
#include "llama-kvp-preset.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstddef>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
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
// keys: where each lives in the struct, and its kind
//

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
    { "split_share", true, offsetof(llama_kvp_policy, split_share) },
    { "topk_share", true,  offsetof(llama_kvp_policy, topk_share) },
    { "pool",       false, offsetof(llama_kvp_policy, pool)       },
    { "pool_max",   true,  offsetof(llama_kvp_policy, pool_max)   },
    { "span_pool",  false, offsetof(llama_kvp_policy, span_pool)  },
    { "span_share", true,  offsetof(llama_kvp_policy, span_share) },
    { "fill",       false, offsetof(llama_kvp_policy, fill)       },
    { "fill_share", true,  offsetof(llama_kvp_policy, fill_share) },
    { "vnorm",      true,  offsetof(llama_kvp_policy, vnorm)      },
    { "fresh",      true,  offsetof(llama_kvp_policy, fresh)      },
    { "slope",      true,  offsetof(llama_kvp_policy, slope)      },
    { "chunk",      false, offsetof(llama_kvp_policy, chunk)      },
    { "guide",      false, offsetof(llama_kvp_policy, guide)      },
    { "segment",    false, offsetof(llama_kvp_policy, segment)    },
    { "block",      false, offsetof(llama_kvp_policy, block)      },
    { "base",       false, offsetof(llama_kvp_policy, base)       },
    { "e_t",        true,  offsetof(llama_kvp_policy, e_t)        },
    { "alpha",      true,  offsetof(llama_kvp_policy, alpha)      },
    { "delta_t",    true,  offsetof(llama_kvp_policy, delta_t)    },
    { "threshold",  false, offsetof(llama_kvp_policy, threshold)  },
    { "skip",       false, offsetof(llama_kvp_policy, skip)       },
    { "per_head",   false, offsetof(llama_kvp_policy, per_head)   },
    { "bin",        false, offsetof(llama_kvp_policy, bin)        },
    { "rank",       false, offsetof(llama_kvp_policy, rank)       },
    { "tau",        true,  offsetof(llama_kvp_policy, tau)        },
    { "k",          false, offsetof(llama_kvp_policy, k)          },
    { "hist",       false, offsetof(llama_kvp_policy, hist)       },
    { "limit",      false, offsetof(llama_kvp_policy, limit)      },
    { "gap",        false, offsetof(llama_kvp_policy, gap)        },
    { "repeat",     false, offsetof(llama_kvp_policy, repeat)     },
    { "z",          true,  offsetof(llama_kvp_policy, z)          },
    { "rewalk",     false, offsetof(llama_kvp_policy, rewalk)     },
    { "span",       false, offsetof(llama_kvp_policy, span)       },
    { "lam",        true,  offsetof(llama_kvp_policy, lam)        },
};

static_assert(sizeof(((llama_kvp_policy *) nullptr)->stage)/sizeof(int32_t) == LLAMA_KVP_SLOT_COUNT, "one stage per slot");

static bool llama_kvp_list_has(const char * list, const std::string & key) {
    const std::string keys = std::string(",") + list + ",";
    return !key.empty() && keys.find("," + key + ",") != std::string::npos;
}

static const llama_kvp_key_info * llama_kvp_key_find(const std::string & name) {
    for (const auto & k : k_keys) {
        if (name == k.name) {
            return &k;
        }
    }
    return nullptr;
}

static bool llama_kvp_key_equal(const llama_kvp_key_info & k, const llama_kvp_policy & a, const llama_kvp_policy & b) {
    return memcmp((const char *) &a + k.offset, (const char *) &b + k.offset, sizeof(int32_t)) == 0;
}

static std::string llama_kvp_key_str(const llama_kvp_key_info & k, const llama_kvp_policy & p) {
    const char * field = (const char *) &p + k.offset;
    char tmp[64];
    if (k.is_float) {
        // a whole number as such (a budget in tokens), else the shortest form that parses back to the same float,
        // its exponent without '+' (which separates stages)
        const float x = *(const float *) field;
        char num[48];
        if (x == std::floor(x) && std::fabs(x) < 1e9f) {
            snprintf(num, sizeof(num), "%.0f", (double) x);
        } else {
            for (int prec = 6; prec <= 9; ++prec) {
                snprintf(num, sizeof(num), "%.*g", prec, (double) x);
                if (strtof(num, nullptr) == x) {
                    break;
                }
            }
        }
        std::string s = num;
        const size_t e = s.find("e+");
        if (e != std::string::npos) {
            s.erase(e + 1, 1);
        }
        snprintf(tmp, sizeof(tmp), "%s=%s", k.name, s.c_str());
    } else {
        snprintf(tmp, sizeof(tmp), "%s=%d", k.name, *(const int32_t *) field);
    }
    return tmp;
}

static std::string llama_kvp_preset_names() {
    std::string res;
    for (const auto * p : llama_kvp_preset_all()) {
        res += res.empty() ? "" : ", ";
        res += p->name;
    }
    return res;
}

static std::string llama_kvp_stage_names() {
    std::string res;
    for (const auto * s : llama_kvp_stage_all()) {
        res += res.empty() ? "" : ", ";
        res += s->name;
    }
    return res;
}

const char * llama_kvp_policy_type_name(int32_t type) {
    const auto * p = llama_kvp_preset_by_type(type);
    return p ? p->name : "unknown";
}

bool llama_kvp_policy_retains(const llama_kvp_policy & p) {
    return llama_kvp_budget_of(p) != nullptr;
}

bool llama_kvp_policy_sparse(const llama_kvp_policy & p) {
    const auto * prefill = llama_kvp_prefill_of(p);
    return prefill && prefill->computes_attention();
}

bool llama_kvp_policy_observes(const llama_kvp_policy & p) {
    const auto * score = llama_kvp_score_of(p);
    return score && score->observes();
}

int32_t llama_kvp_policy_n_protected(const llama_kvp_policy & p) {
    const auto * score = llama_kvp_score_of(p);
    return score ? score->n_protected(p) : 0;
}

// the base values of every key, before a preset sets its own
static llama_kvp_policy llama_kvp_policy_base() {
    llama_kvp_policy res = {};
    res.type       = LLAMA_KVP_POLICY_NONE;
    res.window     = 32;
    res.every      = 0;
    res.decay      = 1.0f;
    res.budget     = 0.0f;
    res.n_sink     = 0;
    res.n_recent   = 0;
    res.min_layer  = 0;
    res.max_layer  = 0;
    res.split_share = 0.5f;
    res.topk_share = 0.5f;
    res.pool       = 1;
    res.pool_max   = 0.0f;
    res.span_pool  = 0;
    res.span_share = 1.0f;
    res.fill       = 0;
    res.fill_share = 0.5f;
    res.vnorm      = 0.0f;
    res.fresh      = 0.0f;
    res.slope      = 0.5f;
    res.chunk      = 128;
    res.guide      = 0;
    llama_kvp_stage_prefill_sparse()->defaults(res); // its keys have values whatever the prefill stage (same chunk, guide)
    llama_kvp_stage_fate_summarise()->defaults(res);
    llama_kvp_stage_fate_host()->defaults(res);
    // the keys only the freeze and latent schedules read (their defaults of `every` are not the base's)
    res.tau    = 0.1f;
    res.k      = 2;
    res.hist   = 128;
    res.z      = 0.0f;
    res.rewalk = 0;
    res.span   = 16;
    res.gap    = 16;
    res.repeat = 0;
    return res;
}

// what a preset makes of the base policy alone, its stages included (before its keys are derived)
static llama_kvp_policy llama_kvp_preset_made(const llama_kvp_preset & preset, int32_t type) {
    llama_kvp_policy res = llama_kvp_policy_base();
    res.type = type;
    preset.make(res);
    return res;
}

struct llama_kvp_policy llama_kvp_policy_default(int32_t type) {
    llama_kvp_policy res = llama_kvp_policy_base();
    res.type = type;
    if (const auto * preset = llama_kvp_preset_by_type(type)) {
        preset->make(res);
        preset->derive(res);
    }
    return res;
}

//
// validation of a composition
//

std::string llama_kvp_policy_check(const llama_kvp_policy & p) {
    char buf[256];
    const auto * preset = llama_kvp_preset_by_type(p.type);
    if (!preset) {
        snprintf(buf, sizeof(buf), "unknown policy type %d (accepted: %s)", p.type, llama_kvp_preset_names().c_str());
        return buf;
    }
    const std::string name = preset->name;
    for (int32_t slot = 0; slot < LLAMA_KVP_SLOT_COUNT; ++slot) {
        const llama_kvp_stage * s = llama_kvp_stage_by_id(p.stage[slot]);
        if (p.stage[slot] != LLAMA_KVP_STAGE_NONE && (!s || s->slot != slot)) {
            snprintf(buf, sizeof(buf), "%s: unknown stage id %d in the %s slot", name.c_str(), p.stage[slot], llama_kvp_slot_name(slot));
            return buf;
        }
    }
    const auto * budget   = llama_kvp_budget_of(p);
    const auto * score    = llama_kvp_score_of(p);
    const auto * schedule = llama_kvp_schedule_of(p);

    // the composition: a budget needs a score, a fate and a prefill stage; observing needs a schedule
    if (budget && (!score || !llama_kvp_fate_of(p) || !llama_kvp_prefill_of(p))) {
        const int32_t slot = !score ? LLAMA_KVP_SLOT_SCORE : !llama_kvp_fate_of(p) ? LLAMA_KVP_SLOT_FATE : LLAMA_KVP_SLOT_PREFILL;
        return name + ": the budget stage '" + budget->name + "' needs a " + llama_kvp_slot_name(slot) + " stage";
    }
    if (score && score->observes() && !schedule) {
        return name + ": the score stage '" + score->name + "' needs a schedule stage (prompt, every, freeze, latent)";
    }
    if (schedule && !(score && score->observes())) {
        return name + ": the schedule stage '" + schedule->name + "' needs a score stage that observes (window, accumulated)";
    }

    // each stage checks the keys it reads; the error names a stage the preset does not have itself
    const llama_kvp_policy own = llama_kvp_preset_made(*preset, p.type);
    static const int32_t order[] = { LLAMA_KVP_SLOT_SCORE, LLAMA_KVP_SLOT_BUDGET, LLAMA_KVP_SLOT_SCHEDULE, LLAMA_KVP_SLOT_PREFILL, LLAMA_KVP_SLOT_FATE };
    for (int32_t slot : order) {
        const llama_kvp_stage * s = llama_kvp_stage_by_id(p.stage[slot]);
        if (!s) {
            continue;
        }
        const std::string err = s->check(p);
        if (!err.empty()) {
            return own.stage[slot] == p.stage[slot] ? name + ": " + err : name + ", stage '" + s->name + "': " + err;
        }
    }

    // a scored budget must leave room for a token chosen by score
    if (budget && p.budget >= 1.0f && !score->protected_only()) {
        const int32_t n_prot = score->n_protected(p);
        if ((float) n_prot >= p.budget) {
            if (!llama_kvp_list_has(preset->keys, "budget")) { // sink_recent: its budget is n_sink + n_recent
                snprintf(buf, sizeof(buf), "%s: its %g tokens (n_sink + n_recent) leave no room for a token chosen by the "
                        "score stage, which always keeps %d (sinks + recent window): use a preset with a budget (snapkv, h2o, ...)",
                        name.c_str(), (double) p.budget, n_prot);
            } else {
                snprintf(buf, sizeof(buf), "%s: budget (%g) must be larger than the tokens always kept (%d: sinks + recent window)%s",
                        name.c_str(), (double) p.budget, n_prot,
                        p.budget == 1.0f ? "; a budget of 1 is one token, a fraction of the prompt is below 1 (all of it: no policy)" : "");
            }
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
// parser: part ("+" part)*, part = name [":" key=value ("," key=value)*]
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
    if (*end != '\0') { // out of range and non-finite values are left to the validation of the key
        return false;
    }
    out = (float) x + 0.0f; // -0 is 0 (and prints so in the canonical spec)
    return true;
}

// why a value of a key is refused by the parser
static std::string llama_kvp_bad_value(const std::string & key, const std::string & val, bool has_eq, bool is_float) {
    const std::string kind = is_float ? "a number" : "an integer";
    if (val.empty()) {
        return "no value: " + key + "=<" + kind + ">" + (has_eq ? " ('+' separates stages: a positive number goes without its sign)" : "");
    }
    if (!is_float) {
        char * end = nullptr;
        (void) strtoll(val.c_str(), &end, 10);
        if (*end == '\0') {
            return "'" + val + "' is out of range (a 32-bit integer)";
        }
    }
    return "'" + val + "' is not " + kind;
}

// where a key a part does not take is read by a stage: how to give it to that stage ("" if no stage reads it); the
// stage already in its slot of p comes first (naming it again keeps the preset's values)
static std::string llama_kvp_key_hint(const std::string & key, const std::string & val, const llama_kvp_policy & p) {
    std::vector<const llama_kvp_stage *> readers;
    for (const auto * st : llama_kvp_stage_all()) {
        if (llama_kvp_list_has(st->keys, key)) {
            readers.insert(p.stage[st->slot] == st->id ? readers.begin() : readers.end(), st);
        }
    }
    if (readers.empty()) {
        return "";
    }
    std::string names;
    for (const auto * st : readers) {
        names += std::string(names.empty() ? "'" : ", '") + st->name + "' (" + llama_kvp_slot_name(st->slot) + ")";
    }
    return "; '" + key + "' is a key of the stage " + names + ": add it as '+" + readers[0]->name + ":" + key + "=" +
        (val.empty() ? "..." : val) + "'";
}

// applies "key=value,..." to p; `accepted` are the keys this part takes, `what` names the part in errors; the keys
// given are appended to `seen`
static bool llama_kvp_apply_keys(const std::string & items, const char * accepted, const std::string & what, llama_kvp_policy & p,
        std::vector<std::string> & seen) {
    const size_t n_before = seen.size();
    size_t start = 0;
    while (start <= items.size()) {
        size_t comma = items.find(',', start);
        if (comma == std::string::npos) {
            comma = items.size();
        }
        const std::string item = llama_kvp_trim(items.substr(start, comma - start));
        start = comma + 1;
        if (item.empty()) {
            continue;
        }
        const size_t eq = item.find('=');
        const std::string key = llama_kvp_trim(item.substr(0, eq));
        const std::string val = eq == std::string::npos ? "" : llama_kvp_trim(item.substr(eq + 1));

        const llama_kvp_key_info * kinfo = llama_kvp_list_has(accepted, key) ? llama_kvp_key_find(key) : nullptr;
        if (!kinfo) {
            llama_kvp_set_error("unknown key '" + key + "' for " + what + " (accepted: " + (*accepted ? accepted : "none") + ")" +
                    llama_kvp_key_hint(key, val, p));
            return false;
        }
        if (std::find(seen.begin() + n_before, seen.end(), key) != seen.end()) {
            llama_kvp_set_error("key '" + key + "' given twice for " + what);
            return false;
        }
        seen.push_back(key);
        char * field = (char *) &p + kinfo->offset;
        const bool val_ok = kinfo->is_float ? llama_kvp_parse_float(val, *(float *) field) : llama_kvp_parse_int(val, *(int32_t *) field);
        if (eq == std::string::npos || !val_ok) {
            llama_kvp_set_error("bad value for '" + key + "' in " + what + ": " + llama_kvp_bad_value(key, val, eq != std::string::npos, kinfo->is_float));
            return false;
        }
    }
    return true;
}

// puts a stage in its slot with its defaults for the keys the preset does not expose; naming the slot's own stage
// again keeps every value (its keys then only override)
static void llama_kvp_add_stage(llama_kvp_policy & p, const llama_kvp_preset & preset, const llama_kvp_stage & stage) {
    if (p.stage[stage.slot] == stage.id) {
        return;
    }
    const llama_kvp_policy keep = p;
    stage.defaults(p);
    for (const auto & k : k_keys) {
        if (llama_kvp_list_has(preset.keys, k.name)) {
            memcpy((char *) &p + k.offset, (const char *) &keep + k.offset, sizeof(int32_t));
        }
    }
    p.stage[stage.slot] = stage.id;
}

// a key given to the preset that only a stage replaced with '+' read, at another value than the preset's own, would
// have no effect: "" if there is none, else the error
static std::string llama_kvp_unread_key(const llama_kvp_policy & p, const llama_kvp_preset & preset,
        const int32_t * preset_stage, const bool * replaced, const std::vector<std::string> & given) {
    const llama_kvp_policy made = llama_kvp_policy_default(p.type);
    for (const auto & key : given) {
        bool read = false;
        for (int32_t slot = 0; slot < LLAMA_KVP_SLOT_COUNT; ++slot) {
            const llama_kvp_stage * s = llama_kvp_stage_by_id(p.stage[slot]);
            read = read || (s && llama_kvp_list_has(s->keys, key));
        }
        if (read || llama_kvp_key_equal(*llama_kvp_key_find(key), p, made)) {
            continue;
        }
        for (int32_t slot = 0; slot < LLAMA_KVP_SLOT_COUNT; ++slot) {
            const llama_kvp_stage * old = llama_kvp_stage_by_id(preset_stage[slot]);
            if (replaced[slot] && old && llama_kvp_list_has(old->keys, key)) {
                const llama_kvp_stage * now = llama_kvp_stage_by_id(p.stage[slot]);
                return "key '" + key + "' of policy '" + preset.name + "' has no effect: its " + llama_kvp_slot_name(slot) +
                    " stage '" + old->name + "' reads it, and '+" + now->name + "' replaces that stage (" + now->name +
                    " reads: " + (*now->keys ? now->keys : "none") + ")";
            }
        }
    }
    return "";
}

// a retaining composition gets the stages it cannot run without: drop, dense and a schedule for observed scores
static void llama_kvp_complete(llama_kvp_policy & p, const llama_kvp_preset & preset) {
    if (llama_kvp_budget_of(p)) {
        if (!llama_kvp_fate_of(p)) {
            llama_kvp_add_stage(p, preset, *llama_kvp_stage_fate_drop());
        }
        if (!llama_kvp_prefill_of(p)) {
            llama_kvp_add_stage(p, preset, *llama_kvp_stage_prefill_dense());
        }
    }
    if (llama_kvp_policy_observes(p) && !llama_kvp_schedule_of(p)) {
        llama_kvp_add_stage(p, preset, p.every != 0 ? *llama_kvp_stage_schedule_every() : *llama_kvp_stage_schedule_prompt());
    }
}

int32_t llama_kvp_policy_parse(const char * spec, struct llama_kvp_policy * out) {
    if (!spec || !out) {
        llama_kvp_set_error("policy spec is NULL");
        return -1;
    }
    const std::string s = spec;

    // stages are separated by '+', except the sign of a number's exponent ("budget=1e+6")
    std::vector<std::string> parts;
    size_t start = 0;
    for (size_t i = 0; i <= s.size(); ++i) {
        if (i < s.size() && (s[i] != '+' || (i >= 2 && (s[i - 1] == 'e' || s[i - 1] == 'E') &&
                (isdigit((unsigned char) s[i - 2]) || s[i - 2] == '.') && i + 1 < s.size() && isdigit((unsigned char) s[i + 1])))) {
            continue;
        }
        parts.push_back(s.substr(start, i - start));
        start = i + 1;
    }

    llama_kvp_policy p = llama_kvp_policy_base();
    const llama_kvp_preset * preset = nullptr;
    bool replaced[LLAMA_KVP_SLOT_COUNT] = {};
    int32_t preset_stage[LLAMA_KVP_SLOT_COUNT] = {};
    std::vector<std::string> given; // the keys given to the preset
    std::vector<std::string> given_stage;
    for (size_t i = 0; i < parts.size(); ++i) {
        const size_t colon = parts[i].find(':');
        const std::string name  = llama_kvp_trim(parts[i].substr(0, colon));
        const std::string items = colon == std::string::npos ? "" : parts[i].substr(colon + 1);
        if (i == 0) {
            preset = llama_kvp_preset_by_name(name == "full" ? "none" : name); // kvbench's name of the full cache
            if (!preset) {
                llama_kvp_set_error("unknown policy '" + name + "' (accepted: " + llama_kvp_preset_names() + "; stages follow with '+')");
                return -1;
            }
            p.type = preset->type;
            preset->make(p);
            if (!llama_kvp_apply_keys(items, preset->keys, "policy '" + name + "'", p, given)) {
                return -1;
            }
            preset->derive(p);
            memcpy(preset_stage, p.stage, sizeof(preset_stage));
            continue;
        }
        if (name.empty()) {
            llama_kvp_set_error("empty stage after '+' in '" + s + "' (accepted: " + llama_kvp_stage_names() + ")");
            return -1;
        }
        const llama_kvp_stage * stage = llama_kvp_stage_by_name(name);
        if (!stage) {
            llama_kvp_set_error("unknown stage '" + name + "' (accepted: " + llama_kvp_stage_names() + ")");
            return -1;
        }
        if (replaced[stage->slot]) {
            llama_kvp_set_error(std::string("two stages for the ") + llama_kvp_slot_name(stage->slot) + " slot: '" +
                    llama_kvp_stage_by_id(p.stage[stage->slot])->name + "' and '" + name + "'");
            return -1;
        }
        replaced[stage->slot] = true;
        llama_kvp_add_stage(p, *preset, *stage);
        if (!llama_kvp_apply_keys(items, stage->keys, "stage '" + name + "'", p, given_stage)) {
            return -1;
        }
    }
    llama_kvp_complete(p, *preset);

    const std::string unread = llama_kvp_unread_key(p, *preset, preset_stage, replaced, given);
    if (!unread.empty()) {
        llama_kvp_set_error(unread);
        return -1;
    }
    if (llama_kvp_policy_validate(&p) != 0) {
        return -1;
    }
    *out = p;
    return 0;
}

std::string llama_kvp_policy_str(const llama_kvp_policy & p) {
    const auto * preset = llama_kvp_preset_by_type(p.type);
    if (!preset) {
        return "unknown";
    }
    // the preset part: every key it exposes
    std::string res = preset->name;
    char sep = ':';
    for (const auto & k : k_keys) {
        if (llama_kvp_list_has(preset->keys, k.name)) {
            res += sep + llama_kvp_key_str(k, p);
            sep = ',';
        }
    }

    // what the preset alone makes of these keys
    llama_kvp_policy ref = llama_kvp_preset_made(*preset, p.type);
    for (const auto & k : k_keys) {
        if (llama_kvp_list_has(preset->keys, k.name)) {
            memcpy((char *) &ref + k.offset, (const char *) &p + k.offset, sizeof(int32_t));
        }
    }
    preset->derive(ref);

    // a stage part for each slot whose stage, or one of its other keys, differs
    for (int32_t slot = 0; slot < LLAMA_KVP_SLOT_COUNT; ++slot) {
        const llama_kvp_stage * s = llama_kvp_stage_by_id(p.stage[slot]);
        if (!s) {
            continue;
        }
        std::string keys;
        bool differs = p.stage[slot] != ref.stage[slot];
        for (const auto & k : k_keys) {
            if (llama_kvp_list_has(s->keys, k.name) && !llama_kvp_list_has(preset->keys, k.name)) {
                keys += (keys.empty() ? ":" : ",") + llama_kvp_key_str(k, p);
                differs = differs || !llama_kvp_key_equal(k, p, ref);
            }
        }
        if (differs) {
            res += std::string("+") + s->name + keys;
        }
    }
    return res;
}

int32_t llama_kvp_policy_to_string(const struct llama_kvp_policy * policy, char * buf, size_t size) {
    if (!policy) {
        llama_kvp_set_error("policy is NULL");
        return -1;
    }
    if (llama_kvp_policy_validate(policy) != 0) { // an unknown preset or stage has no spec that parses back
        return -1;
    }
    const std::string s = llama_kvp_policy_str(*policy);
    if (buf && size > 0) {
        snprintf(buf, size, "%s", s.c_str());
    }
    return (int32_t) s.size();
}

int32_t llama_kvp_policy_describe(const struct llama_kvp_policy * policy, struct llama_kvp_policy_desc * out) {
    if (!out || llama_kvp_policy_validate(policy) != 0) {
        if (!out) {
            llama_kvp_set_error("describe: output is NULL");
        }
        return -1;
    }
    const llama_kvp_policy & p = *policy;
    out->preset = llama_kvp_policy_type_name(p.type);
    for (int32_t slot = 0; slot < LLAMA_KVP_SLOT_COUNT; ++slot) {
        const llama_kvp_stage * s = llama_kvp_stage_by_id(p.stage[slot]);
        out->stage[slot] = s ? s->name : "";
    }
    const auto * prefill = llama_kvp_prefill_of(p);
    out->observes = llama_kvp_policy_observes(p) ? 1 : 0;
    out->retains  = llama_kvp_policy_retains(p) ? 1 : 0;
    out->sparse   = llama_kvp_policy_sparse(p) ? 1 : 0;
    out->guides   = out->retains && prefill && prefill->n_guide(p, UINT32_MAX) > 0 ? 1 : 0;
    out->rerank_at_end = llama_kvp_latent_at_prompt_end(p) ? 1 : 0;
    return 0;
}

// "key=default,..." of a comma-separated key list, the values of p ("none" for an empty list)
static std::string llama_kvp_keys_with_values(const char * keys, const llama_kvp_policy & p) {
    std::string res;
    std::istringstream list(keys);
    for (std::string name; std::getline(list, name, ','); ) {
        if (const llama_kvp_key_info * k = llama_kvp_key_find(name)) {
            res += (res.empty() ? "" : ",") + llama_kvp_key_str(*k, p);
        }
    }
    return res.empty() ? "none" : res;
}

int32_t llama_kvp_policy_help(char * buf, size_t size) {
    std::string s = "presets (spec: preset[:key=value,...][+stage[:key=value,...]]...; keys at their defaults):\n";
    for (const auto * p : llama_kvp_preset_all()) {
        char name[32];
        snprintf(name, sizeof(name), "  %-12s ", p->name);
        s += std::string(name) + p->help + "\n" + std::string(15, ' ') + "keys: " +
            llama_kvp_keys_with_values(p->keys, llama_kvp_policy_default(p->type)) + "\n";
    }
    for (int32_t slot = 0; slot < LLAMA_KVP_SLOT_COUNT; ++slot) {
        s += std::string(llama_kvp_slot_name(slot)) + " stages:\n";
        for (const auto * st : llama_kvp_stage_all()) {
            if (st->slot != slot) {
                continue;
            }
            llama_kvp_policy d = llama_kvp_policy_base();
            st->defaults(d);
            char name[32];
            snprintf(name, sizeof(name), "  %-12s ", st->name);
            s += std::string(name) + st->help + " (keys: " + llama_kvp_keys_with_values(st->keys, d) + ")\n";
        }
    }
    if (buf && size > 0) {
        snprintf(buf, size, "%s", s.c_str());
    }
    return (int32_t) s.size();
}
