/*
 * attention/naive.cu - the traditional attention on CUDA, the baseline the
 * flash kernels are measured against: S and P of every (batch, head)
 * materialised in device memory (O(B * H * Nq * Nk), counted by the pool's
 * statistics) and every product done by cuBLAS. f64, f32, f16, bf16.
 * Limits: seqlens, heads x head_dim and row strides up to INT_MAX (cuBLAS's
 * int); the cuBLAS handle of each device from cublas_util.h.
 * Check: the CUDA specs compare impl "naive" on cuda against the CPU naive
 * path (f64 to ~1e-12; f16/bf16 within their rounding), with causal, GQA,
 * Nq != Nk, strided and expanded q/k/v, and Nq or Nk = 0. Run them with
 * FT_CUDA_SYNC=1 (errors at the launch that caused them) and under
 * compute-sanitizer. Design: kernels/README.md.
 */
#include <climits>
#include <cmath>
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#ifndef FT_HAVE_CUDA
#define FT_HAVE_CUDA 1 /* a .cu is only built with the CUDA backend */
#endif

#include "kernels.h"
#include "cublas_util.h"

#define THREADS 256            /* every kernel's block: 8 warps */
#define MAX_BLOCKS (1 << 20)   /* grid-stride loops beyond this */

/* The variant of one call as the kernels see it: lib/attn_mod.h's
 * description, where ALiBi's slopes and the sinks live on the device, and
 * LSE's element strides (a varlen call's LSE is a strided view). */
struct naive_mod {
    ft_attn_mod m;
    const void *slopes; /* [H] (slopes_sb = 0) or [B, H] */
    int slopes_f64;
    int64_t slopes_sb, slopes_sh;
    const void *sink; /* [H] */
    int sink_f64;
    int64_t sink_sh;
    int64_t batch0, H, Nq, Nk;
    int64_t lse_sb, lse_sh, lse_si;
};

/* ---- kernels (in an anonymous namespace: other .cu files may use the
 * same names) ---- */

namespace {

__device__ inline float acc_exp(float x) { return expf(x); }
__device__ inline double acc_exp(double x) { return exp(x); }

/* Element i of a f16 or bf16 array, rounded to nearest even. */
__device__ inline void store_lo(void *p, int64_t i, int dtype, float v)
{
    if (dtype == FT_F16)
        ((__half *)p)[i] = __float2half_rn(v);
    else
        ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(v);
}

/* Element i of an array of dtype (f64, f32, f16 or bf16) as a double. */
__device__ inline double load_elem(const void *p, int64_t i, int dtype)
{
    switch (dtype) {
    case FT_F64: return ((const double *)p)[i];
    case FT_F32: return (double)((const float *)p)[i];
    case FT_F16: return (double)__half2float(((const __half *)p)[i]);
    default: return (double)__bfloat162float(((const __nv_bfloat16 *)p)[i]);
    }
}

/* The larger of x and m, NaN when either is (as max_nan in flash_common.cuh
 * and the CPU's FT_NAN_MAX); f32 and f64. */
template <typename T> __device__ __forceinline__ T max_nan(T x, T m)
{
    return x > m || x != x ? x : m;
}

/* The sum (or max) of v over the warp, returned to every lane. The max
 * keeps NaN, as the CPU's FT_NAN_MAX does: a row with a NaN score has a NaN
 * maximum, so its output and LSE are NaN. */
template <typename T> __device__ T warp_reduce(T v, bool is_max)
{
    for (int o = 16; o > 0; o >>= 1) {
        const T w = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? max_nan(w, v) : v + w;
    }
    return v;
}

/* The same over the block. shared holds one value per warp; blockDim.x is
 * a multiple of 32. */
template <typename T>
__device__ T block_reduce(T v, bool is_max, T *shared)
{
    v = warp_reduce(v, is_max);
    __syncthreads(); /* readers of the previous reduction are done */
    if ((threadIdx.x & 31) == 0)
        shared[threadIdx.x >> 5] = v;
    __syncthreads();
    v = shared[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); w++)
        v = is_max ? max_nan(shared[w], v) : v + shared[w];
    return v;
}

/* A row r = (b * H + h) * Nq + i of the scores as (b, h, i). */
struct row_index {
    int64_t b, h, i;
};

__device__ inline row_index row_of(const naive_mod &nm, int64_t r)
{
    row_index x;
    x.i = r % nm.Nq;
    x.h = r / nm.Nq % nm.H;
    x.b = r / (nm.Nq * nm.H);
    return x;
}

__device__ inline double load_any(const void *p, int f64, int64_t i)
{
    return f64 ? ((const double *)p)[i] : (double)((const float *)p)[i];
}

/* Dropout's factor for P_ij: 1 / (1 - p) kept, 0 dropped, 1 without. */
__device__ inline double keep_scale(const naive_mod &nm, row_index x, int64_t j)
{
    if (!nm.m.dropout)
        return 1.0;
    return ft_mod_keep(&nm.m, nm.batch0 + x.b, nm.H, x.h, x.i, j) ? nm.m.drop_scale : 0.0;
}

/* One block per row r of S [B, H, Nq, Nk], which holds x = scale q.k: the
 * scores modified as lib/attn_mod.h says, softmax over the keys row i sees
 * (and the sink), then
 *   S    <- P, dropped (times dropout's factor) when drop_in_S
 *   P_lo <- P dropped, rounded to f16/bf16 (lo_dtype), when not NULL
 *   Pd   <- P dropped, when not NULL
 *   SG   <- d score / d x (the softcap's derivative), when not NULL
 *   lse  <- the row's LSE (of the undropped scores), when not NULL.
 * With Nk = 0 (S unused) it only writes LSE: -inf, or the sink. */
template <typename T>
__global__ void __launch_bounds__(THREADS)
softmax_rows(T *S, void *P_lo, int lo_dtype, T *Pd, T *SG, T *lse, int drop_in_S,
             int64_t rows, naive_mod nm)
{
    __shared__ T shared[THREADS / 32];
    const int64_t Nq = nm.Nq, Nk = nm.Nk;
    const int modified = nm.m.softcap > 0 || nm.m.alibi;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const row_index x = row_of(nm, r);
        const int64_t begin = ft_mod_key_begin(&nm.m, Nq, Nk, x.i);
        const int64_t end = ft_mod_key_end(&nm.m, Nq, Nk, x.i);
        const double slope = nm.m.alibi ? load_any(nm.slopes, nm.slopes_f64,
                                                   (nm.batch0 + x.b) * nm.slopes_sb +
                                                       x.h * nm.slopes_sh)
                                        : 0.0;
        const T sink = nm.m.sink ? (T)load_any(nm.sink, nm.sink_f64, x.h * nm.sink_sh)
                                 : (T)-INFINITY;
        T *row = S + r * Nk;
        T m = (T)-INFINITY;
        for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) {
            T v = row[j];
            if (SG)
                SG[r * Nk + j] = (T)ft_mod_score_grad(&nm.m, (double)v);
            if (modified)
                row[j] = v = (T)ft_mod_score(&nm.m, slope, Nq, Nk, x.i, j, (double)v);
            m = max_nan(v, m);
        }
        m = block_reduce(m, true, shared);
        m = max_nan(sink, m);
        const bool empty = m == (T)-INFINITY; /* no visible key, no sink */
        T l = 0;
        if (!empty)
            for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) {
                const T e = acc_exp(row[j] - m);
                row[j] = e;
                l += e;
            }
        l = block_reduce(l, false, shared);
        if (nm.m.sink && !empty)
            l += acc_exp(sink - m);
        for (int64_t j = threadIdx.x; j < Nk; j += blockDim.x) {
            const bool seen = !empty && j >= begin && j < end;
            const T p = seen ? row[j] / l : (T)0;
            const T pd = seen && nm.m.dropout ? p * (T)keep_scale(nm, x, j) : p;
            row[j] = drop_in_S ? pd : p;
            if (P_lo)
                store_lo(P_lo, r * Nk + j, lo_dtype, (float)pd);
            if (Pd)
                Pd[r * Nk + j] = pd;
            if (SG && !seen)
                SG[r * Nk + j] = 0;
        }
        if (lse && threadIdx.x == 0)
            lse[x.b * nm.lse_sb + x.h * nm.lse_sh + x.i * nm.lse_si] =
                empty ? (T)-INFINITY : (T)((double)m + log((double)l));
    }
}

/* One block per row r of P (undropped) and dP [B, H, Nq, Nk]: with z
 * dropout's factor and g the score's derivative (SG, or 1),
 * D = sum_j P z dP, then dS = P (z dP - D) g over dP, and into dS_lo
 * (f16/bf16) when not NULL. */
template <typename T>
__global__ void __launch_bounds__(THREADS)
ds_rows(const T *P, T *dP, void *dS_lo, int lo_dtype, const T *SG, int64_t rows,
        naive_mod nm)
{
    __shared__ T shared[THREADS / 32];
    const int64_t Nk = nm.Nk;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const row_index x = row_of(nm, r);
        const T *p = P + r * Nk;
        T *dp = dP + r * Nk;
        T D = 0;
        for (int64_t j = threadIdx.x; j < Nk; j += blockDim.x) {
            if (nm.m.dropout)
                dp[j] *= (T)keep_scale(nm, x, j);
            D += p[j] * dp[j];
        }
        D = block_reduce(D, false, shared);
        for (int64_t j = threadIdx.x; j < Nk; j += blockDim.x) {
            T ds = p[j] * (dp[j] - D);
            if (SG)
                ds *= SG[r * Nk + j];
            dp[j] = ds;
            if (dS_lo)
                store_lo(dS_lo, r * Nk + j, lo_dtype, (float)ds);
        }
    }
}

/* part[h * SINK_PARTS + c] = sum over the rows (b, i) that block c takes
 * of e^(sink_h - lse) (dout . out), for out, dout [B, Nq, H, d] with
 * element strides o_*, g_* (1 along d): a warp a row, its lanes along d
 * (coalesced), the rows r = c * 8 + warp, then on by SINK_PARTS * 8; sums
 * in f64, in a fixed order (deterministic). Grid (H, SINK_PARTS). */
__global__ void __launch_bounds__(THREADS)
sink_grad_kernel(const void *out, const void *dout, int dtype, int64_t o_sb, int64_t o_si,
                 int64_t o_sh, int64_t g_sb, int64_t g_si, int64_t g_sh, int64_t B,
                 int64_t d, const float *lse32, const double *lse64, naive_mod nm,
                 double *part)
{
    __shared__ double shared[THREADS / 32];
    const int64_t h = blockIdx.x;
    const int lane = threadIdx.x & 31, warps = THREADS / 32;
    const double sink = load_any(nm.sink, nm.sink_f64, h * nm.sink_sh);
    double sum = 0; /* lane 0's */
    for (int64_t t = blockIdx.y * (int64_t)warps + (threadIdx.x >> 5); t < B * nm.Nq;
         t += (int64_t)FT_SINK_PARTS * warps) {
        const int64_t b = t / nm.Nq, i = t % nm.Nq;
        double D = 0;
        for (int64_t e = lane; e < d; e += 32)
            D += load_elem(dout, b * g_sb + i * g_si + h * g_sh + e, dtype) *
                 load_elem(out, b * o_sb + i * o_si + h * o_sh + e, dtype);
        D = warp_reduce(D, false);
        const int64_t lo = b * nm.lse_sb + h * nm.lse_sh + i * nm.lse_si;
        const double L = lse64 ? lse64[lo] : (double)lse32[lo];
        if (lane == 0 && sink != -INFINITY)
            sum += exp(sink - L) * D;
    }
    sum = block_reduce(sum, false, shared); /* lanes past 0 add zeros */
    if (threadIdx.x == 0)
        part[h * FT_SINK_PARTS + blockIdx.y] = sum;
}

/* acc[h] -= the SINK_PARTS partial sums of head h, in order. */
__global__ void sink_grad_sum(const double *part, double *acc, int64_t H)
{
    const int64_t h = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (h >= H)
        return;
    double sum = 0;
    for (int c = 0; c < FT_SINK_PARTS; c++)
        sum += part[h * FT_SINK_PARTS + c];
    acc[h] -= sum;
}

/* dst[i] = src[i] rounded to f16/bf16, n elements. */
__global__ void __launch_bounds__(THREADS)
f32_to_lo(const float *src, void *dst, int lo_dtype, int64_t n)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        store_lo(dst, i, lo_dtype, src[i]);
}

/* dst [B, N, Hx, d] contiguous = src with element strides sb, sn, sh (and
 * 1 along d, or d = 1); elements of esize bytes (2, 4 or 8). */
__global__ void __launch_bounds__(THREADS)
pack_rows(const char *src, char *dst, int esize, int64_t N, int64_t Hx, int64_t d,
          int64_t sb, int64_t sn, int64_t sh, int64_t n)
{
    for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        int64_t t = idx;
        const int64_t c = t % d;
        t /= d;
        const int64_t h = t % Hx;
        t /= Hx;
        const int64_t row = t % N, b = t / N;
        const int64_t off = b * sb + row * sn + h * sh + c;
        if (esize == 2)
            ((uint16_t *)dst)[idx] = ((const uint16_t *)src)[off];
        else if (esize == 4)
            ((uint32_t *)dst)[idx] = ((const uint32_t *)src)[off];
        else
            ((uint64_t *)dst)[idx] = ((const uint64_t *)src)[off];
    }
}

/* mask [B, H, Nq, Nk] (f32, contiguous) = dropout's factor of every P_ij. */
__global__ void __launch_bounds__(THREADS)
dropout_mask_kernel(float *mask, ft_attn_mod m, int64_t H, int64_t Nq, int64_t Nk, int64_t n)
{
    for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < n;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t j = idx % Nk, i = idx / Nk % Nq, h = idx / (Nk * Nq) % H;
        const int64_t b = idx / (Nk * Nq * H);
        mask[idx] = ft_mod_keep(&m, b, H, h, i, j) ? (float)m.drop_scale : 0.0f;
    }
}

} /* namespace */

static unsigned blocks_for(int64_t work)
{
    return (unsigned)(work < 1 ? 1 : work > MAX_BLOCKS ? MAX_BLOCKS : work);
}

static unsigned blocks_for_elems(int64_t n) { return blocks_for((n + THREADS - 1) / THREADS); }

/* ---- one call's context: shape, handle, scratch ---- */

#define MAX_SCRATCH 12 /* the backward: 4 packed inputs, 5 buffers */

typedef struct naive_ctx {
    const ft_attn_shape *s;
    const char *func;
    ft_device device;
    ft_dtype dtype;  /* of every input and gradient */
    ft_dtype acc;    /* of S, P, dP and LSE: f64 for f64 inputs, else f32 */
    int lo;          /* f16/bf16 inputs: P and dS also kept in dtype */
    cublasHandle_t handle;
    ft_tensor *scratch[MAX_SCRATCH];
    int nscratch;
} naive_ctx;

/* count elements of dtype from the device pool (a 1-d tensor, so that the
 * pool's statistics count it), freed by release_scratch whatever happens. */
static ft_status scratch_alloc(naive_ctx *c, void **p, int64_t count, ft_dtype dtype)
{
    if (c->nscratch == MAX_SCRATCH)
        return ft_fail(FT_ERR_INTERNAL, c->func, 0, "naive attention: too many scratch buffers");
    ft_tensor *t = NULL;
    FT_TRY(ft_empty_named(&t, 1, &count, dtype, c->device, c->func));
    c->scratch[c->nscratch++] = t;
    *p = t->data;
    return FT_OK;
}

static void release_scratch(naive_ctx *c)
{
    /* Frees are stream-ordered (cudaFreeAsync on stream 0): queued work
     * that reads the buffers finishes first. */
    for (int i = 0; i < c->nscratch; i++)
        ft_tensor_free(c->scratch[i]);
    c->nscratch = 0;
}

/* B * H * Nq * Nk, the elements of one score buffer. */
static ft_status score_count(const naive_ctx *c, int64_t *out)
{
    const ft_attn_shape *s = c->s;
    int64_t n;
    if (__builtin_mul_overflow(s->B, s->H, &n) || __builtin_mul_overflow(n, s->Nq, &n) ||
        __builtin_mul_overflow(n, s->Nk, &n))
        return ft_fail(FT_ERR_NOMEM, c->func, 0,
                       "naive attention: %lld x %lld x %lld x %lld scores do not fit in memory",
                       (long long)s->B, (long long)s->H, (long long)s->Nq, (long long)s->Nk);
    *out = n;
    return FT_OK;
}

static ft_status check_limits(const naive_ctx *c)
{
    const ft_attn_shape *s = c->s;
    if (s->Nq > INT_MAX || s->Nk > INT_MAX || s->H > INT_MAX / s->d)
        return ft_fail(FT_ERR_UNSUPPORTED, c->func, 0,
                       "naive CUDA attention: seqlen_q %lld, seqlen_k %lld and heads x head_dim "
                       "%lld must be at most %d (cuBLAS's int)",
                       (long long)s->Nq, (long long)s->Nk, (long long)(s->H * s->d), INT_MAX);
    return FT_OK;
}

static cudaDataType_t cuda_type(ft_dtype t)
{
    switch (t) {
    case FT_F64: return CUDA_R_64F;
    case FT_F16: return CUDA_R_16F;
    case FT_BF16: return CUDA_R_16BF;
    default: return CUDA_R_32F;
    }
}

/* ---- GEMM operands ---- */

/* A matrix per (b, head): element (row, col) of batch b, head x lies at
 * ptr + (b * sb + x * sh + row * ld + col) elements. kv: indexed by kv
 * head (k, v, dk, dv), else by query head (q, dout, out, dq, scores). */
typedef struct operand {
    char *ptr;
    size_t esize;
    cudaDataType_t type;
    int64_t ld, sb, sh;
    int kv;
} operand;

static operand make_operand(void *p, ft_dtype dtype, int64_t ld, int64_t sb, int64_t sh, int kv)
{
    operand op;
    op.ptr = (char *)p;
    op.esize = ft_dtype_size(dtype);
    op.type = cuda_type(dtype);
    op.ld = ld, op.sb = sb, op.sh = sh, op.kv = kv;
    return op;
}

/* A contiguous [B, N, Hx, d] tensor (out, the gradients, packed copies). */
static operand contiguous_operand(void *p, ft_dtype dtype, int64_t N, int64_t Hx, int64_t d,
                                  int kv)
{
    return make_operand(p, dtype, Hx * d, N * Hx * d, d, kv);
}

/* A score buffer [B, H, Nq, Nk]. */
static operand scores_operand(const naive_ctx *c, void *p, ft_dtype dtype)
{
    const ft_attn_shape *s = c->s;
    return make_operand(p, dtype, s->Nk, s->H * s->Nq * s->Nk, s->Nq * s->Nk, 0);
}

/* An input [B, N, Hx, d] as it lies when cuBLAS can read it (rows at least
 * d and at most INT_MAX elements apart; a single row any), else a packed
 * copy. */
static ft_status input_operand(naive_ctx *c, const ft_tensor *t, int kv, operand *op)
{
    const int64_t N = t->shape[1], Hx = t->shape[2], d = t->shape[3];
    if (N <= 1 || (t->stride[1] >= d && t->stride[1] <= INT_MAX)) {
        *op = make_operand(t->data, t->dtype, N > 1 ? t->stride[1] : d, t->stride[0],
                           t->stride[2], kv);
        return FT_OK;
    }
    const int64_t n = ft_numel(t);
    void *p = NULL;
    FT_TRY(scratch_alloc(c, &p, n, t->dtype));
    pack_rows<<<blocks_for_elems(n), THREADS>>>((const char *)t->data, (char *)p,
                                                (int)ft_dtype_size(t->dtype),
                                                N, Hx, d, t->stride[0], t->stride[1],
                                                t->stride[2], n);
    FT_CUDA_CHECK_LAUNCH(c->func);
    *op = contiguous_operand(p, t->dtype, N, Hx, d, kv);
    return FT_OK;
}

/* C = alpha op(A) op(B) (+ C) for every (b, h), column-major as cuBLAS
 * sees the operands: one strided batch over the Hk kv heads per (b, g),
 * query head hk * G + g. A kv-indexed C (dK, dV) sums the G heads of its
 * group: beta = 0 for g = 0, then 1. */
static ft_status gemm_heads(const naive_ctx *c, cublasOperation_t ta, cublasOperation_t tb,
                            int64_t m, int64_t n, int64_t k, double alpha, const operand *A,
                            const operand *B, const operand *C)
{
    const ft_attn_shape *s = c->s;
    const int64_t G = s->H / s->Hk;
    const int f64 = c->acc == FT_F64;
    const operand *ops[3] = {A, B, C};
    for (int64_t b = 0; b < s->B; b++)
        for (int64_t g = 0; g < G; g++) {
            char *ptr[3];
            long long stride[3];
            for (int i = 0; i < 3; i++) {
                const operand *o = ops[i];
                ptr[i] = o->ptr + (b * o->sb + (o->kv ? 0 : g * o->sh)) * (int64_t)o->esize;
                stride[i] = o->kv ? o->sh : G * o->sh;
            }
            const int accumulate = C->kv && g > 0;
            const float alpha32 = (float)alpha, beta32 = accumulate ? 1.0f : 0.0f;
            const double alpha64 = alpha, beta64 = accumulate ? 1.0 : 0.0;
            cublasStatus_t e = cublasGemmStridedBatchedEx(
                c->handle, ta, tb, (int)m, (int)n, (int)k,
                f64 ? (const void *)&alpha64 : (const void *)&alpha32,
                ptr[0], A->type, (int)A->ld, stride[0],
                ptr[1], B->type, (int)B->ld, stride[1],
                f64 ? (const void *)&beta64 : (const void *)&beta32,
                ptr[2], C->type, (int)C->ld, stride[2], (int)s->Hk,
                f64 ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
            if (e != CUBLAS_STATUS_SUCCESS)
                return ft_cublas_fail(e, c->func, "cublasGemmStridedBatchedEx", __FILE__,
                                      __LINE__);
        }
    const int64_t heads = C->kv ? s->Hk : s->H;
    if (s->B > 0 && heads > 0 && m > 0 && n > 0)
        ft_cuda_mark_written(C->ptr, (size_t)((s->B - 1) * C->sb + (heads - 1) * C->sh +
                                              (n - 1) * C->ld + m) * C->esize);
    return FT_OK;
}

/* ---- the passes ---- */

/* The variant for the kernels; lse (or NULL) gives LSE's strides. */
static naive_mod make_mod(const ft_attn_shape *s, const ft_tensor *lse)
{
    naive_mod nm;
    memset(&nm, 0, sizeof nm);
    nm.m = s->mod;
    if (s->alibi) {
        nm.slopes = s->alibi->data;
        nm.slopes_f64 = s->alibi->dtype == FT_F64;
        nm.slopes_sb = s->alibi->ndim == 2 ? s->alibi->stride[0] : 0;
        nm.slopes_sh = s->alibi->stride[s->alibi->ndim - 1];
    }
    if (s->sink) {
        nm.sink = s->sink->data;
        nm.sink_f64 = s->sink->dtype == FT_F64;
        nm.sink_sh = s->sink->stride[0];
    }
    nm.batch0 = s->batch0, nm.H = s->H, nm.Nq = s->Nq, nm.Nk = s->Nk;
    if (lse)
        nm.lse_sb = lse->stride[0], nm.lse_sh = lse->stride[1], nm.lse_si = lse->stride[2];
    return nm;
}

/* S = scale Q K^T into S (acc dtype): column-major S^T [Nk, Nq] = K [Nk, d]
 * Q^T [d, Nq]. Then softmax_rows over it (see there for P_lo, Pd, SG,
 * drop_in_S); LSE into lse when not NULL. */
static ft_status scores_and_softmax(naive_ctx *c, const operand *Q, const operand *K, void *S,
                                    void *P_lo, void *Pd, void *SG, ft_tensor *lse,
                                    int drop_in_S)
{
    const ft_attn_shape *s = c->s;
    const operand Sop = scores_operand(c, S, c->acc);
    FT_TRY(gemm_heads(c, CUBLAS_OP_T, CUBLAS_OP_N, s->Nk, s->Nq, s->d, s->scale, K, Q, &Sop));
    const int64_t rows = s->B * s->H * s->Nq;
    const naive_mod nm = make_mod(s, lse);
    if (c->acc == FT_F64)
        softmax_rows<double><<<blocks_for(rows), THREADS>>>(
            (double *)S, NULL, 0, (double *)Pd, (double *)SG, lse ? (double *)lse->data : NULL,
            drop_in_S, rows, nm);
    else
        softmax_rows<float><<<blocks_for(rows), THREADS>>>(
            (float *)S, P_lo, (int)c->dtype, (float *)Pd, (float *)SG,
            lse ? (float *)lse->data : NULL, drop_in_S, rows, nm);
    FT_CUDA_CHECK_LAUNCH(c->func);
    return FT_OK;
}

static ft_status forward_work(naive_ctx *c, const ft_tensor *q, const ft_tensor *k,
                              const ft_tensor *v, ft_tensor *out, ft_tensor *lse)
{
    const ft_attn_shape *s = c->s;
    int64_t scores;
    FT_TRY(check_limits(c));
    FT_TRY(score_count(c, &scores));
    FT_TRY(ft_cublas_handle(c->device.index, c->func, &c->handle));
    operand Q, K, V;
    FT_TRY(input_operand(c, q, 0, &Q));
    FT_TRY(input_operand(c, k, 1, &K));
    FT_TRY(input_operand(c, v, 1, &V));
    void *S = NULL, *P_lo = NULL;
    FT_TRY(scratch_alloc(c, &S, scores, c->acc));
    if (c->lo)
        FT_TRY(scratch_alloc(c, &P_lo, scores, c->dtype));

    FT_TRY(scores_and_softmax(c, &Q, &K, S, P_lo, NULL, NULL, lse, 1));

    /* O = P V: column-major O^T [d, Nq] = V^T [d, Nk] P^T [Nk, Nq]. */
    const operand P = c->lo ? scores_operand(c, P_lo, c->dtype) : scores_operand(c, S, c->acc);
    const operand O = contiguous_operand(out->data, c->dtype, s->Nq, s->H, s->d, 0);
    FT_TRY(gemm_heads(c, CUBLAS_OP_N, CUBLAS_OP_N, s->d, s->Nq, s->Nk, 1.0, &V, &P, &O));
    return FT_OK;
}

static ft_status backward_work(naive_ctx *c, const ft_tensor *dout, const ft_tensor *q,
                               const ft_tensor *k, const ft_tensor *v, ft_tensor *dq,
                               ft_tensor *dk, ft_tensor *dv)
{
    const ft_attn_shape *s = c->s;
    int64_t scores;
    FT_TRY(check_limits(c));
    FT_TRY(score_count(c, &scores));
    FT_TRY(ft_cublas_handle(c->device.index, c->func, &c->handle));
    operand Q, K, V, dO;
    FT_TRY(input_operand(c, q, 0, &Q));
    FT_TRY(input_operand(c, k, 1, &K));
    FT_TRY(input_operand(c, v, 1, &V));
    FT_TRY(input_operand(c, dout, 0, &dO));
    void *S = NULL, *dP = NULL, *lo = NULL, *dK32 = NULL, *dV32 = NULL, *Pd = NULL, *SG = NULL;
    FT_TRY(scratch_alloc(c, &S, scores, c->acc));
    FT_TRY(scratch_alloc(c, &dP, scores, c->acc));
    if (s->mod.dropout && !c->lo) /* P dropped, for dV (lo holds it otherwise) */
        FT_TRY(scratch_alloc(c, &Pd, scores, c->acc));
    if (s->mod.softcap > 0) /* the softcap's derivative */
        FT_TRY(scratch_alloc(c, &SG, scores, c->acc));
    const int64_t kv_numel = ft_numel(dk);
    if (c->lo) { /* P, then dS, in dtype; dK and dV summed in f32 */
        FT_TRY(scratch_alloc(c, &lo, scores, c->dtype));
        FT_TRY(scratch_alloc(c, &dK32, kv_numel, FT_F32));
        FT_TRY(scratch_alloc(c, &dV32, kv_numel, FT_F32));
    }

    FT_TRY(scores_and_softmax(c, &Q, &K, S, lo, Pd, SG, NULL, 0));

    /* dP = dO V^T: column-major dP^T [Nk, Nq] = V [Nk, d] dO^T [d, Nq]. */
    const operand dPop = scores_operand(c, dP, c->acc);
    FT_TRY(gemm_heads(c, CUBLAS_OP_T, CUBLAS_OP_N, s->Nk, s->Nq, s->d, 1.0, &V, &dO, &dPop));

    /* dV = sum_g P^T dO (P dropped): column-major dV^T [d, Nk] = dO^T [d, Nq] P [Nq, Nk]. */
    const operand P = c->lo ? scores_operand(c, lo, c->dtype)
                            : scores_operand(c, Pd ? Pd : S, c->acc);
    const operand dVop = c->lo ? contiguous_operand(dV32, FT_F32, s->Nk, s->Hk, s->d, 1)
                               : contiguous_operand(dv->data, c->dtype, s->Nk, s->Hk, s->d, 1);
    FT_TRY(gemm_heads(c, CUBLAS_OP_N, CUBLAS_OP_T, s->d, s->Nk, s->Nq, 1.0, &dO, &P, &dVop));

    /* dS = P * (dP - D) over dP, and over P's dtype copy in lo (which the
     * dV product above has read: same stream). */
    const int64_t rows = s->B * s->H * s->Nq;
    const naive_mod nm = make_mod(s, NULL);
    if (c->acc == FT_F64)
        ds_rows<double><<<blocks_for(rows), THREADS>>>((const double *)S, (double *)dP, NULL,
                                                       0, (const double *)SG, rows, nm);
    else
        ds_rows<float><<<blocks_for(rows), THREADS>>>((const float *)S, (float *)dP, lo,
                                                      (int)c->dtype, (const float *)SG, rows,
                                                      nm);
    FT_CUDA_CHECK_LAUNCH(c->func);
    const operand dS = c->lo ? scores_operand(c, lo, c->dtype) : dPop;

    /* dQ = scale dS K: column-major dQ^T [d, Nq] = K^T [d, Nk] dS^T [Nk, Nq]. */
    const operand dQop = contiguous_operand(dq->data, c->dtype, s->Nq, s->H, s->d, 0);
    FT_TRY(gemm_heads(c, CUBLAS_OP_N, CUBLAS_OP_N, s->d, s->Nq, s->Nk, s->scale, &K, &dS, &dQop));

    /* dK = sum_g scale dS^T Q: column-major dK^T [d, Nk] = Q^T [d, Nq] dS [Nq, Nk]. */
    const operand dKop = c->lo ? contiguous_operand(dK32, FT_F32, s->Nk, s->Hk, s->d, 1)
                               : contiguous_operand(dk->data, c->dtype, s->Nk, s->Hk, s->d, 1);
    FT_TRY(gemm_heads(c, CUBLAS_OP_N, CUBLAS_OP_T, s->d, s->Nk, s->Nq, s->scale, &Q, &dS, &dKop));

    if (c->lo) {
        f32_to_lo<<<blocks_for_elems(kv_numel), THREADS>>>((const float *)dK32, dk->data,
                                                           (int)c->dtype, kv_numel);
        FT_CUDA_CHECK_LAUNCH(c->func);
        f32_to_lo<<<blocks_for_elems(kv_numel), THREADS>>>((const float *)dV32, dv->data,
                                                           (int)c->dtype, kv_numel);
        FT_CUDA_CHECK_LAUNCH(c->func);
    }
    return FT_OK;
}

/* ---- the launchers ---- */

static naive_ctx make_ctx(const ft_attn_shape *s, const ft_tensor *q, const char *func)
{
    naive_ctx c;
    memset(&c, 0, sizeof c);
    c.s = s;
    c.func = func;
    c.device = q->device;
    c.dtype = q->dtype;
    c.acc = q->dtype == FT_F64 ? FT_F64 : FT_F32;
    c.lo = q->dtype == FT_F16 || q->dtype == FT_BF16;
    return c;
}

/* Zeros over a contiguous tensor (all-zero bits are 0.0 in every dtype). */
static ft_status zero_tensor(ft_tensor *t, const char *func)
{
    const size_t nbytes = (size_t)ft_numel(t) * ft_dtype_size(t->dtype);
    if (nbytes > 0)
        FT_CUDA_TRY(func, cudaMemsetAsync(t->data, 0, nbytes, 0));
    return FT_OK;
}

ft_status ft_attention_forward_naive_cuda(const ft_attn_shape *s, const ft_tensor *q,
                                          const ft_tensor *k, const ft_tensor *v,
                                          ft_tensor *out, ft_tensor *lse)
{
    static const char func[] = "ft_attention_forward";
    FT_TRY(ft_cuda_use_device(q->device.index, func));
    if (s->B == 0 || s->H == 0 || s->Nq == 0) /* out and lse are empty */
        return FT_OK;
    naive_ctx c = make_ctx(s, q, func);
    if (s->Nk == 0) { /* no keys: zero rows, LSE = log of an empty sum */
        FT_TRY(zero_tensor(out, func));
        const int64_t rows = s->B * s->H * s->Nq;
        const naive_mod nm = make_mod(s, lse);
        if (c.acc == FT_F64)
            softmax_rows<double><<<blocks_for(rows), THREADS>>>(
                NULL, NULL, 0, NULL, NULL, (double *)lse->data, 1, rows, nm);
        else
            softmax_rows<float><<<blocks_for(rows), THREADS>>>(
                NULL, NULL, 0, NULL, NULL, (float *)lse->data, 1, rows, nm);
        FT_CUDA_CHECK_LAUNCH(func);
        return FT_OK;
    }
    ft_status st = forward_work(&c, q, k, v, out, lse);
    release_scratch(&c);
    return st;
}

ft_status ft_attention_backward_naive_cuda(const ft_attn_shape *s, const ft_tensor *dout,
                                           const ft_tensor *q, const ft_tensor *k,
                                           const ft_tensor *v, const ft_tensor *out,
                                           const ft_tensor *lse, ft_tensor *dq,
                                           ft_tensor *dk, ft_tensor *dv)
{
    static const char func[] = "ft_attention_backward";
    (void)out, (void)lse; /* P comes from a full softmax, D from P and dP */
    FT_TRY(ft_cuda_use_device(q->device.index, func));
    if (s->B == 0 || s->H == 0 || s->Nq == 0 || s->Nk == 0) { /* no scores */
        FT_TRY(zero_tensor(dq, func));
        FT_TRY(zero_tensor(dk, func));
        FT_TRY(zero_tensor(dv, func));
        return FT_OK;
    }
    naive_ctx c = make_ctx(s, q, func);
    ft_status st = backward_work(&c, dout, q, k, v, dq, dk, dv);
    release_scratch(&c);
    return st;
}

ft_status ft_attention_sink_grad_cuda(const ft_attn_shape *s, const ft_tensor *dout,
                                      const ft_tensor *out, const ft_tensor *lse, double *acc,
                                      double *part)
{
    static const char func[] = "ft_attention_backward";
    FT_TRY(ft_cuda_use_device(out->device.index, func));
    if (s->H == 0)
        return FT_OK;
    const naive_mod nm = make_mod(s, lse);
    sink_grad_kernel<<<dim3((unsigned)s->H, FT_SINK_PARTS), THREADS>>>(
        out->data, dout->data, (int)out->dtype, out->stride[0], out->stride[1], out->stride[2],
        dout->stride[0], dout->stride[1], dout->stride[2], s->B, s->d,
        lse->dtype == FT_F32 ? (const float *)lse->data : NULL,
        lse->dtype == FT_F64 ? (const double *)lse->data : NULL, nm, part);
    FT_CUDA_CHECK_LAUNCH(func);
    sink_grad_sum<<<(unsigned)((s->H + THREADS - 1) / THREADS), THREADS>>>(part, acc, s->H);
    FT_CUDA_CHECK_LAUNCH(func);
    return FT_OK;
}

ft_status ft_attention_dropout_mask_cuda(ft_tensor *mask, const ft_attn_mod *m)
{
    static const char func[] = "ft_attention_dropout_mask";
    FT_TRY(ft_cuda_use_device(mask->device.index, func));
    const int64_t n = ft_numel(mask);
    if (n == 0)
        return FT_OK;
    dropout_mask_kernel<<<blocks_for_elems(n), THREADS>>>(
        (float *)mask->data, *m, mask->shape[1], mask->shape[2], mask->shape[3], n);
    FT_CUDA_CHECK_LAUNCH(func);
    return FT_OK;
}
