/*
 * tensor.c - tensor handles over refcounted storage: creation, views,
 * copies with dtype conversion, fill, and single-element access.
 *
 * A handle (ft_tensor) is owned by one caller; the storage behind it is
 * shared by every view and freed with the last one.
 */
#include "internal.h"
#include "scalar_ops.h"
#ifdef FT_HAVE_CUDA
#include "kernels.h"
#endif

#include <stdlib.h>
#include <string.h>


ft_status ft_check_device(const char *func, int arg, const ft_tensor *t,
                          const ft_tensor *ref)
{
    char a[16], b[16];
    if (t->device.type == FT_CUDA && !ft_cuda_built())
        return ft_fail(FT_ERR_UNSUPPORTED, func, arg,
                       "tensor on %s: flashtile was built without CUDA",
                       ft_device_name(t->device, a, sizeof a));
    if (ref && !ft_device_equal(t->device, ref->device))
        return ft_fail(FT_ERR_ARGUMENT, func, arg,
                       "tensors are on different devices (%s and %s)",
                       ft_device_name(ref->device, a, sizeof a),
                       ft_device_name(t->device, b, sizeof b));
    return FT_OK;
}

ft_status ft_check_same_shape(const char *func, int arg, const ft_tensor *a,
                              const ft_tensor *b)
{
    int same = a->ndim == b->ndim;
    for (int d = 0; same && d < a->ndim; d++)
        same = a->shape[d] == b->shape[d];
    if (!same) {
        char sa[SHAPE_TEXT], sb[SHAPE_TEXT];
        return ft_fail(FT_ERR_ARGUMENT, func, arg, "shapes differ (%s and %s)",
                       ft_format_shape(sa, sizeof sa, a->ndim, a->shape),
                       ft_format_shape(sb, sizeof sb, b->ndim, b->shape));
    }
    return FT_OK;
}

/* Row-major strides of shape. For a tensor with elements they are products
 * of sizes to the right, which fit int64 because the element count does.
 * A tensor with no elements may have sizes whose product does not fit
 * ({1e18, 0, 16}); no element is ever reached through its strides, and a
 * product that would overflow saturates at INT64_MAX instead. */
static void contiguous_strides(int ndim, const int64_t *shape, int64_t *stride)
{
    int64_t s = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        stride[d] = s;
        if (ft_mul_size(s, shape[d] > 0 ? shape[d] : 1, &s) != 0)
            s = INT64_MAX;
    }
}

ft_status ft_check_walk(const char *func, int arg, int64_t n, const char *what)
{
    if (n > FT_MAX_ELEMENTS)
        return ft_fail(FT_ERR_UNSUPPORTED, func, arg,
                       "the operation would visit %lld %s, more than flashtile's "
                       "limit of 2^48 (%lld) for one loop",
                       (long long)n, what, (long long)FT_MAX_ELEMENTS);
    return FT_OK;
}

/* A device a tensor can be made on: the CPU (index 0) or a CUDA ordinal. */
static ft_status check_device_arg(const char *func, int arg, ft_device device)
{
    if (device.type == FT_CPU && device.index != 0)
        return ft_fail(FT_ERR_ARGUMENT, func, arg,
                       "the cpu device has index 0, got %d", device.index);
    if (device.type != FT_CPU && device.type != FT_CUDA)
        return ft_fail(FT_ERR_ARGUMENT, func, arg, "invalid device type %d",
                       (int)device.type);
    if (device.type == FT_CUDA && device.index < 0)
        return ft_fail(FT_ERR_ARGUMENT, func, arg,
                       "CUDA device index %d is negative", device.index);
    return FT_OK;
}

/* Checks a shape and gives its element count, failing on negative sizes,
 * too many dims, or more than FT_MAX_ELEMENTS elements. A shape with a
 * size 0 has no elements, whatever its other sizes. */
static ft_status check_shape(const char *func, int arg, int ndim,
                             const int64_t *shape, ft_dtype dtype,
                             int64_t *numel)
{
    if (ndim < 0 || ndim > FT_MAX_DIMS)
        return ft_fail(FT_ERR_ARGUMENT, func, arg,
                       "%d dims requested, at most %d are supported", ndim,
                       FT_MAX_DIMS);
    if (ndim > 0 && !shape)
        return ft_fail(FT_ERR_ARGUMENT, func, arg, "shape expected, got NULL");
    for (int d = 0; d < ndim; d++)
        if (shape[d] < 0)
            return ft_fail(FT_ERR_ARGUMENT, func, arg,
                           "size %lld of dim %d is negative",
                           (long long)shape[d], d);
    if (!ft_dtype_size(dtype))
        return ft_fail(FT_ERR_ARGUMENT, func, arg, "invalid dtype %d", (int)dtype);
    int64_t n = 0;
    if (ft_checked_numel(ndim, shape, &n) != 0 || n > FT_MAX_ELEMENTS) {
        char buf[SHAPE_TEXT];
        return ft_fail(FT_ERR_NOMEM, func, arg,
                       "shape %s is too large to allocate: more than 2^48 "
                       "elements, more memory than any machine has",
                       ft_format_shape(buf, sizeof buf, ndim, shape));
    }
    *numel = n;
    return FT_OK;
}

/* Whether a view at byte_offset of s with this geometry reaches only bytes
 * of s: its first element and, when it has elements, its last one (the
 * offset of the last is the sum of stride * (size - 1), strides >= 0). */
static int view_inside(const ft_storage *s, size_t byte_offset, ft_dtype dtype,
                       int ndim, const int64_t *shape, const int64_t *stride)
{
    int64_t n, last = 0, span, end_elems;
    size_t end;
    if (byte_offset > s->nbytes || ft_checked_numel(ndim, shape, &n) != 0)
        return 0;
    if (n == 0)
        return 1;
    for (int d = 0; d < ndim; d++)
        if (ft_mul_size(stride[d], shape[d] - 1, &span) != 0 ||
            ft_add_size(last, span, &last) != 0)
            return 0;
    if (ft_add_size(last, 1, &end_elems) != 0 ||
        ft_checked_bytes(end_elems, ft_dtype_size(dtype), &end) != 0)
        return 0;
    return end <= s->nbytes - byte_offset;
}

ft_status ft_tensor_wrap(ft_tensor **out, ft_storage *s, size_t byte_offset,
                         ft_dtype dtype, int ndim, const int64_t *shape,
                         const int64_t *stride, const char *func)
{
    *out = NULL;
    if (!view_inside(s, byte_offset, dtype, ndim, shape, stride)) {
        char buf[SHAPE_TEXT];
        return ft_fail(FT_ERR_INTERNAL, func, 0,
                       "a view of shape %s at byte %zu would reach outside "
                       "its storage of %zu bytes",
                       ft_format_shape(buf, sizeof buf, ndim, shape),
                       byte_offset, s->nbytes);
    }
    ft_tensor *t = calloc(1, sizeof *t);
    if (!t)
        return ft_fail(FT_ERR_NOMEM, func, 0, "out of memory");
    ft_storage_retain(s);
    t->storage = s;
    t->data = (char *)s->data + byte_offset;
    t->dtype = dtype;
    t->device = s->device;
    t->ndim = ndim;
    for (int d = 0; d < ndim; d++) {
        t->shape[d] = shape[d];
        t->stride[d] = stride[d];
    }
    *out = t;
    return FT_OK;
}

ft_status ft_empty_named(ft_tensor **out, int ndim, const int64_t *shape,
                         ft_dtype dtype, ft_device device, const char *func)
{
    if (!out)
        return ft_fail(FT_ERR_ARGUMENT, func, 0, "result pointer is NULL");
    *out = NULL;
    int64_t numel = 0;
    size_t nbytes = 0;
    FT_TRY(check_shape(func, 1, ndim, shape, dtype, &numel));
    FT_TRY(check_device_arg(func, 1, device));
    if (ft_checked_bytes(numel, ft_dtype_size(dtype), &nbytes) != 0)
        return ft_fail(FT_ERR_NOMEM, func, 1, "shape is too large to allocate");
    ft_storage *s;
    FT_TRY(ft_storage_new(&s, nbytes, device, func));
    int64_t stride[FT_MAX_DIMS];
    contiguous_strides(ndim, shape, stride);
    ft_status st = ft_tensor_wrap(out, s, 0, dtype, ndim, shape, stride, func);
    ft_storage_release(s); /* the handle holds its own reference */
    return st;
}

ft_status ft_empty(ft_tensor **out, int ndim, const int64_t *shape,
                   ft_dtype dtype, ft_device device)
{
    return ft_empty_named(out, ndim, shape, dtype, device, "ft_empty");
}

void ft_tensor_free(ft_tensor *t)
{
    if (!t)
        return;
    ft_storage_release(t->storage);
    free(t);
}

/* Views keep their element count within int64 (ft_expand and ft_view
 * check it); a count that does not fit could only come from a handle
 * changed by hand, and saturates. */
int64_t ft_numel(const ft_tensor *t)
{
    int64_t n;
    if (!t)
        return 0;
    return ft_checked_numel(t->ndim, t->shape, &n) == 0 ? n : INT64_MAX;
}

int ft_is_contiguous(const ft_tensor *t)
{
    if (!t)
        return 0;
    if (ft_numel(t) == 0)
        return 1;
    int64_t expected = 1;
    for (int d = t->ndim - 1; d >= 0; d--) {
        if (t->shape[d] != 1 && t->stride[d] != expected)
            return 0;
        if (ft_mul_size(expected, t->shape[d], &expected) != 0)
            return 0;
    }
    return 1;
}

size_t ft_storage_nbytes(const ft_tensor *t)
{
    return t && t->storage ? t->storage->nbytes : 0;
}

int ft_same_storage(const ft_tensor *a, const ft_tensor *b)
{
    return a && b && a->storage == b->storage;
}

/* ---- stride-0 dims ---- */

int64_t ft_collapse_broadcast(ft_tensor *t)
{
    int64_t mult = 1;
    if (ft_numel(t) == 0)
        return 1;
    for (int d = 0; d < t->ndim; d++)
        if (t->shape[d] > 1 && t->stride[d] == 0) {
            if (ft_mul_size(mult, t->shape[d], &mult) != 0) /* a factor of numel: fits */
                mult = INT64_MAX;
            t->shape[d] = 1;
        }
    return mult;
}

void ft_collapse_for_write(ft_tensor *dst, ft_tensor *src)
{
    if (ft_numel(dst) == 0)
        return;
    for (int d = 0; d < dst->ndim; d++)
        if (dst->shape[d] > 1 && dst->stride[d] == 0) {
            if (src) {
                /* src's last element along d: inside src, as src has
                 * elements (its shape is dst's). */
                src->data = ft_elem_ptr(src, src->stride[d] * (src->shape[d] - 1));
                src->shape[d] = 1;
            }
            dst->shape[d] = 1;
        }
}

int ft_has_broadcast(const ft_tensor *t)
{
    if (ft_numel(t) == 0)
        return 0;
    for (int d = 0; d < t->ndim; d++)
        if (t->shape[d] > 1 && t->stride[d] == 0)
            return 1;
    return 0;
}

/* A new handle on t's storage with the given geometry. */
static ft_status make_view(ft_tensor **out, const ft_tensor *t, void *data,
                           int ndim, const int64_t *shape,
                           const int64_t *stride, const char *func)
{
    size_t offset = (size_t)((char *)data - (char *)t->storage->data);
    return ft_tensor_wrap(out, t->storage, offset, t->dtype, ndim, shape,
                          stride, func);
}

/* The result pointer of a view or copy, and the tensor it starts from. */
static ft_status check_out_and_tensor(const char *func, ft_tensor **out,
                                      const ft_tensor *t)
{
    if (!out)
        return ft_fail(FT_ERR_ARGUMENT, func, 0, "result pointer is NULL");
    *out = NULL;
    return ft_check_tensor(func, 1, t);
}

ft_status ft_expand(ft_tensor **out, const ft_tensor *t, int ndim,
                    const int64_t *shape)
{
    FT_TRY(check_out_and_tensor("ft_expand", out, t));
    char sr[SHAPE_TEXT], st[SHAPE_TEXT];
    if (ndim < t->ndim || ndim > FT_MAX_DIMS || (ndim > 0 && !shape))
        return ft_fail(FT_ERR_ARGUMENT, "ft_expand", 2,
                       "cannot expand a %d-d tensor to %d dims", t->ndim, ndim);
    int64_t size[FT_MAX_DIMS], stride[FT_MAX_DIMS], numel;
    const int lead = ndim - t->ndim;
    for (int d = 0; d < ndim; d++) {
        const int64_t want = shape[d];
        if (d < lead) { /* a new leading dim */
            if (want < 0)
                return ft_fail(FT_ERR_ARGUMENT, "ft_expand", 2,
                               "size %lld of a new dim must be >= 0", (long long)want);
            size[d] = want, stride[d] = 0;
            continue;
        }
        const int64_t have = t->shape[d - lead];
        if (want == -1 || want == have) {
            size[d] = have, stride[d] = t->stride[d - lead];
        } else if (have == 1 && want >= 0) {
            size[d] = want, stride[d] = 0;
        } else {
            return ft_fail(FT_ERR_ARGUMENT, "ft_expand", 2,
                           "cannot expand %s to %s: size %lld is not 1 and differs from %lld",
                           ft_format_shape(st, sizeof st, t->ndim, t->shape),
                           ft_format_shape(sr, sizeof sr, ndim, shape), (long long)have,
                           (long long)want);
        }
    }
    if (ft_checked_numel(ndim, size, &numel) != 0)
        return ft_fail(FT_ERR_ARGUMENT, "ft_expand", 2, "shape %s is too large",
                       ft_format_shape(sr, sizeof sr, ndim, size));
    return make_view(out, t, t->data, ndim, size, stride, "ft_expand");
}

ft_status ft_alias(ft_tensor **out, const ft_tensor *t)
{
    FT_TRY(check_out_and_tensor("ft_alias", out, t));
    return make_view(out, t, t->data, t->ndim, t->shape, t->stride, "ft_alias");
}

/* Resolves a -1 entry of a requested shape against numel. */
static ft_status infer_shape(const char *func, const ft_tensor *t, int ndim,
                             const int64_t *req, int64_t *shape)
{
    char sr[SHAPE_TEXT], st[SHAPE_TEXT];
    if (ndim < 0 || ndim > FT_MAX_DIMS)
        return ft_fail(FT_ERR_ARGUMENT, func, 2,
                       "%d dims requested, at most %d are supported", ndim,
                       FT_MAX_DIMS);
    if (ndim > 0 && !req)
        return ft_fail(FT_ERR_ARGUMENT, func, 2, "shape expected, got NULL");
    int infer = -1, zero = 0;
    for (int d = 0; d < ndim; d++) {
        shape[d] = req[d];
        if (req[d] == -1) {
            if (infer >= 0)
                return ft_fail(FT_ERR_ARGUMENT, func, 2,
                               "only one size may be -1 in %s",
                               ft_format_shape(sr, sizeof sr, ndim, req));
            infer = d;
        } else if (req[d] < 0) {
            return ft_fail(FT_ERR_ARGUMENT, func, 2, "negative size in %s",
                           ft_format_shape(sr, sizeof sr, ndim, req));
        }
        zero |= req[d] == 0;
    }
    /* The product of the given sizes: 0 if one is 0, whatever the others. */
    int64_t known = 1;
    for (int d = 0; d < ndim && !zero; d++)
        if (d != infer && ft_mul_size(known, req[d], &known) != 0)
            return ft_fail(FT_ERR_ARGUMENT, func, 2, "shape %s is too large",
                           ft_format_shape(sr, sizeof sr, ndim, req));
    if (zero)
        known = 0;
    int64_t numel = ft_numel(t);
    if (infer >= 0) {
        if (known == 0 || numel % known != 0)
            return ft_fail(FT_ERR_ARGUMENT, func, 2,
                           "shape %s cannot hold %lld elements",
                           ft_format_shape(sr, sizeof sr, ndim, req),
                           (long long)numel);
        shape[infer] = numel / known;
        known = numel;
    }
    if (known != numel)
        return ft_fail(FT_ERR_ARGUMENT, func, 2,
                       "shape %s has %lld elements, tensor %s has %lld",
                       ft_format_shape(sr, sizeof sr, ndim, req),
                       (long long)known,
                       ft_format_shape(st, sizeof st, t->ndim, t->shape),
                       (long long)numel);
    return FT_OK;
}

/* Strides for viewing t with shape, if t's strides allow it without a
 * copy: each run of dims of t that is contiguous within itself may be
 * split or merged freely, runs may not be merged with each other. The
 * products stay within t's element count and extent; checked anyway. */
static int view_strides(const ft_tensor *t, int ndim, const int64_t *shape,
                        int64_t *stride)
{
    if (ft_numel(t) <= 1 || t->ndim == 0) {
        contiguous_strides(ndim, shape, stride);
        return 1;
    }
    int vd = ndim - 1;
    int64_t chunk_stride = t->stride[t->ndim - 1];
    int64_t t_numel = 1, v_numel = 1, next;
    for (int td = t->ndim - 1; td >= 0; td--) {
        if (ft_mul_size(t_numel, t->shape[td], &t_numel) != 0)
            return 0;
        int chunk_ends = td == 0 ||
                         (t->shape[td - 1] != 1 &&
                          (ft_mul_size(t_numel, chunk_stride, &next) != 0 ||
                           t->stride[td - 1] != next));
        if (!chunk_ends)
            continue;
        while (vd >= 0 && (v_numel < t_numel || shape[vd] == 1)) {
            if (ft_mul_size(v_numel, chunk_stride, &stride[vd]) != 0 ||
                ft_mul_size(v_numel, shape[vd], &v_numel) != 0)
                return 0;
            vd--;
        }
        if (v_numel != t_numel)
            return 0;
        if (td > 0) {
            chunk_stride = t->stride[td - 1];
            t_numel = v_numel = 1;
        }
    }
    return vd == -1;
}

static ft_status view_named(ft_tensor **out, const ft_tensor *t, int ndim,
                            const int64_t *req, const char *func, int *no_view)
{
    FT_TRY(check_out_and_tensor(func, out, t));
    int64_t shape[FT_MAX_DIMS], stride[FT_MAX_DIMS];
    FT_TRY(infer_shape(func, t, ndim, req, shape));
    if (ft_numel(t) == 0) {
        contiguous_strides(ndim, shape, stride);
    } else if (!view_strides(t, ndim, shape, stride)) {
        char sr[SHAPE_TEXT];
        *no_view = 1;
        return ft_fail(FT_ERR_ARGUMENT, func, 2,
                       "tensor's strides cannot be viewed as %s without a "
                       "copy (use reshape or contiguous)",
                       ft_format_shape(sr, sizeof sr, ndim, shape));
    }
    return make_view(out, t, t->data, ndim, shape, stride, func);
}

ft_status ft_view(ft_tensor **out, const ft_tensor *t, int ndim,
                  const int64_t *shape)
{
    int no_view = 0;
    return view_named(out, t, ndim, shape, "ft_view", &no_view);
}

ft_status ft_reshape(ft_tensor **out, const ft_tensor *t, int ndim,
                     const int64_t *shape)
{
    int no_view = 0;
    ft_status st = view_named(out, t, ndim, shape, "ft_reshape", &no_view);
    if (st == FT_OK || !no_view)
        return st;
    ft_tensor *c;
    FT_TRY(ft_clone(&c, t));
    st = view_named(out, c, ndim, shape, "ft_reshape", &no_view);
    ft_tensor_free(c);
    return st;
}

ft_status ft_transpose(ft_tensor **out, const ft_tensor *t, int dim0, int dim1)
{
    FT_TRY(check_out_and_tensor("ft_transpose", out, t));
    int d0, d1;
    FT_TRY(ft_check_dim("ft_transpose", 2, dim0, t->ndim, &d0));
    FT_TRY(ft_check_dim("ft_transpose", 3, dim1, t->ndim, &d1));
    int64_t shape[FT_MAX_DIMS], stride[FT_MAX_DIMS];
    memcpy(shape, t->shape, sizeof shape);
    memcpy(stride, t->stride, sizeof stride);
    shape[d0] = t->shape[d1], shape[d1] = t->shape[d0];
    stride[d0] = t->stride[d1], stride[d1] = t->stride[d0];
    return make_view(out, t, t->data, t->ndim, shape, stride, "ft_transpose");
}

ft_status ft_permute(ft_tensor **out, const ft_tensor *t, const int *perm)
{
    FT_TRY(check_out_and_tensor("ft_permute", out, t));
    if (t->ndim > 0 && !perm)
        return ft_fail(FT_ERR_ARGUMENT, "ft_permute", 2, "permutation expected");
    int64_t shape[FT_MAX_DIMS], stride[FT_MAX_DIMS];
    int seen[FT_MAX_DIMS] = {0};
    for (int d = 0; d < t->ndim; d++) {
        int src;
        FT_TRY(ft_check_dim("ft_permute", 2, perm[d], t->ndim, &src));
        if (seen[src]++)
            return ft_fail(FT_ERR_ARGUMENT, "ft_permute", 2,
                           "dim %d appears twice in the permutation", perm[d]);
        shape[d] = t->shape[src];
        stride[d] = t->stride[src];
    }
    return make_view(out, t, t->data, t->ndim, shape, stride, "ft_permute");
}

/* The address of index along dim d of t, for a view that starts there. A
 * view with no elements keeps t's address: its index may lie past the
 * end of t's storage ({1e18, 0} has huge rows of nothing, and a length-0
 * narrow may start one past the end), and it reaches no element. */
static void *view_start(const ft_tensor *t, int d, int64_t index, int has_elements)
{
    int64_t off;
    if (!has_elements || ft_mul_size(index, t->stride[d], &off) != 0)
        return t->data;
    return ft_elem_ptr(t, off);
}

ft_status ft_narrow(ft_tensor **out, const ft_tensor *t, int dim,
                    int64_t start, int64_t length)
{
    FT_TRY(check_out_and_tensor("ft_narrow", out, t));
    int d;
    FT_TRY(ft_check_dim("ft_narrow", 2, dim, t->ndim, &d));
    if (start < 0 || start > t->shape[d])
        return ft_fail(FT_ERR_ARGUMENT, "ft_narrow", 3,
                       "start %lld out of range for dim %d of size %lld",
                       (long long)start, dim, (long long)t->shape[d]);
    if (length < 0 || length > t->shape[d] - start)
        return ft_fail(FT_ERR_ARGUMENT, "ft_narrow", 4,
                       "length %lld from start %lld exceeds dim %d of size %lld",
                       (long long)length, (long long)start, dim,
                       (long long)t->shape[d]);
    int64_t shape[FT_MAX_DIMS];
    memcpy(shape, t->shape, sizeof shape);
    shape[d] = length;
    return make_view(out, t, view_start(t, d, start, length > 0 && ft_numel(t) > 0),
                     t->ndim, shape, t->stride, "ft_narrow");
}

ft_status ft_select(ft_tensor **out, const ft_tensor *t, int dim,
                    int64_t index)
{
    FT_TRY(check_out_and_tensor("ft_select", out, t));
    int d;
    FT_TRY(ft_check_dim("ft_select", 2, dim, t->ndim, &d));
    if (index < 0 || index >= t->shape[d])
        return ft_fail(FT_ERR_ARGUMENT, "ft_select", 3,
                       "index %lld out of range for dim %d of size %lld",
                       (long long)index, dim, (long long)t->shape[d]);
    int64_t shape[FT_MAX_DIMS], stride[FT_MAX_DIMS];
    int n = 0;
    for (int k = 0; k < t->ndim; k++)
        if (k != d) {
            shape[n] = t->shape[k];
            stride[n++] = t->stride[k];
        }
    return make_view(out, t, view_start(t, d, index, ft_numel(t) > 0), n, shape,
                     stride, "ft_select");
}

/* ---- copies ---- */

static int same_view(const ft_tensor *a, const ft_tensor *b)
{
    if (a->data != b->data || a->dtype != b->dtype || a->ndim != b->ndim)
        return 0;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d] || a->stride[d] != b->stride[d])
            return 0;
    return 1;
}

/* Row copies, n elements from s (dtype st, ss elements apart) to d (dt,
 * ds apart). The same dtype: moved by their size. i32 <-> i64: without the
 * double's 53 bits. Otherwise floats: through a block of doubles, each
 * loop with its dtype fixed (the compiler specialises ft_elem_load and
 * ft_elem_store in each case, so the bits are those of the element by
 * element conversion), f32 <-> bf16 by their bits, fp8 through a table of
 * its 256 values. */
#define FT_CONVERT_BLOCK 512
typedef struct {
    double e4m3[256]; /* fp8's values, filled when a long copy reads fp8 */
    int table;
} convert_state;

static void move_row(char *d, int64_t ds, const char *s, int64_t ss, size_t es, int64_t n)
{
#define FT_MOVE(T)                                                                           \
    for (int64_t i = 0; i < n; i++)                                                          \
        ((T *)d)[i * ds] = ((const T *)s)[i * ss];                                           \
    return;
    switch (es) {
    case 1: FT_MOVE(uint8_t)
    case 2: FT_MOVE(uint16_t)
    case 4: FT_MOVE(uint32_t)
    case 8: FT_MOVE(uint64_t)
    default:
        for (int64_t i = 0; i < n; i++)
            memcpy(d + (size_t)(i * ds) * es, s + (size_t)(i * ss) * es, es);
    }
#undef FT_MOVE
}

static void convert_row(void *d, int64_t ds, ft_dtype dt, const void *s, int64_t ss, ft_dtype st,
                        int64_t n, const convert_state *cs)
{
    if (st == FT_F32 && dt == FT_BF16) { /* the f32's bits rounded to nearest even */
        const uint32_t *x = s;
        uint16_t *y = d;
        for (int64_t i = 0; i < n; i++) {
            const uint32_t u = x[i * ss];
            y[i * ds] = (u & 0x7fffffffu) > 0x7f800000u
                            ? (uint16_t)(((u >> 16) & 0x8000u) | 0x7fc0u) /* NaN: quiet, sign kept */
                            : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        }
        return;
    }
    if (st == FT_BF16 && dt == FT_F32) { /* exact: the bits moved up */
        const uint16_t *x = s;
        uint32_t *y = d;
        for (int64_t i = 0; i < n; i++) {
            const uint16_t b = x[i * ss];
            y[i * ds] = (b & 0x7fffu) > 0x7f80u ? (uint32_t)(b & 0x8000u) << 16 | 0x7fc00000u
                                                : (uint32_t)b << 16;
        }
        return;
    }
    double buf[FT_CONVERT_BLOCK];
    for (int64_t i = 0; i < n; i += FT_CONVERT_BLOCK) {
        const int m = n - i < FT_CONVERT_BLOCK ? (int)(n - i) : FT_CONVERT_BLOCK;
#define FT_LOAD_CASE(T)                                                                      \
    case T:                                                                                  \
        for (int j = 0; j < m; j++)                                                          \
            buf[j] = ft_elem_load(s, (i + j) * ss, T);                                       \
        break;
#define FT_STORE_CASE(T)                                                                     \
    case T:                                                                                  \
        for (int j = 0; j < m; j++)                                                          \
            ft_elem_store(d, (i + j) * ds, T, buf[j]);                                       \
        break;
        if (cs->table) {
            const uint8_t *x = s;
            for (int j = 0; j < m; j++)
                buf[j] = cs->e4m3[x[(i + j) * ss]];
        }
        switch (cs->table ? -1 : (int)st) { /* -1: loaded from the table */
            FT_LOAD_CASE(FT_F64)
            FT_LOAD_CASE(FT_F32)
            FT_LOAD_CASE(FT_F16)
            FT_LOAD_CASE(FT_BF16)
            FT_LOAD_CASE(FT_I32)
            FT_LOAD_CASE(FT_I64)
            FT_LOAD_CASE(FT_FP8_E4M3)
        case -1:
            break;
        default:
            for (int j = 0; j < m; j++)
                buf[j] = ft_elem_load(s, (i + j) * ss, st);
        }
        switch (dt) {
            FT_STORE_CASE(FT_F64)
            FT_STORE_CASE(FT_F32)
            FT_STORE_CASE(FT_F16)
            FT_STORE_CASE(FT_BF16)
            FT_STORE_CASE(FT_I32)
            FT_STORE_CASE(FT_I64)
            FT_STORE_CASE(FT_FP8_E4M3)
        default:
            for (int j = 0; j < m; j++)
                ft_elem_store(d, (i + j) * ds, dt, buf[j]);
        }
#undef FT_LOAD_CASE
#undef FT_STORE_CASE
    }
}

static void int_row(void *d, int64_t ds, ft_dtype dt, const void *s, int64_t ss, ft_dtype st,
                    int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        const int64_t v = st == FT_I64 ? ((const int64_t *)s)[i * ss] : ((const int32_t *)s)[i * ss];
        if (dt == FT_I64)
            ((int64_t *)d)[i * ds] = v;
        else
            ((int32_t *)d)[i * ds] = ft_i64_to_i32(v);
    }
}

/* dst = src of one dtype where dst's last dim and src's second-to-last
 * are the contiguous ones (a transpose of the last two): FT_TILE_ROWS
 * rows of dst at a time, so that each read of src takes consecutive
 * elements and the writes stay in FT_TILE_ROWS lines of the cache. */
#define FT_TILE_ROWS 16
static void copy_transposed(ft_tensor *dst, const ft_tensor *src, size_t es)
{
    const int nd = dst->ndim;
    const int64_t R = dst->shape[nd - 2], C = dst->shape[nd - 1];
    const int64_t drs = dst->stride[nd - 2], scs = src->stride[nd - 1];
    const int64_t outer = R > 0 && C > 0 ? ft_numel(dst) / (R * C) : 0;
    ft_iter it;
    ft_iter_init(&it, nd - 2, dst->shape, 2, (const int64_t *[]){dst->stride, src->stride});
    for (int64_t o = 0; o < outer; o++, ft_iter_next(&it)) {
        char *d0 = ft_elem_ptr(dst, it.offset[0]);
        const char *s0 = ft_elem_ptr(src, it.offset[1]);
        for (int64_t r0 = 0; r0 < R; r0 += FT_TILE_ROWS) {
            const int64_t nr = R - r0 < FT_TILE_ROWS ? R - r0 : FT_TILE_ROWS;
#define FT_TILE(T)                                                                           \
    for (int64_t c = 0; c < C; c++)                                                          \
        for (int64_t r = r0; r < r0 + nr; r++)                                               \
            ((T *)d0)[r * drs + c] = ((const T *)s0)[r + c * scs];                           \
    break;
            switch (es) {
            case 1: FT_TILE(uint8_t)
            case 2: FT_TILE(uint16_t)
            case 4: FT_TILE(uint32_t)
            case 8: FT_TILE(uint64_t)
            default:
                for (int64_t c = 0; c < C; c++)
                    for (int64_t r = r0; r < r0 + nr; r++)
                        memcpy(d0 + (size_t)(r * drs + c) * es, s0 + (size_t)(r + c * scs) * es, es);
            }
#undef FT_TILE
        }
    }
}

/* dst = src (same shape, no overlap, dst's stride-0 dims collapsed): a
 * row of the last dim at a time, the rows walked by an iterator (a
 * transpose of the last two dims by tiles). */
static void copy_cpu(ft_tensor *dst, const ft_tensor *src)
{
    int64_t n = ft_numel(dst);
    size_t es = ft_dtype_size(dst->dtype);
    const int same = dst->dtype == src->dtype;
    if (same && ft_is_contiguous(dst) && ft_is_contiguous(src)) {
        size_t bytes = 0; /* n fits memory: dst holds n distinct elements */
        if (ft_checked_bytes(n, es, &bytes) == 0)
            memcpy(dst->data, src->data, bytes);
        return;
    }
    const int ints = ft_dtype_is_int(dst->dtype) && ft_dtype_is_int(src->dtype);
    convert_state cs;
    cs.table = !same && !ints && src->dtype == FT_FP8_E4M3 && n >= 4096;
    for (int b = 0; cs.table && b < 256; b++)
        cs.e4m3[b] = ft_elem_load(&(uint8_t){(uint8_t)b}, 0, FT_FP8_E4M3);
    const int nd = dst->ndim;
    const int contiguous = ft_is_contiguous(dst) && ft_is_contiguous(src);
    if (same && !contiguous && nd >= 2 && dst->stride[nd - 1] == 1 && src->stride[nd - 2] == 1 &&
        src->stride[nd - 1] != 1 && dst->shape[nd - 2] >= FT_TILE_ROWS) {
        copy_transposed(dst, src, es);
        return;
    }
    /* contiguous: one row of n; else rows along the last dim */
    const int64_t row = contiguous || nd == 0 ? n : dst->shape[nd - 1];
    const int64_t ds = contiguous || nd == 0 ? 1 : dst->stride[nd - 1];
    const int64_t ss = contiguous || nd == 0 ? 1 : src->stride[nd - 1];
    const int64_t rows = row > 0 ? n / row : 0;
    ft_iter it;
    ft_iter_init(&it, contiguous || nd == 0 ? 0 : nd - 1, dst->shape, 2,
                 (const int64_t *[]){dst->stride, src->stride});
    for (int64_t r = 0; r < rows; r++, ft_iter_next(&it)) {
        void *pd = ft_elem_ptr(dst, it.offset[0]);
        const void *ps = ft_elem_ptr(src, it.offset[1]);
        if (same)
            move_row(pd, ds, ps, ss, es, row);
        else if (ints)
            int_row(pd, ds, dst->dtype, ps, ss, src->dtype, row);
        else
            convert_row(pd, ds, dst->dtype, ps, ss, src->dtype, row, &cs);
    }
}

#ifdef FT_HAVE_CUDA
/* Bytes between a contiguous CPU tensor and a contiguous CUDA tensor of the
 * same dtype and shape. */
static ft_status memcpy_host_device(ft_tensor *dst, const ft_tensor *src)
{
    size_t n;
    if (ft_checked_bytes(ft_numel(dst), ft_dtype_size(dst->dtype), &n) != 0)
        return ft_fail(FT_ERR_INTERNAL, "ft_copy", 1, "contiguous tensor of impossible size");
    const ft_tensor *dev = dst->device.type == FT_CUDA ? dst : src;
    FT_TRY(ft_cuda_use_device(dev->device.index, "ft_copy"));
    if (n)
        FT_CUDA_TRY("ft_copy", cudaMemcpy(dst->data, src->data, n, cudaMemcpyDefault));
    return FT_OK;
}

/* A new contiguous tensor shaped like t, of dtype, on device. */
static ft_status empty_like(ft_tensor **out, const ft_tensor *t, ft_dtype dtype,
                            ft_device device)
{
    return ft_empty_named(out, t->ndim, t->shape, dtype, device, "ft_copy");
}

/* Copies between devices: converts on the side that has the strided or
 * differently-typed data, and moves contiguous bytes across. */
static ft_status copy_across(ft_tensor *dst, const ft_tensor *src)
{
    ft_tensor *a = NULL, *b = NULL;
    ft_status st = FT_OK;
    if (dst->device.type == FT_CUDA && src->device.type == FT_CUDA) {
        /* two GPUs: through the host */
        st = empty_like(&a, src, dst->dtype, (ft_device){FT_CPU, 0});
        if (st == FT_OK) st = ft_copy(a, src);
        if (st == FT_OK) st = ft_copy(dst, a);
    } else if (dst->device.type == FT_CUDA) { /* cpu -> cuda */
        const int direct = ft_is_contiguous(src) && src->dtype == dst->dtype;
        if (!direct) {
            st = empty_like(&a, src, dst->dtype, src->device);
            if (st == FT_OK) copy_cpu(a, src);
        }
        const ft_tensor *host = direct ? src : a;
        if (st == FT_OK && ft_is_contiguous(dst)) {
            st = memcpy_host_device(dst, host);
        } else if (st == FT_OK) {
            st = empty_like(&b, dst, dst->dtype, dst->device);
            if (st == FT_OK) st = memcpy_host_device(b, host);
            if (st == FT_OK) st = ft_cuda_copy(dst, b);
        }
    } else { /* cuda -> cpu */
        const int direct = ft_is_contiguous(src) && src->dtype == dst->dtype;
        if (!direct) {
            st = empty_like(&a, src, dst->dtype, src->device);
            if (st == FT_OK) st = ft_cuda_copy(a, src);
        }
        const ft_tensor *dev = direct ? src : a;
        if (st == FT_OK && ft_is_contiguous(dst)) {
            st = memcpy_host_device(dst, dev);
        } else if (st == FT_OK) {
            st = empty_like(&b, dst, dst->dtype, dst->device);
            if (st == FT_OK) st = memcpy_host_device(b, dev);
            if (st == FT_OK) copy_cpu(dst, b);
        }
    }
    ft_tensor_free(a);
    ft_tensor_free(b);
    return st;
}
#endif

ft_status ft_copy(ft_tensor *dst, const ft_tensor *src)
{
    FT_TRY(ft_check_tensor("ft_copy", 1, dst));
    FT_TRY(ft_check_tensor("ft_copy", 2, src));
    FT_TRY(ft_check_device("ft_copy", 1, dst, NULL));
    FT_TRY(ft_check_device("ft_copy", 2, src, NULL));
    FT_TRY(ft_check_same_shape("ft_copy", 2, dst, src));
    if (same_view(dst, src) || ft_numel(dst) == 0)
        return FT_OK;
    /* Each distinct element of dst is written once, with the value a
     * row-major loop would leave in it (stride-0 dims of dst collapsed). */
    ft_tensor d = *dst, s = *src;
    ft_collapse_for_write(&d, &s);
    FT_TRY(ft_check_walk("ft_copy", 1, ft_numel(&d), "elements"));
    if (ft_same_storage(&d, &s)) {
        /* Overlapping views: read everything before writing anything. */
        ft_tensor *tmp;
        FT_TRY(ft_clone(&tmp, &s));
        ft_status st = ft_copy(&d, tmp);
        ft_tensor_free(tmp);
        return st;
    }
#ifdef FT_HAVE_CUDA
    if (!ft_device_equal(d.device, s.device) || d.device.type == FT_CUDA) {
        if (ft_device_equal(d.device, s.device)) {
            FT_TRY(ft_cuda_use_device(d.device.index, "ft_copy"));
            return ft_cuda_copy(&d, &s);
        }
        return copy_across(&d, &s);
    }
#endif
    copy_cpu(&d, &s);
    return FT_OK;
}

ft_status ft_to(ft_tensor **out, const ft_tensor *t, ft_dtype dtype,
                ft_device device)
{
    FT_TRY(check_out_and_tensor("ft_to", out, t));
    if (!ft_dtype_size(dtype))
        return ft_fail(FT_ERR_ARGUMENT, "ft_to", 2, "invalid dtype %d", (int)dtype);
    ft_tensor *r;
    FT_TRY(ft_empty_named(&r, t->ndim, t->shape, dtype, device, "ft_to"));
    ft_status st = ft_copy(r, t);
    if (st != FT_OK) {
        ft_tensor_free(r);
        return st;
    }
    *out = r;
    return FT_OK;
}

ft_status ft_clone(ft_tensor **out, const ft_tensor *t)
{
    FT_TRY(check_out_and_tensor("ft_clone", out, t));
    return ft_to(out, t, t->dtype, t->device);
}

ft_status ft_contiguous(ft_tensor **out, const ft_tensor *t)
{
    FT_TRY(check_out_and_tensor("ft_contiguous", out, t));
    if (ft_is_contiguous(t))
        return ft_alias(out, t);
    return ft_clone(out, t);
}

ft_status ft_fill(ft_tensor *t, double value)
{
    FT_TRY(ft_check_tensor("ft_fill", 1, t));
    FT_TRY(ft_check_device("ft_fill", 1, t, NULL));
    if (ft_numel(t) == 0)
        return FT_OK;
    /* Each distinct element once: stride-0 dims collapsed. */
    ft_tensor w = *t;
    ft_collapse_for_write(&w, NULL);
    const int64_t n = ft_numel(&w);
    FT_TRY(ft_check_walk("ft_fill", 1, n, "elements"));
#ifdef FT_HAVE_CUDA
    if (w.device.type == FT_CUDA) {
        FT_TRY(ft_cuda_use_device(w.device.index, "ft_fill"));
        return ft_cuda_fill(&w, value);
    }
#endif
    /* Convert once, then replicate the bytes. */
    unsigned char bytes[8];
    size_t es = ft_dtype_size(w.dtype);
    ft_store_f64(bytes, w.dtype, value);
    ft_iter it;
    ft_iter_init(&it, w.ndim, w.shape, 1, (const int64_t *[]){w.stride});
    for (int64_t i = 0; i < n; i++, ft_iter_next(&it))
        memcpy(ft_elem_ptr(&w, it.offset[0]), bytes, es);
    return FT_OK;
}

ft_status ft_arange_count(int64_t start, int64_t stop, int64_t step,
                          int64_t *count)
{
    static const char F[] = "ft_arange_count";
    if (!count)
        return ft_fail(FT_ERR_ARGUMENT, F, 0, "result pointer is NULL");
    if (step == 0)
        return ft_fail(FT_ERR_ARGUMENT, F, 3, "step must be nonzero");
    /* ceil((stop - start) / step) in unsigned arithmetic: the distance
     * between two int64 values always fits a uint64. */
    uint64_t dist, ustep;
    if (step > 0) {
        dist = stop > start ? (uint64_t)stop - (uint64_t)start : 0;
        ustep = (uint64_t)step;
    } else {
        dist = start > stop ? (uint64_t)start - (uint64_t)stop : 0;
        ustep = (uint64_t)0 - (uint64_t)step;
    }
    const uint64_t n = dist / ustep + (dist % ustep != 0);
    if (n > (uint64_t)FT_MAX_ELEMENTS)
        return ft_fail(FT_ERR_ARGUMENT, F, 2,
                       "%llu elements from %lld to %lld by %lld: more than "
                       "the 2^48 a tensor may hold",
                       (unsigned long long)n, (long long)start, (long long)stop,
                       (long long)step);
    *count = (int64_t)n;
    return FT_OK;
}

ft_status ft_arange_int(ft_tensor *t, int64_t start, int64_t step)
{
    static const char F[] = "ft_arange_int";
    FT_TRY(ft_check_tensor(F, 1, t));
    FT_TRY(ft_check_device(F, 1, t, NULL));
    if (t->dtype != FT_I64 && t->dtype != FT_I32)
        return ft_fail(FT_ERR_ARGUMENT, F, 1, "needs an i64 or i32 tensor, got %s",
                       ft_dtype_name(t->dtype));
    const int64_t n = ft_numel(t);
    if (n == 0)
        return FT_OK;
    /* The values run from start to start + (n - 1) * step, each in
     * between: both ends must fit the dtype. */
    const int64_t lo = t->dtype == FT_I64 ? INT64_MIN : INT32_MIN;
    const int64_t hi = t->dtype == FT_I64 ? INT64_MAX : INT32_MAX;
    int64_t span, last;
    if (__builtin_mul_overflow(n - 1, step, &span) ||
        __builtin_add_overflow(start, span, &last) || start < lo || start > hi ||
        last < lo || last > hi)
        return ft_fail(FT_ERR_ARGUMENT, F, 3,
                       "%lld elements from %lld by %lld go past the range of %s",
                       (long long)n, (long long)start, (long long)step,
                       ft_dtype_name(t->dtype));
    if (t->device.type != FT_CPU) {
        /* Computed on the CPU, then copied over. */
        ft_tensor *host;
        FT_TRY(ft_empty_named(&host, t->ndim, t->shape, t->dtype,
                              (ft_device){FT_CPU, 0}, F));
        ft_status st = ft_arange_int(host, start, step);
        if (st == FT_OK)
            st = ft_copy(t, host);
        ft_tensor_free(host);
        return st;
    }
    /* Element i (row-major) is start + i * step. Stride-0 dims are
     * collapsed; each distinct element takes the value of its last index
     * along them, as a row-major loop would leave it. row[] are the
     * row-major strides of the whole shape, which fit (n does). */
    ft_tensor w = *t;
    ft_collapse_for_write(&w, NULL);
    int64_t row[FT_MAX_DIMS], base = 0, r = 1;
    for (int d = t->ndim - 1; d >= 0; d--) {
        int64_t span_d = 0;
        row[d] = r;
        if (w.shape[d] != t->shape[d] &&
            ft_mul_size(row[d], t->shape[d] - 1, &span_d) == 0)
            ft_add_size(base, span_d, &base); /* <= n - 1: fits */
        ft_mul_size(r, t->shape[d], &r);       /* <= n: fits */
    }
    const int64_t m = ft_numel(&w);
    ft_iter it;
    ft_iter_init(&it, w.ndim, w.shape, 2, (const int64_t *[]){w.stride, row});
    for (int64_t i = 0; i < m; i++, ft_iter_next(&it)) {
        const int64_t v = start + (base + it.offset[1]) * step;
        void *p = ft_elem_ptr(&w, it.offset[0]);
        if (w.dtype == FT_I64)
            *(int64_t *)p = v;
        else
            *(int32_t *)p = (int32_t)v;
    }
    return FT_OK;
}

/* ---- single elements ---- */

static ft_status element_offset(const char *func, const ft_tensor *t,
                                const int64_t *index, int64_t *off)
{
    FT_TRY(ft_check_tensor(func, 1, t));
    FT_TRY(ft_check_device(func, 1, t, NULL));
    if (t->ndim > 0 && !index)
        return ft_fail(FT_ERR_ARGUMENT, func, 2, "index expected");
    int64_t o = 0;
    for (int d = 0; d < t->ndim; d++) {
        if (index[d] < 0 || index[d] >= t->shape[d])
            return ft_fail(FT_ERR_ARGUMENT, func, 2,
                           "index %lld out of range for dim %d of size %lld",
                           (long long)index[d], d, (long long)t->shape[d]);
        int64_t step;
        /* Inside the view, so inside its storage: never fails. */
        if (ft_mul_size(index[d], t->stride[d], &step) != 0 ||
            ft_add_size(o, step, &o) != 0)
            return ft_fail(FT_ERR_INTERNAL, func, 2, "element offset overflows");
    }
    *off = o;
    return FT_OK;
}

/* Reads (or writes) the bytes of one element, wherever it lives. */
static ft_status element_bytes(const char *func, const ft_tensor *t, int64_t off,
                               void *bytes, int write)
{
    void *p = ft_elem_ptr(t, off);
    size_t n = ft_dtype_size(t->dtype);
#ifdef FT_HAVE_CUDA
    if (t->device.type == FT_CUDA) {
        FT_TRY(ft_cuda_use_device(t->device.index, func));
        FT_CUDA_TRY(func, write ? cudaMemcpy(p, bytes, n, cudaMemcpyHostToDevice)
                                : cudaMemcpy(bytes, p, n, cudaMemcpyDeviceToHost));
        return FT_OK;
    }
#else
    (void)func;
#endif
    if (write)
        memcpy(p, bytes, n);
    else
        memcpy(bytes, p, n);
    return FT_OK;
}

ft_status ft_get(const ft_tensor *t, const int64_t *index, double *value)
{
    int64_t off;
    unsigned char bytes[8];
    if (!value)
        return ft_fail(FT_ERR_ARGUMENT, "ft_get", 0, "result pointer is NULL");
    FT_TRY(element_offset("ft_get", t, index, &off));
    FT_TRY(element_bytes("ft_get", t, off, bytes, 0));
    *value = ft_load_f64(bytes, t->dtype);
    return FT_OK;
}

ft_status ft_set(ft_tensor *t, const int64_t *index, double value)
{
    int64_t off;
    unsigned char bytes[8];
    FT_TRY(element_offset("ft_set", t, index, &off));
    ft_store_f64(bytes, t->dtype, value);
    return element_bytes("ft_set", t, off, bytes, 1);
}

ft_status ft_get_int(const ft_tensor *t, const int64_t *index, int64_t *value)
{
    int64_t off;
    unsigned char bytes[8];
    if (!value)
        return ft_fail(FT_ERR_ARGUMENT, "ft_get_int", 0, "result pointer is NULL");
    FT_TRY(element_offset("ft_get_int", t, index, &off));
    switch (t->dtype) {
    case FT_I64: case FT_I32: break;
    default:
        return ft_fail(FT_ERR_ARGUMENT, "ft_get_int", 1,
                       "needs an integer tensor, got %s", ft_dtype_name(t->dtype));
    }
    FT_TRY(element_bytes("ft_get_int", t, off, bytes, 0));
    if (t->dtype == FT_I64) {
        int64_t v;
        memcpy(&v, bytes, sizeof v);
        *value = v;
    } else {
        int32_t v;
        memcpy(&v, bytes, sizeof v);
        *value = v;
    }
    return FT_OK;
}

ft_status ft_set_int(ft_tensor *t, const int64_t *index, int64_t value)
{
    int64_t off;
    unsigned char bytes[8];
    FT_TRY(element_offset("ft_set_int", t, index, &off));
    switch (t->dtype) {
    case FT_I64: memcpy(bytes, &value, sizeof value); break;
    case FT_I32: {
        int32_t v = (int32_t)(value > INT32_MAX ? INT32_MAX : value < INT32_MIN ? INT32_MIN : value);
        memcpy(bytes, &v, sizeof v);
        break;
    }
    default: ft_store_f64(bytes, t->dtype, (double)value); break;
    }
    return element_bytes("ft_set_int", t, off, bytes, 1);
}
