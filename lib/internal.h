/*
 * internal.h - what the files of lib/ share and users of flashtile.h need
 * not see: the storage record, error reporting, overflow-checked sizes and
 * the element limit, element access by dtype, stride-0 views, a strided
 * iterator, how BLAS reads a matrix, and writing files in one piece.
 */
#ifndef FT_INTERNAL_H
#define FT_INTERNAL_H

#include "flashtile.h"
#include "attn_mod.h"

#include <limits.h>
#include <stdbool.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The storage record is C11 (atomics); CUDA sources, compiled as C++, see
 * only pointers to it. */
#ifndef __cplusplus
#include <stdatomic.h>

struct ft_storage {
    atomic_long refcount;
    void *data;
    size_t nbytes;
    ft_device device;
};
#endif

/* ---- errors (error.c) ---- */

/* Records "func: detail" as this thread's last error, with the offending
 * input's position (0 if none), and returns status. Use as
 *   return ft_fail(FT_ERR_ARGUMENT, "ft_view", 2, "shape %s ...", ...); */
ft_status ft_fail(ft_status status, const char *func, int arg,
                  const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#define FT_TRY(expr)                         \
    do {                                     \
        ft_status ft_try_s_ = (expr);        \
        if (ft_try_s_ != FT_OK)              \
            return ft_try_s_;                \
    } while (0)

/* Formats a shape as "{2, 3, 4}" into buf; returns buf. SHAPE_TEXT bytes
 * hold any shape of FT_MAX_DIMS sizes. */
#define SHAPE_TEXT 160
char *ft_format_shape(char *buf, size_t size, int ndim, const int64_t *shape);

/* Normalises a possibly negative dim against ndim into *out; fails with a
 * message for func/arg when out of range. */
ft_status ft_check_dim(const char *func, int arg, int dim, int ndim, int *out);

/* Checks a tensor argument is non-NULL; the message names func and arg. */
ft_status ft_check_tensor(const char *func, int arg, const ft_tensor *t);
/* The elements of an i32 tensor (any device) as a malloc'd int64 array on
 * the host (*out, freed by the caller; *n of them). A tensor that is not
 * i32 is an error naming func, argument ap and name. */
ft_status ft_read_i32(const char *func, int ap, const char *name, const ft_tensor *t,
                      int64_t **out, int64_t *n);

/* Refuses a storage dtype (fp8_e4m3) where `what` (an op's name) would
 * compute on it, with the way out in the message; FT_OK for the others. */
ft_status ft_check_computable(const char *func, int arg, ft_dtype dtype, const char *what);

/* 1 for the integer dtypes, i32 and i64 (neither float nor storage). */
static inline int ft_dtype_is_int(ft_dtype d)
{
    return d == FT_I32 || d == FT_I64;
}

/* ---- sizes ----
 * Every element count, byte size, scratch size and stride product of lib/
 * goes through ft_mul_size / ft_add_size (or the helpers built on them
 * below), never through a bare * or + that could wrap: each returns 0 and
 * stores the result, or returns -1 and stores nothing when an operand is
 * negative or the exact result does not fit in int64. The caller turns -1
 * into an ft_fail that names the function, the argument and the size.
 * What stays plain arithmetic is the offset of an element inside a view
 * (index * stride, within the view's extent) and indexing inside a buffer
 * whose size was checked: ft_tensor_wrap refuses any view that reaches
 * outside its storage, so those values are bounded by memory that exists. */
static inline int ft_mul_size(int64_t a, int64_t b, int64_t *out)
{
    if (a < 0 || b < 0 || (a != 0 && b > INT64_MAX / a))
        return -1;
    *out = a * b;
    return 0;
}

static inline int ft_add_size(int64_t a, int64_t b, int64_t *out)
{
    if (a < 0 || b < 0 || b > INT64_MAX - a)
        return -1;
    *out = a + b;
    return 0;
}

/* The element count of shape: 0 when any size is 0 (a tensor with no
 * elements may have any shape, however large its other sizes), else the
 * product of the sizes; -1 for a negative size or a product past int64. */
static inline int ft_checked_numel(int ndim, const int64_t *shape, int64_t *out)
{
    int64_t n = 1;
    int zero = 0;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 0)
            return -1;
        zero |= shape[d] == 0;
    }
    if (zero) {
        *out = 0;
        return 0;
    }
    for (int d = 0; d < ndim; d++)
        if (ft_mul_size(n, shape[d], &n) != 0)
            return -1;
    *out = n;
    return 0;
}

/* n elements of esize bytes as a size_t byte count; -1 if that overflows. */
static inline int ft_checked_bytes(int64_t n, size_t esize, size_t *out)
{
    int64_t b;
    if (esize > (size_t)INT64_MAX || ft_mul_size(n, (int64_t)esize, &b) != 0 ||
        (uint64_t)b > (uint64_t)SIZE_MAX)
        return -1;
    *out = (size_t)b;
    return 0;
}

/* The most elements a tensor of flashtile may hold and the most elements
 * (or pairs of elements) one loop of lib/ may visit: 2^48. That many
 * elements of the smallest dtype (2 bytes) are 512 TiB, more memory than
 * any one machine has, and a loop over them at 10^9 elements a second
 * would run for more than three days. A larger count can only come from
 * stride-0 views (ft_expand) or from a mistake, so allocations past it
 * fail at once (FT_ERR_NOMEM, no malloc is tried) and so do loops past it
 * (FT_ERR_UNSUPPORTED) instead of running for ever; loops over stride-0
 * views visit each distinct element once wherever the result allows it
 * (see "stride-0 dims" below), so real work never comes near the limit. */
#define FT_MAX_ELEMENTS ((int64_t)1 << 48)

/* Fails unless a loop over n elements stays within FT_MAX_ELEMENTS; what
 * names them in the message ("elements", "pairs of elements"...). */
ft_status ft_check_walk(const char *func, int arg, int64_t n, const char *what);

/* ---- CUDA (device.c) ---- */

#ifdef FT_HAVE_CUDA
#include <cuda_runtime_api.h>

/* Turns a failed CUDA runtime call into an ft_status with the call, the
 * CUDA message, file and line; out of memory becomes FT_ERR_NOMEM so that
 * callers can collect garbage and try again. */
ft_status ft_cuda_fail(int err, const char *func, const char *expr,
                       const char *file, int line);
#define FT_CUDA_TRY(func, expr)                                                \
    do {                                                                        \
        cudaError_t ft_cuda_e_ = (expr);                                        \
        if (ft_cuda_e_ != cudaSuccess)                                          \
            return ft_cuda_fail((int)ft_cuda_e_, func, #expr, __FILE__, __LINE__); \
    } while (0)
/* Makes index the calling thread's current device. */
ft_status ft_cuda_use_device(int index, const char *func);
/* Checks the last kernel launch (launch errors and, when FT_CUDA_SYNC is
 * set in the environment, execution errors). */
ft_status ft_cuda_check_launch(const char *func, const char *file, int line);
#define FT_CUDA_CHECK_LAUNCH(func) \
    FT_TRY(ft_cuda_check_launch(func, __FILE__, __LINE__))
#endif

/* Device memory (device.c): a CUDA allocation from the device's pool, and
 * its release. Fails clearly in a build without CUDA. */
ft_status ft_device_alloc(void **p, size_t nbytes, ft_device device, const char *func);
void ft_device_free(void *p, ft_device device);
/* Host memory to the device, queued on the default stream: the bytes are
 * staged at once, so src may be reused on return, and the call does not
 * wait for the device's earlier work. */
ft_status ft_device_upload(void *dst, const void *src, size_t nbytes, ft_device device,
                           const char *func);
ft_status ft_cuda_memory_stats(int index, ft_memory_stats *out);
ft_status ft_cuda_reset_peak(int index);
/* Fails unless CUDA device index exists (and the build has CUDA). */
ft_status ft_cuda_device_check(const char *func, int arg, int index);

/* Checks that t is on a device this build can compute on (the CPU, or a
 * CUDA device in a CUDA build) and on the same device as ref (if ref). */
ft_status ft_check_device(const char *func, int arg, const ft_tensor *t,
                          const ft_tensor *ref);

/* ---- memory (memory.c) ---- */

/* Tensor storage with refcount 1, 64-byte aligned, counted in the stats. */
ft_status ft_storage_new(ft_storage **out, size_t nbytes, ft_device device,
                         const char *func);
void ft_storage_retain(ft_storage *s);
void ft_storage_release(ft_storage *s);

/* ---- element access (dtype.c) ---- */

/* The element at p (of type dtype) as a double, and back. Stores round
 * to nearest even for f16/bf16 and truncate + saturate for integers. */
double ft_load_f64(const void *p, ft_dtype dtype);
void ft_store_f64(void *p, ft_dtype dtype, double v);

/* ---- tensors (tensor.c) ---- */

/* A new tensor handle viewing storage s (retained) at byte offset. */
ft_status ft_tensor_wrap(ft_tensor **out, ft_storage *s, size_t byte_offset,
                         ft_dtype dtype, int ndim, const int64_t *shape,
                         const int64_t *stride, const char *func);
/* ft_empty with a caller-chosen function name for error messages. */
ft_status ft_empty_named(ft_tensor **out, int ndim, const int64_t *shape,
                         ft_dtype dtype, ft_device device, const char *func);
/* Fails unless a and b have equal shapes. */
ft_status ft_check_same_shape(const char *func, int arg, const ft_tensor *a,
                              const ft_tensor *b);

/* ---- stride-0 dims (tensor.c) ----
 * ft_expand repeats an element along a dim with stride 0, so a view of
 * 2^62 elements may hold one. The only aliasing views of flashtile have is
 * this one (every other view op keeps distinct indices on distinct
 * elements), so a loop visits each distinct element once by collapsing
 * such dims to size 1 in a copy of the handle (a local ft_tensor sharing
 * the storage, used only during the call). */

/* 1 if t has elements and a dim of size > 1 with stride 0. */
int ft_has_broadcast(const ft_tensor *t);
/* For reads: sets every such dim of *t to size 1 and returns the product
 * of their sizes, how many times each remaining element was repeated
 * (1 when there were none, or t has no elements). */
int64_t ft_collapse_broadcast(ft_tensor *t);
/* For writes through dst of values from src (NULL: none) of dst's shape:
 * every such dim of *dst becomes size 1, and *src is moved to its last
 * index along it, the element whose write a row-major loop does last (the
 * value the element ends with). */
void ft_collapse_for_write(ft_tensor *dst, ft_tensor *src);

/* ---- strided iteration ----
 * Walks up to FT_ITER_MAX operands of one shape in row-major order:
 *
 *   ft_iter it;
 *   ft_iter_init(&it, a->ndim, a->shape, 2, (const int64_t *[]){a->stride, b->stride});
 *   for (int64_t i = 0; i < n; i++, ft_iter_next(&it))
 *       use(it.offset[0], it.offset[1]);   // element offsets
 */
#define FT_ITER_MAX 3

typedef struct ft_iter {
    int ndim, nops;
    int64_t shape[FT_MAX_DIMS];
    int64_t index[FT_MAX_DIMS];
    int64_t stride[FT_ITER_MAX][FT_MAX_DIMS];
    int64_t offset[FT_ITER_MAX];
} ft_iter;

static inline void ft_iter_init(ft_iter *it, int ndim, const int64_t *shape,
                                int nops, const int64_t *const *strides)
{
    it->ndim = ndim;
    it->nops = nops;
    for (int d = 0; d < ndim; d++) {
        it->shape[d] = shape[d];
        it->index[d] = 0;
        for (int k = 0; k < nops; k++)
            it->stride[k][d] = strides[k][d];
    }
    for (int k = 0; k < nops; k++)
        it->offset[k] = 0;
}

static inline void ft_iter_next(ft_iter *it)
{
    for (int d = it->ndim - 1; d >= 0; d--) {
        if (++it->index[d] < it->shape[d]) {
            for (int k = 0; k < it->nops; k++)
                it->offset[k] += it->stride[k][d];
            return;
        }
        it->index[d] = 0;
        for (int k = 0; k < it->nops; k++)
            it->offset[k] -= it->stride[k][d] * (it->shape[d] - 1);
    }
}

/* Byte address of the element at element offset off of t. */
static inline void *ft_elem_ptr(const ft_tensor *t, int64_t off)
{
    return (char *)t->data + off * (int64_t)ft_dtype_size(t->dtype);
}

/* ---- matrices for BLAS (ops.c: CBLAS; kernels/matmul.cu: cuBLAS) ---- */

/* How BLAS reads the last two dims of t, a rows x cols matrix, where it
 * lies: as a row-major matrix with *ld its row stride (*transposed 0) when
 * its last stride is 1, or as the row-major form of its transpose with
 * *ld its column stride (*transposed 1) when its second-to-last stride is
 * 1. A stride over a dim of size 1 is never used and counts as compact.
 * Returns 0 when neither fits (both strides above 1, or a leading
 * dimension outside [max(1, row length), INT_MAX], BLAS's int): such a
 * matrix is packed, or copied contiguous, first. */
static inline int ft_blas_layout(const ft_tensor *t, int *transposed, int *ld)
{
    const int r = t->ndim - 2;
    const int64_t rows = t->shape[r], cols = t->shape[r + 1];
    const int64_t rs = rows == 1 ? cols : t->stride[r];
    const int64_t cs = cols == 1 ? rows : t->stride[r + 1];
    if (cs == 1 && rs >= (cols > 1 ? cols : 1) && rs <= INT_MAX) {
        *transposed = 0;
        *ld = (int)rs;
        return 1;
    }
    if (rs == 1 && cs >= (rows > 1 ? rows : 1) && cs <= INT_MAX) {
        *transposed = 1;
        *ld = (int)cs;
        return 1;
    }
    return 0;
}


/* ---- attention (attention.c validates, attention_cpu.c computes) ---- */

/* Below this many multiply-adds (Nq * Nk * d summed over batch and heads)
 * a CPU attention call, forward, backward or decoding, runs on one thread:
 * starting and joining the OpenMP team costs more than it saves (a tiny
 * model's training step ran faster on one thread than on two). */
#define FT_PARALLEL_MIN_WORK (1 << 20)

/* The checked sizes and options of one attention call:
 * q [B, Nq, H, d], k/v [B, Nk, Hk, d]. A varlen call (cu_q not NULL) is
 * run one sequence at a time, each as a call of B = 1 whose batch0 is the
 * sequence's index (ALiBi's slopes and dropout's counter use batch0 + b). */
typedef struct ft_attn_shape {
    int64_t B, Nq, Nk, H, Hk, d;
    ft_dtype dtype; /* of q, k, v (and out, dout) */
    double scale;
    int causal;
    int64_t block_q, block_k;
    ft_attn_mod mod;             /* the variant: lib/attn_mod.h */
    const ft_tensor *alibi;      /* [H] or [B, H], or NULL */
    const ft_tensor *sink;       /* [H], or NULL */
    int64_t batch0;
    const int64_t *cu_q, *cu_k;  /* varlen: B + 1 offsets each (host copies) */
    const int32_t *cu_q_dev, *cu_k_dev; /* the same on q's device (the flash kernels' one launch) */
    const ft_attn_mods *mods;    /* or NULL; with the tensors it reads */
    const ft_tensor *const *mod_tensors;
    int *mod_fault;              /* set when a mod read out of range */
    const ft_attn_block_mask *block_mask; /* or NULL (tiled cpu path) */
    /* the mods' mask keeps exactly the pairs of its band (its block mask,
     * made on CUDA, says so): the band, as a window, is the whole mask,
     * which the kernels then never evaluate */
    int mask_is_band;
    double *mod_scratch;         /* the interpreter's, per thread (cpu) */
    size_t mod_scratch_per_thread;
    /* The captured tensors' gradients (backward, cpu): per tensor slot a
     * running f64 sum of its numel (NULL: no gradient), added into by each
     * call in a fixed order; mod_gbuf holds one [sum of numels] buffer per
     * backward task, mod_goff each slot's offset in it. */
    double *const *mod_gacc;
    /* The same on CUDA: per slot an f32 [numel] buffer on q's device,
     * zeroed, that the dK/dV kernel adds into (NULL: none; the whole table
     * NULL when no gradient is asked). */
    float *const *mod_gdev;
    double *mod_gbuf;
    size_t mod_gbuf_per_task;
    const int64_t *mod_goff;
} ft_attn_shape;

/* Whether a checked call is attention with no variant but causal (no
 * window but causal's, softcap, ALiBi, sink, dropout, Lua mods or block
 * mask): what the decoding and fp8 kernels take. Varlen is the caller's. */
static inline int ft_attn_plain_or_causal(const ft_attn_shape *s)
{
    const ft_attn_mod *m = &s->mod;
    return !s->mods && !s->block_mask && m->left < 0 &&
           (m->right < 0 || (s->causal && m->right == 0)) && m->softcap == 0 && !m->alibi &&
           !m->sink && !m->dropout;
}

#ifdef FT_HAVE_CUDA
/* attention_cache.c: plain attention of up to 16 query rows a kv head
 * against many keys (decoding without a cache) through the split-KV kernel;
 * returns 1 (with *st) when it took the call, 0 when the flash kernels
 * should. */
int ft_attention_decode_plain(const ft_attn_shape *s, const ft_tensor *q, const ft_tensor *k,
                              const ft_tensor *v, ft_tensor *out, ft_tensor *lse, ft_status *st);
#endif

/* The larger of x and m, NaN once either is: a softmax row with a NaN
 * score (or a NaN sink) has a NaN maximum, so its output and LSE are NaN,
 * as PyTorch's softmax gives, not those of a row that sees no key (the
 * CPU's attention and decoding). */
#define FT_NAN_MAX(x, m) ((x) > (m) || (x) != (x) ? (x) : (m))

/* Loops the compiler vectorises, compiled also for AVX-512 and AVX2 and
 * chosen at load time from the CPU (x86-64 with GCC; elsewhere the
 * baseline only): the CPU attention's row work and decoding. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FT_ROW_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FT_ROW_CLONES
#endif

/* attention_decode_cpu.c: attention of q [B, Nq, H, d] over caches k, v
 * [B, rows, Hk, d] (or page pools with table) on the cpu, f32 or f64, the
 * last dims contiguous, causal or not; out [B, Nq, H, d] and lse [B, H, Nq]
 * (contiguous) written. */
typedef struct {
    const ft_tensor *q, *k, *v;
    ft_tensor *out, *lse;
    const int64_t *lens;  /* keys per sequence */
    const int64_t *table; /* [B][max_pages] 0-based pages, or NULL */
    int64_t max_pages, page_size;
    int causal;
    double scale;
} ft_decode_cpu;
ft_status ft_attention_decode_cpu(const ft_decode_cpu *a);
/* attention.c: every check a plain call of q against keys [B, Nk, kv_heads,
 * d] laid out as k's and v's (dtype, device, row strides) makes, with p's
 * variants: what a KV cache call checks before it writes the new rows, Nk
 * its longest sequence after them. */
ft_status ft_attention_check_like(const char *func, const ft_tensor *q, const ft_tensor *k,
                                  const ft_tensor *v, int64_t Nk, const ft_attn_params *p);
/* attention_cache.c: ft_attention_forward with a KV cache (p->cache_seqlens
 * set). */
ft_status ft_attention_cache_forward(ft_tensor **out, ft_tensor **lse, const ft_tensor *q,
                                     const ft_tensor *k, const ft_tensor *v,
                                     const ft_attn_params *p);
/* acc[h] -= sum over b, i of e^(sink_h - lse) (dout . out): the sink's
 * gradient (a row's sink probability times D = rowsum(dout * out)). */
void ft_attention_sink_grad_cpu(const ft_attn_shape *s, const ft_tensor *dout,
                                const ft_tensor *out, const ft_tensor *lse, double *acc);
/* mods.c: whether a graph has a score function, its check against the tensors of a call
 * (count, dims, device), the scratch doubles a row of `width` needs, and
 * the interpreter: for query i of (b, h) and keys j0 .. j0 + nc - 1
 * (0-based; the graph sees them 1-based), from the scores s (NULL when the
 * graph has no score), writes the modified scores, d score / ds and the
 * mask's verdict (1 keep) into whichever of score, dscore, keep is not
 * NULL. A read out of range sets *fault. */
int ft_attn_mods_has_score(const ft_attn_mods *m);
ft_status ft_attn_mods_check_tensors(const ft_attn_mods *m, const char *func, int arg,
                                     int ntensors, const ft_tensor *const *tensors,
                                     ft_device device);
/* The reads of captured tensors: how many, and which tensor read k reads.
 * With dread and read_lin (each [reads][nc]) not NULL, the interpreter
 * also gives d score / d (the value read k read) and that value's
 * row-major index in its tensor: the captured tensors' gradients. */
int ft_attn_mods_reads(const ft_attn_mods *m);
/* The graph's nodes, its list of read indices, and its roots (which 0:
 * the score, 1: the mask; -1 when absent). */
const ft_mod_node *ft_attn_mods_graph(const ft_attn_mods *m);
const int32_t *ft_attn_mods_index_list(const ft_attn_mods *m);
int ft_attn_mods_root(const ft_attn_mods *m, int which);
/* mods_cuda.c: the graph as CUDA source, struct FtUserMod (the flash
 * kernels' UM), for these tensors' dtypes; fast: the bf16 kernels' fast
 * exp and tanh; debug: reads out of range set ft_mod_fault; grads: a
 * grad(b, h, i, j, s, g) that adds g times the score's derivative in each
 * float tensor's value read into that tensor's f32 gradient (atomics), with
 * has_grad true when some read has one; call: what else the call does
 * (FT_RTC_BUILTIN_SCORES: built-in score variants, softcap or ALiBi;
 * FT_RTC_DROPOUT; FT_RTC_MASK_IS_BAND: the mask is its band, which the
 * call takes as a window), whose code kernels compiled without it leave
 * out (FtUserMod::builtin_scores, dropout, has_mask). NULL when out of memory; the
 * caller frees it. On CUDA a call's mods read at most FT_RTC_MAX_TENSORS
 * tensors of at most 4 dims. */
#define FT_RTC_MAX_TENSORS 8
enum { FT_RTC_BUILTIN_SCORES = 1, FT_RTC_DROPOUT = 2, FT_RTC_MASK_IS_BAND = 4 };
char *ft_attn_mods_cuda_source(const ft_attn_mods *m, const ft_tensor *const *tensors, int fast,
                               int debug, int grads, int call);
/* Whether some read of a float tensor feeds the score (so that the
 * tensors have gradients); 0 also when out of memory. */
int ft_attn_mods_cuda_has_grad(const ft_attn_mods *m, const ft_tensor *const *tensors);
/* What the CUDA table of a mod's tensors holds (count, dims, sizes);
 * tensors already checked as tensors. */
ft_status ft_attn_mods_cuda_check_tensors(const char *func, int arg, int ntensors,
                                         const ft_tensor *const *tensors);
/* Whether the graph's score function is more than s itself (a mask
 * alone runs in the kernels' plain instantiations). */
int ft_attn_mods_cuda_has_score(const ft_attn_mods *m);
/* Whether the call's mods change nothing that its window does not: no
 * score function, and no mask or one that is its band (s->mask_is_band:
 * the window the band gave the call is the whole mask). The flash kernels
 * then run as for a call without mods, with no kernel compiled for them. */
static inline int ft_attn_mods_band_only(const ft_attn_shape *s)
{
    return s->mods && !ft_attn_mods_cuda_has_score(s->mods) &&
           (s->mask_is_band || ft_attn_mods_root(s->mods, 1) < 0);
}
int ft_attn_mods_read_tensor(const ft_attn_mods *m, int k);
size_t ft_attn_mods_scratch(const ft_attn_mods *m, int64_t width, int with_reads);
void ft_attn_mods_eval_row(const ft_attn_mods *m, const ft_tensor *const *tensors, int64_t b,
                           int64_t h, int64_t i, int64_t j0, int64_t nc, const double *s,
                           double *score, double *dscore, int *keep, double *dread,
                           int64_t *read_lin, double *scratch, int *fault);

/* A block mask's check against a call, and the kind of the rectangle
 * [i0, i1) x [j0, j1) of (b, h): empty or full when every tile it touches
 * is (ft_block_kind). */
ft_status ft_attn_block_mask_check(const ft_attn_block_mask *bm, const ft_attn_mods *mods,
                                   const char *func, int arg, ft_device device, int64_t B,
                                   int64_t H, int64_t Nq, int64_t Nk, int64_t block_q,
                                   int64_t block_k);
/* A block mask made on CUDA: the band of the pairs its mask keeps (query
 * i, bottom-right aligned, keeps keys within [i + shift - left, i + shift
 * + right]; both -1 when it keeps none); 0 for one made on the cpu. */
int ft_attn_block_mask_band(const ft_attn_block_mask *bm, int64_t *left, int64_t *right);
/* A block mask made on CUDA whose mask keeps every key from left before
 * to right after each query's diagonal (INT32_MAX: to the end; keys past
 * the ends count as kept): that inner band; 0 when there is none (some
 * row drops its diagonal key) or the mask was made on the cpu. */
int ft_attn_block_mask_inner(const ft_attn_block_mask *bm, int64_t *left, int64_t *right);
int ft_attn_block_kind(const ft_attn_block_mask *bm, int64_t b, int64_t h, int64_t i0,
                       int64_t i1, int64_t j0, int64_t j1);

/* ALiBi's slope for batch batch0 + b, head h (0 without ALiBi). */
double ft_attn_slope(const ft_attn_shape *s, int64_t b, int64_t h);
/* The sink logit of head h (-inf without a sink). */
double ft_attn_sink(const ft_attn_shape *s, int64_t h);

/* out and lse (and dq, dk, dv) are allocated and contiguous; the inputs
 * are checked. Only scratch allocation can fail. */
ft_status ft_attention_forward_cpu(ft_attn_impl impl, const ft_attn_shape *s,
                                   const ft_tensor *q, const ft_tensor *k,
                                   const ft_tensor *v, ft_tensor *out,
                                   ft_tensor *lse);
ft_status ft_attention_backward_cpu(ft_attn_impl impl, const ft_attn_shape *s,
                                    const ft_tensor *dout, const ft_tensor *q,
                                    const ft_tensor *k, const ft_tensor *v,
                                    const ft_tensor *out, const ft_tensor *lse,
                                    ft_tensor *dq, ft_tensor *dk,
                                    ft_tensor *dv);

/* impl "cudnn" (attention_cudnn.c): cuDNN's fused attention on CUDA, for
 * calls attention.c has checked (check_cudnn: f16 or bf16, head_dim a
 * multiple of FT_CUDNN_HEAD_DIM_STEP up to FT_CUDNN_MAX_HEAD_DIM, no
 * variant but causal, fixed lengths); out, lse and the gradients are
 * allocated and contiguous. In a build without cuDNN they fail saying so. */
#define FT_CUDNN_HEAD_DIM_STEP 8
#define FT_CUDNN_MAX_HEAD_DIM 256
ft_status ft_attention_forward_cudnn(const ft_attn_shape *s, const ft_tensor *q,
                                     const ft_tensor *k, const ft_tensor *v, ft_tensor *out,
                                     ft_tensor *lse);
ft_status ft_attention_backward_cudnn(const ft_attn_shape *s, const ft_tensor *dout,
                                      const ft_tensor *q, const ft_tensor *k, const ft_tensor *v,
                                      const ft_tensor *out, const ft_tensor *lse, ft_tensor *dq,
                                      ft_tensor *dk, ft_tensor *dv);

/* File helpers shared by the .npy and .safetensors readers (npy.c). */
int ft_host_is_little_endian(void);
/* Reverses the bytes of each of n elements of esize bytes at data. */
void ft_swap_elements(void *data, size_t n, size_t esize);
/* The message for the errno of a failed stdio call; stdio does not always
 * set errno (a short read at end of file sets nothing). */
const char *ft_errno_text(int err, const char *fallback);

/* A file written in one piece, for both savers (npy.c). ft_file_begin
 * creates a new file next to the target, under a fresh temporary name
 * (the target's name + ".tmp-PID-N", made with O_EXCL, so nobody else's
 * file), with the target's permission bits when it exists; ft_file_end
 * then flushes it to the disk and renames it over the target, so that a
 * reader of path sees the old file or the whole new one, never a mix, and
 * a failed save leaves path as it was and removes the temporary file on
 * every failure path. The target is path, or the file a symbolic link at
 * path points to (the link stays). A device or FIFO at path (/dev/null,
 * /dev/full, a pipe), which cannot be replaced, and a link that points
 * nowhere are opened and written in place instead, as fopen "wb" would.
 * Errors name func, the argument position arg and path. */
typedef struct ft_out_file {
    FILE *f;           /* write the contents here */
    char *tmp;         /* the temporary file; NULL when writing in place */
    char *target;      /* what tmp is renamed to */
    const char *path;  /* as the caller gave it, for messages */
    const char *func;
    int arg;
} ft_out_file;

ft_status ft_file_begin(ft_out_file *o, const char *path, const char *func,
                        int arg);
/* Finishes o: when status is FT_OK, flushes, syncs, closes and renames the
 * file into place; otherwise, or when one of those fails, closes it and
 * removes the temporary file. Returns status, or the first failure. */
ft_status ft_file_end(ft_out_file *o, ft_status status);

#ifdef __cplusplus
}
#endif

#endif /* FT_INTERNAL_H */
