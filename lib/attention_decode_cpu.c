/*
 * attention_decode_cpu.c - attention over a KV cache on the cpu, for
 * decoding: few query rows per sequence against many keys. The work is
 * split into tasks of (sequence, kv head, a chunk of DEC_CHUNK keys); a
 * task runs the query heads of its kv head together (GQA: every key and
 * value row is read once for all of them) through an online softmax over
 * blocks of keys, and the chunks' partial results are merged by their LSE
 * in chunk order. The chunks come from the shape alone, so the result does
 * not depend on the thread count, bit for bit.
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

#define DEC_CHUNK 512 /* keys a task */
#define DEC_BLOCK 64  /* keys an online-softmax step */
#define DEC_LANES 16  /* running sums of a dot product */

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
    /* One task: rows (query i, head g) of kv head hk of sequence b, keys                     \
     * [k0, k1); writes each row's unnormalised O, its max m and sum l                        \
     * (scaled scores, natural units) into part. */                                           \
    FT_ROW_CLONES static void task##SFX(const ft_decode_cpu *a, int64_t b, int64_t hk, int64_t k0,          \
                          int64_t k1, T *part, T *scratch)                                    \
    {                                                                                         \
        const ft_tensor *q = a->q;                                                            \
        const int64_t Nq = q->shape[1], H = q->shape[2], d = q->shape[3];                     \
        const int64_t G = H / a->k->shape[2], M = Nq * G, len = a->lens[b];                   \
        const T scale = (T)a->scale;                                                          \
        T *s = scratch, *o = part, *m = part + M * d, *l = m + M;                             \
        const T **qr = (const T **)(s + M * DEC_BLOCK);                                       \
        for (int64_t r = 0; r < M; r++) {                                                     \
            qr[r] = (const T *)ft_elem_ptr(q, b * q->stride[0] + (r / G) * q->stride[1] +     \
                                                  (hk * G + r % G) * q->stride[2]);           \
            m[r] = -INFINITY;                                                                 \
            l[r] = 0;                                                                         \
            memset(o + r * d, 0, (size_t)d * sizeof(T));                                      \
        }                                                                                     \
        for (int64_t j0 = k0; j0 < k1; j0 += DEC_BLOCK) {                                     \
            const int64_t nb = k1 - j0 < DEC_BLOCK ? k1 - j0 : DEC_BLOCK;                     \
            for (int64_t jj = 0; jj < nb; jj++) {                                             \
                const T *kr = (const T *)key_row(a, a->k, b, hk, j0 + jj);                    \
                for (int64_t r = 0; r < M; r++) {                                             \
                    const T *qv = qr[r];                                                      \
                    /* DEC_LANES running sums: a loop the compiler vectorises */              \
                    T lane[DEC_LANES] = {0}, dot = 0;                                         \
                    int64_t c = 0;                                                            \
                    for (; c + DEC_LANES <= d; c += DEC_LANES)                                \
                        for (int u = 0; u < DEC_LANES; u++)                                   \
                            lane[u] += qv[c + u] * kr[c + u];                                 \
                    for (; c < d; c++)                                                        \
                        dot += qv[c] * kr[c];                                                 \
                    for (int u = 0; u < DEC_LANES; u++)                                       \
                        dot += lane[u];                                                       \
                    const int64_t last = a->causal ? len - Nq + r / G : len - 1;              \
                    s[r * DEC_BLOCK + jj] = j0 + jj <= last ? dot * scale : (T)-INFINITY;     \
                }                                                                             \
            }                                                                                 \
            for (int64_t r = 0; r < M; r++) {                                                 \
                T *sr = s + r * DEC_BLOCK, mx = m[r];                                         \
                for (int64_t jj = 0; jj < nb; jj++)                                           \
                    mx = sr[jj] > mx ? sr[jj] : mx;                                           \
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
            for (int64_t jj = 0; jj < nb; jj++) {                                             \
                const T *vr = (const T *)key_row(a, a->v, b, hk, j0 + jj);                    \
                for (int64_t r = 0; r < M; r++) {                                             \
                    const T pr = s[r * DEC_BLOCK + jj];                                       \
                    T *orow = o + r * d;                                                      \
                    if (pr != 0)                                                              \
                        for (int64_t c = 0; c < d; c++)                                       \
                            orow[c] += pr * vr[c];                                            \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
                                                                                              \
    /* The chunks of (b, hk) merged into out and lse, in chunk order. */                      \
    static void merge##SFX(const ft_decode_cpu *a, int64_t b, int64_t hk, int64_t chunks,     \
                           const T *parts)                                                    \
    {                                                                                         \
        const ft_tensor *q = a->q;                                                            \
        const int64_t Nq = q->shape[1], H = q->shape[2], d = q->shape[3];                     \
        const int64_t G = H / a->k->shape[2], M = Nq * G, per = M * (d + 2);                  \
        for (int64_t r = 0; r < M; r++) {                                                     \
            const int64_t i = r / G, h = hk * G + r % G;                                      \
            T best = -INFINITY;                                                               \
            for (int64_t s = 0; s < chunks; s++) {                                            \
                const T *p = parts + s * per;                                                 \
                const T ls = p[M * d + M + r] > 0 ? p[M * d + r] + LOG(p[M * d + M + r])      \
                                                  : (T)-INFINITY;                             \
                best = ls > best ? ls : best;                                                 \
            }                                                                                 \
            T total = 0;                                                                      \
            for (int64_t s = 0; s < chunks; s++) {                                            \
                const T *p = parts + s * per;                                                 \
                if (p[M * d + M + r] > 0)                                                     \
                    total += EXP(p[M * d + r] + LOG(p[M * d + M + r]) - best);                \
            }                                                                                 \
            const T lse = total > 0 ? best + LOG(total) : (T)-INFINITY;                       \
            T *out = (T *)ft_elem_ptr(a->out, b * a->out->stride[0] + i * a->out->stride[1] + \
                                                  h * a->out->stride[2]);                     \
            for (int64_t c = 0; c < d; c++)                                                   \
                out[c] = 0;                                                                   \
            for (int64_t s = 0; s < chunks && total > 0; s++) {                               \
                const T *p = parts + s * per;                                                 \
                if (!(p[M * d + M + r] > 0))                                                  \
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
    const int64_t chunks = longest > 0 ? (longest + DEC_CHUNK - 1) / DEC_CHUNK : 1;
    const int f64 = q->dtype == FT_F64;
    const size_t es = f64 ? sizeof(double) : sizeof(float);
    const int64_t per = M * (d + 2), tasks = B * Hk * chunks;
    const int nthreads = ft_get_num_threads();
    /* per task its partial rows; per thread its scores and row pointers */
    const size_t scratch = (size_t)M * DEC_BLOCK * es + (size_t)M * sizeof(void *) + 64;
    char *parts = malloc((size_t)tasks * (size_t)per * es);
    char *scr = malloc((size_t)nthreads * scratch);
    if (!parts || !scr) {
        free(parts);
        free(scr);
        return ft_fail(FT_ERR_NOMEM, func, 0, "out of memory for the decoding's %lld partial "
                       "results", (long long)tasks);
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t b = t / (Hk * chunks), hk = t / chunks % Hk, c = t % chunks;
        const int64_t k0 = c * DEC_CHUNK, k1 = a->lens[b] < k0 + DEC_CHUNK ? a->lens[b] : k0 + DEC_CHUNK;
#ifdef _OPENMP
        char *mine = scr + (size_t)omp_get_thread_num() * scratch;
#else
        char *mine = scr;
#endif
        char *part = parts + (size_t)t * (size_t)per * es;
        if (f64)
            task_f64(a, b, hk, k0, k1 > k0 ? k1 : k0, (double *)part, (double *)mine);
        else
            task_f32(a, b, hk, k0, k1 > k0 ? k1 : k0, (float *)part, (float *)mine);
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < B * Hk; t++) {
        const char *p = parts + (size_t)t * (size_t)chunks * (size_t)per * es;
        if (f64)
            merge_f64(a, t / Hk, t % Hk, chunks, (const double *)p);
        else
            merge_f32(a, t / Hk, t % Hk, chunks, (const float *)p);
    }
    free(parts);
    free(scr);
    return FT_OK;
}
