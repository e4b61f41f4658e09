/*
 * attention_decode_cpu.c - attention over a KV cache on the cpu, for
 * decoding: few query rows per sequence against many keys. The work is
 * split into tasks of (sequence, a chunk of keys, a group of kv heads:
 * all of them unless that leaves few tasks); a task walks its keys one by
 * one across its kv heads (a key's rows of all heads lie together in the
 * cache, so the reads are sequential) and runs the query heads of each kv
 * head together (GQA: every key and value row is read
 * once for all of them) through an online softmax over blocks of keys;
 * the chunks' partial results are merged by their LSE in chunk order. The
 * chunks come from the shape alone, so the result does not depend on the
 * thread count, bit for bit. A key's rows are asked for DEC_AHEAD keys
 * ahead, and values are taken four keys a step (each O row read and
 * written once per four).
 *
 * f32 and f64 (q, k, v, out of one dtype; the last dim contiguous); causal
 * or not, no other variant (attention_cache.c runs those sequence by
 * sequence). Check: spec/kvcache_spec.lua, against the tiled path.
 */
#include "internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define DEC_CHUNK 512 /* keys a task at most; fewer when that leaves under 32 a sequence */
#define DEC_BLOCK 64  /* keys an online-softmax step */
#define DEC_LANES 16  /* running sums of a dot product */
#define DEC_AHEAD 4   /* keys whose rows are asked for ahead of use (measured on
                       * a 2-core AVX-512 VM, B 1 x 32768 keys, 8 kv heads, f32:
                       * 2 keys ahead 0.65-0.72 of a copy's rate, 4: 0.76, 8:
                       * 0.52-0.60, none 0.54-0.57) */

/* Asks for the cache lines of `bytes` at p (the loop below also waits
 * on the memory without it: the work per key, 32 dot products and their
 * exponentials, keeps the core from running far enough ahead). */
static inline void prefetch_row(const char *p, size_t bytes)
{
#if defined(__GNUC__)
    for (size_t o = 0; o < bytes; o += 64)
        __builtin_prefetch(p + o, 0, 1);
#else
    (void)p, (void)bytes;
#endif
}

/* Row j of sequence b's keys (or values), head hk. */
static const char *key_row(const ft_decode_cpu *a, const ft_tensor *t, int64_t b, int64_t hk,
                           int64_t j)
{
    int64_t entry = b, row = j;
    if (a->table) {
        entry = a->table[b * a->max_pages + j / a->page_size];
        row = j % a->page_size;
    }
    return (const char *)ft_elem_ptr(t, entry * t->stride[0] + row * t->stride[1] +
                                            hk * t->stride[2]);
}

#define DEC_DEFINE(SFX, T, EXP, LOG)                                                           \
    /* One task: kv heads [h0, h1) of sequence b over keys [k0, k1), each with                \
     * the rows (query i, head g) of its group, key by key across the heads                   \
     * (a key's rows of all heads lie together, so the reads are sequential                   \
     * and the hardware's prefetchers follow them); writes each row's                         \
     * unnormalised O, its max m and sum l (scaled scores, natural units)                     \
     * into part (kv head hk's at hk per). */                                                 \
    FT_ROW_CLONES static void task##SFX(const ft_decode_cpu *a, int64_t b, int64_t h0,        \
                                        int64_t h1, int64_t k0, int64_t k1, T *part,          \
                                        T *scratch)                                           \
    {                                                                                         \
        const ft_tensor *q = a->q;                                                            \
        const int64_t Nq = q->shape[1], H = q->shape[2], d = q->shape[3];                     \
        const int64_t Hk = a->k->shape[2], G = H / Hk, M = Nq * G, len = a->lens[b];          \
        const int64_t HM = (h1 - h0) * M, per = M * (d + 2);                                  \
        const T scale = (T)a->scale;                                                          \
        T *s = scratch;                                                                       \
        const T **qr = (const T **)(s + HM * DEC_BLOCK);                                      \
        for (int64_t x = 0; x < HM; x++) { /* x = (hk - h0) M + r */                          \
            const int64_t hk = h0 + x / M, r = x % M;                                         \
            T *o = part + hk * per;                                                           \
            qr[x] = (const T *)ft_elem_ptr(q, b * q->stride[0] + (r / G) * q->stride[1] +     \
                                                  (hk * G + r % G) * q->stride[2]);           \
            o[M * d + r] = -INFINITY;                                                         \
            o[M * d + M + r] = 0;                                                             \
            memset(o + r * d, 0, (size_t)d * sizeof(T));                                      \
        }                                                                                     \
        for (int64_t j0 = k0; j0 < k1; j0 += DEC_BLOCK) {                                     \
            const int64_t nb = k1 - j0 < DEC_BLOCK ? k1 - j0 : DEC_BLOCK;                     \
            for (int64_t jj = 0; jj < nb; jj++)                                               \
                for (int64_t hk = h0; hk < h1; hk++) {                                        \
                    const T *kr = (const T *)key_row(a, a->k, b, hk, j0 + jj);                \
                    if (j0 + jj + DEC_AHEAD < k1) { /* and its value rows */                  \
                        prefetch_row(key_row(a, a->k, b, hk, j0 + jj + DEC_AHEAD),            \
                                     (size_t)d * sizeof(T));                                  \
                        prefetch_row(key_row(a, a->v, b, hk, j0 + jj + DEC_AHEAD),            \
                                     (size_t)d * sizeof(T));                                  \
                    }                                                                         \
                    for (int64_t r = 0; r < M; r++) {                                         \
                        const T *qv = qr[(hk - h0) * M + r];                                  \
                        /* DEC_LANES running sums: a loop the compiler vectorises */          \
                        T lane[DEC_LANES] = {0}, dot = 0;                                     \
                        int64_t c = 0;                                                        \
                        for (; c + DEC_LANES <= d; c += DEC_LANES)                            \
                            for (int u = 0; u < DEC_LANES; u++)                               \
                                lane[u] += qv[c + u] * kr[c + u];                             \
                        for (; c < d; c++)                                                    \
                            dot += qv[c] * kr[c];                                             \
                        for (int u = 0; u < DEC_LANES; u++)                                   \
                            dot += lane[u];                                                   \
                        const int64_t last = a->causal ? len - Nq + r / G : len - 1;          \
                        s[((hk - h0) * M + r) * DEC_BLOCK + jj] =                             \
                            j0 + jj <= last ? dot * scale : (T)-INFINITY;                     \
                    }                                                                         \
                }                                                                             \
            for (int64_t x = 0; x < HM; x++) {                                                \
                T *o = part + (h0 + x / M) * per, *m = o + M * d, *l = m + M;                 \
                const int64_t r = x % M;                                                      \
                T *sr = s + x * DEC_BLOCK, mx = m[r];                                         \
                for (int64_t jj = 0; jj < nb; jj++)                                           \
                    mx = FT_NAN_MAX(sr[jj], mx);                                              \
                const T use = mx == -INFINITY ? 0 : mx, alpha = EXP(m[r] - use);              \
                T sum = 0;                                                                    \
                for (int64_t jj = 0; jj < nb; jj++) {                                         \
                    sr[jj] = EXP(sr[jj] - use);                                               \
                    sum += sr[jj];                                                            \
                }                                                                             \
                l[r] = l[r] * alpha + sum;                                                    \
                m[r] = mx;                                                                    \
                if (alpha != 1)                                                               \
                    for (int64_t c = 0; c < d; c++)                                           \
                        o[r * d + c] *= alpha;                                                \
            }                                                                                 \
            /* four keys a step: each O row is read and written once per four */              \
            int64_t jj = 0;                                                                   \
            for (; jj + 4 <= nb; jj += 4)                                                     \
                for (int64_t hk = h0; hk < h1; hk++) {                                        \
                    const T *v0 = (const T *)key_row(a, a->v, b, hk, j0 + jj);                \
                    const T *v1 = (const T *)key_row(a, a->v, b, hk, j0 + jj + 1);            \
                    const T *v2 = (const T *)key_row(a, a->v, b, hk, j0 + jj + 2);            \
                    const T *v3 = (const T *)key_row(a, a->v, b, hk, j0 + jj + 3);            \
                    T *o = part + hk * per;                                                   \
                    for (int64_t r = 0; r < M; r++) {                                         \
                        const T *pr = s + ((hk - h0) * M + r) * DEC_BLOCK + jj;               \
                        const T p0 = pr[0], p1 = pr[1], p2 = pr[2], p3 = pr[3];               \
                        T *orow = o + r * d;                                                  \
                        for (int64_t c = 0; c < d; c++)                                       \
                            orow[c] += p0 * v0[c] + p1 * v1[c] + p2 * v2[c] + p3 * v3[c];     \
                    }                                                                         \
                }                                                                             \
            for (; jj < nb; jj++)                                                             \
                for (int64_t hk = h0; hk < h1; hk++) {                                        \
                    const T *vr = (const T *)key_row(a, a->v, b, hk, j0 + jj);                \
                    T *o = part + hk * per;                                                   \
                    for (int64_t r = 0; r < M; r++) {                                         \
                        const T pr = s[((hk - h0) * M + r) * DEC_BLOCK + jj];                 \
                        T *orow = o + r * d;                                                  \
                        for (int64_t c = 0; c < d; c++)                                       \
                            orow[c] += pr * vr[c];                                            \
                    }                                                                         \
                }                                                                             \
        }                                                                                     \
    }                                                                                         \
                                                                                              \
    /* The chunks of (b, hk) merged into out and lse, in chunk order. */                      \
    static void merge##SFX(const ft_decode_cpu *a, int64_t b, int64_t hk, int64_t chunks,     \
                           const T *parts)                                                    \
    {                                                                                         \
        const ft_tensor *q = a->q;                                                            \
        const int64_t Nq = q->shape[1], H = q->shape[2], d = q->shape[3];                     \
        const int64_t Hk = a->k->shape[2], G = H / Hk, M = Nq * G, per = M * (d + 2);         \
        const int64_t stride = Hk * per; /* from one chunk's part of head hk to the next's */ \
        for (int64_t r = 0; r < M; r++) {                                                     \
            const int64_t i = r / G, h = hk * G + r % G;                                      \
            T best = -INFINITY;                                                               \
            for (int64_t s = 0; s < chunks; s++) {                                            \
                const T *p = parts + s * stride;                                                 \
                const T lc = p[M * d + M + r]; /* 0: a chunk of no key; NaN: of a NaN */     \
                const T ls = lc != 0 ? p[M * d + r] + LOG(lc) : (T)-INFINITY;                 \
                best = FT_NAN_MAX(ls, best);                                                  \
            }                                                                                 \
            T total = 0;                                                                      \
            for (int64_t s = 0; s < chunks; s++) {                                            \
                const T *p = parts + s * stride;                                                 \
                if (p[M * d + M + r] != 0)                                                    \
                    total += EXP(p[M * d + r] + LOG(p[M * d + M + r]) - best);                \
            }                                                                                 \
            const T lse = total != 0 ? best + LOG(total) : (T)-INFINITY;                      \
            T *out = (T *)ft_elem_ptr(a->out, b * a->out->stride[0] + i * a->out->stride[1] + \
                                                  h * a->out->stride[2]);                     \
            for (int64_t c = 0; c < d; c++)                                                   \
                out[c] = 0;                                                                   \
            for (int64_t s = 0; s < chunks && total != 0; s++) {                              \
                const T *p = parts + s * stride;                                                 \
                if (p[M * d + M + r] == 0)                                                    \
                    continue;                                                                 \
                /* e^(m + log l - lse) / l: the chunk's share of the row */                   \
                const T w = EXP(p[M * d + r] - lse);                                          \
                for (int64_t c = 0; c < d; c++)                                               \
                    out[c] += w * p[r * d + c];                                               \
            }                                                                                 \
            if (a->lse->dtype == FT_F32)                                                      \
                ((float *)a->lse->data)[(b * H + h) * Nq + i] = (float)lse;                   \
            else                                                                              \
                ((double *)a->lse->data)[(b * H + h) * Nq + i] = (double)lse;                 \
        }                                                                                     \
    }

DEC_DEFINE(_f32, float, expf, logf)
DEC_DEFINE(_f64, double, exp, log)

ft_status ft_attention_decode_cpu(const ft_decode_cpu *a)
{
    static const char func[] = "ft_attention_forward";
    const ft_tensor *q = a->q;
    const int64_t B = q->shape[0], Nq = q->shape[1], H = q->shape[2], d = q->shape[3];
    const int64_t Hk = a->k->shape[2], M = Nq * (H / Hk);
    int64_t longest = 0;
    for (int64_t b = 0; b < B; b++)
        longest = a->lens[b] > longest ? a->lens[b] : longest;
    /* from the shape alone (the bits do not depend on the thread count):
     * 32 chunks of the longest sequence, in whole blocks, 1 to 8 blocks */
    int64_t chunk = (longest + 31) / 32;
    chunk = (chunk + DEC_BLOCK - 1) / DEC_BLOCK * DEC_BLOCK;
    chunk = chunk < DEC_BLOCK ? DEC_BLOCK : chunk > DEC_CHUNK ? DEC_CHUNK : chunk;
    const int64_t chunks = longest > 0 ? (longest + chunk - 1) / chunk : 1;
    const int f64 = q->dtype == FT_F64;
    const size_t es = f64 ? sizeof(double) : sizeof(float);
    /* and when that still leaves under 32 tasks, the kv heads in groups */
    const int64_t whole = B * chunks > 0 ? B * chunks : 1;
    int64_t groups = (32 + whole - 1) / whole;
    groups = groups > Hk ? Hk : groups;
    const int64_t per = M * (d + 2), tasks = B * chunks * groups;
    /* one thread for small work (FT_PARALLEL_MIN_WORK), never more than
     * the tasks */
    const double work = (double)B * (double)H * (double)Nq * (double)longest * (double)d;
    int nthreads = work < FT_PARALLEL_MIN_WORK ? 1 : ft_get_num_threads();
    nthreads = tasks < nthreads ? (int)(tasks > 0 ? tasks : 1) : nthreads;
    /* per task its partial rows of every kv head; per thread its scores and
     * row pointers */
    const size_t scratch =
        (size_t)(Hk * M) * DEC_BLOCK * es + (size_t)(Hk * M) * sizeof(void *) + 64;
    char *parts = malloc((size_t)(B * chunks) * (size_t)(Hk * per) * es);
    char *scr = malloc((size_t)nthreads * scratch);
    if (!parts || !scr) {
        free(parts);
        free(scr);
        return ft_fail(FT_ERR_NOMEM, func, 0, "out of memory for the decoding's %lld partial "
                       "results", (long long)tasks);
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t b = t / (chunks * groups), c = t / groups % chunks, g = t % groups;
        const int64_t h0 = g * Hk / groups, h1 = (g + 1) * Hk / groups;
        const int64_t k0 = c * chunk, k1 = a->lens[b] < k0 + chunk ? a->lens[b] : k0 + chunk;
#ifdef _OPENMP
        char *mine = scr + (size_t)omp_get_thread_num() * scratch;
#else
        char *mine = scr;
#endif
        char *part = parts + (size_t)(b * chunks + c) * (size_t)(Hk * per) * es;
        if (f64)
            task_f64(a, b, h0, h1, k0, k1 > k0 ? k1 : k0, (double *)part, (double *)mine);
        else
            task_f32(a, b, h0, h1, k0, k1 > k0 ? k1 : k0, (float *)part, (float *)mine);
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < B * Hk; t++) {
        const int64_t b = t / Hk, hk = t % Hk;
        const char *p = parts + (size_t)(b * chunks * Hk + hk) * (size_t)per * es;
        if (f64)
            merge_f64(a, b, hk, chunks, (const double *)p);
        else
            merge_f32(a, b, hk, chunks, (const float *)p);
    }
    free(parts);
    free(scr);
    return FT_OK;
}
