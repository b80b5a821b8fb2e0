// sparse-attn.cu - CUDA kernel of GGML_OP_SPARSE_ATTN_EXT (pykvcache): block-sparse attention for prefill.
// The semantics and tensor layouts are those of native/kernels/ggml-sparse-attn.h; the result equals the CPU kernel's
// (sparse-attn-cpu.cpp) up to rounding.
//
// One thread block per (query block, head), SPARSE_ATTN_NWARPS warps. The query block is processed in passes of
// rows_pass rows (32 for D <= 128, 16 for D <= 256): a pass loads its Q rows (f32) into shared memory once, then walks
// the listed key blocks in chunks of 32 keys (WARP_SIZE). For every chunk the K rows are converted to f32 into shared
// memory, each warp computes the scores of its query rows (lane = key), applies scale, softcap, mask (with the ALiBi
// slope) and updates its online softmax (running max and sum per row, rescaling the accumulator); then the V rows are
// converted into the same shared buffer and each warp accumulates P V into registers (lane = columns of V).
// Shared memory: (rows_pass*DK + 32*D)*4 bytes, at most 48 KB, so no opt-in is needed.

#include "sparse-attn.cuh"
#include "ggml-sparse-attn.h"

#include <cstdint>

#define SPARSE_ATTN_NWARPS 16        // warps per thread block (one block per SM at a prompt ubatch's grid: the warps hide the latency)
#define SPARSE_ATTN_KT     WARP_SIZE // keys per chunk: one key per lane when computing the scores
#define SPARSE_ATTN_D_MAX  256       // largest supported DK and DV
#define SPARSE_ATTN_B_MAX  128       // largest supported q_block and k_block

struct sparse_attn_params {
    const char * q;
    const char * k;
    const char * v;
    const char * mask;   // may be nullptr
    const char * blocks;
    const char * counts;
    const float * sinks; // may be nullptr
    char * dst;

    int DK;
    int DV;
    int n_q;
    int n_kv;
    int n_head;
    int n_gqa_k; // query heads per K head
    int n_gqa_v; // query heads per V head
    int n_list;
    int n_qb;
    int q_block;
    int k_block;

    size_t nbq1, nbq2;
    size_t nbk1, nbk2;
    size_t nbv1, nbv2;
    size_t nbm1;
    size_t nbb1, nbb2;
    size_t nbc0, nbc1;
    size_t nbd1, nbd2;

    float    scale; // already divided by logit_softcap when softcap is on
    float    logit_softcap;
    float    max_bias;
    float    m0;
    float    m1;
    uint32_t n_head_log2;
};

// query rows per warp in one pass: D_MAX is the power of 2 that holds both DK and DV
static constexpr __host__ __device__ int sparse_attn_rows_per_warp(const int D_MAX) {
    return D_MAX <= 128 ? 2 : 1;
}

static constexpr __host__ __device__ int sparse_attn_rows_pass(const int D_MAX) {
    return SPARSE_ATTN_NWARPS*sparse_attn_rows_per_warp(D_MAX);
}

// dynamic shared memory: Q rows of one pass [rows_pass][DK], then a K or V chunk [SPARSE_ATTN_KT][D_MAX]
static size_t sparse_attn_smem_size(const int D_MAX, const int DK) {
    return (size_t) (sparse_attn_rows_pass(D_MAX)*DK + SPARSE_ATTN_KT*D_MAX)*sizeof(float);
}

static bool sparse_attn_type_supported(const ggml_type type) {
    switch (type) {
        case GGML_TYPE_F32:
        case GGML_TYPE_F16:
        case GGML_TYPE_BF16:
        case GGML_TYPE_Q4_0:
        case GGML_TYPE_Q4_1:
        case GGML_TYPE_Q5_0:
        case GGML_TYPE_Q5_1:
        case GGML_TYPE_Q8_0:
            return true;
        default:
            return false;
    }
}

// element i of a K or V row, as f32
template <ggml_type type>
static __device__ __forceinline__ float sparse_attn_get_f32(const char * row, const int i) {
    if constexpr (type == GGML_TYPE_F32) {
        return ((const float *) row)[i];
    } else if constexpr (type == GGML_TYPE_F16) {
        return __half2float(((const half *) row)[i]);
    } else if constexpr (type == GGML_TYPE_BF16) {
        return __bfloat162float(((const nv_bfloat16 *) row)[i]);
    } else if constexpr (type == GGML_TYPE_Q4_0) {
        const block_q4_0 * x = (const block_q4_0 *) row + i/QK4_0;
        const int j = i % QK4_0;
        const int q = j < QK4_0/2 ? x->qs[j] & 0x0F : x->qs[j - QK4_0/2] >> 4;
        return (q - 8)*__half2float(x->d);
    } else if constexpr (type == GGML_TYPE_Q4_1) {
        const block_q4_1 * x = (const block_q4_1 *) row + i/QK4_1;
        const int j = i % QK4_1;
        const int q = j < QK4_1/2 ? x->qs[j] & 0x0F : x->qs[j - QK4_1/2] >> 4;
        const float2 dm = __half22float2(x->dm);
        return q*dm.x + dm.y;
    } else if constexpr (type == GGML_TYPE_Q5_0) {
        const block_q5_0 * x = (const block_q5_0 *) row + i/QK5_0;
        const int j = i % QK5_0;
        uint32_t qh;
        memcpy(&qh, x->qh, sizeof(qh));
        const int ql = j < QK5_0/2 ? x->qs[j] & 0x0F : x->qs[j - QK5_0/2] >> 4;
        const int q  = ql | (((qh >> j) & 1) << 4);
        return (q - 16)*__half2float(x->d);
    } else if constexpr (type == GGML_TYPE_Q5_1) {
        const block_q5_1 * x = (const block_q5_1 *) row + i/QK5_1;
        const int j = i % QK5_1;
        uint32_t qh;
        memcpy(&qh, x->qh, sizeof(qh));
        const int ql = j < QK5_1/2 ? x->qs[j] & 0x0F : x->qs[j - QK5_1/2] >> 4;
        const int q  = ql | (((qh >> j) & 1) << 4);
        const float2 dm = __half22float2(x->dm);
        return q*dm.x + dm.y;
    } else if constexpr (type == GGML_TYPE_Q8_0) {
        const block_q8_0 * x = (const block_q8_0 *) row + i/QK8_0;
        return x->qs[i % QK8_0]*__half2float(x->d);
    } else {
        static_assert(type == GGML_TYPE_F32, "unsupported type");
        return 0.0f;
    }
}

template <ggml_type type, int D_MAX>
static __global__ void __launch_bounds__(SPARSE_ATTN_NWARPS*WARP_SIZE, 1)
sparse_attn_ext_kernel(const sparse_attn_params p) {
    constexpr int nwarps        = SPARSE_ATTN_NWARPS;
    constexpr int kt            = SPARSE_ATTN_KT;
    constexpr int rows_per_warp = sparse_attn_rows_per_warp(D_MAX);
    constexpr int rows_pass     = sparse_attn_rows_pass(D_MAX);
    constexpr int ncv           = D_MAX/WARP_SIZE; // V columns per lane
    static_assert((D_MAX & (D_MAX - 1)) == 0 && D_MAX % WARP_SIZE == 0, "D_MAX must be a power of 2 >= WARP_SIZE");
    static_assert(kt == WARP_SIZE, "one key per lane");

    // q_sh: the Q rows of the pass [rows_pass][DK]; kv_sh: one chunk of K rows [kt][D_MAX], row j stored rotated by j
    // (element d at (d + j) % D_MAX, so that the lanes of a warp reading element d of their keys hit distinct banks),
    // then the V rows of the same chunk [kt][D_MAX] (not rotated, zero-padded up to a multiple of WARP_SIZE columns)
    extern __shared__ float4 sparse_attn_smem[];
    float * q_sh  = (float *) sparse_attn_smem;
    float * kv_sh = q_sh + rows_pass*p.DK;

    const int lane = threadIdx.x;
    const int warp = threadIdx.y;

    // later query blocks list more key blocks: start them first, as the CPU kernel does
    const int ih  = blockIdx.x % p.n_head;
    const int iqb = p.n_qb - 1 - blockIdx.x / p.n_head;

    const int DK  = p.DK;
    const int DV  = p.DV;
    const int DVp = (DV + WARP_SIZE - 1)/WARP_SIZE*WARP_SIZE;

    const int q0   = iqb*p.q_block;
    const int rows = min(p.q_block, p.n_q - q0);
    const int n_kb = (p.n_kv + p.k_block - 1)/p.k_block;

    const char * k_head = p.k + (int64_t) (ih/p.n_gqa_k)*p.nbk2;
    const char * v_head = p.v + (int64_t) (ih/p.n_gqa_v)*p.nbv2;

    const int32_t * list  = (const int32_t *) (p.blocks + (int64_t) iqb*p.nbb1 + (int64_t) ih*p.nbb2);
    const int32_t   n_vis = *(const int32_t *) (p.counts + (int64_t) iqb*p.nbc0 + (int64_t) ih*p.nbc1);
    const int       count = max(0, min(p.n_list, n_vis));

    const float slope = get_alibi_slope(p.max_bias, ih, p.n_head_log2, p.m0, p.m1);

    for (int r0 = 0; r0 < rows; r0 += rows_pass) {
        const int nr = min(rows_pass, rows - r0); // valid rows in this pass

        __syncthreads(); // the previous pass is done with the shared memory

        // Q rows of the pass (zero for rows past the query block)
        for (int r = warp; r < rows_pass; r += nwarps) {
            const float * q_row = (const float *) (p.q + (int64_t) (q0 + r0 + r)*p.nbq1 + (int64_t) ih*p.nbq2);
            for (int d = lane; d < DK; d += WARP_SIZE) {
                q_sh[r*DK + d] = r < nr ? q_row[d] : 0.0f;
            }
        }

        // this warp handles the rows i*nwarps + warp of the pass
        float acc[rows_per_warp][ncv];
        float row_max[rows_per_warp]; // running max, the same in all lanes
        float row_sum[rows_per_warp]; // running sum, partial per lane
#pragma unroll
        for (int i = 0; i < rows_per_warp; ++i) {
            row_max[i] = -INFINITY;
            row_sum[i] = 0.0f;
#pragma unroll
            for (int c = 0; c < ncv; ++c) {
                acc[i][c] = 0.0f;
            }
        }

        for (int il = 0; il < count; ++il) {
            const int ib = list[il];
            if (ib < 0 || ib >= n_kb) {
                continue;
            }
            const int c_end = min((ib + 1)*p.k_block, p.n_kv);

            for (int c0 = ib*p.k_block; c0 < c_end; c0 += kt) {
                const int nc = min(kt, c_end - c0); // valid keys in this chunk

                // mask of key c0 + lane for this warp's rows: -inf past the chunk and for rows past the query block
                float mv[rows_per_warp];
                bool  any = false;
#pragma unroll
                for (int i = 0; i < rows_per_warp; ++i) {
                    const int r = i*nwarps + warp;
                    mv[i] = -INFINITY;
                    if (r < nr && lane < nc) {
                        if (p.mask) {
                            const half * m_row = (const half *) (p.mask + (int64_t) (q0 + r0 + r)*p.nbm1);
                            mv[i] = slope*__half2float(m_row[c0 + lane]);
                        } else {
                            mv[i] = 0.0f;
                        }
                    }
                    any = any || mv[i] != -INFINITY;
                }

                // skip a chunk masked everywhere for the rows of the pass; this barrier also makes sure that all warps
                // are done with the V rows of the previous chunk
                if (!__syncthreads_or(any)) {
                    continue;
                }

                // K rows of the chunk as f32 (zero past the chunk)
                for (int j = warp; j < kt; j += nwarps) {
                    const char * k_row = k_head + (int64_t) (c0 + j)*p.nbk1;
                    float * dst_row = kv_sh + j*D_MAX;
                    for (int d = lane; d < DK; d += WARP_SIZE) {
                        dst_row[(d + j) & (D_MAX - 1)] = j < nc ? sparse_attn_get_f32<type>(k_row, d) : 0.0f;
                    }
                }
                __syncthreads();

                // scores: lane = key
                float s[rows_per_warp];
#pragma unroll
                for (int i = 0; i < rows_per_warp; ++i) {
                    s[i] = 0.0f;
                }
                const float * k_lane = kv_sh + lane*D_MAX;
                for (int d = 0; d < DK; d += 4) {
                    const float k0 = k_lane[(d + 0 + lane) & (D_MAX - 1)];
                    const float k1 = k_lane[(d + 1 + lane) & (D_MAX - 1)];
                    const float k2 = k_lane[(d + 2 + lane) & (D_MAX - 1)];
                    const float k3 = k_lane[(d + 3 + lane) & (D_MAX - 1)];
#pragma unroll
                    for (int i = 0; i < rows_per_warp; ++i) {
                        const float4 qv = *(const float4 *) (q_sh + (i*nwarps + warp)*DK + d);
                        s[i] += qv.x*k0 + qv.y*k1 + qv.z*k2 + qv.w*k3;
                    }
                }

                // scale, softcap, mask, online softmax; s becomes the (unnormalized) probabilities
#pragma unroll
                for (int i = 0; i < rows_per_warp; ++i) {
                    float x = s[i]*p.scale;
                    if (p.logit_softcap != 0.0f) {
                        x = p.logit_softcap*tanhf(x);
                    }
                    x = mv[i] == -INFINITY ? -INFINITY : x + mv[i];

                    const float tile_max = warp_reduce_max(x);
                    if (tile_max == -INFINITY) {
                        s[i] = 0.0f; // row masked in this chunk
                        continue;
                    }
                    const float m_new = fmaxf(row_max[i], tile_max);
                    if (m_new > row_max[i]) {
                        const float ms = expf(row_max[i] - m_new);
                        row_sum[i] *= ms;
#pragma unroll
                        for (int c = 0; c < ncv; ++c) {
                            acc[i][c] *= ms;
                        }
                        row_max[i] = m_new;
                    }
                    s[i] = expf(x - m_new);
                    row_sum[i] += s[i];
                }

                __syncthreads(); // all warps are done with the K rows

                // V rows of the chunk as f32 (columns DV..DVp-1 zero)
                for (int j = warp; j < nc; j += nwarps) {
                    const char * v_row = v_head + (int64_t) (c0 + j)*p.nbv1;
                    float * dst_row = kv_sh + j*D_MAX;
                    for (int d = lane; d < DVp; d += WARP_SIZE) {
                        dst_row[d] = d < DV ? sparse_attn_get_f32<type>(v_row, d) : 0.0f;
                    }
                }
                __syncthreads();

                // acc += P V: lane = columns c*WARP_SIZE + lane
                for (int j = 0; j < nc; ++j) {
                    float vj[ncv];
#pragma unroll
                    for (int c = 0; c < ncv; ++c) {
                        vj[c] = c*WARP_SIZE < DV ? kv_sh[j*D_MAX + c*WARP_SIZE + lane] : 0.0f;
                    }
#pragma unroll
                    for (int i = 0; i < rows_per_warp; ++i) {
                        const float pj = __shfl_sync(0xFFFFFFFF, s[i], j);
#pragma unroll
                        for (int c = 0; c < ncv; ++c) {
                            acc[i][c] += pj*vj[c];
                        }
                    }
                }
            }
        }

        // sinks, normalization, output [DV, n_head, n_q]
        const float sink = p.sinks ? p.sinks[ih] : -INFINITY;
#pragma unroll
        for (int i = 0; i < rows_per_warp; ++i) {
            const int r = i*nwarps + warp;
            if (r >= nr) {
                continue;
            }
            float sum = warp_reduce_sum(row_sum[i]);
            float ms  = 1.0f;
            if (p.sinks) {
                float vs = 1.0f;
                if (sink > row_max[i]) {
                    ms = expf(row_max[i] - sink);
                } else {
                    vs = expf(sink - row_max[i]);
                }
                sum = sum*ms + vs;
            }
            const float inv = sum == 0.0f ? 0.0f : ms/sum; // fully masked rows give 0

            float * out = (float *) (p.dst + (int64_t) (q0 + r0 + r)*p.nbd2 + (int64_t) ih*p.nbd1);
#pragma unroll
            for (int c = 0; c < ncv; ++c) {
                const int d = c*WARP_SIZE + lane;
                if (d < DV) {
                    out[d] = acc[i][c]*inv;
                }
            }
        }
    }
}

template <ggml_type type, int D_MAX>
static void sparse_attn_ext_launch(const sparse_attn_params & p, cudaStream_t stream) {
    const size_t nbytes = sparse_attn_smem_size(D_MAX, p.DK);
    GGML_ASSERT(nbytes <= 48*1024); // the default limit: no cudaFuncSetAttribute needed

    const dim3 block_dims(WARP_SIZE, SPARSE_ATTN_NWARPS, 1);
    const dim3 grid_dims(p.n_qb*p.n_head, 1, 1);
    sparse_attn_ext_kernel<type, D_MAX><<<grid_dims, block_dims, nbytes, stream>>>(p);
}

template <int D_MAX>
static void sparse_attn_ext_switch_type(const ggml_type type, const sparse_attn_params & p, cudaStream_t stream) {
    switch (type) {
        case GGML_TYPE_F32:  sparse_attn_ext_launch<GGML_TYPE_F32,  D_MAX>(p, stream); break;
        case GGML_TYPE_F16:  sparse_attn_ext_launch<GGML_TYPE_F16,  D_MAX>(p, stream); break;
        case GGML_TYPE_BF16: sparse_attn_ext_launch<GGML_TYPE_BF16, D_MAX>(p, stream); break;
        case GGML_TYPE_Q4_0: sparse_attn_ext_launch<GGML_TYPE_Q4_0, D_MAX>(p, stream); break;
        case GGML_TYPE_Q4_1: sparse_attn_ext_launch<GGML_TYPE_Q4_1, D_MAX>(p, stream); break;
        case GGML_TYPE_Q5_0: sparse_attn_ext_launch<GGML_TYPE_Q5_0, D_MAX>(p, stream); break;
        case GGML_TYPE_Q5_1: sparse_attn_ext_launch<GGML_TYPE_Q5_1, D_MAX>(p, stream); break;
        case GGML_TYPE_Q8_0: sparse_attn_ext_launch<GGML_TYPE_Q8_0, D_MAX>(p, stream); break;
        default:
            GGML_ABORT("fatal error");
    }
}

void ggml_cuda_sparse_attn_ext(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * q      = dst->src[0];
    const ggml_tensor * k      = dst->src[1];
    const ggml_tensor * v      = dst->src[2];
    const ggml_tensor * mask   = dst->src[3];
    const ggml_tensor * blocks = dst->src[4];
    const ggml_tensor * counts = dst->src[5];
    const ggml_tensor * sinks  = dst->src[6];

    GGML_ASSERT(ggml_cuda_sparse_attn_ext_supported(ggml_cuda_get_device(), dst));

    float scale         = 1.0f;
    float max_bias      = 0.0f;
    float logit_softcap = 0.0f;
    ggml_sparse_attn_ext_get_params(dst, &scale, &max_bias, &logit_softcap);
    if (logit_softcap != 0.0f) {
        scale /= logit_softcap;
    }
    const int32_t q_block = ggml_sparse_attn_ext_q_block(dst);
    const int32_t k_block = ggml_sparse_attn_ext_k_block(dst);

    const int64_t n_q  = q->ne[1];
    const int64_t n_qb = (n_q + q_block - 1)/q_block;
    if (n_q == 0 || q->ne[2] == 0) {
        return;
    }

    const uint32_t n_head      = (uint32_t) q->ne[2];
    const uint32_t n_head_log2 = 1u << (uint32_t) floorf(log2f((float) n_head));

    sparse_attn_params p;
    p.q      = (const char *) q->data;
    p.k      = (const char *) k->data;
    p.v      = (const char *) v->data;
    p.mask   = mask  ? (const char *) mask->data : nullptr;
    p.blocks = (const char *) blocks->data;
    p.counts = (const char *) counts->data;
    p.sinks  = sinks ? (const float *) sinks->data : nullptr;
    p.dst    = (char *) dst->data;

    p.DK      = (int) k->ne[0];
    p.DV      = (int) v->ne[0];
    p.n_q     = (int) n_q;
    p.n_kv    = (int) k->ne[1];
    p.n_head  = (int) n_head;
    p.n_gqa_k = (int) (q->ne[2]/k->ne[2]);
    p.n_gqa_v = (int) (q->ne[2]/v->ne[2]);
    p.n_list  = (int) blocks->ne[0];
    p.n_qb    = (int) n_qb;
    p.q_block = q_block;
    p.k_block = k_block;

    p.nbq1 = q->nb[1];      p.nbq2 = q->nb[2];
    p.nbk1 = k->nb[1];      p.nbk2 = k->nb[2];
    p.nbv1 = v->nb[1];      p.nbv2 = v->nb[2];
    p.nbm1 = mask ? mask->nb[1] : 0;
    p.nbb1 = blocks->nb[1]; p.nbb2 = blocks->nb[2];
    p.nbc0 = counts->nb[0]; p.nbc1 = counts->nb[1];
    p.nbd1 = dst->nb[1];    p.nbd2 = dst->nb[2];

    p.scale         = scale;
    p.logit_softcap = logit_softcap;
    p.max_bias      = max_bias;
    p.m0            = powf(2.0f, -(max_bias       )/n_head_log2);
    p.m1            = powf(2.0f, -(max_bias / 2.0f)/n_head_log2);
    p.n_head_log2   = n_head_log2;

    const int d_max = std::max(p.DK, p.DV);
    cudaStream_t stream = ctx.stream();
    if (d_max <= 64) {
        sparse_attn_ext_switch_type<64>(k->type, p, stream);
    } else if (d_max <= 128) {
        sparse_attn_ext_switch_type<128>(k->type, p, stream);
    } else {
        sparse_attn_ext_switch_type<SPARSE_ATTN_D_MAX>(k->type, p, stream);
    }
    CUDA_CHECK(cudaGetLastError());
}

bool ggml_cuda_sparse_attn_ext_supported(int device, const ggml_tensor * op) {
    GGML_UNUSED(device);

    const ggml_tensor * q      = op->src[0];
    const ggml_tensor * k      = op->src[1];
    const ggml_tensor * v      = op->src[2];
    const ggml_tensor * mask   = op->src[3];
    const ggml_tensor * blocks = op->src[4];
    const ggml_tensor * counts = op->src[5];
    const ggml_tensor * sinks  = op->src[6];

    if (op->type != GGML_TYPE_F32 || !q || !k || !v || !blocks || !counts) {
        return false;
    }
    if (ggml_sparse_attn_ext_has_probs(op)) {
        return false; // the probabilities are written by the CPU kernel only
    }
    if (q->type != GGML_TYPE_F32 || q->nb[0] != sizeof(float)) {
        return false;
    }
    if (k->type != v->type || !sparse_attn_type_supported(k->type)) {
        return false;
    }
    if (k->nb[0] != ggml_type_size(k->type) || v->nb[0] != ggml_type_size(v->type)) {
        return false;
    }

    // the Q rows are read as float4 from shared memory: DK a multiple of 4
    const int64_t DK = k->ne[0];
    const int64_t DV = v->ne[0];
    if (q->ne[0] != DK || DK < 4 || DK > SPARSE_ATTN_D_MAX || DK % 4 != 0 || DV < 1 || DV > SPARSE_ATTN_D_MAX) {
        return false;
    }
    if (q->ne[3] != 1 || k->ne[3] != 1 || v->ne[3] != 1 || k->ne[2] == 0 || v->ne[2] == 0 ||
            q->ne[2] % k->ne[2] != 0 || q->ne[2] % v->ne[2] != 0 || k->ne[1] != v->ne[1]) {
        return false;
    }
    if (q->ne[1] > INT32_MAX || k->ne[1] > INT32_MAX || q->ne[1]*q->ne[2] > INT32_MAX) {
        return false;
    }

    const int32_t q_block = ggml_sparse_attn_ext_q_block(op);
    const int32_t k_block = ggml_sparse_attn_ext_k_block(op);
    if (q_block < 1 || q_block > SPARSE_ATTN_B_MAX || k_block < 1 || k_block > SPARSE_ATTN_B_MAX) {
        return false;
    }

    if (mask && (mask->type != GGML_TYPE_F16 || mask->nb[0] != sizeof(half))) {
        return false;
    }
    if (blocks->type != GGML_TYPE_I32 || counts->type != GGML_TYPE_I32) {
        return false;
    }
    if (sinks && sinks->type != GGML_TYPE_F32) {
        return false;
    }
    return true;
}
