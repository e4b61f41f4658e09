/*
 * flash_fwd_sm90.cu - the flash forward pass on Hopper's warpgroup matrix
 * products (wgmma, sm_90a), for f16/bf16 with head dims up to 128.
 *
 *   flash_fwd_wgmma_kernel<T, D, BC, NWG>: one CTA of NWG warpgroups per
 *       64 x NWG query rows of one (batch, head); each warpgroup owns 64
 *       rows. Q, K and V tiles sit in shared memory in the 128-byte
 *       swizzled layout (flash_wgmma.cuh), K and V in two stages: cp.async
 *       fills block j+1 while block j is multiplied. S = Q K^T is one chain
 *       of m64nBCk16 products with both operands in shared memory; the
 *       online softmax runs on S's accumulators in registers; O += P V takes
 *       P from registers and V from shared memory (transposed by the
 *       descriptor, no ldmatrix.trans). D is the head dim rounded up to 64
 *       or 128 (zero columns). Warpgroups whose rows lie wholly before a
 *       causal block skip it; the mask is applied only on blocks that cross
 *       the diagonal or the end of K.
 *
 * Built when the CUDA architectures include 90a (FT_HAVE_SM90A); used on
 * devices of compute capability 9.0, the mma.sync kernels of flash_fwd.cu
 * elsewhere. Check: spec/cuda_attention_spec.lua (busted, tag gpu) against
 * the CPU f64 reference; scripts/bench.lua checks, then times.
 */
#include "flash_wgmma.cuh"

#include <math.h>

#define WG_THREADS 128

template <int N> __device__ __forceinline__ void cp_async_wait_n()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

/* Rows row0 .. row0+ROWS-1 of head `head` of t into a swizzled [ROWS][D]
 * tile; rows past n and columns past d are zeros. */
template <typename T, int ROWS, int D, int THREADS>
__device__ __forceinline__ void load_tile_swz(unsigned char *tile, const FlashTensor &t, int b,
                                              int head, int row0, int n, int d)
{
    constexpr int CHUNKS = D / 8;
    const T *base = (const T *)t.data;
#pragma unroll
    for (int it = 0; it < (ROWS * CHUNKS + THREADS - 1) / THREADS; it++) {
        const int idx = threadIdx.x + it * THREADS;
        if ((ROWS * CHUNKS) % THREADS != 0 && idx >= ROWS * CHUNKS)
            break;
        const int r = idx / CHUNKS, c = (idx % CHUNKS) * 8;
        const bool valid = r < n && c < d;
        const T *src = valid ? base + row_offset(t, b, row0 + r, head) + c : base;
        cp_async_16(tile + swz_offset<ROWS>(r, c), src, valid);
    }
}

template <typename T, int D, int BC, int NWG>
__global__ void __launch_bounds__(NWG *WG_THREADS, 1) flash_fwd_wgmma_kernel(FlashParams p)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int BR = 64 * NWG, THREADS = NWG * WG_THREADS;
    constexpr int Q_BYTES = BR * D * 2, KV_BYTES = BC * D * 2;
    constexpr int NT_S = BC / 8, NT_O = D / 8;
    extern __shared__ unsigned char smem_raw[];
    /* the swizzle is on address bits: chunks must start on 1024 bytes */
    unsigned char *smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    unsigned char *const sQ = smem, *const sK = sQ + Q_BYTES, *const sV = sK + 2 * KV_BYTES;

    const int tid = threadIdx.x, wg = tid / WG_THREADS, lane = tid % FT_WARP;
    const int wwarp = (tid / FT_WARP) % 4; /* warp in the warpgroup */
    const int g = lane / 4, t4 = lane % 4;
    const int nblocks = (p.Nq + BR - 1) / BR;
    /* causal: the longest rows first, so the short ones fill the tail */
    const int qb = p.causal ? nblocks - 1 - (int)blockIdx.x : (int)blockIdx.x;
    const int i0 = qb * BR, h = blockIdx.y, b = blockIdx.z;
    const int hk = h / (p.H / p.Hk);
    const int nq = min(BR, p.Nq - i0);
    const int shift = p.Nk - p.Nq; /* key j visible to query i when j <= i + shift */
    const int jend = flash_key_end(p, i0 + nq - 1);
    const int wg_rows = min(64, nq - wg * 64); /* may be <= 0 */
    const int wg_jend = wg_rows > 0 ? flash_key_end(p, i0 + wg * 64 + wg_rows - 1) : 0;
    const int wrow0 = i0 + wg * 64 + wwarp * 16; /* this warp's first row */

    load_tile_swz<T, BR, D, THREADS>(sQ, p.q, b, h, i0, nq, p.d);
    if (jend > 0) {
        load_tile_swz<T, BC, D, THREADS>(sK, p.k, b, hk, 0, min(BC, p.Nk), p.d);
        load_tile_swz<T, BC, D, THREADS>(sV, p.v, b, hk, 0, min(BC, p.Nk), p.d);
    }
    cp_async_commit();

    float o[D / 2];
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}; /* rows g, g+8; log2 units */
#pragma unroll
    for (int i = 0; i < D / 2; i++)
        o[i] = 0.f;

    const uint32_t q_addr = smem_addr(sQ) + wg * 64 * 128;
    for (int j0 = 0, stage = 0; j0 < jend; j0 += BC, stage ^= 1) {
        cp_async_wait_n<0>(); /* K_j, V_j (and Q) landed for this thread */
        fence_proxy_async();  /* ... visible to the tensor cores */
        __syncthreads();      /* ... for every thread; stage^1 is free */
        if (j0 + BC < jend) {
            const int nk = min(BC, p.Nk - j0 - BC);
            load_tile_swz<T, BC, D, THREADS>(sK + (stage ^ 1) * KV_BYTES, p.k, b, hk, j0 + BC, nk, p.d);
            load_tile_swz<T, BC, D, THREADS>(sV + (stage ^ 1) * KV_BYTES, p.v, b, hk, j0 + BC, nk, p.d);
        }
        cp_async_commit();
        if (j0 >= wg_jend) /* nothing this warpgroup's rows can see */
            continue;

        /* S = Q K^T: 64 x BC per warpgroup */
        float s[BC / 2];
        const uint32_t k_addr = smem_addr(sK + stage * KV_BYTES);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++) {
            /* column chunk ks / 4, then 32 bytes per k16 step inside it */
            const uint64_t da = wgmma_desc(q_addr + (ks / 4) * BR * 128 + (ks % 4) * 32, 16, 1024);
            const uint64_t db = wgmma_desc(k_addr + (ks / 4) * BC * 128 + (ks % 4) * 32, 16, 1024);
            Wgmma<T, BC>::ss(s, da, db, ks > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();

        /* scale into log2 units, mask where needed, online softmax */
        const bool edge = j0 + BC > p.Nk || (p.causal && j0 + BC - 1 > wrow0 + shift);
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int row = wrow0 + g + 8 * r;
            float mx = -INFINITY;
#pragma unroll
            for (int n = 0; n < NT_S; n++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    float &v = s[4 * n + 2 * r + e];
                    v *= p.scale_log2;
                    if (edge) {
                        const int col = j0 + n * 8 + t4 * 2 + e;
                        if (col >= p.Nk || (p.causal && col > row + shift))
                            v = -INFINITY;
                    }
                    mx = fmaxf(mx, v);
                }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m[r], mx);
            const float m_use = m_new == -INFINITY ? 0.f : m_new; /* all masked: no NaNs */
            const float alpha = exp2f(m[r] - m_use);
            float sum = 0.f;
#pragma unroll
            for (int n = 0; n < NT_S; n++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    float &v = s[4 * n + 2 * r + e];
                    v = exp2f(v - m_use);
                    sum += v;
                }
            l[r] = l[r] * alpha + sum; /* this thread's share; the quad adds up at the end */
            m[r] = m_new;
#pragma unroll
            for (int n = 0; n < NT_O; n++) {
                o[4 * n + 2 * r] *= alpha;
                o[4 * n + 2 * r + 1] *= alpha;
            }
        }

        /* O += P V: S's accumulators in 16 bits are P's A fragments */
        uint32_t pa[BC / 16][4];
#pragma unroll
        for (int kk = 0; kk < BC / 16; kk++) {
            pa[kk][0] = MmaType<T>::pack(s[8 * kk + 0], s[8 * kk + 1]);
            pa[kk][1] = MmaType<T>::pack(s[8 * kk + 2], s[8 * kk + 3]);
            pa[kk][2] = MmaType<T>::pack(s[8 * kk + 4], s[8 * kk + 5]);
            pa[kk][3] = MmaType<T>::pack(s[8 * kk + 6], s[8 * kk + 7]);
        }
        const uint32_t v_addr = smem_addr(sV + stage * KV_BYTES);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BC / 16; kk++)
            Wgmma<T, D>::rs(o, pa[kk], wgmma_desc(v_addr + kk * 16 * 128, BC * 128, 1024), 1);
        wgmma_commit();
        wgmma_wait<0>();
    }
    cp_async_wait_n<0>();

    /* finish: the quad's partial sums, normalise, store O and LSE */
    T *out = reinterpret_cast<T *>(p.out.data);
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = wrow0 + g + 8 * r;
        float sum = l[r];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        if (row >= p.Nq)
            continue;
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        const int64_t base = row_offset(p.out, b, row, h);
#pragma unroll
        for (int n = 0; n < NT_O; n++) {
            const int col = n * 8 + t4 * 2;
            if (col < p.d) /* d % 8 == 0: both columns or neither */
                *reinterpret_cast<uint32_t *>(out + base + col) =
                    MmaType<T>::pack(o[4 * n + 2 * r] * inv, o[4 * n + 2 * r + 1] * inv);
        }
        if (t4 == 0)
            p.lse[((int64_t)b * p.H + h) * p.Nq + row] =
                sum > 0.f ? (m[r] + log2f(sum)) / FT_LOG2E : -INFINITY;
    }
#endif
}

template <typename T, int D, int BC, int NWG>
static ft_status launch_fwd_wgmma(const FlashParams &p)
{
    constexpr int BR = 64 * NWG;
    const size_t smem = 1024 + (size_t)(BR + 4 * BC) * D * sizeof(T); /* Q, 2 x K, 2 x V */
    auto kernel = flash_fwd_wgmma_kernel<T, D, BC, NWG>;
    FT_CUDA_TRY("ft_attention_forward",
                cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)smem));
    dim3 grid((p.Nq + BR - 1) / BR, p.H, p.B);
    kernel<<<grid, NWG * WG_THREADS, smem>>>(p);
    FT_CUDA_CHECK_LAUNCH("ft_attention_forward");
    return FT_OK;
}

template <typename T> static ft_status launch_fwd_wgmma_dtype(const FlashParams &p)
{
    if (p.d <= 64)
        return launch_fwd_wgmma<T, 64, 128, 2>(p);
    return launch_fwd_wgmma<T, 128, 128, 2>(p);
}

/* Head dims up to 128, f16/bf16, 16-byte aligned rows (the caller checks). */
ft_status flash_fwd_sm90(const FlashParams &p)
{
    return p.dtype == FT_F16 ? launch_fwd_wgmma_dtype<__half>(p)
                             : launch_fwd_wgmma_dtype<__nv_bfloat16>(p);
}
