/*
 * flash_common.cuh - what flash_fwd.cu and flash_bwd.cu share: the kernel
 * parameters (pointers, strides in elements, sizes, scale), element loads
 * by a run-time dtype, warp reductions, and which keys a query sees (causal
 * and sliding windows: lib/attn_mod.h's rules, on the kernels' ints), and
 * softcap and ALiBi on the raw scores (ScoreMod).
 *
 *   q, dq, out, dout [B, Nq, H, d]   k, v, dk, dv [B, Nk, Hk, d]
 *   lse, D [B, H, Nq] f32, rows contiguous (stat_bs, stat_hs)
 *
 * Variable lengths run in one launch: the tensors are [total, heads, d]
 * (batch stride 0), LSE and D [H, total_q], and cu_q, cu_k (device) give
 * each sequence's rows; a kernel's first step, flash_enter_seq, turns its
 * copy of the parameters into those of sequence blockIdx.z (sizes, row
 * pointers), so the rest of the kernel sees one sequence as it sees a
 * batch entry. B is then the number of sequences, Nq and Nk the longest
 * (the grid's size); blocks past a sequence's end return at once.
 */
#ifndef FT_FLASH_COMMON_CUH
#define FT_FLASH_COMMON_CUH

#ifdef __CUDACC_RTC__
/* Compiled at run time for a modification written in Lua (rtc.cu): the
 * device code only, with lib/attn_mod.h's masks and lib/flashtile.h's
 * dtype codes (whose header declares host functions, which NVRTC does not
 * take; checked equal below). */
#include "attn_mod.h"
#include <cuda_bf16.h>
#include <cuda_fp16.h>
enum { FT_F64 = 0, FT_F32 = 1, FT_F16 = 2, FT_BF16 = 3 };
#else
#include "kernels.h"
#include "flash_tiles.cuh"
static_assert(FT_F64 == 0 && FT_F32 == 1 && FT_F16 == 2 && FT_BF16 == 3,
              "flash_common.cuh's run-time copy of the dtype codes");

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#endif

#define FT_LOG2E 1.4426950408889634f
#define FT_WARP 32

/* A [B, N, heads, d] tensor as the kernels see it. */
struct FlashTensor {
    void *data;
    int64_t batch_stride, row_stride, head_stride; /* elements */
};

struct FlashParams {
    FlashTensor q, k, v, out, dout, dq, dk, dv;
    float *lse;       /* [B, H, Nq] */
    float *D;         /* [B, H, Nq], backward: rowsum(dO * O) */
    float *lse2;      /* [B, H, Nq], backward (sm90): LSE log2(e), +inf for rows that saw no key */
    int64_t stat_bs, stat_hs; /* lse's, D's and lse2's strides over batch and head */
    const int *cu_q, *cu_k;   /* variable lengths: B + 1 row offsets each (device), or null */
    int B, H, Hk, Nq, Nk, d;
    int dtype;        /* ft_dtype of every tensor above but lse and D */
    int causal;
    int lengths_first; /* the persistent forward's walk: tiles in order of
                        * their lengths across heads (FT_PERSIST, causal) */
    ft_attn_mod mod;  /* which keys each query sees: lib/attn_mod.h */
    const float *sink; /* [H] contiguous: each row's softmax starts from it; or null */
    const float *alibi; /* ALiBi slopes of batch 0, head 0 (f32), or null */
    int64_t alibi_bs, alibi_hs; /* their strides over batch and head, in elements */
    float scale;      /* softmax scale */
    float scale_log2; /* scale * log2(e): exp(x * scale) = exp2(x * scale_log2) */
    /* ScoreMod's constants of the call, worked out once on the host */
    float cap2, cap, inv_scale;
    int user_mod;     /* a modification written in Lua: the kernels compiled for it (rtc.cu) */
    /* its mask keeps every key from um_left before to um_right after each
     * query's diagonal (its block mask's inner band; um_left -1: unknown):
     * the tiles inside skip the mask */
    int um_left, um_right;
    /* the Hopper forward keeps a row's running maximum until a block
     * raises it by more than LAZY_MAX_LOG2 (log2 units), so that O is
     * rescaled only then (head dims 65 to 128; flash_fwd.cu) */
    int lazy_max;
    /* a bf16 softcap's rows take the logits' bound, softcap, as their
     * maximum (FwdRows::capped); um_cap: a Lua score's top, where its
     * range is narrow (FwdRows::um_capped) */
    int cap_max, um_cap;
};
#define LAZY_MAX_LOG2 8.f /* P up to 2^8 in between: bf16 and f16 hold it, f32 sums it */

#ifndef __CUDACC_RTC__
/* [B, N, heads, d], or a varlen [total, heads, d] (batch stride 0). */
static inline FlashTensor flash_tensor(const ft_tensor *t)
{
    FlashTensor r = {nullptr, 0, 0, 0};
    if (t) {
        const int o = t->ndim == 3 ? -1 : 0;
        r.data = t->data;
        r.batch_stride = o ? 0 : t->stride[0];
        r.row_stride = t->stride[1 + o];
        r.head_stride = t->stride[2 + o];
    }
    return r;
}
#endif

/* Where row statistics (lse, D, lse2) of batch b, head h start. */
__device__ __forceinline__ int64_t flash_stat(const FlashParams &p, int b, int h)
{
    return (int64_t)b * p.stat_bs + (int64_t)h * p.stat_hs;
}

__device__ __forceinline__ void flash_seq_rows(FlashTensor &t, int row0, int es)
{
    if (t.data)
        t.data = (char *)t.data + (int64_t)row0 * t.row_stride * es;
}

/* A varlen call: p becomes the parameters of sequence b (its sizes, its
 * rows of every tensor and statistic); otherwise nothing changes. */
__device__ __forceinline__ void flash_enter_seq(FlashParams &p, int b)
{
    if (!p.cu_q)
        return;
    const int q0 = p.cu_q[b], k0 = p.cu_k[b];
    const int es = p.dtype == FT_F32 ? 4 : 2;
    p.Nq = p.cu_q[b + 1] - q0;
    p.Nk = p.cu_k[b + 1] - k0;
    flash_seq_rows(p.q, q0, es);
    flash_seq_rows(p.out, q0, es);
    flash_seq_rows(p.dout, q0, es);
    flash_seq_rows(p.dq, q0, es);
    flash_seq_rows(p.k, k0, es);
    flash_seq_rows(p.v, k0, es);
    flash_seq_rows(p.dk, k0, es);
    flash_seq_rows(p.dv, k0, es);
    if (p.lse)
        p.lse += q0;
    if (p.D)
        p.D += q0;
    if (p.lse2)
        p.lse2 += q0;
}

/* Element offset of row `row` of head `head` in batch `b`. */
__device__ __forceinline__ int64_t row_offset(const FlashTensor &t, int b, int row, int head)
{
    return (int64_t)b * t.batch_stride + (int64_t)row * t.row_stride +
           (int64_t)head * t.head_stride;
}

__device__ __forceinline__ float load_elem(const void *p, int64_t i, int dtype)
{
    switch (dtype) {
    case FT_F16: return __half2float(((const __half *)p)[i]);
    case FT_BF16: return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

/* Round to nearest even, as the CPU's conversions do. */
__device__ __forceinline__ void store_elem(void *p, int64_t i, int dtype, float v)
{
    switch (dtype) {
    case FT_F16: ((__half *)p)[i] = __float2half_rn(v); break;
    case FT_BF16: ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(v); break;
    default: ((float *)p)[i] = v; break;
    }
}

__device__ __forceinline__ float warp_sum(float x)
{
    for (int o = FT_WARP / 2; o > 0; o /= 2)
        x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

/* The keys query `row` sees are [flash_key_begin, flash_key_end); the
 * queries that see key `j` are [flash_query_begin, flash_query_end). Each
 * bound moves right (or stays) as row or j grows. */
__device__ __forceinline__ int flash_key_begin(const FlashParams &p, int row)
{
    return (int)ft_mod_key_begin(&p.mod, p.Nq, p.Nk, row);
}

__device__ __forceinline__ int flash_key_end(const FlashParams &p, int row)
{
    return (int)ft_mod_key_end(&p.mod, p.Nq, p.Nk, row);
}

__device__ __forceinline__ int flash_query_begin(const FlashParams &p, int j)
{
    return (int)ft_mod_query_begin(&p.mod, p.Nq, p.Nk, j);
}

__device__ __forceinline__ int flash_query_end(const FlashParams &p, int j)
{
    return (int)ft_mod_query_end(&p.mod, p.Nq, p.Nk, j);
}

/* Where a row's online softmax starts, in log2 units of the scaled scores:
 * the running max at the sink logit and the sum at e^0 = 1 (the sink's
 * term, with no value row); without a sink, -inf and 0. The sum is held
 * in shares by a quad of lanes in the tensor-core kernels: `share` says
 * whether this lane's share takes the 1. */
__device__ __forceinline__ float flash_sink_log2(const FlashParams &p, int h)
{
    return p.sink ? p.sink[h] * FT_LOG2E : -INFINITY;
}

__device__ __forceinline__ float flash_sink_sum(float sink_log2, bool share)
{
    return share && sink_log2 != -INFINITY ? 1.f : 0.f;
}

/* The keys [lo, hi) that every query of a group of rows sees. A block of
 * keys [j0, j1) needs a mask (some pair hidden, or a key past the end)
 * unless it lies inside: two compares a block, the bounds worked out once
 * per group of rows (lib/attn_mod.h's ft_mod_block, specialised). */
struct FullKeys {
    int lo, hi;
    __device__ __forceinline__ bool masks(int j0, int j1) const { return j0 < lo || j1 > hi; }
};

/* For the queries [r0, r1): the visible intervals move right with the row,
 * so the last row's first key and the first row's end bound them all. */
__device__ __forceinline__ FullKeys flash_full_keys(const FlashParams &p, int r0, int r1)
{
    FullKeys f;
    f.lo = flash_key_begin(p, r1 - 1);
    f.hi = flash_key_end(p, r0);
    return f;
}

/* The same from the keys' side (dK/dV): the queries [lo, hi) that see every
 * key of [k0, k1); a block of queries [i0, i1) needs a mask unless it lies
 * inside (also when a key or a query is past the end). */
__device__ __forceinline__ FullKeys flash_full_queries(const FlashParams &p, int k0, int k1)
{
    FullKeys f;
    f.lo = flash_query_begin(p, k1 - 1);
    f.hi = k1 > p.Nk ? -1 : flash_query_end(p, k0);
    return f;
}

/* The keys one query row sees, for masking element by element. */
struct KeyRange {
    int begin, end;
    __device__ __forceinline__ bool hides(int col) const { return col < begin || col >= end; }
};

__device__ __forceinline__ KeyRange flash_keys(const FlashParams &p, int row)
{
    KeyRange k;
    k.begin = flash_key_begin(p, row);
    k.end = flash_key_end(p, row);
    return k;
}

/* The queries that see one key, likewise (the dK/dV kernels); none for a
 * key past the end. */
struct QueryRange {
    int begin, end;
    __device__ __forceinline__ bool hides(int qi) const { return qi < begin || qi >= end; }
};

__device__ __forceinline__ QueryRange flash_queries(const FlashParams &p, int j)
{
    QueryRange q;
    q.begin = flash_query_begin(p, j);
    q.end = j < p.Nk ? flash_query_end(p, j) : 0; /* a key past the end: none */
    return q;
}

#ifndef __CUDACC_RTC__
struct FlashRtc;
/* flash_fwd.cu: the parameters of a call, and whether every tensor's rows
 * start on 16 bytes (what cp.async and the tensor-core kernels need). */
FlashParams flash_params(const ft_attn_shape *s, const ft_tensor *q, const ft_tensor *k,
                         const ft_tensor *v, const ft_tensor *out, const ft_tensor *lse);
bool flash_rows_aligned(const ft_tensor *const *ts, int n);

/* flash_fwd_sm90.cu (built for 90a): the wgmma forward, head dims up to
 * 256, f16/bf16, rows aligned. flash_sm90_usable: it was built and the device
 * is of compute capability 9.0 (and the switch FT_NO_WGMMA, which keeps
 * the mma.sync kernels for comparison, is off: lib/switches.c). */
ft_status flash_fwd_sm90(const FlashParams &p, FlashRtc *rtc);
/* flash_bwd_sm90.cu: dK, dV, dQ once p.D holds rowsum(dO * O); Nq > 0. */
ft_status flash_bwd_sm90(const FlashParams &p, FlashRtc *rtc);
bool flash_sm90_usable(int device);
/* The device's SM count, asked once a device (132, an H100/H200's, when
 * the driver does not say): what persistent grids and split counts size
 * themselves by. */
int flash_sm_count(int device);

/* A call with a modification written in Lua (rtc.cu) runs the same
 * kernels instantiated with its FtUserMod, compiled at run time: a
 * launcher given one names its kernel by its template arguments
 * (rtc_name) and flash_rtc_launch finds or compiles it, from the source
 * file `file` of kernels/attention/. */
struct FlashRtc;
/* A call's mods made ready (its FtUserMod source, its tensors' table), and
 * freed; kernels/attention/rtc.cu. */
extern "C" ft_status flash_rtc_new(const ft_attn_shape *s, int dtype, int device,
                                   FlashRtc **out, const char *func);
extern "C" void flash_rtc_free(FlashRtc *rtc);
ft_status flash_rtc_launch(FlashRtc *rtc, const char *file, const char *name, dim3 grid,
                           int threads, size_t smem, const FlashParams &p, const char *func,
                           void *extra = nullptr);
/* The mma.sync launchers (flash_fwd.cu, flash_bwd.cu): the row of
 * MMA_FWD_TILES / MMA_BWD_TILES that takes the head dim, for p's dtype and
 * kind; through rtc for a call with mods (a dry rtc compiles its kernels
 * and launches nothing). */
ft_status flash_fwd_mma(const FlashParams &p, FlashRtc *rtc);
ft_status flash_bwd_mma(const FlashParams &p, FlashRtc *rtc);
/* Every kernel a call with rtc's mod runs, forward and backward, on the
 * Hopper kernels (wgmma) or the mma.sync ones; has_score: the backward's
 * need EXT (rtc.cu). */
ft_status flash_rtc_dry_run(FlashParams p, FlashRtc *rtc, bool wgmma, bool has_score,
                            int passes);

template <typename T> struct TypeOf {
    using type = T;
};
/* "kernel<arg, ..., FtUserMod>" */
struct RtcName {
    char s[256];
    int n;
    void add(int v) { n += snprintf(s + n, sizeof s - n, "%d, ", v); }
    void add(bool v) { n += snprintf(s + n, sizeof s - n, "%s, ", v ? "true" : "false"); }
    void add(TypeOf<__half>) { n += snprintf(s + n, sizeof s - n, "__half, "); }
    void add(TypeOf<__nv_bfloat16>) { n += snprintf(s + n, sizeof s - n, "__nv_bfloat16, "); }
};
template <typename... A> static RtcName rtc_name(const char *kernel, A... args)
{
    RtcName r;
    r.n = snprintf(r.s, sizeof r.s, "%s<", kernel);
    (r.add(args), ...);
    snprintf(r.s + r.n, sizeof r.s - r.n, "FtUserMod>");
    return r;
}

/* Launches kernel(p), or kernel(p, extra) (one more parameter), with `smem`
 * bytes of dynamic shared memory (raising the kernel's limit first); CUDA
 * failures become ft_status for `func`.
 * With rtc, the kernel of the same template arguments and rtc's
 * modification instead: name() gives its RtcName, file its source. */
template <typename Kernel, typename Name, typename... Extra>
static ft_status flash_launch(FlashRtc *rtc, const char *file, Kernel kernel, Name name,
                              dim3 grid, int threads, size_t smem, const FlashParams &p,
                              const char *func, Extra... extra)
{
    static_assert(sizeof...(Extra) <= 1, "kernel(p) or kernel(p, extra)");
    if (rtc) {
        void *ex[] = {(void *)&extra..., nullptr};
        return flash_rtc_launch(rtc, file, name().s, grid, threads, smem, p, func, ex[0]);
    }
    FT_CUDA_TRY(func, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)smem));
    kernel<<<grid, threads, smem>>>(p, extra...);
    FT_CUDA_CHECK_LAUNCH(func);
    return FT_OK;
}
#endif /* __CUDACC_RTC__ */

/* The larger of a and b, NaN when either is (max.NaN, sm_80 and later: one
 * instruction, as fmaxf). A row's running maximum takes it, so a row with a
 * NaN score has a NaN maximum and NaN output and LSE, as PyTorch's softmax
 * and the CPU's FT_NAN_MAX give, not those of a row that sees no key
 * (fmaxf drops NaN: a row of NaN scores kept the maximum -inf). */
__device__ __forceinline__ float max_nan(float a, float b)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    float y;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
    return y;
#else
    return a != a || b != b ? a + b : fmaxf(a, b);
#endif
}

/* ex2.approx: 2^x in one MUFU instruction (2^-inf = 0). */
__device__ __forceinline__ float ex2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* The score modifications of lib/attn_mod.h (softcap, then ALiBi) on the
 * kernels' raw scores s = q.k, before the scale: the modified score comes
 * back in the same raw units (x' / scale, x' = ft_mod_score(scale s)), so
 * the online softmax and the saved LSE work as without. The kernels that
 * run a modification, or variable lengths in one launch, are instantiated
 * with EXT = true (plain attention keeps its own code, with no register
 * spent on either); the rest of each kernel is the same.
 *
 * tanh(y) = 1 - 2 / (1 + e^2y): two special-function instructions (ex2,
 * rcp) a score besides the softmax's exp2; a reciprocal by Newton's
 * method on the FMA units instead measured the same on the H200 (the
 * softmax of one warpgroup, while the other multiplies, is bound by the
 * special-function unit's 4 lanes a clock and the FMA unit's 16 in
 * turn). The bf16 kernels take tanh.approx (one instruction; relative
 * error below 2^-10.9, under bf16's rounding of P, 2^-9): FAST kinds.
 * f16 keeps the exact form, its rounding being 2^-12. ALiBi's
 * distance is taken between positions held as floats (exact below 2^24):
 * an integer conversion per score would take the special-function unit's
 * rate too. Loops over fragments are compiled per ModKind, without a
 * branch per score (ALiBi measured 1.4x slower with one). */
/* Which modifications a loop applies, fixed at compile time: each loop
 * over a fragment is compiled once per kind (with_mod_kind picks it once
 * per call), so no score waits on a branch of its own. */
template <bool CAP, bool ALIBI, bool FAST = false> struct ModKind {
    static constexpr bool cap = CAP, alibi = ALIBI, fast = FAST;
};

/* Whether the kernels of element type T take tanh.approx for the softcap. */
template <typename T> struct FastTanh {
    static constexpr bool value = false;
};
template <> struct FastTanh<__nv_bfloat16> {
    static constexpr bool value = true;
};
template <typename T> __host__ __device__ constexpr bool fast_tanh()
{
    return FastTanh<T>::value;
}

/* tanh.approx: one special-function instruction. */
__device__ __forceinline__ float tanh_approx(float x)
{
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

struct ScoreMod {
    float cap2;  /* 2 log2(e) scale / softcap: e^2y = 2^(cap2 s); 0: off */
    float cap;   /* softcap / scale */
    float slope; /* ALiBi slope / scale; 0: off */
    int shift;   /* Nk - Nq: query i sits at key position i + shift */
    float scale, inv_scale; /* for a modification written in Lua: its s is scaled */
    int b, h;
    int um_left, um_right; /* FlashParams' */
    int nq, nk;            /* this sequence's rows and keys */
    /* The query's position among the keys, as apply takes it. */
    __device__ __forceinline__ float pos(int qi) const { return (float)(qi + shift); }
    /* The modified score of the query at key position a (pos) against key
     * j; *grad gets d score' / d score (the softcap's 1 - tanh^2). */
    template <typename K>
    __device__ __forceinline__ float apply(K, float s, float a, float j, float *grad) const
    {
        *grad = 1.f;
        if (K::cap) {
            /* y = scale s / softcap = cap2 s / (2 log2 e) */
            const float t = K::fast ? tanh_approx(s * (cap2 * (0.5f / FT_LOG2E)))
                                    : 1.f - __fdividef(2.f, 1.f + ex2(cap2 * s));
            s = cap * t;
            *grad = fmaf(-t, t, 1.f);
        }
        if (K::alibi)
            s = fmaf(-slope, fabsf(a - j), s);
        return s;
    }
    /* The same, the kind chosen per call (the row kernels). */
    __device__ __forceinline__ float apply(float s, float a, float j, float *grad) const
    {
        return cap2 != 0.f ? apply(ModKind<true, true>(), s, a, j, grad)
                           : apply(ModKind<false, true>(), s, a, j, grad);
    }
};

/* f(kind) with the kind of m: softcap with or without ALiBi, ALiBi, or
 * none (a varlen call without modifications; a head of zero slope). */
template <bool FAST = false, typename F>
__device__ __forceinline__ void with_mod_kind(const struct ScoreMod &m, F f)
{
    if (m.cap2 == 0.f && m.slope == 0.f)
        f(ModKind<false, false>());
    else if (m.cap2 == 0.f)
        f(ModKind<false, true>());
    else if (m.slope != 0.f)
        f(ModKind<true, true, FAST>());
    else
        f(ModKind<true, false, FAST>());
}

/* ALiBi's slope of batch b, head h over the scale (ScoreMod's), or 0:
 * a load and a division, which a loop over one head's blocks takes once */
__device__ __forceinline__ float flash_alibi_slope(const FlashParams &p, int b, int h)
{
    return p.alibi ? p.alibi[b * p.alibi_bs + h * p.alibi_hs] / p.scale : 0.f;
}

__device__ __forceinline__ ScoreMod flash_score_mod(const FlashParams &p, int b, int h, float slope)
{
    ScoreMod m;
    m.cap2 = p.cap2;
    m.cap = p.cap;
    m.slope = slope;
    m.shift = p.Nk - p.Nq;
    m.scale = p.scale;
    m.inv_scale = p.inv_scale;
    m.b = b, m.h = h;
    m.um_left = p.um_left, m.um_right = p.um_right;
    m.nq = p.Nq, m.nk = p.Nk;
    return m;
}

__device__ __forceinline__ ScoreMod flash_score_mod(const FlashParams &p, int b, int h)
{
    return flash_score_mod(p, b, h, flash_alibi_slope(p, b, h));
}

/* Whether a call modifies its scores (softcap or ALiBi). */
__host__ __device__ inline bool flash_score_modified(const FlashParams &p)
{
    return p.mod.softcap > 0 || p.alibi;
}

/* Whether a call needs the extended kernels (EXT = true): it modifies
 * its scores, drops probabilities, or runs variable lengths in one
 * launch. */
__host__ __device__ inline bool flash_extended(const FlashParams &p)
{
    return flash_score_modified(p) || p.mod.dropout || p.cu_q || p.user_mod;
}

/* Dropout (lib/attn_mod.h's rule, ft_drop_keep) sixteen scores at a time:
 * the keep bits (bit k: key j16 + k, j16 % 16 == 0) of query i from one
 * primary call, and in *tie the keys whose top byte equals the
 * threshold's, which the secondary words decide (drop_untie). Four bytes
 * at a time: a byte x is above t = 128 th + tl when bit 7 of x & u (th =
 * 1) or of x | u (th = 0) is set, u = (x | 128) - (tl + 1) (whose bit 7
 * says x's low seven bits are above tl; no borrow crosses bytes), and
 * equal when x ^ t is a zero byte. */
__device__ __forceinline__ uint32_t drop_draw16(const FlashParams &p, uint32_t bh, int i, int j16,
                                                uint32_t *tie)
{
    const ft_philox4 w = ft_drop_primary(p.mod.seed, p.mod.offset, bh, (uint32_t)i, (uint32_t)j16);
    const uint32_t t = p.mod.drop_threshold >> 24, H7 = 0x80808080u, L7 = 0x7f7f7f7fu;
    const uint32_t lo = t & 0x80u ? 0u : H7; /* th = 0: x | u decides */
    const uint32_t sub = ((t & 0x7fu) + 1) * 0x01010101u, rep = t * 0x01010101u;
    uint32_t keep = 0, eq = 0;
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const uint32_t x = w.v[q], u = (x | H7) - sub, z = x ^ rep;
        const uint32_t gt = (x & u & H7) | ((x | u) & lo);
        const uint32_t ze = ~(((z & L7) + L7) | z | L7);
        /* bit 7 of bytes 0..3 to bits 28..31 (the products do not overlap) */
        keep |= (gt * 0x00204081u) >> 28 << 4 * q;
        eq |= (ze * 0x00204081u) >> 28 << 4 * q;
    }
    *tie = eq;
    return keep;
}

/* A lane's keep bits (16 a call: call q at bits 16 q) with the ties
 * decided: at(q, i, j16) says which query and keys call q drew. Ties come
 * at 1 score in 256, so the loop runs about once or twice a warp. */
template <typename At>
__device__ __forceinline__ uint64_t drop_untie(const FlashParams &p, uint32_t bh, uint64_t keep,
                                               uint64_t tie, At at)
{
    const uint32_t thr = p.mod.drop_threshold, t = thr >> 24;
    while (__any_sync(0xffffffffu, tie != 0)) {
        if (tie) {
            const int e = __ffsll((long long)tie) - 1, q = e >> 4, k = e & 12;
            int i, j16;
            at(q, i, j16);
            const ft_philox4 s =
                ft_drop_secondary(p.mod.seed, p.mod.offset, bh, (uint32_t)i, (uint32_t)(j16 + k));
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                const int bit = 16 * q + k + kk;
                if (tie >> bit & 1)
                    keep |= (uint64_t)((t << 24 | s.v[kk] >> 8) >= thr) << bit;
            }
            tie &= ~(0xfull << (16 * q + k));
        }
    }
    return keep;
}

/* A flag fixed at compile time, and f(Bool<p's dropout>()): loops with
 * and without dropout compiled apart (as with_mod_kind does for the score
 * modifications). */
template <bool V> struct Bool {
    static constexpr bool value = V;
};
template <int V> struct IntC {
    static constexpr int value = V;
};
/* Whether p drops, in kernels compiled for UM (a Lua mod's kernels are
 * compiled for the call, with dropout's code only where it drops:
 * UM::dropout) */
struct NoUserMod;
template <typename UM = NoUserMod> __device__ __forceinline__ bool flash_dropout(const FlashParams &p)
{
    return UM::dropout && p.mod.dropout;
}
template <typename UM = NoUserMod, typename F>
__device__ __forceinline__ void with_dropout(const FlashParams &p, F f)
{
    if (flash_dropout<UM>(p))
        f(Bool<true>());
    else
        f(Bool<false>());
}

/* f(TypeOf<T>(), Bool<EXT>()) for p's element type (f16 or bf16) and
 * whether it needs the extended kernels: the one place the tensor-core
 * launchers turn a call into template arguments. */
#ifndef __CUDACC_RTC__
template <typename F> static ft_status flash_dispatch(const FlashParams &p, F f)
{
    if (flash_extended(p))
        return p.dtype == FT_F16 ? f(TypeOf<__half>(), Bool<true>())
                                 : f(TypeOf<__nv_bfloat16>(), Bool<true>());
    return p.dtype == FT_F16 ? f(TypeOf<__half>(), Bool<false>())
                             : f(TypeOf<__nv_bfloat16>(), Bool<false>());
}
#endif

/* Whether dropout keeps (i, j). */
__device__ __forceinline__ bool flash_keep(const FlashParams &p, int b, int h, int i, int j)
{
    return ft_drop_keep(p.mod.seed, p.mod.offset, p.mod.drop_threshold, (uint32_t)(b * p.H + h),
                        (uint32_t)i, (uint32_t)j);
}

/* Dropout's keep bits of an accumulator fragment in mod_acc's layout: bit
 * e for entry e = 4 n + 2 r + c (row g + 8 r, column 8 n + 2 t4 + c; N <=
 * 64). A call (drop_draw16) gives one query's sixteen keys, which 8 (rows
 * queries) or 16 (KEY_ROWS: rows keys, the dK/dV kernels) entries of the
 * fragment hold, spread over 4 or 8 lanes: each lane draws its share of
 * the calls, decides its ties, and shuffles hand every lane the bits of
 * its entries. One call sixteen entries, every byte used. The calls are a
 * rolled loop: unrolled, their registers were live together and the
 * kernels spilled. Every lane of the warp calls it; rows queries need
 * col0 % 16 == 0, KEY_ROWS row0 % 16 == 0. */
template <int N, bool KEY_ROWS = false>
__device__ __forceinline__ uint64_t keep_bits(const FlashParams &p, int b, int h, int row0,
                                              int col0)
{
    static_assert(N <= 64 && N % 4 == 0, "one word of keep bits, whole groups of eight columns");
    const int lane = threadIdx.x % FT_WARP, g = lane / 4, t4 = lane % 4;
    const uint32_t bh = (uint32_t)(b * p.H + h);
    uint64_t keep = 0, tie = 0, bits = 0;
    if (KEY_ROWS) {
        /* A query's calls: the warp's 16 keys, bits g and g + 8 for each of
         * the 8 lanes of its t4. The Y = N / 2 columns y (query 8 (y / 2) +
         * 2 t4 + y % 2) of a t4: lane g draws y = g + 8 q in call q. */
        constexpr int Y = N / 2, CALLS = (Y + 7) / 8;
        auto at = [&](int q, int &i, int &j16) {
            const int y = g + 8 * q;
            i = col0 + 8 * (y >> 1) + 2 * t4 + (y & 1), j16 = row0;
        };
#pragma unroll 1
        for (int q = 0; q < CALLS; q++) {
            int i, j16;
            at(q, i, j16);
            uint32_t t;
            keep |= (uint64_t)drop_draw16(p, bh, i, j16, &t) << 16 * q;
            if (g + 8 * q < Y)
                tie |= (uint64_t)t << 16 * q;
        }
        keep = drop_untie(p, bh, keep, tie, at);
#pragma unroll
        for (int w = 0; w < (CALLS + 1) / 2; w++) { /* calls 2 w and 2 w + 1 */
            const uint32_t mine = (uint32_t)(keep >> 32 * w);
#pragma unroll
            for (int gs = 0; gs < 8; gs++) { /* lane (gs, t4) drew y = gs + 8 q */
                const uint32_t x = __shfl_sync(0xffffffffu, mine, 4 * gs + t4) >> g & 0x01010101u;
                /* keys g, g + 8 of call 2 w (bits 0, 8) and 2 w + 1 (16, 24)
                 * to entries 0, 2 and 16, 18 past 4 n + c of call 2 w's y */
                const uint32_t y = (x & 0x00010001u) | (x >> 6 & 0x00040004u);
                bits |= (uint64_t)y << (32 * w + 4 * (gs >> 1) + (gs & 1));
            }
        }
    } else {
        /* A row's calls: 16 keys, 2 t4, 2 t4 + 1, 8 + 2 t4, 9 + 2 t4 for
         * each lane of its quad. The quad's 2 G calls (row half r, group
         * gi): lane t4 draws (r, gi) = (ci % 2, ci / 2), ci = 4 q + t4. */
        constexpr int G = (N + 7) / 8, CALLS = (2 * G + 3) / 4;
        auto at = [&](int q, int &i, int &j16) {
            const int ci = 4 * q + t4;
            i = row0 + g + 8 * (ci & 1), j16 = col0 + 16 * (ci >> 1);
        };
#pragma unroll 1
        for (int q = 0; q < CALLS; q++) {
            int i, j16;
            at(q, i, j16);
            uint32_t t;
            keep |= (uint64_t)drop_draw16(p, bh, i, j16, &t) << 16 * q;
            if ((4 * q + t4) >> 1 < G)
                tie |= (uint64_t)t << 16 * q;
        }
        keep = drop_untie(p, bh, keep, tie, at);
#pragma unroll
        for (int w = 0; w < (CALLS + 1) / 2; w++) {
            const uint32_t mine = (uint32_t)(keep >> 32 * w);
#pragma unroll
            for (int s = 0; s < 4; s++) { /* lane s drew (s % 2, 4 w + s / 2), then gi + 2 */
                const uint32_t x =
                    __shfl_sync(0xffffffffu, mine, (lane & ~3) | s) >> 2 * t4 & 0x03030303u;
                /* pairs at bits 0, 8 (call 2 w) and 16, 24 (2 w + 1) to
                 * entries 0, 4 and 16, 20 past 8 gi + 2 r */
                const uint32_t y = (x & 0x00030003u) | (x >> 4 & 0x00300030u);
                bits |= (uint64_t)y << (8 * (4 * w + (s >> 1)) + 2 * (s & 1));
            }
        }
    }
    return N == 64 ? bits : bits & ((1ull << N) - 1);
}

/* Entry i's dropout factor: 1 / (1 - p) where kept, else 0. */
__device__ __forceinline__ float drop_factor(const FlashParams &p, uint64_t bits, int i)
{
    return (bits >> i) & 1 ? (float)p.mod.drop_scale : 0.f;
}

/* Dropout over an accumulator fragment of probabilities (rows queries);
 * a word of keep bits takes 64 entries (128 columns) at a time. */
template <int N>
__device__ __forceinline__ void drop_acc(const FlashParams &p, int b, int h, float *acc, int row0,
                                         int col0)
{
    if constexpr (N > 64) {
        drop_acc<64>(p, b, h, acc, row0, col0);
        drop_acc<N - 64>(p, b, h, acc + 64, row0, col0 + 128);
    } else {
        const uint64_t bits = keep_bits<N>(p, b, h, row0, col0);
#pragma unroll
        for (int i = 0; i < N; i++)
            acc[i] *= drop_factor(p, bits, i);
    }
}

/* A modification written in Lua, as rtc.cu generates it: prepare(b, h)
 * works out once what a (batch, head) tile shares (reads at indices of b
 * and h alone: a per-head slope) into a Ctx; score(ctx, i, j, fi, fj, x,
 * &dx) takes the scaled score x (after the built-in variants) and gives
 * the new one and its derivative in x; keep(ctx, i, j, fi, fj) the mask.
 * Indices are 0-based here (i, j within the sequence), and come as floats
 * too, 1-based as in Lua (fi = i + 1, fj = j + 1: what the mod's arithmetic
 * on positions takes, with no conversion a score); has_score is
 * false for a mask alone (whose backward needs no derivative, so runs in
 * the plain instantiations). With has_grad, grad(b, h, i, j, x, g, st)
 * adds g times the score's derivatives in the values it read from float
 * tensors into their gradients (the dK/dV kernel calls it with g = dL /
 * d score): into a thread's running sum in st while the element stays the
 * same (a per-head table: one atomic a thread and head, not one a score),
 * with an atomic when it moves on and in grad_flush(st) at the end
 * (grad takes fi, fj after i, j as score does). The
 * kernels compiled ahead of time take NoUserMod, whose code never runs. */
struct NoUserMod {
    static constexpr bool on = false, has_score = false, has_grad = false, unit_grad = false;
    static constexpr bool has_bound = false; /* a Lua score's narrow range, its top */
    static constexpr float bound = 0.f;
    static constexpr bool builtin_scores = true; /* compiled with the built-in variants */
    static constexpr bool has_mask = false;
    static constexpr bool debug = false; /* compiled with bounds-checked reads */
    static constexpr bool dropout = true; /* compiled with dropout's code */
    struct GradState {};
    struct Ctx {};
    static __device__ __forceinline__ Ctx prepare(int, int) { return Ctx(); }
    static __device__ __forceinline__ float score(const Ctx &, int, int, float, float, float x,
                                                  float *dx)
    {
        *dx = 1.f;
        return x;
    }
    static __device__ __forceinline__ bool keep(const Ctx &, int, int, float, float) { return true; }
    static __device__ __forceinline__ void grad(const Ctx &, int, int, float, float, float, float,
                                                GradState &)
    {
    }
    static __device__ __forceinline__ void grad_flush(GradState &) {}
};

/* The modification over an accumulator fragment in the C layout of
 * mma.sync and wgmma: entry i is row row0 + g + 8 ((i / 2) % 2), column
 * col0 + 8 (i / 4) + 2 t + i % 2 (g = lane / 4, t = lane % 4). Rows are
 * queries and columns keys, or (KEY_ROWS) the transposed products of the
 * dK/dV kernels. sink(k, d0, d1) takes the derivatives of entries 2 k and
 * 2 k + 1 (a row's neighbours); mod_acc drops them or stores them in grad.
 * um_in (UM::has_grad): the scores the Lua-written mod took, entry by
 * entry, for UM::grad. BUILTIN false: a kernel without the built-in
 * variants (not EXT), so only UM acts; the same where UM was compiled for
 * calls without built-in score variants (UM::builtin_scores false: a Lua
 * softcap's dK/dV kernel spilled 92 bytes with the four kinds' code). */
template <int N, bool KEY_ROWS, bool FAST = false, typename UM = NoUserMod, bool BUILTIN = true,
          typename Sink>
__device__ __forceinline__ void mod_acc_with(const ScoreMod &m, float *acc, int row0, int col0,
                                             Sink sink, float *um_in = nullptr)
{
    const int lane = threadIdx.x % FT_WARP, g = lane / 4, t4 = lane % 4;
    /* positions as floats: two rows, and the columns from one base */
    float rpos[2];
#pragma unroll
    for (int r = 0; r < 2; r++)
        rpos[r] = KEY_ROWS ? (float)(row0 + g + 8 * r) : m.pos(row0 + g + 8 * r);
    const float cbase = KEY_ROWS ? m.pos(col0 + 2 * t4) : (float)(col0 + 2 * t4);
    /* ALiBi's distance from the rows' offsets to the first column: the
     * distance to column K is then |off - K| with K a constant, one
     * subtraction a score fewer than forming each column's position
     * (exact: integers below 2^24, so the same bits) */
    float off[2];
#pragma unroll
    for (int r = 0; r < 2; r++)
        off[r] = rpos[r] - cbase;
    /* and for UM, the indices as floats, 1-based (Lua's i and j) */
    float urow[2];
#pragma unroll
    for (int r = 0; r < 2; r++)
        urow[r] = UM::on ? (float)(row0 + g + 8 * r + 1) : 0.f;
    const float ucol = UM::on ? (float)(col0 + 2 * t4 + 1) : 0.f;
    const typename UM::Ctx uc = UM::prepare(m.b, m.h);
    /* the fragment inside the mask's inner band: no mask to evaluate */
    const long long q0 = KEY_ROWS ? col0 : row0, q1 = q0 + (KEY_ROWS ? 2 * N : 16);
    const long long k0 = KEY_ROWS ? row0 : col0, k1 = k0 + (KEY_ROWS ? 16 : 2 * N);
    const bool inside = m.um_left >= 0 && k0 - (q1 - 1) - m.shift >= -(long long)m.um_left &&
                        (k1 - 1) - q0 - m.shift <= (long long)m.um_right;
    auto body = [&](auto kind, auto mask) {
#pragma unroll
        for (int k = 0; k < N / 2; k++) {
            float d[2];
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int i = 2 * k + e;
                acc[i] = m.apply(kind, acc[i], off[(i / 2) % 2], (float)(8 * (i / 4) + e), &d[e]);
                if (UM::on) { /* then the Lua-written one, on the scaled score */
                    const int r = row0 + g + 8 * ((i / 2) % 2), c = col0 + 8 * (i / 4) + 2 * t4 + e;
                    int qi = KEY_ROWS ? c : r, kj = KEY_ROWS ? r : c;
                    const float fr = urow[(i / 2) % 2], fc = ucol + (float)(8 * (i / 4) + e);
                    float fq = KEY_ROWS ? fc : fr, fk = KEY_ROWS ? fr : fc;
                    if (UM::debug) { /* a tile's padding (rows past Nq, keys past
                                      * Nk, masked later) as the last real
                                      * position: else its reads count as
                                      * the mod's faults */
                        qi = min(qi, m.nq - 1), kj = min(kj, m.nk - 1);
                        fq = (float)(qi + 1), fk = (float)(kj + 1);
                    }
                    if (decltype(mask)::value && !UM::keep(uc, qi, kj, fq, fk)) {
                        acc[i] = -INFINITY;
                        d[e] = 0.f;
                    } else if (UM::has_score) {
                        float dx;
                        if (UM::has_grad && um_in) /* the dK/dV kernel's */
                            um_in[i] = acc[i] * m.scale;
                        if (UM::unit_grad) /* s + g: g from s = -0 (-0 + g is g
                                            * exactly, so the compiler drops
                                            * the add), added in one FMA */
                            acc[i] = fmaf(UM::score(uc, qi, kj, fq, fk, -0.f, &dx), m.inv_scale,
                                          acc[i]);
                        else {
                            acc[i] = UM::score(uc, qi, kj, fq, fk, acc[i] * m.scale, &dx) *
                                     m.inv_scale;
                            d[e] *= dx;
                        }
                    }
                }
            }
            sink(k, d[0], d[1]);
        }
    };
    auto run = [&](auto kind) {
        if (!UM::has_mask || inside)
            body(kind, Bool<false>());
        else
            body(kind, Bool<true>());
    };
    if (BUILTIN && UM::builtin_scores)
        with_mod_kind<FAST>(m, run);
    else
        run(ModKind<false, false>());
}

template <int N, bool KEY_ROWS = false, bool FAST = false, typename UM = NoUserMod,
          bool BUILTIN = true>
__device__ __forceinline__ void mod_acc(const ScoreMod &m, float *acc, int row0, int col0,
                                        float *grad = nullptr)
{
    mod_acc_with<N, KEY_ROWS, FAST, UM, BUILTIN>(m, acc, row0, col0, [&](int k, float d0, float d1) {
        if (grad) {
            grad[2 * k] = d0;
            grad[2 * k + 1] = d1;
        }
    });
}

#define SIMT_WARPS 4 /* warps per CTA of the SIMT kernels: one query or key row each */
#define FT_SIMT_MAX_COLS 8 /* columns per lane: head_dim up to 8 * 32 = 256 */

#endif
