// kvbench - speed, KV memory and observation overhead of KV-cache policies, in the spirit of llama-bench.
//
// Every policy runs in the same process on the same tokens; each figure is also given as a ratio to the full cache
// (`full`, added first if not asked for) measured in the same run. KV bytes are read from the real ggml buffers.
// A retention policy of mean layer budget B is also compared with its physical limit: the full cache decoding at
// depth B (the same attention work), measured in the same run (`limit:d=B` rows, `x limit` column).
//
//     kvbench -p 4096 -n 128 -d 0,4096 --policy full --policy entropy:budget=0.1 -r 3 -t 2 -o md

#include "llama.h"
#include "llama-kvp.h"
#include "kvp-tool.h"

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cinttypes>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

struct kvbench_params {
    std::string              model;
    std::string              text_file;
    std::string              text;         // the text file's text, read before the model loads
    std::vector<std::string> policies;
    std::vector<int32_t>     n_prompt = { 512 };
    std::vector<int32_t>     n_gen    = { 128 };
    std::vector<int32_t>     n_depth  = { 0 };
    std::vector<std::pair<int32_t, int32_t>> n_pg; // (prompt, gen) pairs, as llama-bench's -pg, beside the -p x -n tests
    int32_t                  reps     = 3;
    std::vector<int32_t>     n_threads;    // CPU threads, as llama-bench's -t list (empty: the hardware threads)
    std::vector<int32_t>     n_gpu_layers = { 0 }; // as llama-bench's -ngl list: the model loaded for each value in turn
    std::string              rpc;          // RPC servers, as llama-bench's --rpc
    int32_t                  n_ctx    = 0;
    int32_t                  n_batch  = 512;
    int32_t                  n_ubatch = 0;   // 0: n_batch
    std::vector<ggml_type>   type_k   = { GGML_TYPE_F16 }; // KV cache types, as llama-bench's -ctk / -ctv
    std::vector<ggml_type>   type_v   = { GGML_TYPE_F16 };
    std::vector<llama_flash_attn_type> flash_attn = { LLAMA_FLASH_ATTN_TYPE_ENABLED }; // as llama-bench's -fa list
    uint32_t                 seed     = 42;
    std::string              output   = "md";
    bool                     progress = true;
    bool                     limit    = true; // measure the physical limit of the retention rows
    bool                     verbose  = false;
    std::string              model_desc;   // the md table's caption: the model, its size, the backend
};

// the names of the devices that can take offloaded layers: GPUs, and the RPC servers' devices added with -rpc
static std::vector<std::string> kvbench_gpu_devices() {
    std::vector<std::string> names;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        const enum ggml_backend_dev_type type = ggml_backend_dev_type(dev);
        if (type == GGML_BACKEND_DEVICE_TYPE_GPU || type == GGML_BACKEND_DEVICE_TYPE_IGPU) {
            names.push_back(ggml_backend_dev_name(dev));
        }
    }
    return names;
}

// one row: a policy at one (prompt, gen, depth) configuration
struct kvbench_result {
    std::string policy; // type name
    std::string label;  // the spec as given
    std::string spec;   // canonical spec (every parameter)
    int32_t     n_prompt = 0;
    int32_t     n_gen    = 0;
    int32_t     n_depth  = 0;
    int32_t     n_ctx    = 0; // the context it ran in
    ggml_type   type_k   = GGML_TYPE_F16; // its KV cache types
    ggml_type   type_v   = GGML_TYPE_F16;
    int32_t     n_threads = 0; // the CPU threads it ran with
    llama_flash_attn_type flash_attn = LLAMA_FLASH_ATTN_TYPE_ENABLED; // and its flash attention
    int32_t     n_gpu_layers = 0; // and the layers offloaded

    std::vector<double> pp_ts; // prefill tokens/s, one per repetition
    std::vector<double> tg_ts; // decode tokens/s, one per repetition

    int64_t              kv_bytes      = 0; // K+V bytes after the last repetition
    int64_t              kv_bytes_peak = 0; // largest K+V bytes at any time
    std::vector<int64_t> kv_layer_bytes;    // per layer, after the last repetition
    std::vector<int32_t> kv_layer_cells;    // per layer capacity
    int64_t              n_evicted     = 0;   // cells evicted per repetition, all layers
    double               obs_overhead  = 0.0; // share of decode time spent in observing steps beyond a plain step
    int32_t              n_obs_steps   = 0;   // observing decode steps (all repetitions)
    std::vector<double>  t_obs_steps;         // their times (s)
    double               t_plain       = 0.0; // median time of a plain (non-observing) step, 0 if none
    double               t_gen         = 0.0; // all decode steps (s)
    double               density       = 1.0; // sparse prefill: key blocks computed / dense, in ubatches that ran sparse
    int32_t              n_recover[4]  = { 0, 0, 0, 0 }; // recovery ladder events by level (all repetitions)
    int32_t              n_gen_steps   = 0;   // decode steps timed (all repetitions)
    int32_t              n_gen_reused  = 0;   // of them, steps whose compute graph llama.cpp reused (not rebuilt)

    // host tier (fate stage `host`): peak bytes of the last repetition, token moves per repetition (all layers)
    int32_t host            = 0; // 1: the policy has a host tier
    int64_t host_bytes_peak = 0;
    int64_t n_freeze        = 0; // frozen by the freeze schedule
    int64_t n_host_evict    = 0; // moved to the host tier by the budget's eviction
    int64_t n_thaw          = 0; // back into a layer cache
    int64_t n_dropped       = 0; // dropped for good from the host tier (its limit)
    int64_t n_rerank        = 0; // latent re-rankings (per layer)
    int64_t n_promote       = 0; // host tokens made active by a re-ranking

    // summarise (fate stage `summarise`), per repetition: bins replaced by centroids, and the host time the fate spent
    // reading leavers from the caches, fitting and writing centroids, during the prompt and during decode
    int32_t summarise = 0; // 1: the policy summarises
    double  sum_bins  = 0.0;
    double  sum_ms_pp = 0.0;
    double  sum_ms_tg = 0.0;

    // the policy's host time around the graphs (llama_kvp_perf), per repetition (ms): the prompt's all together, the
    // decode steps' by part (prepare, slot, input, settle); apart, the time it waited in them for the backends
    int32_t perf       = 0; // 1: the context has a policy
    double  perf_ms_pp = 0.0;
    double  perf_tg[4] = { 0.0, 0.0, 0.0, 0.0 };
    double  wait_ms_pp = 0.0;
    double  wait_ms_tg = 0.0;

    // ratios to `full` at the same configuration (has_ref: there is one)
    bool   has_ref  = false;
    double pp_ratio = 0.0;
    double tg_ratio = 0.0;
    double kv_ratio = 0.0;
    double peak_ratio = 0.0;

    int32_t per_layer = 0; // llama_kvp_memory_info after the test: 1 for a retention policy (one KV cache per layer)
    int32_t budget    = 0; // its resolved mean budget per layer (tokens)

    // physical limit: the full cache decoding n_gen tokens at depth limit_depth (0: none), its steps alternating
    // with the row's own decode steps
    int32_t             limit_depth    = 0;
    int32_t             limit_n_ctx    = 0;   // the full cache's context the limit steps ran in
    double              limit_tg_ts    = 0.0;
    double              limit_tg_ts_sd = 0.0;
    double              tg_limit_ratio = 0.0; // tg t/s / limit_tg_ts
    std::vector<double> lim_tg_ts;            // the limit's tg t/s, one per repetition
    std::vector<double> lim_step_t;           // the limit's decode steps (s)
};

// one test: the tokens in the context before the prompt, the prompt, the tokens generated
struct kvbench_test {
    int32_t   n_depth;
    int32_t   n_prompt;
    int32_t   n_gen;
    ggml_type type_k;
    ggml_type type_v;
    int32_t   n_threads;
    llama_flash_attn_type flash_attn;
    int32_t   n_gpu_layers;
    size_t    i_model; // the index of its -ngl value: the model loaded with those layers offloaded
};

// a model, freed on every way out
struct kvbench_model {
    llama_model * ptr;

    explicit kvbench_model(llama_model * m) : ptr(m) {}
    ~kvbench_model() {
        if (ptr) {
            llama_model_free(ptr);
        }
    }
    kvbench_model(const kvbench_model &) = delete;
    kvbench_model & operator=(const kvbench_model &) = delete;
};

// the KV cache types llama.cpp's tools take by name (common/arg.cpp's list)
static std::vector<ggml_type> kvbench_parse_types(const std::string & flag, const std::string & s) {
    static const ggml_type allowed[] = { GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0,
                                         GGML_TYPE_Q4_1, GGML_TYPE_IQ4_NL, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1 };
    std::vector<ggml_type> res;
    std::stringstream ss(s);
    std::string name;
    while (std::getline(ss, name, ',')) {
        bool found = false;
        for (ggml_type t : allowed) {
            if (name == ggml_type_name(t)) {
                res.push_back(t);
                found = true;
            }
        }
        if (!found) {
            std::string names;
            for (ggml_type t : allowed) {
                names += std::string(names.empty() ? "" : ", ") + ggml_type_name(t);
            }
            throw std::invalid_argument(flag + ": unknown KV cache type '" + name + "' (one of " + names + ")");
        }
    }
    if (res.empty()) {
        throw std::invalid_argument(flag + ": expected a KV cache type");
    }
    return res;
}

// flash attention in the JSON: true, false or "auto"
static const char * kvbench_fa_json(llama_flash_attn_type fa) {
    return fa == LLAMA_FLASH_ATTN_TYPE_AUTO ? "\"auto\"" : fa == LLAMA_FLASH_ATTN_TYPE_ENABLED ? "true" : "false";
}

// flash attention as -fa takes it: on, off or auto (md and CSV)
static const char * kvbench_fa_name(llama_flash_attn_type fa) {
    return fa == LLAMA_FLASH_ATTN_TYPE_AUTO ? "auto" : fa == LLAMA_FLASH_ATTN_TYPE_ENABLED ? "on" : "off";
}

// what tells a row from the others of its policy and sizes: its KV types if not f16, and its threads, flash
// attention and offloaded layers where those lists have more than one value (md labels, progress)
static std::string kvbench_row_tag(const kvbench_params & params, const kvbench_result & r) {
    std::string res;
    if (params.type_k != std::vector<ggml_type>{ GGML_TYPE_F16 } || params.type_v != std::vector<ggml_type>{ GGML_TYPE_F16 }) {
        res += std::string(" [") + ggml_type_name(r.type_k) + "/" + ggml_type_name(r.type_v) + "]";
    }
    if (params.n_threads.size() > 1) {
        res += " [t=" + std::to_string(r.n_threads) + "]";
    }
    if (params.flash_attn.size() > 1) {
        res += std::string(" [fa ") + kvbench_fa_name(r.flash_attn) + "]";
    }
    if (params.n_gpu_layers.size() > 1) {
        res += " [ngl " + std::to_string(r.n_gpu_layers) + "]";
    }
    return res;
}

// flash attention values, as llama-bench's -fa list: on/1, off/0, auto/-1
static std::vector<llama_flash_attn_type> kvbench_parse_fa(const std::string & flag, const std::string & s) {
    std::vector<llama_flash_attn_type> res;
    std::stringstream ss(s + ",");
    std::string v;
    while (std::getline(ss, v, ',')) {
        if (v == "on" || v == "1") {
            res.push_back(LLAMA_FLASH_ATTN_TYPE_ENABLED);
        } else if (v == "off" || v == "0") {
            res.push_back(LLAMA_FLASH_ATTN_TYPE_DISABLED);
        } else if (v == "auto" || v == "-1") {
            res.push_back(LLAMA_FLASH_ATTN_TYPE_AUTO);
        } else {
            throw std::invalid_argument(flag + ": expected on, off or auto (or a comma-separated list of them), got '" + s + "'");
        }
    }
    return res;
}

// a test's context size: -c, else depth + prompt + gen (as llama-bench sizes each test), raised to what the policy
// needs (a budget in tokens, the observation window, the tokens always kept), padded to 256
static uint32_t kvbench_n_ctx(const kvbench_params & params, const llama_kvp_policy & pol, const kvbench_test & t) {
    if (params.n_ctx > 0) {
        return (uint32_t) params.n_ctx;
    }
    int64_t n = t.n_depth + t.n_prompt + t.n_gen;
    if (pol.budget >= 1.0f && pol.budget <= 1.0e6f) { // a count of tokens (larger values are the engine's "all")
        n = std::max<int64_t>(n, (int64_t) std::ceil(pol.budget));
    }
    n = std::max<int64_t>(n, std::max<int64_t>(pol.window, (int64_t) pol.n_sink + pol.n_recent));
    return (uint32_t) std::max<int64_t>(256, (n + 255)/256*256);
}

static void kvbench_usage(const char * argv0) {
    printf("usage: %s [options]\n\n", argv0);
    printf("Benchmarks KV-cache policies of pykvcache against the full cache, in one run.\n\n");
    printf("options:\n");
    printf("  -h, --help                show this help and exit\n");
    printf("  -m, --model FNAME         GGUF model (default: the embedded SmolLM2-135M-Instruct Q4_1, found through\n");
    printf("                            $PYKVCACHE_MODEL or the installed pykvcache package)\n");
    printf("  --policy SPEC             a policy spec, repeatable (e.g. full, snapkv:budget=0.25, entropy:budget=0.1,\n");
    printf("                            snapkv:budget=0.1+entropy; listed below);\n");
    printf("                            'full' (llama.cpp's cache) is always run first, as the reference of the ratios\n");
    printf("                            (default: full, sink_recent (4 sinks + 252 recent tokens), and snapkv, h2o, pyramid, entropy at budget 0.25)\n");
    printf("  -p, --n-prompt N[,N..]    prompt tokens processed and timed (default: 512); with lists, every combination of\n");
    printf("                            -d, -p and -n is one test (a row), in a context of its own; a list flag given\n");
    printf("                            again adds its values (-p 16 -p 32 = -p 16,32), and an item may be a range\n");
    printf("                            first-last[+step|*factor] (-p 1024-4096*2 = -p 1024,2048,4096), as in llama-bench\n");
    printf("  -n, --n-gen N[,N..]       tokens generated one by one and timed, after the depth and the prompt (default: 128;\n");
    printf("                            llama-bench's tgN runs at depth d alone: here the policy decodes what it kept of d + p)\n");
    printf("  -pg PP,TG                 one more test of PP prompt and TG generated tokens (at every -d), beside the -p x -n\n");
    printf("                            ones; repeatable (to run these alone: -p 0 -n 0 -pg 4096,128)\n");
    printf("  -d, --n-depth N[,N..]     tokens already in the context before the prompt (default: 0)\n");
    printf("                            a fractional budget is a fraction of depth + prompt\n");
    printf("  -r, --repetitions N       repetitions of each test (default: 3)\n");
    printf("  -t, --threads N[,N..]     CPU threads (default: the hardware threads of the machine); with a list, each is a\n");
    printf("                            test of its own, its ratios against the full cache at the same threads (JSON: the\n");
    printf("                            run's n_threads is the first, each row has its own)\n");
    printf("  -ngl, --n-gpu-layers N[,N..]  layers offloaded to the GPU (default: 0); with a list, the model is loaded\n");
    printf("                            once per value and each is a test of its own, its ratios against the full cache\n");
    printf("                            with the same layers offloaded (JSON: the run's n_gpu_layers is the first)\n");
    printf("  -rpc, --rpc SERVERS       RPC servers (host:port[,host:port..], started with `pykvcache rpc-server`) whose\n");
    printf("                            devices take the offloaded layers and their KV caches (with -ngl)\n");
    printf("  -c, --ctx-size N          context size of every test (default: each test's depth + prompt + gen, raised to a\n");
    printf("                            policy's budget in tokens, padded to 256; the full cache's KV bytes, the reference of\n");
    printf("                            KV x, are those of the test's own context)\n");
    printf("  -b, --batch-size N        logical batch size: tokens per llama_decode call (default: 512)\n");
    printf("  -ub, --ubatch-size N      physical batch size: tokens per graph (default: -b; at most -b); a retention\n");
    printf("                            policy's prompt ubatches are also at most its `chunk`\n");
    printf("  -ctk, --cache-type-k T[,T..]  KV cache type of K: f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1\n");
    printf("                            (default: f16); with lists, each type is a test of its own, its ratios against\n");
    printf("                            the full cache of the same types\n");
    printf("  -ctv, --cache-type-v T[,T..]  KV cache type of V (default: f16; a quantized V needs flash attention)\n");
    printf("  -fa, --flash-attn on|off|auto[,..]\n");
    printf("                            flash attention (default: on; auto: llama.cpp's choice per device, on for the CPU);\n");
    printf("                            with a list (-fa off,on), each is a test of its own, its ratios against the full\n");
    printf("                            cache with the same flash attention (JSON: the run's flash_attn is the first)\n");
    printf("  -f, --file FNAME          text whose tokens are used (repeated as needed; default: random tokens, when\n");
    printf("                            kvbench runs alone; `pykvcache bench` gives it the essays)\n");
    printf("  -s, --seed N              seed of the random tokens (default: 42)\n");
    printf("  -o, --output FMT          output format on stdout: md, json, jsonl (one row per line) or csv (default: md);\n");
    printf("                            a run that fails part way prints the tests measured before it and exits 1\n");
    printf("                            (Ctrl-C: the same, exit 130)\n");
    printf("  --no-limit                do not measure the physical limit of the retention policies\n");
    printf("  --no-progress             do not print progress on stderr\n");
    printf("  -v, --verbose             show llama.cpp's log\n");
    printf("\nfigures: pp t/s and tg t/s (mean and sd over repetitions), KV bytes per layer and in total and their peak\n");
    printf("(from the ggml buffers), evicted cells per repetition, observation overhead (share of decode time that observing steps take\n");
    printf("beyond the median plain step of the policy; if every step observes, beyond its physical limit's steps, taken at the\n");
    printf("same moments, or beyond the median step of full with --no-limit), and ratios to full.\n");
    printf("KV x / peak x: the policy's KV bytes (after the test / at peak) over the full cache's in the same test; a\n");
    printf("retention policy's layer holds its budget plus room for a prompt chunk (`chunk`) and the observation window,\n");
    printf("so at a prompt a few times the budget KV x is above the budget's share (json: kv_layer_cells per layer).\n");
    printf("density: the share of key blocks a sparse prefill (+sparse) computed in the prompt's ubatches (1: dense).\n");
    printf("physical limit: for a retention policy whose mean layer budget is B tokens (at most depth + prompt), the full\n");
    printf("cache's decode speed at depth B: after the policy's prompt, B tokens are prefilled untimed in the full cache's\n");
    printf("context, then its decode steps alternate with the policy's (same token), so that a slow moment of the machine\n");
    printf("costs both alike; `x limit` = tg t/s / the tg t/s of those limit steps; `limit:d=B` rows (md; \"limits\" in\n");
    printf("json) pool every policy's limit steps at that depth.\n");
    printf("host memory of the fate stage (not in KV MiB; md: a second table): its peak bytes, for the host tier (a policy with\n");
    printf("+host) with its token moves per repetition, all layers: frozen, evicted to host, thawed, dropped for good, latent\n");
    printf("re-ranks, promoted, recovery ladder events; for summarise, the pending bins (as allocated), the bins fitted\n");
    printf("and the fits' time (json, per repetition: sum_bins, sum_ms_pp in the prompt, sum_ms_tg over all decoded tokens;\n");
    printf("md: per decoded token).\n");
    printf("policy host time (md: a table of its own; host_ms_* in json, per repetition): the time the policy's own code took\n");
    printf("on the host around llama.cpp's graphs (llama_kvp_perf), for the prompt and per decoded token, by part: prepare\n");
    printf("(budgets, scores, evictions, the fate stage's work), slots (each layer's cells for the ubatch), inputs (per-layer\n");
    printf("masks and cell indices, the observation's inputs), settle (a prompt's end settled after its last ubatch, summarise);\n");
    printf("host_ms_tg_parts lists the four in that order; `x step` is its share of the mean decode step. wait (host_wait_ms_*):\n");
    printf("the time the policy's code waited in those parts for a GPU to finish earlier graphs before reading what they\n");
    printf("wrote; not counted in the host time (~0 on the CPU; over RPC it stays in the host time).\n");

    const int32_t n = llama_kvp_policy_help(nullptr, 0);
    std::vector<char> buf(n + 1);
    llama_kvp_policy_help(buf.data(), buf.size());
    printf("\npolicy specs, as in Python and the pykvcache CLI: %s", buf.data());
}

// returns 0 to run, 1 for --help, throws on bad input
static int kvbench_parse_args(int argc, char ** argv, kvbench_params & params) {
    // a list flag given again adds its values, as llama-bench's (-p 16 -p 32 = -p 16,32); the first replaces the default
    std::vector<std::string> seen;
    auto add = [&seen](const std::string & arg, auto & list, const auto & values) {
        if (std::find(seen.begin(), seen.end(), arg) == seen.end()) {
            seen.push_back(arg);
            list.clear();
        }
        list.insert(list.end(), values.begin(), values.end());
    };
    for (int i = 1; i < argc; ++i) {
        std::string arg = argv[i];
        // --option=value, as well as --option value
        std::string inline_value;
        bool has_inline = false;
        if (arg.rfind("--", 0) == 0 && arg.find('=') != std::string::npos) {
            inline_value = arg.substr(arg.find('=') + 1);
            arg          = arg.substr(0, arg.find('='));
            has_inline   = true;
        }
        auto value = [&]() -> std::string {
            if (has_inline) {
                has_inline = false;
                return inline_value;
            }
            if (i + 1 >= argc) {
                throw std::invalid_argument(arg + ": missing value");
            }
            return argv[++i];
        };
        if (arg == "-h" || arg == "--help") {
            return 1;
        } else if (arg == "-m" || arg == "--model") {
            params.model = value();
            if (params.model.empty()) {
                throw std::invalid_argument(arg + ": an empty path; give a GGUF file, or leave -m out for the embedded model");
            }
        } else if (arg == "--policy") {
            params.policies.push_back(value());
        } else if (arg == "-p" || arg == "--n-prompt") {
            add("-p", params.n_prompt, kvp_tool_parse_list(arg, value(), 0));
        } else if (arg == "-n" || arg == "--n-gen") {
            add("-n", params.n_gen, kvp_tool_parse_list(arg, value(), 0));
        } else if (arg == "-pg") {
            const std::string v     = value();
            const size_t      comma = v.find(',');
            if (comma == std::string::npos) {
                throw std::invalid_argument(arg + ": expected pp,tg (two integers >= 0), got '" + v + "'");
            }
            params.n_pg.emplace_back(kvp_tool_parse_int(arg + " pp", v.substr(0, comma), 0),
                                     kvp_tool_parse_int(arg + " tg", v.substr(comma + 1), 0));
        } else if (arg == "-d" || arg == "--n-depth") {
            add("-d", params.n_depth, kvp_tool_parse_list(arg, value(), 0));
        } else if (arg == "-r" || arg == "--repetitions") {
            params.reps = kvp_tool_parse_int(arg, value(), 1);
        } else if (arg == "-t" || arg == "--threads") {
            const auto n = kvp_tool_parse_list(arg, value(), 1);
            for (int32_t x : n) {
                if (x > GGML_MAX_N_THREADS) {
                    throw std::invalid_argument(arg + ": at most " + std::to_string(GGML_MAX_N_THREADS) + " threads (got " + std::to_string(x) + ")");
                }
            }
            add("-t", params.n_threads, n);
        } else if (arg == "-ngl" || arg == "--n-gpu-layers") {
            add("-ngl", params.n_gpu_layers, kvp_tool_parse_list(arg, value(), 0));
        } else if (arg == "-rpc" || arg == "--rpc") {
            params.rpc = value();
            kvp_tool_add_rpc_servers(params.rpc); // as llama.cpp's own --rpc: the devices exist before the model loads
        } else if (arg == "-c" || arg == "--ctx-size") {
            params.n_ctx = kvp_tool_parse_int(arg, value(), 0);
        } else if (arg == "-ctk" || arg == "--cache-type-k") {
            add("-ctk", params.type_k, kvbench_parse_types(arg, value()));
        } else if (arg == "-ctv" || arg == "--cache-type-v") {
            add("-ctv", params.type_v, kvbench_parse_types(arg, value()));
        } else if (arg == "-b" || arg == "--batch-size") {
            params.n_batch = kvp_tool_parse_int(arg, value(), 1);
        } else if (arg == "-ub" || arg == "--ubatch-size") {
            params.n_ubatch = kvp_tool_parse_int(arg, value(), 1);
        } else if (arg == "-fa" || arg == "--flash-attn") {
            add("-fa", params.flash_attn, kvbench_parse_fa(arg, value()));
        } else if (arg == "-f" || arg == "--file") {
            params.text_file = value();
            params.text      = kvp_tool_read_text(params.text_file);
        } else if (arg == "-s" || arg == "--seed") {
            params.seed = (uint32_t) kvp_tool_parse_int(arg, value(), 0);
        } else if (arg == "-o" || arg == "--output") {
            params.output = value();
            if (params.output != "md" && params.output != "json" && params.output != "jsonl" && params.output != "csv") {
                throw std::invalid_argument(arg + ": expected md, json, jsonl or csv, got '" + params.output + "'");
            }
        } else if (arg == "--no-limit") {
            params.limit = false;
        } else if (arg == "--no-progress") {
            params.progress = false;
        } else if (arg == "-v" || arg == "--verbose") {
            params.verbose = true;
        } else {
            throw std::invalid_argument("unknown argument: " + arg + " (see --help)");
        }
        if (has_inline) {
            throw std::invalid_argument(arg + ": takes no value");
        }
    }
    return 0;
}

// the embedded default model: $PYKVCACHE_MODEL, else asked from the installed pykvcache package
static std::string kvbench_default_model() {
    if (const char * env = getenv("PYKVCACHE_MODEL")) {
        return env;
    }
    std::string res;
    // from /, so that a source checkout in the current folder does not shadow the installed package
    FILE * f = popen("cd / && python3 -c 'from pykvcache import default_model_path; print(default_model_path())' 2>/dev/null", "r");
    if (f) {
        char buf[4096];
        while (fgets(buf, sizeof(buf), f)) {
            res += buf;
        }
        pclose(f);
    }
    while (!res.empty() && (res.back() == '\n' || res.back() == '\r')) {
        res.pop_back();
    }
    return res;
}

// what a policy does, from the engine's own description
static llama_kvp_policy_desc kvbench_describe(const llama_kvp_policy & pol) {
    llama_kvp_policy_desc d = {};
    llama_kvp_policy_describe(&pol, &d);
    return d;
}

// the full cache: neither observes, retains nor computes sparse attention
static bool kvbench_is_full(const llama_kvp_policy & pol) {
    const llama_kvp_policy_desc d = kvbench_describe(pol);
    return !d.observes && !d.retains && !d.sparse;
}

// canonical name of a spec ("full" for the full cache)
static std::string kvbench_spec(const std::string & spec, llama_kvp_policy & pol) {
    const std::string s = spec == "full" ? "none" : spec;
    if (llama_kvp_policy_parse(s.c_str(), &pol) != 0) {
        throw std::invalid_argument(std::string("--policy ") + spec + ": " + llama_kvp_last_error());
    }
    return kvbench_is_full(pol) ? "full" : kvp_tool_policy_str(pol);
}

static void kvbench_mean_sd(const std::vector<double> & v, double & mean, double & sd) {
    mean = 0.0;
    sd   = 0.0;
    if (v.empty()) {
        return;
    }
    for (double x : v) {
        mean += x;
    }
    mean /= v.size();
    for (double x : v) {
        sd += (x - mean)*(x - mean);
    }
    sd = v.size() > 1 ? std::sqrt(sd/(v.size() - 1)) : 0.0;
}

static double kvbench_now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// the tokens the memory's layers have evicted since the context was made
static int64_t kvbench_n_evicted(llama_context * ctx) {
    struct llama_kvp_memory_info info = {};
    return llama_kvp_memory_info(ctx, &info) == 0 ? info.n_evicted : 0;
}

// the end of a prompt under gap=0 latent re-ranking (schedule `latent`, or `freeze` with gap=0), as Python's Llama marks
// it: re-ranked and its last tokens evaluated again (stages/schedule-latent.cpp)
static void kvbench_latent_prompt_end(llama_context * ctx, const llama_token * tokens, int32_t n, int32_t pos0, bool pruned) {
    if (llama_kvp_latent_prompt_end(ctx, tokens, n, pos0, pruned ? 1 : 0, nullptr) < 0) {
        throw std::runtime_error(std::string("latent re-ranking failed: ") + llama_kvp_last_error());
    }
}

static llama_token kvbench_argmax(llama_context * ctx, int32_t n_vocab) {
    const float * logits = llama_get_logits_ith(ctx, -1);
    return (llama_token) (std::max_element(logits, logits + n_vocab) - logits);
}

static int32_t kvbench_n_obs(llama_context * ctx) {
    struct llama_kvp_obs_info info = {};
    if (llama_kvp_obs_info(ctx, &info) != 0) {
        llama_kvp_clear_error();
        return 0;
    }
    return info.n_obs;
}

// depth of the physical limit of a policy with memory info mi: its mean layer budget, at most the tokens it has before
// decoding (-1: none)
static int32_t kvbench_limit_depth_of(const struct llama_kvp_memory_info & mi, int32_t n_before) {
    if (mi.per_layer != 1) {
        return -1;
    }
    return std::min(mi.budget, n_before);
}

// one single-token decode step of seq 0 at pos, complete when it returns; its wall time (s)
static double kvbench_step(llama_context * ctx, llama_batch & batch, llama_token tok, llama_pos pos) {
    batch.n_tokens     = 1;
    batch.token[0]     = tok;
    batch.pos[0]       = pos;
    batch.n_seq_id[0]  = 1;
    batch.seq_id[0][0] = 0;
    batch.logits[0]    = 1;
    const double t0 = kvbench_now();
    if (llama_decode(ctx, batch) != 0) {
        throw std::runtime_error("llama_decode failed at position " + std::to_string(pos));
    }
    llama_synchronize(ctx);
    return kvbench_now() - t0;
}

// ctx_lim: the full cache's context for the physical limit, whose steps alternate with this row's (nullptr: none)
static void kvbench_run_test(llama_context * ctx, const llama_kvp_policy & pol, const std::vector<llama_token> & tokens,
                             const kvbench_params & params, kvbench_result & r, llama_context * ctx_lim) {
    const llama_vocab * vocab = llama_model_get_vocab(llama_get_model(ctx));
    const int32_t n_vocab = llama_vocab_n_tokens(vocab);
    const llama_kvp_policy_desc desc = kvbench_describe(pol);
    const bool retains = desc.retains != 0;
    const bool guided  = desc.guides  != 0;
    const bool latent_at_end = desc.rerank_at_end != 0;

    struct llama_kvp_memory_info mi0 = {};
    llama_kvp_memory_info(ctx, &mi0);
    struct llama_kvp_host_stats hs0 = {};
    r.host = llama_kvp_host(ctx, &hs0) == 0;
    struct llama_kvp_summary_stats ss = {};
    r.summarise = llama_kvp_summary(ctx, &ss) == 0;
    llama_kvp_clear_error();
    // the summarise fate's time and bins so far (they restart with the memory)
    auto sum_now = [&](double & ms, double & bins) {
        struct llama_kvp_summary_stats x = {};
        if (r.summarise && llama_kvp_summary(ctx, &x) == 0) {
            ms   = x.t_ms;
            bins = (double) x.n_bins;
        }
    };
    double sum_ms0 = 0.0, sum_bins0 = 0.0;
    // the policy's host time so far, all parts or by part
    struct llama_kvp_perf_data pf = {};
    r.perf = llama_kvp_perf(ctx, &pf) == 0;
    llama_kvp_clear_error();
    auto perf_now = [&](double * parts) {
        struct llama_kvp_perf_data x = {};
        if (r.perf && llama_kvp_perf(ctx, &x) == 0) {
            parts[0] = x.t_prepare_ms;
            parts[1] = x.t_slot_ms;
            parts[2] = x.t_input_ms;
            parts[3] = x.t_settle_ms;
            parts[4] = x.t_wait_ms;
        }
    };
    double perf0[5] = { 0.0, 0.0, 0.0, 0.0, 0.0 };
    double perf1[5] = { 0.0, 0.0, 0.0, 0.0, 0.0 };

    std::vector<double> step_t;   // all decode steps of all repetitions
    std::vector<bool>   step_obs; // whether that step observed
    for (int32_t rep = 0; rep < params.reps; ++rep) {
        if (params.progress) {
            fprintf(stderr, "kvbench: %-28s p=%d n=%d d=%d  rep %d/%d\n", (r.label + kvbench_row_tag(params, r)).c_str(),
                    r.n_prompt, r.n_gen, r.n_depth, rep + 1, params.reps);
        }
        llama_memory_clear(llama_get_memory(ctx), true);
        if (retains && llama_kvp_set_prompt_len(ctx, r.n_depth + r.n_prompt) != 0) {
            throw std::runtime_error(llama_kvp_last_error());
        }
        llama_kvp_reset_peak(ctx); // the peak of this test, not of the set-up
        if (r.n_depth > 0) {
            kvp_tool_prefill(ctx, tokens.data(), r.n_depth, 0, params.n_batch, guided);
        }
        sum_now(sum_ms0, sum_bins0);
        perf_now(perf0);
        if (r.n_prompt > 0) {
            llama_synchronize(ctx);
            const double t0 = kvbench_now();
            const int64_t n_ev0 = latent_at_end ? kvbench_n_evicted(ctx) : 0;
            kvp_tool_prefill(ctx, tokens.data() + r.n_depth, r.n_prompt, r.n_depth, params.n_batch, guided);
            if (latent_at_end && r.n_prompt > 1) {
                const bool pruned = r.n_depth > 0 || kvbench_n_evicted(ctx) > n_ev0;
                kvbench_latent_prompt_end(ctx, tokens.data() + r.n_depth, r.n_prompt, r.n_depth, pruned);
            }
            llama_synchronize(ctx);
            r.pp_ts.push_back(r.n_prompt/(kvbench_now() - t0));
        }
        double sum_ms1 = sum_ms0, sum_bins1 = sum_bins0;
        sum_now(sum_ms1, sum_bins1);
        r.sum_ms_pp += (sum_ms1 - sum_ms0)/params.reps;
        perf_now(perf1);
        for (int32_t k = 0; k < 4; ++k) {
            r.perf_ms_pp += (perf1[k] - perf0[k])/params.reps;
        }
        r.wait_ms_pp += (perf1[4] - perf0[4])/params.reps;
        if (r.n_gen > 0) {
            llama_token tok = r.n_depth + r.n_prompt > 0 ? kvbench_argmax(ctx, n_vocab) : tokens[0];
            // the physical limit: the full cache prefilled (untimed) with as many tokens as the mean layer budget
            int32_t d_lim = -1;
            if (ctx_lim && retains) {
                struct llama_kvp_memory_info mi = {};
                llama_kvp_memory_info(ctx, &mi);
                d_lim = kvbench_limit_depth_of(mi, r.n_depth + r.n_prompt);
                if (d_lim >= 0) {
                    llama_memory_clear(llama_get_memory(ctx_lim), true);
                    kvp_tool_prefill(ctx_lim, tokens.data(), d_lim, 0, params.n_batch, false);
                    llama_synchronize(ctx_lim);
                    r.limit_depth = d_lim;
                    r.limit_n_ctx = (int32_t) llama_n_ctx(ctx_lim);
                }
            }
            llama_batch batch_lim = llama_batch_init(1, 0, 1);
            int32_t n_lim = 0;
            double t_lim = 0.0;
            llama_batch batch = llama_batch_init(1, 0, 1);
            double t_gen = 0.0;
            // the freeze schedule's recovery ladder sees every step's distribution; a Rewalk re-decodes the last
            // `rewalk` steps (counted in the time, not in n_gen)
            const bool ladder = pol.stage[LLAMA_KVP_SLOT_SCHEDULE] == LLAMA_KVP_SCHEDULE_FREEZE && pol.z > 0.0f;
            std::vector<llama_token> fed;
            int32_t n_rewalk = 0;
            const int32_t n_reused0 = llama_perf_context(ctx).n_reused;
            try {
                for (int32_t i = 0; i < r.n_gen; ++i) {
                    fed.push_back(tok);
                    const int32_t n_obs0 = kvbench_n_obs(ctx);
                    const double t0 = kvbench_now();
                    kvbench_step(ctx, batch, tok, r.n_depth + r.n_prompt + i);
                    tok = kvbench_argmax(ctx, n_vocab);
                    int32_t back = -1;
                    if (ladder) {
                        const int32_t lvl = llama_kvp_recover_step(ctx, llama_get_logits_ith(ctx, -1), n_vocab);
                        if (lvl < 0) {
                            throw std::runtime_error(llama_kvp_last_error());
                        }
                        if (lvl > 0) {
                            r.n_recover[lvl - 1]++;
                        }
                        if (lvl == 4 && pol.rewalk > 0 && i >= pol.rewalk && n_rewalk < 16) {
                            back = i - pol.rewalk; // decode step back..i again, from the token fed at step back
                            llama_memory_seq_rm(llama_get_memory(ctx), 0, r.n_depth + r.n_prompt + back, -1);
                            n_rewalk++;
                        }
                    }
                    const double dt = kvbench_now() - t0;
                    t_gen += dt;
                    step_t.push_back(dt);
                    step_obs.push_back(kvbench_n_obs(ctx) > n_obs0);
                    if (d_lim >= 0 && n_lim < r.n_gen) {
                        const double dl = kvbench_step(ctx_lim, batch_lim, tok, d_lim + n_lim);
                        t_lim += dl;
                        r.lim_step_t.push_back(dl);
                        n_lim++;
                    }
                    if (back >= 0) {
                        tok = fed[back];
                        fed.resize(back);
                        i = back - 1;
                    }
                }
            } catch (...) {
                llama_batch_free(batch);
                llama_batch_free(batch_lim);
                throw;
            }
            llama_batch_free(batch);
            llama_batch_free(batch_lim);
            r.n_gen_reused += llama_perf_context(ctx).n_reused - n_reused0;
            r.tg_ts.push_back(r.n_gen/t_gen);
            if (n_lim > 0) {
                r.lim_tg_ts.push_back(n_lim/t_lim);
            }
        }
        double sum_ms2 = sum_ms1, sum_bins2 = sum_bins1;
        sum_now(sum_ms2, sum_bins2);
        r.sum_ms_tg += (sum_ms2 - sum_ms1)/params.reps;
        double perf2[5] = { perf1[0], perf1[1], perf1[2], perf1[3], perf1[4] };
        perf_now(perf2);
        for (int32_t k = 0; k < 4; ++k) {
            r.perf_tg[k] += (perf2[k] - perf1[k])/params.reps;
        }
        r.wait_ms_tg += (perf2[4] - perf1[4])/params.reps;
        r.sum_bins  += (sum_bins2 - sum_bins0)/params.reps;
    }

    // observing steps and the median plain step (the overhead is computed once the full cache has run)
    std::vector<double> plain;
    r.t_gen = 0.0;
    for (size_t i = 0; i < step_t.size(); ++i) {
        r.t_gen += step_t[i];
        if (step_obs[i]) {
            r.t_obs_steps.push_back(step_t[i]);
        } else {
            plain.push_back(step_t[i]);
        }
    }
    r.n_obs_steps = (int32_t) r.t_obs_steps.size();
    r.n_gen_steps = (int32_t) step_t.size();
    if (!plain.empty()) {
        std::nth_element(plain.begin(), plain.begin() + plain.size()/2, plain.end());
        r.t_plain = plain[plain.size()/2];
    }

    // memory, from the buffers
    const int32_t n_layer = llama_kvp_n_layers(ctx);
    std::vector<llama_kvp_layer_stats> stats(std::max(n_layer, 1));
    const int32_t n = llama_kvp_get_layer_stats(ctx, stats.data(), n_layer);
    r.kv_layer_bytes.clear();
    r.kv_layer_cells.clear();
    for (int32_t i = 0; i < n; ++i) {
        r.kv_layer_bytes.push_back(stats[i].k_bytes + stats[i].v_bytes);
        r.kv_layer_cells.push_back(stats[i].n_cells);
    }
    struct llama_kvp_memory_info mi = {};
    llama_kvp_memory_info(ctx, &mi);
    r.kv_bytes      = mi.bytes;
    r.kv_bytes_peak = mi.bytes_peak;
    r.host_bytes_peak = mi.host_bytes_peak; // the host tier's tokens or summarise's pending bins
    r.n_evicted     = (mi.n_evicted - mi0.n_evicted)/params.reps;
    struct llama_kvp_host_stats hs = {};
    if (r.host && llama_kvp_host(ctx, &hs) == 0) {
        r.n_freeze        = (hs.n_freeze  - hs0.n_freeze )/params.reps;
        r.n_host_evict    = (hs.n_evict   - hs0.n_evict  )/params.reps;
        r.n_thaw          = (hs.n_thaw    - hs0.n_thaw   )/params.reps;
        r.n_dropped       = (hs.n_dropped - hs0.n_dropped)/params.reps;
        r.n_rerank        = (hs.n_rerank  - hs0.n_rerank )/params.reps;
        r.n_promote       = (hs.n_promote - hs0.n_promote)/params.reps;
    }
    r.per_layer     = mi.per_layer;
    r.budget        = mi.budget;

    // sparse prefill: share of the key blocks computed (the last repetition's prompt)
    struct llama_kvp_sparse_info si = {};
    if (llama_kvp_sparse_info(ctx, &si) == 0) {
        std::vector<float> counts(3*(size_t) si.n_layer);
        if (llama_kvp_sparse_telemetry(ctx, counts.data(), nullptr, nullptr, nullptr, 0) >= 0) {
            double done = 0.0;
            double vis  = 0.0;
            for (int32_t l = 0; l < si.n_layer; ++l) {
                done += counts[3*l + 0];
                vis  += counts[3*l + 1];
            }
            r.density = vis > 0.0 ? done/vis : 1.0;
        }
    }
    llama_kvp_clear_error();
}

// whether two rows ran with the same KV types, threads, flash attention and offloaded layers (the lists' axes beside
// the sizes): a row's ratios and limit are against the full cache's with the same
static bool kvbench_same_setup(const kvbench_result & a, const kvbench_result & b) {
    return a.type_k == b.type_k && a.type_v == b.type_v && a.n_threads == b.n_threads && a.flash_attn == b.flash_attn &&
           a.n_gpu_layers == b.n_gpu_layers;
}

// the physical limits, one row per (depth, n_gen): every row's limit steps at that depth, pooled
static std::vector<kvbench_result> kvbench_pool_limits(const std::vector<kvbench_result> & rows) {
    std::vector<kvbench_result> limits;
    for (const auto & row : rows) {
        if (row.lim_tg_ts.empty()) {
            continue;
        }
        kvbench_result * l = nullptr;
        for (auto & x : limits) {
            l = (x.n_depth == row.limit_depth && x.n_gen == row.n_gen && x.n_ctx == row.limit_n_ctx &&
                 kvbench_same_setup(x, row)) ? &x : l;
        }
        if (!l) {
            limits.emplace_back();
            l = &limits.back();
            l->policy   = "full";
            l->label    = "limit:d=" + std::to_string(row.limit_depth);
            l->spec     = "full";
            l->n_gen    = row.n_gen;
            l->n_depth  = row.limit_depth;
            l->n_ctx    = row.limit_n_ctx;
            l->type_k   = row.type_k;
            l->type_v   = row.type_v;
            l->n_threads = row.n_threads;
            l->flash_attn = row.flash_attn;
            l->n_gpu_layers = row.n_gpu_layers;
        }
        l->tg_ts.insert(l->tg_ts.end(), row.lim_tg_ts.begin(), row.lim_tg_ts.end());
        l->lim_step_t.insert(l->lim_step_t.end(), row.lim_step_t.begin(), row.lim_step_t.end());
        l->n_gen_steps = (int32_t) l->lim_step_t.size();
    }
    return limits;
}

//
// output
//

template <typename T>
static std::string kvbench_json_list(const std::vector<T> & v) {
    std::ostringstream os;
    os << "[";
    for (size_t i = 0; i < v.size(); ++i) {
        os << (i ? ", " : "") << v[i];
    }
    os << "]";
    return os.str();
}

// a figure that exists only where `ok` (a row with a full-cache reference, a row with a limit), else `none` ("-" in
// tables, null in JSON, empty in CSV)
static std::string kvbench_opt(bool ok, double v, const char * fmt, const char * none) {
    if (!ok) {
        return none;
    }
    char buf[64];
    snprintf(buf, sizeof(buf), fmt, v);
    return buf;
}

// a figure of a test that ran (samples), else `none`: -p 0 or -n 0 measure no prefill or no decode, which is not 0 t/s
static std::string kvbench_fig(const std::vector<double> & samples, double v, const char * fmt, const char * none) {
    return kvbench_opt(!samples.empty(), v, fmt, none);
}

// the policy's host time over a repetition's decode steps (ms)
static double kvbench_perf_tg(const kvbench_result & r) {
    return r.perf_tg[0] + r.perf_tg[1] + r.perf_tg[2] + r.perf_tg[3];
}

// one row as a JSON object: indented over lines (json), or on one line after `head` (jsonl, as llama-bench's);
// null where a figure was not measured (a limit row has no KV bytes, a row without a limit no limit figures)
static void kvbench_print_json_row(const kvbench_result & r, const std::string & head, const char * sep, const char * end) {
    double pp, pp_sd, tg, tg_sd;
    kvbench_mean_sd(r.pp_ts, pp, pp_sd);
    kvbench_mean_sd(r.tg_ts, tg, tg_sd);
    const bool lim = !r.lim_tg_ts.empty();
    const bool mem = !r.kv_layer_bytes.empty();
    printf("{%s\"policy\": %s, \"label\": %s, \"spec\": %s, \"n_prompt\": %d, \"n_gen\": %d, \"n_depth\": %d, \"n_ctx\": %s,"
           " \"type_k\": \"%s\", \"type_v\": \"%s\", \"n_threads\": %d, \"flash_attn\": %s, \"n_gpu_layers\": %d,%s",
            head.c_str(), kvp_tool_json_str(r.policy).c_str(), kvp_tool_json_str(r.label).c_str(), kvp_tool_json_str(r.spec).c_str(),
            r.n_prompt, r.n_gen, r.n_depth, kvbench_opt(r.n_ctx > 0, r.n_ctx, "%.0f", "null").c_str(),
            ggml_type_name(r.type_k), ggml_type_name(r.type_v), r.n_threads, kvbench_fa_json(r.flash_attn), r.n_gpu_layers, sep);
    printf("\"pp_ts\": %s, \"pp_ts_sd\": %s, \"pp_samples\": %s, \"tg_ts\": %s, \"tg_ts_sd\": %s, \"tg_samples\": %s,%s",
            kvbench_fig(r.pp_ts, pp, "%.3f", "null").c_str(), kvbench_fig(r.pp_ts, pp_sd, "%.3f", "null").c_str(),
            kvbench_json_list(r.pp_ts).c_str(), kvbench_fig(r.tg_ts, tg, "%.3f", "null").c_str(),
            kvbench_fig(r.tg_ts, tg_sd, "%.3f", "null").c_str(), kvbench_json_list(r.tg_ts).c_str(), sep);
    printf("\"kv_bytes\": %s, \"kv_bytes_peak\": %s, \"kv_layer_bytes\": %s, \"kv_layer_cells\": %s,%s",
            kvbench_opt(mem, (double) r.kv_bytes, "%.0f", "null").c_str(),
            kvbench_opt(mem, (double) r.kv_bytes_peak, "%.0f", "null").c_str(),
            kvbench_json_list(r.kv_layer_bytes).c_str(), kvbench_json_list(r.kv_layer_cells).c_str(), sep);
    printf("\"n_evicted\": %" PRId64 ", \"obs_overhead\": %s, \"n_obs_steps\": %d, \"n_gen_steps\": %d, \"n_gen_reused\": %d,%s",
            r.n_evicted, kvbench_fig(r.tg_ts, r.obs_overhead, "%.4f", "null").c_str(), r.n_obs_steps, r.n_gen_steps, r.n_gen_reused, sep);
    printf("\"pp_ratio\": %s, \"tg_ratio\": %s, \"kv_ratio\": %s, \"kv_peak_ratio\": %s,%s",
            kvbench_opt(r.has_ref && !r.pp_ts.empty(), r.pp_ratio, "%.4f", "null").c_str(),
            kvbench_opt(r.has_ref && !r.tg_ts.empty(), r.tg_ratio, "%.4f", "null").c_str(),
            kvbench_opt(r.has_ref, r.kv_ratio, "%.4f", "null").c_str(), kvbench_opt(r.has_ref, r.peak_ratio, "%.4f", "null").c_str(), sep);
    printf("\"n_recover\": [%d, %d, %d, %d],%s", r.n_recover[0], r.n_recover[1], r.n_recover[2], r.n_recover[3], sep);
    printf("\"host\": %s, \"host_bytes_peak\": %" PRId64 ", \"n_freeze\": %" PRId64 ", \"n_host_evict\": %" PRId64 ", \"n_thaw\": %" PRId64 ","
           " \"n_dropped\": %" PRId64 ", \"n_rerank\": %" PRId64 ", \"n_promote\": %" PRId64 ",%s",
            r.host ? "true" : "false", r.host_bytes_peak, r.n_freeze, r.n_host_evict, r.n_thaw, r.n_dropped, r.n_rerank, r.n_promote, sep);
    printf("\"sum_bins\": %s, \"sum_ms_pp\": %s, \"sum_ms_tg\": %s,%s",
            kvbench_opt(r.summarise, r.sum_bins, "%.1f", "null").c_str(), kvbench_opt(r.summarise, r.sum_ms_pp, "%.2f", "null").c_str(),
            kvbench_opt(r.summarise, r.sum_ms_tg, "%.2f", "null").c_str(), sep);
    printf("\"host_ms_pp\": %s, \"host_ms_tg\": %s, \"host_ms_tg_parts\": %s, \"host_wait_ms_pp\": %s, \"host_wait_ms_tg\": %s,%s",
            kvbench_opt(r.perf && !r.pp_ts.empty(), r.perf_ms_pp, "%.3f", "null").c_str(),
            kvbench_opt(r.perf && !r.tg_ts.empty(), kvbench_perf_tg(r), "%.3f", "null").c_str(),
            r.perf && !r.tg_ts.empty() ? kvbench_json_list(std::vector<double>(r.perf_tg, r.perf_tg + 4)).c_str() : "null",
            kvbench_opt(r.perf && !r.pp_ts.empty(), r.wait_ms_pp, "%.3f", "null").c_str(),
            kvbench_opt(r.perf && !r.tg_ts.empty(), r.wait_ms_tg, "%.3f", "null").c_str(), sep);
    printf("\"limit_depth\": %s, \"limit_tg_ts\": %s, \"limit_tg_ts_sd\": %s, \"limit_tg_samples\": %s, \"tg_limit_ratio\": %s,"
           " \"density\": %.4f}%s\n",
            kvbench_opt(lim, r.limit_depth, "%.0f", "null").c_str(), kvbench_opt(lim, r.limit_tg_ts, "%.3f", "null").c_str(),
            kvbench_opt(lim, r.limit_tg_ts_sd, "%.3f", "null").c_str(), kvbench_json_list(r.lim_tg_ts).c_str(),
            kvbench_opt(lim, r.tg_limit_ratio, "%.6f", "null").c_str(), r.density, end);
}

// the physical batch size: -ub, at most -b (llama.cpp's rule), else -b
static int32_t kvbench_n_ubatch(const kvbench_params & params) {
    return params.n_ubatch > 0 ? std::min(params.n_ubatch, params.n_batch) : params.n_batch;
}

// limits: the physical limit measurements (full cache at depth B), after the rows
static void kvbench_print(const kvbench_params & params, const std::string & model, const std::vector<kvbench_result> & results,
                          const std::vector<kvbench_result> & limits) {
    char run[4096];
    const std::string rpc = params.rpc.empty() ? "null" : kvp_tool_json_str(params.rpc);
    // jsonl: the run's settings in each row, but those each row has of its own (threads, flash attention, layers)
    snprintf(run, sizeof(run), "\"model\": %s, \"rpc\": %s, \"repetitions\": %d, "
            "\"n_batch\": %d, \"n_ubatch\": %d, \"seed\": %u, \"tokens\": %s, ",
            kvp_tool_json_str(model).c_str(), rpc.c_str(), params.reps,
            params.n_batch, kvbench_n_ubatch(params), params.seed,
            kvp_tool_json_str(params.text_file.empty() ? "random" : params.text_file).c_str());
    if (params.output == "json") {
        printf("{\n  \"model\": %s,\n  \"n_threads\": %d,\n  \"n_gpu_layers\": %d,\n  \"rpc\": %s,\n  \"flash_attn\": %s,\n  \"repetitions\": %d,\n",
                kvp_tool_json_str(model).c_str(), params.n_threads[0], params.n_gpu_layers[0], rpc.c_str(), kvbench_fa_json(params.flash_attn[0]), params.reps);
        printf("  \"n_batch\": %d,\n  \"n_ubatch\": %d,\n  \"seed\": %u,\n  \"tokens\": %s,\n  \"results\": [\n", params.n_batch,
                kvbench_n_ubatch(params), params.seed,
                kvp_tool_json_str(params.text_file.empty() ? "random" : params.text_file).c_str());
        for (size_t i = 0; i < results.size(); ++i) {
            printf("    ");
            kvbench_print_json_row(results[i], "", "\n     ", i + 1 == results.size() ? "" : ",");
        }
        printf("  ],\n  \"limits\": [\n");
        for (size_t i = 0; i < limits.size(); ++i) {
            printf("    ");
            kvbench_print_json_row(limits[i], "", "\n     ", i + 1 == limits.size() ? "" : ",");
        }
        printf("  ]\n}\n");
        return;
    }
    if (params.output == "jsonl") {
        // one object per row, the limits after the rows; the run's settings in each (as llama-bench's jsonl)
        for (const auto & r : results) {
            kvbench_print_json_row(r, run, " ", "");
        }
        for (const auto & l : limits) {
            kvbench_print_json_row(l, run, " ", "");
        }
        return;
    }
    if (params.output == "csv") {
        printf("policy,label,spec,n_prompt,n_gen,n_depth,pp_ts,pp_ts_sd,tg_ts,tg_ts_sd,kv_bytes,kv_bytes_peak,n_evicted,obs_overhead,pp_ratio,tg_ratio,kv_ratio,kv_peak_ratio,"
               "limit_depth,limit_tg_ts,tg_limit_ratio,density,host_bytes_peak,n_freeze,n_host_evict,n_thaw,n_dropped,n_rerank,n_promote,n_ctx,type_k,type_v,sum_bins,sum_ms_pp,sum_ms_tg,host_ms_pp,host_ms_tg,host_wait_ms_pp,host_wait_ms_tg,n_threads,flash_attn,n_gpu_layers\n");
        for (const auto & r : results) {
            double pp, pp_sd, tg, tg_sd;
            kvbench_mean_sd(r.pp_ts, pp, pp_sd);
            kvbench_mean_sd(r.tg_ts, tg, tg_sd);
            const bool lim = !r.lim_tg_ts.empty();
            printf("%s,\"%s\",\"%s\",%d,%d,%d,%s,%s,%s,%s,%" PRId64 ",%" PRId64 ",%" PRId64 ",%s,%s,%s,%s,%s,%s,%s,%s,%.4f,"
                   "%" PRId64 ",%" PRId64 ",%" PRId64 ",%" PRId64 ",%" PRId64 ",%" PRId64 ",%" PRId64 ",%d,%s,%s,%s,%s,%s,%s,%s,%s,%s,%d,%s,%d\n",
                    r.policy.c_str(), r.label.c_str(), r.spec.c_str(), r.n_prompt, r.n_gen, r.n_depth,
                    kvbench_fig(r.pp_ts, pp, "%.3f", "").c_str(), kvbench_fig(r.pp_ts, pp_sd, "%.3f", "").c_str(),
                    kvbench_fig(r.tg_ts, tg, "%.3f", "").c_str(), kvbench_fig(r.tg_ts, tg_sd, "%.3f", "").c_str(),
                    r.kv_bytes, r.kv_bytes_peak, r.n_evicted, kvbench_fig(r.tg_ts, r.obs_overhead, "%.4f", "").c_str(),
                    kvbench_opt(r.has_ref && !r.pp_ts.empty(), r.pp_ratio, "%.4f", "").c_str(),
                    kvbench_opt(r.has_ref && !r.tg_ts.empty(), r.tg_ratio, "%.4f", "").c_str(),
                    kvbench_opt(r.has_ref, r.kv_ratio, "%.4f", "").c_str(), kvbench_opt(r.has_ref, r.peak_ratio, "%.4f", "").c_str(),
                    kvbench_opt(lim, r.limit_depth, "%.0f", "").c_str(), kvbench_opt(lim, r.limit_tg_ts, "%.3f", "").c_str(),
                    kvbench_opt(lim, r.tg_limit_ratio, "%.4f", "").c_str(), r.density,
                    r.host_bytes_peak, r.n_freeze, r.n_host_evict, r.n_thaw, r.n_dropped, r.n_rerank, r.n_promote, r.n_ctx,
                    ggml_type_name(r.type_k), ggml_type_name(r.type_v), kvbench_opt(r.summarise, r.sum_bins, "%.1f", "").c_str(),
                    kvbench_opt(r.summarise, r.sum_ms_pp, "%.2f", "").c_str(), kvbench_opt(r.summarise, r.sum_ms_tg, "%.2f", "").c_str(),
                    kvbench_opt(r.perf && !r.pp_ts.empty(), r.perf_ms_pp, "%.3f", "").c_str(),
                    kvbench_opt(r.perf && !r.tg_ts.empty(), kvbench_perf_tg(r), "%.3f", "").c_str(),
                    kvbench_opt(r.perf && !r.pp_ts.empty(), r.wait_ms_pp, "%.3f", "").c_str(),
                    kvbench_opt(r.perf && !r.tg_ts.empty(), r.wait_ms_tg, "%.3f", "").c_str(), r.n_threads,
                    kvbench_fa_name(r.flash_attn), r.n_gpu_layers);
        }
        return;
    }
    auto label = [&params](const kvbench_result & r) { return r.label + kvbench_row_tag(params, r); };
    std::string n_threads;
    for (int32_t t : params.n_threads) {
        n_threads += (n_threads.empty() ? "" : ",") + std::to_string(t);
    }
    std::string fa_names;
    for (llama_flash_attn_type f : params.flash_attn) {
        fa_names += (fa_names.empty() ? "" : ",") + std::string(kvbench_fa_name(f));
    }
    printf("kvbench: %s, %s threads, n_batch %d, n_ubatch %d, flash attention %s, %d repetitions, tokens: %s\n\n",
            params.model_desc.c_str(), n_threads.c_str(), params.n_batch, kvbench_n_ubatch(params),
            fa_names.c_str(), params.reps,
            params.text_file.empty() ? "random" : params.text_file.c_str());
    printf("| policy | p | n | d | pp t/s | tg t/s | KV MiB | peak MiB | KV x | peak x | pp x | tg x | x limit | obs ovh | density |\n");
    printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (const auto & r : results) {
        double pp, pp_sd, tg, tg_sd;
        kvbench_mean_sd(r.pp_ts, pp, pp_sd);
        kvbench_mean_sd(r.tg_ts, tg, tg_sd);
        char x_limit[32] = "-";
        if (r.tg_limit_ratio > 0.0) {
            snprintf(x_limit, sizeof(x_limit), "%.2f", r.tg_limit_ratio);
        }
        const std::string pp_s = kvbench_fig(r.pp_ts, pp, "%.1f", "-") + (r.pp_ts.empty() ? "" : kvbench_fig(r.pp_ts, pp_sd, " ± %.1f", ""));
        const std::string tg_s = kvbench_fig(r.tg_ts, tg, "%.1f", "-") + (r.tg_ts.empty() ? "" : kvbench_fig(r.tg_ts, tg_sd, " ± %.1f", ""));
        printf("| %s | %d | %d | %d | %s | %s | %.2f | %.2f | %.3f | %.3f | %s | %s | %s | %.1f%% | %.2f |\n",
                label(r).c_str(), r.n_prompt, r.n_gen, r.n_depth, pp_s.c_str(), tg_s.c_str(),
                r.kv_bytes/1048576.0, r.kv_bytes_peak/1048576.0, r.kv_ratio, r.peak_ratio,
                kvbench_fig(r.pp_ts, r.pp_ratio, "%.2f", "-").c_str(), kvbench_fig(r.tg_ts, r.tg_ratio, "%.2f", "-").c_str(),
                x_limit, 100.0*r.obs_overhead, r.density);
    }
    // the references of `x limit`: the full cache decoding at depth B, nothing timed but the decode steps
    for (const auto & l : limits) {
        double tg, tg_sd;
        kvbench_mean_sd(l.tg_ts, tg, tg_sd);
        printf("| %s | %d | %d | %d | - | %.1f ± %.1f | - | - | - | - | - | - | - | - | - |\n",
                label(l).c_str(), l.n_prompt, l.n_gen, l.n_depth, tg, tg_sd);
    }
    // the fate stage's host memory apart (the host tier, summarise's pending bins): its bytes are not in `KV MiB`
    bool any_host = false;
    for (const auto & r : results) {
        any_host = any_host || r.host || r.host_bytes_peak > 0;
    }
    if (any_host) {
        printf("\n| policy | p | n | d | host peak MiB | frozen | evicted to host | thawed | dropped | re-ranks | promoted | ladder S/W/F/R |\n");
        printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
        for (const auto & r : results) {
            if (!r.host) {
                if (r.host_bytes_peak > 0) {
                    printf("| %s | %d | %d | %d | %.2f | - | - | - | - | - | - | - |\n",
                            label(r).c_str(), r.n_prompt, r.n_gen, r.n_depth, r.host_bytes_peak/1048576.0);
                }
                continue;
            }
            printf("| %s | %d | %d | %d | %.2f | %" PRId64 " | %" PRId64 " | %" PRId64 " | %" PRId64 " | %" PRId64 " | %" PRId64 " | %d/%d/%d/%d |\n",
                    label(r).c_str(), r.n_prompt, r.n_gen, r.n_depth, r.host_bytes_peak/1048576.0, r.n_freeze, r.n_host_evict,
                    r.n_thaw, r.n_dropped, r.n_rerank, r.n_promote, r.n_recover[0], r.n_recover[1], r.n_recover[2], r.n_recover[3]);
        }
    }
    // the policy's own host time around the graphs, beside the decode step it is part of
    bool any_perf = false;
    for (const auto & r : results) {
        any_perf = any_perf || r.perf;
    }
    if (any_perf) {
        printf("\n| policy | p | n | d | policy host ms, prompt | per decoded token: ms | prepare | slots | inputs | x step | wait ms, prompt / per token |\n");
        printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
        for (const auto & r : results) {
            if (!r.perf) {
                continue;
            }
            double tg, tg_sd;
            kvbench_mean_sd(r.tg_ts, tg, tg_sd);
            const double n = r.n_gen > 0 ? (double) r.n_gen : 1.0;
            const double per_tok = kvbench_perf_tg(r)/n;
            printf("| %s | %d | %d | %d | %s | %s | %s | %s | %s | %s | %s / %s |\n", label(r).c_str(), r.n_prompt, r.n_gen, r.n_depth,
                    kvbench_fig(r.pp_ts, r.perf_ms_pp, "%.1f", "-").c_str(), kvbench_fig(r.tg_ts, per_tok, "%.3f", "-").c_str(),
                    kvbench_fig(r.tg_ts, r.perf_tg[0]/n, "%.3f", "-").c_str(), kvbench_fig(r.tg_ts, r.perf_tg[1]/n, "%.3f", "-").c_str(),
                    kvbench_fig(r.tg_ts, r.perf_tg[2]/n, "%.3f", "-").c_str(),
                    kvbench_opt(!r.tg_ts.empty() && tg > 0.0, per_tok*tg/1000.0, "%.3f", "-").c_str(),
                    kvbench_fig(r.pp_ts, r.wait_ms_pp, "%.1f", "-").c_str(), kvbench_fig(r.tg_ts, r.wait_ms_tg/n, "%.3f", "-").c_str());
        }
    }
    // summarise's own time on the host: reading leavers, fitting and writing centroids
    bool any_sum = false;
    for (const auto & r : results) {
        any_sum = any_sum || r.summarise;
    }
    if (!any_sum) {
        return;
    }
    printf("\n| policy | p | n | d | bins | summarise ms, prompt | summarise ms per decoded token |\n");
    printf("|---|---:|---:|---:|---:|---:|---:|\n");
    for (const auto & r : results) {
        if (r.summarise) {
            printf("| %s | %d | %d | %d | %.0f | %.1f | %.3f |\n", label(r).c_str(), r.n_prompt, r.n_gen, r.n_depth, r.sum_bins,
                    r.sum_ms_pp, r.n_gen > 0 ? r.sum_ms_tg/r.n_gen : 0.0);
        }
    }
}

static void kvbench_log_none(enum ggml_log_level level, const char * text, void * user_data) {
    (void) level;
    (void) text;
    (void) user_data;
}

// the md table's caption: the model, its size and parameters, the backend (the layers each -ngl offloads)
static std::string kvbench_model_desc(const llama_model * model, const kvbench_params & params, bool offload) {
    char desc[256];
    llama_model_desc(model, desc, sizeof(desc));
    std::string backend = "CPU";
    if (offload && !kvbench_gpu_devices().empty()) {
        backend.clear();
        for (int32_t ngl : params.n_gpu_layers) {
            backend += (backend.empty() ? "" : ",") + std::to_string(std::min(ngl, llama_model_n_layer(model)));
        }
        backend += " layers on";
        for (const auto & name : kvbench_gpu_devices()) {
            backend += " " + name;
        }
    }
    char buf[512];
    snprintf(buf, sizeof(buf), "%s, %.2f MiB, %.1fM params, %s", desc, llama_model_size(model)/1048576.0,
            llama_model_n_params(model)/1e6, backend.c_str());
    return buf;
}

// Ctrl-C (or a kill) during a run: the test in progress stops (its contexts' abort callback), the tests measured before
// it are printed, and kvbench exits 128 + the signal (as a shell reports a process the signal ended)
static volatile std::sig_atomic_t g_kvbench_signal = 0;

static void kvbench_on_signal(int sig) {
    g_kvbench_signal = sig;
}

static bool kvbench_abort(void * data) {
    (void) data;
    return g_kvbench_signal != 0;
}

// the context of test t under policy pol (full: llama.cpp's own cache); nullptr if it cannot be made
static llama_context * kvbench_init_ctx(llama_model * model, const kvbench_params & params, const llama_kvp_policy & pol,
                                        const kvbench_test & t, llama_context_params & cparams) {
    cparams = llama_context_default_params();
    cparams.n_ctx    = kvbench_n_ctx(params, pol, t);
    cparams.n_batch  = params.n_batch;
    cparams.n_ubatch = kvbench_n_ubatch(params);
    cparams.flash_attn_type = t.flash_attn;
    cparams.n_threads       = t.n_threads;
    cparams.n_threads_batch = t.n_threads;
    cparams.type_k          = t.type_k;
    cparams.type_v          = t.type_v;
    cparams.abort_callback  = kvbench_abort;
    if (!kvbench_is_full(pol) && llama_kvp_set_pending(&pol) != 0) {
        return nullptr;
    }
    llama_context * ctx = llama_init_from_model(model, cparams);
    llama_kvp_clear_pending();
    return ctx;
}

static void kvbench_log_quiet(enum ggml_log_level level, const char * text, void * user_data) {
    (void) user_data;
    if (level == GGML_LOG_LEVEL_ERROR && !g_kvbench_signal) { // not llama_decode's lines about the abort it was told
        fputs(text, stderr);
    }
}

// a retention policy's sparse prefill whose layers never hold `threshold` cells runs every prompt dense (the Llama
// warns so too): one line, so that its density column of 1 is not read as a measurement of sparse attention
static void kvbench_say_never_sparse(llama_context * ctx, const std::string & label, const llama_kvp_policy & pol,
                                     const kvbench_test & t) {
    if (pol.stage[LLAMA_KVP_SLOT_PREFILL] != LLAMA_KVP_PREFILL_SPARSE || pol.stage[LLAMA_KVP_SLOT_BUDGET] == LLAMA_KVP_STAGE_NONE) {
        return;
    }
    std::vector<llama_kvp_layer_budget> b(512);
    const int32_t n = llama_kvp_get_budgets(ctx, b.data(), (int32_t) b.size());
    int32_t most = 0;
    for (int32_t i = 0; i < n; ++i) {
        most = std::max(most, b[i].capacity);
    }
    if (n > 0 && most < pol.threshold) {
        fprintf(stderr, "kvbench: %s: its layers hold at most %d cells at p=%d n=%d d=%d, below sparse's threshold=%d: its "
                        "prompts run dense\n", label.c_str(), most, t.n_prompt, t.n_gen, t.n_depth, pol.threshold);
    }
}

int main(int argc, char ** argv) {
    kvbench_params params;
    try {
        if (kvbench_parse_args(argc, argv, params) == 1) {
            kvbench_usage(argv[0]);
            return 0;
        }
    } catch (const std::exception & e) {
        fprintf(stderr, "kvbench: %s\n", e.what());
        return 1;
    }
    if (params.n_threads.empty()) {
        // the machine's hardware threads (llama.h's default of 4 oversubscribes small machines)
        params.n_threads = { (int32_t) std::max(1u, std::thread::hardware_concurrency()) };
    }
    if (params.policies.empty()) {
        params.policies = { "full", "sink_recent", "snapkv:budget=0.25", "h2o:budget=0.25", "pyramid:budget=0.25", "entropy:budget=0.25" };
    }

    // the policies, full first
    struct kvbench_policy { std::string label; std::string spec; llama_kvp_policy pol; };
    std::vector<kvbench_policy> pols;
    try {
        bool has_full = false;
        for (const auto & s : params.policies) {
            llama_kvp_policy p = {};
            const std::string spec = kvbench_spec(s, p);
            has_full = has_full || kvbench_is_full(p);
            pols.push_back({ kvbench_is_full(p) ? "full" : s, spec, p });
        }
        if (!has_full) {
            pols.insert(pols.begin(), { "full", "full", llama_kvp_policy_default(LLAMA_KVP_POLICY_NONE) });
        }
        std::stable_partition(pols.begin(), pols.end(), [](const auto & x) { return kvbench_is_full(x.pol); });
    } catch (const std::exception & e) {
        fprintf(stderr, "kvbench: %s\n", e.what());
        return 1;
    }

    if (params.model.empty()) {
        params.model = kvbench_default_model();
        if (params.model.empty()) {
            fprintf(stderr, "kvbench: no model given and the embedded default was not found: pass -m MODEL, set "
                            "PYKVCACHE_MODEL, or install pykvcache with its model package (bash scripts/setup.sh)\n");
            return 1;
        }
    }
    if (const std::string err = kvp_tool_model_error(params.model); !err.empty()) {
        fprintf(stderr, "kvbench: %s\n", err.c_str());
        return 1;
    }

    if (!params.verbose) {
        llama_log_set(kvbench_log_quiet, nullptr);
    }
    llama_backend_init();

    // the tests, as llama-bench's instances: every (depth, prompt, gen), each in a context of its own size; checked
    // before any model loads
    const bool offload = *std::max_element(params.n_gpu_layers.begin(), params.n_gpu_layers.end()) > 0;
    std::vector<kvbench_test> tests;
    int32_t n_need = 0;
    const size_t n_tests_max = 100000;
    const double n_tests = (double) params.n_depth.size()*(params.n_prompt.size()*params.n_gen.size() + params.n_pg.size())*
                           params.type_k.size()*params.type_v.size()*params.n_threads.size()*params.flash_attn.size()*
                           params.n_gpu_layers.size(); // at most: -pg pairs among -p x -n run once
    if (n_tests > n_tests_max) {
        fprintf(stderr, "kvbench: the lists make %.0f tests (-d x (-p x -n, -pg) x -ctk x -ctv x -t x -fa x -ngl), more than %zu\n", n_tests, n_tests_max);
        return 1;
    }
    std::vector<std::pair<int32_t, int32_t>> pgs; // (prompt, gen): every -p with every -n, then the -pg pairs not among them
    for (int32_t p : params.n_prompt) {
        for (int32_t g : params.n_gen) {
            pgs.emplace_back(p, g);
        }
    }
    for (const auto & pg : params.n_pg) {
        if (std::find(pgs.begin(), pgs.end(), pg) == pgs.end()) {
            pgs.push_back(pg);
        }
    }
    for (int32_t d : params.n_depth) {
        for (const auto & pg : pgs) {
            const int32_t p = pg.first;
            const int32_t g = pg.second;
            if (p == 0 && g == 0) {
                continue; // measures nothing (llama-bench's lists hold such pairs too); none left is an error below
            }
            if ((int64_t) d + p + g > (1 << 30)) {
                fprintf(stderr, "kvbench: depth + prompt + gen (%" PRId64 ") is too large\n", (int64_t) d + p + g);
                return 1;
            }
            if (params.n_ctx > 0 && d + p + g > params.n_ctx) {
                fprintf(stderr, "kvbench: depth + prompt + gen (%d) exceeds the context size (-c %d)\n", d + p + g, params.n_ctx);
                return 1;
            }
            for (ggml_type tk : params.type_k) {
                for (ggml_type tv : params.type_v) {
                    for (int32_t nt : params.n_threads) {
                        for (llama_flash_attn_type fa : params.flash_attn) {
                            for (size_t im = 0; im < params.n_gpu_layers.size(); ++im) {
                                tests.push_back({ d, p, g, tk, tv, nt, fa, params.n_gpu_layers[im], im });
                            }
                        }
                    }
                }
            }
            n_need = std::max(n_need, d + p + g);
        }
    }
    if (tests.empty()) {
        fprintf(stderr, "kvbench: -p 0 with -n 0 measures nothing (every test has neither a prompt nor generated tokens)\n");
        return 1;
    }
    if (offload && kvbench_gpu_devices().empty()) {
        // llama_supports_gpu_offload() is true in every build with the RPC backend, servers or not
        fprintf(stderr, "kvbench: warning: no GPU device and no RPC server (-rpc), -ngl offloads nothing\n");
    }
    const bool fa_off = std::find(params.flash_attn.begin(), params.flash_attn.end(), LLAMA_FLASH_ATTN_TYPE_DISABLED) != params.flash_attn.end();
    for (ggml_type tv : params.type_v) {
        if (ggml_is_quantized(tv) && fa_off) {
            fprintf(stderr, "kvbench: -ctv %s: a quantized V cache needs flash attention (-fa on)\n", ggml_type_name(tv));
            return 1;
        }
    }
    if (fa_off) {
        for (const auto & kp : pols) {
            if (kvbench_describe(kp.pol).sparse) {
                fprintf(stderr, "kvbench: warning: %s: sparse prefill needs flash attention, with -fa off its prompts run dense\n", kp.label.c_str());
            }
        }
    }

    // the model loaded once per -ngl value, in turn (as llama-bench: one at a time), its tests run before the next
    std::vector<llama_token>    tokens;
    std::vector<kvbench_result> results;
    int rc = 0;
    std::signal(SIGINT,  kvbench_on_signal);
    std::signal(SIGTERM, kvbench_on_signal);
    for (size_t im = 0; im < params.n_gpu_layers.size() && rc == 0; ++im) {
        llama_model_params mparams = llama_model_default_params();
        mparams.n_gpu_layers = params.n_gpu_layers[im];
        kvbench_model model(llama_model_load_from_file(params.model.c_str(), mparams));
        if (!model.ptr) {
            fprintf(stderr, "kvbench: failed to load the model %s\n", params.model.c_str());
            rc = 1;
            break;
        }
        if (im == 0) {
            params.model_desc = kvbench_model_desc(model.ptr, params, offload);
            try {
                tokens = kvp_tool_tokens(llama_model_get_vocab(model.ptr), params.text, params.text_file, params.seed, (size_t) n_need + 1);
            } catch (const std::exception & e) {
                fprintf(stderr, "kvbench: %s\n", e.what());
                return 1;
            }
        }
        std::vector<size_t> its; // this model's tests
        for (size_t it = 0; it < tests.size(); ++it) {
            if (tests[it].i_model == im) {
                its.push_back(it);
            }
        }
        // every policy's context of every test made once first, so that what the model or the context refuses (a
        // rank above the head size, a bin that never fills) is one line before any test runs, not after the full
        // cache's (with several -ngl: before the tests of that model)
        for (const auto & kp : pols) {
            for (size_t it : its) {
                if (kvbench_is_full(kp.pol) || rc != 0) {
                    continue;
                }
                llama_context_params cparams;
                if (!params.verbose) {
                    llama_log_set(kvbench_log_none, nullptr);
                }
                llama_context * ctx = kvbench_init_ctx(model.ptr, params, kp.pol, tests[it], cparams);
                if (!params.verbose) {
                    llama_log_set(kvbench_log_quiet, nullptr);
                }
                if (!ctx) {
                    fprintf(stderr, "kvbench: %s: cannot create the context (n_ctx %u): %s\n", kp.label.c_str(), cparams.n_ctx,
                            llama_kvp_last_error());
                    rc = 1;
                    continue;
                }
                kvbench_say_never_sparse(ctx, kp.label, kp.pol, tests[it]);
                llama_free(ctx);
            }
        }
        std::vector<llama_context *> ctx_lims(tests.size(), nullptr); // the full cache's context of each test, kept for the limits
        for (size_t ip = 0; ip < pols.size() && rc == 0; ++ip) {
            const auto & kp = pols[ip];
            const std::string     & name = kp.label;
            const llama_kvp_policy & pol = kp.pol;
            const bool full = kvbench_is_full(pol);
            for (size_t it : its) {
                const kvbench_test & t = tests[it];
                llama_context_params cparams;
                llama_context * ctx = kvbench_init_ctx(model.ptr, params, pol, t, cparams);
                if (!ctx) {
                    fprintf(stderr, "kvbench: %s: cannot create the context (n_ctx %u): %s\n", name.c_str(), cparams.n_ctx,
                            llama_kvp_last_error());
                    rc = 1;
                    break;
                }
                kvbench_result r;
                r.policy   = kp.spec.substr(0, kp.spec.find(':'));
                r.label    = kp.label;
                r.spec     = kp.spec;
                r.n_prompt = t.n_prompt;
                r.n_gen    = t.n_gen;
                r.n_depth  = t.n_depth;
                r.n_ctx    = (int32_t) cparams.n_ctx;
                r.type_k   = t.type_k;
                r.type_v   = t.type_v;
                r.n_threads = t.n_threads;
                r.flash_attn = t.flash_attn;
                r.n_gpu_layers = t.n_gpu_layers;
                try {
                    kvbench_run_test(ctx, pol, tokens, params, r, full ? nullptr : ctx_lims[it]);
                    results.push_back(std::move(r));
                } catch (const std::exception & e) {
                    if (!g_kvbench_signal) {
                        fprintf(stderr, "kvbench: %s: %s\n", name.c_str(), e.what());
                    }
                    rc = 1;
                }
                if (g_kvbench_signal) {
                    rc = 128 + g_kvbench_signal;
                }
                if (rc == 0 && params.limit && full && !ctx_lims[it]) {
                    ctx_lims[it] = ctx;
                } else {
                    llama_free(ctx);
                }
                if (rc != 0) {
                    break;
                }
            }
        }
        for (llama_context * ctx : ctx_lims) {
            if (ctx) {
                llama_free(ctx);
            }
        }
    }
    if (g_kvbench_signal) {
        rc = 128 + g_kvbench_signal;
        fprintf(stderr, "kvbench: interrupted%s\n", results.empty() ? "" :
                (", the " + std::to_string(results.size()) + " test(s) measured before it follow").c_str());
        if (results.empty()) {
            return rc;
        }
    } else if (rc != 0) {
        if (results.empty()) {
            return rc;
        }
        fprintf(stderr, "kvbench: the %zu test(s) measured before the failure follow\n", results.size());
    }

    // ratios to full at the same configuration
    for (auto & r : results) {
        for (const auto & f : results) {
            if (f.policy != "full" || f.n_prompt != r.n_prompt || f.n_gen != r.n_gen || f.n_depth != r.n_depth ||
                !kvbench_same_setup(f, r)) {
                continue;
            }
            double a, b, sd;
            kvbench_mean_sd(r.pp_ts, a, sd);
            kvbench_mean_sd(f.pp_ts, b, sd);
            r.has_ref  = true;
            r.pp_ratio = b > 0 ? a/b : 0.0;
            kvbench_mean_sd(r.tg_ts, a, sd);
            kvbench_mean_sd(f.tg_ts, b, sd);
            r.tg_ratio   = b > 0 ? a/b : 0.0;
            r.kv_ratio   = f.kv_bytes > 0 ? (double) r.kv_bytes/f.kv_bytes : 0.0;
            r.peak_ratio = f.kv_bytes_peak > 0 ? (double) r.kv_bytes_peak/f.kv_bytes_peak : 0.0;
            // a policy that observes every step has no plain step of its own: the full cache's is the reference
            const double t_ref = r.t_plain > 0.0 ? r.t_plain : f.t_plain;
            double extra = 0.0;
            for (double t : r.t_obs_steps) {
                extra += std::max(0.0, t - t_ref);
            }
            r.obs_overhead = r.t_gen > 0.0 ? extra/r.t_gen : 0.0;
            break;
        }
    }
    // ratios to the physical limit (the full cache at depth B, its steps alternating with the row's)
    for (auto & r : results) {
        if (r.lim_tg_ts.empty()) {
            r.limit_depth = 0;
            continue;
        }
        double tg, sd;
        kvbench_mean_sd(r.tg_ts, tg, sd);
        kvbench_mean_sd(r.lim_tg_ts, r.limit_tg_ts, r.limit_tg_ts_sd);
        r.tg_limit_ratio = r.limit_tg_ts > 0 ? tg/r.limit_tg_ts : 0.0;
        // a policy that observes every step: its overhead is the share of its decode time beyond the limit's steps,
        // taken at the same moments (mean step against mean step: a step that rewalks adds to the policy's count)
        double t_lim = 0.0;
        for (double t : r.lim_step_t) {
            t_lim += t;
        }
        const size_t n_steps = r.t_obs_steps.size();
        if (r.t_plain <= 0.0 && t_lim > 0.0 && n_steps > 0 && r.t_gen > 0.0) {
            const double mean_lim = t_lim/r.lim_step_t.size();
            const double mean_obs = r.t_gen/n_steps;
            r.obs_overhead = std::max(0.0, 1.0 - mean_lim/mean_obs);
        }
    }
    const std::vector<kvbench_result> limits = kvbench_pool_limits(results);
    kvbench_print(params, params.model, results, limits);
    if (fflush(stdout) != 0 || ferror(stdout)) { // a full disk or a closed pipe: the results are not where asked
        fprintf(stderr, "kvbench: writing the results failed: %s\n", strerror(errno));
        return 1;
    }
    return rc;
}
