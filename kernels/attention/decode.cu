/*
 * decode.cu - attention for decoding: a few query rows per sequence (1 to
 * 64) against a long KV cache, with the keys split across CTAs (split-KV)
 * so that the whole GPU reads the cache, and the splits' partial results
 * merged by their LSE in a fixed order (deterministic): by the last CTA of
 * each group to finish (up to DEC_FUSED_MAX splits), else by a second
 * kernel.
 *
 *   q [B, Nq, H, d]; k, v caches [B, rows, Hk, d] or page pools [pages,
 *   page_size, Hk, d] with a block table (0-based, [B, max_pages]);
 *   lens (i32 [B], device): the keys of each sequence before the append;
 *   k_new, v_new [B, Nnew, Hk, d] (or none); out [B, Nq, H, d], lse
 *   [B, H, Nq] f32.
 *
 * The append is part of the kernel: keys and values at positions
 * lens[b] .. lens[b] + Nnew - 1 are read from k_new / v_new, and the CTA of
 * row block 0 whose split holds them also writes them into the cache. So a
 * decoding step is one launch, and no row is read from the cache while
 * another CTA writes it.
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
#include <pthread.h>
#include <string.h>

struct DecodeParams {
    const void *q;
    int64_t q_bs, q_rs, q_hs; /* elements */
    const void *k, *v;
    int64_t k_bs, k_rs, k_hs, v_bs, v_rs, v_hs; /* batch (or page), row, head */
    void *kw, *vw;     /* the caches again, written by the append */
    const void *kn, *vn; /* new rows, or null */
    int64_t kn_bs, kn_rs, kn_hs, vn_bs, vn_rs, vn_hs;
    const int *lens;   /* [B] keys per sequence before the append, or null: */
    int lens_inline[FT_DECODE_INLINE]; /* B <= FT_DECODE_INLINE, not paged: here */
    const int *table;  /* [B][table_stride] pages, or null */
    int table_stride, page_size, Nnew;
    void *out;
    int64_t o_bs, o_rs, o_hs;
    float *lse;       /* [B, H, Nq] contiguous */
    float *part_o;    /* splits > 1: [S][B][H][Nq][d] */
    float *part_lse;  /* [S][B][H][Nq] */
    unsigned *tickets; /* the merge in the split kernel: a count a (b, hk, row block), zero
                        * between launches (the group's last CTA resets its own) */
    int B, Nq, H, Hk, G, d, splits, chunk, causal;
    float scale_log2;
};

#define DEC_BC 64   /* keys a tile */
#define DEC_WARPS 4
#define DEC_FUSED_MAX 128 /* splits merged in the split kernel, more by decode_merge_kernel */
#define DEC_MERGE_CHUNK 16 /* splits whose partial results a merging thread loads at once */

/* Shared memory: Q [16 WR][LD], then NS stages of K and V [DEC_BC][LD]
 * (16-bit, rows padded for ldmatrix); the epilogue reuses the stages. */
template <int D, int WR, int NS> struct DecodeSmem {
    static constexpr int LD = D + 8, ROWS = 16 * WR;
    static constexpr int K = ROWS * LD, STAGE = 2 * DEC_BC * LD;
    /* then (paged) the page and row in it of each key of two tiles */
    static constexpr size_t pages = (size_t)(K + NS * STAGE) * 2;
    /* then full[NS], empty[NS] and (with the copying warps) Q's */
    static constexpr size_t bars = pages + 2 * DEC_BC * sizeof(int2);
    static constexpr size_t bytes = bars + (2 * NS + 1) * 8;
};

/* Key j of sequence b: its batch entry (or page) and row there. */
__device__ __forceinline__ int2 cache_place(const DecodeParams &p, int b, int j)
{
    if (!p.table)
        return make_int2(b, j);
    const int pg = j / p.page_size;
    return make_int2(p.table[(int64_t)b * p.table_stride + pg], j - pg * p.page_size);
}

/* Where key and value row j of sequence b, head hk are read: at place e
 * of the cache, or (from len0, the keys before the append, on) from the
 * new rows. */
__device__ __forceinline__ void kv_rows(const DecodeParams &p, int b, int hk, int len0, int j,
                                        int2 e, const char **kr, const char **vr)
{
    if (j >= len0) {
        const int64_t r = j - len0;
        *kr = (const char *)p.kn + 2 * (b * p.kn_bs + r * p.kn_rs + hk * p.kn_hs);
        *vr = (const char *)p.vn + 2 * (b * p.vn_bs + r * p.vn_rs + hk * p.vn_hs);
        return;
    }
    *kr = (const char *)p.k + 2 * (e.x * p.k_bs + (int64_t)e.y * p.k_rs + hk * p.k_hs);
    *vr = (const char *)p.v + 2 * (e.x * p.v_bs + (int64_t)e.y * p.v_rs + hk * p.v_hs);
}

/* The cache row where new key (and value) row j goes: p.kw / p.vw plus
 * the returned element offsets. */
__device__ __forceinline__ void cache_slot(const DecodeParams &p, int b, int hk, int j,
                                           int64_t *ko, int64_t *vo)
{
    const int2 e = cache_place(p, b, j);
    *ko = e.x * p.k_bs + (int64_t)e.y * p.k_rs + hk * p.k_hs;
    *vo = e.x * p.v_bs + (int64_t)e.y * p.v_rs + hk * p.v_hs;
}

/* ---- the merge of the splits' partial results, in split order ---- */

/* Columns c, c + 1 (d % 8 == 0) of stat row `row` merged over the
 * splits in one pass, DEC_MERGE_CHUNK splits at a time: their LSEs and partial
 * rows loaded together, then folded in as the online softmax folds keys
 * (the running maximum rescaling what came before); the row's LSE into
 * *lse. Every thread of a row does the same arithmetic, so each gets the
 * same LSE. The partial results come from other CTAs: read at L2
 * (ld.global.cg). A row no split saw gives zeros and LSE -inf; a NaN stays
 * NaN. */
__device__ __forceinline__ float2 merge_row2(const DecodeParams &p, int64_t row, int c, float *lse)
{
    const int64_t plane = (int64_t)p.B * p.H * p.Nq, step = plane * p.d / 2;
    const float2 *po = reinterpret_cast<const float2 *>(p.part_o + row * p.d + c);
    float m = -INFINITY, l = 0.f;
    float2 acc = make_float2(0.f, 0.f);
    for (int s0 = 0; s0 < p.splits; s0 += DEC_MERGE_CHUNK) {
        float e[DEC_MERGE_CHUNK];
        float2 x[DEC_MERGE_CHUNK];
#pragma unroll
        for (int k = 0; k < DEC_MERGE_CHUNK; k++) {
            const bool in = s0 + k < p.splits;
            e[k] = in ? __ldcg(p.part_lse + (s0 + k) * plane + row) : -INFINITY;
            x[k] = in ? __ldcg(po + (s0 + k) * step) : make_float2(0.f, 0.f);
        }
        float mc = m;
#pragma unroll
        for (int k = 0; k < DEC_MERGE_CHUNK; k++)
            mc = max_nan(mc, e[k]);
        const float mu = mc == -INFINITY ? 0.f : mc, scale = expf(m - mu);
        l *= scale;
        acc.x *= scale;
        acc.y *= scale;
#pragma unroll
        for (int k = 0; k < DEC_MERGE_CHUNK; k++) {
            const float w = expf(e[k] - mu);
            l += w;
            acc.x = fmaf(w, x[k].x, acc.x);
            acc.y = fmaf(w, x[k].y, acc.y);
        }
        m = mc;
    }
    const float inv = l != 0.f ? 1.f / l : 0.f;
    *lse = l != 0.f ? m + logf(l) : -INFINITY;
    return make_float2(acc.x * inv, acc.y * inv);
}

/* A ticket: *t + 1 at GPU scope, acquire and release; the old value. */
__device__ __forceinline__ unsigned ticket_add(unsigned *t)
{
    unsigned old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;\n" : "=r"(old) : "l"(t) : "memory");
    return old;
}

/* Stat row (b, h, i) = ((b H + h) Nq + i): columns c, c + 1 of its output. */
template <typename T>
__device__ __forceinline__ void merge_store(const DecodeParams &p, int64_t row, int c, float2 v)
{
    const int i = (int)(row % p.Nq), h = (int)(row / p.Nq % p.H), b = (int)(row / p.Nq / p.H);
    T *out = reinterpret_cast<T *>(p.out) + (int64_t)b * p.o_bs + (int64_t)i * p.o_rs +
             (int64_t)h * p.o_hs + c;
    out[0] = T(v.x);
    out[1] = T(v.y);
}

/* The split kernel. WS: four more warps issue the K/V copies into the
 * ring and every computing thread releases each stage on an "empty"
 * mbarrier, so the copies run ahead of the products by the ring and no CTA
 * barrier stands in the loop; a copying thread arrives on a stage's "full"
 * mbarrier once its copies of that tile have landed, which it learns a
 * tile later (cp.async.wait_group 1), so two tiles stay in flight. Every
 * thread arrives for itself and no named barrier is used: that is what
 * compute-sanitizer's racecheck follows (kernels/README.md). Else every
 * thread copies and the CTA meets twice a tile. */
template <typename T, int D, int WR, int NS, bool WS>
__device__ __forceinline__ void decode_split(const DecodeParams &p)
{
    using L = DecodeSmem<D, WR, NS>;
    constexpr int LD = L::LD, ROWS = L::ROWS, WK = DEC_WARPS / WR, KW = DEC_BC / WK;
    constexpr int NT_S = KW / 8, NT_O = D / 8, THREADS = DEC_WARPS * FT_WARP;
    constexpr int ALL = (1 + WS) * THREADS; /* with the copying warps */
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T *const sQ = reinterpret_cast<T *>(smem_raw), *const sKV = sQ + L::K;
    const uint32_t full = smem_addr(smem_raw + L::bars), empty = full + 8 * NS;
    const uint32_t qbar = empty + 8 * NS;

    const int tid = threadIdx.x, lane = tid % FT_WARP, warp = tid / FT_WARP;
    const int g = lane / 4, t4 = lane % 4, wr = warp % WR, wk = warp / WR;
    const int split = blockIdx.x % p.splits, rb = blockIdx.x / p.splits;
    const int hk = blockIdx.y, b = blockIdx.z;
    const int M = p.Nq * p.G, r0 = rb * ROWS;
    const int len0 = p.lens ? p.lens[b] : p.lens_inline[b & (FT_DECODE_INLINE - 1)];
    const int len = len0 + p.Nnew;
    const int k_lo = split * p.chunk, k_hi = min(len, k_lo + p.chunk);
    /* stage st of tile t: keys k_lo + t DEC_BC ..; rows past k_hi and
     * columns past d are zeros, never read from the cache */
    const int ntiles = k_hi > k_lo ? (k_hi - k_lo + DEC_BC - 1) / DEC_BC : 0;

    /* The copies of tile t into its stage, by copier c of THREADS (the
     * computing threads, or as many copying ones): its 16-byte chunks, at
     * column (c % CPR) 8 of rows c / CPR + k RPI; paged, where(k, r) says
     * where row r (its k-th) lies, looked up a tile ahead (place): in
     * sPg[t % 2], filled by copier r for row r, without the copying warps;
     * in each copying thread's registers for its own rows with them. */
    constexpr int CPR = D / 8, RPI = THREADS / CPR, RPT = DEC_BC / RPI;
    int2 *const sPg = reinterpret_cast<int2 *>(smem_raw + L::pages);
    auto place = [&](int t, int c) {
        const int j = k_lo + t * DEC_BC + c;
        return j < min(k_hi, len0) ? cache_place(p, b, j) : make_int2(0, 0);
    };
    auto load = [&](int t, int c, auto where) {
        T *sk = sKV + (t % NS) * L::STAGE, *sv = sk + DEC_BC * LD;
        const int lc = (c % CPR) * 8;
#pragma unroll
        for (int k = 0; k < RPT; k++) {
            const int r = c / CPR + k * RPI, j = k_lo + t * DEC_BC + r;
            const bool ok = j < k_hi && lc < p.d;
            const char *kr = (const char *)p.k, *vr = (const char *)p.v;
            if (ok)
                kv_rows(p, b, hk, len0, j, p.table ? where(k, r) : make_int2(b, j), &kr, &vr);
            cp_async_16(sk + r * LD + lc, ok ? kr + 2 * lc : kr, ok);
            cp_async_16(sv + r * LD + lc, ok ? vr + 2 * lc : vr, ok);
        }
    };
    auto shared_places = [&](int t) {
        const int2 *pg = sPg + (t % 2) * DEC_BC;
        return [pg](int, int r) { return pg[r]; };
    };

    if constexpr (WS) {
        if (tid == 0) {
            for (int st = 0; st < NS; st++) {
                mbar_init(full + 8 * st, THREADS); /* each copying thread, its copies landed */
                mbar_init(empty + 8 * st, THREADS); /* each computing thread, its reads done */
            }
            mbar_init(qbar, THREADS); /* each computing thread, its copies of Q landed */
        }
        __syncthreads();
        if (warp >= DEC_WARPS) {
            /* The copying warps: a stage refilled as soon as the computing
             * warps release it; paged, the places of the next tile's rows
             * looked up while this one is issued, each thread its own (no
             * barrier among the copiers). */
            const int c = tid - THREADS;
            int2 pl[RPT];
            auto own_places = [&](int t) {
                const int j0 = k_lo + t * DEC_BC;
                if (p.page_size % DEC_BC == 0) { /* the tile lies in one page: one look-up */
                    const int pg = j0 / p.page_size;
                    const int page = j0 < len0 ? p.table[(int64_t)b * p.table_stride + pg] : 0;
#pragma unroll
                    for (int k = 0; k < RPT; k++)
                        pl[k] = make_int2(page, j0 - pg * p.page_size + c / CPR + k * RPI);
                    return;
                }
#pragma unroll
                for (int k = 0; k < RPT; k++)
                    pl[k] = place(t, c / CPR + k * RPI);
            };
            if (p.table)
                own_places(0);
            for (int t = 0; t < ntiles; t++) {
                const int st = t % NS;
                if (t >= NS)
                    mbar_wait(empty + 8 * st, ((t / NS) & 1) ^ 1);
                load(t, c, [&](int k, int) { return pl[k]; });
                cp_async_commit();
                if (t > 0) { /* tile t - 1 landed: its stage is full */
                    cp_async_wait<1>();
                    mbar_arrive(full + 8 * ((t - 1) % NS));
                }
                if (p.table && t + 1 < ntiles)
                    own_places(t + 1);
            }
            if (ntiles > 0) {
                cp_async_wait<0>();
                mbar_arrive(full + 8 * ((ntiles - 1) % NS));
            }
        }
    }

    float o[NT_O][4], m[2], l[2];
    if (!WS || warp < DEC_WARPS) {
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
        if constexpr (!WS) {
#pragma unroll
            for (int t = 0; t < NS; t++) {
                if (p.table) { /* uniform across the CTA */
                    if (tid < DEC_BC)
                        sPg[(t % 2) * DEC_BC + tid] = place(t, tid);
                    __syncthreads();
                }
                if (t < NS - 1) {
                    if (t < ntiles)
                        load(t, tid, shared_places(t));
                    cp_async_commit();
                }
            }
        }

        /* the append: this split's share of the new rows into the cache,
         * while the first tiles are on their way */
        if (p.Nnew > 0 && rb == 0) {
            const int n0 = max(k_lo, len0), n1 = k_hi;
            for (int idx = tid; idx < (n1 - n0) * (D / 8); idx += THREADS) {
                const int j = n0 + idx / (D / 8), c = idx % (D / 8) * 8;
                if (j >= n1 || c >= p.d)
                    continue;
                const char *kr, *vr;
                int64_t ko, vo;
                kv_rows(p, b, hk, len0, j, make_int2(0, 0), &kr, &vr); /* j >= len0 */
                cache_slot(p, b, hk, j, &ko, &vo);
                *reinterpret_cast<uint4 *>((char *)p.kw + 2 * (ko + c)) =
                    *reinterpret_cast<const uint4 *>(kr + 2 * c);
                *reinterpret_cast<uint4 *>((char *)p.vw + 2 * (vo + c)) =
                    *reinterpret_cast<const uint4 *>(vr + 2 * c);
            }
        }

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

        if constexpr (WS) {
            cp_async_wait<0>(); /* Q: the computing warps meet on an mbarrier */
            mbar_arrive(qbar);
            mbar_wait(qbar, 0);
        } else {
            cp_async_wait<NS - 1>(); /* Q */
            __syncthreads();
        }
        uint32_t qa[D / 16][4];
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++)
            ldmatrix_x4(qa[kk], sQ + (wr * 16 + lane % 16) * LD + kk * 16 + (lane / 16) * 8);

        for (int t = 0; t < ntiles; t++) {
            int2 next = make_int2(0, 0); /* paged: tile t + NS's places, stored below */
            if constexpr (WS) {
                mbar_wait(full + 8 * (t % NS), (t / NS) & 1);
            } else {
                if (t + NS - 1 < ntiles)
                    load(t + NS - 1, tid, shared_places(t + NS - 1));
                cp_async_commit();
                if (p.table && tid < DEC_BC)
                    next = place(t + NS, tid);
                cp_async_wait<NS - 1>(); /* tile t landed */
                __syncthreads();
            }
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
                        mx = max_nan(mx, x);
                    }
                mx = max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float m_new = max_nan(m[r], mx), m_use = m_new == -INFINITY ? 0.f : m_new;
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
                acc_to_a<T>(s[2 * kk], s[2 * kk + 1], a);
#pragma unroll
                for (int dn = 0; dn < NT_O / 2; dn++) {
                    uint32_t bv[4];
                    ldmatrix_x4_trans(bv, sv + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * LD +
                                              dn * 16 + (lane / 16) * 8);
                    MmaType<T>::mma(o[2 * dn], a, bv[0], bv[1]);
                    MmaType<T>::mma(o[2 * dn + 1], a, bv[2], bv[3]);
                }
            }
            if constexpr (WS) {
                mbar_arrive(empty + 8 * (t % NS)); /* this thread's reads of the stage are done */
            } else {
                if (p.table && tid < DEC_BC)
                    sPg[((t + NS) % 2) * DEC_BC + tid] = next;
                __syncthreads(); /* stage t % NS is refilled next iteration */
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();

    /* The warps of one row group (WK of them, each over its key slices)
     * meet in shared memory: O [WK][ROWS][D] f32, then m and l. */
    /* rows padded to D + 4 floats: a warp's float2 stores touch each bank
     * twice, the fewest for 256 bytes; rows past M are left out */
    constexpr int SLD = D + 4;
    static_assert((WK * ROWS * (SLD + 2)) * 4 <= NS * L::STAGE * 2, "the meeting fits the stages");
    const int R = min(ROWS, M - r0);
    float *so = reinterpret_cast<float *>(sKV), *sm = so + WK * ROWS * SLD, *sl = sm + WK * ROWS;
#pragma unroll
    for (int r = 0; r < 2 && (!WS || warp < DEC_WARPS); r++) {
        float sum = l[r];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const int row = wr * 16 + g + 8 * r;
        if (row >= R)
            continue;
        if (t4 == 0) {
            sm[wk * ROWS + row] = m[r];
            sl[wk * ROWS + row] = sum;
        }
#pragma unroll
        for (int n = 0; n < NT_O; n++)
            *reinterpret_cast<float2 *>(so + (wk * ROWS + row) * SLD + n * 8 + t4 * 2) =
                make_float2(o[n][2 * r], o[n][2 * r + 1]);
    }
    __syncthreads();
    for (int idx = tid; idx < R * p.d; idx += ALL) {
        const int row = idx / p.d, c = idx % p.d, rr = r0 + row;
        float mt = -INFINITY;
        for (int w = 0; w < WK; w++)
            mt = max_nan(mt, sm[w * ROWS + row]);
        const float mu = mt == -INFINITY ? 0.f : mt;
        float lt = 0.f, ot = 0.f;
        for (int w = 0; w < WK; w++) {
            const float f = ex2(sm[w * ROWS + row] - mu);
            lt += sl[w * ROWS + row] * f;
            ot += so[(w * ROWS + row) * SLD + c] * f;
        }
        const float val = lt != 0.f ? ot / lt : 0.f; /* NaN stays NaN */
        const float lse = lt != 0.f ? (mu + log2f(lt)) / FT_LOG2E : -INFINITY;
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
    if (p.splits == 1 || !p.tickets)
        return;
    /* The group's last CTA to finish merges its rows (the partial results
     * made visible before the ticket is taken: the CTA's barrier, then one
     * thread's acquire-release add at GPU scope, which releases what the
     * barrier ordered before it and acquires the other CTAs' results for
     * what the barrier orders after), so one launch does the whole step. */
    __shared__ int s_last;
    __syncthreads();
    const int64_t grp = ((int64_t)b * p.Hk + hk) * (gridDim.x / p.splits) + rb;
    if (tid == 0)
        s_last = ticket_add(p.tickets + grp) == (unsigned)p.splits - 1;
    __syncthreads();
    if (!s_last)
        return;
    for (int idx = tid; idx < R * (p.d / 2); idx += ALL) {
        const int r = idx / (p.d / 2), c = idx % (p.d / 2) * 2, rr = r0 + r;
        const int64_t stat = ((int64_t)b * p.H + hk * p.G + rr % p.G) * p.Nq + rr / p.G;
        float lse;
        merge_store<T>(p, stat, c, merge_row2(p, stat, c, &lse));
        if (c == 0)
            p.lse[stat] = lse;
    }
    if (tid == 0)
        p.tickets[grp] = 0;
}

/* The copying warps' form is launched on sm_90 and later only
 * (decode_dispatch): for older devices it is not compiled, a quarter
 * less of this file's build. */
template <typename T, int D, int WR, int NS, bool WS>
__global__ void __launch_bounds__((1 + WS) * DEC_WARPS * FT_WARP, WS && WR == 1 && D <= 128 ? 2 : 1)
decode_split_kernel(DecodeParams p)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    if constexpr (WS)
        __trap();
    else
#endif
        decode_split<T, D, WR, NS, WS>(p);
}

/* The merge as a kernel of its own, for more splits than the split kernel
 * merges (DEC_FUSED_MAX): a CTA a (b, h, i) row. On sm_90 it is launched
 * before the split kernel ends (programmatic dependent launch) and waits
 * for its results here. */
#define DEC_MERGE_MAX 4096
template <typename T> __global__ void __launch_bounds__(128) decode_merge_kernel(DecodeParams p)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
    const int64_t row = blockIdx.x; /* (b, h, i) */
    for (int c = threadIdx.x * 2; c < p.d; c += blockDim.x * 2) {
        float lse;
        merge_store<T>(p, row, c, merge_row2(p, row, c, &lse));
        if (c == 0)
            p.lse[row] = lse;
    }
}

/* ---- launch ---- */

/* Stages of the K/V ring: as many as let two CTAs share an SM at head dims
 * up to 128 with 16 rows (d 64: 6 x 18 KB, d 128: 3 x 35 KB); at 256, three
 * (one CTA), two with 64 rows (Q's 33 KB more would pass the 227 KB a CTA
 * may have). Measured at d 128 (H200, bench --decode, the kernel without
 * the copying warps): one CTA of 6 stages an SM read the cache at 0.53-0.65
 * of the copy rate, three CTAs of 2 stages at 0.63-0.93, two of 3 stages at
 * 0.67-0.97: the CTAs that wait on their tiles in turn matter more than the
 * bytes in flight. */
template <int D, int WR> struct DecodeStages {
    static constexpr int value = D == 64 ? 6 : D == 128 || WR == 1 ? 3 : 2;
};

/* The kernel for a head dim and row grouping, with the copying warps (WS)
 * or without, its shared-memory limit raised once per device. */
template <typename T, int D, int WR, bool WS> struct DecodeKernel {
    static constexpr int NS = DecodeStages<D, WR>::value, THREADS = (1 + WS) * DEC_WARPS * FT_WARP;
    static constexpr bool COPIERS = WS;
    using L = DecodeSmem<D, WR, NS>;
    static_assert(L::bytes <= 227 * 1024, "a CTA's shared memory");
    static ft_status get(void (**k)(DecodeParams), const char *func)
    {
        static unsigned long long ready = 0; /* a bit per device */
        int dev = 0;
        *k = decode_split_kernel<T, D, WR, NS, WS>;
        cudaGetDevice(&dev);
        const unsigned long long bit = dev < 64 ? 1ull << dev : 0;
        if (!(ready & bit)) {
            FT_CUDA_TRY(func, cudaFuncSetAttribute(*k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   (int)L::bytes));
            ready |= bit;
        }
        return FT_OK;
    }
    /* CTAs an SM holds, asked once per device (the query costs microseconds
     * of host time, comparable to a short decoding step). */
    static int per_sm(const char *func)
    {
        static int cached[64];
        int dev = 0;
        cudaGetDevice(&dev);
        if (dev >= 0 && dev < 64 && cached[dev] > 0)
            return cached[dev];
        void (*k)(DecodeParams);
        int n = 1;
        if (get(&k, func) != FT_OK ||
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k, THREADS, L::bytes) !=
                cudaSuccess || n < 1)
            n = 1;
        cudaGetLastError();
        if (dev >= 0 && dev < 64)
            cached[dev] = n;
        return n;
    }
};

/* A CTA's rows: one 16-row fragment for up to 16 rows a kv head (WR = 1),
 * else blocks of 4 x 16 (WR = 4); how many such blocks M rows take. */
static int decode_row_blocks(int M)
{
    return M <= 16 ? 1 : (M + 63) / 64;
}

/* Whether the device is sm_90 or later, asked once per device: there the
 * copying warps are the default (measured there; before sm_90 their waits
 * are polls, not the suspending try_wait) and the merge kernel is a
 * programmatic dependent launch. */
static bool decode_sm90(int dev)
{
    static int known[64]; /* 0 unknown, 1 yes, 2 no */
    if (dev < 0 || dev >= 64)
        return false;
    if (!known[dev]) {
        int major = 0;
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
        known[dev] = major >= 9 ? 1 : 2;
    }
    return known[dev] == 1;
}

/* Calls fn(K()) with K the DecodeKernel of the call's dtype, padded head
 * dim, row grouping (WR as decode_row_blocks counts) and copying warps (WS:
 * on sm_90 and later, unless FT_NO_DECODE_WS is on). */
template <typename F> static ft_status decode_dispatch(int dev, int dtype, int d, int M, F fn)
{
    const bool ws = ft_switch("FT_NO_DECODE_WS") != 1 && decode_sm90(dev);
    auto rows = [&](auto type, auto dd) {
        using T = typename decltype(type)::type;
        constexpr int D = decltype(dd)::value;
        if (M <= 16)
            return ws ? fn(DecodeKernel<T, D, 1, true>()) : fn(DecodeKernel<T, D, 1, false>());
        return ws ? fn(DecodeKernel<T, D, 4, true>()) : fn(DecodeKernel<T, D, 4, false>());
    };
    auto dims = [&](auto type) {
        return d <= 64 ? rows(type, IntC<64>()) : d <= 128 ? rows(type, IntC<128>())
                                                           : rows(type, IntC<256>());
    };
    return dtype == FT_F16 ? dims(TypeOf<__half>()) : dims(TypeOf<__nv_bfloat16>());
}

/* Keys a split: ceil(max_len / splits) rounded up to whole tiles. */
static int64_t decode_chunk(int64_t max_len, int64_t splits)
{
    const int64_t c = ((max_len + splits - 1) / splits + DEC_BC - 1) / DEC_BC * DEC_BC;
    return c > 0 ? c : DEC_BC;
}

extern "C" int ft_attention_decode_splits_cuda(const ft_tensor *q, int64_t Hk, int64_t max_len,
                                               int requested)
{
    if (requested > 0) { /* at most a split a tile (more would be empty) */
        int64_t s = requested < DEC_MERGE_MAX ? requested : DEC_MERGE_MAX;
        const int64_t tiles = (max_len + DEC_BC - 1) / DEC_BC;
        s = s < tiles ? s : tiles;
        return (int)(s > 0 ? s : 1);
    }
    const int B = (int)q->shape[0], G = (int)(q->shape[2] / Hk), d = (int)q->shape[3];
    const int M = (int)q->shape[1] * G, row_blocks = decode_row_blocks(M);
    /* CTAs that run at once: SMs x CTAs an SM holds */
    const int sms = flash_sm_count(q->device.index);
    int per_sm = 1;
    bool ws = false;
    decode_dispatch(q->device.index, q->dtype, d, M, [&](auto kernel) {
        per_sm = decltype(kernel)::per_sm("ft_attention_forward");
        ws = decltype(kernel)::COPIERS;
        return FT_OK;
    });
    const int64_t ctas = (int64_t)B * Hk * row_blocks;
    /* With the copying warps, one CTA an SM streams as fast as two, so
     * where the CTAs of one split leave SMs idle the plan is one wave of
     * one CTA an SM: fewer, longer splits, so less ring fill and merge. */
    if (ws && ctas < sms)
        per_sm = 1;
    const int64_t slots = (int64_t)sms * (per_sm > 0 ? per_sm : 1);
    /* splits of at least 512 keys (the ring's fill and the merge are paid
     * per split); among those, the count whose CTAs fill the last wave best
     * (the fewest splits on a tie), in one wave where planned above */
    const int64_t most = max_len > 512 ? max_len / 512 : 1;
    int64_t best = 1;
    double best_fill = -1;
    for (int64_t s = 1; s <= most && s <= 128; s++) {
        const int64_t used = (max_len + decode_chunk(max_len, s) - 1) / decode_chunk(max_len, s);
        if (ws && ctas < sms && s > 1 && ctas * used > slots)
            break;
        const double waves = (double)(ctas * used) / (double)slots;
        const double fill = waves >= 1 ? waves / ceil(waves) : waves;
        if (fill > best_fill + 1e-9) {
            best_fill = fill;
            best = s;
        }
    }
    return (int)best;
}

/* Each device's tickets for the merge in the split kernel: zeroed once,
 * grown when a call needs more (cudaFree waits for the device, so no
 * launch still counts on the old ones), kept until the process ends. */
static ft_status decode_tickets(int dev, size_t n, unsigned **out, const char *func)
{
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    static unsigned *buf[64];
    static size_t cap[64];
    if (dev < 0 || dev >= 64) {
        *out = NULL; /* the merge kernel does it */
        return FT_OK;
    }
    ft_status st = FT_OK;
    pthread_mutex_lock(&lock);
    if (cap[dev] < n) {
        const size_t want = n > 4096 ? n : 4096;
        unsigned *nb = NULL;
        if (buf[dev])
            cudaFree(buf[dev]);
        buf[dev] = NULL, cap[dev] = 0;
        cudaError_t e = cudaMalloc((void **)&nb, want * sizeof *nb);
        if (e == cudaSuccess)
            e = cudaMemset(nb, 0, want * sizeof *nb);
        if (e != cudaSuccess) {
            cudaGetLastError();
            if (nb)
                cudaFree(nb);
            st = ft_fail(e == cudaErrorMemoryAllocation ? FT_ERR_NOMEM : FT_ERR_DEVICE, func, 0,
                         "CUDA device %d: the decoding's merge counters: %s", dev,
                         cudaGetErrorString(e));
        } else {
            buf[dev] = nb, cap[dev] = want;
        }
    }
    *out = buf[dev];
    pthread_mutex_unlock(&lock);
    return st;
}

extern "C" ft_status ft_attention_decode_cuda(const ft_decode_cuda *a)
{
    static const char func[] = "ft_attention_forward";
    const ft_tensor *q = a->q, *k = a->k, *v = a->v;
    FT_TRY(ft_cuda_use_device(q->device.index, func));
    DecodeParams p;
    memset(&p, 0, sizeof p);
    p.B = (int)q->shape[0], p.Nq = (int)q->shape[1], p.H = (int)q->shape[2];
    p.Hk = (int)k->shape[2], p.d = (int)q->shape[3], p.G = p.H / p.Hk;
    if (p.B == 0 || p.Nq == 0 || p.H == 0)
        return FT_OK;
    p.q = q->data, p.q_bs = q->stride[0], p.q_rs = q->stride[1], p.q_hs = q->stride[2];
    p.k = p.kw = k->data, p.k_bs = k->stride[0], p.k_rs = k->stride[1], p.k_hs = k->stride[2];
    p.v = p.vw = v->data, p.v_bs = v->stride[0], p.v_rs = v->stride[1], p.v_hs = v->stride[2];
    if (a->k_new) {
        const ft_tensor *kn = a->k_new, *vn = a->v_new;
        p.kn = kn->data, p.kn_bs = kn->stride[0], p.kn_rs = kn->stride[1], p.kn_hs = kn->stride[2];
        p.vn = vn->data, p.vn_bs = vn->stride[0], p.vn_rs = vn->stride[1], p.vn_hs = vn->stride[2];
        p.Nnew = (int)kn->shape[1];
    }
    p.out = a->out->data, p.o_bs = a->out->stride[0], p.o_rs = a->out->stride[1];
    p.o_hs = a->out->stride[2];
    p.lse = (float *)a->lse->data;
    p.lens = a->lens, p.table = a->table, p.table_stride = (int)a->max_pages;
    for (int b = 0; !a->lens && b < p.B && b < FT_DECODE_INLINE; b++)
        p.lens_inline[b] = (int)a->lens_host[b];
    p.page_size = (int)a->page_size;
    p.causal = a->causal;
    p.scale_log2 = (float)(a->scale * 1.4426950408889634);
    p.splits = a->splits;
    p.chunk = (int)decode_chunk(a->max_len, a->splits);
    p.part_o = a->part_o, p.part_lse = a->part_lse;
    const int M = p.Nq * p.G;
    const int64_t row_blocks = decode_row_blocks(M);
    if (p.splits > 1 && p.splits <= DEC_FUSED_MAX)
        FT_TRY(decode_tickets(q->device.index, (size_t)(p.B * p.Hk * row_blocks), &p.tickets, func));
    ft_status st = decode_dispatch(q->device.index, q->dtype, p.d, M, [&](auto kernel) {
        using K = decltype(kernel);
        void (*kern)(DecodeParams);
        FT_TRY(K::get(&kern, func));
        kern<<<dim3((unsigned)(p.splits * row_blocks), p.Hk, p.B), K::THREADS, K::L::bytes>>>(p);
        return ft_cuda_check_launch(func, __FILE__, __LINE__);
    });
    if (st == FT_OK && p.splits > 1 && !p.tickets) {
        /* sm_90: launched while the split kernel runs, waiting in the kernel */
        cudaLaunchConfig_t cfg;
        memset(&cfg, 0, sizeof cfg);
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.gridDim = dim3((unsigned)((int64_t)p.B * p.H * p.Nq));
        cfg.blockDim = dim3(128);
        cfg.attrs = attr;
        cfg.numAttrs = decode_sm90(q->device.index) ? 1 : 0;
        if (q->dtype == FT_F16)
            FT_CUDA_TRY(func, cudaLaunchKernelEx(&cfg, decode_merge_kernel<__half>, p));
        else
            FT_CUDA_TRY(func, cudaLaunchKernelEx(&cfg, decode_merge_kernel<__nv_bfloat16>, p));
        st = ft_cuda_check_launch(func, __FILE__, __LINE__);
    }
    return st;
}
