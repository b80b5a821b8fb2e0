// sparse-attn-perf - times GGML_OP_SPARSE_ATTN_EXT against ggml_flash_attn_ext on one prompt ubatch's shape, on
// every backend that runs it (the CPU, and a GPU where there is one), in the spirit of test-backend-ops' perf mode.
//
// The shape is the last ubatch of a long prompt: n_q queries at positions n_kv - n_q .. n_kv - 1 under a causal mask,
// K/V of n_kv cells. Per (query block, head) the lists hold the sink block, the query block's own (diagonal) blocks
// and the one before, then random visible blocks until `density` of the visible blocks are listed; density 1 lists
// every visible block. Times are medians over repetitions of one graph with the node alone.
//
//     sparse-attn-perf --n-kv 8192 --n-q 512 --density 0.1,0.2,0.3,1

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-sparse-attn.h"

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

struct perf_params {
    int64_t             n_kv      = 8192;
    int64_t             n_q       = 512;
    int64_t             n_head    = 9;
    int64_t             n_head_kv = 3;
    int64_t             D         = 64;
    int64_t             block     = 32; // the sparse stage's default segment and block
    ggml_type           type      = GGML_TYPE_F16;
    std::vector<double> density   = { 0.1, 0.2, 0.3, 1.0 };
    int                 reps      = 5;
    int                 n_threads = 0;
};

static void print_usage(const char * argv0) {
    printf("usage: %s [options]\n\n", argv0);
    printf("Times GGML_OP_SPARSE_ATTN_EXT against ggml_flash_attn_ext on the last ubatch of a long prompt, on every\n");
    printf("backend that runs it. Prints a markdown table: ms per call (median), listed density, speed-up over flash.\n\n");
    printf("options:\n");
    printf("  --n-kv N            cells of K/V (the prompt depth at the end of the ubatch; default 8192)\n");
    printf("  --n-q N             queries of the ubatch (default 512)\n");
    printf("  --heads H/HKV       query heads / KV heads (default 9/3, SmolLM2-135M)\n");
    printf("  --head-size D       head size (default 64)\n");
    printf("  --block B           query and key block (default 32, the sparse stage's segment and block)\n");
    printf("  --type T            K/V type: f16, q8_0, q4_0, f32 (default f16)\n");
    printf("  --density D[,D..]   listed fraction of the visible blocks (default 0.1,0.2,0.3,1)\n");
    printf("  -r, --reps N        repetitions (default 5)\n");
    printf("  -t, --threads N     CPU threads (default: hardware threads)\n");
    printf("  -h, --help          show this help and exit\n");
}

static long perf_int(const std::string & arg, const char * value, long lo, long hi) {
    if (!value) {
        throw std::invalid_argument(arg + " needs a value");
    }
    char * end = nullptr;
    const long v = strtol(value, &end, 10);
    if (end == value || *end != '\0' || v < lo || v > hi) {
        throw std::invalid_argument(arg + ": expected an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got '" + value + "'");
    }
    return v;
}

static int perf_parse(int argc, char ** argv, perf_params & p) {
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        const char * value = i + 1 < argc ? argv[i + 1] : nullptr;
        if (arg == "-h" || arg == "--help") {
            return 1;
        } else if (arg == "--n-kv") {
            p.n_kv = perf_int(arg, value, 1, 1 << 20); ++i;
        } else if (arg == "--n-q") {
            p.n_q = perf_int(arg, value, 1, 1 << 16); ++i;
        } else if (arg == "--heads") {
            if (!value || sscanf(value, "%" SCNd64 "/%" SCNd64, &p.n_head, &p.n_head_kv) != 2 || p.n_head < 1 ||
                p.n_head_kv < 1 || p.n_head % p.n_head_kv != 0) {
                throw std::invalid_argument("--heads: expected H/HKV with HKV dividing H, e.g. 9/3");
            }
            ++i;
        } else if (arg == "--head-size") {
            p.D = perf_int(arg, value, 32, 256); ++i;
        } else if (arg == "--block") {
            p.block = perf_int(arg, value, 16, 256); ++i;
        } else if (arg == "--type") {
            const std::string t = value ? value : "";
            if      (t == "f16")  { p.type = GGML_TYPE_F16;  }
            else if (t == "f32")  { p.type = GGML_TYPE_F32;  }
            else if (t == "q8_0") { p.type = GGML_TYPE_Q8_0; }
            else if (t == "q4_0") { p.type = GGML_TYPE_Q4_0; }
            else { throw std::invalid_argument("--type: expected f16, f32, q8_0 or q4_0, got '" + t + "'"); }
            ++i;
        } else if (arg == "--density") {
            if (!value) {
                throw std::invalid_argument("--density needs a value");
            }
            p.density.clear();
            std::stringstream ss(value);
            std::string item;
            while (std::getline(ss, item, ',')) {
                char * end = nullptr;
                const double d = strtod(item.c_str(), &end);
                if (end == item.c_str() || *end != '\0' || !(d > 0.0 && d <= 1.0)) {
                    throw std::invalid_argument("--density: expected values in (0, 1], got '" + item + "'");
                }
                p.density.push_back(d);
            }
            ++i;
        } else if (arg == "-r" || arg == "--reps") {
            p.reps = (int) perf_int(arg, value, 1, 1000); ++i;
        } else if (arg == "-t" || arg == "--threads") {
            p.n_threads = (int) perf_int(arg, value, 1, 512); ++i;
        } else {
            throw std::invalid_argument("unknown argument: " + arg + " (see --help)");
        }
    }
    if (p.n_q > p.n_kv) {
        throw std::invalid_argument("--n-q must not exceed --n-kv");
    }
    return 0;
}

// lists per (query block, head): sink, diagonal and previous block, then random visible blocks up to the density
static void perf_lists(const perf_params & p, double density, std::mt19937_64 & rng,
                       std::vector<int32_t> & blocks, std::vector<int32_t> & counts, int64_t & n_list, double & listed) {
    const int64_t n_qb = (p.n_q + p.block - 1)/p.block;
    const int64_t n_kb = (p.n_kv + p.block - 1)/p.block;
    const int64_t q_pos0 = p.n_kv - p.n_q;
    n_list = n_kb;
    blocks.assign(n_list*n_qb*p.n_head, 0);
    counts.assign(n_qb*p.n_head, 0);
    int64_t n_listed = 0, n_visible = 0;
    for (int64_t h = 0; h < p.n_head; ++h) {
        for (int64_t iqb = 0; iqb < n_qb; ++iqb) {
            const int64_t last = std::min(q_pos0 + (iqb + 1)*p.block, p.n_kv) - 1; // last position of the query block
            const int64_t n_vis = last/p.block + 1;                             // blocks 0 .. n_vis-1 are visible
            const int64_t want  = std::max<int64_t>(1, std::min<int64_t>(n_vis, (int64_t) std::ceil(density*n_vis)));
            std::vector<int32_t> order;
            std::vector<char>    used(n_vis, 0);
            auto take = [&](int64_t b) {
                if (b >= 0 && b < n_vis && !used[b] && (int64_t) order.size() < want) {
                    used[b] = 1;
                    order.push_back((int32_t) b);
                }
            };
            take(0);
            take(n_vis - 1);
            take((q_pos0 + iqb*p.block)/p.block);
            take((q_pos0 + iqb*p.block)/p.block - 1);
            std::vector<int32_t> rest;
            for (int64_t b = 0; b < n_vis; ++b) {
                if (!used[b]) { rest.push_back((int32_t) b); }
            }
            std::shuffle(rest.begin(), rest.end(), rng);
            for (int32_t b : rest) { take(b); }
            int32_t * dst = blocks.data() + (h*n_qb + iqb)*n_list;
            std::copy(order.begin(), order.end(), dst);
            counts[h*n_qb + iqb] = (int32_t) order.size();
            n_listed  += (int64_t) order.size();
            n_visible += n_vis;
        }
    }
    listed = (double) n_listed/(double) n_visible;
}

static double perf_time(ggml_backend_t backend, ggml_cgraph * gf, int reps) {
    ggml_backend_graph_compute(backend, gf); // warm-up
    std::vector<double> t;
    for (int r = 0; r < reps; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        ggml_backend_graph_compute(backend, gf);
        ggml_backend_synchronize(backend);
        t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(t.begin(), t.end());
    return t[t.size()/2];
}

static void perf_backend(ggml_backend_t backend, const std::string & name, const perf_params & p) {
    const int64_t n_qb = (p.n_q + p.block - 1)/p.block;
    const int64_t n_kb = (p.n_kv + p.block - 1)/p.block;
    const size_t n_nodes = 4 + 3*p.density.size();

    ggml_init_params ip = { ggml_tensor_overhead()*(8 + 4*n_nodes) + ggml_graph_overhead()*(1 + n_nodes), nullptr, true };
    ggml_context * ctx = ggml_init(ip);

    ggml_tensor * q    = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, p.D, p.n_q, p.n_head);
    ggml_tensor * k    = ggml_new_tensor_3d(ctx, p.type, p.D, p.n_kv, p.n_head_kv);
    ggml_tensor * v    = ggml_new_tensor_3d(ctx, p.type, p.D, p.n_kv, p.n_head_kv);
    ggml_tensor * mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, p.n_kv, GGML_PAD(p.n_q, 64));
    const float scale = 1.0f/std::sqrt((float) p.D);

    ggml_tensor * fa = ggml_flash_attn_ext(ctx, q, k, v, mask, scale, 0.0f, 0.0f);
    ggml_prec_set_acc(fa, GGML_PREC_F32);
    if (!ggml_backend_supports_op(backend, fa)) {
        printf("| %s | flash attention not supported for %s | | | |\n", name.c_str(), ggml_type_name(p.type));
        ggml_free(ctx);
        return;
    }
    std::vector<ggml_tensor *> blocks_t, counts_t, sp;
    for (size_t i = 0; i < p.density.size(); ++i) {
        blocks_t.push_back(ggml_new_tensor_3d(ctx, GGML_TYPE_I32, n_kb, n_qb, p.n_head));
        counts_t.push_back(ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_qb, p.n_head));
        sp.push_back(ggml_sparse_attn_ext(ctx, q, k, v, mask, blocks_t[i], counts_t[i], scale, 0.0f, 0.0f, (int32_t) p.block, (int32_t) p.block));
        if (!ggml_backend_supports_op(backend, sp[i])) {
            printf("| %s | sparse attention not supported for %s | | | |\n", name.c_str(), ggml_type_name(p.type));
            ggml_free(ctx);
            return;
        }
    }
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);

    // data: random Q, K, V; causal mask for queries at the end of the context
    std::mt19937_64 rng(42);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> qd(ggml_nelements(q));
    for (float & x : qd) { x = nd(rng); }
    ggml_backend_tensor_set(q, qd.data(), 0, ggml_nbytes(q));
    std::vector<float> kvf(p.D*p.n_kv*p.n_head_kv);
    std::vector<uint8_t> raw(ggml_nbytes(k));
    for (ggml_tensor * t : { k, v }) {
        for (float & x : kvf) { x = nd(rng); }
        ggml_quantize_chunk(p.type, kvf.data(), raw.data(), 0, p.n_kv*p.n_head_kv, p.D, nullptr);
        ggml_backend_tensor_set(t, raw.data(), 0, ggml_nbytes(t));
    }
    std::vector<ggml_fp16_t> md(ggml_nelements(mask));
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), ninf = ggml_fp32_to_fp16(-INFINITY);
    for (int64_t r = 0; r < mask->ne[1]; ++r) {
        const int64_t pos = p.n_kv - p.n_q + r;
        for (int64_t c = 0; c < p.n_kv; ++c) {
            md[r*p.n_kv + c] = (r < p.n_q && c <= pos) ? zero : ninf;
        }
    }
    ggml_backend_tensor_set(mask, md.data(), 0, ggml_nbytes(mask));

    auto one = [&](ggml_tensor * node) {
        ggml_cgraph * gf = ggml_new_graph(ctx);
        ggml_build_forward_expand(gf, node);
        return perf_time(backend, gf, p.reps);
    };
    const double t_fa = one(fa);
    printf("| %s | flash_attn_ext | 1.000 | %.2f | 1.00 |\n", name.c_str(), t_fa);
    for (size_t i = 0; i < p.density.size(); ++i) {
        std::vector<int32_t> bl, cn;
        int64_t n_list = 0;
        double listed = 0.0;
        perf_lists(p, p.density[i], rng, bl, cn, n_list, listed);
        ggml_backend_tensor_set(blocks_t[i], bl.data(), 0, ggml_nbytes(blocks_t[i]));
        ggml_backend_tensor_set(counts_t[i], cn.data(), 0, ggml_nbytes(counts_t[i]));
        const double t = one(sp[i]);
        printf("| %s | sparse_attn_ext | %.3f | %.2f | %.2f |\n", name.c_str(), listed, t, t_fa/t);
    }
    fflush(stdout);
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
}

int main(int argc, char ** argv) {
    perf_params p;
    try {
        if (perf_parse(argc, argv, p) == 1) {
            print_usage(argv[0]);
            return 0;
        }
    } catch (const std::exception & e) {
        fprintf(stderr, "sparse-attn-perf: error: %s\n", e.what());
        return 2;
    }
    ggml_log_set([](ggml_log_level, const char *, void *) {}, nullptr);

    printf("n_q=%lld n_kv=%lld heads=%lld/%lld D=%lld block=%lld type=%s reps=%d\n\n", (long long) p.n_q, (long long) p.n_kv,
           (long long) p.n_head, (long long) p.n_head_kv, (long long) p.D, (long long) p.block, ggml_type_name(p.type), p.reps);
    printf("| backend | op | listed density | ms | x flash |\n|---|---|---:|---:|---:|\n");
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        ggml_backend_t backend = ggml_backend_dev_init(dev, nullptr);
        if (!backend) {
            continue;
        }
        std::string name = ggml_backend_dev_name(dev);
        if (ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU) {
            ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
            auto set_n = reg ? (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads") : nullptr;
            const int nt = p.n_threads > 0 ? p.n_threads : (int) std::max(1u, std::thread::hardware_concurrency());
            if (set_n) {
                set_n(backend, nt);
            }
            name += " (" + std::to_string(nt) + " threads)";
        }
        perf_backend(backend, name, p);
        ggml_backend_free(backend);
    }
    return 0;
}
