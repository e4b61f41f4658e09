/*
 * flash_fwd_fp8.cu - the flash forward on fp8_e4m3 tensor cores (wgmma
 * e4m3, k = 32 a product, sm_90a): q, k and v fp8_e4m3 [B, N, H, 128] with
 * FlashAttention-3's per-tensor descale factors, out bf16, LSE f32; plain
 * or causal (bottom-right), GQA/MQA, any lengths.
 *
 * fp8 wgmma reads B K-major only. S = Q K^T has K's rows (d contiguous) as
 * its B, K-major already; O += P V has V as B with the keys as K, so V is
 * first written transposed, [B][Hk][128][keys rounded up to 128] (fp8_v_t
 * below, one pass over V), and with the keys of each group of 32 put in the
 * order in which a thread's S accumulators become its k32 A fragments: a
 * thread holds S's columns 2t, 2t+1, 8+2t, 9+2t (and 16 more) of a 32-key
 * group, the A fragment wants columns 4t .. 4t+3 (and 16 more), so P's
 * values go into the A registers as they are and V's keys are permuted to
 * match (fp8_perm): no shuffles.
 *
 * The kernel is FlashAttention-3's structure: a producer warpgroup (one
 * thread issuing bulk tensor copies of Q once, then K and V^T blocks of
 * 224 keys into a ring of 3 stages (F8Fwd), each with a full and an empty
 * mbarrier) and two consumer warpgroups of 64 query rows each, taking
 * turns issuing their products; S_j is issued before P_{j-1} V_{j-1} and
 * its softmax runs while the latter is on the tensor cores; P is rounded
 * to e4m3 in registers. Up to F8_PERSIST_KEYS keys the grid is
 * persistent (one CTA an SM walking the tiles, the next tile's copies
 * under this one's end). The row sums are the f32
 * probabilities' (as FlashAttention-3's), the output is O times
 * descale_v / sum, rounded to bf16 once.
 *
 * Built when the CUDA architectures include 90a; lib/attention.c takes it
 * for fp8 calls that ft_attention_fp8_cuda_takes accepts (else it runs the
 * bf16 kernels on the converted inputs). Check: spec/fp8_spec.lua (tag gpu)
 * against the f64 reference and the bf16 route; kernels/README.md.
 */
#include "flash_wgmma.cuh"

#include <math.h>
#include <string.h>

#define F8_D 128      /* the head dim */
#define F8_BR 128     /* query rows a CTA: two consumer warpgroups of 64 */
#define F8_VB 128     /* keys a block of the transposing pass, and npad's unit */
#define F8_SLAB (128 * F8_D) /* bytes of 128 rows of 128 bytes: Q, or 128 keys of V^T */
/* The persistent grid up to this many keys (H100, against a CTA a tile in
 * one process: 1.08x / 1.02x at 1024 / 4096 keys, causal 1.12x / 1.16x;
 * at 16384, 0.95x, causal 0.68x: a static walk over tiles of 128 lengths
 * a head balances worse than the hardware's scheduler) */
#define F8_PERSIST_KEYS 4096

struct F8Params {
    int B, H, Hk, Nq, Nk, causal;
    int lengths_first; /* tiles in order of their lengths across heads */
    float scale_log2; /* softmax scale times descale_q descale_k, times log2 e */
    float descale_v;
    __nv_bfloat16 *out;
    int64_t o_bs, o_rs, o_hs; /* elements */
    float *lse;               /* [B, H, Nq] contiguous */
};
struct F8Maps {
    FlashTmaMap q, k, vt;
};

/* A kernel's shape: BC keys a block (a multiple of 32: P V's k), STAGES
 * K and V^T blocks in flight. Shared memory: up to 1023 bytes to reach
 * 1024-byte alignment, Q, then the stages (K: BC rows of 128 bytes; V^T:
 * 128 rows of the block's keys in slabs of 128 keys, the copy engine's
 * widest 128-byte swizzled box, the last slab's keys past BC unused), then
 * full[STAGES], empty[STAGES], Q's full and Q's empty mbarrier. */
template <int BC_, int STAGES_> struct F8Shape {
    static constexpr int BC = BC_, STAGES = STAGES_, NT = BC / 8, KK = BC / 32;
    static constexpr int SLABS = (BC + 127) / 128;
    static constexpr size_t K_BYTES = (size_t)BC * F8_D, V_BYTES = (size_t)SLABS * F8_SLAB;
    static constexpr size_t STAGE = K_BYTES + V_BYTES;
    static constexpr size_t Q = 0, KV = F8_SLAB, BARS = KV + STAGES * STAGE;
    static constexpr size_t bytes = 1024 + BARS + (2 * STAGES + 2) * 8;
    static_assert(BC % 32 == 0 && BC <= 256, "P V's k is 32, S's n at most 256");
};
/* 224-key blocks, 3 stages (H100, against 128-key blocks in one process:
 * 1.07x at 4096 and 16384 keys, causal 0.99x and 1.07x; 192 keys:
 * 0.98x-1.04x; 224 keys in 2 stages: 0.72x-0.78x). The per-block work
 * that does not grow with the keys (O's rescale, the rows' shuffles and
 * factors, the barriers) is spread over more scores; S takes 112
 * registers a thread, no spills. */
using F8Fwd = F8Shape<224, 3>;
template <bool B> struct F8Bool {
    static constexpr bool value = B;
};

/* Key position (0..31) that k32 fragment column c holds: column 4t + e
 * (e < 4) of each half of 16 is S's column 2t + e for e < 2, 8 + 2t + e - 2
 * otherwise. */
__host__ __device__ __forceinline__ int fp8_perm(int c)
{
    const int h = c & 16, t = (c & 15) >> 2, e = c & 3;
    return h + (e < 2 ? 2 * t + e : 8 + 2 * t + e - 2);
}

/* V^T: vt[b][hk][c][j'] = v[b][j][hk][c], j' = the block's first key plus
 * 32 (j % 128 / 32) + fp8_perm^-1 (j % 32); keys past Nk are zeros. One
 * CTA a block of 128 keys of one head, through shared memory. */
__global__ void __launch_bounds__(256) fp8_v_t(const unsigned char *v, int64_t v_bs,
                                               int64_t v_rs, int64_t v_hs, int Nk, int npad,
                                               unsigned char *vt)
{
    __shared__ unsigned char tile[F8_VB][F8_D + 4];
    const int jb = blockIdx.x, hk = blockIdx.y, b = blockIdx.z, Hk = gridDim.y;
    for (int idx = threadIdx.x; idx < F8_VB * (F8_D / 4); idx += blockDim.x) {
        const int r = idx / (F8_D / 4), c = idx % (F8_D / 4) * 4, j = jb * F8_VB + r;
        uint32_t x = 0;
        if (j < Nk)
            x = *reinterpret_cast<const uint32_t *>(v + b * v_bs + (int64_t)j * v_rs + hk * v_hs + c);
        *reinterpret_cast<uint32_t *>(&tile[r][c]) = x;
    }
    __syncthreads();
    unsigned char *out = vt + (((int64_t)b * Hk + hk) * F8_D) * npad + (int64_t)jb * F8_VB;
    for (int idx = threadIdx.x; idx < F8_D * (F8_VB / 4); idx += blockDim.x) {
        const int c = idx / (F8_VB / 4), q = idx % (F8_VB / 4) * 4;
        uint32_t x = 0;
#pragma unroll
        for (int e = 0; e < 4; e++)
            x |= (uint32_t)tile[(q + e) / 32 * 32 + fp8_perm((q + e) % 32)][c] << (8 * e);
        *reinterpret_cast<uint32_t *>(out + (int64_t)c * npad + q) = x;
    }
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define F8_REG112 \
    "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22," \
    "%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43," \
    "%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64," \
    "%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85," \
    "%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104," \
    "%105,%106,%107,%108,%109,%110,%111}"
#define F8_ACC112(d) FT_ACC96(d), FT_ACC8(d, 96), FT_ACC8(d, 104)

/* S (64 x N per warpgroup, f32) (+)= A B^T, m64nNk32 e4m3, A and B K-major
 * in shared memory, N keys a block (F8Shape's BC: 224; 128 and 192 were
 * measured too, with FT_REG64 and FT_REG96 in the same form). */
template <int N> struct F8S;
#define F8_S_MMA(N, REGS, ACC, OPS)                                                          \
    template <> struct F8S<N> {                                                              \
        static __device__ __forceinline__ void ss(float *d, uint64_t da, uint64_t db,        \
                                                  int accumulate)                            \
        {                                                                                    \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " OPS                              \
                         : ACC                                                               \
                         : "l"(da), "l"(db), "r"(accumulate));                               \
        }                                                                                    \
    };
F8_S_MMA(224, F8_REG112, F8_ACC112(d),
         "%114, 0;\nwgmma.mma_async.sync.aligned.m64n224k32.f32.e4m3.e4m3 " F8_REG112
         ", %112, %113, p, 1, 1;\n}\n")
#undef F8_S_MMA
/* O (64 x 128 per warpgroup) += P V, m64n128k32 e4m3: P from registers,
 * V^T K-major in shared memory. */
__device__ __forceinline__ void wgmma_fp8_rs(float *d, const uint32_t *a, uint64_t db)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " FT_REG64
                 ", {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
                 : FT_ACC64(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
/* Four f32 as e4m3 bytes, a the lowest (round to nearest, saturating). */
__device__ __forceinline__ uint32_t pack_e4m3(float a, float b, float c, float d)
{
    uint16_t lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
    return (uint32_t)lo | ((uint32_t)hi << 16);
}
#endif

/* one thread of each consumer warpgroup (ct: the thread's index among
 * the consumers) arrives on the mbarrier at bar */
__device__ __forceinline__ void consumer_arrive(uint32_t bar, int ct)
{
    if (ct % WG_THREADS == 0)
        mbar_arrive(bar);
}

template <typename Sh, bool PERSIST>
__global__ void __launch_bounds__(3 * WG_THREADS, 1)
    flash_fwd_fp8_kernel(const F8Params p, const __grid_constant__ F8Maps maps)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int BC = Sh::BC, STAGES = Sh::STAGES, NT = Sh::NT;
    constexpr uint32_t STAGE = (uint32_t)Sh::STAGE, K_BYTES = (uint32_t)Sh::K_BYTES;
    extern __shared__ unsigned char smem_raw[];
    unsigned char *sm = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    const uint32_t s_q = smem_addr(sm + Sh::Q), s_kv = smem_addr(sm + Sh::KV);
    const uint32_t full = smem_addr(sm + Sh::BARS), empty = full + 8 * STAGES;
    const uint32_t qbar = empty + 8 * STAGES, qempty = qbar + 8;
    const int tid = threadIdx.x, wg = warpgroup_of<true>(tid);
    const int nqb = (p.Nq + F8_BR - 1) / F8_BR, shift = p.Nk - p.Nq;
    /* The tiles and a persistent grid's walk over them: TileWalk (a grid
     * of every tile is its one round). The K/V ring's blocks and Q's
     * phases are counted across a CTA's tiles; Q has an empty barrier
     * too, handed back once a tile's last S product is done, so the
     * producer copies the next tile's Q and first blocks while the
     * consumers finish this tile. lengths_first (causal, FT_PERSIST): a
     * walk in head order leaves the busiest CTA far above the mean (a
     * model of these rounds, 132 CTAs, causal: 1.53x the mean work at
     * 16384 keys, 1.04x at 4096; in order of length 1.004x and 1.006x). */
    const TileWalk walk(nqb, p.H, p.B, p.lengths_first);
    const int ntiles = walk.ntiles, rounds = PERSIST ? walk.rounds() : 1;
    auto tile_of = [&](int r) { return walk.tile(r); };
    struct Tile {
        int i0, h, b, nkb;
    };
    auto tile_at = [&](int t) {
        Tile x;
        const int bh = walk.head_batch(t), qb = walk.block(t);
        x.i0 = (p.causal ? nqb - 1 - qb : qb) * F8_BR;
        x.h = bh % p.H;
        x.b = bh / p.H;
        /* key blocks: all, or causal up to the last row's diagonal */
        const int last_row = min(x.i0 + F8_BR, p.Nq) - 1;
        x.nkb = (p.Nk + BC - 1) / BC;
        if (p.causal)
            x.nkb = last_row + shift < 0 ? 0 : min(x.nkb, (last_row + shift) / BC + 1);
        return x;
    };

    if (tid == 0) {
        for (int st = 0; st < STAGES; st++) {
            mbar_init(full + 8 * st, 1);  /* the producer's arrival, with the bytes */
            mbar_init(empty + 8 * st, 2); /* one thread of each consumer */
        }
        mbar_init(qbar, 1);
        mbar_init(qempty, 2);
        mbar_init_fence();
    }
    __syncthreads();

    if (wg == 0) { /* the producer */
        regs_dec<24>();
        if (tid == 0) {
            int n = 0; /* K/V blocks so far */
            for (int rr = 0; rr < rounds; rr++) {
                const int t = tile_of(rr);
                if (t >= ntiles)
                    continue;
                const Tile x = tile_at(t);
                const int hk = x.h / (p.H / p.Hk);
                if (rr > 0)
                    mbar_wait(qempty, (rr - 1) & 1);
                if (x.nkb == 0) { /* Q's phase goes round without a copy */
                    mbar_arrive(qbar);
                    continue;
                }
                mbar_expect(qbar, F8_SLAB);
                tma_load_4d(s_q, &maps.q, qbar, 0, x.h, x.i0, x.b);
                for (int j = 0; j < x.nkb; j++, n++) {
                    const int st = n % STAGES;
                    if (n >= STAGES)
                        mbar_wait(empty + 8 * st, ((n / STAGES) & 1) ^ 1);
                    const uint32_t sk = s_kv + st * STAGE;
                    mbar_expect(full + 8 * st, STAGE);
                    tma_load_4d(sk, &maps.k, full + 8 * st, 0, hk, j * BC, x.b);
#pragma unroll
                    for (int sl = 0; sl < Sh::SLABS; sl++) /* past npad: zeros */
                        tma_load_4d(sk + K_BYTES + sl * F8_SLAB, &maps.vt, full + 8 * st,
                                    j * BC + 128 * sl, 0, hk, x.b);
                }
            }
        }
        return;
    }
    regs_inc<240>();
    const int ct = tid - WG_THREADS, w = wg - 1; /* consumer 0 or 1 */
    const Turns<true> turns(w);
    float o[64], s[BC / 2], m[2], l[2];
    /* Every round before the last has a tile, and every tile one phase
     * of Q's barriers and at least one turn (a tile without keys an empty
     * one), so that what the loop carries is the round and the ring's
     * count; warpgroup 1 skips its last pass in the last round with a
     * tile. */
    const int last_round = tile_of(rounds - 1) < ntiles ? rounds - 1 : rounds - 2;
    int n0 = 0; /* as the producer's n */
    for (int rr = 0; rr < rounds; rr++) {
        const int t = tile_of(rr);
        if (t >= ntiles)
            continue;
        const Tile x = tile_at(t);
        /* the thread's places worked out again each tile from a copy of
         * its index the compiler cannot see through: hoisted out of the
         * walk, what only a tile's first block and its end use stayed live
         * through the key loop (184 bytes of spills, none this way) */
        int ctv = ct;
        asm volatile("" : "+r"(ctv));
        const int lane = ctv % FT_WARP, warp = ctv % WG_THREADS / FT_WARP, g = lane / 4, t4 = lane % 4;
        const uint32_t qa = desc_lo(s_q + w * 64 * 128, 16);
        const int i0 = x.i0, h = x.h, b = x.b, nkb = x.nkb;
        const int row0 = i0 + 64 * w + 16 * warp + g; /* this thread's rows: row0, row0 + 8 */
        m[0] = m[1] = -INFINITY;
        l[0] = l[1] = 0.f;
#pragma unroll
        for (int i = 0; i < 64; i++)
            o[i] = 0.f;
        mbar_wait(qbar, rr & 1);
        if (nkb == 0) {
            consumer_arrive(qempty, ct); /* Q goes back */
            turns.wait();
            turns.pass(rr == last_round);
        }

        /* S_j issued in a group of its own, then P_{j-1} V_{j-1}; once S_j is
         * done (wait_group 1) its softmax runs while P V is still on the tensor
         * cores; after P V, the stage goes back, O is rescaled and P_j packed
         * into the A fragments. The two consumers take turns issuing their
         * products (Turns), so one's softmax runs under the other's. */
        uint32_t pf[Sh::KK][4];
        float alpha[2];
        auto issue_s = [&](int j) {
            const int n = n0 + j, st = n % STAGES;
            mbar_wait(full + 8 * st, (n / STAGES) & 1);
            const uint32_t kb = desc_lo(s_kv + st * STAGE, 16);
#pragma unroll
            for (int ks = 0; ks < F8_D / 32; ks++)
                F8S<BC>::ss(s, make_desc(qa + 2 * ks, FT_DESC_HI(1024)),
                             make_desc(kb + 2 * ks, FT_DESC_HI(1024)), ks > 0);
            wgmma_commit();
        };
        auto issue_pv = [&](int j) {
            const uint32_t vb = desc_lo(s_kv + (n0 + j) % STAGES * STAGE + K_BYTES, 16);
#pragma unroll
            for (int kk = 0; kk < Sh::KK; kk++) /* 128 keys a slab, 32 bytes a k step */
                wgmma_fp8_rs(o, pf[kk], make_desc(vb + (kk / 4) * (F8_SLAB >> 4) + 2 * (kk % 4),
                                                  FT_DESC_HI(1024)));
            wgmma_commit();
        };
        /* the softmax of S_j: masks at the edges, the running maximum (log2
         * units: the raw maximum times c), P = 2^(s c - m) by one FFMA and an
         * ex2 a score, the row sums; O's factors into alpha */
        const float c = p.scale_log2; /* positive */
        auto softmax_in = [&](int j, auto edge_) {
            constexpr bool EDGE = decltype(edge_)::value;
            pin_all<BC / 2>(s);
            const int j0 = j * BC;
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const int lim = p.causal ? min(p.Nk, row0 + 8 * r + shift + 1) : p.Nk;
                float mx4[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY}; /* four chains */
#pragma unroll
                for (int i = 0; i < NT; i++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        float &x = s[4 * i + 2 * r + e];
                        if (EDGE && j0 + 8 * i + 2 * t4 + e >= lim)
                            x = -INFINITY;
                        mx4[(2 * i + e) % 4] = max_nan(mx4[(2 * i + e) % 4], x);
                    }
                float mx = max_nan(max_nan(mx4[0], mx4[1]), max_nan(mx4[2], mx4[3]));
                mx = max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float mn = max_nan(m[r], mx * c), mu = mn == -INFINITY ? 0.f : mn;
                alpha[r] = ex2(m[r] - mu);
                float sum4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int i = 0; i < NT; i++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        float &x = s[4 * i + 2 * r + e];
                        x = ex2(fmaf(x, c, -mu));
                        sum4[(2 * i + e) % 4] += x;
                    }
                l[r] = l[r] * alpha[r] + ((sum4[0] + sum4[1]) + (sum4[2] + sum4[3]));
                m[r] = mn;
            }
        };
        /* two copies: with a runtime test around each score's mask, ptxas
         * predicated it into every block (an add, a compare and a select a
         * score: 945-1003 instructions a thread for a block of 112 scores,
         * 722 without); the blocks past the keys' end or the diagonal take the
         * masking copy (H100, in one process: 1.09x / 1.19x at 4096 / 16384
         * keys, causal 1.08x / 1.18x) */
        auto softmax = [&](int j) {
            const int j0 = j * BC;
            if (j0 + BC > p.Nk || (p.causal && j0 + BC - 1 > i0 + 64 * w + shift))
                softmax_in(j, F8Bool<true>());
            else
                softmax_in(j, F8Bool<false>());
        };
        auto rescale_pack = [&] {
            pin_all<64>(o);
#pragma unroll
            for (int i = 0; i < 16; i++) {
                o[4 * i] *= alpha[0];
                o[4 * i + 1] *= alpha[0];
                o[4 * i + 2] *= alpha[1];
                o[4 * i + 3] *= alpha[1];
            }
#pragma unroll
            for (int kk = 0; kk < Sh::KK; kk++) {
                const float *x = s + 16 * kk;
                pf[kk][0] = pack_e4m3(x[0], x[1], x[4], x[5]);     /* row g, columns 4t .. */
                pf[kk][1] = pack_e4m3(x[2], x[3], x[6], x[7]);     /* row g + 8 */
                pf[kk][2] = pack_e4m3(x[8], x[9], x[12], x[13]);   /* row g, 16 + 4t .. */
                pf[kk][3] = pack_e4m3(x[10], x[11], x[14], x[15]); /* row g + 8 */
            }
        };
        /* once wgmma_wait has seen P V of stage j done, one thread a consumer
         * hands it back (K by S long before, V^T by P V) */
        auto release = [&](int j) { consumer_arrive(empty + 8 * ((n0 + j) % STAGES), ct); };
        if (nkb > 0) { /* Q goes back once the tile's last S is done */
            wgmma_fence();
            turns.wait();
            issue_s(0);
            turns.pass();
            wgmma_wait<0>();
            if (nkb == 1)
                consumer_arrive(qempty, ct);
            softmax(0);
            rescale_pack();
            for (int j = 1; j < nkb; j++) {
                wgmma_fence();
                turns.wait();
                issue_s(j);
                issue_pv(j - 1);
                turns.pass();
                wgmma_wait<1>(); /* S_j is done; P_{j-1} V_{j-1} may still run */
                if (j == nkb - 1)
                    consumer_arrive(qempty, ct);
                softmax(j);
                wgmma_wait<0>();
                release(j - 1);
                rescale_pack();
            }
            wgmma_fence();
            turns.wait();
            issue_pv(nkb - 1);
            turns.pass(rr == last_round);
            wgmma_wait<0>();
            release(nkb - 1);
            pin_all<64>(o);
            n0 += nkb;
        }

        /* O / sum times descale_v, as bf16; LSE in natural log */
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float sum = l[r];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const int row = row0 + 8 * r;
            if (row >= p.Nq)
                continue;
            const float f = sum > 0.f ? p.descale_v / sum : 0.f;
            __nv_bfloat16 *dst = p.out + (int64_t)b * p.o_bs + (int64_t)row * p.o_rs + (int64_t)h * p.o_hs;
#pragma unroll
            for (int i = 0; i < 16; i++)
                *reinterpret_cast<__nv_bfloat162 *>(dst + 8 * i + 2 * t4) =
                    __floats2bfloat162_rn(o[4 * i + 2 * r] * f, o[4 * i + 2 * r + 1] * f);
            if (t4 == 0)
                p.lse[((int64_t)b * p.H + h) * p.Nq + row] =
                    sum > 0.f ? (m[r] + log2f(sum)) * 0.69314718055994531f : -INFINITY;
        }
    }
#endif
}

#ifndef __CUDACC_RTC__
extern "C" int ft_attention_fp8_cuda_takes(const ft_tensor *q, const ft_tensor *k,
                                           const ft_tensor *v)
{
#ifdef FT_HAVE_SM90A
    if (ft_switch("FT_NO_FP8_MMA") == 1 || q->ndim != 4 || k->ndim != 4 || v->ndim != 4 ||
        q->shape[3] != F8_D || !flash_sm90_usable(q->device.index))
        return 0;
    const ft_tensor *t[3] = {q, k, v};
    for (int i = 0; i < 3; i++) { /* the copy engine's 16-byte strides, d contiguous */
        if (t[i]->stride[3] != 1 || ((uintptr_t)t[i]->data & 15) != 0)
            return 0;
        for (int a = 0; a < 3; a++)
            if (t[i]->shape[a] > 1 && t[i]->stride[a] % 16 != 0)
                return 0;
    }
    return q->shape[1] < INT32_MAX && k->shape[1] > 0 && k->shape[1] < INT32_MAX - 512;
#else
    (void)q, (void)k, (void)v;
    return 0;
#endif
}

extern "C" size_t ft_attention_fp8_cuda_workspace(const ft_tensor *k)
{
    const int64_t npad = (k->shape[1] + F8_VB - 1) / F8_VB * F8_VB;
    return (size_t)(k->shape[0] * k->shape[2] * F8_D * (npad > 0 ? npad : F8_VB));
}

#ifdef FT_HAVE_SM90A
/* K's map (its box is a block's BC rows) and the launch, for one shape */
template <typename Sh>
static ft_status fp8_launch(F8Params p, F8Maps maps, const FlashTensor &tk, const char *func)
{
    if (!flash_tma_map(&maps.k, tk, p.B, p.Nk > 0 ? p.Nk : 1, p.Hk, F8_D, Sh::BC, FT_FP8_E4M3))
        return ft_fail(FT_ERR_UNSUPPORTED, func, 0,
                       "the copy engine does not take these fp8 tensors (their strides)");
    /* persistent (one CTA an SM over the tiles) up to F8_PERSIST_KEYS
     * keys, or at any length with FT_PERSIST; else, or with
     * FT_NO_PERSIST, a CTA a tile (the kernel compiled for one). With
     * FT_PERSIST a causal walk takes the tiles in order of their lengths
     * across heads (lengths_first; not measured yet, so not the default) */
    const int ntiles = (p.Nq + F8_BR - 1) / F8_BR * p.H * p.B;
    int dev = 0;
    const bool forced = switch_on("FT_PERSIST");
    const bool persist = !switch_on("FT_NO_PERSIST") && (p.Nk <= F8_PERSIST_KEYS || forced) &&
                         cudaGetDevice(&dev) == cudaSuccess;
    p.lengths_first = persist && forced && p.causal;
    auto kernel = persist ? flash_fwd_fp8_kernel<Sh, true> : flash_fwd_fp8_kernel<Sh, false>;
    const int grid = persist ? min(ntiles, flash_sm_count(dev)) : ntiles;
    FT_CUDA_TRY(func, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)Sh::bytes));
    kernel<<<grid, 3 * WG_THREADS, Sh::bytes>>>(p, maps);
    FT_CUDA_CHECK_LAUNCH(func);
    return FT_OK;
}
#endif

extern "C" ft_status ft_attention_forward_fp8_cuda(const ft_fp8_fwd_cuda *a)
{
    static const char func[] = "ft_attention_forward";
#ifdef FT_HAVE_SM90A
    const ft_tensor *q = a->q, *k = a->k, *v = a->v;
    FT_TRY(ft_cuda_use_device(q->device.index, func));
    F8Params p;
    memset(&p, 0, sizeof p);
    p.B = (int)q->shape[0], p.Nq = (int)q->shape[1], p.H = (int)q->shape[2];
    p.Nk = (int)k->shape[1], p.Hk = (int)k->shape[2], p.causal = a->causal;
    p.scale_log2 = (float)(a->scale * 1.4426950408889634);
    p.descale_v = (float)a->descale_v;
    p.out = (__nv_bfloat16 *)a->out->data;
    p.o_bs = a->out->stride[0], p.o_rs = a->out->stride[1], p.o_hs = a->out->stride[2];
    p.lse = (float *)a->lse->data;
    if (p.B == 0 || p.Nq == 0 || p.H == 0)
        return FT_OK;
    const int npad = (int)((p.Nk + F8_VB - 1) / F8_VB * F8_VB);
    unsigned char *vt = (unsigned char *)a->workspace;
    if (npad > 0) {
        fp8_v_t<<<dim3(npad / F8_VB, p.Hk, p.B), 256>>>(
            (const unsigned char *)v->data, v->stride[0], v->stride[1], v->stride[2], p.Nk, npad, vt);
        FT_CUDA_CHECK_LAUNCH(func);
    }
    F8Maps maps;
    memset(&maps, 0, sizeof maps);
    const FlashTensor tq = flash_tensor(q), tk = flash_tensor(k);
    /* vt is [B][Hk][128][npad] */
    const cuuint64_t vdims[4] = {(cuuint64_t)(npad > 0 ? npad : F8_VB), F8_D, (cuuint64_t)p.Hk,
                                 (cuuint64_t)p.B};
    const cuuint64_t vstr[3] = {(cuuint64_t)(npad > 0 ? npad : F8_VB),
                                (cuuint64_t)F8_D * (npad > 0 ? npad : F8_VB),
                                (cuuint64_t)F8_D * (npad > 0 ? npad : F8_VB) * p.Hk};
    const cuuint32_t vbox[4] = {F8_VB, F8_D, 1, 1};
    if (!flash_tma_map(&maps.q, tq, p.B, p.Nq, p.H, F8_D, F8_BR, FT_FP8_E4M3) ||
        !flash_tma_encode(&maps.vt, vt, CU_TENSOR_MAP_DATA_TYPE_UINT8, vdims, vstr, vbox))
        return ft_fail(FT_ERR_UNSUPPORTED, func, 0,
                       "the copy engine does not take these fp8 tensors (their strides)");
    return fp8_launch<F8Fwd>(p, maps, tk, func);
#else
    (void)a;
    return ft_fail(FT_ERR_UNSUPPORTED, func, 0, "built without sm_90a");
#endif
}
#endif
