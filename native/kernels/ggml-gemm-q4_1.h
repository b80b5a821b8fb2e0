// ggml-gemm-q4_1.h - a register-tiled CPU matmul for Q4_1 weights against Q8_1 activations (pykvcache).
//
// ggml's CPU backend multiplies Q4_1 weights by calling the one-row, one-column dot product (vec_dot_q4_1_q8_1)
// for every (row, column) pair of a prompt ubatch, unpacking each weight block once per column. This kernel
// computes the same dot products for a tile of rows x columns at once (each weight block unpacked once per tile),
// with the same arithmetic in the same order per pair, so that its results equal vec_dot's bit for bit. It is
// reached through llamafile_sgemm (patch 0006) for prompt ubatches (n >= 2 columns); decode keeps vec_dot.
// GGML_CPU_TILED_MM=0, the in-tree switch of the tiled K-quant matmul, turns it off as well.
#pragma once

#include "ggml-backend.h"

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct ggml_compute_params;

// whether the kernel runs in this process: built with AVX2/FMA/F16C and not turned off by GGML_CPU_TILED_MM=0
GGML_BACKEND_API bool ggml_gemm_q4_1_available(void);

// how many matrix products the kernel has computed in this process (one per product: thread 0's call counts it), so
// that a test can tell that the dispatch reached it; 0 where it is not available
GGML_BACKEND_API uint64_t ggml_gemm_q4_1_calls(void);

// C[j*ldc + i] = dot(A row i, B column j) for i < m, j < n; A: m rows of k Q4_1 blocks (row stride lda blocks),
// B: n columns of k Q8_1 blocks (stride ldb blocks). Every thread of the params must call it (jobs of rows are
// shared out). Returns false (nothing computed) where the kernel is not available.
bool ggml_gemm_q4_1_q8_1(const struct ggml_compute_params * params, int64_t m, int64_t n, int64_t k,
                         const void * A, int64_t lda, const void * B, int64_t ldb, float * C, int64_t ldc);

#ifdef __cplusplus
}
#endif
