/*
 * attention_cpu.c - attention on the CPU, two ways:
 *
 *   naive  S = scale * Q K^T and P = softmax(S) materialised per (b, h):
 *          O(Nq * Nk) memory, the traditional method;
 *   tiled  FlashAttention's algorithm: Q in blocks of block_q rows, K/V in
 *          blocks of block_k rows, online softmax (running max and sum) in
 *          the forward pass, P recomputed from the saved LSE in the
 *          backward pass: O(N) extra memory.
 *
 * The kernels live in attention_cpu_impl.h, written once over the
 * accumulator type and included here for float (f32/f16/bf16 inputs) and
 * double (f64 inputs). Work is spread over threads with OpenMP; each thread
 * has its own slice of one scratch allocation, counted in the memory stats
 * like any tensor, so the O(N) versus O(N^2) difference can be measured.
 */
#include "internal.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define FT_CAT_(a, b) a##b
#define FT_CAT(a, b) FT_CAT_(a, b)

static int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

/* The cap a host put on flashtile's CPU threads (0: none; the first call
 * reads FT_NUM_THREADS), process-wide. */
static int thread_cap = -1;

static int cap_now(void)
{
    int cap = __atomic_load_n(&thread_cap, __ATOMIC_RELAXED);
    if (cap < 0) {
        const char *env = getenv("FT_NUM_THREADS");
        char *end = NULL;
        const long v = env ? strtol(env, &end, 10) : 0;
        cap = env && end != env && *end == 0 && v >= 1 && v <= 4096 ? (int)v : 0;
        int expected = -1;
        __atomic_compare_exchange_n(&thread_cap, &expected, cap, 0, __ATOMIC_RELAXED,
                                    __ATOMIC_RELAXED);
        cap = __atomic_load_n(&thread_cap, __ATOMIC_RELAXED);
    }
    return cap;
}

static int thread_count(void)
{
#ifdef _OPENMP
    const int n = omp_get_max_threads(), cap = cap_now();
    return cap > 0 && cap < n ? cap : n;
#else
    return 1;
#endif
}

void ft_set_num_threads(int n)
{
    __atomic_store_n(&thread_cap, n > 0 ? n : 0, __ATOMIC_RELAXED);
}

int ft_get_num_threads(void)
{
    return thread_count();
}

static size_t thread_index(void)
{
#ifdef _OPENMP
    return (size_t)omp_get_thread_num();
#else
    return 0;
#endif
}

/* Which keys a query sees: lib/attn_mod.h (causal, windows). */
static int64_t key_begin(const ft_attn_shape *s, int64_t i)
{
    return ft_mod_key_begin(&s->mod, s->Nq, s->Nk, i);
}

static int64_t key_end(const ft_attn_shape *s, int64_t i)
{
    return ft_mod_key_end(&s->mod, s->Nq, s->Nk, i);
}

static int64_t query_begin(const ft_attn_shape *s, int64_t j)
{
    return ft_mod_query_begin(&s->mod, s->Nq, s->Nk, j);
}

static int64_t query_end(const ft_attn_shape *s, int64_t j)
{
    return ft_mod_query_end(&s->mod, s->Nq, s->Nk, j);
}

/* Dropout's factor for P_ij of (b, h): 1 / (1 - p) where kept, 0 where
 * dropped, 1 without dropout. */
static double keep_scale(const ft_attn_shape *s, int64_t b, int64_t h, int64_t i, int64_t j)
{
    if (!s->mod.dropout)
        return 1.0;
    return ft_mod_keep(&s->mod, s->batch0 + b, s->H, h, i, j) ? s->mod.drop_scale : 0.0;
}

/* The traditional method run in a 16-bit input precision holds its
 * materialised matrices (P, dP, dS) in that precision, as PyTorch's math
 * path does; the naive path does the same, so that it is the fair
 * "same input precision" yardstick of flashtile's accuracy standard (a
 * 16-bit result may err at most twice as much as the naive path in the
 * same input precision, both against an f64 reference). */
static double round_input(const ft_attn_shape *s, double x)
{
    switch (s->dtype) {
    case FT_F16: return ft_f16_to_f64(ft_f64_to_f16(x));
    case FT_BF16: return ft_bf16_to_f64(ft_f64_to_bf16(x));
    default: return x;
    }
}

/* lse [B, H, Nq], any strides (the backward takes the caller's). */
static void *lse_ptr(const ft_tensor *lse, int64_t b, int64_t h, int64_t i)
{
    return ft_elem_ptr(lse, b * lse->stride[0] + h * lse->stride[1] + i * lse->stride[2]);
}

static void lse_store(ft_tensor *lse, int64_t b, int64_t h, int64_t i, double v)
{
    ft_store_f64(lse_ptr(lse, b, h, i), lse->dtype, v);
}

static double lse_load(const ft_tensor *lse, int64_t b, int64_t h, int64_t i)
{
    return ft_load_f64(lse_ptr(lse, b, h, i), lse->dtype);
}

/* *n += a * b for a scratch size; nonzero when it overflows int64. */
static int scratch_add(int64_t *n, int64_t a, int64_t b)
{
    int64_t p;
    return ft_mul_size(a, b, &p) != 0 || ft_add_size(*n, p, n) != 0;
}

/* The row work of the online softmax keeps FT_LANES running maxima and
 * sums, each over every FT_LANES-th score, combined in a fixed order at
 * the end: loops the compiler vectorises (a single running value is a
 * chain of dependent instructions, a quarter of the d = 64 forward's
 * time), and the same bits whatever the thread count. */
#define FT_LANES 16

/* The largest of m and x[0 .. n) (NaN if any is). */
FT_ROW_CLONES
static float max_row_f32(const float *x, int64_t n, float m)
{
    float acc[FT_LANES];
    for (int u = 0; u < FT_LANES; u++)
        acc[u] = m;
    int64_t c = 0;
    for (; c + FT_LANES <= n; c += FT_LANES)
        for (int u = 0; u < FT_LANES; u++)
            acc[u] = FT_NAN_MAX(x[c + u], acc[u]);
    for (; c < n; c++)
        m = FT_NAN_MAX(x[c], m);
    for (int u = 0; u < FT_LANES; u++)
        m = FT_NAN_MAX(acc[u], m);
    return m;
}

static double max_row_f64(const double *x, int64_t n, double m)
{
    for (int64_t c = 0; c < n; c++)
        m = FT_NAN_MAX(x[c], m);
    return m;
}

/* e^(v) for v = a score less the row's max (f32; see exp_row_f32). */
static inline float exp_shifted_f32(float v)
{
    float t = v > -87.3f ? v : -87.3f; /* -inf, NaN and below: set at the end */
    t = t < 88.7f ? t : 88.7f;
    /* k = t log2(e) rounded to nearest (adding and taking away 1.5 2^23
     * rounds in every SIMD width, with no rounding instruction) */
    const float k = (t * 1.44269504f + 12582912.f) - 12582912.f;
    const float r = (t - k * 0.693359375f) + k * 2.12194440e-4f; /* t - k ln 2 */
    float p = 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    union {
        float f;
        int32_t i;
    } two = {.i = ((int32_t)k + 127) << 23}; /* 2^k, k in [-126, 128] */
    return v < -87.3f ? 0.f : v != v ? v : p * two.f;
}

/* x[c] = e^(x[c] - sub) along a row of scores (-inf gives 0), and their
 * sum: the softmax's exponentials, the CPU path's largest cost after the
 * tile products. In f32 a polynomial the compiler vectorises (Cody-Waite
 * reduction to [-ln 2 / 2, ln 2 / 2], a degree-6 Taylor polynomial there,
 * the power of two put into the exponent bits; within a few ulp of expf,
 * 0 below e^-87.3, where a float has no normal value left, NaN kept),
 * compiled for
 * AVX-512 and AVX2 as well as the baseline, chosen at load time from the
 * CPU (x86-64 with GCC's target_clones; the baseline elsewhere), the sum
 * in FT_LANES running sums. In f64 libm's exp and one running sum, as
 * before: the f64 path keeps its accuracy. */
FT_ROW_CLONES
static float exp_row_f32(float *x, int64_t n, float sub)
{
    float acc[FT_LANES] = {0};
    int64_t c = 0;
    for (; c + FT_LANES <= n; c += FT_LANES)
        for (int u = 0; u < FT_LANES; u++) {
            x[c + u] = exp_shifted_f32(x[c + u] - sub);
            acc[u] += x[c + u];
        }
    float sum = 0;
    for (; c < n; c++) {
        x[c] = exp_shifted_f32(x[c] - sub);
        sum += x[c];
    }
    for (int u = 0; u < FT_LANES; u++)
        sum += acc[u];
    return sum;
}

static double exp_row_f64(double *x, int64_t n, double sub)
{
    double sum = 0;
    for (int64_t c = 0; c < n; c++) {
        x[c] = exp(x[c] - sub);
        sum += x[c];
    }
    return sum;
}

#define ACC float
#define SFX _f32
#define ACC_EXP expf
#define ACC_EXP_ROW exp_row_f32
#define ACC_MAX_ROW max_row_f32
#define ACC_GEMM cblas_sgemm
#include "attention_cpu_impl.h"
#undef ACC
#undef SFX
#undef ACC_EXP
#undef ACC_EXP_ROW
#undef ACC_MAX_ROW
#undef ACC_GEMM

#define ACC double
#define SFX _f64
#define ACC_EXP exp
#define ACC_EXP_ROW exp_row_f64
#define ACC_MAX_ROW max_row_f64
#define ACC_GEMM cblas_dgemm
#include "attention_cpu_impl.h"
#undef ACC
#undef SFX
#undef ACC_EXP
#undef ACC_EXP_ROW
#undef ACC_MAX_ROW

/* OpenBLAS's own threads inside flashtile's OpenMP team oversubscribe the
 * cores (the d = 128 backward ran 5 times slower on two cores): while an
 * attention call runs, its tile products run on one OpenBLAS thread each,
 * and the setting is put back after. Weak references: another CBLAS has
 * none of this, and then nothing is done. */
extern void openblas_set_num_threads(int) __attribute__((weak));
extern int openblas_get_num_threads(void) __attribute__((weak));

static int blas_single_begin(void)
{
    if (!openblas_set_num_threads || !openblas_get_num_threads)
        return 0;
    const int n = openblas_get_num_threads();
    if (n > 1)
        openblas_set_num_threads(1);
    return n;
}

static void blas_single_end(int n)
{
    if (n > 1 && openblas_set_num_threads)
        openblas_set_num_threads(n);
}

/* Threads worth starting for `tasks` independent tasks: no more than the
 * tasks, since each thread holds its own scratch (for the backward an O(N)
 * slice), and memory should not grow with idle threads; one for small work. */
static int threads_for(int64_t tasks, const ft_attn_shape *s)
{
    const double work = (double)s->B * (double)s->H * (double)s->Nq * (double)s->Nk * (double)s->d;
    int n = thread_count();
    if (work < FT_PARALLEL_MIN_WORK)
        return 1;
    return tasks < n ? (tasks > 0 ? (int)tasks : 1) : n;
}

/* How many chunks of key blocks the tiled backward splits each (b, hk)
 * into: enough for about BWD_TASKS tasks when B x Hk is smaller (one
 * head on many cores, say) and each (b, hk) has BWD_CHUNK_WORK
 * multiply-adds or more (a chunk's dQ partial sum costs memory as dQ does),
 * from the shape alone, so that the result is the same bits on any number
 * of threads. One when the mods' tensors' gradients are asked for (their
 * buffers are per (b, hk)). */
#define BWD_TASKS 8
#define BWD_CHUNK_WORK ((double)(1 << 28))
static int64_t bwd_chunks(const ft_attn_shape *s)
{
    const int64_t tasks = s->B * s->Hk, nkb = (s->Nk + s->block_k - 1) / s->block_k;
    const double work = (double)s->Nq * (double)s->Nk * (double)s->d * (double)(s->H / s->Hk);
    if (s->mod_gacc || tasks >= BWD_TASKS || nkb < 2 || work < BWD_CHUNK_WORK)
        return 1;
    const int64_t c = (BWD_TASKS + tasks - 1) / tasks;
    return c < nkb ? c : nkb;
}

/* Scratch for nthreads threads of per_thread elements plus `extra` shared
 * elements (per_thread < 0: its count overflowed). More than
 * FT_MAX_ELEMENTS fails at once, without asking malloc. */
static ft_status scratch_new(ft_storage **out, int64_t per_thread, int nthreads,
                             int64_t extra, size_t elem, const char *func)
{
    int64_t n;
    size_t bytes;
    if (per_thread < 0 || extra < 0 || ft_mul_size(per_thread, nthreads, &n) != 0 ||
        ft_add_size(n, extra, &n) != 0 || n > FT_MAX_ELEMENTS ||
        ft_checked_bytes(n, elem, &bytes) != 0)
        return ft_fail(FT_ERR_NOMEM, func, 0,
                       "attention on the cpu needs more scratch memory than any "
                       "machine has (more than 2^48 elements)");
    return ft_storage_new(out, bytes, (ft_device){FT_CPU, 0}, func);
}

void ft_attention_sink_grad_cpu(const ft_attn_shape *s, const ft_tensor *dout,
                                const ft_tensor *out, const ft_tensor *lse, double *acc)
{
    for (int64_t h = 0; h < s->H; h++) {
        const double sink = ft_attn_sink(s, h);
        if (sink == -INFINITY) /* a sink of weight 0 */
            continue;
        for (int64_t b = 0; b < s->B; b++)
            for (int64_t i = 0; i < s->Nq; i++) {
                const int64_t od = b * out->stride[0] + i * out->stride[1] + h * out->stride[2];
                const int64_t dd = b * dout->stride[0] + i * dout->stride[1] +
                                   h * dout->stride[2];
                double D = 0;
                for (int64_t j = 0; j < s->d; j++)
                    D += ft_load_f64(ft_elem_ptr(dout, dd + j * dout->stride[3]), dout->dtype) *
                         ft_load_f64(ft_elem_ptr(out, od + j * out->stride[3]), out->dtype);
                acc[h] -= exp(sink - lse_load(lse, b, h, i)) * D;
            }
    }
}

/* The captured tensors' gradients (s->mod_gacc): one buffer per backward
 * task (B x Hk), so that each sum runs in a fixed order whatever thread
 * runs the task; mod_grads_end adds them, task by task, into the running
 * sums. s gets mod_gbuf (NULL without gradients). */
static ft_status mod_grads_new(ft_attn_shape *s, int64_t *goff, const char *func)
{
    s->mod_gbuf = NULL;
    s->mod_gbuf_per_task = 0;
    s->mod_goff = goff;
    if (!s->mods || !s->mod_gacc)
        return FT_OK;
    int64_t total = 0;
    const int n = ft_attn_mods_tensors(s->mods);
    for (int t = 0; t < n; t++) {
        goff[t] = total;
        if (s->mod_gacc[t] && ft_add_size(total, ft_numel(s->mod_tensors[t]), &total) != 0)
            return ft_fail(FT_ERR_NOMEM, func, 0, "mods' tensors too large for gradients");
    }
    int64_t all;
    const int64_t tasks = s->B * s->Hk;
    if (total == 0 || tasks == 0)
        return FT_OK;
    if (ft_mul_size(total, tasks, &all) != 0 || all > FT_MAX_ELEMENTS)
        return ft_fail(FT_ERR_NOMEM, func, 0, "mods' tensors too large for gradients");
    s->mod_gbuf = calloc((size_t)all, sizeof(double));
    if (!s->mod_gbuf)
        return ft_fail(FT_ERR_NOMEM, func, 0, "out of memory for the mods' gradients");
    s->mod_gbuf_per_task = (size_t)total;
    return FT_OK;
}

static void mod_grads_end(ft_attn_shape *s, int add)
{
    if (!s->mod_gbuf)
        return;
    const int n = ft_attn_mods_tensors(s->mods);
    const int64_t tasks = s->B * s->Hk;
    for (int t = 0; add && t < n; t++) {
        if (!s->mod_gacc[t])
            continue;
        const int64_t numel = ft_numel(s->mod_tensors[t]);
        for (int64_t task = 0; task < tasks; task++) {
            const double *g = s->mod_gbuf + (size_t)task * s->mod_gbuf_per_task + s->mod_goff[t];
            for (int64_t e = 0; e < numel; e++)
                s->mod_gacc[t][e] += g[e];
        }
    }
    free(s->mod_gbuf);
    s->mod_gbuf = NULL;
}

/* A copy of s with the mods interpreter's scratch (rows of `width`
 * scores) for nthreads threads; *s unchanged without mods. Freed by
 * mods_scratch_free. */
static ft_status mods_scratch_new(ft_attn_shape *copy, const ft_attn_shape *s, int nthreads,
                                  int64_t width, const char *func)
{
    *copy = *s;
    copy->mod_scratch = NULL;
    copy->mod_scratch_per_thread = 0;
    if (!s->mods)
        return FT_OK;
    if (width < 1)
        width = 1;
    /* the interpreter, and rows: in, score, dscore, keep; with the
     * tensors' gradients also the reads' derivatives and places */
    const int grads = s->mod_gbuf != NULL;
    const size_t per = ft_attn_mods_scratch(s->mods, width, grads) + 4 * (size_t)width +
                       (grads ? 2 * (size_t)ft_attn_mods_reads(s->mods) * (size_t)width : 0);
    copy->mod_scratch = malloc(per * (size_t)nthreads * sizeof(double));
    if (!copy->mod_scratch)
        return ft_fail(FT_ERR_NOMEM, func, 0, "out of memory for the mods' scratch");
    copy->mod_scratch_per_thread = per;
    return FT_OK;
}

ft_status ft_attention_forward_cpu(ft_attn_impl impl, const ft_attn_shape *s,
                                   const ft_tensor *q, const ft_tensor *k,
                                   const ft_tensor *v, ft_tensor *out, ft_tensor *lse)
{
    /* No query (B, Nq or H is 0): out and lse have no elements. Otherwise
     * B * H * Nq is lse's element count, which was allocated, and every
     * count of tasks below is at most that. */
    if (ft_numel(out) == 0)
        return FT_OK;
    const int f64 = q->dtype == FT_F64;
    int64_t per = -1;
    if (f64 ? scratch_per_thread_f64(impl, 0, s, &per) : scratch_per_thread_f32(impl, 0, s, &per))
        per = -1;
    const int64_t nqb = (s->Nq + s->block_q - 1) / s->block_q;
    const int nthreads = threads_for(s->B * s->H * (impl == FT_ATTN_NAIVE ? 1 : nqb), s);
    ft_storage *scratch;
    FT_TRY(scratch_new(&scratch, per, nthreads, 0, f64 ? sizeof(double) : sizeof(float),
                       "ft_attention_forward"));
    ft_attn_shape sm;
    ft_status st = mods_scratch_new(&sm, s, nthreads, impl == FT_ATTN_NAIVE ? s->Nk : s->block_k,
                                    "ft_attention_forward");
    const int blas = blas_single_begin();
    if (st == FT_OK && f64)
        forward_f64(impl, &sm, q, k, v, out, lse, scratch->data, (size_t)per, nthreads);
    else if (st == FT_OK)
        forward_f32(impl, &sm, q, k, v, out, lse, scratch->data, (size_t)per, nthreads);
    blas_single_end(blas);
    free(sm.mod_scratch);
    ft_storage_release(scratch);
    return st;
}

ft_status ft_attention_backward_cpu(ft_attn_impl impl, const ft_attn_shape *s,
                                    const ft_tensor *dout, const ft_tensor *q,
                                    const ft_tensor *k, const ft_tensor *v,
                                    const ft_tensor *out, const ft_tensor *lse,
                                    ft_tensor *dq, ft_tensor *dk, ft_tensor *dv)
{
    static const char func[] = "ft_attention_backward";
    /* No query, or no key: the gradients that have elements are zero (no
     * score reaches them). Otherwise dq and dk were allocated, so
     * B * H * Nq and B * Hk * Nk fit, and so do the task counts below. */
    if (ft_numel(dq) == 0 || ft_numel(dk) == 0) {
        FT_TRY(ft_fill(dq, 0.0));
        FT_TRY(ft_fill(dk, 0.0));
        return ft_fill(dv, 0.0);
    }
    /* the mods' tensors' gradients first: they change the scratch sizes */
    ft_attn_shape sg = *s;
    int64_t goff[FT_MOD_MAX_TENSORS];
    FT_TRY(mod_grads_new(&sg, goff, func));
    const int f64 = q->dtype == FT_F64;
    int64_t per = -1, nD = 0;
    if (f64 ? scratch_per_thread_f64(impl, 1, &sg, &per)
            : scratch_per_thread_f32(impl, 1, &sg, &per))
        per = -1;
    if (impl != FT_ATTN_NAIVE) /* D: one value per query row, B * H * Nq */
        nD = ft_numel(lse);
    /* tiled: (b, hk) tasks split into chunks of key blocks, whose dQ
     * partial sums follow D */
    const int64_t chunks = impl == FT_ATTN_NAIVE ? 1 : bwd_chunks(&sg);
    int64_t nP = 0;
    if (chunks > 1 && (ft_mul_size(chunks, ft_numel(dq), &nP) != 0 || nP > FT_MAX_ELEMENTS))
        nP = -1;
    const int nthreads = threads_for(s->B * s->Hk * chunks, s);
    ft_storage *scratch = NULL;
    ft_status st = scratch_new(&scratch, per, nthreads, nP < 0 ? -1 : nD + nP,
                               f64 ? sizeof(double) : sizeof(float), func);
    ft_attn_shape sm = sg;
    sm.mod_scratch = NULL;
    if (st == FT_OK)
        st = mods_scratch_new(&sm, &sg, nthreads, impl == FT_ATTN_NAIVE ? s->Nk : s->block_k,
                              func);
    const size_t threads_part = (size_t)per * (size_t)nthreads;
    const int blas = blas_single_begin();
    if (st == FT_OK && f64) {
        double *base = scratch->data;
        backward_f64(impl, &sm, dout, q, k, v, out, lse, dq, dk, dv, base, (size_t)per,
                     nthreads, base + threads_part, chunks, base + threads_part + nD);
    } else if (st == FT_OK) {
        float *base = scratch->data;
        backward_f32(impl, &sm, dout, q, k, v, out, lse, dq, dk, dv, base, (size_t)per,
                     nthreads, base + threads_part, chunks, base + threads_part + nD);
    }
    blas_single_end(blas);
    free(sm.mod_scratch);
    if (scratch)
        ft_storage_release(scratch);
    mod_grads_end(&sg, st == FT_OK);
    return st;
}
