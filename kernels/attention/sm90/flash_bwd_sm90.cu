/*
 * flash_bwd_sm90.cu - the flash backward pass on Hopper's warpgroup matrix
 * products (wgmma, sm_90a), f16/bf16, every head dim up to 256: a dK/dV and
 * a dQ kernel, and *_wide_kernel for head dims 192 and 256. No atomics, so
 * the gradients are bitwise reproducible; D = rowsum(dO * O) and LSE in
 * log2 units come from flash_bwd.cu's dot kernel first.
 * Built with 90a, used as flash_fwd_sm90.cu is; needs Nq > 0 (the caller
 * checks).
 * Check: spec/cuda_attention_spec.lua (busted, tag gpu) against the CPU f64
 * reference; scripts/bench.lua checks, then times; scripts/profile.lua runs
 * one call for ncu. Design and measurements: kernels/README.md.
 */
#include "flash_wgmma.cuh"

#include <math.h>

#define FLASH_FILE "sm90/flash_bwd_sm90.cu" /* rtc.cu compiles it again for a Lua-written mod */

#define BWD_STAGES 3

/* 4 bytes global -> shared (LSE and D entries), zero-filled when !valid */
__device__ __forceinline__ void cp_async_4(void *dst, const void *src, bool valid)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 4 : 0)
                 : "memory");
}

/* Stores this warp's rows (row0 + g, + 8) of a 64 x D accumulator into
 * columns col0 .. col0+D-1 of a [B, N, heads, d] tensor, times `scale`;
 * rows past n and columns past d are skipped. */
template <typename T, int D>
__device__ __forceinline__ void store_acc(const FlashTensor &t, int b, int head, int row0,
                                          int n, int d, const float *acc, float scale,
                                          int col0 = 0)
{
    const int lane = threadIdx.x % FT_WARP, g = lane / 4, t4 = lane % 4;
    T *base = reinterpret_cast<T *>(t.data);
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row0 + g + 8 * r;
        if (row >= n)
            continue;
        T *dst = base + row_offset(t, b, row, head);
#pragma unroll
        for (int c = 0; c < D / 8; c++) {
            const int col = col0 + c * 8 + t4 * 2;
            if (col < d) /* d % 8 == 0: both columns or neither */
                *reinterpret_cast<uint32_t *>(dst + col) =
                    MmaType<T>::pack(acc[4 * c + 2 * r] * scale, acc[4 * c + 2 * r + 1] * scale);
        }
    }
}

/* The A fragments of the next product from 16 accumulator columns each. */
template <typename T, int N>
__device__ __forceinline__ void pack_frags(uint32_t (*f)[4], const float *acc)
{
#pragma unroll
    for (int kk = 0; kk < N / 16; kk++) {
        f[kk][0] = MmaType<T>::pack(acc[8 * kk + 0], acc[8 * kk + 1]);
        f[kk][1] = MmaType<T>::pack(acc[8 * kk + 2], acc[8 * kk + 3]);
        f[kk][2] = MmaType<T>::pack(acc[8 * kk + 4], acc[8 * kk + 5]);
        f[kk][3] = MmaType<T>::pack(acc[8 * kk + 6], acc[8 * kk + 7]);
    }
}

/* Zeroes the entries of an accumulator (this warp's rows row0 + g + 8 r,
 * r = 0, 1; columns col0 + 8 n + 2 t + e) where masked(r, col); r is a
 * constant once unrolled. Only blocks at an edge (the end of the sequence,
 * a mask's boundary) call it, outside the hot loop. */
template <int N, typename F>
__device__ __forceinline__ void mask_acc(float *acc, int col0, F masked)
{
    const int t4 = (threadIdx.x % FT_WARP) % 4;
#pragma unroll
    for (int i = 0; i < N; i++)
        if (masked((i / 2) % 2, col0 + (i / 4) * 8 + t4 * 2 + i % 2))
            acc[i] = 0.f;
}

/* The blocks of BM queries that a CTA of keys [j0, j1) walks (dK/dV), for
 * each query head of its GQA group in turn: those from the first query
 * that sees key j0 to the last query that sees key j1 - 1; total of them.
 * (h, i0) is the block at hand, next() steps to the following one without
 * a division. */
template <int BM> struct QueryWalk {
    int ib0, iend, total; /* blocks from query ib0 * BM to iend, per head */
    int h, i0;
    __device__ __forceinline__ QueryWalk(const FlashParams &p, int j0, int j1, int hk)
    {
        const int G = p.H / p.Hk;
        ib0 = flash_query_begin(p, j0) / BM;
        iend = flash_query_end(p, min(j1, p.Nk) - 1);
        const int per_head = (iend + BM - 1) / BM - ib0;
        total = per_head > 0 ? G * per_head : 0;
        h = hk * G;
        i0 = ib0 * BM;
    }
    __device__ __forceinline__ void next()
    {
        i0 += BM;
        if (i0 >= iend) {
            i0 = ib0 * BM;
            h++;
        }
    }
};

/* The query blocks of a QueryWalk, copied with cp.async: Q, dO, LSE (log2
 * units) and D of block t go into stage t % ST of `base`; one walk for the
 * copies, one for the arithmetic. */
template <typename T, int BM, int HD, int THREADS, int ST> struct QueryStream {
    static constexpr int Q_BYTES = BM * FT_TW(HD) * 2;
    static constexpr size_t BYTES = (size_t)ST * (2 * Q_BYTES + 2 * BM * sizeof(float));
    unsigned char *sQ, *sdO;
    float *sL, *sD;
    QueryWalk<BM> lw, cw; /* the next block to copy; the next the arithmetic takes */
    int total;
    int ch; /* the head of the block next_i0 returned last */
    __device__ __forceinline__ QueryStream(const FlashParams &p, unsigned char *base, int j0,
                                           int j1, int hk)
        : lw(p, j0, j1, hk), cw(lw), total(lw.total), ch(lw.h)
    {
        sQ = base;
        sdO = sQ + ST * Q_BYTES;
        sL = reinterpret_cast<float *>(sdO + ST * Q_BYTES);
        sD = sL + ST * BM;
    }
    /* copies the next block (block t) into its stage */
    __device__ __forceinline__ void load(const FlashParams &p, int b, int t)
    {
        const int h = lw.h, i0 = lw.i0, st = t % ST;
        lw.next();
        TileLoader<T, BM, HD, THREADS>(p.q, b, h, p.Nq, p.d).load(sQ + st * Q_BYTES, i0);
        TileLoader<T, BM, HD, THREADS>(p.dout, b, h, p.Nq, p.d).load(sdO + st * Q_BYTES, i0);
        const int tid = threadIdx.x;
        if (tid < 2 * BM) {
            const int r = tid % BM, row = i0 + r;
            const float *src = (tid < BM ? p.lse2 : p.D) + flash_stat(p, b, h);
            cp_async_4((tid < BM ? sL : sD) + st * BM + r, src + (row < p.Nq ? row : 0),
                       row < p.Nq);
        }
    }
    /* the first query of the next block the arithmetic takes */
    __device__ __forceinline__ int next_i0()
    {
        const int i0 = cw.i0;
        ch = cw.h;
        cw.next();
        return i0;
    }
    __device__ __forceinline__ uint32_t q(int t) const { return smem_addr(sQ + (t % ST) * Q_BYTES); }
    __device__ __forceinline__ uint32_t dout(int t) const
    {
        return smem_addr(sdO + (t % ST) * Q_BYTES);
    }
    __device__ __forceinline__ const float *lse(int t) const { return sL + (t % ST) * BM; }
    __device__ __forceinline__ const float *D(int t) const { return sD + (t % ST) * BM; }
};

/* LSE (log2 units; +inf past the end) and D of this thread's rows row0 + g
 * and row0 + g + 8 (dQ). */
__device__ __forceinline__ void row_stats(const FlashParams &p, int b, int h, int row0,
                                          float *lse, float *Dr)
{
    const int g = (threadIdx.x % FT_WARP) / 4;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row0 + g + 8 * r;
        const int64_t o = flash_stat(p, b, h) + row;
        lse[r] = row < p.Nq ? p.lse2[o] : INFINITY;
        Dr[r] = row < p.Nq ? p.D[o] : 0.f;
    }
}

/* dQ's dS = P (dP - D), in place of dp, for this thread's rows (row0 + g,
 * + 8) and N accumulator entries from key col0, P = exp2(S scale log2e -
 * LSE); in a block at an edge (keys [block_begin, block_end) not all in
 * `full`, the keys every row sees), hidden keys are zeroed. With EXT, S is
 * modified first and dS takes the modification's derivative. */
template <typename T, int N, bool EXT, typename UM>
__device__ __forceinline__ void dq_dscores(const FlashParams &p, const ScoreMod &smod, int b,
                                           int h, float *dp, float *s, const float *lse,
                                           const float *Dr, int row0, int col0,
                                           const FullKeys &full, int block_begin, int block_end)
{
    if (EXT) /* S modified, and g (Z dP - D) in place of dP - D */
        with_dropout<UM>(p, [&](auto drop) {
            const uint64_t bits = decltype(drop)::value ? keep_bits<N>(p, b, h, row0, col0) : 0;
            mod_acc_with<N, false, fast_tanh<T>(), UM>(smod, s, row0, col0, [&](int k, float d0, float d1) {
                const float z0 = decltype(drop)::value ? drop_factor(p, bits, 2 * k) : 1.f;
                const float z1 = decltype(drop)::value ? drop_factor(p, bits, 2 * k + 1) : 1.f;
                dp[2 * k] = d0 * (z0 * dp[2 * k] - Dr[k % 2]);
                dp[2 * k + 1] = d1 * (z1 * dp[2 * k + 1] - Dr[k % 2]);
            });
        });
    else if (UM::on) /* a Lua-written mask alone: no derivative */
        mod_acc<N, false, fast_tanh<T>(), UM, false>(smod, s, row0, col0);
#pragma unroll
    for (int n = 0; n < N / 4; n++)
#pragma unroll
        for (int r = 0; r < 2; r++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int idx = 4 * n + 2 * r + e;
                dp[idx] = ex2(fmaf(s[idx], p.scale_log2, -lse[r])) *
                          (EXT ? dp[idx] : dp[idx] - Dr[r]);
            }
    if (full.masks(block_begin, block_end)) {
        const int row = row0 + (threadIdx.x % FT_WARP) / 4;
        const KeyRange k0 = flash_keys(p, row), k1 = flash_keys(p, row + 8);
        mask_acc<N>(dp, col0, [&](int r, int col) { return r ? k1.hides(col) : k0.hides(col); });
    }
}

/* The start of a dQ kernel: copies this CTA's BR rows of Q and dO and the
 * first K, V block (keys from key0, into the stages at sK and sV; one
 * commit group). */
template <typename T, int BR, int BC, int D, int THREADS>
__device__ __forceinline__ void dq_prologue(const FlashParams &p, int b, int h, int i0,
                                            unsigned char *sQ, unsigned char *sdO,
                                            const TileLoader<T, BC, D, THREADS> &kload,
                                            const TileLoader<T, BC, D, THREADS> &vload,
                                            unsigned char *sK, unsigned char *sV, int key0)
{
    TileLoader<T, BR, D, THREADS>(p.q, b, h, p.Nq, p.d).load(sQ, i0);
    TileLoader<T, BR, D, THREADS>(p.dout, b, h, p.Nq, p.d).load(sdO, i0);
    kload.load(sK, key0);
    vload.load(sV, key0);
    cp_async_commit();
}

/* ---- shared memory ----
 *
 * Each kernel's layout, for the kernel and its launcher, in bytes after up
 * to 1024 bytes of alignment (the swizzle is on address bits), rows TW wide
 * (16-bit, swizzled).
 * dK/dV: K, V [BN], the query stream's stages, then (EXT) each thread's
 * words of the modification's derivatives (dkdv_mod_bytes).
 * dQ: Q, dO [BR], then ST stages of K, then ST of V [BC].
 * Wide dK/dV: K, V [64][256], P and dS [64][64], the query stream's stages.
 * Wide dQ: Q, dO [64][256], two stages of K and of V, then the swap's
 * buffer (2 x 128 threads x 16 floats). */
template <int D, int BR, int BC, int ST> struct Sm90DqSmem {
    static constexpr int TW = FT_TW(D), Q_BYTES = BR * TW * 2, KV_BYTES = BC * TW * 2;
    static constexpr int DO = Q_BYTES, K = 2 * Q_BYTES, V = K + ST * KV_BYTES;
    static constexpr int END = V + ST * KV_BYTES;
    static constexpr size_t bytes = 1024 + (size_t)END;
};

/* ---- dK, dV ---- */

/* With EXT, each thread keeps the modification's derivatives of one block
 * (BM / 2 entries, f16 pairs) in shared memory from P^T to dS^T, in a place
 * of its own (word k of thread t at k * THREADS + t): registers are what
 * these kernels run short of. Bytes after the query stream's stages. */
template <int BM, int THREADS, bool EXT> constexpr size_t dkdv_mod_bytes()
{
    return EXT ? (size_t)THREADS * (BM / 4) * sizeof(uint32_t) : 0;
}

template <typename T, int D, int BM, int NWG, bool EXT> struct Sm90DkdvSmem {
    static constexpr int BN = 64 * NWG, THREADS = NWG * WG_THREADS, ST = BWD_STAGES;
    using Stream = QueryStream<T, BM, D, THREADS, ST>;
    static constexpr int KV_BYTES = BN * FT_TW(D) * 2;
    static constexpr int V = KV_BYTES, STREAM = 2 * KV_BYTES;
    static constexpr size_t MOD = STREAM + Stream::BYTES;
    static constexpr size_t bytes = 1024 + MOD + dkdv_mod_bytes<BM, THREADS, EXT>();
};

template <typename T> struct Sm90WideDkdvSmem {
    static constexpr int KV_BYTES = 64 * 256 * 2, P_BYTES = 64 * 64 * 2;
    using Stream = QueryStream<T, 64, 256, 2 * WG_THREADS, 2>;
    static constexpr int V = KV_BYTES, P = 2 * KV_BYTES, DS = P + P_BYTES, STREAM = DS + P_BYTES;
    static constexpr size_t bytes = 1024 + STREAM + Stream::BYTES;
};

/* the wide dQ: the swap's buffer after the dQ layout */
using Sm90WideDqSmem = Sm90DqSmem<256, 64, 64, 2>;
static constexpr size_t SM90_WIDE_DQ_BYTES =
    Sm90WideDqSmem::bytes + 2 * WG_THREADS * 16 * sizeof(float);

/* A dK/dV warpgroup's 64 keys (each thread: keys g and g + 8 of its warp's
 * 16, from wkey0) against one block of BM queries, as both dK/dV kernels
 * run them. probs: P^T (rows keys, columns queries) from S^T, straight
 * into the A fragments of dV += P^T dO; dscores: dS^T = P^T (dP^T - D)
 * into the A fragments of dK += dS^T Q, taking P from pf (rounded to 16
 * bits, as the naive path rounds it), which keeps S^T and dP^T from being
 * live together. With EXT, what dS^T needs besides pf waits in gmod
 * between the two (word k of this thread at k * THREADS), as gmode says:
 * 0, nothing (ALiBi, varlen: the derivative is 1, and dS^T is the plain
 * kernel's); 1, the modification's derivatives g (a softcap, a Lua score),
 * which dscores multiplies into pf's P; 2 (dropout, where pf holds the
 * kept probabilities that dV takes), P g. */
template <typename T, int BM, int THREADS, bool EXT, typename UM> struct DkdvRows {
    const FlashParams &p;
    const int b, wkey0, lane, t4;
    const FullKeys full;
    uint32_t *const gmod;
    const int gmode;
    uint64_t kbits; /* dropout: the keep bits of the block's entries */
    int slope_h;    /* the head whose ALiBi slope is in slope (the walk's
                     * heads change seldom: one load and division each) */
    float slope;
    __device__ __forceinline__ DkdvRows(const FlashParams &p_, int b_, int wkey0_, uint32_t *gmod_)
        : p(p_), b(b_), wkey0(wkey0_), lane(threadIdx.x % FT_WARP), t4(lane % 4),
          full(flash_full_queries(p_, wkey0_, wkey0_ + 16)), gmod(gmod_),
          gmode(!EXT             ? 0
                : flash_dropout<UM>(p_) ? 2
                : p_.mod.softcap > 0 || (UM::has_score && !UM::unit_grad) ? 1
                                                                           : 0),
          kbits(0), slope_h(-1), slope(0.f)
    {
    }

    /* block (h, i0), its LSE in L */
    __device__ __forceinline__ void probs(float *s, uint32_t (*pf)[4], int i0, int h,
                                          const float *L)
    {
        pin_all<BM / 2>(s);
        const bool edge = full.masks(i0, i0 + BM);
        if (EXT && UM::builtin_scores && h != slope_h) {
            slope = flash_alibi_slope(p, b, h);
            slope_h = h;
        }
        if (EXT && gmode != 0)
            mod_acc_with<BM / 2, true, fast_tanh<T>(), UM>(
                flash_score_mod(p, b, h, slope), s, wkey0, i0, [&](int k, float d0, float d1) {
                    const __half2 g2 = __floats2half2_rn(d0, d1);
                    gmod[k * THREADS] = *reinterpret_cast<const uint32_t *>(&g2);
                });
        else if (EXT) /* a derivative of 1 */
            mod_acc<BM / 2, true, fast_tanh<T>(), UM>(flash_score_mod(p, b, h, slope), s, wkey0, i0);
        else if (UM::on) /* a Lua-written mask alone: no derivative */
            mod_acc<BM / 2, true, fast_tanh<T>(), UM, false>(flash_score_mod(p, b, h), s, wkey0, i0);
        const float sl2 = p.scale_log2;
#pragma unroll
        for (int n = 0; n < BM / 8; n++) {
            const int col = n * 8 + t4 * 2;
            const float2 l2 = *reinterpret_cast<const float2 *>(L + col);
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const float lse = e ? l2.y : l2.x;
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    const int idx = 4 * n + 2 * r + e;
                    s[idx] = ex2(fmaf(s[idx], sl2, -lse));
                }
            }
        }
        if (edge) {
            const int key = wkey0 + lane / 4;
            const QueryRange q0 = flash_queries(p, key), q1 = flash_queries(p, key + 8);
            mask_acc<BM / 2>(s, i0, [&](int r, int qi) { return r ? q1.hides(qi) : q0.hides(qi); });
        }
        /* dropout: gmod gets P g as dS^T takes it (16 bits, as pf), pf the
         * kept probabilities */
        if (EXT && gmode == 2) {
            kbits = keep_bits<BM / 2, true>(p, b, h, wkey0, i0);
#pragma unroll
            for (int k = 0; k < BM / 4; k++) {
                const uint32_t gw = gmod[k * THREADS];
                const float2 g2 = __half22float2(*reinterpret_cast<const __half2 *>(&gw));
                gmod[k * THREADS] = MmaType<T>::pack(s[2 * k] * g2.x, s[2 * k + 1] * g2.y);
                s[2 * k] *= drop_factor(p, kbits, 2 * k);
                s[2 * k + 1] *= drop_factor(p, kbits, 2 * k + 1);
            }
        }
        pack_frags<T, BM>(pf, s);
    }

    /* the block's D in Dq */
    __device__ __forceinline__ void dscores(float *dp, const uint32_t (*pf)[4], uint32_t (*df)[4],
                                            const float *Dq)
    {
        pin_all<BM / 2>(dp);
        auto body = [&](auto mode) {
            constexpr int M = decltype(mode)::value;
#pragma unroll
            for (int kk = 0; kk < BM / 16; kk++)
#pragma unroll
                for (int w = 0; w < 4; w++) {
                    /* fragment register w: row g + 8 (w % 2), columns 16 kk + 8 (w / 2) + 2 t4,
                     * entries idx, idx + 1; in gmode's word idx / 2 of gmod */
                    const int idx = 8 * kk + 2 * w;
                    float2 pp = MmaType<T>::unpack(M == 2 ? gmod[(idx / 2) * THREADS] : pf[kk][w]);
                    if (M == 1) {
                        const uint32_t gw = gmod[(idx / 2) * THREADS];
                        const float2 g2 = __half22float2(*reinterpret_cast<const __half2 *>(&gw));
                        pp.x *= g2.x;
                        pp.y *= g2.y;
                    }
                    const float2 d2 =
                        *reinterpret_cast<const float2 *>(Dq + 16 * kk + 8 * (w / 2) + 2 * t4);
                    float x0 = dp[idx], x1 = dp[idx + 1];
                    if (M == 2) {
                        x0 *= drop_factor(p, kbits, idx);
                        x1 *= drop_factor(p, kbits, idx + 1);
                    }
                    df[kk][w] = MmaType<T>::pack(pp.x * (x0 - d2.x), pp.y * (x1 - d2.y));
                }
        };
        if (EXT && gmode == 2)
            body(IntC<2>());
        else if (EXT && gmode == 1)
            body(IntC<1>());
        else
            body(IntC<0>());
    }
};

/* The dK/dV loop of a warpgroup over `total` query blocks: block t is
 * S^T_t with dK += dS^T_{t-1} Q_{t-1} (P^T_t computed meanwhile), then
 * dP^T_t with dV += P^T_t dO_t (dS^T_t computed meanwhile). top(t) makes
 * block t's stage ready, q(t) and dout(t) give its tiles, probs(t) and
 * dscores(t) run the block's DkdvRows steps, done(t) says that no product
 * reads block t's stage any more. K and V: this warpgroup's 64 rows of
 * BN-row tiles at k_addr and v_addr. */
template <typename T, int D, int DK, int BM, int BN, bool TURNS, typename Top, typename TileQ,
          typename TileDO, typename Probs, typename Dscores, typename Done>
__device__ __forceinline__ void dkdv_loop(int total, const Turns<TURNS> &turns, float *s, float *dp,
                                          uint32_t (*pf)[4], uint32_t (*df)[4], float *dk,
                                          float *dv, uint32_t k_addr, uint32_t v_addr, Top top,
                                          TileQ q_tile, TileDO do_tile, Probs probs, Dscores dscores,
                                          Done done)
{
    auto second_half = [&](int t) {
        wgmma_fence();
        turns.wait();
        product_abt<T, BM, DK, BN, BM>(dp, v_addr, do_tile(t));
        wgmma_commit();
        product_fb<T, BM, D>(dv, pf, do_tile(t));
        wgmma_commit();
        turns.pass();
        wgmma_wait<1>();
        dscores(t);
        wgmma_wait<0>();
        pin_all<D / 2>(dv);
    };
    top(0);
    wgmma_fence();
    turns.wait();
    product_abt<T, BM, DK, BN, BM>(s, k_addr, q_tile(0));
    wgmma_commit();
    turns.pass();
    wgmma_wait<0>();
    probs(0);
    second_half(0);
    for (int t = 1; t < total; t++) {
        top(t);
        wgmma_fence();
        turns.wait();
        product_abt<T, BM, DK, BN, BM>(s, k_addr, q_tile(t));
        wgmma_commit();
        product_fb<T, BM, D>(dk, df, q_tile(t - 1));
        wgmma_commit();
        turns.pass();
        wgmma_wait<1>();
        probs(t);
        wgmma_wait<0>();
        pin_all<D / 2>(dk);
        done(t - 1);
        second_half(t);
    }
    wgmma_fence();
    turns.wait();
    product_fb<T, BM, D>(dk, df, q_tile(total - 1));
    wgmma_commit();
    turns.pass(true);
    wgmma_wait<0>();
    pin_all<D / 2>(dk);
    done(total - 1);
}

template <typename T, int D, int DK, int BM, int NWG, bool TURNS, bool EXT,
          typename UM = NoUserMod>
__global__ void __launch_bounds__(NWG *WG_THREADS, 1) flash_bwd_dkdv_wgmma_kernel(FlashParams p)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using L = Sm90DkdvSmem<T, D, BM, NWG, EXT>;
    constexpr int BN = L::BN, THREADS = L::THREADS;
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    unsigned char *const sK = smem, *const sV = smem + L::V;

    const int tid = threadIdx.x, wg = tid / WG_THREADS;
    const int wwarp = (tid / FT_WARP) % 4;
    const int j0 = blockIdx.x * BN, hk = blockIdx.y, b = blockIdx.z;
    if (EXT) { /* varlen: this CTA's sequence; past its end, nothing to do */
        flash_enter_seq(p, b);
        if (j0 >= p.Nk)
            return;
    }
    const int wkey0 = j0 + wg * 64 + wwarp * 16; /* this warp's first key */
    typename L::Stream qs(p, smem + L::STREAM, j0, j0 + BN, hk);
    const int total = qs.total;
    float dk[D / 2], dv[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; i++)
        dk[i] = dv[i] = 0.f;
    if (total == 0) { /* no query sees these keys: dK = dV = 0 */
        store_acc<T, D>(p.dk, b, hk, wkey0, p.Nk, p.d, dk, 1.f);
        store_acc<T, D>(p.dv, b, hk, wkey0, p.Nk, p.d, dv, 1.f);
        return;
    }
    TileLoader<T, BN, D, THREADS>(p.k, b, hk, p.Nk, p.d).load(sK, j0);
    TileLoader<T, BN, D, THREADS>(p.v, b, hk, p.Nk, p.d).load(sV, j0);
    qs.load(p, b, 0);
    cp_async_commit();

    float s[BM / 2], dp[BM / 2];
    uint32_t pf[BM / 16][4], df[BM / 16][4];
    DkdvRows<T, BM, THREADS, EXT, UM> rows(p, b, wkey0,
                                           reinterpret_cast<uint32_t *>(smem + L::MOD) + tid);
    dkdv_loop<T, D, DK, BM, BN>(
        total, Turns<TURNS>(wg), s, dp, pf, df, dk, dv, smem_addr(sK) + wg * 64 * 128,
        smem_addr(sV) + wg * 64 * 128,
        [&](int t) {
            stages_ready();
            if (t + 1 < total)
                qs.load(p, b, t + 1);
            cp_async_commit();
        },
        [&](int t) { return qs.q(t); }, [&](int t) { return qs.dout(t); },
        [&](int t) {
            const int i0 = qs.next_i0();
            rows.probs(s, pf, i0, qs.ch, qs.lse(t));
        },
        [&](int t) { rows.dscores(dp, pf, df, qs.D(t)); }, [](int) {});
    cp_async_wait<0>();

    store_acc<T, D>(p.dk, b, hk, wkey0, p.Nk, p.d, dk, p.scale);
    store_acc<T, D>(p.dv, b, hk, wkey0, p.Nk, p.d, dv, 1.f);
#endif
}

/* The warp-specialised backward kernels' pieces: a consumer warp's rows
 * of a gradient no query (key) reaches, as zeros; and the barriers of a
 * ring of ST stages (a full barrier expecting full_count arrivals and an
 * empty one expecting empty_count each, 8 bytes apart), with `once` (the
 * tiles copied once) expecting one, made visible to the copy engine
 * (thread 0, before a CTA barrier). */
template <typename T, int D>
__device__ __forceinline__ void store_zero_rows(const FlashTensor &t, int b, int head, int row0,
                                                int n, int d)
{
    float zero[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; i++)
        zero[i] = 0.f;
    store_acc<T, D>(t, b, head, row0, n, d, zero, 1.f);
}
template <int ST> struct RingBars { /* their offsets after a layout's BAR */
    static constexpr int ONCE = 0, FULL = 8, EMPTY = FULL + 8 * ST, BYTES = EMPTY + 8 * ST;
};
__device__ __forceinline__ void ring_init(uint32_t once, uint32_t full, uint32_t empty, int st,
                                          int full_count, int empty_count)
{
    mbar_init(once, 1);
    for (int i = 0; i < st; i++) {
        mbar_init(full + 8 * i, full_count);
        mbar_init(empty + 8 * i, empty_count);
    }
    mbar_init_fence();
}

/* The warp-specialised dK/dV kernel's tensor maps: q and dO with boxes of
 * BM rows, k and v of BN (= 128). */
struct BwdMaps {
    FlashTmaMap q, k, v, dout;
};

/* Its shared memory: K, V [128 rows], ST stages of Q, then of dO [BM
 * rows], then of LSE and of D [BM floats], (EXT) the modification's
 * derivatives, then the barriers: K/V full, and full and empty for each
 * stage. */
template <int D, int BM, int ST, bool EXT> struct Sm90WsDkdvSmem : RingBars<ST> {
    static constexpr int BN = 128, TW = FT_TW(D), THREADS = 2 * WG_THREADS;
    static constexpr int KV_BYTES = BN * TW * 2, Q_BYTES = BM * TW * 2;
    static constexpr int V = KV_BYTES, Q = 2 * KV_BYTES, DO = Q + ST * Q_BYTES;
    static constexpr int LSE = DO + ST * Q_BYTES, DD = LSE + ST * BM * 4, MOD = DD + ST * BM * 4;
    static constexpr int BAR = MOD + (int)dkdv_mod_bytes<BM, THREADS, EXT>();
    static constexpr size_t bytes = 1024 + (size_t)BAR + RingBars<ST>::BYTES;
};

/* dK/dV in the forward's warp-specialised structure: warpgroup 0 the
 * producer, whose first warp copies K and V once and then, per query
 * block, Q and dO through the copy engine and LSE and D by its lanes'
 * cp.async into a ring of ST stages (lane 0 announces the copy engine's
 * bytes on the stage's full barrier, and each lane arrives on it once its
 * own copies have landed); warpgroups 1 and 2 the consumers, 64 keys
 * each, which run dkdv_loop on DkdvRows and hand a stage back once dK's
 * product with its Q is done: every consumer thread arrives on the empty
 * barrier, since an arrival releases only its own thread's loads of LSE
 * and D (one arrival a warp after __syncwarp left the loads of the other
 * lanes unordered for compute-sanitizer's racecheck; 256 arrivals cost
 * nothing measurable, 0.93x-1.05x, median 1.00x). No CTA-wide barrier after the start. Not for varlen (the boxes
 * would run into the next sequence). */
template <typename T, int D, int DK, int BM, int ST, bool TURNS, bool EXT,
          typename UM = NoUserMod>
__global__ void __launch_bounds__(3 * WG_THREADS, 1)
    flash_bwd_dkdv_ws_kernel(const FlashParams p, const __grid_constant__ BwdMaps maps)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using L = Sm90WsDkdvSmem<D, BM, ST, EXT>;
    constexpr int BN = L::BN, Q_BYTES = L::Q_BYTES;
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    const uint32_t sK = smem_addr(smem), sV = sK + L::V, sQ = sK + L::Q, sdO = sK + L::DO;
    const uint32_t bar = sK + L::BAR;
    float *const sL = reinterpret_cast<float *>(smem + L::LSE);
    float *const sD = reinterpret_cast<float *>(smem + L::DD);

    const int tid = threadIdx.x, wg = tid / WG_THREADS;
    const int j0 = blockIdx.x * BN, hk = blockIdx.y, b = blockIdx.z;
    QueryWalk<BM> walk(p, j0, j0 + BN, hk);
    const int total = walk.total;
    const int wkey0 = j0 + (wg - 1) * 64 + (tid / FT_WARP) % 4 * 16; /* a consumer warp's */
    if (total == 0) { /* no query sees these keys: dK = dV = 0 */
        if (wg > 0) {
            store_zero_rows<T, D>(p.dk, b, hk, wkey0, p.Nk, p.d);
            store_zero_rows<T, D>(p.dv, b, hk, wkey0, p.Nk, p.d);
        }
        return;
    }
    const int chunks = (p.d + 63) / 64; /* copied; the tiles' other columns are never read */
    if (tid == 0) /* full: the producer's lanes; empty: every consumer thread */
        ring_init(bar + L::ONCE, bar + L::FULL, bar + L::EMPTY, ST, FT_WARP, 2 * WG_THREADS);
    __syncthreads();

    if (wg == 0) { /* the producer */
        regs_dec<24>();
        const int lane = tid;
        if (tid >= FT_WARP)
            return;
        if (lane == 0) {
            mbar_expect(bar + L::ONCE, 2 * chunks * BN * 128);
            for (int c = 0; c < chunks; c++) {
                tma_load_4d(sK + c * BN * 128, &maps.k, bar + L::ONCE, c * 64, hk, j0, b);
                tma_load_4d(sV + c * BN * 128, &maps.v, bar + L::ONCE, c * 64, hk, j0, b);
            }
        }
        for (int t = 0; t < total; t++, walk.next()) {
            const int st = t % ST;
            const uint32_t full = bar + L::FULL + 8 * st;
            mbar_wait(bar + L::EMPTY + 8 * st, ((t / ST) & 1) ^ 1);
            if (lane == 0) {
                mbar_expect_tx(full, 2 * chunks * BM * 128);
                for (int c = 0; c < chunks; c++) {
                    tma_load_4d(sQ + st * Q_BYTES + c * BM * 128, &maps.q, full, c * 64, walk.h,
                                walk.i0, b);
                    tma_load_4d(sdO + st * Q_BYTES + c * BM * 128, &maps.dout, full, c * 64,
                                walk.h, walk.i0, b);
                }
            }
            const int64_t o = flash_stat(p, b, walk.h) + walk.i0;
            const int left = p.Nq - walk.i0; /* rows past it: zeros, as in QueryStream */
#pragma unroll
            for (int r = lane; r < BM; r += FT_WARP) {
                cp_async_4(sL + st * BM + r, p.lse2 + o + (r < left ? r : 0), r < left);
                cp_async_4(sD + st * BM + r, p.D + o + (r < left ? r : 0), r < left);
            }
            cp_async_commit();
            cp_async_wait<0>();
            mbar_arrive(full); /* after this lane's copies have landed (a release) */
        }
    } else { /* the consumers */
        regs_inc<240>();
        const int cwg = wg - 1;
        float dk[D / 2], dv[D / 2], s[BM / 2], dp[BM / 2];
        uint32_t pf[BM / 16][4], df[BM / 16][4];
#pragma unroll
        for (int i = 0; i < D / 2; i++)
            dk[i] = dv[i] = 0.f;
        DkdvRows<T, BM, L::THREADS, EXT, UM> rows(
            p, b, wkey0, reinterpret_cast<uint32_t *>(smem + L::MOD) + tid - WG_THREADS);
        mbar_wait(bar + L::ONCE, 0);
        dkdv_loop<T, D, DK, BM, BN>(
            total, Turns<TURNS>(cwg), s, dp, pf, df, dk, dv, sK + cwg * 64 * 128,
            sV + cwg * 64 * 128,
            [&](int t) { mbar_wait(bar + L::FULL + 8 * (t % ST), (t / ST) & 1); },
            [&](int t) { return sQ + (t % ST) * Q_BYTES; },
            [&](int t) { return sdO + (t % ST) * Q_BYTES; },
            [&](int t) {
                rows.probs(s, pf, walk.i0, walk.h, sL + (t % ST) * BM);
                walk.next();
            },
            [&](int t) { rows.dscores(dp, pf, df, sD + (t % ST) * BM); },
            [&](int t) { /* this thread's reads of the stage are done */
                mbar_arrive(bar + L::EMPTY + 8 * (t % ST));
            });
        store_acc<T, D>(p.dk, b, hk, wkey0, p.Nk, p.d, dk, p.scale);
        store_acc<T, D>(p.dv, b, hk, wkey0, p.Nk, p.d, dv, 1.f);
    }
#endif
}

/* ---- dQ ---- */

/* The dQ loop of a warpgroup over key blocks kb0 .. nkb - 1: block j is S_j
 * and dP_j (Q and dO of this warpgroup's rows at q_addr, do_addr in
 * BR-row tiles) with dQ += dS_{j-1} K_{j-1}, then dS_j. top(j) makes block
 * j's stage ready, k_tile(j) and v_tile(j) give its tiles, elementwise(j)
 * turns S_j and dP_j into dS_j (in dp), done(j) says that no product reads
 * block j's stage any more. */
template <typename T, int D, int DK, int BR, int BC, bool TURNS, typename Top, typename TileK,
          typename TileV, typename Elementwise, typename Done>
__device__ __forceinline__ void dq_loop(int kb0, int nkb, const Turns<TURNS> &turns, float *s,
                                        float *dp, uint32_t (*df)[4], float *dq, uint32_t q_addr,
                                        uint32_t do_addr, Top top, TileK k_tile, TileV v_tile,
                                        Elementwise elementwise, Done done)
{
    auto issue_scores = [&](int j) {
        product_abt<T, BC, DK, BR, BC>(s, q_addr, k_tile(j));
        product_abt<T, BC, DK, BR, BC>(dp, do_addr, v_tile(j));
        wgmma_commit();
    };
    auto issue_grad = [&](int j) {
        product_fb<T, BC, D>(dq, df, k_tile(j));
        wgmma_commit();
    };
    top(kb0);
    wgmma_fence();
    turns.wait();
    issue_scores(kb0);
    turns.pass();
    wgmma_wait<0>();
    pin_all<BC / 2>(s);
    pin_all<BC / 2>(dp);
    elementwise(kb0);
    pack_frags<T, BC>(df, dp);
    for (int j = kb0 + 1; j < nkb; j++) {
        top(j);
        wgmma_fence();
        turns.wait();
        issue_scores(j);
        issue_grad(j - 1);
        turns.pass();
        wgmma_wait<1>(); /* block j's scores are done; j-1's dQ product may run */
        pin_all<BC / 2>(s);
        pin_all<BC / 2>(dp);
        elementwise(j);
        wgmma_wait<0>();
        pin_all<D / 2>(dq);
        done(j - 1);
        pack_frags<T, BC>(df, dp);
    }
    wgmma_fence();
    turns.wait();
    issue_grad(nkb - 1);
    turns.pass(true);
    wgmma_wait<0>();
    pin_all<D / 2>(dq);
    done(nkb - 1);
}

template <typename T, int D, int DK, int BC, int NWG, bool TURNS, bool EXT,
          typename UM = NoUserMod>
__global__ void __launch_bounds__(NWG *WG_THREADS, 1) flash_bwd_dq_wgmma_kernel(FlashParams p)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int BR = 64 * NWG, THREADS = NWG * WG_THREADS, ST = BWD_STAGES;
    using L = Sm90DqSmem<D, BR, BC, ST>;
    constexpr int KV_BYTES = L::KV_BYTES;
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    unsigned char *const sQ = smem, *const sdO = smem + L::DO, *const sK = smem + L::K;
    unsigned char *const sV = smem + L::V;

    const int tid = threadIdx.x, wg = tid / WG_THREADS;
    const int wwarp = (tid / FT_WARP) % 4;
    if (EXT) /* varlen: this CTA's sequence */
        flash_enter_seq(p, blockIdx.z);
    const QueryBlock qblk = query_block<BR, BC>(p);
    if (EXT && (qblk.i0 < 0 || qblk.i0 >= p.Nq))
        return; /* past its end: nothing to do */
    const int i0 = qblk.i0, kb0 = qblk.kb0, nkb = qblk.nkb, h = blockIdx.y, b = blockIdx.z;
    const int hk = h / (p.H / p.Hk);
    const int wrow0 = i0 + wg * 64 + wwarp * 16; /* this warp's first row */
    const FullKeys full = flash_full_keys(p, wrow0, wrow0 + 16);
    float dq[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; i++)
        dq[i] = 0.f;
    if (nkb == kb0) { /* no row sees a key: dQ = 0 */
        store_acc<T, D>(p.dq, b, h, wrow0, p.Nq, p.d, dq, 1.f);
        return;
    }
    float lse[2], Dr[2]; /* rows g, g + 8 */
    row_stats(p, b, h, wrow0, lse, Dr);
    const ScoreMod smod = flash_score_mod(p, b, h);

    const TileLoader<T, BC, D, THREADS> kload(p.k, b, hk, p.Nk, p.d), vload(p.v, b, hk, p.Nk, p.d);
    dq_prologue<T, BR, BC, D, THREADS>(p, b, h, i0, sQ, sdO, kload, vload,
                                       sK + (kb0 % ST) * KV_BYTES, sV + (kb0 % ST) * KV_BYTES,
                                       kb0 * BC);

    float s[BC / 2], dp[BC / 2];
    uint32_t df[BC / 16][4];
    dq_loop<T, D, DK, BR, BC>(
        kb0, nkb, Turns<TURNS>(wg), s, dp, df, dq, smem_addr(sQ) + wg * 64 * 128,
        smem_addr(sdO) + wg * 64 * 128,
        [&](int j) {
            stages_ready();
            if (j + 1 < nkb) {
                kload.load(sK + ((j + 1) % ST) * KV_BYTES, (j + 1) * BC);
                vload.load(sV + ((j + 1) % ST) * KV_BYTES, (j + 1) * BC);
            }
            cp_async_commit();
        },
        [&](int j) { return smem_addr(sK + (j % ST) * KV_BYTES); },
        [&](int j) { return smem_addr(sV + (j % ST) * KV_BYTES); },
        [&](int j) {
            dq_dscores<T, BC / 2, EXT, UM>(p, smod, b, h, dp, s, lse, Dr, wrow0, j * BC, full,
                                           j * BC, (j + 1) * BC);
        },
        [](int) {});
    cp_async_wait<0>();

    store_acc<T, D>(p.dq, b, h, wrow0, p.Nq, p.d, dq, p.scale);
#endif
}

/* The warp-specialised dQ kernel's shared memory: Q, dO [128 rows], then
 * ST stages of K, then of V [BC rows], then the barriers: Q/dO full, and
 * full and empty for each stage. */
template <int D, int BC, int ST> struct Sm90WsDqSmem : RingBars<ST> {
    static constexpr int BR = 128, TW = FT_TW(D), Q_BYTES = BR * TW * 2, KV_BYTES = BC * TW * 2;
    static constexpr int DO = Q_BYTES, K = 2 * Q_BYTES, V = K + ST * KV_BYTES;
    static constexpr int BAR = V + ST * KV_BYTES;
    static constexpr size_t bytes = 1024 + (size_t)BAR + RingBars<ST>::BYTES;
};

/* dQ in the warp-specialised structure: warpgroup 0's first thread copies
 * Q and dO of the CTA's 128 rows once, then K_j and V_j through the copy
 * engine into a ring of ST stages; warpgroups 1 and 2, 64 rows each, run
 * dq_loop and hand a stage back (one arrival each) once dQ's product with
 * its K is done. Not for varlen. */
template <typename T, int D, int DK, int BC, int ST, bool TURNS, bool EXT,
          typename UM = NoUserMod>
__global__ void __launch_bounds__(3 * WG_THREADS, 1)
    flash_bwd_dq_ws_kernel(const FlashParams p, const __grid_constant__ BwdMaps maps)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using L = Sm90WsDqSmem<D, BC, ST>;
    constexpr int BR = L::BR, KV_BYTES = L::KV_BYTES;
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    const uint32_t sQ = smem_addr(smem), sdO = sQ + L::DO, sK = sQ + L::K, sV = sQ + L::V;
    const uint32_t bar = sQ + L::BAR;

    const int tid = threadIdx.x, wg = tid / WG_THREADS;
    const QueryBlock qblk = query_block<BR, BC>(p);
    const int i0 = qblk.i0, kb0 = qblk.kb0, nkb = qblk.nkb, h = blockIdx.y, b = blockIdx.z;
    const int wrow0 = i0 + (wg - 1) * 64 + (tid / FT_WARP) % 4 * 16; /* a consumer warp's */
    if (nkb == kb0) { /* no row sees a key: dQ = 0 */
        if (wg > 0)
            store_zero_rows<T, D>(p.dq, b, h, wrow0, p.Nq, p.d);
        return;
    }
    const int chunks = (p.d + 63) / 64; /* copied; the tiles' other columns are never read */
    if (tid == 0) /* full: the producer; empty: a thread of each consumer */
        ring_init(bar + L::ONCE, bar + L::FULL, bar + L::EMPTY, ST, 1, 2);
    __syncthreads();

    if (wg == 0) { /* the producer */
        regs_dec<24>();
        if (tid == 0) {
            const int hk = h / (p.H / p.Hk);
            mbar_expect(bar + L::ONCE, 2 * chunks * BR * 128);
            for (int c = 0; c < chunks; c++) {
                tma_load_4d(sQ + c * BR * 128, &maps.q, bar + L::ONCE, c * 64, h, i0, b);
                tma_load_4d(sdO + c * BR * 128, &maps.dout, bar + L::ONCE, c * 64, h, i0, b);
            }
            for (int j = kb0; j < nkb; j++) {
                const int n = j - kb0, st = n % ST;
                const uint32_t full = bar + L::FULL + 8 * st;
                mbar_wait(bar + L::EMPTY + 8 * st, ((n / ST) & 1) ^ 1);
                mbar_expect(full, 2 * chunks * BC * 128);
                for (int c = 0; c < chunks; c++) {
                    tma_load_4d(sK + st * KV_BYTES + c * BC * 128, &maps.k, full, c * 64, hk,
                                j * BC, b);
                    tma_load_4d(sV + st * KV_BYTES + c * BC * 128, &maps.v, full, c * 64, hk,
                                j * BC, b);
                }
            }
        }
    } else { /* the consumers */
        regs_inc<240>();
        const int cwg = wg - 1;
        const FullKeys full = flash_full_keys(p, wrow0, wrow0 + 16);
        float dq[D / 2], s[BC / 2], dp[BC / 2];
        uint32_t df[BC / 16][4];
#pragma unroll
        for (int i = 0; i < D / 2; i++)
            dq[i] = 0.f;
        float lse[2], Dr[2]; /* rows g, g + 8 */
        row_stats(p, b, h, wrow0, lse, Dr);
        const ScoreMod smod = flash_score_mod(p, b, h);
        const bool signal = tid % WG_THREADS == 0;
        auto stage = [&](int j) { return (j - kb0) % ST; };
        mbar_wait(bar + L::ONCE, 0);
        dq_loop<T, D, DK, BR, BC>(
            kb0, nkb, Turns<TURNS>(cwg), s, dp, df, dq, sQ + cwg * 64 * 128, sdO + cwg * 64 * 128,
            [&](int j) { mbar_wait(bar + L::FULL + 8 * stage(j), ((j - kb0) / ST) & 1); },
            [&](int j) { return sK + stage(j) * KV_BYTES; },
            [&](int j) { return sV + stage(j) * KV_BYTES; },
            [&](int j) {
                dq_dscores<T, BC / 2, EXT, UM>(p, smod, b, h, dp, s, lse, Dr, wrow0, j * BC, full,
                                               j * BC, (j + 1) * BC);
            },
            [&](int j) {
                if (signal)
                    mbar_arrive(bar + L::EMPTY + 8 * stage(j));
            });
        store_acc<T, D>(p.dq, b, h, wrow0, p.Nq, p.d, dq, p.scale);
    }
#endif
}

/* ---- head dims 192 and 256 ----
 *
 * A 64 x 256 f32 accumulator takes 128 registers a thread, so dK and dV
 * (or dQ) of 64 rows cannot both live in one warpgroup. Here the two
 * warpgroups of a CTA share 64 rows and split the work: warpgroup 0
 * computes S (S^T), warpgroup 1 dP (dP^T), each for the whole 64 x 64
 * block; they swap halves thread to thread (swap_halves) so that each has
 * S and dP for 32 of the other side's rows and computes P and dS there.
 * dK/dV: both are written (16 bits) to shared memory, and after a barrier
 * warpgroup 0 updates dV with P, warpgroup 1 dK with dS (K-major A from
 * shared memory, the Q or dO tile read transposed), each over all DK
 * columns. dQ: each warpgroup multiplies its 32 keys of dS, straight from
 * registers, by those 32 rows of K, over all DK columns; the two partial
 * sums meet in shared memory at the end (in a fixed order: deterministic).
 * The tiles are D = 256 wide; at d = 192 the score and gradient products
 * run over DK = 192 columns only. Nothing overlaps here: products,
 * elementwise work and barriers take turns (kernels/README.md says why, and
 * what each version measured). */

/* gradient (64 x N) += F B: F a 64 x 64 shared tile [row][k] (16-bit,
 * swizzled), B the first N columns of a [64][256] tile read transposed */
template <typename T, int N>
__device__ __forceinline__ void product_sb(float *acc, uint32_t f_addr, uint32_t b_addr)
{
    const uint32_t f = desc_lo(f_addr, 16), b = desc_lo(b_addr, 64 * 128);
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
        Wgmma<T, N>::sst(acc, make_desc(f + kk * 2, FT_DESC_HI(1024)),
                           make_desc(b + kk * 128, FT_DESC_HI(1024)), 1);
}

/* Writes a 64 x 32 accumulator (this warpgroup's columns col0 .. col0+31)
 * into a swizzled [64][64] 16-bit tile. */
template <typename T>
__device__ __forceinline__ void store_tile32(unsigned char *tile, const float *acc, int col0)
{
    const int lane = threadIdx.x % FT_WARP, g = lane / 4, t4 = lane % 4;
    const int row0 = ((threadIdx.x / FT_WARP) % 4) * 16;
#pragma unroll
    for (int n = 0; n < 4; n++)
#pragma unroll
        for (int r = 0; r < 2; r++)
            *reinterpret_cast<uint32_t *>(tile + swz_offset<64>(row0 + g + 8 * r,
                                                                 col0 + n * 8 + 2 * t4)) =
                MmaType<T>::pack(acc[4 * n + 2 * r], acc[4 * n + 2 * r + 1]);
}

/* The two warpgroups each computed one 64 x 64 product of the block (S or
 * dP); warpgroup w keeps columns 32 w .. 32 w + 31 of its own (mine) and
 * receives the same columns of the other's (theirs) through xbuf (16 KB):
 * thread t of one warpgroup holds the same places as thread t of the other,
 * so the swap is thread to thread. Ends with a barrier; xbuf is read until
 * the caller's next barrier. */
__device__ __forceinline__ void swap_halves(const float *x, float *mine, float *theirs, float *xbuf)
{
    const int wg = threadIdx.x / WG_THREADS, t = threadIdx.x % WG_THREADS;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        xbuf[i * 2 * WG_THREADS + wg * WG_THREADS + t] = wg ? x[i] : x[16 + i];
        mine[i] = wg ? x[16 + i] : x[i];
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 16; i++)
        theirs[i] = xbuf[i * 2 * WG_THREADS + (1 - wg) * WG_THREADS + t];
}

template <typename T, int DK, bool EXT, typename UM = NoUserMod>
__global__ void __launch_bounds__(2 * WG_THREADS, 1) flash_bwd_dkdv_wide_kernel(FlashParams p)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int D = 256, BN = 64, BM = 64, THREADS = 2 * WG_THREADS;
    using L = Sm90WideDkdvSmem<T>;
    using Stream = typename L::Stream;
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    unsigned char *const sK = smem, *const sV = smem + L::V, *const sP = smem + L::P;
    unsigned char *const sdS = smem + L::DS;

    const int tid = threadIdx.x, wg = tid / WG_THREADS, lane = tid % FT_WARP;
    const int wwarp = (tid / FT_WARP) % 4, t4 = lane % 4;
    const int j0 = blockIdx.x * BN, hk = blockIdx.y, b = blockIdx.z;
    if (EXT) { /* varlen: this CTA's sequence; past its end, nothing to do */
        flash_enter_seq(p, b);
        if (j0 >= p.Nk)
            return;
    }
    const int wkey0 = j0 + wwarp * 16; /* this warp's first key */
    const FullKeys full = flash_full_queries(p, wkey0, wkey0 + 16);
    Stream qs(p, smem + L::STREAM, j0, j0 + BN, hk);
    const int total = qs.total;
    /* warpgroup 0 accumulates dV, warpgroup 1 dK, both DK columns wide */
    float grad[DK / 2];
#pragma unroll
    for (int i = 0; i < DK / 2; i++)
        grad[i] = 0.f;
    const FlashTensor gt = wg ? p.dk : p.dv; /* a copy: p may be the kernel's own (varlen) */
    if (total == 0) {
        store_acc<T, DK>(gt, b, hk, wkey0, p.Nk, p.d, grad, 1.f);
        return;
    }
    TileLoader<T, BN, D, THREADS>(p.k, b, hk, p.Nk, p.d).load(sK, j0);
    TileLoader<T, BN, D, THREADS>(p.v, b, hk, p.Nk, p.d).load(sV, j0);
    qs.load(p, b, 0);
    cp_async_commit();

    float x[32], s[16], dp[16];
    const float sl2 = p.scale_log2;
    for (int t = 0; t < total; t++) {
        stages_ready();
        if (t + 1 < total)
            qs.load(p, b, t + 1);
        cp_async_commit();
        const uint32_t q_addr = qs.q(t), do_addr = qs.dout(t);
        /* warpgroup 0: S^T = K Q^T, warpgroup 1: dP^T = V dO^T, all 64
         * queries (one product each reads K or V once); then each keeps its
         * 32 queries of both (the swap goes through sP, free until now) */
        wgmma_fence();
        product_abt<T, 64, DK, BN, BM>(x, wg ? smem_addr(sV) : smem_addr(sK), wg ? do_addr : q_addr);
        wgmma_commit();
        wgmma_wait<0>();
        pin_all<32>(x);
        float mine[16], theirs[16];
        swap_halves(x, mine, theirs, reinterpret_cast<float *>(sP));
#pragma unroll
        for (int i = 0; i < 16; i++) {
            s[i] = wg ? theirs[i] : mine[i];
            dp[i] = wg ? mine[i] : theirs[i];
        }
        const int i0 = qs.next_i0();
        const float *L = qs.lse(t), *Dq = qs.D(t);
        const bool edge = full.masks(i0, i0 + BM);
        float dmod[EXT ? 16 : 1]; /* the modification's derivatives */
        if (EXT)
            mod_acc<16, true, fast_tanh<T>(), UM>(flash_score_mod(p, b, qs.ch), s, wkey0, i0 + wg * 32, dmod);
        else if (UM::on) /* a Lua-written mask alone: no derivative */
            mod_acc<16, true, fast_tanh<T>(), UM, false>(flash_score_mod(p, b, qs.ch), s, wkey0, i0 + wg * 32);
        auto body = [&](auto drop) {
            const uint64_t bits =
                decltype(drop)::value ? keep_bits<16, true>(p, b, qs.ch, wkey0, i0 + wg * 32) : 0;
#pragma unroll
            for (int n = 0; n < 4; n++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int col = wg * 32 + n * 8 + t4 * 2 + e;
                    const float lse = L[col], dd = Dq[col];
#pragma unroll
                    for (int r = 0; r < 2; r++) {
                        const int idx = 4 * n + 2 * r + e;
                        s[idx] = ex2(fmaf(s[idx], sl2, -lse));
                        /* dropout: dV takes P Z, dS = P (Z dP - D) */
                        const float z = decltype(drop)::value ? drop_factor(p, bits, idx) : 1.f;
                        dp[idx] = s[idx] * (z * dp[idx] - dd);
                        if (EXT)
                            dp[idx] *= dmod[idx];
                        if (decltype(drop)::value)
                            s[idx] *= z;
                    }
                }
        };
        if (EXT)
            with_dropout<UM>(p, body);
        else
            body(Bool<false>());
        if (edge) {
            const int key = wkey0 + lane / 4;
            const QueryRange q0 = flash_queries(p, key), q1 = flash_queries(p, key + 8);
            auto masked = [&](int r, int qi) { return r ? q1.hides(qi) : q0.hides(qi); };
            mask_acc<16>(s, i0 + wg * 32, masked);
            mask_acc<16>(dp, i0 + wg * 32, masked);
        }
        __syncthreads(); /* both warpgroups have read the swap */
        store_tile32<T>(sP, s, wg * 32);
        store_tile32<T>(sdS, dp, wg * 32);
        fence_proxy_async();
        __syncthreads();
        /* warpgroup 0: dV += P^T dO, warpgroup 1: dK += dS^T Q (the same
         * instructions on other operands) */
        wgmma_fence();
        product_sb<T, DK>(grad, smem_addr(wg ? sdS : sP), wg ? q_addr : do_addr);
        wgmma_commit();
        wgmma_wait<0>();
        pin_all<DK / 2>(grad);
    }
    cp_async_wait<0>();
    store_acc<T, DK>(gt, b, hk, wkey0, p.Nk, p.d, grad, wg ? p.scale : 1.f);
#endif
}

template <typename T, int DK, bool EXT, typename UM = NoUserMod>
__global__ void __launch_bounds__(2 * WG_THREADS, 1) flash_bwd_dq_wide_kernel(FlashParams p)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int D = 256, BR = 64, BC = 64, THREADS = 2 * WG_THREADS, ST = 2;
    using L = Sm90WideDqSmem;
    constexpr int KV_BYTES = L::KV_BYTES;
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    unsigned char *const sQ = smem, *const sdO = smem + L::DO, *const sK = smem + L::K;
    unsigned char *const sV = smem + L::V;
    float *const xbuf = reinterpret_cast<float *>(smem + L::END); /* swap_halves */

    const int tid = threadIdx.x, wg = tid / WG_THREADS;
    const int wwarp = (tid / FT_WARP) % 4;
    if (EXT) /* varlen: this CTA's sequence */
        flash_enter_seq(p, blockIdx.z);
    const QueryBlock qblk = query_block<BR, BC>(p);
    if (EXT && (qblk.i0 < 0 || qblk.i0 >= p.Nq))
        return; /* past its end: nothing to do */
    const int i0 = qblk.i0, kb0 = qblk.kb0, nkb = qblk.nkb, h = blockIdx.y, b = blockIdx.z;
    const int hk = h / (p.H / p.Hk);
    const int wrow0 = i0 + wwarp * 16;
    const FullKeys full = flash_full_keys(p, wrow0, wrow0 + 16);
    /* each warpgroup's share of dQ over its 32 keys of every block, DK
     * columns wide; the two shares are added at the end */
    float dq[DK / 2];
#pragma unroll
    for (int i = 0; i < DK / 2; i++)
        dq[i] = 0.f;
    if (nkb == kb0) {
        if (wg == 0)
            store_acc<T, DK>(p.dq, b, h, wrow0, p.Nq, p.d, dq, 1.f);
        return;
    }
    float lse[2], Dr[2];
    row_stats(p, b, h, wrow0, lse, Dr);
    const ScoreMod smod = flash_score_mod(p, b, h);
    const TileLoader<T, BC, D, THREADS> kload(p.k, b, hk, p.Nk, p.d), vload(p.v, b, hk, p.Nk, p.d);
    dq_prologue<T, BR, BC, D, THREADS>(p, b, h, i0, sQ, sdO, kload, vload,
                                       sK + (kb0 % ST) * KV_BYTES, sV + (kb0 % ST) * KV_BYTES,
                                       kb0 * BC);

    float x[32], s[16], dp[16];
    for (int j = kb0; j < nkb; j++) {
        stages_ready();
        if (j + 1 < nkb) {
            kload.load(sK + ((j + 1) % ST) * KV_BYTES, (j + 1) * BC);
            vload.load(sV + ((j + 1) % ST) * KV_BYTES, (j + 1) * BC);
        }
        cp_async_commit();
        const uint32_t k_addr = smem_addr(sK + (j % ST) * KV_BYTES);
        const uint32_t v_addr = smem_addr(sV + (j % ST) * KV_BYTES);
        /* warpgroup 0: S = Q K^T, warpgroup 1: dP = dO V^T, all 64 keys;
         * then each keeps its 32 keys of both */
        wgmma_fence();
        product_abt<T, 64, DK, BR, BC>(x, wg ? smem_addr(sdO) : smem_addr(sQ), wg ? v_addr : k_addr);
        wgmma_commit();
        wgmma_wait<0>();
        pin_all<32>(x);
        float mine[16], theirs[16];
        swap_halves(x, mine, theirs, xbuf);
#pragma unroll
        for (int i = 0; i < 16; i++) {
            s[i] = wg ? theirs[i] : mine[i];
            dp[i] = wg ? mine[i] : theirs[i];
        }
        dq_dscores<T, 16, EXT, UM>(p, smod, b, h, dp, s, lse, Dr, wrow0, j * BC + wg * 32, full, j * BC,
                            (j + 1) * BC);
        /* dQ += dS K over this warpgroup's 32 keys: dS from registers */
        uint32_t df[2][4];
        pack_frags<T, 32>(df, dp);
        wgmma_fence();
        product_fb<T, 32, DK, BC>(dq, df, k_addr + wg * 32 * 128);
        wgmma_commit();
        wgmma_wait<0>();
        pin_all<DK / 2>(dq);
    }
    cp_async_wait<0>();
    /* warpgroup 1's share through the K stages (free now), in the same
     * thread-to-element places; warpgroup 0 adds it and stores */
    __syncthreads();
    float *const share = reinterpret_cast<float *>(sK);
    const int t = tid % WG_THREADS;
    if (wg == 1) {
#pragma unroll
        for (int i = 0; i < DK / 2; i++)
            share[i * WG_THREADS + t] = dq[i];
    }
    __syncthreads();
    if (wg == 0) {
#pragma unroll
        for (int i = 0; i < DK / 2; i++)
            dq[i] += share[i * WG_THREADS + t];
        store_acc<T, DK>(p.dq, b, h, wrow0, p.Nq, p.d, dq, p.scale);
    }
#endif
}

/* ---- launch ---- */
#ifndef __CUDACC_RTC__

/* Whether the warp-specialised kernels may take p: not with FT_NO_WS set
 * (which keeps the wgmma kernels, for comparison; ctest's *_nows specs),
 * not for varlen. */
static bool bwd_ws_wanted(const FlashParams &p)
{
    return !p.cu_q && !switch_on("FT_NO_WS");
}

/* Their tensor maps, boxes of q_rows rows of q and dO, kv_rows of k and
 * v; false where the copy engine does not take a tensor. A dry rtc
 * (compiling a mod's kernels) has no tensors: the kernels are named and
 * compiled. */
static bool bwd_ws_maps(const FlashParams &p, int q_rows, int kv_rows, BwdMaps *maps)
{
    memset(maps, 0, sizeof *maps);
    return !p.q.data || (flash_tma_map(&maps->q, p.q, p.B, p.Nq, p.H, p.d, q_rows, p.dtype) &&
                         flash_tma_map(&maps->dout, p.dout, p.B, p.Nq, p.H, p.d, q_rows, p.dtype) &&
                         flash_tma_map(&maps->k, p.k, p.B, p.Nk, p.Hk, p.d, kv_rows, p.dtype) &&
                         flash_tma_map(&maps->v, p.v, p.B, p.Nk, p.Hk, p.d, kv_rows, p.dtype));
}

/* dK/dV, then dQ: the warp-specialised kernels where bwd_ws_wanted and
 * bwd_ws_maps say so, the wgmma kernels otherwise. A dry rtc (compiling a
 * mod's kernels) compiles both kinds: varlen calls take the wgmma ones. */
template <typename T, int D, int DK, int BM, int BC, bool TURNS, bool EXT>
static ft_status launch_bwd_wgmma(const FlashParams &p, FlashRtc *rtc)
{
    constexpr int NWG = 2, BN = 64 * NWG, BR = 64 * NWG, ST = BWD_STAGES;
    const char *func = "ft_attention_backward";
    const bool ws = bwd_ws_wanted(p), dry = !p.q.data;
    BwdMaps maps;
    const bool ws_kv = p.Nk > 0 && ws && bwd_ws_maps(p, BM, BN, &maps);
    if (ws_kv) {
        using L = Sm90WsDkdvSmem<D, BM, ST, EXT>;
        FT_TRY(flash_launch(rtc, FLASH_FILE, flash_bwd_dkdv_ws_kernel<T, D, DK, BM, ST, TURNS, EXT>,
                            [] { return rtc_name("flash_bwd_dkdv_ws_kernel", TypeOf<T>(), D, DK, BM, ST, TURNS, EXT); },
                            dim3((p.Nk + BN - 1) / BN, p.Hk, p.B), 3 * WG_THREADS, L::bytes, p,
                            func, maps));
    }
    if (p.Nk > 0 && (!ws_kv || dry)) {
        FT_TRY(flash_launch(rtc, FLASH_FILE, flash_bwd_dkdv_wgmma_kernel<T, D, DK, BM, NWG, TURNS, EXT>,
                            [] { return rtc_name("flash_bwd_dkdv_wgmma_kernel", TypeOf<T>(), D, DK, BM, NWG, TURNS, EXT); },
                            dim3((p.Nk + BN - 1) / BN, p.Hk, p.B), NWG * WG_THREADS,
                            Sm90DkdvSmem<T, D, BM, NWG, EXT>::bytes, p, func));
    }
    if (ws && bwd_ws_maps(p, BR, BC, &maps)) {
        using L = Sm90WsDqSmem<D, BC, ST>;
        FT_TRY(flash_launch(rtc, FLASH_FILE, flash_bwd_dq_ws_kernel<T, D, DK, BC, ST, TURNS, EXT>,
                            [] { return rtc_name("flash_bwd_dq_ws_kernel", TypeOf<T>(), D, DK, BC, ST, TURNS, EXT); },
                            dim3((p.Nq + BR - 1) / BR, p.H, p.B), 3 * WG_THREADS, L::bytes, p, func,
                            maps));
        if (!dry)
            return FT_OK;
    }
    return flash_launch(rtc, FLASH_FILE, flash_bwd_dq_wgmma_kernel<T, D, DK, BC, NWG, TURNS, EXT>,
                        [] { return rtc_name("flash_bwd_dq_wgmma_kernel", TypeOf<T>(), D, DK, BC, NWG, TURNS, EXT); },
                        dim3((p.Nq + BR - 1) / BR, p.H, p.B), NWG * WG_THREADS,
                        Sm90DqSmem<D, BR, BC, ST>::bytes, p, func);
}

template <typename T, int DK, bool EXT>
static ft_status launch_bwd_wide(const FlashParams &p, FlashRtc *rtc)
{
    constexpr int ROWS = 64, THREADS = 2 * WG_THREADS;
    const char *func = "ft_attention_backward";
    if (p.Nk > 0)
        FT_TRY(flash_launch(rtc, FLASH_FILE, flash_bwd_dkdv_wide_kernel<T, DK, EXT>,
                            [] { return rtc_name("flash_bwd_dkdv_wide_kernel", TypeOf<T>(), DK, EXT); },
                            dim3((p.Nk + ROWS - 1) / ROWS, p.Hk, p.B),
                            THREADS, Sm90WideDkdvSmem<T>::bytes, p, func));
    return flash_launch(rtc, FLASH_FILE, flash_bwd_dq_wide_kernel<T, DK, EXT>,
                        [] { return rtc_name("flash_bwd_dq_wide_kernel", TypeOf<T>(), DK, EXT); },
                        dim3((p.Nq + ROWS - 1) / ROWS, p.H, p.B),
                        THREADS, SM90_WIDE_DQ_BYTES, p, func);
}

/* dK, dV and dQ once D is in p.D: f16/bf16, rows aligned, Nq > 0 (the
 * caller checks); the row of SM90_BWD_TILES (flash_tiles.cuh) that takes
 * the head dim. */
ft_status flash_bwd_sm90(const FlashParams &p, FlashRtc *rtc)
{
    return flash_dispatch(p, [&](auto type, auto ext) {
        using T = typename decltype(type)::type;
        constexpr bool EXT = decltype(ext)::value;
        return flash_pick(SM90_BWD_TILES, p.d, [&](auto row) {
            constexpr Sm90BwdTile c = SM90_BWD_TILES[decltype(row)::value];
            if constexpr (c.wide)
                return launch_bwd_wide<T, c.DK, EXT>(p, rtc);
            else
                return launch_bwd_wgmma<T, c.D, c.DK, c.BM, c.BC, c.turns, EXT>(p, rtc);
        });
    });
}
#endif
