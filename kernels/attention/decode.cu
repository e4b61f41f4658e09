/*
 * decode.cu - attention for decoding: a few query rows per sequence (1 to
 * 64) against a long KV cache, with the keys split across CTAs (split-KV)
 * so that the whole GPU reads the cache, and the splits' partial results
 * merged by their LSE in a second kernel (in a fixed order: deterministic).
 *
 *   q [B, Nq, H, d]; k, v caches [B, rows, Hk, d] or page pools [pages,
 *   page_size, Hk, d] with a block table (0-based, [B, max_pages]);
 *   lens (i32 [B], device): the keys of each sequence; out [B, Nq, H, d],
 *   lse [B, H, Nq] f32.
 *
 * The query heads of one kv head are processed together (GQA): a CTA's
 * rows are (query i, head g of the group) pairs, packed r = i G + g, so
 * that each key and value row read serves every head that needs it.
 * Causal: query i sees keys j <= len - Nq + i (bottom-right). f16/bf16,
 * head dims rounded up to 64, 128 or 256; mma.sync (sm_80 and later).
 * Check: spec/kvcache_spec.lua (tag gpu); scripts/bench.lua --decode.
 */
#include "flash_mma.cuh"

#include <math.h>
#include <string.h>

template <int V> struct IntC {
    static constexpr int value = V;
};

struct DecodeParams {
    const void *q;
    int64_t q_bs, q_rs, q_hs; /* elements */
    const void *k, *v;
    int64_t k_bs, k_rs, k_hs, v_bs, v_rs, v_hs; /* batch (or page), row, head */
    const int *lens;   /* [B] keys per sequence */
    const int *table;  /* [B][table_stride] pages, or null */
    int table_stride, page_size;
    void *out;
    int64_t o_bs, o_rs, o_hs;
    float *lse;       /* [B, H, Nq] contiguous */
    float *part_o;    /* splits > 1: [S][B][H][Nq][d] */
    float *part_lse;  /* [S][B][H][Nq] */
    int B, Nq, H, Hk, G, d, splits, chunk, causal;
    float scale_log2;
};

#define DEC_BC 64   /* keys a tile */
#define DEC_WARPS 4

/* Shared memory: Q [16 WR][LD], then NS stages of K and V [DEC_BC][LD]
 * (16-bit, rows padded for ldmatrix); the epilogue reuses the stages. */
template <int D, int WR, int NS> struct DecodeSmem {
    static constexpr int LD = D + 8, ROWS = 16 * WR;
    static constexpr int K = ROWS * LD, STAGE = 2 * DEC_BC * LD;
    static constexpr size_t bytes = (size_t)(K + NS * STAGE) * 2;
};

/* The address of key (or value) row j of sequence b, head hk. */
__device__ __forceinline__ const char *kv_row(const DecodeParams &p, const void *base, int64_t bs,
                                              int64_t rs, int64_t hs, int b, int hk, int j)
{
    int64_t entry = b, row = j;
    if (p.table) {
        entry = p.table[(int64_t)b * p.table_stride + j / p.page_size];
        row = j % p.page_size;
    }
    return (const char *)base + 2 * (entry * bs + row * rs + (int64_t)hk * hs);
}

template <typename T, int D, int WR, int NS>
__global__ void __launch_bounds__(DEC_WARPS *FT_WARP) decode_split_kernel(DecodeParams p)
{
    using L = DecodeSmem<D, WR, NS>;
    constexpr int LD = L::LD, ROWS = L::ROWS, WK = DEC_WARPS / WR, KW = DEC_BC / WK;
    constexpr int NT_S = KW / 8, NT_O = D / 8, THREADS = DEC_WARPS * FT_WARP;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T *const sQ = reinterpret_cast<T *>(smem_raw), *const sKV = sQ + L::K;

    const int tid = threadIdx.x, lane = tid % FT_WARP, warp = tid / FT_WARP;
    const int g = lane / 4, t4 = lane % 4, wr = warp % WR, wk = warp / WR;
    const int split = blockIdx.x % p.splits, rb = blockIdx.x / p.splits;
    const int hk = blockIdx.y, b = blockIdx.z;
    const int M = p.Nq * p.G, r0 = rb * ROWS, len = p.lens[b];
    const int k_lo = split * p.chunk, k_hi = min(len, k_lo + p.chunk);

    /* Q rows r0 .. r0 + ROWS - 1 (zeros past M and past d) */
    for (int idx = tid; idx < ROWS * (D / 8); idx += THREADS) {
        const int r = idx / (D / 8), c = idx % (D / 8) * 8, rr = r0 + r;
        const bool ok = rr < M && c < p.d;
        const int i = ok ? rr / p.G : 0, h = hk * p.G + (ok ? rr % p.G : 0);
        const char *src = (const char *)p.q + 2 * ((int64_t)b * p.q_bs + (int64_t)i * p.q_rs +
                                                   (int64_t)h * p.q_hs + c);
        cp_async_16(sQ + r * LD + c, ok ? src : (const char *)p.q, ok);
    }
    cp_async_commit();
    /* stage st of tile t: keys k_lo + t DEC_BC ..; rows past k_hi and
     * columns past d are zeros, never read from the cache */
    const int ntiles = k_hi > k_lo ? (k_hi - k_lo + DEC_BC - 1) / DEC_BC : 0;
    auto load = [&](int t) {
        T *sk = sKV + (t % NS) * L::STAGE, *sv = sk + DEC_BC * LD;
        for (int idx = tid; idx < DEC_BC * (D / 8); idx += THREADS) {
            const int r = idx / (D / 8), c = idx % (D / 8) * 8, j = k_lo + t * DEC_BC + r;
            const bool ok = j < k_hi && c < p.d;
            cp_async_16(sk + r * LD + c,
                        ok ? kv_row(p, p.k, p.k_bs, p.k_rs, p.k_hs, b, hk, j) + 2 * c : (const char *)p.k, ok);
            cp_async_16(sv + r * LD + c,
                        ok ? kv_row(p, p.v, p.v_bs, p.v_rs, p.v_hs, b, hk, j) + 2 * c : (const char *)p.v, ok);
        }
    };
#pragma unroll
    for (int t = 0; t < NS - 1; t++) {
        if (t < ntiles)
            load(t);
        cp_async_commit();
    }

    float o[NT_O][4], m[2], l[2];
#pragma unroll
    for (int n = 0; n < NT_O; n++)
        o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.f;
    /* the last key each of this thread's two rows sees (exclusive) */
    int kend[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int rr = r0 + wr * 16 + g + 8 * r, i = rr / p.G;
        kend[r] = rr >= M ? 0 : p.causal ? min(k_hi, len - p.Nq + i + 1) : k_hi;
    }

    cp_async_wait<NS - 1>(); /* Q */
    __syncthreads();
    uint32_t qa[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++)
        ldmatrix_x4(qa[kk], sQ + (wr * 16 + lane % 16) * LD + kk * 16 + (lane / 16) * 8);

    for (int t = 0; t < ntiles; t++) {
        if (t + NS - 1 < ntiles)
            load(t + NS - 1);
        cp_async_commit();
        cp_async_wait<NS - 1>(); /* tile t landed */
        __syncthreads();
        const T *sk = sKV + (t % NS) * L::STAGE + wk * KW * LD, *sv = sk + DEC_BC * LD;
        const int j0 = k_lo + t * DEC_BC + wk * KW; /* this warp's first key */

        float s[NT_S][4];
#pragma unroll
        for (int n = 0; n < NT_S; n++)
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++)
#pragma unroll
            for (int nn = 0; nn < NT_S / 2; nn++) {
                uint32_t bk[4];
                ldmatrix_x4(bk, sk + (nn * 16 + lane % 8 + (lane / 16) * 8) * LD + kk * 16 +
                                    ((lane / 8) % 2) * 8);
                MmaType<T>::mma(s[2 * nn], qa[kk], bk[0], bk[1]);
                MmaType<T>::mma(s[2 * nn + 1], qa[kk], bk[2], bk[3]);
            }
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float mx = -INFINITY;
#pragma unroll
            for (int n = 0; n < NT_S; n++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    float &x = s[n][2 * r + e];
                    x = j0 + n * 8 + t4 * 2 + e < kend[r] ? x * p.scale_log2 : -INFINITY;
                    mx = fmaxf(mx, x);
                }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m[r], mx), m_use = m_new == -INFINITY ? 0.f : m_new;
            const float alpha = ex2(m[r] - m_use);
            float sum = 0.f;
#pragma unroll
            for (int n = 0; n < NT_S; n++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    float &x = s[n][2 * r + e];
                    x = ex2(x - m_use);
                    sum += x;
                }
            l[r] = l[r] * alpha + sum;
            m[r] = m_new;
#pragma unroll
            for (int n = 0; n < NT_O; n++) {
                o[n][2 * r] *= alpha;
                o[n][2 * r + 1] *= alpha;
            }
        }
#pragma unroll
        for (int kk = 0; kk < KW / 16; kk++) {
            uint32_t a[4];
            a[0] = MmaType<T>::pack(s[2 * kk][0], s[2 * kk][1]);
            a[1] = MmaType<T>::pack(s[2 * kk][2], s[2 * kk][3]);
            a[2] = MmaType<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            a[3] = MmaType<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int dn = 0; dn < NT_O / 2; dn++) {
                uint32_t bv[4];
                ldmatrix_x4_trans(bv, sv + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * LD +
                                          dn * 16 + (lane / 16) * 8);
                MmaType<T>::mma(o[2 * dn], a, bv[0], bv[1]);
                MmaType<T>::mma(o[2 * dn + 1], a, bv[2], bv[3]);
            }
        }
        __syncthreads(); /* stage t % NS is refilled next iteration */
    }
    cp_async_wait<0>();
    __syncthreads();

    /* The warps of one row group (WK of them, each over its key slices)
     * meet in shared memory: O [WK][ROWS][D] f32, then m and l. */
    float *so = reinterpret_cast<float *>(sKV), *sm = so + WK * ROWS * D, *sl = sm + WK * ROWS;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float sum = l[r];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const int row = wr * 16 + g + 8 * r;
        if (t4 == 0) {
            sm[wk * ROWS + row] = m[r];
            sl[wk * ROWS + row] = sum;
        }
#pragma unroll
        for (int n = 0; n < NT_O; n++) {
            so[(wk * ROWS + row) * D + n * 8 + t4 * 2] = o[n][2 * r];
            so[(wk * ROWS + row) * D + n * 8 + t4 * 2 + 1] = o[n][2 * r + 1];
        }
    }
    __syncthreads();
    for (int idx = tid; idx < ROWS * D; idx += THREADS) {
        const int row = idx / D, c = idx % D, rr = r0 + row;
        if (rr >= M || c >= p.d)
            continue;
        float mt = -INFINITY;
        for (int w = 0; w < WK; w++)
            mt = fmaxf(mt, sm[w * ROWS + row]);
        const float mu = mt == -INFINITY ? 0.f : mt;
        float lt = 0.f, ot = 0.f;
        for (int w = 0; w < WK; w++) {
            const float f = ex2(sm[w * ROWS + row] - mu);
            lt += sl[w * ROWS + row] * f;
            ot += so[(w * ROWS + row) * D + c] * f;
        }
        const float val = lt > 0.f ? ot / lt : 0.f;
        const float lse = lt > 0.f ? (mu + log2f(lt)) / FT_LOG2E : -INFINITY;
        const int i = rr / p.G, h = hk * p.G + rr % p.G;
        const int64_t stat = ((int64_t)b * p.H + h) * p.Nq + i;
        if (p.splits == 1) {
            reinterpret_cast<T *>(p.out)[(int64_t)b * p.o_bs + (int64_t)i * p.o_rs +
                                         (int64_t)h * p.o_hs + c] = T(val);
            if (c == 0)
                p.lse[stat] = lse;
        } else {
            const int64_t part = (int64_t)split * p.B * p.H * p.Nq + stat;
            p.part_o[part * p.d + c] = val;
            if (c == 0)
                p.part_lse[part] = lse;
        }
    }
}

/* The splits' results of each (b, h, i) row merged: LSE = log sum e^lse_s,
 * out = sum e^(lse_s - LSE) O_s, in split order. */
template <typename T> __global__ void decode_merge_kernel(DecodeParams p)
{
    const int64_t row = blockIdx.x; /* (b, h, i) */
    const int i = (int)(row % p.Nq), h = (int)(row / p.Nq % p.H), b = (int)(row / p.Nq / p.H);
    const int64_t plane = (int64_t)p.B * p.H * p.Nq;
    float mx = -INFINITY;
    for (int s = 0; s < p.splits; s++)
        mx = fmaxf(mx, p.part_lse[s * plane + row]);
    float sum = 0.f;
    for (int s = 0; s < p.splits; s++)
        sum += mx == -INFINITY ? 0.f : expf(p.part_lse[s * plane + row] - mx);
    const float lse = sum > 0.f ? mx + logf(sum) : -INFINITY;
    for (int c = threadIdx.x; c < p.d; c += blockDim.x) {
        float acc = 0.f;
        for (int s = 0; s < p.splits; s++) {
            const float ls = p.part_lse[s * plane + row];
            if (ls != -INFINITY)
                acc += expf(ls - lse) * p.part_o[(s * plane + row) * p.d + c];
        }
        T *out = reinterpret_cast<T *>(p.out) + (int64_t)b * p.o_bs + (int64_t)i * p.o_rs +
                 (int64_t)h * p.o_hs + c;
        *out = (T)acc;
    }
    if (threadIdx.x == 0)
        p.lse[row] = lse;
}

/* ---- launch ---- */

template <typename T, int D, int WR>
static ft_status launch_split(const DecodeParams &p, int row_blocks)
{
    constexpr int NS = D == 256 ? 3 : 4;
    using L = DecodeSmem<D, WR, NS>;
    auto kernel = decode_split_kernel<T, D, WR, NS>;
    static const char func[] = "ft_attention_forward";
    FT_CUDA_TRY(func, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)L::bytes));
    kernel<<<dim3(p.splits * row_blocks, p.Hk, p.B), DEC_WARPS * FT_WARP, L::bytes>>>(p);
    FT_CUDA_CHECK_LAUNCH(func);
    return FT_OK;
}

extern "C" ft_status ft_attention_decode_cuda(const ft_tensor *q, const ft_tensor *k,
                                              const ft_tensor *v, const int *lens,
                                              int64_t max_len, const int *table,
                                              int64_t table_stride, int64_t page_size,
                                              int causal, double scale, int splits,
                                              ft_tensor *out, ft_tensor *lse)
{
    static const char func[] = "ft_attention_forward";
    FT_TRY(ft_cuda_use_device(q->device.index, func));
    DecodeParams p;
    memset(&p, 0, sizeof p);
    p.B = (int)q->shape[0], p.Nq = (int)q->shape[1], p.H = (int)q->shape[2];
    p.Hk = (int)k->shape[2], p.d = (int)q->shape[3], p.G = p.H / p.Hk;
    if (p.B == 0 || p.Nq == 0 || p.H == 0)
        return FT_OK;
    p.q = q->data, p.q_bs = q->stride[0], p.q_rs = q->stride[1], p.q_hs = q->stride[2];
    p.k = k->data, p.k_bs = k->stride[0], p.k_rs = k->stride[1], p.k_hs = k->stride[2];
    p.v = v->data, p.v_bs = v->stride[0], p.v_rs = v->stride[1], p.v_hs = v->stride[2];
    p.out = out->data, p.o_bs = out->stride[0], p.o_rs = out->stride[1], p.o_hs = out->stride[2];
    p.lse = (float *)lse->data;
    p.lens = lens, p.table = table, p.table_stride = (int)table_stride;
    p.page_size = (int)page_size;
    p.causal = causal;
    p.scale_log2 = (float)(scale * 1.4426950408889634);
    const int M = p.Nq * p.G, WR = M <= 16 ? 1 : 4, row_blocks = (M + 16 * WR - 1) / (16 * WR);
    /* splits: enough CTAs for two waves of the SMs, each at least 256 keys */
    int sms = 132, dev = q->device.index;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    const int64_t ctas = (int64_t)p.B * p.Hk * row_blocks;
    int64_t s = splits > 0 ? splits : (2 * sms + ctas - 1) / ctas;
    const int64_t most = max_len > 0 ? (max_len + 255) / 256 : 1;
    if (splits <= 0 && s > most)
        s = most;
    if (s < 1)
        s = 1;
    const int64_t chunk = ((max_len + s - 1) / s + DEC_BC - 1) / DEC_BC * DEC_BC;
    p.splits = (int)s;
    p.chunk = (int)(chunk > 0 ? chunk : DEC_BC);
    ft_tensor *po = NULL, *pl = NULL;
    if (p.splits > 1) {
        const int64_t so[5] = {p.splits, p.B, p.H, p.Nq, p.d}, sl[4] = {p.splits, p.B, p.H, p.Nq};
        FT_TRY(ft_empty_named(&po, 5, so, FT_F32, q->device, func));
        ft_status st = ft_empty_named(&pl, 4, sl, FT_F32, q->device, func);
        if (st != FT_OK) {
            ft_tensor_free(po);
            return st;
        }
        p.part_o = (float *)po->data, p.part_lse = (float *)pl->data;
    }
    ft_status st = FT_OK;
    auto run = [&](auto type) {
        using T = typename decltype(type)::type;
        auto rows = [&](auto d) {
            constexpr int D = decltype(d)::value;
            return WR == 1 ? launch_split<T, D, 1>(p, row_blocks) : launch_split<T, D, 4>(p, row_blocks);
        };
        return p.d <= 64 ? rows(IntC<64>()) : p.d <= 128 ? rows(IntC<128>()) : rows(IntC<256>());
    };
    st = q->dtype == FT_F16 ? run(TypeOf<__half>()) : run(TypeOf<__nv_bfloat16>());
    if (st == FT_OK && p.splits > 1) {
        if (q->dtype == FT_F16)
            decode_merge_kernel<__half><<<(unsigned)((int64_t)p.B * p.H * p.Nq), 128>>>(p);
        else
            decode_merge_kernel<__nv_bfloat16><<<(unsigned)((int64_t)p.B * p.H * p.Nq), 128>>>(p);
        st = ft_cuda_check_launch(func, __FILE__, __LINE__);
    }
    ft_tensor_free(po);
    ft_tensor_free(pl);
    return st;
}
