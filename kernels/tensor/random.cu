/*
 * random.cu - ft_cuda_random, the CUDA half of lib/random.c's ft_rand and
 * ft_randn: the stream of lib/philox.h, element i of it (row-major) at
 * element i of a strided tensor, clamped below 1 as scalar_ops.h says, so
 * a CUDA tensor gets the CPU's values (normals up to the last bit of the
 * device's log, sin and cos, which the rounding to f32 or narrower almost
 * always hides). A view with stride-0 dims comes collapsed, with the
 * stream index of each element along a stride row (random.c's
 * broadcast_plan). Check: spec/gpu_spec.lua (busted, tag gpu) against the
 * CPU. Design: kernels/README.md.
 */
#include "common.cuh"
#include "philox.h"

/* Thread per Philox block: elements 4 b .. 4 b + 3 (row-major) take the
 * lanes of block offset + b, as random.c's fill_random. A uniform that an
 * f16/bf16 tensor would round up to 1 is stored as its largest value
 * below 1 (ft_uniform_for_dtype). */
__global__ void __launch_bounds__(BLOCK)
random_kernel(geo g, void *data, int dtype, uint64_t seed, uint64_t offset,
              int normal, int64_t n)
{
    const int64_t blocks = (n + FT_PHILOX_LANES - 1) / FT_PHILOX_LANES;
    const int64_t step = (int64_t)gridDim.x * BLOCK;
    for (int64_t b = (int64_t)blockIdx.x * BLOCK + threadIdx.x; b < blocks;
         b += step) {
        const ft_philox4 block = ft_philox_block(seed, offset + (uint64_t)b);
        double z[FT_PHILOX_LANES] = {0, 0, 0, 0};
        if (normal)
            ft_philox_block_normals(block, z);
#pragma unroll
        for (int lane = 0; lane < FT_PHILOX_LANES; lane++) {
            const int64_t i = b * FT_PHILOX_LANES + lane;
            if (i >= n)
                break;
            double v;
            if (normal) {
                v = z[lane];
            } else {
                v = ft_uniform_for_dtype(
                    ft_philox_lane_uniform(block, (unsigned)lane), dtype);
            }
            int64_t off[1];
            geo_offsets<1>(g, i, off);
            ft_elem_store(data, off[0], dtype, v);
        }
    }
}

/* One element per thread: element k of g's shape lies at offset off[0]
 * and is element base + off[1] of the stream (a stride-0 view collapsed:
 * the logical indices are not consecutive, so each element takes its own
 * Philox block). */
__global__ void __launch_bounds__(BLOCK)
random_at_kernel(geo g, void *data, int dtype, uint64_t seed, uint64_t offset,
                 int normal, int64_t base, int64_t n)
{
    const int64_t step = (int64_t)gridDim.x * BLOCK;
    for (int64_t k = (int64_t)blockIdx.x * BLOCK + threadIdx.x; k < n; k += step) {
        int64_t off[2];
        geo_offsets<2>(g, k, off);
        const uint64_t i = (uint64_t)(base + off[1]);
        const unsigned lane = (unsigned)(i % FT_PHILOX_LANES);
        const ft_philox4 block = ft_philox_block(seed, offset + i / FT_PHILOX_LANES);
        double v;
        if (normal) {
            double z[FT_PHILOX_LANES];
            ft_philox_block_normals(block, z);
            v = z[lane];
        } else {
            v = ft_uniform_for_dtype(ft_philox_lane_uniform(block, lane), dtype);
        }
        ft_elem_store(data, off[0], dtype, v);
    }
}

ft_status ft_cuda_random(ft_tensor *t, const int64_t *row, int64_t base, uint64_t seed,
                         uint64_t offset, int normal)
{
    const char *const F = normal ? "ft_randn" : "ft_rand";
    FT_TRY(ft_cuda_use_device(t->device.index, F));
    const int64_t n = ft_numel(t);
    if (n == 0)
        return FT_OK;
    if (row) {
        const int64_t *strides[2] = {t->stride, row};
        const geo g = geo_make(t->ndim, t->shape, 2, strides);
        random_at_kernel<<<grid_for(n, BLOCK, MAX_GRID), BLOCK>>>(
            g, t->data, (int)t->dtype, seed, offset, normal, base, n);
    } else {
        const int64_t *strides[1] = {t->stride};
        const geo g = geo_make(t->ndim, t->shape, 1, strides);
        const int64_t blocks = (n + FT_PHILOX_LANES - 1) / FT_PHILOX_LANES;
        random_kernel<<<grid_for(blocks, BLOCK, MAX_GRID), BLOCK>>>(
            g, t->data, (int)t->dtype, seed, offset, normal, n);
    }
    FT_CUDA_CHECK_LAUNCH(F);
    return FT_OK;
}
