/*
 * dtype.c - dtype names and sizes, device names, and element conversion.
 *
 * Every conversion goes through double: it holds f32, f16, bf16 and i32
 * exactly, so one rounding step (double -> narrow type) is the only one.
 * Rounding to f16, bf16 and fp8 e4m3 is to nearest, ties to even, done on
 * the bits of the double so that no double rounding through f32 can
 * happen (fp8 e4m3, which has no infinity, saturates finite values at
 * +-448). The conversions themselves are scalar_ops.h's, shared with the
 * CUDA kernels. fp8 e4m3 is a storage dtype: ft_dtype_is_float is 0 for
 * it, so that every operation that computes refuses it.
 */
#include "internal.h"
#include "scalar_ops.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>

/* What a dtype's values are: floats arithmetic takes, integers, or
 * floats held as data only (ft_dtype_is_storage_only). */
enum dtype_kind { KIND_FLOAT, KIND_INT, KIND_STORAGE };

static const struct {
    const char *name;
    size_t size;
    enum dtype_kind kind;
} dtype_info[FT_NUM_DTYPES] = {
    [FT_F64] = {"f64", 8, KIND_FLOAT},  [FT_F32] = {"f32", 4, KIND_FLOAT},
    [FT_F16] = {"f16", 2, KIND_FLOAT},  [FT_BF16] = {"bf16", 2, KIND_FLOAT},
    [FT_I32] = {"i32", 4, KIND_INT},    [FT_I64] = {"i64", 8, KIND_INT},
    [FT_FP8_E4M3] = {"fp8_e4m3", 1, KIND_STORAGE},
};

static const struct {
    const char *alias;
    ft_dtype dtype;
} dtype_aliases[] = {
    {"float64", FT_F64}, {"double", FT_F64},   {"float32", FT_F32},
    {"float", FT_F32},   {"float16", FT_F16},  {"half", FT_F16},
    {"bfloat16", FT_BF16}, {"int32", FT_I32},  {"int", FT_I32},
    {"int64", FT_I64},   {"long", FT_I64},     {"float8_e4m3fn", FT_FP8_E4M3},
    {"e4m3", FT_FP8_E4M3},
};

static int dtype_valid(ft_dtype d) { return d >= 0 && d < FT_NUM_DTYPES; }

size_t ft_dtype_size(ft_dtype d) { return dtype_valid(d) ? dtype_info[d].size : 0; }

const char *ft_dtype_name(ft_dtype d)
{
    return dtype_valid(d) ? dtype_info[d].name : "invalid";
}

int ft_dtype_is_float(ft_dtype d) { return dtype_valid(d) && dtype_info[d].kind == KIND_FLOAT; }

int ft_dtype_is_storage_only(ft_dtype d)
{
    return dtype_valid(d) && dtype_info[d].kind == KIND_STORAGE;
}

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
                   "unknown dtype '%s' (expected f64, f32, f16, bf16, i32, i64 or fp8_e4m3)",
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

/* ---- f16, bf16, fp8 e4m3 and element load and store: the rules of
 * scalar_ops.h, which the CUDA kernels share ---- */

uint16_t ft_f64_to_f16(double x)
{
    return ft_f64_to_small(x, FT_F16_EXP_BITS, FT_F16_MANT_BITS);
}

double ft_f16_to_f64(uint16_t h)
{
    return ft_small_to_f64(h, FT_F16_EXP_BITS, FT_F16_MANT_BITS);
}

uint16_t ft_f64_to_bf16(double x)
{
    return ft_f64_to_small(x, FT_BF16_EXP_BITS, FT_BF16_MANT_BITS);
}

double ft_bf16_to_f64(uint16_t h)
{
    return ft_small_to_f64(h, FT_BF16_EXP_BITS, FT_BF16_MANT_BITS);
}

uint8_t ft_f64_to_fp8_e4m3(double x) { return ft_f64_to_e4m3(x); }

double ft_fp8_e4m3_to_f64(uint8_t b) { return ft_e4m3_to_f64(b); }

double ft_load_f64(const void *p, ft_dtype dtype) { return ft_elem_load(p, 0, dtype); }

void ft_store_f64(void *p, ft_dtype dtype, double v) { ft_elem_store(p, 0, dtype, v); }
