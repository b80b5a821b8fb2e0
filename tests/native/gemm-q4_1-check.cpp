// gemm-q4_1-check - checks the tiled Q4_1 matmul of prompt ubatches (native/kernels/gemm-q4_1-cpu.cpp) against
// ggml's own one-pair dot product.
//
// Every case draws a random shape (weight rows m, columns n >= 2, k = 32 x blocks; the edges of the 4 x 3 tiles
// included) and random data from a fixed seed, quantizes the weights to Q4_1, and runs GGML_OP_MUL_MAT on the CPU
// backend with a random thread count: with n >= 2 columns it goes through llamafile_sgemm, i.e. the tiled kernel.
// The reference is computed on the host with the type traits' own functions, as the stock path would: each column
// quantized by Q8_1's from_float, then Q4_1's vec_dot for every (row, column). The two must agree bit for bit.
// The kernel's call counter (ggml_gemm_q4_1_calls) tells whether the matmul really went through it: "kernel_calls"
// gives the calls made while the graph ran ("mul_mat") and while the reference was computed ("reference", 0), and
// "cases_in_kernel" the cases whose matmul entered it; where the kernel is available, a case that did not is a failure.
// With --bench it times the matmul on SmolLM2-135M's shapes instead (run it with GGML_CPU_TILED_MM=0 for the
// stock path; "calls" counts the kernel's calls). One JSON object goes to stdout; the exit code is 1 if any case
// differs or missed the kernel.
//
//     gemm-q4_1-check --cases 40 --seed 1

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml-gemm-q4_1.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

struct check_params {
    int      n_cases   = 40;
    uint64_t seed      = 1;
    int      n_threads = 2;
    bool     bench     = false;
};

static void print_usage(const char * argv0) {
    printf("usage: %s [options]\n\n", argv0);
    printf("Checks the tiled Q4_1 x Q8_1 matmul of prompt ubatches against ggml's vec_dot, bit for bit, on random\n");
    printf("shapes. Prints one JSON object on stdout; exits with 1 if any case differs.\n\n");
    printf("options:\n");
    printf("  --cases N      number of random cases (default 40)\n");
    printf("  --seed S       seed of the case generator (default 1)\n");
    printf("  --threads T    at most T CPU threads per case, drawn per case (default 2)\n");
    printf("  --bench        time MUL_MAT on SmolLM2-135M's shapes (512 columns) instead; compare with\n");
    printf("                 GGML_CPU_TILED_MM=0, the stock path\n");
    printf("  -h, --help     show this help and exit\n");
}

static long parse_int(const std::string & arg, const char * value, long lo, long hi) {
    if (!value) {
        throw std::invalid_argument(arg + " needs a value");
    }
    char * end = nullptr;
    const long v = strtol(value, &end, 10);
    if (end == value || *end != '\0' || v < lo || v > hi) {
        throw std::invalid_argument(arg + " must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                                    "] (got '" + value + "')");
    }
    return v;
}

// 0: run, 1: help
static int parse_args(int argc, char ** argv, check_params & p) {
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        const char * next = i + 1 < argc ? argv[i + 1] : nullptr;
        if (arg == "-h" || arg == "--help") {
            return 1;
        } else if (arg == "--cases") {
            p.n_cases = (int) parse_int(arg, next, 1, 100000); ++i;
        } else if (arg == "--seed") {
            p.seed = (uint64_t) parse_int(arg, next, 0, 1L << 40); ++i;
        } else if (arg == "--threads") {
            p.n_threads = (int) parse_int(arg, next, 1, 256); ++i;
        } else if (arg == "--bench") {
            p.bench = true;
        } else {
            throw std::invalid_argument("unknown argument '" + arg + "' (see --help)");
        }
    }
    return 0;
}

static void quiet_log(enum ggml_log_level level, const char * text, void * user_data) {
    (void) user_data;
    if (level >= GGML_LOG_LEVEL_WARN) {
        fputs(text, stderr);
    }
}

// W (m x k, Q4_1) times X (k x n, F32) on the CPU backend; the result is n columns of m floats
struct mul_mat_graph {
    ggml_context *        ctx    = nullptr;
    ggml_backend_buffer_t buf    = nullptr;
    ggml_cgraph *         graph  = nullptr;
    ggml_tensor *         w      = nullptr;
    ggml_tensor *         x      = nullptr;
    ggml_tensor *         out    = nullptr;

    mul_mat_graph(ggml_backend_t cpu, int64_t m, int64_t n, int64_t k) {
        ggml_init_params ip = { ggml_tensor_overhead()*8 + ggml_graph_overhead(), nullptr, true };
        ctx   = ggml_init(ip);
        w     = ggml_new_tensor_2d(ctx, GGML_TYPE_Q4_1, k, m);
        x     = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, n);
        out   = ggml_mul_mat(ctx, w, x);
        graph = ggml_new_graph(ctx);
        ggml_build_forward_expand(graph, out);
        buf   = ggml_backend_alloc_ctx_tensors(ctx, cpu);
    }
    ~mul_mat_graph() {
        ggml_backend_buffer_free(buf);
        ggml_free(ctx);
    }
};

static std::vector<uint8_t> quantize_q4_1(const std::vector<float> & f, int64_t m, int64_t k) {
    std::vector<uint8_t> q(ggml_row_size(GGML_TYPE_Q4_1, k)*m);
    ggml_quantize_chunk(GGML_TYPE_Q4_1, f.data(), q.data(), 0, m, k, nullptr);
    return q;
}

static int run_bench(ggml_backend_t cpu, const check_params & p) {
    struct shape { const char * name; int64_t m, k; };
    // SmolLM2-135M: hidden 576, 9 query heads and 3 KV heads of 64, FFN 1536
    const shape shapes[] = { { "attn_q", 576, 576 }, { "attn_k", 192, 576 }, { "attn_out", 576, 576 },
                             { "ffn_up", 1536, 576 }, { "ffn_down", 576, 1536 } };
    const int64_t n = 512;
    std::mt19937_64 rng(p.seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    ggml_backend_cpu_set_n_threads(cpu, p.n_threads);
    const uint64_t calls0 = ggml_gemm_q4_1_calls();
    printf("{\"tiled\": %s, \"threads\": %d, \"columns\": %lld, \"shapes\": [", ggml_gemm_q4_1_available() ? "true" : "false",
           p.n_threads, (long long) n);
    for (size_t s = 0; s < sizeof(shapes)/sizeof(shapes[0]); ++s) {
        const shape & sh = shapes[s];
        mul_mat_graph g(cpu, sh.m, n, sh.k);
        std::vector<float> wf(sh.m*sh.k), xf(sh.k*n);
        for (float & v : wf) v = nd(rng);
        for (float & v : xf) v = nd(rng);
        const std::vector<uint8_t> wq = quantize_q4_1(wf, sh.m, sh.k);
        ggml_backend_tensor_set(g.w, wq.data(), 0, wq.size());
        ggml_backend_tensor_set(g.x, xf.data(), 0, xf.size()*sizeof(float));
        ggml_backend_graph_compute(cpu, g.graph); // warm-up
        const int reps = 20;
        const auto t0 = std::chrono::steady_clock::now();
        for (int r = 0; r < reps; ++r) {
            ggml_backend_graph_compute(cpu, g.graph);
        }
        const double s_per = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()/reps;
        printf("%s{\"name\": \"%s\", \"m\": %lld, \"k\": %lld, \"ms\": %.3f, \"gflops\": %.2f}", s ? ", " : "", sh.name,
               (long long) sh.m, (long long) sh.k, s_per*1e3, 2.0*sh.m*sh.k*n/s_per*1e-9);
    }
    printf("], \"calls\": %llu}\n", (unsigned long long) (ggml_gemm_q4_1_calls() - calls0));
    return 0;
}

int main(int argc, char ** argv) {
    check_params p;
    try {
        if (parse_args(argc, argv, p) == 1) {
            print_usage(argv[0]);
            return 0;
        }
    } catch (const std::exception & e) {
        fprintf(stderr, "gemm-q4_1-check: error: %s\n", e.what());
        return 2;
    }
    ggml_log_set(quiet_log, nullptr);
    ggml_backend_t cpu = ggml_backend_cpu_init();
    if (!cpu) {
        fprintf(stderr, "gemm-q4_1-check: error: no CPU backend\n");
        return 2;
    }
    if (p.bench) {
        const int rc = run_bench(cpu, p);
        ggml_backend_free(cpu);
        return rc;
    }

    const ggml_type_traits_cpu * q4_1 = ggml_get_type_traits_cpu(GGML_TYPE_Q4_1);
    const ggml_type_traits_cpu * q8_1 = ggml_get_type_traits_cpu(GGML_TYPE_Q8_1);
    if (q4_1->vec_dot_type != GGML_TYPE_Q8_1) {
        fprintf(stderr, "gemm-q4_1-check: error: Q4_1's vec_dot_type is not Q8_1 in this ggml\n");
        return 2;
    }

    std::mt19937_64 rng(p.seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const bool tiled = ggml_gemm_q4_1_available();
    int n_fail = 0, n_in_kernel = 0;
    uint64_t calls_mul_mat = 0, calls_ref = 0; // the kernel's calls while the graph ran, and during the reference
    int64_t n_values = 0, n_diff = 0;
    double max_abs = 0.0;
    std::string failures;
    for (int ci = 0; ci < p.n_cases; ++ci) {
        // shapes around the 4 x 3 tiles' edges, and now and then a model's
        const bool model = rng() % 4 == 0;
        const int64_t m = model ? (rng() % 2 ? 576 : 192) : 1 + (int64_t) (rng() % 70);
        const int64_t n = 2 + (int64_t) (rng() % (model ? 130 : 40));
        const int64_t k = 32*(model ? 18 : 1 + (int64_t) (rng() % 24));
        const int n_threads = 1 + (int) (rng() % p.n_threads);
        const float scale = std::exp(nd(rng)); // data of a random magnitude, with an offset that Q4_1's min carries
        const float shift = nd(rng);

        std::vector<float> wf(m*k), xf(k*n);
        for (float & v : wf) v = scale*nd(rng) + shift;
        for (float & v : xf) v = nd(rng);
        const std::vector<uint8_t> wq = quantize_q4_1(wf, m, k);

        mul_mat_graph g(cpu, m, n, k);
        ggml_backend_tensor_set(g.w, wq.data(), 0, wq.size());
        ggml_backend_tensor_set(g.x, xf.data(), 0, xf.size()*sizeof(float));
        ggml_backend_cpu_set_n_threads(cpu, n_threads);
        const uint64_t calls0 = ggml_gemm_q4_1_calls();
        ggml_backend_graph_compute(cpu, g.graph);
        const uint64_t calls1 = ggml_gemm_q4_1_calls();
        std::vector<float> got(m*n);
        ggml_backend_tensor_get(g.out, got.data(), 0, got.size()*sizeof(float));

        // the stock path's arithmetic: Q8_1 columns, one vec_dot per (row, column)
        const size_t row_w = ggml_row_size(GGML_TYPE_Q4_1, k);
        const size_t row_x = ggml_row_size(GGML_TYPE_Q8_1, k);
        std::vector<uint8_t> xq(row_x*n);
        for (int64_t j = 0; j < n; ++j) {
            q8_1->from_float(xf.data() + j*k, xq.data() + j*row_x, k);
        }
        int64_t diff = 0;
        for (int64_t j = 0; j < n; ++j) {
            for (int64_t i = 0; i < m; ++i) {
                float ref = 0.0f;
                q4_1->vec_dot((int) k, &ref, 0, wq.data() + i*row_w, 0, xq.data() + j*row_x, 0, 1);
                const float v = got[j*m + i];
                if (memcmp(&v, &ref, sizeof(float)) != 0) {
                    ++diff;
                    max_abs = std::max(max_abs, (double) std::fabs(v - ref));
                }
            }
        }
        const uint64_t calls2 = ggml_gemm_q4_1_calls();
        const bool in_kernel = calls1 > calls0;
        calls_mul_mat += calls1 - calls0;
        calls_ref     += calls2 - calls1;
        n_in_kernel   += in_kernel;
        n_values += m*n;
        n_diff   += diff;
        if (diff || (tiled && !in_kernel)) { // with n >= 2 columns, the matmul must have gone through the kernel
            ++n_fail;
            char buf[200];
            snprintf(buf, sizeof(buf), "%s{\"case\": %d, \"m\": %lld, \"n\": %lld, \"k\": %lld, \"threads\": %d, "
                     "\"differ\": %lld, \"in_kernel\": %s}", failures.empty() ? "" : ", ", ci, (long long) m,
                     (long long) n, (long long) k, n_threads, (long long) diff, in_kernel ? "true" : "false");
            failures += buf;
        }
    }
    printf("{\"cases\": %d, \"fail\": %d, \"values\": %lld, \"differ\": %lld, \"max_abs\": %g, \"tiled\": %s, "
           "\"kernel_calls\": {\"mul_mat\": %llu, \"reference\": %llu}, \"cases_in_kernel\": %d, \"failures\": [%s]}\n",
           p.n_cases, n_fail, (long long) n_values, (long long) n_diff, max_abs, tiled ? "true" : "false",
           (unsigned long long) calls_mul_mat, (unsigned long long) calls_ref, n_in_kernel, failures.c_str());
    ggml_backend_free(cpu);
    return n_fail ? 1 : 0;
}
