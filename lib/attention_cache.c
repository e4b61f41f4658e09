/*
 * attention_cache.c - attention over a KV cache (decoding): the caches
 * hold each sequence's keys and values so far, cache_seqlens how many;
 * the call writes k_new and v_new in after them (in place) and attends
 * over the first cache_seqlens[b] + Nnew keys of each sequence, as
 * FlashAttention's flash_attn_with_kvcache does. Rows of a cache past a
 * sequence's keys are never read (they may hold anything, NaN included).
 *
 *   q [B, Nq, H, d]; k_cache, v_cache [B, Ncache, Hk, d], or page pools
 *   [pages, page_size, Hk, d] with block_table i32 [B, max_pages] (page
 *   numbers from block_table_base: 0 in C, 1 from Lua); cache_seqlens i32 [B];
 *   k_new, v_new [B, Nnew, Hk, d]; out [B, Nq, H, d], lse [B, H, Nq].
 *
 * Each sequence runs as its own call of ft_attention_forward on views of
 * its keys (a paged sequence's pages gathered first), so every check,
 * variant and implementation of that function applies to it.
 * Check: spec/kvcache_spec.lua against full attention in f64.
 */
#include "internal.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef FT_HAVE_CUDA
#include "kernels.h"
#endif

/* Rows r0 .. r0 + n - 1 of batch entry b of a [B, N, heads, d] tensor, as
 * [1, n, heads, d] (a view, no reference taken). */
static ft_tensor entry_rows(const ft_tensor *t, int64_t b, int64_t r0, int64_t n)
{
    ft_tensor v = *t;
    v.shape[0] = 1;
    v.shape[1] = n;
    v.data = ft_elem_ptr(t, b * t->stride[0] + r0 * t->stride[1]);
    return v;
}

/* An i32 tensor of the given shape, read to the host as int64. */
static ft_status read_ints(const char *func, int ap, const char *name, const ft_tensor *t,
                           int ndim, const int64_t *shape, int64_t **out)
{
    char sa[64], sb[64];
    FT_TRY(ft_check_tensor(func, ap, t));
    int ok = t->dtype == FT_I32 && t->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++)
        ok = t->shape[i] == shape[i];
    if (!ok)
        return ft_fail(FT_ERR_ARGUMENT, func, ap, "%s must be an i32 tensor %s, got %s %s",
                       name, ft_format_shape(sa, sizeof sa, ndim, shape),
                       ft_dtype_name(t->dtype), ft_format_shape(sb, sizeof sb, t->ndim, t->shape));
    int64_t n = 0;
    return ft_read_i32(func, ap, name, t, out, &n);
}

/* A cache, page pool or new rows: 4-d, q's dtype and device, heads of
 * q's head_dim (kv_heads of them unless kv_heads < 0). */
static ft_status check_rows(const char *func, int ap, const char *name, const ft_tensor *t,
                            const ft_tensor *q, int64_t kv_heads)
{
    char sa[64];
    FT_TRY(ft_check_tensor(func, ap, t));
    FT_TRY(ft_check_device(func, ap, q, t));
    if (t->ndim != 4 || t->dtype != q->dtype || t->shape[3] != q->shape[3] ||
        (kv_heads >= 0 && t->shape[2] != kv_heads))
        return ft_fail(FT_ERR_ARGUMENT, func, ap,
                       "%s must be a 4-d %s tensor [.., .., kv_heads, %lld]%s, got %s %s", name,
                       ft_dtype_name(q->dtype), (long long)q->shape[3],
                       kv_heads >= 0 ? " with k_cache's kv_heads" : "", ft_dtype_name(t->dtype),
                       ft_format_shape(sa, sizeof sa, t->ndim, t->shape));
    return FT_OK;
}

typedef struct {
    int64_t B, capacity, page_size; /* page_size 0: not paged */
    int64_t Nnew, max_pages;
    int64_t *lens, *table;          /* host copies */
    int64_t longest;                /* the longest sequence after the append */
    int base;                       /* the index base of the messages */
} cache_call;

static int cmp_i64(const void *a, const void *b)
{
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

/* Row r of sequence b's keys: its batch entry (or page) and row there. */
static void locate(const cache_call *c, int64_t b, int64_t r, int64_t *entry, int64_t *row)
{
    if (c->page_size) {
        *entry = c->table[b * c->max_pages + r / c->page_size];
        *row = r % c->page_size;
    } else {
        *entry = b;
        *row = r;
    }
}

/* Whether the rows a paged call appends (lens[b] .. lens[b] + Nnew - 1 of
 * each sequence) are all different rows of the pool: a page shared by two
 * sequences, or listed twice in one, would take two writes. */
static ft_status check_writes_once(const char *func, const cache_call *c)
{
    /* pairs (pool row, sequence), sorted by the pool row */
    int64_t n = 0, *slot = malloc((size_t)(c->B * c->Nnew * 2 + 1) * sizeof *slot);
    if (!slot)
        return ft_fail(FT_ERR_NOMEM, func, 0, "out of memory");
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t r = c->lens[b]; r < c->lens[b] + c->Nnew; r++, n++) {
            int64_t page, row;
            locate(c, b, r, &page, &row);
            slot[2 * n] = page * c->page_size + row, slot[2 * n + 1] = b;
        }
    qsort(slot, (size_t)n, 2 * sizeof *slot, cmp_i64); /* by the first of each pair */
    ft_status st = FT_OK;
    for (int64_t i = 1; st == FT_OK && i < n; i++)
        if (slot[2 * i] == slot[2 * (i - 1)])
            st = ft_fail(FT_ERR_ARGUMENT, func, 4,
                         "block_table: row %lld of page %lld would take two of the new keys "
                         "(sequences %lld and %lld): a page the new keys go into must belong to "
                         "one sequence, once",
                         (long long)(slot[2 * i] % c->page_size + c->base),
                         (long long)(slot[2 * i] / c->page_size + c->base),
                         (long long)(slot[2 * (i - 1) + 1] + c->base),
                         (long long)(slot[2 * i + 1] + c->base));
    free(slot);
    return st;
}

/* Writes new[b] into the cache after sequence b's keys, one piece per
 * page it falls in. */
static ft_status append(const cache_call *c, const ft_tensor *cache, const ft_tensor *new)
{
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t r = 0; r < c->Nnew;) {
            int64_t entry, row;
            locate(c, b, c->lens[b] + r, &entry, &row);
            const int64_t room = c->page_size ? c->page_size - row : c->Nnew - r;
            const int64_t n = room < c->Nnew - r ? room : c->Nnew - r;
            ft_tensor dst = entry_rows(cache, entry, row, n), src = entry_rows(new, b, r, n);
            FT_TRY(ft_copy(&dst, &src));
            r += n;
        }
    return FT_OK;
}

/* Sequence b's first n keys of a cache as [1, n, Hk, d]: a view, or (paged)
 * its pages gathered into *tmp. */
static ft_status sequence_keys(const cache_call *c, const ft_tensor *cache,
                               const ft_tensor *table, int64_t b, int64_t n, ft_tensor *out,
                               ft_tensor **tmp)
{
    if (!c->page_size) {
        *out = entry_rows(cache, b, 0, n);
        return FT_OK;
    }
    const int64_t pages = (n + c->page_size - 1) / c->page_size;
    ft_tensor idx = *table; /* row b, its first pages entries */
    idx.ndim = 1;
    idx.shape[0] = pages;
    idx.stride[0] = table->stride[1];
    idx.data = ft_elem_ptr(table, b * table->stride[0]);
    ft_tensor *g = NULL;
    FT_TRY(ft_index_select(&g, cache, 0, &idx));
    /* [pages, page_size, Hk, d], contiguous: [1, pages * page_size, Hk, d] */
    *out = *g;
    out->shape[0] = 1;
    out->shape[1] = n;
    out->stride[0] = pages * c->page_size * g->stride[1];
    *tmp = g;
    return FT_OK;
}

/* FT_NO_DECODE set (not empty, not "0"): the decoding paths stay out, for
 * comparison. */
static int decode_off(void)
{
    return ft_switch("FT_NO_DECODE") == 1;
}

/* Whether attention_decode_cpu.c takes the call: the cpu, f32 or f64,
 * the last dims contiguous, impl auto or tiled, causal or not and no other
 * variant (the calls sequence by sequence take those), FT_NO_DECODE unset. */
static int cpu_decode_takes(const ft_tensor *q, const ft_tensor *k, const ft_tensor *v,
                            const ft_tensor *out, const ft_attn_params *p)
{
    return q->device.type == FT_CPU && (q->dtype == FT_F32 || q->dtype == FT_F64) &&
           q->stride[3] == 1 && k->stride[3] == 1 && v->stride[3] == 1 && out->stride[3] == 1 &&
           (p->impl == FT_ATTN_AUTO || p->impl == FT_ATTN_TILED) && p->window_left < 0 &&
           p->window_right < 0 && p->softcap == 0 && !p->alibi_slopes && !p->sink &&
           !decode_off();
}

#ifdef FT_HAVE_CUDA
/* Whether kernels/attention/decode.cu takes the call: CUDA, f16 or bf16,
 * head_dim a multiple of 8 up to 256, every row on 16 bytes, lengths and
 * pages that fit 32 bits, causal or not and no other variant (the
 * per-sequence calls take those), impl auto or flash, FT_NO_DECODE unset. */
static int aligned16(const ft_tensor *t)
{
    if (!t)
        return 1;
    if (((uintptr_t)t->data & 15) != 0 || t->stride[3] != 1)
        return 0;
    for (int i = 0; i < 3; i++)
        if (t->shape[i] > 1 && (t->stride[i] * 2) % 16 != 0)
            return 0;
    return 1;
}

static int decode_kernel_takes(const ft_tensor *q, const ft_tensor *k, const ft_tensor *v,
                               const cache_call *c, const ft_attn_params *p)
{
    const int64_t d = q->shape[3];
    return q->device.type == FT_CUDA && (q->dtype == FT_F16 || q->dtype == FT_BF16) &&
           d % 8 == 0 && d <= 256 && (p->impl == FT_ATTN_AUTO || p->impl == FT_ATTN_FLASH) &&
           p->window_left < 0 && p->window_right < 0 && p->softcap == 0 && !p->alibi_slopes &&
           !p->sink && aligned16(q) && aligned16(k) && aligned16(v) && aligned16(p->k_new) &&
           aligned16(p->v_new) && c->capacity < INT32_MAX / 2 && k->shape[0] < INT32_MAX &&
           c->B * (c->max_pages > 0 ? c->max_pages : 1) < INT32_MAX && !decode_off();
}

/* The split-KV kernel's call: lengths and pages go to the device in one
 * queued copy (no wait on the device), the partial results get room, and
 * the kernel appends and attends. */
static ft_status decode_on_device(const cache_call *c, const ft_tensor *q, const ft_tensor *k,
                                  const ft_tensor *v, const ft_attn_params *p, ft_tensor *o,
                                  ft_tensor *l)
{
    static const char func[] = "ft_attention_forward";
    /* q's device current: the split count asks it for its occupancy */
    FT_TRY(ft_cuda_use_device(q->device.index, func));
    const int64_t B = c->B, H = q->shape[2], Nq = q->shape[1], d = q->shape[3];
    const int64_t ntable = c->page_size ? B * c->max_pages : 0;
    const int inline_lens = !ntable && B <= FT_DECODE_INLINE; /* nothing to upload */
    const int64_t nints = inline_lens ? 0 : B + ntable;
    const int64_t longest = c->longest;
    const int splits = ft_attention_decode_splits_cuda(q, k->shape[2], longest, (int)p->num_splits);
    int32_t *h = malloc((size_t)(nints > 0 ? nints : 1) * sizeof *h);
    if (!h)
        return ft_fail(FT_ERR_NOMEM, func, 0, "out of memory");
    for (int64_t b = 0; b < B && nints > 0; b++)
        h[b] = (int32_t)c->lens[b];
    for (int64_t i = 0; i < ntable; i++)
        h[B + i] = (int32_t)c->table[i];
    void *ints = NULL, *po = NULL, *pl = NULL;
    ft_status st = FT_OK;
    if (nints > 0)
        st = ft_device_alloc(&ints, (size_t)nints * sizeof *h, q->device, func);
    if (st == FT_OK && nints > 0)
        st = ft_device_upload(ints, h, (size_t)nints * sizeof *h, q->device, func);
    free(h);
    const size_t rows = (size_t)splits * (size_t)(B * H * Nq);
    if (st == FT_OK && splits > 1)
        st = ft_device_alloc(&po, rows * (size_t)d * sizeof(float), q->device, func);
    if (st == FT_OK && splits > 1)
        st = ft_device_alloc(&pl, rows * sizeof(float), q->device, func);
    const ft_decode_cuda a = {q, k, v, p->k_new, p->v_new, (const int32_t *)ints, c->lens,
                              ntable ? (const int32_t *)ints + B : NULL, c->max_pages,
                              c->page_size, longest, p->causal, splits,
                              p->scale != 0 ? p->scale : 1.0 / sqrt((double)d),
                              (float *)po, (float *)pl, o, l};
    if (st == FT_OK)
        st = ft_attention_decode_cuda(&a);
    ft_device_free(ints, q->device);
    ft_device_free(po, q->device);
    ft_device_free(pl, q->device);
    return st;
}
#endif

#ifdef FT_HAVE_CUDA
int ft_attention_decode_plain(const ft_attn_shape *s, const ft_tensor *q, const ft_tensor *k,
                              const ft_tensor *v, ft_tensor *out, ft_tensor *lse, ft_status *st)
{
    /* a few query rows against many keys, no variant but causal: at most 16
     * rows a kv head (GQA packs a group's rows), where the split-KV kernel
     * measured faster than the flash kernels (H200, bf16, d 128: 7.7x at
     * 1 x 32768 keys, GQA 32/8; 0.93x at 16 rows x 4 heads a group, 0.37x at
     * 64 rows without GQA; bench/h200-decode.md) */
    const int shape_ok = s->B >= 1 && s->H >= 1 && s->Hk >= 1 && s->Nq >= 1 &&
                         s->Nq * (s->H / s->Hk) <= 16 && s->Nk >= 512 && s->Nk >= 16 * s->Nq &&
                         !s->cu_q;
    const int plain = ft_attn_plain_or_causal(s);
    /* the same call as a cache of Nk valid rows and nothing to append */
    cache_call c = {0};
    c.B = s->B;
    c.capacity = s->Nk;
    c.longest = s->Nk; /* the splits are cut from it */
    ft_attn_params p;
    ft_attn_params_init(&p);
    p.causal = s->causal;
    p.scale = s->scale;
    if (!shape_ok || !plain || !decode_kernel_takes(q, k, v, &c, &p) || !aligned16(out) ||
        lse->dtype != FT_F32)
        return 0;
    if (!(c.lens = malloc((size_t)c.B * sizeof *c.lens))) {
        *st = ft_fail(FT_ERR_NOMEM, "ft_attention_forward", 0, "out of memory");
        return 1;
    }
    for (int64_t b = 0; b < c.B; b++)
        c.lens[b] = s->Nk;
    *st = decode_on_device(&c, q, k, v, &p, out, lse);
    free(c.lens);
    return 1;
}
#endif

ft_status ft_attention_cache_forward(ft_tensor **out, ft_tensor **lse, const ft_tensor *q,
                                     const ft_tensor *k, const ft_tensor *v,
                                     const ft_attn_params *p)
{
    static const char func[] = "ft_attention_forward";
    char sa[64];
    FT_TRY(ft_check_tensor(func, 1, q));
    if (q->ndim != 4)
        return ft_fail(FT_ERR_ARGUMENT, func, 1, "q must be [batch, seqlen, heads, head_dim] "
                       "with a KV cache, got %d dims", q->ndim);
    /* before the new rows go in: a call the attention itself refuses
     * (integer or fp8_e4m3 tensors) must leave the caches as they were */
    if (!ft_dtype_is_float(q->dtype))
        return ft_fail(FT_ERR_ARGUMENT, func, 1, "q must be f64, f32, f16 or bf16, got %s",
                       ft_dtype_name(q->dtype));
    if (p->cu_seqlens_q || p->cu_seqlens_k)
        return ft_fail(FT_ERR_ARGUMENT, func, 4, "a KV cache call takes cache_seqlens, not "
                       "cu_seqlens_q / cu_seqlens_k");
    if (p->dropout_p != 0 || p->mods || p->block_mask)
        return ft_fail(FT_ERR_UNSUPPORTED, func, 4, "a KV cache call (decoding) takes no %s",
                       p->dropout_p != 0 ? "dropout" : "mods");
    if (!p->k_new != !p->v_new)
        return ft_fail(FT_ERR_ARGUMENT, func, 4, "k_new and v_new go together: give both or "
                       "neither");
    const int paged = p->block_table != NULL;
    FT_TRY(check_rows(func, 2, "k_cache", k, q, -1));
    FT_TRY(check_rows(func, 3, "v_cache", v, q, k->shape[2]));
    if (k->shape[0] != v->shape[0] || k->shape[1] != v->shape[1])
        return ft_fail(FT_ERR_ARGUMENT, func, 3, "v_cache %s must have k_cache's shape",
                       ft_format_shape(sa, sizeof sa, v->ndim, v->shape));
    cache_call c = {0};
    c.B = q->shape[0];
    if (!paged && k->shape[0] != c.B)
        return ft_fail(FT_ERR_ARGUMENT, func, 2, "k_cache has %lld batch entries, q %lld "
                       "(a page pool needs block_table)", (long long)k->shape[0],
                       (long long)c.B);
    if (paged) {
        c.page_size = k->shape[1];
        if (c.page_size < 1)
            return ft_fail(FT_ERR_ARGUMENT, func, 2, "pages of size 0");
        FT_TRY(ft_check_tensor(func, 4, p->block_table));
        if (p->block_table->device.type != FT_CPU)
            FT_TRY(ft_check_device(func, 4, q, p->block_table));
        if (p->block_table->ndim != 2 || p->block_table->shape[0] != c.B)
            return ft_fail(FT_ERR_ARGUMENT, func, 4, "block_table must be [batch, max_pages], "
                           "got %s", ft_format_shape(sa, sizeof sa, p->block_table->ndim,
                                                     p->block_table->shape));
        c.max_pages = p->block_table->shape[1];
        c.capacity = c.max_pages * c.page_size;
    } else {
        c.capacity = k->shape[1];
    }
    if (p->k_new) {
        FT_TRY(check_rows(func, 4, "k_new", p->k_new, q, k->shape[2]));
        FT_TRY(check_rows(func, 4, "v_new", p->v_new, q, k->shape[2]));
        c.Nnew = p->k_new->shape[1];
        for (int i = 0; i < 4; i++)
            if (p->v_new->shape[i] != p->k_new->shape[i] || (i == 0 && p->k_new->shape[0] != c.B))
                return ft_fail(FT_ERR_ARGUMENT, func, 4, "k_new and v_new must both be "
                               "[batch, new, kv_heads, head_dim] with q's batch, got %s",
                               ft_format_shape(sa, sizeof sa, 4, p->v_new->shape));
    }
    const int64_t lshape[1] = {c.B}, tshape[2] = {c.B, c.max_pages};
    ft_status st = read_ints(func, 4, "cache_seqlens", p->cache_seqlens, 1, lshape, &c.lens);
    if (st == FT_OK && paged)
        st = read_ints(func, 4, "block_table", p->block_table, 2, tshape, &c.table);
    const int base = p->block_table_base;
    c.base = base;
    for (int64_t i = 0; st == FT_OK && paged && i < c.B * c.max_pages; i++)
        c.table[i] -= base; /* 0-based from here on */
    for (int64_t b = 0; st == FT_OK && b < c.B; b++) {
        const int64_t n = c.lens[b] + c.Nnew;
        c.longest = n > c.longest ? n : c.longest;
        if (c.lens[b] < 0 || n > c.capacity)
            st = ft_fail(FT_ERR_ARGUMENT, func, 4,
                         "cache_seqlens[%lld] = %lld%s: the cache holds %lld rows",
                         (long long)(b + base),
                         (long long)c.lens[b],
                         c.lens[b] < 0 ? " is negative" : " plus the new keys does not fit",
                         (long long)c.capacity);
        for (int64_t i = 0; st == FT_OK && paged && i < (n + c.page_size - 1) / c.page_size; i++) {
            const int64_t pg = c.table[b * c.max_pages + i];
            if (pg < 0 || pg >= k->shape[0])
                st = ft_fail(FT_ERR_ARGUMENT, func, 4,
                             "block_table[%lld][%lld] = %lld is not a page (pages %d to %lld)",
                             (long long)(b + base), (long long)(i + base),
                             (long long)(pg + base), base, (long long)k->shape[0] - 1 + base);
        }
    }
    /* the attention's own checks (heads, head_dim, scale, variants, impl)
     * before anything is written, so a refused call leaves the caches as
     * they were; and no cache row written twice (two sequences appending
     * into one page) */
    if (st == FT_OK)
        st = ft_attention_check_like(func, q, k, v, c.longest, p);
    if (st == FT_OK && paged && c.Nnew > 0)
        st = check_writes_once(func, &c);
    int on_device = 0; /* the split-KV kernel, which appends as it reads */
#ifdef FT_HAVE_CUDA
    on_device = st == FT_OK && decode_kernel_takes(q, k, v, &c, p);
#endif
    /* the new keys and values in place, then each sequence's attention */
    if (st == FT_OK && c.Nnew > 0 && !on_device)
        st = append(&c, k, p->k_new);
    if (st == FT_OK && c.Nnew > 0 && !on_device)
        st = append(&c, v, p->v_new);
    ft_tensor *o = NULL, *l = NULL;
    const int64_t H = q->shape[2], Nq = q->shape[1];
    const int64_t lse_shape[3] = {c.B, H, Nq};
    if (st == FT_OK)
        st = ft_empty_named(&o, 4, q->shape, q->dtype, q->device, func);
    if (st == FT_OK)
        st = ft_empty_named(&l, 3, lse_shape, q->dtype == FT_F64 ? FT_F64 : FT_F32, q->device,
                            func);
    /* the gathers' index: the table 0-based, on the pool's device */
    ft_tensor *table0 = NULL;
    if (st == FT_OK && paged && !on_device &&
        p->block_table->device.type != k->device.type) { /* a CPU table for a CUDA pool */
        ft_tensor host = *p->block_table;
        host.dtype = FT_I64;
        host.data = c.table; /* 0-based already */
        host.stride[0] = c.max_pages, host.stride[1] = 1;
        st = ft_to(&table0, &host, FT_I64, k->device);
    } else if (st == FT_OK && paged && !on_device && base != 0) {
        st = ft_binary_scalar(&table0, FT_SUB, p->block_table, (double)base, 0);
    }
    const ft_tensor *table = table0 ? table0 : p->block_table;
    int done = 0;
    if (st == FT_OK && cpu_decode_takes(q, k, v, o, p)) {
        int64_t *n = malloc((size_t)c.B * sizeof *n);
        if (!n)
            st = ft_fail(FT_ERR_NOMEM, func, 0, "out of memory");
        for (int64_t b = 0; n && b < c.B; b++)
            n[b] = c.lens[b] + c.Nnew;
        const ft_decode_cpu a = {q, k, v, o, l, n, paged ? c.table : NULL, c.max_pages,
                                 c.page_size, p->causal,
                                 p->scale != 0 ? p->scale : 1.0 / sqrt((double)q->shape[3])};
        if (st == FT_OK)
            st = ft_attention_decode_cpu(&a);
        free(n);
        done = 1;
    }
#ifdef FT_HAVE_CUDA
    if (st == FT_OK && on_device) {
        st = decode_on_device(&c, q, k, v, p, o, l);
        done = 1;
    }
#endif
    ft_attn_params one = *p;
    one.cache_seqlens = one.k_new = one.v_new = one.block_table = NULL;
    for (int64_t b = 0; st == FT_OK && !done && b < c.B; b++) {
        const int64_t n = c.lens[b] + c.Nnew;
        ft_tensor kb, vb, *kt = NULL, *vt = NULL, *ob = NULL, *lb = NULL;
        ft_tensor qb = entry_rows(q, b, 0, Nq), alibi;
        if (p->alibi_slopes && p->alibi_slopes->ndim == 2 && p->alibi_slopes->shape[0] == c.B) {
            alibi = *p->alibi_slopes; /* [B, H]: row b, as [1, H] */
            alibi.shape[0] = 1;
            alibi.data = ft_elem_ptr(p->alibi_slopes, b * p->alibi_slopes->stride[0]);
            one.alibi_slopes = &alibi;
        }
        st = sequence_keys(&c, k, table, b, n, &kb, &kt);
        if (st == FT_OK)
            st = sequence_keys(&c, v, table, b, n, &vb, &vt);
        if (st == FT_OK)
            st = ft_attention_forward(&ob, &lb, &qb, &kb, &vb, &one);
        ft_tensor od = entry_rows(o, b, 0, Nq), ld = *l;
        ld.shape[0] = 1;
        ld.data = ft_elem_ptr(l, b * l->stride[0]);
        if (st == FT_OK)
            st = ft_copy(&od, ob);
        if (st == FT_OK)
            st = ft_copy(&ld, lb);
        ft_tensor_free(kt);
        ft_tensor_free(vt);
        ft_tensor_free(ob);
        ft_tensor_free(lb);
    }
    ft_tensor_free(table0);
    free(c.lens);
    free(c.table);
    if (st != FT_OK) {
        ft_tensor_free(o);
        ft_tensor_free(l);
        return st;
    }
    *out = o;
    *lse = l;
    return FT_OK;
}
