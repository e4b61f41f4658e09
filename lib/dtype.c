/*
 * dtype.c - dtype names and sizes, device names, and element conversion.
 *
 * Every conversion goes through double: it holds f32, f16, bf16 and i32
 * exactly, so one rounding step (double -> narrow type) is the only one.
 * Rounding to f16 and bf16 is to nearest, ties to even, done on the bits
 * of the double so that no double rounding through f32 can happen.
 */
#include "internal.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

static const struct {
    const char *name;
    size_t size;
    int is_float;
} dtype_info[FT_NUM_DTYPES] = {
    [FT_F64] = {"f64", 8, 1},  [FT_F32] = {"f32", 4, 1},
    [FT_F16] = {"f16", 2, 1},  [FT_BF16] = {"bf16", 2, 1},
    [FT_I32] = {"i32", 4, 0},  [FT_I64] = {"i64", 8, 0},
};

static const struct {
    const char *alias;
    ft_dtype dtype;
} dtype_aliases[] = {
    {"float64", FT_F64}, {"double", FT_F64},   {"float32", FT_F32},
    {"float", FT_F32},   {"float16", FT_F16},  {"half", FT_F16},
    {"bfloat16", FT_BF16}, {"int32", FT_I32},  {"int", FT_I32},
    {"int64", FT_I64},   {"long", FT_I64},
};

static int dtype_valid(ft_dtype d) { return d >= 0 && d < FT_NUM_DTYPES; }

size_t ft_dtype_size(ft_dtype d) { return dtype_valid(d) ? dtype_info[d].size : 0; }

const char *ft_dtype_name(ft_dtype d)
{
    return dtype_valid(d) ? dtype_info[d].name : "invalid";
}

int ft_dtype_is_float(ft_dtype d) { return dtype_valid(d) && dtype_info[d].is_float; }

ft_status ft_dtype_parse(const char *name, ft_dtype *out)
{
    if (!name)
        return ft_fail(FT_ERR_ARGUMENT, "ft_dtype_parse", 1, "dtype name expected");
    if (!out)
        return ft_fail(FT_ERR_ARGUMENT, "ft_dtype_parse", 0, "result pointer is NULL");
    for (int d = 0; d < FT_NUM_DTYPES; d++)
        if (strcmp(name, dtype_info[d].name) == 0) {
            *out = (ft_dtype)d;
            return FT_OK;
        }
    for (size_t i = 0; i < sizeof dtype_aliases / sizeof dtype_aliases[0]; i++)
        if (strcmp(name, dtype_aliases[i].alias) == 0) {
            *out = dtype_aliases[i].dtype;
            return FT_OK;
        }
    return ft_fail(FT_ERR_ARGUMENT, "ft_dtype_parse", 1,
                   "unknown dtype '%s' (expected f64, f32, f16, bf16, i32 or i64)",
                   name);
}

/* The N of "cuda:N": decimal digits only (no sign, space or other
 * character), at most INT_MAX. Returns 0, or -1 with *why set. */
static int parse_cuda_index(const char *s, int *index, const char **why)
{
    if (*s == '\0') {
        *why = "the device index after 'cuda:' is missing";
        return -1;
    }
    long long v = 0;
    for (const char *p = s; *p; p++) {
        if (*p < '0' || *p > '9') {
            *why = "the device index must be decimal digits only";
            return -1;
        }
        v = v * 10 + (*p - '0');
        if (v > INT_MAX) {
            *why = "the device index is too large";
            return -1;
        }
    }
    *index = (int)v;
    return 0;
}

ft_status ft_device_parse(const char *name, ft_device *out)
{
    if (!name)
        return ft_fail(FT_ERR_ARGUMENT, "ft_device_parse", 1, "device name expected");
    if (!out)
        return ft_fail(FT_ERR_ARGUMENT, "ft_device_parse", 0, "result pointer is NULL");
    if (strcmp(name, "cpu") == 0) {
        *out = (ft_device){FT_CPU, 0};
        return FT_OK;
    }
    int index = 0;
    if (strncmp(name, "cuda:", 5) == 0) {
        const char *why = NULL;
        if (parse_cuda_index(name + 5, &index, &why) != 0)
            return ft_fail(FT_ERR_ARGUMENT, "ft_device_parse", 1,
                           "invalid device '%.40s%s': %s (expected 'cuda:N', N from 0)",
                           name, strlen(name) > 40 ? "..." : "", why);
    } else if (strcmp(name, "cuda") != 0) {
        return ft_fail(FT_ERR_ARGUMENT, "ft_device_parse", 1,
                       "unknown device '%.40s%s' (expected 'cpu', 'cuda' or 'cuda:N')",
                       name, strlen(name) > 40 ? "..." : "");
    }
    if (!ft_cuda_built())
        return ft_fail(FT_ERR_UNSUPPORTED, "ft_device_parse", 1,
                       "device '%s': flashtile was built without CUDA", name);
    ft_status st = ft_cuda_device_check("ft_device_parse", 1, index);
    if (st != FT_OK) {
        char why[256];
        snprintf(why, sizeof why, "%s", ft_last_error_detail());
        return ft_fail(st, "ft_device_parse", 1, "device '%s': %s", name, why);
    }
    *out = (ft_device){FT_CUDA, index};
    return FT_OK;
}

char *ft_device_name(ft_device device, char *buf, size_t size)
{
    if (!buf || size == 0)
        return buf;
    if (device.type == FT_CPU)
        snprintf(buf, size, "cpu");
    else
        snprintf(buf, size, "cuda:%d", device.index);
    return buf;
}

int ft_device_equal(ft_device a, ft_device b)
{
    return a.type == b.type && a.index == b.index;
}

/* ---- f16 and bf16 ---- */

/* Rounds the double x to a binary float with mant_bits explicit mantissa
 * bits, exponent bias exp_bias and exp_bits exponent bits, returning the
 * 1 + exp_bits + mant_bits bit pattern. Ties go to even. Handles NaN,
 * infinities, overflow to infinity, subnormals and underflow to zero. */
static uint16_t round_to_small_float(double x, int exp_bits, int mant_bits)
{
    uint64_t bits;
    memcpy(&bits, &x, sizeof bits);
    const uint16_t sign = (uint16_t)((bits >> 63) << (exp_bits + mant_bits));
    const int exp_max = (1 << exp_bits) - 1; /* all ones: inf / NaN */
    const int bias = (1 << (exp_bits - 1)) - 1;
    const uint16_t inf = (uint16_t)(exp_max << mant_bits);

    if (isnan(x)) /* a quiet NaN, keeping the sign */
        return (uint16_t)(sign | inf | (1u << (mant_bits - 1)));
    double a = fabs(x);
    if (isinf(a))
        return sign | inf;
    if (a == 0.0)
        return sign;

    /* a = m * 2^e with m in [1, 2) (ilogb handles subnormal doubles). */
    int e = ilogb(a);
    /* The target's exponent; below the minimum normal we keep the
     * minimum exponent and lose mantissa bits (subnormal). */
    int emin = 1 - bias;
    int shift_exp = e < emin ? emin : e;
    /* Scale so that the integer part holds the mantissa bits kept. */
    double scaled = ldexp(a, mant_bits - shift_exp);
    double r = nearbyint(scaled); /* the FPU default mode: ties to even */
    uint64_t q = (uint64_t)r;
    /* q in [2^mant_bits, 2^(mant_bits+1)] for normals; rounding up may
     * carry into the next binade. */
    if (q >= (2ull << mant_bits)) {
        q >>= 1;
        shift_exp++;
    }
    if (q < (1ull << mant_bits)) /* subnormal (or rounded to zero) */
        return (uint16_t)(sign | q);
    int biased = shift_exp + bias;
    if (biased >= exp_max)
        return sign | inf;
    return (uint16_t)(sign | ((uint16_t)biased << mant_bits) |
                      (q & ((1ull << mant_bits) - 1)));
}

static double small_float_to_f64(uint16_t h, int exp_bits, int mant_bits)
{
    const int exp_max = (1 << exp_bits) - 1;
    const int bias = (1 << (exp_bits - 1)) - 1;
    int sign = (h >> (exp_bits + mant_bits)) & 1;
    int biased = (h >> mant_bits) & exp_max;
    uint32_t mant = h & ((1u << mant_bits) - 1);
    double v;
    if (biased == exp_max)
        v = mant ? NAN : INFINITY;
    else if (biased == 0)
        v = ldexp((double)mant, 1 - bias - mant_bits);
    else
        v = ldexp((double)(mant | (1u << mant_bits)), biased - bias - mant_bits);
    return sign ? -v : v;
}

#define F16_EXP_BITS 5
#define F16_MANT_BITS 10
#define BF16_EXP_BITS 8
#define BF16_MANT_BITS 7

uint16_t ft_f64_to_f16(double x) { return round_to_small_float(x, F16_EXP_BITS, F16_MANT_BITS); }
double ft_f16_to_f64(uint16_t h) { return small_float_to_f64(h, F16_EXP_BITS, F16_MANT_BITS); }
uint16_t ft_f64_to_bf16(double x) { return round_to_small_float(x, BF16_EXP_BITS, BF16_MANT_BITS); }
double ft_bf16_to_f64(uint16_t h) { return small_float_to_f64(h, BF16_EXP_BITS, BF16_MANT_BITS); }

/* ---- element load and store ---- */

double ft_load_f64(const void *p, ft_dtype dtype)
{
    switch (dtype) {
    case FT_F64: return *(const double *)p;
    case FT_F32: return *(const float *)p;
    case FT_F16: return ft_f16_to_f64(*(const uint16_t *)p);
    case FT_BF16: return ft_bf16_to_f64(*(const uint16_t *)p);
    case FT_I32: return *(const int32_t *)p;
    case FT_I64: return (double)*(const int64_t *)p;
    default: return NAN;
    }
}

/* Truncation toward zero that saturates and sends NaN to 0, so that no
 * value makes the C conversion undefined. */
static int64_t double_to_int(double v, double lo, double hi)
{
    if (isnan(v))
        return 0;
    if (v <= lo)
        return (int64_t)lo;
    if (v >= hi)
        return (int64_t)hi;
    return (int64_t)v;
}

void ft_store_f64(void *p, ft_dtype dtype, double v)
{
    switch (dtype) {
    case FT_F64: *(double *)p = v; break;
    case FT_F32: *(float *)p = (float)v; break;
    case FT_F16: *(uint16_t *)p = ft_f64_to_f16(v); break;
    case FT_BF16: *(uint16_t *)p = ft_f64_to_bf16(v); break;
    case FT_I32: *(int32_t *)p = (int32_t)double_to_int(v, INT32_MIN, INT32_MAX); break;
    /* 2^63 is the first double above INT64_MAX; the largest below it is
     * 2^63 - 1024, which converts exactly. */
    case FT_I64:
        if (isnan(v)) *(int64_t *)p = 0;
        else if (v >= 0x1p63) *(int64_t *)p = INT64_MAX;
        else if (v < -0x1p63) *(int64_t *)p = INT64_MIN;
        else *(int64_t *)p = (int64_t)v;
        break;
    default: break;
    }
}
