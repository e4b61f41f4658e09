/*
 * test_safetensors.c - checks of lib/safetensors.c: round trips of every
 * dtype (0-d, empty and strided tensors too) with metadata, the exact bytes
 * flashtile writes, files written byte by byte as another writer would,
 * every kind of malformed file, truncations and corruptions of a valid file
 * (which must fail cleanly or load, never crash), and the handle's
 * argument checks. Prints a line per failed check to stderr; exits nonzero
 * if any failed. Temporary files go under $TMPDIR (else /tmp).
 */
#define _POSIX_C_SOURCE 200809L /* mkstemp, close, unlink, opendir */

#include "flashtile.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define PATH_CAP 4096
#define FILE_CAP (1 << 16) /* the largest file the test reads back */

#include "check.h"
#include "tensor_files.h"

/* ---- utilities ---- */

static int64_t at_int(const ft_tensor *t, int64_t i)
{
    int64_t idx[FT_MAX_DIMS], v = 0;
    unravel(i, t->ndim, t->shape, idx);
    if (ft_get_int(t, idx, &v) != FT_OK) {
        fprintf(stderr, "ft_get_int: %s\n", ft_last_error());
        failures++;
    }
    return v;
}

/* write_bytes for an existing file, overwriting it in place and then
 * cutting it to n bytes: many filesystems flush a file truncated to 0
 * before rewriting it, which makes thousands of rewrites slow. */
static void overwrite_bytes(const char *path, const void *data, size_t n)
{
    FILE *f = fopen(path, "r+b");
    if (f == NULL || (n > 0 && fwrite(data, 1, n, f) != n) ||
        fflush(f) != 0 || ftruncate(fileno(f), (off_t)n) != 0) {
        fprintf(stderr, "overwrite %s: %s\n", path, strerror(errno));
        failures++;
    }
    if (f != NULL)
        fclose(f);
}

/* Writes a .safetensors file by hand: the 8-byte little-endian size of
 * header, header as given, then n bytes of data. */
static void write_st_sized(const char *path, uint64_t size_field,
                           const char *header, const void *data, size_t n)
{
    static unsigned char buf[FILE_CAP];
    size_t len = strlen(header);
    if (8 + len + n > sizeof buf) {
        CHECK(0, "test file too large");
        return;
    }
    for (int b = 0; b < 8; b++)
        buf[b] = (unsigned char)(size_field >> (8 * b));
    memcpy(buf + 8, header, len);
    if (n > 0)
        memcpy(buf + 8 + len, data, n);
    write_bytes(path, buf, 8 + len + n);
}

static void write_st(const char *path, const char *header, const void *data,
                     size_t n)
{
    write_st_sized(path, strlen(header), header, data, n);
}

static void put_u16(unsigned char *p, uint16_t v)
{
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
}

static void put_u32(unsigned char *p, uint32_t v)
{
    for (int b = 0; b < 4; b++)
        p[b] = (unsigned char)(v >> (8 * b));
}

static void put_u64(unsigned char *p, uint64_t v)
{
    for (int b = 0; b < 8; b++)
        p[b] = (unsigned char)(v >> (8 * b));
}

static uint32_t f32_bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

/* Whether a temporary file of a save to path was left in its directory
 * (the writer names them path + ".tmp-..."). */
static int temp_left_behind(const char *path)
{
    char dir[PATH_CAP], prefix[PATH_CAP];
    const char *slash = strrchr(path, '/');
    if (slash != NULL)
        snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path);
    else
        snprintf(dir, sizeof dir, ".");
    snprintf(prefix, sizeof prefix, "%s.tmp-", slash ? slash + 1 : path);
    DIR *d = opendir(dir);
    if (d == NULL)
        return 0;
    int found = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;)
        found |= strncmp(e->d_name, prefix, strlen(prefix)) == 0;
    closedir(d);
    return found;
}

/* Loads path, which must fail with status and a message containing text;
 * *out must stay NULL. */
static void expect_load_fail(const char *path, ft_status status,
                             const char *text, const char *what)
{
    ft_safetensors *st = (ft_safetensors *)&failures; /* a non-NULL junk */
    ft_status s = ft_safetensors_load(path, &st);
    CHECK(s == status, "%s: status %d, want %d (%s)", what, (int)s,
          (int)status, ft_last_error());
    CHECK(strstr(ft_last_error(), text) != NULL,
          "%s: message \"%s\" lacks \"%s\"", what, ft_last_error(), text);
    CHECK(ft_last_error_arg() == 1, "%s: arg %d", what, ft_last_error_arg());
    CHECK(strstr(ft_last_error(), "ft_safetensors_load: ") ==
              ft_last_error(),
          "%s: message does not name the function: %s", what,
          ft_last_error());
    CHECK(st == NULL, "%s: out not NULL after a failure", what);
    if (s == FT_OK)
        ft_safetensors_free(st);
}

/* Same tensor: dtype, shape and every element (row-major, so strided
 * sources compare by their logical contents; floats bitwise through
 * their f64 values, NaN equal to NaN). */
static void check_same(const ft_tensor *got, const ft_tensor *want,
                       const char *what)
{
    CHECK(got->dtype == want->dtype, "%s: dtype %s", what,
          ft_dtype_name(got->dtype));
    CHECK(got->device.type == FT_CPU, "%s: not on the cpu", what);
    CHECK(ft_is_contiguous(got), "%s: not contiguous", what);
    int same = got->ndim == want->ndim;
    for (int d = 0; same && d < got->ndim; d++)
        same = got->shape[d] == want->shape[d];
    CHECK(same, "%s: shape differs (ndim %d)", what, got->ndim);
    if (!same || got->dtype != want->dtype)
        return;
    const int64_t n = ft_numel(want);
    for (int64_t i = 0; i < n; i++) {
        if (ft_dtype_is_float(want->dtype)) {
            double x = at(got, i), y = at(want, i);
            CHECK(x == y || (isnan(x) && isnan(y)),
                  "%s: element %lld: %g, want %g", what, (long long)i, x, y);
        } else {
            int64_t x = at_int(got, i), y = at_int(want, i);
            CHECK(x == y, "%s: element %lld: %lld, want %lld", what,
                  (long long)i, (long long)x, (long long)y);
        }
    }
}

/* ---- round trips ---- */

enum { NT = 11 };

static void test_round_trip(const char *path)
{
    ft_tensor *t[NT] = {0};
    ft_tensor *base = NULL, *row = NULL;
    const char *names[NT] = {
        "f64",        "f32",        "f16",   "bf16",  "i32",
        "i64",        "scalar",     "empty", "layer.0/transposed",
        "expanded",   "\xc3\xa9t\xc3\xa9 \"q\"\\", /* "été "q"\" */
    };

    t[0] = empty(FT_F64, 2, (const int64_t[]){2, 3});
    t[1] = empty(FT_F32, 1, (const int64_t[]){5});
    t[2] = empty(FT_F16, 2, (const int64_t[]){2, 2});
    t[3] = empty(FT_BF16, 1, (const int64_t[]){4});
    t[4] = empty(FT_I32, 2, (const int64_t[]){2, 3});
    t[5] = empty(FT_I64, 1, (const int64_t[]){3});
    t[6] = empty(FT_F64, 0, NULL);
    t[7] = empty(FT_F32, 2, (const int64_t[]){0, 3});
    base = empty(FT_F32, 3, (const int64_t[]){2, 3, 4});
    row = empty(FT_I32, 1, (const int64_t[]){3});
    t[10] = empty(FT_BF16, 0, NULL);
    for (int i = 0; i < NT; i++)
        if (i != 8 && i != 9 && t[i] == NULL)
            goto done;
    if (base == NULL || row == NULL)
        goto done;

    for (int i = 0; i < 6; i++) {
        set_at(t[0], i, (i - 2) * 1.5 + 1e-9 * i); /* needs all of f64 */
        set_at(t[4], i, (i - 3) * 100000);
    }
    for (int i = 0; i < 5; i++)
        set_at(t[1], i, i == 4 ? INFINITY : (i - 2) * 0.375);
    for (int i = 0; i < 4; i++) {
        set_at(t[2], i, i == 3 ? NAN : (i - 1) * 0.5);
        set_at(t[3], i, (i - 2) * 256.0);
    }
    ((int64_t *)t[5]->data)[0] = INT64_MAX;
    ((int64_t *)t[5]->data)[1] = INT64_MIN;
    ((int64_t *)t[5]->data)[2] = -1;
    *(double *)t[6]->data = -0.0;
    set_at(t[10], 0, 3.0);
    for (int i = 0; i < 24; i++)
        ((float *)base->data)[i] = (float)i;
    for (int i = 0; i < 3; i++)
        ((int32_t *)row->data)[i] = 7 * i - 5;
    /* Non-contiguous sources: a transposed view, and a broadcast one
     * (stride 0). */
    CHECK_OK(ft_transpose(&t[8], base, 0, 2));
    CHECK_OK(ft_expand(&t[9], row, 2, (const int64_t[]){4, 3}));
    if (t[8] == NULL || t[9] == NULL)
        goto done;
    CHECK(!ft_is_contiguous(t[8]) && !ft_is_contiguous(t[9]),
          "views are contiguous?");

    const char *keys[] = {"format", "note", "empty", ""};
    const char *values[] = {"pt", "tab\t nl\n quote\" bs\\ ctl\x01 \xf0\x9f\x98\x80",
                            "", "empty key"};
    CHECK_OK(ft_safetensors_save(path, NT, names, t, 4, keys, values));
    CHECK(!temp_left_behind(path), "a temporary file was left behind");

    ft_safetensors *st = NULL;
    CHECK_OK(ft_safetensors_load(path, &st));
    if (st == NULL)
        goto done;
    CHECK(ft_safetensors_count(st) == NT, "count %d",
          ft_safetensors_count(st));
    for (int i = 1; i < ft_safetensors_count(st); i++)
        CHECK(strcmp(ft_safetensors_name(st, i - 1),
                     ft_safetensors_name(st, i)) < 0,
              "names not sorted at %d", i);
    for (int k = 0; k < NT; k++) {
        int i = ft_safetensors_find(st, names[k]);
        CHECK(i >= 0, "tensor '%s' not found", names[k]);
        if (i < 0)
            continue;
        CHECK(strcmp(ft_safetensors_name(st, i), names[k]) == 0, "name %d",
              i);
        ft_tensor *back = NULL;
        CHECK_OK(ft_safetensors_tensor(st, i, &back));
        if (back != NULL)
            check_same(back, t[k], names[k]);
        ft_tensor_free(back);
    }
    /* -0.0 keeps its sign. */
    int s = ft_safetensors_find(st, "scalar");
    ft_tensor *sc = NULL;
    if (s >= 0 && ft_safetensors_tensor(st, s, &sc) == FT_OK) {
        CHECK(sc->ndim == 0 && signbit(*(const double *)sc->data),
              "0-d -0.0");
        ft_tensor_free(sc);
    }
    /* Metadata, in key order. */
    static const char *const sorted_keys[] = {"", "empty", "format", "note"};
    static const int from[] = {3, 2, 0, 1};
    CHECK(ft_safetensors_meta_count(st) == 4, "meta count %d",
          ft_safetensors_meta_count(st));
    for (int i = 0; i < 4 && i < ft_safetensors_meta_count(st); i++) {
        CHECK(strcmp(ft_safetensors_meta_key(st, i), sorted_keys[i]) == 0,
              "meta key %d: '%s'", i, ft_safetensors_meta_key(st, i));
        CHECK(strcmp(ft_safetensors_meta_value(st, i), values[from[i]]) == 0,
              "meta value %d: '%s'", i, ft_safetensors_meta_value(st, i));
    }
    /* Reading a tensor twice gives a fresh copy each time. */
    ft_tensor *a = NULL, *b = NULL;
    CHECK_OK(ft_safetensors_tensor(st, 0, &a));
    CHECK_OK(ft_safetensors_tensor(st, 0, &b));
    CHECK(a != NULL && b != NULL && !ft_same_storage(a, b),
          "two reads share storage");
    ft_tensor_free(a);
    ft_tensor_free(b);
    ft_safetensors_free(st);

    /* The layout: the header's length is a multiple of 8 and ends in
     * spaces; the data is contiguous in name order, so the file is
     * 8 + N + the tensors' bytes, and the first tensor by name (bf16)
     * starts the data. */
    static unsigned char file[FILE_CAP];
    size_t n = read_bytes(path, file, sizeof file);
    uint64_t hlen = 0;
    for (int k = 7; k >= 0; k--)
        hlen = hlen << 8 | file[k];
    CHECK(hlen % 8 == 0, "header length %llu", (unsigned long long)hlen);
    size_t total = 0;
    for (int k = 0; k < NT; k++)
        total += (size_t)ft_numel(t[k]) * ft_dtype_size(t[k]->dtype);
    CHECK(n == 8 + hlen + total, "file size %zu, want %llu", n,
          (unsigned long long)(8 + hlen + total));
    CHECK(n > 16 && memcmp(file + 8, "{\"__metadata__\":{\"\":\"empty key\",",
                           32) == 0,
          "header starts \"%.40s\"", (const char *)file + 8);
    CHECK(n >= 8 + hlen + 8 && memcmp(file + 8 + hlen, t[3]->data, 8) == 0,
          "bf16 data does not start the buffer");
    size_t tail = 8 + (size_t)hlen;
    while (tail > 8 && file[tail - 1] == ' ')
        tail--;
    CHECK(tail > 8 && file[tail - 1] == '}', "header does not end in '}'");
    CHECK(8 + hlen - tail < 8, "%zu spaces of padding",
          (size_t)(8 + hlen - tail));

done:
    for (int i = 0; i < NT; i++)
        ft_tensor_free(t[i]);
    ft_tensor_free(base);
    ft_tensor_free(row);
}

/* The exact bytes written for small cases: what any reader of the format
 * expects (compact JSON, fields in the order dtype, shape, data_offsets,
 * "__metadata__" first, space padding to a multiple of 8). */
static void test_exact_bytes(const char *path)
{
    static unsigned char file[1024];
    ft_tensor *t = empty(FT_F32, 3, (const int64_t[]){1, 2, 3});
    if (t == NULL)
        return;
    for (int i = 0; i < 6; i++)
        ((float *)t->data)[i] = (float)i;
    const char *name = "attn.0";
    CHECK_OK(ft_safetensors_save(path, 1, &name, &t, 0, NULL, NULL));
    const char *json =
        "{\"attn.0\":{\"dtype\":\"F32\",\"shape\":[1,2,3],\"data_offsets\":"
        "[0,24]}}";
    unsigned char want[8 + 64 + 24];
    put_u64(want, 64);
    memcpy(want + 8, json, 64);
    for (int i = 0; i < 6; i++)
        put_u32(want + 72 + 4 * i, f32_bits((float)i));
    size_t n = read_bytes(path, file, sizeof file);
    CHECK(strlen(json) == 64, "test's json is %zu bytes", strlen(json));
    CHECK(n == sizeof want && memcmp(file, want, sizeof want) == 0,
          "one f32 tensor: %zu bytes, header \"%.*s\"", n,
          n > 8 ? (int)(n - 8) : 0, (const char *)file + 8);

    /* A shorter name needs padding. */
    name = "attn0";
    CHECK_OK(ft_safetensors_save(path, 1, &name, &t, 0, NULL, NULL));
    n = read_bytes(path, file, sizeof file);
    CHECK(n == 8 + 64 + 24 && file[0] == 64 &&
              memcmp(file + 8, "{\"attn0\":{", 10) == 0 &&
              memcmp(file + 8 + 63 - 1, "} ", 2) == 0,
          "padded header: \"%.*s\"", n > 8 ? (int)(n - 8) : 0,
          (const char *)file + 8);
    ft_tensor_free(t);

    /* No tensors. */
    CHECK_OK(ft_safetensors_save(path, 0, NULL, NULL, 0, NULL, NULL));
    n = read_bytes(path, file, sizeof file);
    CHECK(n == 16 && memcmp(file, "\x08\0\0\0\0\0\0\0{}      ", 16) == 0,
          "empty file: %zu bytes", n);
    const char *key = "framework", *value = "pt";
    CHECK_OK(ft_safetensors_save(path, 0, NULL, NULL, 1, &key, &value));
    n = read_bytes(path, file, sizeof file);
    CHECK(n == 48 && file[0] == 40 &&
              memcmp(file + 8, "{\"__metadata__\":{\"framework\":\"pt\"}}"
                               "     ",
                     40) == 0,
          "metadata only: %zu bytes", n);
    ft_safetensors *st = NULL;
    CHECK_OK(ft_safetensors_load(path, &st));
    CHECK(ft_safetensors_count(st) == 0 && ft_safetensors_meta_count(st) == 1,
          "metadata-only file");
    ft_safetensors_free(st);
}

/* ---- files written by hand ---- */

static void test_hand_written(const char *path)
{
    /* Another writer's file: keys in another order, whitespace between
     * tokens, no padding (odd length), "__metadata__" in the middle with
     * escapes, tensors stored in another order than their names, gaps in
     * the data and trailing bytes after it; F16 data. */
    const char *header =
        "{ \"b\" : {\"shape\" : [ 2 ], \"data_offsets\":[8,16],\n"
        "  \"dtype\":\"F32\"},\n"
        "\t\"__metadata__\" : {\"who\":\"x\\u00e9\\ud83d\\ude00\\/\\n\", "
        "\"k\":\"v\"},\r\n"
        " \"a\":{\"data_offsets\":[0,4],\"dtype\":\"F16\",\"shape\":[2]},"
        " \"\\u0063\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\""
        ":[16,24]},\"z\":{\"dtype\":\"BF16\",\"shape\":[0,5],"
        "\"data_offsets\":[24,24]} }";
    CHECK(strlen(header) % 8 != 0, "test header happens to be aligned");
    unsigned char data[28];
    memset(data, 0xee, sizeof data); /* bytes 4..7 and 24.. are unused */
    put_u16(data + 0, ft_f64_to_f16(1.0));
    put_u16(data + 2, ft_f64_to_f16(-2.5));
    put_u32(data + 8, f32_bits(0.5f));
    put_u32(data + 12, f32_bits(3.0f));
    put_u64(data + 16, (uint64_t)-7);
    write_st(path, header, data, sizeof data);

    ft_safetensors *st = NULL;
    CHECK_OK(ft_safetensors_load(path, &st));
    if (st == NULL)
        return;
    CHECK(ft_safetensors_count(st) == 4, "count %d", ft_safetensors_count(st));
    static const char *const want_names[] = {"a", "b", "c", "z"};
    for (int i = 0; i < 4 && i < ft_safetensors_count(st); i++)
        CHECK(strcmp(ft_safetensors_name(st, i), want_names[i]) == 0,
              "name %d: '%s'", i, ft_safetensors_name(st, i));
    ft_tensor *t = NULL;
    if (ft_safetensors_tensor(st, 0, &t) == FT_OK) {
        CHECK(t->dtype == FT_F16 && t->ndim == 1 && t->shape[0] == 2,
              "a: f16 [2]");
        CHECK(at(t, 0) == 1.0 && at(t, 1) == -2.5, "a = %g %g", at(t, 0),
              at(t, 1));
        ft_tensor_free(t);
    } else {
        CHECK(0, "tensor a: %s", ft_last_error());
    }
    if (ft_safetensors_tensor(st, 1, &t) == FT_OK) {
        CHECK(t->dtype == FT_F32 && at(t, 0) == 0.5 && at(t, 1) == 3.0,
              "b = %g %g", at(t, 0), at(t, 1));
        ft_tensor_free(t);
    } else {
        CHECK(0, "tensor b: %s", ft_last_error());
    }
    if (ft_safetensors_tensor(st, 2, &t) == FT_OK) {
        CHECK(t->dtype == FT_I64 && t->ndim == 0 &&
                  *(const int64_t *)t->data == -7,
              "c: 0-d i64 -7");
        ft_tensor_free(t);
    } else {
        CHECK(0, "tensor c: %s", ft_last_error());
    }
    if (ft_safetensors_tensor(st, 3, &t) == FT_OK) {
        CHECK(t->dtype == FT_BF16 && t->ndim == 2 && t->shape[0] == 0 &&
                  t->shape[1] == 5,
              "z: empty bf16 [0, 5]");
        ft_tensor_free(t);
    } else {
        CHECK(0, "tensor z: %s", ft_last_error());
    }
    CHECK(ft_safetensors_meta_count(st) == 2, "meta count %d",
          ft_safetensors_meta_count(st));
    if (ft_safetensors_meta_count(st) == 2) {
        CHECK(strcmp(ft_safetensors_meta_key(st, 0), "k") == 0 &&
                  strcmp(ft_safetensors_meta_value(st, 0), "v") == 0,
              "meta 0");
        CHECK(strcmp(ft_safetensors_meta_key(st, 1), "who") == 0 &&
                  strcmp(ft_safetensors_meta_value(st, 1),
                         "x\xc3\xa9\xf0\x9f\x98\x80/\n") == 0,
              "meta 1: '%s'", ft_safetensors_meta_value(st, 1));
    }
    ft_safetensors_free(st);

    /* An empty object, with whitespace around it; and a header holding
     * raw UTF-8 names. */
    write_st(path, " \n{ }\t\r\n  ", NULL, 0);
    st = NULL;
    CHECK_OK(ft_safetensors_load(path, &st));
    CHECK(st != NULL && ft_safetensors_count(st) == 0 &&
              ft_safetensors_meta_count(st) == 0,
          "empty header");
    ft_safetensors_free(st);

    const unsigned char one[8] = {0, 0, 0x80, 0x3f, 0, 0, 0, 0x40};
    write_st(path,
             "{\"\xe5\x90\x8d\":{\"dtype\":\"F32\",\"shape\":[1],"
             "\"data_offsets\":[0,4]},\"\xf0\x9f\x98\x80\":{\"dtype\":"
             "\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
             one, sizeof one);
    st = NULL;
    CHECK_OK(ft_safetensors_load(path, &st));
    if (st != NULL) {
        int i = ft_safetensors_find(st, "\xf0\x9f\x98\x80");
        CHECK(i == 1, "utf-8 name index %d", i);
        if (i >= 0 && ft_safetensors_tensor(st, i, &t) == FT_OK) {
            CHECK(at(t, 0) == 2.0, "utf-8 named tensor %g", at(t, 0));
            ft_tensor_free(t);
        }
        ft_safetensors_free(st);
    }
}

/* ---- malformed files ---- */

static void test_malformed(const char *path)
{
    static const unsigned char zeros[64] = {0};
    const char *good =
        "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]}}";

    /* The size field and the header's extent. */
    write_bytes(path, "", 0);
    expect_load_fail(path, FT_ERR_IO, "too short for the 8-byte header size",
                     "empty file");
    write_bytes(path, "\x10\0\0", 3);
    expect_load_fail(path, FT_ERR_IO, "file is truncated: 3 bytes",
                     "3-byte file");
    write_st_sized(path, strlen(good), "{\"a\":{\"dtype\":\"F3", NULL, 0);
    expect_load_fail(path, FT_ERR_IO,
                     "file is truncated: the header size is 57 bytes, but "
                     "only 17 bytes follow it",
                     "truncated header");
    write_st_sized(path, 50000000, good, zeros, 16);
    expect_load_fail(path, FT_ERR_IO,
                     "the header size is 50000000 bytes, but only 73 bytes",
                     "header size larger than the file");
    write_st_sized(path, 100000001, good, zeros, 16);
    expect_load_fail(path, FT_ERR_IO,
                     "header size 100000001 exceeds the limit of 100000000 "
                     "bytes",
                     "header size over the limit");
    write_st_sized(path, UINT64_MAX, good, zeros, 16);
    expect_load_fail(path, FT_ERR_IO, "exceeds the limit", "size 2^64 - 1");

    /* The data. */
    write_st(path, good, zeros, 8);
    expect_load_fail(path, FT_ERR_IO,
                     "tensor 'a': data_offsets [0, 16] go past the end of "
                     "the data (8 bytes): the file is truncated",
                     "truncated data");
    write_st(path,
             "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],"
             "\"data_offsets\":[4096,4104]}}",
             zeros, 16);
    expect_load_fail(path, FT_ERR_IO, "go past the end of the data",
                     "lying offsets");
    write_st(path,
             "{\"a\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":"
             "[18446744073709551608,18446744073709551615]}}",
             zeros, 16);
    expect_load_fail(path, FT_ERR_IO,
                     "data offset 18446744073709551608 is too large",
                     "offsets past 2^63");
    write_st(path,
             "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
             "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
             zeros, 16);
    expect_load_fail(path, FT_ERR_IO,
                     "tensors 'a' and 'b' overlap in the data ([0, 8] and "
                     "[4, 12])",
                     "overlapping ranges");
    write_st(path,
             "{\"b\":{\"dtype\":\"I32\",\"shape\":[4],\"data_offsets\":[0,16]},"
             "\"e\":{\"dtype\":\"I32\",\"shape\":[0],\"data_offsets\":[4,4]},"
             "\"a\":{\"dtype\":\"I32\",\"shape\":[1],\"data_offsets\":[8,12]}}",
             zeros, 16);
    expect_load_fail(path, FT_ERR_IO, "tensors 'b' and 'a' overlap",
                     "a range inside another");
    write_st(path,
             "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
             "\"b\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[0,8]}}",
             zeros, 16);
    expect_load_fail(path, FT_ERR_IO, "overlap", "the same range twice");
    write_st(path,
             "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}",
             zeros, 16);
    expect_load_fail(path, FT_ERR_IO,
                     "tensor 'a': data_offsets [8, 0] end before they begin",
                     "end < begin");
    write_st(path,
             "{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}",
             zeros, 16);
    expect_load_fail(path, FT_ERR_IO,
                     "tensor 'a': data_offsets [0, 8] span 8 bytes, but F32 "
                     "of shape {3} takes 12",
                     "size not matching the shape");
    write_st(path,
             "{\"a\":{\"dtype\":\"F64\",\"shape\":[4294967296,4294967296,"
             "4294967296],\"data_offsets\":[0,8]}}",
             zeros, 16);
    expect_load_fail(path, FT_ERR_IO,
                     "the size of shape {4294967296, 4294967296, "
                     "4294967296} overflows 64 bits",
                     "shape product overflow");
    write_st(path,
             "{\"a\":{\"dtype\":\"BF16\",\"shape\":[4611686018427387904],"
             "\"data_offsets\":[0,0]}}",
             zeros, 16);
    expect_load_fail(path, FT_ERR_IO, "overflows 64 bits",
                     "byte size overflow");

    /* dtypes. */
    write_st(path,
             "{\"a\":{\"dtype\":\"F8_E5M2\",\"shape\":[2],"
             "\"data_offsets\":[0,2]}}",
             zeros, 16);
    expect_load_fail(path, FT_ERR_UNSUPPORTED,
                     "tensor 'a': dtype 'F8_E5M2' is not supported",
                     "F8_E5M2");
    write_st(path,
             "{\"a\":{\"dtype\":\"XYZ\",\"shape\":[2],\"data_offsets\":[0,2]}}",
             zeros, 16);
    expect_load_fail(path, FT_ERR_IO, "tensor 'a': unknown dtype 'XYZ'",
                     "XYZ");
    write_st(path,
             "{\"a\":{\"dtype\":\"f32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
             zeros, 16);
    expect_load_fail(path, FT_ERR_IO, "unknown dtype 'f32'", "lower case");
    write_st(path,
             "{\"a\":{\"dtype\":4,\"shape\":[2],\"data_offsets\":[0,8]}}",
             zeros, 16);
    expect_load_fail(path, FT_ERR_IO,
                     "tensor 'a': dtype must be a string, got a number",
                     "dtype not a string");

    /* Structure and types. */
    static const struct {
        const char *header;
        ft_status status;
        const char *text;
    } bad[] = {
        /* duplicates */
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
         FT_ERR_IO, "duplicate tensor name 'a'"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"\\u0061\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":"
         "[4,8]}}",
         FT_ERR_IO, "duplicate tensor name 'a'"},
        {"{\"a\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[1],"
         "\"data_offsets\":[0,4]}}",
         FT_ERR_IO, "tensor 'a' has 'dtype' twice"},
        {"{\"__metadata__\":{},\"__metadata__\":{}}", FT_ERR_IO,
         "'__metadata__' twice"},
        {"{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}", FT_ERR_IO,
         "duplicate __metadata__ key 'k'"},
        /* not an object */
        {"[1, 2]", FT_ERR_IO, "the header is not a JSON object (it is an "
                              "array)"},
        {"\"{}\"", FT_ERR_IO, "not a JSON object (it is a string)"},
        {"42", FT_ERR_IO, "not a JSON object (it is a number)"},
        {"null", FT_ERR_IO, "not a JSON object (it is null)"},
        {"", FT_ERR_IO, "the header is empty"},
        {"        ", FT_ERR_IO, "the header is empty"},
        /* bad JSON */
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}",
         FT_ERR_IO, "invalid JSON in the header: expected ',' or '}' after a "
                    "tensor (at byte 53)"},
        {"{\"a\" {}}", FT_ERR_IO, "expected ':' after a tensor name"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},}",
         FT_ERR_IO, "unexpected character '}' (at byte 54)"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1,],\"data_offsets\":[0,4]}}",
         FT_ERR_IO, "invalid JSON in the header: unexpected character ']'"},
        {"{'a':{}}", FT_ERR_IO, "unexpected character '\'' (at byte 1)"},
        {"{\"a", FT_ERR_IO, "unterminated string"},
        {"{\"a\x01\":{}}", FT_ERR_IO, "control character in a string"},
        {"{\"a\\x\":{}}", FT_ERR_IO, "invalid escape in a string"},
        {"{\"a\\u12g4\":{}}", FT_ERR_IO, "4 hex digits"},
        {"{\"a\\ud800\":{}}", FT_ERR_IO, "high surrogate not followed by a "
                                          "low surrogate"},
        {"{\"a\\ud800\\u0041\":{}}", FT_ERR_IO, "high surrogate"},
        {"{\"a\\udc00\":{}}", FT_ERR_IO, "lone low surrogate"},
        {"{\"a\xff\":{}}", FT_ERR_IO, "invalid UTF-8"},
        {"{\"a\xc0\xaf\":{}}", FT_ERR_IO, "invalid UTF-8"},       /* overlong */
        {"{\"a\xed\xa0\x80\":{}}", FT_ERR_IO, "invalid UTF-8"},   /* surrogate */
        {"{\"a\xe5\x90\":{}}", FT_ERR_IO, "invalid UTF-8"},       /* cut */
        {"{} x", FT_ERR_IO, "text after the header's object"},
        {"{}{}", FT_ERR_IO, "text after the header's object"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[01],\"data_offsets\":[0,4]}}",
         FT_ERR_IO, "leading zero"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1.],\"data_offsets\":[0,4]}}",
         FT_ERR_IO, "'.' not followed by a digit"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[tru],\"data_offsets\":[0,4]}}",
         FT_ERR_IO, "unexpected character 't'"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1] \"data_offsets\":[0,4]}}",
         FT_ERR_IO, "expected ',' or '}' after a field"},
        /* numbers the header cannot hold */
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,4]}}",
         FT_ERR_IO, "tensor 'a': shape entry -2 is negative"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]}}",
         FT_ERR_IO, "tensor 'a': shape entry 1.5 is not an integer"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1e0],\"data_offsets\":[0,4]}}",
         FT_ERR_IO, "shape entry 1e0 is not an integer"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1.0],\"data_offsets\":[0,4]}}",
         FT_ERR_IO, "shape entry 1.0 is not an integer"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[99999999999999999999],"
         "\"data_offsets\":[0,4]}}",
         FT_ERR_IO, "shape entry 99999999999999999999 is too large"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,4]}}",
         FT_ERR_IO, "data offset -4 is negative"},
        /* wrong types and fields */
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":\"2\",\"data_offsets\":[0,4]}}",
         FT_ERR_IO, "tensor 'a': shape must be an array of integers, got a "
                    "string"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[[1]],\"data_offsets\":[0,4]}}",
         FT_ERR_IO, "shape entry must be a non-negative integer, got an "
                    "array"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[true],\"data_offsets\":[0,4]}}",
         FT_ERR_IO, "got a boolean"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}",
         FT_ERR_IO, "data_offsets must hold two integers [begin, end], it "
                    "holds more"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4]}}",
         FT_ERR_IO, "it holds 1"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":{}}}",
         FT_ERR_IO, "data_offsets must be an array [begin, end], got an "
                    "object"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", FT_ERR_IO,
         "tensor 'a' has no 'data_offsets'"},
        {"{\"a\":{}}", FT_ERR_IO, "tensor 'a' has no 'dtype'"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],"
         "\"offsets\":[0,4]}}",
         FT_ERR_IO, "tensor 'a' has an unexpected field 'offsets'"},
        {"{\"a\":[]}", FT_ERR_IO, "tensor 'a' must be an object, got an "
                                  "array"},
        {"{\"a\":null}", FT_ERR_IO, "tensor 'a' must be an object, got null"},
        {"{\"__metadata__\":[]}", FT_ERR_IO,
         "__metadata__ must be an object of strings, got an array"},
        {"{\"__metadata__\":{\"k\":1}}", FT_ERR_IO,
         "__metadata__ value of 'k' must be a string, got a number"},
        {"{\"__metadata__\":{\"k\":{\"x\":{\"y\":{}}}}}", FT_ERR_IO,
         "__metadata__ value of 'k' must be a string, got an object"},
        {"{\"__metadata__\":{\"k\":null}}", FT_ERR_IO, "got null"},
        /* valid files flashtile cannot represent */
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],"
         "\"data_offsets\":[0,4]}}",
         FT_ERR_UNSUPPORTED, "tensor 'a' has more than 8 dimensions"},
        {"{\"a\\u0000b\":{}}", FT_ERR_UNSUPPORTED, "U+0000"},
        {"{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}",
         FT_ERR_UNSUPPORTED, "dtype 'U8' is not supported"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        char what[64];
        snprintf(what, sizeof what, "bad header %zu", k);
        write_st(path, bad[k].header, zeros, 16);
        expect_load_fail(path, bad[k].status, bad[k].text, what);
    }

    /* Deep nesting is refused at the first level that cannot hold it,
     * without recursion. */
    static char deep[20000];
    size_t len = 0;
    len += (size_t)snprintf(deep, sizeof deep, "{\"a\":{\"shape\":");
    while (len < sizeof deep - 2)
        deep[len++] = '[';
    deep[len] = '\0';
    write_st(path, deep, NULL, 0);
    expect_load_fail(path, FT_ERR_IO, "shape entry must be a non-negative "
                                      "integer, got an array",
                     "deep nesting");

    /* A long name is cut short in messages. */
    char longname[400];
    char header[600];
    memset(longname, 'n', 300);
    longname[300] = '\0';
    snprintf(header, sizeof header,
             "{\"%s\":{\"dtype\":\"XYZ\",\"shape\":[1],\"data_offsets\":[0,4]}"
             "}",
             longname);
    write_st(path, header, zeros, 16);
    expect_load_fail(path, FT_ERR_IO, "nnn...': unknown dtype 'XYZ'",
                     "long name");

    /* The OS's errors name the path and the reason. */
    char missing[PATH_CAP + 32];
    snprintf(missing, sizeof missing, "%s.missing/x.safetensors", path);
    expect_load_fail(missing, FT_ERR_IO, strerror(ENOENT), "missing file");
    const char *dir = getenv("TMPDIR");
    if (dir == NULL || dir[0] == '\0')
        dir = "/tmp";
    expect_load_fail(dir, FT_ERR_IO, "not a regular file", "a directory");
}

/* Every truncation of a valid file fails cleanly, and corrupting any byte
 * of its header either fails cleanly or gives a file whose tensors read
 * (never a crash, a leak or a read outside the file: the sanitizer build
 * checks). */
static void test_corruption(const char *path)
{
    ft_tensor *t[3] = {0};
    t[0] = empty(FT_F32, 2, (const int64_t[]){2, 3});
    t[1] = empty(FT_I64, 1, (const int64_t[]){2});
    t[2] = empty(FT_BF16, 0, NULL);
    const char *names[3] = {"w", "ids", "b\\\"\xc3\xa9"};
    const char *key = "k", *value = "v\xe2\x82\xac";
    for (int k = 0; k < 3; k++)
        if (t[k] == NULL)
            goto done;
    CHECK_OK(ft_fill(t[0], 1.5));
    CHECK_OK(ft_fill(t[1], -3));
    CHECK_OK(ft_fill(t[2], 0.25));
    CHECK_OK(ft_safetensors_save(path, 3, names, t, 1, &key, &value));

    static unsigned char file[FILE_CAP], copy[FILE_CAP];
    size_t n = read_bytes(path, file, sizeof file);
    CHECK(n > 16, "saved file %zu bytes", n);
    if (n <= 16)
        goto done;
    int fails = 0;
    for (size_t cut = 0; cut < n; cut++) {
        overwrite_bytes(path, file, cut);
        ft_safetensors *st = NULL;
        ft_status s = ft_safetensors_load(path, &st);
        fails += s == FT_ERR_IO;
        CHECK(s == FT_ERR_IO && st == NULL, "prefix of %zu bytes: %s", cut,
              s == FT_OK ? "loaded" : ft_last_error());
        ft_safetensors_free(st);
    }
    CHECK(fails == (int)n, "%d of %zu truncations failed", fails, n);

    uint64_t hlen = 0;
    for (int b = 7; b >= 0; b--)
        hlen = hlen << 8 | file[b];
    static const unsigned char subst[] = {0x00, ' ',  '"',  '\\', '{',  '}',
                                          '[',  ']',  ',',  ':',  '0',  '9',
                                          '-',  'e',  '.',  0x80, 0xc3, 0xff};
    int loaded = 0;
    for (size_t pos = 0; pos < 8 + hlen && pos < n; pos++)
        for (size_t k = 0; k < sizeof subst; k++) {
            if (file[pos] == subst[k])
                continue;
            memcpy(copy, file, n);
            copy[pos] = subst[k];
            overwrite_bytes(path, copy, n);
            ft_safetensors *st = NULL;
            ft_status s = ft_safetensors_load(path, &st);
            CHECK((s == FT_OK) == (st != NULL), "corrupt byte %zu", pos);
            CHECK(s == FT_OK || s == FT_ERR_IO || s == FT_ERR_UNSUPPORTED,
                  "corrupt byte %zu: status %d (%s)", pos, (int)s,
                  ft_last_error());
            if (s != FT_OK)
                continue;
            loaded++;
            for (int i = 0; i < ft_safetensors_count(st); i++) {
                ft_tensor *x = NULL;
                s = ft_safetensors_tensor(st, i, &x);
                CHECK(s == FT_OK || s == FT_ERR_NOMEM, "read %d: %s", i,
                      ft_last_error());
                ft_tensor_free(x);
            }
            ft_safetensors_free(st);
        }
    /* Some corruptions are harmless (a digit of the data, a letter of a
     * name). */
    CHECK(loaded > 0, "no corrupted header loaded");

done:
    for (int k = 0; k < 3; k++)
        ft_tensor_free(t[k]);
}

/* CUDA tensors, contiguous or not, are saved through a CPU copy. Runs only
 * where a GPU is present. */
static void test_cuda(const char *path)
{
    if (ft_cuda_device_count() == 0)
        return;
    const ft_device gpu = {FT_CUDA, 0};
    ft_tensor *h = empty(FT_BF16, 2, (const int64_t[]){3, 5});
    ft_tensor *d = NULL, *dt = NULL, *ht = NULL;
    if (h == NULL)
        return;
    CHECK_OK(ft_randn(h, 3, 0));
    CHECK_OK(ft_to(&d, h, FT_BF16, gpu));
    if (d != NULL)
        CHECK_OK(ft_transpose(&dt, d, 0, 1));
    CHECK_OK(ft_transpose(&ht, h, 0, 1));
    if (d == NULL || dt == NULL || ht == NULL)
        goto done;
    const char *names[2] = {"gpu", "gpu.t"};
    ft_tensor *ts[2] = {d, dt};
    CHECK_OK(ft_safetensors_save(path, 2, names, ts, 0, NULL, NULL));
    ft_safetensors *st = NULL;
    CHECK_OK(ft_safetensors_load(path, &st));
    for (int i = 0; st != NULL && i < 2; i++) {
        ft_tensor *back = NULL;
        CHECK_OK(ft_safetensors_tensor(st, i, &back));
        if (back != NULL)
            check_same(back, i == 0 ? h : ht, names[i]);
        ft_tensor_free(back);
    }
    ft_safetensors_free(st);
done:
    ft_tensor_free(ht);
    ft_tensor_free(dt);
    ft_tensor_free(d);
    ft_tensor_free(h);
}

/* ---- the API's argument checks ---- */

static void test_arguments(const char *path)
{
    ft_tensor *a = empty(FT_F32, 1, (const int64_t[]){2});
    ft_tensor *b = empty(FT_F32, 1, (const int64_t[]){3});
    if (a == NULL || b == NULL)
        goto done;
    CHECK_OK(ft_fill(a, 1.0));
    CHECK_OK(ft_fill(b, 2.0));
    ft_tensor *two[2] = {a, b};
    const char *ab[2] = {"a", "b"};

    /* A known file to compare against after each failed save. */
    CHECK_OK(ft_safetensors_save(path, 2, ab, two, 0, NULL, NULL));
    static unsigned char before[4096], after[4096];
    size_t nbefore = read_bytes(path, before, sizeof before);

    const char *dup[2] = {"w", "w"};
    CHECK_FAIL(ft_safetensors_save(path, 2, dup, two, 0, NULL, NULL),
               FT_ERR_ARGUMENT, 2, "duplicate name 'w' (names 0 and 1)");
    const char *blank[2] = {"a", ""};
    CHECK_FAIL(ft_safetensors_save(path, 2, blank, two, 0, NULL, NULL),
               FT_ERR_ARGUMENT, 2, "name 1 is empty");
    const char *reserved[2] = {"__metadata__", "a"};
    CHECK_FAIL(ft_safetensors_save(path, 2, reserved, two, 0, NULL, NULL),
               FT_ERR_ARGUMENT, 2, "name 0 is '__metadata__'");
    const char *null_name[2] = {"a", NULL};
    CHECK_FAIL(ft_safetensors_save(path, 2, null_name, two, 0, NULL, NULL),
               FT_ERR_ARGUMENT, 2, "name 1 is NULL");
    const char *bad_utf8[2] = {"a", "b\xff"};
    CHECK_FAIL(ft_safetensors_save(path, 2, bad_utf8, two, 0, NULL, NULL),
               FT_ERR_ARGUMENT, 2, "name 1 is not valid UTF-8");
    ft_tensor *null_t[2] = {a, NULL};
    CHECK_FAIL(ft_safetensors_save(path, 2, ab, null_t, 0, NULL, NULL),
               FT_ERR_ARGUMENT, 3, "tensor 1 is NULL");
    CHECK_FAIL(ft_safetensors_save(path, 2, NULL, two, 0, NULL, NULL),
               FT_ERR_ARGUMENT, 2, "names is NULL");
    CHECK_FAIL(ft_safetensors_save(path, 2, ab, NULL, 0, NULL, NULL),
               FT_ERR_ARGUMENT, 3, "tensors is NULL");
    CHECK_FAIL(ft_safetensors_save(path, -1, ab, two, 0, NULL, NULL),
               FT_ERR_ARGUMENT, 2, "count -1 is negative");
    CHECK_FAIL(ft_safetensors_save(NULL, 2, ab, two, 0, NULL, NULL),
               FT_ERR_ARGUMENT, 1, "path is NULL");
    CHECK_FAIL(ft_safetensors_save("", 2, ab, two, 0, NULL, NULL),
               FT_ERR_ARGUMENT, 1, "path is empty");
    const char *keys[2] = {"k", "k"}, *values[2] = {"1", "2"};
    CHECK_FAIL(ft_safetensors_save(path, 2, ab, two, 2, keys, values),
               FT_ERR_ARGUMENT, 4, "duplicate metadata key 'k'");
    CHECK_FAIL(ft_safetensors_save(path, 2, ab, two, 1, NULL, values),
               FT_ERR_ARGUMENT, 4, "meta_keys is NULL");
    CHECK_FAIL(ft_safetensors_save(path, 2, ab, two, 1, keys, NULL),
               FT_ERR_ARGUMENT, 5, "meta_values is NULL");
    CHECK_FAIL(ft_safetensors_save(path, 2, ab, two, -3, keys, values),
               FT_ERR_ARGUMENT, 4, "meta_count -3 is negative");
    const char *null_value[1] = {NULL};
    CHECK_FAIL(ft_safetensors_save(path, 2, ab, two, 1, keys, null_value),
               FT_ERR_ARGUMENT, 5, "metadata value 0 is NULL");
    const char *bad_key[1] = {"\xc0\x80"};
    CHECK_FAIL(ft_safetensors_save(path, 2, ab, two, 1, bad_key, values),
               FT_ERR_ARGUMENT, 4, "metadata key 0 is not valid UTF-8");
    ft_tensor fake = *a;
    fake.device = (ft_device){FT_CUDA, 0};
    ft_tensor *on_gpu[2] = {a, &fake};
    if (!ft_cuda_built())
        CHECK_FAIL(ft_safetensors_save(path, 2, ab, on_gpu, 0, NULL, NULL),
                   FT_ERR_UNSUPPORTED, 3, "built without CUDA");
    size_t nafter = read_bytes(path, after, sizeof after);
    CHECK(nafter == nbefore && memcmp(before, after, nbefore) == 0,
          "a failed save changed the file");
    CHECK(!temp_left_behind(path), "a failed save left a temporary file");

    /* OS errors: a missing directory, and a directory in place of the
     * file (the rename fails; the temporary file goes). */
    char missing[PATH_CAP + 32];
    snprintf(missing, sizeof missing, "%s.missing/x.safetensors", path);
    CHECK_FAIL(ft_safetensors_save(missing, 2, ab, two, 0, NULL, NULL),
               FT_ERR_IO, 1, strerror(ENOENT));
    CHECK(strstr(ft_last_error(), missing) != NULL, "no path: %s",
          ft_last_error());
    const char *dir = getenv("TMPDIR");
    if (dir == NULL || dir[0] == '\0')
        dir = "/tmp";
    char sub[PATH_CAP + 32];
    snprintf(sub, sizeof sub, "%s.dir", path);
    if (mkdir(sub, 0700) == 0) {
        CHECK_FAIL(ft_safetensors_save(sub, 2, ab, two, 0, NULL, NULL),
                   FT_ERR_IO, 1, "cannot move the new file into place");
        CHECK(!temp_left_behind(sub), "a failed rename left a file");
        rmdir(sub);
    }

    /* Loading and reading. */
    ft_safetensors *st = NULL;
    CHECK_FAIL(ft_safetensors_load(NULL, &st), FT_ERR_ARGUMENT, 1,
               "path is NULL");
    CHECK_FAIL(ft_safetensors_load(path, NULL), FT_ERR_ARGUMENT, 0,
               "out is NULL");
    CHECK_OK(ft_safetensors_load(path, &st));
    if (st != NULL) {
        ft_tensor *t = a; /* must become NULL on failure */
        CHECK_FAIL(ft_safetensors_tensor(st, 2, &t), FT_ERR_ARGUMENT, 2,
                   "index 2 out of range for a file of 2 tensors");
        CHECK(t == NULL, "out not NULL after a failure");
        CHECK_FAIL(ft_safetensors_tensor(st, -1, &t), FT_ERR_ARGUMENT, 2,
                   "index -1");
        CHECK_FAIL(ft_safetensors_tensor(NULL, 0, &t), FT_ERR_ARGUMENT, 1,
                   "handle is NULL");
        CHECK_FAIL(ft_safetensors_tensor(st, 0, NULL), FT_ERR_ARGUMENT, 0,
                   "out is NULL");
        CHECK(ft_safetensors_name(st, 2) == NULL &&
                  ft_safetensors_name(st, -1) == NULL,
              "name out of range");
        CHECK(ft_safetensors_meta_key(st, 0) == NULL &&
                  ft_safetensors_meta_value(st, 0) == NULL,
              "meta out of range");
        CHECK(ft_safetensors_find(st, "b") == 1 &&
                  ft_safetensors_find(st, "c") == -1 &&
                  ft_safetensors_find(st, NULL) == -1,
              "find");

        /* The file shrinks after the header was read: reading fails
         * cleanly. */
        write_bytes(path, before, nbefore - 4);
        CHECK_FAIL(ft_safetensors_tensor(st, 1, &t), FT_ERR_IO, 1,
                   "file is truncated: expected 12 bytes of tensor data, "
                   "found 8");
        CHECK(t == NULL, "out not NULL after a short read");
        ft_safetensors_free(st);
    }
    CHECK(ft_safetensors_count(NULL) == 0 &&
              ft_safetensors_meta_count(NULL) == 0 &&
              ft_safetensors_name(NULL, 0) == NULL &&
              ft_safetensors_meta_key(NULL, 0) == NULL &&
              ft_safetensors_meta_value(NULL, 0) == NULL &&
              ft_safetensors_find(NULL, "a") == -1,
          "NULL handle");
    ft_safetensors_free(NULL);

    /* A save replaces the file as a whole: a handle opened before keeps
     * reading the old contents. */
    CHECK_OK(ft_safetensors_save(path, 2, ab, two, 0, NULL, NULL));
    st = NULL;
    CHECK_OK(ft_safetensors_load(path, &st));
    CHECK_OK(ft_fill(b, 5.0));
    CHECK_OK(ft_safetensors_save(path, 1, &ab[1], &b, 0, NULL, NULL));
    if (st != NULL) {
        ft_tensor *old = NULL;
        CHECK_OK(ft_safetensors_tensor(st, 1, &old));
        CHECK(old != NULL && at(old, 2) == 2.0, "old contents");
        ft_tensor_free(old);
        ft_safetensors_free(st);
    }
    st = NULL;
    CHECK_OK(ft_safetensors_load(path, &st));
    CHECK(ft_safetensors_count(st) == 1, "new file count");
    ft_safetensors_free(st);

done:
    ft_tensor_free(a);
    ft_tensor_free(b);
}

int main(void)
{
    ft_memory_stats before = {0}, after = {0};
    ft_memory_stats_get(CPU, &before);

    char path[PATH_CAP];
    if (temp_file(path, sizeof path, "ft_test_st") == 0) {
        test_round_trip(path);
        test_exact_bytes(path);
        test_hand_written(path);
        test_malformed(path);
        test_corruption(path);
        test_cuda(path);
        test_arguments(path);
        unlink(path);
    }

    /* Failed loads and saves must not leak tensors. */
    ft_memory_stats_get(CPU, &after);
    CHECK(after.in_use == before.in_use, "%lld bytes of tensors leaked",
          (long long)(after.in_use - before.in_use));

    if (failures != 0) {
        fprintf(stderr, "test_safetensors: %d checks failed\n", failures);
        return 1;
    }
    printf("test_safetensors: all checks passed\n");
    return 0;
}
