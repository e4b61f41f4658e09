/*
 * test_hostile.c - the C API under hostile arguments and extreme shapes:
 * sizes whose products overflow, tensors with no elements but huge sizes,
 * stride-0 views (ft_expand) of 2^62 elements, attention whose scratch or
 * loops no machine could hold, device names past int, integer ranges past
 * 2^53, saves racing with loads, NULL result pointers. Every call must
 * return at once with a clear error or the right answer: no crash, no
 * hang, nothing undefined (the suite also runs under ASan and UBSan). An
 * alarm ends the program if a loop runs away. Temporary files go under
 * $TMPDIR (else /tmp). Prints a line per failed check to stderr; exits
 * nonzero if any failed.
 */
#define _POSIX_C_SOURCE 200809L /* mkstemp, fork, lstat, symlink, setrlimit */

#include "flashtile.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "tensor_files.h"

/* Seconds the whole program may take: each check returns at once, so
 * running out means a loop walked a stride-0 view element by element. */
#define WATCHDOG_S 120
#define PATH_CAP 4096
#define P62 ((int64_t)1 << 62)
#define P40 ((int64_t)1 << 40)
#define P50 ((int64_t)1 << 50)

/* Under AddressSanitizer an impossible malloc must fail as it does in a
 * normal build (NULL), not abort; flashtile refuses the sizes these tests
 * use before asking malloc, and this keeps a regression a failed check. */
const char *__asan_default_options(void);
const char *__asan_default_options(void) { return "allocator_may_return_null=1"; }

static ft_tensor *full1(ft_dtype dtype, double v)
{
    ft_tensor *t = empty(dtype, 1, (const int64_t[]){1});
    if (t)
        CHECK_OK(ft_fill(t, v));
    return t;
}

/* A contiguous f64 tensor of shape with the given values. */
static ft_tensor *make(int ndim, const int64_t *shape, const double *vals)
{
    ft_tensor *t = empty(FT_F64, ndim, shape);
    for (int64_t i = 0; t && i < ft_numel(t); i++)
        set_at(t, i, vals[i]);
    return t;
}

static ft_tensor *expand(const ft_tensor *t, int ndim, const int64_t *shape)
{
    ft_tensor *e = NULL;
    CHECK_OK(ft_expand(&e, t, ndim, shape));
    return e;
}

static int64_t get_int(const ft_tensor *t, int64_t i)
{
    int64_t idx[FT_MAX_DIMS], v = 0;
    unravel(i, t->ndim, t->shape, idx);
    CHECK_OK(ft_get_int(t, idx, &v));
    return v;
}

/* A view's data lies within the storage that base (a fresh tensor)
 * starts. */
static void check_inside(const ft_tensor *view, const ft_tensor *base, const char *what)
{
    const char *p = view->data, *b = base->data;
    CHECK(p >= b && (size_t)(p - b) <= ft_storage_nbytes(base),
          "%s: data at byte %td of a %zu-byte storage", what, p - b,
          ft_storage_nbytes(base));
}

/* ---- sizes: checked products, tensors of no elements -------------------- */

static void test_sizes(void)
{
    ft_tensor *t = NULL;
    /* A tensor with no elements may have any shape; its strides are
     * defined (no signed overflow) and its views stay in its storage. */
    const int64_t zshape[3] = {1000000000000000000LL, 0, 16};
    CHECK_OK(ft_empty(&t, 3, zshape, FT_F32, CPU));
    if (t) {
        CHECK(ft_numel(t) == 0, "numel %lld", (long long)ft_numel(t));
        CHECK(ft_is_contiguous(t), "an empty tensor is contiguous");
        for (int d = 0; d < 3; d++)
            CHECK(t->stride[d] >= 0, "stride[%d] = %lld", d, (long long)t->stride[d]);
        ft_tensor *v = NULL;
        CHECK_OK(ft_narrow(&v, t, 0, 1000000000000000000LL, 0));
        if (v)
            check_inside(v, t, "narrow at the end of an empty dim");
        ft_tensor_free(v);
        CHECK_OK(ft_select(&v, t, 0, 500000000000000000LL));
        if (v) {
            check_inside(v, t, "select of an empty tensor");
            CHECK(v->ndim == 2 && v->shape[0] == 0 && v->shape[1] == 16, "select shape");
        }
        ft_tensor_free(v);
        CHECK_OK(ft_narrow(&v, t, 2, 3, 10));
        if (v)
            check_inside(v, t, "narrow of an empty tensor");
        ft_tensor_free(v);
        CHECK_OK(ft_view(&v, t, 2, (const int64_t[]){-1, 16}));
        if (v)
            CHECK(v->shape[0] == 0, "view {-1, 16} of nothing: %lld", (long long)v->shape[0]);
        ft_tensor_free(v);
        CHECK_OK(ft_reshape(&v, t, 3, (const int64_t[]){P62, P62, 0}));
        ft_tensor_free(v);
        CHECK_OK(ft_transpose(&v, t, 0, 2));
        ft_tensor *w = NULL;
        if (v)
            CHECK_OK(ft_contiguous(&w, v));
        ft_tensor_free(w);
        ft_tensor_free(v);
        CHECK_OK(ft_expand(&v, t, 5, (const int64_t[]){P62, P62, -1, -1, -1}));
        ft_tensor_free(v);
        CHECK_OK(ft_fill(t, 1.0));
        double r = -1;
        CHECK_OK(ft_reduce_all(FT_SUM, t, &r));
        CHECK(r == 0, "sum of nothing: %g", r);
        CHECK_OK(ft_clone(&v, t));
        ft_tensor_free(v);
        CHECK_OK(ft_unary(&v, FT_EXP, t));
        ft_tensor_free(v);
        /* softmax along the 0-size dim and along a huge one: no line */
        CHECK_OK(ft_softmax(&v, t, 1));
        ft_tensor_free(v);
        CHECK_OK(ft_softmax(&v, t, 0));
        ft_tensor_free(v);
        /* a result of 1e18 x 16 elements cannot be allocated */
        CHECK_FAIL(ft_reduce_dim(&v, NULL, FT_SUM, t, 1, 0), FT_ERR_NOMEM, 1, "too large");
        CHECK(v == NULL, "no result after a failure");
        ft_tensor_free(t);
    }
    /* {2^40, 2^40, 0}: the order of the sizes does not matter. */
    CHECK_OK(ft_empty(&t, 3, (const int64_t[]){P40, P40, 0}, FT_F64, CPU));
    if (t) {
        CHECK(ft_numel(t) == 0 && ft_is_contiguous(t), "{2^40, 2^40, 0} is empty");
        ft_tensor *v = NULL;
        CHECK_OK(ft_view(&v, t, 1, (const int64_t[]){0}));
        ft_tensor_free(v);
        ft_tensor_free(t);
    }
    /* More elements than any machine: refused before malloc. */
    CHECK_FAIL(ft_empty(&t, 1, (const int64_t[]){P50}, FT_F16, CPU), FT_ERR_NOMEM, 1,
               "too large");
    CHECK_FAIL(ft_empty(&t, 2, (const int64_t[]){P62, 4}, FT_F64, CPU), FT_ERR_NOMEM, 1,
               "too large");
    CHECK_FAIL(ft_empty(&t, 2, (const int64_t[]){P62, -4}, FT_F64, CPU), FT_ERR_ARGUMENT,
               1, "negative");
    CHECK(t == NULL, "no tensor after a failure");
    /* Devices that do not exist as values. */
    CHECK_FAIL(ft_empty(&t, 1, (const int64_t[]){2}, FT_F32, ((ft_device){(ft_device_type)7, 0})),
               FT_ERR_ARGUMENT, 1, "invalid device type 7");
    CHECK_FAIL(ft_empty(&t, 1, (const int64_t[]){2}, FT_F32, ((ft_device){FT_CPU, 3})),
               FT_ERR_ARGUMENT, 1, "cpu device has index 0");
    CHECK_FAIL(ft_empty(&t, 1, (const int64_t[]){2}, FT_F32, ((ft_device){FT_CUDA, -1})),
               FT_ERR_ARGUMENT, 1, "negative");
    /* Views whose element count overflows. */
    ft_tensor *one = full1(FT_F32, 1.0), *v = NULL;
    if (one) {
        CHECK_FAIL(ft_expand(&v, one, 2, (const int64_t[]){P62, 4}), FT_ERR_ARGUMENT, 2,
                   "too large");
        CHECK_FAIL(ft_view(&v, one, 3, (const int64_t[]){P40, P40, 1}), FT_ERR_ARGUMENT, 2,
                   "too large");
        CHECK_FAIL(ft_view(&v, one, 2, (const int64_t[]){-1, -1}), FT_ERR_ARGUMENT, 2,
                   "only one size may be -1");
        CHECK_FAIL(ft_narrow(&v, one, 0, 1, INT64_MAX), FT_ERR_ARGUMENT, 4, "exceeds");
        CHECK_FAIL(ft_narrow(&v, one, 0, INT64_MIN, 1), FT_ERR_ARGUMENT, 3, "out of range");
        CHECK_FAIL(ft_select(&v, one, 0, INT64_MIN), FT_ERR_ARGUMENT, 3, "out of range");
        CHECK_FAIL(ft_select(&v, one, INT_MIN, 0), FT_ERR_ARGUMENT, 2, "out of range");
        CHECK_FAIL(ft_transpose(&v, one, INT_MAX, 0), FT_ERR_ARGUMENT, 2, "out of range");
        CHECK(v == NULL, "no view after a failure");
        int64_t idx = INT64_MAX;
        double x;
        CHECK_FAIL(ft_get(one, &idx, &x), FT_ERR_ARGUMENT, 2, "out of range");
        idx = 0;
        CHECK_FAIL(ft_get(one, &idx, NULL), FT_ERR_ARGUMENT, 0, "result pointer is NULL");
        /* NULL result pointers are errors, not crashes. */
        CHECK_FAIL(ft_empty(NULL, 1, (const int64_t[]){2}, FT_F32, CPU), FT_ERR_ARGUMENT, 0,
                   "result pointer is NULL");
        CHECK_FAIL(ft_view(NULL, one, 1, (const int64_t[]){1}), FT_ERR_ARGUMENT, 0,
                   "result pointer is NULL");
        CHECK_FAIL(ft_clone(NULL, one), FT_ERR_ARGUMENT, 0, "result pointer is NULL");
        CHECK_FAIL(ft_index_select(NULL, one, 0, one), FT_ERR_ARGUMENT, 0,
                   "result pointer is NULL");
        CHECK_FAIL(ft_device_parse("cpu", NULL), FT_ERR_ARGUMENT, 0, "result pointer is NULL");
        CHECK_FAIL(ft_dtype_parse("f32", NULL), FT_ERR_ARGUMENT, 0, "result pointer is NULL");
        CHECK_FAIL(ft_memory_stats_get(CPU, NULL), FT_ERR_ARGUMENT, 0,
                   "result pointer is NULL");
        ft_tensor_free(one);
    }
    CHECK(ft_numel(NULL) == 0 && !ft_is_contiguous(NULL) && ft_storage_nbytes(NULL) == 0 &&
              !ft_same_storage(NULL, NULL),
          "NULL handles have nothing");
}

/* A .npy file of shape (1e18, 0, 16) loads as an empty tensor. */
static void test_npy_empty_huge(void)
{
    char path[PATH_CAP];
    if (temp_file(path, sizeof path, "ft_hostile_npy") != 0)
        return;
    const char dict[] = "{'descr': '<f4', 'fortran_order': False, "
                        "'shape': (1000000000000000000, 0, 16), }\n";
    unsigned char buf[256];
    size_t n = strlen(dict);
    memcpy(buf, "\x93NUMPY\x01\x00", 8);
    buf[8] = (unsigned char)(n & 0xff);
    buf[9] = (unsigned char)(n >> 8);
    memcpy(buf + 10, dict, n);
    write_bytes(path, buf, 10 + n);
    ft_tensor *t = NULL;
    CHECK_OK(ft_load_npy(&t, path));
    if (t) {
        CHECK(t->ndim == 3 && t->shape[0] == 1000000000000000000LL && ft_numel(t) == 0,
              "loaded shape");
        ft_tensor *v = NULL;
        CHECK_OK(ft_select(&v, t, 0, 999999999999999999LL));
        if (v)
            check_inside(v, t, "select of a loaded empty tensor");
        ft_tensor_free(v);
        CHECK_OK(ft_save_npy(t, path)); /* and back */
        unsigned char head[512];
        const size_t got = read_bytes(path, head, sizeof head);
        CHECK(got > 0 && got % 64 == 0, "an empty tensor's file is its header: %zu bytes", got);
        ft_tensor_free(t);
        t = NULL;
        CHECK_OK(ft_load_npy(&t, path));
        CHECK(t && ft_numel(t) == 0 && t->shape[2] == 16, "reloaded");
        ft_tensor_free(t);
    }
    /* A crafted shape of more elements than any machine (the file could
     * never hold them; a pipe would not tell its size). */
    const char big[] = "{'descr': '<f8', 'fortran_order': True, "
                       "'shape': (4294967296, 4294967296), }\n";
    n = strlen(big);
    buf[8] = (unsigned char)(n & 0xff);
    buf[9] = (unsigned char)(n >> 8);
    memcpy(buf + 10, big, n);
    write_bytes(path, buf, 10 + n);
    CHECK_FAIL(ft_load_npy(&t, path), FT_ERR_IO, 1, "too large");

    /* The same empty shape in a .safetensors file. */
    const char json[] = "{\"t\":{\"dtype\":\"F32\",\"shape\":[1000000000000000000,0,16],"
                        "\"data_offsets\":[0,0]}}";
    size_t len = strlen(json), padded = (len + 7) / 8 * 8;
    memset(buf, ' ', sizeof buf);
    for (int b = 0; b < 8; b++)
        buf[b] = (unsigned char)((uint64_t)padded >> (8 * b));
    memcpy(buf + 8, json, len);
    write_bytes(path, buf, 8 + padded);
    ft_safetensors *st = NULL;
    CHECK_OK(ft_safetensors_load(path, &st));
    if (st) {
        CHECK_OK(ft_safetensors_tensor(st, 0, &t));
        if (t) {
            CHECK(ft_numel(t) == 0 && t->shape[0] == 1000000000000000000LL, "safetensors shape");
            ft_tensor *v = NULL;
            CHECK_OK(ft_narrow(&v, t, 0, 1000000000000000000LL - 5, 5));
            if (v)
                check_inside(v, t, "narrow of a loaded empty tensor");
            ft_tensor_free(v);
            ft_tensor_free(t);
        }
        ft_safetensors_free(st);
    }
    unlink(path);
}

/* ---- stride-0 views: loops visit distinct elements ----------------------- */

static void test_broadcast_reductions(void)
{
    ft_tensor *x = full1(FT_F32, 1.5);
    if (!x)
        return;
    ft_tensor *e = expand(x, 1, (const int64_t[]){P62});
    if (!e) {
        ft_tensor_free(x);
        return;
    }
    double r = 0;
    CHECK_OK(ft_reduce_all(FT_SUM, e, &r));
    CHECK(r == 1.5 * 0x1p62, "sum %.17g", r);
    CHECK_OK(ft_reduce_all(FT_MEAN, e, &r));
    CHECK(r == 1.5, "mean %.17g", r);
    CHECK_OK(ft_reduce_all(FT_MAX, e, &r));
    CHECK(r == 1.5, "max %.17g", r);
    CHECK_OK(ft_reduce_all(FT_MIN, e, &r));
    CHECK(r == 1.5, "min %.17g", r);
    CHECK_OK(ft_reduce_all(FT_NORM, e, &r));
    CHECK(r == 1.5 * 0x1p31, "norm %.17g", r);

    /* Along a dim: a stride-0 line of n copies, and lines repeated. */
    ft_tensor *out = NULL, *idx = NULL;
    ft_tensor *e2 = expand(x, 2, (const int64_t[]){P62 / 4, 3});
    CHECK_OK(ft_reduce_dim(&out, NULL, FT_SUM, e2, 0, 0));
    if (out) {
        CHECK(out->ndim == 1 && out->shape[0] == 3, "sum over dim 0: shape");
        for (int64_t i = 0; i < 3; i++)
            CHECK(at(out, i) == 1.5 * 0x1p60, "sum over dim 0 [%lld] = %g", (long long)i,
                  at(out, i));
    }
    ft_tensor_free(out);
    CHECK_OK(ft_reduce_dim(&out, &idx, FT_MAX, e2, 0, 1));
    if (out && idx)
        CHECK(out->shape[0] == 1 && at(out, 2) == 1.5 && get_int(idx, 2) == 0,
              "max over dim 0");
    ft_tensor_free(out);
    ft_tensor_free(idx);
    /* The result itself would have 2^62 elements. */
    CHECK_FAIL(ft_reduce_dim(&out, NULL, FT_SUM, e2, 1, 0), FT_ERR_NOMEM, 1, "too large");
    ft_tensor_free(e2);

    /* Comparisons of two stride-0 views. */
    ft_tensor *y = full1(FT_F64, 1.25);
    ft_tensor *f = y ? expand(y, 1, (const int64_t[]){P62}) : NULL;
    if (f) {
        CHECK_OK(ft_max_abs_diff(e, f, &r));
        CHECK(r == 0.25, "max_abs_diff %g", r);
        int close = -1;
        CHECK_OK(ft_allclose(e, f, 0, 0.3, &close));
        CHECK(close == 1, "allclose with atol 0.3");
        CHECK_OK(ft_allclose(e, f, 0, 0.2, &close));
        CHECK(close == 0, "not allclose with atol 0.2");
    }
    /* Operands repeating along different dims pair each of 2^25 distinct
     * elements with 2^24 others: 2^49 pairs would be compared, refused. */
    const int64_t n24 = (int64_t)1 << 24, n25 = n24 * 2;
    ft_tensor *u = empty(FT_F16, 2, (const int64_t[]){n25, 1});
    ft_tensor *w = empty(FT_F16, 1, (const int64_t[]){n24});
    if (u && w) {
        CHECK_OK(ft_fill(u, 0.5));
        CHECK_OK(ft_fill(w, 0.5));
        ft_tensor *a = expand(u, 2, (const int64_t[]){n25, n24}); /* strides {1, 0} */
        ft_tensor *b = expand(w, 2, (const int64_t[]){n25, n24});  /* strides {0, 1} */
        if (a && b) {
            int close = -1;
            CHECK_FAIL(ft_max_abs_diff(a, b, &r), FT_ERR_UNSUPPORTED, 1, "pairs of elements");
            CHECK_FAIL(ft_allclose(a, b, 0, 0, &close), FT_ERR_UNSUPPORTED, 1, "limit of 2^48");
            /* against itself only its 2^25 distinct elements are visited */
            CHECK_OK(ft_max_abs_diff(a, a, &r));
            CHECK(r == 0, "max_abs_diff with itself %g", r);
        }
        ft_tensor_free(b);
        ft_tensor_free(a);
    }
    ft_tensor_free(u);
    ft_tensor_free(w);
    ft_tensor_free(f);
    ft_tensor_free(y);
    ft_tensor_free(e);
    ft_tensor_free(x);
}

/* Reductions of a stride-0 view match those of the same values
 * materialised, for every op, dim and keepdim. */
static void test_broadcast_matches_copy(void)
{
    const double vals[3] = {1.0, -2.5, 4.0};
    ft_tensor *b = make(1, (const int64_t[]){3}, vals);
    ft_tensor *col = make(2, (const int64_t[]){3, 1}, vals);
    if (!b || !col)
        return;
    ft_tensor *views[2] = {expand(b, 2, (const int64_t[]){5, 3}),
                           expand(col, 3, (const int64_t[]){2, 3, 4})};
    const ft_reduce_op ops[5] = {FT_SUM, FT_MEAN, FT_MAX, FT_MIN, FT_NORM};
    for (int k = 0; k < 2; k++) {
        ft_tensor *v = views[k], *c = NULL;
        if (!v)
            continue;
        CHECK_OK(ft_clone(&c, v));
        if (!c)
            continue;
        for (int o = 0; o < 5; o++) {
            double rv = 0, rc = 1;
            CHECK_OK(ft_reduce_all(ops[o], v, &rv));
            CHECK_OK(ft_reduce_all(ops[o], c, &rc));
            CHECK(fabs(rv - rc) <= 1e-12 * fabs(rc), "view %d op %d: %.17g vs %.17g", k, o,
                  rv, rc);
            for (int d = 0; d < v->ndim; d++)
                for (int keep = 0; keep < 2; keep++) {
                    const int extreme = ops[o] == FT_MAX || ops[o] == FT_MIN;
                    ft_tensor *ov = NULL, *oc = NULL, *iv = NULL, *ic = NULL;
                    CHECK_OK(ft_reduce_dim(&ov, extreme ? &iv : NULL, ops[o], v, d, keep));
                    CHECK_OK(ft_reduce_dim(&oc, extreme ? &ic : NULL, ops[o], c, d, keep));
                    if (ov && oc) {
                        double diff = 1;
                        CHECK(ov->ndim == oc->ndim, "ndim");
                        CHECK_OK(ft_max_abs_diff(ov, oc, &diff));
                        CHECK(diff <= 1e-12, "view %d op %d dim %d keep %d: diff %g", k, o,
                              d, keep, diff);
                    }
                    if (iv && ic) {
                        double diff = 1;
                        CHECK_OK(ft_max_abs_diff(iv, ic, &diff));
                        CHECK(diff == 0, "indices view %d op %d dim %d: diff %g", k, o, d,
                              diff);
                    }
                    ft_tensor_free(ov);
                    ft_tensor_free(oc);
                    ft_tensor_free(iv);
                    ft_tensor_free(ic);
                }
        }
        ft_tensor_free(c);
    }
    ft_tensor_free(views[0]);
    ft_tensor_free(views[1]);
    ft_tensor_free(b);
    ft_tensor_free(col);
}

static void test_broadcast_writes(void)
{
    ft_tensor *x = full1(FT_F64, 0.0);
    ft_tensor *e = x ? expand(x, 2, (const int64_t[]){P62 / 4, 4}) : NULL;
    if (!e) {
        ft_tensor_free(x);
        return;
    }
    /* fill writes the one distinct element once */
    CHECK_OK(ft_fill(e, 3.0));
    CHECK(at(x, 0) == 3.0, "fill through a stride-0 view: %g", at(x, 0));
    /* copy: each distinct element gets the value a row-major loop would
     * leave, the last one */
    const double vals[4] = {1, 2, 3, 4};
    ft_tensor *src = make(1, (const int64_t[]){4}, vals);
    ft_tensor *d4 = expand(x, 1, (const int64_t[]){4});
    if (src && d4) {
        CHECK_OK(ft_copy(d4, src));
        CHECK(at(x, 0) == 4.0, "copy into a stride-0 view keeps the last: %g", at(x, 0));
    }
    ft_tensor *seven = full1(FT_F32, 7.0);
    ft_tensor *s = seven ? expand(seven, 2, (const int64_t[]){P62 / 4, 4}) : NULL;
    if (s) {
        CHECK_OK(ft_copy(e, s));
        CHECK(at(x, 0) == 7.0, "copy of 2^62 repeats: %g", at(x, 0));
    }
    /* overlapping views of one storage: a[0] = a[1] through 2^62 repeats */
    const double two[2] = {5, 6};
    ft_tensor *a = make(1, (const int64_t[]){2}, two), *a0 = NULL, *a1 = NULL;
    if (a) {
        CHECK_OK(ft_select(&a0, a, 0, 0));
        CHECK_OK(ft_select(&a1, a, 0, 1));
    }
    if (a0 && a1) {
        ft_tensor *e0 = expand(a0, 1, (const int64_t[]){P62});
        ft_tensor *e1 = expand(a1, 1, (const int64_t[]){P62});
        if (e0 && e1) {
            CHECK_OK(ft_copy(e0, e1));
            CHECK(at(a, 0) == 6.0 && at(a, 1) == 6.0, "overlapping copy: %g %g", at(a, 0),
                  at(a, 1));
        }
        ft_tensor_free(e0);
        ft_tensor_free(e1);
    }
    /* results of 2^62 elements fail at once */
    ft_tensor *r = NULL;
    CHECK_FAIL(ft_binary(&r, FT_ADD, e, e), FT_ERR_NOMEM, 1, "too large");
    CHECK_FAIL(ft_unary(&r, FT_EXP, e), FT_ERR_NOMEM, 1, "too large");
    CHECK_FAIL(ft_binary_scalar(&r, FT_MUL, e, 2.0, 0), FT_ERR_NOMEM, 1, "too large");
    CHECK_FAIL(ft_softmax(&r, e, 1), FT_ERR_NOMEM, 1, "too large");
    CHECK_FAIL(ft_clone(&r, e), FT_ERR_NOMEM, 1, "too large");
    CHECK_FAIL(ft_contiguous(&r, e), FT_ERR_NOMEM, 1, "too large");
    CHECK_FAIL(ft_to(&r, e, FT_F32, CPU), FT_ERR_NOMEM, 1, "too large");
    CHECK(r == NULL, "no result after a failure");
    /* all its strides are 0: any shape of as many elements is a view */
    CHECK_OK(ft_reshape(&r, e, 2, (const int64_t[]){4, P62 / 4}));
    ft_tensor_free(r);
    r = NULL;
    /* a reshape that must copy fails to allocate */
    ft_tensor *pair = make(1, (const int64_t[]){2}, vals);
    ft_tensor *pe = pair ? expand(pair, 2, (const int64_t[]){P62 / 4, 2}) : NULL;
    if (pe) {
        CHECK_FAIL(ft_reshape(&r, pe, 1, (const int64_t[]){P62 / 2}), FT_ERR_NOMEM, 1,
                   "too large");
        CHECK(r == NULL, "no result after a failure");
    }
    ft_tensor_free(pe);
    ft_tensor_free(pair);
    /* files would hold every repeat */
    char path[PATH_CAP];
    if (temp_file(path, sizeof path, "ft_hostile_save") == 0) {
        unlink(path);
        CHECK_FAIL(ft_save_npy(e, path), FT_ERR_UNSUPPORTED, 1, "limit of 2^48");
        const char *names[1] = {"e"};
        ft_tensor *ts[1] = {e};
        CHECK_FAIL(ft_safetensors_save(path, 1, names, ts, 0, NULL, NULL),
                   FT_ERR_UNSUPPORTED, 3, "limit of 2^48");
        CHECK(access(path, F_OK) != 0, "a refused save created '%s'", path);
    }
    ft_tensor_free(a0);
    ft_tensor_free(a1);
    ft_tensor_free(a);
    ft_tensor_free(s);
    ft_tensor_free(seven);
    ft_tensor_free(d4);
    ft_tensor_free(src);
    ft_tensor_free(e);
    ft_tensor_free(x);
}

/* ft_rand into a stride-0 view leaves each element as a row-major loop
 * over every index would: the stream's value at its last repeat. */
static void test_broadcast_random(void)
{
    const uint64_t seed = 1234, offset = 77;
    for (int normal = 0; normal < 2; normal++) {
        ft_status (*fn)(ft_tensor *, uint64_t, uint64_t) = normal ? ft_randn : ft_rand;
        /* {3} as {4, 3}: base[j] = full[3][j] */
        ft_tensor *base = empty(FT_F32, 1, (const int64_t[]){3});
        ft_tensor *full = empty(FT_F32, 2, (const int64_t[]){4, 3});
        ft_tensor *e = base ? expand(base, 2, (const int64_t[]){4, 3}) : NULL;
        if (e && full) {
            CHECK_OK(fn(e, seed, offset));
            CHECK_OK(fn(full, seed, offset));
            for (int64_t j = 0; j < 3; j++)
                CHECK(at(base, j) == at(full, 9 + j), "rand row [%lld]: %g vs %g",
                      (long long)j, at(base, j), at(full, 9 + j));
        }
        ft_tensor_free(e);
        ft_tensor_free(full);
        ft_tensor_free(base);
        /* {3, 1} as {3, 5}: col[i] = full[i][4] */
        base = empty(FT_F64, 2, (const int64_t[]){3, 1});
        full = empty(FT_F64, 2, (const int64_t[]){3, 5});
        e = base ? expand(base, 2, (const int64_t[]){3, 5}) : NULL;
        if (e && full) {
            CHECK_OK(fn(e, seed, offset));
            CHECK_OK(fn(full, seed, offset));
            for (int64_t i = 0; i < 3; i++)
                CHECK(at(base, i) == at(full, 5 * i + 4), "rand col [%lld]: %g vs %g",
                      (long long)i, at(base, i), at(full, 5 * i + 4));
        }
        ft_tensor_free(e);
        ft_tensor_free(full);
        ft_tensor_free(base);
        /* 2^62 repeats: one element written */
        base = full1(FT_F16, 0.0);
        e = base ? expand(base, 1, (const int64_t[]){P62}) : NULL;
        if (e) {
            CHECK_OK(fn(e, seed, offset));
            CHECK(isfinite(at(base, 0)), "a value was written");
        }
        ft_tensor_free(e);
        ft_tensor_free(base);
    }
}

/* The same on a CUDA device: each distinct element written once, by one
 * thread, with the CPU's value (a kernel over every index would race). */
static void test_broadcast_random_cuda(void)
{
    if (ft_cuda_device_count() <= 0) {
        printf("test_broadcast_random_cuda: skipped, no CUDA device\n");
        return;
    }
    const ft_device gpu = {FT_CUDA, 0};
    const uint64_t seed = 99, offset = 5;
    const ft_dtype dtypes[3] = {FT_F32, FT_F16, FT_BF16};
    for (int normal = 0; normal < 2; normal++)
        for (int k = 0; k < 3; k++) {
            ft_status (*fn)(ft_tensor *, uint64_t, uint64_t) = normal ? ft_randn : ft_rand;
            const int64_t shape[3] = {3, 4, 5}, small[3] = {3, 1, 5};
            ft_tensor *c = empty(dtypes[k], 3, small), *g = NULL, *ec = NULL, *eg = NULL,
                      *back = NULL;
            CHECK_OK(ft_empty(&g, 3, small, dtypes[k], gpu));
            if (c && g && (ec = expand(c, 3, shape)) && (eg = expand(g, 3, shape))) {
                CHECK_OK(fn(ec, seed, offset));
                CHECK_OK(fn(eg, seed, offset));
                CHECK_OK(ft_to(&back, g, dtypes[k], (ft_device){FT_CPU, 0}));
                /* Uniforms are exact; normals pass through the device's
                 * log and sincos, an ulp from the host's at most. */
                const double tol = normal ? (k == 0 ? 1e-6 : k == 1 ? 1e-3 : 8e-3) : 0;
                for (int64_t i = 0; back && i < 15; i++)
                    CHECK(fabs(at(back, i) - at(c, i)) <= tol * (1 + fabs(at(c, i))), "cuda %s %s [%lld]: %g vs cpu %g",
                          normal ? "randn" : "rand", ft_dtype_name(dtypes[k]),
                          (long long)i, at(back, i), at(c, i));
            }
            ft_tensor_free(back);
            ft_tensor_free(eg);
            ft_tensor_free(ec);
            ft_tensor_free(g);
            ft_tensor_free(c);
        }
    /* 2^62 repeats on the device: one element written, at once */
    ft_tensor *g = NULL, *e = NULL, *back = NULL;
    CHECK_OK(ft_empty(&g, 1, (const int64_t[]){1}, FT_F32, gpu));
    if (g && (e = expand(g, 1, (const int64_t[]){P62}))) {
        CHECK_OK(ft_rand(e, seed, offset));
        CHECK_OK(ft_to(&back, g, FT_F32, (ft_device){FT_CPU, 0}));
        CHECK(back && at(back, 0) >= 0 && at(back, 0) < 1, "a value was written");
    }
    ft_tensor_free(back);
    ft_tensor_free(e);
    ft_tensor_free(g);
}

static void test_broadcast_index(void)
{
    const double vals[3] = {10, 20, 30};
    ft_tensor *t = make(1, (const int64_t[]){3}, vals);
    ft_tensor *i1 = empty(FT_I64, 1, (const int64_t[]){1});
    if (!t || !i1)
        return;
    int64_t zero = 0;
    CHECK_OK(ft_set_int(i1, &zero, 1));
    ft_tensor *ie = expand(i1, 1, (const int64_t[]){P62});
    ft_tensor *r = NULL;
    if (ie) {
        /* the index is checked once (one distinct entry); the result would
         * have 2^62 elements */
        CHECK_FAIL(ft_index_select(&r, t, 0, ie), FT_ERR_NOMEM, 1, "too large");
        CHECK_OK(ft_set_int(i1, &zero, 3));
        CHECK_FAIL(ft_index_select(&r, t, 0, ie), FT_ERR_ARGUMENT, 3,
                   "index[0] = 3 is out of range");
        CHECK_OK(ft_set_int(i1, &zero, -1));
        CHECK_FAIL(ft_index_select(&r, t, 0, ie), FT_ERR_ARGUMENT, 3, "out of range");
        CHECK_OK(ft_set_int(i1, &zero, 2));
        /* index_add would add 2^62 values one by one: refused */
        ft_tensor *one = full1(FT_F64, 1.0);
        ft_tensor *src = one ? expand(one, 1, (const int64_t[]){P62}) : NULL;
        if (src) {
            CHECK_FAIL(ft_index_add(t, 0, ie, src), FT_ERR_UNSUPPORTED, 4, "limit of 2^48");
            CHECK(at(t, 2) == 30, "a refused index_add changed the tensor");
        }
        ft_tensor_free(src);
        ft_tensor_free(one);
    }
    /* a small expanded index works as its copy does */
    ft_tensor *i5 = expand(i1, 1, (const int64_t[]){5});
    if (i5) {
        CHECK_OK(ft_index_select(&r, t, 0, i5));
        if (r)
            CHECK(r->shape[0] == 5 && at(r, 4) == 30, "gather by a stride-0 index");
        ft_tensor_free(r);
        r = NULL;
    }
    /* an empty tensor gathered 2^62 times has no elements: no loop */
    ft_tensor *z = empty(FT_F64, 2, (const int64_t[]){3, 0});
    if (z && ie) {
        CHECK_OK(ft_index_select(&r, z, 0, ie));
        if (r)
            CHECK(r->shape[0] == P62 && ft_numel(r) == 0, "empty gather");
        ft_tensor_free(r);
    }
    ft_tensor_free(z);
    ft_tensor_free(i5);
    ft_tensor_free(ie);
    ft_tensor_free(i1);
    ft_tensor_free(t);
}

static void test_matmul_limits(void)
{
    ft_tensor *one = full1(FT_F32, 1.0);
    if (!one)
        return;
    ft_tensor *r = NULL;
    /* k past CBLAS's int */
    ft_tensor *a = expand(one, 2, (const int64_t[]){1, (int64_t)INT_MAX + 1});
    ft_tensor *b = expand(one, 2, (const int64_t[]){(int64_t)INT_MAX + 1, 1});
    if (a && b)
        CHECK_FAIL(ft_matmul(&r, a, b), FT_ERR_UNSUPPORTED, 1, "BLAS limit");
    ft_tensor_free(a);
    ft_tensor_free(b);
    /* operands of 2^50 elements (stride 0) would be packed in full */
    a = expand(one, 2, (const int64_t[]){1 << 20, 1 << 30});
    b = expand(one, 2, (const int64_t[]){1 << 30, 1});
    if (a && b)
        CHECK_FAIL(ft_matmul(&r, a, b), FT_ERR_UNSUPPORTED, 1, "limit of 2^48");
    ft_tensor_free(a);
    ft_tensor_free(b);
    /* a batch-invariant operand (stride-0 batch) gives the product of its
     * copy */
    const double av[6] = {1, 2, 3, 4, 5, 6};
    ft_tensor *a1 = make(3, (const int64_t[]){1, 2, 3}, av);
    ft_tensor *bb = empty(FT_F64, 3, (const int64_t[]){4, 3, 2});
    ft_tensor *ae = a1 ? expand(a1, 3, (const int64_t[]){4, 2, 3}) : NULL;
    ft_tensor *ac = NULL, *r1 = NULL, *r2 = NULL;
    if (ae && bb) {
        for (int64_t i = 0; i < 24; i++)
            set_at(bb, i, (double)(i % 7) - 3.0);
        /* a transposed view forces packing */
        ft_tensor *at_ = NULL, *aet = NULL;
        CHECK_OK(ft_transpose(&at_, ae, 1, 2));
        if (at_)
            CHECK_OK(ft_transpose(&aet, at_, 1, 2));
        CHECK_OK(ft_clone(&ac, ae));
        if (aet && ac) {
            CHECK_OK(ft_matmul(&r1, aet, bb));
            CHECK_OK(ft_matmul(&r2, ac, bb));
            double diff = 1;
            if (r1 && r2)
                CHECK_OK(ft_max_abs_diff(r1, r2, &diff));
            CHECK(diff == 0, "batched matmul of a stride-0 batch: diff %g", diff);
        }
        ft_tensor_free(aet);
        ft_tensor_free(at_);
    }
    ft_tensor_free(r1);
    ft_tensor_free(r2);
    ft_tensor_free(ac);
    ft_tensor_free(ae);
    ft_tensor_free(bb);
    ft_tensor_free(a1);
    ft_tensor_free(one);
}

/* ---- attention ------------------------------------------------------------ */

static void test_attention_limits(void)
{
    ft_attn_params p;
    ft_attn_params_init(&p);
    ft_tensor *one = NULL;
    CHECK_OK(ft_empty(&one, 4, (const int64_t[]){1, 1, 1, 1}, FT_F64, CPU));
    if (!one)
        return;
    CHECK_OK(ft_fill(one, 1.0));
    /* The reproduction: Nq * Nk * 8 bytes of naive scratch wrapped size_t
     * and was written past a 64-byte buffer. */
    ft_tensor *q = expand(one, 4, (const int64_t[]){1, 1073807360, 1, 1});
    ft_tensor *k = expand(one, 4, (const int64_t[]){1, 2147352578, 1, 1});
    ft_tensor *out = NULL, *lse = NULL;
    for (int impl = FT_ATTN_AUTO; impl <= FT_ATTN_TILED && q && k; impl++) {
        p.impl = (ft_attn_impl)impl;
        CHECK_FAIL(ft_attention_forward(&out, &lse, q, k, k, &p), FT_ERR_UNSUPPORTED, 1,
                   "limit of 2^48");
        CHECK(out == NULL && lse == NULL, "no results after a failure");
    }
    ft_tensor_free(q);
    ft_tensor_free(k);
    /* No query row: huge batch and heads, nothing to compute. */
    ft_tensor *qe = NULL, *k3 = NULL;
    CHECK_OK(ft_empty(&qe, 4, (const int64_t[]){P40, 0, 1 << 20, 1}, FT_F64, CPU));
    k3 = expand(one, 4, (const int64_t[]){P40, 3, 1 << 20, 1});
    p.impl = FT_ATTN_NAIVE;
    if (qe && k3) {
        CHECK_OK(ft_attention_forward(&out, &lse, qe, k3, k3, &p));
        CHECK(out && lse && ft_numel(out) == 0 && ft_numel(lse) == 0, "empty results");
        ft_tensor *dq = NULL, *dk = NULL, *dv = NULL;
        if (out && lse)
            CHECK_FAIL(ft_attention_backward(&dq, &dk, &dv, qe, qe, k3, k3, out, lse, &p),
                       FT_ERR_NOMEM, 1, "too large");
        CHECK(dq == NULL && dk == NULL && dv == NULL, "no gradients after a failure");
        ft_tensor_free(out);
        ft_tensor_free(lse);
        out = lse = NULL;
    }
    ft_tensor_free(qe);
    ft_tensor_free(k3);
    /* Zero query heads (0 is a multiple of the 2 k/v heads): the forward
     * has nothing to do, the backward's dk and dv are zero. */
    for (int impl = FT_ATTN_NAIVE; impl <= FT_ATTN_TILED; impl++) {
        p.impl = (ft_attn_impl)impl;
        ft_tensor *q0 = NULL, *kk = NULL;
        CHECK_OK(ft_empty(&q0, 4, (const int64_t[]){1, 4, 0, 8}, FT_F32, CPU));
        CHECK_OK(ft_empty(&kk, 4, (const int64_t[]){1, 5, 2, 8}, FT_F32, CPU));
        if (q0 && kk) {
            CHECK_OK(ft_fill(kk, 0.5));
            CHECK_OK(ft_attention_forward(&out, &lse, q0, kk, kk, &p));
            ft_tensor *dq = NULL, *dk = NULL, *dv = NULL;
            if (out && lse) {
                CHECK_OK(ft_attention_backward(&dq, &dk, &dv, out, q0, kk, kk, out, lse, &p));
                double m = 1;
                if (dk && dv) {
                    CHECK_OK(ft_reduce_all(FT_NORM, dk, &m));
                    CHECK(m == 0, "dk of no query: %g", m);
                    CHECK_OK(ft_reduce_all(FT_NORM, dv, &m));
                    CHECK(m == 0, "dv of no query: %g", m);
                }
            }
            ft_tensor_free(dq);
            ft_tensor_free(dk);
            ft_tensor_free(dv);
            ft_tensor_free(out);
            ft_tensor_free(lse);
            out = lse = NULL;
        }
        ft_tensor_free(q0);
        ft_tensor_free(kk);
    }
    CHECK_FAIL(ft_attention_forward(NULL, &lse, one, one, one, &p), FT_ERR_ARGUMENT, 0,
               "result pointer is NULL");
    ft_tensor_free(one);
}

/* ---- devices, integer ranges ---------------------------------------------- */

static void test_device_parse(void)
{
    ft_device d = {FT_CPU, 0};
    const char *bad[] = {"cuda:4294967296", "cuda:2147483648", "cuda:99999999999999999999",
                         "cuda:",           "cuda:+1",         "cuda:-1",
                         "cuda: 1",         "cuda:1 ",         "cuda:1x",
                         "cuda:0x1",        "cuda:1.0",        "cuda:1:2"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        ft_status st = ft_device_parse(bad[i], &d);
        CHECK(st == FT_ERR_ARGUMENT, "'%s' parsed with status %d (%s)", bad[i], (int)st,
              ft_last_error());
        CHECK(strstr(ft_last_error(), "ft_device_parse") != NULL &&
                  ft_last_error_arg() == 1,
              "'%s': %s", bad[i], ft_last_error());
    }
    CHECK_FAIL(ft_device_parse("cuda:4294967296", &d), FT_ERR_ARGUMENT, 1, "too large");
    CHECK_FAIL(ft_device_parse("cuda:", &d), FT_ERR_ARGUMENT, 1, "missing");
    CHECK_FAIL(ft_device_parse("cuda:-1", &d), FT_ERR_ARGUMENT, 1, "digits only");
    CHECK_FAIL(ft_device_parse("tpu", &d), FT_ERR_ARGUMENT, 1, "unknown device 'tpu'");
    CHECK_FAIL(ft_device_parse(NULL, &d), FT_ERR_ARGUMENT, 1, "device name expected");
    /* "cuda:2147483647" is well-formed: it fails only as a device. */
    ft_status st = ft_device_parse("cuda:2147483647", &d);
    CHECK(st == FT_ERR_UNSUPPORTED || st == FT_ERR_ARGUMENT, "status %d", (int)st);
    CHECK(strstr(ft_last_error(), "digits") == NULL && strstr(ft_last_error(), "large") == NULL,
          "a valid index read as malformed: %s", ft_last_error());
    CHECK_OK(ft_device_parse("cpu", &d));
    CHECK(d.type == FT_CPU && d.index == 0, "cpu");
}

static void test_arange(void)
{
    ft_tensor *t = empty(FT_I64, 1, (const int64_t[]){4});
    if (t) {
        const int64_t p53 = (int64_t)1 << 53;
        CHECK_OK(ft_arange_int(t, p53, 1));
        for (int64_t i = 0; i < 4; i++)
            CHECK(get_int(t, i) == p53 + i, "arange [%lld] = %lld", (long long)i,
                  (long long)get_int(t, i));
        CHECK_OK(ft_arange_int(t, INT64_MAX, -3));
        CHECK(get_int(t, 3) == INT64_MAX - 9, "descending from INT64_MAX");
        CHECK_OK(ft_arange_int(t, INT64_MIN + 3, -1));
        CHECK(get_int(t, 3) == INT64_MIN, "down to INT64_MIN");
        CHECK_FAIL(ft_arange_int(t, INT64_MAX - 2, 1), FT_ERR_ARGUMENT, 3, "range of i64");
        CHECK_FAIL(ft_arange_int(t, 0, INT64_MAX / 2), FT_ERR_ARGUMENT, 3, "range of i64");
        CHECK_FAIL(ft_arange_int(t, INT64_MIN, INT64_MIN), FT_ERR_ARGUMENT, 3, "range");
        CHECK(get_int(t, 3) == INT64_MIN, "a failed arange wrote");
        ft_tensor_free(t);
    }
    t = empty(FT_I32, 1, (const int64_t[]){4});
    if (t) {
        CHECK_OK(ft_arange_int(t, INT32_MAX - 3, 1));
        CHECK(get_int(t, 3) == INT32_MAX, "i32 up to INT32_MAX");
        CHECK_FAIL(ft_arange_int(t, INT32_MAX - 2, 1), FT_ERR_ARGUMENT, 3, "range of i32");
        CHECK_FAIL(ft_arange_int(t, (int64_t)INT32_MIN - 1, 1), FT_ERR_ARGUMENT, 3, "range");
        ft_tensor_free(t);
    }
    /* any shape, row-major; a stride-0 view keeps its last value */
    t = empty(FT_I64, 2, (const int64_t[]){2, 3});
    if (t) {
        CHECK_OK(ft_arange_int(t, 10, 5));
        CHECK(get_int(t, 5) == 35, "2-d arange");
        ft_tensor *tt = NULL;
        CHECK_OK(ft_transpose(&tt, t, 0, 1));
        if (tt) {
            CHECK_OK(ft_arange_int(tt, 0, 1)); /* tt[i][j] = 2i + j */
            CHECK(get_int(t, 1) == 2 && get_int(t, 3) == 1, "transposed arange");
        }
        ft_tensor_free(tt);
        ft_tensor_free(t);
    }
    ft_tensor *base = empty(FT_I64, 1, (const int64_t[]){1});
    ft_tensor *e = base ? expand(base, 1, (const int64_t[]){P62}) : NULL;
    if (e) {
        CHECK_OK(ft_arange_int(e, 0, 1));
        CHECK(get_int(base, 0) == P62 - 1, "stride-0 arange keeps the last value");
        CHECK_FAIL(ft_arange_int(e, 0, 4), FT_ERR_ARGUMENT, 3, "range");
    }
    ft_tensor_free(e);
    ft_tensor_free(base);
    ft_tensor *f = empty(FT_F32, 1, (const int64_t[]){2});
    if (f)
        CHECK_FAIL(ft_arange_int(f, 0, 1), FT_ERR_ARGUMENT, 1, "i64 or i32");
    ft_tensor_free(f);
    CHECK_FAIL(ft_arange_int(NULL, 0, 1), FT_ERR_ARGUMENT, 1, "tensor expected");

    int64_t n = -1;
    const int64_t p53 = (int64_t)1 << 53;
    CHECK_OK(ft_arange_count(p53, p53 + 4, 1, &n));
    CHECK(n == 4, "count %lld", (long long)n);
    CHECK_OK(ft_arange_count(0, 10, 3, &n));
    CHECK(n == 4, "count %lld", (long long)n);
    CHECK_OK(ft_arange_count(10, 0, -3, &n));
    CHECK(n == 4, "count %lld", (long long)n);
    CHECK_OK(ft_arange_count(0, 10, -1, &n));
    CHECK(n == 0, "count %lld", (long long)n);
    CHECK_OK(ft_arange_count(INT64_MAX - 1, INT64_MAX, INT64_MIN, &n));
    CHECK(n == 0, "count %lld", (long long)n);
    CHECK_OK(ft_arange_count(INT64_MIN, INT64_MAX, INT64_MAX, &n));
    CHECK(n == 3, "count %lld", (long long)n);
    CHECK_FAIL(ft_arange_count(INT64_MIN, INT64_MAX, 1, &n), FT_ERR_ARGUMENT, 2, "2^48");
    CHECK_FAIL(ft_arange_count(0, 1, 0, &n), FT_ERR_ARGUMENT, 3, "nonzero");
    CHECK_FAIL(ft_arange_count(0, 1, 1, NULL), FT_ERR_ARGUMENT, 0, "result pointer");
}

/* ---- saving in one piece ---------------------------------------------------- */

/* A tensor of n f64 values v. */
static ft_tensor *filled(int64_t n, double v)
{
    ft_tensor *t = empty(FT_F64, 1, (const int64_t[]){n});
    if (t)
        CHECK_OK(ft_fill(t, v));
    return t;
}

/* The value of path when it loads as n copies of one value, else NAN. */
static double loaded_value(const char *path, int64_t n)
{
    ft_tensor *t = NULL;
    if (ft_load_npy(&t, path) != FT_OK)
        return NAN;
    double lo = 0, hi = 0;
    int ok = ft_numel(t) == n && ft_reduce_all(FT_MIN, t, &lo) == FT_OK &&
             ft_reduce_all(FT_MAX, t, &hi) == FT_OK && lo == hi;
    ft_tensor_free(t);
    return ok ? lo : NAN;
}

/* 1 if path loads as n copies of v. */
static int loads_as(const char *path, int64_t n, double v)
{
    return loaded_value(path, n) == v;
}

/* Whether dir holds a leftover temporary file of a save to name. */
static int temp_left(const char *path)
{
    char cmd[PATH_CAP + 64];
    const char *slash = strrchr(path, '/');
    char dir[PATH_CAP];
    snprintf(dir, sizeof dir, "%.*s", slash ? (int)(slash - path) : 1, slash ? path : ".");
    char pattern[PATH_CAP];
    snprintf(pattern, sizeof pattern, "%s.tmp-", slash ? slash + 1 : path);
    snprintf(cmd, sizeof cmd, "ls -a '%s'", dir);
    FILE *p = popen(cmd, "r");
    if (!p)
        return 0;
    char line[PATH_CAP];
    int found = 0;
    while (fgets(line, sizeof line, p))
        found |= strncmp(line, pattern, strlen(pattern)) == 0;
    pclose(p);
    return found;
}

static void test_atomic_save(void)
{
    char path[PATH_CAP];
    if (temp_file(path, sizeof path, "ft_hostile_atomic") != 0)
        return;
    const int64_t n = 1 << 16;
    ft_tensor *ones = filled(n, 1.0), *twos = filled(n, 2.0);
    if (!ones || !twos)
        return;
    CHECK_OK(ft_save_npy(ones, path));
    CHECK(loads_as(path, n, 1.0), "first save");
    CHECK(!temp_left(path), "a temporary file was left");

    /* A reader that opened the old file keeps reading the old file whole:
     * the new one replaces it instead of being written into it. */
    FILE *old = fopen(path, "rb");
    CHECK_OK(ft_save_npy(twos, path));
    if (old) {
        static unsigned char buf[(1 << 16) * 8 + 128];
        size_t got = fread(buf, 1, sizeof buf, old);
        fclose(old);
        double last;
        memcpy(&last, buf + got - 8, 8);
        CHECK(got == (size_t)n * 8 + 128 && last == 1.0,
              "the open old file changed: %zu bytes, last %g", got, last);
    }
    CHECK(loads_as(path, n, 2.0), "second save");

    /* Loads racing with saves see one whole version or the other. */
    pid_t child = fork();
    if (child == 0) {
        int bad = 0;
        for (int i = 0; i < 300 && !bad; i++) {
            const double v = loaded_value(path, n);
            bad = v != 1.0 && v != 2.0;
        }
        _exit(bad);
    }
    for (int i = 0; i < 100; i++)
        CHECK_OK(ft_save_npy(i % 2 ? twos : ones, path));
    int status = 0;
    if (child > 0) {
        waitpid(child, &status, 0);
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0,
              "a load during saves saw a mix or a missing file");
    }

    /* The file's permissions stay; a failed save (the disk full after a
     * few bytes) leaves the old file and no temporary one. */
    CHECK(chmod(path, 0640) == 0, "chmod: %s", strerror(errno));
    CHECK_OK(ft_save_npy(ones, path));
    struct stat st;
    CHECK(stat(path, &st) == 0 && (st.st_mode & 07777) == 0640, "mode %o",
          (unsigned)(st.st_mode & 07777));
    struct rlimit saved;
    if (getrlimit(RLIMIT_FSIZE, &saved) == 0) {
        struct rlimit small = saved;
        small.rlim_cur = 4096;
        signal(SIGXFSZ, SIG_IGN);
        if (setrlimit(RLIMIT_FSIZE, &small) == 0) {
            ft_status s = ft_save_npy(twos, path);
            setrlimit(RLIMIT_FSIZE, &saved);
            CHECK(s == FT_ERR_IO, "a save past the file size limit: %d (%s)", (int)s,
                  ft_last_error());
            CHECK(loads_as(path, n, 1.0), "a failed save changed the file");
            CHECK(!temp_left(path), "a failed save left a temporary file");
        }
        signal(SIGXFSZ, SIG_DFL);
    }

    /* Through a symbolic link: the file it points to is replaced, the
     * link stays a link. */
    char link[PATH_CAP + 8];
    snprintf(link, sizeof link, "%s.lnk", path);
    unlink(link);
    if (symlink(path, link) == 0) {
        CHECK_OK(ft_save_npy(twos, link));
        struct stat ls;
        CHECK(lstat(link, &ls) == 0 && S_ISLNK(ls.st_mode), "the link was replaced");
        CHECK(loads_as(path, n, 2.0), "the link's target was not written");
        CHECK(!temp_left(path) && !temp_left(link), "a temporary file was left");
        unlink(link);
    }

    /* A device is written in place, never replaced. */
    if (access("/dev/null", W_OK) == 0) {
        CHECK_OK(ft_save_npy(ones, "/dev/null"));
        struct stat ds;
        CHECK(stat("/dev/null", &ds) == 0 && S_ISCHR(ds.st_mode), "/dev/null was replaced");
    }
    CHECK_FAIL(ft_save_npy(ones, ""), FT_ERR_ARGUMENT, 2, "path is empty");
    ft_tensor_free(ones);
    ft_tensor_free(twos);
    unlink(path);
}

int main(void)
{
    alarm(WATCHDOG_S);
    test_sizes();
    test_npy_empty_huge();
    test_broadcast_reductions();
    test_broadcast_matches_copy();
    test_broadcast_writes();
    test_broadcast_random();
    test_broadcast_random_cuda();
    test_broadcast_index();
    test_matmul_limits();
    test_attention_limits();
    test_device_parse();
    test_arange();
    test_atomic_save();
    if (failures)
        fprintf(stderr, "%d check(s) failed\n", failures);
    return failures != 0;
}
