/*
 * kernels.h - the C launchers of flashtile's CUDA kernels, one family per
 * file of kernels/. lib/ checks every argument before calling them (shapes,
 * dtypes, devices: all CUDA tensors of one device here); a launcher only
 * launches, and turns CUDA and cuBLAS failures into ft_status with a
 * message (FT_CUDA_TRY). All work goes on the legacy default stream, so it
 * is ordered with the host copies of lib/tensor.c.
 */
#ifndef FT_KERNELS_H
#define FT_KERNELS_H

#ifdef __cplusplus
extern "C" {
#endif

#include "internal.h"

/* ---- tensor/: work on strided tensors of any dtype, one family a file,
 * per element as lib/ does it (lib/scalar_ops.h) ---- */

/* copy.cu: dst = src converted; same shape, same device, any strides and
 * dtypes. */
ft_status ft_cuda_copy(ft_tensor *dst, const ft_tensor *src);
ft_status ft_cuda_fill(ft_tensor *t, double value);
/* random.cu: Philox 4x32-10 exactly as ft_rand/ft_randn on the CPU
 * (philox.h): element i of t in row-major order gets the stream's element
 * i; with row not NULL, element i gets the stream's element base + (i's
 * offset along the strides row[]) instead (random.c's stride-0 views,
 * collapsed). */
ft_status ft_cuda_random(ft_tensor *t, const int64_t *row, int64_t base, uint64_t seed,
                         uint64_t offset, int normal);
/* elementwise.cu: out is allocated, contiguous, a's shape and dtype. */
ft_status ft_cuda_binary(ft_tensor *out, ft_binop op, const ft_tensor *a,
                         const ft_tensor *b);
ft_status ft_cuda_binary_scalar(ft_tensor *out, ft_binop op, const ft_tensor *a,
                                double s, int scalar_first);
ft_status ft_cuda_unary(ft_tensor *out, ft_unop op, const ft_tensor *a);
/* reduce.cu: *result = op over every element of a. */
ft_status ft_cuda_reduce_all(ft_reduce_op op, const ft_tensor *a, double *result);
/* out (and indices, i64, 0-based, when not NULL) hold a's shape with dim
 * removed or kept as 1, contiguous; they are allocated. */
ft_status ft_cuda_reduce_dim(ft_tensor *out, ft_tensor *indices, ft_reduce_op op,
                             const ft_tensor *a, int dim);
/* max |a - b| and whether |a - b| <= atol + rtol |b| everywhere. */
ft_status ft_cuda_compare(const ft_tensor *a, const ft_tensor *b, double rtol,
                          double atol, double *max_abs_diff, int *all_close);
/* softmax.cu: out (allocated, a's shape and dtype) = softmax of a along
 * dim. */
ft_status ft_cuda_softmax(ft_tensor *out, const ft_tensor *a, int dim);

/* ---- index_ops.cu: gathers and scatter-adds along one dim ---- */

/* out (allocated, contiguous) = t gathered along dim by index (0-based
 * i32/i64 on the device); entries out of range make it fail. t and index
 * are contiguous (lib/index.c copies them). */
ft_status ft_cuda_index_select(ft_tensor *out, const ft_tensor *t, int dim,
                               const ft_tensor *index);
/* t (f32/f64) += src scattered along dim, with atomics; t, index and src
 * are contiguous. */
ft_status ft_cuda_index_add(ft_tensor *t, int dim, const ft_tensor *index,
                            const ft_tensor *src);

/* ---- matmul.cu: cuBLAS ---- */

/* out [B, m, n] (or [m, n]) = a x b, allocated and contiguous; f32, f16 and
 * bf16 with f32 accumulation, f64 in f64. a and b are matrices cuBLAS reads
 * where they lie (ft_blas_layout in lib/internal.h; lib/ops.c copies any
 * other contiguous first). */
ft_status ft_cuda_matmul(ft_tensor *out, const ft_tensor *a, const ft_tensor *b);

/* Tells compute-sanitizer's initcheck (run with --nvtx yes) that the
 * bytes [p, p + bytes) on the current device were written by work queued
 * on the default stream. cuBLAS's Hopper GEMMs store C in a way initcheck
 * does not track: without this every read of a GEMM result is reported as
 * uninitialized (scripts/gpu-check). Without an NVTX tool attached it
 * costs one branch. */
void ft_cuda_mark_written(const void *p, size_t bytes);

/* ---- attention/naive.cu: S and P materialised, through cuBLAS ---- */

ft_status ft_attention_forward_naive_cuda(const ft_attn_shape *s, const ft_tensor *q,
                                          const ft_tensor *k, const ft_tensor *v,
                                          ft_tensor *out, ft_tensor *lse);
ft_status ft_attention_backward_naive_cuda(const ft_attn_shape *s, const ft_tensor *dout,
                                           const ft_tensor *q, const ft_tensor *k,
                                           const ft_tensor *v, const ft_tensor *out,
                                           const ft_tensor *lse, ft_tensor *dq,
                                           ft_tensor *dk, ft_tensor *dv);

/* acc[h] (device, f64) -= the sink's gradient from one call's dout, out
 * and lse (any strides, 1 along d; s->sink on the device); part: device
 * scratch of H * FT_SINK_PARTS doubles (each head's partial sums, added in
 * a fixed order). */
#define FT_SINK_PARTS 128
ft_status ft_attention_sink_grad_cuda(const ft_attn_shape *s, const ft_tensor *dout,
                                      const ft_tensor *out, const ft_tensor *lse, double *acc,
                                      double *part);
/* mask (f32 [B, H, Nq, Nk], contiguous) = dropout's factor of each P_ij. */
ft_status ft_attention_dropout_mask_cuda(ft_tensor *mask, const ft_attn_mod *m);

/* ---- flash_fwd.cu / flash_bwd.cu: the tiled kernels on tensor cores ---- */

/* decode.cu: attention of q [B, Nq, H, d] (f16/bf16, d % 8 == 0, d <= 256,
 * rows on 16 bytes) over KV caches [B, rows, Hk, d] or page pools [pages,
 * page_size, Hk, d], with k_new / v_new appended in place by the same
 * launch. lib/ checks the lengths and pages and puts them on the device. */
#define FT_DECODE_INLINE 64 /* lengths passed with the launch up to this batch */
typedef struct {
    const ft_tensor *q, *k, *v;        /* k, v: caches or page pools */
    const ft_tensor *k_new, *v_new;    /* [B, Nnew, Hk, d], or NULL */
    const int32_t *lens;               /* device [B]: keys before the append, or NULL */
    const int64_t *lens_host;          /* the same on the host (lens NULL: B <= FT_DECODE_INLINE) */
    const int32_t *table;              /* device [B][max_pages], 0-based; NULL: not paged */
    int64_t max_pages, page_size;
    int64_t max_len;                   /* the longest sequence after the append */
    int causal, splits;                /* splits from ft_attention_decode_splits_cuda */
    double scale;
    float *part_o, *part_lse;          /* splits > 1: [splits][B][H][Nq][d], [splits][B][H][Nq] */
    ft_tensor *out, *lse;              /* [B, Nq, H, d]; f32 [B, H, Nq] */
} ft_decode_cuda;
/* The splits of the keys for such a call: requested when > 0, else chosen
 * from the shape, the SMs and the CTAs each holds. */
int ft_attention_decode_splits_cuda(const ft_tensor *q, int64_t Hk, int64_t max_len,
                                    int requested);
ft_status ft_attention_decode_cuda(const ft_decode_cuda *a);
/* sm90/flash_fwd_fp8.cu: the forward on fp8 tensor cores, q, k, v
 * fp8_e4m3 [B, N, H, 128] (Nk > 0), out bf16 [B, Nq, H, 128] and lse f32
 * [B, H, Nq] contiguous, plain or causal; workspace: the bytes
 * ft_attention_fp8_cuda_workspace(k) gives (V transposed). takes: whether
 * the kernel runs here (built for sm_90a, a compute capability 9.0 device,
 * head dim 128, 16-byte strides, FT_NO_FP8_MMA off); the launcher fails
 * with FT_ERR_UNSUPPORTED, having written nothing but the workspace, when
 * the copy engine refuses the tensors all the same. */
typedef struct {
    const ft_tensor *q, *k, *v;
    double scale;     /* the softmax scale times descale_q descale_k */
    double descale_v;
    int causal;
    void *workspace;
    ft_tensor *out, *lse;
} ft_fp8_fwd_cuda;
int ft_attention_fp8_cuda_takes(const ft_tensor *q, const ft_tensor *k, const ft_tensor *v);
size_t ft_attention_fp8_cuda_workspace(const ft_tensor *k);
ft_status ft_attention_forward_fp8_cuda(const ft_fp8_fwd_cuda *a);
ft_status ft_attention_forward_flash_cuda(const ft_attn_shape *s, const ft_tensor *q,
                                          const ft_tensor *k, const ft_tensor *v,
                                          ft_tensor *out, ft_tensor *lse);
/* The flash backward, prepared by lib/attention.c: lse contiguous f32,
 * work f32 [2, lse's shape] (D = rowsum(dO * O), and LSE in log2 units),
 * Nq > 0 (with no query lib/ fills dK and dV with zeros itself). */
ft_status ft_attention_backward_flash_cuda(const ft_attn_shape *s, const ft_tensor *dout,
                                           const ft_tensor *q, const ft_tensor *k,
                                           const ft_tensor *v, const ft_tensor *out,
                                           const ft_tensor *lse, ft_tensor *work,
                                           ft_tensor *dq, ft_tensor *dk, ft_tensor *dv);

#ifdef __cplusplus
}
#endif

#endif /* FT_KERNELS_H */
