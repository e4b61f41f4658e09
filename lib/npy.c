/*
 * npy.c - ft_save_npy and ft_load_npy: NumPy's .npy file format.
 *
 * A .npy file is
 *   magic "\x93NUMPY" (6 bytes), major and minor version (1 byte each),
 *   the dict's length (little-endian uint16 in version 1.0, uint32 in 2.0
 *   and 3.0), and the dict: a Python literal such as
 *     {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
 *   padded with spaces and ended by '\n' so that the data starts at a
 *   multiple of 64 bytes; then the raw elements, in row-major order (or
 *   column-major when fortran_order is True).
 * Version 3.0 differs from 2.0 only in that the dict may be UTF-8; the keys
 * and values flashtile understands are ASCII either way.
 *
 * flashtile writes version 1.0, little-endian, row-major, for f16, f32, f64,
 * i32 and i64 (bf16 has no NumPy dtype); a CUDA tensor is copied to the CPU
 * first. It reads versions 1.0, 2.0 and 3.0 of those dtypes in either byte
 * order and either memory order, and always gives a contiguous row-major CPU
 * tensor.
 *
 * fp8_e4m3 has no NumPy dtype either, and NumPy refuses a dict with any key
 * but the three, so the dtype is said in the descr itself: a structured
 * dtype of one uint8 field named after it, [('fp8_e4m3', '|u1')]. NumPy
 * loads such a file as records whose field holds the raw bits
 * (a['fp8_e4m3'], or a.view(ml_dtypes.float8_e4m3fn)); flashtile reads
 * that descr, and no other structured one, back as fp8_e4m3. A plain
 * '|u1' or '|V1' is not taken for fp8: NumPy writes those for real bytes
 * and for every 8-bit float of ml_dtypes alike.
 *
 * Error statuses: the OS failing to open, read or write a file, and files
 * that are not well-formed .npy (bad magic, truncated, malformed dict,
 * impossible shape), are FT_ERR_IO; well-formed files that flashtile cannot
 * represent (another dtype, a version other than 1.0-3.0, more than
 * FT_MAX_DIMS dimensions) are FT_ERR_UNSUPPORTED.
 */
#define _XOPEN_SOURCE 700 /* POSIX 2008 with XSI: fdopen, fsync, fchmod, lstat, realpath */

#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#define NPY_MAGIC "\x93NUMPY"
#define NPY_MAGIC_LEN 6
#define NPY_VERSION_LEN 2
/* Bytes before the dict: magic, version, and the dict's length field. */
#define NPY_V1_LEN_FIELD 2
#define NPY_V2_LEN_FIELD 4
#define NPY_V1_PREAMBLE (NPY_MAGIC_LEN + NPY_VERSION_LEN + NPY_V1_LEN_FIELD)
#define NPY_V1_MAX_HEADER 65535u
/* The data starts at a multiple of this many bytes (NumPy's ARRAY_ALIGN). */
#define NPY_ALIGN 64
/* Room for the dict flashtile writes: under 300 characters for 8 dims of
 * 19 digits, plus up to NPY_ALIGN of padding. */
#define NPY_HEADER_CAP 1024
/* A dict longer than this is not one of the simple dtypes flashtile reads;
 * refusing it early keeps a corrupt length from allocating gigabytes. */
#define NPY_MAX_HEADER_READ (1u << 20)
/* Longest descr string kept for parsing and error messages. */
#define NPY_DESCR_CAP 64
/* Bytes gathered before each fwrite when saving a strided view. */
#define NPY_WRITE_CHUNK (64 * 1024)
#define NPY_ERR_CAP 160

static const char SAVE[] = "ft_save_npy";
static const char LOAD[] = "ft_load_npy";

/* ---- byte order ---- */

int ft_host_is_little_endian(void)
{
    const uint16_t one = 1;
    unsigned char first;
    memcpy(&first, &one, 1);
    return first == 1;
}

void ft_swap_elements(void *data, size_t n, size_t esize)
{
    unsigned char *p = data;
    for (size_t i = 0; i < n; i++, p += esize)
        for (size_t a = 0, b = esize - 1; a < b; a++, b--) {
            unsigned char tmp = p[a];
            p[a] = p[b];
            p[b] = tmp;
        }
}

/* The message for the errno of a failed stdio call; stdio does not always
 * set errno (a short read at end of file sets nothing). glibc's strerror
 * returns static strings for known errnos, so it is safe across threads
 * there. */
const char *ft_errno_text(int err, const char *fallback)
{
    return err != 0 ? strerror(err) : fallback;
}


/* ---- writing a file in one piece (both savers) ---- */

/* Attempts at a fresh temporary name before giving up. */
#define FT_TMP_TRIES 100

/* The file to write for path: *target (malloc'd) is path, or the file the
 * symbolic link path points to; *in_place is set for a device or FIFO and
 * for a link that points nowhere. Returns 0, or an errno. */
static int file_target(const char *path, char **target, int *in_place,
                       struct stat *existing, int *exists)
{
    struct stat st;
    *in_place = 0;
    *exists = 0;
    *target = NULL;
    const char *name = path;
    char *resolved = NULL;
    if (lstat(path, &st) == 0 && S_ISLNK(st.st_mode)) {
        resolved = realpath(path, NULL);
        if (resolved == NULL) { /* a dangling link: fopen creates its target */
            *in_place = 1;
            return 0;
        }
        name = resolved;
    }
    if (stat(name, &st) == 0) {
        *exists = 1;
        *existing = st;
        if (S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) || S_ISFIFO(st.st_mode) ||
            S_ISSOCK(st.st_mode)) {
            free(resolved);
            *in_place = 1;
            return 0;
        }
    }
    *target = resolved ? resolved : strdup(path);
    return *target ? 0 : ENOMEM;
}

ft_status ft_file_begin(ft_out_file *o, const char *path, const char *func,
                        int arg)
{
    static atomic_uint serial;
    memset(o, 0, sizeof *o);
    o->path = path;
    o->func = func;
    o->arg = arg;
    struct stat existing;
    int in_place, exists, err;
    err = file_target(path, &o->target, &in_place, &existing, &exists);
    if (err != 0)
        return ft_fail(FT_ERR_NOMEM, func, arg, "out of memory");
    if (in_place) {
        errno = 0;
        o->f = fopen(path, "wb");
        if (o->f == NULL)
            return ft_fail(FT_ERR_IO, func, arg, "cannot open '%s' for writing: %s",
                           path, ft_errno_text(errno, "fopen failed"));
        return FT_OK;
    }
    const size_t cap = strlen(o->target) + 64;
    o->tmp = malloc(cap);
    if (o->tmp == NULL) {
        free(o->target);
        o->target = NULL;
        return ft_fail(FT_ERR_NOMEM, func, arg, "out of memory");
    }
    int fd = -1;
    err = 0;
    for (int attempt = 0; attempt < FT_TMP_TRIES && fd < 0; attempt++) {
        snprintf(o->tmp, cap, "%s.tmp-%ld-%u", o->target, (long)getpid(),
                 atomic_fetch_add(&serial, 1u));
        errno = 0;
        fd = open(o->tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        err = errno;
        if (fd < 0 && err != EEXIST)
            break;
    }
    if (fd < 0) {
        free(o->tmp);
        free(o->target);
        o->tmp = o->target = NULL;
        return ft_fail(FT_ERR_IO, func, arg,
                       "cannot create a temporary file next to '%s': %s", path,
                       ft_errno_text(err, "open failed"));
    }
    /* The new file keeps the permissions of the one it replaces (its
     * owner cannot be kept without privileges; a failure leaves the
     * umask's). */
    if (exists && S_ISREG(existing.st_mode))
        (void)fchmod(fd, existing.st_mode & 07777);
    errno = 0;
    o->f = fdopen(fd, "wb");
    if (o->f == NULL) {
        err = errno;
        close(fd);
        return ft_file_end(o, ft_fail(FT_ERR_IO, func, arg, "cannot write '%s': %s", path,
                                      ft_errno_text(err, "fdopen failed")));
    }
    return FT_OK;
}

ft_status ft_file_end(ft_out_file *o, ft_status status)
{
    if (o->f != NULL) {
        /* The data reaches the disk before the rename makes it visible
         * under path (a device written in place is only flushed); a full
         * disk may only show at the flush. */
        errno = 0;
        if (status == FT_OK &&
            (fflush(o->f) != 0 || (o->tmp != NULL && fsync(fileno(o->f)) != 0)))
            status = ft_fail(FT_ERR_IO, o->func, o->arg, "cannot write '%s': %s",
                             o->path, ft_errno_text(errno, "write error"));
        errno = 0;
        if (fclose(o->f) != 0 && status == FT_OK)
            status = ft_fail(FT_ERR_IO, o->func, o->arg, "cannot write '%s': %s",
                             o->path, ft_errno_text(errno, "fclose failed"));
        o->f = NULL;
    }
    if (status == FT_OK && o->tmp != NULL) {
        errno = 0;
        if (rename(o->tmp, o->target) != 0)
            status = ft_fail(FT_ERR_IO, o->func, o->arg,
                             "cannot move the new file into place as '%s': %s",
                             o->path, ft_errno_text(errno, "rename failed"));
    }
    /* The temporary file is ours (created with O_EXCL): on failure it
     * goes, and the file at path is untouched. */
    if (status != FT_OK && o->tmp != NULL)
        unlink(o->tmp);
    free(o->tmp);
    free(o->target);
    o->tmp = o->target = NULL;
    return status;
}

/* ---- dtypes ---- */

/* The NumPy type code ("f4"...) of a dtype, NULL for bf16, fp8_e4m3 and
 * invalid. */
static const char *npy_type_code(ft_dtype dtype)
{
    switch (dtype) {
    case FT_F16:
        return "f2";
    case FT_F32:
        return "f4";
    case FT_F64:
        return "f8";
    case FT_I32:
        return "i4";
    case FT_I64:
        return "i8";
    default:
        return NULL;
    }
}

/* The field name and element code of the descr that stands for fp8_e4m3
 * (see the top of the file). */
#define NPY_FP8_FIELD "fp8_e4m3"
#define NPY_FP8_CODE "u1"

/* The type code of a descr string without its byte-order character ('<',
 * '>', '|', '=' or none); *file_little: the byte order it says ('|', '='
 * and none mean native). */
static const char *npy_strip_order(const char *descr, int *file_little)
{
    *file_little = ft_host_is_little_endian();
    if (*descr == '<' || *descr == '>' || *descr == '|' || *descr == '=') {
        if (*descr == '<')
            *file_little = 1;
        else if (*descr == '>')
            *file_little = 0;
        descr++;
    }
    return descr;
}

/* Decodes a descr string ("<f4", ">i8", "|f2", "=f8", or "f4" with no
 * byte-order character) into a dtype and whether the file's bytes need
 * swapping on this host; field (NULL for a plain descr) is the field name
 * of a one-field structured descr [(field, descr)], which only fp8_e4m3's
 * is. Returns 0, or -1 for anything else. */
static int npy_decode_descr(const char *field, const char *descr, ft_dtype *dtype, int *swap)
{
    int file_little;
    const char *p = npy_strip_order(descr, &file_little);
    if (field != NULL) {
        if (strcmp(field, NPY_FP8_FIELD) != 0 || strcmp(p, NPY_FP8_CODE) != 0)
            return -1;
        *dtype = FT_FP8_E4M3;
        *swap = 0;
        return 0;
    }
    const int host_little = ft_host_is_little_endian();
    for (int d = 0; d < FT_NUM_DTYPES; d++) {
        const char *code = npy_type_code((ft_dtype)d);
        if (code != NULL && strcmp(p, code) == 0) {
            *dtype = (ft_dtype)d;
            *swap = file_little != host_little;
            return 0;
        }
    }
    return -1;
}

/* ---- saving ---- */

/* Writes the padded version 1.0 header for t into buf; returns its length
 * (magic to '\n'), or 0 if it does not fit (cannot happen for
 * FT_MAX_DIMS dims; checked anyway). */
static size_t npy_format_header(char *buf, size_t cap, const ft_tensor *t)
{
    /* NumPy's layout: a 1-d shape keeps its tuple comma, "(5,)"; 0-d is
     * "()"; the dict ends with ", }". */
    char shape[FT_MAX_DIMS * 24 + 4];
    size_t len = 0;
    shape[len++] = '(';
    for (int d = 0; d < t->ndim; d++) {
        int w = snprintf(shape + len, sizeof shape - len, "%s%" PRId64,
                         d > 0 ? ", " : "", t->shape[d]);
        if (w < 0 || (size_t)w >= sizeof shape - len)
            return 0;
        len += (size_t)w;
    }
    if (t->ndim == 1)
        shape[len++] = ',';
    shape[len++] = ')';
    shape[len] = '\0';

    char descr[NPY_DESCR_CAP];
    if (t->dtype == FT_FP8_E4M3)
        snprintf(descr, sizeof descr, "[('%s', '|%s')]", NPY_FP8_FIELD, NPY_FP8_CODE);
    else
        snprintf(descr, sizeof descr, "'<%s'", npy_type_code(t->dtype));
    char *dict = buf + NPY_V1_PREAMBLE;
    size_t room = cap - NPY_V1_PREAMBLE;
    int w = snprintf(dict, room,
                     "{'descr': %s, 'fortran_order': False, "
                     "'shape': %s, }",
                     descr, shape);
    if (w < 0 || (size_t)w >= room)
        return 0;
    size_t dict_len = (size_t)w;
    /* Spaces, then '\n', up to the next multiple of NPY_ALIGN. */
    size_t unpadded = NPY_V1_PREAMBLE + dict_len + 1;
    size_t total = (unpadded + NPY_ALIGN - 1) / NPY_ALIGN * NPY_ALIGN;
    size_t header_len = total - NPY_V1_PREAMBLE;
    if (total > cap || header_len > NPY_V1_MAX_HEADER)
        return 0;
    memset(dict + dict_len, ' ', header_len - dict_len - 1);
    dict[header_len - 1] = '\n';

    memcpy(buf, NPY_MAGIC, NPY_MAGIC_LEN);
    buf[NPY_MAGIC_LEN] = 1; /* version 1.0 */
    buf[NPY_MAGIC_LEN + 1] = 0;
    buf[NPY_MAGIC_LEN + 2] = (char)(header_len & 0xff);
    buf[NPY_MAGIC_LEN + 3] = (char)(header_len >> 8);
    return total;
}

/* Whether t's bytes can be written as they lie: contiguous, and the host
 * is little-endian like the file. Otherwise the elements go through a
 * staging buffer. */
static int npy_direct_write(const ft_tensor *t)
{
    return ft_host_is_little_endian() && ft_is_contiguous(t);
}

/* Writes t's elements in row-major order, little-endian; chunk is a
 * staging buffer of NPY_WRITE_CHUNK bytes, or NULL when
 * npy_direct_write(t). Returns 0, or the errno of the failure (EIO when
 * stdio set none). */
static int npy_write_data(FILE *f, const ft_tensor *t, unsigned char *chunk)
{
    const size_t esize = ft_dtype_size(t->dtype);
    const int64_t n = ft_numel(t);
    if (n == 0)
        return 0;
    errno = 0;
    if (chunk == NULL) {
        if (fwrite(t->data, esize, (size_t)n, f) != (size_t)n)
            return errno != 0 ? errno : EIO;
        return 0;
    }
    const int swap = !ft_host_is_little_endian();
    const size_t per_chunk = NPY_WRITE_CHUNK / esize;
    ft_iter it;
    ft_iter_init(&it, t->ndim, t->shape, 1,
                 (const int64_t *const[]){t->stride});
    size_t filled = 0;
    for (int64_t i = 0; i < n; i++, ft_iter_next(&it)) {
        memcpy(chunk + filled * esize, ft_elem_ptr(t, it.offset[0]), esize);
        if (++filled == per_chunk || i == n - 1) {
            if (swap)
                ft_swap_elements(chunk, filled, esize);
            if (fwrite(chunk, esize, filled, f) != filled)
                return errno != 0 ? errno : EIO;
            filled = 0;
        }
    }
    return 0;
}

ft_status ft_save_npy(const ft_tensor *t, const char *path)
{
    FT_TRY(ft_check_tensor(SAVE, 1, t));
    if (path == NULL)
        return ft_fail(FT_ERR_ARGUMENT, SAVE, 2, "path is NULL");
    if (path[0] == '\0')
        return ft_fail(FT_ERR_ARGUMENT, SAVE, 2, "path is empty");
    FT_TRY(ft_check_device(SAVE, 1, t, NULL));
    if (t->dtype == FT_BF16)
        return ft_fail(FT_ERR_ARGUMENT, SAVE, 1,
                       "bf16 has no .npy dtype; convert first (t:float())");
    if (npy_type_code(t->dtype) == NULL && t->dtype != FT_FP8_E4M3)
        return ft_fail(FT_ERR_ARGUMENT, SAVE, 1, "invalid dtype %d",
                       (int)t->dtype);
    /* The file holds every element, repeats of a stride-0 view included:
     * more than FT_MAX_ELEMENTS is more than any disk holds. */
    FT_TRY(ft_check_walk(SAVE, 1, ft_numel(t), "elements"));
    if (t->device.type != FT_CPU) {
        /* The file is written from a contiguous CPU copy. */
        ft_tensor *host = NULL;
        FT_TRY(ft_to(&host, t, t->dtype, (ft_device){FT_CPU, 0}));
        ft_status st = ft_save_npy(host, path);
        ft_tensor_free(host);
        return st;
    }

    char header[NPY_HEADER_CAP];
    size_t header_total = npy_format_header(header, sizeof header, t);
    if (header_total == 0)
        return ft_fail(FT_ERR_INTERNAL, SAVE, 1,
                       "the .npy header does not fit %d bytes",
                       NPY_HEADER_CAP);

    /* The staging buffer comes first: running out of memory must not
     * leave a file behind. */
    unsigned char *chunk = NULL;
    if (!npy_direct_write(t) && ft_numel(t) > 0) {
        chunk = malloc(NPY_WRITE_CHUNK);
        if (chunk == NULL)
            return ft_fail(FT_ERR_NOMEM, SAVE, 1,
                           "cannot allocate a %d-byte staging buffer",
                           NPY_WRITE_CHUNK);
    }

    /* Written under a temporary name and renamed over path: a reader sees
     * the old file or the whole new one, and a failed save leaves path as
     * it was (ft_file_begin). */
    ft_out_file o;
    ft_status st = ft_file_begin(&o, path, SAVE, 2);
    if (st != FT_OK) {
        free(chunk);
        return st;
    }
    int err = 0;
    errno = 0;
    if (fwrite(header, 1, header_total, o.f) != header_total)
        err = errno != 0 ? errno : EIO;
    else
        err = npy_write_data(o.f, t, chunk);
    free(chunk);
    if (err != 0)
        st = ft_fail(FT_ERR_IO, SAVE, 2, "cannot write '%s': %s", path,
                     strerror(err));
    return ft_file_end(&o, st);
}

/* ---- the header dict ---- */

typedef struct npy_header {
    char descr[NPY_DESCR_CAP]; /* the type string, or the field's type */
    char field[NPY_DESCR_CAP]; /* a one-field structured descr's name */
    int descr_is_string; /* a type string */
    int descr_is_field;  /* [(field, descr)]; neither: another value */
    int fortran_order;
    int ndim;
    int64_t shape[FT_MAX_DIMS];
    int have_descr, have_fortran, have_shape;
} npy_header;

/* A tiny reader of the Python literal NumPy writes. On failure it leaves
 * the status (FT_ERR_IO for malformed, FT_ERR_UNSUPPORTED for valid but
 * unsupported) and a message. */
typedef struct npy_parser {
    const char *s;
    size_t n, pos;
    ft_status status;
    char msg[NPY_ERR_CAP + 48]; /* what, plus " (at byte N of the dict)" */
} npy_parser;

static int parse_error(npy_parser *p, ft_status status, const char *what)
{
    p->status = status;
    snprintf(p->msg, sizeof p->msg, "%s (at byte %zu of the dict)", what,
             p->pos);
    return -1;
}

static int is_space(char c)
{
    return c == ' ' || c == '\t' || c == '\r' || c == '\n' || c == '\f' ||
           c == '\v';
}

static void skip_space(npy_parser *p)
{
    while (p->pos < p->n && is_space(p->s[p->pos]))
        p->pos++;
}

static int peek(const npy_parser *p)
{
    return p->pos < p->n ? (unsigned char)p->s[p->pos] : -1;
}

static int expect_char(npy_parser *p, char c, const char *what)
{
    skip_space(p);
    if (peek(p) != (unsigned char)c)
        return parse_error(p, FT_ERR_IO, what);
    p->pos++;
    return 0;
}

/* A quoted string ('...' or "..."); a backslash keeps the next character.
 * Longer strings than cap - 1 are an error; out NULL skips the string. */
static int parse_string(npy_parser *p, char *out, size_t cap)
{
    skip_space(p);
    int quote = peek(p);
    if (quote != '\'' && quote != '"')
        return parse_error(p, FT_ERR_IO, "expected a quoted string");
    p->pos++;
    size_t len = 0;
    for (;;) {
        int c = peek(p);
        if (c < 0)
            return parse_error(p, FT_ERR_IO, "unterminated string");
        p->pos++;
        if (c == quote)
            break;
        if (c == '\\') {
            c = peek(p);
            if (c < 0)
                return parse_error(p, FT_ERR_IO, "unterminated string");
            p->pos++;
        }
        if (out == NULL)
            continue;
        if (len + 1 >= cap)
            return parse_error(p, FT_ERR_IO, "string too long");
        out[len++] = (char)c;
    }
    if (out != NULL)
        out[len] = '\0';
    return 0;
}

static int parse_bool(npy_parser *p, int *out)
{
    skip_space(p);
    const char *rest = p->s + p->pos;
    size_t left = p->n - p->pos;
    if (left >= 4 && strncmp(rest, "True", 4) == 0) {
        *out = 1;
        p->pos += 4;
    } else if (left >= 5 && strncmp(rest, "False", 5) == 0) {
        *out = 0;
        p->pos += 5;
    } else {
        return parse_error(p, FT_ERR_IO, "expected True or False");
    }
    return 0;
}

/* A non-negative decimal integer that fits int64; Python 2's long suffix
 * ("3L", from old NumPy writers) is accepted. */
static int parse_dim(npy_parser *p, int64_t *out)
{
    skip_space(p);
    int negative = 0;
    if (peek(p) == '-' || peek(p) == '+') {
        negative = peek(p) == '-';
        p->pos++;
    }
    int c = peek(p);
    if (c < '0' || c > '9')
        return parse_error(p, FT_ERR_IO, "expected an integer in shape");
    int64_t v = 0;
    while ((c = peek(p)) >= '0' && c <= '9') {
        int digit = c - '0';
        if (v > (INT64_MAX - digit) / 10)
            return parse_error(p, FT_ERR_IO, "dimension overflows int64");
        v = v * 10 + digit;
        p->pos++;
    }
    if (peek(p) == 'L' || peek(p) == 'l')
        p->pos++;
    if (negative && v != 0)
        return parse_error(p, FT_ERR_IO, "negative dimension in shape");
    *out = v;
    return 0;
}

/* A tuple (or list) of dimensions: "()", "(5,)", "(2, 3)", "(2, 3,)". */
static int parse_shape(npy_parser *p, npy_header *h)
{
    skip_space(p);
    int open = peek(p);
    if (open != '(' && open != '[')
        return parse_error(p, FT_ERR_IO, "shape is not a tuple");
    const char close = open == '(' ? ')' : ']';
    p->pos++;
    h->ndim = 0;
    for (;;) {
        skip_space(p);
        if (peek(p) == (unsigned char)close) {
            p->pos++;
            return 0;
        }
        if (h->ndim == FT_MAX_DIMS) {
            char what[NPY_ERR_CAP];
            snprintf(what, sizeof what,
                     "shape has more than %d dimensions", FT_MAX_DIMS);
            return parse_error(p, FT_ERR_UNSUPPORTED, what);
        }
        if (parse_dim(p, &h->shape[h->ndim]) != 0)
            return -1;
        h->ndim++;
        skip_space(p);
        if (peek(p) == ',')
            p->pos++;
        else if (peek(p) != (unsigned char)close)
            return parse_error(p, FT_ERR_IO, "expected ',' or the end of "
                                             "shape");
    }
}

/* Skips a value flashtile does not interpret (a structured descr such as
 * [('a', '<f4')]) by matching brackets and quotes, so the error can name
 * the dtype problem rather than a syntax error. */
static int skip_value(npy_parser *p)
{
    int depth = 0;
    skip_space(p);
    for (;;) {
        int c = peek(p);
        if (c < 0)
            return parse_error(p, FT_ERR_IO, "unterminated value");
        if (c == '\'' || c == '"') {
            if (parse_string(p, NULL, 0) != 0)
                return -1;
            continue;
        }
        if (depth == 0 && (c == ',' || c == '}'))
            return 0;
        if (c == '(' || c == '[' || c == '{')
            depth++;
        else if (c == ')' || c == ']' || c == '}')
            depth--;
        p->pos++;
    }
}

/* A structured descr of one field, [('name', 'type')] (a trailing comma
 * after the tuple or in it allowed, as Python allows), into h->field and
 * h->descr. Returns 0, or -1 with p where it was (status and message
 * cleared) for any other value, which the caller then skips. */
static int parse_field_descr(npy_parser *p, npy_header *h)
{
    const size_t start = p->pos;
    if (expect_char(p, '[', "") == 0 && expect_char(p, '(', "") == 0 &&
        parse_string(p, h->field, sizeof h->field) == 0 && expect_char(p, ',', "") == 0 &&
        parse_string(p, h->descr, sizeof h->descr) == 0) {
        skip_space(p);
        if (peek(p) == ',')
            p->pos++;
        if (expect_char(p, ')', "") == 0) {
            skip_space(p);
            if (peek(p) == ',')
                p->pos++;
            if (expect_char(p, ']', "") == 0)
                return 0;
        }
    }
    p->pos = start;
    p->status = FT_OK;
    p->msg[0] = '\0';
    h->field[0] = h->descr[0] = '\0';
    return -1;
}

/* Parses the whole dict into h: the three keys in any order, whitespace
 * anywhere, an optional trailing comma; unknown keys are rejected as
 * NumPy rejects them. */
static int parse_dict(npy_parser *p, npy_header *h)
{
    memset(h, 0, sizeof *h);
    if (expect_char(p, '{', "the header does not start with '{'") != 0)
        return -1;
    for (;;) {
        skip_space(p);
        if (peek(p) == '}') {
            p->pos++;
            break;
        }
        char key[NPY_DESCR_CAP];
        if (parse_string(p, key, sizeof key) != 0)
            return -1;
        if (expect_char(p, ':', "expected ':' after a key") != 0)
            return -1;
        skip_space(p);
        if (strcmp(key, "descr") == 0) {
            if (peek(p) == '\'' || peek(p) == '"') {
                if (parse_string(p, h->descr, sizeof h->descr) != 0)
                    return -1;
                h->descr_is_string = 1;
                h->descr_is_field = 0;
            } else {
                h->descr_is_string = 0;
                h->descr_is_field = parse_field_descr(p, h) == 0;
                if (!h->descr_is_field && skip_value(p) != 0)
                    return -1;
            }
            h->have_descr = 1;
        } else if (strcmp(key, "fortran_order") == 0) {
            if (parse_bool(p, &h->fortran_order) != 0)
                return -1;
            h->have_fortran = 1;
        } else if (strcmp(key, "shape") == 0) {
            if (parse_shape(p, h) != 0)
                return -1;
            h->have_shape = 1;
        } else {
            char what[NPY_ERR_CAP];
            snprintf(what, sizeof what, "unexpected key '%s'", key);
            return parse_error(p, FT_ERR_IO, what);
        }
        skip_space(p);
        if (peek(p) == ',') {
            p->pos++;
        } else if (peek(p) != '}') {
            return parse_error(p, FT_ERR_IO, "expected ',' or '}'");
        }
    }
    /* Only padding (spaces, '\n', NULs from some writers) may follow. */
    while (p->pos < p->n) {
        char c = p->s[p->pos];
        if (c != '\0' && !is_space(c))
            return parse_error(p, FT_ERR_IO, "text after the dict");
        p->pos++;
    }
    if (!h->have_descr)
        return parse_error(p, FT_ERR_IO, "the dict has no 'descr'");
    if (!h->have_fortran)
        return parse_error(p, FT_ERR_IO, "the dict has no 'fortran_order'");
    if (!h->have_shape)
        return parse_error(p, FT_ERR_IO, "the dict has no 'shape'");
    return 0;
}

/* ---- loading ---- */

/* Reads and checks the preamble and dict of f into h. Returns FT_OK or
 * the status of an ft_fail naming path. */
static ft_status npy_read_header(FILE *f, const char *path, npy_header *h)
{
    unsigned char pre[NPY_MAGIC_LEN + NPY_VERSION_LEN + NPY_V2_LEN_FIELD];
    errno = 0;
    size_t got = fread(pre, 1, NPY_MAGIC_LEN + NPY_VERSION_LEN, f);
    if (got < NPY_MAGIC_LEN + NPY_VERSION_LEN && ferror(f))
        return ft_fail(FT_ERR_IO, LOAD, 1, "cannot read '%s': %s", path,
                       ft_errno_text(errno, "read error"));
    if (got < NPY_MAGIC_LEN || memcmp(pre, NPY_MAGIC, NPY_MAGIC_LEN) != 0)
        return ft_fail(FT_ERR_IO, LOAD, 1,
                       "'%s': not a .npy file (bad magic)", path);
    if (got < NPY_MAGIC_LEN + NPY_VERSION_LEN)
        return ft_fail(FT_ERR_IO, LOAD, 1,
                       "'%s': file is truncated in the header", path);

    const int major = pre[NPY_MAGIC_LEN], minor = pre[NPY_MAGIC_LEN + 1];
    size_t len_field;
    if (major == 1 && minor == 0)
        len_field = NPY_V1_LEN_FIELD;
    else if ((major == 2 || major == 3) && minor == 0)
        len_field = NPY_V2_LEN_FIELD;
    else
        return ft_fail(FT_ERR_UNSUPPORTED, LOAD, 1,
                       "'%s': .npy format version %d.%d is not supported "
                       "(1.0, 2.0 and 3.0 are)",
                       path, major, minor);

    unsigned char *lenp = pre + NPY_MAGIC_LEN + NPY_VERSION_LEN;
    errno = 0;
    got = fread(lenp, 1, len_field, f);
    if (got < len_field) {
        if (ferror(f))
            return ft_fail(FT_ERR_IO, LOAD, 1, "cannot read '%s': %s", path,
                           ft_errno_text(errno, "read error"));
        return ft_fail(FT_ERR_IO, LOAD, 1,
                       "'%s': file is truncated in the header", path);
    }
    uint32_t header_len = 0;
    for (size_t b = len_field; b-- > 0;) /* little-endian */
        header_len = header_len << 8 | lenp[b];
    if (header_len > NPY_MAX_HEADER_READ)
        return ft_fail(FT_ERR_IO, LOAD, 1,
                       "'%s': header length %" PRIu32
                       " is implausible (limit %u)",
                       path, header_len, NPY_MAX_HEADER_READ);

    char *text = malloc((size_t)header_len + 1);
    if (text == NULL)
        return ft_fail(FT_ERR_NOMEM, LOAD, 1,
                       "cannot allocate %" PRIu32 " bytes for the header",
                       header_len);
    errno = 0;
    got = fread(text, 1, header_len, f);
    if (got < header_len) {
        int err = errno;
        int failed = ferror(f);
        free(text);
        if (failed)
            return ft_fail(FT_ERR_IO, LOAD, 1, "cannot read '%s': %s", path,
                           ft_errno_text(err, "read error"));
        return ft_fail(FT_ERR_IO, LOAD, 1,
                       "'%s': file is truncated: expected a header of %" PRIu32
                       " bytes, found %zu",
                       path, header_len, got);
    }
    text[header_len] = '\0';

    npy_parser p = {.s = text, .n = header_len, .pos = 0, .status = FT_OK};
    int rc = parse_dict(&p, h);
    free(text);
    if (rc != 0) {
        if (p.status == FT_ERR_UNSUPPORTED)
            return ft_fail(FT_ERR_UNSUPPORTED, LOAD, 1, "'%s': %s", path,
                           p.msg);
        return ft_fail(FT_ERR_IO, LOAD, 1, "'%s': malformed .npy header: %s",
                       path, p.msg);
    }
    if (!h->descr_is_string && !h->descr_is_field)
        return ft_fail(FT_ERR_UNSUPPORTED, LOAD, 1,
                       "'%s': structured dtypes are not supported (descr is "
                       "not a type string, nor [('fp8_e4m3', '|u1')])",
                       path);
    return FT_OK;
}

/* Bytes left in f from the current position, or -1 if f cannot seek
 * (a pipe): then the short read itself reports truncation. */
static int64_t npy_bytes_left(FILE *f)
{
    long here = ftell(f);
    if (here < 0 || fseek(f, 0, SEEK_END) != 0)
        return -1;
    long end = ftell(f);
    if (fseek(f, here, SEEK_SET) != 0 || end < here)
        return -1;
    return (int64_t)(end - here);
}

/* Copies a column-major buffer of shape[ndim] into the contiguous
 * row-major tensor t of that shape: element (i0, ..., in-1) of the file
 * lies at sum_d i_d * prod_{e<d} shape[e]. */
static void npy_from_fortran(ft_tensor *t, const unsigned char *src,
                             int64_t n)
{
    const size_t esize = ft_dtype_size(t->dtype);
    int64_t fstride[FT_MAX_DIMS];
    int64_t s = 1;
    for (int d = 0; d < t->ndim; d++) {
        fstride[d] = s;
        ft_mul_size(s, t->shape[d], &s); /* <= n, which fits */
    }
    ft_iter it;
    ft_iter_init(&it, t->ndim, t->shape, 2,
                 (const int64_t *const[]){t->stride, fstride});
    for (int64_t i = 0; i < n; i++, ft_iter_next(&it))
        memcpy(ft_elem_ptr(t, it.offset[0]),
               src + (size_t)it.offset[1] * esize, esize);
}

/* Reads the data of a parsed header from f into a new tensor *out. */
static ft_status npy_read_data(FILE *f, const char *path,
                               const npy_header *h, ft_tensor **out)
{
    ft_dtype dtype;
    int swap;
    if (h->descr_is_field &&
        npy_decode_descr(h->field, h->descr, &dtype, &swap) != 0)
        return ft_fail(FT_ERR_UNSUPPORTED, LOAD, 1,
                       "'%s': structured dtypes are not supported (descr is "
                       "[('%s', '%s')], not [('fp8_e4m3', '|u1')])",
                       path, h->field, h->descr);
    if (!h->descr_is_field && npy_decode_descr(NULL, h->descr, &dtype, &swap) != 0)
        return ft_fail(FT_ERR_UNSUPPORTED, LOAD, 1,
                       "'%s': unsupported dtype '%s' (flashtile reads f2, "
                       "f4, f8, i4 and i8, and [('fp8_e4m3', '|u1')])",
                       path, h->descr);
    const size_t esize = ft_dtype_size(dtype);

    /* The element count and byte size must fit int64 (and so size_t on
     * 64-bit hosts). */
    int64_t n;
    size_t nbytes;
    if (ft_checked_numel(h->ndim, h->shape, &n) != 0 ||
        ft_checked_bytes(n, esize, &nbytes) != 0) {
        char buf[FT_MAX_DIMS * 24 + 4];
        return ft_fail(FT_ERR_IO, LOAD, 1, "'%s': shape %s is too large", path,
                       ft_format_shape(buf, sizeof buf, h->ndim, h->shape));
    }

    /* Check the size before allocating: a corrupt shape must not cost a
     * huge allocation. */
    int64_t left = npy_bytes_left(f);
    if (left >= 0 && (uint64_t)left < (uint64_t)nbytes)
        return ft_fail(FT_ERR_IO, LOAD, 1,
                       "'%s': file is truncated: expected %zu bytes of "
                       "data, found %" PRId64,
                       path, nbytes, left);

    ft_tensor *t = NULL;
    FT_TRY(ft_empty_named(&t, h->ndim, h->shape, dtype, (ft_device){FT_CPU, 0},
                          LOAD));
    /* Column-major data of more than one dim is read aside, then moved. */
    const int reorder = h->fortran_order && h->ndim > 1 && n > 1;
    unsigned char *dst = t->data;
    if (reorder) {
        dst = malloc(nbytes);
        if (dst == NULL) {
            ft_tensor_free(t);
            return ft_fail(FT_ERR_NOMEM, LOAD, 1,
                           "cannot allocate %zu bytes to reorder a "
                           "fortran_order array",
                           nbytes);
        }
    }
    errno = 0;
    size_t got = nbytes == 0 ? 0 : fread(dst, 1, nbytes, f);
    if (got < nbytes) {
        int err = errno;
        int failed = ferror(f);
        if (reorder)
            free(dst);
        ft_tensor_free(t);
        if (failed)
            return ft_fail(FT_ERR_IO, LOAD, 1, "cannot read '%s': %s", path,
                           ft_errno_text(err, "read error"));
        return ft_fail(FT_ERR_IO, LOAD, 1,
                       "'%s': file is truncated: expected %zu bytes of "
                       "data, found %zu",
                       path, nbytes, got);
    }
    if (swap)
        ft_swap_elements(dst, (size_t)n, esize);
    if (reorder) {
        npy_from_fortran(t, dst, n);
        free(dst);
    }
    *out = t;
    return FT_OK;
}

ft_status ft_load_npy(ft_tensor **out, const char *path)
{
    if (out == NULL)
        return ft_fail(FT_ERR_ARGUMENT, LOAD, 0, "out is NULL");
    *out = NULL;
    if (path == NULL)
        return ft_fail(FT_ERR_ARGUMENT, LOAD, 1, "path is NULL");

    errno = 0;
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return ft_fail(FT_ERR_IO, LOAD, 1, "cannot open '%s': %s", path,
                       ft_errno_text(errno, "fopen failed"));
    npy_header h;
    ft_status st = npy_read_header(f, path, &h);
    if (st == FT_OK)
        st = npy_read_data(f, path, &h, out);
    /* A read-only stream has nothing to flush; its fclose cannot lose
     * data, so its result does not change the outcome. */
    fclose(f);
    return st;
}
