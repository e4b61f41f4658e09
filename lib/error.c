/*
 * error.c - the per-thread last error, and the small argument checks that
 * every file of lib/ uses so that messages read the same everywhere.
 */
#include "internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FT_ERROR_SIZE 512

/* One record per thread: a library loaded into several Lua states on
 * several threads must not mix their messages. */
static _Thread_local struct {
    char message[FT_ERROR_SIZE + 64]; /* "func: detail" */
    char detail[FT_ERROR_SIZE];
    int arg;
} last_error;

ft_status ft_fail(ft_status status, const char *func, int arg,
                  const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error.detail, sizeof last_error.detail, fmt, ap);
    va_end(ap);
    snprintf(last_error.message, sizeof last_error.message, "%.60s: %s", func,
             last_error.detail);
    last_error.arg = arg;
    return status;
}

const char *ft_last_error(void) { return last_error.message; }
const char *ft_last_error_detail(void) { return last_error.detail; }
int ft_last_error_arg(void) { return last_error.arg; }

char *ft_format_shape(char *buf, size_t size, int ndim, const int64_t *shape)
{
    size_t n = (size_t)snprintf(buf, size, "{");
    for (int d = 0; d < ndim && n < size; d++)
        n += (size_t)snprintf(buf + n, size - n, "%s%lld", d ? ", " : "",
                              (long long)shape[d]);
    if (n < size)
        snprintf(buf + n, size - n, "}");
    return buf;
}

ft_status ft_check_dim(const char *func, int arg, int dim, int ndim, int *out)
{
    int d = dim < 0 ? dim + ndim : dim;
    if (d < 0 || d >= ndim)
        return ft_fail(FT_ERR_ARGUMENT, func, arg,
                       "dim %d out of range for a %d-d tensor", dim, ndim);
    *out = d;
    return FT_OK;
}

ft_status ft_check_tensor(const char *func, int arg, const ft_tensor *t)
{
    if (!t)
        return ft_fail(FT_ERR_ARGUMENT, func, arg, "tensor expected, got NULL");
    return FT_OK;
}

ft_status ft_check_computable(const char *func, int arg, ft_dtype dtype, const char *what)
{
    if (ft_dtype_is_storage_only(dtype))
        return ft_fail(FT_ERR_ARGUMENT, func, arg,
                       "%s: %s tensors hold data only; convert with :to('f16') (ft_to) first",
                       what, ft_dtype_name(dtype));
    return FT_OK;
}

ft_status ft_read_i32(const char *func, int ap, const char *name, const ft_tensor *t,
                      int64_t **out, int64_t *n)
{
    *out = NULL;
    *n = 0;
    FT_TRY(ft_check_tensor(func, ap, t));
    if (t->dtype != FT_I32)
        return ft_fail(FT_ERR_ARGUMENT, func, ap, "%s must be an i32 tensor, got %s", name,
                       ft_dtype_name(t->dtype));
    ft_tensor *h = NULL;
    FT_TRY(ft_to(&h, t, FT_I64, (ft_device){FT_CPU, 0}));
    const int64_t count = ft_numel(h);
    ft_status st = FT_OK;
    if (!(*out = malloc((size_t)(count > 0 ? count : 1) * sizeof **out)))
        st = ft_fail(FT_ERR_NOMEM, func, ap, "out of memory reading %s", name);
    else
        memcpy(*out, h->data, (size_t)count * sizeof **out);
    *n = count;
    ft_tensor_free(h);
    return st;
}
