// sparse-attn-cpu.cpp - CPU kernel of GGML_OP_SPARSE_ATTN_EXT (compiled into ggml-cpu).
//
// One task per (query block, head), handed out to the threads through the threadpool's chunk counter. A task keeps
// its query block in f32 and walks the key blocks it lists with the online softmax of the CPU flash-attention kernel
// (tiled path): KQ = Q K^T as a small GEMM, scale, softcap, mask, running max and sum, VKQ += softmax(KQ) V. Keys and
// values of any type with to_float are converted to f32 one block at a time. With the probabilities asked for
// (ggml_sparse_attn_ext_probs: every block), a task also keeps its rows' masked scores in the result's probability
// slices and turns them into exp(s - max)/sum once its final max and sum are known. A single query row with its
// probabilities (an observed decode step, F16 K and V) is split over the threads by cells instead, as flash
// attention's split-KV path splits a single query.

#include "ggml-sparse-attn.h"

#include "ggml-cpu.h"
#include "ggml-impl.h"
#include "simd-gemm.h"
#include "vec.h"
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__AVX__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#endif

// f32 scratch per thread: Q (qb*DK), KQ (qb*kb), mask (qb*kb), VKQ (qb*DV), V (kb*DV), K^T (kb*DK), K rows (kb*DK),
// max and sum (2*qb)
static size_t ggml_sparse_attn_ext_scratch(const ggml_tensor * dst) {
    const int64_t DK = dst->src[1]->ne[0];
    const int64_t DV = dst->src[2]->ne[0];
    const int64_t qb = ggml_sparse_attn_ext_q_block(dst);
    const int64_t kb = ggml_sparse_attn_ext_k_block(dst);
    return (size_t) (qb*DK + 2*qb*kb + qb*DV + kb*DV + 2*kb*DK + 2*qb + CACHE_LINE_SIZE_F32);
}

size_t ggml_cpu_sparse_attn_ext_work_size(const ggml_tensor * dst, int n_tasks) {
    return sizeof(float)*ggml_sparse_attn_ext_scratch(dst)*n_tasks;
}

// converts rows [c0, c0 + n) of k or v (one KV head) to f32, row-major [n][D]
static void ggml_sparse_attn_rows_f32(const ggml_tensor * t, int64_t c0, int64_t n, int64_t ih, float * out) {
    const int64_t D = t->ne[0];
    for (int64_t i = 0; i < n; ++i) {
        const char * row = (const char *) t->data + (c0 + i)*t->nb[1] + ih*t->nb[2];
        float * dst = out + i*D;
        switch (t->type) {
            case GGML_TYPE_F32: memcpy(dst, row, D*sizeof(float)); break;
            case GGML_TYPE_F16: ggml_cpu_fp16_to_fp32((const ggml_fp16_t *) row, dst, D); break;
            default:            ggml_get_type_traits(t->type)->to_float(row, dst, D); break;
        }
    }
}

// y += v*x for F16 x and F32 y (flash attention's ggml_vec_mad_f16 accumulates in F16)
static void ggml_sparse_attn_mad_f16(int64_t n, float * y, const ggml_fp16_t * x, float v) {
    int64_t i = 0;
#if defined(__AVX__) && defined(__F16C__) && defined(__FMA__)
    const __m256 vv = _mm256_set1_ps(v);
    for (; i + 8 <= n; i += 8) {
        const __m256 vx = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (x + i)));
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(vx, vv, _mm256_loadu_ps(y + i)));
    }
#endif
    for (; i < n; ++i) {
        y[i] += GGML_CPU_FP16_TO_FP32(x[i])*v;
    }
}

// the op's parameters, the scale divided by the softcap where there is one (scores are then softcap*tanh(q.k*scale))
static void ggml_sparse_attn_ext_scales(const ggml_tensor * dst, float * scale, float * max_bias, float * logit_softcap) {
    *scale         = 1.0f;
    *max_bias      = 0.0f;
    *logit_softcap = 0.0f;
    ggml_sparse_attn_ext_get_params(dst, scale, max_bias, logit_softcap);
    if (*logit_softcap != 0.0f) {
        *scale /= *logit_softcap;
    }
}

// ALiBi slope of head ih (1 without max_bias)
static float ggml_sparse_attn_ext_slope(float max_bias, int64_t n_head, int64_t ih) {
    if (max_bias <= 0.0f) {
        return 1.0f;
    }
    const uint32_t n_head_log2 = 1u << (uint32_t) floor(log2((double) n_head));
    const float m0 = powf(2.0f, -(max_bias       )/n_head_log2);
    const float m1 = powf(2.0f, -(max_bias / 2.0f)/n_head_log2);
    return ih < n_head_log2 ? powf(m0, ih + 1) : powf(m1, 2*(ih - n_head_log2) + 1);
}

// floats of a thread's scratch the split row path needs: Q in f32 and f16, VKQ, and per head its chunk's max, sum
// and VKQ (read by the other threads after the barrier)
static size_t ggml_sparse_attn_ext_split_scratch(const ggml_tensor * dst) {
    const int64_t DK = dst->src[1]->ne[0];
    const int64_t DV = dst->src[2]->ne[0];
    return (size_t) (2*DK + DV + dst->src[0]->ne[2]*(2 + DV));
}

// one query row (row iq of Q and of the mask) of head ih against the cells [c0, c1), for F16 K and V, scored as flash
// attention scores them (vec_dot_f16 of the scaled query): P[c] = exp(s_c - m) with m the chunk's max (0 where
// masked), VKQ = sum_c P[c] V_c (DV floats); returns m (-INFINITY: nothing visible, P 0) and the sum of P in *sum.
// Qf (DK floats) and Q16 (DK halves) are scratch.
static float ggml_sparse_attn_ext_row_f16_cells(const ggml_tensor * dst, int64_t iq, int64_t ih, int64_t c0, int64_t c1,
        float slope, float scale, float logit_softcap, float * P, float * VKQ, double * sum, float * Qf, ggml_fp16_t * Q16) {
    const ggml_tensor * q    = dst->src[0];
    const ggml_tensor * k    = dst->src[1];
    const ggml_tensor * v    = dst->src[2];
    const ggml_tensor * mask = dst->src[3];

    const int64_t DK     = k->ne[0];
    const int64_t DV     = v->ne[0];
    const int64_t n_head = q->ne[2];
    const int64_t ik     = ih/(n_head/k->ne[2]);
    const int64_t iv     = ih/(n_head/v->ne[2]);

    memcpy(Qf, (const char *) q->data + iq*q->nb[1] + ih*q->nb[2], DK*sizeof(float));
    ggml_vec_scale_f32((int) DK, Qf, scale);
    ggml_cpu_fp32_to_fp16(Qf, Q16, DK);

    const ggml_fp16_t * mrow = mask ? (const ggml_fp16_t *) ((const char *) mask->data + iq*mask->nb[1]) : nullptr;
    float m = -INFINITY;
    for (int64_t c = c0; c < c1; ++c) {
        const float mv = mrow ? slope*GGML_CPU_FP16_TO_FP32(mrow[c]) : 0.0f;
        if (mv == -INFINITY) {
            P[c] = -INFINITY;
            continue;
        }
        float sc = 0.0f;
        ggml_vec_dot_f16((int) DK, &sc, 0, (ggml_fp16_t *) ((char *) k->data + c*k->nb[1] + ik*k->nb[2]), 0, Q16, 0, 1);
        if (logit_softcap != 0.0f) {
            sc = logit_softcap*tanhf(sc);
        }
        P[c] = sc + mv;
        m = std::max(m, P[c]);
    }
    memset(VKQ, 0, DV*sizeof(float));
    *sum = 0.0;
    if (m == -INFINITY) {
        for (int64_t c = c0; c < c1; ++c) {
            P[c] = 0.0f;
        }
        return m;
    }
    *sum = ggml_vec_soft_max_f32((int) (c1 - c0), P + c0, P + c0, m); // exp(s - m), 0 where masked
    for (int64_t c = c0; c < c1; ++c) {
        if (P[c] != 0.0f) {
            ggml_sparse_attn_mad_f16(DV, VKQ, (const ggml_fp16_t *) ((const char *) v->data + c*v->nb[1] + iv*v->nb[2]), P[c]);
        }
    }
    return m;
}

// one query row with the probabilities kept, F16 K and V, split over the threads by cells as flash attention splits
// a single query (its split-KV path): each thread scores a contiguous chunk of cells for every head, so it reads
// only its share of the layer's K and V and the 9 heads of SmolLM2 do not leave one of 2 threads idle; the chunks'
// maxima, sums and partial outputs are then combined per head, and each thread turns its chunk's scores into
// probabilities with the row's final max and sum. Measured against one task per head walking every cell (2-core
// EPYC, ~1k cells): the per-head walk spent ~2.2x flash attention's time per dot (docs/NOTES.md, issue 11).
static void ggml_sparse_attn_ext_row_f16_split(const ggml_compute_params * params, ggml_tensor * dst) {
    const ggml_tensor * q     = dst->src[0];
    const ggml_tensor * k     = dst->src[1];
    const ggml_tensor * v     = dst->src[2];
    const ggml_tensor * sinks = dst->src[6];

    const int64_t DK     = k->ne[0];
    const int64_t DV     = v->ne[0];
    const int64_t n_kv   = k->ne[1];
    const int64_t n_head = q->ne[2];
    const int     ith    = params->ith;
    const int     nth    = params->nth;
    const size_t  stride = ggml_sparse_attn_ext_scratch(dst);

    float scale, max_bias, logit_softcap;
    ggml_sparse_attn_ext_scales(dst, &scale, &max_bias, &logit_softcap);

    const int64_t chunk = (n_kv + nth - 1)/nth;
    const int64_t c0    = std::min<int64_t>(n_kv, ith*chunk);
    const int64_t c1    = std::min<int64_t>(n_kv, c0 + chunk);

    float       * wdata = (float *) params->wdata + ith*stride;
    float       * Qf    = wdata;
    ggml_fp16_t * Q16   = (ggml_fp16_t *) (Qf + DK);
    float       * VKQ   = Qf + 2*DK;
    float       * part  = VKQ + DV; // [n_head][max, sum, VKQ[DV]] of this thread's chunk

    // the chunk's scores, max, sum and partial output, per head
    for (int64_t ih = 0; ih < n_head; ++ih) {
        float * P  = (float *) ((char *) dst->data + dst->nb[3]) + ih*n_kv;
        float * ph = part + ih*(2 + DV);
        double sum = 0.0;
        ph[0] = ggml_sparse_attn_ext_row_f16_cells(dst, 0, ih, c0, c1, ggml_sparse_attn_ext_slope(max_bias, n_head, ih),
                scale, logit_softcap, P, ph + 2, &sum, Qf, Q16);
        ph[1] = (float) sum;
    }

    ggml_barrier(params->threadpool);

    // per head: the row's max and sum over the chunks (and the sink), this chunk's probabilities, and the output
    // (heads shared out over the threads)
    const auto part_of = [&](int t, int64_t ih) {
        return (const float *) params->wdata + t*stride + 2*DK + DV + ih*(2 + DV);
    };
    for (int64_t ih = 0; ih < n_head; ++ih) {
        const float s_sink = sinks ? ((const float *) sinks->data)[ih] : -INFINITY;
        float M = s_sink;
        for (int t = 0; t < nth; ++t) {
            M = std::max(M, part_of(t, ih)[0]);
        }
        double S = sinks && M != -INFINITY ? expf(s_sink - M) : 0.0;
        for (int t = 0; t < nth; ++t) {
            const float * ph = part_of(t, ih);
            if (ph[0] != -INFINITY) {
                S += ph[1]*expf(ph[0] - M);
            }
        }
        const float inv = S == 0.0 ? 0.0f : (float) (1.0/S);
        const float * own = part_of(ith, ih);
        float * P = (float *) ((char *) dst->data + dst->nb[3]) + ih*n_kv;
        if (own[0] != -INFINITY) {
            ggml_vec_scale_f32((int) (c1 - c0), P + c0, expf(own[0] - M)*inv);
        }
        if (ih % nth == ith) {
            memset(VKQ, 0, DV*sizeof(float));
            for (int t = 0; t < nth; ++t) {
                const float * ph = part_of(t, ih);
                if (ph[0] != -INFINITY) {
                    ggml_vec_mad_f32((int) DV, VKQ, ph + 2, expf(ph[0] - M)*inv);
                }
            }
            memcpy((char *) dst->data + ih*dst->nb[1], VKQ, DV*sizeof(float));
        }
    }
}

// one query row (q_block 1) against every cell with the probabilities kept, for F16 K and V (an observed decode
// step): the scores as flash attention computes them, an exact softmax over the row (and the sink) written to P, then
// VKQ = P V
static void ggml_sparse_attn_ext_row_f16(ggml_tensor * dst, int64_t iq, int64_t ih, float slope, float scale,
        float logit_softcap, float * P, float * wdata) {
    const ggml_tensor * k     = dst->src[1];
    const ggml_tensor * v     = dst->src[2];
    const ggml_tensor * sinks = dst->src[6];

    const int64_t DK   = k->ne[0];
    const int64_t DV   = v->ne[0];
    const int64_t n_kv = k->ne[1];

    float       * VKQ = wdata;
    float       * Qf  = VKQ + DV;
    ggml_fp16_t * Q16 = (ggml_fp16_t *) (Qf + DK);

    double sum = 0.0;
    const float m = ggml_sparse_attn_ext_row_f16_cells(dst, iq, ih, 0, n_kv, slope, scale, logit_softcap, P, VKQ, &sum, Qf, Q16);

    // the sink's share: the row's max and sum with it
    const float s_sink = sinks ? ((const float *) sinks->data)[ih] : -INFINITY;
    const float M      = std::max(m, s_sink);
    const float f      = m == -INFINITY ? 0.0f : (m == M ? 1.0f : expf(m - M));
    double      S      = sum*f;
    if (sinks && M != -INFINITY) {
        S += expf(s_sink - M);
    }
    const float inv = S == 0.0 ? 0.0f : (float) (f/S);
    ggml_vec_scale_f32((int) DV, VKQ, inv);
    ggml_vec_scale_f32((int) n_kv, P, inv);
    memcpy((char *) dst->data + iq*dst->nb[2] + ih*dst->nb[1], VKQ, DV*sizeof(float));
}

static void ggml_sparse_attn_ext_task(const ggml_compute_params * params, ggml_tensor * dst, int64_t iqb, int64_t ih, float * wdata) {
    const ggml_tensor * q      = dst->src[0];
    const ggml_tensor * k      = dst->src[1];
    const ggml_tensor * v      = dst->src[2];
    const ggml_tensor * mask   = dst->src[3];
    const ggml_tensor * blocks = dst->src[4];
    const ggml_tensor * counts = dst->src[5];
    const ggml_tensor * sinks  = dst->src[6];
    const bool          probs  = ggml_sparse_attn_ext_has_probs(dst);
    (void) params;

    const int64_t DK     = k->ne[0];
    const int64_t DV     = v->ne[0];
    const int64_t n_q    = q->ne[1];
    const int64_t n_kv   = k->ne[1];
    const int64_t n_head = q->ne[2];
    const int64_t QB     = ggml_sparse_attn_ext_q_block(dst);
    const int64_t KB     = ggml_sparse_attn_ext_k_block(dst);
    const int64_t n_kb   = (n_kv + KB - 1)/KB;
    const int64_t n_list = blocks ? blocks->ne[0] : n_kb; // no list: every block

    float scale, max_bias, logit_softcap;
    ggml_sparse_attn_ext_scales(dst, &scale, &max_bias, &logit_softcap);

    const float slope = ggml_sparse_attn_ext_slope(max_bias, n_head, ih);

    const int64_t ik = ih/(n_head/k->ne[2]);
    const int64_t iv = ih/(n_head/v->ne[2]);

    const int64_t q0   = iqb*QB;
    const int64_t rows = std::min(QB, n_q - q0);

    if (probs && QB == 1 && k->type == GGML_TYPE_F16 && v->type == GGML_TYPE_F16) {
        float * P = (float *) ((char *) dst->data + dst->nb[3]) + (ih*n_q + q0)*n_kv;
        ggml_sparse_attn_ext_row_f16(dst, q0, ih, slope, scale, logit_softcap, P, wdata);
        return;
    }

    float * Qf   = wdata;
    float * KQ   = Qf   + QB*DK;
    float * M32  = KQ   + QB*KB;
    float * VKQ  = M32  + QB*KB;
    float * V32  = VKQ  + QB*DV;
    float * KT   = V32  + KB*DV;
    float * Kr   = KT   + KB*DK;
    float * Mx   = Kr   + KB*DK;
    float * Sm   = Mx   + QB;

    for (int64_t r = 0; r < QB; ++r) {
        if (r < rows) {
            memcpy(Qf + r*DK, (const char *) q->data + (q0 + r)*q->nb[1] + ih*q->nb[2], DK*sizeof(float));
            ggml_vec_scale_f32((int) DK, Qf + r*DK, scale); // (Q*scale) K^T: the scale costs one pass over Q
        } else {
            memset(Qf + r*DK, 0, DK*sizeof(float));
        }
        Mx[r] = -INFINITY;
        Sm[r] = 0.0f;
    }
    memset(VKQ, 0, QB*DV*sizeof(float));

    const int32_t * list  = blocks ? (const int32_t *) ((const char *) blocks->data + iqb*blocks->nb[1] + ih*blocks->nb[2]) : nullptr;
    const int32_t   count = !blocks ? (int32_t) n_kb : std::max<int32_t>(0, std::min<int32_t>((int32_t) n_list,
                                *(const int32_t *) ((const char *) counts->data + iqb*counts->nb[0] + ih*counts->nb[1])));

    // probabilities of row r: [n_kv] floats, the scores until the end of the task (-inf: a cell never visited)
    float * P0 = probs ? (float *) ((char *) dst->data + dst->nb[3]) + (ih*n_q + q0)*n_kv : nullptr;
    for (int64_t r = 0; probs && r < rows; ++r) {
        std::fill(P0 + r*n_kv, P0 + (r + 1)*n_kv, -INFINITY);
    }

    for (int32_t il = 0; il < count; ++il) {
        const int64_t ib = list ? list[il] : il;
        if (ib < 0 || ib >= n_kb) {
            continue;
        }
        const int64_t c0 = ib*KB;
        const int64_t nc = std::min(KB, n_kv - c0);

        // mask of the tile (-inf outside the block and for padding rows): none needed when every row is a full row
        // of zeros (a block wholly in the past of the query block, the common case); skip a tile masked everywhere
        bool flat = rows == QB && nc == KB;
        if (mask && flat) {
            for (int64_t r = 0; r < rows; ++r) {
                const ggml_fp16_t * mp = (const ggml_fp16_t *) ((const char *) mask->data + (q0 + r)*mask->nb[1]) + c0;
                uint16_t bits_or = 0;
                for (int64_t c = 0; c < nc; ++c) {
                    bits_or |= mp[c];
                }
                flat = flat && bits_or == 0; // +0.0 everywhere
            }
        }
        if (!flat) {
            bool any = mask == nullptr;
            for (int64_t r = 0; r < QB; ++r) {
                float * mr = M32 + r*KB;
                if (r >= rows) {
                    for (int64_t c = 0; c < KB; ++c) { mr[c] = -INFINITY; }
                    continue;
                }
                if (mask) {
                    const ggml_fp16_t * mp = (const ggml_fp16_t *) ((const char *) mask->data + (q0 + r)*mask->nb[1]) + c0;
                    ggml_cpu_fp16_to_fp32(mp, mr, nc);
                    if (slope != 1.0f) {
                        ggml_vec_scale_f32((int) nc, mr, slope);
                    }
                    float mx = -INFINITY;
                    ggml_vec_max_f32((int) nc, &mx, mr);
                    any = any || mx != -INFINITY;
                } else {
                    for (int64_t c = 0; c < nc; ++c) { mr[c] = 0.0f; }
                }
                for (int64_t c = nc; c < KB; ++c) { mr[c] = -INFINITY; }
            }
            if (!any) {
                continue;
            }
        }

        // K^T tile [DK][KB] (zero-padded columns), KQ = Q K^T
        ggml_sparse_attn_rows_f32(k, c0, nc, ik, Kr);
        if (nc < KB) {
            memset(Kr + nc*DK, 0, (KB - nc)*DK*sizeof(float));
        }
        for (int64_t d0 = 0; d0 < DK; d0 += 8) {       // 8x8 tiles: both sides stay in a few cache lines
            for (int64_t c0t = 0; c0t < KB; c0t += 8) {
                for (int64_t d = d0; d < std::min(d0 + 8, DK); ++d) {
                    for (int64_t c = c0t; c < std::min(c0t + 8, KB); ++c) {
                        KT[d*KB + c] = Kr[c*DK + d];
                    }
                }
            }
        }
        memset(KQ, 0, QB*KB*sizeof(float));
        simd_gemm(KQ, Qf, KT, (int) QB, (int) DK, (int) KB);
        if (logit_softcap != 0.0f) {
            ggml_vec_tanh_f32((int) (QB*KB), KQ, KQ);
            ggml_vec_scale_f32((int) (QB*KB), KQ, logit_softcap);
        }
        if (!flat) {
            ggml_vec_add_f32((int) (QB*KB), KQ, KQ, M32);
        }

        for (int64_t r = 0; probs && r < rows; ++r) {
            memcpy(P0 + r*n_kv + c0, KQ + r*KB, nc*sizeof(float));
        }

        // online softmax per row
        for (int64_t r = 0; r < QB; ++r) {
            float * kr = KQ + r*KB;
            float tile_max = -INFINITY;
            ggml_vec_max_f32((int) KB, &tile_max, kr);
            if (tile_max == -INFINITY) {
                memset(kr, 0, KB*sizeof(float));
                continue;
            }
            const float m_new = std::max(Mx[r], tile_max);
            if (m_new > Mx[r]) {
                const float ms = expf(Mx[r] - m_new);
                ggml_vec_scale_f32((int) DV, VKQ + r*DV, ms);
                Sm[r] *= ms;
            }
            Mx[r] = m_new;
            Sm[r] += (float) ggml_vec_soft_max_f32((int) KB, kr, kr, m_new);
        }

        // VKQ += P V
        ggml_sparse_attn_rows_f32(v, c0, nc, iv, V32);
        if (nc < KB) {
            memset(V32 + nc*DV, 0, (KB - nc)*DV*sizeof(float));
        }
        simd_gemm(VKQ, KQ, V32, (int) QB, (int) KB, (int) DV);
    }

    const float s_sink = sinks ? ((const float *) sinks->data)[ih] : -INFINITY;
    for (int64_t r = 0; r < rows; ++r) {
        if (sinks) {
            float ms = 1.0f;
            float vs = 1.0f;
            if (s_sink > Mx[r]) {
                ms = expf(Mx[r] - s_sink);
                ggml_vec_scale_f32((int) DV, VKQ + r*DV, ms);
            } else {
                vs = expf(s_sink - Mx[r]);
            }
            Sm[r] = Sm[r]*ms + vs;
        }
        const float inv = Sm[r] == 0.0f ? 0.0f : 1.0f/Sm[r];
        ggml_vec_scale_f32((int) DV, VKQ + r*DV, inv);
        if (probs) {
            // scores -> probabilities with the row's final max and sum (the sink's term is in the sum)
            float * pr = P0 + r*n_kv;
            const float m = sinks ? std::max(Mx[r], s_sink) : Mx[r];
            for (int64_t c = 0; c < n_kv; ++c) {
                pr[c] = pr[c] == -INFINITY ? 0.0f : expf(pr[c] - m)*inv;
            }
        }
        // result [DV, n_head, n_q]
        memcpy((char *) dst->data + (q0 + r)*dst->nb[2] + ih*dst->nb[1], VKQ + r*DV, DV*sizeof(float));
    }
}

void ggml_compute_forward_sparse_attn_ext(const ggml_compute_params * params, ggml_tensor * dst) {
    const ggml_tensor * q = dst->src[0];
    const ggml_tensor * k = dst->src[1];
    GGML_ASSERT(q->type == GGML_TYPE_F32);
    GGML_ASSERT(q->nb[0] == sizeof(float));
    GGML_ASSERT(k->nb[0] == ggml_type_size(k->type) && dst->src[2]->nb[0] == ggml_type_size(k->type));
    GGML_ASSERT(k->type == GGML_TYPE_F32 || k->type == GGML_TYPE_F16 || ggml_get_type_traits(k->type)->to_float);

    const int64_t QB     = ggml_sparse_attn_ext_q_block(dst);
    const int64_t n_qb   = (q->ne[1] + QB - 1)/QB;
    const int64_t n_task = n_qb*q->ne[2];

    const int ith = params->ith;
    const int nth = params->nth;

    float * wdata = (float *) params->wdata + ith*ggml_sparse_attn_ext_scratch(dst);

    // a single query row with its probabilities (an observed decode step): split by cells over the threads
    const ggml_tensor * v = dst->src[2];
    if (ggml_sparse_attn_ext_has_probs(dst) && QB == 1 && q->ne[1] == 1 && q->ne[3] == 1 && nth > 1 &&
        k->type == GGML_TYPE_F16 && v->type == GGML_TYPE_F16 && k->ne[1] >= 64*nth &&
        ggml_sparse_attn_ext_split_scratch(dst) <= ggml_sparse_attn_ext_scratch(dst)) {
        ggml_sparse_attn_ext_row_f16_split(params, dst);
        return;
    }

    if (ith == 0) {
        ggml_threadpool_chunk_set(params->threadpool, nth);
    }
    ggml_barrier(params->threadpool);

    // later query blocks list more blocks: hand out the tasks from the last query block down
    for (int64_t t = ith; t < n_task; t = ggml_threadpool_chunk_add(params->threadpool, 1)) {
        const int64_t iqb = n_qb - 1 - t/q->ne[2];
        const int64_t ih  = t % q->ne[2];
        ggml_sparse_attn_ext_task(params, dst, iqb, ih, wdata);
    }
}

bool ggml_cpu_sparse_attn_ext_supported(const ggml_tensor * op) {
    const ggml_tensor * k = op->src[1];
    const ggml_tensor * v = op->src[2];
    const bool convertible = k->type == GGML_TYPE_F32 || k->type == GGML_TYPE_F16 || ggml_get_type_traits(k->type)->to_float != nullptr;
    return op->src[0]->type == GGML_TYPE_F32 && k->type == v->type && convertible &&
           k->nb[0] == ggml_type_size(k->type) && v->nb[0] == ggml_type_size(v->type);
}
