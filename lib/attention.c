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
#include <stdlib.h>
#include <string.h>

#define MAX_HEAD_DIM 256
#define MAX_BLOCK 4096
#define MAX_GRID_YZ 65535 /* CUDA grids: heads on y, batch on z */
#define DEFAULT_BLOCK_Q 128 /* 128 x 128 tiles: their CBLAS products ran 30% faster */
#define DEFAULT_BLOCK_K 128 /* than 64 x 64 on two cores (d = 64, f32) */

static const char *const impl_names[] = {"auto", "naive", "tiled", "flash", "cudnn"};

void ft_attn_params_init(ft_attn_params *p)
{
    memset(p, 0, sizeof *p);
    p->impl = FT_ATTN_AUTO;
    p->window_left = -1;
    p->window_right = -1;
}

const char *ft_attn_impl_name(ft_attn_impl impl)
{
    return impl >= FT_ATTN_AUTO && impl <= FT_ATTN_CUDNN ? impl_names[impl] : "invalid";
}

ft_status ft_attn_impl_parse(const char *name, ft_attn_impl *out)
{
    if (!out)
        return ft_fail(FT_ERR_ARGUMENT, "ft_attn_impl_parse", 0, "result pointer is NULL");
    for (int i = 0; name && i <= FT_ATTN_CUDNN; i++)
        if (strcmp(name, impl_names[i]) == 0) {
            *out = (ft_attn_impl)i;
            return FT_OK;
        }
    return ft_fail(FT_ERR_ARGUMENT, "ft_attn_impl_parse", 1,
                   "unknown impl '%s' (expected auto, naive, tiled, flash or cudnn)",
                   name ? name : "(null)");
}

/* The dtype LSE has for inputs of dtype: f64 stays f64, the rest f32. */
static ft_dtype lse_dtype(ft_dtype in) { return in == FT_F64 ? FT_F64 : FT_F32; }

static ft_status check_qkv_tensor(const char *func, int arg, const char *name,
                                  const ft_tensor *t, const ft_tensor *q, int varlen)
{
    FT_TRY(ft_check_tensor(func, arg, t));
    if (t->ndim != (varlen ? 3 : 4))
        return ft_fail(FT_ERR_ARGUMENT, func, arg, "%s must be %s, got %d-d", name,
                       varlen ? "3-d [total_tokens, heads, head_dim] (cu_seqlens given)"
                              : "4-d [batch, seqlen, heads, head_dim]",
                       t->ndim);
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
    const int last = t->ndim - 1;
    if (t->shape[last] > 1 && t->stride[last] != 1)
        return ft_fail(FT_ERR_ARGUMENT, func, arg,
                       "%s's last dim (head_dim) must be contiguous, its stride is %lld",
                       name, (long long)t->stride[last]);
    return FT_OK;
}

/* A per-head (or per batch and head) float vector option: alibi_slopes
 * [H] or [B, H], sink [H]. */
static ft_status check_head_vector(const char *func, int ap, const char *name,
                                   const ft_tensor *t, const ft_tensor *q, int64_t B,
                                   int64_t H, int allow_batch)
{
    char sa[SHAPE_TEXT];
    FT_TRY(ft_check_tensor(func, ap, t));
    if (t->dtype != FT_F32 && t->dtype != FT_F64)
        return ft_fail(FT_ERR_ARGUMENT, func, ap, "%s must be f32 or f64, got %s", name,
                       ft_dtype_name(t->dtype));
    if (!ft_device_equal(t->device, q->device)) {
        char a[16], b[16];
        return ft_fail(FT_ERR_ARGUMENT, func, ap, "%s is on %s but q is on %s", name,
                       ft_device_name(t->device, a, sizeof a),
                       ft_device_name(q->device, b, sizeof b));
    }
    const int per_head = t->ndim == 1 && t->shape[0] == H;
    const int per_batch = allow_batch && t->ndim == 2 && t->shape[0] == B && t->shape[1] == H;
    if (!per_head && !per_batch) {
        char want[96];
        if (allow_batch)
            snprintf(want, sizeof want, "[heads] or [batch, heads] = {%lld} or {%lld, %lld}",
                     (long long)H, (long long)B, (long long)H);
        else
            snprintf(want, sizeof want, "[heads] = {%lld}", (long long)H);
        return ft_fail(FT_ERR_ARGUMENT, func, ap, "%s must be %s, got %s", name, want,
                       ft_format_shape(sa, sizeof sa, t->ndim, t->shape));
    }
    return FT_OK;
}

/* dropout_p, seed and offset into m (B batches of H heads). */
static ft_status check_dropout(const char *func, int ap, const ft_attn_params *p, int64_t B,
                               int64_t H, ft_attn_mod *m)
{
    if (!(p->dropout_p >= 0 && p->dropout_p < 1))
        return ft_fail(FT_ERR_ARGUMENT, func, ap, "dropout_p must be in [0, 1), got %g",
                       p->dropout_p);
    if (p->dropout_offset >= (UINT64_C(1) << 31))
        return ft_fail(FT_ERR_ARGUMENT, func, ap, "offset must be below 2^31, got %llu",
                       (unsigned long long)p->dropout_offset);
    if (p->dropout_p > 0) {
        if (B > 0 && H > (int64_t)UINT32_MAX / B)
            return ft_fail(FT_ERR_UNSUPPORTED, func, ap,
                           "dropout counts batch x heads in 32 bits; %lld x %lld is more",
                           (long long)B, (long long)H);
        m->dropout = 1;
        m->drop_threshold = (uint32_t)floor(p->dropout_p * 4294967296.0);
        m->drop_scale = 1.0 / (1.0 - p->dropout_p);
        m->seed = p->dropout_seed;
        m->offset = (uint32_t)p->dropout_offset;
    }
    return FT_OK;
}

/* The variant options into s->mod (s's sizes are set). */
/* Mods on CUDA run in the flash kernels compiled for them (their
 * tensor-core path); what those take. */
static ft_status check_cuda_mods(const char *func, int ap, const ft_tensor *q,
                                 const ft_attn_params *p, const ft_attn_shape *s)
{
    if (p->impl == FT_ATTN_NAIVE)
        return ft_fail(FT_ERR_UNSUPPORTED, func, ap,
                       "mods on CUDA run in the flash kernels: impl 'flash' or 'auto', not "
                       "'naive'");
    if (q->dtype != FT_F16 && q->dtype != FT_BF16)
        return ft_fail(FT_ERR_UNSUPPORTED, func, 1,
                       "mods on CUDA take f16 or bf16 tensors (the flash kernels' tensor-core "
                       "path), got %s; use the cpu for f32 and f64",
                       ft_dtype_name(q->dtype));
    if (s->d % 8 != 0)
        return ft_fail(FT_ERR_UNSUPPORTED, func, 1,
                       "mods on CUDA need head_dim a multiple of 8, got %lld", (long long)s->d);
    return ft_attn_mods_cuda_check_tensors(func, ap, p->mod_ntensors, p->mod_tensors);
}

static ft_status check_variant(const char *func, int ap, const ft_tensor *q,
                               const ft_attn_params *p, ft_attn_shape *s)
{
    ft_attn_mod *m = &s->mod;
    memset(m, 0, sizeof *m);
    s->alibi = s->sink = NULL;
    s->batch0 = 0;
    if (p->window_left < -1 || p->window_right < -1)
        return ft_fail(FT_ERR_ARGUMENT, func, ap,
                       "window_left and window_right must be -1 (unbounded) or at least 0, "
                       "got %lld and %lld", (long long)p->window_left,
                       (long long)p->window_right);
    if (s->causal && p->window_right > 0)
        return ft_fail(FT_ERR_ARGUMENT, func, ap,
                       "window_right must be 0 or -1 with causal (causal is window_right = 0), "
                       "got %lld", (long long)p->window_right);
    /* a window at least Nq + Nk wide on a side reaches every key of every
     * sequence (each at most Nq by Nk): no bound there, which also keeps
     * i + Nk - Nq +- window within int64 (lib/attn_mod.h) */
    m->left = p->window_left >= s->Nq + s->Nk ? -1 : p->window_left;
    m->right = s->causal ? 0 : p->window_right >= s->Nq + s->Nk ? -1 : p->window_right;
    if (!(p->softcap >= 0) || !isfinite(p->softcap))
        return ft_fail(FT_ERR_ARGUMENT, func, ap, "softcap must be 0 (off) or positive, got %g",
                       p->softcap);
    m->softcap = p->softcap;
    if (p->alibi_slopes) {
        FT_TRY(check_head_vector(func, ap, "alibi_slopes", p->alibi_slopes, q, s->B, s->H, 1));
        s->alibi = p->alibi_slopes;
        m->alibi = 1;
    }
    if (p->sink) {
        FT_TRY(check_head_vector(func, ap, "sink", p->sink, q, s->B, s->H, 0));
        s->sink = p->sink;
        m->sink = 1;
    }
    FT_TRY(check_dropout(func, ap, p, s->B, s->H, m));
    s->mods = NULL, s->mod_tensors = NULL, s->mod_fault = NULL;
    s->mod_scratch = NULL, s->mod_scratch_per_thread = 0;
    s->mod_gacc = NULL, s->mod_gbuf = NULL, s->mod_gbuf_per_task = 0, s->mod_goff = NULL;
    s->mod_gdev = NULL;
    s->mask_is_band = 0;
    if (p->mods) {
        if (p->mod_ntensors > 0 && !p->mod_tensors)
            return ft_fail(FT_ERR_ARGUMENT, func, ap, "mod_tensors is NULL");
        FT_TRY(ft_attn_mods_check_tensors(p->mods, func, ap, p->mod_ntensors, p->mod_tensors,
                                          q->device));
        if (q->device.type == FT_CUDA)
            FT_TRY(check_cuda_mods(func, ap, q, p, s));
        s->mods = p->mods;
        s->mod_tensors = p->mod_tensors;
    }
    s->block_mask = NULL;
    if (p->block_mask) {
        if (!p->mods)
            return ft_fail(FT_ERR_ARGUMENT, func, ap, "block_mask needs the mods it was made for");
        if (s->cu_q)
            return ft_fail(FT_ERR_UNSUPPORTED, func, ap,
                           "block_mask with variable lengths: not supported");
        FT_TRY(ft_attn_block_mask_check(p->block_mask, p->mods, func, ap, q->device, s->B, s->H,
                                        s->Nq, s->Nk, s->block_q, s->block_k));
        s->block_mask = p->block_mask;
        int64_t left, right, in_left, in_right;
        if (ft_attn_block_mask_band(p->block_mask, &left, &right)) {
            /* every pair the mask keeps lies in the band: as a window, it
             * lets the flash kernels skip the tiles outside (the mask is
             * still applied inside); none kept: only the diagonal, which
             * the mask hides too */
            /* and where every pair of the band is kept too (its inner
             * band, where every row keeps every key, holds it: the block
             * mask evaluated every pair), the band is the mask: a Lua
             * causal or window mask runs as the built-in one */
            s->mask_is_band = left >= 0 && right >= 0 &&
                              ft_attn_block_mask_inner(p->block_mask, &in_left, &in_right) &&
                              in_left >= left && in_right >= right;
            left = left < 0 ? 0 : left, right = right < 0 ? 0 : right;
            m->left = m->left < 0 || left < m->left ? left : m->left;
            m->right = m->right < 0 || right < m->right ? right : m->right;
            /* a side that reaches every key of every row is no bound (row
             * i sees keys from i + Nk - Nq - left: key 0 for every row when
             * left >= Nk - 1; up to the last when right >= Nq - 1), and a
             * band with no left bound ending at the diagonal is the causal
             * mask (the kernels order its tiles longest first) */
            if (m->left >= s->Nk - 1)
                m->left = -1;
            if (m->right >= s->Nq - 1)
                m->right = -1;
            if (m->left < 0 && m->right == 0)
                s->causal = 1;
        }
    }
    /* The flash kernels run every variant (slopes and sinks in other
     * forms are converted for them: flash_inputs). */
    return FT_OK;
}

double ft_attn_slope(const ft_attn_shape *s, int64_t b, int64_t h)
{
    const ft_tensor *t = s->alibi;
    if (!t)
        return 0;
    const int64_t off = t->ndim == 1 ? h * t->stride[0]
                                     : (s->batch0 + b) * t->stride[0] + h * t->stride[1];
    return ft_load_f64(ft_elem_ptr(t, off), t->dtype);
}

double ft_attn_sink(const ft_attn_shape *s, int64_t h)
{
    const ft_tensor *t = s->sink;
    return t ? ft_load_f64(ft_elem_ptr(t, h * t->stride[0]), t->dtype) : -INFINITY;
}

/* A varlen call's offsets t (i32 [B + 1], the first 0, never decreasing,
 * the last `total`) as a new host array *out; *longest: the longest
 * sequence. */
static ft_status read_offsets(const char *func, int ap, const char *name, const ft_tensor *t,
                              int64_t total, int64_t **out, int64_t *count, int64_t *longest)
{
    FT_TRY(ft_check_tensor(func, ap, t));
    if (t->dtype != FT_I32 || t->ndim != 1)
        return ft_fail(FT_ERR_ARGUMENT, func, ap,
                       "%s must be a 1-d i32 tensor [batch + 1], got %s with %d dims", name,
                       ft_dtype_name(t->dtype), t->ndim);
    if (t->shape[0] < 1)
        return ft_fail(FT_ERR_ARGUMENT, func, ap,
                       "%s is empty: it holds batch + 1 offsets, the first 0 (a call of no "
                       "sequence is {0})", name);
    int64_t n = 0, *v = NULL;
    FT_TRY(ft_read_i32(func, ap, name, t, &v, &n));
    ft_status st = FT_OK;
    *longest = 0;
    if (v[0] != 0)
        st = ft_fail(FT_ERR_ARGUMENT, func, ap, "%s must start at 0, got %lld", name,
                     (long long)v[0]);
    for (int64_t b = 1; st == FT_OK && b < n; b++) {
        if (v[b] < v[b - 1])
            st = ft_fail(FT_ERR_ARGUMENT, func, ap,
                         "%s must never decrease, but offset %lld comes after %lld "
                         "(sequence %lld of %lld would be %lld long)",
                         name, (long long)v[b], (long long)v[b - 1], (long long)b,
                         (long long)(n - 1), (long long)(v[b] - v[b - 1]));
        else if (v[b] - v[b - 1] > *longest)
            *longest = v[b] - v[b - 1];
    }
    if (st == FT_OK && v[n - 1] != total)
        st = ft_fail(FT_ERR_ARGUMENT, func, ap,
                     "%s must end at the token count %lld, got %lld", name, (long long)total,
                     (long long)v[n - 1]);
    if (st != FT_OK) {
        free(v);
        return st;
    }
    *out = v;
    *count = n;
    return FT_OK;
}

/* The sizes of a varlen call: B sequences, Nq and Nk their longest. */
static ft_status check_varlen(const char *func, int aq, int ap, const ft_tensor *q,
                              const ft_tensor *k, const ft_attn_params *p, ft_attn_shape *s)
{
    if (!p->cu_seqlens_q || !p->cu_seqlens_k)
        return ft_fail(FT_ERR_ARGUMENT, func, ap,
                       "cu_seqlens_q and cu_seqlens_k go together, got only %s",
                       p->cu_seqlens_q ? "cu_seqlens_q" : "cu_seqlens_k");
    int64_t nq, nk, *cq = NULL, *ck = NULL;
    FT_TRY(read_offsets(func, ap, "cu_seqlens_q", p->cu_seqlens_q, q->shape[0], &cq, &nq,
                        &s->Nq));
    s->cu_q = cq;
    FT_TRY(read_offsets(func, ap, "cu_seqlens_k", p->cu_seqlens_k, k->shape[0], &ck, &nk,
                        &s->Nk));
    s->cu_k = ck;
    if (nq != nk)
        return ft_fail(FT_ERR_ARGUMENT, func, ap,
                       "cu_seqlens_q has %lld offsets but cu_seqlens_k %lld (one per "
                       "sequence, plus one)", (long long)nq, (long long)nk);
    const int64_t given[2] = {p->max_seqlen_q, p->max_seqlen_k}, real[2] = {s->Nq, s->Nk};
    for (int i = 0; i < 2; i++)
        if (given[i] < 0 || (given[i] > 0 && given[i] < real[i]))
            return ft_fail(FT_ERR_ARGUMENT, func, ap,
                           "max_seqlen_%c must be 0 (worked out) or at least the longest "
                           "sequence, %lld; got %lld", i ? 'k' : 'q', (long long)real[i],
                           (long long)given[i]);
    (void)aq;
    s->B = nq - 1;
    s->H = q->shape[1], s->d = q->shape[2], s->Hk = k->shape[1];
    return FT_OK;
}

/* impl "cudnn" (attention_cudnn.c): cuDNN's fused attention on CUDA, f16
 * or bf16, causal or not, with a scale, GQA/MQA. Every other option is
 * refused here rather than ignored there. */
static ft_status check_cudnn(const char *func, int aq, int ap, const ft_tensor *q,
                             const ft_attn_params *p, const ft_attn_shape *s)
{
    const int built = ft_cudnn_version() != 0;
    if (q->device.type != FT_CUDA)
        return ft_fail(FT_ERR_UNSUPPORTED, func, ap,
                       "impl 'cudnn' runs on CUDA tensors; these are on the cpu (use 'tiled' "
                       "or 'naive')%s", built ? "" : ", and flashtile was built without cuDNN");
    if (!built)
        return ft_fail(FT_ERR_UNSUPPORTED, func, ap,
                       "impl 'cudnn': flashtile was built without cuDNN (use 'flash')");
    if (q->dtype != FT_F16 && q->dtype != FT_BF16)
        return ft_fail(FT_ERR_UNSUPPORTED, func, aq,
                       "impl 'cudnn' takes f16 or bf16 tensors (cuDNN's fused attention), got %s",
                       ft_dtype_name(q->dtype));
    if (s->d % FT_CUDNN_HEAD_DIM_STEP != 0 || s->d > FT_CUDNN_MAX_HEAD_DIM)
        return ft_fail(FT_ERR_UNSUPPORTED, func, aq,
                       "impl 'cudnn' takes head_dim a multiple of %d up to %d (cuDNN's fused "
                       "attention), got %lld", FT_CUDNN_HEAD_DIM_STEP, FT_CUDNN_MAX_HEAD_DIM,
                       (long long)s->d);
    const char *opt = NULL;
    if (p->cu_seqlens_q || p->cu_seqlens_k)
        opt = "cu_seqlens (variable lengths)";
    else if (p->window_left != -1 || (p->window_right != -1 && !(s->causal && p->window_right == 0)))
        opt = "a sliding window (window_left, window_right)";
    else if (p->softcap != 0)
        opt = "softcap";
    else if (p->alibi_slopes)
        opt = "alibi_slopes";
    else if (p->sink)
        opt = "sink";
    else if (p->dropout_p != 0)
        opt = "dropout_p";
    else if (p->mods || p->block_mask)
        opt = p->mods ? "mods" : "block_mask";
    if (opt)
        return ft_fail(FT_ERR_UNSUPPORTED, func, ap,
                       "impl 'cudnn' takes causal and scale, not %s (impl 'flash' does)", opt);
    return FT_OK;
}

/* The softmax scale: the one given, else 1 / sqrt(d). */
static double attn_scale(double given, int64_t d)
{
    return given != 0 ? given : 1.0 / sqrt((double)d);
}

/* Checks q, k, v (inputs at positions aq, aq+1, aq+2) and the options
 * (position ap), and fills s. A varlen call leaves host arrays in s that
 * shape_free releases, also after a failure. */
static ft_status check_qkv(const char *func, int aq, int ap, const ft_tensor *q,
                           const ft_tensor *k, const ft_tensor *v,
                           const ft_attn_params *p, ft_attn_shape *s)
{
    char sa[SHAPE_TEXT], sb[SHAPE_TEXT];
    s->cu_q = s->cu_k = NULL;
    s->cu_q_dev = s->cu_k_dev = NULL;
    if (!p)
        return ft_fail(FT_ERR_ARGUMENT, func, ap, "params expected (ft_attn_params_init)");
    const int varlen = p->cu_seqlens_q || p->cu_seqlens_k;
    FT_TRY(check_qkv_tensor(func, aq, "q", q, q, varlen));
    FT_TRY(check_qkv_tensor(func, aq + 1, "k", k, q, varlen));
    FT_TRY(check_qkv_tensor(func, aq + 2, "v", v, q, varlen));
    FT_TRY(ft_check_device(func, aq, q, NULL));
    s->dtype = q->dtype;
    const int r = varlen ? 0 : 1; /* the seqlen dim; heads and head_dim follow */
    for (int dim = 0; dim < q->ndim; dim++)
        if (v->shape[dim] != k->shape[dim])
            return ft_fail(FT_ERR_ARGUMENT, func, aq + 2,
                           "v %s must have k's shape %s",
                           ft_format_shape(sa, sizeof sa, v->ndim, v->shape),
                           ft_format_shape(sb, sizeof sb, k->ndim, k->shape));
    if ((!varlen && k->shape[0] != q->shape[0]) || k->shape[r + 2] != q->shape[r + 2])
        return ft_fail(FT_ERR_ARGUMENT, func, aq + 1,
                       "k %s does not match q %s in %s",
                       ft_format_shape(sa, sizeof sa, k->ndim, k->shape),
                       ft_format_shape(sb, sizeof sb, q->ndim, q->shape),
                       varlen ? "head_dim" : "batch or head_dim");
    if (varlen) {
        FT_TRY(check_varlen(func, aq, ap, q, k, p, s));
    } else {
        if (p->max_seqlen_q || p->max_seqlen_k)
            return ft_fail(FT_ERR_ARGUMENT, func, ap,
                           "max_seqlen_q and max_seqlen_k belong to a varlen call (q, k, v "
                           "packed [tokens, heads, head_dim] with cu_seqlens_q/k), got %lld "
                           "and %lld", (long long)p->max_seqlen_q, (long long)p->max_seqlen_k);
        s->B = q->shape[0], s->Nq = q->shape[1], s->H = q->shape[2], s->d = q->shape[3];
        s->Nk = k->shape[1], s->Hk = k->shape[2];
    }
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

    if (p->impl < FT_ATTN_AUTO || p->impl > FT_ATTN_CUDNN)
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
    s->scale = attn_scale(p->scale, s->d);
    s->causal = p->causal != 0;
    for (int i = 0; i < 2; i++) {
        const int64_t b = i ? p->block_k : p->block_q;
        if (b < 0 || b > MAX_BLOCK)
            return ft_fail(FT_ERR_ARGUMENT, func, ap,
                           "%s must be 1 to %d (or left unset: the default), got %lld",
                           i ? "block_k" : "block_q", MAX_BLOCK, (long long)b);
    }
    if (cuda && (p->block_q || p->block_k))
        return ft_fail(FT_ERR_UNSUPPORTED, func, ap,
                       "block_q and block_k set the cpu's tiles; the CUDA kernels choose "
                       "their own (leave them unset)");
    s->block_q = p->block_q ? p->block_q : DEFAULT_BLOCK_Q;
    s->block_k = p->block_k ? p->block_k : DEFAULT_BLOCK_K;

    FT_TRY(check_variant(func, ap, q, p, s));
    return p->impl == FT_ATTN_CUDNN ? check_cudnn(func, aq, ap, q, p, s) : FT_OK;
}

#ifdef FT_HAVE_CUDA
/* On CUDA, "auto" is flash but for f64. */
static int use_naive_cuda(ft_attn_impl impl, const ft_attn_shape *s)
{
    return impl == FT_ATTN_NAIVE || (impl == FT_ATTN_AUTO && s->dtype == FT_F64);
}
#endif

/* The implementation for the device: the cpu's naive or tiled code, or
 * the CUDA naive (cuBLAS) or flash kernels. */
#ifdef FT_HAVE_CUDA
/* The flash kernels read ALiBi slopes in f32 (any strides) and sinks in
 * f32, contiguous: fs is s with other forms converted into tmp[0] and
 * tmp[1] (freed by the caller, also after a failure). */
static ft_status flash_inputs(const ft_attn_shape *s, ft_attn_shape *fs, ft_tensor **tmp)
{
    *fs = *s;
    tmp[0] = tmp[1] = NULL;
    if (s->alibi && s->alibi->dtype != FT_F32) {
        FT_TRY(ft_to(&tmp[0], s->alibi, FT_F32, s->alibi->device));
        fs->alibi = tmp[0];
    }
    if (s->sink && (s->sink->dtype != FT_F32 || !ft_is_contiguous(s->sink))) {
        FT_TRY(ft_to(&tmp[1], s->sink, FT_F32, s->sink->device));
        fs->sink = tmp[1];
    }
    return FT_OK;
}

static ft_status forward_flash_cuda(const ft_attn_shape *s, const ft_tensor *q,
                                    const ft_tensor *k, const ft_tensor *v, ft_tensor *out,
                                    ft_tensor *lse)
{
    ft_status st = FT_OK;
    if (ft_attention_decode_plain(s, q, k, v, out, lse, &st)) /* a few rows, many keys */
        return st;
    ft_attn_shape fs;
    ft_tensor *tmp[2];
    st = flash_inputs(s, &fs, tmp);
    if (st == FT_OK)
        st = ft_attention_forward_flash_cuda(&fs, q, k, v, out, lse);
    ft_tensor_free(tmp[0]);
    ft_tensor_free(tmp[1]);
    return st;
}
#endif

static ft_status run_forward(ft_attn_impl impl, const ft_attn_shape *s,
                             const ft_tensor *q, const ft_tensor *k, const ft_tensor *v,
                             ft_tensor *out, ft_tensor *lse)
{
#ifdef FT_HAVE_CUDA
    if (q->device.type == FT_CUDA && impl == FT_ATTN_CUDNN)
        return ft_attention_forward_cudnn(s, q, k, v, out, lse);
    if (q->device.type == FT_CUDA)
        return use_naive_cuda(impl, s) ? ft_attention_forward_naive_cuda(s, q, k, v, out, lse)
                                       : forward_flash_cuda(s, q, k, v, out, lse);
#endif
    return ft_attention_forward_cpu(impl, s, q, k, v, out, lse);
}

#ifdef FT_HAVE_CUDA
/* The flash backward's preparation: LSE contiguous, the kernels' work
 * space (D and LSE in log2 units, laid out as LSE), and with no query
 * dK = dV = 0 without a launch. */
static ft_status backward_flash_cuda(const ft_attn_shape *s, const ft_tensor *dout,
                                     const ft_tensor *q, const ft_tensor *k, const ft_tensor *v,
                                     const ft_tensor *out, const ft_tensor *lse, ft_tensor *dq,
                                     ft_tensor *dk, ft_tensor *dv)
{
    static const char func[] = "ft_attention_backward";
    if (s->Nq == 0 || s->B == 0 || s->H == 0) {
        FT_TRY(ft_fill(dk, 0.0));
        return ft_fill(dv, 0.0);
    }
    ft_attn_shape fs;
    ft_tensor *lse_c = NULL, *work = NULL, *tmp[2];
    ft_status st = flash_inputs(s, &fs, tmp);
    if (st == FT_OK)
        st = ft_contiguous(&lse_c, lse);
    int64_t shape[FT_MAX_DIMS + 1];
    shape[0] = 2;
    for (int i = 0; i < lse->ndim; i++)
        shape[i + 1] = lse->shape[i];
    if (st == FT_OK)
        st = ft_empty_named(&work, lse->ndim + 1, shape, FT_F32, q->device, func);
    if (st == FT_OK)
        st = ft_attention_backward_flash_cuda(&fs, dout, q, k, v, out, lse_c, work, dq, dk, dv);
    ft_tensor_free(lse_c);
    ft_tensor_free(work);
    ft_tensor_free(tmp[0]);
    ft_tensor_free(tmp[1]);
    return st;
}
#endif

static ft_status run_backward(ft_attn_impl impl, const ft_attn_shape *s,
                              const ft_tensor *dout, const ft_tensor *q,
                              const ft_tensor *k, const ft_tensor *v,
                              const ft_tensor *out, const ft_tensor *lse,
                              ft_tensor *dq, ft_tensor *dk, ft_tensor *dv)
{
#ifdef FT_HAVE_CUDA
    if (q->device.type == FT_CUDA && impl == FT_ATTN_CUDNN)
        return ft_attention_backward_cudnn(s, dout, q, k, v, out, lse, dq, dk, dv);
    if (q->device.type == FT_CUDA)
        return use_naive_cuda(impl, s)
                   ? ft_attention_backward_naive_cuda(s, dout, q, k, v, out, lse, dq, dk, dv)
                   : backward_flash_cuda(s, dout, q, k, v, out, lse, dq, dk, dv);
#endif
    return ft_attention_backward_cpu(impl, s, dout, q, k, v, out, lse, dq, dk, dv);
}

/* The captured float tensors' gradients into new tensors (shape and dtype
 * of each), for the slots that have one. */
static ft_status mod_grads_store(const char *func, const ft_attn_shape *s, double *const *gacc,
                                 ft_tensor **grads)
{
    const int n = ft_attn_mods_tensors(s->mods);
    ft_status st = FT_OK;
    for (int t = 0; t < n && st == FT_OK; t++) {
        const ft_tensor *x = s->mod_tensors[t];
        if (!ft_dtype_is_float(x->dtype))
            continue;
        st = ft_empty_named(&grads[t], x->ndim, x->shape, x->dtype, x->device, func);
        for (int64_t e = 0; st == FT_OK && e < ft_numel(x); e++)
            ft_store_f64(ft_elem_ptr(grads[t], e), x->dtype, gacc[t] ? gacc[t][e] : 0.0);
    }
    if (st != FT_OK)
        for (int t = 0; t < n; t++) {
            ft_tensor_free(grads[t]);
            grads[t] = NULL;
        }
    return st;
}

/* A mod read one of its tensors out of range (the nearest element was
 * read instead): the call fails. */
static ft_status mod_fault(const char *func)
{
    return ft_fail(FT_ERR_ARGUMENT, func, 0,
                   "mods: a read of a captured tensor was out of range (indices are 1-based "
                   "and must lie within the tensor's shape)");
}

static void shape_free(ft_attn_shape *s)
{
    free((void *)s->cu_q);
    free((void *)s->cu_k);
    s->cu_q = s->cu_k = NULL;
}

ft_status ft_attention_check_like(const char *func, const ft_tensor *q, const ft_tensor *k,
                                  const ft_tensor *v, int64_t Nk, const ft_attn_params *p)
{
    ft_tensor kv[2] = {*k, *v};
    for (int i = 0; i < 2; i++)
        kv[i].shape[0] = q->shape[0], kv[i].shape[1] = Nk;
    ft_attn_params one = *p;
    one.cache_seqlens = one.k_new = one.v_new = one.block_table = NULL;
    ft_attn_shape s;
    memset(&s, 0, sizeof s);
    const ft_status st = check_qkv(func, 1, 4, q, &kv[0], &kv[1], &one, &s);
    shape_free(&s);
    return st;
}

/* Rows r0 .. r0 + n - 1 of a varlen tensor [total, heads, d] as the
 * [1, n, heads, d] tensor of a one-sequence call: a view on the stack,
 * never freed. */
static ft_tensor seq_rows(const ft_tensor *t, int64_t r0, int64_t n)
{
    ft_tensor v = *t;
    v.ndim = 4;
    v.shape[0] = 1, v.shape[1] = n, v.shape[2] = t->shape[1], v.shape[3] = t->shape[2];
    v.stride[0] = 0, v.stride[1] = t->stride[0];
    v.stride[2] = t->stride[1], v.stride[3] = t->stride[2];
    v.data = ft_elem_ptr(t, r0 * t->stride[0]);
    return v;
}

/* Columns r0 .. r0 + n - 1 of a varlen lse [H, total] as [1, H, n]. */
static ft_tensor seq_lse(const ft_tensor *t, int64_t r0, int64_t n)
{
    ft_tensor v = *t;
    v.ndim = 3;
    v.shape[0] = 1, v.shape[1] = t->shape[0], v.shape[2] = n;
    v.stride[0] = 0, v.stride[1] = t->stride[0], v.stride[2] = t->stride[1];
    v.data = ft_elem_ptr(t, r0 * t->stride[1]);
    return v;
}

/* Whether a varlen call runs in one launch: the flash kernels take every
 * sequence at once; the other paths go sequence by sequence. */
static int one_launch(ft_attn_impl impl, const ft_attn_shape *s, const ft_tensor *q)
{
#ifdef FT_HAVE_CUDA
    return s->cu_q && q->device.type == FT_CUDA && !use_naive_cuda(impl, s);
#else
    (void)impl, (void)s, (void)q;
    return 0;
#endif
}

/* The offsets of a one-launch varlen call as the kernels read them: i32,
 * contiguous, on q's device (dev[0] for q, dev[1] for k; the caller frees
 * them). */
static ft_status device_offsets(const ft_attn_params *p, const ft_tensor *q, ft_attn_shape *s,
                                ft_tensor **dev)
{
    dev[0] = dev[1] = NULL;
    ft_status st = ft_to(&dev[0], p->cu_seqlens_q, FT_I32, q->device);
    if (st == FT_OK)
        st = ft_to(&dev[1], p->cu_seqlens_k, FT_I32, q->device);
    s->cu_q_dev = st == FT_OK ? dev[0]->data : NULL;
    s->cu_k_dev = st == FT_OK ? dev[1]->data : NULL;
    return st;
}

/* Sequence b of a varlen call as a call of its own. */
static ft_attn_shape seq_shape(const ft_attn_shape *s, int64_t b)
{
    ft_attn_shape one = *s;
    one.B = 1;
    one.Nq = s->cu_q[b + 1] - s->cu_q[b];
    one.Nk = s->cu_k[b + 1] - s->cu_k[b];
    one.batch0 = b;
    one.cu_q = one.cu_k = NULL;
    one.cu_q_dev = one.cu_k_dev = NULL;
    return one;
}

/* Whether p gives any fp8 descale factor. */
static int descaled(const ft_attn_params *p)
{
    return p && (p->descale_q != 0 || p->descale_k != 0 || p->descale_v != 0);
}

/* A descale factor: 0 (not given: 1) or finite and positive. */
static ft_status check_descale(const char *func, double x, const char *name, double *out)
{
    if (!(x >= 0) || !isfinite(x))
        return ft_fail(FT_ERR_ARGUMENT, func, 4, "%s %g: must be a finite positive number",
                       name, x);
    *out = x == 0 ? 1 : x;
    return FT_OK;
}

#ifdef FT_HAVE_CUDA
/* fp8_e4m3 q, k, v on the fp8 tensor cores (sm90/flash_fwd_fp8.cu), when
 * the kernel takes the tensors and the call is plain or causal attention
 * (GQA included); *took says whether it ran. The plain call's checks run
 * on the tensors read as bf16; a call they refuse goes the converted way,
 * which refuses it with the same words. */
static ft_status fp8_forward_mma(const char *func, ft_tensor **out, ft_tensor **lse,
                                 const ft_tensor *q, const ft_tensor *k, const ft_tensor *v,
                                 const ft_attn_params *p, double dqk, double dv, int *took)
{
    *took = 0;
    if ((p->impl != FT_ATTN_AUTO && p->impl != FT_ATTN_FLASH) ||
        !ft_attention_fp8_cuda_takes(q, k, v))
        return FT_OK;
    ft_tensor as16[3] = {*q, *k, *v};
    for (int i = 0; i < 3; i++)
        as16[i].dtype = FT_BF16;
    ft_attn_params p2 = *p;
    p2.descale_q = p2.descale_k = p2.descale_v = 0;
    ft_attn_shape s;
    memset(&s, 0, sizeof s);
    ft_status st = check_qkv(func, 1, 4, &as16[0], &as16[1], &as16[2], &p2, &s);
    const int plain = st == FT_OK && !s.cu_q && ft_attn_plain_or_causal(&s);
    const double scale = s.scale;
    const int causal = s.causal;
    shape_free(&s);
    if (!plain)
        return FT_OK;
    ft_tensor *o = NULL, *l = NULL;
    void *ws = NULL;
    const int64_t lshape[3] = {q->shape[0], q->shape[2], q->shape[1]};
    st = ft_empty_named(&o, 4, q->shape, FT_BF16, q->device, func);
    if (st == FT_OK)
        st = ft_empty_named(&l, 3, lshape, FT_F32, q->device, func);
    if (st == FT_OK)
        st = ft_device_alloc(&ws, ft_attention_fp8_cuda_workspace(k), q->device, func);
    if (st == FT_OK) {
        const ft_fp8_fwd_cuda a = {q, k, v, scale * dqk, dv, causal, ws, o, l};
        st = ft_attention_forward_fp8_cuda(&a);
    }
    ft_device_free(ws, q->device);
    if (st != FT_OK) {
        ft_tensor_free(o);
        ft_tensor_free(l);
        return st == FT_ERR_UNSUPPORTED ? FT_OK : st; /* the converted way, then */
    }
    *out = o;
    *lse = l;
    *took = 1;
    return FT_OK;
}
#endif

/* fp8_e4m3 q, k, v: on CUDA the fp8 tensor-core kernel where it takes the
 * call (fp8_forward_mma), else converted (f32 on the CPU, bf16 on CUDA; v
 * times descale_v), run as attention of that dtype with scale times
 * descale_q descale_k, the output made bf16. */
static ft_status fp8_forward(const char *func, ft_tensor **out, ft_tensor **lse,
                             const ft_tensor *q, const ft_tensor *k, const ft_tensor *v,
                             const ft_attn_params *p)
{
    const ft_tensor *in[3] = {q, k, v};
    static const char *const names[3] = {"q", "k", "v"};
    for (int i = 0; i < 3; i++) {
        FT_TRY(ft_check_tensor(func, 1 + i, in[i]));
        if (in[i]->dtype != FT_FP8_E4M3)
            return ft_fail(FT_ERR_ARGUMENT, func, 1 + i,
                           "%s is %s but q is fp8_e4m3 (one dtype for all inputs)", names[i],
                           ft_dtype_name(in[i]->dtype));
    }
    if (!p)
        return ft_fail(FT_ERR_ARGUMENT, func, 4, "params expected (ft_attn_params_init)");
    if (p->cache_seqlens || p->k_new || p->v_new || p->block_table)
        return ft_fail(FT_ERR_ARGUMENT, func, 4,
                       "a KV cache call does not take fp8_e4m3 tensors (f16, bf16, f32 or f64)");
    if (p->impl == FT_ATTN_CUDNN)
        return ft_fail(FT_ERR_ARGUMENT, func, 4,
                       "impl cudnn does not take fp8_e4m3 inputs (flash, naive or tiled do)");
    double dq = 1, dk = 1, dv = 1;
    FT_TRY(check_descale(func, p->descale_q, "descale_q", &dq));
    FT_TRY(check_descale(func, p->descale_k, "descale_k", &dk));
    FT_TRY(check_descale(func, p->descale_v, "descale_v", &dv));
    const int cpu = q->device.type == FT_CPU;
#ifdef FT_HAVE_CUDA
    if (!cpu) {
        int took = 0;
        FT_TRY(fp8_forward_mma(func, out, lse, q, k, v, p, dq * dk, dv, &took));
        if (took)
            return FT_OK;
    }
#endif
    const ft_dtype work = cpu ? FT_F32 : FT_BF16;
    ft_tensor *qc = NULL, *kc = NULL, *vf = NULL, *vs = NULL, *vc = NULL, *o = NULL, *l = NULL;
    ft_status st = ft_to(&qc, q, work, q->device);
    if (st == FT_OK)
        st = ft_to(&kc, k, work, k->device);
    if (st == FT_OK)
        st = ft_to(&vf, v, FT_F32, v->device);
    if (st == FT_OK)
        st = ft_binary_scalar(&vs, FT_MUL, vf, dv, 0);
    if (st == FT_OK && !cpu)
        st = ft_to(&vc, vs, FT_BF16, v->device);
    if (st == FT_OK) {
        ft_attn_params p2 = *p;
        const int64_t d = q->ndim > 0 ? q->shape[q->ndim - 1] : 1; /* else refused below */
        p2.scale = attn_scale(p->scale, d > 0 ? d : 1) * dq * dk;
        p2.descale_q = p2.descale_k = p2.descale_v = 0;
        st = ft_attention_forward(&o, &l, qc, kc, cpu ? vs : vc, &p2);
    }
    if (st == FT_OK && cpu) {
        ft_tensor *ob = NULL;
        st = ft_to(&ob, o, FT_BF16, o->device);
        ft_tensor_free(o);
        o = ob;
    }
    ft_tensor_free(qc);
    ft_tensor_free(kc);
    ft_tensor_free(vf);
    ft_tensor_free(vs);
    ft_tensor_free(vc);
    if (st != FT_OK) {
        ft_tensor_free(o);
        ft_tensor_free(l);
        return st;
    }
    *out = o;
    *lse = l;
    return FT_OK;
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
    FT_TRY(ft_check_tensor(func, 1, q));
    if (q->dtype == FT_FP8_E4M3)
        return fp8_forward(func, out, lse, q, k, v, p);
    if (descaled(p))
        return ft_fail(FT_ERR_ARGUMENT, func, 4,
                       "descale_q, descale_k and descale_v are for fp8_e4m3 inputs (q is %s)",
                       ft_dtype_name(q->dtype));
    if (p && (p->cache_seqlens || p->k_new || p->v_new || p->block_table)) {
        if (!p->cache_seqlens)
            return ft_fail(FT_ERR_ARGUMENT, func, 4,
                           "k_new, v_new and block_table belong to a KV cache call: "
                           "cache_seqlens expected");
        return ft_attention_cache_forward(out, lse, q, k, v, p); /* attention_cache.c */
    }
    ft_attn_shape s;
    ft_tensor *o = NULL, *l = NULL;
    int fault = 0;
    ft_status st = check_qkv(func, 1, 4, q, k, v, p, &s);
    s.mod_fault = &fault;
    if (st == FT_OK)
        st = ft_empty_named(&o, q->ndim, q->shape, q->dtype, q->device, func);
    if (st == FT_OK) {
        /* [B, H, Nq]; varlen: [H, total_q] */
        const int64_t fixed[3] = {s.B, s.H, s.Nq}, packed[2] = {s.H, q->shape[0]};
        st = s.cu_q ? ft_empty_named(&l, 2, packed, lse_dtype(q->dtype), q->device, func)
                    : ft_empty_named(&l, 3, fixed, lse_dtype(q->dtype), q->device, func);
    }
    const int one = st == FT_OK && one_launch(p->impl, &s, q);
    ft_tensor *offs[2] = {NULL, NULL};
    if (one)
        st = device_offsets(p, q, &s, offs);
    if (st == FT_OK && (!s.cu_q || one))
        st = run_forward(p->impl, &s, q, k, v, o, l);
    ft_tensor_free(offs[0]);
    ft_tensor_free(offs[1]);
    for (int64_t b = 0; st == FT_OK && s.cu_q && !one && b < s.B; b++) {
        const ft_attn_shape one = seq_shape(&s, b);
        const int64_t iq = s.cu_q[b], ik = s.cu_k[b];
        ft_tensor qb = seq_rows(q, iq, one.Nq), kb = seq_rows(k, ik, one.Nk),
                  vb = seq_rows(v, ik, one.Nk), ob = seq_rows(o, iq, one.Nq),
                  lb = seq_lse(l, iq, one.Nq);
        if (q->device.type == FT_CUDA) {
            /* the CUDA kernels write LSE contiguous: into its rows after */
            ft_tensor *lc = NULL;
            st = ft_empty_named(&lc, 3, lb.shape, lb.dtype, lb.device, func);
            if (st == FT_OK)
                st = run_forward(p->impl, &one, &qb, &kb, &vb, &ob, lc);
            if (st == FT_OK)
                st = ft_copy(&lb, lc);
            ft_tensor_free(lc);
        } else {
            st = run_forward(p->impl, &one, &qb, &kb, &vb, &ob, &lb);
        }
    }
    shape_free(&s);
    if (st == FT_OK && fault)
        st = mod_fault(func);
    if (st != FT_OK) {
        ft_tensor_free(o);
        ft_tensor_free(l);
        return st;
    }
    *out = o;
    *lse = l;
    return FT_OK;
}

/* The checks of the backward's own inputs: dout and out like q, lse as
 * the forward returned it. */
static ft_status check_backward_inputs(const char *func, const ft_attn_shape *s,
                                       const ft_tensor *dout, const ft_tensor *q,
                                       const ft_tensor *out, const ft_tensor *lse)
{
    char sa[SHAPE_TEXT], sb[SHAPE_TEXT];
    const int varlen = s->cu_q != NULL;
    FT_TRY(check_qkv_tensor(func, 1, "dout", dout, q, varlen));
    FT_TRY(check_qkv_tensor(func, 5, "out", out, q, varlen));
    const ft_tensor *like_q[2] = {dout, out};
    const char *like_q_name[2] = {"dout", "out"};
    for (int i = 0; i < 2; i++)
        for (int dim = 0; dim < q->ndim; dim++)
            if (like_q[i]->shape[dim] != q->shape[dim])
                return ft_fail(FT_ERR_ARGUMENT, func, i == 0 ? 1 : 5,
                               "%s %s must have q's shape %s", like_q_name[i],
                               ft_format_shape(sa, sizeof sa, q->ndim, like_q[i]->shape),
                               ft_format_shape(sb, sizeof sb, q->ndim, q->shape));
    FT_TRY(ft_check_tensor(func, 6, lse));
    const int64_t fixed[3] = {s->B, s->H, s->Nq}, packed[2] = {s->H, q->shape[0]};
    const int64_t *want = varlen ? packed : fixed;
    const int nd = varlen ? 2 : 3;
    int lse_ok = lse->ndim == nd;
    for (int dim = 0; lse_ok && dim < nd; dim++)
        lse_ok = lse->shape[dim] == want[dim];
    if (!lse_ok)
        return ft_fail(FT_ERR_ARGUMENT, func, 6, "lse must be %s = %s, got %s",
                       varlen ? "[heads, total_q]" : "[batch, heads, seqlen_q]",
                       ft_format_shape(sa, sizeof sa, nd, want),
                       ft_format_shape(sb, sizeof sb, lse->ndim, lse->shape));
    if (lse->dtype != lse_dtype(q->dtype))
        return ft_fail(FT_ERR_ARGUMENT, func, 6,
                       "lse must be %s for %s inputs, got %s",
                       ft_dtype_name(lse_dtype(q->dtype)), ft_dtype_name(q->dtype),
                       ft_dtype_name(lse->dtype));
    if (!ft_device_equal(lse->device, q->device))
        return ft_fail(FT_ERR_ARGUMENT, func, 6, "lse is not on q's device");
    return FT_OK;
}

#ifdef FT_HAVE_CUDA
/* sink_grad on CUDA: summed in f64 on the device, then converted. */
static ft_status sink_grad_cuda(const char *func, const ft_attn_shape *s, const ft_tensor *dout,
                                const ft_tensor *out, const ft_tensor *lse, ft_tensor **dsink)
{
    ft_tensor *acc = NULL, *part = NULL;
    const int64_t nparts = s->H * FT_SINK_PARTS;
    ft_status st = ft_empty_named(&acc, 1, &s->H, FT_F64, out->device, func);
    if (st == FT_OK)
        st = ft_empty_named(&part, 1, &nparts, FT_F64, out->device, func);
    if (st == FT_OK)
        st = ft_fill(acc, 0.0);
    if (st == FT_OK && !s->cu_q)
        st = ft_attention_sink_grad_cuda(s, dout, out, lse, acc->data, part->data);
    for (int64_t b = 0; st == FT_OK && s->cu_q && b < s->B; b++) {
        const ft_attn_shape one = seq_shape(s, b);
        const int64_t iq = s->cu_q[b];
        ft_tensor db = seq_rows(dout, iq, one.Nq), ob = seq_rows(out, iq, one.Nq),
                  lb = seq_lse(lse, iq, one.Nq);
        st = ft_attention_sink_grad_cuda(&one, &db, &ob, &lb, acc->data, part->data);
    }
    if (st == FT_OK)
        st = ft_to(dsink, acc, s->sink->dtype, s->sink->device);
    ft_tensor_free(part);
    ft_tensor_free(acc);
    return st;
}
#endif

/* The sink's gradient into a new tensor like s->sink. */
static ft_status sink_grad(const char *func, const ft_attn_shape *s, const ft_tensor *dout,
                           const ft_tensor *out, const ft_tensor *lse, ft_tensor **dsink)
{
#ifdef FT_HAVE_CUDA
    if (out->device.type == FT_CUDA)
        return sink_grad_cuda(func, s, dout, out, lse, dsink);
#endif
    double *acc = calloc((size_t)s->H, sizeof *acc);
    if (!acc)
        return ft_fail(FT_ERR_NOMEM, func, 0, "out of memory for the sink's gradient");
    if (!s->cu_q)
        ft_attention_sink_grad_cpu(s, dout, out, lse, acc);
    for (int64_t b = 0; s->cu_q && b < s->B; b++) {
        const ft_attn_shape one = seq_shape(s, b);
        const int64_t iq = s->cu_q[b];
        ft_tensor db = seq_rows(dout, iq, one.Nq), ob = seq_rows(out, iq, one.Nq),
                  lb = seq_lse(lse, iq, one.Nq);
        ft_attention_sink_grad_cpu(&one, &db, &ob, &lb, acc);
    }
    ft_status st = ft_empty_named(dsink, 1, &s->H, s->sink->dtype, s->sink->device, func);
    for (int64_t h = 0; st == FT_OK && h < s->H; h++)
        ft_store_f64(ft_elem_ptr(*dsink, h), (*dsink)->dtype, acc[h]);
    free(acc);
    return st;
}

ft_status ft_attention_backward(ft_tensor **dq, ft_tensor **dk, ft_tensor **dv,
                                const ft_tensor *dout, const ft_tensor *q,
                                const ft_tensor *k, const ft_tensor *v,
                                const ft_tensor *out, const ft_tensor *lse,
                                const ft_attn_params *p)
{
    static const char func[] = "ft_attention_backward";
    if (!dq || !dk || !dv)
        return ft_fail(FT_ERR_ARGUMENT, func, 0, "result pointer is NULL");
    *dq = *dk = *dv = NULL;
    if (p && p->dsink)
        *p->dsink = NULL;
    if (p && (p->cache_seqlens || p->k_new || p->v_new || p->block_table))
        return ft_fail(FT_ERR_UNSUPPORTED, func, 7,
                       "a KV cache call (cache_seqlens, k_new, v_new, block_table) is "
                       "decoding and has no backward; differentiate the full-sequence call");
    if ((q && ft_check_tensor(func, 2, q) == FT_OK && q->dtype == FT_FP8_E4M3) || descaled(p))
        return ft_fail(FT_ERR_UNSUPPORTED, func, 2,
                       "fp8_e4m3 attention (descale_q, descale_k, descale_v) is forward only, "
                       "as FlashAttention-3's: no backward");
    /* the mods' gradients' slots: empty until the end */
    const int ngrad = p && p->mods && p->mod_grads ? ft_attn_mods_tensors(p->mods) : 0;
    for (int t = 0; t < ngrad; t++)
        p->mod_grads[t] = NULL;
    ft_attn_shape s;
    int fault = 0;
    ft_status st = check_qkv(func, 2, 7, q, k, v, p, &s);
    s.mod_fault = &fault;
    if (st == FT_OK)
        st = check_backward_inputs(func, &s, dout, q, out, lse);
    if (st == FT_OK && p->impl == FT_ATTN_CUDNN && p->deterministic)
        st = ft_fail(FT_ERR_UNSUPPORTED, func, 7,
                     "deterministic: cuDNN's backward (impl 'cudnn') sums dQ with atomics, "
                     "not bitwise reproducibly; use impl 'flash'");
    ft_tensor *g[3] = {NULL, NULL, NULL}, *ds = NULL;
    const ft_tensor *like[3] = {q, k, v};
    /* the mods' float tensors' gradients: on CUDA f32 sums on the device
     * (atomics), on the cpu f64 running sums; then tensors */
    ft_tensor *gdev[FT_MOD_MAX_TENSORS] = {NULL};
    float *gdev_ptr[FT_MOD_MAX_TENSORS] = {NULL};
    double *gacc[FT_MOD_MAX_TENSORS] = {NULL};
    int gacc_n = 0;
    if (st == FT_OK && ngrad > 0 && q->device.type == FT_CUDA) {
        if (p->deterministic)
            st = ft_fail(FT_ERR_UNSUPPORTED, func, 7,
                         "deterministic: on CUDA the gradients of the float tensors mods read "
                         "are summed with atomics (not bitwise reproducible); leave mod_grads "
                         "NULL (Lua: mod_grads = false) or run on the cpu");
        for (int t = 0; st == FT_OK && t < ngrad; t++) {
            const ft_tensor *x = s.mod_tensors[t];
            if (!ft_dtype_is_float(x->dtype))
                continue;
            st = ft_empty_named(&gdev[t], x->ndim, x->shape, FT_F32, q->device, func);
            if (st == FT_OK)
                st = ft_fill(gdev[t], 0.0);
            if (st == FT_OK)
                gdev_ptr[t] = (float *)gdev[t]->data;
        }
        if (st == FT_OK && ft_attn_mods_cuda_has_grad(s.mods, s.mod_tensors))
            s.mod_gdev = gdev_ptr; /* else every gradient is 0 */
    } else if (st == FT_OK && ngrad > 0) {
        gacc_n = ngrad;
        for (int t = 0; t < gacc_n; t++) {
            if (ft_dtype_is_float(s.mod_tensors[t]->dtype) && ft_numel(s.mod_tensors[t]) > 0 &&
                !(gacc[t] = calloc((size_t)ft_numel(s.mod_tensors[t]), sizeof(double))))
                st = ft_fail(FT_ERR_NOMEM, func, 0, "out of memory for the mods' gradients");
        }
        s.mod_gacc = gacc;
    }
    for (int i = 0; i < 3 && st == FT_OK; i++)
        st = ft_empty_named(&g[i], like[i]->ndim, like[i]->shape, q->dtype, q->device, func);
    const int one = st == FT_OK && one_launch(p->impl, &s, q);
    ft_tensor *offs[2] = {NULL, NULL};
    if (one)
        st = device_offsets(p, q, &s, offs);
    if (st == FT_OK && (!s.cu_q || one))
        st = run_backward(p->impl, &s, dout, q, k, v, out, lse, g[0], g[1], g[2]);
    ft_tensor_free(offs[0]);
    ft_tensor_free(offs[1]);
    for (int64_t b = 0; st == FT_OK && s.cu_q && !one && b < s.B; b++) {
        const ft_attn_shape one = seq_shape(&s, b);
        const int64_t iq = s.cu_q[b], ik = s.cu_k[b];
        ft_tensor qb = seq_rows(q, iq, one.Nq), kb = seq_rows(k, ik, one.Nk),
                  vb = seq_rows(v, ik, one.Nk), ob = seq_rows(out, iq, one.Nq),
                  db = seq_rows(dout, iq, one.Nq), lb = seq_lse(lse, iq, one.Nq),
                  gq = seq_rows(g[0], iq, one.Nq), gk = seq_rows(g[1], ik, one.Nk),
                  gv = seq_rows(g[2], ik, one.Nk);
        if (q->device.type == FT_CUDA) { /* the CUDA kernels read LSE contiguous */
            ft_tensor *lc = NULL;
            st = ft_contiguous(&lc, &lb);
            if (st == FT_OK)
                st = run_backward(p->impl, &one, &db, &qb, &kb, &vb, &ob, lc, &gq, &gk, &gv);
            ft_tensor_free(lc);
        } else {
            st = run_backward(p->impl, &one, &db, &qb, &kb, &vb, &ob, &lb, &gq, &gk, &gv);
        }
    }
    if (st == FT_OK && s.sink && p->dsink)
        st = sink_grad(func, &s, dout, out, lse, &ds);
    if (st == FT_OK && gacc_n > 0)
        st = mod_grads_store(func, &s, gacc, p->mod_grads);
    for (int t = 0; t < gacc_n; t++)
        free(gacc[t]);
    for (int t = 0; t < ngrad; t++) { /* CUDA: the f32 sums in each tensor's dtype */
        if (st == FT_OK && gdev[t])
            st = ft_to(&p->mod_grads[t], gdev[t], s.mod_tensors[t]->dtype, q->device);
        ft_tensor_free(gdev[t]);
    }
    shape_free(&s);
    if (st == FT_OK && fault)
        st = mod_fault(func);
    if (st != FT_OK) {
        for (int i = 0; i < 3; i++)
            ft_tensor_free(g[i]);
        ft_tensor_free(ds);
        for (int t = 0; t < ngrad; t++) {
            ft_tensor_free(p->mod_grads[t]);
            p->mod_grads[t] = NULL;
        }
        return st;
    }
    *dq = g[0], *dk = g[1], *dv = g[2];
    if (p->dsink)
        *p->dsink = ds;
    return FT_OK;
}

ft_status ft_attention_dropout_mask(ft_tensor **out, int64_t B, int64_t H, int64_t Nq,
                                    int64_t Nk, const ft_attn_params *p, ft_device device)
{
    static const char func[] = "ft_attention_dropout_mask";
    if (!out)
        return ft_fail(FT_ERR_ARGUMENT, func, 0, "result pointer is NULL");
    *out = NULL;
    if (!p)
        return ft_fail(FT_ERR_ARGUMENT, func, 5, "params expected (ft_attn_params_init)");
    const int64_t shape[4] = {B, H, Nq, Nk};
    for (int i = 0; i < 4; i++)
        if (shape[i] < 0)
            return ft_fail(FT_ERR_ARGUMENT, func, i + 1, "sizes must be at least 0, got %lld",
                           (long long)shape[i]);
    if (Nq > INT32_MAX || Nk > INT32_MAX)
        return ft_fail(FT_ERR_UNSUPPORTED, func, Nq > INT32_MAX ? 3 : 4,
                       "seqlens above %d are not supported", INT32_MAX);
#ifndef FT_HAVE_CUDA
    if (device.type == FT_CUDA)
        return ft_fail(FT_ERR_UNSUPPORTED, func, 6, "this flashtile has no CUDA backend");
#endif
    ft_attn_mod mod;
    memset(&mod, 0, sizeof mod);
    FT_TRY(check_dropout(func, 5, p, B, H, &mod));
    if (!mod.dropout)
        return ft_fail(FT_ERR_ARGUMENT, func, 5, "dropout_p must be in (0, 1) for a mask, got %g",
                       p->dropout_p);
    ft_tensor *t = NULL;
    FT_TRY(ft_empty_named(&t, 4, shape, FT_F32, device, func));
#ifdef FT_HAVE_CUDA
    if (device.type == FT_CUDA) {
        ft_status cst = ft_attention_dropout_mask_cuda(t, &mod);
        if (cst != FT_OK) {
            ft_tensor_free(t);
            return cst;
        }
        *out = t;
        return FT_OK;
    }
#endif
    ft_status st = ft_check_walk(func, 1, ft_numel(t), "elements");
    float *m = t->data;
    for (int64_t b = 0; st == FT_OK && b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < Nq; i++)
                for (int64_t j = 0; j < Nk; j++)
                    *m++ = ft_mod_keep(&mod, b, H, h, i, j) ? (float)mod.drop_scale : 0.0f;
    if (st != FT_OK) {
        ft_tensor_free(t);
        return st;
    }
    *out = t;
    return FT_OK;
}
