/*
 * flash_mma.cuh - the tensor-core building blocks of the flash kernels
 * (sm_80+): mma.sync m16n8k16 with f32 accumulators, ldmatrix (and .trans)
 * fragment loads from shared memory, cp.async tile copies, and the store of
 * a finished forward row. Fragment layouts are the PTX ISA's for m16n8k16
 * (.row.col), written out in kernels/README.md: S's C fragments, converted
 * to 16 bits, are P's A fragments. Check: spec/cuda_attention_spec.lua.
 */
#ifndef FT_FLASH_MMA_CUH
#define FT_FLASH_MMA_CUH

#include "flash_common.cuh"

template <typename T> struct MmaType;
template <> struct MmaType<__half> {
    static __device__ __forceinline__ uint32_t pack(float lo, float hi)
    {
        __half2 h = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&h);
    }
    static __device__ __forceinline__ float2 unpack(uint32_t x)
    {
        return __half22float2(*reinterpret_cast<__half2 *>(&x));
    }
    static __device__ __forceinline__ void mma(float *c, const uint32_t *a, uint32_t b0,
                                               uint32_t b1)
    {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};
template <> struct MmaType<__nv_bfloat16> {
    static __device__ __forceinline__ uint32_t pack(float lo, float hi)
    {
        __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&h);
    }
    static __device__ __forceinline__ float2 unpack(uint32_t x)
    {
        return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162 *>(&x));
    }
    static __device__ __forceinline__ void mma(float *c, const uint32_t *a, uint32_t b0,
                                               uint32_t b1)
    {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

/* Two 16 x 8 accumulator tiles c0 and c1 (mma.sync's C layout: columns 0-7
 * and 8-15 of 16 rows) rounded to T as the 16 x 16 A operand of the next
 * product, so S (or dS) feeds P V (or dS K) from registers. */
template <typename T>
__device__ __forceinline__ void acc_to_a(const float *c0, const float *c1, uint32_t *a)
{
    a[0] = MmaType<T>::pack(c0[0], c0[1]);
    a[1] = MmaType<T>::pack(c0[2], c0[3]);
    a[2] = MmaType<T>::pack(c1[0], c1[1]);
    a[3] = MmaType<T>::pack(c1[2], c1[3]);
}

/* The end of one forward row: `row` is row g + 8 r of a 16-row tile whose
 * O accumulators acc[4 n + 2 r + e] hold columns 8 n + 2 t + e (mma.sync's
 * C layout, wgmma's too). Adds up the quad's shares of the row sum, then
 * stores O / sum and LSE (m_log2: the row maximum in log2 units). Every
 * lane of the warp calls it (the sum is shuffled). */
template <typename T, int NT_O>
__device__ __forceinline__ void store_out_row(const FlashParams &p, int b, int h, int row, int r,
                                              const float *acc, float l_part, float m_log2)
{
    const int t4 = threadIdx.x % 4;
    float sum = l_part;
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    if (row >= p.Nq)
        return;
    const float inv = sum != 0.f ? 1.f / sum : 0.f; /* NaN stays NaN */
    T *out = reinterpret_cast<T *>(p.out.data) + row_offset(p.out, b, row, h);
#pragma unroll
    for (int n = 0; n < NT_O; n++) {
        const int col = n * 8 + t4 * 2;
        if (col < p.d) /* d % 8 == 0: both columns or neither */
            *reinterpret_cast<uint32_t *>(out + col) =
                MmaType<T>::pack(acc[4 * n + 2 * r] * inv, acc[4 * n + 2 * r + 1] * inv);
    }
    if (t4 == 0)
        p.lse[flash_stat(p, b, h) + row] =
            sum != 0.f ? (m_log2 + log2f(sum)) / FT_LOG2E : -INFINITY;
}

__device__ __forceinline__ uint32_t smem_addr(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i. */
__device__ __forceinline__ void ldmatrix_x4(uint32_t *r, const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t *r, const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

/* 16 bytes global -> shared, zero-filled when !valid. The copies and the
 * waits carry a "memory" clobber, so that the compiler keeps this
 * thread's own loads and stores of the destination on their side of them
 * (the CTA barriers after the waits are compiler barriers too). */
__device__ __forceinline__ void cp_async_16(void *dst, const void *src, bool valid)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
                 "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit()
{
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void cp_async_wait_all()
{
    asm volatile("cp.async.wait_all;\n" ::: "memory");
}
/* wait until at most N of this thread's cp.async groups are pending */
template <int N> __device__ __forceinline__ void cp_async_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* mbarriers in shared memory (sm_80 and later; the address from
 * smem_addr): a phase completes when `count` arrivals have come; waiters
 * name the phase by its parity. */
__device__ __forceinline__ void mbar_init(uint32_t bar, int count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
/* Waits until the phase of parity `parity` has completed (sm_90: the
 * suspending try_wait; before it, a poll). */
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("{\n.reg .pred done;\nWAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
                 "r"(parity)
                 : "memory");
#else
    asm volatile("{\n.reg .pred done;\nWAIT_%=:\n"
                 "mbarrier.test_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
                 "r"(parity)
                 : "memory");
#endif
}

/* Copies rows row0 .. row0+ROWS-1 of head `head` of t (batch b) into a
 * shared tile [ROWS][LD], 8 elements per cp.async; rows past n and columns
 * past d are zeros. d is a multiple of 8 and rows are 16-byte aligned. */
template <typename T, int ROWS, int D, int LD, int THREADS>
__device__ __forceinline__ void load_tile(T *tile, const FlashTensor &t, int b, int head,
                                          int row0, int n, int d)
{
    constexpr int CHUNKS = D / 8;
    const T *base = (const T *)t.data;
    for (int idx = threadIdx.x; idx < ROWS * CHUNKS; idx += THREADS) {
        const int r = idx / CHUNKS, c = (idx % CHUNKS) * 8;
        const bool valid = r < n && c < d;
        const T *src = valid ? base + row_offset(t, b, row0 + r, head) + c : base;
        cp_async_16(tile + r * LD + c, src, valid);
    }
}

#endif
