// kvp-backend-check - runs KV-cache policies on the CPU and on a GPU backend over the same tokens and compares them,
// in the spirit of test-backend-ops' cross-backend checks, but for the whole engine (observation, budgets, eviction,
// the fates of leaving tokens, sparse prefill) rather than one op.
//
// The model is loaded twice: with no layer offloaded (the reference) and with every layer offloaded. For each policy,
// both contexts process the same prompt (guided chunks where the policy guides, as kvbench does), then decode the
// same tokens (the reference's greedy choice, so both see one sequence). Compared:
//   - the next-token distributions: KL(reference || other) after the prompt and at every decode step, top-1 agreement;
//   - per KV layer, the positions the cache holds (Jaccard index of the two sets) after the prompt and at the end.
// A policy fails if its mean KL exceeds --max-kl or its mean Jaccard index falls below --min-jaccard (either point).
// Without a GPU backend the "other" side runs on the CPU as well (the check of the checker: identical results);
// --perturb gives the other side 20% less budget, which the bars must catch. One JSON object goes to stdout; the exit
// code is 1 if any policy fails.
//
//     kvp-backend-check -m model.gguf -f text.txt -p 2048 -n 32

#include "llama.h"
#include "llama-kvp.h"
#include "kvp-tool.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

struct check_params {
    std::string              model;
    std::string              text_file;
    std::string              text;      // the text file's text, read before the model loads
    std::vector<std::string> policies;
    int32_t                  n_prompt    = 2048;
    int32_t                  n_gen       = 32;
    int32_t                  n_batch     = 512;
    int32_t                  n_threads   = 0;
    int32_t                  n_gpu_layers = 999;
    std::string              rpc;          // RPC servers: their device is the other side
    double                   max_kl      = 0.02;
    double                   min_jaccard = 0.9;
    bool                     perturb     = false;
};

struct check_side {
    std::vector<std::vector<int32_t>> pos_prompt; // per KV layer: positions held after the prompt
    std::vector<std::vector<int32_t>> pos_end;    // ... after the last decode step
    std::vector<std::vector<float>>   logits;     // after the prompt, then after each decode step
    bool                              summarises = false;
    llama_kvp_summary_stats           summary    = {}; // the summarise fate's counters at the end (if it summarises)
};

static void check_usage(const char * argv0) {
    printf("usage: %s [options]\n\n", argv0);
    printf("Runs KV-cache policies on the CPU and with every layer on a GPU backend over the same tokens and compares\n");
    printf("the next-token distributions (KL, top-1) and, per layer, the positions the caches hold (Jaccard).\n");
    printf("Prints one JSON object on stdout; exits with 1 if any policy is outside the bars.\n\n");
    printf("options:\n");
    printf("  -m, --model FNAME     GGUF model (`pykvcache backend-check` gives the embedded one without it)\n");
    printf("  -f, --file FNAME      text whose tokens are the prompt (repeated as needed; default: random tokens)\n");
    printf("  --policy SPEC         a policy spec, repeatable (default: full, sink_recent, snapkv, h2o, pyramid at 0.25,\n");
    printf("                        entropy:budget=0.1, none+sparse, snapkv:budget=0.1+summarise, freeze)\n");
    printf("  -p, --n-prompt N      prompt tokens (default 2048)\n");
    printf("  -n, --n-gen N         decode steps compared after the prompt (default 32)\n");
    printf("  -b, --batch-size N    logical and physical batch size (default 512)\n");
    printf("  -t, --threads N       CPU threads (default: the hardware threads)\n");
    printf("  -ngl, --n-gpu-layers N  layers the other side offloads to the GPU (default: all; fewer: a cache split\n");
    printf("                        between the GPU and the host)\n");
    printf("  -rpc, --rpc SERVERS   RPC servers (host:port[,..], `pykvcache rpc-server`): the other side runs on their\n");
    printf("                        device (a GPU there, or that machine's CPU: the host-device moves of every policy\n");
    printf("                        checked without a local GPU)\n");
    printf("  --max-kl X            largest mean KL(CPU || GPU) a policy may show (default 0.02)\n");
    printf("  --min-jaccard X       smallest mean Jaccard index of the layers' positions (default 0.9)\n");
    printf("  --perturb             the other side gets 20%% less budget: the bars must then fail (checks the checker;\n");
    printf("                        a policy without a budget, or one too small to lose 20%%, reports \"perturbed\": false)\n");
    printf("  -h, --help            show this help and exit\n");
}

static double check_parse_double(const std::string & flag, const std::string & s) {
    char * end = nullptr;
    const double v = std::strtod(s.c_str(), &end);
    if (s.empty() || *end != '\0' || !(v >= 0.0)) {
        throw std::invalid_argument(flag + ": expected a number >= 0, got '" + s + "'");
    }
    return v;
}

// returns 1 for --help
static int check_parse_args(int argc, char ** argv, check_params & params) {
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) {
                throw std::invalid_argument(arg + " needs a value");
            }
            return argv[++i];
        };
        if (arg == "-h" || arg == "--help") {
            return 1;
        } else if (arg == "-m" || arg == "--model") {
            params.model = value();
        } else if (arg == "-f" || arg == "--file") {
            params.text_file = value();
            params.text      = kvp_tool_read_text(params.text_file);
        } else if (arg == "--policy") {
            params.policies.push_back(value());
        } else if (arg == "-p" || arg == "--n-prompt") {
            params.n_prompt = kvp_tool_parse_int(arg, value(), 1);
        } else if (arg == "-n" || arg == "--n-gen") {
            params.n_gen = kvp_tool_parse_int(arg, value(), 0);
        } else if (arg == "-b" || arg == "--batch-size") {
            params.n_batch = kvp_tool_parse_int(arg, value(), 1);
        } else if (arg == "-t" || arg == "--threads") {
            params.n_threads = kvp_tool_parse_int(arg, value(), 1);
            if (params.n_threads > GGML_MAX_N_THREADS) {
                throw std::invalid_argument(arg + ": at most " + std::to_string(GGML_MAX_N_THREADS) + " threads (got " + std::to_string(params.n_threads) + ")");
            }
        } else if (arg == "-ngl" || arg == "--n-gpu-layers") {
            params.n_gpu_layers = kvp_tool_parse_int(arg, value(), 0);
        } else if (arg == "-rpc" || arg == "--rpc") {
            params.rpc = value();
            kvp_tool_add_rpc_servers(params.rpc); // as llama.cpp's own --rpc: the devices exist before the model loads
        } else if (arg == "--max-kl") {
            params.max_kl = check_parse_double(arg, value());
        } else if (arg == "--min-jaccard") {
            params.min_jaccard = check_parse_double(arg, value());
            if (params.min_jaccard > 1.0) {
                throw std::invalid_argument(arg + ": a Jaccard index is at most 1 (got " + std::to_string(params.min_jaccard) + ")");
            }
        } else if (arg == "--perturb") {
            params.perturb = true;
        } else {
            throw std::invalid_argument("unknown argument '" + arg + "' (see --help)");
        }
    }
    if (params.model.empty()) {
        throw std::invalid_argument("-m MODEL is required (see --help)");
    }
    return 0;
}

// positions held by each KV layer's cells, sorted (a context without per-layer caches: one set, the shared cache's)
static std::vector<std::vector<int32_t>> check_positions(llama_context * ctx) {
    const int32_t n_cells = (int32_t) llama_n_ctx(ctx) + 1024;
    std::vector<int32_t> buf(n_cells);
    std::vector<std::vector<int32_t>> res;
    struct llama_kvp_memory_info mi = {};
    const bool per_layer = llama_kvp_memory_info(ctx, &mi) == 0 && mi.per_layer == 1;
    llama_kvp_clear_error();
    const int32_t n_sets = per_layer ? llama_kvp_n_layers(ctx) : 1;
    for (int32_t ikv = 0; ikv < n_sets; ++ikv) {
        const int32_t n = per_layer ? llama_kvp_layer_cell_pos(ctx, ikv, buf.data(), n_cells) : llama_kvp_cell_pos(ctx, buf.data(), n_cells);
        if (n < 0) {
            throw std::runtime_error(std::string("cell positions: ") + llama_kvp_last_error());
        }
        std::vector<int32_t> s;
        for (int32_t i = 0; i < n; ++i) {
            if (buf[i] >= 0) {
                s.push_back(buf[i]);
            }
        }
        std::sort(s.begin(), s.end());
        res.push_back(s);
    }
    return res;
}

static std::vector<float> check_logits(llama_context * ctx, int32_t n_vocab) {
    const float * l = llama_get_logits_ith(ctx, -1);
    return std::vector<float>(l, l + n_vocab);
}

// one side: the prompt, then n_gen steps of the given tokens (empty: this side's own greedy choice, written to gen)
static check_side check_run(llama_model * model, const llama_kvp_policy & pol, const std::vector<llama_token> & prompt,
                            std::vector<llama_token> & gen, const check_params & params) {
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    llama_kvp_policy_desc desc = {};
    llama_kvp_policy_describe(&pol, &desc);
    const bool full = !desc.observes && !desc.retains && !desc.sparse;

    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx           = (uint32_t) ((params.n_prompt + params.n_gen + 255)/256*256);
    cparams.n_batch         = params.n_batch;
    cparams.n_ubatch        = params.n_batch;
    cparams.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    cparams.n_threads       = params.n_threads;
    cparams.n_threads_batch = params.n_threads;
    if (!full && llama_kvp_set_pending(&pol) != 0) {
        throw std::runtime_error(llama_kvp_last_error());
    }
    llama_context * ctx = llama_init_from_model(model, cparams);
    llama_kvp_clear_pending();
    if (!ctx) {
        throw std::runtime_error(std::string("cannot create the context: ") + llama_kvp_last_error());
    }
    check_side side;
    try {
        if (desc.retains && llama_kvp_set_prompt_len(ctx, params.n_prompt) != 0) {
            throw std::runtime_error(llama_kvp_last_error());
        }
        kvp_tool_prefill(ctx, prompt.data(), params.n_prompt, 0, params.n_batch, desc.guides != 0);
        side.logits.push_back(check_logits(ctx, n_vocab));
        side.pos_prompt = check_positions(ctx);
        const bool own = gen.empty();
        llama_pos pos = params.n_prompt;
        for (int32_t i = 0; i < params.n_gen; ++i) {
            const std::vector<float> & l = side.logits.back();
            const llama_token tok = own ? (llama_token) (std::max_element(l.begin(), l.end()) - l.begin()) : gen[i];
            if (own) {
                gen.push_back(tok);
            }
            kvp_tool_prefill(ctx, &tok, 1, pos++, 1, false);
            side.logits.push_back(check_logits(ctx, n_vocab));
        }
        side.pos_end = check_positions(ctx);
        side.summarises = llama_kvp_summary(ctx, &side.summary) == 0;
        llama_kvp_clear_error();
    } catch (...) {
        llama_free(ctx);
        throw;
    }
    llama_free(ctx);
    return side;
}

// KL(p || q) of the softmax distributions of two logit vectors (nats)
static double check_kl(const std::vector<float> & a, const std::vector<float> & b) {
    const double ma = *std::max_element(a.begin(), a.end());
    const double mb = *std::max_element(b.begin(), b.end());
    double za = 0.0;
    double zb = 0.0;
    for (size_t i = 0; i < a.size(); ++i) {
        za += std::exp(a[i] - ma);
        zb += std::exp(b[i] - mb);
    }
    double kl = 0.0;
    for (size_t i = 0; i < a.size(); ++i) {
        const double la = a[i] - ma - std::log(za);
        const double lb = b[i] - mb - std::log(zb);
        kl += std::exp(la)*(la - lb);
    }
    return std::max(0.0, kl);
}

static double check_jaccard(const std::vector<int32_t> & a, const std::vector<int32_t> & b) {
    std::vector<int32_t> both;
    std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(both));
    const size_t n_union = a.size() + b.size() - both.size();
    return n_union == 0 ? 1.0 : (double) both.size()/n_union;
}

// mean and min Jaccard index over the layers (0 if the two sides have different layer counts)
static void check_jaccard_layers(const std::vector<std::vector<int32_t>> & a, const std::vector<std::vector<int32_t>> & b,
                                 double & mean, double & min) {
    mean = 0.0;
    min  = 0.0;
    if (a.size() != b.size() || a.empty()) {
        return;
    }
    min = 1.0;
    for (size_t i = 0; i < a.size(); ++i) {
        const double j = check_jaccard(a[i], b[i]);
        mean += j;
        min   = std::min(min, j);
    }
    mean /= a.size();
}

static void check_log_quiet(enum ggml_log_level level, const char * text, void * user_data) {
    (void) user_data;
    if (level == GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

int main(int argc, char ** argv) {
    check_params params;
    try {
        if (check_parse_args(argc, argv, params) == 1) {
            check_usage(argv[0]);
            return 0;
        }
    } catch (const std::exception & e) {
        fprintf(stderr, "kvp-backend-check: %s\n", e.what());
        return 1;
    }
    if (params.n_threads == 0) {
        params.n_threads = (int32_t) std::max(1u, std::thread::hardware_concurrency());
    }
    if (params.policies.empty()) {
        params.policies = { "full", "sink_recent", "snapkv:budget=0.25", "h2o:budget=0.25", "pyramid:budget=0.25",
                            "entropy:budget=0.1", "none+sparse", "snapkv:budget=0.1+summarise", "freeze" };
    }
    std::vector<llama_kvp_policy> pols;
    for (const auto & s : params.policies) {
        llama_kvp_policy p = {};
        if (llama_kvp_policy_parse(s == "full" ? "none" : s.c_str(), &p) != 0) {
            fprintf(stderr, "kvp-backend-check: --policy %s: %s\n", s.c_str(), llama_kvp_last_error());
            return 1;
        }
        pols.push_back(p);
    }
    if (const std::string err = kvp_tool_model_error(params.model); !err.empty()) {
        fprintf(stderr, "kvp-backend-check: %s\n", err.c_str());
        return 1;
    }

    llama_log_set(check_log_quiet, nullptr);
    llama_backend_init();
    std::string gpu_name; // the first GPU device (an RPC server's, with --rpc)
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        if (ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_GPU && gpu_name.empty()) {
            gpu_name = ggml_backend_dev_description(dev);
        }
    }
    const bool gpu = !gpu_name.empty();
    if (!gpu) {
        fprintf(stderr, "kvp-backend-check: no GPU device: both sides run on the CPU (the check of the checker)\n");
    }
    llama_model_params mp_cpu = llama_model_default_params();
    mp_cpu.n_gpu_layers = 0;
    llama_model_params mp_gpu = llama_model_default_params();
    mp_gpu.n_gpu_layers = gpu ? params.n_gpu_layers : 0;
    llama_model * model_cpu = llama_model_load_from_file(params.model.c_str(), mp_cpu);
    llama_model * model_gpu = model_cpu ? llama_model_load_from_file(params.model.c_str(), mp_gpu) : nullptr;
    if (!model_cpu || !model_gpu) {
        fprintf(stderr, "kvp-backend-check: failed to load the model %s\n", params.model.c_str());
        llama_model_free(model_cpu);
        return 1;
    }

    int rc = 0;
    printf("{\n  \"gpu\": %s,\n  \"n_gpu_layers\": %d,\n  \"n_prompt\": %d,\n  \"n_gen\": %d,\n  \"perturb\": %s,\n  \"max_kl\": %g,\n  \"min_jaccard\": %g,\n  \"policies\": [\n",
           gpu ? kvp_tool_json_str(gpu_name).c_str() : "null", gpu ? params.n_gpu_layers : 0, params.n_prompt, params.n_gen, params.perturb ? "true" : "false",
           params.max_kl, params.min_jaccard);
    for (size_t k = 0; k < pols.size(); ++k) {
        const llama_kvp_policy & pol = pols[k];
        const std::string name = kvp_tool_policy_str(pol);
        llama_kvp_policy pol_other = pol;
        if (params.perturb && pol.budget > 0.0f) {
            // a fraction of the prompt, or a token count (one a budget that small cannot lose stays as it is)
            pol_other.budget = pol.budget < 1.0f ? pol.budget*0.8f : std::floor(pol.budget*0.8f);
            if (llama_kvp_policy_validate(&pol_other) != 0) {
                pol_other.budget = pol.budget;
            }
        }
        const bool perturbed = pol_other.budget != pol.budget;
        fprintf(stderr, "kvp-backend-check: %s\n", name.c_str());
        std::string line;
        try {
            const std::vector<llama_token> prompt = kvp_tool_tokens(llama_model_get_vocab(model_cpu), params.text, params.text_file, 42, params.n_prompt);
            std::vector<llama_token> gen;
            const check_side a = check_run(model_cpu, pol, prompt, gen, params);
            const check_side b = check_run(model_gpu, pol_other, prompt, gen, params);
            const double kl_prompt = check_kl(a.logits[0], b.logits[0]);
            double kl_mean = 0.0;
            double kl_max  = 0.0;
            int32_t n_top1 = 0;
            bool finite = true;
            for (size_t i = 0; i < a.logits.size(); ++i) {
                const double kl = check_kl(a.logits[i], b.logits[i]);
                finite  = finite && std::isfinite(kl);
                kl_mean += kl;
                kl_max   = std::max(kl_max, kl);
                const auto & la = a.logits[i];
                const auto & lb = b.logits[i];
                n_top1 += std::max_element(la.begin(), la.end()) - la.begin() == std::max_element(lb.begin(), lb.end()) - lb.begin();
            }
            kl_mean /= a.logits.size();
            double jp_mean, jp_min, je_mean, je_min;
            check_jaccard_layers(a.pos_prompt, b.pos_prompt, jp_mean, jp_min);
            check_jaccard_layers(a.pos_end, b.pos_end, je_mean, je_min);
            const bool pass = finite && kl_mean <= params.max_kl && jp_mean >= params.min_jaccard && je_mean >= params.min_jaccard;
            rc = pass ? rc : 1;
            char buf[1024];
            snprintf(buf, sizeof(buf),
                     ", \"kl_prompt\": %.6g, \"kl_mean\": %.6g, \"kl_max\": %.6g, \"top1\": %.4f, "
                     "\"jaccard_prompt_mean\": %.4f, \"jaccard_prompt_min\": %.4f, \"jaccard_end_mean\": %.4f, "
                     "\"jaccard_end_min\": %.4f, \"n_layers\": %zu, \"perturbed\": %s, \"pass\": %s}",
                     kl_prompt, kl_mean, kl_max, (double) n_top1/a.logits.size(),
                     jp_mean, jp_min, je_mean, je_min, a.pos_prompt.size(), perturbed ? "true" : "false", pass ? "true" : "false");
            line = "    {\"policy\": " + kvp_tool_json_str(name) + buf; // the spec whole, whatever its length
            if (a.summarises && b.summarises) {
                // where the two sides' bins differ (the fits' own figures; centroids are placed per bin)
                line.pop_back();
                for (const auto * side : { &a, &b }) {
                    const llama_kvp_summary_stats & st = side->summary;
                    snprintf(buf, sizeof(buf), ", \"summary_%s\": {\"n_bins\": %lld, \"n_fallback\": %lld, \"n_centroids\": %d, "
                             "\"fit_err\": %.4g, \"fit_lse_err\": %.4g, \"t_ms\": %.1f}", side == &a ? "cpu" : "other",
                             (long long) st.n_bins, (long long) st.n_fallback, st.n_centroids, st.fit_err, st.fit_lse_err, st.t_ms);
                    line += buf;
                }
                line += "}";
            }
        } catch (const std::exception & e) {
            rc = 1;
            line = "    {\"policy\": " + kvp_tool_json_str(name) + ", \"error\": " + kvp_tool_json_str(e.what()) + ", \"pass\": false}";
        }
        printf("%s%s\n", line.c_str(), k + 1 < pols.size() ? "," : "");
        fflush(stdout);
    }
    printf("  ],\n  \"pass\": %s\n}\n", rc == 0 ? "true" : "false");
    llama_model_free(model_gpu);
    llama_model_free(model_cpu);
    llama_backend_free();
    return rc;
}
