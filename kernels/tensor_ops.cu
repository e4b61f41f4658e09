/*
 * tensor_ops.cu - the CUDA half of lib/tensor.c, lib/random.c and lib/ops.c:
 * copy, fill, rand/randn, elementwise ops, reductions, softmax and the
 * comparisons, on strided tensors of any dtype, computed in double as the
 * CPU computes them (the same bits wherever the CPU's result depends only
 * on the elements). Work and temporary buffers on the legacy default stream.
 * Check: spec/cuda_ops_spec.lua (busted, tag gpu) against the CPU. Design:
 * kernels/README.md.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* kernels.h brings internal.h in with C linkage: include it first. */
#include "kernels.h"
#include "philox.h"

/* ---- launch geometry --------------------------------------------------- */

#define BLOCK 256          /* threads per block, every kernel here */
#define MAX_GRID 4096      /* blocks of a grid-stride elementwise launch */
#define UNROLL 4           /* elements a thread loads before it computes */
#define REDUCE_GRID 1024   /* partial results of a two-pass reduction */
#define WARP 32

static unsigned grid_for(int64_t work, int64_t per_block, int64_t cap)
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
static geo geo_make(int ndim, const int64_t *shape, int nops,
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

/* ---- element conversion (the rules of lib/dtype.c) --------------------- */

#define F16_EXP_BITS 5
#define F16_MANT_BITS 10
#define BF16_EXP_BITS 8
#define BF16_MANT_BITS 7

/* Rounds x to a binary float of exp_bits exponent and mant_bits mantissa
 * bits, ties to even, from the bits of the double: the algorithm of
 * dtype.c's round_to_small_float with the scaling and rounding done on the
 * integer significand. NaN keeps its sign and becomes quiet, overflow goes
 * to infinity, small values to subnormals or zero. */
__host__ __device__ __forceinline__ uint16_t f64_to_small(double x,
                                                          int exp_bits,
                                                          int mant_bits)
{
    uint64_t bits;
#ifdef __CUDA_ARCH__
    bits = (uint64_t)__double_as_longlong(x);
#else
    memcpy(&bits, &x, sizeof bits);
#endif
    const uint32_t sign = (uint32_t)(bits >> 63) << (exp_bits + mant_bits);
    const int exp_max = (1 << exp_bits) - 1;
    const int bias = (1 << (exp_bits - 1)) - 1;
    const uint32_t inf = (uint32_t)exp_max << mant_bits;
    const int dexp = (int)((bits >> 52) & 0x7ff);
    const uint64_t dmant = bits & ((1ull << 52) - 1);

    if (dexp == 0x7ff) /* infinity, or NaN made quiet */
        return (uint16_t)(dmant ? sign | inf | (1u << (mant_bits - 1))
                                : sign | inf);
    if (dexp == 0) /* zero, or a subnormal double: far below half the
                      smallest f16/bf16 subnormal, so it rounds to zero */
        return (uint16_t)sign;

    const int e = dexp - 1023;              /* |x| = sig * 2^(e - 52) */
    const uint64_t sig = dmant | (1ull << 52);
    const int emin = 1 - bias;
    int shift_exp = e < emin ? emin : e;
    /* q = round(|x| * 2^(mant_bits - shift_exp)) = round(sig >> s). */
    const int s = 52 - mant_bits + shift_exp - e; /* >= 52 - mant_bits */
    uint64_t q;
    if (s >= 64) {
        q = 0; /* sig < 2^53, so sig / 2^64 < 1/2 */
    } else {
        q = sig >> s;
        const uint64_t rem = sig & ((1ull << s) - 1);
        const uint64_t half = 1ull << (s - 1);
        if (rem > half || (rem == half && (q & 1)))
            q++;
    }
    if (q >= (2ull << mant_bits)) { /* rounding carried into the next binade */
        q >>= 1;
        shift_exp++;
    }
    if (q < (1ull << mant_bits)) /* subnormal, or rounded to zero */
        return (uint16_t)(sign | (uint32_t)q);
    const int biased = shift_exp + bias;
    if (biased >= exp_max)
        return (uint16_t)(sign | inf);
    return (uint16_t)(sign | ((uint32_t)biased << mant_bits) |
                      (uint32_t)(q & ((1ull << mant_bits) - 1)));
}


/* 2^e as a double, for e in the normal range. */
__host__ __device__ __forceinline__ double pow2(int e)
{
    const uint64_t bits = (uint64_t)(e + 1023) << 52;
    double v;
#ifdef __CUDA_ARCH__
    v = __longlong_as_double((long long)bits);
#else
    memcpy(&v, &bits, sizeof v);
#endif
    return v;
}

/* The exact double of a small float's bits, as dtype.c's
 * small_float_to_f64: NaN is the default quiet NaN (0x7ff8...) with h's
 * sign, subnormals are mant * 2^(1 - bias - mant_bits). */
__host__ __device__ __forceinline__ double small_to_f64(uint16_t h,
                                                        int exp_bits,
                                                        int mant_bits)
{
    const int exp_max = (1 << exp_bits) - 1;
    const int bias = (1 << (exp_bits - 1)) - 1;
    const int negative = (h >> (exp_bits + mant_bits)) & 1;
    const int biased = (h >> mant_bits) & exp_max;
    const uint32_t mant = h & ((1u << mant_bits) - 1);
    double v;
    if (biased == exp_max) {
        const uint64_t bits =
            ((uint64_t)negative << 63) |
            (mant ? 0x7ff8000000000000ull : 0x7ff0000000000000ull);
#ifdef __CUDA_ARCH__
        return __longlong_as_double((long long)bits);
#else
        memcpy(&v, &bits, sizeof v);
        return v;
#endif
    }
    if (biased == 0) /* a power of two times an integer below 2^10: exact */
        v = (double)mant * pow2(1 - bias - mant_bits);
    else
        v = (double)(mant | (1u << mant_bits)) *
            pow2(biased - bias - mant_bits);
    return negative ? -v : v;
}

/* Truncation toward zero that saturates, NaN -> 0 (dtype.c's
 * double_to_int). */
__device__ __forceinline__ int64_t f64_to_int(double v, double lo, double hi)
{
    if (isnan(v))
        return 0;
    if (v <= lo)
        return (int64_t)lo;
    if (v >= hi)
        return (int64_t)hi;
    return (int64_t)v;
}

/* Element off of the array base of dtype, as a double (ft_load_f64). */
__device__ __forceinline__ double load_f64(const void *base, int64_t off,
                                           int dtype)
{
    switch (dtype) {
    case FT_F64: return ((const double *)base)[off];
    case FT_F32: return (double)((const float *)base)[off];
    case FT_F16:
        return small_to_f64(((const uint16_t *)base)[off], F16_EXP_BITS,
                            F16_MANT_BITS);
    case FT_BF16:
        return small_to_f64(((const uint16_t *)base)[off], BF16_EXP_BITS,
                            BF16_MANT_BITS);
    case FT_I32: return (double)((const int32_t *)base)[off];
    case FT_I64: return (double)((const int64_t *)base)[off];
    default: return NAN;
    }
}

/* Stores v as element off of the array base of dtype (ft_store_f64). */
__device__ __forceinline__ void store_f64(void *base, int64_t off, int dtype,
                                          double v)
{
    switch (dtype) {
    case FT_F64: ((double *)base)[off] = v; break;
    case FT_F32: ((float *)base)[off] = __double2float_rn(v); break;
    case FT_F16:
        ((uint16_t *)base)[off] = f64_to_small(v, F16_EXP_BITS, F16_MANT_BITS);
        break;
    case FT_BF16:
        ((uint16_t *)base)[off] =
            f64_to_small(v, BF16_EXP_BITS, BF16_MANT_BITS);
        break;
    case FT_I32:
        ((int32_t *)base)[off] =
            (int32_t)f64_to_int(v, (double)INT32_MIN, (double)INT32_MAX);
        break;
    case FT_I64:
        /* 2^63 is the first double above INT64_MAX; below it every double
         * converts exactly. */
        if (isnan(v))
            ((int64_t *)base)[off] = 0;
        else if (v >= 0x1p63)
            ((int64_t *)base)[off] = INT64_MAX;
        else if (v < -0x1p63)
            ((int64_t *)base)[off] = INT64_MIN;
        else
            ((int64_t *)base)[off] = (int64_t)v;
        break;
    default: break;
    }
}

/* v as dtype would hold it (the float dtypes; others unchanged). */
__device__ __forceinline__ double round_to_dtype(double v, int dtype)
{
    switch (dtype) {
    case FT_F32: return (double)__double2float_rn(v);
    case FT_F16:
        return small_to_f64(f64_to_small(v, F16_EXP_BITS, F16_MANT_BITS),
                            F16_EXP_BITS, F16_MANT_BITS);
    case FT_BF16:
        return small_to_f64(f64_to_small(v, BF16_EXP_BITS, BF16_MANT_BITS),
                            BF16_EXP_BITS, BF16_MANT_BITS);
    default: return v;
    }
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

/* load_f64 of cnt elements of operand k. */
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
                       ? small_to_f64(r[u], F16_EXP_BITS, F16_MANT_BITS)
                       : small_to_f64(r[u], BF16_EXP_BITS, BF16_MANT_BITS);
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
    default:
#pragma unroll
        for (int u = 0; u < UNROLL; u++)
            v[u] = NAN;
        break;
    }
}

/* store_f64 of cnt elements of operand k. */
template <int NOPS>
__device__ __forceinline__ void store_many(void *base, int dtype,
                                           const int64_t (&off)[UNROLL][NOPS],
                                           int k, int cnt,
                                           const double (&v)[UNROLL])
{
#pragma unroll
    for (int u = 0; u < UNROLL; u++)
        if (u < cnt)
            store_f64(base, off[u][k], dtype, v[u]);
}

/* ---- copy and fill ------------------------------------------------------ */

enum copy_mode {
    COPY_RAW, /* same dtype: the element's bytes */
    COPY_INT, /* i32 <-> i64 without the double's 53 bits */
    COPY_CONV /* through double, with ft_store_f64's rounding */
};

/* Operand 0 is dst, operand 1 src. */
__global__ void __launch_bounds__(BLOCK)
copy_kernel(geo g, void *dst, int ddt, const void *src, int sdt, int mode,
            int esize, int64_t n)
{
    const int64_t step = (int64_t)gridDim.x * BLOCK;
    for (int64_t base = (int64_t)blockIdx.x * BLOCK + threadIdx.x; base < n;
         base += step * UNROLL) {
        int64_t off[UNROLL][2];
        const int cnt = unrolled_offsets<2>(g, base, step, n, off);
        if (mode == COPY_RAW) {
            if (esize == 8) {
                uint64_t r[UNROLL];
                gather<uint64_t, 2>(src, off, 1, cnt, r);
                scatter<uint64_t, 2>(dst, off, 0, cnt, r);
            } else if (esize == 4) {
                uint32_t r[UNROLL];
                gather<uint32_t, 2>(src, off, 1, cnt, r);
                scatter<uint32_t, 2>(dst, off, 0, cnt, r);
            } else {
                uint16_t r[UNROLL];
                gather<uint16_t, 2>(src, off, 1, cnt, r);
                scatter<uint16_t, 2>(dst, off, 0, cnt, r);
            }
        } else if (mode == COPY_INT) {
            int64_t v[UNROLL];
            if (sdt == FT_I64) {
                gather<int64_t, 2>(src, off, 1, cnt, v);
            } else {
                int32_t r[UNROLL];
                gather<int32_t, 2>(src, off, 1, cnt, r);
#pragma unroll
                for (int u = 0; u < UNROLL; u++)
                    v[u] = r[u];
            }
            if (ddt == FT_I64) {
                scatter<int64_t, 2>(dst, off, 0, cnt, v);
            } else {
                int32_t r[UNROLL];
#pragma unroll
                for (int u = 0; u < UNROLL; u++)
                    r[u] = (int32_t)(v[u] > INT32_MAX   ? INT32_MAX
                                     : v[u] < INT32_MIN ? INT32_MIN
                                                        : v[u]);
                scatter<int32_t, 2>(dst, off, 0, cnt, r);
            }
        } else {
            double v[UNROLL];
            load_many<2>(src, sdt, off, 1, cnt, v);
            store_many<2>(dst, ddt, off, 0, cnt, v);
        }
    }
}

/* Every element of t gets the low esize bytes of bits. */
__global__ void __launch_bounds__(BLOCK)
fill_kernel(geo g, void *data, int esize, uint64_t bits, int64_t n)
{
    const int64_t step = (int64_t)gridDim.x * BLOCK;
    for (int64_t i = (int64_t)blockIdx.x * BLOCK + threadIdx.x; i < n;
         i += step) {
        int64_t off[1];
        geo_offsets<1>(g, i, off);
        if (esize == 8)
            ((uint64_t *)data)[off[0]] = bits;
        else if (esize == 4)
            ((uint32_t *)data)[off[0]] = (uint32_t)bits;
        else
            ((uint16_t *)data)[off[0]] = (uint16_t)bits;
    }
}

ft_status ft_cuda_copy(ft_tensor *dst, const ft_tensor *src)
{
    static const char *const F = "ft_copy";
    FT_TRY(ft_cuda_use_device(dst->device.index, F));
    const int64_t n = ft_numel(dst);
    if (n == 0)
        return FT_OK;
    const int64_t *strides[2] = {dst->stride, src->stride};
    const geo g = geo_make(dst->ndim, dst->shape, 2, strides);
    const size_t esize = ft_dtype_size(dst->dtype);
    if (dst->dtype == src->dtype && g.ndim == 1 && g.stride[0][0] == 1 &&
        g.stride[1][0] == 1) {
        FT_CUDA_TRY(F, cudaMemcpyAsync(dst->data, src->data, (size_t)n * esize,
                                       cudaMemcpyDeviceToDevice, 0));
        return FT_OK;
    }
    int mode = COPY_CONV;
    if (dst->dtype == src->dtype)
        mode = COPY_RAW;
    else if (!ft_dtype_is_float(dst->dtype) && !ft_dtype_is_float(src->dtype))
        mode = COPY_INT;
    copy_kernel<<<grid_for(n, BLOCK * UNROLL, MAX_GRID), BLOCK>>>(
        g, dst->data, (int)dst->dtype, src->data, (int)src->dtype, mode,
        (int)esize, n);
    FT_CUDA_CHECK_LAUNCH(F);
    return FT_OK;
}

ft_status ft_cuda_fill(ft_tensor *t, double value)
{
    static const char *const F = "ft_fill";
    FT_TRY(ft_cuda_use_device(t->device.index, F));
    const int64_t n = ft_numel(t);
    if (n == 0)
        return FT_OK;
    /* Convert once on the host, exactly as the CPU fill does. */
    unsigned char bytes[8] = {0};
    ft_store_f64(bytes, t->dtype, value);
    uint64_t bits = 0;
    const size_t esize = ft_dtype_size(t->dtype);
    memcpy(&bits, bytes, esize); /* little-endian: the low bytes */
    const int64_t *strides[1] = {t->stride};
    const geo g = geo_make(t->ndim, t->shape, 1, strides);
    fill_kernel<<<grid_for(n, BLOCK, MAX_GRID), BLOCK>>>(g, t->data, (int)esize,
                                                         bits, n);
    FT_CUDA_CHECK_LAUNCH(F);
    return FT_OK;
}

/* ---- random numbers ------------------------------------------------------ */

/* Thread per Philox block: elements 4 b .. 4 b + 3 (row-major) take the
 * lanes of block offset + b, as random.c's fill_random. clamp > 0: the
 * largest value below 1 of an f16/bf16 tensor, stored instead of a
 * uniform that would round up to 1. */
__global__ void __launch_bounds__(BLOCK)
random_kernel(geo g, void *data, int dtype, uint64_t seed, uint64_t offset,
              int normal, double clamp, int64_t n)
{
    const int64_t blocks = (n + FT_PHILOX_LANES - 1) / FT_PHILOX_LANES;
    const int64_t step = (int64_t)gridDim.x * BLOCK;
    for (int64_t b = (int64_t)blockIdx.x * BLOCK + threadIdx.x; b < blocks;
         b += step) {
        const ft_philox4 block = ft_philox_block(seed, offset + (uint64_t)b);
        double z[FT_PHILOX_LANES] = {0, 0, 0, 0};
        if (normal)
            ft_philox_block_normals(block, z);
#pragma unroll
        for (int lane = 0; lane < FT_PHILOX_LANES; lane++) {
            const int64_t i = b * FT_PHILOX_LANES + lane;
            if (i >= n)
                break;
            double v;
            if (normal) {
                v = z[lane];
            } else {
                v = (double)ft_philox_lane_uniform(block, (unsigned)lane);
                if (clamp > 0.0 && round_to_dtype(v, dtype) >= 1.0)
                    v = clamp;
            }
            int64_t off[1];
            geo_offsets<1>(g, i, off);
            store_f64(data, off[0], dtype, v);
        }
    }
}

/* One element per thread: element k of g's shape lies at offset off[0]
 * and is element base + off[1] of the stream (a stride-0 view collapsed:
 * the logical indices are not consecutive, so each element takes its own
 * Philox block). */
__global__ void __launch_bounds__(BLOCK)
random_at_kernel(geo g, void *data, int dtype, uint64_t seed, uint64_t offset,
                 int normal, double clamp, int64_t base, int64_t n)
{
    const int64_t step = (int64_t)gridDim.x * BLOCK;
    for (int64_t k = (int64_t)blockIdx.x * BLOCK + threadIdx.x; k < n; k += step) {
        int64_t off[2];
        geo_offsets<2>(g, k, off);
        const uint64_t i = (uint64_t)(base + off[1]);
        const unsigned lane = (unsigned)(i % FT_PHILOX_LANES);
        const ft_philox4 block = ft_philox_block(seed, offset + i / FT_PHILOX_LANES);
        double v;
        if (normal) {
            double z[FT_PHILOX_LANES];
            ft_philox_block_normals(block, z);
            v = z[lane];
        } else {
            v = (double)ft_philox_lane_uniform(block, lane);
            if (clamp > 0.0 && round_to_dtype(v, dtype) >= 1.0)
                v = clamp;
        }
        store_f64(data, off[0], dtype, v);
    }
}

ft_status ft_cuda_random(ft_tensor *t, const int64_t *row, int64_t base, uint64_t seed,
                         uint64_t offset, int normal)
{
    const char *const F = normal ? "ft_randn" : "ft_rand";
    FT_TRY(ft_cuda_use_device(t->device.index, F));
    const int64_t n = ft_numel(t);
    if (n == 0)
        return FT_OK;
    /* random.c's below_one: the largest f16/bf16 below 1. */
    double clamp = 0.0;
    if (t->dtype == FT_F16)
        clamp = 1.0 - 1.0 / 2048.0;
    else if (t->dtype == FT_BF16)
        clamp = 1.0 - 1.0 / 256.0;
    if (row) {
        const int64_t *strides[2] = {t->stride, row};
        const geo g = geo_make(t->ndim, t->shape, 2, strides);
        random_at_kernel<<<grid_for(n, BLOCK, MAX_GRID), BLOCK>>>(
            g, t->data, (int)t->dtype, seed, offset, normal, clamp, base, n);
    } else {
        const int64_t *strides[1] = {t->stride};
        const geo g = geo_make(t->ndim, t->shape, 1, strides);
        const int64_t blocks = (n + FT_PHILOX_LANES - 1) / FT_PHILOX_LANES;
        random_kernel<<<grid_for(blocks, BLOCK, MAX_GRID), BLOCK>>>(
            g, t->data, (int)t->dtype, seed, offset, normal, clamp, n);
    }
    FT_CUDA_CHECK_LAUNCH(F);
    return FT_OK;
}

/* ---- elementwise ops ------------------------------------------------------ */

/* x^y that is exact whenever y is a small integer and x^y is a double
 * (a power of an f16, bf16 or small f32 often is): such a result is
 * computed by repeated squaring, every product checked exact with an fma.
 * The host's pow returns exact results exactly; CUDA's pow may be an ulp
 * off them, which an f16/bf16 store at a rounding tie turns into a whole
 * ulp of the narrow type. Everything else goes to CUDA's pow. */
__device__ __forceinline__ double pow_exact(double x, double y)
{
    if (isfinite(x) && x != 0.0 && y != 0.0 && fabs(y) <= 64.0 &&
        y == rint(y)) {
        unsigned n = (unsigned)fabs(y);
        double result = 1.0, base = x;
        bool exact = true;
        for (;;) {
            if (n & 1) {
                const double p = __dmul_rn(result, base);
                exact = exact && isfinite(p) && fabs(p) >= 0x1p-969 &&
                        __fma_rn(result, base, -p) == 0.0;
                result = p;
            }
            n >>= 1;
            if (n == 0)
                break;
            const double sq = __dmul_rn(base, base);
            exact = exact && isfinite(sq) && fabs(sq) >= 0x1p-969 &&
                    __fma_rn(base, base, -sq) == 0.0;
            base = sq;
        }
        if (exact) /* x^-n: one correctly rounded division of an exact x^n */
            return y > 0.0 ? result : __ddiv_rn(1.0, result);
    }
    return pow(x, y);
}

/* ops.c's apply_binop and apply_unop, in double. */
__device__ __forceinline__ double apply_binop(int op, double x, double y)
{
    switch (op) {
    case FT_ADD: return x + y;
    case FT_SUB: return x - y;
    case FT_MUL: return x * y;
    case FT_DIV: return x / y;
    case FT_POW: return pow_exact(x, y);
    /* maximum/minimum propagate NaN, as torch.maximum does. */
    case FT_MAXIMUM: return isnan(x) || isnan(y) ? x + y : (x > y ? x : y);
    case FT_MINIMUM: return isnan(x) || isnan(y) ? x + y : (x < y ? x : y);
    default: return NAN;
    }
}

__device__ __forceinline__ double apply_unop(int op, double x)
{
    switch (op) {
    case FT_NEG: return -x;
    case FT_EXP: return exp(x);
    case FT_LOG: return log(x);
    case FT_ABS: return fabs(x);
    case FT_SQRT: return sqrt(x);
    case FT_TANH: return tanh(x);
    case FT_SIGMOID: return 1.0 / (1.0 + exp(-x));
    case FT_RELU: return x > 0.0 || isnan(x) ? x : 0.0;
    default: return NAN;
    }
}

enum scalar_mode {
    SCALAR_NONE,  /* out = a op b */
    SCALAR_AFTER, /* out = a op s */
    SCALAR_FIRST  /* out = s op a */
};

/* Operands: 0 out, 1 a, 2 b (unused, strides 0, when a scalar is given). */
__global__ void __launch_bounds__(BLOCK)
binary_kernel(geo g, void *out, int odt, const void *a, int adt,
              const void *b, int bdt, int op, double s, int smode, int64_t n)
{
    const int64_t step = (int64_t)gridDim.x * BLOCK;
    for (int64_t base = (int64_t)blockIdx.x * BLOCK + threadIdx.x; base < n;
         base += step * UNROLL) {
        int64_t off[UNROLL][3];
        const int cnt = unrolled_offsets<3>(g, base, step, n, off);
        double x[UNROLL], y[UNROLL];
        load_many<3>(a, adt, off, 1, cnt, x);
        if (smode == SCALAR_NONE)
            load_many<3>(b, bdt, off, 2, cnt, y);
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            if (smode == SCALAR_NONE)
                x[u] = apply_binop(op, x[u], y[u]);
            else if (smode == SCALAR_AFTER)
                x[u] = apply_binop(op, x[u], s);
            else
                x[u] = apply_binop(op, s, x[u]);
        }
        store_many<3>(out, odt, off, 0, cnt, x);
    }
}

/* Operands: 0 out, 1 a. */
__global__ void __launch_bounds__(BLOCK)
unary_kernel(geo g, void *out, int odt, const void *a, int adt, int op,
             int64_t n)
{
    const int64_t step = (int64_t)gridDim.x * BLOCK;
    for (int64_t base = (int64_t)blockIdx.x * BLOCK + threadIdx.x; base < n;
         base += step * UNROLL) {
        int64_t off[UNROLL][2];
        const int cnt = unrolled_offsets<2>(g, base, step, n, off);
        double x[UNROLL];
        load_many<2>(a, adt, off, 1, cnt, x);
#pragma unroll
        for (int u = 0; u < UNROLL; u++)
            x[u] = apply_unop(op, x[u]);
        store_many<2>(out, odt, off, 0, cnt, x);
    }
}

static ft_status binary_launch(const char *F, ft_tensor *out, ft_binop op,
                               const ft_tensor *a, const ft_tensor *b, double s,
                               int smode)
{
    FT_TRY(ft_cuda_use_device(a->device.index, F));
    const int64_t n = ft_numel(a);
    if (n == 0)
        return FT_OK;
    const int64_t *strides[3] = {out->stride, a->stride,
                                 b ? b->stride : out->stride};
    /* A scalar's operand row stays all zeros: geo_make sees two operands. */
    const geo g = geo_make(a->ndim, a->shape, b ? 3 : 2, strides);
    binary_kernel<<<grid_for(n, BLOCK * UNROLL, MAX_GRID), BLOCK>>>(
        g, out->data, (int)out->dtype, a->data, (int)a->dtype,
        b ? b->data : NULL, b ? (int)b->dtype : (int)a->dtype, (int)op, s,
        smode, n);
    FT_CUDA_CHECK_LAUNCH(F);
    return FT_OK;
}

ft_status ft_cuda_binary(ft_tensor *out, ft_binop op, const ft_tensor *a,
                         const ft_tensor *b)
{
    return binary_launch("ft_binary", out, op, a, b, 0.0, SCALAR_NONE);
}

ft_status ft_cuda_binary_scalar(ft_tensor *out, ft_binop op,
                                const ft_tensor *a, double s, int scalar_first)
{
    return binary_launch("ft_binary_scalar", out, op, a, NULL, s,
                         scalar_first ? SCALAR_FIRST : SCALAR_AFTER);
}

ft_status ft_cuda_unary(ft_tensor *out, ft_unop op, const ft_tensor *a)
{
    static const char *const F = "ft_unary";
    FT_TRY(ft_cuda_use_device(a->device.index, F));
    const int64_t n = ft_numel(a);
    if (n == 0)
        return FT_OK;
    const int64_t *strides[2] = {out->stride, a->stride};
    const geo g = geo_make(a->ndim, a->shape, 2, strides);
    unary_kernel<<<grid_for(n, BLOCK * UNROLL, MAX_GRID), BLOCK>>>(
        g, out->data, (int)out->dtype, a->data, (int)a->dtype, (int)op, n);
    FT_CUDA_CHECK_LAUNCH(F);
    return FT_OK;
}

/* ---- reductions ------------------------------------------------------------ */

/* What a reduction accumulates, per element and when combining two runs. */
enum acc_mode {
    ACC_SUM,   /* Neumaier sum of the elements (SUM, MEAN) */
    ACC_SUMSQ, /* ... of their squares (NORM) */
    ACC_MAX,   /* first position of the max; the first NaN wins */
    ACC_MIN,
    ACC_CMP    /* max |a - b| and whether all are close (ft_cuda_compare) */
};

/* A partial reduction. ACC_SUM/ACC_SUMSQ: a is the sum, b its
 * compensation. ACC_MAX/ACC_MIN: a is the extreme, at its position (-1
 * while empty). ACC_CMP: a is max |x - y| (NaN once any is NaN), at is 1
 * while every pair is close. */
struct acc {
    double a, b;
    long long at;
};

__device__ __forceinline__ acc acc_empty(int mode)
{
    acc r;
    r.a = 0.0;
    r.b = 0.0;
    r.at = mode == ACC_MAX || mode == ACC_MIN ? -1 : mode == ACC_CMP ? 1 : 0;
    return r;
}

/* Neumaier's step (ops.c's ksum_add): the rounding error of s + v goes
 * into the compensation. */
__device__ __forceinline__ void ksum_add(acc &k, double v)
{
    const double t = __dadd_rn(k.a, v);
    if (fabs(k.a) >= fabs(v))
        k.b = __dadd_rn(k.b, __dadd_rn(__dsub_rn(k.a, t), v));
    else
        k.b = __dadd_rn(k.b, __dadd_rn(__dsub_rn(v, t), k.a));
    k.a = t;
}

/* ops.c's ksum_result: once the sum is inf or NaN, the plain sum. */
__device__ __forceinline__ double ksum_result(const acc &k)
{
    return isfinite(k.a) ? __dadd_rn(k.a, k.b) : k.a;
}

/* The better of two extremes: a NaN beats any number (the first NaN wins),
 * a strictly larger (smaller) value wins, and equal values go to the
 * first position. This is the CPU's sequential rule, made order-free. */
__device__ __forceinline__ acc pick_extreme(int mode, const acc &x,
                                            const acc &y)
{
    if (y.at < 0)
        return x;
    if (x.at < 0)
        return y;
    const bool xn = isnan(x.a), yn = isnan(y.a);
    if (xn || yn) {
        if (xn && yn)
            return x.at <= y.at ? x : y;
        return xn ? x : y;
    }
    if (x.a == y.a)
        return x.at <= y.at ? x : y;
    const bool y_wins = mode == ACC_MAX ? y.a > x.a : y.a < x.a;
    return y_wins ? y : x;
}

/* Adds element v at position pos. */
__device__ __forceinline__ void acc_add(int mode, acc &x, double v,
                                        int64_t pos)
{
    switch (mode) {
    case ACC_SUM: ksum_add(x, v); break;
    case ACC_SUMSQ: ksum_add(x, __dmul_rn(v, v)); break;
    case ACC_MAX:
    case ACC_MIN: {
        acc y;
        y.a = v;
        y.b = 0.0;
        y.at = pos;
        x = pick_extreme(mode, x, y);
        break;
    }
    default: break;
    }
}

/* Adds the pair (v, w) of ACC_CMP: ops.c's visit_max_diff and
 * visit_close. */
__device__ __forceinline__ void acc_add_pair(acc &x, double v, double w,
                                             double rtol, double atol)
{
    double d;
    int close;
    if (isnan(v) || isnan(w)) {
        d = NAN;
        close = 0;
    } else {
        d = v == w ? 0.0 : fabs(v - w);
        if (isinf(v) || isinf(w))
            close = v == w;
        else
            close = fabs(v - w) <= __dadd_rn(atol, __dmul_rn(rtol, fabs(w)));
    }
    if (!isnan(x.a) && (isnan(d) || d > x.a))
        x.a = d;
    if (!close)
        x.at = 0;
}

/* Merges two partial reductions of disjoint sets of elements. */
__device__ __forceinline__ acc acc_combine(int mode, acc x, const acc &y)
{
    switch (mode) {
    case ACC_SUM:
    case ACC_SUMSQ:
        ksum_add(x, y.a);
        x.b = __dadd_rn(x.b, y.b);
        return x;
    case ACC_MAX:
    case ACC_MIN: return pick_extreme(mode, x, y);
    case ACC_CMP:
        if (!isnan(x.a) && (isnan(y.a) || y.a > x.a))
            x.a = y.a;
        x.at = x.at && y.at;
        return x;
    default: return x;
    }
}

/* The combined value of every thread's x, valid in all threads; the block
 * has BLOCK threads and all of them call it. Deterministic: the tree is
 * fixed. */
__device__ __forceinline__ acc block_reduce(int mode, acc x)
{
    __shared__ acc sh[BLOCK];
    const int t = threadIdx.x;
    sh[t] = x;
    __syncthreads();
    for (int s = BLOCK / 2; s > 0; s >>= 1) {
        if (t < s)
            sh[t] = acc_combine(mode, sh[t], sh[t + s]);
        __syncthreads();
    }
    const acc r = sh[0];
    __syncthreads(); /* sh may be reused by the next call */
    return r;
}

/* Pass 1 of a reduction over all elements: block k writes its partial to
 * part[k]. Operand 0 is a, operand 1 b (ACC_CMP only). */
__global__ void __launch_bounds__(BLOCK)
reduce_partial_kernel(geo g, const void *a, int adt, const void *b, int bdt,
                      int mode, double rtol, double atol, int64_t n, acc *part)
{
    acc x = acc_empty(mode);
    const int64_t step = (int64_t)gridDim.x * BLOCK;
    for (int64_t base = (int64_t)blockIdx.x * BLOCK + threadIdx.x; base < n;
         base += step * UNROLL) {
        int64_t off[UNROLL][2];
        const int cnt = unrolled_offsets<2>(g, base, step, n, off);
        double v[UNROLL], w[UNROLL];
        load_many<2>(a, adt, off, 0, cnt, v);
        if (mode == ACC_CMP)
            load_many<2>(b, bdt, off, 1, cnt, w);
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            if (u >= cnt)
                break;
            if (mode == ACC_CMP)
                acc_add_pair(x, v[u], w[u], rtol, atol);
            else
                acc_add(mode, x, v[u], base + u * step);
        }
    }
    x = block_reduce(mode, x);
    if (threadIdx.x == 0)
        part[blockIdx.x] = x;
}

/* Pass 2: one block combines the count partials into *result. */
__global__ void __launch_bounds__(BLOCK)
reduce_final_kernel(const acc *part, int count, int mode, acc *result)
{
    acc x = acc_empty(mode);
    for (int i = threadIdx.x; i < count; i += BLOCK)
        x = acc_combine(mode, x, part[i]);
    x = block_reduce(mode, x);
    if (threadIdx.x == 0)
        *result = x;
}

/* Gives back a temporary buffer; a failure to free is reported only when
 * nothing failed before it. */
static ft_status free_temp(void *p, ft_status st, const char *func)
{
    cudaError_t e = cudaFreeAsync(p, 0);
    if (e != cudaSuccess) {
        if (st == FT_OK)
            return ft_cuda_fail((int)e, func, "cudaFreeAsync(buffer, 0)",
                                __FILE__, __LINE__);
        cudaGetLastError();
    }
    return st;
}

/* Runs both passes into buf (grid + 1 accs) and copies the result back;
 * the copy waits for the kernels. */
static ft_status reduce_run(const char *F, const geo &g, const ft_tensor *a,
                            const ft_tensor *b, int mode, double rtol,
                            double atol, int64_t n, unsigned grid, acc *buf,
                            acc *result)
{
    reduce_partial_kernel<<<grid, BLOCK>>>(
        g, a->data, (int)a->dtype, b ? b->data : NULL,
        b ? (int)b->dtype : (int)a->dtype, mode, rtol, atol, n, buf);
    FT_CUDA_CHECK_LAUNCH(F);
    reduce_final_kernel<<<1, BLOCK>>>(buf, (int)grid, mode, buf + grid);
    FT_CUDA_CHECK_LAUNCH(F);
    FT_CUDA_TRY(F, cudaMemcpy(result, buf + grid, sizeof *result,
                              cudaMemcpyDeviceToHost));
    return FT_OK;
}

/* The combined acc of every element of a (and b), n > 0. */
static ft_status reduce_all_elements(const char *F, const ft_tensor *a,
                                     const ft_tensor *b, int mode, double rtol,
                                     double atol, acc *result)
{
    const int64_t n = ft_numel(a);
    const int64_t *strides[2] = {a->stride, b ? b->stride : a->stride};
    const geo g = geo_make(a->ndim, a->shape, b ? 2 : 1, strides);
    const unsigned grid = grid_for(n, BLOCK * UNROLL, REDUCE_GRID);
    acc *buf = NULL;
    FT_CUDA_TRY(F, cudaMallocAsync((void **)&buf, (grid + 1) * sizeof *buf, 0));
    ft_status st = reduce_run(F, g, a, b, mode, rtol, atol, n, grid, buf,
                              result);
    return free_temp(buf, st, F);
}

static int acc_mode_of(ft_reduce_op op)
{
    switch (op) {
    case FT_MAX: return ACC_MAX;
    case FT_MIN: return ACC_MIN;
    case FT_NORM: return ACC_SUMSQ;
    default: return ACC_SUM;
    }
}

/* ops.c's reducer_result, on the host. */
static double host_result(ft_reduce_op op, const acc &x, int64_t count)
{
    const double sum = isfinite(x.a) ? x.a + x.b : x.a;
    switch (op) {
    case FT_SUM: return sum;
    case FT_MEAN: return sum / (double)count;
    case FT_NORM: return sqrt(sum);
    default: return x.a;
    }
}

ft_status ft_cuda_reduce_all(ft_reduce_op op, const ft_tensor *a,
                             double *result)
{
    static const char *const F = "ft_reduce_all";
    FT_TRY(ft_cuda_use_device(a->device.index, F));
    const int64_t n = ft_numel(a);
    acc x = {0.0, 0.0, -1}; /* the empty sum (MAX/MIN of nothing is
                               rejected by ops.c) */
    if (n > 0)
        FT_TRY(reduce_all_elements(F, a, NULL, acc_mode_of(op), 0.0, 0.0, &x));
    *result = host_result(op, x, n);
    return FT_OK;
}

ft_status ft_cuda_compare(const ft_tensor *a, const ft_tensor *b, double rtol,
                          double atol, double *max_abs_diff, int *all_close)
{
    /* ops.c asks for one of the two results; the name follows. */
    const char *const F = all_close ? "ft_allclose" : "ft_max_abs_diff";
    FT_TRY(ft_cuda_use_device(a->device.index, F));
    acc x = {0.0, 0.0, 1};
    if (ft_numel(a) > 0)
        FT_TRY(reduce_all_elements(F, a, b, ACC_CMP, rtol, atol, &x));
    if (max_abs_diff)
        *max_abs_diff = x.a;
    if (all_close)
        *all_close = x.at != 0;
    return FT_OK;
}

/* The result of one line, stored as ops.c's reduce_dim_cpu stores it. */
__device__ __forceinline__ void store_line(int op, const acc &x, int64_t len,
                                           void *out, int odt, int64_t *idx,
                                           int64_t line)
{
    double r;
    switch (op) {
    case FT_SUM: r = ksum_result(x); break;
    case FT_MEAN: r = ksum_result(x) / (double)len; break;
    case FT_NORM: r = sqrt(ksum_result(x)); break;
    default: r = x.a; break;
    }
    store_f64(out, line, odt, r);
    if (idx)
        idx[line] = x.at;
}

/* The warp's combined x in lane 0 (all 32 lanes call it). */
__device__ __forceinline__ acc warp_reduce(int mode, acc x)
{
    for (int s = WARP / 2; s > 0; s >>= 1) {
        acc other;
        other.a = __shfl_down_sync(0xffffffffu, x.a, s);
        other.b = __shfl_down_sync(0xffffffffu, x.b, s);
        other.at = __shfl_down_sync(0xffffffffu, x.at, s);
        x = acc_combine(mode, x, other);
    }
    return x;
}

/* log2 of a line group: 1 thread, or a warp. */
#define GROUP_THREAD 0
#define GROUP_WARP 5

/* A group of 2^shift threads per line (one thread, or a warp); g walks
 * the line starts of a (a's shape without the reduced dim). With one
 * thread the elements are added in order: the CPU's arithmetic exactly.
 * With a warp the lanes stride along the line (coalesced when it is
 * contiguous) and combine in a tree: MAX/MIN and their positions are still
 * the CPU's, sums may differ from it in the last bit. */
__global__ void __launch_bounds__(BLOCK)
reduce_lines_kernel(geo g, const void *a, int adt, int64_t len, int64_t step,
                    int op, int mode, void *out, int odt, int64_t *idx,
                    int64_t lines, int shift)
{
    const int64_t thread = (int64_t)blockIdx.x * BLOCK + threadIdx.x;
    const int group = 1 << shift;
    const int lane = (int)(threadIdx.x & (group - 1));
    const int64_t lstep = ((int64_t)gridDim.x * BLOCK) >> shift;
    /* With a warp per line all its lanes have the same line: the loop and
     * the shuffles are warp-uniform. */
    for (int64_t line = thread >> shift; line < lines; line += lstep) {
        int64_t off[1];
        geo_offsets<1>(g, line, off);
        acc x = acc_empty(mode);
        for (int64_t j = lane; j < len; j += group)
            acc_add(mode, x, load_f64(a, off[0] + j * step, adt), j);
        if (shift == GROUP_WARP)
            x = warp_reduce(mode, x);
        if (lane == 0)
            store_line(op, x, len, out, odt, idx, line);
    }
}

/* Block per line, for long lines: the threads stride along the line and
 * combine in a tree (MAX/MIN and their positions are still the CPU's;
 * sums may differ from it in the last bit). */
__global__ void __launch_bounds__(BLOCK)
reduce_lines_block_kernel(geo g, const void *a, int adt, int64_t len,
                          int64_t step, int op, int mode, void *out, int odt,
                          int64_t *idx, int64_t lines)
{
    for (int64_t line = blockIdx.x; line < lines; line += gridDim.x) {
        int64_t off[1];
        geo_offsets<1>(g, line, off);
        acc x = acc_empty(mode);
        for (int64_t j = threadIdx.x; j < len; j += BLOCK)
            acc_add(mode, x, load_f64(a, off[0] + j * step, adt), j);
        x = block_reduce(mode, x);
        if (threadIdx.x == 0)
            store_line(op, x, len, out, odt, idx, line);
    }
}

/* How many threads work on one line of a reduction or softmax:
 *   - a block (BLOCK threads) for a long line (LONG_LINE elements or more)
 *     when the line is contiguous, or when there are too few lines for a
 *     thread each to fill the GPU (neighbouring lines are then read by
 *     neighbouring blocks, which shares their cache lines in L2);
 *   - a warp for a contiguous line of at least WARP elements (coalesced);
 *   - otherwise a thread: many short lines, or strided lines whose
 *     neighbours are neighbours in memory (coalesced across threads). */
#define LONG_LINE 1024
#define FEW_LINES 65536
#define MAX_LINE_BLOCKS 65535

enum line_group { LINE_THREAD, LINE_WARP, LINE_BLOCK };

static int line_group_for(int64_t len, int64_t step, int64_t lines)
{
    if (len >= LONG_LINE && (step == 1 || lines < FEW_LINES))
        return LINE_BLOCK;
    if (step == 1 && len >= WARP)
        return LINE_WARP;
    return LINE_THREAD;
}

static unsigned line_blocks(int64_t lines)
{
    return (unsigned)(lines < MAX_LINE_BLOCKS ? lines : MAX_LINE_BLOCKS);
}

/* The line starts of a along dim d (its shape and strides without d),
 * for nops operands of a's shape. */
static geo lines_geo(const ft_tensor *a, int d, int nops,
                     const int64_t *const *strides, int64_t *count)
{
    int64_t shape[FT_MAX_DIMS] = {0}, st[GEO_OPS][FT_MAX_DIMS] = {{0}};
    const int64_t *rows[GEO_OPS] = {NULL, NULL, NULL};
    int nd = 0;
    *count = 1;
    for (int i = 0; i < a->ndim; i++) {
        if (i == d)
            continue;
        shape[nd] = a->shape[i];
        for (int k = 0; k < nops; k++)
            st[k][nd] = strides[k][i];
        *count *= a->shape[i];
        nd++;
    }
    for (int k = 0; k < nops; k++)
        rows[k] = st[k];
    return geo_make(nd, shape, nops, rows);
}

ft_status ft_cuda_reduce_dim(ft_tensor *out, ft_tensor *indices,
                             ft_reduce_op op, const ft_tensor *a, int dim)
{
    static const char *const F = "ft_reduce_dim";
    FT_TRY(ft_cuda_use_device(a->device.index, F));
    int64_t lines;
    const int64_t *strides[1] = {a->stride};
    const geo g = lines_geo(a, dim, 1, strides, &lines);
    if (lines == 0)
        return FT_OK;
    const int64_t len = a->shape[dim], step = a->stride[dim];
    int64_t *idx = indices ? (int64_t *)indices->data : NULL;
    const int mode = acc_mode_of(op);
    const int group = line_group_for(len, step, lines);
    if (group == LINE_BLOCK) {
        reduce_lines_block_kernel<<<line_blocks(lines), BLOCK>>>(
            g, a->data, (int)a->dtype, len, step, (int)op, mode, out->data,
            (int)out->dtype, idx, lines);
    } else {
        const int shift = group == LINE_WARP ? GROUP_WARP : GROUP_THREAD;
        reduce_lines_kernel<<<grid_for(lines << shift, BLOCK, MAX_GRID),
                              BLOCK>>>(g, a->data, (int)a->dtype, len, step,
                                       (int)op, mode, out->data,
                                       (int)out->dtype, idx, lines, shift);
    }
    FT_CUDA_CHECK_LAUNCH(F);
    return FT_OK;
}

/* ---- softmax ---------------------------------------------------------------- */

/* The larger of m and v; NaN once either is NaN. */
__device__ __forceinline__ double nan_max(double m, double v)
{
    if (isnan(m))
        return m;
    if (isnan(v))
        return v;
    return v > m ? v : m;
}

/* A group of 2^shift threads (1, or a whole warp) per line; g walks the
 * line starts of a (operand 0) and out (operand 1). Each line: m = max
 * (NaN if any is NaN), then exp(x - m) / sum exp(x - m), as ops.c's
 * softmax_cpu; with one thread the sum is in the CPU's order. */
__global__ void __launch_bounds__(BLOCK)
softmax_kernel(geo g, const void *a, int adt, void *out, int odt, int64_t len,
               int64_t sa, int64_t so, int64_t lines, int shift)
{
    const int64_t thread = (int64_t)blockIdx.x * BLOCK + threadIdx.x;
    const int group = 1 << shift;
    const int lane = (int)(threadIdx.x & (group - 1));
    const int64_t lstep = ((int64_t)gridDim.x * BLOCK) >> shift;
    /* With a warp per line every lane of it has the same line, so the
     * loop and the shuffles are warp-uniform. */
    for (int64_t line = thread >> shift; line < lines; line += lstep) {
        int64_t off[2];
        geo_offsets<2>(g, line, off);
        const int64_t ia = off[0], io = off[1];

        double m = -INFINITY;
        for (int64_t j = lane; j < len; j += group)
            m = nan_max(m, load_f64(a, ia + j * sa, adt));
        if (shift == GROUP_WARP) {
            for (int s = WARP / 2; s > 0; s >>= 1)
                m = nan_max(m, __shfl_down_sync(0xffffffffu, m, s));
            m = __shfl_sync(0xffffffffu, m, 0);
        }

        acc total = {0.0, 0.0, 0};
        for (int64_t j = lane; j < len; j += group)
            ksum_add(total, exp(load_f64(a, ia + j * sa, adt) - m));
        if (shift == GROUP_WARP) {
            total = warp_reduce(ACC_SUM, total);
            total.a = __shfl_sync(0xffffffffu, total.a, 0);
            total.b = __shfl_sync(0xffffffffu, total.b, 0);
        }
        /* __drcp_rn is the correctly rounded 1 / x, as the CPU's
         * division; unlike `/` it has no slow-path call to spill around. */
        const double inv = __drcp_rn(ksum_result(total));

        for (int64_t j = lane; j < len; j += group)
            store_f64(out, io + j * so, odt,
                      __dmul_rn(exp(load_f64(a, ia + j * sa, adt) - m), inv));
    }
}

/* nan_max over the block, valid in all threads (all BLOCK call it). */
__device__ __forceinline__ double block_max(double m)
{
    __shared__ double sh[BLOCK];
    const int t = threadIdx.x;
    sh[t] = m;
    __syncthreads();
    for (int s = BLOCK / 2; s > 0; s >>= 1) {
        if (t < s)
            sh[t] = nan_max(sh[t], sh[t + s]);
        __syncthreads();
    }
    m = sh[0];
    __syncthreads(); /* sh may be reused by the next call */
    return m;
}

/* Block per line, for few long lines: the same three passes, the max and
 * the sum combined across the block. */
__global__ void __launch_bounds__(BLOCK)
softmax_block_kernel(geo g, const void *a, int adt, void *out, int odt,
                     int64_t len, int64_t sa, int64_t so, int64_t lines)
{
    for (int64_t line = blockIdx.x; line < lines; line += gridDim.x) {
        int64_t off[2];
        geo_offsets<2>(g, line, off);
        const int64_t ia = off[0], io = off[1];

        double m = -INFINITY;
        for (int64_t j = threadIdx.x; j < len; j += BLOCK)
            m = nan_max(m, load_f64(a, ia + j * sa, adt));
        m = block_max(m); /* NaN if any is */

        acc total = {0.0, 0.0, 0};
        /* Not unrolled: unrolled, this loop made ptxas spill. */
#pragma unroll 1
        for (int64_t j = threadIdx.x; j < len; j += BLOCK)
            ksum_add(total, exp(load_f64(a, ia + j * sa, adt) - m));
        total = block_reduce(ACC_SUM, total);
        const double inv = __drcp_rn(ksum_result(total));

        for (int64_t j = threadIdx.x; j < len; j += BLOCK)
            store_f64(out, io + j * so, odt,
                      __dmul_rn(exp(load_f64(a, ia + j * sa, adt) - m), inv));
    }
}

ft_status ft_cuda_softmax(ft_tensor *out, const ft_tensor *a, int dim)
{
    static const char *const F = "ft_softmax";
    FT_TRY(ft_cuda_use_device(a->device.index, F));
    if (ft_numel(a) == 0)
        return FT_OK;
    int64_t lines;
    const int64_t *strides[2] = {a->stride, out->stride};
    const geo g = lines_geo(a, dim, 2, strides, &lines);
    const int64_t len = a->shape[dim];
    const int64_t sa = a->stride[dim], so = out->stride[dim];
    const int group = line_group_for(len, sa, lines);
    if (group == LINE_BLOCK) {
        softmax_block_kernel<<<line_blocks(lines), BLOCK>>>(
            g, a->data, (int)a->dtype, out->data, (int)out->dtype, len, sa, so,
            lines);
    } else {
        const int shift = group == LINE_WARP ? GROUP_WARP : GROUP_THREAD;
        softmax_kernel<<<grid_for(lines << shift, BLOCK, MAX_GRID), BLOCK>>>(
            g, a->data, (int)a->dtype, out->data, (int)out->dtype, len, sa, so,
            lines, shift);
    }
    FT_CUDA_CHECK_LAUNCH(F);
    return FT_OK;
}
