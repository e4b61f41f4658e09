/*
 * philox.h - the counter-based generator behind ft_rand / ft_randn.
 *
 * Philox 4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as
 * easy as 1, 2, 3", SC'11), with the constants of the Random123 library, so
 * the known-answer vectors of Random123 (tests/kat_vectors) apply. Every
 * function here is a pure `static inline` function of its arguments, usable
 * from C and, through FT_HOST_DEVICE, from a CUDA kernel: the CPU code and a
 * future GPU kernel then draw the same numbers from the same (seed, offset,
 * element index).
 *
 * The stream of flashtile (what ft_rand / ft_randn promise):
 *   key     = {seed & 0xffffffff, seed >> 32}
 *   block b = offset + i / 4 (a 64-bit counter, wrapping modulo 2^64) in
 *             counter words 0 (low 32 bits) and 1 (high 32 bits); words 2
 *             and 3 are zero
 *   element i takes output word i % 4 of Philox(block b, key)
 *   uniform = (word >> 8) * 2^-24, in [0, 1), exact in f32
 *   normal  = Box-Muller on the pairs of words (0, 1) and (2, 3) of a
 *             block: the even lane of a pair takes the cos branch, the odd
 *             lane the sin branch.
 */
#ifndef FT_PHILOX_H
#define FT_PHILOX_H

#include <math.h>
#include <stdint.h>

#ifdef __CUDACC__
#define FT_HOST_DEVICE __host__ __device__
#else
#define FT_HOST_DEVICE
#endif

/* Round multipliers and key increments (Weyl sequence: the golden ratio
 * and sqrt(3) - 1, as 32-bit fractions) of Random123's philox4x32. */
#define FT_PHILOX_M0 0xD2511F53u
#define FT_PHILOX_M1 0xCD9E8D57u
#define FT_PHILOX_W0 0x9E3779B9u
#define FT_PHILOX_W1 0xBB67AE85u
#define FT_PHILOX_ROUNDS 10

/* Output words per Philox block: each block serves this many elements. */
#define FT_PHILOX_LANES 4

/* A uniform keeps the top 24 bits of a word: 24 bits fit the f32
 * significand, so k * 2^-24 (0 <= k < 2^24) is exact in f32. */
#define FT_PHILOX_UNIFORM_SHIFT 8
#define FT_PHILOX_UNIFORM_SCALE (1.0f / 16777216.0f) /* 2^-24 */

#define FT_PHILOX_TWO_PI 6.283185307179586476925286766559

/* Four 32-bit words: a Philox counter or its output. */
typedef struct ft_philox4 {
    uint32_t v[4];
} ft_philox4;

/* The high and low halves of the 64-bit product a * b. */
static inline FT_HOST_DEVICE void ft_philox_mulhilo(uint32_t a, uint32_t b,
                                                    uint32_t *hi,
                                                    uint32_t *lo)
{
    uint64_t p = (uint64_t)a * (uint64_t)b;
    *hi = (uint32_t)(p >> 32);
    *lo = (uint32_t)p;
}

/* One Philox round: two multiplications mix words 0 and 2; the high
 * halves are xored with words 1 and 3 and the round key, and the words
 * are permuted so every word is multiplied within two rounds. */
static inline FT_HOST_DEVICE ft_philox4 ft_philox_round(ft_philox4 c,
                                                        uint32_t k0,
                                                        uint32_t k1)
{
    uint32_t hi0, lo0, hi1, lo1;
    ft_philox_mulhilo(FT_PHILOX_M0, c.v[0], &hi0, &lo0);
    ft_philox_mulhilo(FT_PHILOX_M1, c.v[2], &hi1, &lo1);
    ft_philox4 r;
    r.v[0] = hi1 ^ c.v[1] ^ k0;
    r.v[1] = lo1;
    r.v[2] = hi0 ^ c.v[3] ^ k1;
    r.v[3] = lo0;
    return r;
}

/* Philox 4x32 with 10 rounds: the four output words for counter[4] under
 * key[2]. The key is bumped by the Weyl increments between rounds. */
static inline FT_HOST_DEVICE ft_philox4
ft_philox4x32_10(const uint32_t counter[4], const uint32_t key[2])
{
    ft_philox4 c;
    for (int w = 0; w < 4; w++)
        c.v[w] = counter[w];
    uint32_t k0 = key[0], k1 = key[1];
    for (int r = 0; r < FT_PHILOX_ROUNDS; r++) {
        if (r > 0) {
            k0 += FT_PHILOX_W0;
            k1 += FT_PHILOX_W1;
        }
        c = ft_philox_round(c, k0, k1);
    }
    return c;
}

/* A word as a uniform float in [0, 1): its top 24 bits times 2^-24. */
static inline FT_HOST_DEVICE float ft_philox_uniform(uint32_t x)
{
    return (float)(x >> FT_PHILOX_UNIFORM_SHIFT) * FT_PHILOX_UNIFORM_SCALE;
}

/* Box-Muller: two uniforms in [0, 1) to two independent standard normals,
 * z0 = r cos(theta) and z1 = r sin(theta). u_a is flipped to 1 - u_a, in
 * (0, 1] (exact in f32), so log never sees 0 and r stays finite (at most
 * sqrt(-2 log 2^-24) ~ 5.77). Computed in double; a device's libm may
 * differ from the host's in the last bit of a double, which rounding the
 * result to f32 or narrower almost always hides. */
static inline FT_HOST_DEVICE void ft_philox_box_muller(float u_a, float u_b,
                                                       double *z0,
                                                       double *z1)
{
    double u1 = (double)(1.0f - u_a);
    double r = sqrt(-2.0 * log(u1));
    double theta = FT_PHILOX_TWO_PI * (double)u_b;
    *z0 = r * cos(theta);
    *z1 = r * sin(theta);
}

/* ---- flashtile's stream ---- */

/* The Philox output of block number `block` of the stream of `seed`. */
static inline FT_HOST_DEVICE ft_philox4 ft_philox_block(uint64_t seed,
                                                        uint64_t block)
{
    const uint32_t counter[4] = {(uint32_t)block, (uint32_t)(block >> 32), 0,
                                 0};
    const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    return ft_philox4x32_10(counter, key);
}

/* The uniform of lane (0..3) of a block's output. */
static inline FT_HOST_DEVICE float ft_philox_lane_uniform(ft_philox4 b,
                                                          unsigned lane)
{
    return ft_philox_uniform(b.v[lane]);
}

/* The normal of lane (0..3) of a block's output: lanes (0, 1) and (2, 3)
 * are Box-Muller pairs; the even lane is the cos branch, the odd the sin. */
static inline FT_HOST_DEVICE double ft_philox_lane_normal(ft_philox4 b,
                                                          unsigned lane)
{
    unsigned first = lane & ~1u;
    double z0, z1;
    ft_philox_box_muller(ft_philox_uniform(b.v[first]),
                         ft_philox_uniform(b.v[first + 1]), &z0, &z1);
    return (lane & 1u) ? z1 : z0;
}

/* All four normals of a block, as ft_philox_lane_normal gives them one by
 * one, with one Box-Muller evaluation per pair. */
static inline FT_HOST_DEVICE void ft_philox_block_normals(ft_philox4 b,
                                                          double out[4])
{
    ft_philox_box_muller(ft_philox_uniform(b.v[0]), ft_philox_uniform(b.v[1]),
                         &out[0], &out[1]);
    ft_philox_box_muller(ft_philox_uniform(b.v[2]), ft_philox_uniform(b.v[3]),
                         &out[2], &out[3]);
}

/* Element i of the uniform stream (seed, offset). */
static inline FT_HOST_DEVICE float ft_random_uniform_at(uint64_t seed,
                                                        uint64_t offset,
                                                        uint64_t i)
{
    ft_philox4 b = ft_philox_block(seed, offset + i / FT_PHILOX_LANES);
    return ft_philox_lane_uniform(b, (unsigned)(i % FT_PHILOX_LANES));
}

/* Element i of the normal stream (seed, offset). */
static inline FT_HOST_DEVICE double ft_random_normal_at(uint64_t seed,
                                                        uint64_t offset,
                                                        uint64_t i)
{
    ft_philox4 b = ft_philox_block(seed, offset + i / FT_PHILOX_LANES);
    return ft_philox_lane_normal(b, (unsigned)(i % FT_PHILOX_LANES));
}

#endif /* FT_PHILOX_H */
