/*
 * fuzz_npy.c - the fuzz target of the .npy loader (lib/npy.c).
 *
 * Each input is written to a file and loaded with ft_load_npy. A rejected
 * file must fail cleanly (fuzz.h's ff_check_failure). A loaded tensor has
 * every element read, is saved with ft_save_npy and loaded again (the
 * same dtype, shape and bytes), and when it has two dims or more, its
 * transpose (a strided view, which the saver writes through its staging
 * buffer) is saved and reloaded too and compared with a contiguous copy.
 */
#include "fuzz.h"

int ft_fuzz_loaded;

/* Saves t to path, loads it back and checks the result is expect. */
static void round_trip(const ft_tensor *t, const ft_tensor *expect,
                       const char *path, const char *what)
{
    ff_check_ok(ft_save_npy(t, path), what);
    ft_tensor *back = NULL;
    ff_check_ok(ft_load_npy(&back, path), what);
    ff_same(expect, back, what);
    ft_tensor_free(back);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *path = ff_write_input(data, size);
    ft_tensor *t = NULL;
    ft_status st = ft_load_npy(&t, path);
    ft_fuzz_loaded = st == FT_OK;
    if (st != FT_OK) {
        ff_check_failure(st, "ft_load_npy", t);
        return 0;
    }
    ff_touch(t, "ft_load_npy");
    if (t->dtype == FT_BF16)
        ff_die("ft_load_npy gave a bf16 tensor, which .npy cannot hold");

    char out[FF_PATH_CAP];
    ff_scratch("saved.npy", out, sizeof out);
    round_trip(t, t, out, "ft_save_npy then ft_load_npy");

    if (t->ndim >= 2) {
        ft_tensor *view = NULL, *copy = NULL;
        ff_check_ok(ft_transpose(&view, t, 0, -1), "ft_transpose");
        ff_check_ok(ft_clone(&copy, view), "ft_clone");
        round_trip(view, copy, out,
                   "ft_save_npy of a transposed view then ft_load_npy");
        ft_tensor_free(copy);
        ft_tensor_free(view);
    }
    ft_tensor_free(t);
    return 0;
}
