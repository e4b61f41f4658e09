/*
 * scalar_ops.h - the per-element rules that the CPU loops of lib/ and the
 * CUDA kernels of kernels/tensor/ must apply alike, bit for bit: element
 * loads and stores by dtype (f16, bf16 and fp8 e4m3 rounded to nearest
 * even on the bits of the double, fp8 saturated, integers truncated and
 * saturated, NaN -> 0), the clamp of a stored uniform below 1, the
 * elementwise ops, Neumaier's compensated sum and a reduction's result,
 * and the comparison of two elements.
 *
 * Every function is a pure `static inline` function, usable from C and,
 * through FT_HOST_DEVICE (philox.h), from a CUDA kernel, as philox.h and
 * attn_mod.h are; on the device it is inlined into its caller, as the
 * kernels' own helpers are. Dtypes and ops are passed as int, so that C and
 * C++ callers pass their enums alike.
 *
 * Where the two compilers could differ, the device spells out the host's
 * arithmetic: sums and products that must not be fused into an fma are
 * __dadd_rn / __dmul_rn there (ft_add_rn, ft_mul_rn), and x^y for a small
 * integer y is computed exactly (ft_pow_exact), where CUDA's pow may be an
 * ulp off the exact result that the host's pow returns.
 */
#ifndef FT_SCALAR_OPS_H
#define FT_SCALAR_OPS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "flashtile.h" /* the dtype and op enums */
#include "philox.h"    /* FT_HOST_DEVICE */

#ifdef __CUDACC__
#define FT_SCALAR_FN static __forceinline__ FT_HOST_DEVICE
/* fp8's conversions are called, not inlined, on the device: only copies
 * and comparisons meet fp8 there, and every kernel's dtype switch (each
 * unrolled load and store) would otherwise carry them inline, for a
 * longer build of kernels that never see the dtype. */
#define FT_SCALAR_CALLED static __noinline__ FT_HOST_DEVICE
#else
#define FT_SCALAR_FN static inline FT_HOST_DEVICE
#define FT_SCALAR_CALLED static inline FT_HOST_DEVICE
#endif

/* ---- arithmetic that stays unfused on the device ---- */

FT_SCALAR_FN double ft_add_rn(double a, double b)
{
#ifdef __CUDA_ARCH__
    return __dadd_rn(a, b);
#else
    return a + b;
#endif
}

FT_SCALAR_FN double ft_sub_rn(double a, double b)
{
#ifdef __CUDA_ARCH__
    return __dsub_rn(a, b);
#else
    return a - b;
#endif
}

FT_SCALAR_FN double ft_mul_rn(double a, double b)
{
#ifdef __CUDA_ARCH__
    return __dmul_rn(a, b);
#else
    return a * b;
#endif
}

/* The bits of a double, and back. */
FT_SCALAR_FN uint64_t ft_f64_bits(double x)
{
#ifdef __CUDA_ARCH__
    return (uint64_t)__double_as_longlong(x);
#else
    uint64_t bits;
    memcpy(&bits, &x, sizeof bits);
    return bits;
#endif
}

FT_SCALAR_FN double ft_f64_from_bits(uint64_t bits)
{
#ifdef __CUDA_ARCH__
    return __longlong_as_double((long long)bits);
#else
    double x;
    memcpy(&x, &bits, sizeof x);
    return x;
#endif
}

/* ---- small binary floats: f16, bf16 and fp8 e4m3 ---- */

#define FT_F16_EXP_BITS 5
#define FT_F16_MANT_BITS 10
#define FT_BF16_EXP_BITS 8
#define FT_BF16_MANT_BITS 7
/* fp8 e4m3 (the OCP FP8 spec's E4M3, CUDA's __nv_fp8_e4m3, torch's
 * float8_e4m3fn): bias 7 like any 4-bit exponent, but no infinities: the
 * top exponent holds finite values too, up to S.1111.110 = 448, and only
 * S.1111.111 is NaN. The smallest subnormal is 2^-9. */
#define FT_E4M3_EXP_BITS 4
#define FT_E4M3_MANT_BITS 3
#define FT_E4M3_MAX_BITS 0x7e /* 448, the largest finite magnitude */
#define FT_E4M3_NAN_BITS 0x7f

/* The magnitude bits (biased exponent << mant_bits | mantissa) of |x|
 * rounded to nearest, ties to even, on the grid of a binary float of
 * exp_bits exponent and mant_bits mantissa bits; x finite. The rounding is
 * done on the integer significand of the double, so no double rounding
 * through f32 can happen; small values go to subnormals or zero, and a
 * rounding that carries into the next binade carries into the exponent.
 * Magnitudes past the format's top exponent come out as larger codes: the
 * caller makes them infinite or saturates them. */
FT_SCALAR_FN uint32_t ft_f64_round_small(double x, int exp_bits, int mant_bits)
{
    const uint64_t bits = ft_f64_bits(x);
    const int dexp = (int)((bits >> 52) & 0x7ff);
    if (dexp == 0) /* zero, or a subnormal double: far below half the
                      smallest subnormal of any small float, so zero */
        return 0;
    const int bias = (1 << (exp_bits - 1)) - 1;
    const int e = dexp - 1023; /* |x| = sig * 2^(e - 52) */
    const uint64_t sig = (bits & ((1ull << 52) - 1)) | (1ull << 52);
    /* The target's exponent; below the minimum normal the minimum
     * exponent is kept and mantissa bits are lost (subnormal). */
    const int emin = 1 - bias;
    const int shift_exp = e < emin ? emin : e;
    /* q = round(|x| * 2^(mant_bits - shift_exp)) = round(sig >> s). */
    const int s = 52 - mant_bits + shift_exp - e; /* >= 52 - mant_bits */
    uint64_t q;
    if (s >= 64) {
        q = 0; /* sig < 2^53, so sig / 2^64 < 1/2 */
    } else {
        q = sig >> s;
        const uint64_t rem = sig & ((1ull << s) - 1);
        const uint64_t half = 1ull << (s - 1);
        if (rem > half || (rem == half && (q & 1)))
            q++;
    }
    /* A normal q is 2^mant_bits plus the mantissa, so adding the binades
     * above the minimum gives the biased exponent and mantissa at once; a
     * subnormal q (below 2^mant_bits) is its own code, and a q that
     * rounded up to the next power of two moves the exponent by one. */
    return (uint32_t)(q + ((uint64_t)(shift_exp - emin) << mant_bits));
}

/* Rounds x to a binary float of exp_bits exponent and mant_bits mantissa
 * bits with IEEE's infinities (f16, bf16), ties to even, and returns its
 * 1 + exp_bits + mant_bits bit pattern. NaN keeps its sign and becomes
 * quiet, overflow goes to infinity. */
FT_SCALAR_FN uint16_t ft_f64_to_small(double x, int exp_bits, int mant_bits)
{
    const uint64_t bits = ft_f64_bits(x);
    const uint32_t sign = (uint32_t)(bits >> 63) << (exp_bits + mant_bits);
    const int exp_max = (1 << exp_bits) - 1; /* all ones: inf / NaN */
    const uint32_t inf = (uint32_t)exp_max << mant_bits;
    if (((bits >> 52) & 0x7ff) == 0x7ff) /* infinity, or NaN made quiet */
        return (uint16_t)((bits & ((1ull << 52) - 1))
                              ? sign | inf | (1u << (mant_bits - 1))
                              : sign | inf);
    const uint32_t mag = ft_f64_round_small(x, exp_bits, mant_bits);
    return (uint16_t)(sign | (mag >= inf ? inf : mag));
}

/* x as fp8 e4m3 bits, rounded to nearest, ties to even, once from the
 * double. e4m3 has no infinity: finite values past 448 saturate to +-448
 * (PyTorch's eager cast to float8_e4m3fn from 2026 on, Triton's, CUDA's
 * __NV_SATFINITE; older PyTorch gave NaN above 464), while +-inf and NaN
 * become NaN (S.1111.111, the sign kept), as the OCP spec and ONNX's cast
 * table have it (__NV_SATFINITE alone makes inf 448). */
FT_SCALAR_CALLED uint8_t ft_f64_to_e4m3(double x)
{
    const uint64_t bits = ft_f64_bits(x);
    const uint32_t sign = (uint32_t)(bits >> 63) << 7;
    if (((bits >> 52) & 0x7ff) == 0x7ff)
        return (uint8_t)(sign | FT_E4M3_NAN_BITS);
    const uint32_t mag = ft_f64_round_small(x, FT_E4M3_EXP_BITS, FT_E4M3_MANT_BITS);
    return (uint8_t)(sign | (mag > FT_E4M3_MAX_BITS ? FT_E4M3_MAX_BITS : mag));
}

/* 2^e as a double, for e in the normal range. */
FT_SCALAR_FN double ft_pow2(int e)
{
    return ft_f64_from_bits((uint64_t)(e + 1023) << 52);
}

/* The exact double of a small float's finite magnitude bits (as
 * ft_f64_round_small gives them), negated when negative: subnormals are
 * mant * 2^(1 - bias - mant_bits), normals (2^mant_bits + mant) *
 * 2^(biased - bias - mant_bits), a power of two times an integer below
 * 2^11. */
FT_SCALAR_FN double ft_small_finite_to_f64(uint32_t mag, int negative, int exp_bits,
                                           int mant_bits)
{
    const int bias = (1 << (exp_bits - 1)) - 1;
    const int biased = (int)(mag >> mant_bits);
    const uint32_t mant = mag & ((1u << mant_bits) - 1);
    const double v = biased == 0
                         ? (double)mant * ft_pow2(1 - bias - mant_bits)
                         : (double)(mant | (1u << mant_bits)) *
                               ft_pow2(biased - bias - mant_bits);
    return negative ? -v : v;
}

/* The default quiet NaN (0x7ff8...) with the given sign. */
FT_SCALAR_FN double ft_signed_nan(int negative)
{
    return ft_f64_from_bits(((uint64_t)negative << 63) | 0x7ff8000000000000ull);
}

/* The exact double of an f16 or bf16 bit pattern: infinities stay
 * infinite, NaN is the default quiet NaN with h's sign. */
FT_SCALAR_FN double ft_small_to_f64(uint16_t h, int exp_bits, int mant_bits)
{
    const int exp_max = (1 << exp_bits) - 1;
    const int negative = (h >> (exp_bits + mant_bits)) & 1;
    const uint32_t mag = h & ((1u << (exp_bits + mant_bits)) - 1);
    if ((int)(mag >> mant_bits) == exp_max)
        return (mag & ((1u << mant_bits) - 1))
                   ? ft_signed_nan(negative)
                   : ft_f64_from_bits(((uint64_t)negative << 63) | 0x7ff0000000000000ull);
    return ft_small_finite_to_f64(mag, negative, exp_bits, mant_bits);
}

/* The exact double of fp8 e4m3 bits: S.1111.111 is NaN (with its sign),
 * every other pattern finite. */
FT_SCALAR_CALLED double ft_e4m3_to_f64(uint8_t b)
{
    const int negative = b >> 7;
    const uint32_t mag = b & 0x7fu;
    if (mag == FT_E4M3_NAN_BITS)
        return ft_signed_nan(negative);
    return ft_small_finite_to_f64(mag, negative, FT_E4M3_EXP_BITS, FT_E4M3_MANT_BITS);
}

/* ---- integers ---- */

/* Truncation toward zero that saturates at [lo, hi] and sends NaN to 0, so
 * that no value makes the C conversion undefined (lo and hi are exact
 * doubles of the target type's range). */
FT_SCALAR_FN int64_t ft_f64_to_int(double v, double lo, double hi)
{
    if (isnan(v))
        return 0;
    if (v <= lo)
        return (int64_t)lo;
    if (v >= hi)
        return (int64_t)hi;
    return (int64_t)v;
}

/* The same for i64, whose largest value is no double: 2^63 is the first
 * double above INT64_MAX, and every double below it converts exactly. */
FT_SCALAR_FN int64_t ft_f64_to_i64(double v)
{
    if (isnan(v))
        return 0;
    if (v >= 0x1p63)
        return INT64_MAX;
    if (v < -0x1p63)
        return INT64_MIN;
    return (int64_t)v;
}

/* An i64 saturated to i32 (a copy between the integer dtypes, which does
 * not go through the double's 53 bits). */
FT_SCALAR_FN int32_t ft_i64_to_i32(int64_t v)
{
    return (int32_t)(v > INT32_MAX ? INT32_MAX : v < INT32_MIN ? INT32_MIN : v);
}

/* ---- elements by dtype ---- */

/* Element off of the array base of dtype, as a double (exact for every
 * dtype but i64 beyond 2^53); NaN for an invalid dtype. */
FT_SCALAR_FN double ft_elem_load(const void *base, int64_t off, int dtype)
{
    switch (dtype) {
    case FT_F64: return ((const double *)base)[off];
    case FT_F32: return (double)((const float *)base)[off];
    case FT_F16:
        return ft_small_to_f64(((const uint16_t *)base)[off], FT_F16_EXP_BITS,
                               FT_F16_MANT_BITS);
    case FT_BF16:
        return ft_small_to_f64(((const uint16_t *)base)[off], FT_BF16_EXP_BITS,
                               FT_BF16_MANT_BITS);
    case FT_I32: return (double)((const int32_t *)base)[off];
    case FT_I64: return (double)((const int64_t *)base)[off];
    case FT_FP8_E4M3: return ft_e4m3_to_f64(((const uint8_t *)base)[off]);
    default: return NAN;
    }
}

/* Stores v as element off of the array base of dtype: floats rounded to
 * nearest even (fp8 e4m3 saturated, see ft_f64_to_e4m3), integers
 * truncated and saturated (NaN -> 0). */
FT_SCALAR_FN void ft_elem_store(void *base, int64_t off, int dtype, double v)
{
    switch (dtype) {
    case FT_F64: ((double *)base)[off] = v; break;
    case FT_F32: ((float *)base)[off] = (float)v; break;
    case FT_F16:
        ((uint16_t *)base)[off] =
            ft_f64_to_small(v, FT_F16_EXP_BITS, FT_F16_MANT_BITS);
        break;
    case FT_BF16:
        ((uint16_t *)base)[off] =
            ft_f64_to_small(v, FT_BF16_EXP_BITS, FT_BF16_MANT_BITS);
        break;
    case FT_I32:
        ((int32_t *)base)[off] =
            (int32_t)ft_f64_to_int(v, (double)INT32_MIN, (double)INT32_MAX);
        break;
    case FT_I64: ((int64_t *)base)[off] = ft_f64_to_i64(v); break;
    case FT_FP8_E4M3: ((uint8_t *)base)[off] = ft_f64_to_e4m3(v); break;
    default: break;
    }
}

/* v as dtype would hold it (the float dtypes; others unchanged). */
FT_SCALAR_FN double ft_round_to_dtype(double v, int dtype)
{
    switch (dtype) {
    case FT_F32: return (double)(float)v;
    case FT_F16:
        return ft_small_to_f64(ft_f64_to_small(v, FT_F16_EXP_BITS, FT_F16_MANT_BITS),
                               FT_F16_EXP_BITS, FT_F16_MANT_BITS);
    case FT_BF16:
        return ft_small_to_f64(ft_f64_to_small(v, FT_BF16_EXP_BITS, FT_BF16_MANT_BITS),
                               FT_BF16_EXP_BITS, FT_BF16_MANT_BITS);
    case FT_FP8_E4M3: return ft_e4m3_to_f64(ft_f64_to_e4m3(v));
    default: return v;
    }
}

/* A uniform u in [0, 1) as it is to be stored in dtype: u, or the largest
 * value below 1 that dtype holds where dtype would round u up to 1 (f16
 * 1 - 2^-11, 0x3BFF; bf16 1 - 2^-8, 0x3F7F), as rand promises [0, 1).
 * f32 and f64 hold every uniform (k * 2^-24) exactly. */
FT_SCALAR_FN double ft_uniform_for_dtype(double u, int dtype)
{
    const double below_one = dtype == FT_F16    ? 1.0 - 1.0 / 2048.0
                             : dtype == FT_BF16 ? 1.0 - 1.0 / 256.0
                                                : 0.0;
    return below_one > 0.0 && ft_round_to_dtype(u, dtype) >= 1.0 ? below_one : u;
}

/* ---- elementwise ops, in double ---- */

#ifdef __CUDACC__
/* x^y that is exact whenever y is a small integer and x^y is a double (a
 * power of an f16, bf16 or small f32 often is): such a result is computed
 * by repeated squaring, every product checked exact with an fma. The
 * host's pow returns exact results exactly; CUDA's pow may be an ulp off
 * them, which an f16/bf16 store at a rounding tie turns into a whole ulp
 * of the narrow type. Everything else goes to CUDA's pow. */
static __forceinline__ __device__ double ft_pow_exact(double x, double y)
{
    if (isfinite(x) && x != 0.0 && y != 0.0 && fabs(y) <= 64.0 &&
        y == rint(y)) {
        unsigned n = (unsigned)fabs(y);
        double result = 1.0, base = x;
        bool exact = true;
        for (;;) {
            if (n & 1) {
                const double p = __dmul_rn(result, base);
                exact = exact && isfinite(p) && fabs(p) >= 0x1p-969 &&
                        __fma_rn(result, base, -p) == 0.0;
                result = p;
            }
            n >>= 1;
            if (n == 0)
                break;
            const double sq = __dmul_rn(base, base);
            exact = exact && isfinite(sq) && fabs(sq) >= 0x1p-969 &&
                    __fma_rn(base, base, -sq) == 0.0;
            base = sq;
        }
        if (exact) /* x^-n: one correctly rounded division of an exact x^n */
            return y > 0.0 ? result : __ddiv_rn(1.0, result);
    }
    return pow(x, y);
}
#endif

/* x op y for an ft_binop; NaN for an unknown op. */
FT_SCALAR_FN double ft_apply_binop(int op, double x, double y)
{
    switch (op) {
    case FT_ADD: return x + y;
    case FT_SUB: return x - y;
    case FT_MUL: return x * y;
    case FT_DIV: return x / y;
#ifdef __CUDA_ARCH__
    case FT_POW: return ft_pow_exact(x, y);
#else
    case FT_POW: return pow(x, y);
#endif
    /* maximum/minimum propagate NaN, as torch.maximum does (fmax would not). */
    case FT_MAXIMUM: return isnan(x) || isnan(y) ? x + y : (x > y ? x : y);
    case FT_MINIMUM: return isnan(x) || isnan(y) ? x + y : (x < y ? x : y);
    default: return NAN;
    }
}

/* op x for an ft_unop; NaN for an unknown op. */
FT_SCALAR_FN double ft_apply_unop(int op, double x)
{
    switch (op) {
    case FT_NEG: return -x;
    case FT_EXP: return exp(x);
    case FT_LOG: return log(x);
    case FT_ABS: return fabs(x);
    case FT_SQRT: return sqrt(x);
    case FT_TANH: return tanh(x);
    /* exp(-x) overflows to inf for very negative x, giving 0: no NaN. */
    case FT_SIGMOID: return 1.0 / (1.0 + exp(-x));
    case FT_RELU: return x > 0.0 || isnan(x) ? x : 0.0;
    default: return NAN;
    }
}

/* ---- sums and reductions ---- */

/* Neumaier's compensated sum: adds v to *sum and the rounding error of
 * that addition to *comp, so that 1e6 f32-sized terms sum to about double
 * precision. */
FT_SCALAR_FN void ft_ksum_add(double *sum, double *comp, double v)
{
    const double t = ft_add_rn(*sum, v);
    if (fabs(*sum) >= fabs(v))
        *comp = ft_add_rn(*comp, ft_add_rn(ft_sub_rn(*sum, t), v));
    else
        *comp = ft_add_rn(*comp, ft_add_rn(ft_sub_rn(v, t), *sum));
    *sum = t;
}

/* The compensated sum's value. Once the sum is inf or NaN the compensation
 * is NaN; the plain sum is then the right answer. */
FT_SCALAR_FN double ft_ksum_result(double sum, double comp)
{
    return isfinite(sum) ? ft_add_rn(sum, comp) : sum;
}

/* The result of an ft_reduce_op over count elements: from the compensated
 * sum (sum, comp) of the elements (SUM, MEAN) or of their squares (NORM),
 * or the extreme (MAX, MIN). The mean of nothing is NaN (0/0), as in
 * torch. */
FT_SCALAR_FN double ft_reduce_result(int op, double sum, double comp,
                                     double extreme, int64_t count)
{
    switch (op) {
    case FT_SUM: return ft_ksum_result(sum, comp);
    case FT_MEAN: return ft_ksum_result(sum, comp) / (double)count;
    case FT_NORM: return sqrt(ft_ksum_result(sum, comp));
    case FT_MAX:
    case FT_MIN: return extreme;
    default: return NAN;
    }
}

/* ---- comparing two elements ---- */

/* |x - y| for ft_max_abs_diff: equal values (infinities included) differ
 * by 0; NaN when either is NaN. */
FT_SCALAR_FN double ft_abs_diff(double x, double y)
{
    if (isnan(x) || isnan(y))
        return NAN;
    return x == y ? 0.0 : fabs(x - y);
}

/* Whether x is close to y for ft_allclose: |x - y| <= atol + rtol |y|; an
 * infinity is close only to itself, a NaN to nothing. */
FT_SCALAR_FN int ft_is_close(double x, double y, double rtol, double atol)
{
    if (isnan(x) || isnan(y))
        return 0;
    if (isinf(x) || isinf(y))
        return x == y;
    return fabs(x - y) <= ft_add_rn(atol, ft_mul_rn(rtol, fabs(y)));
}

#endif /* FT_SCALAR_OPS_H */
