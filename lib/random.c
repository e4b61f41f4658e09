/*
 * random.c - ft_rand, ft_randn and ft_random_counters.
 *
 * The numbers come from the counter-based stream of philox.h: element i (in
 * row-major order of the tensor's shape, whatever its strides) depends only
 * on (seed, offset, i). The per-element arithmetic lives in philox.h and
 * scalar_ops.h (the clamp below 1 of a uniform stored in f16/bf16), which
 * the CUDA kernel (kernels/tensor/random.cu, ft_cuda_random) shares, so a
 * CUDA tensor gets the same values as a CPU one.
 */
#include "internal.h"
#include "philox.h"
#include "scalar_ops.h"
#ifdef FT_HAVE_CUDA
#include "kernels.h"
#endif

typedef enum ft_distribution {
    FT_DIST_UNIFORM,
    FT_DIST_NORMAL
} ft_distribution;

/* Stores the stream's element i (uniform or normal) at p, of dtype. */
static void store_random(void *p, ft_dtype dtype, ft_distribution dist,
                         ft_philox4 block, const double *normals, unsigned lane)
{
    if (dist == FT_DIST_UNIFORM)
        ft_store_f64(p, dtype,
                     ft_uniform_for_dtype(ft_philox_lane_uniform(block, lane), dtype));
    else
        ft_store_f64(p, dtype, normals[lane]);
}

/* A view with stride-0 dims (ft_expand's): each distinct element is
 * written once, with the value of its last index along those dims, the
 * value a row-major loop over every index would leave in it. w: t with
 * those dims collapsed; row[]: the row-major strides of t's whole shape
 * (they fit: its element count does), so element k of w is element
 * *base + (k's offset along row) of the stream. */
static void broadcast_plan(const ft_tensor *t, ft_tensor *w, int64_t row[FT_MAX_DIMS],
                           int64_t *base)
{
    *w = *t;
    ft_collapse_for_write(w, NULL);
    int64_t r = 1, span;
    *base = 0;
    for (int d = t->ndim - 1; d >= 0; d--) {
        row[d] = r;
        if (w->shape[d] != t->shape[d] &&
            ft_mul_size(row[d], t->shape[d] - 1, &span) == 0)
            ft_add_size(*base, span, base);
        ft_mul_size(r, t->shape[d], &r);
    }
}

static void fill_random_broadcast(ft_tensor *w, const int64_t *row, int64_t base,
                                  uint64_t seed, uint64_t offset, ft_distribution dist)
{
    const int64_t m = ft_numel(w);
    ft_iter it;
    ft_iter_init(&it, w->ndim, w->shape, 2, (const int64_t *const[]){w->stride, row});
    double normals[FT_PHILOX_LANES] = {0, 0, 0, 0};
    for (int64_t k = 0; k < m; k++, ft_iter_next(&it)) {
        const uint64_t i = (uint64_t)(base + it.offset[1]);
        const ft_philox4 block = ft_philox_block(seed, offset + i / FT_PHILOX_LANES);
        if (dist == FT_DIST_NORMAL)
            ft_philox_block_normals(block, normals);
        store_random(ft_elem_ptr(w, it.offset[0]), w->dtype, dist, block, normals,
                     (unsigned)(i % FT_PHILOX_LANES));
    }
}

/* Fills t (any shape and strides) with the stream (seed, offset) in
 * row-major logical order. One Philox block serves FT_PHILOX_LANES
 * consecutive elements, so it is computed once per block; the values are
 * those of ft_random_uniform_at / ft_random_normal_at for each i. */
static ft_status fill_random(ft_tensor *t, uint64_t seed, uint64_t offset,
                             ft_distribution dist, const char *func)
{
    FT_TRY(ft_check_tensor(func, 1, t));
    FT_TRY(ft_check_device(func, 1, t, NULL));
    FT_TRY(ft_check_computable(func, 1, t->dtype, dist == FT_DIST_NORMAL ? "randn" : "rand"));
    if (!ft_dtype_is_float(t->dtype))
        return ft_fail(FT_ERR_ARGUMENT, func, 1,
                       "needs a floating-point tensor, got %s",
                       ft_dtype_name(t->dtype));
    const int64_t n = ft_numel(t);
    if (n == 0)
        return FT_OK;
    if (ft_has_broadcast(t)) {
        ft_tensor w;
        int64_t row[FT_MAX_DIMS], base;
        broadcast_plan(t, &w, row, &base);
        FT_TRY(ft_check_walk(func, 1, ft_numel(&w), "elements"));
#ifdef FT_HAVE_CUDA
        if (t->device.type == FT_CUDA)
            return ft_cuda_random(&w, row, base, seed, offset, dist == FT_DIST_NORMAL);
#endif
        fill_random_broadcast(&w, row, base, seed, offset, dist);
        return FT_OK;
    }
#ifdef FT_HAVE_CUDA
    if (t->device.type == FT_CUDA) {
        FT_TRY(ft_check_walk(func, 1, n, "elements"));
        return ft_cuda_random(t, NULL, 0, seed, offset, dist == FT_DIST_NORMAL);
    }
#endif
    FT_TRY(ft_check_walk(func, 1, n, "elements"));
    ft_iter it;
    ft_iter_init(&it, t->ndim, t->shape, 1,
                 (const int64_t *const[]){t->stride});
    ft_philox4 block = {{0, 0, 0, 0}};
    double normals[FT_PHILOX_LANES] = {0, 0, 0, 0};
    for (int64_t i = 0; i < n; i++, ft_iter_next(&it)) {
        const unsigned lane = (unsigned)(i % FT_PHILOX_LANES);
        if (lane == 0) {
            block = ft_philox_block(seed,
                                    offset + (uint64_t)i / FT_PHILOX_LANES);
            /* A Box-Muller pair serves two elements: evaluate it once. */
            if (dist == FT_DIST_NORMAL)
                ft_philox_block_normals(block, normals);
        }
        store_random(ft_elem_ptr(t, it.offset[0]), t->dtype, dist, block, normals,
                     lane);
    }
    return FT_OK;
}

ft_status ft_rand(ft_tensor *t, uint64_t seed, uint64_t offset)
{
    return fill_random(t, seed, offset, FT_DIST_UNIFORM, "ft_rand");
}

ft_status ft_randn(ft_tensor *t, uint64_t seed, uint64_t offset)
{
    return fill_random(t, seed, offset, FT_DIST_NORMAL, "ft_randn");
}

uint64_t ft_random_counters(int64_t numel)
{
    if (numel <= 0)
        return 0;
    /* ceil(numel / 4) without overflow: numel + 3 fits in a uint64. */
    return ((uint64_t)numel + (FT_PHILOX_LANES - 1)) / FT_PHILOX_LANES;
}
