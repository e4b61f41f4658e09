/*
 * flash_fwd_sm90.cu - the flash forward pass on Hopper's warpgroup matrix
 * products (wgmma, sm_90a), f16/bf16: flash_fwd_ws_kernel, warp-specialised
 * (a producer warpgroup copying through the copy engine, two consumer
 * warpgroups), for the head dims and lengths of SM90_WS_FWD_TILES; and
 * flash_fwd_wgmma_kernel (every warpgroup copies with cp.async), every head
 * dim up to 256, for the rest and for varlen. Both run FwdRows.
 * Built when the CUDA architectures include 90a (FT_HAVE_SM90A); used on
 * devices of compute capability 9.0 unless FT_NO_WGMMA is set (FT_NO_WS:
 * never the warp-specialised kernel; FT_WS: at any length). Needs
 * head_dim % 8 == 0 and 16-byte aligned rows (the caller checks).
 * Check: spec/cuda_attention_spec.lua (busted, tag gpu; ctest's *_ws runs
 * with FT_WS=1) against the CPU f64 reference; scripts/bench.lua checks,
 * then times; scripts/profile.lua runs one call for ncu. Design and
 * measurements: kernels/README.md.
 */
#include "flash_wgmma.cuh"

#include <math.h>

#define FLASH_FILE "sm90/flash_fwd_sm90.cu" /* rtc.cu compiles it again for a Lua-written mod */

/* The kernel's shared memory, for the kernel and its launcher, in bytes:
 * Q [BR], then K stages 0 and 1, then V stages 0 and 1 [BC], rows TW wide
 * (16-bit, swizzled), after up to 1024 bytes of alignment (the swizzle is
 * on address bits: chunks start on 1024 bytes). */
template <int D, int BC, int NWG> struct Sm90FwdSmem {
    static constexpr int BR = 64 * NWG, TW = FT_TW(D);
    static constexpr int Q_BYTES = BR * TW * 2, KV_BYTES = BC * TW * 2;
    static constexpr int K = Q_BYTES, V = K + 2 * KV_BYTES;
    static constexpr size_t bytes = 1024 + (size_t)V + 2 * KV_BYTES;
};

/* Whether the tiles hold V's column of ones (see FwdRows) and the width of
 * P V then. */
template <int D, int DK, int BC, bool EXT> struct FwdOnes {
    /* EXT: dropout drops from P V, not from the sum */
    static constexpr bool on = !EXT && DK < FT_TW(D) && BC == 64;
    static constexpr int DO = on && DK + 8 > D ? DK + 8 : D;
};

/* A warpgroup's 64 query rows (each thread: rows g and g + 8 of its warp's
 * 16), as both forward kernels run them: the row statistics and the steps
 * on the accumulators. softmax(s, j) masks and modifies S_j, takes the
 * running maximum and sum in raw units (exp2 by one FFMA) and leaves P in
 * s; rescale_pack scales O by exp(m_old - m_new) and packs P (16 bits)
 * into the A fragments of P V (S's accumulators are P's A fragments);
 * finish normalises and stores O and LSE.
 * With ONES (the tiles wider than the score products' DK columns: d = 32
 * in 64-wide rows, d = 192 in D = 256; 64-key blocks) V's columns DK ..
 * DK+7 hold ones and P V's column DK is P's row sum: added up by the
 * tensor cores and rescaled with O, no per-score add (d = 96, 128-key
 * blocks, measured slower with it and keeps the adds). */
template <typename T, int D, int DK, int BC, bool EXT, typename UM> struct FwdRows {
    static constexpr bool ONES = FwdOnes<D, DK, BC, EXT>::on;
    static constexpr int DO = FwdOnes<D, DK, BC, EXT>::DO; /* the width of P V */
    static constexpr int NT_S = BC / 8, NT_O = DO / 8;
    const FlashParams &p;
    const int b, h, wrow0, g, t4;
    const FullKeys full;
    const float sl2;
    const ScoreMod smod;
    float m[2], l[2], alpha[2];
    float m_start; /* the rows' maximum before any key: the sink's, or -inf */

    /* O = 0; a sink starts the rows (raw units: times sl2 is log2 units) */
    __device__ __forceinline__ FwdRows(const FlashParams &p_, int b_, int h_, int wrow0_,
                                       float sink2, float *o)
        : p(p_), b(b_), h(h_), wrow0(wrow0_), g(threadIdx.x % FT_WARP / 4),
          t4(threadIdx.x % 4), full(flash_full_keys(p_, wrow0_, wrow0_ + 16)),
          sl2(p_.scale_log2), smod(flash_score_mod(p_, b_, h_))
    {
        const float m0 = capped()      ? p.cap
                         : um_capped() ? UM::bound * p.inv_scale
                         : sink2 == -INFINITY ? -INFINITY
                                              : sink2 / sl2;
        const float l0 = flash_sink_sum(sink2, t4 == 0);
        m[0] = m[1] = m_start = m0;
        l[0] = l[1] = ONES ? 0.f : l0;
#pragma unroll
        for (int i = 0; i < DO / 2; i++)
            o[i] = 0.f;
        if (ONES) { /* the sum sits in O's column DK, lane t4 = 0 */
            o[4 * (DK / 8)] = l0;
            o[4 * (DK / 8) + 2] = l0;
        }
    }

    /* A softcap bounds every logit by softcap (raw units: p.cap): a bf16
     * call with p.cap_max (flash_fwd.cu) takes that bound as each row's
     * maximum from the start, so it needs no running maximum and never
     * rescales, and s holds t = tanh(scale s / softcap), the logit being
     * softcap t (one multiplication a score fewer: exp2 takes c t - c,
     * c = softcap log2 e). */
    __device__ __forceinline__ bool capped() const { return EXT && !UM::on && fast_tanh<T>() && p.cap_max; }
    /* The same for a Lua-written score whose range is narrow (UM::has_bound,
     * its top UM::bound in scaled units; bf16, p.um_cap): the rows start at
     * the top, and s keeps the score. */
    __device__ __forceinline__ bool um_capped() const
    {
        return UM::has_bound && fast_tanh<T>() && p.um_cap;
    }
    /* Either: the rows' maximum m is fixed from the start */
    __device__ __forceinline__ bool fixed_max() const { return capped() || um_capped(); }

    /* ALiBi alone (no softcap, no Lua mod): in a block of keys wholly on
     * one side of all the warp's rows' diagonals the bias is linear in the
     * key, -slope |a - j| = sg slope (j - a) (sg = 1 left of the diagonal,
     * -1 right), and entry i's key is j0 + 2 t4 + K, K = 8 (i / 4) + i % 2
     * a constant: s + sg slope K (one FFMA a score instead of a
     * subtraction and an FFMA), and the row's part dr = sg slope (j0 + 2 t4
     * - a) goes into its maximum and its exponents' offset. Returns whether
     * the block took it (head dims up to 128: at 192 and 256 its registers
     * made the consumers spill). */
    __device__ __forceinline__ bool alibi_linear(float *s, int j0, float *dr) const
    {
        if (!(EXT && !UM::on && D <= 128) || !p.alibi || p.cap2 != 0.f)
            return false;
        const int a0 = wrow0 + smod.shift; /* the warp's first row's key position */
        const float sg = j0 + BC - 1 <= a0 ? 1.f : j0 >= a0 + 15 ? -1.f : 0.f;
        if (sg == 0.f)
            return false;
        const float ss = sg * smod.slope;
#pragma unroll
        for (int i = 0; i < BC / 2; i++)
            s[i] = fmaf(ss, (float)(8 * (i / 4) + i % 2), s[i]);
#pragma unroll
        for (int r = 0; r < 2; r++)
            dr[r] = ss * (float)(j0 + 2 * t4 - (a0 + g + 8 * r));
        return true;
    }

    __device__ __forceinline__ void softmax(float *s, int j)
    {
        pin_all<BC / 2>(s);
        const int j0 = j * BC;
        float dr[2] = {0.f, 0.f}; /* alibi_linear's row parts */
        const bool linear = alibi_linear(s, j0, dr);
        if (capped()) {
            const float k = p.cap2 * (0.5f / FT_LOG2E); /* scale / softcap */
#pragma unroll
            for (int i = 0; i < BC / 2; i++)
                s[i] = tanh_approx(s[i] * k);
        } else if (!linear && (EXT || UM::on)) /* a Lua-written mod alone needs none of EXT's state */
            mod_acc<BC / 2, false, fast_tanh<T>(), UM, EXT>(smod, s, wrow0, j0);
        if (full.masks(j0, j0 + BC)) {
            const KeyRange k0 = flash_keys(p, wrow0 + g), k1 = flash_keys(p, wrow0 + g + 8);
#pragma unroll
            for (int i = 0; i < BC / 2; i++) {
                const int col = j0 + (i / 4) * 8 + t4 * 2 + i % 2;
                if ((i / 2) % 2 ? k1.hides(col) : k0.hides(col))
                    s[i] = -INFINITY;
            }
        }
#pragma unroll
        for (int r = 0; r < 2; r++) {
            if (fixed_max()) { /* capped: s holds t, the logit m t */
                const float ms = m[r] * sl2;
                alpha[r] = 1.f;
                exp_row(s, r, capped() ? ms : sl2, ms);
                continue;
            }
            /* four partial maxima and sums: shorter dependency chains */
            float mx4[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
            for (int n = 0; n < NT_S; n++)
#pragma unroll
                for (int e = 0; e < 2; e++)
                    mx4[(2 * n + e) % 4] = max_nan(mx4[(2 * n + e) % 4], s[4 * n + 2 * r + e]);
            float mx = max_nan(max_nan(mx4[0], mx4[1]), max_nan(mx4[2], mx4[3])) + dr[r];
            mx = max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            float m_new = max_nan(m[r], mx);
            /* lazy: the old maximum stays while the new one is within
             * LAZY_MAX_LOG2 of it (the sum and O keep their scale), once a
             * score has set it: a row's first keys take their own maximum
             * (else a short row's largest P, exactly 1, would be a
             * rounded one; a sink's row of one key failed the 2x-naive
             * rule by 3x) */
            const bool keep = p.lazy_max && m[r] != m_start &&
                              (m_new - m[r]) * sl2 <= LAZY_MAX_LOG2;
            if (keep)
                m_new = m[r];
            const float ms = m_new == -INFINITY ? 0.f : m_new * sl2; /* all masked: no NaNs */
            alpha[r] = keep ? 1.f : ex2(m[r] * sl2 - ms);
            exp_row(s, r, sl2, fmaf(-dr[r], sl2, ms));
            m[r] = m_new;
        }
        /* dropout: P V takes the kept probabilities, scaled; the sum (and
         * LSE) all of them */
        if (EXT && flash_dropout<UM>(p))
            drop_acc<BC / 2>(p, b, h, s, wrow0, j0);
    }

    /* row r's P = 2^(s es - ms) in place, and its sum (this thread's
     * share; the quad adds up at the end) into l, rescaled by alpha */
    __device__ __forceinline__ void exp_row(float *s, int r, float es, float ms)
    {
        /* four partial sums: shorter dependency chains */
        float sum4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int n = 0; n < NT_S; n++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float &v = s[4 * n + 2 * r + e];
                v = ex2(fmaf(v, es, -ms));
                if (!ONES)
                    sum4[(2 * n + e) % 4] += v;
            }
        if (!ONES)
            l[r] = l[r] * alpha[r] + ((sum4[0] + sum4[1]) + (sum4[2] + sum4[3]));
    }

    __device__ __forceinline__ void rescale_pack(float *o, const float *s, uint32_t (*pa)[4]) const
    {
        pin_all<DO / 2>(o);
        /* a lazy maximum skips the products where no row of the warp
         * moved its own */
        if (!fixed_max() &&
            (!p.lazy_max || !__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f))) {
#pragma unroll
            for (int n = 0; n < NT_O; n++) {
                o[4 * n + 0] *= alpha[0];
                o[4 * n + 1] *= alpha[0];
                o[4 * n + 2] *= alpha[1];
                o[4 * n + 3] *= alpha[1];
            }
        }
#pragma unroll
        for (int kk = 0; kk < BC / 16; kk++) {
            pa[kk][0] = MmaType<T>::pack(s[8 * kk + 0], s[8 * kk + 1]);
            pa[kk][1] = MmaType<T>::pack(s[8 * kk + 2], s[8 * kk + 3]);
            pa[kk][2] = MmaType<T>::pack(s[8 * kk + 4], s[8 * kk + 5]);
            pa[kk][3] = MmaType<T>::pack(s[8 * kk + 6], s[8 * kk + 7]);
        }
    }

    /* the quad's partial sums (with ones in V, the whole sum sits in every
     * lane: one lane of the quad gives it), normalise, store O, LSE */
    __device__ __forceinline__ void finish(const float *o) const
    {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            /* a row that saw no key and no sink: sum 0, so O = 0 and
             * LSE = -inf */
            const float l_part = m[r] == -INFINITY ? 0.f
                                 : ONES ? (t4 == 0 ? o[4 * (DK / 8) + 2 * r] : 0.f)
                                        : l[r];
            store_out_row<T, NT_O>(p, b, h, wrow0 + g + 8 * r, r, o, l_part, m[r] * sl2);
        }
    }
};

/* The loop of both forward kernels over a warpgroup's key blocks kb0 ..
 * nkb - 1: iteration j issues S_j = Q K_j together with
 * O += P_{j-1} V_{j-1}, and the softmax of S_j runs while the tensor cores
 * work on the second. top(j) comes first in iteration j (the wgmma
 * kernel's copies; nkb: the last), s_done(j) once S_j is complete,
 * pv_done(j) once P_j V_j is (the warp-specialised kernel hands the
 * stages back there). Both warpgroups run every block (at most one wholly
 * masked block for the first under the causal mask): wgmma on a path the
 * compiler cannot prove uniform is serialised. */
template <bool TURNS, typename Rows, typename Top, typename IssueS, typename IssuePV,
          typename SDone, typename PVDone>
__device__ __forceinline__ void fwd_loop(int kb0, int nkb, const Turns<TURNS> &turns, Rows &rows,
                                         float *s, float *o, uint32_t (*pa)[4], Top top,
                                         IssueS issue_s, IssuePV issue_pv, SDone s_done,
                                         PVDone pv_done)
{
    top(kb0);
    wgmma_fence();
    turns.wait();
    issue_s(kb0);
    turns.pass();
    wgmma_wait<0>();
    s_done(kb0);
    rows.softmax(s, kb0);
    rows.rescale_pack(o, s, pa);
    for (int j = kb0 + 1; j < nkb; j++) {
        top(j);
        wgmma_fence();
        turns.wait();
        issue_s(j);
        issue_pv(j - 1);
        turns.pass();
        wgmma_wait<1>(); /* S_j is done; P_{j-1} V_{j-1} may still run */
        s_done(j);
        rows.softmax(s, j);
        wgmma_wait<0>();
        pv_done(j - 1);
        rows.rescale_pack(o, s, pa);
    }
    top(nkb);
    wgmma_fence();
    turns.wait();
    issue_pv(nkb - 1);
    turns.pass(true);
    wgmma_wait<0>();
    pin_all<Rows::DO / 2>(o);
}

/* A query block that no row of which sees a key: O = 0, LSE = -inf (or the
 * sink). */
__device__ __forceinline__ void fwd_store_empty(const FlashParams &p, int b, int h, int i0, int nq,
                                                float sink2, int tid, int threads)
{
    for (int idx = tid; idx < nq * p.d; idx += threads)
        store_elem(p.out.data, row_offset(p.out, b, i0 + idx / p.d, h) + idx % p.d, p.dtype, 0.f);
    for (int idx = tid; idx < nq; idx += threads)
        p.lse[flash_stat(p, b, h) + i0 + idx] = sink2 / FT_LOG2E;
}

template <typename T, int D, int DK, int BC, int NWG, int MINB, bool TURNS, bool EXT,
          typename UM = NoUserMod>
__global__ void __launch_bounds__(NWG *WG_THREADS, MINB) flash_fwd_wgmma_kernel(FlashParams p)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using L = Sm90FwdSmem<D, BC, NWG>;
    using Rows = FwdRows<T, D, DK, BC, EXT, UM>;
    constexpr int BR = L::BR, THREADS = NWG * WG_THREADS;
    constexpr int KV_BYTES = L::KV_BYTES, DO = Rows::DO;
    constexpr bool ONES = Rows::ONES;
    extern __shared__ unsigned char smem_raw[];
    /* the swizzle is on address bits: chunks must start on 1024 bytes */
    unsigned char *smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    unsigned char *const sQ = smem, *const sK = smem + L::K, *const sV = smem + L::V;

    const int tid = threadIdx.x, wg = tid / WG_THREADS;
    const int wwarp = (tid / FT_WARP) % 4; /* warp in the warpgroup */
    if (EXT) /* varlen: this CTA's sequence */
        flash_enter_seq(p, blockIdx.z);
    const QueryBlock qblk = query_block<BR, BC>(p);
    if (EXT && (qblk.i0 < 0 || qblk.i0 >= p.Nq))
        return; /* past its end: nothing to do */
    const int i0 = qblk.i0, kb0 = qblk.kb0, nkb = qblk.nkb;
    const int h = blockIdx.y, b = blockIdx.z;
    const int hk = h / (p.H / p.Hk);
    const float sink2 = flash_sink_log2(p, h);
    if (nkb == kb0)
        return fwd_store_empty(p, b, h, i0, qblk.nq, sink2, tid, THREADS);

    /* the copies fill D columns (zeros past d): the products read no more */
    const TileLoader<T, BC, D, THREADS> kload(p.k, b, hk, p.Nk, p.d),
        vload(p.v, b, hk, p.Nk, p.d, ONES ? DK : -1);
    TileLoader<T, BR, D, THREADS>(p.q, b, h, p.Nq, p.d).load(sQ, i0);
    kload.load(sK + (kb0 & 1) * KV_BYTES, kb0 * BC);
    cp_async_commit();
    if (ONES && tid < 2 * BC) { /* both V stages; made visible by top(0) */
        const uint32_t one = MmaType<T>::pack(1.f, 1.f);
        *reinterpret_cast<uint4 *>(sV + (tid / BC) * KV_BYTES + swz_offset<BC>(tid % BC, DK)) =
            make_uint4(one, one, one, one);
    }

    float o[DO / 2], s[BC / 2];
    uint32_t pa[BC / 16][4];
    Rows rows(p, b, h, i0 + wg * 64 + wwarp * 16, sink2, o);

    const uint32_t q_addr = smem_addr(sQ) + wg * 64 * 128;
    /* The top of iteration j: K_j and V_{j-1} have landed; K_{j+1} and V_j
     * are copied into the stages that K_{j-1} and V_{j-2} left (K runs one
     * block ahead of V). */
    auto top = [&](int j) {
        stages_ready();
        if (j + 1 < nkb)
            kload.load(sK + ((j + 1) & 1) * KV_BYTES, (j + 1) * BC);
        if (j < nkb)
            vload.load(sV + (j & 1) * KV_BYTES, j * BC);
        cp_async_commit();
    };
    auto issue_s = [&](int j) {
        product_abt<T, BC, DK, BR, BC>(s, q_addr, smem_addr(sK + (j & 1) * KV_BYTES));
        wgmma_commit();
    };
    auto issue_pv = [&](int j) {
        product_fb<T, BC, DO>(o, pa, smem_addr(sV + (j & 1) * KV_BYTES));
        wgmma_commit();
    };

    const auto none = [](int) {};
    fwd_loop(kb0, nkb, Turns<TURNS>(wg), rows, s, o, pa, top, issue_s, issue_pv, none, none);
    cp_async_wait<0>();
    rows.finish(o);
#endif
}

/* The warp-specialised forward's tensor maps: q, k, v as [B][N][heads][d]
 * (4-d maps, innermost first), boxes of 64 columns x rows. */
struct FwdMaps {
    FlashTmaMap q, k, v;
};

/* Its shared memory: Q [64 NC rows: NC consumer warpgroups], then K
 * stages, then V stages [BC rows], rows TW wide (16-bit, swizzled, chunks
 * on 1024 bytes), then the barriers: Q full, and full and empty for each
 * K and V stage. */
template <int D, int BC, int STAGES, int NC = 2> struct Sm90WsFwdSmem {
    static constexpr int BR = 64 * NC, TW = FT_TW(D);
    static constexpr int Q_BYTES = BR * TW * 2, KV_BYTES = BC * TW * 2;
    static constexpr int K = Q_BYTES, V = K + STAGES * KV_BYTES, BAR = V + STAGES * KV_BYTES;
    static constexpr int Q_FULL = 0, K_FULL = 8, K_EMPTY = K_FULL + 8 * STAGES,
                         V_FULL = K_EMPTY + 8 * STAGES, V_EMPTY = V_FULL + 8 * STAGES;
    static constexpr size_t bytes = 1024 + (size_t)BAR + V_EMPTY + 8 * STAGES;
};

/* The forward in FlashAttention-3's structure: warpgroup 0 is the producer
 * (one thread issues every copy, through the copy engine, into a ring of
 * STAGES K and V stages; it gives its registers to the others), warpgroups
 * 1 to NC the consumers, 64 query rows each, which never copy: they wait
 * on a stage's full barrier, multiply, and arrive on its empty barrier
 * when their products have read it. No CTA-wide barrier after the start.
 * The consumers' loop is the wgmma kernel's (S_j issued with
 * P_{j-1} V_{j-1}, the softmax under the latter, turns between the two
 * warpgroups), on FwdRows. Not for varlen calls (a box would run into the
 * next sequence's rows; the wgmma kernel takes them). With three
 * consumers (NC = 3) each scheduler has three of their warps to hide the
 * softmax's latencies (two leave d 64 latency-bound: 5.7 cycles an issue,
 * the tensor pipe 43% busy), on 160 registers a thread. */
template <int NC> struct WsRegs {
    static constexpr int producer = NC == 2 ? 24 : 32, consumer = NC == 2 ? 240 : 160;
    static_assert(producer * WG_THREADS + NC * consumer * WG_THREADS <= 65536, "registers");
};
template <typename T, int D, int DK, int BC, int STAGES, int NC, bool TURNS, bool EXT,
          typename UM = NoUserMod>
__global__ void __launch_bounds__((NC + 1) * WG_THREADS, 1)
    flash_fwd_ws_kernel(const FlashParams p, const __grid_constant__ FwdMaps maps)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    static_assert(!TURNS || NC == 2, "Turns takes two warpgroups (its named barriers)");
    using L = Sm90WsFwdSmem<D, BC, STAGES, NC>;
    using Rows = FwdRows<T, D, DK, BC, EXT, UM>;
    constexpr int BR = L::BR, KV_BYTES = L::KV_BYTES, DO = Rows::DO;
    constexpr bool ONES = Rows::ONES;
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    const uint32_t sQ = smem_addr(smem), sK = sQ + L::K, sV = sQ + L::V, bar = sQ + L::BAR;

    const int tid = threadIdx.x, wg = warpgroup_of<TURNS>(tid);
    const QueryBlock qblk = query_block<BR, BC>(p);
    const int i0 = qblk.i0, kb0 = qblk.kb0, nkb = qblk.nkb;
    const int h = blockIdx.y, b = blockIdx.z;
    const float sink2 = flash_sink_log2(p, h);
    if (nkb == kb0)
        return fwd_store_empty(p, b, h, i0, qblk.nq, sink2, tid, (NC + 1) * WG_THREADS);
    /* the chunks of 64 columns holding some of the d columns: the copies
     * bring those (zeros past d); the rest of a tile is never written */
    const int chunks = (p.d + 63) / 64;
    if (tid == 0) {
        mbar_init(bar + L::Q_FULL, 1);
        for (int st = 0; st < STAGES; st++) {
            mbar_init(bar + L::K_FULL + 8 * st, 1);
            mbar_init(bar + L::V_FULL + 8 * st, 1);
            mbar_init(bar + L::K_EMPTY + 8 * st, NC); /* a thread of each consumer */
            mbar_init(bar + L::V_EMPTY + 8 * st, NC);
        }
        mbar_init_fence();
    }
    /* columns of V past the chunks copied: zeros, and the ones column */
    for (int idx = tid; idx < STAGES * BC * FT_TW(D) / 8; idx += (NC + 1) * WG_THREADS) {
        const int st = idx / (BC * FT_TW(D) / 8), r = idx / (FT_TW(D) / 8) % BC,
                  c = idx % (FT_TW(D) / 8) * 8;
        if (c >= chunks * 64) {
            const uint32_t one = MmaType<T>::pack(1.f, 1.f), w = ONES && c == DK ? one : 0u;
            *reinterpret_cast<uint4 *>(smem + L::V + st * KV_BYTES + swz_offset<BC>(r, c)) =
                make_uint4(w, w, w, w);
        }
    }
    fence_proxy_async();
    __syncthreads();

    if (wg == 0) { /* the producer */
        regs_dec<WsRegs<NC>::producer>();
        if (tid == 0) {
            const int hk = h / (p.H / p.Hk);
            mbar_expect(bar + L::Q_FULL, chunks * BR * 128);
            for (int c = 0; c < chunks; c++)
                tma_load_4d(sQ + c * BR * 128, &maps.q, bar + L::Q_FULL, c * 64, h, i0, b);
            for (int j = kb0; j < nkb; j++) {
                const int n = j - kb0, st = n % STAGES, ph = (n / STAGES) & 1;
                mbar_wait(bar + L::K_EMPTY + 8 * st, ph ^ 1);
                mbar_expect(bar + L::K_FULL + 8 * st, chunks * BC * 128);
                for (int c = 0; c < chunks; c++)
                    tma_load_4d(sK + st * KV_BYTES + c * BC * 128, &maps.k, bar + L::K_FULL + 8 * st,
                                c * 64, hk, j * BC, b);
                mbar_wait(bar + L::V_EMPTY + 8 * st, ph ^ 1);
                mbar_expect(bar + L::V_FULL + 8 * st, chunks * BC * 128);
                for (int c = 0; c < chunks; c++)
                    tma_load_4d(sV + st * KV_BYTES + c * BC * 128, &maps.v, bar + L::V_FULL + 8 * st,
                                c * 64, hk, j * BC, b);
            }
        }
    } else { /* the consumers */
        regs_inc<WsRegs<NC>::consumer>();
        const int cwg = wg - 1, wwarp = (tid / FT_WARP) % 4;
        float o[DO / 2], s[BC / 2];
        uint32_t pa[BC / 16][4];
        Rows rows(p, b, h, i0 + cwg * 64 + wwarp * 16, sink2, o);
        const uint32_t q_addr = sQ + cwg * 64 * 128;
        auto stage = [&](int j) { return (j - kb0) % STAGES; };
        auto phase = [&](int j) { return ((j - kb0) / STAGES) & 1; };
        auto issue_s = [&](int j) {
            mbar_wait(bar + L::K_FULL + 8 * stage(j), phase(j));
            product_abt<T, BC, DK, BR, BC>(s, q_addr, sK + stage(j) * KV_BYTES);
            wgmma_commit();
        };
        auto issue_pv = [&](int j) {
            mbar_wait(bar + L::V_FULL + 8 * stage(j), phase(j));
            product_fb<T, BC, DO>(o, pa, sV + stage(j) * KV_BYTES);
            wgmma_commit();
        };
        /* once wgmma_wait has seen the products that read a stage done (for
         * the whole warpgroup), one thread hands the stage back */
        const bool signal = tid % WG_THREADS == 0;
        auto release = [&](int empty, int j) {
            if (signal)
                mbar_arrive(bar + empty + 8 * stage(j));
        };
        mbar_wait(bar + L::Q_FULL, 0);
        fwd_loop(kb0, nkb, Turns<TURNS>(cwg), rows, s, o, pa, [](int) {}, issue_s, issue_pv,
                 [&](int j) { release(L::K_EMPTY, j); }, [&](int j) { release(L::V_EMPTY, j); });
        rows.finish(o);
    }
#endif
}

/* The persistent form of the warp-specialised forward (head dims 65 to
 * 128 up to the tile row's persist_max_keys keys, and at any length with
 * FT_PERSIST=1; two consumers, so not the three of d <= 64): a grid of at
 * most one CTA an SM, each taking tiles (query block, head, batch entry)
 * in rounds of the grid's size, the query blocks of one head next to each
 * other (they share its K/V copies in L2), longest first under the causal
 * mask, snaking (tile_of). The K/V ring and its phases run on across a
 * CTA's tiles, and Q has an empty barrier too (the consumers hand it back
 * once their last S product of a tile is done), so the producer copies the next tile's Q and first K/V blocks
 * while the consumers finish this tile's last P V and store O and LSE. */
template <int D, int BC, int STAGES> struct Sm90WsPersistSmem : Sm90WsFwdSmem<D, BC, STAGES> {
    using Base = Sm90WsFwdSmem<D, BC, STAGES>;
    static constexpr int Q_EMPTY = Base::V_EMPTY + 8 * STAGES;
    static constexpr size_t bytes = Base::bytes + 8;
};

template <typename T, int D, int DK, int BC, int STAGES, bool TURNS, bool EXT,
          typename UM = NoUserMod>
__global__ void __launch_bounds__(3 * WG_THREADS, 1)
    flash_fwd_ws_persistent_kernel(const FlashParams p, const __grid_constant__ FwdMaps maps)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using L = Sm90WsPersistSmem<D, BC, STAGES>;
    using Rows = FwdRows<T, D, DK, BC, EXT, UM>;
    constexpr int BR = L::BR, KV_BYTES = L::KV_BYTES, DO = Rows::DO;
    constexpr bool ONES = Rows::ONES;
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    const uint32_t sQ = smem_addr(smem), sK = sQ + L::K, sV = sQ + L::V, bar = sQ + L::BAR;

    const int tid = threadIdx.x, wg = warpgroup_of<TURNS>(tid);
    /* the walk (TileWalk; snaking: a static schedule within 3% of the
     * mean work a CTA up to 32 query blocks a head, where a stride of G
     * left 0.75 of it at 8) */
    const TileWalk walk((p.Nq + BR - 1) / BR, p.H, p.B, p.lengths_first);
    const int ntiles = walk.ntiles, rounds = walk.rounds();
    auto tile_of = [&](int r) { return walk.tile(r); };
    auto tile_at = [&](int t, int *h, int *b) {
        const int bh = walk.head_batch(t);
        *h = bh % p.H;
        *b = bh / p.H;
        return query_block<BR, BC>(p, walk.block(t));
    };
    const int chunks = (p.d + 63) / 64;
    if (tid == 0) {
        mbar_init(bar + L::Q_FULL, 1);
        mbar_init(bar + L::Q_EMPTY, 2); /* a thread of each consumer */
        for (int st = 0; st < STAGES; st++) {
            mbar_init(bar + L::K_FULL + 8 * st, 1);
            mbar_init(bar + L::V_FULL + 8 * st, 1);
            mbar_init(bar + L::K_EMPTY + 8 * st, 2);
            mbar_init(bar + L::V_EMPTY + 8 * st, 2);
        }
        mbar_init_fence();
    }
    /* columns of V past the chunks copied: zeros, and the ones column */
    for (int idx = tid; idx < STAGES * BC * FT_TW(D) / 8; idx += 3 * WG_THREADS) {
        const int st = idx / (BC * FT_TW(D) / 8), r = idx / (FT_TW(D) / 8) % BC,
                  c = idx % (FT_TW(D) / 8) * 8;
        if (c >= chunks * 64) {
            const uint32_t one = MmaType<T>::pack(1.f, 1.f), w = ONES && c == DK ? one : 0u;
            *reinterpret_cast<uint4 *>(smem + L::V + st * KV_BYTES + swz_offset<BC>(r, c)) =
                make_uint4(w, w, w, w);
        }
    }
    fence_proxy_async();
    __syncthreads();

    if (wg == 0) { /* the producer */
        regs_dec<WsRegs<2>::producer>();
        if (tid == 0) {
            int n = 0, k = 0; /* K/V blocks and tiles with keys so far */
            for (int r = 0; r < rounds; r++) {
                const int t = tile_of(r);
                if (t >= ntiles)
                    continue;
                int h, b;
                const QueryBlock q = tile_at(t, &h, &b);
                if (q.nkb == q.kb0)
                    continue;
                const int hk = h / (p.H / p.Hk);
                mbar_wait(bar + L::Q_EMPTY, (k & 1) ^ 1);
                mbar_expect(bar + L::Q_FULL, chunks * BR * 128);
                for (int c = 0; c < chunks; c++)
                    tma_load_4d(sQ + c * BR * 128, &maps.q, bar + L::Q_FULL, c * 64, h, q.i0, b);
                for (int j = q.kb0; j < q.nkb; j++, n++) {
                    const int st = n % STAGES, ph = (n / STAGES) & 1;
                    mbar_wait(bar + L::K_EMPTY + 8 * st, ph ^ 1);
                    mbar_expect(bar + L::K_FULL + 8 * st, chunks * BC * 128);
                    for (int c = 0; c < chunks; c++)
                        tma_load_4d(sK + st * KV_BYTES + c * BC * 128, &maps.k,
                                    bar + L::K_FULL + 8 * st, c * 64, hk, j * BC, b);
                    mbar_wait(bar + L::V_EMPTY + 8 * st, ph ^ 1);
                    mbar_expect(bar + L::V_FULL + 8 * st, chunks * BC * 128);
                    for (int c = 0; c < chunks; c++)
                        tma_load_4d(sV + st * KV_BYTES + c * BC * 128, &maps.v,
                                    bar + L::V_FULL + 8 * st, c * 64, hk, j * BC, b);
                }
                k++;
            }
        }
    } else { /* the consumers */
        regs_inc<WsRegs<2>::consumer>();
        const int cwg = wg - 1, wwarp = (tid / FT_WARP) % 4;
        const bool signal = tid % WG_THREADS == 0;
        const uint32_t q_addr = sQ + cwg * 64 * 128;
        float o[DO / 2], s[BC / 2];
        uint32_t pa[BC / 16][4];
        /* the ring's blocks are counted across tiles: block nb sits in
         * stage nb % STAGES, phase (nb / STAGES) & 1 */
        auto issue_s = [&](int nb) {
            mbar_wait(bar + L::K_FULL + 8 * (nb % STAGES), (nb / STAGES) & 1);
            product_abt<T, BC, DK, BR, BC>(s, q_addr, sK + (nb % STAGES) * KV_BYTES);
            wgmma_commit();
        };
        auto issue_pv = [&](int nb) {
            mbar_wait(bar + L::V_FULL + 8 * (nb % STAGES), (nb / STAGES) & 1);
            product_fb<T, BC, DO>(o, pa, sV + (nb % STAGES) * KV_BYTES);
            wgmma_commit();
        };
        auto release = [&](int empty, int nb) {
            if (signal)
                mbar_arrive(bar + empty + 8 * (nb % STAGES));
        };
        int n = 0, k = 0;
        for (int r = 0; r < rounds; r++) {
            const int t = tile_of(r);
            if (t >= ntiles)
                continue;
            int h, b;
            const QueryBlock q = tile_at(t, &h, &b);
            const float sink2 = flash_sink_log2(p, h);
            if (q.nkb == q.kb0) {
                fwd_store_empty(p, b, h, q.i0, q.nq, sink2, tid - WG_THREADS, 2 * WG_THREADS);
                continue;
            }
            Rows rows(p, b, h, q.i0 + cwg * 64 + wwarp * 16, sink2, o);
            const int kb0 = q.kb0, n0 = n;
            const auto nb = [&](int j) { return n0 + j - kb0; }; /* key block j's */
            mbar_wait(bar + L::Q_FULL, k & 1);
            fwd_loop(kb0, q.nkb, Turns<TURNS>(cwg), rows, s, o, pa, [](int) {},
                     [&](int j) { issue_s(nb(j)); }, [&](int j) { issue_pv(nb(j)); },
                     [&](int j) {
                         release(L::K_EMPTY, nb(j));
                         if (j == q.nkb - 1 && signal) /* the tile's last S: Q is free */
                             mbar_arrive(bar + L::Q_EMPTY);
                     },
                     [&](int j) { release(L::V_EMPTY, nb(j)); });
            /* fwd_loop hands back every V stage but the last block's (the
             * kernel above ends there); the ring runs on here */
            release(L::V_EMPTY, nb(q.nkb - 1));
            rows.finish(o);
            n += q.nkb - kb0;
            k++;
        }
    }
#endif
}

#ifndef __CUDACC_RTC__
template <typename T, int D, int DK, int BC, int NWG, int MINB, bool TURNS, bool EXT>
static ft_status launch_fwd_wgmma(const FlashParams &p, FlashRtc *rtc)
{
    using L = Sm90FwdSmem<D, BC, NWG>;
    static_assert(sizeof(T) == 2, "the wgmma kernels take 16-bit elements");
    return flash_launch(rtc, FLASH_FILE, flash_fwd_wgmma_kernel<T, D, DK, BC, NWG, MINB, TURNS, EXT>,
                        [] { return rtc_name("flash_fwd_wgmma_kernel", TypeOf<T>(), D, DK, BC, NWG, MINB, TURNS, EXT); },
                        dim3((p.Nq + L::BR - 1) / L::BR, p.H, p.B), NWG * WG_THREADS, L::bytes, p,
                        "ft_attention_forward");
}

/* The warp-specialised kernel for p, if it takes it: not for varlen, not
 * with FT_NO_WS set (which keeps the wgmma kernel, for comparison), from
 * the row's min_keys on (at any length with FT_WS set, which the specs
 * use), and only where the copy engine takes the tensors; its persistent
 * form where a block of rows sees up to persist_max_keys keys (at any
 * length with FT_PERSIST set, two consumers only; never with FT_NO_PERSIST
 * set, nor by length with FT_WS set). *launched says whether it ran. A
 * dry rtc (compiling a mod's kernels) has no tensors: the kernels the
 * defaults may take are named and compiled. */
template <typename T, int D, int DK, int BC, int STAGES, int NC, bool TURNS, bool EXT>
static ft_status launch_fwd_ws(const FlashParams &p, FlashRtc *rtc, int min_keys,
                               int persist_max_keys, bool *launched)
{
    using L = Sm90WsFwdSmem<D, BC, STAGES, NC>;
    *launched = false;
    const bool any_length = switch_on("FT_WS");
    /* the keys a block of rows sees: a window bounded on both sides (a
     * causal one included) gives every tile the same few key blocks at any
     * length, and the persistent kernel's overlap of one tile's end with
     * the next one's start pays there as on short calls (1.11x-1.14x at
     * window 1024, causal, N 4096 and 16384) */
    const int64_t keys = ft_mod_block_keys(&p.mod, p.Nk, L::BR);
    const bool persist = D == 128 && NC == 2 && !TURNS && !switch_on("FT_NO_PERSIST") &&
                         (switch_on("FT_PERSIST") ||
                          (persist_max_keys > 0 && keys <= persist_max_keys && !any_length));
    if (p.cu_q || switch_on("FT_NO_WS") || (p.Nk < min_keys && !any_length && !persist && p.q.data))
        return FT_OK;
    FwdMaps maps;
    memset(&maps, 0, sizeof maps);
    if (p.q.data && !(flash_tma_map(&maps.q, p.q, p.B, p.Nq, p.H, p.d, L::BR, p.dtype) &&
                      flash_tma_map(&maps.k, p.k, p.B, p.Nk, p.Hk, p.d, BC, p.dtype) &&
                      flash_tma_map(&maps.v, p.v, p.B, p.Nk, p.Hk, p.d, BC, p.dtype)))
        return FT_OK;
    *launched = true;
    if constexpr (D == 128 && !TURNS && NC == 2) /* head dims 65 to 128 */
    if (persist || (!p.q.data && persist_max_keys > 0)) {
        using LP = Sm90WsPersistSmem<D, BC, STAGES>;
        const int64_t tiles = (int64_t)((p.Nq + L::BR - 1) / L::BR) * p.H * p.B;
        int dev = 0; /* a dry rtc launches nothing: any count */
        const int sms = p.q.data && cudaGetDevice(&dev) == cudaSuccess ? flash_sm_count(dev) : 132;
        if (!p.q.data || (tiles > 0 && tiles < 2147483647LL)) {
            /* forced (FT_PERSIST), a causal walk goes in order of the
             * tiles' lengths across heads: not measured yet, so only then */
            FlashParams pp = p;
            pp.lengths_first = p.causal && switch_on("FT_PERSIST");
            const ft_status st = flash_launch(
                rtc, FLASH_FILE, flash_fwd_ws_persistent_kernel<T, D, DK, BC, STAGES, TURNS, EXT>,
                [] { return rtc_name("flash_fwd_ws_persistent_kernel", TypeOf<T>(), D, DK, BC, STAGES, TURNS, EXT); },
                dim3((unsigned)(tiles < sms ? tiles : sms)), 3 * WG_THREADS, LP::bytes, pp,
                "ft_attention_forward", maps);
            if (p.q.data || st != FT_OK)
                return st; /* a dry rtc compiles the other one too */
        }
    }
    return flash_launch(rtc, FLASH_FILE, flash_fwd_ws_kernel<T, D, DK, BC, STAGES, NC, TURNS, EXT>,
                        [] { return rtc_name("flash_fwd_ws_kernel", TypeOf<T>(), D, DK, BC, STAGES, NC, TURNS, EXT); },
                        dim3((p.Nq + L::BR - 1) / L::BR, p.H, p.B), (NC + 1) * WG_THREADS, L::bytes, p,
                        "ft_attention_forward", maps);
}

/* f16/bf16, 16-byte aligned rows (the caller checks): the row of
 * SM90_WS_FWD_TILES (flash_tiles.cuh) that takes the head dim, else that
 * of SM90_FWD_TILES. */
ft_status flash_fwd_sm90(const FlashParams &p, FlashRtc *rtc)
{
    return flash_dispatch(p, [&](auto type, auto ext) {
        using T = typename decltype(type)::type;
        constexpr bool EXT = decltype(ext)::value;
        bool done = false;
        int shorter = 0; /* whether calls of some length take the wgmma kernel */
        FT_TRY(flash_pick(SM90_WS_FWD_TILES, p.d, [&](auto row) {
            constexpr Sm90WsFwdTile c = SM90_WS_FWD_TILES[decltype(row)::value];
            shorter = c.min_keys || c.min_keys_causal || c.ext_min_keys;
            if constexpr (c.BC > 0) {
                const int min_keys = EXT && c.ext_min_keys ? c.ext_min_keys
                                     : p.causal           ? c.min_keys_causal
                                                          : c.min_keys;
                constexpr int BC = EXT && c.ext_BC ? c.ext_BC : c.BC,
                              NC = EXT && c.ext_consumers ? c.ext_consumers : c.consumers;
                /* the consumers take turns (never in the persistent
                 * kernel) from the row's turns_min_keys keys a block of
                 * rows sees; FT_TURNS: at any length, FT_NO_TURNS: never */
                if constexpr (c.turns_min_keys > 0) {
                    const int64_t keys = ft_mod_block_keys(
                        &p.mod, p.Nk, Sm90WsFwdSmem<c.D, BC, c.STAGES, NC>::BR);
                    const bool forced = switch_on("FT_TURNS");
                    const bool turns = !switch_on("FT_NO_TURNS") &&
                                       (forced ||
                                        (keys >= c.turns_min_keys && !switch_on("FT_PERSIST")));
                    if (turns || !p.q.data) /* a dry rtc compiles it too */
                        FT_TRY((launch_fwd_ws<T, c.D, c.DK, BC, c.STAGES, NC, true, EXT>(
                            p, rtc, forced ? 0 : min_keys, 0, &done)));
                    if (done && p.q.data)
                        return FT_OK;
                }
                return launch_fwd_ws<T, c.D, c.DK, BC, c.STAGES, NC, false, EXT>(
                    p, rtc, min_keys, c.persist_max_keys, &done);
            }
            return FT_OK;
        }));
        if (done && (p.q.data || !shorter))
            return FT_OK; /* a dry run compiles both where both may run */
        return flash_pick(SM90_FWD_TILES, p.d, [&](auto row) {
            constexpr Sm90FwdTile c = SM90_FWD_TILES[decltype(row)::value];
            return launch_fwd_wgmma<T, c.D, c.DK, c.BC, c.NWG, c.MINB, c.turns, EXT>(p, rtc);
        });
    });
}
#endif
