/*
 * flash_fwd_sm90.cu - the flash forward pass on Hopper's warpgroup matrix
 * products (wgmma, sm_90a), f16/bf16, every head dim up to 256.
 *
 *   flash_fwd_wgmma_kernel<T, D, DK, BC, NWG, MINB, TURNS>: one CTA of NWG
 *       warpgroups per 64 x NWG query rows of one (batch, head); each
 *       warpgroup owns 64 rows. Q, K and V tiles sit in shared memory in the
 *       128-byte swizzled layout (flash_wgmma.cuh); K and V in two stages,
 *       copied by cp.async. S = Q K^T is a chain of m64nBCk16 products with
 *       both operands in shared memory; the online softmax runs on S's
 *       accumulators in registers (exp2 by one FFMA and ex2.approx); O += P V
 *       takes P from registers and V from shared memory, transposed by the
 *       descriptor. Iteration j issues S_j = Q K_j together with
 *       O += P_{j-1} V_{j-1}, and the softmax of S_j runs while the tensor
 *       cores work on the second (K runs one block ahead of V). Masks are
 *       applied in a separate pass, only on blocks at the end of K or across
 *       the causal diagonal; causal CTAs start with the longest rows.
 *       D: head dim rounded up to 32, 64, 128 or 256 (the width of O and of
 *       P V); DK: rounded up to a multiple of 32 (the columns Q K^T
 *       multiplies): d = 96 runs D = 128, DK = 96; d = 192 runs D = 256,
 *       DK = 192. Shapes: d <= 64: 64-key blocks, two CTAs per SM;
 *       d <= 128: 128-key blocks; d > 128: 64-key blocks; 12 instantiations.
 *       Where the tiles are wider than DK (d = 32 and 192), V carries a
 *       column of ones and P V yields the row sums (below, w6). TURNS: the
 *       two warpgroups issue their products in turn (w7; d = 96, 128).
 *
 * Built when the CUDA architectures include 90a (FT_HAVE_SM90A); used on
 * devices of compute capability 9.0 unless FT_NO_WGMMA is set; the
 * mma.sync kernels of flash_fwd.cu run elsewhere. Check:
 * spec/cuda_attention_spec.lua (busted, tag gpu) against the CPU f64
 * reference; scripts/bench.lua checks, then times; scripts/profile.lua
 * runs one call for ncu.
 *
 * Measured on the H200 (2026-11-30, f16, N = 16384, B x H = 1 x 2048/d,
 * non-causal, TFLOP/s; FlashAttention-2 on the same card: 302 at d = 64,
 * 340 at d = 128; the mma.sync kernel of flash_fwd.cu: 178 and 235):
 *   w1  S, softmax, P V one after the other, 128 x 128 blocks, 2 warpgroups:
 *       d = 64: 204, d = 128: 278. Both products waited for at once.
 *   w2  S_j issued with P_{j-1} V_{j-1}, softmax overlapping the latter;
 *       exp2 on one FFMA + ex2.approx.ftz (was FMUL + exp2f's range code);
 *       copies with per-thread pointers: d = 64: 275, d = 128: 401.
 *   w3  d = 64 with 64-key blocks and two CTAs per SM (~120 registers):
 *       275 -> 304 (128-key blocks: 262-274; 192: 282; 3 or 4 warpgroups
 *       of 64-key blocks: 253, 273 - lockstep warpgroups, slower).
 *       d = 128 with 3 or 4 warpgroups: 391 (and spills), 336.
 *   w4  masks in their own pass on edge blocks only (the hot loop had
 *       carried the per-element index arithmetic: ncu showed the kernel
 *       issue-bound, 65% issue slots busy at d = 64, 17 instructions per
 *       score); max and sum in four partial chains: d = 64: 360, d = 128:
 *       405. Skipping the O rescale when no row maximum moved (a warp vote)
 *       was slower: 383 at d = 128.
 *   w5  descriptors built once per product (one 32-bit add per k-step
 *       instead of building each), copy pointers stepped by a precomputed
 *       stride: d = 64: 379, d = 128: 453 (the hot loop went from 412 to
 *       about 330 instructions per thread at d = 64).
 *   Other head dims (N = 16384): d = 32: 235 (0.62x of d = 64: the
 *   exponentials and the softmax's other per-score instructions, not the
 *   products, bound it, and d = 32 has half the FLOPs per score), d = 96:
 *   371, d = 192: 420, d = 256: 470.
 *   w6  the row sums from the tensor cores: V's columns DK .. DK+7 (unused
 *       at d = 32 and 192) hold ones, so P V's column DK is the row sum,
 *       rescaled with O; the per-score add goes (d = 32 with P V 40 wide).
 *       The copies fill only the D columns the products read (d = 32 had
 *       zero-filled all 64). d = 32: 238 -> 248 (causal 230 -> 241),
 *       d = 192: 0.92x -> 0.97x of d = 128 in the same run. With 128-key
 *       blocks (d = 96) it was slower: 0.86x -> 0.76x of d = 128, so d = 96
 *       keeps the adds. Tried at d = 32, all slower than 248: 128-key blocks
 *       (150 registers, one CTA per SM) 205; 3 or 4 warpgroups 200 to 206;
 *       three CTAs per SM (78 registers, 192 bytes spilled) 132. ncu at
 *       d = 32: 344 instructions per thread per 64-key block, 64% of issue
 *       slots busy, the MUFU pipe at 52%; ex2.approx.f16x2 would not help:
 *       on sm_90 it is two MUFU.EX2.F16, 16 results per clock per SM like
 *       the f32 form (measured, with its error: 3.4e-3 relative, 7x the
 *       f16 rounding).
 *   w7  the two warpgroups take turns to issue their products (named
 *       barriers, Turns in flash_wgmma.cuh): one's softmax runs under the
 *       other's products instead of both at once. Same run, turns against
 *       none, N = 1024 to 16384 (mean of two runs each): d = 128 +3% to
 *       +8% (N = 16384: 448 -> 471 causal), d = 96 +2% to +7%; d = 64
 *       -5% to +3%, d = 32 -1% to -2%, d = 192 and 256 +-2%: turns only
 *       at d = 96 and 128. Each warpgroup with its own K/V stages and
 *       barrier (64-key blocks, so that they fit; no CTA-wide barrier)
 *       plus turns: slower (d = 128: 431 against 449, d = 64: 348 against
 *       378); d = 128 with 64-key blocks alone: 420.
 *   ptxas: no spills; 102 to 240 registers.
 */
#include "flash_wgmma.cuh"

#include <math.h>

template <typename T, int D, int DK, int BC, int NWG, int MINB, bool TURNS>
__global__ void __launch_bounds__(NWG *WG_THREADS, MINB) flash_fwd_wgmma_kernel(FlashParams p)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int BR = 64 * NWG, THREADS = NWG * WG_THREADS;
    constexpr int TW = FT_TW(D), Q_BYTES = BR * TW * 2, KV_BYTES = BC * TW * 2;
    /* When the tiles are wider than the score products' DK columns (d = 32
     * in 64-wide rows, d = 192 in D = 256) and the blocks have 64 keys,
     * V's columns DK .. DK+7 hold ones and P V's column DK is P's row sum:
     * added up by the tensor cores and rescaled with O, no per-score add
     * (d = 96, 128-key blocks, measured slower with it and keeps the adds). */
    constexpr bool ONES = DK < TW && BC == 64;
    constexpr int DO = ONES && DK + 8 > D ? DK + 8 : D; /* the width of P V */
    constexpr int NT_S = BC / 8, NT_O = DO / 8;
    extern __shared__ unsigned char smem_raw[];
    /* the swizzle is on address bits: chunks must start on 1024 bytes */
    unsigned char *smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    unsigned char *const sQ = smem, *const sK = sQ + Q_BYTES, *const sV = sK + 2 * KV_BYTES;

    const int tid = threadIdx.x, wg = tid / WG_THREADS, lane = tid % FT_WARP;
    const int wwarp = (tid / FT_WARP) % 4; /* warp in the warpgroup */
    const int g = lane / 4, t4 = lane % 4;
    const QueryBlock qblk = query_block<BR, BC>(p);
    const int i0 = qblk.i0, nq = qblk.nq, nkb = qblk.nkb, h = blockIdx.y, b = blockIdx.z;
    const int hk = h / (p.H / p.Hk);
    const int shift = p.Nk - p.Nq; /* key j visible to query i when j <= i + shift */
    if (nkb == 0) { /* no row sees a key: O = 0, LSE = -inf */
        for (int idx = tid; idx < nq * p.d; idx += THREADS)
            store_elem(p.out.data, row_offset(p.out, b, i0 + idx / p.d, h) + idx % p.d, p.dtype, 0.f);
        for (int idx = tid; idx < nq; idx += THREADS)
            p.lse[((int64_t)b * p.H + h) * p.Nq + i0 + idx] = -INFINITY;
        return;
    }
    const int wrow0 = i0 + wg * 64 + wwarp * 16; /* this warp's first row */
    const float sl2 = p.scale_log2;

    /* the copies fill D columns (zeros past d): the products read no more */
    const TileLoader<T, BC, D, THREADS> kload(p.k, b, hk, p.Nk, p.d),
        vload(p.v, b, hk, p.Nk, p.d, ONES ? DK : -1);
    TileLoader<T, BR, D, THREADS>(p.q, b, h, p.Nq, p.d).load(sQ, i0);
    kload.load(sK, 0);
    cp_async_commit();
    if (ONES && tid < 2 * BC) { /* both V stages; made visible by top(0) */
        const uint32_t one = MmaType<T>::pack(1.f, 1.f);
        *reinterpret_cast<uint4 *>(sV + (tid / BC) * KV_BYTES + swz_offset<BC>(tid % BC, DK)) =
            make_uint4(one, one, one, one);
    }

    float o[DO / 2], s[BC / 2];
    uint32_t pa[BC / 16][4];
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}; /* rows g, g+8; raw units */
#pragma unroll
    for (int i = 0; i < DO / 2; i++)
        o[i] = 0.f;

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
        if (j0 + BC > p.Nk || (p.causal && j0 + BC - 1 > wrow0 + shift)) {
#pragma unroll
            for (int i = 0; i < BC / 2; i++) {
                const int col = j0 + (i / 4) * 8 + t4 * 2 + i % 2, row = wrow0 + g + 8 * ((i / 2) % 2);
                if (col >= p.Nk || (p.causal && col > row + shift))
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
    top(0);
    wgmma_fence();
    turns.wait();
    issue_s(0);
    turns.pass();
    wgmma_wait<0>();
    softmax(0);
    rescale_pack();
    for (int j = 1; j < nkb; j++) {
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

template <typename T, int D, int DK, int BC, int NWG, int MINB, bool TURNS>
static ft_status launch_fwd_wgmma(const FlashParams &p)
{
    constexpr int BR = 64 * NWG;
    const size_t smem = 1024 + (size_t)(BR + 4 * BC) * FT_TW(D) * sizeof(T); /* Q, 2 x K, 2 x V */
    return flash_launch(flash_fwd_wgmma_kernel<T, D, DK, BC, NWG, MINB, TURNS>,
                        dim3((p.Nq + BR - 1) / BR, p.H, p.B), NWG * WG_THREADS, smem, p,
                        "ft_attention_forward");
}

/* D: the head dim rounded up to 32, 64, 128 or 256; DK: to 32, 64, 96,
 * 128, 192 or 256, the columns Q K^T multiplies. Turns where they measured
 * faster (d = 96, 128; w7). */
template <typename T> static ft_status launch_fwd_wgmma_dtype(const FlashParams &p)
{
    if (p.d <= 32)
        return launch_fwd_wgmma<T, 32, 32, 64, 2, 2, false>(p);
    if (p.d <= 64)
        return launch_fwd_wgmma<T, 64, 64, 64, 2, 2, false>(p);
    if (p.d <= 96)
        return launch_fwd_wgmma<T, 128, 96, 128, 2, 1, true>(p);
    if (p.d <= 128)
        return launch_fwd_wgmma<T, 128, 128, 128, 2, 1, true>(p);
    if (p.d <= 192)
        return launch_fwd_wgmma<T, 256, 192, 64, 2, 1, false>(p);
    return launch_fwd_wgmma<T, 256, 256, 64, 2, 1, false>(p);
}

/* f16/bf16, 16-byte aligned rows (the caller checks). */
ft_status flash_fwd_sm90(const FlashParams &p)
{
    return p.dtype == FT_F16 ? launch_fwd_wgmma_dtype<__half>(p)
                             : launch_fwd_wgmma_dtype<__nv_bfloat16>(p);
}
