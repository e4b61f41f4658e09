/*
 * tensor_files.h - helpers the C tests of the file formats share (after
 * check.h): tensors made and read element by element, temporary files and
 * their bytes. Failures are counted in check.h's `failures`.
 */
#ifndef FT_TEST_TENSOR_FILES_H
#define FT_TEST_TENSOR_FILES_H

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static ft_tensor *empty(ft_dtype dtype, int ndim, const int64_t *shape)
{
    ft_tensor *t = NULL;
    if (ft_empty(&t, ndim, shape, dtype, CPU) != FT_OK) {
        fprintf(stderr, "ft_empty: %s\n", ft_last_error());
        failures++;
    }
    return t;
}

/* The row-major multi-index of element i of shape. */
static void unravel(int64_t i, int ndim, const int64_t *shape, int64_t *idx)
{
    for (int d = ndim - 1; d >= 0; d--) {
        idx[d] = i % shape[d];
        i /= shape[d];
    }
}

/* Element i (row-major) of t, any strides. */
static double at(const ft_tensor *t, int64_t i)
{
    int64_t idx[FT_MAX_DIMS];
    double v = NAN;
    unravel(i, t->ndim, t->shape, idx);
    if (ft_get(t, idx, &v) != FT_OK) {
        fprintf(stderr, "ft_get: %s\n", ft_last_error());
        failures++;
    }
    return v;
}

static void set_at(ft_tensor *t, int64_t i, double v)
{
    int64_t idx[FT_MAX_DIMS];
    unravel(i, t->ndim, t->shape, idx);
    if (ft_set(t, idx, v) != FT_OK) {
        fprintf(stderr, "ft_set: %s\n", ft_last_error());
        failures++;
    }
}

/* A fresh empty file under $TMPDIR (or /tmp) named prefix_XXXXXX; its path
 * goes to path. */
static int temp_file(char *path, size_t cap, const char *prefix)
{
    const char *dir = getenv("TMPDIR");
    if (dir == NULL || dir[0] == '\0')
        dir = "/tmp";
    if ((size_t)snprintf(path, cap, "%s/%s_XXXXXX", dir, prefix) >= cap)
        return -1;
    int fd = mkstemp(path);
    if (fd < 0) {
        fprintf(stderr, "mkstemp(%s): %s\n", path, strerror(errno));
        failures++;
        return -1;
    }
    close(fd);
    return 0;
}

static void write_bytes(const char *path, const void *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (f == NULL || (n > 0 && fwrite(data, 1, n, f) != n)) {
        fprintf(stderr, "write %s: %s\n", path, strerror(errno));
        failures++;
    }
    if (f != NULL)
        fclose(f);
}

/* Reads up to cap bytes of path into buf; returns the count. */
static size_t read_bytes(const char *path, void *buf, size_t cap)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return 0;
    size_t n = fread(buf, 1, cap, f);
    fclose(f);
    return n;
}

#endif
