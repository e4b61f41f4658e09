/*
 * flash_fwd_sm90.cu - the flash forward pass on Hopper's warpgroup matrix
 * products (wgmma, sm_90a): flash_fwd_wgmma_kernel, f16/bf16, every head
 * dim up to 256 (12 instantiations).
 * Built when the CUDA architectures include 90a (FT_HAVE_SM90A); used on
 * devices of compute capability 9.0 unless FT_NO_WGMMA is set. Needs
 * head_dim % 8 == 0 and 16-byte aligned rows (the caller checks).
 * Check: spec/cuda_attention_spec.lua (busted, tag gpu) against the CPU f64
 * reference; scripts/bench.lua checks, then times; scripts/profile.lua runs
 * one call for ncu. Design and measurements: kernels/README.md.
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

template <typename T, int D, int DK, int BC, int NWG, int MINB, bool TURNS, bool EXT,
          typename UM = NoUserMod>
__global__ void __launch_bounds__(NWG *WG_THREADS, MINB) flash_fwd_wgmma_kernel(FlashParams p)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using L = Sm90FwdSmem<D, BC, NWG>;
    constexpr int BR = L::BR, THREADS = NWG * WG_THREADS;
    constexpr int TW = L::TW, KV_BYTES = L::KV_BYTES;
    /* When the tiles are wider than the score products' DK columns (d = 32
     * in 64-wide rows, d = 192 in D = 256) and the blocks have 64 keys,
     * V's columns DK .. DK+7 hold ones and P V's column DK is P's row sum:
     * added up by the tensor cores and rescaled with O, no per-score add
     * (d = 96, 128-key blocks, measured slower with it and keeps the adds). */
    constexpr bool ONES = !EXT && DK < TW && BC == 64; /* EXT: dropout drops from P V, not the sum */
    constexpr int DO = ONES && DK + 8 > D ? DK + 8 : D; /* the width of P V */
    constexpr int NT_S = BC / 8, NT_O = DO / 8;
    extern __shared__ unsigned char smem_raw[];
    /* the swizzle is on address bits: chunks must start on 1024 bytes */
    unsigned char *smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    unsigned char *const sQ = smem, *const sK = smem + L::K, *const sV = smem + L::V;

    const int tid = threadIdx.x, wg = tid / WG_THREADS, lane = tid % FT_WARP;
    const int wwarp = (tid / FT_WARP) % 4; /* warp in the warpgroup */
    const int g = lane / 4, t4 = lane % 4;
    if (EXT) /* varlen: this CTA's sequence */
        flash_enter_seq(p, blockIdx.z);
    const QueryBlock qblk = query_block<BR, BC>(p);
    if (EXT && (qblk.i0 < 0 || qblk.i0 >= p.Nq))
        return; /* past its end: nothing to do */
    const int i0 = qblk.i0, nq = qblk.nq, kb0 = qblk.kb0, nkb = qblk.nkb;
    const int h = blockIdx.y, b = blockIdx.z;
    const int hk = h / (p.H / p.Hk);
    const float sink2 = flash_sink_log2(p, h);
    if (nkb == kb0) { /* no row sees a key: O = 0, LSE = -inf (or the sink) */
        for (int idx = tid; idx < nq * p.d; idx += THREADS)
            store_elem(p.out.data, row_offset(p.out, b, i0 + idx / p.d, h) + idx % p.d, p.dtype, 0.f);
        for (int idx = tid; idx < nq; idx += THREADS)
            p.lse[flash_stat(p, b, h) + i0 + idx] = sink2 / FT_LOG2E;
        return;
    }
    const int wrow0 = i0 + wg * 64 + wwarp * 16; /* this warp's first row */
    const FullKeys full = flash_full_keys(p, wrow0, wrow0 + 16);
    const float sl2 = p.scale_log2;
    const ScoreMod smod = flash_score_mod(p, b, h);

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
    /* rows g, g+8; raw units (times sl2: log2 units); a sink starts them */
    const float m0 = sink2 == -INFINITY ? -INFINITY : sink2 / sl2;
    const float l0 = flash_sink_sum(sink2, t4 == 0);
    float m[2] = {m0, m0}, l[2] = {ONES ? 0.f : l0, ONES ? 0.f : l0};
#pragma unroll
    for (int i = 0; i < DO / 2; i++)
        o[i] = 0.f;
    if (ONES) { /* the sum sits in O's column DK, lane t4 = 0 */
        o[4 * (DK / 8)] = l0;
        o[4 * (DK / 8) + 2] = l0;
    }

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
    /* mask where needed, online softmax in raw units (exp2 by one FFMA) */
    float alpha[2];
    auto softmax = [&](int j) {
        pin_all<BC / 2>(s);
        const int j0 = j * BC;
        if (EXT || UM::on) /* a Lua-written mod alone needs none of EXT's state */
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
            /* four partial maxima and sums: shorter dependency chains */
            float mx4[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
            for (int n = 0; n < NT_S; n++)
#pragma unroll
                for (int e = 0; e < 2; e++)
                    mx4[(2 * n + e) % 4] = fmaxf(mx4[(2 * n + e) % 4], s[4 * n + 2 * r + e]);
            float mx = fmaxf(fmaxf(mx4[0], mx4[1]), fmaxf(mx4[2], mx4[3]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m[r], mx);
            const float ms = m_new == -INFINITY ? 0.f : m_new * sl2; /* all masked: no NaNs */
            alpha[r] = ex2(m[r] * sl2 - ms);
            float sum4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int n = 0; n < NT_S; n++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    float &v = s[4 * n + 2 * r + e];
                    v = ex2(fmaf(v, sl2, -ms));
                    if (!ONES)
                        sum4[(2 * n + e) % 4] += v;
                }
            /* this thread's share; the quad adds up at the end */
            if (!ONES)
                l[r] = l[r] * alpha[r] + ((sum4[0] + sum4[1]) + (sum4[2] + sum4[3]));
            m[r] = m_new;
        }
        /* dropout: P V takes the kept probabilities, scaled; the sum (and
         * LSE) all of them */
        if (EXT && p.mod.dropout)
            drop_acc<BC / 2>(p, b, h, s, wrow0, j0);
    };
    /* O *= alpha, and P (16 bits) from S: S's accumulators are P's A fragments */
    auto rescale_pack = [&]() {
        pin_all<DO / 2>(o);
#pragma unroll
        for (int n = 0; n < NT_O; n++) {
            o[4 * n + 0] *= alpha[0];
            o[4 * n + 1] *= alpha[0];
            o[4 * n + 2] *= alpha[1];
            o[4 * n + 3] *= alpha[1];
        }
#pragma unroll
        for (int kk = 0; kk < BC / 16; kk++) {
            pa[kk][0] = MmaType<T>::pack(s[8 * kk + 0], s[8 * kk + 1]);
            pa[kk][1] = MmaType<T>::pack(s[8 * kk + 2], s[8 * kk + 3]);
            pa[kk][2] = MmaType<T>::pack(s[8 * kk + 4], s[8 * kk + 5]);
            pa[kk][3] = MmaType<T>::pack(s[8 * kk + 6], s[8 * kk + 7]);
        }
    };

    const Turns<TURNS> turns(wg);

    /* Iteration j issues S_j = Q K_j and O += P_{j-1} V_{j-1} together; the
     * softmax of S_j runs while the tensor cores work on P_{j-1} V_{j-1}.
     * Both warpgroups run every block (at most one wholly masked block for
     * the first under the causal mask): wgmma on a path the compiler cannot
     * prove uniform is serialised. */
    top(kb0);
    wgmma_fence();
    turns.wait();
    issue_s(kb0);
    turns.pass();
    wgmma_wait<0>();
    softmax(kb0);
    rescale_pack();
    for (int j = kb0 + 1; j < nkb; j++) {
        top(j);
        wgmma_fence();
        turns.wait();
        issue_s(j);
        issue_pv(j - 1);
        turns.pass();
        wgmma_wait<1>(); /* S_j is done; P_{j-1} V_{j-1} may still run */
        softmax(j);
        wgmma_wait<0>();
        rescale_pack();
    }
    top(nkb);
    wgmma_fence();
    turns.wait();
    issue_pv(nkb - 1);
    turns.pass(true);
    wgmma_wait<0>();
    pin_all<DO / 2>(o);
    cp_async_wait<0>();

    /* finish: the quad's partial sums (with ones in V, the whole sum sits in
     * every lane: one lane of the quad gives it), normalise, store O, LSE */
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const float l_part = ONES ? (t4 == 0 ? o[4 * (DK / 8) + 2 * r] : 0.f) : l[r];
        store_out_row<T, NT_O>(p, b, h, wrow0 + g + 8 * r, r, o, l_part, m[r] * sl2);
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

/* f16/bf16, 16-byte aligned rows (the caller checks): the row of
 * SM90_FWD_TILES (flash_tiles.cuh) that takes the head dim. */
ft_status flash_fwd_sm90(const FlashParams &p, FlashRtc *rtc)
{
    return flash_dispatch(p, [&](auto type, auto ext) {
        using T = typename decltype(type)::type;
        return flash_pick(SM90_FWD_TILES, p.d, [&](auto row) {
            constexpr Sm90FwdTile c = SM90_FWD_TILES[decltype(row)::value];
            return launch_fwd_wgmma<T, c.D, c.DK, c.BC, c.NWG, c.MINB, c.turns,
                                    decltype(ext)::value>(p, rtc);
        });
    });
}
#endif
