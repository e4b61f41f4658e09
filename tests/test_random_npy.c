/*
 * test_random_npy.c - checks of lib/philox.h, lib/random.c and lib/npy.c:
 * the Philox 4x32-10 known-answer vectors of Random123, the layout and
 * properties of the ft_rand / ft_randn stream, and .npy round trips and
 * rejections. Prints a line per failed check to stderr; exits nonzero if
 * any failed. Temporary files go under $TMPDIR (else /tmp).
 */
#define _POSIX_C_SOURCE 200809L /* mkstemp, close, unlink */

#include "flashtile.h"
#include "philox.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define STAT_N 100000   /* samples for the mean/variance checks */
#define MEAN_TOL 0.02   /* ~6 standard errors of a mean of STAT_N normals */
#define VAR_TOL 0.03    /* ~7 standard errors of their variance */
#define UNIFORM_MEAN_TOL 0.01
#define PATH_CAP 4096

#include "check.h"
#include "tensor_files.h"

/* ---- helpers ---- */

static ft_tensor *empty1(ft_dtype dtype, int64_t n)
{
    return empty(dtype, 1, (const int64_t[]){n});
}

/* Writes a .npy file by hand: version major.0 with dict as given (no
 * padding added), then n bytes of data. */
static void write_npy(const char *path, int major, const char *dict,
                      const void *data, size_t n)
{
    unsigned char buf[1024];
    size_t dict_len = strlen(dict), pos = 0;
    memcpy(buf, "\x93NUMPY", 6);
    buf[6] = (unsigned char)major;
    buf[7] = 0;
    pos = 8;
    size_t len_bytes = major == 1 ? 2 : 4;
    for (size_t b = 0; b < len_bytes; b++)
        buf[pos++] = (unsigned char)(dict_len >> (8 * b));
    memcpy(buf + pos, dict, dict_len);
    pos += dict_len;
    if (n > 0)
        memcpy(buf + pos, data, n);
    write_bytes(path, buf, pos + n);
}

/* ---- Philox ---- */

static void test_philox_kat(void)
{
    /* Random123 tests/kat_vectors, "philox4x32 10" lines: counter, key,
     * expected output. */
    static const struct {
        uint32_t ctr[4], key[2], want[4];
    } kat[] = {
        {{0, 0, 0, 0}, {0, 0},
         {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
        {{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
         {0xffffffffu, 0xffffffffu},
         {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
        {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
         {0xa4093822u, 0x299f31d0u},
         {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
    };
    for (size_t k = 0; k < sizeof kat / sizeof kat[0]; k++) {
        ft_philox4 r = ft_philox4x32_10(kat[k].ctr, kat[k].key);
        for (int w = 0; w < 4; w++)
            CHECK(r.v[w] == kat[k].want[w], "KAT %zu word %d: %08x, want %08x",
                  k, w, r.v[w], kat[k].want[w]);
    }

    /* The uniform conversion: top 24 bits times 2^-24. */
    CHECK(ft_philox_uniform(0) == 0.0f, "uniform(0)");
    CHECK(ft_philox_uniform(0xffu) == 0.0f, "low bits are dropped");
    CHECK(ft_philox_uniform(0x100u) == 0x1p-24f, "uniform(0x100)");
    CHECK(ft_philox_uniform(0xffffffffu) == 1.0f - 0x1p-24f,
          "uniform(max) = %.9g", (double)ft_philox_uniform(0xffffffffu));

    /* Box-Muller: the pair lies on a circle of radius sqrt(-2 log(1-u0)),
     * at angle 2 pi u1; u0 = 0 gives radius 0 without log(0). */
    double z0, z1;
    ft_philox_box_muller(0.0f, 0.25f, &z0, &z1);
    CHECK(z0 == 0.0 && fabs(z1) == 0.0, "radius 0: %g %g", z0, z1);
    ft_philox_box_muller(0.5f, 0.25f, &z0, &z1);
    CHECK(fabs(z0) < 1e-15 && fabs(z1 - sqrt(2.0 * log(2.0))) < 1e-15,
          "quarter turn: %g %g", z0, z1);
    ft_philox_box_muller(1.0f - 0x1p-24f, 0.0f, &z0, &z1);
    CHECK(isfinite(z0) && z0 > 5.7 && z0 < 5.8, "largest radius %g", z0);
}

/* ---- the random stream ---- */

static void test_counters(void)
{
    CHECK(ft_random_counters(0) == 0, "counters(0)");
    CHECK(ft_random_counters(-5) == 0, "counters(-5)");
    CHECK(ft_random_counters(1) == 1, "counters(1)");
    CHECK(ft_random_counters(4) == 1, "counters(4)");
    CHECK(ft_random_counters(5) == 2, "counters(5)");
    CHECK(ft_random_counters(12) == 3, "counters(12)");
    CHECK(ft_random_counters(INT64_MAX) == (uint64_t)INT64_MAX / 4 + 1,
          "counters(INT64_MAX)");
}

static void test_stream_layout(void)
{
    /* Seed 0, offset 0: block 0 is the first KAT vector (key 0, counter
     * 0), so the first 4 uniforms are its words' top 24 bits. */
    static const uint32_t kat0[4] = {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu,
                                     0x9b00dbd8u};
    ft_tensor *t = empty1(FT_F64, 4);
    if (t == NULL)
        return;
    CHECK_OK(ft_rand(t, 0, 0));
    for (int i = 0; i < 4; i++)
        CHECK(at(t, i) == (double)(kat0[i] >> 8) * 0x1p-24,
              "rand[%d] = %.17g", i, at(t, i));

    /* The seed's halves are the key words and the block number's halves
     * are counter words 0 and 1. */
    const uint64_t seed = 0x299f31d0a4093822ull;
    const uint64_t offset = 0x85a308d3243f6a88ull;
    const uint32_t ctr[4] = {0x243f6a88u, 0x85a308d3u, 0, 0};
    const uint32_t key[2] = {0xa4093822u, 0x299f31d0u};
    ft_philox4 b = ft_philox4x32_10(ctr, key);
    CHECK_OK(ft_rand(t, seed, offset));
    for (int i = 0; i < 4; i++)
        CHECK(at(t, i) == (double)ft_philox_uniform(b.v[i]),
              "rand[%d] with a 64-bit seed and offset", i);

    /* randn: lanes (0, 1) and (2, 3) are Box-Muller pairs, cos first. */
    CHECK_OK(ft_randn(t, seed, offset));
    for (int pair = 0; pair < 2; pair++) {
        double u0 = ft_philox_uniform(b.v[2 * pair]);
        double u1 = ft_philox_uniform(b.v[2 * pair + 1]);
        double r = sqrt(-2.0 * log(1.0 - u0));
        double th = 6.283185307179586 * u1;
        CHECK(fabs(at(t, 2 * pair) - r * cos(th)) < 1e-12, "randn cos %d",
              pair);
        CHECK(fabs(at(t, 2 * pair + 1) - r * sin(th)) < 1e-12,
              "randn sin %d", pair);
    }
    ft_tensor_free(t);

    /* The whole-tensor fill matches the per-element functions a GPU
     * kernel would call, including a partial last block. */
    enum { PER_ELEMENT_N = 37 };
    ft_tensor *pe = empty1(FT_F64, PER_ELEMENT_N);
    if (pe) {
        CHECK_OK(ft_rand(pe, seed, offset));
        for (int i = 0; i < PER_ELEMENT_N; i++)
            CHECK(at(pe, i) == (double)ft_random_uniform_at(seed, offset,
                                                            (uint64_t)i),
                  "rand vs ft_random_uniform_at, element %d", i);
        CHECK_OK(ft_randn(pe, seed, offset));
        for (int i = 0; i < PER_ELEMENT_N; i++)
            CHECK(at(pe, i) == ft_random_normal_at(seed, offset, (uint64_t)i),
                  "randn vs ft_random_normal_at, element %d", i);
        ft_tensor_free(pe);
    }

    /* The counter is 64-bit and wraps: block offset + 1 of offset
     * 2^64 - 1 is block 0. */
    ft_tensor *w = empty1(FT_F64, 8), *z = empty1(FT_F64, 4);
    if (w && z) {
        CHECK_OK(ft_rand(w, 7, UINT64_MAX));
        CHECK_OK(ft_rand(z, 7, 0));
        for (int i = 0; i < 4; i++)
            CHECK(at(w, 4 + i) == at(z, i), "counter wraps, element %d", i);
    }
    ft_tensor_free(w);
    ft_tensor_free(z);
}

static void test_determinism_and_offsets(void)
{
    const int n = 20;
    ft_tensor *a = empty1(FT_F32, n), *b = empty1(FT_F32, n);
    ft_tensor *c = empty1(FT_F32, 10), *d = empty1(FT_F32, 8);
    if (!a || !b || !c || !d)
        goto done;

    /* Same seed, same values; another seed, other values. */
    CHECK_OK(ft_rand(a, 1234, 0));
    CHECK_OK(ft_rand(b, 1234, 0));
    for (int i = 0; i < n; i++)
        CHECK(at(a, i) == at(b, i), "same seed, element %d", i);
    CHECK_OK(ft_rand(b, 1235, 0));
    int same = 0;
    for (int i = 0; i < n; i++)
        same += at(a, i) == at(b, i);
    CHECK(same == 0, "%d of %d equal with another seed", same, n);
    /* Seeds differing only in the high word differ too. */
    CHECK_OK(ft_rand(b, 1234 + (1ull << 32), 0));
    same = 0;
    for (int i = 0; i < n; i++)
        same += at(a, i) == at(b, i);
    CHECK(same == 0, "%d of %d equal with another high seed word", same, n);

    /* A prefix of the stream is the stream of a shorter tensor. */
    CHECK_OK(ft_rand(c, 1234, 0));
    for (int i = 0; i < 10; i++)
        CHECK(at(c, i) == at(a, i), "prefix, element %d", i);
    /* Continuing with offset += ft_random_counters(12) gives elements
     * 12.. of the long stream (12 is a whole number of blocks). */
    CHECK_OK(ft_rand(d, 1234, ft_random_counters(12)));
    for (int i = 0; i < 8; i++)
        CHECK(at(d, i) == at(a, 12 + i), "continuation, element %d", i);

    /* The same for randn. */
    CHECK_OK(ft_randn(a, 99, 5));
    CHECK_OK(ft_randn(c, 99, 5));
    CHECK_OK(ft_randn(d, 99, 5 + ft_random_counters(12)));
    for (int i = 0; i < 10; i++)
        CHECK(at(c, i) == at(a, i), "randn prefix, element %d", i);
    for (int i = 0; i < 8; i++)
        CHECK(at(d, i) == at(a, 12 + i), "randn continuation, element %d",
              i);

    /* dtypes only round the same stream: f32 holds the uniforms exactly. */
    ft_tensor *e = empty1(FT_F64, n);
    if (e) {
        CHECK_OK(ft_rand(a, 42, 3));
        CHECK_OK(ft_rand(e, 42, 3));
        for (int i = 0; i < n; i++)
            CHECK(at(a, i) == at(e, i), "f32 vs f64 uniform, element %d", i);
        CHECK_OK(ft_randn(a, 42, 3));
        CHECK_OK(ft_randn(e, 42, 3));
        for (int i = 0; i < n; i++)
            CHECK(at(a, i) == (double)(float)at(e, i),
                  "f32 vs f64 normal, element %d", i);
        ft_tensor_free(e);
    }
done:
    ft_tensor_free(a);
    ft_tensor_free(b);
    ft_tensor_free(c);
    ft_tensor_free(d);
}

static void test_statistics(void)
{
    ft_tensor *t = empty1(FT_F64, STAT_N);
    if (t == NULL)
        return;
    CHECK_OK(ft_randn(t, 2024, 0));
    double sum = 0, sq = 0;
    int finite = 1;
    for (int64_t i = 0; i < STAT_N; i++) {
        double v = ((const double *)t->data)[i];
        finite &= isfinite(v) != 0;
        sum += v;
        sq += v * v;
    }
    double mean = sum / STAT_N, var = sq / STAT_N - mean * mean;
    CHECK(finite, "randn gave a non-finite value");
    CHECK(fabs(mean) < MEAN_TOL, "randn mean %g", mean);
    CHECK(fabs(var - 1.0) < VAR_TOL, "randn variance %g", var);

    CHECK_OK(ft_rand(t, 2024, 0));
    double lo = 1, hi = 0;
    sum = 0;
    for (int64_t i = 0; i < STAT_N; i++) {
        double v = ((const double *)t->data)[i];
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
        sum += v;
    }
    CHECK(lo >= 0.0 && hi < 1.0, "rand range [%g, %g]", lo, hi);
    CHECK(fabs(sum / STAT_N - 0.5) < UNIFORM_MEAN_TOL, "rand mean %g",
          sum / STAT_N);
    ft_tensor_free(t);

    /* f16 and bf16 round uniforms near 1 up to 1.0 (about 1 in 4096 and
     * 1 in 512 here); those must become the largest value below 1. */
    static const struct {
        ft_dtype dtype;
        double below_one;
    } narrow[] = {{FT_F16, 1.0 - 0x1p-11}, {FT_BF16, 1.0 - 0x1p-8}};
    for (int k = 0; k < 2; k++) {
        ft_tensor *h = empty1(narrow[k].dtype, STAT_N);
        if (h == NULL)
            continue;
        CHECK_OK(ft_rand(h, 7, 0));
        double max = 0;
        for (int64_t i = 0; i < STAT_N; i++) {
            double v = at(h, i);
            CHECK(v >= 0.0 && v < 1.0, "%s rand[%lld] = %g",
                  ft_dtype_name(narrow[k].dtype), (long long)i, v);
            max = v > max ? v : max;
        }
        CHECK(max == narrow[k].below_one, "%s max %.17g",
              ft_dtype_name(narrow[k].dtype), max);
        CHECK_OK(ft_randn(h, 7, 0));
        ft_tensor_free(h);
    }
}

static void test_strided_and_errors(void)
{
    /* A transposed view is filled in its own row-major logical order. */
    ft_tensor *base = empty(FT_F32, 2, (const int64_t[]){3, 4});
    ft_tensor *view = NULL, *ref = NULL;
    if (base && ft_transpose(&view, base, 0, 1) == FT_OK) {
        ref = empty(FT_F32, 2, (const int64_t[]){4, 3});
        CHECK_OK(ft_rand(view, 11, 2));
        if (ref) {
            CHECK_OK(ft_rand(ref, 11, 2));
            for (int i = 0; i < 12; i++)
                CHECK(at(view, i) == at(ref, i), "transposed, element %d", i);
            CHECK_OK(ft_randn(view, 11, 2));
            CHECK_OK(ft_randn(ref, 11, 2));
            for (int i = 0; i < 12; i++)
                CHECK(at(view, i) == at(ref, i),
                      "transposed randn, element %d", i);
        }
    } else {
        CHECK(0, "transpose: %s", ft_last_error());
    }
    ft_tensor_free(view);
    ft_tensor_free(ref);
    ft_tensor_free(base);

    /* 0-d and empty tensors. */
    ft_tensor *s = empty(FT_F64, 0, NULL);
    if (s) {
        CHECK_OK(ft_rand(s, 0, 0));
        CHECK(*(const double *)s->data == (double)(0x6627e8d5u >> 8) * 0x1p-24,
              "0-d rand %g", *(const double *)s->data);
        CHECK_OK(ft_randn(s, 0, 0));
        ft_tensor_free(s);
    }
    ft_tensor *z = empty(FT_F32, 2, (const int64_t[]){0, 3});
    if (z) {
        CHECK_OK(ft_rand(z, 0, 0));
        CHECK_OK(ft_randn(z, 0, 0));
        ft_tensor_free(z);
    }

    /* Integer dtypes and NULL are rejected. */
    ft_tensor *i = empty1(FT_I32, 4);
    if (i) {
        CHECK_FAIL(ft_rand(i, 0, 0), FT_ERR_ARGUMENT, 1,
                   "ft_rand: needs a floating-point tensor, got i32");
        ft_tensor_free(i);
    }
    ft_tensor *l = empty1(FT_I64, 4);
    if (l) {
        CHECK_FAIL(ft_randn(l, 0, 0), FT_ERR_ARGUMENT, 1,
                   "ft_randn: needs a floating-point tensor, got i64");
        ft_tensor_free(l);
    }
    CHECK(ft_rand(NULL, 0, 0) != FT_OK, "rand(NULL) succeeded");
    CHECK(ft_last_error_arg() == 1, "rand(NULL) arg %d", ft_last_error_arg());
}

/* ---- .npy ---- */

/* Saves t, loads it back and compares dtype, shape and every element
 * (in row-major order, so views compare by their logical contents). */
static void round_trip(const ft_tensor *t, const char *path, const char *what)
{
    ft_tensor *back = NULL;
    ft_status st = ft_save_npy(t, path);
    CHECK(st == FT_OK, "%s: save: %s", what, ft_last_error());
    if (st != FT_OK)
        return;
    st = ft_load_npy(&back, path);
    CHECK(st == FT_OK, "%s: load: %s", what, ft_last_error());
    if (st != FT_OK)
        return;
    CHECK(back->dtype == t->dtype, "%s: dtype %s", what,
          ft_dtype_name(back->dtype));
    CHECK(back->device.type == FT_CPU, "%s: device", what);
    CHECK(ft_is_contiguous(back), "%s: not contiguous", what);
    CHECK(back->ndim == t->ndim, "%s: ndim %d", what, back->ndim);
    int same_shape = back->ndim == t->ndim;
    for (int d = 0; same_shape && d < t->ndim; d++)
        same_shape = back->shape[d] == t->shape[d];
    CHECK(same_shape, "%s: shape differs", what);
    if (same_shape) {
        int64_t n = ft_numel(t);
        for (int64_t i = 0; i < n; i++) {
            if (t->dtype == FT_I64 || t->dtype == FT_I32) {
                int64_t idx[FT_MAX_DIMS], x = 0, y = 0;
                unravel(i, t->ndim, t->shape, idx);
                ft_get_int(t, idx, &x);
                ft_get_int(back, idx, &y);
                CHECK(x == y, "%s: element %lld: %lld vs %lld", what,
                      (long long)i, (long long)x, (long long)y);
            } else {
                double x = at(t, i), y = at(back, i);
                CHECK(x == y || (isnan(x) && isnan(y)),
                      "%s: element %lld: %g vs %g", what, (long long)i, x, y);
            }
        }
    }
    ft_tensor_free(back);
}

/* The saved header of path: its length is a multiple of 64, it ends with
 * '\n', and its dict starts with want. */
static void check_header(const char *path, const char *want)
{
    unsigned char buf[256];
    size_t n = read_bytes(path, buf, sizeof buf);
    CHECK(n >= 10 && memcmp(buf, "\x93NUMPY\x01\x00", 8) == 0,
          "%s: magic/version", want);
    if (n < 10)
        return;
    size_t len = (size_t)buf[8] | (size_t)buf[9] << 8, total = 10 + len;
    CHECK(total % 64 == 0, "%s: header total %zu", want, total);
    CHECK(total <= n && buf[total - 1] == '\n', "%s: no final newline", want);
    CHECK(strncmp((const char *)buf + 10, want, strlen(want)) == 0,
          "header \"%.*s\", want \"%s\"", (int)(n > 10 ? n - 10 : 0),
          (const char *)buf + 10, want);
}

static void test_npy_round_trips(const char *path)
{
    /* Every savable dtype, 2-d, with values each dtype holds exactly
     * (including a negative, a fraction for floats, and 0). */
    static const ft_dtype dtypes[] = {FT_F16, FT_F32, FT_F64, FT_I32,
                                      FT_I64};
    const int64_t shape23[2] = {2, 3};
    for (size_t k = 0; k < sizeof dtypes / sizeof dtypes[0]; k++) {
        ft_tensor *t = empty(dtypes[k], 2, shape23);
        if (t == NULL)
            continue;
        int is_float = ft_dtype_is_float(dtypes[k]);
        for (int i = 0; i < 6; i++)
            set_at(t, i, is_float ? (i - 2) * 1.5 : (i - 2) * 1000);
        round_trip(t, path, ft_dtype_name(dtypes[k]));
        ft_tensor_free(t);
    }
    /* Large i64 values keep all 64 bits. */
    ft_tensor *big = empty1(FT_I64, 2);
    if (big) {
        ((int64_t *)big->data)[0] = INT64_MAX;
        ((int64_t *)big->data)[1] = INT64_MIN + 1;
        round_trip(big, path, "i64 extremes");
        ft_tensor_free(big);
    }

    ft_tensor *t = empty(FT_F32, 2, shape23);
    if (t) {
        CHECK_OK(ft_fill(t, 0.0));
        CHECK_OK(ft_save_npy(t, path));
        check_header(path,
                     "{'descr': '<f4', 'fortran_order': False, 'shape': (2, "
                     "3), }");
        ft_tensor_free(t);
    }

    /* 0-d. */
    ft_tensor *s = empty(FT_F64, 0, NULL);
    if (s) {
        *(double *)s->data = -3.25;
        round_trip(s, path, "0-d");
        check_header(path, "{'descr': '<f8', 'fortran_order': False, "
                           "'shape': (), }");
        ft_tensor_free(s);
    }
    /* 1-d. */
    ft_tensor *v = empty1(FT_I32, 5);
    if (v) {
        for (int i = 0; i < 5; i++)
            ((int32_t *)v->data)[i] = i * i - 7;
        round_trip(v, path, "1-d");
        check_header(path, "{'descr': '<i4', 'fortran_order': False, "
                           "'shape': (5,), }");
        ft_tensor_free(v);
    }
    /* Empty. */
    ft_tensor *e = empty(FT_F32, 2, (const int64_t[]){0, 3});
    if (e) {
        round_trip(e, path, "empty");
        check_header(path, "{'descr': '<f4', 'fortran_order': False, "
                           "'shape': (0, 3), }");
        ft_tensor_free(e);
    }
    /* 3-d, random contents. */
    ft_tensor *c = empty(FT_F16, 3, (const int64_t[]){2, 3, 4});
    if (c) {
        CHECK_OK(ft_randn(c, 5, 0));
        round_trip(c, path, "3-d");
        ft_tensor_free(c);
    }
    /* A transposed (non-contiguous) view is written in row-major order
     * of its own shape. */
    ft_tensor *base = empty(FT_F64, 3, (const int64_t[]){2, 3, 4});
    ft_tensor *tr = NULL;
    if (base && ft_transpose(&tr, base, 0, 2) == FT_OK) {
        for (int i = 0; i < 24; i++)
            ((double *)base->data)[i] = i;
        CHECK(!ft_is_contiguous(tr), "transpose is contiguous?");
        round_trip(tr, path, "transposed view");
        check_header(path, "{'descr': '<f8', 'fortran_order': False, "
                           "'shape': (4, 3, 2), }");
        /* The first file elements: tr[0][0][0..1] = base[0..1][0][0]. */
        unsigned char buf[128 + 2 * sizeof(double)];
        double x[2];
        if (read_bytes(path, buf, sizeof buf) == sizeof buf) {
            memcpy(x, buf + 128, sizeof x);
            CHECK(x[0] == 0.0 && x[1] == 12.0, "transposed data %g %g", x[0],
                  x[1]);
        }
    } else {
        CHECK(0, "transpose: %s", ft_last_error());
    }
    ft_tensor_free(tr);
    ft_tensor_free(base);

    /* bf16 has no NumPy dtype. */
    ft_tensor *b = empty1(FT_BF16, 3);
    if (b) {
        CHECK_FAIL(ft_save_npy(b, path), FT_ERR_ARGUMENT, 1,
                   "bf16 has no .npy dtype; convert first (t:float())");
        ft_tensor_free(b);
    }
    CHECK(ft_save_npy(NULL, path) != FT_OK && ft_last_error_arg() == 1,
          "save(NULL) arg %d", ft_last_error_arg());
}

static void test_npy_hand_written(const char *path)
{
    ft_tensor *t = NULL;

    /* fortran_order True: logical a[i][j] = 10 i + j, stored by columns. */
    const int32_t fdata[6] = {0, 10, 1, 11, 2, 12};
    write_npy(path, 1,
              "{'descr': '<i4', 'fortran_order': True, 'shape': (2, 3), }\n",
              fdata, sizeof fdata);
    if (ft_load_npy(&t, path) == FT_OK) {
        CHECK(t->ndim == 2 && t->shape[0] == 2 && t->shape[1] == 3,
              "fortran shape");
        CHECK(ft_is_contiguous(t), "fortran result not contiguous");
        for (int i = 0; i < 2; i++)
            for (int j = 0; j < 3; j++)
                CHECK(((const int32_t *)t->data)[i * 3 + j] == 10 * i + j,
                      "fortran [%d][%d] = %d", i, j,
                      ((const int32_t *)t->data)[i * 3 + j]);
        ft_tensor_free(t);
        t = NULL;
    } else {
        CHECK(0, "fortran load: %s", ft_last_error());
    }
    /* 3-d column-major: element (i, j, k) at i + 2 j + 6 k. */
    int16_t raw3[24];
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 3; j++)
            for (int k = 0; k < 4; k++) {
                uint16_t h = ft_f64_to_f16(100 * i + 10 * j + k);
                memcpy(&raw3[i + 2 * j + 6 * k], &h, 2);
            }
    write_npy(path, 1,
              "{'descr': '<f2', 'fortran_order': True, 'shape': (2, 3, 4)}",
              raw3, sizeof raw3);
    if (ft_load_npy(&t, path) == FT_OK) {
        for (int i = 0; i < 24; i++)
            CHECK(at(t, i) == 100 * (i / 12) + 10 * (i / 4 % 3) + i % 4,
                  "fortran 3-d element %d = %g", i, at(t, i));
        ft_tensor_free(t);
        t = NULL;
    } else {
        CHECK(0, "fortran 3-d load: %s", ft_last_error());
    }

    /* Keys in another order, double quotes, odd whitespace, a trailing
     * comma in the shape, version 2.0, big-endian data. */
    const unsigned char be[16] = {0x3f, 0xf8, 0, 0, 0, 0, 0, 0,  /* 1.5 */
                                  0xc0, 0x00, 0, 0, 0, 0, 0, 0}; /* -2 */
    write_npy(path, 2,
              "{ \"shape\" :(2 ,) ,\"fortran_order\":False,\n"
              "  'descr':'>f8' }   \n",
              be, sizeof be);
    if (ft_load_npy(&t, path) == FT_OK) {
        CHECK(t->dtype == FT_F64 && t->ndim == 1 && t->shape[0] == 2,
              "v2 big-endian shape");
        CHECK(at(t, 0) == 1.5 && at(t, 1) == -2.0, "big-endian %g %g",
              at(t, 0), at(t, 1));
        ft_tensor_free(t);
        t = NULL;
    } else {
        CHECK(0, "v2 big-endian load: %s", ft_last_error());
    }
    /* Version 3.0, '|' byte order, 0-d, Python 2 long suffix elsewhere. */
    const int64_t one = 77;
    write_npy(path, 3,
              "{'descr': '|i8', 'fortran_order': False, 'shape': (), }\n",
              &one, sizeof one);
    if (ft_load_npy(&t, path) == FT_OK) {
        CHECK(t->dtype == FT_I64 && t->ndim == 0 &&
                  *(const int64_t *)t->data == 77,
              "v3 0-d i64");
        ft_tensor_free(t);
        t = NULL;
    } else {
        CHECK(0, "v3 load: %s", ft_last_error());
    }
    const float f2[2] = {0.5f, 4.0f};
    write_npy(path, 1,
              "{'descr': '=f4', 'fortran_order': False, 'shape': (1L, 2L)}",
              f2, sizeof f2);
    if (ft_load_npy(&t, path) == FT_OK) {
        CHECK(t->ndim == 2 && t->shape[1] == 2 && at(t, 1) == 4.0,
              "long suffix");
        ft_tensor_free(t);
        t = NULL;
    } else {
        CHECK(0, "long suffix load: %s", ft_last_error());
    }

    /* Rejections. Every failure leaves *out NULL. */
    static ft_tensor dummy;
    ft_tensor *const sentinel = &dummy;
    static const char *const bad_descr[] = {"<c8", "|O", "<u2", "<f16",
                                            "|b1"};
    for (size_t k = 0; k < sizeof bad_descr / sizeof bad_descr[0]; k++) {
        char dict[128], want[64];
        snprintf(dict, sizeof dict,
                 "{'descr': '%s', 'fortran_order': False, 'shape': (1,), }",
                 bad_descr[k]);
        snprintf(want, sizeof want, "unsupported dtype '%s'", bad_descr[k]);
        write_npy(path, 1, dict, "\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0", 16);
        t = sentinel;
        CHECK_FAIL(ft_load_npy(&t, path), FT_ERR_UNSUPPORTED, 1, want);
        CHECK(t == NULL, "out not NULL after a failure");
    }
    write_npy(path, 1,
              "{'descr': [('a', '<f4')], 'fortran_order': False, "
              "'shape': (1,), }",
              "\0\0\0\0", 4);
    CHECK_FAIL(ft_load_npy(&t, path), FT_ERR_UNSUPPORTED, 1, "structured");

    const double three[3] = {1, 2, 3};
    write_npy(path, 1,
              "{'descr': '<f8', 'fortran_order': False, 'shape': (10,), }",
              three, sizeof three);
    CHECK_FAIL(ft_load_npy(&t, path), FT_ERR_IO, 1,
               "file is truncated: expected 80 bytes of data, found 24");

    write_bytes(path, "hello, this is not numpy\n", 25);
    CHECK_FAIL(ft_load_npy(&t, path), FT_ERR_IO, 1,
               "not a .npy file (bad magic)");
    write_bytes(path, "\x93NUM", 4);
    CHECK_FAIL(ft_load_npy(&t, path), FT_ERR_IO, 1,
               "not a .npy file (bad magic)");
    write_bytes(path, "", 0);
    CHECK_FAIL(ft_load_npy(&t, path), FT_ERR_IO, 1,
               "not a .npy file (bad magic)");
    write_bytes(path, "\x93NUMPY\x01\x00\x40\x00{'descr'", 17);
    CHECK_FAIL(ft_load_npy(&t, path), FT_ERR_IO, 1, "truncated");
    write_bytes(path, "\x93NUMPY\x04\x00\x04\x00{}  ", 14);
    CHECK_FAIL(ft_load_npy(&t, path), FT_ERR_UNSUPPORTED, 1, "version 4.0");

    static const struct {
        const char *dict;
        ft_status status;
        const char *text;
    } bad_dict[] = {
        {"{'descr': '<f4', 'fortran_order': False, "
         "'shape': (1, 1, 1, 1, 1, 1, 1, 1, 1), }",
         FT_ERR_UNSUPPORTED, "more than 8 dimensions"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, -3), }",
         FT_ERR_IO, "negative dimension"},
        {"{'descr': '<f4', 'fortran_order': False, "
         "'shape': (99999999999999999999,), }",
         FT_ERR_IO, "overflows"},
        {"{'descr': '<f8', 'fortran_order': False, "
         "'shape': (4294967296, 4294967296), }",
         FT_ERR_IO, "too large"},
        {"{'descr': '<f8', 'fortran_order': False, "
         "'shape': (1000000000000,), }",
         FT_ERR_IO, "file is truncated: expected 8000000000000 bytes"},
        {"{'descr': '<f4', 'shape': (1,), }", FT_ERR_IO, "fortran_order"},
        {"{'descr': '<f4', 'fortran_order': Maybe, 'shape': (1,)}",
         FT_ERR_IO, "True or False"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (1,), "
         "'extra': 1}",
         FT_ERR_IO, "unexpected key 'extra'"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (1,)} x",
         FT_ERR_IO, "text after the dict"},
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (1,)",
         FT_ERR_IO, "malformed"},
        {"['descr', '<f4']", FT_ERR_IO, "malformed"},
    };
    for (size_t k = 0; k < sizeof bad_dict / sizeof bad_dict[0]; k++) {
        write_npy(path, 1, bad_dict[k].dict, "\0\0\0\0\0\0\0\0", 8);
        t = sentinel;
        CHECK_FAIL(ft_load_npy(&t, path), bad_dict[k].status, 1,
                   bad_dict[k].text);
        CHECK(t == NULL, "out not NULL after failure %zu", k);
    }

    /* OS errors name the path and the reason. */
    char missing[PATH_CAP + 32];
    snprintf(missing, sizeof missing, "%s.missing/x.npy", path);
    CHECK_FAIL(ft_load_npy(&t, missing), FT_ERR_IO, 1, missing);
    CHECK(strstr(ft_last_error(), strerror(ENOENT)) != NULL, "no strerror: %s",
          ft_last_error());
    ft_tensor *small = empty1(FT_F32, 2);
    if (small) {
        CHECK_FAIL(ft_save_npy(small, missing), FT_ERR_IO, 2, missing);
        CHECK(strstr(ft_last_error(), strerror(ENOENT)) != NULL,
              "no strerror: %s", ft_last_error());
        ft_tensor_free(small);
    }
    CHECK_FAIL(ft_load_npy(&t, NULL), FT_ERR_ARGUMENT, 1, "path");

    /* A directory opens but cannot be read. */
    const char *dir = getenv("TMPDIR");
    if (dir == NULL || dir[0] == '\0')
        dir = "/tmp";
    CHECK_FAIL(ft_load_npy(&t, dir), FT_ERR_IO, 1, strerror(EISDIR));
    /* A full device fails on write or on the flush at fclose. */
    if (access("/dev/full", W_OK) == 0) {
        ft_tensor *x = empty1(FT_F64, 1000);
        if (x) {
            CHECK_OK(ft_fill(x, 1.0));
            CHECK_FAIL(ft_save_npy(x, "/dev/full"), FT_ERR_IO, 2,
                       strerror(ENOSPC));
            ft_tensor_free(x);
        }
    }
}

int main(void)
{
    ft_memory_stats before = {0}, after = {0};
    ft_memory_stats_get(CPU, &before);

    test_philox_kat();
    test_counters();
    test_stream_layout();
    test_determinism_and_offsets();
    test_statistics();
    test_strided_and_errors();

    char path[PATH_CAP];
    if (temp_file(path, sizeof path, "ft_test_npy") == 0) {
        test_npy_round_trips(path);
        test_npy_hand_written(path);
        unlink(path);
    }

    /* Failed loads and saves must not leak tensors. */
    ft_memory_stats_get(CPU, &after);
    CHECK(after.in_use == before.in_use, "%lld bytes of tensors leaked",
          (long long)(after.in_use - before.in_use));

    if (failures != 0) {
        fprintf(stderr, "test_random_npy: %d checks failed\n", failures);
        return 1;
    }
    printf("test_random_npy: all checks passed\n");
    return 0;
}
