/*
 * attention_cpu_impl.h - the CPU attention kernels, written once over an
 * accumulator type. attention_cpu.c includes this file twice:
 *
 *   ACC = float,  SFX = _f32: f32, f16 and bf16 inputs (float32 statistics
 *                              and accumulators, as on the GPU)
 *   ACC = double, SFX = _f64: f64 inputs (the reference)
 *
 * so every function below exists as name_f32 and name_f64. Shapes:
 *   q, dq, dout, out [B, Nq, H, d]; k, v, dk, dv [B, Nk, Hk, d];
 *   lse [B, H, Nq]; a "rows" buffer is [n, d] contiguous in ACC.
 */
#define FN(name) FT_CAT(name, SFX)

/* n rows of t [B, N, H, d] from row0, at batch b and head h, into dst. */
static void FN(load_rows)(ACC *dst, const ft_tensor *t, int64_t b, int64_t h,
                          int64_t row0, int64_t n)
{
    const int64_t d = t->shape[3];
    for (int64_t r = 0; r < n; r++) {
        const char *p = ft_elem_ptr(t, b * t->stride[0] + (row0 + r) * t->stride[1] +
                                           h * t->stride[2]);
        ACC *o = dst + r * d;
        if (t->dtype == FT_F32)
            for (int64_t j = 0; j < d; j++) o[j] = (ACC)((const float *)p)[j];
        else if (t->dtype == FT_F64)
            for (int64_t j = 0; j < d; j++) o[j] = (ACC)((const double *)p)[j];
        else
            for (int64_t j = 0; j < d; j++) o[j] = (ACC)ft_load_f64(p + 2 * j, t->dtype);
    }
}

/* The inverse of load_rows, rounding to t's dtype. */
static void FN(store_rows)(ft_tensor *t, int64_t b, int64_t h, int64_t row0,
                           int64_t n, const ACC *src)
{
    const int64_t d = t->shape[3];
    for (int64_t r = 0; r < n; r++) {
        char *p = ft_elem_ptr(t, b * t->stride[0] + (row0 + r) * t->stride[1] +
                                     h * t->stride[2]);
        const ACC *s = src + r * d;
        if (t->dtype == FT_F32)
            for (int64_t j = 0; j < d; j++) ((float *)p)[j] = (float)s[j];
        else if (t->dtype == FT_F64)
            for (int64_t j = 0; j < d; j++) ((double *)p)[j] = (double)s[j];
        else
            for (int64_t j = 0; j < d; j++) ft_store_f64(p + 2 * j, t->dtype, (double)s[j]);
    }
}

static ACC FN(dot)(const ACC *a, const ACC *b, int64_t d)
{
    ACC s = 0;
    for (int64_t j = 0; j < d; j++)
        s += a[j] * b[j];
    return s;
}

/* y += a * x */
static void FN(axpy)(ACC *y, ACC a, const ACC *x, int64_t d)
{
    for (int64_t j = 0; j < d; j++)
        y[j] += a * x[j];
}

/* n rows of t from row0 transposed into dst [d, n]: column r is row r.
 * Products against it vectorise along the rows of the tile. */
static void FN(load_rows_t)(ACC *dst, const ft_tensor *t, int64_t b, int64_t h,
                            int64_t row0, int64_t n, ACC *row)
{
    const int64_t d = t->shape[3];
    for (int64_t r = 0; r < n; r++) {
        FN(load_rows)(row, t, b, h, row0 + r, 1);
        for (int64_t j = 0; j < d; j++)
            dst[j * n + r] = row[j];
    }
}

/* C [nr, nc] = A [nr, d] x Bt [d, nc], through CBLAS (row-major). */
static void FN(mm_abt)(ACC *C, const ACC *A, const ACC *Bt, int64_t nr, int64_t nc,
                       int64_t d)
{
    ACC_GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)nr, (int)nc, (int)d, (ACC)1, A,
             (int)d, Bt, (int)nc, (ACC)0, C, (int)nc);
}

/* The Lua-written modifications (lib/mods.c's interpreter, a row at a
 * time) on scores S [nr, nc] that the built-in variants have made: a
 * masked pair becomes -inf, a kept one f(s), and G (when not NULL) is
 * multiplied by f's derivative. Scratch: this thread's part of
 * s->mod_scratch, 2 nodes + 4 rows of nc doubles. */
static void FN(apply_mods)(ACC *S, ACC *G, int64_t nr, int64_t nc, int64_t i0, int64_t j0,
                           const ft_attn_shape *s, int64_t b, int64_t h)
{
    double *base = s->mod_scratch + thread_index() * s->mod_scratch_per_thread;
    double *in = base, *score = in + nc, *dscore = score + nc;
    int *keep = (int *)(dscore + nc);
    double *work = dscore + 2 * nc;
    const int has_score = ft_attn_mods_has_score(s->mods);
    for (int64_t r = 0; r < nr; r++) {
        ACC *row = S + r * nc;
        for (int64_t c = 0; c < nc; c++)
            in[c] = (double)row[c];
        ft_attn_mods_eval_row(s->mods, s->mod_tensors, s->batch0 + b, h, i0 + r, j0, nc,
                              in, has_score ? score : NULL, G && has_score ? dscore : NULL,
                              keep, NULL, NULL, work, s->mod_fault);
        for (int64_t c = 0; c < nc; c++) {
            if (row[c] == (ACC)-INFINITY) /* hidden by a built-in mask */
                continue;
            if (!keep[c]) {
                row[c] = (ACC)-INFINITY;
                if (G)
                    G[r * nc + c] = 0;
                continue;
            }
            if (has_score) {
                row[c] = (ACC)score[c];
                if (G)
                    G[r * nc + c] *= (ACC)dscore[c];
            }
        }
    }
}

/* The scores of query rows i0.. (Q) against key rows j0.. (Kt, transposed
 * [d, nc]) of batch b, head h: x = scale * Q[r] . K[c], modified as
 * lib/attn_mod.h says (softcap, ALiBi) for visible pairs, -inf for masked
 * ones. G, when not NULL, gets d score / d x (the softcap's derivative; 0
 * where masked). */
static void FN(scores)(ACC *S, ACC *G, const ACC *Q, const ACC *Kt, int64_t nr, int64_t nc,
                       int64_t i0, int64_t j0, const ft_attn_shape *s, int64_t b, int64_t h,
                       ACC *X, int skip_mods)
{
    const ACC scale = (ACC)s->scale;
    const ft_attn_mod *m = &s->mod;
    const int modified = m->softcap > 0 || m->alibi;
    const double slope = ft_attn_slope(s, b, h);
    FN(mm_abt)(S, Q, Kt, nr, nc, s->d);
    for (int64_t r = 0; r < nr; r++) {
        /* row i0 + r sees the keys [kb, ke): columns [cb, ce) here; each
         * part in a loop of its own (the scaling one vectorises) */
        const int64_t cb = imin(imax(key_begin(s, i0 + r) - j0, 0), nc);
        const int64_t ce = imax(imin(key_end(s, i0 + r) - j0, nc), cb);
        ACC *x = S + r * nc, *g = G ? G + r * nc : NULL;
        for (int64_t c = 0; c < cb; c++)
            x[c] = (ACC)-INFINITY;
        for (int64_t c = ce; c < nc; c++)
            x[c] = (ACC)-INFINITY;
        for (int64_t c = cb; c < ce; c++)
            x[c] *= scale;
        if (g) {
            for (int64_t c = 0; c < cb; c++)
                g[c] = 0;
            for (int64_t c = ce; c < nc; c++)
                g[c] = 0;
            for (int64_t c = cb; c < ce; c++)
                g[c] = m->softcap > 0 ? (ACC)ft_mod_score_grad(m, (double)x[c]) : (ACC)1;
        }
        if (modified)
            for (int64_t c = cb; c < ce; c++)
                x[c] = (ACC)ft_mod_score(m, slope, s->Nq, s->Nk, i0 + r, j0 + c, (double)x[c]);
    }
    if (X) /* the scores the mods take, for their tensors' gradients */
        memcpy(X, S, (size_t)(nr * nc) * sizeof *X);
    if (s->mods && !skip_mods)
        FN(apply_mods)(S, G, nr, nc, i0, j0, s, b, h);
}

/* With a block mask: whether the tiled path skips the tile (*skip, the
 * mask hides it wholly) or the mods (the mask hides nothing and there is
 * no score function). */
static int FN(tile_kind)(const ft_attn_shape *s, int64_t b, int64_t h, int64_t i0, int64_t nr,
                         int64_t j0, int64_t nc, int *skip_mods)
{
    *skip_mods = 0;
    if (!s->block_mask)
        return FT_BLOCK_PARTIAL;
    const int kind = ft_attn_block_kind(s->block_mask, b, h, i0, i0 + nr, j0, j0 + nc);
    *skip_mods = kind == FT_BLOCK_FULL && !ft_attn_mods_has_score(s->mods);
    return kind;
}

/* The captured tensors' gradients from a tile: for each pair, dS (the
 * loss's gradient in the modified score, DSP [nr, nc]) times d score /
 * d(each value the score read), added into this task's buffer gbuf at
 * the value's place. X: the scores the mods took. */
static void FN(mod_read_grads)(const ACC *X, const ACC *DSP, int64_t nr, int64_t nc, int64_t i0,
                               int64_t j0, const ft_attn_shape *s, int64_t b, int64_t h,
                               double *gbuf)
{
    const int K = ft_attn_mods_reads(s->mods);
    double *base = s->mod_scratch + thread_index() * s->mod_scratch_per_thread;
    double *in = base, *dread = in + nc;
    int64_t *lin = (int64_t *)(dread + (size_t)K * nc);
    double *work = (double *)(lin + (size_t)K * nc);
    for (int64_t r = 0; r < nr; r++) {
        for (int64_t c = 0; c < nc; c++)
            in[c] = (double)X[r * nc + c];
        ft_attn_mods_eval_row(s->mods, s->mod_tensors, s->batch0 + b, h, i0 + r, j0, nc, in,
                              NULL, NULL, NULL, dread, lin, work, s->mod_fault);
        for (int k = 0; k < K; k++) {
            const int slot = ft_attn_mods_read_tensor(s->mods, k);
            if (!s->mod_gacc[slot])
                continue;
            double *g = gbuf + s->mod_goff[slot];
            for (int64_t c = 0; c < nc; c++) {
                const double w = (double)DSP[r * nc + c] * dread[(size_t)k * nc + c];
                if (w != 0)
                    g[lin[(size_t)k * nc + c]] += w;
            }
        }
    }
}

/* ---- naive: S and P of a whole (b, h) materialised ---- */

/* Scratch per thread: Q, O [Nq, d]; K^T [d, Nk]; V [Nk, d]; S [Nq, Nk];
 * a row [d]. */
static int FN(naive_forward_scratch)(const ft_attn_shape *s, int64_t *n)
{
    *n = 0;
    return scratch_add(n, 2 * s->d, s->Nq) || scratch_add(n, 2 * s->d, s->Nk) ||
           scratch_add(n, s->Nq, s->Nk) || scratch_add(n, s->d, 1);
}

static void FN(naive_forward)(const ft_attn_shape *s, const ft_tensor *q,
                              const ft_tensor *k, const ft_tensor *v, ft_tensor *out,
                              ft_tensor *lse, int64_t b, int64_t h, ACC *scratch)
{
    const int64_t Nq = s->Nq, Nk = s->Nk, d = s->d, hk = h / (s->H / s->Hk);
    ACC *Q = scratch, *O = Q + Nq * d, *Kt = O + Nq * d, *V = Kt + Nk * d;
    ACC *S = V + Nk * d, *row = S + Nq * Nk;
    FN(load_rows)(Q, q, b, h, 0, Nq);
    FN(load_rows_t)(Kt, k, b, hk, 0, Nk, row);
    FN(load_rows)(V, v, b, hk, 0, Nk);
    FN(scores)(S, NULL, Q, Kt, Nq, Nk, 0, 0, s, b, h, NULL, 0);
    const ACC sink = (ACC)ft_attn_sink(s, h); /* -inf: none */
    for (int64_t i = 0; i < Nq; i++) {
        ACC *P = S + i * Nk, *o = O + i * d;
        ACC m = sink, l = 0;
        for (int64_t j = 0; j < Nk; j++)
            m = FT_NAN_MAX(P[j], m);
        memset(o, 0, (size_t)d * sizeof *o);
        if (m == (ACC)-INFINITY) { /* no visible key, no sink */
            lse_store(lse, b, h, i, -INFINITY);
            continue;
        }
        for (int64_t j = 0; j < Nk; j++) {
            /* a hidden key adds nothing, whatever m is (a NaN sink's) */
            P[j] = P[j] == (ACC)-INFINITY ? 0 : ACC_EXP(P[j] - m);
            l += P[j];
        }
        if (sink != (ACC)-INFINITY) /* the sink joins the sum, not the output */
            l += ACC_EXP(sink - m);
        for (int64_t j = 0; j < Nk; j++)
            FN(axpy)(o, (ACC)round_input(s, P[j] / l * keep_scale(s, b, h, i, j)), V + j * d,
                     d);
        lse_store(lse, b, h, i, (double)m + log((double)l));
    }
    FN(store_rows)(out, b, h, 0, Nq, O);
}

/* Scratch per thread: Q, dO, dQ [Nq, d]; K, dK, dV [Nk, d]; K^T, V^T
 * [d, Nk]; P, dP, SG (the score gradient of a softcap) [Nq, Nk]; a row
 * [d]; with the mods' tensors' gradients, X and DSP [Nq, Nk] too. */
static int FN(naive_backward_scratch)(const ft_attn_shape *s, int64_t *n)
{
    *n = 0;
    return scratch_add(n, 3 * s->d, s->Nq) || scratch_add(n, 5 * s->d, s->Nk) ||
           scratch_add(n, s->mod_gbuf ? 5 * s->Nq : 3 * s->Nq, s->Nk) ||
           scratch_add(n, s->d, 1);
}

/* One (b, hk) with the H/Hk query heads of its group: the traditional
 * backward, from P recomputed by a full softmax (not from the LSE). */
static void FN(naive_backward)(const ft_attn_shape *s, const ft_tensor *dout,
                               const ft_tensor *q, const ft_tensor *k,
                               const ft_tensor *v, ft_tensor *dq, ft_tensor *dk,
                               ft_tensor *dv, int64_t b, int64_t hk, ACC *scratch)
{
    const int64_t Nq = s->Nq, Nk = s->Nk, d = s->d, G = s->H / s->Hk;
    const ACC scale = (ACC)s->scale;
    ACC *Q = scratch, *dO = Q + Nq * d, *dQ = dO + Nq * d;
    ACC *K = dQ + Nq * d, *Kt = K + Nk * d, *Vt = Kt + Nk * d, *dK = Vt + Nk * d;
    ACC *dV = dK + Nk * d, *P = dV + Nk * d, *dP = P + Nq * Nk, *SG = dP + Nq * Nk;
    ACC *row = SG + Nq * Nk;
    ACC *X = s->mod_gbuf ? row + d : NULL, *DSP = s->mod_gbuf ? X + Nq * Nk : NULL;
    double *gbuf = s->mod_gbuf ? s->mod_gbuf + (size_t)(b * s->Hk + hk) * s->mod_gbuf_per_task
                               : NULL;
    FN(load_rows)(K, k, b, hk, 0, Nk);
    FN(load_rows_t)(Kt, k, b, hk, 0, Nk, row);
    FN(load_rows_t)(Vt, v, b, hk, 0, Nk, row);
    memset(dK, 0, (size_t)(2 * Nk * d) * sizeof *dK); /* dK and dV */
    for (int64_t h = hk * G; h < (hk + 1) * G; h++) {
        FN(load_rows)(Q, q, b, h, 0, Nq);
        FN(load_rows)(dO, dout, b, h, 0, Nq);
        FN(scores)(P, SG, Q, Kt, Nq, Nk, 0, 0, s, b, h, X, 0);
        FN(mm_abt)(dP, dO, Vt, Nq, Nk, d); /* dP = dO V^T */
        memset(dQ, 0, (size_t)(Nq * d) * sizeof *dQ);
        const ACC sink = (ACC)ft_attn_sink(s, h);
        for (int64_t i = 0; i < Nq; i++) {
            ACC *p = P + i * Nk, *dp = dP + i * Nk, *g = SG + i * Nk;
            ACC m = sink, l = 0, D = 0;
            for (int64_t j = 0; j < Nk; j++)
                m = FT_NAN_MAX(p[j], m);
            for (int64_t j = 0; j < Nk; j++) {
                p[j] = p[j] == (ACC)-INFINITY ? 0 : ACC_EXP(p[j] - m);
                l += p[j];
            }
            if (sink != (ACC)-INFINITY)
                l += ACC_EXP(sink - m);
            /* P (undropped) in p, dP (as P's, dropout folded in) in dp;
             * D = sum P dP = rowsum(dO * O). */
            for (int64_t j = 0; j < Nk; j++) {
                const ACC z = (ACC)keep_scale(s, b, h, i, j);
                p[j] = (ACC)round_input(s, l > 0 || l != l ? p[j] / l : 0);
                dp[j] = (ACC)round_input(s, dp[j]) * z;
                D += p[j] * dp[j];
            }
            for (int64_t j = 0; j < Nk; j++) {
                const ACC z = (ACC)keep_scale(s, b, h, i, j);
                if (DSP)
                    DSP[i * Nk + j] = p[j] * (dp[j] - D);
                ACC ds = (ACC)round_input(s, p[j] * (dp[j] - D) * g[j]);
                FN(axpy)(dV + j * d, (ACC)round_input(s, p[j] * z), dO + i * d, d);
                FN(axpy)(dK + j * d, scale * ds, Q + i * d, d);
                FN(axpy)(dQ + i * d, scale * ds, K + j * d, d);
            }
        }
        if (gbuf)
            FN(mod_read_grads)(X, DSP, Nq, Nk, 0, 0, s, b, h, gbuf);
        FN(store_rows)(dq, b, h, 0, Nq, dQ);
    }
    FN(store_rows)(dk, b, hk, 0, Nk, dK);
    FN(store_rows)(dv, b, hk, 0, Nk, dV);
}

/* ---- tiled: FlashAttention's algorithm ---- */

/* Scratch per thread: Q, O [Bq, d]; K^T [d, Bk]; V [Bk, d]; S [Bq, Bk];
 * m, l [Bq]; a row [d]. */
static int FN(tiled_forward_scratch)(const ft_attn_shape *s, int64_t *n)
{
    const int64_t Bq = s->block_q, Bk = s->block_k;
    *n = 0;
    return scratch_add(n, 2 * s->d, Bq) || scratch_add(n, 2 * s->d, Bk) ||
           scratch_add(n, Bq, Bk) || scratch_add(n, 2, Bq) || scratch_add(n, s->d, 1);
}

/* Query rows i0 .. i0+Bq-1 of (b, h): one pass over the K/V blocks with a
 * running max m, running sum l and unnormalised output O per row. */
static void FN(tiled_forward)(const ft_attn_shape *s, const ft_tensor *q,
                              const ft_tensor *k, const ft_tensor *v, ft_tensor *out,
                              ft_tensor *lse, int64_t b, int64_t h, int64_t i0,
                              ACC *scratch)
{
    const int64_t d = s->d, hk = h / (s->H / s->Hk);
    const int64_t nr = imin(s->block_q, s->Nq - i0);
    ACC *Q = scratch, *O = Q + s->block_q * d, *Kt = O + s->block_q * d;
    ACC *V = Kt + s->block_k * d, *S = V + s->block_k * d;
    ACC *m = S + s->block_q * s->block_k, *l = m + s->block_q, *row = l + s->block_q;
    FN(load_rows)(Q, q, b, h, i0, nr);
    memset(O, 0, (size_t)(nr * d) * sizeof *O);
    /* A sink starts each row's sum at e^(sink - sink) = 1, with no value. */
    const ACC sink = (ACC)ft_attn_sink(s, h);
    for (int64_t r = 0; r < nr; r++)
        m[r] = sink, l[r] = sink == (ACC)-INFINITY ? 0 : 1;
    /* Only the key blocks some row of this block sees (the visible keys
     * of a row move right with the row). */
    const int64_t j_begin = key_begin(s, i0) / s->block_k * s->block_k;
    const int64_t j_end = key_end(s, i0 + nr - 1);
    for (int64_t j0 = j_begin; j0 < j_end; j0 += s->block_k) {
        const int64_t nc = imin(s->block_k, s->Nk - j0);
        int skip_mods;
        if (FN(tile_kind)(s, b, h, i0, nr, j0, nc, &skip_mods) == FT_BLOCK_EMPTY)
            continue;
        FN(load_rows_t)(Kt, k, b, hk, j0, nc, row);
        FN(load_rows)(V, v, b, hk, j0, nc);
        FN(scores)(S, NULL, Q, Kt, nr, nc, i0, j0, s, b, h, NULL, skip_mods);
        /* the online softmax row by row: O rescaled, S turned into P
         * (dropped, with dropout), then O += P V as one product */
        for (int64_t r = 0; r < nr; r++) {
            ACC *srow = S + r * nc;
            const ACC m_new = ACC_MAX_ROW(srow, nc, m[r]);
            if (m_new == (ACC)-INFINITY) { /* nothing visible yet: P = 0 */
                memset(srow, 0, (size_t)nc * sizeof *srow);
                continue;
            }
            /* exp(-inf) = 0 drops the empty state of a first visible block. */
            const ACC alpha = ACC_EXP(m[r] - m_new);
            ACC *o = O + r * d;
            for (int64_t j = 0; j < d; j++)
                o[j] *= alpha;
            /* the softmax's sum is of the undropped P */
            const ACC sum = ACC_EXP_ROW(srow, nc, m_new);
            if (s->mod.dropout)
                for (int64_t c = 0; c < nc; c++)
                    srow[c] *= (ACC)keep_scale(s, b, h, i0 + r, j0 + c);
            l[r] = l[r] * alpha + sum;
            m[r] = m_new;
        }
        ACC_GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)nr, (int)d, (int)nc, (ACC)1, S,
                 (int)nc, V, (int)d, (ACC)1, O, (int)d);
    }
    for (int64_t r = 0; r < nr; r++) {
        ACC *o = O + r * d;
        if (l[r] > 0 || l[r] != l[r]) { /* NaN: a NaN score or sink, NaN out */
            for (int64_t j = 0; j < d; j++)
                o[j] /= l[r];
            lse_store(lse, b, h, i0 + r, (double)m[r] + log((double)l[r]));
        } else { /* no visible key: zero output, log of an empty sum */
            lse_store(lse, b, h, i0 + r, -INFINITY);
        }
    }
    FN(store_rows)(out, b, h, i0, nr, O);
}

/* D[b, h, i] = rowsum(dO * O), first of the backward pass. */
static void FN(tiled_backward_D)(const ft_attn_shape *s, const ft_tensor *dout,
                                 const ft_tensor *out, ACC *D, int64_t b, int64_t h,
                                 ACC *scratch)
{
    ACC *dO = scratch, *O = scratch + s->d;
    for (int64_t i = 0; i < s->Nq; i++) {
        FN(load_rows)(dO, dout, b, h, i, 1);
        FN(load_rows)(O, out, b, h, i, 1);
        D[(b * s->H + h) * s->Nq + i] = FN(dot)(dO, O, s->d);
    }
}

/* Scratch per thread: K, dK, dV [Bk, d]; K^T, V^T [d, Bk]; Q, dO [Bq, d];
 * P, dS, SG (the score gradient of a softcap) [Bq, Bk]; lse [Bq]; a row [d]; dQ accumulators for the group
 * [G, Nq, d] (the O(N) part). */
static int FN(tiled_backward_scratch)(const ft_attn_shape *s, int64_t *n)
{
    const int64_t Bq = s->block_q, Bk = s->block_k, G = s->H / s->Hk;
    int64_t dq = 0;
    *n = 0;
    return scratch_add(n, 5 * s->d, Bk) || scratch_add(n, 2 * s->d, Bq) ||
           scratch_add(n, s->mod_gbuf ? 5 * Bq : 3 * Bq, Bk) || scratch_add(n, Bq, 1) ||
           scratch_add(n, s->d, 1) ||
           scratch_add(&dq, G, s->Nq) || scratch_add(n, dq, s->d);
}

/* One (b, hk), key blocks [kb0, kb1): for each K/V block, for each query
 * head of the group and each Q block that can see it, recompute P from the
 * saved LSE and accumulate dV, dK (per block) and dQ (across blocks). dQ
 * goes to dq when dQp is NULL (the task has every key block), else it is
 * this task's partial sum in dQp ([G, Nq, d]), which FN(backward) adds up. */
static void FN(tiled_backward)(const ft_attn_shape *s, const ft_tensor *dout,
                               const ft_tensor *q, const ft_tensor *k,
                               const ft_tensor *v, const ft_tensor *lse, const ACC *D,
                               ft_tensor *dq, ft_tensor *dk, ft_tensor *dv, int64_t b,
                               int64_t hk, int64_t kb0, int64_t kb1, ACC *dQp, ACC *scratch)
{
    const int64_t d = s->d, Bq = s->block_q, Bk = s->block_k, G = s->H / s->Hk;
    const ACC scale = (ACC)s->scale;
    ACC *K = scratch, *Kt = K + Bk * d, *Vt = Kt + Bk * d, *dK = Vt + Bk * d;
    ACC *dV = dK + Bk * d, *Q = dV + Bk * d, *dO = Q + Bq * d, *P = dO + Bq * d;
    ACC *dS = P + Bq * Bk, *SG = dS + Bq * Bk, *L = SG + Bq * Bk, *row = L + Bq;
    ACC *dQ = dQp ? dQp : row + d;
    /* with the mods' tensors' gradients: X, DSP [Bq, Bk] after dQ */
    ACC *X = s->mod_gbuf ? row + d + G * s->Nq * d : NULL, *DSP = s->mod_gbuf ? X + Bq * Bk : NULL;
    double *gbuf = s->mod_gbuf ? s->mod_gbuf + (size_t)(b * s->Hk + hk) * s->mod_gbuf_per_task
                               : NULL;
    memset(dQ, 0, (size_t)(G * s->Nq * d) * sizeof *dQ);
    for (int64_t j0 = kb0 * Bk; j0 < s->Nk && j0 < kb1 * Bk; j0 += Bk) {
        const int64_t nc = imin(Bk, s->Nk - j0);
        FN(load_rows)(K, k, b, hk, j0, nc);
        FN(load_rows_t)(Kt, k, b, hk, j0, nc, row);
        FN(load_rows_t)(Vt, v, b, hk, j0, nc, row);
        memset(dK, 0, (size_t)(2 * Bk * d) * sizeof *dK); /* dK and dV */
        for (int64_t g = 0; g < G; g++) {
            const int64_t h = hk * G + g;
            const ACC *Dh = D + (b * s->H + h) * s->Nq;
            ACC *dQh = dQ + g * s->Nq * d;
            /* Only the query rows that see some key of this block. */
            const int64_t i_end = query_end(s, j0 + nc - 1);
            for (int64_t i0 = query_begin(s, j0); i0 < i_end; i0 += Bq) {
                const int64_t nr = imin(Bq, i_end - i0);
                int skip_mods;
                if (FN(tile_kind)(s, b, h, i0, nr, j0, nc, &skip_mods) == FT_BLOCK_EMPTY)
                    continue;
                FN(load_rows)(Q, q, b, h, i0, nr);
                FN(load_rows)(dO, dout, b, h, i0, nr);
                for (int64_t r = 0; r < nr; r++)
                    L[r] = (ACC)lse_load(lse, b, h, i0 + r);
                FN(scores)(P, SG, Q, Kt, nr, nc, i0, j0, s, b, h, X, skip_mods);
                for (int64_t r = 0; r < nr; r++) { /* a row that saw no key: P = 0 */
                    if (L[r] == (ACC)-INFINITY)
                        memset(P + r * nc, 0, (size_t)nc * sizeof *P);
                    else
                        ACC_EXP_ROW(P + r * nc, nc, L[r]);
                }
                FN(mm_abt)(dS, dO, Vt, nr, nc, d); /* dP = dO V^T */
                for (int64_t r = 0; r < nr; r++)
                    for (int64_t c = 0; c < nc; c++) {
                        /* P is undropped; dV takes it dropped, and dP goes
                         * back through the same mask. */
                        const ACC p = P[r * nc + c];
                        const ACC z = s->mod.dropout
                                          ? (ACC)keep_scale(s, b, h, i0 + r, j0 + c) : 1;
                        const ACC dsp = p * (dS[r * nc + c] * z - Dh[i0 + r]);
                        if (DSP)
                            DSP[r * nc + c] = dsp;
                        dS[r * nc + c] = dsp * SG[r * nc + c];
                        P[r * nc + c] = p * z; /* P dropped, for dV */
                    }
                if (gbuf)
                    FN(mod_read_grads)(X, DSP, nr, nc, i0, j0, s, b, h, gbuf);
                /* dV += P^T dO, dK += scale dS^T Q, dQ += scale dS K */
                ACC_GEMM(CblasRowMajor, CblasTrans, CblasNoTrans, (int)nc, (int)d, (int)nr,
                         (ACC)1, P, (int)nc, dO, (int)d, (ACC)1, dV, (int)d);
                ACC_GEMM(CblasRowMajor, CblasTrans, CblasNoTrans, (int)nc, (int)d, (int)nr, scale,
                         dS, (int)nc, Q, (int)d, (ACC)1, dK, (int)d);
                ACC_GEMM(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)nr, (int)d, (int)nc,
                         scale, dS, (int)nc, K, (int)d, (ACC)1, dQh + i0 * d, (int)d);
            }
        }
        FN(store_rows)(dk, b, hk, j0, nc, dK);
        FN(store_rows)(dv, b, hk, j0, nc, dV);
    }
    for (int64_t g = 0; !dQp && g < G; g++)
        FN(store_rows)(dq, b, hk * G + g, 0, s->Nq, dQ + g * s->Nq * d);
}

/* ---- drivers: scratch sizes and the parallel loops ---- */

/* Elements of ACC scratch per thread for a forward or backward pass into
 * *n; -1 if the count overflows int64. */
static int FN(scratch_per_thread)(ft_attn_impl impl, int backward,
                                  const ft_attn_shape *s, int64_t *n)
{
    if (impl == FT_ATTN_NAIVE)
        return backward ? FN(naive_backward_scratch)(s, n) : FN(naive_forward_scratch)(s, n);
    return backward ? FN(tiled_backward_scratch)(s, n) : FN(tiled_forward_scratch)(s, n);
}

/* Naive: one task per (b, h). Tiled: one per (b, h, query block). */
static void FN(forward)(ft_attn_impl impl, const ft_attn_shape *s, const ft_tensor *q,
                        const ft_tensor *k, const ft_tensor *v, ft_tensor *out,
                        ft_tensor *lse, ACC *scratch, size_t per_thread, int nthreads)
{
    const int64_t H = s->H;
    (void)nthreads; /* used by the OpenMP clauses */
    if (impl == FT_ATTN_NAIVE) {
#pragma omp parallel for schedule(dynamic) num_threads(nthreads)
        for (int64_t t = 0; t < s->B * H; t++)
            FN(naive_forward)(s, q, k, v, out, lse, t / H, t % H,
                              scratch + thread_index() * per_thread);
        return;
    }
    const int64_t nqb = (s->Nq + s->block_q - 1) / s->block_q;
#pragma omp parallel for schedule(dynamic) num_threads(nthreads)
    for (int64_t t = 0; t < s->B * H * nqb; t++)
        FN(tiled_forward)(s, q, k, v, out, lse, t / (H * nqb), t / nqb % H,
                          t % nqb * s->block_q, scratch + thread_index() * per_thread);
}

/* One task per (b, hk) and chunk of key blocks: the heads of a GQA group
 * share dK and dV, a chunk owns its blocks of them, and the chunks' dQ
 * partial sums (dQp, [B, Hk, chunks, G, Nq, d], with chunks > 1) are added
 * in chunk order afterwards, so nothing is written twice and the result
 * does not depend on the schedule or the thread count (chunks comes from
 * the shape alone: bwd_chunks). D (tiled only) holds B * H * Nq elements
 * after the per-thread scratch. */
static void FN(backward)(ft_attn_impl impl, const ft_attn_shape *s,
                         const ft_tensor *dout, const ft_tensor *q, const ft_tensor *k,
                         const ft_tensor *v, const ft_tensor *out, const ft_tensor *lse,
                         ft_tensor *dq, ft_tensor *dk, ft_tensor *dv, ACC *scratch,
                         size_t per_thread, int nthreads, ACC *D, int64_t chunks, ACC *dQp)
{
    const int64_t H = s->H, Hk = s->Hk;
    (void)nthreads; /* used by the OpenMP clauses */
    if (impl == FT_ATTN_NAIVE) {
#pragma omp parallel for schedule(dynamic) num_threads(nthreads)
        for (int64_t t = 0; t < s->B * Hk; t++)
            FN(naive_backward)(s, dout, q, k, v, dq, dk, dv, t / Hk, t % Hk,
                               scratch + thread_index() * per_thread);
        return;
    }
#pragma omp parallel for schedule(dynamic) num_threads(nthreads)
    for (int64_t t = 0; t < s->B * H; t++)
        FN(tiled_backward_D)(s, dout, out, D, t / H, t % H,
                             scratch + thread_index() * per_thread);
    const int64_t nkb = (s->Nk + s->block_k - 1) / s->block_k;
    const int64_t per = (nkb + chunks - 1) / chunks; /* key blocks a chunk */
    const int64_t part = (s->H / Hk) * s->Nq * s->d; /* one chunk's dQ */
#pragma omp parallel for schedule(dynamic) num_threads(nthreads)
    for (int64_t t = 0; t < s->B * Hk * chunks; t++) {
        const int64_t bh = t / chunks, c = t % chunks;
        FN(tiled_backward)(s, dout, q, k, v, lse, D, dq, dk, dv, bh / Hk, bh % Hk, c * per,
                           (c + 1) * per, chunks > 1 ? dQp + t * part : NULL,
                           scratch + thread_index() * per_thread);
    }
    if (chunks == 1)
        return;
#pragma omp parallel for schedule(dynamic) num_threads(nthreads)
    for (int64_t bh = 0; bh < s->B * Hk; bh++) {
        ACC *sum = dQp + bh * chunks * part;
        for (int64_t c = 1; c < chunks; c++) /* in chunk order: the same bits always */
            for (int64_t e = 0; e < part; e++)
                sum[e] += sum[c * part + e];
        const int64_t G = s->H / Hk;
        for (int64_t g = 0; g < G; g++)
            FN(store_rows)(dq, bh / Hk, bh % Hk * G + g, 0, s->Nq, sum + g * s->Nq * s->d);
    }
}

#undef FN
