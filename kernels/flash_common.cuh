/*
 * flash_common.cuh - what flash_fwd.cu and flash_bwd.cu share: the kernel
 * parameters (pointers, strides in elements, sizes, scale), element loads
 * by a run-time dtype, warp reductions, and which keys a query sees (causal
 * and sliding windows: lib/attn_mod.h's rules, on the kernels' ints).
 *
 *   q, dq, out, dout [B, Nq, H, d]   k, v, dk, dv [B, Nk, Hk, d]
 *   lse, D [B, H, Nq] contiguous f32
 */
#ifndef FT_FLASH_COMMON_CUH
#define FT_FLASH_COMMON_CUH

#include "kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#define FT_LOG2E 1.4426950408889634f
#define FT_WARP 32

/* A [B, N, heads, d] tensor as the kernels see it. */
struct FlashTensor {
    void *data;
    int64_t batch_stride, row_stride, head_stride; /* elements */
};

struct FlashParams {
    FlashTensor q, k, v, out, dout, dq, dk, dv;
    float *lse;       /* [B, H, Nq] */
    float *D;         /* [B, H, Nq], backward: rowsum(dO * O) */
    float *lse2;      /* [B, H, Nq], backward (sm90): LSE log2(e), +inf for rows that saw no key */
    int B, H, Hk, Nq, Nk, d;
    int dtype;        /* ft_dtype of every tensor above but lse and D */
    int causal;
    ft_attn_mod mod;  /* which keys each query sees: lib/attn_mod.h */
    const float *sink; /* [H] contiguous: each row's softmax starts from it; or null */
    float scale;      /* softmax scale */
    float scale_log2; /* scale * log2(e): exp(x * scale) = exp2(x * scale_log2) */
};

static inline FlashTensor flash_tensor(const ft_tensor *t)
{
    FlashTensor r;
    r.data = t ? t->data : nullptr;
    r.batch_stride = t ? t->stride[0] : 0;
    r.row_stride = t ? t->stride[1] : 0;
    r.head_stride = t ? t->stride[2] : 0;
    return r;
}

/* Element offset of row `row` of head `head` in batch `b`. */
__device__ __forceinline__ int64_t row_offset(const FlashTensor &t, int b, int row, int head)
{
    return (int64_t)b * t.batch_stride + (int64_t)row * t.row_stride +
           (int64_t)head * t.head_stride;
}

__device__ __forceinline__ float load_elem(const void *p, int64_t i, int dtype)
{
    switch (dtype) {
    case FT_F16: return __half2float(((const __half *)p)[i]);
    case FT_BF16: return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

/* Round to nearest even, as the CPU's conversions do. */
__device__ __forceinline__ void store_elem(void *p, int64_t i, int dtype, float v)
{
    switch (dtype) {
    case FT_F16: ((__half *)p)[i] = __float2half_rn(v); break;
    case FT_BF16: ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(v); break;
    default: ((float *)p)[i] = v; break;
    }
}

__device__ __forceinline__ float warp_sum(float x)
{
    for (int o = FT_WARP / 2; o > 0; o /= 2)
        x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

/* The keys query `row` sees are [flash_key_begin, flash_key_end); the
 * queries that see key `j` are [flash_query_begin, flash_query_end). Each
 * bound moves right (or stays) as row or j grows. */
__device__ __forceinline__ int flash_key_begin(const FlashParams &p, int row)
{
    return (int)ft_mod_key_begin(&p.mod, p.Nq, p.Nk, row);
}

__device__ __forceinline__ int flash_key_end(const FlashParams &p, int row)
{
    return (int)ft_mod_key_end(&p.mod, p.Nq, p.Nk, row);
}

__device__ __forceinline__ int flash_query_begin(const FlashParams &p, int j)
{
    return (int)ft_mod_query_begin(&p.mod, p.Nq, p.Nk, j);
}

__device__ __forceinline__ int flash_query_end(const FlashParams &p, int j)
{
    return (int)ft_mod_query_end(&p.mod, p.Nq, p.Nk, j);
}

/* Where a row's online softmax starts, in log2 units of the scaled scores:
 * the running max at the sink logit and the sum at e^0 = 1 (the sink's
 * term, with no value row); without a sink, -inf and 0. The sum is held
 * in shares by a quad of lanes in the tensor-core kernels: `share` says
 * whether this lane's share takes the 1. */
__device__ __forceinline__ float flash_sink_log2(const FlashParams &p, int h)
{
    return p.sink ? p.sink[h] * FT_LOG2E : -INFINITY;
}

__device__ __forceinline__ float flash_sink_sum(float sink_log2, bool share)
{
    return share && sink_log2 != -INFINITY ? 1.f : 0.f;
}

/* The keys [lo, hi) that every query of a group of rows sees. A block of
 * keys [j0, j1) needs a mask (some pair hidden, or a key past the end)
 * unless it lies inside: two compares a block, the bounds worked out once
 * per group of rows (lib/attn_mod.h's ft_mod_block, specialised). */
struct FullKeys {
    int lo, hi;
    __device__ __forceinline__ bool masks(int j0, int j1) const { return j0 < lo || j1 > hi; }
};

/* For the queries [r0, r1): the visible intervals move right with the row,
 * so the last row's first key and the first row's end bound them all. */
__device__ __forceinline__ FullKeys flash_full_keys(const FlashParams &p, int r0, int r1)
{
    FullKeys f;
    f.lo = flash_key_begin(p, r1 - 1);
    f.hi = flash_key_end(p, r0);
    return f;
}

/* The same from the keys' side (dK/dV): the queries [lo, hi) that see every
 * key of [k0, k1); a block of queries [i0, i1) needs a mask unless it lies
 * inside (also when a key or a query is past the end). */
__device__ __forceinline__ FullKeys flash_full_queries(const FlashParams &p, int k0, int k1)
{
    FullKeys f;
    f.lo = flash_query_begin(p, k1 - 1);
    f.hi = k1 > p.Nk ? -1 : flash_query_end(p, k0);
    return f;
}

/* The keys one query row sees, for masking element by element. */
struct KeyRange {
    int begin, end;
    __device__ __forceinline__ bool hides(int col) const { return col < begin || col >= end; }
};

__device__ __forceinline__ KeyRange flash_keys(const FlashParams &p, int row)
{
    KeyRange k;
    k.begin = flash_key_begin(p, row);
    k.end = flash_key_end(p, row);
    return k;
}

/* The queries that see one key, likewise (the dK/dV kernels); none for a
 * key past the end. */
struct QueryRange {
    int begin, end;
    __device__ __forceinline__ bool hides(int qi) const { return qi < begin || qi >= end; }
};

__device__ __forceinline__ QueryRange flash_queries(const FlashParams &p, int j)
{
    QueryRange q;
    q.begin = flash_query_begin(p, j);
    q.end = j < p.Nk ? flash_query_end(p, j) : 0; /* a key past the end: none */
    return q;
}

/* flash_fwd.cu: the parameters of a call, and whether every tensor's rows
 * start on 16 bytes (what cp.async and the tensor-core kernels need). */
FlashParams flash_params(const ft_attn_shape *s, const ft_tensor *q, const ft_tensor *k,
                         const ft_tensor *v, const ft_tensor *out, const ft_tensor *lse);
bool flash_rows_aligned(const ft_tensor *const *ts, int n);

/* flash_fwd_sm90.cu (built for 90a): the wgmma forward, head dims up to
 * 256, f16/bf16, rows aligned. flash_sm90_usable: it was built and the device
 * is of compute capability 9.0 (and FT_NO_WGMMA is not set in the
 * environment, which keeps the mma.sync kernels for comparison). */
ft_status flash_fwd_sm90(const FlashParams &p);
/* flash_bwd_sm90.cu: dK, dV, dQ once p.D holds rowsum(dO * O); Nq > 0. */
ft_status flash_bwd_sm90(const FlashParams &p);
bool flash_sm90_usable(int device);

/* Launches kernel(p) with `smem` bytes of dynamic shared memory (raising
 * the kernel's limit first); CUDA failures become ft_status for `func`. */
template <typename Kernel>
static ft_status flash_launch(Kernel kernel, dim3 grid, int threads, size_t smem,
                              const FlashParams &p, const char *func)
{
    FT_CUDA_TRY(func, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)smem));
    kernel<<<grid, threads, smem>>>(p);
    FT_CUDA_CHECK_LAUNCH(func);
    return FT_OK;
}

#define SIMT_WARPS 4 /* warps per CTA of the SIMT kernels: one query or key row each */
#define FT_SIMT_MAX_COLS 8 /* columns per lane: head_dim up to 8 * 32 = 256 */

#endif
