/*
 * ops.c - elementwise ops, reductions, softmax, matmul and comparisons.
 *
 * Every op validates its inputs, allocates its result with ft_empty_named
 * on the inputs' device and then calls a static *_cpu function that does
 * the loop, or, for CUDA tensors, the launcher of kernels/ (tensor/,
 * matmul.cu). Elements are read and written through ft_load_f64 /
 * ft_store_f64 and the math is done in double, with the per-element rules
 * of scalar_ops.h that the kernels share; inputs may be any strided
 * view (stride 0, empty, 0-d), walked with ft_iter. All tensor operands
 * of one op must be on one device. fp8_e4m3, a storage dtype, is refused
 * by every op here but the comparisons, which only read and convert.
 */
#include "internal.h"
#include "scalar_ops.h"
#ifdef FT_HAVE_CUDA
#include "kernels.h"
#endif

#include <cblas.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Room for "{d0, d1, ...}" with FT_MAX_DIMS 20-digit dims. */
#define SHAPE_BUF 256
/* The largest m, n, k or leading dimension CBLAS accepts (it takes int). */
#define BLAS_DIM_MAX ((int64_t)INT_MAX)

static const char *const BINOP_NAMES[] = {"add", "sub", "mul", "div",
                                          "pow", "maximum", "minimum"};
static const char *const UNOP_NAMES[] = {"neg", "exp", "log", "abs",
                                         "sqrt", "tanh", "sigmoid", "relu"};
static const char *const REDUCE_NAMES[] = {"sum", "mean", "max", "min",
                                           "norm"};
#define NUM_BINOPS ((int)(sizeof BINOP_NAMES / sizeof *BINOP_NAMES))
#define NUM_UNOPS ((int)(sizeof UNOP_NAMES / sizeof *UNOP_NAMES))
#define NUM_REDUCE_OPS ((int)(sizeof REDUCE_NAMES / sizeof *REDUCE_NAMES))

/* ---- shared checks ---------------------------------------------------- */

static ft_status check_out(const char *func, const void *out)
{
    if (out == NULL)
        return ft_fail(FT_ERR_ARGUMENT, func, 0, "result pointer is NULL");
    return FT_OK;
}

/* A non-NULL tensor at input position arg, on a device this build
 * computes on, and on ref's device when ref is given. */
static ft_status check_input(const char *func, int arg, const ft_tensor *t,
                             const ft_tensor *ref)
{
    FT_TRY(ft_check_tensor(func, arg, t));
    return ft_check_device(func, arg, t, ref);
}

#ifdef FT_HAVE_CUDA
static int on_cuda(const ft_tensor *t)
{
    return t->device.type == FT_CUDA;
}

/* A launcher's status; on failure the result tensors are freed and
 * cleared. */
static ft_status finish(ft_status s, ft_tensor **out, ft_tensor **indices)
{
    if (s != FT_OK) {
        ft_tensor_free(*out);
        *out = NULL;
        if (indices) {
            ft_tensor_free(*indices);
            *indices = NULL;
        }
    }
    return s;
}
#endif

static ft_status check_same_dtype(const char *func, int arg,
                                  const ft_tensor *a, const ft_tensor *b)
{
    if (a->dtype != b->dtype)
        return ft_fail(FT_ERR_ARGUMENT, func, arg, "dtypes differ (%s and %s)",
                       ft_dtype_name(a->dtype), ft_dtype_name(b->dtype));
    return FT_OK;
}

/* ---- elementwise ------------------------------------------------------ */

static int binop_int_ok(ft_binop op)
{
    return op == FT_ADD || op == FT_SUB || op == FT_MUL || op == FT_MAXIMUM ||
           op == FT_MINIMUM;
}

/* The name of a binary op for messages ("binary op" for an unknown one,
 * which check_binop refuses). */
static const char *binop_name(ft_binop op)
{
    return (int)op >= 0 && (int)op < NUM_BINOPS ? BINOP_NAMES[op] : "binary op";
}

static ft_status check_binop(const char *func, ft_binop op, int arg,
                             const ft_tensor *a)
{
    if ((int)op < 0 || (int)op >= NUM_BINOPS)
        return ft_fail(FT_ERR_ARGUMENT, func, 1, "unknown binary op %d",
                       (int)op);
    FT_TRY(ft_check_computable(func, arg, a->dtype, BINOP_NAMES[op]));
    if (!ft_dtype_is_float(a->dtype) && !binop_int_ok(op))
        return ft_fail(FT_ERR_ARGUMENT, func, arg,
                       "%s needs floating-point tensors, got %s",
                       BINOP_NAMES[op], ft_dtype_name(a->dtype));
    return FT_OK;
}

/* out = a op b, or a op s (b NULL), or s op a (b NULL, scalar_first). */
/* f32 operands of + - * /: the same results as the general loop below
 * (each value computed in double and rounded once to f32), a row of the
 * last dim at a time (all of it when everything is contiguous), in loops
 * the compiler vectorises once it has unswitched the invariant op and
 * operand tests (-O3, see CMakeLists.txt); strided and broadcast (stride
 * 0) operands take the same loops with their strides. Returns 0 when it
 * does not apply. */
static void binary_f32_row(float *o, int64_t os, const float *x, int64_t xs, const float *y,
                           int64_t ys, int64_t n, ft_binop op, double s, int scalar_first)
{
    for (int64_t i = 0; i < n; i++) {
        double u = x[i * xs], v = y ? (double)y[i * ys] : s;
        if (scalar_first) {
            double t = u;
            u = v, v = t;
        }
        double r = op == FT_ADD ? u + v : op == FT_SUB ? u - v : op == FT_MUL ? u * v : u / v;
        o[i * os] = (float)r;
    }
}

static int binary_f32(ft_tensor *out, ft_binop op, const ft_tensor *a, const ft_tensor *b,
                      double s, int scalar_first)
{
    if (op > FT_DIV || a->dtype != FT_F32 || (b && b->dtype != FT_F32) || out->dtype != FT_F32)
        return 0;
    const int64_t n = ft_numel(a);
    if (ft_is_contiguous(a) && (!b || ft_is_contiguous(b)) && ft_is_contiguous(out)) {
        binary_f32_row(out->data, 1, a->data, 1, b ? b->data : NULL, 1, n, op, s, scalar_first);
        return 1;
    }
    const int nd = a->ndim;
    if (nd == 0)
        return 0;
    const ft_tensor *second = b ? b : a; /* an unused stride row if scalar */
    const int64_t row = a->shape[nd - 1], rows = row > 0 ? n / row : 0;
    ft_iter it;
    ft_iter_init(&it, nd - 1, a->shape, 3,
                 (const int64_t *[]){a->stride, second->stride, out->stride});
    for (int64_t r = 0; r < rows; r++, ft_iter_next(&it))
        binary_f32_row((float *)ft_elem_ptr(out, it.offset[2]), out->stride[nd - 1],
                       (const float *)ft_elem_ptr(a, it.offset[0]), a->stride[nd - 1],
                       b ? (const float *)ft_elem_ptr(b, it.offset[1]) : NULL,
                       second->stride[nd - 1], row, op, s, scalar_first);
    return 1;
}

static void binary_cpu(ft_tensor *out, ft_binop op, const ft_tensor *a,
                       const ft_tensor *b, double s, int scalar_first)
{
    if (binary_f32(out, op, a, b, s, scalar_first))
        return;
    const ft_tensor *second = b ? b : a; /* an unused stride row if scalar */
    ft_iter it;
    ft_iter_init(&it, a->ndim, a->shape, 3,
                 (const int64_t *[]){a->stride, second->stride, out->stride});
    int64_t n = ft_numel(a);
    for (int64_t i = 0; i < n; i++, ft_iter_next(&it)) {
        double x = ft_load_f64(ft_elem_ptr(a, it.offset[0]), a->dtype);
        double y = b ? ft_load_f64(ft_elem_ptr(b, it.offset[1]), b->dtype) : s;
        double r = scalar_first ? ft_apply_binop(op, y, x)
                                : ft_apply_binop(op, x, y);
        ft_store_f64(ft_elem_ptr(out, it.offset[2]), out->dtype, r);
    }
}

static void unary_cpu(ft_tensor *out, ft_unop op, const ft_tensor *a)
{
    ft_iter it;
    ft_iter_init(&it, a->ndim, a->shape, 2,
                 (const int64_t *[]){a->stride, out->stride});
    int64_t n = ft_numel(a);
    for (int64_t i = 0; i < n; i++, ft_iter_next(&it)) {
        double x = ft_load_f64(ft_elem_ptr(a, it.offset[0]), a->dtype);
        ft_store_f64(ft_elem_ptr(out, it.offset[1]), out->dtype,
                     ft_apply_unop(op, x));
    }
}

ft_status ft_binary(ft_tensor **out, ft_binop op, const ft_tensor *a,
                    const ft_tensor *b)
{
    static const char *const F = "ft_binary";
    FT_TRY(check_out(F, out));
    *out = NULL;
    FT_TRY(check_input(F, 2, a, NULL));
    FT_TRY(check_input(F, 3, b, a));
    FT_TRY(ft_check_computable(F, 2, a->dtype, binop_name(op)));
    FT_TRY(ft_check_computable(F, 3, b->dtype, binop_name(op)));
    FT_TRY(check_same_dtype(F, 3, a, b));
    FT_TRY(ft_check_same_shape(F, 3, a, b));
    FT_TRY(check_binop(F, op, 2, a));
    FT_TRY(ft_empty_named(out, a->ndim, a->shape, a->dtype, a->device, F));
    if (ft_numel(*out) == 0)
        return FT_OK;
#ifdef FT_HAVE_CUDA
    if (on_cuda(a))
        return finish(ft_cuda_binary(*out, op, a, b), out, NULL);
#endif
    binary_cpu(*out, op, a, b, 0.0, 0);
    return FT_OK;
}

ft_status ft_binary_scalar(ft_tensor **out, ft_binop op, const ft_tensor *a,
                           double s, int scalar_first)
{
    static const char *const F = "ft_binary_scalar";
    FT_TRY(check_out(F, out));
    *out = NULL;
    FT_TRY(check_input(F, 2, a, NULL));
    FT_TRY(check_binop(F, op, 2, a));
    FT_TRY(ft_empty_named(out, a->ndim, a->shape, a->dtype, a->device, F));
    if (ft_numel(*out) == 0)
        return FT_OK;
#ifdef FT_HAVE_CUDA
    if (on_cuda(a))
        return finish(ft_cuda_binary_scalar(*out, op, a, s, scalar_first), out,
                      NULL);
#endif
    binary_cpu(*out, op, a, NULL, s, scalar_first);
    return FT_OK;
}

ft_status ft_unary(ft_tensor **out, ft_unop op, const ft_tensor *a)
{
    static const char *const F = "ft_unary";
    FT_TRY(check_out(F, out));
    *out = NULL;
    if ((int)op < 0 || (int)op >= NUM_UNOPS)
        return ft_fail(FT_ERR_ARGUMENT, F, 1, "unknown unary op %d", (int)op);
    FT_TRY(check_input(F, 2, a, NULL));
    FT_TRY(ft_check_computable(F, 2, a->dtype, UNOP_NAMES[op]));
    if (!ft_dtype_is_float(a->dtype) && op != FT_NEG && op != FT_ABS)
        return ft_fail(FT_ERR_ARGUMENT, F, 2,
                       "%s needs a floating-point tensor, got %s",
                       UNOP_NAMES[op], ft_dtype_name(a->dtype));
    FT_TRY(ft_empty_named(out, a->ndim, a->shape, a->dtype, a->device, F));
    if (ft_numel(*out) == 0)
        return FT_OK;
#ifdef FT_HAVE_CUDA
    if (on_cuda(a))
        return finish(ft_cuda_unary(*out, op, a), out, NULL);
#endif
    unary_cpu(*out, op, a);
    return FT_OK;
}

/* ---- reductions ------------------------------------------------------- */

/* One running reduction: SUM, MEAN and NORM keep Neumaier's compensated
 * sum (sum, comp) of the elements or their squares; MAX/MIN keep the first
 * extreme and its position, and a NaN, once seen, is the extreme (torch
 * propagates it). */
typedef struct {
    ft_reduce_op op;
    double sum, comp;
    double best;
    int64_t best_at, count;
} reducer;

static void reducer_init(reducer *r, ft_reduce_op op)
{
    memset(r, 0, sizeof *r);
    r->op = op;
}

static void reducer_add(reducer *r, double v)
{
    switch (r->op) {
    case FT_SUM:
    case FT_MEAN: ft_ksum_add(&r->sum, &r->comp, v); break;
    case FT_NORM: ft_ksum_add(&r->sum, &r->comp, v * v); break;
    case FT_MAX:
    case FT_MIN:
        if (r->count == 0 ||
            (!isnan(r->best) &&
             (isnan(v) || (r->op == FT_MAX ? v > r->best : v < r->best)))) {
            r->best = v;
            r->best_at = r->count;
        }
        break;
    }
    r->count++;
}

static double reducer_result(const reducer *r)
{
    return ft_reduce_result(r->op, r->sum, r->comp, r->best, r->count);
}

static ft_status check_reduce_op(const char *func, ft_reduce_op op)
{
    if ((int)op < 0 || (int)op >= NUM_REDUCE_OPS)
        return ft_fail(FT_ERR_ARGUMENT, func, 1, "unknown reduction %d",
                       (int)op);
    return FT_OK;
}

static int is_extreme(ft_reduce_op op)
{
    return op == FT_MAX || op == FT_MIN;
}

/* Starts an iteration over the lines of t along dim d (t's shape with d
 * collapsed to 1, row-major); returns the number of lines. */
static int64_t lines_init(ft_iter *it, const ft_tensor *t, int d, int nops,
                          const int64_t *const *strides)
{
    int64_t shape[FT_MAX_DIMS], count = 1;
    for (int i = 0; i < t->ndim; i++)
        shape[i] = i == d ? 1 : t->shape[i];
    /* The lines are the elements of the result, which was allocated. */
    if (ft_checked_numel(t->ndim, shape, &count) != 0)
        count = 0;
    ft_iter_init(it, t->ndim, shape, nops, strides);
    return count;
}

static double reduce_all_cpu(ft_reduce_op op, const ft_tensor *a)
{
    reducer r;
    reducer_init(&r, op);
    ft_iter it;
    ft_iter_init(&it, a->ndim, a->shape, 1, (const int64_t *[]){a->stride});
    int64_t n = ft_numel(a);
    for (int64_t i = 0; i < n; i++, ft_iter_next(&it))
        reducer_add(&r, ft_load_f64(ft_elem_ptr(a, it.offset[0]), a->dtype));
    return reducer_result(&r);
}

/* out (and idx) are contiguous, so line i of a lands at element i. */
static void reduce_dim_cpu(ft_tensor *out, ft_tensor *idx, ft_reduce_op op,
                           const ft_tensor *a, int d)
{
    ft_iter it;
    int64_t lines = lines_init(&it, a, d, 1, (const int64_t *[]){a->stride});
    for (int64_t i = 0; i < lines; i++, ft_iter_next(&it)) {
        reducer r;
        reducer_init(&r, op);
        for (int64_t j = 0; j < a->shape[d]; j++) {
            int64_t off = it.offset[0] + j * a->stride[d];
            reducer_add(&r, ft_load_f64(ft_elem_ptr(a, off), a->dtype));
        }
        ft_store_f64(ft_elem_ptr(out, i), out->dtype, reducer_result(&r));
        if (idx)
            ((int64_t *)idx->data)[i] = r.best_at;
    }
}

ft_status ft_reduce_all(ft_reduce_op op, const ft_tensor *a, double *result)
{
    static const char *const F = "ft_reduce_all";
    FT_TRY(check_out(F, result));
    FT_TRY(check_reduce_op(F, op));
    FT_TRY(check_input(F, 2, a, NULL));
    FT_TRY(ft_check_computable(F, 2, a->dtype, REDUCE_NAMES[op]));
    if (is_extreme(op) && ft_numel(a) == 0)
        return ft_fail(FT_ERR_ARGUMENT, F, 2, "%s of an empty tensor",
                       REDUCE_NAMES[op]);
    /* Stride-0 dims repeat each distinct element mult times: the distinct
     * elements are reduced once, and the sum (and norm) scaled; the mean,
     * max and min of the distinct elements are those of the whole. */
    ft_tensor r = *a;
    const int64_t mult = ft_collapse_broadcast(&r);
    FT_TRY(ft_check_walk(F, 2, ft_numel(&r), "elements"));
    double v;
#ifdef FT_HAVE_CUDA
    if (on_cuda(a))
        FT_TRY(ft_cuda_reduce_all(op, &r, &v));
    else
#endif
        v = reduce_all_cpu(op, &r);
    if (mult > 1 && op == FT_SUM)
        v *= (double)mult;
    else if (mult > 1 && op == FT_NORM)
        v *= sqrt((double)mult);
    *result = v;
    return FT_OK;
}

/* dst = part expanded to full (a's shape with dim d of size 1), with dim d
 * dropped when dst has one dim fewer. */
static ft_status copy_broadcast(ft_tensor *dst, const ft_tensor *part, int ndim,
                                const int64_t *full, int d)
{
    ft_tensor *e = NULL, *s = NULL;
    ft_status st = ft_expand(&e, part, ndim, full);
    if (st == FT_OK && dst->ndim < ndim)
        st = ft_select(&s, e, d, 0);
    if (st == FT_OK)
        st = ft_copy(dst, s ? s : e);
    ft_tensor_free(s);
    ft_tensor_free(e);
    return st;
}

/* a has stride-0 dims of size > 1 (from ft_expand): each distinct line is
 * reduced once, on a with those dims collapsed, and the results are copied
 * along them into out (and idx). Along a stride-0 dim d each line repeats
 * one element x n times: its sum is n x (rounded once), its mean, max and
 * min are x (at index 0), its norm is |x| sqrt(n). */
static ft_status reduce_dim_broadcast(ft_tensor *out, ft_tensor *idx,
                                      ft_reduce_op op, const ft_tensor *a, int d)
{
    ft_tensor r = *a;
    ft_collapse_broadcast(&r);
    const int64_t n = a->shape[d];
    ft_tensor *part = NULL, *part_idx = NULL, *tmp = NULL;
    ft_status st = FT_OK;
    if (r.shape[d] != n) { /* dim d itself repeats one element */
        if (op == FT_SUM) {
            st = ft_binary_scalar(&part, FT_MUL, &r, (double)n, 0);
        } else if (op == FT_NORM) {
            st = ft_unary(&tmp, FT_ABS, &r);
            if (st == FT_OK)
                st = ft_binary_scalar(&part, FT_MUL, tmp, sqrt((double)n), 0);
        } else {
            st = ft_clone(&part, &r);
        }
        if (st == FT_OK && idx)
            st = ft_empty_named(&part_idx, r.ndim, r.shape, FT_I64, r.device,
                                "ft_reduce_dim");
        if (st == FT_OK && idx)
            st = ft_fill(part_idx, 0.0);
    } else {
        st = ft_reduce_dim(&part, idx ? &part_idx : NULL, op, &r, d, 1);
    }
    int64_t full[FT_MAX_DIMS];
    memcpy(full, a->shape, sizeof full);
    full[d] = 1;
    if (st == FT_OK)
        st = copy_broadcast(out, part, a->ndim, full, d);
    if (st == FT_OK && idx)
        st = copy_broadcast(idx, part_idx, a->ndim, full, d);
    ft_tensor_free(tmp);
    ft_tensor_free(part);
    ft_tensor_free(part_idx);
    return st;
}

ft_status ft_reduce_dim(ft_tensor **out, ft_tensor **indices, ft_reduce_op op,
                        const ft_tensor *a, int dim, int keepdim)
{
    static const char *const F = "ft_reduce_dim";
    FT_TRY(check_out(F, out));
    *out = NULL;
    if (indices)
        *indices = NULL;
    FT_TRY(check_reduce_op(F, op));
    if (indices && !is_extreme(op))
        return ft_fail(FT_ERR_ARGUMENT, F, 1,
                       "%s gives no indices (only max and min do)",
                       REDUCE_NAMES[op]);
    FT_TRY(check_input(F, 2, a, NULL));
    FT_TRY(ft_check_computable(F, 2, a->dtype, REDUCE_NAMES[op]));
    int d;
    FT_TRY(ft_check_dim(F, 3, dim, a->ndim, &d));
    if ((op == FT_MEAN || op == FT_NORM) && !ft_dtype_is_float(a->dtype))
        return ft_fail(FT_ERR_ARGUMENT, F, 2,
                       "%s needs a floating-point tensor, got %s",
                       REDUCE_NAMES[op], ft_dtype_name(a->dtype));
    if (is_extreme(op) && a->shape[d] == 0)
        return ft_fail(FT_ERR_ARGUMENT, F, 3,
                       "%s along dim %d, which has size 0", REDUCE_NAMES[op],
                       d);

    /* Result shape: a's, with dim d set to 1 (keepdim) or dropped. */
    int64_t shape[FT_MAX_DIMS];
    int ndim = 0;
    for (int i = 0; i < a->ndim; i++) {
        if (i != d)
            shape[ndim++] = a->shape[i];
        else if (keepdim)
            shape[ndim++] = 1;
    }
    if (!ft_has_broadcast(a))
        FT_TRY(ft_check_walk(F, 2, ft_numel(a), "elements"));
    FT_TRY(ft_empty_named(out, ndim, shape, a->dtype, a->device, F));
    if (indices) {
        ft_status s = ft_empty_named(indices, ndim, shape, FT_I64, a->device, F);
        if (s != FT_OK) {
            ft_tensor_free(*out);
            *out = NULL;
            return s;
        }
    }
    if (ft_has_broadcast(a)) {
        ft_status s = reduce_dim_broadcast(*out, indices ? *indices : NULL, op, a, d);
        if (s != FT_OK) {
            ft_tensor_free(*out);
            *out = NULL;
            if (indices) {
                ft_tensor_free(*indices);
                *indices = NULL;
            }
        }
        return s;
    }
    if (ft_numel(*out) == 0)
        return FT_OK;
#ifdef FT_HAVE_CUDA
    if (on_cuda(a))
        return finish(ft_cuda_reduce_dim(*out, indices ? *indices : NULL, op,
                                         a, d),
                      out, indices);
#endif
    reduce_dim_cpu(*out, indices ? *indices : NULL, op, a, d);
    return FT_OK;
}

/* ---- softmax ---------------------------------------------------------- */

/* Each line: m = max, then exp(x - m) / sum exp(x - m). A line of all -inf
 * gives NaN (-inf - -inf), as torch does; so does any NaN or +inf in it. The
 * exponentials are computed twice rather than kept in a scratch buffer. */
static void softmax_cpu(ft_tensor *out, const ft_tensor *a, int d)
{
    ft_iter it;
    int64_t lines = lines_init(&it, a, d, 2,
                               (const int64_t *[]){a->stride, out->stride});
    int64_t n = a->shape[d], sa = a->stride[d], so = out->stride[d];
    for (int64_t i = 0; i < lines; i++, ft_iter_next(&it)) {
        reducer mx;
        reducer_init(&mx, FT_MAX);
        for (int64_t j = 0; j < n; j++)
            reducer_add(&mx, ft_load_f64(ft_elem_ptr(a, it.offset[0] + j * sa),
                                         a->dtype));
        double m = reducer_result(&mx);
        double sum = 0.0, comp = 0.0;
        for (int64_t j = 0; j < n; j++)
            ft_ksum_add(&sum, &comp,
                        exp(ft_load_f64(ft_elem_ptr(a, it.offset[0] + j * sa),
                                        a->dtype) - m));
        double inv = 1.0 / ft_ksum_result(sum, comp);
        for (int64_t j = 0; j < n; j++) {
            double x = ft_load_f64(ft_elem_ptr(a, it.offset[0] + j * sa),
                                   a->dtype);
            ft_store_f64(ft_elem_ptr(out, it.offset[1] + j * so), out->dtype,
                         exp(x - m) * inv);
        }
    }
}

ft_status ft_softmax(ft_tensor **out, const ft_tensor *a, int dim)
{
    static const char *const F = "ft_softmax";
    FT_TRY(check_out(F, out));
    *out = NULL;
    FT_TRY(check_input(F, 1, a, NULL));
    FT_TRY(ft_check_computable(F, 1, a->dtype, "softmax"));
    int d;
    FT_TRY(ft_check_dim(F, 2, dim, a->ndim, &d));
    if (!ft_dtype_is_float(a->dtype))
        return ft_fail(FT_ERR_ARGUMENT, F, 1,
                       "softmax needs a floating-point tensor, got %s",
                       ft_dtype_name(a->dtype));
    FT_TRY(ft_empty_named(out, a->ndim, a->shape, a->dtype, a->device, F));
    if (ft_numel(*out) == 0) /* also a line of size 0: no line to visit */
        return FT_OK;
#ifdef FT_HAVE_CUDA
    if (on_cuda(a))
        return finish(ft_cuda_softmax(*out, a, d), out, NULL);
#endif
    softmax_cpu(*out, a, d);
    return FT_OK;
}

/* ---- matmul ----------------------------------------------------------- */

/* One operand of a (batched) product: matrix b is rows x cols with element
 * (i, j) at data + b*bstride + i*rs + j*cs (in elements). It goes to BLAS
 * directly (trans, ld) when its dtype is the work dtype and BLAS can read
 * its strides (ft_blas_layout); otherwise each batch is packed into
 * `pack`, a contiguous rows x cols buffer of the work dtype. */
typedef struct {
    const ft_tensor *t;
    int64_t bstride, rs, cs, rows, cols;
    enum CBLAS_TRANSPOSE trans;
    int ld;
    void *pack;
} mm_operand;

/* rows x cols elements of elsize bytes; NULL if they are more than
 * FT_MAX_ELEMENTS (no malloc is tried) or malloc fails. */
static void *alloc_matrix(int64_t rows, int64_t cols, size_t elsize)
{
    int64_t n;
    size_t bytes;
    if (ft_mul_size(rows, cols, &n) != 0 || n > FT_MAX_ELEMENTS ||
        ft_checked_bytes(n, elsize, &bytes) != 0)
        return NULL;
    return malloc(bytes ? bytes : 1);
}

static ft_status mm_prepare(mm_operand *o, const ft_tensor *t, ft_dtype work)
{
    int r = t->ndim - 2;
    o->t = t;
    o->bstride = t->ndim == 3 ? t->stride[0] : 0;
    o->rows = t->shape[r];
    o->cols = t->shape[r + 1];
    /* A stride over a dim of size 1 is never used: treat it as compact. */
    o->rs = o->rows == 1 ? o->cols : t->stride[r];
    o->cs = o->cols == 1 ? o->rows : t->stride[r + 1];
    o->pack = NULL;
    int transposed, ld;
    if (t->dtype == work && ft_blas_layout(t, &transposed, &ld)) {
        o->trans = transposed ? CblasTrans : CblasNoTrans;
        o->ld = ld;
    } else {
        o->trans = CblasNoTrans;
        o->ld = (int)o->cols;
        o->pack = alloc_matrix(o->rows, o->cols, ft_dtype_size(work));
        if (o->pack == NULL)
            return ft_fail(FT_ERR_NOMEM, "ft_matmul", 0,
                           "out of memory for a %lld x %lld %s matrix copy",
                           (long long)o->rows, (long long)o->cols,
                           ft_dtype_name(work));
    }
    return FT_OK;
}

/* Batch b of the operand as BLAS reads it, packing it first if needed. */
static const void *mm_matrix(mm_operand *o, int64_t b, ft_dtype work)
{
    int64_t base = b * o->bstride;
    if (o->pack == NULL)
        return ft_elem_ptr(o->t, base);
    if (b > 0 && o->bstride == 0) /* the same matrix in every batch: packed once */
        return o->pack;
    for (int64_t i = 0; i < o->rows; i++)
        for (int64_t j = 0; j < o->cols; j++) {
            double v = ft_load_f64(ft_elem_ptr(o->t, base + i * o->rs +
                                                         j * o->cs),
                                   o->t->dtype);
            if (work == FT_F64)
                ((double *)o->pack)[i * o->cols + j] = v;
            else
                ((float *)o->pack)[i * o->cols + j] = (float)v;
        }
    return o->pack;
}

/* out [B?, m, n] = a x b, both of rank out->ndim, with 0 < m, n, k <= INT_MAX.
 * f64 runs dgemm; everything else sgemm, f16/bf16 through f32 copies. */
static ft_status matmul_cpu(ft_tensor *out, const ft_tensor *a,
                            const ft_tensor *b)
{
    ft_dtype work = a->dtype == FT_F64 ? FT_F64 : FT_F32;
    int r = a->ndim - 2;
    int64_t batches = a->ndim == 3 ? a->shape[0] : 1;
    int m = (int)a->shape[r], k = (int)a->shape[r + 1], n = (int)b->shape[r + 1];
    mm_operand A = {0}, B = {0};
    float *cbuf = NULL; /* f32 result of one batch when out is f16/bf16 */
    ft_status s = mm_prepare(&A, a, work);
    if (s == FT_OK)
        s = mm_prepare(&B, b, work);
    if (s == FT_OK && out->dtype != work) {
        cbuf = alloc_matrix(m, n, sizeof *cbuf);
        if (cbuf == NULL)
            s = ft_fail(FT_ERR_NOMEM, "ft_matmul", 0,
                        "out of memory for a %d x %d f32 result", m, n);
    }
    for (int64_t bi = 0; s == FT_OK && bi < batches; bi++) {
        const void *pa = mm_matrix(&A, bi, work), *pb = mm_matrix(&B, bi, work);
        void *pc = cbuf ? (void *)cbuf : ft_elem_ptr(out, bi * m * (int64_t)n);
        if (work == FT_F64)
            cblas_dgemm(CblasRowMajor, A.trans, B.trans, m, n, k, 1.0, pa,
                        A.ld, pb, B.ld, 0.0, pc, n);
        else
            cblas_sgemm(CblasRowMajor, A.trans, B.trans, m, n, k, 1.0f, pa,
                        A.ld, pb, B.ld, 0.0f, pc, n);
        for (int64_t i = 0; cbuf && i < (int64_t)m * n; i++)
            ft_store_f64(ft_elem_ptr(out, bi * m * (int64_t)n + i), out->dtype,
                         cbuf[i]);
    }
    free(A.pack);
    free(B.pack);
    free(cbuf);
    return s;
}

static ft_status check_matmul(const ft_tensor *a, const ft_tensor *b)
{
    static const char *const F = "ft_matmul";
    char sa[SHAPE_BUF], sb[SHAPE_BUF];
    FT_TRY(check_input(F, 1, a, NULL));
    FT_TRY(check_input(F, 2, b, a));
    FT_TRY(ft_check_computable(F, 1, a->dtype, "matmul"));
    FT_TRY(ft_check_computable(F, 2, b->dtype, "matmul"));
    FT_TRY(check_same_dtype(F, 2, a, b));
    if (!ft_dtype_is_float(a->dtype))
        return ft_fail(FT_ERR_ARGUMENT, F, 1,
                       "needs floating-point tensors, got %s",
                       ft_dtype_name(a->dtype));
    for (int i = 0; i < 2; i++) {
        const ft_tensor *t = i == 0 ? a : b;
        if (t->ndim != 2 && t->ndim != 3)
            return ft_fail(FT_ERR_ARGUMENT, F, i + 1,
                           "needs 2-d or 3-d tensors, got %d-d", t->ndim);
    }
    if (a->ndim != b->ndim)
        return ft_fail(FT_ERR_ARGUMENT, F, 2,
                       "needs both 2-d or both 3-d tensors, got %d-d and %d-d",
                       a->ndim, b->ndim);
    int r = a->ndim - 2;
    if (a->shape[r + 1] != b->shape[r])
        return ft_fail(FT_ERR_ARGUMENT, F, 2,
                       "inner dimensions differ (%s x %s)",
                       ft_format_shape(sa, sizeof sa, a->ndim, a->shape),
                       ft_format_shape(sb, sizeof sb, b->ndim, b->shape));
    if (a->ndim == 3 && a->shape[0] != b->shape[0])
        return ft_fail(FT_ERR_ARGUMENT, F, 2, "batch sizes differ (%lld and %lld)",
                       (long long)a->shape[0], (long long)b->shape[0]);
    for (int i = 0; i < 2; i++) {
        const ft_tensor *t = i == 0 ? a : b;
        for (int j = r; j < t->ndim; j++)
            if (t->shape[j] > BLAS_DIM_MAX)
                return ft_fail(FT_ERR_UNSUPPORTED, F, i + 1,
                               "dimension %lld exceeds the BLAS limit %lld",
                               (long long)t->shape[j],
                               (long long)BLAS_DIM_MAX);
    }
    /* Each operand is read (or packed) batch by batch in full: stride-0
     * views of more elements than a machine holds are refused. */
    for (int i = 0; i < 2; i++) {
        const ft_tensor *t = i == 0 ? a : b;
        FT_TRY(ft_check_walk(F, i + 1, ft_numel(t), "elements"));
    }
    return FT_OK;
}

#ifdef FT_HAVE_CUDA
/* ft_cuda_matmul takes operands that cuBLAS reads where they lie
 * (ft_blas_layout); any other operand is copied contiguous first. The
 * copies go back to the device pool on stream 0, after the products
 * queued there have read them. */
static ft_status matmul_cuda(ft_tensor *out, const ft_tensor *a,
                             const ft_tensor *b)
{
    ft_tensor *ca = NULL, *cb = NULL;
    int transposed, ld;
    ft_status st = FT_OK;
    if (!ft_blas_layout(a, &transposed, &ld))
        st = ft_contiguous(&ca, a);
    if (st == FT_OK && !ft_blas_layout(b, &transposed, &ld))
        st = ft_contiguous(&cb, b);
    if (st == FT_OK)
        st = ft_cuda_matmul(out, ca ? ca : a, cb ? cb : b);
    ft_tensor_free(ca);
    ft_tensor_free(cb);
    return st;
}
#endif

ft_status ft_matmul(ft_tensor **out, const ft_tensor *a, const ft_tensor *b)
{
    static const char *const F = "ft_matmul";
    FT_TRY(check_out(F, out));
    *out = NULL;
    FT_TRY(check_matmul(a, b));
    /* [B?, m, n]: a's leading dims, then b's last. */
    int r = a->ndim - 2;
    int64_t shape[3];
    memcpy(shape, a->shape, (size_t)(r + 1) * sizeof *shape);
    shape[r + 1] = b->shape[r + 1];
    FT_TRY(ft_empty_named(out, a->ndim, shape, a->dtype, a->device, F));
    int64_t numel = ft_numel(*out);
    if (numel == 0)
        return FT_OK;
#ifdef FT_HAVE_CUDA
    if (on_cuda(a)) {
        /* k == 0: an empty sum; ft_fill writes +0 on the device. */
        if (a->shape[r + 1] == 0)
            return finish(ft_fill(*out, 0.0), out, NULL);
        return finish(matmul_cuda(*out, a, b), out, NULL);
    }
#endif
    if (a->shape[r + 1] == 0) {
        /* k == 0: an empty sum. All-zero bits are +0 in every float dtype. */
        memset((*out)->data, 0, ft_storage_nbytes(*out)); /* the fresh result's bytes */
        return FT_OK;
    }
    ft_status s = matmul_cpu(*out, a, b);
    if (s != FT_OK) {
        ft_tensor_free(*out);
        *out = NULL;
    }
    return s;
}

/* ---- comparisons ------------------------------------------------------ */

/* Checks a pair of tensors to compare and gives their headers with the
 * dims where both have stride 0 collapsed (each pair of elements there
 * repeats; repeats change neither a maximum nor an all-close answer). */
static ft_status check_pair(const char *func, const ft_tensor *a,
                            const ft_tensor *b, ft_tensor *ra, ft_tensor *rb)
{
    FT_TRY(check_input(func, 1, a, NULL));
    FT_TRY(check_input(func, 2, b, a));
    FT_TRY(ft_check_same_shape(func, 2, a, b));
    *ra = *a;
    *rb = *b;
    if (ft_numel(a) > 0)
        for (int d = 0; d < a->ndim; d++)
            if (a->shape[d] > 1 && a->stride[d] == 0 && b->stride[d] == 0)
                ra->shape[d] = rb->shape[d] = 1;
    return ft_check_walk(func, 1, ft_numel(ra), "pairs of elements");
}

/* Calls visit(x, y, ctx) on each pair of elements until it returns 0. */
static void pairs_cpu(const ft_tensor *a, const ft_tensor *b,
                      int (*visit)(double, double, void *), void *ctx)
{
    ft_iter it;
    ft_iter_init(&it, a->ndim, a->shape, 2,
                 (const int64_t *[]){a->stride, b->stride});
    int64_t n = ft_numel(a);
    for (int64_t i = 0; i < n; i++, ft_iter_next(&it))
        if (!visit(ft_load_f64(ft_elem_ptr(a, it.offset[0]), a->dtype),
                   ft_load_f64(ft_elem_ptr(b, it.offset[1]), b->dtype), ctx))
            return;
}

/* A NaN (ft_abs_diff's answer when either element is NaN) ends the walk. */
static int visit_max_diff(double x, double y, void *ctx)
{
    double *m = ctx;
    double d = ft_abs_diff(x, y);
    if (isnan(d)) {
        *m = d;
        return 0;
    }
    if (d > *m)
        *m = d;
    return 1;
}

typedef struct {
    double rtol, atol;
    int close;
} close_ctx;

static int visit_close(double x, double y, void *ctx)
{
    close_ctx *c = ctx;
    c->close = ft_is_close(x, y, c->rtol, c->atol);
    return c->close;
}

ft_status ft_max_abs_diff(const ft_tensor *a, const ft_tensor *b,
                          double *result)
{
    static const char *const F = "ft_max_abs_diff";
    FT_TRY(check_out(F, result));
    ft_tensor ra, rb;
    FT_TRY(check_pair(F, a, b, &ra, &rb));
#ifdef FT_HAVE_CUDA
    if (on_cuda(a))
        return ft_cuda_compare(&ra, &rb, 0.0, 0.0, result, NULL);
#endif
    double m = 0.0;
    pairs_cpu(&ra, &rb, visit_max_diff, &m);
    *result = m;
    return FT_OK;
}

ft_status ft_allclose(const ft_tensor *a, const ft_tensor *b, double rtol,
                      double atol, int *result)
{
    static const char *const F = "ft_allclose";
    FT_TRY(check_out(F, result));
    ft_tensor ra, rb;
    FT_TRY(check_pair(F, a, b, &ra, &rb));
    if (!(rtol >= 0.0))
        return ft_fail(FT_ERR_ARGUMENT, F, 3, "rtol must be >= 0, got %g", rtol);
    if (!(atol >= 0.0))
        return ft_fail(FT_ERR_ARGUMENT, F, 4, "atol must be >= 0, got %g", atol);
#ifdef FT_HAVE_CUDA
    if (on_cuda(a))
        return ft_cuda_compare(&ra, &rb, rtol, atol, NULL, result);
#endif
    close_ctx c = {rtol, atol, 1};
    pairs_cpu(&ra, &rb, visit_close, &c);
    *result = c.close;
    return FT_OK;
}
