/*
 * attention.c - the one place that checks an attention call's arguments
 * (shapes, dtypes, devices, strides, options), for every backend, then
 * allocates the results and hands them to an implementation.
 *
 *   q [B, Nq, H, d], k/v [B, Nk, Hk, d], out [B, Nq, H, d], lse [B, H, Nq]
 */
#include "internal.h"
#ifdef FT_HAVE_CUDA
#include "kernels.h"
#endif

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define MAX_HEAD_DIM 256
#define MAX_BLOCK 4096
#define MAX_GRID_YZ 65535 /* CUDA grids: heads on y, batch on z */
#define DEFAULT_BLOCK_Q 64 /* a 64 x 64 score tile plus Q/K/V tiles of */
#define DEFAULT_BLOCK_K 64 /* d <= 128 stay within a core's L2 */

static const char *const impl_names[] = {"auto", "naive", "tiled", "flash"};

void ft_attn_params_init(ft_attn_params *p)
{
    memset(p, 0, sizeof *p);
    p->impl = FT_ATTN_AUTO;
    p->window_left = -1;
    p->window_right = -1;
}

const char *ft_attn_impl_name(ft_attn_impl impl)
{
    return impl >= FT_ATTN_AUTO && impl <= FT_ATTN_FLASH ? impl_names[impl] : "invalid";
}

ft_status ft_attn_impl_parse(const char *name, ft_attn_impl *out)
{
    if (!out)
        return ft_fail(FT_ERR_ARGUMENT, "ft_attn_impl_parse", 0, "result pointer is NULL");
    for (int i = 0; name && i <= FT_ATTN_FLASH; i++)
        if (strcmp(name, impl_names[i]) == 0) {
            *out = (ft_attn_impl)i;
            return FT_OK;
        }
    return ft_fail(FT_ERR_ARGUMENT, "ft_attn_impl_parse", 1,
                   "unknown impl '%s' (expected auto, naive, tiled or flash)",
                   name ? name : "(null)");
}

/* The dtype LSE has for inputs of dtype: f64 stays f64, the rest f32. */
static ft_dtype lse_dtype(ft_dtype in) { return in == FT_F64 ? FT_F64 : FT_F32; }

static ft_status check_qkv_tensor(const char *func, int arg, const char *name,
                                  const ft_tensor *t, const ft_tensor *q)
{
    FT_TRY(ft_check_tensor(func, arg, t));
    if (t->ndim != 4)
        return ft_fail(FT_ERR_ARGUMENT, func, arg,
                       "%s must be 4-d [batch, seqlen, heads, head_dim], got %d-d",
                       name, t->ndim);
    if (!ft_dtype_is_float(t->dtype))
        return ft_fail(FT_ERR_ARGUMENT, func, arg,
                       "%s must be f64, f32, f16 or bf16, got %s", name,
                       ft_dtype_name(t->dtype));
    if (t != q && t->dtype != q->dtype)
        return ft_fail(FT_ERR_ARGUMENT, func, arg,
                       "%s is %s but q is %s (one dtype for all inputs)", name,
                       ft_dtype_name(t->dtype), ft_dtype_name(q->dtype));
    if (t != q && !ft_device_equal(t->device, q->device)) {
        char a[16], b[16];
        return ft_fail(FT_ERR_ARGUMENT, func, arg, "%s is on %s but q is on %s",
                       name, ft_device_name(t->device, a, sizeof a),
                       ft_device_name(q->device, b, sizeof b));
    }
    if (t->shape[3] > 1 && t->stride[3] != 1)
        return ft_fail(FT_ERR_ARGUMENT, func, arg,
                       "%s's last dim (head_dim) must be contiguous, its stride is %lld",
                       name, (long long)t->stride[3]);
    return FT_OK;
}

/* Checks q, k, v (inputs at positions aq, aq+1, aq+2) and the options
 * (position ap), and fills s. */
static ft_status check_qkv(const char *func, int aq, int ap, const ft_tensor *q,
                           const ft_tensor *k, const ft_tensor *v,
                           const ft_attn_params *p, ft_attn_shape *s)
{
    char sa[SHAPE_TEXT], sb[SHAPE_TEXT];
    FT_TRY(check_qkv_tensor(func, aq, "q", q, q));
    FT_TRY(check_qkv_tensor(func, aq + 1, "k", k, q));
    FT_TRY(check_qkv_tensor(func, aq + 2, "v", v, q));
    FT_TRY(ft_check_device(func, aq, q, NULL));
    s->B = q->shape[0], s->Nq = q->shape[1], s->H = q->shape[2], s->d = q->shape[3];
    s->dtype = q->dtype;
    s->Nk = k->shape[1], s->Hk = k->shape[2];
    if (k->shape[0] != s->B || k->shape[3] != s->d)
        return ft_fail(FT_ERR_ARGUMENT, func, aq + 1,
                       "k %s does not match q %s in batch or head_dim",
                       ft_format_shape(sa, sizeof sa, 4, k->shape),
                       ft_format_shape(sb, sizeof sb, 4, q->shape));
    for (int dim = 0; dim < 4; dim++)
        if (v->shape[dim] != k->shape[dim])
            return ft_fail(FT_ERR_ARGUMENT, func, aq + 2,
                           "v %s must have k's shape %s",
                           ft_format_shape(sa, sizeof sa, 4, v->shape),
                           ft_format_shape(sb, sizeof sb, 4, k->shape));
    if (s->Hk == 0 || s->H % s->Hk != 0)
        return ft_fail(FT_ERR_ARGUMENT, func, aq + 1,
                       "k/v heads (%lld) must divide q heads (%lld) for GQA/MQA",
                       (long long)s->Hk, (long long)s->H);
    /* Sizes the kernels index with 32-bit ints and grids whose y and z
     * extents stop at 65535; the cpu's scratch sizes (Nq * Nk) stay far
     * from int64's limit. */
    if (s->Nq > INT32_MAX || s->Nk > INT32_MAX)
        return ft_fail(FT_ERR_UNSUPPORTED, func, aq,
                       "seqlens above %d are not supported (Nq %lld, Nk %lld)", INT32_MAX,
                       (long long)s->Nq, (long long)s->Nk);
    if (q->device.type == FT_CUDA && (s->B > MAX_GRID_YZ || s->H > MAX_GRID_YZ))
        return ft_fail(FT_ERR_UNSUPPORTED, func, aq,
                       "batch and heads above %d are not supported on CUDA (%lld, %lld)",
                       MAX_GRID_YZ, (long long)s->B, (long long)s->H);
    if (s->d < 1 || s->d > MAX_HEAD_DIM)
        return ft_fail(FT_ERR_UNSUPPORTED, func, aq,
                       "head_dim %lld is not supported (1 to %d)", (long long)s->d,
                       MAX_HEAD_DIM);
    /* On the cpu each (batch, head) scores every query against every key:
     * B * H * Nq * Nk scores in loops that must stay within
     * FT_MAX_ELEMENTS (stride-0 inputs can ask for far more). */
    int64_t scores;
    const int64_t dims[4] = {s->B, s->H, s->Nq, s->Nk};
    if (q->device.type == FT_CPU &&
        (ft_checked_numel(4, dims, &scores) != 0 || scores > FT_MAX_ELEMENTS))
        return ft_fail(FT_ERR_UNSUPPORTED, func, aq,
                       "attention on the cpu would compute %lld x %lld x %lld x %lld "
                       "scores (batch x heads x seqlen_q x seqlen_k), more than "
                       "flashtile's limit of 2^48 for one loop",
                       (long long)s->B, (long long)s->H, (long long)s->Nq,
                       (long long)s->Nk);

    if (!p)
        return ft_fail(FT_ERR_ARGUMENT, func, ap, "params expected (ft_attn_params_init)");
    if (p->impl < FT_ATTN_AUTO || p->impl > FT_ATTN_FLASH)
        return ft_fail(FT_ERR_ARGUMENT, func, ap, "invalid impl %d", (int)p->impl);
    const int cuda = q->device.type == FT_CUDA;
    if (p->impl == FT_ATTN_FLASH && !cuda)
        return ft_fail(FT_ERR_UNSUPPORTED, func, ap,
                       "impl 'flash' runs on CUDA tensors; these are on the cpu "
                       "(use 'tiled' or 'naive')");
    if (p->impl == FT_ATTN_TILED && cuda)
        return ft_fail(FT_ERR_UNSUPPORTED, func, ap,
                       "impl 'tiled' is the cpu implementation; on CUDA use 'flash' "
                       "(or 'naive')");
    if (p->impl == FT_ATTN_FLASH && cuda && q->dtype == FT_F64)
        return ft_fail(FT_ERR_UNSUPPORTED, func, aq,
                       "the flash kernels take f16, bf16 or f32; for f64 on CUDA use "
                       "impl = 'naive' or 'auto' (or the cpu)");
    if (!isfinite(p->scale))
        return ft_fail(FT_ERR_ARGUMENT, func, ap, "scale must be finite, got %g", p->scale);
    s->scale = p->scale != 0 ? p->scale : 1.0 / sqrt((double)s->d);
    s->causal = p->causal != 0;
    if (p->block_q < 0 || p->block_q > MAX_BLOCK || p->block_k < 0 || p->block_k > MAX_BLOCK)
        return ft_fail(FT_ERR_ARGUMENT, func, ap,
                       "block sizes must be 1 to %d (0: default), got block_q %lld, block_k %lld",
                       MAX_BLOCK, (long long)p->block_q, (long long)p->block_k);
    s->block_q = p->block_q ? p->block_q : DEFAULT_BLOCK_Q;
    s->block_k = p->block_k ? p->block_k : DEFAULT_BLOCK_K;

    const char *later = NULL;
    if (p->window_left != -1 || p->window_right != -1)
        later = "sliding windows (window_left/window_right)";
    else if (p->softcap != 0)
        later = "softcap";
    else if (p->alibi_slopes)
        later = "ALiBi slopes";
    else if (p->dropout_p != 0)
        later = "dropout";
    else if (p->cu_seqlens_q || p->cu_seqlens_k)
        later = "variable-length batches (cu_seqlens)";
    if (later)
        return ft_fail(FT_ERR_UNSUPPORTED, func, ap, "%s: not supported yet", later);
    return FT_OK;
}

#ifdef FT_HAVE_CUDA
/* On CUDA, "auto" is flash but for f64, which only the naive path takes. */
static int use_naive_cuda(ft_attn_impl impl, const ft_attn_shape *s)
{
    return impl == FT_ATTN_NAIVE || (impl == FT_ATTN_AUTO && s->dtype == FT_F64);
}
#endif

/* The implementation for the device: the cpu's naive or tiled code, or
 * the CUDA naive (cuBLAS) or flash kernels. */
static ft_status run_forward(ft_attn_impl impl, const ft_attn_shape *s,
                             const ft_tensor *q, const ft_tensor *k, const ft_tensor *v,
                             ft_tensor *out, ft_tensor *lse)
{
#ifdef FT_HAVE_CUDA
    if (q->device.type == FT_CUDA)
        return use_naive_cuda(impl, s) ? ft_attention_forward_naive_cuda(s, q, k, v, out, lse)
                                       : ft_attention_forward_flash_cuda(s, q, k, v, out, lse);
#endif
    return ft_attention_forward_cpu(impl, s, q, k, v, out, lse);
}

static ft_status run_backward(ft_attn_impl impl, const ft_attn_shape *s,
                              const ft_tensor *dout, const ft_tensor *q,
                              const ft_tensor *k, const ft_tensor *v,
                              const ft_tensor *out, const ft_tensor *lse,
                              ft_tensor *dq, ft_tensor *dk, ft_tensor *dv)
{
#ifdef FT_HAVE_CUDA
    if (q->device.type == FT_CUDA)
        return use_naive_cuda(impl, s)
                   ? ft_attention_backward_naive_cuda(s, dout, q, k, v, out, lse, dq, dk, dv)
                   : ft_attention_backward_flash_cuda(s, dout, q, k, v, out, lse, dq, dk, dv);
#endif
    return ft_attention_backward_cpu(impl, s, dout, q, k, v, out, lse, dq, dk, dv);
}

ft_status ft_attention_forward(ft_tensor **out, ft_tensor **lse,
                               const ft_tensor *q, const ft_tensor *k,
                               const ft_tensor *v, const ft_attn_params *p)
{
    static const char func[] = "ft_attention_forward";
    if (!out || !lse)
        return ft_fail(FT_ERR_ARGUMENT, func, 0, "result pointer is NULL");
    *out = NULL;
    *lse = NULL;
    ft_attn_shape s;
    FT_TRY(check_qkv(func, 1, 4, q, k, v, p, &s));
    int64_t lse_shape[3] = {s.B, s.H, s.Nq};
    ft_tensor *o = NULL, *l = NULL;
    ft_status st = ft_empty_named(&o, 4, q->shape, q->dtype, q->device, func);
    if (st == FT_OK)
        st = ft_empty_named(&l, 3, lse_shape, lse_dtype(q->dtype), q->device, func);
    if (st == FT_OK)
        st = run_forward(p->impl, &s, q, k, v, o, l);
    if (st != FT_OK) {
        ft_tensor_free(o);
        ft_tensor_free(l);
        return st;
    }
    *out = o;
    *lse = l;
    return FT_OK;
}

ft_status ft_attention_backward(ft_tensor **dq, ft_tensor **dk, ft_tensor **dv,
                                const ft_tensor *dout, const ft_tensor *q,
                                const ft_tensor *k, const ft_tensor *v,
                                const ft_tensor *out, const ft_tensor *lse,
                                const ft_attn_params *p)
{
    static const char func[] = "ft_attention_backward";
    char sa[SHAPE_TEXT], sb[SHAPE_TEXT];
    if (!dq || !dk || !dv)
        return ft_fail(FT_ERR_ARGUMENT, func, 0, "result pointer is NULL");
    *dq = *dk = *dv = NULL;
    ft_attn_shape s;
    FT_TRY(check_qkv(func, 2, 7, q, k, v, p, &s));
    FT_TRY(check_qkv_tensor(func, 1, "dout", dout, q));
    FT_TRY(check_qkv_tensor(func, 5, "out", out, q));
    const ft_tensor *like_q[2] = {dout, out};
    const char *like_q_name[2] = {"dout", "out"};
    for (int i = 0; i < 2; i++)
        for (int dim = 0; dim < 4; dim++)
            if (like_q[i]->shape[dim] != q->shape[dim])
                return ft_fail(FT_ERR_ARGUMENT, func, i == 0 ? 1 : 5,
                               "%s %s must have q's shape %s", like_q_name[i],
                               ft_format_shape(sa, sizeof sa, 4, like_q[i]->shape),
                               ft_format_shape(sb, sizeof sb, 4, q->shape));
    FT_TRY(ft_check_tensor(func, 6, lse));
    int64_t lse_shape[3] = {s.B, s.H, s.Nq};
    int lse_ok = lse->ndim == 3;
    for (int dim = 0; lse_ok && dim < 3; dim++)
        lse_ok = lse->shape[dim] == lse_shape[dim];
    if (!lse_ok)
        return ft_fail(FT_ERR_ARGUMENT, func, 6,
                       "lse must be [batch, heads, seqlen_q] = %s, got %s",
                       ft_format_shape(sa, sizeof sa, 3, lse_shape),
                       ft_format_shape(sb, sizeof sb, lse->ndim, lse->shape));
    if (lse->dtype != lse_dtype(q->dtype))
        return ft_fail(FT_ERR_ARGUMENT, func, 6,
                       "lse must be %s for %s inputs, got %s",
                       ft_dtype_name(lse_dtype(q->dtype)), ft_dtype_name(q->dtype),
                       ft_dtype_name(lse->dtype));
    if (!ft_device_equal(lse->device, q->device))
        return ft_fail(FT_ERR_ARGUMENT, func, 6, "lse is not on q's device");

    ft_tensor *g[3] = {NULL, NULL, NULL};
    const ft_tensor *like[3] = {q, k, v};
    ft_status st = FT_OK;
    for (int i = 0; i < 3 && st == FT_OK; i++)
        st = ft_empty_named(&g[i], 4, like[i]->shape, q->dtype, q->device, func);
    if (st == FT_OK)
        st = run_backward(p->impl, &s, dout, q, k, v, out, lse, g[0], g[1], g[2]);
    if (st != FT_OK) {
        for (int i = 0; i < 3; i++)
            ft_tensor_free(g[i]);
        return st;
    }
    *dq = g[0], *dk = g[1], *dv = g[2];
    return FT_OK;
}
