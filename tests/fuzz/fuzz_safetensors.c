/*
 * fuzz_safetensors.c - the fuzz target of the safetensors loader
 * (lib/safetensors.c).
 *
 * Each input is written to a file and opened with ft_safetensors_load. A
 * rejected file must fail cleanly (fuzz.h's ff_check_failure). From an
 * opened file: every name and metadata pair is read, in strictly
 * increasing bytewise order as documented, ft_safetensors_find finds each
 * name at its index, indices out of range give NULL (and an argument
 * error from ft_safetensors_tensor), and every tensor is read with every
 * element touched; a tensor the header accepted may still fail to read
 * (cleanly). When every tensor was read and every name can be saved
 * (ft_safetensors_save refuses an empty name), the tensors and metadata
 * are saved with ft_safetensors_save, opened again, and must come back
 * with the same names, metadata, dtypes, shapes and bytes.
 */
#include "fuzz.h"

int ft_fuzz_loaded;

/* The same names, metadata and tensors in a and b (ta: a's tensors, read). */
static void same_files(const ft_safetensors *a, ft_tensor *const *ta,
                       ft_safetensors *b)
{
    const char *what = "ft_safetensors_save then ft_safetensors_load";
    const int n = ft_safetensors_count(a), m = ft_safetensors_meta_count(a);
    if (ft_safetensors_count(b) != n)
        ff_die("%s: %d tensors became %d", what, n, ft_safetensors_count(b));
    if (ft_safetensors_meta_count(b) != m)
        ff_die("%s: %d metadata keys became %d", what, m,
               ft_safetensors_meta_count(b));
    for (int i = 0; i < m; i++)
        if (strcmp(ft_safetensors_meta_key(a, i), ft_safetensors_meta_key(b, i)) != 0 ||
            strcmp(ft_safetensors_meta_value(a, i), ft_safetensors_meta_value(b, i)) != 0)
            ff_die("%s: metadata pair %d differs", what, i);
    for (int i = 0; i < n; i++) {
        if (strcmp(ft_safetensors_name(a, i), ft_safetensors_name(b, i)) != 0)
            ff_die("%s: the name of tensor %d differs", what, i);
        ft_tensor *t = NULL;
        ff_check_ok(ft_safetensors_tensor(b, i, &t), what);
        ff_same(ta[i], t, what);
        ft_tensor_free(t);
    }
}

/* Names, metadata and the lookups of an opened file. */
static void check_listing(const ft_safetensors *st)
{
    const int n = ft_safetensors_count(st), m = ft_safetensors_meta_count(st);
    if (n < 0 || m < 0)
        ff_die("negative counts: %d tensors, %d metadata keys", n, m);
    for (int i = 0; i < n; i++) {
        const char *name = ft_safetensors_name(st, i);
        if (name == NULL)
            ff_die("ft_safetensors_name(%d) is NULL with %d tensors", i, n);
        if (i > 0 && strcmp(ft_safetensors_name(st, i - 1), name) >= 0)
            ff_die("tensor names %d and %d are not in increasing order", i - 1, i);
        if (ft_safetensors_find(st, name) != i)
            ff_die("ft_safetensors_find does not find tensor %d at its index", i);
    }
    if (ft_safetensors_name(st, n) != NULL || ft_safetensors_name(st, -1) != NULL)
        ff_die("ft_safetensors_name out of range is not NULL");
    for (int i = 0; i < m; i++) {
        const char *key = ft_safetensors_meta_key(st, i);
        if (key == NULL || ft_safetensors_meta_value(st, i) == NULL)
            ff_die("metadata pair %d is NULL with %d keys", i, m);
        if (i > 0 && strcmp(ft_safetensors_meta_key(st, i - 1), key) >= 0)
            ff_die("metadata keys %d and %d are not in increasing order", i - 1, i);
    }
    if (ft_safetensors_meta_key(st, m) != NULL ||
        ft_safetensors_meta_value(st, -1) != NULL)
        ff_die("metadata out of range is not NULL");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *path = ff_write_input(data, size);
    ft_safetensors *st = NULL;
    ft_status status = ft_safetensors_load(path, &st);
    ft_fuzz_loaded = status == FT_OK;
    if (status != FT_OK) {
        ff_check_failure(status, "ft_safetensors_load", st);
        return 0;
    }
    if (st == NULL)
        ff_die("ft_safetensors_load succeeded without a handle");
    check_listing(st);

    const int n = ft_safetensors_count(st), m = ft_safetensors_meta_count(st);
    ft_tensor *bad = NULL;
    status = ft_safetensors_tensor(st, n, &bad);
    if (status != FT_ERR_ARGUMENT || bad != NULL)
        ff_die("ft_safetensors_tensor(%d) of %d tensors: status %d", n, n,
               (int)status);

    ft_tensor **tensors = calloc((size_t)n + 1, sizeof *tensors);
    const char **names = calloc((size_t)n + 1, sizeof *names);
    const char **keys = calloc((size_t)m + 1, sizeof *keys);
    const char **values = calloc((size_t)m + 1, sizeof *values);
    if (tensors == NULL || names == NULL || keys == NULL || values == NULL)
        ff_die("out of memory for %d tensors and %d metadata keys", n, m);
    int saveable = 1;
    for (int i = 0; i < n; i++) {
        names[i] = ft_safetensors_name(st, i);
        status = ft_safetensors_tensor(st, i, &tensors[i]);
        if (status != FT_OK) {
            ff_check_failure(status, "ft_safetensors_tensor", tensors[i]);
            saveable = 0;
            continue;
        }
        ff_touch(tensors[i], "ft_safetensors_tensor");
        if (names[i][0] == '\0')
            saveable = 0;
    }
    for (int i = 0; i < m; i++) {
        keys[i] = ft_safetensors_meta_key(st, i);
        values[i] = ft_safetensors_meta_value(st, i);
    }

    if (saveable) {
        char out[FF_PATH_CAP];
        ff_scratch("saved.safetensors", out, sizeof out);
        ff_check_ok(ft_safetensors_save(out, n, names, tensors, m, keys, values),
                    "ft_safetensors_save of what was loaded");
        ft_safetensors *back = NULL;
        ff_check_ok(ft_safetensors_load(out, &back),
                    "ft_safetensors_load of what was saved");
        same_files(st, tensors, back);
        ft_safetensors_free(back);
    }

    for (int i = 0; i < n; i++)
        ft_tensor_free(tensors[i]);
    free(tensors);
    free(names);
    free(keys);
    free(values);
    ft_safetensors_free(st);
    return 0;
}
