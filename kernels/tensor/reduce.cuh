/*
 * reduce.cuh - what the reductions (reduce.cu) and softmax (softmax.cu)
 * share: the partial results of a reduction (acc) with their Neumaier sums
 * and order-free extremes, combined in a fixed tree across a warp or a
 * block (deterministic), and how many threads take one line along a dim.
 * Check: spec/cuda_ops_spec.lua (busted, tag gpu) against the CPU.
 */
#ifndef FT_TENSOR_REDUCE_CUH
#define FT_TENSOR_REDUCE_CUH

#include "common.cuh"

/* What a reduction accumulates, per element and when combining two runs. */
enum acc_mode {
    ACC_SUM,   /* Neumaier sum of the elements (SUM, MEAN) */
    ACC_SUMSQ, /* ... of their squares (NORM) */
    ACC_MAX,   /* first position of the max; the first NaN wins */
    ACC_MIN,
    ACC_CMP    /* max |a - b| and whether all are close (ft_cuda_compare) */
};

/* A partial reduction. ACC_SUM/ACC_SUMSQ: a is the sum, b its
 * compensation (scalar_ops.h's ft_ksum_add). ACC_MAX/ACC_MIN: a is the
 * extreme, at its position (-1 while empty). ACC_CMP: a is max |x - y|
 * (NaN once any is NaN), at is 1 while every pair is close. */
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
    case ACC_SUM: ft_ksum_add(&x.a, &x.b, v); break;
    case ACC_SUMSQ: ft_ksum_add(&x.a, &x.b, __dmul_rn(v, v)); break;
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

/* Merges two partial reductions of disjoint sets of elements. */
__device__ __forceinline__ acc acc_combine(int mode, acc x, const acc &y)
{
    switch (mode) {
    case ACC_SUM:
    case ACC_SUMSQ:
        ft_ksum_add(&x.a, &x.b, y.a);
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

static inline int line_group_for(int64_t len, int64_t step, int64_t lines)
{
    if (len >= LONG_LINE && (step == 1 || lines < FEW_LINES))
        return LINE_BLOCK;
    if (step == 1 && len >= WARP)
        return LINE_WARP;
    return LINE_THREAD;
}

static inline unsigned line_blocks(int64_t lines)
{
    return (unsigned)(lines < MAX_LINE_BLOCKS ? lines : MAX_LINE_BLOCKS);
}

/* The line starts of a along dim d (its shape and strides without d),
 * for nops operands of a's shape. */
static inline geo lines_geo(const ft_tensor *a, int d, int nops,
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

#endif /* FT_TENSOR_REDUCE_CUH */
