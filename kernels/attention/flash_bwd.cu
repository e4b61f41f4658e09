/*
 * flash_bwd.cu - the flash backward pass on CUDA, with recomputation and no
 * atomics: flash_bwd_dot_kernel (D = rowsum(dO * O)), the dK/dV and dQ
 * kernels on tensor cores (mma.sync; f16/bf16, sm_80 and later) and on the
 * SIMT path (any dtype and layout), and the backward's choice between these
 * and the wgmma kernels of flash_bwd_sm90.cu.
 * Limits: as flash_fwd.cu's (head dims up to 256; the tensor cores need
 * head_dim % 8 == 0 and 16-byte aligned rows).
 * Check: spec/cuda_attention_spec.lua (busted, tag gpu; also ctest's
 * cuda_attention_spec_mma, with FT_NO_WGMMA=1); scripts/bench.lua. Design
 * and measurements: kernels/README.md.
 */
#include "flash_mma.cuh"

#include <math.h>

#define FLASH_FILE "flash_bwd.cu" /* rtc.cu compiles it again for a Lua-written mod */

#ifndef __CUDACC_RTC__
/* D[b, h, i] = dO_i . O_i, one warp per row (and lse2 when asked for). */
__global__ void __launch_bounds__(SIMT_WARPS * FT_WARP) flash_bwd_dot_kernel(FlashParams p)
{
    const int lane = threadIdx.x % FT_WARP, warp = threadIdx.x / FT_WARP;
    const int row = blockIdx.x * SIMT_WARPS + warp, h = blockIdx.y, b = blockIdx.z;
    flash_enter_seq(p, b);
    if (row >= p.Nq)
        return;
    const int64_t oo = row_offset(p.out, b, row, h), go = row_offset(p.dout, b, row, h);
    float part = 0.f;
    for (int c = lane; c < p.d; c += FT_WARP)
        part += load_elem(p.out.data, oo + c, p.dtype) * load_elem(p.dout.data, go + c, p.dtype);
    part = warp_sum(part);
    const int64_t i = flash_stat(p, b, h) + row;
    if (lane == 0)
        p.D[i] = part;
    if (lane == 0 && p.lse2) /* exp(s - lse) = exp2(s log2(e) - lse2); 0 for empty rows */
        p.lse2[i] = p.lse[i] == -INFINITY ? INFINITY : p.lse[i] * FT_LOG2E;
}

/* The same for the tensor-core kernels' inputs (f16/bf16, head_dim a
 * multiple of 8, rows on 16 bytes): 2^lanes_log2 lanes a row, the power
 * of two at or above d / 8, each loading 16 bytes of O and of dO at once.
 * One warp a row, 2 bytes a lane a load, kept the H200's memory 78% idle
 * (130 us for the 134 MB of B 4, N 4096, 16 heads, d 128): 4% of a plain
 * backward, 13% of a causal sliding window's. */
constexpr int DOT_THREADS = 256;

template <typename T>
__global__ void __launch_bounds__(DOT_THREADS) flash_bwd_dot_vec_kernel(FlashParams p,
                                                                        int lanes_log2)
{
    const int sub = threadIdx.x & ((1 << lanes_log2) - 1);
    const int row = blockIdx.x * (DOT_THREADS >> lanes_log2) + (threadIdx.x >> lanes_log2);
    const int h = blockIdx.y, b = blockIdx.z;
    flash_enter_seq(p, b);
    const bool live = row < p.Nq; /* no early return: the lanes of a row sum by shuffles */
    float part = 0.f;
    if (live && sub * 8 < p.d) {
        const uint4 o = *(const uint4 *)((const T *)p.out.data + row_offset(p.out, b, row, h) +
                                         sub * 8);
        const uint4 g = *(const uint4 *)((const T *)p.dout.data +
                                         row_offset(p.dout, b, row, h) + sub * 8);
        const uint32_t ov[4] = {o.x, o.y, o.z, o.w}, gv[4] = {g.x, g.y, g.z, g.w};
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float2 x = MmaType<T>::unpack(ov[e]), y = MmaType<T>::unpack(gv[e]);
            part = fmaf(x.x, y.x, part);
            part = fmaf(x.y, y.y, part);
        }
    }
    for (int m = 1 << lanes_log2 >> 1; m > 0; m >>= 1)
        part += __shfl_xor_sync(0xffffffffu, part, m);
    if (live && sub == 0) {
        const int64_t i = flash_stat(p, b, h) + row;
        p.D[i] = part;
        if (p.lse2)
            p.lse2[i] = p.lse[i] == -INFINITY ? INFINITY : p.lse[i] * FT_LOG2E;
    }
}

/* D (and lse2) for the backward: the vector kernel where the rows allow. */
static ft_status flash_bwd_dot(const FlashParams &p, bool vec, const char *func)
{
    if (!vec) {
        flash_bwd_dot_kernel<<<dim3((p.Nq + SIMT_WARPS - 1) / SIMT_WARPS, p.H, p.B),
                               dim3(SIMT_WARPS * FT_WARP)>>>(p);
        return ft_cuda_check_launch(func, __FILE__, __LINE__);
    }
    int lanes_log2 = 0;
    while ((8 << lanes_log2) < p.d)
        lanes_log2++;
    const int rows = DOT_THREADS >> lanes_log2;
    const dim3 grid((p.Nq + rows - 1) / rows, p.H, p.B);
    if (p.dtype == FT_F16)
        flash_bwd_dot_vec_kernel<__half><<<grid, DOT_THREADS>>>(p, lanes_log2);
    else
        flash_bwd_dot_vec_kernel<__nv_bfloat16><<<grid, DOT_THREADS>>>(p, lanes_log2);
    return ft_cuda_check_launch(func, __FILE__, __LINE__);
}
#endif

/* Loads this lane's columns of one row into x. */
__device__ __forceinline__ void load_row(float *x, const FlashTensor &t, int b, int row,
                                         int head, const FlashParams &p, int lane)
{
    const int64_t o = row_offset(t, b, row, head);
#pragma unroll
    for (int c8 = 0; c8 < FT_SIMT_MAX_COLS; c8++) {
        const int c = lane + FT_WARP * c8;
        x[c8] = c < p.d ? load_elem(t.data, o + c, p.dtype) : 0.f;
    }
}

__device__ __forceinline__ float row_dot(const float *x, const float *y)
{
    float s = 0.f;
#pragma unroll
    for (int c8 = 0; c8 < FT_SIMT_MAX_COLS; c8++)
        s += x[c8] * y[c8];
    return warp_sum(s);
}

__device__ __forceinline__ void store_row(const FlashTensor &t, int b, int row, int head,
                                          const float *x, float scale, const FlashParams &p,
                                          int lane)
{
    const int64_t o = row_offset(t, b, row, head);
#pragma unroll
    for (int c8 = 0; c8 < FT_SIMT_MAX_COLS; c8++) {
        const int c = lane + FT_WARP * c8;
        if (c < p.d)
            store_elem(t.data, o + c, p.dtype, x[c8] * scale);
    }
}

/* P_ij from the saved LSE; 0 for a row that saw no key. */
__device__ __forceinline__ float prob(float s_dot, float lse, const FlashParams &p)
{
    return lse == -INFINITY ? 0.f : exp2f(s_dot * p.scale_log2 - lse * FT_LOG2E);
}

#ifndef __CUDACC_RTC__
/* dK_j, dV_j for key row j of kv head hk: one warp per row. */
__global__ void __launch_bounds__(SIMT_WARPS * FT_WARP) flash_bwd_dkdv_simt_kernel(FlashParams p)
{
    const int lane = threadIdx.x % FT_WARP, warp = threadIdx.x / FT_WARP;
    const int j = blockIdx.x * SIMT_WARPS + warp, hk = blockIdx.y, b = blockIdx.z;
    flash_enter_seq(p, b);
    if (j >= p.Nk)
        return;
    const int G = p.H / p.Hk;
    float k[FT_SIMT_MAX_COLS], v[FT_SIMT_MAX_COLS], dk[FT_SIMT_MAX_COLS] = {0},
          dv[FT_SIMT_MAX_COLS] = {0}, q[FT_SIMT_MAX_COLS], dO[FT_SIMT_MAX_COLS];
    load_row(k, p.k, b, j, hk, p, lane);
    load_row(v, p.v, b, j, hk, p, lane);
    const bool mods = flash_score_modified(p);
    for (int h = hk * G; h < (hk + 1) * G; h++) {
        const ScoreMod smod = flash_score_mod(p, b, h);
        const float *lse = p.lse + flash_stat(p, b, h);
        const float *D = p.D + flash_stat(p, b, h);
        const int iend = flash_query_end(p, j);
        for (int i = flash_query_begin(p, j); i < iend; i++) {
            load_row(q, p.q, b, i, h, p, lane);
            load_row(dO, p.dout, b, i, h, p, lane);
            float x = row_dot(q, k), grad = 1.f;
            if (mods)
                x = smod.apply(x, smod.pos(i), (float)j, &grad);
            const float pij = prob(x, lse[i], p);
            /* dropout: dV takes the kept probabilities, dS = P (Z dP - D) */
            const float z = p.mod.dropout ? (flash_keep(p, b, h, i, j) ? (float)p.mod.drop_scale : 0.f)
                                          : 1.f;
            const float ds = pij * (z * row_dot(dO, v) - D[i]) * grad;
#pragma unroll
            for (int c8 = 0; c8 < FT_SIMT_MAX_COLS; c8++) {
                dv[c8] += pij * z * dO[c8];
                dk[c8] += ds * q[c8];
            }
        }
    }
    store_row(p.dk, b, j, hk, dk, p.scale, p, lane);
    store_row(p.dv, b, j, hk, dv, 1.f, p, lane);
}

/* dQ_i for query row i of head h: one warp per row. */
__global__ void __launch_bounds__(SIMT_WARPS * FT_WARP) flash_bwd_dq_simt_kernel(FlashParams p)
{
    const int lane = threadIdx.x % FT_WARP, warp = threadIdx.x / FT_WARP;
    const int i = blockIdx.x * SIMT_WARPS + warp, h = blockIdx.y, b = blockIdx.z;
    flash_enter_seq(p, b);
    if (i >= p.Nq)
        return;
    const int hk = h / (p.H / p.Hk);
    float q[FT_SIMT_MAX_COLS], dO[FT_SIMT_MAX_COLS], dq[FT_SIMT_MAX_COLS] = {0},
          k[FT_SIMT_MAX_COLS], v[FT_SIMT_MAX_COLS];
    load_row(q, p.q, b, i, h, p, lane);
    load_row(dO, p.dout, b, i, h, p, lane);
    const float lse = p.lse[flash_stat(p, b, h) + i];
    const float D = p.D[flash_stat(p, b, h) + i];
    const bool mods = flash_score_modified(p);
    const ScoreMod smod = flash_score_mod(p, b, h);
    const int jend = flash_key_end(p, i);
    for (int j = flash_key_begin(p, i); j < jend; j++) {
        load_row(k, p.k, b, j, hk, p, lane);
        load_row(v, p.v, b, j, hk, p, lane);
        float x = row_dot(q, k), grad = 1.f;
        if (mods)
            x = smod.apply(x, smod.pos(i), (float)j, &grad);
        const float pij = prob(x, lse, p);
        const float z = p.mod.dropout ? (flash_keep(p, b, h, i, j) ? (float)p.mod.drop_scale : 0.f)
                                      : 1.f;
        const float ds = pij * (z * row_dot(dO, v) - D) * grad;
#pragma unroll
        for (int c8 = 0; c8 < FT_SIMT_MAX_COLS; c8++)
            dq[c8] += ds * k[c8];
    }
    store_row(p.dq, b, i, h, dq, p.scale, p, lane);
}
#endif


/* ---- tensor cores (f16/bf16) ----
 *
 * dK/dV: one CTA per BC keys of one kv head; warp w owns keys 16w..16w+15
 * (times DSPLIT warps that split the head dim of the accumulators, for
 * D = 256) and computes the transposed products S^T = K Q^T and
 * dP^T = V dO^T for them, so P^T and dS^T come out in registers as the A
 * fragments of dV += P^T dO and dK += dS^T Q.
 * dQ: the forward's layout: one CTA per 64 query rows, warp w owns rows
 * 16w..16w+15; S = Q K^T, dP = dO V^T, dS = P (dP - D), dQ += dS K. */

#define BWD_BR 64 /* query rows per tile */

/* The two kernels' shared memory, for the kernels and their launcher.
 * dK/dV: K, V [BC][LD]; then two buffers of (Q, dO) [BWD_BR][LD]; then two
 * buffers of (lse * log2(e), D) [BWD_BR] floats. dQ: Q, dO [BWD_BR][LD],
 * then two buffers of (K, V) [BC][LD]. Offsets in elements of T. */
template <typename T, int D, int BC> struct MmaBwdSmem {
    static constexpr int LD = D + 8;
    static constexpr int KV_V = BC * LD, KV_Q = 2 * BC * LD, KV_STATS = KV_Q + 4 * BWD_BR * LD;
    static constexpr size_t kv_bytes = (size_t)KV_STATS * sizeof(T) + 4 * BWD_BR * sizeof(float);
    static constexpr int Q_DO = BWD_BR * LD, Q_K = 2 * BWD_BR * LD;
    static constexpr size_t q_bytes = (size_t)(Q_K + 4 * BC * LD) * sizeof(T);
};

/* The gradients of the tensors a Lua-written mod read (UM::has_grad), in
 * two steps. user_mod_gscore, for entries 2 k and 2 k + 1 of a warp's S^T
 * fragment (modified scores in st, dP^T in dp, D of the queries in dd,
 * their LSE in log2 units in sl, the dropout factors z0, z1): each
 * visible entry's dL / d score = P (z dP - D) into gsc (0 where hidden).
 * Keys are the rows from key0, queries the columns from q0. Then
 * user_mod_grads hands every entry with one to UM::grad, with the mod's
 * input score from um_in, in a loop kept rolled: one copy of the mod's
 * gradient code, not one an entry. */
__device__ __forceinline__ void user_mod_gscore(const FlashParams &p, const float *st,
                                                const float *dp, const float *dd, const float *sl,
                                                int k, float z0, float z1, int key0, int q0,
                                                float *gsc)
{
    const int lane = threadIdx.x % FT_WARP, g = lane / 4, t4 = lane % 4;
#pragma unroll
    for (int e = 0; e < 2; e++) {
        const int i = 2 * k + e, qc = 8 * (k / 2) + 2 * t4 + e;
        const int kj = key0 + g + 8 * (k % 2), qi = q0 + qc;
        const bool seen = !flash_queries(p, kj).hides(qi) && st[i] != -INFINITY;
        const float pt = exp2f(st[i] * p.scale_log2 - sl[qc]); /* 0 past the queries' end */
        gsc[i] = seen ? pt * ((e ? z1 : z0) * dp[e] - dd[e]) : 0.f;
    }
}

template <typename UM, int N>
__device__ __forceinline__ void user_mod_grads(const ScoreMod &m, const float *um_in,
                                               const float *gsc, int key0, int q0,
                                               typename UM::GradState &gst)
{
    const int lane = threadIdx.x % FT_WARP, g = lane / 4, t4 = lane % 4;
    const typename UM::Ctx uc = UM::prepare(m.b, m.h);
    /* in the order 1, 0, 3, 2, 5, 4 ... of k (pairs), entry e of each pair
     * apart: then neighbours in the loop share i - j (k = 2 a - 2 and
     * 2 a + 1), and a table indexed by it (a relative bias) sums them
     * before its atomic */
#pragma unroll 1
    for (int n = 0; n < N; n++) {
        const int u = n % (N / 2), e = n / (N / 2);
        const int k = u == 0 ? 1 : u % 2 ? u - 1 : u + 1, i = 2 * k + e;
        if (gsc[i] == 0.f)
            continue;
        const int kj = key0 + g + 8 * (k % 2), qi = q0 + 8 * (k / 2) + 2 * t4 + e;
        UM::grad(uc, qi, kj, (float)(qi + 1), (float)(kj + 1), um_in[i], gsc[i], gst);
    }
}

template <typename T, int D, int BC, int DSPLIT, bool EXT, typename UM = NoUserMod>
__global__ void __launch_bounds__((BC / 16) * DSPLIT * FT_WARP)
    flash_bwd_dkdv_mma_kernel(FlashParams p)
{
    using SL = MmaBwdSmem<T, D, BC>;
    constexpr int LD = SL::LD, THREADS = (BC / 16) * DSPLIT * FT_WARP;
    constexpr int NT_Q = BWD_BR / 8;        /* n-tiles of S^T over queries */
    constexpr int DW = D / DSPLIT;          /* head-dim columns this warp accumulates */
    constexpr int NT_D = DW / 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T *sK = reinterpret_cast<T *>(smem_raw);
    T *sV = sK + SL::KV_V;
    T *const sQ0 = sK + SL::KV_Q;
    float *const sL0 = reinterpret_cast<float *>(sK + SL::KV_STATS);

    const int lane = threadIdx.x % FT_WARP, warp = threadIdx.x / FT_WARP;
    const int kw = warp / DSPLIT, dpart = warp % DSPLIT; /* key slice, column part */
    const int g = lane / 4, t4 = lane % 4;
    const int j0 = blockIdx.x * BC, hk = blockIdx.y, b = blockIdx.z;
    if (EXT) { /* varlen: this CTA's sequence; past its end, nothing to do */
        flash_enter_seq(p, b);
        if (j0 >= p.Nk)
            return;
    }
    const int G = p.H / p.Hk, nk = min(BC, p.Nk - j0);
    const int key[2] = {j0 + kw * 16 + g, j0 + kw * 16 + g + 8};
    const FullKeys full = flash_full_queries(p, j0 + kw * 16, j0 + kw * 16 + 16);

    /* the (query head, query block) tiles this key block meets, in order:
     * the query blocks over [i_begin, i_end) */
    const int i_begin = flash_query_begin(p, j0) / BWD_BR * BWD_BR;
    const int i_end = flash_query_end(p, j0 + nk - 1);
    const int nqb = i_begin < i_end ? (i_end - i_begin + BWD_BR - 1) / BWD_BR : 0;
    const int tiles = G * nqb;

    /* Starts the copy of tile t into buffer buf: Q and dO by cp.async, the
     * row statistics by plain stores (read after the next barrier). */
    auto issue = [&](int t, int buf) {
        const int h = hk * G + t / nqb, i0 = i_begin + (t % nqb) * BWD_BR;
        const int nq = min(BWD_BR, p.Nq - i0);
        T *q = sQ0 + buf * 2 * BWD_BR * LD;
        load_tile<T, BWD_BR, D, LD, THREADS>(q, p.q, b, h, i0, nq, p.d);
        load_tile<T, BWD_BR, D, LD, THREADS>(q + BWD_BR * LD, p.dout, b, h, i0, nq, p.d);
        const float *lse = p.lse + flash_stat(p, b, h);
        const float *Dh = p.D + flash_stat(p, b, h);
        float *sl = sL0 + buf * 2 * BWD_BR;
        for (int r = threadIdx.x; r < BWD_BR; r += THREADS) {
            const bool ok = r < nq && lse[i0 + r] != -INFINITY;
            sl[r] = ok ? lse[i0 + r] * FT_LOG2E : INFINITY; /* exp2(x - inf) = 0 */
            sl[BWD_BR + r] = r < nq ? Dh[i0 + r] : 0.f;
        }
    };

    load_tile<T, BC, D, LD, THREADS>(sK, p.k, b, hk, j0, nk, p.d);
    load_tile<T, BC, D, LD, THREADS>(sV, p.v, b, hk, j0, nk, p.d);
    if (tiles > 0)
        issue(0, 0);
    cp_async_commit();

    typename UM::GradState gst{}; /* UM::has_grad: the running sums of the mod's gradients */
    float dk[NT_D][4], dv[NT_D][4];
#pragma unroll
    for (int n = 0; n < NT_D; n++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            dk[n][e] = dv[n][e] = 0.f;

    for (int t = 0, buf = 0; t < tiles; t++, buf ^= 1) {
        {
            cp_async_wait_all(); /* tile t landed ... */
            __syncthreads();     /* ... for all, and tile t-1's buffer is free */
            if (t + 1 < tiles)
                issue(t + 1, buf ^ 1); /* overlaps the products below */
            cp_async_commit();
            const int i0 = i_begin + (t % nqb) * BWD_BR;
            const int nq = min(BWD_BR, p.Nq - i0);
            const T *sQ = sQ0 + buf * 2 * BWD_BR * LD, *sdO = sQ + BWD_BR * LD;
            const float *sL = sL0 + buf * 2 * BWD_BR, *sD = sL + BWD_BR;
            const int hcur = hk * G + t / nqb;
            const ScoreMod smod = flash_score_mod(p, b, EXT || UM::on ? hcur : 0);
            /* dropout's keep bits of st's entries */
            const uint64_t kbits =
                EXT && flash_dropout<UM>(p) ? keep_bits<NT_Q * 4, true>(p, b, hcur, j0 + kw * 16, i0) : 0;

            /* S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys */
            float st[NT_Q][4], dpt[NT_Q][4];
#pragma unroll
            for (int n = 0; n < NT_Q; n++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    st[n][e] = dpt[n][e] = 0.f;
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                uint32_t ak[4], av[4];
                const int arow = (kw * 16 + lane % 16) * LD + kk * 16 + (lane / 16) * 8;
                ldmatrix_x4(ak, sK + arow);
                ldmatrix_x4(av, sV + arow);
#pragma unroll
                for (int nn = 0; nn < NT_Q / 2; nn++) {
                    const int brow = (nn * 16 + lane % 8 + (lane / 16) * 8) * LD + kk * 16 +
                                     ((lane / 8) % 2) * 8;
                    uint32_t bq[4], bo[4];
                    ldmatrix_x4(bq, sQ + brow);
                    ldmatrix_x4(bo, sdO + brow);
                    MmaType<T>::mma(st[2 * nn], ak, bq[0], bq[1]);
                    MmaType<T>::mma(st[2 * nn + 1], ak, bq[2], bq[3]);
                    MmaType<T>::mma(dpt[2 * nn], av, bo[0], bo[1]);
                    MmaType<T>::mma(dpt[2 * nn + 1], av, bo[2], bo[3]);
                }
            }
            /* P^T from the LSE (masked entries 0), dS^T = P^T (dP^T - D);
             * the queries each key sees are worked out at an edge only.
             * EXT: S^T modified first, and dP^T - D times its derivative
             * (g (dP - D) in place of dP - D). */
            /* UM::has_grad: the Lua-written mod's input scores, dL / d its output */
            float um_in[UM::has_grad ? NT_Q * 4 : 1], gsc[UM::has_grad ? NT_Q * 4 : 1];
            if (EXT) {
                mod_acc_with<NT_Q * 4, true, fast_tanh<T>(), UM>(smod, &st[0][0], j0 + kw * 16, i0,
                                             [&](int k, float d0, float d1) {
                                                 float *x = &dpt[0][0] + 2 * k;
                                                 const float *dd = sD + 8 * (k / 2) + 2 * t4;
                                                 const bool drop = flash_dropout<UM>(p);
                                                 const float z0 = drop ? drop_factor(p, kbits, 2 * k) : 1.f;
                                                 const float z1 = drop ? drop_factor(p, kbits, 2 * k + 1) : 1.f;
                                                 if (UM::has_grad)
                                                     user_mod_gscore(p, &st[0][0], x, dd, sL, k, z0, z1,
                                                                     j0 + kw * 16, i0, gsc);
                                                 x[0] = d0 * (z0 * x[0] - dd[0]);
                                                 x[1] = d1 * (z1 * x[1] - dd[1]);
                                             }, um_in);
                if (UM::has_grad && dpart == 0) /* the other column parts' S^T is the same */
                    user_mod_grads<UM, NT_Q * 4>(smod, um_in, gsc, j0 + kw * 16, i0, gst);
            } else if (UM::on) /* a Lua-written mask alone: no derivative */
                mod_acc<NT_Q * 4, true, fast_tanh<T>(), UM, false>(smod, &st[0][0], j0 + kw * 16, i0);
            QueryRange q0 = {0, p.Nq}, q1 = {0, p.Nq};
            if (full.masks(i0, i0 + BWD_BR)) {
                q0 = flash_queries(p, key[0]);
                q1 = flash_queries(p, key[1]);
            }
#pragma unroll
            for (int n = 0; n < NT_Q; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int qc = n * 8 + t4 * 2 + (e % 2), qi = i0 + qc;
                    const bool ok = !(e / 2 ? q1 : q0).hides(qi); /* qi < Nq among them */
                    const float pt = ok ? exp2f(st[n][e] * p.scale_log2 - sL[qc]) : 0.f;
                    dpt[n][e] = pt * (EXT ? dpt[n][e] : dpt[n][e] - sD[qc]);
                    /* dV takes the kept probabilities */
                    st[n][e] = EXT && flash_dropout<UM>(p) ? pt * drop_factor(p, kbits, 4 * n + e) : pt;
                }
            /* dV += P^T dO, dK += dS^T Q over this warp's columns */
#pragma unroll
            for (int kk = 0; kk < NT_Q / 2; kk++) {
                uint32_t ap[4], as[4];
                acc_to_a<T>(st[2 * kk], st[2 * kk + 1], ap);
                acc_to_a<T>(dpt[2 * kk], dpt[2 * kk + 1], as);
#pragma unroll
                for (int dn = 0; dn < NT_D / 2; dn++) {
                    const int brow = (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * LD +
                                     dpart * DW + dn * 16 + (lane / 16) * 8;
                    uint32_t bo[4], bq[4];
                    ldmatrix_x4_trans(bo, sdO + brow);
                    ldmatrix_x4_trans(bq, sQ + brow);
                    MmaType<T>::mma(dv[2 * dn], ap, bo[0], bo[1]);
                    MmaType<T>::mma(dv[2 * dn + 1], ap, bo[2], bo[3]);
                    MmaType<T>::mma(dk[2 * dn], as, bq[0], bq[1]);
                    MmaType<T>::mma(dk[2 * dn + 1], as, bq[2], bq[3]);
                }
            }
        }
    }

    UM::grad_flush(gst);
    /* store dK (scaled) and dV for this warp's keys and columns */
    T *dkp = reinterpret_cast<T *>(p.dk.data), *dvp = reinterpret_cast<T *>(p.dv.data);
#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (key[r] >= p.Nk)
            continue;
        const int64_t ko = row_offset(p.dk, b, key[r], hk), vo = row_offset(p.dv, b, key[r], hk);
#pragma unroll
        for (int n = 0; n < NT_D; n++) {
            const int col = dpart * DW + n * 8 + t4 * 2;
            if (col < p.d) {
                *reinterpret_cast<uint32_t *>(dkp + ko + col) =
                    MmaType<T>::pack(dk[n][2 * r] * p.scale, dk[n][2 * r + 1] * p.scale);
                *reinterpret_cast<uint32_t *>(dvp + vo + col) =
                    MmaType<T>::pack(dv[n][2 * r], dv[n][2 * r + 1]);
            }
        }
    }
}

template <typename T, int D, int BC, bool EXT, typename UM = NoUserMod>
__global__ void __launch_bounds__(4 * FT_WARP) flash_bwd_dq_mma_kernel(FlashParams p)
{
    using SL = MmaBwdSmem<T, D, BC>;
    constexpr int LD = SL::LD, THREADS = 4 * FT_WARP;
    constexpr int NT_S = BC / 8, NT_D = D / 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T *sQ = reinterpret_cast<T *>(smem_raw);
    T *sdO = sQ + SL::Q_DO;
    T *const sK0 = sQ + SL::Q_K; /* two buffers of (K, V) [BC][LD] */

    const int lane = threadIdx.x % FT_WARP, warp = threadIdx.x / FT_WARP;
    const int g = lane / 4, t4 = lane % 4;
    const int i0 = blockIdx.x * BWD_BR, h = blockIdx.y, b = blockIdx.z;
    if (EXT) { /* varlen: this CTA's sequence; past its end, nothing to do */
        flash_enter_seq(p, b);
        if (i0 >= p.Nq)
            return;
    }
    const int hk = h / (p.H / p.Hk), nq = min(BWD_BR, p.Nq - i0);
    const int row[2] = {i0 + warp * 16 + g, i0 + warp * 16 + g + 8};
    const FullKeys full = flash_full_keys(p, i0 + warp * 16, i0 + warp * 16 + 16);
    const ScoreMod smod = flash_score_mod(p, b, h);

    /* the key blocks some row of this block sees: [jbegin, jend) */
    const int jbegin = flash_key_begin(p, i0) / BC * BC;
    const int jend = flash_key_end(p, i0 + nq - 1);
    load_tile<T, BWD_BR, D, LD, THREADS>(sQ, p.q, b, h, i0, nq, p.d);
    load_tile<T, BWD_BR, D, LD, THREADS>(sdO, p.dout, b, h, i0, nq, p.d);
    if (jend > jbegin) {
        const int nk0 = min(BC, p.Nk - jbegin);
        load_tile<T, BC, D, LD, THREADS>(sK0, p.k, b, hk, jbegin, nk0, p.d);
        load_tile<T, BC, D, LD, THREADS>(sK0 + BC * LD, p.v, b, hk, jbegin, nk0, p.d);
    }
    cp_async_commit();
    float L[2], Dr[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int64_t at = flash_stat(p, b, h) + row[r];
        const float l = row[r] < p.Nq ? p.lse[at] : -INFINITY;
        L[r] = l == -INFINITY ? INFINITY : l * FT_LOG2E; /* exp2(x - inf) = 0 */
        Dr[r] = row[r] < p.Nq ? p.D[at] : 0.f;
    }
    float dq[NT_D][4];
#pragma unroll
    for (int n = 0; n < NT_D; n++)
        dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.f;

    for (int j0 = jbegin, buf = 0; j0 < jend; j0 += BC, buf ^= 1) {
        cp_async_wait_all(); /* block j landed ... */
        __syncthreads();     /* ... for all, and block j-1's buffer is free */
        if (j0 + BC < jend) { /* block j+1 loads while block j is multiplied */
            T *next = sK0 + (buf ^ 1) * 2 * BC * LD;
            const int nk_next = min(BC, p.Nk - j0 - BC);
            load_tile<T, BC, D, LD, THREADS>(next, p.k, b, hk, j0 + BC, nk_next, p.d);
            load_tile<T, BC, D, LD, THREADS>(next + BC * LD, p.v, b, hk, j0 + BC, nk_next, p.d);
        }
        cp_async_commit();
        const T *sK = sK0 + buf * 2 * BC * LD, *sV = sK + BC * LD;

        float s[NT_S][4], dp[NT_S][4];
#pragma unroll
        for (int n = 0; n < NT_S; n++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                s[n][e] = dp[n][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            uint32_t aq[4], ao[4];
            const int arow = (warp * 16 + lane % 16) * LD + kk * 16 + (lane / 16) * 8;
            ldmatrix_x4(aq, sQ + arow);
            ldmatrix_x4(ao, sdO + arow);
#pragma unroll
            for (int nn = 0; nn < NT_S / 2; nn++) {
                const int brow = (nn * 16 + lane % 8 + (lane / 16) * 8) * LD + kk * 16 +
                                 ((lane / 8) % 2) * 8;
                uint32_t bk[4], bv[4];
                ldmatrix_x4(bk, sK + brow);
                ldmatrix_x4(bv, sV + brow);
                MmaType<T>::mma(s[2 * nn], aq, bk[0], bk[1]);
                MmaType<T>::mma(s[2 * nn + 1], aq, bk[2], bk[3]);
                MmaType<T>::mma(dp[2 * nn], ao, bv[0], bv[1]);
                MmaType<T>::mma(dp[2 * nn + 1], ao, bv[2], bv[3]);
            }
        }
        /* the keys each row sees, worked out at an edge only (rows past the
         * end have L = +inf: P = 0) */
        KeyRange k0 = {0, p.Nk}, k1 = {0, p.Nk};
        if (full.masks(j0, j0 + BC)) {
            k0 = flash_keys(p, row[0]);
            k1 = flash_keys(p, row[1]);
        }
        const uint64_t kbits =
            EXT && flash_dropout<UM>(p) ? keep_bits<NT_S * 4>(p, b, h, i0 + warp * 16, j0) : 0;
        if (EXT) /* as in dK/dV: S modified, g (Z dP - D) in place of dP - D */
            mod_acc_with<NT_S * 4, false, fast_tanh<T>(), UM>(smod, &s[0][0], i0 + warp * 16, j0,
                                          [&](int k, float d0, float d1) {
                                              float *x = &dp[0][0] + 2 * k;
                                              const bool drop = flash_dropout<UM>(p);
                                              const float z0 = drop ? drop_factor(p, kbits, 2 * k) : 1.f;
                                              const float z1 = drop ? drop_factor(p, kbits, 2 * k + 1) : 1.f;
                                              x[0] = d0 * (z0 * x[0] - Dr[k % 2]);
                                              x[1] = d1 * (z1 * x[1] - Dr[k % 2]);
                                          });
        else if (UM::on) /* a Lua-written mask alone: no derivative */
            mod_acc<NT_S * 4, false, fast_tanh<T>(), UM, false>(smod, &s[0][0], i0 + warp * 16, j0);
#pragma unroll
        for (int n = 0; n < NT_S; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = e / 2, col = j0 + n * 8 + t4 * 2 + (e % 2);
                const bool ok = !(r ? k1 : k0).hides(col);
                const float pr = ok ? exp2f(s[n][e] * p.scale_log2 - L[r]) : 0.f;
                dp[n][e] = pr * (EXT ? dp[n][e] : dp[n][e] - Dr[r]); /* dS */
            }
        /* dQ += dS K */
#pragma unroll
        for (int kk = 0; kk < BC / 16; kk++) {
            uint32_t a[4];
            acc_to_a<T>(dp[2 * kk], dp[2 * kk + 1], a);
#pragma unroll
            for (int dn = 0; dn < NT_D / 2; dn++) {
                uint32_t bk[4];
                ldmatrix_x4_trans(bk, sK + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * LD +
                                          dn * 16 + (lane / 16) * 8);
                MmaType<T>::mma(dq[2 * dn], a, bk[0], bk[1]);
                MmaType<T>::mma(dq[2 * dn + 1], a, bk[2], bk[3]);
            }
        }
    }

    cp_async_wait_all(); /* nothing left in flight (none when no key is visible) */

    T *dqp = reinterpret_cast<T *>(p.dq.data);
#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (row[r] >= p.Nq)
            continue;
        const int64_t o = row_offset(p.dq, b, row[r], h);
#pragma unroll
        for (int n = 0; n < NT_D; n++) {
            const int col = n * 8 + t4 * 2;
            if (col < p.d)
                *reinterpret_cast<uint32_t *>(dqp + o + col) =
                    MmaType<T>::pack(dq[n][2 * r] * p.scale, dq[n][2 * r + 1] * p.scale);
        }
    }
}

#ifndef __CUDACC_RTC__
template <typename T, int D, int BC, int DSPLIT, bool EXT>
static ft_status launch_bwd_mma(const FlashParams &p, FlashRtc *rtc)
{
    const char *func = "ft_attention_backward";
    using L = MmaBwdSmem<T, D, BC>;
    if (p.Nk > 0)
        FT_TRY(flash_launch(rtc, FLASH_FILE, flash_bwd_dkdv_mma_kernel<T, D, BC, DSPLIT, EXT>,
                            [] { return rtc_name("flash_bwd_dkdv_mma_kernel", TypeOf<T>(), D, BC, DSPLIT, EXT); },
                            dim3((p.Nk + BC - 1) / BC, p.Hk, p.B), (BC / 16) * DSPLIT * FT_WARP,
                            L::kv_bytes, p, func));
    return flash_launch(rtc, FLASH_FILE, flash_bwd_dq_mma_kernel<T, D, BC, EXT>,
                        [] { return rtc_name("flash_bwd_dq_mma_kernel", TypeOf<T>(), D, BC, EXT); },
                        dim3((p.Nq + BWD_BR - 1) / BWD_BR, p.H, p.B),
                        4 * FT_WARP, L::q_bytes, p, func);
}

/* The row of MMA_BWD_TILES that takes the head dim, for p's dtype and kind. */
ft_status flash_bwd_mma(const FlashParams &p, FlashRtc *rtc)
{
    return flash_dispatch(p, [&](auto type, auto ext) {
        using T = typename decltype(type)::type;
        return flash_pick(MMA_BWD_TILES, p.d, [&](auto row) {
            constexpr MmaBwdTile c = MMA_BWD_TILES[decltype(row)::value];
            return launch_bwd_mma<T, c.D, c.BC, c.DSPLIT, decltype(ext)::value>(p, rtc);
        });
    });
}

extern "C" ft_status ft_attention_backward_flash_cuda(const ft_attn_shape *s,
                                                      const ft_tensor *dout,
                                                      const ft_tensor *q, const ft_tensor *k,
                                                      const ft_tensor *v, const ft_tensor *out,
                                                      const ft_tensor *lse, ft_tensor *work,
                                                      ft_tensor *dq, ft_tensor *dk, ft_tensor *dv)
{
    const char *func = "ft_attention_backward";
    FT_TRY(ft_cuda_use_device(q->device.index, func));
    if (s->B == 0 || s->H == 0 || s->Nq == 0)
        return FT_OK;
    const ft_tensor *ts[8] = {q, k, v, out, dout, dq, dk, dv};
    const bool mma = (q->dtype == FT_F16 || q->dtype == FT_BF16) && s->d % 8 == 0 &&
                     flash_rows_aligned(ts, 8);
    const bool sm90 = mma && flash_sm90_usable(q->device.index);
    if (s->mods && !mma)
        return ft_fail(FT_ERR_UNSUPPORTED, func, 2,
                       "mods on CUDA run in the tensor-core kernels: f16 or bf16, head_dim a "
                       "multiple of 8, rows on 16 bytes");
    FlashRtc *rtc = nullptr; /* mods: the kernels compiled for them (rtc.cu) */
    if (s->mods && !ft_attn_mods_band_only(s))
        FT_TRY(flash_rtc_new(s, q->dtype, q->device.index, &rtc, func));
    /* LSE contiguous f32; D and the sm90 kernels' LSE in log2 units in
     * work, laid out as LSE */
    FlashParams p = flash_params(s, q, k, v, out, lse);
    p.dout = flash_tensor(dout);
    p.dq = flash_tensor(dq);
    p.dk = flash_tensor(dk);
    p.dv = flash_tensor(dv);
    p.D = (float *)work->data;
    p.lse2 = sm90 ? p.D + ft_numel(lse) : nullptr;
    /* a score function needs the EXT kernels (its derivatives); a mask
     * alone runs in the plain ones */
    p.user_mod = rtc != nullptr && ft_attn_mods_cuda_has_score(s->mods);
    const dim3 block(SIMT_WARPS * FT_WARP);
    ft_status st = flash_bwd_dot(p, mma, func);
    /* the gradients of a mod's tensors come from the mma.sync dK/dV kernel */
    if (st == FT_OK && sm90 && !s->mod_gdev) {
        st = flash_bwd_sm90(p, rtc);
    } else if (st == FT_OK && mma) {
        st = flash_bwd_mma(p, rtc);
    }
    flash_rtc_free(rtc);
    if (!mma && st == FT_OK && s->Nk > 0) {
        flash_bwd_dkdv_simt_kernel<<<dim3((p.Nk + SIMT_WARPS - 1) / SIMT_WARPS, p.Hk, p.B),
                                     block>>>(p);
        st = ft_cuda_check_launch(func, __FILE__, __LINE__);
    }
    if (!mma && st == FT_OK) {
        flash_bwd_dq_simt_kernel<<<dim3((p.Nq + SIMT_WARPS - 1) / SIMT_WARPS, p.H, p.B),
                                   block>>>(p);
        st = ft_cuda_check_launch(func, __FILE__, __LINE__);
    }
    return st;
}
#endif
