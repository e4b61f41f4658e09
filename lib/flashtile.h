/*
 * flashtile.h - the whole public C API of flashtile.
 *
 * flashtile is a library of tiled (FlashAttention-style) attention kernels
 * with N-d tensors to feed them. This header is usable from plain C, without
 * Lua. Conventions:
 *
 *   - Every function that can fail returns an ft_status; FT_OK is 0. On
 *     failure ft_last_error() gives a one-line message for the calling
 *     thread, naming the function, the argument and the problem. Nothing in
 *     the library aborts, exits or prints.
 *   - Functions that make a tensor take `ft_tensor **out`; on success *out is
 *     a new handle owned by the caller (free it with ft_tensor_free); on
 *     failure *out is NULL and nothing was allocated.
 *   - Dimensions and indices are 0-based here (the Lua layer is 1-based).
 *     A negative dim counts from the end (-1 is the last).
 *   - Shapes and strides are in elements, not bytes.
 *   - No new tensor has more than 2^48 elements (FT_ERR_NOMEM, before any
 *     allocation) and no loop visits more (FT_ERR_UNSUPPORTED); views that
 *     repeat elements (stride 0, ft_expand) may be larger, and loops over
 *     them visit the distinct elements once wherever the result allows it.
 */
#ifndef FLASHTILE_H
#define FLASHTILE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define FT_API __declspec(dllexport)
#else
#define FT_API __attribute__((visibility("default")))
#endif

#define FT_VERSION "0.1.0"

/* ---- status codes ------------------------------------------------------ */

typedef enum ft_status {
    FT_OK = 0,              /* success */
    FT_ERR_ARGUMENT = 1,    /* a bad argument: wrong shape, dtype, index... */
    FT_ERR_NOMEM = 2,       /* an allocation failed */
    FT_ERR_IO = 3,          /* a file could not be read or written */
    FT_ERR_UNSUPPORTED = 4, /* valid request this build cannot serve (yet) */
    FT_ERR_DEVICE = 5,      /* a CUDA or cuBLAS call failed */
    FT_ERR_INTERNAL = 6     /* a bug in flashtile */
} ft_status;

/* The message of the last failed call on this thread ("" if none), as
 * "ft_view: shape {3, 5} has 15 elements, tensor has 16". The pointer stays
 * valid until the next flashtile call on this thread. */
FT_API const char *ft_last_error(void);
/* The same failure in parts, for bindings that format their own errors:
 * the problem alone ("shape {3, 5} has 15 elements, tensor has 16"), and
 * the 1-based position of the offending input among the function's inputs
 * (output pointers not counted; a pointer and its count are one input),
 * or 0 when no single input is at fault. */
FT_API const char *ft_last_error_detail(void);
FT_API int ft_last_error_arg(void);

/* ---- dtypes and devices ------------------------------------------------ */

typedef enum ft_dtype {
    FT_F64 = 0,
    FT_F32 = 1,
    FT_F16 = 2,
    FT_BF16 = 3,
    FT_I32 = 4,
    FT_I64 = 5,
    /* FP8 E4M3 (torch.float8_e4m3fn, CUDA's __nv_fp8_e4m3): 1 sign, 4
     * exponent bits with bias 7, 3 mantissa bits, no infinities
     * (S.1111.111 is NaN), finite values up to 448, subnormals down to
     * 2^-9. A storage dtype: it is copied, viewed, converted to and from
     * every dtype, filled, read, compared (ft_max_abs_diff, ft_allclose),
     * saved and loaded, but arithmetic (elementwise ops, reductions,
     * softmax, matmul, random numbers, index_add, attention) refuses it;
     * convert it first (ft_to). Conversions to it round to nearest even
     * and saturate finite values past 448 to +-448; +-inf and NaN become
     * NaN (ft_f64_to_fp8_e4m3). */
    FT_FP8_E4M3 = 6,
    FT_NUM_DTYPES = 7
} ft_dtype;

/* Bytes per element; 0 for an invalid dtype. */
FT_API size_t ft_dtype_size(ft_dtype dtype);
/* Canonical short name ("f64", "f32", "f16", "bf16", "i32", "i64",
 * "fp8_e4m3"). */
FT_API const char *ft_dtype_name(ft_dtype dtype);
/* Parses a short name or an alias ("double", "float", "half", "bfloat16",
 * "int", "long", "float32", "float8_e4m3fn", "e4m3"...). FT_ERR_ARGUMENT
 * for an unknown name. */
FT_API ft_status ft_dtype_parse(const char *name, ft_dtype *out);
/* 1 for the floating-point dtypes arithmetic takes, f64/f32/f16/bf16; 0
 * for integer dtypes and for fp8_e4m3, which holds data only. */
FT_API int ft_dtype_is_float(ft_dtype dtype);
/* 1 for the storage dtypes (fp8_e4m3): floating-point values that are
 * held, moved and converted but never computed on. */
FT_API int ft_dtype_is_storage_only(ft_dtype dtype);

typedef enum ft_device_type { FT_CPU = 0, FT_CUDA = 1 } ft_device_type;

typedef struct ft_device {
    ft_device_type type;
    int index; /* CUDA ordinal; 0 for the CPU */
} ft_device;

/* Parses "cpu", "cuda" (device 0) or "cuda:N". Unknown names are
 * FT_ERR_ARGUMENT; a CUDA device in a build without CUDA, or one that does
 * not exist on this machine, is FT_ERR_UNSUPPORTED. */
FT_API ft_status ft_device_parse(const char *name, ft_device *out);
/* Writes "cpu" or "cuda:N" into buf (at least 16 bytes). Returns buf. */
FT_API char *ft_device_name(ft_device device, char *buf, size_t size);
FT_API int ft_device_equal(ft_device a, ft_device b);

/* ---- tensors ----------------------------------------------------------- */

#define FT_MAX_DIMS 8

typedef struct ft_storage ft_storage; /* refcounted memory, shared by views */

/* A strided view of a storage. The fields may be read freely; change them
 * only through the functions below. `data` points at element [0, 0, ...]
 * of this view (storage base plus the view's offset). */
typedef struct ft_tensor {
    ft_storage *storage;
    void *data;
    ft_dtype dtype;
    ft_device device;
    int ndim;                         /* 0 (a scalar) to FT_MAX_DIMS */
    int64_t shape[FT_MAX_DIMS];
    int64_t stride[FT_MAX_DIMS];      /* in elements, >= 0 */
} ft_tensor;

/* A new contiguous tensor with uninitialised contents. A size 0 makes a
 * tensor of no elements, whatever its other sizes; more than 2^48
 * elements (more memory than any machine has) fail with FT_ERR_NOMEM
 * before any allocation is tried. */
FT_API ft_status ft_empty(ft_tensor **out, int ndim, const int64_t *shape,
                          ft_dtype dtype, ft_device device);
/* Releases the handle and its reference to the storage; NULL is a no-op.
 * The memory goes when the last view of the storage is freed. */
FT_API void ft_tensor_free(ft_tensor *t);

FT_API int64_t ft_numel(const ft_tensor *t);
FT_API int ft_is_contiguous(const ft_tensor *t);
/* Bytes of the storage behind t (shared with every view of it). */
FT_API size_t ft_storage_nbytes(const ft_tensor *t);
/* 1 if a and b are views of the same storage. */
FT_API int ft_same_storage(const ft_tensor *a, const ft_tensor *b);

/* Views: the result shares t's storage. */

/* A view with a new shape of the same element count; at most one entry
 * may be -1 (inferred). Fails if t's strides cannot express it (use
 * ft_reshape, which copies when it must). */
FT_API ft_status ft_view(ft_tensor **out, const ft_tensor *t, int ndim,
                         const int64_t *shape);
/* ft_view when possible, else a contiguous copy with the new shape. */
FT_API ft_status ft_reshape(ft_tensor **out, const ft_tensor *t, int ndim,
                            const int64_t *shape);
FT_API ft_status ft_transpose(ft_tensor **out, const ft_tensor *t, int dim0,
                              int dim1);
/* perm has t->ndim entries, a permutation of 0..ndim-1 (negatives allowed). */
FT_API ft_status ft_permute(ft_tensor **out, const ft_tensor *t,
                            const int *perm);
/* Elements start..start+length-1 along dim. */
FT_API ft_status ft_narrow(ft_tensor **out, const ft_tensor *t, int dim,
                           int64_t start, int64_t length);
/* The slice at index along dim; the result has one dimension fewer. */
FT_API ft_status ft_select(ft_tensor **out, const ft_tensor *t, int dim,
                           int64_t index);
/* A new handle on t itself if t is contiguous, else a contiguous copy. */
FT_API ft_status ft_contiguous(ft_tensor **out, const ft_tensor *t);
/* A broadcast view with the given shape: t's dims align to the right; a
 * dim of size 1, and every new leading dim, repeats with stride 0; -1
 * keeps t's size. Elementwise ops take such views (e.g. a bias). */
FT_API ft_status ft_expand(ft_tensor **out, const ft_tensor *t, int ndim,
                           const int64_t *shape);
/* Shares storage with t: a new handle with the same view. */
FT_API ft_status ft_alias(ft_tensor **out, const ft_tensor *t);

/* Copies: the result owns fresh storage. */

/* A contiguous copy of t. */
FT_API ft_status ft_clone(ft_tensor **out, const ft_tensor *t);
/* A contiguous copy of t converted to dtype on device. */
FT_API ft_status ft_to(ft_tensor **out, const ft_tensor *t, ft_dtype dtype,
                       ft_device device);
/* dst[...] = src[...], converting dtypes. Shapes must be equal. Floats
 * (and integers, through double) to f16/bf16/fp8_e4m3 round to nearest
 * even, once (fp8 saturating, as ft_f64_to_fp8_e4m3); floats to integers
 * truncate toward zero and saturate (NaN becomes 0). dst and src may be
 * views of one storage
 * only if they are the same view. A dst that repeats elements (stride 0,
 * from ft_expand) gets each written once, with the value of its last
 * index in row-major order. */
FT_API ft_status ft_copy(ft_tensor *dst, const ft_tensor *src);
/* Sets every element to value (converted as ft_copy does). */
FT_API ft_status ft_fill(ft_tensor *t, double value);
/* Integer ranges without doubles: element i (row-major) of the i64 or i32
 * tensor t becomes start + i * step, exactly. Fails (nothing written) if
 * start + (numel - 1) * step leaves t's dtype. Inputs: t=1, start=2,
 * step=3. */
FT_API ft_status ft_arange_int(ft_tensor *t, int64_t start, int64_t step);
/* The number of values start, start + step, ... before stop (stop
 * excluded), ceil((stop - start) / step) or 0, computed exactly; step must
 * be nonzero and the count at most 2^48. Inputs: start=1, stop=2, step=3. */
FT_API ft_status ft_arange_count(int64_t start, int64_t stop, int64_t step,
                                 int64_t *count);

/* One element, index has t->ndim entries. Integer dtypes may use the
 * _int variants to keep all 64 bits. */
FT_API ft_status ft_get(const ft_tensor *t, const int64_t *index,
                        double *value);
FT_API ft_status ft_set(ft_tensor *t, const int64_t *index, double value);
FT_API ft_status ft_get_int(const ft_tensor *t, const int64_t *index,
                            int64_t *value);
FT_API ft_status ft_set_int(ft_tensor *t, const int64_t *index,
                            int64_t value);

/* Scalar conversions with round-to-nearest-even (the bit patterns of
 * IEEE binary16, bfloat16 and fp8 e4m3). fp8 e4m3 saturates: finite x
 * past 448 gives +-448, +-inf and NaN give NaN (0x7f, 0xff with the
 * sign). */
FT_API uint16_t ft_f64_to_f16(double x);
FT_API double ft_f16_to_f64(uint16_t h);
FT_API uint16_t ft_f64_to_bf16(double x);
FT_API double ft_bf16_to_f64(uint16_t h);
FT_API uint8_t ft_f64_to_fp8_e4m3(double x);
FT_API double ft_fp8_e4m3_to_f64(uint8_t b);

/* Gathers along dim: out has t's shape with dim's size replaced by
 * numel(index), and out[.., i, ..] = t[.., index[i], ..]. index: a 1-d
 * i32/i64 tensor of 0-based positions on t's device. A new contiguous
 * tensor. (An embedding lookup is index_select along dim 0.) */
FT_API ft_status ft_index_select(ft_tensor **out, const ft_tensor *t, int dim,
                                 const ft_tensor *index);
/* Scatter-adds along dim, in place: t[.., index[i], ..] += src[.., i, ..].
 * Repeated positions add up. src has t's shape with dim's size replaced by
 * numel(index). CPU: any float dtype; CUDA: f32 or f64, t contiguous (the
 * order of the additions on CUDA is not fixed). */
FT_API ft_status ft_index_add(ft_tensor *t, int dim, const ft_tensor *index,
                              const ft_tensor *src);

/* ---- random numbers ---------------------------------------------------- */

/* Counter-based Philox 4x32-10: element i (in row-major order of t's shape)
 * depends only on (seed, offset, i), on any device. Each call consumes
 * ft_random_counters(numel) counters; pass offset += that to the next call
 * to continue the stream. rand: uniform in [0, 1); randn: standard normal
 * (Box-Muller). Floating dtypes only. */
FT_API ft_status ft_rand(ft_tensor *t, uint64_t seed, uint64_t offset);
FT_API ft_status ft_randn(ft_tensor *t, uint64_t seed, uint64_t offset);
FT_API uint64_t ft_random_counters(int64_t numel);

/* ---- elementwise, reductions, matmul ----------------------------------- */

typedef enum ft_binop {
    FT_ADD, FT_SUB, FT_MUL, FT_DIV, FT_POW, FT_MAXIMUM, FT_MINIMUM
} ft_binop;

typedef enum ft_unop {
    FT_NEG, FT_EXP, FT_LOG, FT_ABS, FT_SQRT, FT_TANH, FT_SIGMOID, FT_RELU
} ft_unop;

typedef enum ft_reduce_op {
    FT_SUM, FT_MEAN, FT_MAX, FT_MIN, FT_NORM /* 2-norm */
} ft_reduce_op;

/* Results are new contiguous tensors of a's dtype and device, computed in
 * f64. Tensor-tensor ops need equal shapes, dtypes and devices. Integer
 * tensors accept ADD, SUB, MUL, MAXIMUM, MINIMUM, NEG and ABS only. */
FT_API ft_status ft_binary(ft_tensor **out, ft_binop op, const ft_tensor *a,
                           const ft_tensor *b);
/* a op s, or s op a when scalar_first is nonzero. */
FT_API ft_status ft_binary_scalar(ft_tensor **out, ft_binop op,
                                  const ft_tensor *a, double s,
                                  int scalar_first);
FT_API ft_status ft_unary(ft_tensor **out, ft_unop op, const ft_tensor *a);

/* Reduction over every element, in f64. MEAN/NORM of integers are fine
 * here. MAX/MIN of an empty tensor fail. */
FT_API ft_status ft_reduce_all(ft_reduce_op op, const ft_tensor *a,
                               double *result);
/* Reduction along dim; the dim is kept with size 1 if keepdim, else
 * removed. For MAX/MIN, indices (if not NULL) receives the i64 positions
 * (0-based) of the first extreme element. Floating dtypes for MEAN/NORM. */
FT_API ft_status ft_reduce_dim(ft_tensor **out, ft_tensor **indices,
                               ft_reduce_op op, const ft_tensor *a, int dim,
                               int keepdim);
/* softmax along dim, computed in f64 with the max subtracted. Floats only. */
FT_API ft_status ft_softmax(ft_tensor **out, const ft_tensor *a, int dim);

/* Matrix product: a [m, k] x b [k, n] -> [m, n], or batched a [B, m, k] x
 * b [B, k, n] -> [B, m, n]. Floating dtypes, equal on both sides; f16 and
 * bf16 are computed in f32. CPU: CBLAS. */
FT_API ft_status ft_matmul(ft_tensor **out, const ft_tensor *a,
                           const ft_tensor *b);

/* max |a - b| over all elements (shapes equal, dtypes may differ). NaN in
 * either gives NaN. */
FT_API ft_status ft_max_abs_diff(const ft_tensor *a, const ft_tensor *b,
                                 double *result);
/* 1 if |a - b| <= atol + rtol * |b| everywhere (NaN is never close). */
FT_API ft_status ft_allclose(const ft_tensor *a, const ft_tensor *b,
                             double rtol, double atol, int *result);

/* ---- attention ------------------------------------------------------------
 *
 * O = softmax(scale * Q K^T + mask) V for every (batch b, head h), and
 * LSE = logsumexp of each row of the masked, scaled scores.
 *
 *   q         [B, Nq, H,  d]   the last dim contiguous, the others any stride
 *   k, v      [B, Nk, Hk, d]   Hk divides H (GQA/MQA: head h reads h / (H/Hk))
 *   out       [B, Nq, H,  d]   contiguous, q's dtype
 *   lse       [B, H,  Nq]      f32 (f64 for f64 inputs)
 *
 * Causal masks align to the bottom-right (FlashAttention 2): query i sees
 * key j when j <= i + Nk - Nq. A query row that sees no key gets a zero
 * output row and LSE = -inf (the log of an empty sum).
 */

typedef enum ft_attn_impl {
    FT_ATTN_AUTO = 0,  /* the best for the device: tiled on cpu */
    FT_ATTN_NAIVE = 1, /* materialises S and P: O(N^2) memory */
    FT_ATTN_TILED = 2, /* FlashAttention's algorithm on the cpu: O(N) memory */
    FT_ATTN_FLASH = 3, /* the CUDA kernels (a CUDA build) */
    FT_ATTN_CUDNN = 4  /* cuDNN's fused attention (a CUDA build with cuDNN):
                        * f16/bf16, causal or not, GQA/MQA, head_dim a
                        * multiple of 8 up to 256, the scale; no other
                        * variant, no varlen, not deterministic backward */
} ft_attn_impl;

/* Attention modifications (Lua: ft.attention_mods): a score function
 * f(s, b, h, i, j) and a mask m(b, h, i, j) as a graph of nodes in
 * evaluation order (each operand an earlier node). s is the scaled score
 * (after the built-in variants); b, h, i, j are 1-based. Comparisons and
 * logic give 1 or 0; FT_MOD_READ reads captured tensor `a` (0-based, of
 * the tensors passed with each call) at the 1-based indices given by the
 * nodes indices[b .. b + c - 1]. */
typedef enum ft_mod_op {
    FT_MOD_S, FT_MOD_B, FT_MOD_H, FT_MOD_I, FT_MOD_J, FT_MOD_CONST,
    FT_MOD_ADD, FT_MOD_SUB, FT_MOD_MUL, FT_MOD_DIV, FT_MOD_MOD, FT_MOD_POW, FT_MOD_NEG,
    FT_MOD_EQ, FT_MOD_NE, FT_MOD_LT, FT_MOD_LE, FT_MOD_GT, FT_MOD_GE,
    FT_MOD_AND, FT_MOD_OR, FT_MOD_NOT, FT_MOD_WHERE,
    FT_MOD_ABS, FT_MOD_EXP, FT_MOD_LOG, FT_MOD_SQRT, FT_MOD_TANH, FT_MOD_SIGMOID,
    FT_MOD_MIN, FT_MOD_MAX, FT_MOD_FLOOR, FT_MOD_READ,
    FT_MOD_OP_COUNT
} ft_mod_op;

#define FT_MOD_MAX_NODES 4096
#define FT_MOD_MAX_TENSORS 64

typedef struct ft_mod_node {
    int32_t op;      /* ft_mod_op */
    int32_t a, b, c; /* operand nodes; READ: tensor, first index, count */
    double value;    /* FT_MOD_CONST */
} ft_mod_node;

typedef struct ft_attn_mods ft_attn_mods;

/* Checks and copies a graph: score and mask are root nodes (-1: none, not
 * both); the mask may not depend on s. Inputs: nodes=2, indices=4,
 * ntensors=5, score=6, mask=7. */
FT_API ft_status ft_attn_mods_new(ft_attn_mods **out, int nnodes, const ft_mod_node *nodes,
                                  int nindices, const int32_t *indices, int ntensors,
                                  int score, int mask);
FT_API void ft_attn_mods_free(ft_attn_mods *m);
/* How many tensors the graph reads (each call passes that many), and its
 * node count. */
FT_API int ft_attn_mods_tensors(const ft_attn_mods *m);
FT_API int ft_attn_mods_nodes_count(const ft_attn_mods *m);
/* The graph at one point (b, h, i, j 0-based here): the score, its
 * derivative in s, the mask's verdict; *fault set by a read out of range.
 * work: 2 * nodes doubles. For checking a trace. */
FT_API void ft_attn_mods_eval_point(const ft_attn_mods *m, const ft_tensor *const *tensors,
                                    int64_t b, int64_t h, int64_t i, int64_t j, double s,
                                    double *score, double *dscore, int *keep, double *work,
                                    int *fault);
FT_API const char *ft_mod_op_name(int op);
/* Whether the score's values lie in a range at most 69 wide whatever s,
 * the indices and the tensors read (interval arithmetic over the graph:
 * a softcap (s / c):tanh() * c of c <= 34 does), the range's top in *top
 * (scaled units). What a bf16 forward on Hopper can take as every row's
 * maximum from the start, as it does for the built-in softcap (no
 * running maximum, no rescaling; not yet done for Lua-written mods). */
FT_API int ft_attn_mods_score_bound(const ft_attn_mods *m, double *top);

/* On CUDA, a call with mods runs the flash kernels compiled for them at
 * run time (NVRTC), kept in memory and in a cache on disk: what that took
 * since the process started (all zero without CUDA). */
typedef struct ft_rtc_stats {
    int64_t compiles, disk_loads, memory_hits;
    double compile_s, load_s;           /* totals, seconds */
    double last_compile_s, last_load_s; /* the latest of each */
} ft_rtc_stats;
FT_API void ft_cuda_mods_stats(ft_rtc_stats *out);
/* Compiles (or, with use_cache, finds in the disk cache) the flash kernels
 * a call with these mods runs (passes: 1 the forward, 2 the backward's
 * dK/dV and dQ, 3 both; plus 4: the backward that also gives the
 * gradients of the float tensors the mods read) for element type dtype
 * (f16, bf16), head_dim and arch ("sm_90a": the Hopper kernels; "sm_80",
 * "sm_89"...: the mma.sync ones), without a GPU if need be: to fill the
 * cache ahead of a run, or to check a mod's CUDA source. *compiled (if not
 * NULL): how many were compiled. FT_ERR_UNSUPPORTED without CUDA.
 * Inputs: mods=1, ntensors=2, tensors=3, dtype=4, head_dim=5, arch=6. */
FT_API ft_status ft_cuda_mods_compile(const ft_attn_mods *mods, int ntensors,
                                      const ft_tensor *const *tensors, ft_dtype dtype,
                                      int head_dim, const char *arch, int passes,
                                      int use_cache, int *compiled);

/* A block mask (FlexAttention's BlockMask): the mods' mask evaluated
 * once for every tile of block_q x block_k of a [B, H, Nq, Nk] call, so
 * that the tiled path skips the tiles it hides wholly and skips the mask
 * where it hides nothing. Made for one mods, one shape and one tiling (a
 * call with others is an error); cpu, fixed lengths. Inputs: mods=1,
 * ntensors=2, tensors=3, B=4, H=5, Nq=6, Nk=7, block_q=8, block_k=9. */
typedef struct ft_attn_block_mask ft_attn_block_mask;
FT_API ft_status ft_attn_block_mask_new(ft_attn_block_mask **out, const ft_attn_mods *mods,
                                        int ntensors, const ft_tensor *const *tensors,
                                        int64_t B, int64_t H, int64_t Nq, int64_t Nk,
                                        int64_t block_q, int64_t block_k);
/* The same for calls on `device`: on CUDA the mask is evaluated on the GPU
 * (its tensors there too), and the flash kernels skip the tiles outside
 * the band that holds every pair it keeps, as they skip a window's, and
 * leave the mask out of the tiles inside its inner band (where it keeps
 * every pair). */
FT_API ft_status ft_attn_block_mask_new_on(ft_attn_block_mask **out, const ft_attn_mods *mods,
                                           int ntensors, const ft_tensor *const *tensors,
                                           int64_t B, int64_t H, int64_t Nq, int64_t Nk,
                                           int64_t block_q, int64_t block_k, ft_device device);
FT_API void ft_attn_block_mask_free(ft_attn_block_mask *bm);
/* How many tiles it hides wholly, partly, not at all. */
FT_API void ft_attn_block_mask_counts(const ft_attn_block_mask *bm, int64_t *empty,
                                      int64_t *partial, int64_t *full);

/* Every option of attention, forward and backward. Fill it with
 * ft_attn_params_init and change what you need; a later feature is a new
 * field here, never a new signature. */
typedef struct ft_attn_params {
    ft_attn_impl impl;
    double scale;        /* 0: 1 / sqrt(d) */
    int causal;          /* nonzero: bottom-right causal mask */
    int64_t block_q;     /* rows of Q per tile (B_r); 0: the default */
    int64_t block_k;     /* rows of K/V per tile (B_c); 0: the default */
    int deterministic;   /* nonzero: bitwise-reproducible gradients */
    /* Variants (lib/attn_mod.h defines each exactly); the init values
     * turn them off. */
    int64_t window_left;     /* -1: unbounded; else keys at most this far left */
    int64_t window_right;    /* -1: unbounded; else this far right (causal: 0) */
    double softcap;          /* 0: off; c > 0: scores become c tanh(score / c) */
    const ft_tensor *alibi_slopes; /* NULL: off; [H] or [B, H], f32 or f64 */
    const ft_tensor *sink;   /* NULL: off; [H] f32 or f64 logits */
    double dropout_p;        /* 0: off; else in (0, 1) */
    uint64_t dropout_seed;
    uint64_t dropout_offset; /* below 2^31 */
    /* Variable lengths: q [total_q, H, d], k/v [total_k, Hk, d], out
     * likewise, lse [H, total_q]; sequence b is rows cu_seqlens[b] ..
     * cu_seqlens[b + 1] - 1. Both or neither; i32 [B + 1], first 0. */
    const ft_tensor *cu_seqlens_q;
    const ft_tensor *cu_seqlens_k;
    int64_t max_seqlen_q;    /* 0: worked out; else at least the longest */
    int64_t max_seqlen_k;
    /* Backward with a sink: where the sink's gradient (a new tensor
     * shaped and typed like sink) goes; NULL: not returned. */
    ft_tensor **dsink;
    /* Modifications (NULL: none) and the tensors they read, in order. */
    const ft_attn_mods *mods;
    int mod_ntensors;
    const ft_tensor *const *mod_tensors;
    /* Backward with mods: mod_ntensors slots (NULL: none asked) that get a
     * new gradient tensor for each float tensor the mods read (NULL for
     * the others). On CUDA they are f32 sums of atomics in the dK/dV
     * kernel, not bitwise reproducible (with deterministic set, the call
     * fails). */
    ft_tensor **mod_grads;
    const ft_attn_block_mask *block_mask; /* with mods: NULL, or made for this call */
    /* KV cache (decoding; forward only): k and v are caches [B, Ncache,
     * Hk, d], or page pools [pages, page_size, Hk, d] with block_table (i32
     * [B, max_pages]: sequence b's rows r are in page block_table[b][r /
     * page_size] - block_table_base, row r % page_size). cache_seqlens (i32
     * [B]) counts each sequence's rows before the call (not changed).
     * k_new and v_new ([B, Nnew, Hk, d], both or neither) are written into
     * the caches after them, in place; the call attends over the first
     * cache_seqlens[b] + Nnew rows (causal: bottom-right aligned on them).
     * Rows past those are never read. NULL cache_seqlens: not a cache call. */
    const ft_tensor *cache_seqlens;
    const ft_tensor *k_new, *v_new;
    const ft_tensor *block_table;
    int block_table_base; /* the number of the pool's first page (0; Lua: 1) */
    int64_t num_splits;   /* CUDA decoding: key splits (0: chosen from the shape) */
    /* fp8_e4m3 inputs (forward only; FlashAttention-3's interface): the
     * per-tensor factors that take q, k and v to the values they stand
     * for (0: 1). The scores are scale * (descale_q q) . (descale_k k),
     * the output sums descale_v v; out is bf16, lse f32. The CPU computes
     * in f32; CUDA runs the bf16 kernels on q and k as they are (e4m3 is
     * exact in bf16) and on descale_v v rounded to bf16. */
    double descale_q, descale_k, descale_v;
} ft_attn_params;

FT_API void ft_attn_params_init(ft_attn_params *p);
FT_API const char *ft_attn_impl_name(ft_attn_impl impl);
/* "auto", "naive", "tiled", "flash", "cudnn"; FT_ERR_ARGUMENT for others. */
FT_API ft_status ft_attn_impl_parse(const char *name, ft_attn_impl *out);

/* The threads the CPU attention may use: at most n from now on (n <= 0:
 * no cap beyond OpenMP's own, OMP_NUM_THREADS), process-wide; the
 * environment variable FT_NUM_THREADS sets the first cap. Results do not
 * depend on the thread count, bit for bit. */
FT_API void ft_set_num_threads(int n);
FT_API int ft_get_num_threads(void);

/* Kernel switches, for comparing kernels (lib/switches.c): FT_NO_WGMMA,
 * FT_NO_WS, FT_WS, FT_PERSIST, FT_NO_PERSIST, FT_NO_DECODE,
 * FT_LAZY_RESCALE, FT_NO_LAZY_RESCALE, FT_TURNS, FT_NO_TURNS, FT_NO_CAP_MAX,
 * FT_NO_DECODE_WS, FT_NO_FP8_MMA.
 * ft_switch: 1 on, 0 off, -1 for a name that is not a switch. ft_set_switch: on 1
 * (on), 0 (off) or -1 (as the environment variable of that name says,
 * which is also where each starts), process-wide, for the calls made
 * after it. ft_switch_name(i): the names from i = 0, NULL past the last. */
FT_API int ft_switch(const char *name);
FT_API ft_status ft_set_switch(const char *name, int on);
FT_API const char *ft_switch_name(int i);

/* Forward: new tensors *out and *lse. Inputs: q=1, k=2, v=3, p=4. */
FT_API ft_status ft_attention_forward(ft_tensor **out, ft_tensor **lse,
                                      const ft_tensor *q, const ft_tensor *k,
                                      const ft_tensor *v,
                                      const ft_attn_params *p);

/* Dropout's mask as attention with these params applies it: a new f32
 * tensor [B, H, Nq, Nk] holding 1 / (1 - dropout_p) where P_ij is kept and
 * 0 where it is dropped (lib/attn_mod.h: the same bits on every device and
 * every tiling). Reads dropout_p (> 0), dropout_seed, dropout_offset.
 * Inputs: B=1, H=2, Nq=3, Nk=4, p=5, device=6. */
FT_API ft_status ft_attention_dropout_mask(ft_tensor **out, int64_t B, int64_t H, int64_t Nq,
                                           int64_t Nk, const ft_attn_params *p,
                                           ft_device device);

/* Backward from the forward's out and lse: new tensors *dq, *dk, *dv
 * (contiguous, shaped and typed like q, k, v; dk/dv summed over the heads
 * of a GQA group). Inputs: dout=1, q=2, k=3, v=4, out=5, lse=6, p=7. */
FT_API ft_status ft_attention_backward(ft_tensor **dq, ft_tensor **dk,
                                       ft_tensor **dv, const ft_tensor *dout,
                                       const ft_tensor *q, const ft_tensor *k,
                                       const ft_tensor *v, const ft_tensor *out,
                                       const ft_tensor *lse,
                                       const ft_attn_params *p);

/* ---- files ------------------------------------------------------------- */

/* NumPy .npy (writes format 1.0, reads 1.0 to 3.0, either byte order), dtypes f16/f32/f64/i32/i64.
 * bf16 has no NumPy dtype and is rejected. fp8_e4m3 has none either: it
 * is written (and read back) as the one-field structured descr
 * [('fp8_e4m3', '|u1')], its raw bits, which NumPy loads as records.
 * Loading gives a CPU tensor. */
FT_API ft_status ft_save_npy(const ft_tensor *t, const char *path);
FT_API ft_status ft_load_npy(ft_tensor **out, const char *path);

/* safetensors (Hugging Face's checkpoint format): named tensors of dtypes
 * F64, F32, F16, BF16, I32, I64, F8_E4M3 (flashtile's seven) and a
 * "__metadata__" map of string keys to string values, in one file.
 *
 * ft_safetensors_save writes count tensors under names (each non-empty,
 * valid UTF-8, distinct, not "__metadata__") and meta_count metadata pairs
 * (keys distinct, keys and values valid UTF-8); either count may be 0 and
 * its arrays NULL then. Tensors may have any layout; CUDA tensors are
 * copied to the CPU. The file holds the tensors in name order, their data
 * contiguous after a header padded with spaces to a multiple of 8 bytes.
 * It is written under a temporary name in the same directory and renamed
 * over path, so a reader sees either the old file or the whole new one,
 * and a failed save leaves path as it was. Inputs: path=1, names=2 (with
 * count), tensors=3, meta_keys=4 (with meta_count), meta_values=5. */
FT_API ft_status ft_safetensors_save(const char *path, int count,
                                     const char *const *names,
                                     ft_tensor *const *tensors, int meta_count,
                                     const char *const *meta_keys,
                                     const char *const *meta_values);

/* An open .safetensors file: its checked header, the file kept open to
 * read tensors from. Not for use by two threads at once. */
typedef struct ft_safetensors ft_safetensors;

/* Reads and checks the header of path into a new handle *out (free it with
 * ft_safetensors_free); tensor data is read by ft_safetensors_tensor. A file
 * that is not well-formed (truncated, header size over 100 MB, invalid
 * JSON, unknown or missing fields, wrong types, duplicate names, offsets
 * that are reversed, past the data or overlapping, a size that does not
 * match dtype and shape) is FT_ERR_IO; a dtype of the format flashtile
 * lacks (U8, F8_E5M2...), more than FT_MAX_DIMS dimensions, or a string
 * holding U+0000 is FT_ERR_UNSUPPORTED. The messages name the path and
 * the problem. */
FT_API ft_status ft_safetensors_load(const char *path, ft_safetensors **out);
/* Tensors are numbered 0..count-1 in name order (bytewise), metadata
 * 0..meta_count-1 in key order. Strings stay valid until
 * ft_safetensors_free. A NULL handle counts 0; an index out of range gives
 * NULL (ft_safetensors_find: -1 when no tensor has the name). */
FT_API int ft_safetensors_count(const ft_safetensors *st);
FT_API const char *ft_safetensors_name(const ft_safetensors *st, int i);
FT_API int ft_safetensors_find(const ft_safetensors *st, const char *name);
/* Tensor i read from the file: a new contiguous CPU tensor *out owned by
 * the caller. Inputs: st=1, i=2. */
FT_API ft_status ft_safetensors_tensor(ft_safetensors *st, int i,
                                       ft_tensor **out);
FT_API int ft_safetensors_meta_count(const ft_safetensors *st);
FT_API const char *ft_safetensors_meta_key(const ft_safetensors *st, int i);
FT_API const char *ft_safetensors_meta_value(const ft_safetensors *st, int i);
/* Closes the file and frees the handle; NULL is a no-op. Tensors already
 * read stay valid. */
FT_API void ft_safetensors_free(ft_safetensors *st);

/* ---- CUDA devices -----------------------------------------------------------
 * In a build without CUDA, or on a machine without a GPU, the count is 0 and
 * the rest fail with a message saying which. */

/* 1 if this build has the CUDA backend (whether or not a GPU is present). */
FT_API int ft_cuda_built(void);
/* The version of the cuDNN library impl "cudnn" runs on, as cuDNN numbers
 * it (91400 for 9.14.0); 0 when this build has no cuDNN. Needs no GPU. */
FT_API int ft_cudnn_version(void);
/* Number of usable CUDA devices; 0 when none (or no driver). */
FT_API int ft_cuda_device_count(void);
/* Writes the device's name (e.g. "NVIDIA H200") into buf. */
FT_API ft_status ft_cuda_device_name(int index, char *buf, size_t size);
/* Waits for all work queued on the device. */
FT_API ft_status ft_cuda_synchronize(int index);

/* Timing events on a device's stream (CUDA events). */
typedef struct ft_event ft_event;
FT_API ft_status ft_event_create(ft_event **out, ft_device device);
FT_API ft_status ft_event_record(ft_event *e);
/* Milliseconds between two recorded events; waits for `end`. */
FT_API ft_status ft_event_elapsed_ms(const ft_event *start, const ft_event *end,
                                     double *ms);
FT_API void ft_event_free(ft_event *e);

/* ---- memory ------------------------------------------------------------ */

typedef struct ft_memory_stats {
    int64_t in_use;   /* bytes of tensor storage alive now */
    int64_t peak;     /* highest in_use since the last reset */
    int64_t reserved; /* bytes held by the allocator (CUDA pool); = in_use
                         on the CPU */
} ft_memory_stats;

FT_API ft_status ft_memory_stats_get(ft_device device, ft_memory_stats *out);
/* Sets peak to the current in_use. */
FT_API ft_status ft_reset_peak_memory(ft_device device);

/* Tensor storage bytes (CPU and every CUDA device) allocated by the
 * calling thread since it started, never decreasing; and bytes of storage
 * alive now in the whole process. A garbage-collected host (the Lua
 * binding) compares the first between its calls to learn how much memory
 * its objects hold, and collects in proportion. */
FT_API int64_t ft_thread_allocated_bytes(void);
FT_API int64_t ft_storage_in_use(void);

/* ---- several GPUs: communicators over NCCL (dist.c) -------------------- */

/* A communicator: the ranks of this process (local ranks, each with a CUDA
 * device) among world ranks in all. Calls take one tensor per local rank,
 * in local order, contiguous, on that rank's device. They run on a stream
 * of the communicator's, after the work queued so far on the devices'
 * default streams, which then wait for them (so they are ordered like
 * kernels). NCCL_NVLS_ENABLE is set to 0 (NVLink multicast stays off).
 * Without NCCL in the build every call is FT_ERR_UNSUPPORTED. */
typedef struct ft_comm ft_comm;
/* An exchange still running on the communicator's streams. */
typedef struct ft_pending ft_pending;

FT_API int ft_dist_built(void);
/* One process driving n devices: local rank i is rank i, on devices[i]. */
FT_API ft_status ft_dist_init_devices(ft_comm **out, int n, const int *devices);
/* One process per GPU: this process is rank (0-based) of world, on device.
 * Rank 0 writes NCCL's id into id_file (a path every rank can read, not
 * left from an earlier run), the others wait for it; a rank that is not
 * there within timeout_s seconds makes the others fail (no hang). */
FT_API ft_status ft_dist_init_rank(ft_comm **out, int rank, int world, int device,
                                   const char *id_file, double timeout_s);
FT_API void ft_comm_free(ft_comm *c);
FT_API int ft_comm_world(const ft_comm *c);
FT_API int ft_comm_local(const ft_comm *c);
/* The rank and the CUDA device of local rank i (-1 past the end). */
FT_API int ft_comm_rank(const ft_comm *c, int i);
FT_API int ft_comm_device(const ft_comm *c, int i);
/* In place over every rank's tensor; op FT_SUM, FT_MEAN, FT_MAX or FT_MIN. */
FT_API ft_status ft_all_reduce(ft_comm *c, ft_tensor *const *ts, int n, ft_reduce_op op);
/* Rank root's tensor into every rank's. */
FT_API ft_status ft_broadcast(ft_comm *c, ft_tensor *const *ts, int n, int root);
/* out[i] (world x in[i]'s elements) gets every rank's in, in rank order. */
FT_API ft_status ft_all_gather(ft_comm *c, ft_tensor *const *out, const ft_tensor *const *in,
                               int n);
/* out[i] gets its rank's share (rank r: part r of world equal parts) of the
 * reduction over every rank's in. */
FT_API ft_status ft_reduce_scatter(ft_comm *c, ft_tensor *const *out,
                                   const ft_tensor *const *in, int n, ft_reduce_op op);
/* Local rank i sends send[i] to rank to[i] and receives recv[i] from rank
 * from[i] (NULL: none), all in one group. With pending NULL the default
 * streams wait for it at once; else *pending holds the tensors' storages
 * and the default streams wait only at ft_pending_wait (kernels queued
 * before then run beside the exchange; do not write send or read recv
 * meanwhile). */
FT_API ft_status ft_sendrecv(ft_comm *c, const ft_tensor *const *send, const int *to,
                             ft_tensor *const *recv, const int *from, int n,
                             ft_pending **pending);
FT_API ft_status ft_pending_wait(ft_pending *p);
/* Waits (as ft_pending_wait) if that was not done, then releases. */
FT_API void ft_pending_free(ft_pending *p);

#ifdef __cplusplus
}
#endif

#endif /* FLASHTILE_H */
