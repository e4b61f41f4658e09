/*
 * safetensors.c - reading and writing .safetensors files.
 *
 * A .safetensors file is
 *   N, the header's length in bytes (little-endian uint64, 8 bytes);
 *   the header: N bytes of UTF-8 JSON, an object that maps each tensor's
 *     name to {"dtype": "F32", "shape": [2, 3], "data_offsets": [b, e]},
 *     plus an optional "__metadata__" key mapping to an object of string
 *     values; writers pad it with spaces;
 *   the data buffer: the rest of the file. A tensor's elements are bytes
 *     [b, e) of it, little-endian, in row-major order.
 *
 * flashtile writes the header compactly, tensors in name order (byte order
 * of the UTF-8 names), "__metadata__" first when there is any, padded with
 * spaces so that the data starts at a multiple of 8 bytes; the data of the
 * tensors follows contiguously in the same order. The file is written under
 * a temporary name in the same directory and renamed over the target.
 *
 * The reader holds the whole header in memory and parses it with a small
 * JSON parser that knows the header's shape (an object of objects of
 * strings and arrays of integers), so nesting is at most three deep and
 * nothing the header cannot hold is accepted: unknown fields, duplicate
 * keys, numbers with a fraction or exponent, negative sizes, invalid
 * UTF-8, lone surrogates, trailing text. Strings are decoded in place in
 * the header's buffer (a decoded string is never longer than its JSON
 * text), which then holds every name, key and value the handle returns.
 * The checks then made of each tensor: the byte range is not reversed,
 * the element count and byte size fit 64 bits, the range holds exactly
 * numel * element size bytes and lies inside the data buffer, and no two
 * non-empty ranges overlap (any order is accepted, and so are gaps). Tensor
 * data is read when asked for, from the file kept open by the handle.
 *
 * Error statuses follow npy.c: the OS failing to open, read or write a file
 * and files that are not well-formed (truncated, invalid JSON, wrong
 * types, impossible offsets) are FT_ERR_IO; well-formed files that
 * flashtile cannot represent (a dtype of the format it lacks, more than
 * FT_MAX_DIMS dimensions, a string holding U+0000) are FT_ERR_UNSUPPORTED.
 */
#define _POSIX_C_SOURCE 200809L /* fseeko, ftello */
#define _FILE_OFFSET_BITS 64

#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

/* Bytes of the header-size field. */
#define ST_SIZE_FIELD 8
/* The largest header a reader accepts (the reference implementation's
 * limit); the writer refuses to produce a larger one. */
#define ST_MAX_HEADER 100000000ull
/* The data buffer starts at a multiple of this many bytes. */
#define ST_ALIGN 8
/* Bytes gathered before each fwrite on a big-endian host. */
#define ST_WRITE_CHUNK (64 * 1024)
/* A parse error's message, before the path is added. */
#define ST_MSG_CAP 400
/* Bytes of a name or key shown in a message; longer ones end in "...". */
#define ST_SHOWN 80

static const char SAVE[] = "ft_safetensors_save";
static const char LOAD[] = "ft_safetensors_load";
static const char TENSOR[] = "ft_safetensors_tensor";

/* ---- dtypes ---- */

static const struct {
    const char *name;
    ft_dtype dtype;
} ST_DTYPES[] = {
    {"F64", FT_F64}, {"F32", FT_F32}, {"F16", FT_F16},
    {"BF16", FT_BF16}, {"I32", FT_I32}, {"I64", FT_I64},
    {"F8_E4M3", FT_FP8_E4M3},
};
#define ST_NUM_DTYPES (sizeof ST_DTYPES / sizeof ST_DTYPES[0])

/* The format's other dtypes: a file holding one is valid, but flashtile
 * has no such tensors. */
static const char *const ST_OTHER_DTYPES[] = {
    "BOOL", "U8", "I8", "I16", "U16", "U32", "U64", "F8_E5M2",
    "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "C64",
};

static const char *st_dtype_name(ft_dtype dtype)
{
    for (size_t k = 0; k < ST_NUM_DTYPES; k++)
        if (ST_DTYPES[k].dtype == dtype)
            return ST_DTYPES[k].name;
    return NULL;
}

/* ---- UTF-8 ---- */

/* The length (1 to 4) of the well-formed UTF-8 sequence at s, of at most
 * left bytes, or 0 if it is not one (overlong forms, surrogates and code
 * points past U+10FFFF are not). */
static size_t utf8_sequence(const unsigned char *s, size_t left)
{
    unsigned char c = s[0];
    if (c < 0x80)
        return 1;
    size_t len;
    unsigned char lo = 0x80, hi = 0xbf; /* the second byte's range */
    if (c >= 0xc2 && c <= 0xdf) {
        len = 2;
    } else if (c >= 0xe0 && c <= 0xef) {
        len = 3;
        if (c == 0xe0)
            lo = 0xa0; /* overlong */
        else if (c == 0xed)
            hi = 0x9f; /* surrogates */
    } else if (c >= 0xf0 && c <= 0xf4) {
        len = 4;
        if (c == 0xf0)
            lo = 0x90; /* overlong */
        else if (c == 0xf4)
            hi = 0x8f; /* past U+10FFFF */
    } else {
        return 0;
    }
    if (left < len || s[1] < lo || s[1] > hi)
        return 0;
    for (size_t k = 2; k < len; k++)
        if (s[k] < 0x80 || s[k] > 0xbf)
            return 0;
    return len;
}

static int utf8_valid(const char *s)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t left = strlen(s);
    while (left > 0) {
        size_t len = utf8_sequence(p, left);
        if (len == 0)
            return 0;
        p += len;
        left -= len;
    }
    return 1;
}

/* Writes code point cp (not a surrogate, at most U+10FFFF) as UTF-8 at
 * out; returns the byte count. */
static size_t utf8_encode(uint32_t cp, char *out)
{
    unsigned char *o = (unsigned char *)out;
    if (cp < 0x80) {
        o[0] = (unsigned char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (unsigned char)(0xc0 | cp >> 6);
        o[1] = (unsigned char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (unsigned char)(0xe0 | cp >> 12);
        o[1] = (unsigned char)(0x80 | (cp >> 6 & 0x3f));
        o[2] = (unsigned char)(0x80 | (cp & 0x3f));
        return 3;
    }
    o[0] = (unsigned char)(0xf0 | cp >> 18);
    o[1] = (unsigned char)(0x80 | (cp >> 12 & 0x3f));
    o[2] = (unsigned char)(0x80 | (cp >> 6 & 0x3f));
    o[3] = (unsigned char)(0x80 | (cp & 0x3f));
    return 4;
}

/* A name as shown in messages: at most ST_SHOWN bytes of it, cut at a
 * character boundary, with "..." when cut. */
typedef struct shown {
    char s[ST_SHOWN + 4];
} shown;

static shown show(const char *name)
{
    shown r;
    size_t len = strnlen(name, ST_SHOWN + 1);
    if (len <= ST_SHOWN) {
        memcpy(r.s, name, len + 1);
        return r;
    }
    len = ST_SHOWN;
    while (len > 0 && ((unsigned char)name[len] & 0xc0) == 0x80)
        len--; /* name[len] would start the cut-off part */
    memcpy(r.s, name, len);
    memcpy(r.s + len, "...", 4);
    return r;
}

/* ---- the handle ---- */

typedef struct st_entry {
    const char *name; /* in the handle's header buffer */
    ft_dtype dtype;
    int ndim;
    int64_t shape[FT_MAX_DIMS];
    uint64_t begin, end; /* in the data buffer */
} st_entry;

typedef struct st_meta {
    const char *key, *value; /* in the handle's header buffer */
} st_meta;

struct ft_safetensors {
    FILE *f;
    char *path;
    char *header;        /* N + 1 bytes: the decoded strings live here */
    uint64_t data_start; /* 8 + N: where the data buffer starts */
    uint64_t data_size;  /* bytes of the data buffer */
    st_entry *entries;   /* sorted by name */
    int count, cap;
    st_meta *meta; /* sorted by key */
    int meta_count, meta_cap;
};

void ft_safetensors_free(ft_safetensors *st)
{
    if (st == NULL)
        return;
    /* The stream was only read: fclose cannot lose data. */
    if (st->f != NULL)
        fclose(st->f);
    free(st->path);
    free(st->header);
    free(st->entries);
    free(st->meta);
    free(st);
}

/* ---- the header parser ---- */

typedef struct st_parser {
    char *s; /* the header text; strings are decoded over it */
    size_t n, pos;
    ft_safetensors *st; /* receives the entries and metadata */
    ft_status status;
    char msg[ST_MSG_CAP];
} st_parser;

static int fail(st_parser *p, ft_status status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int fail(st_parser *p, ft_status status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->msg, sizeof p->msg, fmt, ap);
    va_end(ap);
    p->status = status;
    return -1;
}

/* A syntax error, with where it was found. */
static int syntax(st_parser *p, const char *what)
{
    return fail(p, FT_ERR_IO, "invalid JSON in the header: %s (at byte %zu)",
                what, p->pos);
}

static int peek(const st_parser *p)
{
    return p->pos < p->n ? (unsigned char)p->s[p->pos] : -1;
}

static void skip_space(st_parser *p)
{
    while (p->pos < p->n) {
        char c = p->s[p->pos];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r')
            return;
        p->pos++;
    }
}

static int expect(st_parser *p, char c, const char *what)
{
    skip_space(p);
    if (peek(p) != (unsigned char)c)
        return syntax(p, what);
    p->pos++;
    skip_space(p);
    return 0;
}

static int match_word(const st_parser *p, const char *word)
{
    size_t len = strlen(word);
    return p->n - p->pos >= len && memcmp(p->s + p->pos, word, len) == 0;
}

/* What kind of JSON value starts at the cursor ("a string", ...), or NULL
 * if none does. */
static const char *value_kind(const st_parser *p)
{
    int c = peek(p);
    if (c == '"')
        return "a string";
    if (c == '{')
        return "an object";
    if (c == '[')
        return "an array";
    if (c == '-' || (c >= '0' && c <= '9'))
        return "a number";
    if (match_word(p, "true") || match_word(p, "false"))
        return "a boolean";
    if (match_word(p, "null"))
        return "null";
    return NULL;
}

/* The value at the cursor is not what is expected: a type error if it is
 * a JSON value, else a syntax error. */
static int wrong_type(st_parser *p, const char *what, const char *want)
{
    const char *kind = value_kind(p);
    if (kind != NULL)
        return fail(p, FT_ERR_IO, "%s must be %s, got %s", what, want, kind);
    int c = peek(p);
    if (c < 0)
        return syntax(p, "the header ends inside the object");
    char text[48];
    if (c > 0x20 && c < 0x7f)
        snprintf(text, sizeof text, "unexpected character '%c'", c);
    else
        snprintf(text, sizeof text, "unexpected byte 0x%02x", (unsigned)c);
    return syntax(p, text);
}

static int hex_digit(int c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* The 4 hex digits after "\u" at the cursor (which is at the 'u'). */
static int parse_hex4(st_parser *p, uint32_t *out)
{
    if (p->n - p->pos < 5)
        return syntax(p, "truncated \\u escape");
    uint32_t v = 0;
    for (size_t k = 1; k <= 4; k++) {
        int d = hex_digit((unsigned char)p->s[p->pos + k]);
        if (d < 0)
            return syntax(p, "\\u must be followed by 4 hex digits");
        v = v << 4 | (uint32_t)d;
    }
    p->pos += 5;
    *out = v;
    return 0;
}

/* A JSON string at the cursor, decoded in place: *out points into the
 * header buffer, NUL-terminated. The decoded text is never longer than
 * the quoted text, so the writes stay behind the reads. */
static int parse_string(st_parser *p, char **out, const char *what)
{
    if (peek(p) != '"')
        return wrong_type(p, what, "a string");
    char *const start = p->s + p->pos;
    char *w = start;
    p->pos++;
    for (;;) {
        if (p->pos >= p->n)
            return syntax(p, "unterminated string");
        unsigned char c = (unsigned char)p->s[p->pos];
        if (c == '"') {
            p->pos++;
            break;
        }
        if (c < 0x20)
            return syntax(p, "control character in a string (it must be "
                             "escaped)");
        if (c >= 0x80) {
            size_t len = utf8_sequence((const unsigned char *)p->s + p->pos,
                                       p->n - p->pos);
            if (len == 0)
                return syntax(p, "invalid UTF-8 in a string");
            memmove(w, p->s + p->pos, len);
            w += len;
            p->pos += len;
            continue;
        }
        if (c != '\\') {
            *w++ = (char)c;
            p->pos++;
            continue;
        }
        p->pos++; /* the backslash */
        int e = peek(p);
        uint32_t cp;
        switch (e) {
        case '"': cp = '"'; break;
        case '\\': cp = '\\'; break;
        case '/': cp = '/'; break;
        case 'b': cp = '\b'; break;
        case 'f': cp = '\f'; break;
        case 'n': cp = '\n'; break;
        case 'r': cp = '\r'; break;
        case 't': cp = '\t'; break;
        case 'u':
            if (parse_hex4(p, &cp) != 0)
                return -1;
            if (cp >= 0xdc00 && cp <= 0xdfff)
                return syntax(p, "lone low surrogate in a \\u escape");
            if (cp >= 0xd800 && cp <= 0xdbff) {
                uint32_t low;
                if (!match_word(p, "\\u"))
                    return syntax(p, "high surrogate not followed by a low "
                                     "surrogate");
                p->pos++;
                if (parse_hex4(p, &low) != 0)
                    return -1;
                if (low < 0xdc00 || low > 0xdfff)
                    return syntax(p, "high surrogate not followed by a low "
                                     "surrogate");
                cp = 0x10000 + ((cp - 0xd800) << 10) + (low - 0xdc00);
            }
            if (cp == 0)
                return fail(p, FT_ERR_UNSUPPORTED,
                            "a string in the header holds U+0000, which a "
                            "name or metadata string cannot hold here");
            w += utf8_encode(cp, w);
            continue;
        default:
            return syntax(p, e < 0 ? "unterminated string"
                                   : "invalid escape in a string");
        }
        p->pos++; /* the escape's letter */
        *w++ = (char)cp;
    }
    *w = '\0'; /* at or before the closing quote */
    *out = start;
    return 0;
}

/* A non-negative JSON integer of at most INT64_MAX at the cursor; what
 * names it in messages ("tensor 'w': shape entry"). */
static int parse_count(st_parser *p, uint64_t *out, const char *what)
{
    int c = peek(p);
    if (c != '-' && (c < '0' || c > '9'))
        return wrong_type(p, what, "a non-negative integer");
    const size_t start = p->pos;
    int negative = 0, integral = 1, overflow = 0;
    uint64_t v = 0;
    if (c == '-') {
        negative = 1;
        p->pos++;
        c = peek(p);
        if (c < '0' || c > '9')
            return syntax(p, "'-' not followed by a digit");
    }
    if (c == '0') {
        p->pos++;
        c = peek(p);
        if (c >= '0' && c <= '9')
            return syntax(p, "a number with a leading zero");
    } else {
        while ((c = peek(p)) >= '0' && c <= '9') {
            uint64_t digit = (uint64_t)(c - '0');
            if (v > ((uint64_t)INT64_MAX - digit) / 10)
                overflow = 1;
            else
                v = v * 10 + digit;
            p->pos++;
        }
    }
    if (c == '.') {
        integral = 0;
        p->pos++;
        if ((c = peek(p)) < '0' || c > '9')
            return syntax(p, "'.' not followed by a digit");
        while ((c = peek(p)) >= '0' && c <= '9')
            p->pos++;
    }
    if (c == 'e' || c == 'E') {
        integral = 0;
        p->pos++;
        if ((c = peek(p)) == '+' || c == '-')
            p->pos++;
        if ((c = peek(p)) < '0' || c > '9')
            return syntax(p, "exponent without digits");
        while ((c = peek(p)) >= '0' && c <= '9')
            p->pos++;
    }
    const int len = (int)(p->pos - start < 40 ? p->pos - start : 40);
    const char *text = p->s + start;
    if (!integral)
        return fail(p, FT_ERR_IO, "%s %.*s is not an integer", what, len,
                    text);
    if (negative && (v != 0 || overflow))
        return fail(p, FT_ERR_IO, "%s %.*s is negative", what, len, text);
    if (overflow)
        return fail(p, FT_ERR_IO, "%s %.*s is too large", what, len, text);
    *out = v;
    return 0;
}

/* After an array element or object member: 1 if another follows (the
 * ',' is consumed), 0 at the close (consumed), -1 on an error. */
static int next_item(st_parser *p, char close, const char *what)
{
    skip_space(p);
    int c = peek(p);
    if (c == ',') {
        p->pos++;
        skip_space(p);
        return 1;
    }
    if (c == (unsigned char)close) {
        p->pos++;
        return 0;
    }
    return syntax(p, what);
}

static int parse_dtype(st_parser *p, st_entry *e, const char *what)
{
    char *name;
    if (parse_string(p, &name, what) != 0)
        return -1;
    for (size_t k = 0; k < ST_NUM_DTYPES; k++)
        if (strcmp(name, ST_DTYPES[k].name) == 0) {
            e->dtype = ST_DTYPES[k].dtype;
            return 0;
        }
    const shown t = show(e->name), d = show(name);
    for (size_t k = 0; k < sizeof ST_OTHER_DTYPES / sizeof *ST_OTHER_DTYPES;
         k++)
        if (strcmp(name, ST_OTHER_DTYPES[k]) == 0)
            return fail(p, FT_ERR_UNSUPPORTED,
                        "tensor '%s': dtype '%s' is not supported (flashtile "
                        "reads F64, F32, F16, BF16, I32, I64 and F8_E4M3)",
                        t.s, d.s);
    return fail(p, FT_ERR_IO, "tensor '%s': unknown dtype '%s'", t.s, d.s);
}

static int parse_shape(st_parser *p, st_entry *e, const char *what)
{
    const shown t = show(e->name);
    if (peek(p) != '[')
        return wrong_type(p, what, "an array of integers");
    p->pos++;
    skip_space(p);
    e->ndim = 0;
    if (peek(p) == ']') {
        p->pos++;
        return 0;
    }
    char entry[ST_SHOWN + 48];
    snprintf(entry, sizeof entry, "tensor '%s': shape entry", t.s);
    for (;;) {
        if (e->ndim == FT_MAX_DIMS)
            return fail(p, FT_ERR_UNSUPPORTED,
                        "tensor '%s' has more than %d dimensions", t.s,
                        FT_MAX_DIMS);
        uint64_t v;
        if (parse_count(p, &v, entry) != 0)
            return -1;
        e->shape[e->ndim++] = (int64_t)v;
        int more = next_item(p, ']', "expected ',' or ']' in a shape");
        if (more <= 0)
            return more;
    }
}

static int parse_offsets(st_parser *p, st_entry *e, const char *what)
{
    const shown t = show(e->name);
    if (peek(p) != '[')
        return wrong_type(p, what, "an array [begin, end]");
    p->pos++;
    skip_space(p);
    char entry[ST_SHOWN + 48];
    snprintf(entry, sizeof entry, "tensor '%s': data offset", t.s);
    uint64_t v[2];
    int n = 0;
    if (peek(p) == ']') {
        p->pos++;
    } else {
        for (;;) {
            if (n == 2)
                return fail(p, FT_ERR_IO,
                            "%s must hold two integers [begin, end], it "
                            "holds more",
                            what);
            if (parse_count(p, &v[n++], entry) != 0)
                return -1;
            int more = next_item(p, ']', "expected ',' or ']' in "
                                         "data_offsets");
            if (more < 0)
                return -1;
            if (more == 0)
                break;
        }
    }
    if (n != 2)
        return fail(p, FT_ERR_IO,
                    "%s must hold two integers [begin, end], it holds %d",
                    what, n);
    e->begin = v[0];
    e->end = v[1];
    return 0;
}

/* The object describing tensor name, at the cursor. */
static int parse_tensor(st_parser *p, const char *name)
{
    ft_safetensors *st = p->st;
    const shown t = show(name);
    char what[ST_SHOWN + 48];
    snprintf(what, sizeof what, "tensor '%s'", t.s);
    if (peek(p) != '{')
        return wrong_type(p, what, "an object");
    p->pos++;
    skip_space(p);

    st_entry e;
    memset(&e, 0, sizeof e);
    e.name = name;
    int have_dtype = 0, have_shape = 0, have_offsets = 0;
    if (peek(p) == '}') {
        p->pos++;
    } else {
        for (;;) {
            char *field;
            if (parse_string(p, &field, "a field name") != 0)
                return -1;
            if (expect(p, ':', "expected ':' after a field name") != 0)
                return -1;
            int *have;
            if (strcmp(field, "dtype") == 0)
                have = &have_dtype;
            else if (strcmp(field, "shape") == 0)
                have = &have_shape;
            else if (strcmp(field, "data_offsets") == 0)
                have = &have_offsets;
            else
                return fail(p, FT_ERR_IO,
                            "tensor '%s' has an unexpected field '%s' (the "
                            "fields are dtype, shape and data_offsets)",
                            t.s, show(field).s);
            if (*have)
                return fail(p, FT_ERR_IO, "tensor '%s' has '%s' twice", t.s,
                            field);
            *have = 1;
            char fwhat[ST_SHOWN + 64];
            snprintf(fwhat, sizeof fwhat, "tensor '%s': %s", t.s, field);
            int rc = have == &have_dtype   ? parse_dtype(p, &e, fwhat)
                     : have == &have_shape ? parse_shape(p, &e, fwhat)
                                           : parse_offsets(p, &e, fwhat);
            if (rc != 0)
                return -1;
            int more = next_item(p, '}', "expected ',' or '}' after a field");
            if (more < 0)
                return -1;
            if (more == 0)
                break;
        }
    }
    if (!have_dtype || !have_shape || !have_offsets)
        return fail(p, FT_ERR_IO, "tensor '%s' has no '%s'", t.s,
                    !have_dtype ? "dtype"
                    : !have_shape ? "shape"
                                  : "data_offsets");

    if (st->count == st->cap) {
        if (st->cap > INT32_MAX / 2)
            return fail(p, FT_ERR_UNSUPPORTED, "the header lists too many "
                                               "tensors");
        int cap = st->cap ? 2 * st->cap : 16;
        st_entry *grown = realloc(st->entries, (size_t)cap * sizeof *grown);
        if (grown == NULL)
            return fail(p, FT_ERR_NOMEM, "cannot allocate the list of %d "
                                         "tensors", cap);
        st->entries = grown;
        st->cap = cap;
    }
    st->entries[st->count++] = e;
    return 0;
}

/* The "__metadata__" object at the cursor. */
static int parse_metadata(st_parser *p)
{
    ft_safetensors *st = p->st;
    if (peek(p) != '{')
        return wrong_type(p, "__metadata__", "an object of strings");
    p->pos++;
    skip_space(p);
    if (peek(p) == '}') {
        p->pos++;
        return 0;
    }
    for (;;) {
        st_meta m;
        char *key, *value;
        if (parse_string(p, &key, "a __metadata__ key") != 0)
            return -1;
        if (expect(p, ':', "expected ':' after a __metadata__ key") != 0)
            return -1;
        char what[ST_SHOWN + 48];
        snprintf(what, sizeof what, "__metadata__ value of '%s'",
                 show(key).s);
        if (parse_string(p, &value, what) != 0)
            return -1;
        m.key = key;
        m.value = value;
        if (st->meta_count == st->meta_cap) {
            if (st->meta_cap > INT32_MAX / 2)
                return fail(p, FT_ERR_UNSUPPORTED,
                            "__metadata__ has too many keys");
            int cap = st->meta_cap ? 2 * st->meta_cap : 8;
            st_meta *grown = realloc(st->meta, (size_t)cap * sizeof *grown);
            if (grown == NULL)
                return fail(p, FT_ERR_NOMEM, "cannot allocate the list of "
                                             "%d metadata keys", cap);
            st->meta = grown;
            st->meta_cap = cap;
        }
        st->meta[st->meta_count++] = m;
        int more = next_item(p, '}', "expected ',' or '}' in __metadata__");
        if (more <= 0)
            return more;
    }
}

/* The whole header: an object of tensors and at most one "__metadata__",
 * with only whitespace around it. */
static int parse_header(st_parser *p)
{
    skip_space(p);
    if (peek(p) != '{') {
        const char *kind = value_kind(p);
        if (peek(p) < 0)
            return fail(p, FT_ERR_IO, "the header is empty (it must be a "
                                      "JSON object)");
        if (kind == NULL)
            return syntax(p, "the header does not start with '{'");
        return fail(p, FT_ERR_IO, "the header is not a JSON object (it is "
                                  "%s)", kind);
    }
    p->pos++;
    skip_space(p);
    int have_meta = 0;
    if (peek(p) == '}') {
        p->pos++;
    } else {
        for (;;) {
            char *key;
            if (parse_string(p, &key, "a tensor name") != 0)
                return -1;
            if (expect(p, ':', "expected ':' after a tensor name") != 0)
                return -1;
            if (strcmp(key, "__metadata__") == 0) {
                if (have_meta)
                    return fail(p, FT_ERR_IO, "the header has "
                                              "'__metadata__' twice");
                have_meta = 1;
                if (parse_metadata(p) != 0)
                    return -1;
            } else if (parse_tensor(p, key) != 0) {
                return -1;
            }
            int more = next_item(p, '}', "expected ',' or '}' after a "
                                         "tensor");
            if (more < 0)
                return -1;
            if (more == 0)
                break;
        }
    }
    skip_space(p);
    if (p->pos < p->n)
        return syntax(p, "text after the header's object");
    return 0;
}

/* ---- checks after parsing ---- */

static int by_name(const void *a, const void *b)
{
    return strcmp(((const st_entry *)a)->name, ((const st_entry *)b)->name);
}

static int by_key(const void *a, const void *b)
{
    return strcmp(((const st_meta *)a)->key, ((const st_meta *)b)->key);
}

/* Orders pointers to entries by their byte range. */
static int by_range(const void *a, const void *b)
{
    const st_entry *x = *(const st_entry *const *)a;
    const st_entry *y = *(const st_entry *const *)b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return 0;
}

/* One tensor's range against its dtype and shape and the data buffer. */
static ft_status check_entry(const ft_safetensors *st, const st_entry *e)
{
    const shown t = show(e->name);
    const char *dt = st_dtype_name(e->dtype);
    char shape[SHAPE_TEXT];
    ft_format_shape(shape, sizeof shape, e->ndim, e->shape);
    if (e->end < e->begin)
        return ft_fail(FT_ERR_IO, LOAD, 1,
                       "'%s': tensor '%s': data_offsets [%" PRIu64
                       ", %" PRIu64 "] end before they begin",
                       st->path, t.s, e->begin, e->end);
    /* The element count and the byte size must fit int64 (ft_empty's
     * limit is tighter still; a file cannot hold more anyway). */
    int64_t n, size;
    if (ft_checked_numel(e->ndim, e->shape, &n) != 0 ||
        ft_mul_size(n, (int64_t)ft_dtype_size(e->dtype), &size) != 0)
        return ft_fail(FT_ERR_IO, LOAD, 1,
                       "'%s': tensor '%s': the size of shape %s "
                       "overflows 64 bits",
                       st->path, t.s, shape);
    const uint64_t nbytes = (uint64_t)size;
    if (e->end - e->begin != nbytes)
        return ft_fail(FT_ERR_IO, LOAD, 1,
                       "'%s': tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64
                       "] span %" PRIu64 " bytes, but %s of shape %s takes "
                       "%" PRIu64,
                       st->path, t.s, e->begin, e->end, e->end - e->begin, dt,
                       shape, nbytes);
    if (e->end > st->data_size)
        return ft_fail(FT_ERR_IO, LOAD, 1,
                       "'%s': tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64
                       "] go past the end of the data (%" PRIu64
                       " bytes): the file is truncated or the offsets are "
                       "wrong",
                       st->path, t.s, e->begin, e->end, st->data_size);
    return FT_OK;
}

/* Sorts the entries and metadata, and checks names, ranges and overlaps. */
static ft_status check_header(ft_safetensors *st)
{
    if (st->count > 1)
        qsort(st->entries, (size_t)st->count, sizeof *st->entries, by_name);
    for (int i = 1; i < st->count; i++)
        if (strcmp(st->entries[i - 1].name, st->entries[i].name) == 0)
            return ft_fail(FT_ERR_IO, LOAD, 1,
                           "'%s': duplicate tensor name '%s' in the header",
                           st->path, show(st->entries[i].name).s);
    if (st->meta_count > 1)
        qsort(st->meta, (size_t)st->meta_count, sizeof *st->meta, by_key);
    for (int i = 1; i < st->meta_count; i++)
        if (strcmp(st->meta[i - 1].key, st->meta[i].key) == 0)
            return ft_fail(FT_ERR_IO, LOAD, 1,
                           "'%s': duplicate __metadata__ key '%s'", st->path,
                           show(st->meta[i].key).s);
    for (int i = 0; i < st->count; i++)
        FT_TRY(check_entry(st, &st->entries[i]));

    /* Overlaps: in order of the ranges, each non-empty range must begin at
     * or after the furthest end so far. */
    if (st->count < 2)
        return FT_OK;
    const st_entry **order = malloc((size_t)st->count * sizeof *order);
    if (order == NULL)
        return ft_fail(FT_ERR_NOMEM, LOAD, 1,
                       "cannot allocate %d pointers to check the offsets",
                       st->count);
    for (int i = 0; i < st->count; i++)
        order[i] = &st->entries[i];
    qsort(order, (size_t)st->count, sizeof *order, by_range);
    const st_entry *furthest = NULL;
    ft_status status = FT_OK;
    for (int i = 0; i < st->count; i++) {
        const st_entry *e = order[i];
        if (e->begin == e->end)
            continue;
        if (furthest != NULL && e->begin < furthest->end) {
            status = ft_fail(FT_ERR_IO, LOAD, 1,
                             "'%s': tensors '%s' and '%s' overlap in the data "
                             "([%" PRIu64 ", %" PRIu64 "] and [%" PRIu64
                             ", %" PRIu64 "])",
                             st->path, show(furthest->name).s,
                             show(e->name).s, furthest->begin, furthest->end,
                             e->begin, e->end);
            break;
        }
        if (furthest == NULL || e->end > furthest->end)
            furthest = e;
    }
    free(order);
    return status;
}

/* ---- loading ---- */

/* Reads exactly n bytes at the current position of st's file; a short
 * read is reported as a truncated file, with what was being read. */
static ft_status read_exact(ft_safetensors *st, void *buf, size_t n,
                            const char *func, const char *what)
{
    errno = 0;
    size_t got = n == 0 ? 0 : fread(buf, 1, n, st->f);
    if (got == n)
        return FT_OK;
    if (ferror(st->f))
        return ft_fail(FT_ERR_IO, func, 1, "cannot read '%s': %s", st->path,
                       ft_errno_text(errno, "read error"));
    return ft_fail(FT_ERR_IO, func, 1,
                   "'%s': file is truncated: expected %zu bytes of %s, found "
                   "%zu",
                   st->path, n, what, got);
}

static ft_status read_header(ft_safetensors *st)
{
    errno = 0;
    off_t size = -1;
    if (fseeko(st->f, 0, SEEK_END) == 0)
        size = ftello(st->f);
    if (size < 0 || fseeko(st->f, 0, SEEK_SET) != 0)
        return ft_fail(FT_ERR_IO, LOAD, 1, "cannot read '%s': %s", st->path,
                       ft_errno_text(errno, "cannot seek"));
    if (size < ST_SIZE_FIELD)
        return ft_fail(FT_ERR_IO, LOAD, 1,
                       "'%s': file is truncated: %lld bytes, too short for "
                       "the 8-byte header size",
                       st->path, (long long)size);

    unsigned char field[ST_SIZE_FIELD];
    FT_TRY(read_exact(st, field, sizeof field, LOAD, "the header size"));
    uint64_t n = 0;
    for (int b = ST_SIZE_FIELD - 1; b >= 0; b--) /* little-endian */
        n = n << 8 | field[b];
    const uint64_t after = (uint64_t)size - ST_SIZE_FIELD;
    if (n > ST_MAX_HEADER)
        return ft_fail(FT_ERR_IO, LOAD, 1,
                       "'%s': header size %" PRIu64 " exceeds the limit of "
                       "%llu bytes",
                       st->path, n, ST_MAX_HEADER);
    if (n > after)
        return ft_fail(FT_ERR_IO, LOAD, 1,
                       "'%s': file is truncated: the header size is %" PRIu64
                       " bytes, but only %" PRIu64 " bytes follow it",
                       st->path, n, after);

    st->header = malloc((size_t)n + 1);
    if (st->header == NULL)
        return ft_fail(FT_ERR_NOMEM, LOAD, 1,
                       "cannot allocate %" PRIu64 " bytes for the header", n);
    FT_TRY(read_exact(st, st->header, (size_t)n, LOAD, "header"));
    st->header[n] = '\0';
    st->data_start = ST_SIZE_FIELD + n;
    st->data_size = after - n;

    st_parser p = {.s = st->header, .n = (size_t)n, .st = st};
    if (parse_header(&p) != 0)
        return ft_fail(p.status, LOAD, 1, "'%s': %s", st->path, p.msg);
    return check_header(st);
}

ft_status ft_safetensors_load(const char *path, ft_safetensors **out)
{
    if (out == NULL)
        return ft_fail(FT_ERR_ARGUMENT, LOAD, 0, "out is NULL");
    *out = NULL;
    if (path == NULL)
        return ft_fail(FT_ERR_ARGUMENT, LOAD, 1, "path is NULL");
    ft_safetensors *st = calloc(1, sizeof *st);
    if (st == NULL || (st->path = strdup(path)) == NULL) {
        free(st);
        return ft_fail(FT_ERR_NOMEM, LOAD, 1, "out of memory");
    }
    errno = 0;
    st->f = fopen(path, "rb");
    if (st->f == NULL) {
        int err = errno;
        ft_safetensors_free(st);
        return ft_fail(FT_ERR_IO, LOAD, 1, "cannot open '%s': %s", path,
                       ft_errno_text(err, "fopen failed"));
    }
    /* Unbuffered: the header is read in two reads and each tensor in one,
     * straight into its storage, always from the file as it is now. */
    setvbuf(st->f, NULL, _IONBF, 0);
    struct stat info;
    ft_status status = FT_OK;
    if (fstat(fileno(st->f), &info) != 0)
        status = ft_fail(FT_ERR_IO, LOAD, 1, "cannot read '%s': %s", path,
                         strerror(errno));
    else if (!S_ISREG(info.st_mode))
        status = ft_fail(FT_ERR_IO, LOAD, 1,
                         "cannot read '%s': not a regular file", path);
    if (status == FT_OK)
        status = read_header(st);
    if (status != FT_OK) {
        ft_safetensors_free(st);
        return status;
    }
    *out = st;
    return FT_OK;
}

int ft_safetensors_count(const ft_safetensors *st)
{
    return st != NULL ? st->count : 0;
}

const char *ft_safetensors_name(const ft_safetensors *st, int i)
{
    if (st == NULL || i < 0 || i >= st->count)
        return NULL;
    return st->entries[i].name;
}

int ft_safetensors_find(const ft_safetensors *st, const char *name)
{
    if (st == NULL || name == NULL)
        return -1;
    int lo = 0, hi = st->count - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        int c = strcmp(st->entries[mid].name, name);
        if (c == 0)
            return mid;
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid - 1;
    }
    return -1;
}

int ft_safetensors_meta_count(const ft_safetensors *st)
{
    return st != NULL ? st->meta_count : 0;
}

const char *ft_safetensors_meta_key(const ft_safetensors *st, int i)
{
    if (st == NULL || i < 0 || i >= st->meta_count)
        return NULL;
    return st->meta[i].key;
}

const char *ft_safetensors_meta_value(const ft_safetensors *st, int i)
{
    if (st == NULL || i < 0 || i >= st->meta_count)
        return NULL;
    return st->meta[i].value;
}

ft_status ft_safetensors_tensor(ft_safetensors *st, int i, ft_tensor **out)
{
    if (out == NULL)
        return ft_fail(FT_ERR_ARGUMENT, TENSOR, 0, "out is NULL");
    *out = NULL;
    if (st == NULL)
        return ft_fail(FT_ERR_ARGUMENT, TENSOR, 1, "file handle is NULL");
    if (i < 0 || i >= st->count)
        return ft_fail(FT_ERR_ARGUMENT, TENSOR, 2,
                       "index %d out of range for a file of %d tensors", i,
                       st->count);
    const st_entry *e = &st->entries[i];
    ft_tensor *t = NULL;
    FT_TRY(ft_empty_named(&t, e->ndim, e->shape, e->dtype,
                          (ft_device){FT_CPU, 0}, TENSOR));
    const size_t nbytes = (size_t)(e->end - e->begin);
    if (nbytes > 0) {
        clearerr(st->f);
        errno = 0;
        ft_status status = FT_OK;
        if (fseeko(st->f, (off_t)(st->data_start + e->begin), SEEK_SET) != 0)
            status = ft_fail(FT_ERR_IO, TENSOR, 1, "cannot seek in '%s': %s",
                             st->path, ft_errno_text(errno, "fseeko failed"));
        else
            status = read_exact(st, t->data, nbytes, TENSOR, "tensor data");
        if (status != FT_OK) {
            ft_tensor_free(t);
            return status;
        }
        if (!ft_host_is_little_endian())
            ft_swap_elements(t->data, nbytes / ft_dtype_size(e->dtype),
                          ft_dtype_size(e->dtype));
    }
    *out = t;
    return FT_OK;
}

/* ---- saving ---- */

/* A growing text buffer; a failed allocation sets failed and later
 * appends do nothing. */
typedef struct st_buf {
    char *p;
    size_t len, cap;
    int failed;
} st_buf;

static void buf_add(st_buf *b, const char *s, size_t n)
{
    if (b->failed)
        return;
    if (n > b->cap - b->len) {
        size_t cap = b->cap ? b->cap : 256;
        while (n > cap - b->len) {
            if (cap > SIZE_MAX / 2) {
                b->failed = 1;
                return;
            }
            cap *= 2;
        }
        char *grown = realloc(b->p, cap);
        if (grown == NULL) {
            b->failed = 1;
            return;
        }
        b->p = grown;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
}

static void buf_text(st_buf *b, const char *s) { buf_add(b, s, strlen(s)); }

static void buf_u64(st_buf *b, uint64_t v)
{
    char num[24];
    int w = snprintf(num, sizeof num, "%" PRIu64, v);
    buf_add(b, num, (size_t)w);
}

/* s (valid UTF-8) as a JSON string: quotes, backslashes and control
 * characters escaped, everything else as it is. */
static void buf_json_string(st_buf *b, const char *s)
{
    buf_add(b, "\"", 1);
    for (const char *run = s;; s++) {
        unsigned char c = (unsigned char)*s;
        if (c != '\0' && c != '"' && c != '\\' && c >= 0x20)
            continue;
        buf_add(b, run, (size_t)(s - run));
        if (c == '\0')
            break;
        char esc[8];
        switch (c) {
        case '"': buf_text(b, "\\\""); break;
        case '\\': buf_text(b, "\\\\"); break;
        case '\b': buf_text(b, "\\b"); break;
        case '\f': buf_text(b, "\\f"); break;
        case '\n': buf_text(b, "\\n"); break;
        case '\r': buf_text(b, "\\r"); break;
        case '\t': buf_text(b, "\\t"); break;
        default:
            snprintf(esc, sizeof esc, "\\u%04x", c);
            buf_text(b, esc);
        }
        run = s + 1;
    }
    buf_add(b, "\"", 1);
}

typedef struct st_item {
    const char *name;
    int index;
} st_item;

static int item_by_name(const void *a, const void *b)
{
    return strcmp(((const st_item *)a)->name, ((const st_item *)b)->name);
}

/* Sorts count strings (with their positions) into *out, failing on NULL,
 * invalid UTF-8 or duplicates; arg and kind name them in messages. */
static ft_status sort_strings(st_item **out, int count,
                              const char *const *strings, int arg,
                              const char *kind)
{
    *out = NULL;
    if (count <= 0)
        return FT_OK;
    for (int i = 0; i < count; i++) {
        if (strings[i] == NULL)
            return ft_fail(FT_ERR_ARGUMENT, SAVE, arg, "%s %d is NULL", kind,
                           i);
        if (!utf8_valid(strings[i]))
            return ft_fail(FT_ERR_ARGUMENT, SAVE, arg,
                           "%s %d is not valid UTF-8", kind, i);
    }
    st_item *items = malloc((size_t)count * sizeof *items);
    if (items == NULL)
        return ft_fail(FT_ERR_NOMEM, SAVE, arg, "cannot allocate %d %ss",
                       count, kind);
    for (int i = 0; i < count; i++)
        items[i] = (st_item){strings[i], i};
    qsort(items, (size_t)count, sizeof *items, item_by_name);
    for (int i = 1; i < count; i++)
        if (strcmp(items[i - 1].name, items[i].name) == 0) {
            ft_status status = ft_fail(
                FT_ERR_ARGUMENT, SAVE, arg, "duplicate %s '%s' (%ss %d and %d)",
                kind, show(items[i].name).s, kind,
                items[i - 1].index < items[i].index ? items[i - 1].index
                                                    : items[i].index,
                items[i - 1].index < items[i].index ? items[i].index
                                                    : items[i - 1].index);
            free(items);
            return status;
        }
    *out = items;
    return FT_OK;
}

/* The header for tensors and metadata in the sorted orders, padded with
 * spaces to a multiple of ST_ALIGN bytes, into *b. */
static ft_status build_header(st_buf *b, int count, const st_item *names,
                              ft_tensor *const *tensors, int meta_count,
                              const st_item *keys,
                              const char *const *meta_values)
{
    buf_text(b, "{");
    if (meta_count > 0) {
        buf_text(b, "\"__metadata__\":{");
        for (int i = 0; i < meta_count; i++) {
            if (i > 0)
                buf_text(b, ",");
            buf_json_string(b, keys[i].name);
            buf_text(b, ":");
            buf_json_string(b, meta_values[keys[i].index]);
        }
        buf_text(b, "}");
    }
    uint64_t offset = 0;
    for (int i = 0; i < count; i++) {
        const ft_tensor *t = tensors[names[i].index];
        /* Every element is written, repeats of a stride-0 view included. */
        int64_t nbytes, end;
        FT_TRY(ft_check_walk(SAVE, 3, ft_numel(t), "elements"));
        if (ft_mul_size(ft_numel(t), (int64_t)ft_dtype_size(t->dtype), &nbytes) != 0 ||
            ft_add_size((int64_t)offset, nbytes, &end) != 0)
            return ft_fail(FT_ERR_ARGUMENT, SAVE, 3,
                           "the tensors' sizes add up to more than 2^63 "
                           "bytes");
        if (i > 0 || meta_count > 0)
            buf_text(b, ",");
        buf_json_string(b, names[i].name);
        buf_text(b, ":{\"dtype\":\"");
        buf_text(b, st_dtype_name(t->dtype));
        buf_text(b, "\",\"shape\":[");
        for (int d = 0; d < t->ndim; d++) {
            if (d > 0)
                buf_text(b, ",");
            buf_u64(b, (uint64_t)t->shape[d]);
        }
        buf_text(b, "],\"data_offsets\":[");
        buf_u64(b, offset);
        buf_text(b, ",");
        buf_u64(b, (uint64_t)end);
        buf_text(b, "]}");
        offset = (uint64_t)end;
    }
    buf_text(b, "}");
    while (!b->failed && b->len % ST_ALIGN != 0)
        buf_text(b, " ");
    if (b->failed)
        return ft_fail(FT_ERR_NOMEM, SAVE, 2,
                       "cannot allocate memory for the header");
    if (b->len > ST_MAX_HEADER)
        return ft_fail(FT_ERR_ARGUMENT, SAVE, 2,
                       "the header would take %zu bytes, more than the %llu "
                       "that readers accept",
                       b->len, ST_MAX_HEADER);
    return FT_OK;
}

/* Writes n elements of esize bytes at data, little-endian. Returns 0 or
 * the errno of the failure (EIO when stdio set none). */
static int write_le(FILE *f, const void *data, size_t n, size_t esize)
{
    if (n == 0)
        return 0;
    errno = 0;
    if (ft_host_is_little_endian() || esize == 1) {
        if (fwrite(data, esize, n, f) != n)
            return errno != 0 ? errno : EIO;
        return 0;
    }
    unsigned char chunk[ST_WRITE_CHUNK];
    const size_t per_chunk = ST_WRITE_CHUNK / esize;
    const unsigned char *src = data;
    for (size_t done = 0; done < n;) {
        size_t k = n - done < per_chunk ? n - done : per_chunk;
        memcpy(chunk, src + done * esize, k * esize);
        ft_swap_elements(chunk, k, esize);
        if (fwrite(chunk, esize, k, f) != k)
            return errno != 0 ? errno : EIO;
        done += k;
    }
    return 0;
}

/* Writes tensor t (any layout, any device) as contiguous little-endian
 * bytes; name is for messages. */
static ft_status write_tensor(FILE *f, const char *path, const ft_tensor *t,
                              const char *name)
{
    ft_tensor *c = NULL;
    ft_status status =
        t->device.type == FT_CPU
            ? ft_contiguous(&c, t)
            : ft_to(&c, t, t->dtype, (ft_device){FT_CPU, 0});
    if (status != FT_OK) {
        char why[600];
        snprintf(why, sizeof why, "%s", ft_last_error());
        return ft_fail(status, SAVE, 3,
                       "cannot make a contiguous CPU copy of tensor '%s': %s",
                       show(name).s, why);
    }
    int err = write_le(f, c->data, (size_t)ft_numel(c),
                       ft_dtype_size(c->dtype));
    ft_tensor_free(c);
    if (err != 0)
        return ft_fail(FT_ERR_IO, SAVE, 1, "cannot write '%s': %s", path,
                       strerror(err));
    return FT_OK;
}

/* Checks every argument of ft_safetensors_save but the strings. */
static ft_status check_save_args(const char *path, int count,
                                 const char *const *names,
                                 ft_tensor *const *tensors, int meta_count,
                                 const char *const *meta_keys,
                                 const char *const *meta_values)
{
    if (path == NULL)
        return ft_fail(FT_ERR_ARGUMENT, SAVE, 1, "path is NULL");
    if (path[0] == '\0')
        return ft_fail(FT_ERR_ARGUMENT, SAVE, 1, "path is empty");
    if (count < 0)
        return ft_fail(FT_ERR_ARGUMENT, SAVE, 2, "count %d is negative",
                       count);
    if (count > 0 && names == NULL)
        return ft_fail(FT_ERR_ARGUMENT, SAVE, 2,
                       "names is NULL with count %d", count);
    if (count > 0 && tensors == NULL)
        return ft_fail(FT_ERR_ARGUMENT, SAVE, 3,
                       "tensors is NULL with count %d", count);
    if (meta_count < 0)
        return ft_fail(FT_ERR_ARGUMENT, SAVE, 4, "meta_count %d is negative",
                       meta_count);
    if (meta_count > 0 && meta_keys == NULL)
        return ft_fail(FT_ERR_ARGUMENT, SAVE, 4,
                       "meta_keys is NULL with meta_count %d", meta_count);
    if (meta_count > 0 && meta_values == NULL)
        return ft_fail(FT_ERR_ARGUMENT, SAVE, 5,
                       "meta_values is NULL with meta_count %d", meta_count);
    for (int i = 0; i < count; i++) {
        if (names[i] != NULL && names[i][0] == '\0')
            return ft_fail(FT_ERR_ARGUMENT, SAVE, 2, "name %d is empty", i);
        if (names[i] != NULL && strcmp(names[i], "__metadata__") == 0)
            return ft_fail(FT_ERR_ARGUMENT, SAVE, 2,
                           "name %d is '__metadata__', which the format "
                           "reserves for the metadata",
                           i);
        const ft_tensor *t = tensors[i];
        if (t == NULL)
            return ft_fail(FT_ERR_ARGUMENT, SAVE, 3, "tensor %d is NULL", i);
        if (st_dtype_name(t->dtype) == NULL)
            return ft_fail(FT_ERR_ARGUMENT, SAVE, 3,
                           "tensor %d has an invalid dtype %d", i,
                           (int)t->dtype);
        FT_TRY(ft_check_device(SAVE, 3, t, NULL));
    }
    for (int i = 0; i < meta_count; i++) {
        if (meta_values[i] == NULL)
            return ft_fail(FT_ERR_ARGUMENT, SAVE, 5, "metadata value %d is "
                                                     "NULL", i);
        if (!utf8_valid(meta_values[i]))
            return ft_fail(FT_ERR_ARGUMENT, SAVE, 5,
                           "metadata value %d is not valid UTF-8", i);
    }
    return FT_OK;
}

ft_status ft_safetensors_save(const char *path, int count,
                              const char *const *names,
                              ft_tensor *const *tensors, int meta_count,
                              const char *const *meta_keys,
                              const char *const *meta_values)
{
    FT_TRY(check_save_args(path, count, names, tensors, meta_count,
                           meta_keys, meta_values));
    st_item *order = NULL, *keys = NULL;
    st_buf header = {0};
    ft_out_file o = {0};
    ft_status status = sort_strings(&order, count, names, 2, "name");
    if (status == FT_OK)
        status = sort_strings(&keys, meta_count, meta_keys, 4,
                              "metadata key");
    if (status == FT_OK)
        status = build_header(&header, count, order, tensors, meta_count,
                              keys, meta_values);
    /* Written under a temporary name and renamed over path (ft_file_begin). */
    if (status == FT_OK)
        status = ft_file_begin(&o, path, SAVE, 1);
    if (status == FT_OK) {
        unsigned char field[ST_SIZE_FIELD];
        for (int b = 0; b < ST_SIZE_FIELD; b++)
            field[b] = (unsigned char)((uint64_t)header.len >> (8 * b));
        errno = 0;
        if (fwrite(field, 1, sizeof field, o.f) != sizeof field ||
            fwrite(header.p, 1, header.len, o.f) != header.len)
            status = ft_fail(FT_ERR_IO, SAVE, 1, "cannot write '%s': %s",
                             path, ft_errno_text(errno, "write error"));
    }
    for (int i = 0; status == FT_OK && i < count; i++)
        status = write_tensor(o.f, path, tensors[order[i].index], order[i].name);
    if (o.f != NULL)
        status = ft_file_end(&o, status);
    free(header.p);
    free(order);
    free(keys);
    return status;
}
