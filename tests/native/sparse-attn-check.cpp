// sparse-attn-check - cross-checks GGML_OP_SPARSE_ATTN_EXT (native/kernels/ggml-sparse-attn.h), in the spirit of
// llama.cpp's test-backend-ops.
//
// Every case draws random shapes, data, a mask and block lists from a fixed seed, then on every backend that runs it:
//   (a) with every key block listed (ascending ids, count = number of blocks) the op must equal ggml_flash_attn_ext
//       on the same backend;
//   (b) with a random subset per (query block, head) (random count, sometimes out of [0, n_list]; random distinct ids
//       in random order, sometimes with out-of-range ids, and valid ids past the count that must not be visited) the
//       op must equal a dense reference computed in double on the host from the dequantized K/V, with the mask plus
//       -inf outside the listed blocks; rows that see nothing must be exactly 0;
//   (c) on each non-CPU backend that reports supports_op for the node, the op must equal the CPU backend's output;
//   (d) the probabilities mode (ggml_sparse_attn_ext_probs, every block; CPU only), with a query block of 1 in half
//       the cases of each type (the single-row path of observed decode steps) and the case's own in the others: its
//       output must equal ggml_flash_attn_ext, its probabilities the reference's softmax (rows that see nothing: 0 everywhere).
// Errors are the normalized mean squared error NMSE = sum((a-b)^2)/sum(b^2) (b the reference) against the threshold
// test-backend-ops uses for flash attention (5e-4), and the max abs error. One JSON object goes to stdout; the exit
// code is 1 if any case fails.
//
//     sparse-attn-check --cases 60 --seed 1

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-sparse-attn.h"

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

static constexpr double NMSE_THRESHOLD = 5e-4; // test_flash_attn_ext::max_nmse_err() in test-backend-ops

#ifdef GGML_KQ_MASK_PAD
static constexpr int64_t MASK_PAD = GGML_KQ_MASK_PAD;
#else
static constexpr int64_t MASK_PAD = 64; // this ggml has no GGML_KQ_MASK_PAD; padded masks are still allowed
#endif

// ---------------------------------------------------------------------------------------------------------------------
// options

struct check_params {
    int      n_cases   = 60;
    uint64_t seed      = 1;
    int      n_threads = 0;     // max CPU threads per case (0: hardware concurrency, at least 2)
    bool     corrupt   = false; // give the op (b) counts one off from the reference's: (b) must then fail
    bool     verbose   = false;
};

static void print_usage(const char * argv0) {
    printf("usage: %s [options]\n\n", argv0);
    printf("Cross-checks GGML_OP_SPARSE_ATTN_EXT against ggml_flash_attn_ext (all blocks listed), a double-precision\n");
    printf("host reference (random block subsets) and, on every non-CPU backend that supports it, the CPU backend.\n");
    printf("Prints one JSON object on stdout; exits with 1 if any case fails.\n\n");
    printf("options:\n");
    printf("  --cases N           number of random cases (default 60)\n");
    printf("  --seed S            seed of the case generator (default 1)\n");
    printf("  --threads T         at most T CPU threads per case, drawn per case (default: cores, at least 2)\n");
    printf("  --corrupt-counts    checks the checker: the op gets (b) counts one off from the reference's\n");
    printf("  -v, --verbose       one line per case on stderr\n");
    printf("  -h, --help          show this help and exit\n");
}

static long parse_int(const std::string & arg, const char * value, long lo, long hi) {
    if (!value) {
        throw std::invalid_argument(arg + " needs a value");
    }
    char * end = nullptr;
    errno = 0;
    const long v = strtol(value, &end, 10);
    if (errno != 0 || end == value || *end != '\0' || v < lo || v > hi) {
        throw std::invalid_argument(arg + ": expected an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got '" + value + "'");
    }
    return v;
}

// returns 0 to run, 1 for --help, throws on bad input
static int parse_args(int argc, char ** argv, check_params & p) {
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        const char * value = i + 1 < argc ? argv[i + 1] : nullptr;
        if (arg == "-h" || arg == "--help") {
            return 1;
        } else if (arg == "--cases") {
            p.n_cases = (int) parse_int(arg, value, 1, 100000); ++i;
        } else if (arg == "--seed") {
            p.seed = (uint64_t) parse_int(arg, value, 0, LONG_MAX); ++i;
        } else if (arg == "--threads") {
            p.n_threads = (int) parse_int(arg, value, 1, 512); ++i;
        } else if (arg == "--corrupt-counts") {
            p.corrupt = true;
        } else if (arg == "-v" || arg == "--verbose") {
            p.verbose = true;
        } else {
            throw std::invalid_argument("unknown argument: " + arg + " (see --help)");
        }
    }
    return 0;
}

// ---------------------------------------------------------------------------------------------------------------------
// cases

enum mask_kind { MASK_CAUSAL, MASK_RANDOM, MASK_NONE };

struct check_case {
    int       idx       = 0;
    int64_t   D         = 64;  // DK = DV
    int64_t   n_head    = 4;
    int64_t   n_head_kv = 1;
    int64_t   n_q       = 1;
    int64_t   n_kv      = 64;
    int64_t   n_kv_cap  = 64;  // rows of the K/V buffers (> n_kv: K/V are views, like a KV cache)
    int64_t   QB        = 16;
    int64_t   KB        = 32;
    ggml_type type      = GGML_TYPE_F16;
    mask_kind mask      = MASK_CAUSAL;
    int64_t   n_q_pad   = 1;   // mask rows
    bool      sinks     = false;
    float     softcap   = 0.0f;
    float     max_bias  = 0.0f;
    float     scale     = 1.0f;
    float     q_amp     = 1.0f;
    bool      q_perm    = false; // q is a permuted view of [D, n_head, n_q], as in llama.cpp
    int       n_threads = 1;

    int64_t n_qb() const { return (n_q  + QB - 1)/QB; }
    int64_t n_kb() const { return (n_kv + KB - 1)/KB; }

    std::string str() const {
        std::ostringstream s;
        s << "case " << idx << " [type=" << ggml_type_name(type) << " D=" << D << " heads=" << n_head << "/" << n_head_kv
          << " n_q=" << n_q << " n_kv=" << n_kv << " q_block=" << QB << " k_block=" << KB
          << " mask=" << (mask == MASK_CAUSAL ? "causal" : mask == MASK_RANDOM ? "random" : "none");
        if (mask != MASK_NONE) { s << " mask_rows=" << n_q_pad; }
        s << " sinks=" << (sinks ? 1 : 0) << " softcap=" << softcap << " max_bias=" << max_bias << " q_amp=" << q_amp
          << " q_perm=" << (q_perm ? 1 : 0) << " kv_rows=" << n_kv_cap << " threads=" << n_threads << "]";
        return s.str();
    }
};

template <typename T>
static T pick(std::mt19937_64 & rng, const std::vector<T> & v) {
    return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng)];
}

static bool chance(std::mt19937_64 & rng, double p) {
    return std::uniform_real_distribution<double>(0.0, 1.0)(rng) < p;
}

static check_case make_case(int idx, std::mt19937_64 & rng, int max_threads) {
    static const ggml_type types[] = { GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0 };
    check_case c;
    c.idx       = idx;
    c.type      = types[idx % 4]; // every type equally often
    c.D         = pick<int64_t>(rng, { 64, 128 });
    c.n_head    = pick<int64_t>(rng, { 4, 8 });
    c.n_head_kv = pick<int64_t>(rng, { 1, 2, c.n_head });
    c.n_q       = pick<int64_t>(rng, { 1, 37, 64, 200 });
    c.n_kv      = pick<int64_t>(rng, { 64, 256, 333, 512 });
    c.QB        = pick<int64_t>(rng, { 16, 64 });
    c.KB        = pick<int64_t>(rng, { 32, 64 });
    const double m = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
    c.mask      = m < 0.45 ? MASK_CAUSAL : m < 0.9 ? MASK_RANDOM : MASK_NONE;
    const int64_t pad = pick<int64_t>(rng, { 1, 16, MASK_PAD }); // (GGML_PAD evaluates its arguments twice)
    c.n_q_pad   = GGML_PAD(c.n_q, pad);
    c.sinks     = chance(rng, 0.4);
    c.softcap   = chance(rng, 0.35) ? pick<float>(rng, { 2.5f, 30.0f }) : 0.0f;
    c.max_bias  = c.mask != MASK_NONE && chance(rng, 0.15) ? 8.0f : 0.0f;
    c.scale     = 1.0f/sqrtf((float) c.D);
    c.q_amp     = pick<float>(rng, { 1.0f, 4.0f });
    c.q_perm    = chance(rng, 0.5);
    c.n_kv_cap  = chance(rng, 0.5) ? c.n_kv + pick<int64_t>(rng, { 1, 31, c.n_kv }) : c.n_kv;
    c.n_threads = std::uniform_int_distribution<int>(1, max_threads)(rng);
    return c;
}

// ---------------------------------------------------------------------------------------------------------------------
// host data

struct block_lists {
    int64_t              n_list = 0;
    std::vector<int32_t> blocks; // [n_head][n_qb][n_list]
    std::vector<int32_t> counts; // [n_head][n_qb]
};

struct host_data {
    std::vector<float>       q;      // canonical [n_head][n_q][D]
    std::vector<float>       q_dev;  // as the q tensor (or its permuted source) is laid out
    std::vector<uint8_t>     k_raw;  // [n_head_kv][n_kv_cap] rows of type
    std::vector<uint8_t>     v_raw;
    std::vector<float>       kf;     // dequantized [n_head_kv][n_kv][D]
    std::vector<float>       vf;
    std::vector<ggml_fp16_t> mask;   // [n_q_pad][n_kv]
    std::vector<float>       maskf;
    std::vector<float>       sinks;  // [n_head]
    block_lists              full;   // (a)
    block_lists              sub;    // (b), as the reference reads it
    std::vector<int32_t>     sub_counts_dev; // (b) counts given to the op (== sub.counts unless --corrupt-counts)

    // statistics of the (b) lists
    int64_t n_out_of_range = 0; // out-of-range ids within the counted part
    int64_t n_clamped      = 0; // counts outside [0, n_list]
    int64_t n_trap         = 0; // valid ids past the count (must not be visited)
};

// rows that no reader may touch (K/V view padding): NaN for float types, a NaN scale for block types
static void poison_row(ggml_type type, uint8_t * row, size_t row_size) {
    const ggml_fp16_t nan16 = 0x7E00;
    if (type == GGML_TYPE_F32) {
        const float nan = NAN;
        for (size_t i = 0; i + sizeof(float) <= row_size; i += sizeof(float)) { memcpy(row + i, &nan, sizeof(float)); }
    } else if (type == GGML_TYPE_F16) {
        for (size_t i = 0; i + 2 <= row_size; i += 2) { memcpy(row + i, &nan16, 2); }
    } else {
        // q8_0 / q4_0 blocks start with their f16 scale
        const size_t bs = ggml_type_size(type);
        for (size_t i = 0; i + bs <= row_size; i += bs) { memcpy(row + i, &nan16, 2); }
    }
}

static void make_kv(const check_case & c, std::mt19937_64 & rng, std::vector<uint8_t> & raw, std::vector<float> & deq) {
    const size_t row_size = ggml_row_size(c.type, c.D);
    raw.assign(row_size*c.n_kv_cap*c.n_head_kv, 0);
    deq.assign(c.D*c.n_kv*c.n_head_kv, 0.0f);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> src(c.D*c.n_kv);
    const ggml_type_traits * tr = ggml_get_type_traits(c.type);
    for (int64_t h = 0; h < c.n_head_kv; ++h) {
        for (auto & x : src) { x = u(rng); }
        uint8_t * base = raw.data() + h*c.n_kv_cap*row_size;
        ggml_quantize_chunk(c.type, src.data(), base, 0, c.n_kv, c.D, nullptr);
        for (int64_t r = c.n_kv; r < c.n_kv_cap; ++r) {
            poison_row(c.type, base + r*row_size, row_size);
        }
        for (int64_t r = 0; r < c.n_kv; ++r) {
            float * dst = deq.data() + (h*c.n_kv + r)*c.D;
            if (c.type == GGML_TYPE_F32) {
                memcpy(dst, base + r*row_size, c.D*sizeof(float));
            } else {
                tr->to_float(base + r*row_size, dst, c.D);
            }
        }
    }
}

static void make_mask(const check_case & c, std::mt19937_64 & rng, host_data & hd) {
    if (c.mask == MASK_NONE) {
        return;
    }
    std::vector<float> m(c.n_q_pad*c.n_kv, -INFINITY);
    if (c.mask == MASK_CAUSAL) {
        // query i sits at position n_kv - n_q + i and sees cells 0..its position
        for (int64_t i = 0; i < c.n_q; ++i) {
            const int64_t pos = c.n_kv - c.n_q + i;
            for (int64_t j = 0; j < c.n_kv; ++j) {
                m[i*c.n_kv + j] = j <= pos ? 0.0f : -INFINITY;
            }
        }
    } else {
        // random finite values, random -inf cells, fully masked rows and -inf/0 rectangles (as init_tensor_kq_mask)
        const double p_inf = std::uniform_real_distribution<double>(0.1, 0.9)(rng);
        std::uniform_real_distribution<float> u(-1.0f, 1.0f);
        for (int64_t i = 0; i < c.n_q; ++i) {
            const bool dead = chance(rng, 0.1);
            for (int64_t j = 0; j < c.n_kv; ++j) {
                m[i*c.n_kv + j] = dead || chance(rng, p_inf) ? -INFINITY : u(rng);
            }
        }
        const int n_rect = std::uniform_int_distribution<int>(0, 4)(rng);
        for (int r = 0; r < n_rect; ++r) {
            const int64_t i0 = std::uniform_int_distribution<int64_t>(0, c.n_q - 1)(rng);
            const int64_t j0 = std::uniform_int_distribution<int64_t>(0, c.n_kv - 1)(rng);
            const int64_t di = std::uniform_int_distribution<int64_t>(1, 64)(rng);
            const int64_t dj = std::uniform_int_distribution<int64_t>(1, 128)(rng);
            const float   v  = chance(rng, 0.5) ? -INFINITY : 0.0f;
            for (int64_t i = i0; i < std::min(c.n_q, i0 + di); ++i) {
                for (int64_t j = j0; j < std::min(c.n_kv, j0 + dj); ++j) {
                    m[i*c.n_kv + j] = v;
                }
            }
        }
    }
    hd.mask.resize(m.size());
    hd.maskf.resize(m.size());
    ggml_fp32_to_fp16_row(m.data(), hd.mask.data(), (int64_t) m.size());
    ggml_fp16_to_fp32_row(hd.mask.data(), hd.maskf.data(), (int64_t) m.size());
}

static void make_lists(const check_case & c, std::mt19937_64 & rng, host_data & hd, bool corrupt) {
    const int64_t n_qb = c.n_qb();
    const int64_t n_kb = c.n_kb();

    // (a) every block, ascending
    hd.full.n_list = n_kb;
    hd.full.blocks.resize(c.n_head*n_qb*n_kb);
    hd.full.counts.assign(c.n_head*n_qb, (int32_t) n_kb);
    for (int64_t t = 0; t < c.n_head*n_qb; ++t) {
        for (int64_t b = 0; b < n_kb; ++b) {
            hd.full.blocks[t*n_kb + b] = (int32_t) b;
        }
    }

    // (b) random subsets
    const int64_t n_list = std::uniform_int_distribution<int64_t>(1, n_kb + 3)(rng);
    hd.sub.n_list = n_list;
    hd.sub.blocks.resize(c.n_head*n_qb*n_list);
    hd.sub.counts.resize(c.n_head*n_qb);
    static const int32_t bad_ids[] = { -1, -7, INT32_MIN, INT32_MAX };
    std::vector<int32_t> ids(n_kb);
    for (int64_t t = 0; t < c.n_head*n_qb; ++t) {
        for (int64_t b = 0; b < n_kb; ++b) { ids[b] = (int32_t) b; }
        std::shuffle(ids.begin(), ids.end(), rng);
        int32_t * list = hd.sub.blocks.data() + t*n_list;
        for (int64_t i = 0; i < n_list; ++i) {
            // distinct valid ids in random order; once they run out (n_list > n_kb), out-of-range ids
            list[i] = i < n_kb ? ids[i] : (chance(rng, 0.5) ? (int32_t) (n_kb + i) : bad_ids[rng() % 4]);
        }
        if (chance(rng, 0.3)) {
            // replace a few entries by out-of-range ids
            const int n_bad = std::uniform_int_distribution<int>(1, 3)(rng);
            for (int j = 0; j < n_bad; ++j) {
                const int64_t pos = std::uniform_int_distribution<int64_t>(0, n_list - 1)(rng);
                list[pos] = chance(rng, 0.5) ? (int32_t) (n_kb + (rng() % 5)) : bad_ids[rng() % 4];
            }
        }
        int32_t count;
        const double r = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
        if (r < 0.05) {
            count = -(int32_t) (1 + rng() % 3); // clamped to 0
        } else if (r < 0.1) {
            count = (int32_t) (n_list + 1 + rng() % 5); // clamped to n_list
        } else if (r < 0.15) {
            count = 0;
        } else {
            count = (int32_t) std::uniform_int_distribution<int64_t>(1, n_list)(rng);
        }
        hd.sub.counts[t] = count;

        const int64_t eff = std::max<int64_t>(0, std::min<int64_t>(count, n_list));
        hd.n_clamped += count != eff;
        for (int64_t i = 0; i < n_list; ++i) {
            const bool valid = list[i] >= 0 && list[i] < n_kb;
            if (i < eff) {
                hd.n_out_of_range += !valid;
            } else {
                hd.n_trap += valid;
            }
        }
    }

    hd.sub_counts_dev = hd.sub.counts;
    if (corrupt) {
        for (auto & cnt : hd.sub_counts_dev) {
            const int32_t eff = std::max<int32_t>(0, std::min<int32_t>(cnt, (int32_t) n_list));
            cnt = eff < n_list ? eff + 1 : eff - 1;
        }
    }
}

static host_data make_data(const check_case & c, std::mt19937_64 & rng, bool corrupt) {
    host_data hd;
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);

    hd.q.resize(c.n_head*c.n_q*c.D);
    for (auto & x : hd.q) { x = c.q_amp*u(rng); }
    hd.q_dev.resize(hd.q.size());
    for (int64_t h = 0; h < c.n_head; ++h) {
        for (int64_t i = 0; i < c.n_q; ++i) {
            const float * src = hd.q.data() + (h*c.n_q + i)*c.D;
            // q_perm: the source tensor is [D, n_head, n_q]; otherwise [D, n_q, n_head]
            float * dst = hd.q_dev.data() + (c.q_perm ? (i*c.n_head + h) : (h*c.n_q + i))*c.D;
            memcpy(dst, src, c.D*sizeof(float));
        }
    }

    make_kv(c, rng, hd.k_raw, hd.kf);
    make_kv(c, rng, hd.v_raw, hd.vf);
    make_mask(c, rng, hd);
    if (c.sinks) {
        hd.sinks.resize(c.n_head);
        std::uniform_real_distribution<float> us(-10.0f, 10.0f); // as test-backend-ops: make the sinks matter
        for (auto & s : hd.sinks) { s = us(rng); }
    }
    make_lists(c, rng, hd, corrupt);
    return hd;
}

// ---------------------------------------------------------------------------------------------------------------------
// the dense reference (double, host): mask plus -inf outside the listed blocks; rows that see nothing are 0

// the ALiBi slope of head h (1 without ALiBi), as flash attention computes it
static double ref_slope(const check_case & c, int64_t h) {
    if (c.max_bias <= 0.0f) {
        return 1.0;
    }
    const uint32_t n_head_log2 = 1u << (uint32_t) floor(log2((double) c.n_head));
    const double m0 = pow(2.0, -(double) c.max_bias/n_head_log2);
    const double m1 = pow(2.0, -(double) c.max_bias/2.0/n_head_log2);
    return h < (int64_t) n_head_log2 ? pow(m0, h + 1) : pow(m1, 2*(h - n_head_log2) + 1);
}

// the masked score of query iq of head h for cell j (-inf where the mask hides it), in double
static double ref_score(const check_case & c, const host_data & hd, int64_t h, int64_t iq, int64_t j, double slope) {
    const double mv = c.mask == MASK_NONE ? 0.0 : (double) hd.maskf[iq*c.n_kv + j];
    if (mv == -INFINITY) {
        return -INFINITY;
    }
    const int64_t hk = h/(c.n_head/c.n_head_kv);
    const float * q = hd.q.data() + (h*c.n_q + iq)*c.D;
    const float * k = hd.kf.data() + (hk*c.n_kv + j)*c.D;
    double dot = 0.0;
    for (int64_t d = 0; d < c.D; ++d) { dot += (double) q[d]*(double) k[d]; }
    double x = dot*c.scale;
    if (c.softcap != 0.0f) {
        x = c.softcap*tanh(x/c.softcap);
    }
    return x + slope*mv;
}

// the probabilities of every cell with every block visible, [n_head][n_q][n_kv], in double on the host
static void reference_probs(const check_case & c, const host_data & hd, std::vector<float> & probs) {
    probs.assign(c.n_head*c.n_q*c.n_kv, 0.0f);

    std::vector<double> s(c.n_kv);
    for (int64_t h = 0; h < c.n_head; ++h) {
        const double slope = ref_slope(c, h);
        for (int64_t iq = 0; iq < c.n_q; ++iq) {
            double M = -INFINITY;
            for (int64_t j = 0; j < c.n_kv; ++j) {
                s[j] = ref_score(c, hd, h, iq, j, slope);
                M = std::max(M, s[j]);
            }
            if (M == -INFINITY) {
                continue; // nothing visible: 0
            }
            const double sink = c.sinks ? (double) hd.sinks[h] : -INFINITY;
            M = std::max(M, sink);
            double sum = c.sinks ? exp(sink - M) : 0.0;
            for (int64_t j = 0; j < c.n_kv; ++j) {
                sum += s[j] == -INFINITY ? 0.0 : exp(s[j] - M);
            }
            float * p = probs.data() + (h*c.n_q + iq)*c.n_kv;
            for (int64_t j = 0; j < c.n_kv; ++j) {
                p[j] = s[j] == -INFINITY ? 0.0f : (float) (exp(s[j] - M)/sum);
            }
        }
    }
}

static void reference(const check_case & c, const host_data & hd, std::vector<float> & out, std::vector<char> & visible) {
    const int64_t n_qb = c.n_qb();
    const int64_t n_kb = c.n_kb();
    out.assign(c.D*c.n_head*c.n_q, 0.0f);
    visible.assign(c.n_head*c.n_q, 0);

    std::vector<char>   allowed(n_kb);
    std::vector<double> s(c.n_kv);
    std::vector<double> acc(c.D);
    for (int64_t h = 0; h < c.n_head; ++h) {
        const double slope = ref_slope(c, h);
        const int64_t hk = h/(c.n_head/c.n_head_kv);
        for (int64_t qb = 0; qb < n_qb; ++qb) {
            std::fill(allowed.begin(), allowed.end(), 0);
            const int32_t * list = hd.sub.blocks.data() + (h*n_qb + qb)*hd.sub.n_list;
            const int64_t   eff  = std::max<int64_t>(0, std::min<int64_t>(hd.sub.counts[h*n_qb + qb], hd.sub.n_list));
            for (int64_t i = 0; i < eff; ++i) {
                if (list[i] >= 0 && list[i] < n_kb) {
                    allowed[list[i]] = 1;
                }
            }
            for (int64_t iq = qb*c.QB; iq < std::min(c.n_q, (qb + 1)*c.QB); ++iq) {
                double M = -INFINITY;
                bool any = false;
                for (int64_t j = 0; j < c.n_kv; ++j) {
                    s[j] = allowed[j/c.KB] ? ref_score(c, hd, h, iq, j, slope) : -INFINITY;
                    M = std::max(M, s[j]);
                    any = any || s[j] != -INFINITY;
                }
                if (!any) {
                    continue; // nothing visible: 0 (with or without a sink)
                }
                visible[h*c.n_q + iq] = 1;
                double sink = -INFINITY;
                if (c.sinks) {
                    sink = hd.sinks[h];
                    M = std::max(M, sink);
                }
                double sum = c.sinks ? exp(sink - M) : 0.0;
                std::fill(acc.begin(), acc.end(), 0.0);
                for (int64_t j = 0; j < c.n_kv; ++j) {
                    if (s[j] == -INFINITY) {
                        continue;
                    }
                    const double p = exp(s[j] - M);
                    sum += p;
                    const float * v = hd.vf.data() + (hk*c.n_kv + j)*c.D;
                    for (int64_t d = 0; d < c.D; ++d) { acc[d] += p*v[d]; }
                }
                float * o = out.data() + (iq*c.n_head + h)*c.D; // [D, n_head, n_q]
                for (int64_t d = 0; d < c.D; ++d) { o[d] = (float) (acc[d]/sum); }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------------
// running the graph on one backend

struct run_result {
    bool ran_fa = false, ran_full = false, ran_sub = false, ran_probs = false;
    bool sparse_supported = false;
    std::string error;
    std::vector<float> fa, full, sub, probs_out, probs;
};

static run_result run_case(ggml_backend_t backend, bool is_cpu, const check_case & c, const host_data & hd) {
    run_result res;

    ggml_init_params ip = {
        /*.mem_size   =*/ ggml_tensor_overhead()*40 + ggml_graph_overhead(),
        /*.mem_buffer =*/ nullptr,
        /*.no_alloc   =*/ true,
    };
    ggml_context * ctx = ggml_init(ip);
    if (!ctx) {
        res.error = "ggml_init failed";
        return res;
    }

    ggml_tensor * q_src = c.q_perm ? ggml_new_tensor_3d(ctx, GGML_TYPE_F32, c.D, c.n_head, c.n_q)
                                   : ggml_new_tensor_3d(ctx, GGML_TYPE_F32, c.D, c.n_q, c.n_head);
    ggml_tensor * q = c.q_perm ? ggml_permute(ctx, q_src, 0, 2, 1, 3) : q_src;

    ggml_tensor * k_buf = ggml_new_tensor_3d(ctx, c.type, c.D, c.n_kv_cap, c.n_head_kv);
    ggml_tensor * v_buf = ggml_new_tensor_3d(ctx, c.type, c.D, c.n_kv_cap, c.n_head_kv);
    ggml_tensor * k = c.n_kv_cap == c.n_kv ? k_buf : ggml_view_3d(ctx, k_buf, c.D, c.n_kv, c.n_head_kv, k_buf->nb[1], k_buf->nb[2], 0);
    ggml_tensor * v = c.n_kv_cap == c.n_kv ? v_buf : ggml_view_3d(ctx, v_buf, c.D, c.n_kv, c.n_head_kv, v_buf->nb[1], v_buf->nb[2], 0);

    ggml_tensor * mask  = c.mask != MASK_NONE ? ggml_new_tensor_2d(ctx, GGML_TYPE_F16, c.n_kv, c.n_q_pad) : nullptr;
    ggml_tensor * sinks = c.sinks ? ggml_new_tensor_1d(ctx, GGML_TYPE_F32, c.n_head) : nullptr;

    const int64_t n_qb = c.n_qb();
    ggml_tensor * blocks_full = ggml_new_tensor_3d(ctx, GGML_TYPE_I32, hd.full.n_list, n_qb, c.n_head);
    ggml_tensor * counts_full = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_qb, c.n_head);
    ggml_tensor * blocks_sub  = ggml_new_tensor_3d(ctx, GGML_TYPE_I32, hd.sub.n_list, n_qb, c.n_head);
    ggml_tensor * counts_sub  = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_qb, c.n_head);

    ggml_tensor * fa = ggml_flash_attn_ext(ctx, q, k, v, mask, c.scale, c.max_bias, c.softcap);
    ggml_flash_attn_ext_add_sinks(fa, sinks);
    ggml_prec_set_acc(fa, GGML_PREC_F32);

    ggml_tensor * sp_full = ggml_sparse_attn_ext(ctx, q, k, v, mask, blocks_full, counts_full, c.scale, c.max_bias, c.softcap, (int32_t) c.QB, (int32_t) c.KB);
    ggml_sparse_attn_ext_add_sinks(sp_full, sinks);
    ggml_tensor * sp_sub  = ggml_sparse_attn_ext(ctx, q, k, v, mask, blocks_sub,  counts_sub,  c.scale, c.max_bias, c.softcap, (int32_t) c.QB, (int32_t) c.KB);
    ggml_sparse_attn_ext_add_sinks(sp_sub, sinks);
    ggml_tensor * sp_probs = ggml_sparse_attn_ext_probs(ctx, q, k, v, mask, c.scale, c.max_bias, c.softcap, (int32_t) ((c.idx/4) % 2 == 0 ? 1 : c.QB), (int32_t) c.KB);
    ggml_sparse_attn_ext_add_sinks(sp_probs, sinks);

    res.ran_fa          = ggml_backend_supports_op(backend, fa);
    if (!is_cpu && c.softcap != 0.0f && c.D != 128 && c.D != 256 && c.D != 512) {
        // ggml-cuda's flash attention reports softcap as supported for every head size, but its kernels are compiled
        // with softcap for 128, 256 and 512 only (fattn-mma-f16.cuh: "Skip unused kernel variants"; the launch traps):
        // (a) is not asked of a GPU there; (c) still compares the op with the CPU backend's
        res.ran_fa = false;
    }
    res.ran_probs       = ggml_backend_supports_op(backend, sp_probs);
    if (is_cpu && !res.ran_probs) {
        res.error = "the CPU backend does not support the probabilities mode";
    }
    res.sparse_supported = ggml_backend_supports_op(backend, sp_full) && ggml_backend_supports_op(backend, sp_sub);
    res.ran_full = res.ran_sub = res.sparse_supported;
    if (is_cpu && (!res.ran_fa || !res.sparse_supported)) {
        res.error = std::string("the CPU backend does not support ") + (res.ran_fa ? "the sparse op" : "flash attention");
    }
    if (!res.sparse_supported) {
        res.ran_fa = res.ran_full = res.ran_sub = res.ran_probs = false; // nothing to check here
        ggml_free(ctx);
        return res;
    }

    ggml_cgraph * gf = ggml_new_graph(ctx);
    if (res.ran_fa) {
        ggml_build_forward_expand(gf, fa);
    }
    ggml_build_forward_expand(gf, sp_full);
    ggml_build_forward_expand(gf, sp_sub);
    if (res.ran_probs) {
        ggml_build_forward_expand(gf, sp_probs);
    }

    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
    if (!buf) {
        res.error = "ggml_backend_alloc_ctx_tensors failed";
        res.ran_fa = res.ran_full = res.ran_sub = res.ran_probs = false;
        ggml_free(ctx);
        return res;
    }

    ggml_backend_tensor_set(q_src, hd.q_dev.data(), 0, ggml_nbytes(q_src));
    ggml_backend_tensor_set(k_buf, hd.k_raw.data(), 0, ggml_nbytes(k_buf));
    ggml_backend_tensor_set(v_buf, hd.v_raw.data(), 0, ggml_nbytes(v_buf));
    if (mask) {
        ggml_backend_tensor_set(mask, hd.mask.data(), 0, ggml_nbytes(mask)); // rows past n_q are -inf
    }
    if (sinks) {
        ggml_backend_tensor_set(sinks, hd.sinks.data(), 0, ggml_nbytes(sinks));
    }
    ggml_backend_tensor_set(blocks_full, hd.full.blocks.data(),    0, ggml_nbytes(blocks_full));
    ggml_backend_tensor_set(counts_full, hd.full.counts.data(),    0, ggml_nbytes(counts_full));
    ggml_backend_tensor_set(blocks_sub,  hd.sub.blocks.data(),     0, ggml_nbytes(blocks_sub));
    ggml_backend_tensor_set(counts_sub,  hd.sub_counts_dev.data(), 0, ggml_nbytes(counts_sub));

    const ggml_status st = ggml_backend_graph_compute(backend, gf);
    if (st != GGML_STATUS_SUCCESS) {
        res.error = std::string("graph compute failed: ") + ggml_status_to_string(st);
        res.ran_fa = res.ran_full = res.ran_sub = res.ran_probs = false;
    } else {
        const size_t n = (size_t) (c.D*c.n_head*c.n_q);
        if (res.ran_fa) {
            res.fa.resize(n);
            ggml_backend_tensor_get(fa, res.fa.data(), 0, n*sizeof(float));
        }
        res.full.resize(n);
        res.sub.resize(n);
        ggml_backend_tensor_get(sp_full, res.full.data(), 0, n*sizeof(float));
        ggml_backend_tensor_get(sp_sub,  res.sub.data(),  0, n*sizeof(float));
        if (res.ran_probs) {
            res.probs_out.resize(n);
            res.probs.resize((size_t) (c.n_head*c.n_q*c.n_kv));
            ggml_backend_tensor_get(sp_probs, res.probs_out.data(), 0, n*sizeof(float));
            ggml_backend_tensor_get(sp_probs, res.probs.data(), sp_probs->nb[3], res.probs.size()*sizeof(float));
        }
    }

    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    return res;
}

// ---------------------------------------------------------------------------------------------------------------------
// comparisons

// out (as the op writes it, [n_q][n_head][D]) with the rows that see no key at all (every block listed) set to 0
static std::vector<float> rows_seeing(std::vector<float> out, const check_case & c, const host_data & hd) {
    for (int64_t h = 0; h < c.n_head; ++h) {
        const double slope = ref_slope(c, h);
        for (int64_t iq = 0; iq < c.n_q; ++iq) {
            bool any = false;
            for (int64_t j = 0; j < c.n_kv && !any; ++j) {
                any = ref_score(c, hd, h, iq, j, slope) != -INFINITY;
            }
            if (!any) {
                std::fill(out.begin() + (iq*c.n_head + h)*c.D, out.begin() + (iq*c.n_head + h + 1)*c.D, 0.0f);
            }
        }
    }
    return out;
}

struct cmp_result {
    double nmse    = 0.0;
    double max_abs = 0.0;
    int64_t n_nonfinite = 0;
    bool ok() const { return n_nonfinite == 0 && std::isfinite(nmse) && nmse <= NMSE_THRESHOLD; }
};

// a: the tested output, b: the reference; NMSE = sum((a-b)^2)/sum(b^2)
static cmp_result compare(const std::vector<float> & a, const std::vector<float> & b) {
    cmp_result r;
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < a.size(); ++i) {
        if (!std::isfinite(a[i]) || !std::isfinite(b[i])) {
            r.n_nonfinite++;
            continue;
        }
        const double d = (double) a[i] - (double) b[i];
        num += d*d;
        den += (double) b[i]*(double) b[i];
        r.max_abs = std::max(r.max_abs, fabs(d));
    }
    r.nmse = den > 0.0 ? num/den : (num == 0.0 ? 0.0 : INFINITY);
    if (r.n_nonfinite) {
        r.nmse = INFINITY;
    }
    return r;
}

static std::string fmt(double x) {
    if (!std::isfinite(x)) {
        return "null";
    }
    char buf[64];
    snprintf(buf, sizeof(buf), "%.4g", x);
    return buf;
}

static std::string json_str(const std::string & s) {
    std::string o = "\"";
    for (char ch : s) {
        switch (ch) {
            case '"':  o += "\\\""; break;
            case '\\': o += "\\\\"; break;
            case '\n': o += "\\n";  break;
            default:
                if ((unsigned char) ch < 0x20) {
                    char b[8];
                    snprintf(b, sizeof(b), "\\u%04x", ch);
                    o += b;
                } else {
                    o += ch;
                }
        }
    }
    return o + "\"";
}

static std::string cmp_str(const char * what, const cmp_result & r) {
    std::ostringstream s;
    s << what << ": nmse=" << fmt(r.nmse) << " max_abs=" << fmt(r.max_abs);
    if (r.n_nonfinite) {
        s << " nonfinite=" << r.n_nonfinite;
    }
    return s.str();
}

struct other_backend {
    std::string    name;
    std::string    type;
    ggml_backend_t backend = nullptr;
    int     ran = 0, unsupported = 0, fail = 0, ran_fa = 0;
    double  max_nmse_vs_cpu = 0.0;
    std::string error;
};

static const char * dev_type_name(enum ggml_backend_dev_type t) {
    switch (t) {
        case GGML_BACKEND_DEVICE_TYPE_CPU:   return "CPU";
        case GGML_BACKEND_DEVICE_TYPE_GPU:   return "GPU";
        case GGML_BACKEND_DEVICE_TYPE_IGPU:  return "IGPU";
        case GGML_BACKEND_DEVICE_TYPE_ACCEL: return "ACCEL";
        default:                             return "other";
    }
}

static void quiet_log(ggml_log_level level, const char * text, void * user) {
    (void) user;
    if (level == GGML_LOG_LEVEL_ERROR || level == GGML_LOG_LEVEL_WARN) {
        fputs(text, stderr);
    }
}

int main(int argc, char ** argv) {
    check_params params;
    try {
        if (parse_args(argc, argv, params) == 1) {
            print_usage(argv[0]);
            return 0;
        }
    } catch (const std::exception & e) {
        fprintf(stderr, "sparse-attn-check: error: %s\n", e.what());
        return 2;
    }
    ggml_log_set(quiet_log, nullptr);

    const int hw = (int) std::thread::hardware_concurrency();
    const int max_threads = params.n_threads > 0 ? params.n_threads : std::max(2, hw);

    // backends: the CPU one is the reference of (c)
    ggml_backend_t cpu = nullptr;
    std::string cpu_desc;
    std::vector<other_backend> others;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        const enum ggml_backend_dev_type t = ggml_backend_dev_type(dev);
        if (t == GGML_BACKEND_DEVICE_TYPE_CPU) {
            if (!cpu) {
                cpu = ggml_backend_dev_init(dev, nullptr);
                cpu_desc = ggml_backend_dev_description(dev);
            }
            continue;
        }
        other_backend ob;
        ob.name = ggml_backend_dev_name(dev);
        ob.type = dev_type_name(t);
        ob.backend = ggml_backend_dev_init(dev, nullptr);
        if (!ob.backend) {
            ob.error = "ggml_backend_dev_init failed";
        }
        others.push_back(ob);
    }
    if (!cpu) {
        fprintf(stderr, "sparse-attn-check: error: no CPU backend\n");
        return 2;
    }
    ggml_backend_set_n_threads_t set_n_threads = nullptr;
    {
        ggml_backend_dev_t dev = ggml_backend_get_device(cpu);
        ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : nullptr;
        if (reg) {
            set_n_threads = (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads");
        }
    }

    int n_fail = 0;
    double max_nmse_flash = 0.0, max_abs_flash = 0.0, max_nmse_ref = 0.0, max_abs_ref = 0.0;
    double max_nmse_probs_flash = 0.0, max_nmse_probs_ref = 0.0, max_abs_probs_ref = 0.0;
    int n_probs = 0;
    int n_cpu_ran = 0; // cases whose sparse op (a, b) the CPU backend computed
    int64_t n_out_of_range = 0, n_clamped = 0, n_trap = 0, n_dead_rows = 0, n_rows = 0;
    std::vector<std::string> failures;
    std::map<std::string, int> per_type_fail;

    for (int ci = 0; ci < params.n_cases; ++ci) {
        // one generator per case: a case does not depend on how many came before it
        std::seed_seq seq{ (uint32_t) params.seed, (uint32_t) (params.seed >> 32), (uint32_t) ci, 0x5a77u };
        std::mt19937_64 rng(seq);
        const check_case c = make_case(ci, rng, max_threads);
        const host_data hd = make_data(c, rng, params.corrupt);
        n_out_of_range += hd.n_out_of_range;
        n_clamped      += hd.n_clamped;
        n_trap         += hd.n_trap;

        std::vector<float> ref;
        std::vector<char>  visible;
        reference(c, hd, ref, visible);
        for (char vis : visible) { n_dead_rows += !vis; }
        n_rows += (int64_t) visible.size();

        std::vector<std::string> why;

        // (b) rows that see nothing must be exactly 0
        auto check_dead_rows = [&](const std::vector<float> & out, const std::string & be) {
            int64_t bad = 0;
            for (int64_t h = 0; h < c.n_head; ++h) {
                for (int64_t iq = 0; iq < c.n_q; ++iq) {
                    if (visible[h*c.n_q + iq]) {
                        continue;
                    }
                    const float * o = out.data() + (iq*c.n_head + h)*c.D;
                    for (int64_t d = 0; d < c.D; ++d) {
                        if (o[d] != 0.0f) { bad++; break; }
                    }
                }
            }
            if (bad) {
                why.push_back("(b) " + be + ": " + std::to_string(bad) + " rows that see nothing are not 0");
            }
        };

        if (set_n_threads) {
            set_n_threads(cpu, c.n_threads);
        }
        const run_result rc = run_case(cpu, true, c, hd);
        if (!rc.error.empty()) {
            why.push_back("CPU: " + rc.error);
        }
        cmp_result a_cpu, b_cpu;
        n_cpu_ran += rc.ran_full && rc.ran_sub;
        if (rc.ran_fa && rc.ran_full) {
            a_cpu = compare(rc.full, rc.fa);
            max_nmse_flash = std::max(max_nmse_flash, a_cpu.nmse);
            max_abs_flash  = std::max(max_abs_flash,  a_cpu.max_abs);
            if (!a_cpu.ok()) { why.push_back(cmp_str("(a) CPU vs flash_attn_ext", a_cpu)); }
        }
        if (rc.ran_sub) {
            b_cpu = compare(rc.sub, ref);
            max_nmse_ref = std::max(max_nmse_ref, b_cpu.nmse);
            max_abs_ref  = std::max(max_abs_ref,  b_cpu.max_abs);
            if (!b_cpu.ok()) { why.push_back(cmp_str("(b) CPU vs reference", b_cpu)); }
            check_dead_rows(rc.sub, "CPU");
        }
        if (rc.ran_probs) {
            std::vector<float> ref_p;
            reference_probs(c, hd, ref_p);
            n_probs++;
            if (rc.ran_fa) {
                const cmp_result d_out = compare(rc.probs_out, rc.fa);
                max_nmse_probs_flash = std::max(max_nmse_probs_flash, d_out.nmse);
                if (!d_out.ok()) { why.push_back(cmp_str("(d) CPU probabilities mode vs flash_attn_ext", d_out)); }
            }
            const cmp_result d_p = compare(rc.probs, ref_p);
            max_nmse_probs_ref = std::max(max_nmse_probs_ref, d_p.nmse);
            max_abs_probs_ref  = std::max(max_abs_probs_ref,  d_p.max_abs);
            if (!d_p.ok()) { why.push_back(cmp_str("(d) CPU probabilities vs reference", d_p)); }
        }

        for (auto & ob : others) {
            if (!ob.backend) {
                continue;
            }
            const run_result ro = run_case(ob.backend, false, c, hd);
            if (!ro.error.empty()) {
                why.push_back(ob.name + ": " + ro.error);
                ob.fail++;
                continue;
            }
            if (!ro.sparse_supported) {
                ob.unsupported++;
                continue;
            }
            ob.ran++;
            bool ok = true;
            if (ro.ran_fa) {
                ob.ran_fa++;
                // rows that see no key are left undefined by ggml-cuda's flash attention (NaN where the CPU writes
                // 0; llama.cpp never masks a query row whole): (a) compares the rows that see a key
                const cmp_result a = compare(rows_seeing(ro.full, c, hd), rows_seeing(ro.fa, c, hd));
                max_nmse_flash = std::max(max_nmse_flash, a.nmse);
                max_abs_flash  = std::max(max_abs_flash,  a.max_abs);
                if (!a.ok()) { why.push_back(cmp_str(("(a) " + ob.name + " vs flash_attn_ext").c_str(), a)); ok = false; }
            }
            const cmp_result b = compare(ro.sub, ref);
            max_nmse_ref = std::max(max_nmse_ref, b.nmse);
            max_abs_ref  = std::max(max_abs_ref,  b.max_abs);
            if (!b.ok()) { why.push_back(cmp_str(("(b) " + ob.name + " vs reference").c_str(), b)); ok = false; }
            check_dead_rows(ro.sub, ob.name);
            if (rc.ran_full) {
                const cmp_result cf = compare(ro.full, rc.full);
                const cmp_result cs = compare(ro.sub,  rc.sub);
                ob.max_nmse_vs_cpu = std::max({ ob.max_nmse_vs_cpu, cf.nmse, cs.nmse });
                if (!cf.ok()) { why.push_back(cmp_str(("(c) " + ob.name + " vs CPU, all blocks").c_str(), cf)); ok = false; }
                if (!cs.ok()) { why.push_back(cmp_str(("(c) " + ob.name + " vs CPU, subsets").c_str(),    cs)); ok = false; }
            }
            ob.fail += !ok;
        }

        const bool failed = !why.empty();
        if (failed) {
            n_fail++;
            per_type_fail[ggml_type_name(c.type)]++;
            if (failures.size() < 8) {
                std::string d = c.str() + ":";
                for (size_t i = 0; i < why.size(); ++i) { d += (i ? "; " : " ") + why[i]; }
                failures.push_back(d);
            }
        }
        if (params.verbose) {
            fprintf(stderr, "%s %s (a) nmse=%s (b) nmse=%s n_list=%" PRId64 "\n", failed ? "FAIL" : "ok  ", c.str().c_str(),
                    fmt(a_cpu.nmse).c_str(), fmt(b_cpu.nmse).c_str(), hd.sub.n_list);
        }
    }

    // the JSON report
    std::ostringstream o;
    o << "{\"cases\": " << params.n_cases << ", \"fail\": " << n_fail << ", \"seed\": " << params.seed
      << ", \"nmse_threshold\": " << fmt(NMSE_THRESHOLD)
      << ", \"max_nmse_vs_flash\": " << fmt(max_nmse_flash) << ", \"max_abs_vs_flash\": " << fmt(max_abs_flash)
      << ", \"max_nmse_vs_ref\": " << fmt(max_nmse_ref) << ", \"max_abs_vs_ref\": " << fmt(max_abs_ref)
      << ", \"probs\": {\"ran\": " << n_probs << ", \"max_nmse_out_vs_flash\": " << fmt(max_nmse_probs_flash)
      << ", \"max_nmse_vs_ref\": " << fmt(max_nmse_probs_ref) << ", \"max_abs_vs_ref\": " << fmt(max_abs_probs_ref) << "}";
    if (params.corrupt) {
        o << ", \"corrupt_counts\": true";
    }
    o << ", \"subsets\": {\"out_of_range_ids\": " << n_out_of_range << ", \"clamped_counts\": " << n_clamped
      << ", \"ids_past_count\": " << n_trap << ", \"rows_seeing_nothing\": " << n_dead_rows << ", \"rows\": " << n_rows << "}";
    o << ", \"backends\": {\"CPU\": {\"role\": \"reference\", \"device\": " << json_str(cpu_desc) << ", \"ran\": " << n_cpu_ran << "}";
    for (const auto & ob : others) {
        o << ", " << json_str(ob.name) << ": {\"type\": " << json_str(ob.type) << ", \"ran\": " << ob.ran
          << ", \"ran_flash\": " << ob.ran_fa << ", \"unsupported\": " << ob.unsupported << ", \"fail\": " << ob.fail
          << ", \"max_nmse_vs_cpu\": " << fmt(ob.max_nmse_vs_cpu);
        if (!ob.error.empty()) {
            o << ", \"error\": " << json_str(ob.error);
        }
        o << "}";
    }
    o << "}, \"other_backends\": " << others.size();
    if (others.empty()) {
        o << ", \"note\": \"no backend other than the CPU exists: (c) did not run\"";
    }
    o << ", \"fail_by_type\": {";
    bool first = true;
    for (const auto & kv : per_type_fail) {
        o << (first ? "" : ", ") << json_str(kv.first) << ": " << kv.second;
        first = false;
    }
    o << "}, \"failures\": [";
    for (size_t i = 0; i < failures.size(); ++i) {
        o << (i ? ", " : "") << json_str(failures[i]);
    }
    o << "]}";
    printf("%s\n", o.str().c_str());
    fflush(stdout);

    for (auto & ob : others) {
        if (ob.backend) { ggml_backend_free(ob.backend); }
    }
    ggml_backend_free(cpu);
    return n_fail ? 1 : 0;
}
