/*
 * softmax.cu - ft_cuda_softmax, the CUDA half of lib/ops.c's softmax:
 * along one dim of a strided tensor of any float dtype, each line's max
 * (NaN if any element is), then exp(x - m) / sum exp(x - m) with the sum
 * compensated (Neumaier) as on the CPU, in double. A thread, a warp or a
 * block per line (reduce.cuh); with a thread per line the sum is in the
 * CPU's order, otherwise combined in a tree. The same bits as the CPU up
 * to the last bit of the device's exp and the sum's order, which the
 * rounding to f32 or narrower almost always hides. Check:
 * spec/cuda_ops_spec.lua (busted, tag gpu) against the CPU. Design:
 * kernels/README.md.
 */
#include "reduce.cuh"

/* The larger of m and v; NaN once either is NaN. */
__device__ __forceinline__ double nan_max(double m, double v)
{
    if (isnan(m))
        return m;
    if (isnan(v))
        return v;
    return v > m ? v : m;
}

/* A group of 2^shift threads (1, or a whole warp) per line; g walks the
 * line starts of a (operand 0) and out (operand 1). Each line: m = max
 * (NaN if any is NaN), then exp(x - m) / sum exp(x - m), as ops.c's
 * softmax_cpu; with one thread the sum is in the CPU's order. */
__global__ void __launch_bounds__(BLOCK)
softmax_kernel(geo g, const void *a, int adt, void *out, int odt, int64_t len,
               int64_t sa, int64_t so, int64_t lines, int shift)
{
    const int64_t thread = (int64_t)blockIdx.x * BLOCK + threadIdx.x;
    const int group = 1 << shift;
    const int lane = (int)(threadIdx.x & (group - 1));
    const int64_t lstep = ((int64_t)gridDim.x * BLOCK) >> shift;
    /* With a warp per line every lane of it has the same line, so the
     * loop and the shuffles are warp-uniform. */
    for (int64_t line = thread >> shift; line < lines; line += lstep) {
        int64_t off[2];
        geo_offsets<2>(g, line, off);
        const int64_t ia = off[0], io = off[1];

        double m = -INFINITY;
        for (int64_t j = lane; j < len; j += group)
            m = nan_max(m, ft_elem_load(a, ia + j * sa, adt));
        if (shift == GROUP_WARP) {
            for (int s = WARP / 2; s > 0; s >>= 1)
                m = nan_max(m, __shfl_down_sync(0xffffffffu, m, s));
            m = __shfl_sync(0xffffffffu, m, 0);
        }

        acc total = {0.0, 0.0, 0};
        for (int64_t j = lane; j < len; j += group)
            ft_ksum_add(&total.a, &total.b,
                        exp(ft_elem_load(a, ia + j * sa, adt) - m));
        if (shift == GROUP_WARP) {
            total = warp_reduce(ACC_SUM, total);
            total.a = __shfl_sync(0xffffffffu, total.a, 0);
            total.b = __shfl_sync(0xffffffffu, total.b, 0);
        }
        /* __drcp_rn is the correctly rounded 1 / x, as the CPU's
         * division; unlike `/` it has no slow-path call to spill around. */
        const double inv = __drcp_rn(ft_ksum_result(total.a, total.b));

        for (int64_t j = lane; j < len; j += group)
            ft_elem_store(out, io + j * so, odt,
                          __dmul_rn(exp(ft_elem_load(a, ia + j * sa, adt) - m), inv));
    }
}

/* nan_max over the block, valid in all threads (all BLOCK call it). */
__device__ __forceinline__ double block_max(double m)
{
    __shared__ double sh[BLOCK];
    const int t = threadIdx.x;
    sh[t] = m;
    __syncthreads();
    for (int s = BLOCK / 2; s > 0; s >>= 1) {
        if (t < s)
            sh[t] = nan_max(sh[t], sh[t + s]);
        __syncthreads();
    }
    m = sh[0];
    __syncthreads(); /* sh may be reused by the next call */
    return m;
}

/* Block per line, for few long lines: the same three passes, the max and
 * the sum combined across the block. */
__global__ void __launch_bounds__(BLOCK)
softmax_block_kernel(geo g, const void *a, int adt, void *out, int odt,
                     int64_t len, int64_t sa, int64_t so, int64_t lines)
{
    for (int64_t line = blockIdx.x; line < lines; line += gridDim.x) {
        int64_t off[2];
        geo_offsets<2>(g, line, off);
        const int64_t ia = off[0], io = off[1];

        double m = -INFINITY;
        for (int64_t j = threadIdx.x; j < len; j += BLOCK)
            m = nan_max(m, ft_elem_load(a, ia + j * sa, adt));
        m = block_max(m); /* NaN if any is */

        acc total = {0.0, 0.0, 0};
        /* Not unrolled: unrolled, this loop made ptxas spill. */
#pragma unroll 1
        for (int64_t j = threadIdx.x; j < len; j += BLOCK)
            ft_ksum_add(&total.a, &total.b,
                        exp(ft_elem_load(a, ia + j * sa, adt) - m));
        total = block_reduce(ACC_SUM, total);
        const double inv = __drcp_rn(ft_ksum_result(total.a, total.b));

        for (int64_t j = threadIdx.x; j < len; j += BLOCK)
            ft_elem_store(out, io + j * so, odt,
                          __dmul_rn(exp(ft_elem_load(a, ia + j * sa, adt) - m), inv));
    }
}

ft_status ft_cuda_softmax(ft_tensor *out, const ft_tensor *a, int dim)
{
    static const char *const F = "ft_softmax";
    FT_TRY(ft_cuda_use_device(a->device.index, F));
    if (ft_numel(a) == 0)
        return FT_OK;
    int64_t lines;
    const int64_t *strides[2] = {a->stride, out->stride};
    const geo g = lines_geo(a, dim, 2, strides, &lines);
    const int64_t len = a->shape[dim];
    const int64_t sa = a->stride[dim], so = out->stride[dim];
    const int group = line_group_for(len, sa, lines);
    if (group == LINE_BLOCK) {
        softmax_block_kernel<<<line_blocks(lines), BLOCK>>>(
            g, a->data, (int)a->dtype, out->data, (int)out->dtype, len, sa, so,
            lines);
    } else {
        const int shift = group == LINE_WARP ? GROUP_WARP : GROUP_THREAD;
        softmax_kernel<<<grid_for(lines << shift, BLOCK, MAX_GRID), BLOCK>>>(
            g, a->data, (int)a->dtype, out->data, (int)out->dtype, len, sa, so,
            lines, shift);
    }
    FT_CUDA_CHECK_LAUNCH(F);
    return FT_OK;
}

