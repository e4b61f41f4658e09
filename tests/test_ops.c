/*
 * test_ops.c - checks of lib/ops.c on small known inputs: elementwise ops,
 * reductions, softmax, matmul and comparisons, strided views, 0-d and empty
 * tensors, the error messages, and fp8_e4m3 (conversions, refusals). Uses
 * only the public API. Prints a line
 * per failed check to stderr; exits nonzero if any failed.
 */
#include "flashtile.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define TOL 1e-12      /* for results computed in f64 */
#define TOL_F32 1e-5   /* for f32 results */
#define TOL_F16 2e-2   /* for f16 matmul against f64 (relative to values ~5) */
#define BIG_N 1000000  /* elements of the accuracy test for sums */

#include "check.h"

static int near(double x, double y, double tol)
{
    if (isnan(x) || isnan(y))
        return isnan(x) && isnan(y);
    return x == y || fabs(x - y) <= tol * (1.0 + fabs(y));
}

/* A new contiguous tensor holding vals in row-major order (NULL: zeros). */
static ft_tensor *make(ft_dtype dtype, int ndim, const int64_t *shape,
                       const double *vals)
{
    ft_tensor *t = NULL;
    if (ft_empty(&t, ndim, shape, dtype, CPU) != FT_OK) {
        fprintf(stderr, "make: %s\n", ft_last_error());
        failures++;
        return NULL;
    }
    int64_t n = ft_numel(t), idx[FT_MAX_DIMS] = {0};
    for (int64_t i = 0; i < n; i++) {
        int64_t rest = i;
        for (int d = ndim - 1; d >= 0; d--) {
            idx[d] = rest % shape[d];
            rest /= shape[d];
        }
        ft_set(t, idx, vals ? vals[i] : 0.0);
    }
    return t;
}

/* Element i (row-major) of t. */
static double at(const ft_tensor *t, int64_t i)
{
    int64_t idx[FT_MAX_DIMS] = {0};
    for (int d = t->ndim - 1; d >= 0; d--) {
        idx[d] = i % t->shape[d];
        i /= t->shape[d];
    }
    double v = NAN;
    ft_get(t, idx, &v);
    return v;
}

/* t has the given shape and values (row-major) within tol. */
static void expect(const char *what, const ft_tensor *t, int ndim,
                   const int64_t *shape, const double *vals, double tol)
{
    CHECK(t != NULL, "%s: no tensor", what);
    if (!t)
        return;
    CHECK(t->ndim == ndim, "%s: ndim %d, want %d", what, t->ndim, ndim);
    for (int d = 0; d < ndim && d < t->ndim; d++)
        CHECK(t->shape[d] == shape[d], "%s: shape[%d] %lld, want %lld", what,
              d, (long long)t->shape[d], (long long)shape[d]);
    CHECK(ft_is_contiguous(t), "%s: result not contiguous", what);
    int64_t n = ft_numel(t);
    for (int64_t i = 0; i < n && vals; i++)
        CHECK(near(at(t, i), vals[i], tol), "%s[%lld] = %.17g, want %.17g",
              what, (long long)i, at(t, i), vals[i]);
}

static void test_elementwise(void)
{
    const int64_t s23[] = {2, 3}, s32[] = {3, 2};
    ft_tensor *a = make(FT_F64, 2, s23, (double[]){1, 2, 3, 4, 5, 6});
    ft_tensor *b = make(FT_F64, 2, s23, (double[]){6, 5, 4, 3, 2, 1});
    ft_tensor *r = NULL, *at_ = NULL, *c = NULL;

    CHECK_OK(ft_binary(&r, FT_ADD, a, b));
    expect("add", r, 2, s23, (double[]){7, 7, 7, 7, 7, 7}, TOL);
    ft_tensor_free(r);
    CHECK_OK(ft_binary(&r, FT_DIV, a, b));
    expect("div", r, 2, s23, (double[]){1 / 6., 2 / 5., 3 / 4., 4 / 3., 5 / 2., 6},
           TOL);
    ft_tensor_free(r);
    CHECK_OK(ft_binary(&r, FT_POW, a, b));
    expect("pow", r, 2, s23, (double[]){1, 32, 81, 64, 25, 6}, TOL);
    ft_tensor_free(r);
    CHECK_OK(ft_binary(&r, FT_MAXIMUM, a, b));
    expect("maximum", r, 2, s23, (double[]){6, 5, 4, 4, 5, 6}, TOL);
    ft_tensor_free(r);

    /* A transposed (strided) view against a contiguous tensor. */
    CHECK_OK(ft_transpose(&at_, a, 0, 1));
    c = make(FT_F64, 2, s32, (double[]){10, 20, 30, 40, 50, 60});
    CHECK_OK(ft_binary(&r, FT_SUB, c, at_));
    expect("sub transposed", r, 2, s32, (double[]){9, 16, 28, 35, 47, 54}, TOL);
    ft_tensor_free(r);

    CHECK_OK(ft_binary_scalar(&r, FT_SUB, a, 1.0, 0));
    expect("a - 1", r, 2, s23, (double[]){0, 1, 2, 3, 4, 5}, TOL);
    ft_tensor_free(r);
    CHECK_OK(ft_binary_scalar(&r, FT_SUB, a, 1.0, 1));
    expect("1 - a", r, 2, s23, (double[]){0, -1, -2, -3, -4, -5}, TOL);
    ft_tensor_free(r);

    const int64_t s4[] = {4};
    ft_tensor *u = make(FT_F32, 1, s4, (double[]){-2, 0, 1, 4});
    CHECK_OK(ft_unary(&r, FT_RELU, u));
    expect("relu", r, 1, s4, (double[]){0, 0, 1, 4}, TOL);
    ft_tensor_free(r);
    CHECK_OK(ft_unary(&r, FT_SIGMOID, u));
    expect("sigmoid", r, 1, s4,
           (double[]){1 / (1 + exp(2.)), 0.5, 1 / (1 + exp(-1.)),
                      1 / (1 + exp(-4.))},
           TOL_F32);
    ft_tensor_free(r);
    CHECK_OK(ft_unary(&r, FT_ABS, u));
    expect("abs", r, 1, s4, (double[]){2, 0, 1, 4}, TOL);
    ft_tensor_free(r);
    CHECK_OK(ft_unary(&r, FT_EXP, u));
    expect("exp", r, 1, s4, (double[]){exp(-2.), 1, exp(1.), exp(4.)}, TOL_F32);
    CHECK(r && r->dtype == FT_F32, "exp keeps the dtype");
    ft_tensor_free(r);

    /* Integers: add works, division and exp do not. */
    ft_tensor *i1 = make(FT_I32, 1, s4, (double[]){1, -2, 3, 4});
    ft_tensor *i2 = make(FT_I32, 1, s4, (double[]){10, 20, 30, 40});
    CHECK_OK(ft_binary(&r, FT_MUL, i1, i2));
    expect("i32 mul", r, 1, s4, (double[]){10, -40, 90, 160}, 0);
    CHECK(r && r->dtype == FT_I32, "i32 mul keeps the dtype");
    ft_tensor_free(r);
    CHECK_OK(ft_unary(&r, FT_NEG, i1));
    expect("i32 neg", r, 1, s4, (double[]){-1, 2, -3, -4}, 0);
    ft_tensor_free(r);
    r = a; /* must be reset to NULL on failure */
    CHECK_FAIL(ft_binary(&r, FT_DIV, i1, i2), FT_ERR_ARGUMENT, 2,
               "ft_binary: div needs floating-point tensors, got i32");
    CHECK(r == NULL, "out not NULL after failure");
    CHECK_FAIL(ft_unary(&r, FT_EXP, i1), FT_ERR_ARGUMENT, 2,
               "ft_unary: exp needs a floating-point tensor, got i32");

    /* Errors: dtypes, shapes, NULL. */
    ft_tensor *f32 = make(FT_F32, 2, s23, NULL);
    CHECK_FAIL(ft_binary(&r, FT_ADD, f32, a), FT_ERR_ARGUMENT, 3,
               "ft_binary: dtypes differ (f32 and f64)");
    CHECK_FAIL(ft_binary(&r, FT_ADD, a, c), FT_ERR_ARGUMENT, 3,
               "shapes differ ({2, 3} and {3, 2})");
    CHECK_FAIL(ft_binary(&r, FT_ADD, NULL, a), FT_ERR_ARGUMENT, 2, "NULL");
    CHECK(r == NULL, "out not NULL after failure");

    ft_tensor_free(a);
    ft_tensor_free(b);
    ft_tensor_free(at_);
    ft_tensor_free(c);
    ft_tensor_free(u);
    ft_tensor_free(i1);
    ft_tensor_free(i2);
    ft_tensor_free(f32);
}

static void test_scalar_and_empty(void)
{
    ft_tensor *s = make(FT_F64, 0, NULL, (double[]){-2.5}), *r = NULL;
    CHECK_OK(ft_unary(&r, FT_NEG, s));
    expect("0-d neg", r, 0, NULL, (double[]){2.5}, TOL);
    ft_tensor_free(r);
    double v = 0;
    CHECK_OK(ft_reduce_all(FT_MAX, s, &v));
    CHECK(v == -2.5, "0-d max %g", v);
    CHECK_FAIL(ft_reduce_dim(&r, NULL, FT_SUM, s, 0, 0), FT_ERR_ARGUMENT, 3,
               "dim 0 out of range for a 0-d tensor");

    const int64_t s03[] = {0, 3}, s3[] = {3}, s13[] = {1, 3};
    ft_tensor *e = make(FT_F32, 2, s03, NULL);
    CHECK_OK(ft_binary(&r, FT_ADD, e, e));
    expect("empty add", r, 2, s03, NULL, 0);
    ft_tensor_free(r);
    CHECK_OK(ft_reduce_all(FT_SUM, e, &v));
    CHECK(v == 0.0, "empty sum %g", v);
    CHECK_OK(ft_reduce_all(FT_MEAN, e, &v));
    CHECK(isnan(v), "empty mean %g", v);
    CHECK_FAIL(ft_reduce_all(FT_MAX, e, &v), FT_ERR_ARGUMENT, 2,
               "ft_reduce_all: max of an empty tensor");
    CHECK_OK(ft_reduce_dim(&r, NULL, FT_SUM, e, 0, 0));
    expect("empty sum dim 0", r, 1, s3, (double[]){0, 0, 0}, 0);
    ft_tensor_free(r);
    CHECK_OK(ft_reduce_dim(&r, NULL, FT_NORM, e, 0, 1));
    expect("empty norm dim 0 keepdim", r, 2, s13, (double[]){0, 0, 0}, 0);
    ft_tensor_free(r);
    CHECK_FAIL(ft_reduce_dim(&r, NULL, FT_MIN, e, 0, 0), FT_ERR_ARGUMENT, 3,
               "min along dim 0, which has size 0");
    CHECK_OK(ft_softmax(&r, e, 1));
    expect("empty softmax", r, 2, s03, NULL, 0);
    ft_tensor_free(r);
    int close = 0;
    CHECK_OK(ft_max_abs_diff(e, e, &v));
    CHECK(v == 0.0, "empty max_abs_diff %g", v);
    CHECK_OK(ft_allclose(e, e, 0, 0, &close));
    CHECK(close == 1, "empty allclose %d", close);
    ft_tensor_free(s);
    ft_tensor_free(e);
}

static void test_reductions(void)
{
    const int64_t s23[] = {2, 3}, s2[] = {2}, s21[] = {2, 1}, s3[] = {3};
    ft_tensor *a = make(FT_F64, 2, s23, (double[]){3, -1, 3, 0, 7, 2});
    ft_tensor *r = NULL, *idx = NULL;
    double v = 0;

    CHECK_OK(ft_reduce_all(FT_SUM, a, &v));
    CHECK(v == 14, "sum %g", v);
    CHECK_OK(ft_reduce_all(FT_NORM, a, &v));
    CHECK(near(v, sqrt(72.0), TOL), "norm %g", v);
    CHECK_OK(ft_reduce_all(FT_MIN, a, &v));
    CHECK(v == -1, "min %g", v);

    CHECK_OK(ft_reduce_dim(&r, &idx, FT_MAX, a, 1, 0));
    expect("max dim 1", r, 1, s2, (double[]){3, 7}, 0);
    expect("argmax dim 1 (first of ties)", idx, 1, s2, (double[]){0, 1}, 0);
    CHECK(idx && idx->dtype == FT_I64, "indices are i64");
    ft_tensor_free(r);
    ft_tensor_free(idx);
    CHECK_OK(ft_reduce_dim(&r, NULL, FT_MEAN, a, -1, 1));
    expect("mean dim -1 keepdim", r, 2, s21, (double[]){5 / 3., 3}, TOL);
    ft_tensor_free(r);

    /* Along dim 0 of a transposed view: the rows of a. */
    ft_tensor *t = NULL;
    CHECK_OK(ft_transpose(&t, a, 0, 1));
    CHECK_OK(ft_reduce_dim(&r, &idx, FT_MIN, t, 0, 0));
    expect("min of transposed dim 0", r, 1, s2, (double[]){-1, 0}, 0);
    expect("argmin of transposed dim 0", idx, 1, s2, (double[]){1, 0}, 0);
    ft_tensor_free(r);
    ft_tensor_free(idx);
    CHECK_OK(ft_reduce_dim(&r, NULL, FT_SUM, t, 1, 0));
    expect("sum of transposed dim 1", r, 1, s3, (double[]){3, 6, 5}, 0);
    ft_tensor_free(r);

    /* 1-d reduced along its dim gives 0-d; NaN propagates through max. */
    ft_tensor *n = make(FT_F32, 1, s3, (double[]){1, NAN, 5});
    CHECK_OK(ft_reduce_dim(&r, &idx, FT_MAX, n, 0, 0));
    expect("max with NaN", r, 0, NULL, (double[]){NAN}, 0);
    expect("argmax with NaN", idx, 0, NULL, (double[]){1}, 0);
    ft_tensor_free(r);
    ft_tensor_free(idx);
    CHECK_OK(ft_reduce_all(FT_MIN, n, &v));
    CHECK(isnan(v), "min with NaN %g", v);

    /* Integers: sum along a dim is fine, norm is not; indices need max/min. */
    ft_tensor *i = make(FT_I64, 2, s23, (double[]){1, 2, 3, 4, 5, 6});
    CHECK_OK(ft_reduce_dim(&r, NULL, FT_SUM, i, 0, 0));
    expect("i64 sum dim 0", r, 1, s3, (double[]){5, 7, 9}, 0);
    ft_tensor_free(r);
    CHECK_OK(ft_reduce_all(FT_MEAN, i, &v));
    CHECK(v == 3.5, "i64 mean %g", v);
    CHECK_FAIL(ft_reduce_dim(&r, NULL, FT_NORM, i, 0, 0), FT_ERR_ARGUMENT, 2,
               "norm needs a floating-point tensor, got i64");
    idx = a;
    CHECK_FAIL(ft_reduce_dim(&r, &idx, FT_SUM, a, 0, 0), FT_ERR_ARGUMENT, 1,
               "sum gives no indices");
    CHECK(idx == NULL && r == NULL, "outputs not NULL after failure");
    CHECK_FAIL(ft_reduce_dim(&r, NULL, FT_SUM, a, 3, 0), FT_ERR_ARGUMENT, 3,
               "ft_reduce_dim: dim 3 out of range for a 2-d tensor");

    /* Accuracy: 1e6 copies of 0.1f sum to 1e6 * 0.1f nearly exactly. */
    const int64_t sbig[] = {BIG_N};
    ft_tensor *big = NULL;
    CHECK_OK(ft_empty(&big, 1, sbig, FT_F32, CPU));
    CHECK_OK(ft_fill(big, 0.1));
    CHECK_OK(ft_reduce_all(FT_SUM, big, &v));
    CHECK(fabs(v - BIG_N * (double)0.1f) < 1e-6, "sum of 1e6 f32: %.17g", v);
    CHECK_OK(ft_reduce_dim(&r, NULL, FT_MEAN, big, 0, 0));
    CHECK(r && fabs(at(r, 0) - (double)0.1f) < 1e-9, "mean of 1e6 f32: %.17g",
          r ? at(r, 0) : NAN);
    ft_tensor_free(r);

    ft_tensor_free(a);
    ft_tensor_free(t);
    ft_tensor_free(n);
    ft_tensor_free(i);
    ft_tensor_free(big);
}

static void test_softmax(void)
{
    const int64_t s23[] = {2, 3};
    ft_tensor *a = make(FT_F64, 2, s23,
                        (double[]){0, log(2.), log(5.), -INFINITY, -INFINITY,
                                   -INFINITY});
    ft_tensor *r = NULL, *t = NULL;
    CHECK_OK(ft_softmax(&r, a, 1));
    /* Row 1 is all -inf: NaN, as torch gives. */
    expect("softmax", r, 2, s23, (double[]){1 / 8., 2 / 8., 5 / 8., NAN, NAN, NAN},
           TOL);
    ft_tensor_free(r);

    /* Large values must not overflow (the max is subtracted). */
    ft_tensor *big = make(FT_F32, 2, s23, (double[]){1000, 1000, 1000, 1, 2, 3});
    CHECK_OK(ft_transpose(&t, big, 0, 1));
    CHECK_OK(ft_softmax(&r, t, 0)); /* the rows of big */
    double e1 = 1 / (1 + exp(1.) + exp(2.));
    const int64_t s32[] = {3, 2};
    expect("softmax transposed", r, 2, s32,
           (double[]){1 / 3., e1, 1 / 3., e1 * exp(1.), 1 / 3., e1 * exp(2.)},
           TOL_F32);
    ft_tensor_free(r);

    ft_tensor *i = make(FT_I32, 2, s23, NULL);
    CHECK_FAIL(ft_softmax(&r, i, 1), FT_ERR_ARGUMENT, 1,
               "softmax needs a floating-point tensor, got i32");
    CHECK_FAIL(ft_softmax(&r, a, -3), FT_ERR_ARGUMENT, 2,
               "dim -3 out of range for a 2-d tensor");
    ft_tensor_free(a);
    ft_tensor_free(big);
    ft_tensor_free(t);
    ft_tensor_free(i);
}

static void test_matmul(void)
{
    const int64_t s23[] = {2, 3}, s32[] = {3, 2}, s22[] = {2, 2};
    ft_tensor *a = make(FT_F64, 2, s23, (double[]){1, 2, 3, 4, 5, 6});
    ft_tensor *b = make(FT_F64, 2, s32, (double[]){7, 8, 9, 10, 11, 12});
    ft_tensor *r = NULL, *at_ = NULL, *bt = NULL;
    const double want[] = {58, 64, 139, 154};

    CHECK_OK(ft_matmul(&r, a, b));
    expect("matmul", r, 2, s22, want, TOL);
    ft_tensor_free(r);

    /* Transposed views go to BLAS with CblasTrans: (a^T)^T x (b^T)^T. */
    ft_tensor *ac = NULL, *bc = NULL;
    CHECK_OK(ft_transpose(&at_, a, 0, 1));
    CHECK_OK(ft_transpose(&bt, b, 0, 1));
    CHECK_OK(ft_clone(&ac, at_));
    CHECK_OK(ft_clone(&bc, bt));
    ft_tensor *at2 = NULL, *bt2 = NULL;
    CHECK_OK(ft_transpose(&at2, ac, 0, 1));
    CHECK_OK(ft_transpose(&bt2, bc, 0, 1));
    CHECK_OK(ft_matmul(&r, at2, bt2));
    expect("matmul of transposed views", r, 2, s22, want, TOL);
    ft_tensor_free(r);
    /* b^T x a^T = (a b)^T */
    CHECK_OK(ft_matmul(&r, bt, at_));
    expect("matmul b^T a^T", r, 2, s22, (double[]){58, 139, 64, 154}, TOL);
    ft_tensor_free(r);

    /* A view with no unit stride is packed: p[i][l] = x[l][i][0] = 4l + 2i. */
    const int64_t s322[] = {3, 2, 2};
    double vx[12];
    for (int k = 0; k < 12; k++)
        vx[k] = k;
    ft_tensor *x = make(FT_F64, 3, s322, vx), *xp = NULL, *xs = NULL;
    CHECK_OK(ft_permute(&xp, x, (const int[]){1, 2, 0}));
    CHECK_OK(ft_select(&xs, xp, 1, 0));
    CHECK(xs && xs->stride[0] != 1 && xs->stride[1] != 1, "view has a unit stride");
    CHECK_OK(ft_matmul(&r, xs, b));
    expect("matmul of a packed view", r, 2, s22, (double[]){124, 136, 178, 196},
           TOL);
    ft_tensor_free(r);

    /* Batched f32, batch 1 = 2 * batch 0. */
    const int64_t s223[] = {2, 2, 3}, s232[] = {2, 3, 2}, s222[] = {2, 2, 2};
    ft_tensor *ba = make(FT_F32, 3, s223,
                         (double[]){1, 2, 3, 4, 5, 6, 2, 4, 6, 8, 10, 12});
    ft_tensor *bb = make(FT_F32, 3, s232,
                         (double[]){7, 8, 9, 10, 11, 12, 7, 8, 9, 10, 11, 12});
    CHECK_OK(ft_matmul(&r, ba, bb));
    expect("batched matmul", r, 3, s222,
           (double[]){58, 64, 139, 154, 116, 128, 278, 308}, TOL_F32);
    ft_tensor_free(r);

    /* f16 against f64 on the same (f16-exact) values. */
    const int64_t s45[] = {4, 5}, s53[] = {5, 3}, s43[] = {4, 3};
    double va[20], vb[15];
    for (int i = 0; i < 20; i++)
        va[i] = (i % 7 - 3) * 0.25;
    for (int i = 0; i < 15; i++)
        vb[i] = (i % 5 - 2) * 0.5 + 0.125;
    ft_tensor *h1 = make(FT_F16, 2, s45, va), *h2 = make(FT_F16, 2, s53, vb);
    ft_tensor *d1 = make(FT_F64, 2, s45, va), *d2 = make(FT_F64, 2, s53, vb);
    ft_tensor *rh = NULL, *rd = NULL;
    CHECK_OK(ft_matmul(&rh, h1, h2));
    CHECK_OK(ft_matmul(&rd, d1, d2));
    CHECK(rh && rh->dtype == FT_F16, "f16 matmul gives f16");
    double diff = 1;
    CHECK_OK(ft_max_abs_diff(rh, rd, &diff));
    CHECK(diff < TOL_F16, "f16 vs f64 matmul differ by %g", diff);
    if (rh)
        expect("f16 matmul shape", rh, 2, s43, NULL, 0);

    /* k == 0 gives zeros; m == 0 an empty result. */
    const int64_t s20[] = {2, 0}, s02[] = {0, 2};
    ft_tensor *z1 = make(FT_F64, 2, s20, NULL), *z2 = make(FT_F64, 2, s02, NULL);
    CHECK_OK(ft_matmul(&r, z1, z2));
    expect("k == 0", r, 2, s22, (double[]){0, 0, 0, 0}, 0);
    ft_tensor_free(r);
    CHECK_OK(ft_matmul(&r, z2, a));
    const int64_t s03[] = {0, 3};
    expect("m == 0", r, 2, s03, NULL, 0);
    ft_tensor_free(r);

    /* Errors. */
    const int64_t s4d[] = {1, 1, 2, 2}, s423[] = {4, 3, 2};
    ft_tensor *four = make(FT_F64, 4, s4d, NULL), *i = make(FT_I32, 2, s22, NULL);
    ft_tensor *b4 = make(FT_F32, 3, s423, NULL);
    CHECK_FAIL(ft_matmul(&r, a, a), FT_ERR_ARGUMENT, 2,
               "ft_matmul: inner dimensions differ ({2, 3} x {2, 3})");
    CHECK_FAIL(ft_matmul(&r, four, a), FT_ERR_ARGUMENT, 1,
               "needs 2-d or 3-d tensors, got 4-d");
    CHECK_FAIL(ft_matmul(&r, ba, b4), FT_ERR_ARGUMENT, 2,
               "batch sizes differ (2 and 4)");
    CHECK_FAIL(ft_matmul(&r, a, h2), FT_ERR_ARGUMENT, 2, "dtypes differ");
    CHECK_FAIL(ft_matmul(&r, i, i), FT_ERR_ARGUMENT, 1,
               "needs floating-point tensors, got i32");
    CHECK(r == NULL, "out not NULL after failure");

    ft_tensor *list[] = {a, b, at_, bt, ac, bc, at2, bt2, ba, bb, h1, h2,
                         d1, d2, rh, rd, z1, z2, four, i, b4, x, xp, xs};
    for (size_t k = 0; k < sizeof list / sizeof *list; k++)
        ft_tensor_free(list[k]);
}

static void test_compare(void)
{
    const int64_t s3[] = {3}, s2[] = {2};
    ft_tensor *a = make(FT_F64, 1, s3, (double[]){1, 2, INFINITY});
    ft_tensor *b = make(FT_F32, 1, s3, (double[]){1, 2.5, INFINITY});
    ft_tensor *n = make(FT_F64, 1, s3, (double[]){1, NAN, 3});
    ft_tensor *c = make(FT_F64, 1, s2, NULL);
    double v = 0;
    int close = -1;
    CHECK_OK(ft_max_abs_diff(a, b, &v));
    CHECK(v == 0.5, "max_abs_diff %g", v);
    CHECK_OK(ft_max_abs_diff(a, n, &v));
    CHECK(isnan(v), "max_abs_diff with NaN %g", v);
    CHECK_OK(ft_allclose(a, b, 0, 0.5, &close));
    CHECK(close == 1, "allclose atol 0.5: %d", close);
    CHECK_OK(ft_allclose(a, b, 0.1, 0.2, &close));
    CHECK(close == 0, "allclose rtol 0.1 atol 0.2: %d", close);
    CHECK_OK(ft_allclose(a, b, 0.2, 0, &close));
    CHECK(close == 1, "allclose rtol 0.2: %d", close);
    CHECK_OK(ft_allclose(n, n, 1, 1, &close));
    CHECK(close == 0, "NaN is never close: %d", close);
    CHECK_FAIL(ft_allclose(a, c, 0, 0, &close), FT_ERR_ARGUMENT, 2,
               "shapes differ ({3} and {2})");
    ft_tensor_free(a);
    ft_tensor_free(b);
    ft_tensor_free(n);
    ft_tensor_free(c);
}

/* fp8_e4m3 through the public API: the dtype's facts, the scalar
 * conversions (every pattern, the ties, saturation), and the refusal of
 * every op but the comparisons, with the op and the way out named. */
static void test_fp8(void)
{
    ft_dtype d = FT_F32;
    CHECK_OK(ft_dtype_parse("float8_e4m3fn", &d));
    CHECK(d == FT_FP8_E4M3, "alias parses to %d", (int)d);
    CHECK(ft_dtype_size(FT_FP8_E4M3) == 1, "size %zu", ft_dtype_size(FT_FP8_E4M3));
    CHECK(strcmp(ft_dtype_name(FT_FP8_E4M3), "fp8_e4m3") == 0, "name %s",
          ft_dtype_name(FT_FP8_E4M3));
    CHECK(!ft_dtype_is_float(FT_FP8_E4M3) && ft_dtype_is_storage_only(FT_FP8_E4M3),
          "fp8 is a storage dtype");
    CHECK(!ft_dtype_is_storage_only(FT_F16) && !ft_dtype_is_storage_only(FT_I32),
          "no other dtype is storage only");
    for (int b = 0; b < 256; b++) {
        const double v = ft_fp8_e4m3_to_f64((uint8_t)b);
        if ((b & 0x7f) == 0x7f)
            CHECK(isnan(v) && ft_f64_to_fp8_e4m3(v) == b, "pattern %d: NaN kept", b);
        else
            CHECK(ft_f64_to_fp8_e4m3(v) == b, "pattern %d (%g) round trips", b, v);
    }
    const struct { double x; int bits; } cases[] = {
        {1.0625, 0x38}, {1.1875, 0x3a}, {-1.0625, 0xb8}, {0x1p-10, 0x00}, {-0x1p-10, 0x80},
        {3 * 0x1p-10, 0x02}, {448, 0x7e}, {464, 0x7e}, {480, 0x7e}, {1e300, 0x7e},
        {-1e300, 0xfe}, {INFINITY, 0x7f}, {-INFINITY, 0xff},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        CHECK(ft_f64_to_fp8_e4m3(cases[i].x) == cases[i].bits, "%g gives 0x%02x, want 0x%02x",
              cases[i].x, ft_f64_to_fp8_e4m3(cases[i].x), cases[i].bits);

    const int64_t s3[] = {3};
    ft_tensor *a = make(FT_FP8_E4M3, 1, s3, (double[]){1.0625, -500, 0.1});
    ft_tensor *f = make(FT_F32, 1, s3, (double[]){1, -448, 0.1015625});
    ft_tensor *o = NULL, *idx = NULL, *c = NULL;
    double v = -1;
    expect("fp8 set", a, 1, s3, (double[]){1, -448, 0.1015625}, 0);
    CHECK_OK(ft_to(&c, f, FT_FP8_E4M3, CPU));
    expect("f32 to fp8", c, 1, s3, (double[]){1, -448, 0.1015625}, 0);
    CHECK_OK(ft_max_abs_diff(a, f, &v));
    CHECK(v == 0, "max_abs_diff fp8 / f32 %g", v);
    CHECK_FAIL(ft_binary(&o, FT_ADD, a, a), FT_ERR_ARGUMENT, 2,
               "ft_binary: add: fp8_e4m3 tensors hold data only; convert");
    CHECK_FAIL(ft_binary(&o, FT_MUL, f, a), FT_ERR_ARGUMENT, 3, "mul: fp8_e4m3");
    CHECK_FAIL(ft_binary_scalar(&o, FT_DIV, a, 2, 0), FT_ERR_ARGUMENT, 2, "div: fp8_e4m3");
    CHECK_FAIL(ft_unary(&o, FT_ABS, a), FT_ERR_ARGUMENT, 2, "ft_unary: abs: fp8_e4m3");
    CHECK_FAIL(ft_reduce_all(FT_MAX, a, &v), FT_ERR_ARGUMENT, 2, "ft_reduce_all: max: fp8_e4m3");
    CHECK_FAIL(ft_reduce_dim(&o, &idx, FT_MIN, a, 0, 0), FT_ERR_ARGUMENT, 2, "min: fp8_e4m3");
    CHECK_FAIL(ft_softmax(&o, a, 0), FT_ERR_ARGUMENT, 1, "ft_softmax: softmax: fp8_e4m3");
    CHECK_FAIL(ft_randn(a, 1, 0), FT_ERR_ARGUMENT, 1, "ft_randn: randn: fp8_e4m3");
    CHECK(o == NULL && idx == NULL, "no result after a refusal");
    expect("fp8 unchanged", a, 1, s3, (double[]){1, -448, 0.1015625}, 0);
    ft_tensor_free(a);
    ft_tensor_free(f);
    ft_tensor_free(c);
}

int main(void)
{
    ft_memory_stats before, after;
    ft_memory_stats_get(CPU, &before);
    test_elementwise();
    test_scalar_and_empty();
    test_reductions();
    test_softmax();
    test_matmul();
    test_compare();
    test_fp8();
    ft_memory_stats_get(CPU, &after);
    CHECK(after.in_use == before.in_use, "leaked %lld bytes",
          (long long)(after.in_use - before.in_use));
    if (failures)
        fprintf(stderr, "test_ops: %d check(s) failed\n", failures);
    else
        printf("test_ops: all checks passed\n");
    return failures != 0;
}
