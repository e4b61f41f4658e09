/*
 * fuzz.h - what the fuzz targets (fuzz_npy.c, fuzz_safetensors.c) share:
 * the input written to a file the loaders can open, a scratch directory
 * for the savers, and the checks every input gets.
 *
 * Each target defines LLVMFuzzerTestOneInput. Built with
 * -fsanitize=fuzzer (cmake/fuzz.cmake) it is driven by libFuzzer; built
 * without (cmake/fuzz_replay.cmake) it is driven by replay.c's main over
 * the committed corpus and regression inputs.
 *
 * A loader may reject an input (any status but FT_OK); what it may not do
 * is crash, leak, hit undefined behaviour, hang, leave *out set after a
 * failure, fail without a message that starts with its own name, or give
 * tensors that do not survive a save and a reload bit for bit. The checks
 * here abort() with a message on stderr when one of those happens, which
 * libFuzzer reports as a crash (and replay.c as a failed test).
 *
 * One input file per process: a memfd (opened by the loaders through
 * /proc/self/fd/N) rewritten for each input, or, where that is not
 * available, a file in the scratch directory. The scratch directory is
 * $TMPDIR/flashtile-fuzz-XXXXXX (TMPDIR defaults to /tmp), removed at exit.
 */
#ifndef FT_FUZZ_H
#define FT_FUZZ_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* memfd_create, mkdtemp */
#endif

#include "flashtile.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* The entry point libFuzzer calls (and replay.c). */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Set by LLVMFuzzerTestOneInput: 1 when the last input loaded, 0 when the
 * loader rejected it (replay.c checks this against the file's name). */
extern int ft_fuzz_loaded;

/* Each file includes what it needs of these; the rest stays unused. */
#define FF_STATIC static __attribute__((unused))

/* Room for a path. */
#define FF_PATH_CAP 4096

FF_STATIC char ff_scratch_dir[FF_PATH_CAP];
FF_STATIC char ff_input_path[FF_PATH_CAP];
FF_STATIC int ff_input_fd = -1;

FF_STATIC void ff_die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

FF_STATIC void ff_die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("flashtile fuzz: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    abort();
}

/* Removes the scratch directory and everything in it (it holds only
 * plain files written here: the input, the saved copies, a saver's
 * temporary file if one was left). */
FF_STATIC void ff_cleanup(void)
{
    if (ff_input_fd >= 0)
        close(ff_input_fd);
    ff_input_fd = -1;
    if (ff_scratch_dir[0] == '\0')
        return;
    DIR *d = opendir(ff_scratch_dir);
    if (d != NULL) {
        struct dirent *e;
        char path[FF_PATH_CAP + 256];
        while ((e = readdir(d)) != NULL) {
            if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
                continue;
            snprintf(path, sizeof path, "%s/%s", ff_scratch_dir, e->d_name);
            unlink(path);
        }
        closedir(d);
    }
    rmdir(ff_scratch_dir);
    ff_scratch_dir[0] = '\0';
}

/* A file name in the scratch directory. */
FF_STATIC const char *ff_scratch(const char *name, char *buf, size_t cap)
{
    if ((size_t)snprintf(buf, cap, "%s/%s", ff_scratch_dir, name) >= cap)
        ff_die("scratch path too long: %s/%s", ff_scratch_dir, name);
    return buf;
}

/* Whether fopen(path) reads the bytes of fd (it does for a memfd through
 * /proc/self/fd; not where /proc is not mounted). */
FF_STATIC int ff_reopens(int fd, const char *path)
{
    if (ftruncate(fd, 0) != 0 || pwrite(fd, "ok", 2, 0) != 2)
        return 0;
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return 0;
    char buf[4] = {0};
    size_t got = fread(buf, 1, sizeof buf, f);
    fclose(f);
    return got == 2 && memcmp(buf, "ok", 2) == 0;
}

FF_STATIC void ff_init(void)
{
    if (ff_input_fd >= 0)
        return;
    const char *tmp = getenv("TMPDIR");
    if (tmp == NULL || tmp[0] == '\0')
        tmp = "/tmp";
    if ((size_t)snprintf(ff_scratch_dir, sizeof ff_scratch_dir,
                         "%s/flashtile-fuzz-XXXXXX", tmp) >= sizeof ff_scratch_dir)
        ff_die("TMPDIR is too long: %s", tmp);
    if (mkdtemp(ff_scratch_dir) == NULL) {
        int err = errno;
        char dir[FF_PATH_CAP];
        snprintf(dir, sizeof dir, "%s", ff_scratch_dir);
        ff_scratch_dir[0] = '\0';
        ff_die("cannot create a scratch directory %s: %s", dir, strerror(err));
    }
    atexit(ff_cleanup);

#ifdef MFD_CLOEXEC
    int fd = memfd_create("flashtile-fuzz-input", MFD_CLOEXEC);
    if (fd >= 0) {
        snprintf(ff_input_path, sizeof ff_input_path, "/proc/self/fd/%d", fd);
        if (ff_reopens(fd, ff_input_path)) {
            ff_input_fd = fd;
            return;
        }
        close(fd);
    }
#endif
    ff_scratch("input", ff_input_path, sizeof ff_input_path);
    ff_input_fd = open(ff_input_path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (ff_input_fd < 0)
        ff_die("cannot create %s: %s", ff_input_path, strerror(errno));
}

/* Makes the input file hold exactly data[0..size); returns its path. */
FF_STATIC const char *ff_write_input(const uint8_t *data, size_t size)
{
    ff_init();
    if (ftruncate(ff_input_fd, 0) != 0)
        ff_die("cannot truncate %s: %s", ff_input_path, strerror(errno));
    size_t done = 0;
    while (done < size) {
        ssize_t w = pwrite(ff_input_fd, data + done, size - done, (off_t)done);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            ff_die("cannot write %s: %s", ff_input_path, strerror(errno));
        done += (size_t)w;
    }
    return ff_input_path;
}

/* ---- the checks ---- */

/* A failed call: a status a file can cause, a message that starts with
 * "func: ", and no result left behind (out_left: whatever *out holds). */
FF_STATIC void ff_check_failure(ft_status st, const char *func, const void *out_left)
{
    const char *msg = ft_last_error();
    size_t n = strlen(func);
    if (st != FT_ERR_IO && st != FT_ERR_UNSUPPORTED && st != FT_ERR_NOMEM)
        ff_die("%s failed with status %d, which a file's contents should not "
               "cause: %s", func, (int)st, msg);
    if (strncmp(msg, func, n) != 0 || msg[n] != ':' || msg[n + 1] != ' ' ||
        msg[n + 2] == '\0')
        ff_die("%s failed (status %d) without a message naming it: '%s'", func,
               (int)st, msg);
    if (out_left != NULL)
        ff_die("%s failed (status %d) but left its result set: %s", func,
               (int)st, msg);
}

/* A call that must succeed here. */
FF_STATIC void ff_check_ok(ft_status st, const char *what)
{
    if (st != FT_OK)
        ff_die("%s failed (status %d): %s", what, (int)st, ft_last_error());
}

FF_STATIC volatile double ff_sink;

/* A loaded tensor: a contiguous CPU tensor of a valid dtype and rank, its
 * storage large enough; every element is read (a sum through the public
 * API; for a storage dtype, which sums refuse, the sum of its f64 copy). */
FF_STATIC void ff_touch(const ft_tensor *t, const char *what)
{
    if (t == NULL)
        ff_die("%s: a successful load gave no tensor", what);
    if (t->device.type != FT_CPU)
        ff_die("%s: the tensor is not on the CPU", what);
    if (ft_dtype_size(t->dtype) == 0)
        ff_die("%s: invalid dtype %d", what, (int)t->dtype);
    if (t->ndim < 0 || t->ndim > FT_MAX_DIMS)
        ff_die("%s: invalid ndim %d", what, t->ndim);
    for (int d = 0; d < t->ndim; d++)
        if (t->shape[d] < 0)
            ff_die("%s: negative size %lld of dim %d", what,
                   (long long)t->shape[d], d);
    if (!ft_is_contiguous(t))
        ff_die("%s: the tensor is not contiguous", what);
    const int64_t n = ft_numel(t);
    if ((uint64_t)n * ft_dtype_size(t->dtype) > ft_storage_nbytes(t))
        ff_die("%s: %lld elements of %zu bytes in a storage of %zu bytes", what,
               (long long)n, ft_dtype_size(t->dtype), ft_storage_nbytes(t));
    double sum = 0;
    if (ft_dtype_is_storage_only(t->dtype)) {
        ft_tensor *wide = NULL;
        ff_check_ok(ft_to(&wide, t, FT_F64, t->device), "ft_to of a loaded tensor");
        ff_check_ok(ft_reduce_all(FT_SUM, wide, &sum), "ft_reduce_all of its f64 copy");
        ft_tensor_free(wide);
    } else {
        ff_check_ok(ft_reduce_all(FT_SUM, t, &sum), "ft_reduce_all of a loaded tensor");
    }
    ff_sink = sum;
}

/* a and b (contiguous) hold the same dtype, shape and bytes. */
FF_STATIC void ff_same(const ft_tensor *a, const ft_tensor *b, const char *what)
{
    if (a->dtype != b->dtype)
        ff_die("%s: dtype %s became %s", what, ft_dtype_name(a->dtype),
               ft_dtype_name(b->dtype));
    if (a->ndim != b->ndim)
        ff_die("%s: %d dims became %d", what, a->ndim, b->ndim);
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d])
            ff_die("%s: dim %d of size %lld became %lld", what, d,
                   (long long)a->shape[d], (long long)b->shape[d]);
    if (!ft_is_contiguous(a) || !ft_is_contiguous(b))
        ff_die("%s: not contiguous", what);
    const size_t nbytes = (size_t)ft_numel(a) * ft_dtype_size(a->dtype);
    if (nbytes > 0 && memcmp(a->data, b->data, nbytes) != 0)
        ff_die("%s: the elements differ", what);
}

#endif
