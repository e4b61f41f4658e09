/*
 * flash_fwd.cu - the flash forward pass on CUDA: flash_fwd_mma_kernel
 * (f16/bf16 on tensor cores: mma.sync, ldmatrix, cp.async; sm_80 and later)
 * and flash_fwd_simt_kernel (any dtype and layout, one warp per query row);
 * flash_params, flash_sm90_usable, and the forward's choice between these
 * and the wgmma kernel of flash_fwd_sm90.cu.
 * Limits: head dims up to 256; the tensor-core kernel needs f16/bf16,
 * head_dim % 8 == 0 and 16-byte aligned rows (D rounded up to 64, 128, 256).
 * Check: spec/cuda_attention_spec.lua (busted, tag gpu; on Hopper ctest's
 * cuda_attention_spec_mma runs it with FT_NO_WGMMA=1 for these kernels);
 * scripts/bench.lua. Design and measurements: kernels/README.md.
 */
#include "flash_mma.cuh"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define MMA_WARPS 4 /* per CTA; rows per CTA: 16 x MT x MMA_WARPS */
#define FLASH_FILE "flash_fwd.cu" /* rtc.cu compiles it again for a Lua-written mod */

/* ---- simple path ---- */
#ifndef __CUDACC_RTC__

__global__ void __launch_bounds__(SIMT_WARPS * FT_WARP) flash_fwd_simt_kernel(FlashParams p)
{
    const int lane = threadIdx.x % FT_WARP, warp = threadIdx.x / FT_WARP;
    const int row = blockIdx.x * SIMT_WARPS + warp, h = blockIdx.y, b = blockIdx.z;
    flash_enter_seq(p, b);
    if (row >= p.Nq)
        return;
    const int hk = h / (p.H / p.Hk);
    float q[FT_SIMT_MAX_COLS], o[FT_SIMT_MAX_COLS];
    const int64_t qo = row_offset(p.q, b, row, h);
#pragma unroll
    for (int t = 0; t < FT_SIMT_MAX_COLS; t++) {
        const int c = lane + FT_WARP * t;
        q[t] = c < p.d ? load_elem(p.q.data, qo + c, p.dtype) : 0.f;
        o[t] = 0.f;
    }
    float m = flash_sink_log2(p, h), l = flash_sink_sum(m, true); /* m in log2 units */
    const bool mods = flash_score_modified(p);
    const ScoreMod smod = flash_score_mod(p, b, h);
    const int jend = flash_key_end(p, row);
    for (int j = flash_key_begin(p, row); j < jend; j++) {
        const int64_t ko = row_offset(p.k, b, j, hk), vo = row_offset(p.v, b, j, hk);
        float part = 0.f;
#pragma unroll
        for (int t = 0; t < FT_SIMT_MAX_COLS; t++) {
            const int c = lane + FT_WARP * t;
            if (c < p.d)
                part += q[t] * load_elem(p.k.data, ko + c, p.dtype);
        }
        float s = warp_sum(part);
        if (mods)
        {
            float unused;
            s = smod.apply(s, smod.pos(row), (float)j, &unused);
        }
        s *= p.scale_log2;
        const float m_new = max_nan(m, s);
        const float alpha = exp2f(m - m_new), pj = exp2f(s - m_new);
        l = l * alpha + pj;
        /* dropout: O takes the kept probabilities, the sum all of them */
        const float pv = p.mod.dropout ? (flash_keep(p, b, h, row, j) ? pj * (float)p.mod.drop_scale : 0.f)
                                       : pj;
#pragma unroll
        for (int t = 0; t < FT_SIMT_MAX_COLS; t++) {
            const int c = lane + FT_WARP * t;
            if (c < p.d)
                o[t] = o[t] * alpha + pv * load_elem(p.v.data, vo + c, p.dtype);
        }
        m = m_new;
    }
    const int64_t oo = row_offset(p.out, b, row, h);
    const float inv = l != 0.f ? 1.f / l : 0.f; /* NaN stays NaN */
#pragma unroll
    for (int t = 0; t < FT_SIMT_MAX_COLS; t++) {
        const int c = lane + FT_WARP * t;
        if (c < p.d)
            store_elem(p.out.data, oo + c, p.dtype, o[t] * inv);
    }
    if (lane == 0)
        p.lse[flash_stat(p, b, h) + row] =
            l != 0.f ? (m + log2f(l)) / FT_LOG2E : -INFINITY;
}
#endif

/* ---- tensor cores ---- */

/* MT m-tiles of 16 rows per warp: each K or V fragment read from shared
 * memory feeds MT mma instructions, which halves the shared-memory traffic
 * per FLOP at MT = 2 (the limit at MT = 1 was ldmatrix, not the tensor
 * cores). K and V are double-buffered: the copy of block j+1 runs while
 * block j is multiplied. */
/* The kernel's shared memory, for the kernel and its launcher: Q [BR][LD],
 * then K buffers 0 and 1, then V buffers 0 and 1 [BC][LD] (offsets in
 * elements of T; rows padded to LD for conflict-free ldmatrix). */
template <typename T, int D, int BC, int MT> struct MmaFwdSmem {
    static constexpr int LD = D + 8, BR = 16 * MT * MMA_WARPS;
    static constexpr int K = BR * LD, V = K + 2 * BC * LD;
    static constexpr size_t bytes = (size_t)(V + 2 * BC * LD) * sizeof(T);
};

template <typename T, int D, int BC, int MT, bool EXT, typename UM = NoUserMod>
__global__ void __launch_bounds__(MMA_WARPS * FT_WARP) flash_fwd_mma_kernel(FlashParams p)
{
    using L = MmaFwdSmem<T, D, BC, MT>;
    constexpr int LD = L::LD, BR = L::BR, THREADS = MMA_WARPS * FT_WARP;
    constexpr int NT_S = BC / 8, NT_O = D / 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T *sQ = reinterpret_cast<T *>(smem_raw);
    T *const sK = sQ + L::K, *const sV = sQ + L::V;

    const int lane = threadIdx.x % FT_WARP, warp = threadIdx.x / FT_WARP;
    const int g = lane / 4, t4 = lane % 4;
    const int i0 = blockIdx.x * BR, h = blockIdx.y, b = blockIdx.z;
    if (EXT) { /* varlen: this CTA's sequence; past its end, nothing to do */
        flash_enter_seq(p, b);
        if (i0 >= p.Nq)
            return;
    }
    const int hk = h / (p.H / p.Hk);
    const int nq = min(BR, p.Nq - i0);
    /* the key blocks some row of this block sees: [jbegin, jend) */
    const int jbegin = flash_key_begin(p, i0) / BC * BC;
    const int jend = flash_key_end(p, i0 + nq - 1);
    const int wrow0 = i0 + warp * 16 * MT; /* this warp's first row */
    const FullKeys full = flash_full_keys(p, wrow0, wrow0 + 16 * MT);
    const ScoreMod smod = flash_score_mod(p, b, h);

    /* prologue: Q and K_0 in one group, V_0 in the next */
    load_tile<T, BR, D, LD, THREADS>(sQ, p.q, b, h, i0, nq, p.d);
    if (jend > jbegin)
        load_tile<T, BC, D, LD, THREADS>(sK, p.k, b, hk, jbegin, min(BC, p.Nk - jbegin), p.d);
    cp_async_commit();
    if (jend > jbegin)
        load_tile<T, BC, D, LD, THREADS>(sV, p.v, b, hk, jbegin, min(BC, p.Nk - jbegin), p.d);
    cp_async_commit();

    float o[MT][NT_O][4];
    float m[MT][2], l[MT][2]; /* rows g and g+8 of each m-tile; log2 units */
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int n = 0; n < NT_O; n++)
            o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
        m[mt][0] = m[mt][1] = flash_sink_log2(p, h);
        l[mt][0] = l[mt][1] = flash_sink_sum(m[mt][0], t4 == 0);
    }

    for (int j0 = jbegin, buf = 0; j0 < jend; j0 += BC, buf ^= 1) {
        const bool more = j0 + BC < jend;
        const int nk_next = more ? min(BC, p.Nk - j0 - BC) : 0;
        cp_async_wait<1>(); /* K_j (and Q) landed; V_j may be in flight */
        __syncthreads();    /* ... for every thread; K_{j-1}'s buffer is free */
        if (more)
            load_tile<T, BC, D, LD, THREADS>(sK + (buf ^ 1) * BC * LD, p.k, b, hk, j0 + BC, nk_next, p.d);
        cp_async_commit();

        /* S = Q K^T for this warp's MT x 16 rows */
        float s[MT][NT_S][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int n = 0; n < NT_S; n++)
                s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
        const T *kb = sK + buf * BC * LD;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            uint32_t a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
                ldmatrix_x4(a[mt], sQ + (warp * 16 * MT + mt * 16 + lane % 16) * LD + kk * 16 +
                                       (lane / 16) * 8);
#pragma unroll
            for (int nn = 0; nn < NT_S / 2; nn++) {
                uint32_t bk[4];
                ldmatrix_x4(bk, kb + (nn * 16 + lane % 8 + (lane / 16) * 8) * LD + kk * 16 +
                                    ((lane / 8) % 2) * 8);
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    MmaType<T>::mma(s[mt][2 * nn], a[mt], bk[0], bk[1]);
                    MmaType<T>::mma(s[mt][2 * nn + 1], a[mt], bk[2], bk[3]);
                }
            }
        }

        /* modify, scale into log2 units, mask where needed, online softmax */
        if (EXT || UM::on) /* a Lua-written mod alone needs none of EXT's state */
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
                mod_acc<NT_S * 4, false, fast_tanh<T>(), UM, EXT>(smod, &s[mt][0][0], wrow0 + mt * 16, j0);
        const bool edge = full.masks(j0, j0 + BC);
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const int row = wrow0 + mt * 16 + g + 8 * r;
                const KeyRange keys = edge ? flash_keys(p, row) : KeyRange{0, 0};
                float mx = -INFINITY;
#pragma unroll
                for (int n = 0; n < NT_S; n++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        float &v = s[mt][n][2 * r + e];
                        v *= p.scale_log2;
                        if (edge && keys.hides(j0 + n * 8 + t4 * 2 + e))
                            v = -INFINITY;
                        mx = max_nan(mx, v);
                    }
                mx = max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float m_new = max_nan(m[mt][r], mx);
                /* all masked so far: keep everything at zero without NaNs */
                const float m_use = m_new == -INFINITY ? 0.f : m_new;
                const float alpha = exp2f(m[mt][r] - m_use);
                float sum = 0.f;
#pragma unroll
                for (int n = 0; n < NT_S; n++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        float &v = s[mt][n][2 * r + e];
                        v = exp2f(v - m_use);
                        sum += v;
                    }
                l[mt][r] = l[mt][r] * alpha + sum; /* this thread's share; the quad adds up at the end */
                m[mt][r] = m_new;
#pragma unroll
                for (int n = 0; n < NT_O; n++) {
                    o[mt][n][2 * r] *= alpha;
                    o[mt][n][2 * r + 1] *= alpha;
                }
            }

        if (EXT && flash_dropout<UM>(p)) /* P V takes the kept probabilities; the sums all */
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
                drop_acc<NT_S * 4>(p, b, h, &s[mt][0][0], wrow0 + mt * 16, j0);

        cp_async_wait<1>(); /* V_j landed; K_{j+1} may be in flight */
        __syncthreads();    /* ... for every thread; V_{j-1}'s buffer is free */
        if (more)
            load_tile<T, BC, D, LD, THREADS>(sV + (buf ^ 1) * BC * LD, p.v, b, hk, j0 + BC, nk_next, p.d);
        cp_async_commit();

        /* O += P V: P's C fragments are A fragments in 16 bits */
        const T *vb = sV + buf * BC * LD;
#pragma unroll
        for (int kk = 0; kk < BC / 16; kk++) {
            uint32_t a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                acc_to_a<T>(s[mt][2 * kk], s[mt][2 * kk + 1], a[mt]);
            }
#pragma unroll
            for (int dn = 0; dn < NT_O / 2; dn++) {
                uint32_t bv[4];
                ldmatrix_x4_trans(bv, vb + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * LD +
                                          dn * 16 + (lane / 16) * 8);
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    MmaType<T>::mma(o[mt][2 * dn], a[mt], bv[0], bv[1]);
                    MmaType<T>::mma(o[mt][2 * dn + 1], a[mt], bv[2], bv[3]);
                }
            }
        }
    }
    cp_async_wait<0>();

    /* finish: the quad's partial sums, normalise, store O and LSE */
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int r = 0; r < 2; r++)
            store_out_row<T, NT_O>(p, b, h, wrow0 + mt * 16 + g + 8 * r, r, &o[mt][0][0], l[mt][r],
                                   m[mt][r]);
}

/* ---- launch ---- */
#ifndef __CUDACC_RTC__

FlashParams flash_params(const ft_attn_shape *s, const ft_tensor *q, const ft_tensor *k,
                         const ft_tensor *v, const ft_tensor *out, const ft_tensor *lse)
{
    FlashParams p;
    memset(&p, 0, sizeof p);
    p.q = flash_tensor(q);
    p.k = flash_tensor(k);
    p.v = flash_tensor(v);
    p.out = flash_tensor(out);
    p.lse = lse ? (float *)lse->data : nullptr;
    /* [B, H, Nq] or a varlen [H, total_q]; rows contiguous */
    if (lse) {
        p.stat_bs = lse->ndim == 2 ? 0 : lse->stride[0];
        p.stat_hs = lse->stride[lse->ndim - 2];
    }
    p.cu_q = s->cu_q_dev;
    p.cu_k = s->cu_k_dev;
    p.B = (int)s->B, p.H = (int)s->H, p.Hk = (int)s->Hk;
    p.Nq = (int)s->Nq, p.Nk = (int)s->Nk, p.d = (int)s->d;
    p.dtype = q->dtype;
    p.causal = s->causal;
    p.mod = s->mod;
    /* lib/attention.c sends a sink here only as f32, contiguous */
    p.sink = s->sink ? (const float *)s->sink->data : nullptr;
    /* and ALiBi slopes only as f32, [H] or [B, H] (batch0: a varlen call's
     * sequence) */
    if (s->alibi) {
        const ft_tensor *a = s->alibi;
        p.alibi_bs = a->ndim == 2 ? a->stride[0] : 0;
        p.alibi_hs = a->stride[a->ndim - 1];
        p.alibi = (const float *)a->data + s->batch0 * p.alibi_bs;
    }
    p.scale = (float)s->scale;
    p.scale_log2 = (float)(s->scale * 1.4426950408889634);
    /* the softcap's constants (ScoreMod's: float arithmetic, as the kernels
     * did it) */
    const float sc = (float)s->mod.softcap;
    p.cap2 = sc > 0.f ? 2.f * FT_LOG2E * p.scale / sc : 0.f;
    p.cap = sc > 0.f ? sc / p.scale : 0.f;
    p.inv_scale = 1.f / p.scale;
    /* a Lua-written mask's inner band, from its block mask made on CUDA */
    int64_t il, ir;
    p.um_left = p.um_right = -1;
    if (s->mods && s->block_mask && ft_attn_block_mask_inner(s->block_mask, &il, &ir))
        p.um_left = (int)il, p.um_right = (int)ir; /* at most INT32_MAX */
    return p;
}

/* True when every tensor's rows start on 16 bytes, as cp.async needs
 * (every stride but the last, of a [B, N, heads, d] or a varlen
 * [total, heads, d]). */
bool flash_rows_aligned(const ft_tensor *const *ts, int n)
{
    for (int i = 0; i < n; i++) {
        const ft_tensor *t = ts[i];
        const size_t es = ft_dtype_size(t->dtype);
        if ((uintptr_t)t->data % 16 != 0)
            return false;
        for (int dim = 0; dim < t->ndim - 1; dim++)
            if ((t->stride[dim] * (int64_t)es) % 16 != 0 && t->shape[dim] > 1)
                return false;
    }
    return true;
}

bool flash_sm90_usable(int device)
{
#ifdef FT_HAVE_SM90A
    enum { MAX_DEVICES = 64 };
    static int known[MAX_DEVICES]; /* 0 unknown, 1 yes, 2 no */
    if (device < 0 || device >= MAX_DEVICES)
        return false;
    if (!known[device]) {
        int major = 0, minor = 0;
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
        known[device] = major == 9 && minor == 0 ? 1 : 2;
    }
    return known[device] == 1 && ft_switch("FT_NO_WGMMA") != 1;
#else
    (void)device;
    return false;
#endif
}

int flash_sm_count(int device)
{
    enum { MAX_DEVICES = 64 };
    static int known[MAX_DEVICES]; /* 0: not asked yet */
    if (device < 0 || device >= MAX_DEVICES)
        return 132;
    if (!known[device]) {
        int sms = 0;
        if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
            sms <= 0)
            sms = 132;
        known[device] = sms;
    }
    return known[device];
}

template <typename T, int D, int BC, int MT, bool EXT>
static ft_status launch_fwd_mma(const FlashParams &p, FlashRtc *rtc)
{
    using L = MmaFwdSmem<T, D, BC, MT>;
    return flash_launch(rtc, FLASH_FILE, flash_fwd_mma_kernel<T, D, BC, MT, EXT>,
                        [] { return rtc_name("flash_fwd_mma_kernel", TypeOf<T>(), D, BC, MT, EXT); },
                        dim3((p.Nq + L::BR - 1) / L::BR, p.H, p.B), MMA_WARPS * FT_WARP, L::bytes,
                        p, "ft_attention_forward");
}

/* The row of MMA_FWD_TILES that takes the head dim, for p's dtype and kind. */
ft_status flash_fwd_mma(const FlashParams &p, FlashRtc *rtc)
{
    return flash_dispatch(p, [&](auto type, auto ext) {
        using T = typename decltype(type)::type;
        return flash_pick(MMA_FWD_TILES, p.d, [&](auto row) {
            constexpr MmaFwdTile c = MMA_FWD_TILES[decltype(row)::value];
            return launch_fwd_mma<T, c.D, c.BC, c.MT, decltype(ext)::value>(p, rtc);
        });
    });
}

ft_status flash_rtc_dry_run(FlashParams p, FlashRtc *rtc, bool wgmma, bool has_score,
                            int passes)
{
    p.user_mod = 0; /* the forward applies a mod in its plain kernels */
    if (passes & 1)
        FT_TRY(wgmma ? flash_fwd_sm90(p, rtc) : flash_fwd_mma(p, rtc));
    if (!(passes & 2))
        return FT_OK;
    p.user_mod = has_score; /* a score function's backward needs EXT */
    /* the gradients of the mods' tensors: the mma.sync kernels */
    return wgmma && !(passes & 4) ? flash_bwd_sm90(p, rtc) : flash_bwd_mma(p, rtc);
}

extern "C" ft_status ft_attention_forward_flash_cuda(const ft_attn_shape *s,
                                                     const ft_tensor *q, const ft_tensor *k,
                                                     const ft_tensor *v, ft_tensor *out,
                                                     ft_tensor *lse)
{
    FT_TRY(ft_cuda_use_device(q->device.index, "ft_attention_forward"));
    if (s->B == 0 || s->H == 0 || s->Nq == 0)
        return FT_OK;
    FlashParams p = flash_params(s, q, k, v, out, lse);
    /* A softcap bounds the logits by softcap, and a bf16 Hopper forward
     * takes that bound as every row's maximum (no running maximum, no
     * rescaling): P = e^(x - softcap) >= e^(-2 softcap) >= 2^-100 for
     * softcap <= 34, far from bf16's and f32's smallest normal numbers
     * (2^-126; f16 stops at 2^-14). Not with ALiBi, a sink or a Lua-written
     * mod, which take logits past the bound (a row whose largest logit lay
     * far below it would lose its precision; FwdRows::capped trusts this
     * test, and keeps the sink's sum out only through it). FT_NO_CAP_MAX:
     * never. */
    const bool bound_max = !ft_switch("FT_NO_CAP_MAX") && p.dtype == FT_BF16 && !p.sink;
    p.cap_max = bound_max && p.cap2 > 0.f && p.cap > 0.f && p.mod.softcap <= 34 && !p.alibi &&
                (!s->mods || ft_attn_mods_band_only(s)); /* mods that change nothing */
    /* the same for a Lua-written score whose range lib/mods.c finds at most
     * 69 wide (a Lua softcap of at most 34: the kernels compiled for it know
     * the top): a Lua softcap 30's forward 1.12x-1.20x (bf16, d 128, H200,
     * 2026-12-02) */
    p.um_cap = bound_max;
    /* the Hopper forward's lazy maximum (FwdRows): head dims 65 to 128
     * (1.01x-1.13x at d 128 from 4096 keys, 0.96x-1.02x below; at d 64
     * 0.97x-1.03x, so not there), FT_LAZY_RESCALE: every head dim,
     * FT_NO_LAZY_RESCALE: none. Not with dropout in f16: a kept P of up to
     * 2^8 scaled by 1 / (1 - p) would pass f16's 65504 from p = 0.996 on */
    p.lazy_max = !ft_switch("FT_NO_LAZY_RESCALE") &&
                 (ft_switch("FT_LAZY_RESCALE") || (s->d > 64 && s->d <= 128)) &&
                 !(p.mod.dropout && p.dtype == FT_F16);
    const ft_tensor *ts[4] = {q, k, v, out};
    const bool mma = (q->dtype == FT_F16 || q->dtype == FT_BF16) && s->d % 8 == 0 &&
                     flash_rows_aligned(ts, 4);
    if (s->mods && !mma)
        return ft_fail(FT_ERR_UNSUPPORTED, "ft_attention_forward", 1,
                       "mods on CUDA run in the tensor-core kernels: f16 or bf16, "
                       "head_dim a multiple of 8, rows on 16 bytes");
    /* mods: the tensor-core kernels compiled for them (rtc.cu); none for
     * mods that change nothing but the window (an empty mod; a mask alone
     * that is its band) */
    if (s->mods && !ft_attn_mods_band_only(s)) {
        FlashRtc *rtc = nullptr;
        FT_TRY(flash_rtc_new(s, q->dtype, q->device.index, &rtc, "ft_attention_forward"));
        /* the forward kernels apply a mod without their EXT state (the
         * backward's keep the mod's derivatives in it) */
        const ft_status st = flash_sm90_usable(q->device.index) ? flash_fwd_sm90(p, rtc)
                                                                : flash_fwd_mma(p, rtc);
        flash_rtc_free(rtc);
        return st;
    }
    if (mma && flash_sm90_usable(q->device.index))
        return flash_fwd_sm90(p, nullptr);
    if (mma)
        return flash_fwd_mma(p, nullptr);
    dim3 grid((p.Nq + SIMT_WARPS - 1) / SIMT_WARPS, p.H, p.B);
    flash_fwd_simt_kernel<<<grid, SIMT_WARPS * FT_WARP>>>(p);
    FT_CUDA_CHECK_LAUNCH("ft_attention_forward");
    return FT_OK;
}
#endif
