/*
 * gen_corpus.c - writes the seed corpus of the fuzz targets:
 * tests/fuzz/corpus/npy/ and tests/fuzz/corpus/safetensors/.
 *
 *   fuzz_corpus_gen DIR            writes the files of DIR/npy and DIR/safetensors
 *   fuzz_corpus_gen --check DIR    checks that DIR holds exactly those
 *                                  files with exactly those bytes
 *
 * Every file is built byte by byte here (not with flashtile's savers), so
 * that the corpus holds what other writers produce: every dtype, either
 * byte order, fortran order, 0-d and empty arrays, versions 1.0, 2.0 and
 * 3.0 of .npy, dicts written differently; safetensors files with metadata,
 * several tensors, gaps, escapes and raw UTF-8 in names. A name starting
 * with "ok-" is a file the loader must accept, "err-" one it must reject
 * (replay.c --expect-by-name checks both); the rejected ones are near
 * misses, which give the fuzzer the loaders' error paths to start from.
 *
 * The corpus is committed; ctest's fuzz_corpus runs --check, so the
 * generator and the files cannot drift apart. After changing this file:
 *   build/fuzz_corpus_gen tests/fuzz/corpus
 * (and remove any file it no longer writes).
 */
#define _POSIX_C_SOURCE 200809L

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define CAP 4096
#define MAX_FILES 128

static int check_mode = 0;
static int problems = 0;
static const char *root;
/* The files written (or checked) so far, as "npy/name". */
static char *written[MAX_FILES];
static int nwritten = 0;

static void emit(const char *sub, const char *name, const uint8_t *bytes, size_t n)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s/%s", root, sub, name);
    if (nwritten == MAX_FILES) {
        fprintf(stderr, "gen_corpus: more than %d files\n", MAX_FILES);
        exit(2);
    }
    char rel[512];
    snprintf(rel, sizeof rel, "%s/%s", sub, name);
    written[nwritten] = strdup(rel);
    if (written[nwritten] == NULL)
        exit(2);
    nwritten++;
    if (check_mode) {
        uint8_t have[CAP + 1];
        FILE *f = fopen(path, "rb");
        size_t got = 0;
        if (f != NULL) {
            got = fread(have, 1, sizeof have, f);
            fclose(f);
        }
        if (f == NULL) {
            fprintf(stderr, "gen_corpus: %s is missing\n", path);
            problems++;
        } else if (got != n || memcmp(have, bytes, n) != 0) {
            fprintf(stderr, "gen_corpus: %s differs from what the generator "
                            "writes\n", path);
            problems++;
        }
        return;
    }
    FILE *f = fopen(path, "wb");
    if (f == NULL || fwrite(bytes, 1, n, f) != n || fclose(f) != 0) {
        fprintf(stderr, "gen_corpus: cannot write %s: %s\n", path, strerror(errno));
        exit(2);
    }
}

/* ---- elements ---- */

/* Bit patterns of the sample values of each type: 0, -0, 1.5, -2.25, inf,
 * NaN, then 1 to 6 (integers: 0, -1, the extremes, 2^24 + 1 or 2^53 + 1,
 * 42, then 1 to 6). */
static uint64_t sample_bits(const char *type, int k)
{
    static const uint16_t f2[12] = {0x0000, 0x8000, 0x3e00, 0xc080, 0x7c00, 0x7e00,
                                    0x3c00, 0x4000, 0x4200, 0x4400, 0x4500, 0x4600};
    static const double f[12] = {0.0, -0.0, 1.5, -2.25, INFINITY, 0.0,
                                 1, 2, 3, 4, 5, 6};
    static const int64_t i4[12] = {0, -1, INT32_MAX, INT32_MIN, 16777217, 42,
                                   1, 2, 3, 4, 5, 6};
    static const int64_t i8[12] = {0, -1, INT64_MAX, INT64_MIN, 9007199254740993LL,
                                   42, 1, 2, 3, 4, 5, 6};
    k %= 12;
    if (strcmp(type, "f2") == 0)
        return f2[k];
    if (strcmp(type, "f4") == 0 || strcmp(type, "bf16") == 0) {
        uint32_t b;
        float v = (float)f[k];
        memcpy(&b, &v, 4);
        if (k == 5)
            b = 0x7fc00000u; /* a quiet NaN */
        return strcmp(type, "bf16") == 0 ? b >> 16 : b;
    }
    if (strcmp(type, "f8") == 0) {
        uint64_t b;
        memcpy(&b, &f[k], 8);
        if (k == 5)
            b = 0x7ff8000000000000ull;
        return b;
    }
    if (strcmp(type, "i4") == 0)
        return (uint64_t)(uint32_t)(int32_t)i4[k];
    return (uint64_t)i8[k];
}

static int type_size(const char *type)
{
    if (strcmp(type, "f2") == 0 || strcmp(type, "bf16") == 0)
        return 2;
    if (strcmp(type, "f4") == 0 || strcmp(type, "i4") == 0)
        return 4;
    return 8;
}

/* n sample elements of type, little- or big-endian, at out; returns the
 * byte count. */
static size_t elems(uint8_t *out, const char *type, int big, int n)
{
    const int size = type_size(type);
    for (int k = 0; k < n; k++) {
        uint64_t bits = sample_bits(type, k);
        for (int b = 0; b < size; b++) {
            uint8_t byte = (uint8_t)(bits >> (8 * b));
            out[k * size + (big ? size - 1 - b : b)] = byte;
        }
    }
    return (size_t)n * (size_t)size;
}

/* ---- .npy ---- */

/* A .npy file of version major.minor: the dict padded with pad (spaces,
 * or NULs as some writers do) and '\n' to a multiple of 64 bytes, then
 * the data. Returns the length, the bytes at out. */
static size_t npy_bytes(uint8_t *out, int major, int minor, const char *dict,
                        char pad, const uint8_t *data, size_t n)
{
    const size_t lenfield = major == 1 ? 2 : 4;
    const size_t pre = 6 + 2 + lenfield;
    size_t dlen = strlen(dict);
    size_t total = (pre + dlen + 1 + 63) / 64 * 64;
    size_t hlen = total - pre;
    memcpy(out, "\x93NUMPY", 6);
    out[6] = (uint8_t)major;
    out[7] = (uint8_t)minor;
    for (size_t b = 0; b < lenfield; b++)
        out[8 + b] = (uint8_t)(hlen >> (8 * b));
    memcpy(out + pre, dict, dlen);
    memset(out + pre + dlen, pad, hlen - dlen - 1);
    out[total - 1] = '\n';
    memcpy(out + total, data, n);
    return total + n;
}

static void npy(const char *name, int major, const char *dict, const uint8_t *data,
                size_t n)
{
    uint8_t buf[CAP];
    emit("npy", name, buf, npy_bytes(buf, major, 0, dict, ' ', data, n));
}

/* A plain version 1.0 file of type ("<f4"...) and shape text, with count
 * sample elements. */
static void npy_simple(const char *name, const char *descr, const char *shape,
                       int count)
{
    char dict[256];
    uint8_t data[CAP];
    snprintf(dict, sizeof dict,
             "{'descr': '%s', 'fortran_order': False, 'shape': %s, }", descr, shape);
    const char *type = descr[0] == '<' || descr[0] == '>' || descr[0] == '|' ||
                               descr[0] == '='
                           ? descr + 1
                           : descr;
    size_t n = elems(data, type, descr[0] == '>', count);
    npy(name, 1, dict, data, n);
}

static void gen_npy(void)
{
    uint8_t data[CAP], buf[CAP];
    size_t n, len;

    /* Every dtype, little-endian, version 1.0. */
    npy_simple("ok-f2", "<f2", "(2, 3)", 6);
    npy_simple("ok-f4", "<f4", "(2, 3)", 6);
    npy_simple("ok-f8", "<f8", "(2, 3)", 6);
    npy_simple("ok-i4", "<i4", "(2, 3)", 6);
    npy_simple("ok-i8", "<i8", "(2, 3)", 6);
    /* Big-endian. */
    npy_simple("ok-f2-big", ">f2", "(6,)", 6);
    npy_simple("ok-f4-big", ">f4", "(3, 2)", 6);
    npy_simple("ok-f8-big", ">f8", "(6,)", 6);
    npy_simple("ok-i4-big", ">i4", "(2, 3)", 6);
    npy_simple("ok-i8-big", ">i8", "(6,)", 6);
    /* Native and unspecified byte order. */
    npy_simple("ok-f4-native", "=f4", "(4,)", 4);
    npy_simple("ok-i4-no-order", "i4", "(4,)", 4);
    npy_simple("ok-f8-pipe", "|f8", "(2,)", 2);
    /* 0-d, empty, 1-d, 8-d. */
    npy_simple("ok-f4-0d", "<f4", "()", 1);
    npy_simple("ok-f8-empty", "<f8", "(0,)", 0);
    npy_simple("ok-i8-empty-2d", "<i8", "(3, 0)", 0);
    npy_simple("ok-f4-8d", "<f4", "(1, 2, 1, 1, 2, 1, 1, 2)", 8);

    /* Fortran order. */
    n = elems(data, "f4", 0, 6);
    npy("ok-f4-fortran", 1,
        "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", data, n);
    n = elems(data, "i8", 1, 8);
    npy("ok-i8-big-fortran-3d", 1,
        "{'descr': '>i8', 'fortran_order': True, 'shape': (2, 2, 2), }", data, n);
    n = elems(data, "f2", 0, 3);
    npy("ok-f2-fortran-1d", 1,
        "{'descr': '<f2', 'fortran_order': True, 'shape': (3,), }", data, n);

    /* Versions 2.0 and 3.0 (a 4-byte header length). */
    n = elems(data, "f4", 0, 6);
    npy("ok-f4-v2", 2, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
        data, n);
    n = elems(data, "f8", 0, 2);
    npy("ok-f8-v3", 3, "{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }",
        data, n);

    /* Dicts written differently: keys in another order, double quotes, a
     * list for the shape, Python 2's long suffix, no trailing comma, no
     * spaces; padding of NULs. */
    n = elems(data, "f4", 0, 6);
    npy("ok-f4-dict-variants", 1,
        "{\"shape\":[2L,3L],\"fortran_order\":False,\"descr\":\"<f4\"}", data, n);
    n = elems(data, "i4", 0, 2);
    len = npy_bytes(buf, 1, 0,
                    "{'descr': '<i4', 'fortran_order': False, 'shape': (2,)}", '\0',
                    data, n);
    emit("npy", "ok-i4-nul-padding", buf, len);

    /* fp8_e4m3, as flashtile writes it: a one-field structured descr of
     * u1, in either spelling of its byte order; zeros, 1, -1, 448, the
     * smallest subnormal and both NaNs among the bytes. */
    static const uint8_t fp8[8] = {0x00, 0x80, 0x38, 0xb8, 0x7e, 0x01, 0x7f, 0xff};
    npy("ok-fp8", 1,
        "{'descr': [('fp8_e4m3', '|u1')], 'fortran_order': False, 'shape': (2, 4), }", fp8,
        sizeof fp8);
    npy("ok-fp8-fortran", 1,
        "{'descr': [(\"fp8_e4m3\", \"<u1\")], 'fortran_order': True, 'shape': (4, 2), }",
        fp8, sizeof fp8);

    /* Near misses. */
    npy("err-structured-u1", 1,
        "{'descr': [('x', '|u1')], 'fortran_order': False, 'shape': (8,), }", fp8,
        sizeof fp8);
    n = elems(data, "f4", 0, 5);
    npy("err-truncated-data", 1,
        "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", data, n);
    n = elems(data, "f4", 0, 2);
    len = npy_bytes(buf, 1, 0, "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }",
                    ' ', data, n);
    buf[1] = 'n';
    emit("npy", "err-bad-magic", buf, len);
    len = npy_bytes(buf, 4, 0, "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }",
                    ' ', data, n);
    emit("npy", "err-version-4", buf, len);
    len = npy_bytes(buf, 1, 0, "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }",
                    ' ', data, n);
    buf[8] = 0xff; /* a header length past the end of the file */
    emit("npy", "err-header-past-end", buf, len);
    emit("npy", "err-truncated-header", buf, 40);
    npy("err-structured", 1,
        "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,), }", data, n);
    npy("err-u1", 1, "{'descr': '|u1', 'fortran_order': False, 'shape': (8,), }", data,
        n);
    npy("err-negative-dim", 1,
        "{'descr': '<f4', 'fortran_order': False, 'shape': (-2,), }", data, n);
    npy("err-9d", 1,
        "{'descr': '<f4', 'fortran_order': False, "
        "'shape': (1, 1, 1, 1, 1, 1, 1, 1, 2), }",
        data, n);
    npy("err-no-fortran-order", 1, "{'descr': '<f4', 'shape': (2,), }", data, n);
    npy("err-unknown-key", 1,
        "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'align': 0, }", data,
        n);
    npy("err-text-after-dict", 1,
        "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), } x", data, n);
    npy("err-huge-shape", 1,
        "{'descr': '<f8', 'fortran_order': False, "
        "'shape': (4294967296, 4294967296), }",
        data, n);
}

/* ---- safetensors ---- */

/* A safetensors file: the 8-byte header size, the header padded with
 * spaces to a multiple of 8 bytes (of size field plus header), then the
 * data. */
static void st(const char *name, const char *json, const uint8_t *data, size_t n)
{
    uint8_t buf[CAP];
    size_t hlen = strlen(json);
    size_t padded = (8 + hlen + 7) / 8 * 8 - 8;
    for (int b = 0; b < 8; b++)
        buf[b] = (uint8_t)((uint64_t)padded >> (8 * b));
    memcpy(buf + 8, json, hlen);
    memset(buf + 8 + hlen, ' ', padded - hlen);
    if (n > 0)
        memcpy(buf + 8 + padded, data, n);
    emit("safetensors", name, buf, 8 + padded + n);
}

static void gen_safetensors(void)
{
    uint8_t data[CAP];
    size_t n = 0;

    /* Every dtype, with metadata. */
    n = 0;
    n += elems(data + n, "f8", 0, 2);
    n += elems(data + n, "f4", 0, 2);
    n += elems(data + n, "f2", 0, 2);
    n += elems(data + n, "bf16", 0, 2);
    n += elems(data + n, "i4", 0, 2);
    n += elems(data + n, "i8", 0, 2);
    st("ok-every-dtype",
       "{\"__metadata__\":{\"format\":\"pt\",\"note\":\"six dtypes\"},"
       "\"a.f64\":{\"dtype\":\"F64\",\"shape\":[2],\"data_offsets\":[0,16]},"
       "\"b.f32\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[16,24]},"
       "\"c.f16\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[24,28]},"
       "\"d.bf16\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[28,32]},"
       "\"e.i32\":{\"dtype\":\"I32\",\"shape\":[2],\"data_offsets\":[32,40]},"
       "\"f.i64\":{\"dtype\":\"I64\",\"shape\":[2],\"data_offsets\":[40,56]}}",
       data, n);

    /* fp8_e4m3 (F8_E4M3), NaN bytes included. */
    static const uint8_t fp8[6] = {0x38, 0xb8, 0x7e, 0x01, 0x7f, 0xff};
    st("ok-fp8", "{\"q\":{\"dtype\":\"F8_E4M3\",\"shape\":[2,3],\"data_offsets\":[0,6]}}",
       fp8, sizeof fp8);

    /* Several tensors listed out of order, stored in another order, with a
     * gap; a 0-d tensor; an empty one; an 8-d one. */
    n = 0;
    n += elems(data + n, "f4", 0, 6); /* w: [0, 24) */
    n += elems(data + n, "i4", 0, 2); /* 8 bytes of gap: [24, 32) */
    n += elems(data + n, "f8", 0, 1); /* s: [32, 40) */
    n += elems(data + n, "bf16", 0, 8); /* deep: [40, 56) */
    st("ok-several-tensors",
       "{\"w\":{\"shape\":[2,3],\"data_offsets\":[0,24],\"dtype\":\"F32\"},"
       "\"deep\":{\"dtype\":\"BF16\",\"shape\":[1,2,1,1,2,1,1,2],\"data_offsets\":[40,56]},"
       "\"empty\":{\"dtype\":\"I64\",\"shape\":[3,0],\"data_offsets\":[24,24]},"
       "\"s\":{\"dtype\":\"F64\",\"shape\":[],\"data_offsets\":[32,40]}}",
       data, n);

    /* Metadata only; an empty header; whitespace everywhere. */
    st("ok-metadata-only", "{\"__metadata__\":{\"format\":\"pt\"}}", NULL, 0);
    st("ok-empty-header", "{}", NULL, 0);
    n = elems(data, "i8", 0, 3);
    st("ok-whitespace",
       " {\n\t\"x\" : { \"dtype\" : \"I64\" ,\r\n \"shape\" : [ 3 ] , "
       "\"data_offsets\" : [ 0 , 24 ] } ,\n \"__metadata__\" : { } \n} ",
       data, n);

    /* Escapes and raw UTF-8 in names and metadata. */
    n = elems(data, "f2", 0, 4);
    st("ok-escapes",
       "{\"__metadata__\":{\"q\\\"uote\":\"back\\\\slash\\/\\b\\f\\n\\r\\t\","
       "\"\\u00e9t\\u00e9\":\"\\ud83d\\ude00 \xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\"},"
       "\"layer\\u002e0\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[0,4]},"
       "\"\xce\xbb\\n\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[4,8]}}",
       data, n);

    /* Near misses. */
    n = elems(data, "f4", 0, 4);
    st("err-overlap",
       "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
       "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
       data, n);
    st("err-past-the-data",
       "{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", data, 12);
    st("err-size-mismatch",
       "{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,16]}}", data, 16);
    st("err-reversed-offsets",
       "{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,4]}}", data, 16);
    st("err-u8-dtype", "{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]}}",
       data, 4);
    st("err-unknown-field",
       "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"x\":1}}", data,
       4);
    st("err-duplicate-name",
       "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
       "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
       data, 8);
    st("err-fraction", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1.0],\"data_offsets\":[0,4]}}",
       data, 4);
    st("err-nul-escape",
       "{\"a\\u0000\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", data, 4);
    st("err-lone-surrogate",
       "{\"a\\udc00\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", data, 4);
    st("err-9d",
       "{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}",
       data, 4);
    st("err-metadata-number", "{\"__metadata__\":{\"n\":1}}", NULL, 0);
    st("err-trailing-comma",
       "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},}", data, 4);
    uint8_t buf[16] = {0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0, '{', '}'};
    emit("safetensors", "err-header-size-past-end", buf, 10);
}

/* In check mode: files in DIR/sub that the generator does not write. */
static void check_extras(const char *sub)
{
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/%s", root, sub);
    DIR *d = opendir(dir);
    if (d == NULL) {
        fprintf(stderr, "gen_corpus: cannot open %s: %s\n", dir, strerror(errno));
        problems++;
        return;
    }
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        char rel[512];
        snprintf(rel, sizeof rel, "%s/%s", sub, e->d_name);
        int known = 0;
        for (int i = 0; i < nwritten && !known; i++)
            known = strcmp(written[i], rel) == 0;
        if (!known) {
            fprintf(stderr, "gen_corpus: %s/%s is not a file the generator writes\n",
                    root, rel);
            problems++;
        }
    }
    closedir(d);
}

int main(int argc, char **argv)
{
    int i = 1;
    if (i < argc && strcmp(argv[i], "--check") == 0) {
        check_mode = 1;
        i++;
    }
    if (i != argc - 1) {
        fprintf(stderr, "usage: %s [--check] CORPUS-DIR\n", argv[0]);
        return 2;
    }
    root = argv[i];
    if (!check_mode) {
        char dir[1024];
        mkdir(root, 0777);
        snprintf(dir, sizeof dir, "%s/npy", root);
        mkdir(dir, 0777);
        snprintf(dir, sizeof dir, "%s/safetensors", root);
        mkdir(dir, 0777);
    }
    gen_npy();
    gen_safetensors();
    if (check_mode) {
        check_extras("npy");
        check_extras("safetensors");
        if (problems > 0) {
            fprintf(stderr, "gen_corpus: %s is not what tests/fuzz/gen_corpus.c "
                            "writes (%d problems)\n", root, problems);
            return 1;
        }
        printf("gen_corpus: %s holds the %d files the generator writes\n", root,
               nwritten);
        return 0;
    }
    printf("gen_corpus: wrote %d files under %s\n", nwritten, root);
    for (int k = 0; k < nwritten; k++)
        free(written[k]);
    return 0;
}
