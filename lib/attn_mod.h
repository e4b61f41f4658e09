/*
 * attn_mod.h - which keys a query sees and what its scores become: the
 * masks and score modifications of every attention variant, written once
 * for the CPU (lib/attention_cpu*.c) and the CUDA kernels (through
 * FT_HOST_DEVICE, as philox.h). Each implementation asks these functions
 * and nothing else, so a variant is defined here and only here.
 *
 * One sequence pair has Nq queries and Nk keys (a varlen batch: each
 * sequence its own Nq and Nk), aligned bottom-right: query i sits at key
 * position i + Nk - Nq (FlashAttention 2's convention).
 *
 *   window  query i sees key j when
 *             i + shift - left <= j   (left >= 0; -1: no bound)
 *             j <= i + shift + right  (right >= 0; -1: no bound)
 *           with shift = Nk - Nq; causal is right = 0.
 *   score   x = scale * q.k; with softcap c > 0, x = c tanh(x / c); then
 *           with ALiBi slope m (per batch and head), x -= m |i + shift - j|.
 *   sink    a logit per head that joins each row's softmax denominator
 *           without a value row: LSE = log(sum_j e^x_ij + e^sink).
 *   dropout P_ij is kept, scaled by 1 / (1 - p), when a 32-bit random
 *           number u_ij of (seed, offset, b, h, i, j) is >= floor(p * 2^32)
 *           (ft_drop_keep below: two Philox 4x32-10 calls, the second
 *           only for 1 score in 256): the same bit on every device and
 *           every tiling.
 */
#ifndef FT_ATTN_MOD_H
#define FT_ATTN_MOD_H

#include <math.h>
#include <stdint.h>

#include "philox.h"

/* The variant of one call, as plain values (a kernel takes it by value). */
typedef struct ft_attn_mod {
    int64_t left, right;     /* window bounds; -1: none (causal: right 0) */
    double softcap;          /* 0: off */
    int alibi;               /* slopes given (per (b, h), read by the caller) */
    int sink;                /* sink logits given (per h) */
    int dropout;             /* dropout_p > 0 */
    uint32_t drop_threshold; /* floor(p * 2^32) */
    double drop_scale;       /* 1 / (1 - p) */
    uint64_t seed;
    uint32_t offset;         /* below 2^31 */
} ft_attn_mod;

/* How a block of queries [i0, i1) and keys [j0, j1) is treated. */
typedef enum ft_block_kind {
    FT_BLOCK_EMPTY = 0, /* no query sees any key: skipped */
    FT_BLOCK_PARTIAL,   /* some pairs masked: mask each score */
    FT_BLOCK_FULL       /* every pair visible: no mask needed */
} ft_block_kind;

static inline FT_HOST_DEVICE int64_t ft_mod_clamp(int64_t x, int64_t lo, int64_t hi)
{
    return x < lo ? lo : x > hi ? hi : x;
}

/* The first key query i sees (Nk when none). */
static inline FT_HOST_DEVICE int64_t ft_mod_key_begin(const ft_attn_mod *m, int64_t Nq,
                                                      int64_t Nk, int64_t i)
{
    return m->left < 0 ? 0 : ft_mod_clamp(i + Nk - Nq - m->left, 0, Nk);
}

/* One past the last key query i sees (0 when none). */
static inline FT_HOST_DEVICE int64_t ft_mod_key_end(const ft_attn_mod *m, int64_t Nq,
                                                    int64_t Nk, int64_t i)
{
    return m->right < 0 ? Nk : ft_mod_clamp(i + Nk - Nq + m->right + 1, 0, Nk);
}

/* The first query that sees key j (Nq when none). */
static inline FT_HOST_DEVICE int64_t ft_mod_query_begin(const ft_attn_mod *m, int64_t Nq,
                                                        int64_t Nk, int64_t j)
{
    return m->right < 0 ? 0 : ft_mod_clamp(j - (Nk - Nq) - m->right, 0, Nq);
}

/* One past the last query that sees key j (0 when none). */
static inline FT_HOST_DEVICE int64_t ft_mod_query_end(const ft_attn_mod *m, int64_t Nq,
                                                      int64_t Nk, int64_t j)
{
    return m->left < 0 ? Nq : ft_mod_clamp(j - (Nk - Nq) + m->left + 1, 0, Nq);
}

/* The most keys a block of `rows` consecutive queries sees: Nk, or for a
 * window bounded on both sides (causal included) left + right + rows
 * when fewer (each bound taken at most Nk: no overflow). */
static inline FT_HOST_DEVICE int64_t ft_mod_block_keys(const ft_attn_mod *m, int64_t Nk,
                                                       int64_t rows)
{
    if (m->left < 0 || m->right < 0)
        return Nk;
    const int64_t keys = ft_mod_clamp(m->left, 0, Nk) + ft_mod_clamp(m->right, 0, Nk) + rows;
    return keys < Nk ? keys : Nk;
}

/* Queries [i0, i1) against keys [j0, j1), both non-empty. The visible
 * interval of a query moves right as i grows, so the first and the last
 * query bound every other. */
static inline FT_HOST_DEVICE ft_block_kind ft_mod_block(const ft_attn_mod *m, int64_t Nq,
                                                        int64_t Nk, int64_t i0, int64_t i1,
                                                        int64_t j0, int64_t j1)
{
    if (ft_mod_key_end(m, Nq, Nk, i1 - 1) <= j0 || ft_mod_key_begin(m, Nq, Nk, i0) >= j1)
        return FT_BLOCK_EMPTY;
    if (ft_mod_key_begin(m, Nq, Nk, i1 - 1) <= j0 && ft_mod_key_end(m, Nq, Nk, i0) >= j1)
        return FT_BLOCK_FULL;
    return FT_BLOCK_PARTIAL;
}

/* The score of a visible pair from x = scale * q.k: softcap, then ALiBi
 * (slope: that of the pair's batch and head, 0 without ALiBi). */
static inline FT_HOST_DEVICE double ft_mod_score(const ft_attn_mod *m, double slope, int64_t Nq,
                                                 int64_t Nk, int64_t i, int64_t j, double x)
{
    if (m->softcap > 0)
        x = m->softcap * tanh(x / m->softcap);
    if (m->alibi) {
        const int64_t dist = i + Nk - Nq - j;
        x -= slope * (double)(dist < 0 ? -dist : dist);
    }
    return x;
}

/* d score / d x at x = scale * q.k: the softcap's 1 - tanh^2 (1 without). */
static inline FT_HOST_DEVICE double ft_mod_score_grad(const ft_attn_mod *m, double x)
{
    if (m->softcap > 0) {
        const double t = tanh(x / m->softcap);
        return 1.0 - t * t;
    }
    return 1.0;
}

/* Dropout's random number u_ij, 32 bits, is drawn in two parts, so that a
 * GPU makes one Philox call for sixteen scores and not four:
 *   primary   Philox 4x32-10 at counter {j / 16, i, bh, offset | 2^31}:
 *             byte j % 16 of its 16 output bytes (byte k: bits 8 (k % 4)
 *             .. + 7 of word k / 4) is u's top 8 bits;
 *   secondary Philox 4x32-10 at counter {j / 4, i | 2^31, bh,
 *             offset | 2^31}: the top 24 bits of word j % 4 are u's low
 *             24 bits.
 * P_ij is kept when u >= floor(p 2^32), a full 32-bit comparison (the keep
 * rate is exact), but the secondary call is made only when the top byte
 * equals the threshold's (1 score in 256): otherwise the byte decides.
 * Both under key {seed low, seed high}; bh = b H + h. Word 1 tells the two
 * apart (i < 2^31); bit 31 of word 3, both from ft_rand's stream (whose
 * words 2 and 3 are zero). */
static inline FT_HOST_DEVICE ft_philox4 ft_drop_primary(uint64_t seed, uint32_t offset,
                                                        uint32_t bh, uint32_t i, uint32_t j)
{
    const uint32_t counter[4] = {j >> 4, i, bh, offset | 0x80000000u};
    const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    return ft_philox4x32_10(counter, key);
}

static inline FT_HOST_DEVICE ft_philox4 ft_drop_secondary(uint64_t seed, uint32_t offset,
                                                          uint32_t bh, uint32_t i, uint32_t j)
{
    const uint32_t counter[4] = {j >> 2, i | 0x80000000u, bh, offset | 0x80000000u};
    const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    return ft_philox4x32_10(counter, key);
}

/* Whether dropout keeps (i, j) of bh with threshold floor(p 2^32). */
static inline FT_HOST_DEVICE int ft_drop_keep(uint64_t seed, uint32_t offset, uint32_t threshold,
                                              uint32_t bh, uint32_t i, uint32_t j)
{
    const ft_philox4 w = ft_drop_primary(seed, offset, bh, i, j);
    const uint32_t top = (w.v[(j >> 2) & 3] >> 8 * (j & 3)) & 0xffu, t = threshold >> 24;
    if (top != t)
        return top > t;
    const ft_philox4 s = ft_drop_secondary(seed, offset, bh, i, j);
    return (t << 24 | s.v[j & 3] >> 8) >= threshold;
}

/* Whether dropout keeps P_ij of batch b and head h (H heads). */
static inline FT_HOST_DEVICE int ft_mod_keep(const ft_attn_mod *m, int64_t b, int64_t H,
                                             int64_t h, int64_t i, int64_t j)
{
    if (!m->dropout)
        return 1;
    return ft_drop_keep(m->seed, m->offset, m->drop_threshold, (uint32_t)(b * H + h),
                        (uint32_t)i, (uint32_t)j);
}

#endif
