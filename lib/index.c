/*
 * index.c - gathers and scatter-adds along one dim: ft_index_select and
 * ft_index_add (an embedding's lookup and its gradient). Checks here; the
 * CPU works slice by slice through views, CUDA in kernels/index_ops.cu,
 * whose launchers take contiguous tensors: the copies are made here.
 */
#include "internal.h"
#ifdef FT_HAVE_CUDA
#include "kernels.h"
#endif

#include <string.h>


/* index: 1-d i32/i64 on t's device with every entry in [0, size). Only CPU
 * indices are read here; CUDA kernels check their entries themselves. */
static ft_status check_index(const char *func, int arg, const ft_tensor *index,
                             const ft_tensor *t, int64_t size)
{
    FT_TRY(ft_check_tensor(func, arg, index));
    if (index->dtype != FT_I64 && index->dtype != FT_I32)
        return ft_fail(FT_ERR_ARGUMENT, func, arg, "index must be i64 or i32, got %s",
                       ft_dtype_name(index->dtype));
    if (index->ndim != 1)
        return ft_fail(FT_ERR_ARGUMENT, func, arg, "index must be 1-d, got %d-d",
                       index->ndim);
    FT_TRY(ft_check_device(func, arg, index, t));
    if (index->device.type != FT_CPU)
        return FT_OK;
    /* An index expanded from one entry (stride 0) holds one value. */
    const int64_t distinct = index->stride[0] == 0 && index->shape[0] > 0 ? 1 : index->shape[0];
    for (int64_t i = 0; i < distinct; i++) {
        int64_t v = 0;
        FT_TRY(ft_get_int(index, &i, &v));
        if (v < 0 || v >= size)
            return ft_fail(FT_ERR_ARGUMENT, func, arg,
                           "index[%lld] = %lld is out of range for a dim of size %lld",
                           (long long)i, (long long)v, (long long)size);
    }
    return FT_OK;
}

/* t's shape with dim's size replaced by n. */
static void replaced_shape(const ft_tensor *t, int dim, int64_t n, int64_t *shape)
{
    memcpy(shape, t->shape, sizeof(int64_t) * (size_t)t->ndim);
    shape[dim] = n;
}

/* index[i] of a 1-d i32/i64 tensor on the CPU. */
static int64_t index_at(const ft_tensor *index, int64_t i)
{
    const void *p = ft_elem_ptr(index, i * index->stride[0]);
    return index->dtype == FT_I64 ? *(const int64_t *)p : *(const int32_t *)p;
}

/* On the CPU, for every i: gather copies src's slice index[i] into dst's
 * slice i; add adds src's slice i into dst's slice index[i] (computed in
 * f64, rounded once, as ft_binary does). No allocation, so it cannot fail
 * half-way: the binding retries a call that ran out of memory, which must
 * find the tensor unchanged. */
static void slices_cpu(ft_tensor *dst, const ft_tensor *src, int dim,
                       const ft_tensor *index, int add)
{
    int64_t shape[FT_MAX_DIMS], sd[FT_MAX_DIMS], ss[FT_MAX_DIMS], count;
    int n = 0;
    for (int k = 0; k < dst->ndim; k++)
        if (k != dim) {
            shape[n] = dst->shape[k];
            sd[n] = dst->stride[k];
            ss[n++] = src->stride[k];
        }
    /* A slice of a tensor with elements (the callers return early
     * otherwise): its count fits. */
    if (ft_checked_numel(n, shape, &count) != 0)
        return;
    const size_t es = ft_dtype_size(dst->dtype);
    for (int64_t i = 0; i < index->shape[0]; i++) {
        const int64_t pos = index_at(index, i);
        const int64_t base_d = (add ? pos : i) * dst->stride[dim];
        const int64_t base_s = (add ? i : pos) * src->stride[dim];
        ft_iter it;
        ft_iter_init(&it, n, shape, 2, (const int64_t *[]){sd, ss});
        for (int64_t e = 0; e < count; e++, ft_iter_next(&it)) {
            void *pd = ft_elem_ptr(dst, base_d + it.offset[0]);
            const void *ps = ft_elem_ptr(src, base_s + it.offset[1]);
            if (add)
                ft_store_f64(pd, dst->dtype,
                             ft_load_f64(pd, dst->dtype) + ft_load_f64(ps, src->dtype));
            else
                memcpy(pd, ps, es);
        }
    }
}

#ifdef FT_HAVE_CUDA
/* slices_cpu's work on CUDA (dst contiguous). The launchers read src and
 * index contiguous: each goes to them as a contiguous copy, or as an alias
 * where it already is contiguous. */
static ft_status slices_cuda(ft_tensor *dst, const ft_tensor *src, int dim,
                             const ft_tensor *index, int add)
{
    ft_tensor *sc = NULL, *ic = NULL;
    FT_TRY(ft_contiguous(&sc, src));
    ft_status st = ft_contiguous(&ic, index);
    if (st == FT_OK)
        st = add ? ft_cuda_index_add(dst, dim, ic, sc)
                 : ft_cuda_index_select(dst, sc, dim, ic);
    ft_tensor_free(sc);
    ft_tensor_free(ic);
    return st;
}
#endif

ft_status ft_index_select(ft_tensor **out, const ft_tensor *t, int dim,
                          const ft_tensor *index)
{
    static const char func[] = "ft_index_select";
    if (!out)
        return ft_fail(FT_ERR_ARGUMENT, func, 0, "result pointer is NULL");
    *out = NULL;
    FT_TRY(ft_check_tensor(func, 1, t));
    FT_TRY(ft_check_device(func, 1, t, NULL));
    int d;
    FT_TRY(ft_check_dim(func, 2, dim, t->ndim, &d));
    FT_TRY(check_index(func, 3, index, t, t->shape[d]));
    int64_t shape[FT_MAX_DIMS];
    replaced_shape(t, d, index->shape[0], shape);
    ft_tensor *r;
    FT_TRY(ft_empty_named(&r, t->ndim, shape, t->dtype, t->device, func));
    ft_status st = FT_OK;
#ifdef FT_HAVE_CUDA
    if (t->device.type == FT_CUDA)
        st = ft_numel(r) ? slices_cuda(r, t, d, index, 0) : FT_OK;
    else
#endif
        if (ft_numel(r) > 0)
            slices_cpu(r, t, d, index, 0);
    if (st != FT_OK) {
        ft_tensor_free(r);
        return st;
    }
    *out = r;
    return FT_OK;
}

ft_status ft_index_add(ft_tensor *t, int dim, const ft_tensor *index, const ft_tensor *src)
{
    static const char func[] = "ft_index_add";
    char a[SHAPE_TEXT], b[SHAPE_TEXT];
    FT_TRY(ft_check_tensor(func, 1, t));
    FT_TRY(ft_check_device(func, 1, t, NULL));
    FT_TRY(ft_check_computable(func, 1, t->dtype, "index_add"));
    if (!ft_dtype_is_float(t->dtype))
        return ft_fail(FT_ERR_ARGUMENT, func, 1, "needs a floating-point tensor, got %s",
                       ft_dtype_name(t->dtype));
    int d;
    FT_TRY(ft_check_dim(func, 2, dim, t->ndim, &d));
    FT_TRY(check_index(func, 3, index, t, t->shape[d]));
    FT_TRY(ft_check_tensor(func, 4, src));
    FT_TRY(ft_check_device(func, 4, src, t));
    if (src->dtype != t->dtype)
        return ft_fail(FT_ERR_ARGUMENT, func, 4, "src is %s but the tensor is %s",
                       ft_dtype_name(src->dtype), ft_dtype_name(t->dtype));
    int64_t shape[FT_MAX_DIMS];
    replaced_shape(t, d, index->shape[0], shape);
    int ok = src->ndim == t->ndim;
    for (int k = 0; ok && k < t->ndim; k++)
        ok = src->shape[k] == shape[k];
    if (!ok)
        return ft_fail(FT_ERR_ARGUMENT, func, 4, "src must have shape %s, got %s",
                       ft_format_shape(a, sizeof a, t->ndim, shape),
                       ft_format_shape(b, sizeof b, src->ndim, src->shape));
    /* Every element of src is added in turn, repeats (stride 0) included. */
    if (ft_numel(src) == 0)
        return FT_OK;
    FT_TRY(ft_check_walk(func, 4, ft_numel(src), "elements"));
#ifdef FT_HAVE_CUDA
    if (t->device.type == FT_CUDA) {
        if (t->dtype != FT_F32 && t->dtype != FT_F64)
            return ft_fail(FT_ERR_UNSUPPORTED, func, 1,
                           "index_add on CUDA takes f32 or f64, got %s",
                           ft_dtype_name(t->dtype));
        if (!ft_is_contiguous(t))
            return ft_fail(FT_ERR_UNSUPPORTED, func, 1,
                           "index_add on CUDA needs a contiguous tensor");
        return slices_cuda(t, src, d, index, 1);
    }
#endif
    slices_cpu(t, src, d, index, 1);
    return FT_OK;
}
