// sparse-attn.cuh - CUDA kernel of GGML_OP_SPARSE_ATTN_EXT (pykvcache, native/kernels/ggml-sparse-attn.h).
#pragma once

#include "ggml-cuda/common.cuh"

void ggml_cuda_sparse_attn_ext(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
bool ggml_cuda_sparse_attn_ext_supported(int device, const ggml_tensor * op);
