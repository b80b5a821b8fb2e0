// gemm-q4_1-cpu.cpp - register-tiled Q4_1 x Q8_1 matmul for prompt ubatches (compiled into ggml-cpu).
//
// Per (row i, column j) the result is what ggml_vec_dot_q4_1_q8_1 computes on AVX2, step for step:
//   for each block b:  acc   += (d_x[b] * d_y[b]) * float(sum of the 32 products q_x * q_y, as 8 int32 lanes)
//                      summs += m_x[b] * s_y[b]
//   C = hsum(acc) + summs
// with the lanes and the horizontal sum formed as there, so the two agree bit for bit. What changes is the loop
// nest: a tile of RM rows x RN columns walks the blocks together, so a weight block is unpacked once per tile
// instead of once per column, and an activation block is loaded once per tile instead of once per row.

#include "ggml-gemm-q4_1.h"

#include "ggml-cpu.h"
#include "ggml-cpu-impl.h"
#include "ggml-impl.h"
#include "simd-mappings.h"

#include <atomic>
#include <cstdlib>
#include <mutex>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define GGML_GEMM_Q4_1_AVX2 1
#endif

// the blocks, as ggml-common.h lays them out (static_asserted there): Q4_1 {d, m, 16 bytes of nibbles},
// Q8_1 {d, s = d * sum(qs), 32 int8}
struct gemm_q4_1_block { ggml_fp16_t d; ggml_fp16_t m; uint8_t qs[16]; };
struct gemm_q8_1_block { ggml_fp16_t d; ggml_fp16_t s; int8_t  qs[32]; };
static_assert(sizeof(gemm_q4_1_block) == 20, "Q4_1 block layout");
static_assert(sizeof(gemm_q8_1_block) == 36, "Q8_1 block layout");

static bool ggml_gemm_q4_1_enabled(void) {
    static bool enabled = true;
    static std::once_flag flag;
    std::call_once(flag, []() {
        const char * env = getenv("GGML_CPU_TILED_MM"); // the in-tree switch of the tiled matmuls
        enabled = env == NULL || atoi(env) != 0;
    });
    return enabled;
}

// matrix products computed by the kernel (ggml_gemm_q4_1_calls)
static std::atomic<uint64_t> gemm_q4_1_n_calls{0};

#ifdef GGML_GEMM_Q4_1_AVX2

// vec_dot's horizontal sum of 8 floats (arch/x86/quants.c), in its order
static inline float gemm_q4_1_hsum(const __m256 x) {
    __m128 res = _mm256_extractf128_ps(x, 1);
    res = _mm_add_ps(res, _mm256_castps256_ps128(x));
    res = _mm_add_ps(res, _mm_movehl_ps(res, res));
    res = _mm_add_ss(res, _mm_movehdup_ps(res));
    return _mm_cvtss_f32(res);
}

// 32 nibbles as bytes: the low nibbles are elements 0..15, the high ones 16..31
static inline __m256i gemm_q4_1_unpack(const uint8_t * qs) {
    const __m128i lo = _mm_loadu_si128((const __m128i *) qs);
    const __m256i b  = _mm256_set_m128i(_mm_srli_epi16(lo, 4), lo);
    return _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
}

// 4 halves to floats, exactly (as GGML_CPU_FP16_TO_FP32's table gives them)
static inline __m128 gemm_q4_1_halves(ggml_fp16_t h0, ggml_fp16_t h1, ggml_fp16_t h2, ggml_fp16_t h3) {
    return _mm_cvtph_ps(_mm_setr_epi16((short) h0, (short) h1, (short) h2, (short) h3, 0, 0, 0, 0));
}

// rows i0..i0+RM-1 x columns j0..j0+RN-1 (RN <= 4)
template <int RM, int RN>
static void gemm_q4_1_tile(int64_t k, const gemm_q4_1_block * A, int64_t lda, const gemm_q8_1_block * B, int64_t ldb,
                           float * C, int64_t ldc, int64_t i0, int64_t j0) {
    static_assert(RN <= 4, "a tile's columns share one __m128 of scales");
    const gemm_q4_1_block * x[RM];
    const gemm_q8_1_block * y[4];
    for (int i = 0; i < RM; ++i) {
        x[i] = A + (i0 + i)*lda;
    }
    for (int j = 0; j < 4; ++j) {
        y[j] = B + (j0 + (j < RN ? j : 0))*ldb;
    }

    // the products' part: acc += (d_x * d_y) * (q_x . q_y), 8 lanes per pair
    __m256 acc[RM][RN];
    for (int i = 0; i < RM; ++i) {
        for (int j = 0; j < RN; ++j) {
            acc[i][j] = _mm256_setzero_ps();
        }
    }
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t l = 0; l < k; ++l) {
        alignas(16) float dy[4];
        _mm_store_ps(dy, gemm_q4_1_halves(y[0][l].d, y[1][l].d, y[2][l].d, y[3][l].d));
        __m256 dyv[RN];
        for (int j = 0; j < RN; ++j) {
            dyv[j] = _mm256_set1_ps(dy[j]);
        }
        for (int i = 0; i < RM; ++i) {
            const __m256i qx  = gemm_q4_1_unpack(x[i][l].qs);
            const __m256  dxv = _mm256_set1_ps(GGML_CPU_FP16_TO_FP32(x[i][l].d));
            for (int j = 0; j < RN; ++j) {
                const __m256  d = _mm256_mul_ps(dxv, dyv[j]);
                const __m256i p = _mm256_madd_epi16(ones, _mm256_maddubs_epi16(qx, _mm256_loadu_si256((const __m256i *) y[j][l].qs)));
                acc[i][j] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(p), acc[i][j]);
            }
        }
    }

    // the minimums' part: summs += m_x * s_y, in block order, the columns of a row side by side
    __m128 summs[RM];
    for (int i = 0; i < RM; ++i) {
        summs[i] = _mm_setzero_ps();
    }
    for (int64_t l = 0; l < k; ++l) {
        const __m128 sy = gemm_q4_1_halves(y[0][l].s, y[1][l].s, y[2][l].s, y[3][l].s);
        for (int i = 0; i < RM; ++i) {
            summs[i] = _mm_fmadd_ps(_mm_set1_ps(GGML_CPU_FP16_TO_FP32(x[i][l].m)), sy, summs[i]);
        }
    }

    for (int i = 0; i < RM; ++i) {
        alignas(16) float sm[4];
        _mm_store_ps(sm, summs[i]);
        for (int j = 0; j < RN; ++j) {
            C[(j0 + j)*ldc + i0 + i] = gemm_q4_1_hsum(acc[i][j]) + sm[j];
        }
    }
}

typedef void (*gemm_q4_1_tile_t)(int64_t, const gemm_q4_1_block *, int64_t, const gemm_q8_1_block *, int64_t,
                                 float *, int64_t, int64_t, int64_t);

// 3 x 4: 12 accumulators and the operands fit AVX2's 16 registers; 4 x 3, 2 x 4 and 4 x 2 measured 2-10% slower
// (gemm-q4_1-check --bench, one thread, AMD EPYC)
static constexpr int GEMM_Q4_1_RM = 3; // rows of a tile
static constexpr int GEMM_Q4_1_RN = 4; // columns of a tile
static constexpr int GEMM_Q4_1_JOB = 4; // row tiles per job

// the tile kernel of rm x rn (the edges of the matrix take the smaller ones)
template <int RM>
static gemm_q4_1_tile_t gemm_q4_1_pick(int rn) {
    switch (rn) {
        case 1:  return gemm_q4_1_tile<RM, 1>;
        case 2:  return gemm_q4_1_tile<RM, 2>;
        case 3:  return gemm_q4_1_tile<RM, 3>;
        default: return gemm_q4_1_tile<RM, 4>;
    }
}

static gemm_q4_1_tile_t gemm_q4_1_pick(int rm, int rn) {
    switch (rm) {
        case 1:  return gemm_q4_1_pick<1>(rn);
        case 2:  return gemm_q4_1_pick<2>(rn);
        case 3:  return gemm_q4_1_pick<3>(rn);
        default: return gemm_q4_1_pick<4>(rn);
    }
}

#endif // GGML_GEMM_Q4_1_AVX2

bool ggml_gemm_q4_1_available(void) {
#ifdef GGML_GEMM_Q4_1_AVX2
    return ggml_gemm_q4_1_enabled();
#else
    return false;
#endif
}

uint64_t ggml_gemm_q4_1_calls(void) {
    return gemm_q4_1_n_calls.load(std::memory_order_relaxed);
}

bool ggml_gemm_q4_1_q8_1(const struct ggml_compute_params * params, int64_t m, int64_t n, int64_t k,
                         const void * A, int64_t lda, const void * B, int64_t ldb, float * C, int64_t ldc) {
#ifdef GGML_GEMM_Q4_1_AVX2
    if (!ggml_gemm_q4_1_enabled()) {
        return false;
    }
    // jobs of GEMM_Q4_1_JOB row tiles x every column, handed out through the threadpool's chunk counter (as the
    // stock path and tinyBLAS do), so that a thread slowed down by the machine does not hold the others back
    const int64_t n_tiles = (m + GEMM_Q4_1_RM - 1)/GEMM_Q4_1_RM;
    const int64_t n_jobs  = (n_tiles + GEMM_Q4_1_JOB - 1)/GEMM_Q4_1_JOB;
    if (params->ith == 0) {
        ggml_threadpool_chunk_set(params->threadpool, params->nth);
    }
    ggml_barrier(params->threadpool);

    const gemm_q4_1_block * a = (const gemm_q4_1_block *) A;
    const gemm_q8_1_block * b = (const gemm_q8_1_block *) B;

    for (int64_t job = params->ith; job < n_jobs; job = ggml_threadpool_chunk_add(params->threadpool, 1)) {
        const int64_t t1 = (job + 1)*GEMM_Q4_1_JOB < n_tiles ? (job + 1)*GEMM_Q4_1_JOB : n_tiles;
        for (int64_t t = job*GEMM_Q4_1_JOB; t < t1; ++t) {
            const int64_t i0 = t*GEMM_Q4_1_RM;
            const int     rm = (int) (m - i0 < GEMM_Q4_1_RM ? m - i0 : GEMM_Q4_1_RM);
            for (int64_t j0 = 0; j0 < n; j0 += GEMM_Q4_1_RN) {
                const int rn = (int) (n - j0 < GEMM_Q4_1_RN ? n - j0 : GEMM_Q4_1_RN);
                gemm_q4_1_pick(rm, rn)(k, a, lda, b, ldb, C, ldc, i0, j0);
            }
        }
    }
    ggml_barrier(params->threadpool);
    if (params->ith == 0) {
        gemm_q4_1_n_calls.fetch_add(1, std::memory_order_relaxed);
    }
    return true;
#else
    GGML_UNUSED(params); GGML_UNUSED(m); GGML_UNUSED(n); GGML_UNUSED(k); GGML_UNUSED(A); GGML_UNUSED(lda);
    GGML_UNUSED(B); GGML_UNUSED(ldb); GGML_UNUSED(C); GGML_UNUSED(ldc);
    return false;
#endif
}
