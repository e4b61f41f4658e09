/*
 * common.cuh - what the files of kernels/tensor/ share: the launch
 * geometry (grid-stride loops of BLOCK threads), the strided geometry of
 * up to three operands of one shape (geo), and unrolled loads and stores
 * of elements by a run-time dtype. An element is loaded as a double and
 * stored from one with the rules of lib/scalar_ops.h, which lib/ uses too.
 * Limits: FT_MAX_DIMS dims, GEO_OPS operands a launch. Check: through the
 * kernels that use it, spec/cuda_ops_spec.lua (busted, tag gpu).
 */
#ifndef FT_TENSOR_COMMON_CUH
#define FT_TENSOR_COMMON_CUH

#include <stdint.h>

/* kernels.h brings internal.h in with C linkage: include it first. */
#include "kernels.h"
#include "scalar_ops.h"

/* ---- launch geometry --------------------------------------------------- */

#define BLOCK 256          /* threads per block, every kernel of tensor/ */
#define MAX_GRID 4096      /* blocks of a grid-stride elementwise launch */
#define UNROLL 4           /* elements a thread loads before it computes */
#define REDUCE_GRID 1024   /* partial results of a two-pass reduction */
#define WARP 32

static inline unsigned grid_for(int64_t work, int64_t per_block, int64_t cap)
{
    int64_t blocks = (work + per_block - 1) / per_block;
    if (blocks < 1)
        blocks = 1;
    return (unsigned)(blocks < cap ? blocks : cap);
}

/* ---- strided geometry -------------------------------------------------- */

#define GEO_OPS 3

/* One shape walked by up to GEO_OPS operands, each with its strides (in
 * elements). ndim >= 1 after geo_make. */
struct geo {
    int ndim;
    int64_t shape[FT_MAX_DIMS];
    int64_t stride[GEO_OPS][FT_MAX_DIMS];
};

/* Builds the geometry of nops operands of one shape: dims of size 1 are
 * dropped, and a dim is merged into the one before it when every operand
 * steps over both as over one dim. The row-major order of the elements is
 * unchanged, so element i of the result is element i of the original. */
static inline geo geo_make(int ndim, const int64_t *shape, int nops,
                           const int64_t *const *strides)
{
    geo g;
    g.ndim = 0;
    for (int k = 0; k < GEO_OPS; k++)
        for (int d = 0; d < FT_MAX_DIMS; d++)
            g.stride[k][d] = 0;
    for (int d = 0; d < FT_MAX_DIMS; d++)
        g.shape[d] = 1;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] == 1)
            continue;
        int p = g.ndim - 1;
        int merge = p >= 0;
        for (int k = 0; merge && k < nops; k++)
            merge = g.stride[k][p] == strides[k][d] * shape[d];
        if (merge) {
            g.shape[p] *= shape[d];
            for (int k = 0; k < nops; k++)
                g.stride[k][p] = strides[k][d];
        } else {
            g.shape[g.ndim] = shape[d];
            for (int k = 0; k < nops; k++)
                g.stride[k][g.ndim] = strides[k][d];
            g.ndim++;
        }
    }
    if (g.ndim == 0) /* a single element (or a 0-d tensor) */
        g.ndim = 1;
    return g;
}

/* The element offsets (per operand) of element i, in row-major order of
 * g's shape. The loop is unrolled so the shape and strides are read from
 * the kernel's parameters, not copied to local memory. */
template <int NOPS>
__device__ __forceinline__ void geo_offsets(const geo &g, int64_t i,
                                            int64_t off[NOPS])
{
#pragma unroll
    for (int k = 0; k < NOPS; k++)
        off[k] = 0;
#pragma unroll
    for (int d = FT_MAX_DIMS - 1; d >= 1; d--) {
        if (d < g.ndim) {
            int64_t n = g.shape[d];
            int64_t q = i / n, r = i - q * n;
#pragma unroll
            for (int k = 0; k < NOPS; k++)
                off[k] += r * g.stride[k][d];
            i = q;
        }
    }
#pragma unroll
    for (int k = 0; k < NOPS; k++)
        off[k] += i * g.stride[k][0];
}

/* ---- unrolled element access ---------------------------------------------
 * An elementwise thread takes UNROLL elements per step of its grid-stride
 * loop, base + u * step for u < UNROLL (each u coalesced across the warp),
 * and issues all their loads before it uses any: the dtype switch is
 * outside the unrolled loops, so the loads are independent and in flight
 * together. */

/* The offsets of elements base + u * step (u < UNROLL) below n; returns
 * how many there are (a prefix). */
template <int NOPS>
__device__ __forceinline__ int unrolled_offsets(const geo &g, int64_t base,
                                                int64_t step, int64_t n,
                                                int64_t (&off)[UNROLL][NOPS])
{
    int cnt = 0;
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
        const int64_t i = base + u * step;
        if (i < n) {
            geo_offsets<NOPS>(g, i, off[u]);
            cnt = u + 1;
        } else {
#pragma unroll
            for (int k = 0; k < NOPS; k++)
                off[u][k] = 0;
        }
    }
    return cnt;
}

template <typename T, int NOPS>
__device__ __forceinline__ void gather(const void *base,
                                       const int64_t (&off)[UNROLL][NOPS],
                                       int k, int cnt, T (&raw)[UNROLL])
{
#pragma unroll
    for (int u = 0; u < UNROLL; u++)
        raw[u] = u < cnt ? ((const T *)base)[off[u][k]] : (T)0;
}

template <typename T, int NOPS>
__device__ __forceinline__ void scatter(void *base,
                                        const int64_t (&off)[UNROLL][NOPS],
                                        int k, int cnt, const T (&raw)[UNROLL])
{
#pragma unroll
    for (int u = 0; u < UNROLL; u++)
        if (u < cnt)
            ((T *)base)[off[u][k]] = raw[u];
}

/* ft_elem_load of cnt elements of operand k. */
template <int NOPS>
__device__ __forceinline__ void load_many(const void *base, int dtype,
                                          const int64_t (&off)[UNROLL][NOPS],
                                          int k, int cnt, double (&v)[UNROLL])
{
    switch (dtype) {
    case FT_F64: {
        gather<double, NOPS>(base, off, k, cnt, v);
        break;
    }
    case FT_F32: {
        float r[UNROLL];
        gather<float, NOPS>(base, off, k, cnt, r);
#pragma unroll
        for (int u = 0; u < UNROLL; u++)
            v[u] = (double)r[u];
        break;
    }
    case FT_F16:
    case FT_BF16: {
        uint16_t r[UNROLL];
        gather<uint16_t, NOPS>(base, off, k, cnt, r);
#pragma unroll
        for (int u = 0; u < UNROLL; u++)
            v[u] = dtype == FT_F16
                       ? ft_small_to_f64(r[u], FT_F16_EXP_BITS, FT_F16_MANT_BITS)
                       : ft_small_to_f64(r[u], FT_BF16_EXP_BITS, FT_BF16_MANT_BITS);
        break;
    }
    case FT_I32: {
        int32_t r[UNROLL];
        gather<int32_t, NOPS>(base, off, k, cnt, r);
#pragma unroll
        for (int u = 0; u < UNROLL; u++)
            v[u] = (double)r[u];
        break;
    }
    case FT_I64: {
        int64_t r[UNROLL];
        gather<int64_t, NOPS>(base, off, k, cnt, r);
#pragma unroll
        for (int u = 0; u < UNROLL; u++)
            v[u] = (double)r[u];
        break;
    }
    case FT_FP8_E4M3: { /* copies and comparisons only: lib/ refuses arithmetic */
        uint8_t r[UNROLL];
        gather<uint8_t, NOPS>(base, off, k, cnt, r);
#pragma unroll
        for (int u = 0; u < UNROLL; u++)
            v[u] = ft_e4m3_to_f64(r[u]);
        break;
    }
    default:
#pragma unroll
        for (int u = 0; u < UNROLL; u++)
            v[u] = NAN;
        break;
    }
}

/* ft_elem_store of cnt elements of operand k. */
template <int NOPS>
__device__ __forceinline__ void store_many(void *base, int dtype,
                                           const int64_t (&off)[UNROLL][NOPS],
                                           int k, int cnt,
                                           const double (&v)[UNROLL])
{
#pragma unroll
    for (int u = 0; u < UNROLL; u++)
        if (u < cnt)
            ft_elem_store(base, off[u][k], dtype, v[u]);
}

#endif /* FT_TENSOR_COMMON_CUH */
