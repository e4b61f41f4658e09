/*
 * flash_wgmma.cuh - Hopper's warpgroup matrix products (wgmma, sm_90a) for
 * the flash kernels: descriptors of shared tiles in the 128-byte swizzled
 * layout (cols / 64 chunks of [rows][64], 16-byte piece c of row r at
 * c ^ (r % 8), chunks on 1024 bytes), m64nNk16 products with f32
 * accumulators, and what flash_fwd_sm90.cu and flash_bwd_sm90.cu share:
 * product_abt, product_fb, TileLoader, stages_ready, bar_sync, bar_arrive,
 * Turns, query_block and pin. Layouts and design: kernels/README.md.
 * Check: as the two kernels that use it (spec/cuda_attention_spec.lua).
 */
#ifndef FT_FLASH_WGMMA_CUH
#define FT_FLASH_WGMMA_CUH

#include "../flash_mma.cuh"

#ifndef __CUDACC_RTC__
#include <cuda.h> /* CUtensorMap; the encoder comes through the runtime, no driver link */
#include <cudaTypedefs.h>
#include <stdlib.h>
#include <string.h>
#endif

/* Descriptor of a tile at shared address `addr` (1024-aligned chunks),
 * in two halves: the low word holds the start address (and LBO), so an
 * offset inside the tile is one 32-bit add on it; the high word (SBO, the
 * 128B swizzle) is a constant. */
__device__ __forceinline__ uint32_t desc_lo(uint32_t addr, uint32_t lbo)
{
    return ((addr & 0x3FFFF) >> 4) | ((lbo >> 4) << 16);
}
#define FT_DESC_HI(sbo) (((uint32_t)(sbo) >> 4) | (1u << 30))
__device__ __forceinline__ uint64_t make_desc(uint32_t lo, uint32_t hi)
{
    return ((uint64_t)hi << 32) | lo;
}
/* Width of the shared tiles for head dim D: at least one 64-column chunk
 * (a 32-wide head leaves the second half of each row unread). */
#define FT_TW(D) ((D) < 64 ? 64 : (D))

/* Byte offset of element (r, col) in a swizzled [rows][cols] tile. */
template <int ROWS>
__device__ __forceinline__ uint32_t swz_offset(int r, int col)
{
    return (uint32_t)((col / 64) * ROWS * 128 + r * 128 + ((((col % 64) / 8) ^ (r % 8)) * 16) +
                      (col % 8) * 2);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait()
{
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/* Ordinary (cp.async) writes to shared memory, made visible to wgmma. */
__device__ __forceinline__ void fence_proxy_async()
{
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

#define FT_ACC8(d, i)                                                                         \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]),            \
        "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define FT_ACC32_AT(d, i) FT_ACC8(d, i), FT_ACC8(d, i + 8), FT_ACC8(d, i + 16), FT_ACC8(d, i + 24)
#define FT_ACC16(d) FT_ACC8(d, 0), FT_ACC8(d, 8)
#define FT_ACC20(d) FT_ACC16(d), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19])
#define FT_ACC32(d) FT_ACC32_AT(d, 0)
#define FT_ACC64(d) FT_ACC32_AT(d, 0), FT_ACC32_AT(d, 32)
#define FT_ACC96(d) FT_ACC64(d), FT_ACC32_AT(d, 64)
#define FT_ACC128(d) FT_ACC64(d), FT_ACC32_AT(d, 64), FT_ACC32_AT(d, 96)
#define FT_REG16 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}"
#define FT_REG20 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19}"
#define FT_REG32 \
    "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22," \
    "%23,%24,%25,%26,%27,%28,%29,%30,%31}"
#define FT_REG64 \
    "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22," \
    "%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43," \
    "%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
#define FT_REG96 \
    "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22," \
    "%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43," \
    "%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64," \
    "%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85," \
    "%86,%87,%88,%89,%90,%91,%92,%93,%94,%95}"
#define FT_REG128 \
    "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22," \
    "%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43," \
    "%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64," \
    "%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85," \
    "%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104," \
    "%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120," \
    "%121,%122,%123,%124,%125,%126,%127}"

/* Wgmma<T, N>::ss: d (+)= A B, m64nNk16, A and B from shared memory, both
 * K-major; ::sst: the same with B MN-major (transposed). ::rs: A from
 * registers, B from shared memory MN-major. accumulate = 0 overwrites d.
 * N = 32, 40 (the forward's P V at d = 32, with a column of ones), 64, 128,
 * 192 (the wide backward's gradients at d = 192), 256. */
template <typename T, int N> struct Wgmma;

#define FT_WGMMA_PAIR(TYPE, TY, N, REGS, ACC, SS_OPS, RS_OPS)                                \
    template <> struct Wgmma<TYPE, N> {                                                      \
        static __device__ __forceinline__ void ss(float *d, uint64_t da, uint64_t db,        \
                                                  int accumulate)                            \
        {                                                                                    \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SS_OPS "0;\n}\n"                 \
                         : ACC                                                               \
                         : "l"(da), "l"(db), "r"(accumulate));                               \
        }                                                                                    \
        static __device__ __forceinline__ void sst(float *d, uint64_t da, uint64_t db,       \
                                                   int accumulate)                           \
        {                                                                                    \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SS_OPS "1;\n}\n"                 \
                         : ACC                                                               \
                         : "l"(da), "l"(db), "r"(accumulate));                               \
        }                                                                                    \
        static __device__ __forceinline__ void rs(float *d, const uint32_t *a, uint64_t db,  \
                                                  int accumulate)                            \
        {                                                                                    \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " RS_OPS                           \
                         : ACC                                                               \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db),              \
                           "r"(accumulate));                                                 \
        }                                                                                    \
    };

#define FT_WGMMA_TYPE(TYPE, TY)                                                              \
    FT_WGMMA_PAIR(TYPE, TY, 32, FT_REG16, FT_ACC16(d),                                      \
                  "%18, 0;\nwgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " "      \
                  FT_REG16 ", %16, %17, p, 1, 1, 0, ",                                \
                  "%21, 0;\nwgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " "      \
                  FT_REG16 ", {%16, %17, %18, %19}, %20, p, 1, 1, 1;\n}\n") \
    FT_WGMMA_PAIR(TYPE, TY, 40, FT_REG20, FT_ACC20(d),                                      \
                  "%22, 0;\nwgmma.mma_async.sync.aligned.m64n40k16.f32." TY "." TY " "      \
                  FT_REG20 ", %20, %21, p, 1, 1, 0, ",                                \
                  "%25, 0;\nwgmma.mma_async.sync.aligned.m64n40k16.f32." TY "." TY " "      \
                  FT_REG20 ", {%20, %21, %22, %23}, %24, p, 1, 1, 1;\n}\n") \
    FT_WGMMA_PAIR(TYPE, TY, 64, FT_REG32, FT_ACC32(d),                                      \
                  "%34, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " "      \
                  FT_REG32 ", %32, %33, p, 1, 1, 0, ",                                \
                  "%37, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " "      \
                  FT_REG32 ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n") \
    FT_WGMMA_PAIR(TYPE, TY, 128, FT_REG64, FT_ACC64(d),                                      \
                  "%66, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " "      \
                  FT_REG64 ", %64, %65, p, 1, 1, 0, ",                                \
                  "%69, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " "      \
                  FT_REG64 ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n") \
    FT_WGMMA_PAIR(TYPE, TY, 192, FT_REG96, FT_ACC96(d),                                      \
                  "%98, 0;\nwgmma.mma_async.sync.aligned.m64n192k16.f32." TY "." TY " "      \
                  FT_REG96 ", %96, %97, p, 1, 1, 0, ",                                \
                  "%101, 0;\nwgmma.mma_async.sync.aligned.m64n192k16.f32." TY "." TY " "      \
                  FT_REG96 ", {%96, %97, %98, %99}, %100, p, 1, 1, 1;\n}\n") \
    FT_WGMMA_PAIR(TYPE, TY, 256, FT_REG128, FT_ACC128(d),                                      \
                  "%130, 0;\nwgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " "      \
                  FT_REG128 ", %128, %129, p, 1, 1, 0, ",                                \
                  "%133, 0;\nwgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " "      \
                  FT_REG128 ", {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n")

FT_WGMMA_TYPE(__half, "f16")
FT_WGMMA_TYPE(__nv_bfloat16, "bf16")

/* acc (64 x N per warpgroup) = A B^T over the first DK columns: A rows at
 * a_addr in a swizzled tile of A_ROWS rows, B rows at b_addr in one of
 * B_ROWS rows (both K-major). */
template <typename T, int N, int DK, int A_ROWS, int B_ROWS>
__device__ __forceinline__ void product_abt(float *acc, uint32_t a_addr, uint32_t b_addr)
{
    const uint32_t a = desc_lo(a_addr, 16), b = desc_lo(b_addr, 16);
#pragma unroll
    for (int ks = 0; ks < DK / 16; ks++) {
        /* column chunk ks / 4, then 32 bytes per k16 step inside it */
        const uint32_t ao = ((ks / 4) * A_ROWS * 128 + (ks % 4) * 32) >> 4;
        const uint32_t bo = ((ks / 4) * B_ROWS * 128 + (ks % 4) * 32) >> 4;
        Wgmma<T, N>::ss(acc, make_desc(a + ao, FT_DESC_HI(1024)), make_desc(b + bo, FT_DESC_HI(1024)),
                        ks > 0);
    }
}

/* acc (64 x D) += F B over K rows: F the register fragments, B K rows of
 * a swizzled [ROWS][D] tile read transposed (MN-major). */
template <typename T, int K, int D, int ROWS = K>
__device__ __forceinline__ void product_fb(float *acc, const uint32_t (*f)[4], uint32_t b_addr)
{
    const uint32_t b = desc_lo(b_addr, ROWS * 128);
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++)
        Wgmma<T, D>::rs(acc, f[kk], make_desc(b + kk * 16 * 128 / 16, FT_DESC_HI(1024)), 1);
}

#define WG_THREADS 128

/* Rows j0 .. j0+ROWS-1 of one head of t into a swizzled [ROWS][D] tile;
 * rows past n and columns past d are zeros, except the 8 columns from
 * keep (if any), which are left as they are. Each thread copies the same
 * column piece of rows r0, r0 + RP, ...: its shared offsets and global
 * pointer are worked out once. */
template <typename T, int ROWS, int D, int THREADS> struct TileLoader {
    static constexpr int CHUNKS = D / 8, RP = THREADS / CHUNKS, ITERS = (ROWS + RP - 1) / RP;
    static_assert(THREADS % CHUNKS == 0 && RP % 8 == 0, "loader shape");
    const T *src; /* row r0 of the head, column c */
    int64_t row_stride, rp_stride; /* elements between rows, and RP rows */
    uint32_t dst; /* byte offset of (r0, c) in the tile */
    int rows_left; /* n - r0, or 0 when column c is past d */
    bool skip; /* column c is keep's */
    __device__ __forceinline__ TileLoader(const FlashTensor &t, int b, int head, int n_rows, int d,
                                          int keep = -1)
    {
        const int tx = threadIdx.x % THREADS; /* THREADS threads share the copy */
        const int c = (tx % CHUNKS) * 8, r0 = tx / CHUNKS;
        row_stride = t.row_stride;
        rp_stride = RP * t.row_stride;
        src = (const T *)t.data + row_offset(t, b, r0, head) + c;
        dst = swz_offset<ROWS>(r0, c);
        rows_left = c < d ? n_rows - r0 : 0;
        skip = c == keep;
    }
    __device__ __forceinline__ void load(unsigned char *tile, int j0) const
    {
        const T *g = src + (int64_t)j0 * row_stride;
        const int left = rows_left - j0;
        if (skip)
            return;
#pragma unroll
        for (int it = 0; it < ITERS; it++, g += rp_stride) {
            if (ROWS % RP != 0 && (int)(dst / 128) + it * RP >= ROWS)
                break;
            const bool valid = it * RP < left;
            cp_async_16(tile + dst + it * RP * 128, valid ? g : src, valid);
        }
    }
};

/* Waits until every thread's cp.async copies have landed and are visible
 * to the tensor cores (and every thread is done with the stage about to be
 * refilled). */
__device__ __forceinline__ void stages_ready()
{
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
}
/* Named barriers: bar_sync waits until n threads have reached barrier id
 * (bar_arrive counts one and goes on). */
__device__ __forceinline__ void bar_sync(int id, int n)
{
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int n)
{
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

/* The two warpgroups of a CTA take turns to issue their products: wait()
 * before issuing, pass() after (named barriers 3 and 4), so that the tensor
 * cores take one warpgroup's products, then the other's, and the
 * elementwise work of one runs under the products of the other. Both must
 * make the same number of rounds; warpgroup 1 lets warpgroup 0 begin and
 * skips its last pass (nobody would wait for it). ON = false: no-ops.
 * The barrier ids come from a register, so ptxas reserves all 16 barriers
 * of the CTA: fine where it is used (one CTA per SM), to be kept in mind
 * before using it with several CTAs per SM. */
template <bool ON> struct Turns;

/* The warpgroup of thread tid. With turns (UNIFORM) through a shuffle
 * from lane 0, a value the compiler knows to be the same across the warp:
 * computed plainly, the warp-specialised kernels' branches on it count as
 * divergent, and ptxas serialised every wgmma of theirs with turns
 * (C7520, "wgmma.mma_async instructions are serialized due to program
 * dependence on compiler-inserted WG.AR in divergent path"): the turns
 * measured there (0.72x-0.93x) were those serialised kernels. */
template <bool UNIFORM> __device__ __forceinline__ int warpgroup_of(int tid)
{
    return UNIFORM ? __shfl_sync(0xffffffffu, tid / WG_THREADS, 0) : tid / WG_THREADS;
}

template <bool ON> struct Turns {
    int wg;
    __device__ __forceinline__ explicit Turns(int warpgroup) : wg(warpgroup)
    {
        if (ON && wg == 1)
            bar_arrive(3, 2 * WG_THREADS);
    }
    __device__ __forceinline__ void wait() const
    {
        if (ON)
            bar_sync(3 + wg, 2 * WG_THREADS);
    }
    __device__ __forceinline__ void pass(bool last = false) const
    {
        if (ON && !(last && wg == 1))
            bar_arrive(4 - wg, 2 * WG_THREADS);
    }
};

/* A forward's tiles (query block, head, batch entry) and a persistent
 * grid's walk over them. Tile t is query block x = t % nqb of head-batch
 * bh = t / nqb (= b H + h): a head's blocks next to each other, sharing
 * its K and V in L2; with lengths_first, x = t / (B H) of bh = t % (B H):
 * every head's x = 0 first, then x = 1 (under the causal mask x counts
 * from the longest block, so the tiles come in order of their lengths;
 * kernels/README, "The order of the walk"). Round r gives CTA c tile
 * r G + c, or r G + G - 1 - c when r is odd (snaking: under the causal
 * mask the CTAs that took the longest tiles of a round take the shortest
 * of the next). A grid of a CTA a tile is the one round r = 0. */
struct TileWalk {
    int nqb, heads, ntiles; /* heads: B H */
    bool lengths_first;
    __device__ __forceinline__ TileWalk(int nqb_, int H, int B, bool lf)
        : nqb(nqb_), heads(H * B), ntiles(nqb_ * H * B), lengths_first(lf)
    {
    }
    __device__ __forceinline__ int rounds() const
    {
        return (ntiles + (int)gridDim.x - 1) / (int)gridDim.x;
    }
    __device__ __forceinline__ int tile(int r) const
    {
        const int G = (int)gridDim.x, c = (int)blockIdx.x;
        return r * G + ((r & 1) ? G - 1 - c : c);
    }
    __device__ __forceinline__ int block(int t) const { return lengths_first ? t / heads : t % nqb; }
    __device__ __forceinline__ int head_batch(int t) const { return lengths_first ? t % heads : t / nqb; }
};

/* The query block of a CTA that walks the keys (the forward, dQ): BR rows
 * from i0 (under the causal mask the longest rows first, so that the short
 * ones fill the tail), nq of them inside the sequence, and the blocks of BC
 * keys that any of them sees: kb0 .. nkb - 1 (none when nkb == kb0). x:
 * the block's place in the grid's x (a persistent kernel passes its tile's). */
struct QueryBlock {
    int i0, nq, kb0, nkb;
};
template <int BR, int BC>
__device__ __forceinline__ QueryBlock query_block(const FlashParams &p, int x = (int)blockIdx.x)
{
    const int nblocks = (p.Nq + BR - 1) / BR;
    const int qb = p.causal ? nblocks - 1 - x : x;
    QueryBlock q;
    q.i0 = qb * BR;
    q.nq = min(BR, p.Nq - q.i0);
    q.kb0 = flash_key_begin(p, q.i0) / BC;
    q.nkb = max(q.kb0, (flash_key_end(p, q.i0 + q.nq - 1) + BC - 1) / BC);
    return q;
}

/* The copy engine (TMA) and its barriers, for the warp-specialised kernels:
 * a tensor map (CUtensorMap, built on the host by flash_tma_map) is 128
 * opaque bytes passed as a __grid_constant__ kernel parameter; a copy of a
 * box of it lands in shared memory in the 128-byte swizzled layout and
 * counts its bytes on an mbarrier, which the consumers wait on by phase
 * parity (mbar_init, mbar_arrive and mbar_wait: flash_mma.cuh). */
struct alignas(64) FlashTmaMap {
    unsigned long long w[16];
};
/* Barrier inits made visible to the copy engine (then a CTA barrier). */
__device__ __forceinline__ void mbar_init_fence()
{
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
/* One arrival that also announces `bytes` of copies to come. */
__device__ __forceinline__ void mbar_expect(uint32_t bar, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}
/* Announces `bytes` of copies to come, without an arrival. */
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes)
{
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}
/* A box of map at coordinates (c0, c1, c2, c3), innermost first, into
 * shared memory at dst, completing on bar. */
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const FlashTmaMap *map, uint32_t bar,
                                            int c0, int c1, int c2, int c3)
{
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(dst),
                 "l"(map), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
                 : "memory");
}
/* Registers moved between the warpgroups of a CTA (sm_90a): the producer
 * gives up its registers, the consumers take them. */
template <int N> __device__ __forceinline__ void regs_dec()
{
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N> __device__ __forceinline__ void regs_inc()
{
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

#ifndef __CUDACC_RTC__
/* A tensor map of a 4-dimensional tensor at data: dims innermost first,
 * the byte strides of the outer three, boxes `box` (innermost first, at
 * most 128 bytes wide), swizzled by 128 bytes. False when the copy engine
 * cannot take it (the driver says no). */
static inline bool flash_tma_encode(FlashTmaMap *out, void *data, CUtensorMapDataType type,
                                    const cuuint64_t dims[4], const cuuint64_t strides[3],
                                    const cuuint32_t box[4])
{
    static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
        void *fn = nullptr;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                             cudaEnableDefault, &q) != cudaSuccess ||
            q != cudaDriverEntryPointSuccess)
            fn = nullptr;
        return (PFN_cuTensorMapEncodeTiled_v12000)fn;
    }();
    static_assert(sizeof(FlashTmaMap) == sizeof(CUtensorMap), "FlashTmaMap is a CUtensorMap");
    const cuuint32_t unit[4] = {1, 1, 1, 1};
    return encode &&
           encode(reinterpret_cast<CUtensorMap *>(out), type, 4, data, dims, strides, box, unit,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

/* The tensor map of t ([B][rows][heads][d]) with boxes of box_rows rows of
 * one head and 128 bytes of columns (64 16-bit ones, 128 fp8 ones); dims
 * innermost first: d, heads, rows, batch. */
static inline bool flash_tma_map(FlashTmaMap *out, const FlashTensor &t, int B, int rows, int heads,
                          int d, int box_rows, int dtype)
{
    const int es = dtype == FT_FP8_E4M3 ? 1 : 2;
    const cuuint64_t dims[4] = {(cuuint64_t)d, (cuuint64_t)heads, (cuuint64_t)rows, (cuuint64_t)B};
    /* a dim of size 1 takes any stride: give it a valid one */
    const int64_t hs = heads > 1 ? t.head_stride : d, rs = rows > 1 ? t.row_stride : d,
                  bs = B > 1 ? t.batch_stride : d;
    const cuuint64_t strides[3] = {(cuuint64_t)hs * es, (cuuint64_t)rs * es, (cuuint64_t)bs * es};
    const cuuint32_t box[4] = {(cuuint32_t)(128 / es), 1, (cuuint32_t)box_rows, 1};
    if (hs <= 0 || rs <= 0 || bs <= 0)
        return false;
    return flash_tma_encode(out, t.data,
                            dtype == FT_F16      ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                            : dtype == FT_BF16   ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                 : CU_TENSOR_MAP_DATA_TYPE_UINT8,
                            dims, strides, box);
}

/* A kernel switch (FT_WS, ...: lib/switches.c) is on. */
static inline bool switch_on(const char *name)
{
    return ft_switch(name) == 1;
}
#endif

/* Keeps the compiler from moving register reads or writes across wgmma's
 * asynchronous window (the asm statements name the registers). */
__device__ __forceinline__ void pin(float &x) { asm volatile("" : "+f"(x)::"memory"); }
__device__ __forceinline__ void pin(uint32_t &x) { asm volatile("" : "+r"(x)::"memory"); }
template <int N> __device__ __forceinline__ void pin_all(float *x)
{
#pragma unroll
    for (int i = 0; i < N; i++)
        pin(x[i]);
}

#endif
