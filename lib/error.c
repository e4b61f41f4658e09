/*
 * error.c - the per-thread last error, and the small argument checks that
 * every file of lib/ uses so that messages read the same everywhere.
 */
#include "internal.h"

#include <stdarg.h>
#include <stdio.h>
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
