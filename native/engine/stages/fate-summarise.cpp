// fate-summarise.cpp - fate stage `summarise` (HAE/SRC): tokens leaving a layer's cache go to a bin; a full bin of
// `bin` tokens is replaced, per KV head, by `rank` synthetic centroid cells fitted so that attention over them
// approximates attention over the bin for the observation window's queries, so the leavers still contribute.
//
// What is fitted (per KV head, reference queries Q = the valid post-RoPE queries of the observation window of every
// query head of the KV head's group; never future queries):
//   - per KV head, the bin's tokens are split into `rank` groups of similar keys and values (recursive halving along
//     the principal direction of rows [key, 0.5 x value scaled to the keys' norm]; keys alone until the 15th session;
//     the groups have the same sizes in every head, so one mask bias fits a cell). Centroid r
//     stands for the c_r tokens of its group, its column of the attention mask gets log(c_r), its share of mass, and
//     it sits at one of the bin's last `rank` positions (every later query sees the whole bin). Measured against
//     runs of consecutive positions (SnapKV at 179 tokens per layer of a 1.8k-token prompt, same run): streamed KL
//     0.045 against 0.054, eviction alone ~0.052: one key represents similar keys for any query, not only the
//     window's;
//   - its key k_r solves a ridge least-squares fit of the log attention mass of its group for each reference query:
//         s*q_i.k_r + log c_r  ~  log sum_{j in group r} exp(s*q_i.k_j)      (ridge towards the group's mean key)
//     so the centroids' softmax mass matches the bin's (c copies of one key give that key back exactly);
//   - the values V_c solve a ridge least-squares fit of the bin's attention output for each reference query:
//         P V_c ~ T,   P_ir = softmax_r(s*q_i.k_r + log c_r),   T_i = sum_j softmax_j(s*q_i.k_j) v_j
//     (ridge towards the groups' mean values). With the mass and the normalised output both matched, attention over
//     kept tokens + centroids approximates attention over kept tokens + bin, whatever the kept tokens are.
// The seed's OLS (pinv(Q_ref) . Attn(Q_ref, K_bin, V_bin)) fits values only and has no way to give centroids the
// bin's share of mass; this is the consistent version of that idea. A fit that fails (not positive definite, not
// finite) drops its bin instead, counted. Centroid cells count against the layer's budget (the memory evicts as many
// more tokens), share the summed score of the bin's tokens until observed, and are dropped when they leave in turn.
// Bins close in leave() and are fitted once every layer has evicted (after_evictions): one task per (bin, KV head),
// shared out among the context's threads, so a step that closes bins in many layers (the prompt's end, the first
// decode step) takes the longest fit's time per thread, not the sum of all fits.
// Which tokens enter the bins (the seed's score - λ·entropy): the middle tokens leave by log(score) - lam*H, H the
// token's entropy over the window's queries: the entropy of the head-mean attention that each window query that saw
// the token gives it, normalised by the log of their number (llama_kvp_obs_layer_query_entropy). A token every query
// attends alike leaves before one of equal score that a few queries attend strongly (the seed's reasoning: the first
// is background a centroid can carry, the second a specific fact). Measured: the same order without bins (eviction
// alone) gains much less (SnapKV, essays: 0.0478 against 0.0522; summarise with it 0.0343, without 0.0397); on texts
// never used for the choice it gains at 10% and is within the noise at 25% (docs/NOTES.md).

#include "llama-kvp-stage.h"
#include "llama-kvp-impl.h"
#include "llama-kvp-memory.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <vector>

//
// the fit (pure)
//

// solves A X = B for a symmetric positive definite A [n][n] (row-major; overwritten by its Cholesky factor) and
// B [n][nrhs] (overwritten by X); false if A is not positive definite
static bool llama_kvp_chol_solve(std::vector<double> & a, int32_t n, std::vector<double> & b, int32_t nrhs) {
    for (int32_t j = 0; j < n; ++j) {
        double s = a[(size_t) j*n + j];
        for (int32_t k = 0; k < j; ++k) {
            s -= a[(size_t) j*n + k]*a[(size_t) j*n + k];
        }
        if (!(s > 0.0) || !std::isfinite(s)) {
            return false;
        }
        const double ljj = std::sqrt(s);
        a[(size_t) j*n + j] = ljj;
        for (int32_t i = j + 1; i < n; ++i) {
            double t = a[(size_t) i*n + j];
            for (int32_t k = 0; k < j; ++k) {
                t -= a[(size_t) i*n + k]*a[(size_t) j*n + k];
            }
            a[(size_t) i*n + j] = t/ljj;
        }
    }
    for (int32_t c = 0; c < nrhs; ++c) {
        // L y = b, then L^T x = y
        for (int32_t i = 0; i < n; ++i) {
            double t = b[(size_t) i*nrhs + c];
            for (int32_t k = 0; k < i; ++k) {
                t -= a[(size_t) i*n + k]*b[(size_t) k*nrhs + c];
            }
            b[(size_t) i*nrhs + c] = t/a[(size_t) i*n + i];
        }
        for (int32_t i = n - 1; i >= 0; --i) {
            double t = b[(size_t) i*nrhs + c];
            for (int32_t k = i + 1; k < n; ++k) {
                t -= a[(size_t) k*n + i]*b[(size_t) k*nrhs + c];
            }
            b[(size_t) i*nrhs + c] = t/a[(size_t) i*n + i];
        }
    }
    return true;
}

// ridge strengths, relative to the mean diagonal of the normal equations. The keys' ridge decides how the fit
// generalises from the window's queries to later ones (measured, SmolLM2, 2k-token text, SnapKV at 192 tokens per
// layer, streamed KL against the full cache: 1e-3 0.18, 3e-2 0.049, 1e-1 0.049, 1 0.053, 100 (the runs' mean keys)
// 0.057; plain eviction 0.049). Values towards the runs' means with a strong ridge (10) gave 0.34.
static constexpr double LLAMA_KVP_SUM_RIDGE_K = 3e-2;
static constexpr double LLAMA_KVP_SUM_RIDGE_V = 1e-2;

// weight of the values in the grouping of a bin's tokens (rows [k, w*s*v], s equalising the mean norms; 0: keys
// alone). Chosen on the essays KL text (10%, lam=2, streamed KL, SnapKV / entropy): 0 0.0343 / 0.0282, 0.25 0.0352 /
// 0.0281, 0.35 0.0322 / 0.0301, 0.5 0.0297 / 0.0262, 0.7 0.0318 / 0.0274, 1 0.0335 / 0.0308. On ten texts never used for
// the choice (docs/NOTES.md) it lowers the geometric mean of the ratio to eviction in 7 of 8 (budget, policy, set)
// cells: a centroid of tokens with similar keys and values blends fewer different values.
static constexpr double LLAMA_KVP_SUM_GROUP_V = 0.5;

int32_t llama_kvp_summarise_fit(const float * q, int32_t m, const float * k, const float * v, int32_t n, int32_t d, int32_t dv,
                                float scale, int32_t rank, float * k_out, float * v_out, int32_t * cnt_out, float * err_out) {
    if (!q || !k || !v || !k_out || !v_out || !cnt_out || m < 1 || d < 1 || dv < 1 || n < 2 || rank < 1 || rank >= n ||
        rank > d || !(scale > 0.0f)) {
        llama_kvp_set_error("summarise fit: needs m >= 1 queries, n >= 2 tokens, 1 <= rank < n, rank <= d and scale > 0");
        return -1;
    }
    const double s = scale;

    // runs of consecutive tokens
    std::vector<int32_t> r0(rank + 1);
    for (int32_t r = 0; r <= rank; ++r) {
        r0[r] = (int32_t) (((int64_t) r*n)/rank);
    }
    for (int32_t r = 0; r < rank; ++r) {
        cnt_out[r] = r0[r + 1] - r0[r];
    }

    // logits of the reference queries over the bin, the bin's log mass and attention output per query (the
    // products in float with contiguous inner loops, which the compiler vectorises; sums of exponentials in double)
    std::vector<float> kt((size_t) d*n); // K transposed
    for (int32_t j = 0; j < n; ++j) {
        for (int32_t e = 0; e < d; ++e) {
            kt[(size_t) e*n + j] = k[(size_t) j*d + e];
        }
    }
    std::vector<double> lg((size_t) m*n);
    std::vector<double> lse_run((size_t) m*rank);
    std::vector<double> lse_bin(m);
    std::vector<double> t((size_t) m*dv, 0.0);
    std::vector<float>  row(n);
    std::vector<double> ex(n); // exp(logit - the query's largest)
    std::vector<float>  ti(dv);
    for (int32_t i = 0; i < m; ++i) {
        const float * qi = q + (size_t) i*d;
        std::fill(row.begin(), row.end(), 0.0f);
        for (int32_t e = 0; e < d; ++e) {
            const float   qe = qi[e];
            const float * ke = kt.data() + (size_t) e*n;
            for (int32_t j = 0; j < n; ++j) {
                row[j] += qe*ke[j];
            }
        }
        double mx = -INFINITY;
        for (int32_t j = 0; j < n; ++j) {
            lg[(size_t) i*n + j] = s*row[j];
            mx = std::max(mx, lg[(size_t) i*n + j]);
        }
        double z = 0.0;
        std::fill(ti.begin(), ti.end(), 0.0f);
        for (int32_t j = 0; j < n; ++j) {
            const double p  = std::exp(lg[(size_t) i*n + j] - mx);
            const float  pf = (float) p;
            ex[j] = p;
            z += p;
            const float * vj = v + (size_t) j*dv;
            for (int32_t e = 0; e < dv; ++e) {
                ti[e] += pf*vj[e];
            }
        }
        for (int32_t e = 0; e < dv; ++e) {
            t[(size_t) i*dv + e] = ti[e]/z;
        }
        lse_bin[i] = mx + std::log(z);
        // each run's log mass from the same exponentials; a run whose terms all underflow (logits ~700 below the
        // query's largest) again with its own maximum
        for (int32_t r = 0; r < rank; ++r) {
            double zr = 0.0;
            for (int32_t j = r0[r]; j < r0[r + 1]; ++j) {
                zr += ex[j];
            }
            if (zr > 1e-280) {
                lse_run[(size_t) i*rank + r] = mx + std::log(zr);
                continue;
            }
            double mr = -INFINITY;
            for (int32_t j = r0[r]; j < r0[r + 1]; ++j) {
                mr = std::max(mr, lg[(size_t) i*n + j]);
            }
            zr = 0.0;
            for (int32_t j = r0[r]; j < r0[r + 1]; ++j) {
                zr += std::exp(lg[(size_t) i*n + j] - mr);
            }
            lse_run[(size_t) i*rank + r] = mr + std::log(zr);
        }
    }

    // keys: (s^2 Q^T Q + lambda I) k_r = s Q^T (lse_run_r - log c_r) + lambda mean_r(k)
    std::vector<float> af((size_t) d*d, 0.0f);
    for (int32_t i = 0; i < m; ++i) {
        const float * qi = q + (size_t) i*d;
        for (int32_t e = 0; e < d; ++e) {
            const float qe = qi[e];
            float * ae = af.data() + (size_t) e*d;
            for (int32_t f = 0; f <= e; ++f) {
                ae[f] += qe*qi[f];
            }
        }
    }
    std::vector<double> a((size_t) d*d);
    double tr = 0.0;
    for (int32_t e = 0; e < d; ++e) {
        for (int32_t f = 0; f <= e; ++f) {
            a[(size_t) e*d + f] = a[(size_t) f*d + e] = s*s*af[(size_t) e*d + f];
        }
        tr += a[(size_t) e*d + e];
    }
    const double lam = LLAMA_KVP_SUM_RIDGE_K*tr/d + 1e-12;
    for (int32_t e = 0; e < d; ++e) {
        a[(size_t) e*d + e] += lam;
    }
    std::vector<double> bk((size_t) d*rank, 0.0); // [d][rank]
    for (int32_t r = 0; r < rank; ++r) {
        const double lc = std::log((double) cnt_out[r]);
        for (int32_t i = 0; i < m; ++i) {
            const double y = lse_run[(size_t) i*rank + r] - lc;
            const float * qi = q + (size_t) i*d;
            for (int32_t e = 0; e < d; ++e) {
                bk[(size_t) e*rank + r] += s*qi[e]*y;
            }
        }
        for (int32_t j = r0[r]; j < r0[r + 1]; ++j) {
            for (int32_t e = 0; e < d; ++e) {
                bk[(size_t) e*rank + r] += lam*k[(size_t) j*d + e]/cnt_out[r];
            }
        }
    }
    if (!llama_kvp_chol_solve(a, d, bk, rank)) {
        llama_kvp_set_error("summarise fit: the key system is not positive definite");
        return -1;
    }

    // the centroids' share of each reference query's attention over the bin
    std::vector<double> p((size_t) m*rank);
    double lse_err = 0.0;
    for (int32_t i = 0; i < m; ++i) {
        const float * qi = q + (size_t) i*d;
        double mx = -INFINITY;
        for (int32_t r = 0; r < rank; ++r) {
            double dot = 0.0;
            for (int32_t e = 0; e < d; ++e) {
                dot += (double) qi[e]*bk[(size_t) e*rank + r];
            }
            p[(size_t) i*rank + r] = s*dot + std::log((double) cnt_out[r]);
            mx = std::max(mx, p[(size_t) i*rank + r]);
        }
        double z = 0.0;
        for (int32_t r = 0; r < rank; ++r) {
            p[(size_t) i*rank + r] = std::exp(p[(size_t) i*rank + r] - mx);
            z += p[(size_t) i*rank + r];
        }
        for (int32_t r = 0; r < rank; ++r) {
            p[(size_t) i*rank + r] /= z;
        }
        lse_err += std::fabs(mx + std::log(z) - lse_bin[i]);
    }

    // values: (P^T P + mu I) V_c = P^T T + mu mean_r(v)
    std::vector<double> b((size_t) rank*rank, 0.0);
    std::vector<double> bv((size_t) rank*dv, 0.0);
    for (int32_t i = 0; i < m; ++i) {
        for (int32_t r = 0; r < rank; ++r) {
            const double pr = p[(size_t) i*rank + r];
            for (int32_t c = 0; c < rank; ++c) {
                b[(size_t) r*rank + c] += pr*p[(size_t) i*rank + c];
            }
            for (int32_t e = 0; e < dv; ++e) {
                bv[(size_t) r*dv + e] += pr*t[(size_t) i*dv + e];
            }
        }
    }
    double trp = 0.0;
    for (int32_t r = 0; r < rank; ++r) {
        trp += b[(size_t) r*rank + r];
    }
    const double mu = LLAMA_KVP_SUM_RIDGE_V*trp/rank + 1e-12;
    for (int32_t r = 0; r < rank; ++r) {
        b[(size_t) r*rank + r] += mu;
        for (int32_t j = r0[r]; j < r0[r + 1]; ++j) {
            for (int32_t e = 0; e < dv; ++e) {
                bv[(size_t) r*dv + e] += mu*v[(size_t) j*dv + e]/cnt_out[r];
            }
        }
    }
    if (!llama_kvp_chol_solve(b, rank, bv, dv)) {
        llama_kvp_set_error("summarise fit: the value system is not positive definite");
        return -1;
    }

    // relative error of the bin's attention output
    double num = 0.0;
    double den = 0.0;
    for (int32_t i = 0; i < m; ++i) {
        for (int32_t e = 0; e < dv; ++e) {
            double o = 0.0;
            for (int32_t r = 0; r < rank; ++r) {
                o += p[(size_t) i*rank + r]*bv[(size_t) r*dv + e];
            }
            const double x = t[(size_t) i*dv + e];
            num += (o - x)*(o - x);
            den += x*x;
        }
    }

    bool finite = true;
    for (int32_t r = 0; r < rank; ++r) {
        for (int32_t e = 0; e < d; ++e) {
            k_out[(size_t) r*d + e] = (float) bk[(size_t) e*rank + r];
            finite = finite && std::isfinite(k_out[(size_t) r*d + e]);
        }
        for (int32_t e = 0; e < dv; ++e) {
            v_out[(size_t) r*dv + e] = (float) bv[(size_t) r*dv + e];
            finite = finite && std::isfinite(v_out[(size_t) r*dv + e]);
        }
    }
    if (err_out) {
        err_out[0] = (float) std::sqrt(num/std::max(den, 1e-30));
        err_out[1] = (float) (lse_err/m);
    }
    if (!finite) {
        llama_kvp_set_error("summarise fit: the centroids are not finite");
        return -1;
    }
    return 0;
}

//
// the per-layer bin
//

struct llama_kvp_summarise_state : llama_kvp_layer_state {
    std::vector<llama_pos> pos;    // pending tokens, in the order they left
    std::vector<float>     score;  // their eviction scores
    std::vector<uint8_t>   k;      // their K rows (n_embd_k_gqa values each, of type `type`), their V rows
    std::vector<uint8_t>   v;      // (n_embd_v_gqa each)
    ggml_type              type  = GGML_TYPE_COUNT; // the rows' type, set at the first leavers (llama_kvp_summarise_bin_type)
    size_t                 row_k = 0; // bytes per K row, per V row
    size_t                 row_v = 0;
    std::vector<uint32_t>  unread; // cells of the last pending tokens, whose K and V rows are not read yet (until the
                                   // end of the eviction pass: llama_kvp_fate_summarise::read_leavers)
    std::vector<llama_pos> done;   // positions summarised (telemetry), bin after bin
    std::vector<uint32_t>  done_end; // where each bin's positions end in done
    llama_pos              pos_max = -1; // the largest position pending or summarised (forget has nothing past it)
    std::vector<std::pair<int32_t, int32_t>> closing; // bins that closed in this step's eviction: (tokens, centroids),
                                                      // the first pending tokens in this order (fitted in after_evictions)

    int64_t host_bytes = 0;  // the host bytes of k and v as counted in the memory's host_bytes (allocated)

    int64_t n_bins     = 0;
    int64_t n_fallback = 0;
    int64_t n_dropped  = 0;  // centroids dropped: evicted in turn, or no cell left for them when their bin was fitted
    int64_t n_tokens   = 0;
    int64_t n_fit      = 0;  // (bin, KV head) fits, the denominator of the errors
    double  err_sum    = 0.0;
    double  lse_sum    = 0.0;
    double  t_ms       = 0.0;
};

// counts a layer's pending bin, as allocated, in the memory's host bytes (the fate stage's host memory, not in the
// cache's bytes) and their peak: the change since it was last counted, so that every sequence's bins add up
static void llama_kvp_summarise_count_host(llama_kvp_memory & mem, llama_kvp_summarise_state & S) {
    const int64_t bytes = (int64_t) (S.k.capacity() + S.v.capacity());
    mem.host_bytes     += bytes - S.host_bytes;
    mem.host_bytes_peak = std::max(mem.host_bytes_peak, mem.host_bytes);
    S.host_bytes        = bytes;
}

// the type of a bin's pending K/V rows: q8_0 (1.06 bytes a value, about half of f16; each value rounded to 1/254 of
// its block's largest magnitude at most, far below the fit's own error on the window's queries, ~0.28) when every
// head's keys and values are whole q8_0 blocks, so that a fit reads one head's part of a row alone; f16 otherwise
static ggml_type llama_kvp_summarise_bin_type(int64_t d, int64_t dv) {
    const int64_t qk = ggml_blck_size(GGML_TYPE_Q8_0);
    return d > 0 && dv > 0 && d % qk == 0 && dv % qk == 0 ? GGML_TYPE_Q8_0 : GGML_TYPE_F16;
}

// values [off, off + n) of a pending row of type t as f32 (off and n whole blocks of t)
static void llama_kvp_summarise_row_get(const uint8_t * row, ggml_type t, int64_t off, int64_t n, float * out) {
    ggml_get_type_traits(t)->to_float(row + ggml_row_size(t, off), out, n);
}

// the bin state of KV layer ikv (nullptr if no token left it yet)
static llama_kvp_summarise_state * llama_kvp_summarise_find(llama_kvp_memory & mem, size_t ikv) {
    auto & L = mem.layers[ikv];
    return L.fate ? static_cast<llama_kvp_summarise_state *>(L.fate.get()) : nullptr;
}

// a bin that closed: its tokens are the layer's pending [off, off + n), fitted into `rank` centroids per KV head
struct llama_kvp_summarise_job {
    int32_t ikv   = 0;
    int32_t off   = 0;
    int32_t n     = 0;
    int32_t rank  = 0;
    int32_t n_q   = 0;     // reference queries (the layer's observation window)
    float   scale = 0.0f;
    std::vector<float>   q;     // [n_q][n_head*n_embd_head]
    std::vector<float>   kc;    // centroids [rank][n_embd_k_gqa]
    std::vector<float>   vc;    // [rank][n_embd_v_gqa]
    std::vector<int32_t> cnt;   // tokens per centroid
    std::vector<char>    ok_h;  // per KV head: the fit succeeded
    std::vector<float>   err_h; // per KV head: output and log-mass errors
};

static llama_kvp_summarise_state & llama_kvp_summarise_of(llama_kvp_mem_layer & L) {
    if (!L.fate) {
        L.fate = std::make_unique<llama_kvp_summarise_state>();
    }
    return static_cast<llama_kvp_summarise_state &>(*L.fate);
}

// orders tokens idx[0..n) (rows of k [*][d]) so that the groups of sizes r0[g+1] - r0[g], g in [g0, g1), are
// contiguous and each holds similar keys: the set is split by its projection on its principal direction (power
// iteration on the centred keys, in float with contiguous inner loops), recursively, into parts of the required sizes;
// c is scratch of n*d floats
static void llama_kvp_group_keys(const float * k, int32_t d, int32_t * idx, int32_t n, const std::vector<int32_t> & r0,
                                 int32_t g0, int32_t g1, float * c) {
    if (g1 - g0 <= 1 || n <= 1) {
        return;
    }
    std::vector<double> mean(d, 0.0);
    for (int32_t j = 0; j < n; ++j) {
        const float * kj = k + (size_t) idx[j]*d;
        for (int32_t e = 0; e < d; ++e) {
            mean[e] += kj[e];
        }
    }
    for (auto & x : mean) {
        x /= n;
    }
    // the centred keys, once
    for (int32_t j = 0; j < n; ++j) {
        const float * kj = k + (size_t) idx[j]*d;
        float       * cj = c + (size_t) j*d;
        for (int32_t e = 0; e < d; ++e) {
            cj[e] = (float) (kj[e] - mean[e]);
        }
    }
    std::vector<float> u(d, 1.0f/std::sqrt((float) d));
    std::vector<float> w(d);
    std::vector<float> t(n);
    auto project = [&]() { // t = C u
        for (int32_t j = 0; j < n; ++j) {
            const float * cj = c + (size_t) j*d;
            float acc = 0.0f;
            for (int32_t e = 0; e < d; ++e) {
                acc += cj[e]*u[e];
            }
            t[j] = acc;
        }
    };
    for (int it = 0; it < 12; ++it) {
        project();
        std::fill(w.begin(), w.end(), 0.0f); // w = C^T t
        for (int32_t j = 0; j < n; ++j) {
            const float * cj = c + (size_t) j*d;
            const float   tj = t[j];
            for (int32_t e = 0; e < d; ++e) {
                w[e] += tj*cj[e];
            }
        }
        double nrm = 0.0;
        for (float x : w) {
            nrm += (double) x*x;
        }
        nrm = std::sqrt(nrm);
        if (!(nrm > 0.0)) {
            break;
        }
        for (int32_t e = 0; e < d; ++e) {
            u[e] = (float) (w[e]/nrm);
        }
    }
    project();
    std::vector<std::pair<float, int32_t>> order(n);
    for (int32_t j = 0; j < n; ++j) {
        order[j] = { t[j], idx[j] };
    }
    std::sort(order.begin(), order.end());
    for (int32_t j = 0; j < n; ++j) {
        idx[j] = order[j].second;
    }
    const int32_t gm     = (g0 + g1)/2;
    const int32_t n_left = r0[gm] - r0[g0];
    llama_kvp_group_keys(k, d, idx,          n_left,     r0, g0, gm, c);
    llama_kvp_group_keys(k, d, idx + n_left, n - n_left, r0, gm, g1, c);
}

// the bins that close when n tokens are pending: every full bin of `bin` tokens with `rank` centroids; then, on a
// ubatch shorter than a prompt chunk (a decode step, a streamed chunk, a prompt's short last chunk) or where a prompt
// has been computed (ubatch_ends: the memory settles its end, llama_kvp_memory::ubatch_done), the rest too if it is worth
// at least two centroids (2*bin/rank tokens), with rank*rest/bin of them. Measured (SmolLM2, essays KL text, 2k
// tokens at 10%, 768/12): without the rest, the prompt's last up to bin-1 leavers wait unsummarised while the stream
// is scored; with it, SnapKV's streamed KL 0.0397 against 0.0522 for eviction. A rest of one centroid's worth is not
// fitted: one centroid per KV head stands for dissimilar keys (64/1: 2.4x eviction's KL).
struct llama_kvp_summarise_bins {
    int32_t n_full    = 0; // full bins
    int32_t n_rest    = 0; // tokens of the rest fitted (0: none)
    int32_t rank_rest = 0; // its centroids

    llama_kvp_summarise_bins(const llama_kvp_memory & mem, size_t n) {
        const int32_t bin  = mem.policy.bin;
        const int32_t rank = mem.policy.rank;
        n_full = (int32_t) (n/bin);
        const int64_t rest = (int64_t) (n % bin);
        const bool ends = mem.n_ubatch_cur < mem.chunk || mem.ubatch_ends; // a step, a short chunk, a prompt's end
        if (ends && rank >= 2 && rest*rank >= 2*(int64_t) bin) {
            n_rest    = (int32_t) rest;
            rank_rest = (int32_t) std::max<int64_t>(2, std::min<int64_t>((rest*rank + bin/2)/bin, rest - 1));
        }
    }

    uint32_t n_cells(const llama_kvp_policy & p) const { return (uint32_t) (n_full*p.rank + rank_rest); }
};

// the λ of the token order: `lam`, or with lam = -1 (the default) 2 where the window has two or more queries and 0
// (the retention policy's order) where it has one (H2O). Measured (SmolLM2, essays KL text, 10% of 1.8k tokens, 768/12,
// streamed KL at equal bytes): SnapKV 0 0.0397, 0.25 0.0378, 0.5 0.0353, 1 0.0353, 2 0.0343, 4 0.0351, 8 0.0359;
// entropy 0 0.0333, 0.5 0.0313, 1 0.0324, 2 0.0282, 4 0.0288 (eviction alone 0.0522 and 0.0459)
static float llama_kvp_summarise_lam(const llama_kvp_policy & p) {
    if (p.lam >= 0.0f) {
        return p.lam;
    }
    return p.window >= 2 ? 2.0f : 0.0f;
}

struct llama_kvp_fate_summarise : llama_kvp_fate_stage {
    llama_kvp_fate_summarise() : llama_kvp_fate_stage(LLAMA_KVP_FATE_SUMMARISE, LLAMA_KVP_SLOT_FATE, "summarise", "bin,rank,lam",
            "leaving tokens go to a bin of `bin` tokens per layer, replaced by `rank` fitted centroid cells when full (a rest of 2*bin/rank or more when a prompt ends)") {}

    // 768 tokens in 12 centroids (64 tokens per centroid cell): large bins group the prompt's many leavers into
    // centroids of similar keys and leave more of the budget to real tokens (docs/NOTES.md, issue 14)
    void defaults(llama_kvp_policy & p) const override {
        p.bin  = 768;
        p.rank = 12;
        p.lam  = -1.0f;
    }

    std::string check(const llama_kvp_policy & p) const override {
        char buf[160];
        if (p.bin < 2) {
            snprintf(buf, sizeof(buf), "bin must be >= 2 tokens (got %d)", p.bin);
            return buf;
        }
        if (p.rank < 1 || p.rank >= p.bin) {
            snprintf(buf, sizeof(buf), "rank must be >= 1 and below bin=%d (got %d)", p.bin, p.rank);
            return buf;
        }
        if (!(p.lam == -1.0f || (p.lam >= 0.0f && p.lam <= 16.0f))) {
            snprintf(buf, sizeof(buf), "lam must be in [0, 16], or -1 for the default (got %g)", (double) p.lam);
            return buf;
        }
        if (p.lam > 0.0f && p.window < 2) {
            snprintf(buf, sizeof(buf), "lam needs an observation window of 2 or more queries (window=%d): the entropy is over them", p.window);
            return buf;
        }
        if (!llama_kvp_budget_of(p)) {
            return "summarise needs a retention policy (a budget stage): without one no token leaves the cache";
        }
        const auto * score = llama_kvp_score_of(p);
        if (!score || !score->observes()) {
            return "summarise needs a score stage that observes (window, accumulated): its reference queries are the observation window's";
        }
        return "";
    }

    std::string check_model(const llama_kvp_policy & p, int32_t n_embd_head, uint32_t n_ctx_seq) const override {
        char buf[160];
        if (p.rank > n_embd_head) {
            snprintf(buf, sizeof(buf), "rank must be <= the head size %d (got %d)", n_embd_head, p.rank);
            return buf;
        }
        if ((uint32_t) p.bin > n_ctx_seq && (p.rank < 2 || 2*(int64_t) p.bin > (int64_t) p.rank*n_ctx_seq)) {
            // a layer's leavers are fewer than its positions: no bin fills, and no rest is worth two centroids
            snprintf(buf, sizeof(buf), "bin=%d never fills in this context (n_ctx=%u), nor a rest of it worth two of its "
                    "%d centroids (2*bin/rank tokens)", p.bin, n_ctx_seq, p.rank);
            return buf;
        }
        return "";
    }

    uint32_t n_added(const llama_kvp_memory & mem, int32_t ikv, uint32_t n_leaving) const override {
        const auto & L = mem.layers[ikv];
        const size_t n_pending = L.fate ? static_cast<const llama_kvp_summarise_state &>(*L.fate).pos.size() : 0;
        return llama_kvp_summarise_bins(mem, n_pending + n_leaving).n_cells(mem.policy);
    }

    // with lam > 0, the seed's ordering: a middle token leaves by log(score) - lam*H, H the entropy of its head-mean
    // attention over the window's queries that saw it, normalised to [0, 1] (llama_kvp_obs_layer_query_entropy); the
    // score is multiplied by exp(-lam*H), so its scale does not matter. A token attended evenly by every query
    // (H near 1) goes to a bin before one that a few queries attend as much in all (H low). Tokens without two
    // queries' rows keep their score.
    void rescore(const llama_kvp_memory & mem, int32_t ikv, uint32_t i0, uint32_t i1, std::vector<llama_kvp_cell> & cells) const override {
        const float lam = llama_kvp_summarise_lam(mem.policy);
        if (!(lam > 0.0f) || !mem.st || i1 <= i0) {
            return;
        }
        const std::vector<float>     * ent = nullptr;
        const std::vector<llama_pos> * pos = nullptr;
        const int32_t n_kv = llama_kvp_obs_layer_query_entropy_at_obs(mem.st, ikv, &ent, &pos);
        for (uint32_t i = i0; i < i1; ++i) {
            auto & c = cells[i];
            if (c.idx < (uint32_t) n_kv && (*pos)[c.idx] == c.pos && (*ent)[c.idx] >= 0.0f && c.score > 0.0f) {
                c.score *= std::exp(-lam*(*ent)[c.idx]);
            }
        }
    }

    // the leavers join the bin; their K and V rows are read later, for every layer at once (read_leavers): from
    // device memory that is one transfer per step instead of a few per layer. Their cells are free now, and nothing
    // writes them before the rows are read (the end of the eviction pass, or a resize of the layer, comes first)
    bool uses_query_entropy(const llama_kvp_policy & p) const override {
        return llama_kvp_summarise_lam(p) > 0.0f;
    }

    void leave(llama_kvp_memory & mem, int32_t ikv, const std::vector<llama_kvp_cell> & leaving) const override {
        const auto t0 = std::chrono::steady_clock::now();
        auto & L = mem.layers[ikv];
        auto & S = llama_kvp_summarise_of(L);
        for (const auto & c : leaving) {
            if (L.bias.count(c.pos)) {
                mem.cell_free(ikv, c.idx); // a centroid leaving is dropped
                S.n_dropped++;
                continue;
            }
            S.pos.push_back(c.pos);
            S.pos_max = std::max(S.pos_max, c.pos);
            S.score.push_back(c.score);
            S.unread.push_back(c.idx);
            mem.cell_free(ikv, c.idx);
        }

        const llama_kvp_summarise_bins bins(mem, S.pos.size());
        S.closing.clear();
        for (int32_t b = 0; b < bins.n_full; ++b) {
            S.closing.emplace_back(mem.policy.bin, mem.policy.rank);
        }
        if (bins.n_rest > 0) {
            S.closing.emplace_back(bins.n_rest, bins.rank_rest);
        }
        S.t_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    }

    void before_resize(llama_kvp_memory & mem, int32_t ikv) const override {
        (void) ikv;
        read_leavers(mem);
    }
    // the prompt's last leavers are evicted and fitted as soon as the prompt is computed, not at the first decode step
    // (kvbench, 4k prompt at 10%: that step took ~170 ms of fits, 0.89x eviction's decode over 128 steps)
    bool settles_prompt_end() const override { return true; }

    // the bins that closed in every layer's eviction of this step, fitted together: one task per (bin, KV head),
    // shared out among the context's threads (the compute threads are idle while the memory evicts); the same
    // results for any number of threads
    void after_evictions(llama_kvp_memory & mem) const override {
        read_leavers(mem);
        const auto t0 = std::chrono::steady_clock::now();
        llama_kvp_context * st = mem.st;
        std::vector<llama_kvp_summarise_job> jobs;
        for (int32_t ikv = 0; ikv < (int32_t) mem.layers.size(); ++ikv) {
            llama_kvp_summarise_state * Sp = llama_kvp_summarise_find(mem, ikv);
            if (!Sp || Sp->closing.empty()) {
                continue;
            }
            auto & S = *Sp;
            std::vector<float> qbuf;
            const int32_t n_q   = st ? llama_kvp_obs_layer_queries(st, ikv, qbuf) : 0;
            const float   scale = st ? st->layers[ikv].kq_scale : 0.0f;
            int32_t off = 0;
            for (const auto & c : S.closing) {
                llama_kvp_summarise_job j;
                j.ikv   = ikv;
                j.off   = off;
                j.n     = c.first;
                j.rank  = c.second;
                j.n_q   = n_q;
                j.scale = scale;
                j.q     = qbuf;
                off += c.first;
                jobs.push_back(std::move(j));
            }
        }
        if (jobs.empty()) {
            return;
        }
        const int32_t n_head_kv = st ? st->n_head_kv : 0;
        const bool    fits      = st && n_head_kv > 0 && st->n_head % n_head_kv == 0;
        std::vector<std::pair<int32_t, int32_t>> tasks; // (job, KV head)
        for (int32_t i = 0; i < (int32_t) jobs.size(); ++i) {
            auto & j = jobs[i];
            ggml_tensor * kt = llama_kvp_kv_access::layer_k(*mem.layers[j.ikv].kv, 0);
            ggml_tensor * vt = llama_kvp_kv_access::layer_v(*mem.layers[j.ikv].kv, 0);
            j.kc.assign((size_t) j.rank*kt->ne[0], 0.0f);
            j.vc.assign((size_t) j.rank*vt->ne[0], 0.0f);
            j.cnt.assign(j.rank, 0);
            j.ok_h.assign(std::max(n_head_kv, 1), 0);
            j.err_h.assign((size_t) 2*std::max(n_head_kv, 1), 0.0f);
            if (fits && j.n_q > 0 && j.scale > 0.0f) {
                for (int32_t h = 0; h < n_head_kv; ++h) {
                    tasks.emplace_back(i, h);
                }
            }
        }
        const int32_t n_threads = (int32_t) (mem.n_ubatch_cur > 1 ? mem.cparams.n_threads_batch : mem.cparams.n_threads);
        std::vector<std::vector<float>> scratch(std::max(1, n_threads));
        llama_kvp_run_tasks((int32_t) tasks.size(), n_threads, [&](int32_t t, int32_t thread) {
            auto & j = jobs[tasks[t].first];
            try {
                fit_head(mem, j, tasks[t].second, scratch[thread]);
            } catch (const std::exception &) {
                j.ok_h[tasks[t].second] = 0; // out of memory in a fit: its bin is dropped (a fallback), not the process
            }
        });
        const double t_fit = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();

        // the centroids into their layers, bin by bin in the order they closed (each layer's fit time: the fits' wall
        // time shared by tokens); then the fitted tokens leave the bin
        int64_t n_tokens = 0;
        for (const auto & j : jobs) {
            n_tokens += j.n;
        }
        for (auto & j : jobs) {
            auto & S = static_cast<llama_kvp_summarise_state &>(*mem.layers[j.ikv].fate);
            place_bin(mem, j, S, n_head_kv);
            S.t_ms += t_fit*(double) j.n/(double) n_tokens;
        }
        for (int32_t ikv = 0; ikv < (int32_t) mem.layers.size(); ++ikv) {
            llama_kvp_summarise_state * Sp = llama_kvp_summarise_find(mem, ikv);
            if (!Sp || Sp->closing.empty()) {
                continue;
            }
            auto & S = *Sp;
            int32_t n = 0;
            for (const auto & c : S.closing) {
                n += c.first;
            }
            S.pos.erase(S.pos.begin(), S.pos.begin() + n);
            S.score.erase(S.score.begin(), S.score.begin() + n);
            S.k.erase(S.k.begin(), S.k.begin() + (size_t) n*S.row_k);
            S.v.erase(S.v.begin(), S.v.begin() + (size_t) n*S.row_v);
            S.closing.clear();
            llama_kvp_summarise_count_host(mem, S);
        }
    }

    // the pending bin, so that a restored state fits the same bins: n, the rows' type and bytes per K and V row, the
    // count of positions summarised, the telemetry counters, those positions, then per pending token (pos, score),
    // then the K and V bytes. The fits' host time is not state (its slot holds 0): the same tokens give the same bytes
    void state_write(const llama_kvp_memory & mem, int32_t ikv, std::vector<uint8_t> & out) const override {
        const auto & L = mem.layers[ikv];
        if (!L.fate) {
            return;
        }
        const auto & S = static_cast<const llama_kvp_summarise_state &>(*L.fate);
        const uint32_t hdr[6] = { (uint32_t) S.pos.size(), (uint32_t) S.type, (uint32_t) S.row_k, (uint32_t) S.row_v,
                                  (uint32_t) S.done.size(), (uint32_t) S.done_end.size() };
        auto put = [&](const void * x, size_t n) { llama_kvp_state_put(out, x, n); };
        const int64_t cnt[5] = { S.n_bins, S.n_fallback, S.n_tokens, S.n_fit, S.n_dropped };
        const double  sum[3] = { S.err_sum, S.lse_sum, 0.0 };
        put(hdr, sizeof(hdr));
        put(cnt, sizeof(cnt));
        put(sum, sizeof(sum));
        put(S.done.data(), S.done.size()*sizeof(llama_pos));
        put(S.done_end.data(), S.done_end.size()*sizeof(uint32_t));
        for (size_t i = 0; i < S.pos.size(); ++i) {
            put(&S.pos[i],   sizeof(int32_t));
            put(&S.score[i], sizeof(float));
        }
        put(S.k.data(), S.k.size());
        put(S.v.data(), S.v.size());
    }

    void state_read(llama_kvp_memory & mem, int32_t ikv, const std::vector<uint8_t> & in) const override {
        if (in.empty()) {
            return;
        }
        auto & L = mem.layers[ikv];
        auto & S = llama_kvp_summarise_of(L);
        uint32_t hdr[6] = {};
        if (in.size() < sizeof(hdr)) {
            throw std::runtime_error("pykvcache: corrupt summarise bins in the state");
        }
        memcpy(hdr, in.data(), sizeof(hdr));
        const size_t n = hdr[0];
        const ggml_type type = (ggml_type) hdr[1];
        const int64_t n_embd_k = llama_kvp_kv_access::layer_k(*L.kv, 0)->ne[0];
        const int64_t n_embd_v = llama_kvp_kv_access::layer_v(*L.kv, 0)->ne[0];
        if (n > 0 && ((type != GGML_TYPE_F16 && type != GGML_TYPE_Q8_0) || hdr[2] != ggml_row_size(type, n_embd_k) ||
                      hdr[3] != ggml_row_size(type, n_embd_v))) {
            throw std::runtime_error("pykvcache: the summarise bins in this state were saved with other K/V sizes");
        }
        int64_t cnt[5] = {};
        double  sum[3] = {};
        if (in.size() != sizeof(hdr) + sizeof(cnt) + sizeof(sum) + (size_t) hdr[4]*sizeof(llama_pos) + (size_t) hdr[5]*sizeof(uint32_t) +
                         n*(8 + (size_t) hdr[2] + hdr[3])) {
            throw std::runtime_error("pykvcache: corrupt summarise bins in the state");
        }
        const uint8_t * x = in.data() + sizeof(hdr);
        memcpy(cnt, x, sizeof(cnt));
        x += sizeof(cnt);
        memcpy(sum, x, sizeof(sum));
        x += sizeof(sum);
        S.n_bins     = cnt[0];
        S.n_fallback = cnt[1];
        S.n_tokens   = cnt[2];
        S.n_fit      = cnt[3];
        S.n_dropped  = cnt[4];
        S.err_sum    = sum[0];
        S.lse_sum    = sum[1]; // sum[2]: the time slot, 0 (a context's fit time stays its own)
        S.done.resize(hdr[4]);
        memcpy(S.done.data(), x, S.done.size()*sizeof(llama_pos));
        x += S.done.size()*sizeof(llama_pos);
        S.done_end.resize(hdr[5]);
        memcpy(S.done_end.data(), x, S.done_end.size()*sizeof(uint32_t));
        x += S.done_end.size()*sizeof(uint32_t);
        if ((S.done_end.empty() ? 0 : S.done_end.back()) != S.done.size()) {
            throw std::runtime_error("pykvcache: corrupt summarise bins in the state");
        }
        S.pos.resize(n);
        S.score.resize(n);
        for (size_t i = 0; i < n; ++i, x += 8) {
            memcpy(&S.pos[i],   x,     4);
            memcpy(&S.score[i], x + 4, 4);
        }
        if (n > 0) {
            S.type  = type;
            S.row_k = hdr[2];
            S.row_v = hdr[3];
        }
        S.k.assign(x, x + n*S.row_k);
        x += n*S.row_k;
        S.v.assign(x, x + n*S.row_v);
        S.pos_max = -1;
        for (llama_pos p : S.pos) {
            S.pos_max = std::max(S.pos_max, p);
        }
        for (llama_pos p : S.done) {
            S.pos_max = std::max(S.pos_max, p);
        }
        llama_kvp_summarise_count_host(mem, S);
    }

    void forget(llama_kvp_memory & mem, llama_pos p0, llama_pos p1) const override {
        for (auto & L : mem.layers) {
            if (!L.fate) {
                continue;
            }
            auto & S = static_cast<llama_kvp_summarise_state &>(*L.fate);
            if (S.pos_max < p0) {
                continue; // a truncation past everything the bin holds (llama-cpp-python's eval does one per call)
            }
            size_t w = 0;
            for (size_t i = 0; i < S.pos.size(); ++i) {
                if (S.pos[i] >= p0 && (p1 < 0 || S.pos[i] < p1)) {
                    continue; // removed from the sequence
                }
                if (w != i) {
                    S.pos[w]   = S.pos[i];
                    S.score[w] = S.score[i];
                    std::copy_n(S.k.begin() + i*S.row_k, S.row_k, S.k.begin() + w*S.row_k);
                    std::copy_n(S.v.begin() + i*S.row_v, S.row_v, S.v.begin() + w*S.row_v);
                }
                w++;
            }
            S.pos.resize(w);
            S.score.resize(w);
            S.k.resize(w*S.row_k);
            S.v.resize(w*S.row_v);
            if (p0 <= 0 && p1 < 0) {
                S.done.clear();
                S.done_end.clear();
                S.k.shrink_to_fit(); // a cleared sequence gives its bin's host memory back
                S.v.shrink_to_fit();
            } else {
                // the positions removed, bin by bin (a bin left with none is gone)
                size_t   wd = 0;
                size_t   wb = 0;
                uint32_t b0 = 0;
                for (uint32_t b1 : S.done_end) {
                    for (uint32_t i = b0; i < b1; ++i) {
                        if (!(S.done[i] >= p0 && (p1 < 0 || S.done[i] < p1))) {
                            S.done[wd++] = S.done[i];
                        }
                    }
                    if (wd > (wb > 0 ? S.done_end[wb - 1] : 0)) {
                        S.done_end[wb++] = (uint32_t) wd;
                    }
                    b0 = b1;
                }
                S.done.resize(wd);
                S.done_end.resize(wb);
            }
            if (S.pos.empty() && S.done.empty()) {
                S.pos_max = -1;
            }
            llama_kvp_summarise_count_host(mem, S);
        }
    }

private:
    // the K and V rows of every layer's leavers not read yet, into their bins (in the bins' row type): one gather,
    // so from device memory one transfer for all layers (a transposed V: its elements gathered into rows on the
    // device; read element by element, a decode step over RPC took 390 ms instead of 15)
    void read_leavers(llama_kvp_memory & mem) const {
        const auto t0 = std::chrono::steady_clock::now();
        const bool v_trans = !mem.cparams.flash_attn; // as the memory made its caches
        llama_kvp_gather g;
        std::vector<std::vector<float>> kf(mem.layers.size());
        std::vector<std::vector<float>> vf(mem.layers.size());
        size_t n_all = 0;
        std::vector<size_t> todo; // layers with rows to read
        for (size_t ikv = 0; ikv < mem.layers.size(); ++ikv) {
            llama_kvp_summarise_state * Sp = llama_kvp_summarise_find(mem, ikv);
            if (!Sp || Sp->unread.empty()) {
                continue;
            }
            todo.push_back(ikv);
            auto & L = mem.layers[ikv];
            auto & S = *Sp;
            ggml_tensor * kt = llama_kvp_kv_access::layer_k(*L.kv, 0);
            ggml_tensor * vt = llama_kvp_kv_access::layer_v(*L.kv, 0);
            kf[ikv].resize(S.unread.size()*kt->ne[0]);
            vf[ikv].resize(S.unread.size()*vt->ne[0]);
            g.add_rows(kt, false,   L.kv->get_size(), S.unread, kf[ikv].data());
            g.add_rows(vt, v_trans, L.kv->get_size(), S.unread, vf[ikv].data());
            n_all += S.unread.size();
        }
        if (todo.empty()) {
            return;
        }
        g.run(mem.st);
        const double t_read = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        for (size_t ikv : todo) {
            auto & L = mem.layers[ikv];
            auto & S = *llama_kvp_summarise_find(mem, ikv);
            const auto t1 = std::chrono::steady_clock::now();
            const int64_t n_embd_k = llama_kvp_kv_access::layer_k(*L.kv, 0)->ne[0];
            const int64_t n_embd_v = llama_kvp_kv_access::layer_v(*L.kv, 0)->ne[0];
            if (S.type == GGML_TYPE_COUNT) {
                const int32_t n_head_kv = mem.st ? mem.st->n_head_kv : 0;
                S.type  = n_head_kv > 0 ? llama_kvp_summarise_bin_type(n_embd_k/n_head_kv, n_embd_v/n_head_kv) : GGML_TYPE_F16;
                S.row_k = ggml_row_size(S.type, n_embd_k);
                S.row_v = ggml_row_size(S.type, n_embd_v);
            }
            const ggml_from_float_t to_bin = ggml_get_type_traits(S.type)->from_float_ref;
            // room for a whole bin at once: the pending rows grow to `bin` (and past it by a prompt chunk's leavers)
            // without the doubling of one row at a time, which would hold up to twice the rows in host memory
            const size_t n0     = S.k.size()/S.row_k;
            const size_t n_rows = n0 + S.unread.size();
            if (S.k.capacity() < n_rows*S.row_k) {
                // no more than the layer's positions, whatever the bin (its rest is fitted where a prompt ends)
                const size_t rows = std::max<size_t>(n_rows, std::min<size_t>(mem.policy.bin, mem.cparams.n_ctx_seq));
                S.k.reserve(rows*S.row_k);
                S.v.reserve(rows*S.row_v);
            }
            S.k.resize(n_rows*S.row_k);
            S.v.resize(n_rows*S.row_v);
            for (size_t i = 0; i < S.unread.size(); ++i) {
                to_bin(kf[ikv].data() + i*n_embd_k, S.k.data() + (n0 + i)*S.row_k, n_embd_k);
                to_bin(vf[ikv].data() + i*n_embd_v, S.v.data() + (n0 + i)*S.row_v, n_embd_v);
            }
            const double t_conv = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t1).count();
            S.t_ms += t_read*(double) S.unread.size()/(double) n_all + t_conv; // the read's time shared by rows
            S.unread.clear();
            llama_kvp_summarise_count_host(mem, S);
        }
    }

    // fits the bin of job j for KV head h (its K and V of the bin's tokens, grouped by similar keys) into j.kc, j.vc
    void fit_head(const llama_kvp_memory & mem, llama_kvp_summarise_job & j, int32_t h, std::vector<float> & scratch) const {
        const llama_kvp_context * st = mem.st;
        const auto & S = static_cast<const llama_kvp_summarise_state &>(*mem.layers[j.ikv].fate);
        const int64_t n_embd_k  = (int64_t) (j.kc.size()/j.rank);
        const int64_t n_embd_v  = (int64_t) (j.vc.size()/j.rank);
        const int32_t n_head_kv = st->n_head_kv;
        const int32_t g  = st->n_head/n_head_kv;
        const int32_t d  = (int32_t) (n_embd_k/n_head_kv);
        const int32_t dv = (int32_t) (n_embd_v/n_head_kv);
        const int32_t m  = j.n_q*g;
        const int32_t n  = j.n;
        const int32_t rank = j.rank;
        std::vector<int32_t> r0(rank + 1); // the group sizes the fit uses
        for (int32_t r = 0; r <= rank; ++r) {
            r0[r] = (int32_t) (((int64_t) r*n)/rank);
        }
        std::vector<float> qh((size_t) m*d), kh((size_t) n*d), vh((size_t) n*dv), ko((size_t) rank*d), vo((size_t) rank*dv);
        const int32_t dg = d + dv; // a row of the grouping: the key, then the value scaled
        std::vector<float> kall((size_t) n*dg);
        std::vector<int32_t> grp(n);
        scratch.resize((size_t) n*dg);
        for (int32_t i = 0; i < j.n_q; ++i) {
            for (int32_t a = 0; a < g; ++a) {
                const float * src = j.q.data() + (size_t) i*st->n_head*st->n_embd_head + (size_t) (h*g + a)*st->n_embd_head;
                std::copy_n(src, d, qh.data() + (size_t) (i*g + a)*d);
            }
        }
        // this head's keys and values of the bin, split into groups of similar keys and values (the fit's runs): rows
        // [k, w*s*v], s the ratio of the bin's mean key norm to its mean value norm, w = LLAMA_KVP_SUM_GROUP_V
        const uint8_t * k0 = S.k.data() + (size_t) j.off*S.row_k;
        const uint8_t * v0 = S.v.data() + (size_t) j.off*S.row_v;
        double nk = 0.0;
        double nv = 0.0;
        for (int32_t t = 0; t < n; ++t) {
            float * row = kall.data() + (size_t) t*dg;
            llama_kvp_summarise_row_get(k0 + (size_t) t*S.row_k, S.type, (int64_t) h*d,  d,  row);
            llama_kvp_summarise_row_get(v0 + (size_t) t*S.row_v, S.type, (int64_t) h*dv, dv, row + d);
            double a = 0.0;
            double b = 0.0;
            for (int32_t e = 0; e < d; ++e) {
                a += (double) row[e]*row[e];
            }
            for (int32_t e = d; e < dg; ++e) {
                b += (double) row[e]*row[e];
            }
            nk += std::sqrt(a);
            nv += std::sqrt(b);
        }
        const float sv = nv > 0.0 ? (float) (LLAMA_KVP_SUM_GROUP_V*nk/nv) : 0.0f;
        for (int32_t t = 0; t < n; ++t) {
            float * row = kall.data() + (size_t) t*dg;
            for (int32_t e = d; e < dg; ++e) {
                row[e] *= sv;
            }
        }
        std::iota(grp.begin(), grp.end(), 0);
        llama_kvp_group_keys(kall.data(), dg, grp.data(), n, r0, 0, rank, scratch.data());
        for (int32_t t = 0; t < n; ++t) {
            std::copy_n(kall.data() + (size_t) grp[t]*dg, d, kh.data() + (size_t) t*d);
            llama_kvp_summarise_row_get(v0 + (size_t) grp[t]*S.row_v, S.type, (int64_t) h*dv, dv, vh.data() + (size_t) t*dv);
        }
        std::vector<int32_t> cnt(rank);
        j.ok_h[h] = llama_kvp_summarise_fit(qh.data(), m, kh.data(), vh.data(), n, d, dv, j.scale, rank,
                                            ko.data(), vo.data(), cnt.data(), j.err_h.data() + 2*h) == 0;
        if (j.ok_h[h]) {
            for (int32_t r = 0; r < rank; ++r) {
                std::copy_n(ko.data() + (size_t) r*d,  d,  j.kc.data() + (size_t) r*n_embd_k + (size_t) h*d);
                std::copy_n(vo.data() + (size_t) r*dv, dv, j.vc.data() + (size_t) r*n_embd_v + (size_t) h*dv);
            }
            if (h == 0) {
                j.cnt = cnt; // the same group sizes in every head
            }
        }
    }

    // puts the centroid cells of job j into its layer (or drops the bin if a head's fit failed)
    void place_bin(llama_kvp_memory & mem, const llama_kvp_summarise_job & j, llama_kvp_summarise_state & S, int32_t n_head_kv) const {
        auto & L = mem.layers[j.ikv];
        llama_kvp_context * st = mem.st;
        ggml_tensor * kt = llama_kvp_kv_access::layer_k(*L.kv, 0);
        ggml_tensor * vt = llama_kvp_kv_access::layer_v(*L.kv, 0);
        const int64_t n_embd_v = vt->ne[0];
        const bool    v_trans  = !mem.cparams.flash_attn; // as the memory made its caches
        const int32_t n    = j.n;
        const int32_t rank = j.rank;

        bool ok = n_head_kv > 0 && j.n_q > 0 && j.scale > 0.0f;
        for (int32_t h = 0; h < n_head_kv && ok; ++h) {
            ok = j.ok_h[h] != 0;
            if (ok) {
                S.err_sum += j.err_h[2*h];
                S.lse_sum += j.err_h[2*h + 1];
                S.n_fit++;
            }
        }
        if (!ok) {
            S.n_fallback++;
            return;
        }

        // the bin's tokens in position order (for the centroids' positions)
        std::vector<int32_t> ord(n);
        std::iota(ord.begin(), ord.end(), j.off);
        std::sort(ord.begin(), ord.end(), [&](int32_t a, int32_t b) { return S.pos[a] < S.pos[b]; });

        // the groups differ per head: the centroids take the bin's last `rank` positions (each cell its own
        // position; every later query sees the whole bin) and share its score
        float sc = 0.0f;
        for (int32_t t = 0; t < n; ++t) {
            sc += S.score[j.off + t];
        }
        sc /= rank;
        const size_t nb_k = llama_kvp_cell_bytes(kt, false);
        const size_t nb_v = llama_kvp_cell_bytes(vt, v_trans);
        const uint32_t size = L.kv->get_size();
        // the cells the ubatch about to run needs (after a prompt's end, the next step's token)
        const uint32_t n_next = mem.ubatch_ends ? 1 : std::max<uint32_t>(1, mem.n_ubatch_cur);
        std::vector<uint32_t>  idx;
        std::vector<llama_pos> pos;
        std::vector<uint8_t>   k_rows((size_t) rank*nb_k);
        std::vector<uint8_t>  v_rows((size_t) rank*nb_v);
        for (int32_t r = 0; r < rank; ++r) {
            // the memory evicts more tokens to make room for the centroids, but never the protected ones (sinks and
            // recent): where rank is a large share of bin at a small budget, the centroids left after them would
            // take the ubatch's cells, and its decode would fail; those are dropped instead
            const llama_pos p_last = S.pos[ord[n - rank + r]];
            const int32_t i = llama_kvp_kv_access::n_used(*L.kv) + n_next < size ? mem.cell_place(j.ikv, p_last, std::log((float) j.cnt[r])) : -1;
            if (i < 0) {
                S.n_dropped++;
                continue;
            }
            // in the cache's types (a transposed V is never quantized: its elements are its row's)
            ggml_quantize_chunk(kt->type, j.kc.data() + (size_t) r*kt->ne[0], k_rows.data() + idx.size()*nb_k, 0, 1, kt->ne[0], nullptr);
            ggml_quantize_chunk(vt->type, j.vc.data() + (size_t) r*n_embd_v,  v_rows.data() + idx.size()*nb_v, 0, 1, n_embd_v,  nullptr);
            idx.push_back((uint32_t) i);
            pos.push_back(p_last);
        }
        // the centroids' cells and their scores (their tokens' score until observed) written together: a few
        // transfers to device memory, not one per row or element
        if (st && !idx.empty()) {
            const std::vector<float> scs(idx.size(), sc);
            llama_kvp_obs_cells_set_score(st, j.ikv, idx.data(), pos.data(), scs.data(), idx.size(), nullptr);
        }
        llama_kvp_cells_write(kt, false,   size, idx, k_rows.data());
        llama_kvp_cells_write(vt, v_trans, size, idx, v_rows.data());
        for (int32_t t = 0; t < n; ++t) {
            S.done.push_back(S.pos[j.off + t]);
        }
        S.done_end.push_back((uint32_t) S.done.size());
        S.n_bins++;
        S.n_tokens += n;
    }
};

const llama_kvp_stage * llama_kvp_stage_fate_summarise() {
    static const llama_kvp_fate_summarise stage;
    return &stage;
}

// sums of the fit errors over the (bin, KV head) fits
struct llama_kvp_summarise_sums {
    double  err   = 0.0;
    double  lse   = 0.0;
    int64_t n_fit = 0;
};

// adds the summarise counters of KV layer ikv to out and sums (false if the layer has no summarise state); appends
// the positions it summarised to `summarised` and those waiting in its bin to `pending` when not null
static bool llama_kvp_summarise_layer_stats(const llama_kvp_memory & mem, int32_t ikv, llama_kvp_summary_stats & out,
                                     llama_kvp_summarise_sums & sums, std::vector<llama_pos> * summarised,
                                     std::vector<llama_pos> * pending) {
    const auto & L = mem.layers[ikv];
    out.n_centroids += (int32_t) L.bias.size();
    if (!L.fate) {
        return false;
    }
    const auto & S = static_cast<const llama_kvp_summarise_state &>(*L.fate);
    out.n_bins        += S.n_bins;
    out.n_fallback    += S.n_fallback;
    out.n_dropped     += S.n_dropped;
    out.n_tokens      += S.n_tokens;
    out.n_pending     += (int32_t) S.pos.size();
    out.pending_bytes += (int64_t) (S.k.size() + S.v.size());
    out.t_ms          += S.t_ms;
    sums.err  += S.err_sum;
    sums.lse  += S.lse_sum;
    sums.n_fit += S.n_fit;
    // a bin's tokens are summarised while one of its centroids is held (each sits at one of its tokens' positions)
    uint32_t b0 = 0;
    for (uint32_t b1 : S.done_end) {
        bool held = false;
        for (uint32_t i = b0; i < b1 && !held && summarised; ++i) {
            held = L.bias.count(S.done[i]) > 0;
        }
        if (held) {
            summarised->insert(summarised->end(), S.done.begin() + b0, S.done.begin() + b1);
        }
        b0 = b1;
    }
    if (pending) {
        pending->insert(pending->end(), S.pos.begin(), S.pos.end());
    }
    return true;
}

//
// C API (llama-kvp.h): the summaries of a context
//

static llama_kvp_memory * llama_kvp_summarising_mem(struct llama_context * ctx) {
    return llama_kvp_mem_with_fate(ctx, LLAMA_KVP_FATE_SUMMARISE, "the context's policy does not summarise (fate stage 'summarise')");
}

int32_t llama_kvp_summary(struct llama_context * ctx, struct llama_kvp_summary_stats * out) {
    llama_kvp_memory * mem = llama_kvp_summarising_mem(ctx);
    if (!mem || !llama_kvp_check_out(out)) {
        return -1;
    }
    *out = {};
    llama_kvp_summarise_sums sums;
    for (int32_t i = 0; i < (int32_t) mem->layers.size(); ++i) {
        llama_kvp_summarise_layer_stats(*mem, i, *out, sums, nullptr, nullptr);
    }
    out->fit_err     = sums.n_fit > 0 ? (float) (sums.err/sums.n_fit) : 0.0f;
    out->fit_lse_err = sums.n_fit > 0 ? (float) (sums.lse/sums.n_fit) : 0.0f;
    return 0;
}

// positions of a summarising layer's tokens that are summarised (pending: false) or waiting in its bin (true)
static int32_t llama_kvp_layer_summary_pos(struct llama_context * ctx, int32_t ikv, bool pending, int32_t * out, int32_t n_max) {
    llama_kvp_memory * mem = llama_kvp_summarising_mem(ctx);
    if (!mem || !llama_kvp_check_layer(mem, ikv)) {
        return -1;
    }
    llama_kvp_summary_stats tmp = {};
    llama_kvp_summarise_sums sums;
    std::vector<llama_pos> pos;
    llama_kvp_summarise_layer_stats(*mem, ikv, tmp, sums, pending ? nullptr : &pos, pending ? &pos : nullptr);
    for (int32_t i = 0; i < (int32_t) pos.size() && i < n_max && out; ++i) {
        out[i] = pos[i];
    }
    return (int32_t) pos.size();
}

int32_t llama_kvp_layer_summarised(struct llama_context * ctx, int32_t ikv, int32_t * out, int32_t n_max) {
    return llama_kvp_layer_summary_pos(ctx, ikv, false, out, n_max);
}

int32_t llama_kvp_layer_pending(struct llama_context * ctx, int32_t ikv, int32_t * out, int32_t n_max) {
    return llama_kvp_layer_summary_pos(ctx, ikv, true, out, n_max);
}
