/*
 * reduce.cu - ft_cuda_reduce_all, ft_cuda_compare and ft_cuda_reduce_dim,
 * the CUDA half of lib/ops.c's reductions (sum, mean, max, min, norm) and
 * comparisons (ft_max_abs_diff, ft_allclose), on strided tensors of any
 * dtype, computed in double. Over all elements: two passes, a partial per
 * block into a temporary buffer, then one block. Along a dim: a thread, a
 * warp or a block per line (reduce.cuh). MAX/MIN and their positions, and
 * sums along short or strided lines (a thread per line, in order), are the
 * CPU's bits; other sums are combined in a tree and may differ from the
 * CPU's in the last bit. Check: spec/cuda_ops_spec.lua (busted, tag gpu)
 * against the CPU. Design: kernels/README.md.
 */
#include "reduce.cuh"

/* Adds the pair (v, w) of ACC_CMP: ops.c's visit_max_diff and
 * visit_close, through the same scalar_ops.h functions. */
__device__ __forceinline__ void acc_add_pair(acc &x, double v, double w,
                                             double rtol, double atol)
{
    const double d = ft_abs_diff(v, w);
    const int close = ft_is_close(v, w, rtol, atol);
    if (!isnan(x.a) && (isnan(d) || d > x.a))
        x.a = d;
    if (!close)
        x.at = 0;
}

/* Pass 1 of a reduction over all elements: block k writes its partial to
 * part[k]. Operand 0 is a, operand 1 b (ACC_CMP only). */
__global__ void __launch_bounds__(BLOCK)
reduce_partial_kernel(geo g, const void *a, int adt, const void *b, int bdt,
                      int mode, double rtol, double atol, int64_t n, acc *part)
{
    acc x = acc_empty(mode);
    const int64_t step = (int64_t)gridDim.x * BLOCK;
    for (int64_t base = (int64_t)blockIdx.x * BLOCK + threadIdx.x; base < n;
         base += step * UNROLL) {
        int64_t off[UNROLL][2];
        const int cnt = unrolled_offsets<2>(g, base, step, n, off);
        double v[UNROLL], w[UNROLL];
        load_many<2>(a, adt, off, 0, cnt, v);
        if (mode == ACC_CMP)
            load_many<2>(b, bdt, off, 1, cnt, w);
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            if (u >= cnt)
                break;
            if (mode == ACC_CMP)
                acc_add_pair(x, v[u], w[u], rtol, atol);
            else
                acc_add(mode, x, v[u], base + u * step);
        }
    }
    x = block_reduce(mode, x);
    if (threadIdx.x == 0)
        part[blockIdx.x] = x;
}

/* Pass 2: one block combines the count partials into *result. */
__global__ void __launch_bounds__(BLOCK)
reduce_final_kernel(const acc *part, int count, int mode, acc *result)
{
    acc x = acc_empty(mode);
    for (int i = threadIdx.x; i < count; i += BLOCK)
        x = acc_combine(mode, x, part[i]);
    x = block_reduce(mode, x);
    if (threadIdx.x == 0)
        *result = x;
}

/* Gives back a temporary buffer; a failure to free is reported only when
 * nothing failed before it. */
static ft_status free_temp(void *p, ft_status st, const char *func)
{
    cudaError_t e = cudaFreeAsync(p, 0);
    if (e != cudaSuccess) {
        if (st == FT_OK)
            return ft_cuda_fail((int)e, func, "cudaFreeAsync(buffer, 0)",
                                __FILE__, __LINE__);
        cudaGetLastError();
    }
    return st;
}

/* Runs both passes into buf (grid + 1 accs) and copies the result back;
 * the copy waits for the kernels. */
static ft_status reduce_run(const char *F, const geo &g, const ft_tensor *a,
                            const ft_tensor *b, int mode, double rtol,
                            double atol, int64_t n, unsigned grid, acc *buf,
                            acc *result)
{
    reduce_partial_kernel<<<grid, BLOCK>>>(
        g, a->data, (int)a->dtype, b ? b->data : NULL,
        b ? (int)b->dtype : (int)a->dtype, mode, rtol, atol, n, buf);
    FT_CUDA_CHECK_LAUNCH(F);
    reduce_final_kernel<<<1, BLOCK>>>(buf, (int)grid, mode, buf + grid);
    FT_CUDA_CHECK_LAUNCH(F);
    FT_CUDA_TRY(F, cudaMemcpy(result, buf + grid, sizeof *result,
                              cudaMemcpyDeviceToHost));
    return FT_OK;
}

/* The combined acc of every element of a (and b), n > 0. */
static ft_status reduce_all_elements(const char *F, const ft_tensor *a,
                                     const ft_tensor *b, int mode, double rtol,
                                     double atol, acc *result)
{
    const int64_t n = ft_numel(a);
    const int64_t *strides[2] = {a->stride, b ? b->stride : a->stride};
    const geo g = geo_make(a->ndim, a->shape, b ? 2 : 1, strides);
    const unsigned grid = grid_for(n, BLOCK * UNROLL, REDUCE_GRID);
    acc *buf = NULL;
    FT_CUDA_TRY(F, cudaMallocAsync((void **)&buf, (grid + 1) * sizeof *buf, 0));
    ft_status st = reduce_run(F, g, a, b, mode, rtol, atol, n, grid, buf,
                              result);
    return free_temp(buf, st, F);
}

static int acc_mode_of(ft_reduce_op op)
{
    switch (op) {
    case FT_MAX: return ACC_MAX;
    case FT_MIN: return ACC_MIN;
    case FT_NORM: return ACC_SUMSQ;
    default: return ACC_SUM;
    }
}

ft_status ft_cuda_reduce_all(ft_reduce_op op, const ft_tensor *a,
                             double *result)
{
    static const char *const F = "ft_reduce_all";
    FT_TRY(ft_cuda_use_device(a->device.index, F));
    const int64_t n = ft_numel(a);
    acc x = {0.0, 0.0, -1}; /* the empty sum (MAX/MIN of nothing is
                               rejected by ops.c) */
    if (n > 0)
        FT_TRY(reduce_all_elements(F, a, NULL, acc_mode_of(op), 0.0, 0.0, &x));
    *result = ft_reduce_result(op, x.a, x.b, x.a, n); /* on the host */
    return FT_OK;
}

ft_status ft_cuda_compare(const ft_tensor *a, const ft_tensor *b, double rtol,
                          double atol, double *max_abs_diff, int *all_close)
{
    /* ops.c asks for one of the two results; the name follows. */
    const char *const F = all_close ? "ft_allclose" : "ft_max_abs_diff";
    FT_TRY(ft_cuda_use_device(a->device.index, F));
    acc x = {0.0, 0.0, 1};
    if (ft_numel(a) > 0)
        FT_TRY(reduce_all_elements(F, a, b, ACC_CMP, rtol, atol, &x));
    if (max_abs_diff)
        *max_abs_diff = x.a;
    if (all_close)
        *all_close = x.at != 0;
    return FT_OK;
}

/* The result of one line, stored as ops.c's reduce_dim_cpu stores it. */
__device__ __forceinline__ void store_line(int op, const acc &x, int64_t len,
                                           void *out, int odt, int64_t *idx,
                                           int64_t line)
{
    ft_elem_store(out, line, odt, ft_reduce_result(op, x.a, x.b, x.a, len));
    if (idx)
        idx[line] = x.at;
}

/* A group of 2^shift threads per line (one thread, or a warp); g walks
 * the line starts of a (a's shape without the reduced dim). With one
 * thread the elements are added in order: the CPU's arithmetic exactly.
 * With a warp the lanes stride along the line (coalesced when it is
 * contiguous) and combine in a tree: MAX/MIN and their positions are still
 * the CPU's, sums may differ from it in the last bit. */
__global__ void __launch_bounds__(BLOCK)
reduce_lines_kernel(geo g, const void *a, int adt, int64_t len, int64_t step,
                    int op, int mode, void *out, int odt, int64_t *idx,
                    int64_t lines, int shift)
{
    const int64_t thread = (int64_t)blockIdx.x * BLOCK + threadIdx.x;
    const int group = 1 << shift;
    const int lane = (int)(threadIdx.x & (group - 1));
    const int64_t lstep = ((int64_t)gridDim.x * BLOCK) >> shift;
    /* With a warp per line all its lanes have the same line: the loop and
     * the shuffles are warp-uniform. */
    for (int64_t line = thread >> shift; line < lines; line += lstep) {
        int64_t off[1];
        geo_offsets<1>(g, line, off);
        acc x = acc_empty(mode);
        for (int64_t j = lane; j < len; j += group)
            acc_add(mode, x, ft_elem_load(a, off[0] + j * step, adt), j);
        if (shift == GROUP_WARP)
            x = warp_reduce(mode, x);
        if (lane == 0)
            store_line(op, x, len, out, odt, idx, line);
    }
}

/* Block per line, for long lines: the threads stride along the line and
 * combine in a tree (MAX/MIN and their positions are still the CPU's;
 * sums may differ from it in the last bit). */
__global__ void __launch_bounds__(BLOCK)
reduce_lines_block_kernel(geo g, const void *a, int adt, int64_t len,
                          int64_t step, int op, int mode, void *out, int odt,
                          int64_t *idx, int64_t lines)
{
    for (int64_t line = blockIdx.x; line < lines; line += gridDim.x) {
        int64_t off[1];
        geo_offsets<1>(g, line, off);
        acc x = acc_empty(mode);
        for (int64_t j = threadIdx.x; j < len; j += BLOCK)
            acc_add(mode, x, ft_elem_load(a, off[0] + j * step, adt), j);
        x = block_reduce(mode, x);
        if (threadIdx.x == 0)
            store_line(op, x, len, out, odt, idx, line);
    }
}

ft_status ft_cuda_reduce_dim(ft_tensor *out, ft_tensor *indices,
                             ft_reduce_op op, const ft_tensor *a, int dim)
{
    static const char *const F = "ft_reduce_dim";
    FT_TRY(ft_cuda_use_device(a->device.index, F));
    int64_t lines;
    const int64_t *strides[1] = {a->stride};
    const geo g = lines_geo(a, dim, 1, strides, &lines);
    if (lines == 0)
        return FT_OK;
    const int64_t len = a->shape[dim], step = a->stride[dim];
    int64_t *idx = indices ? (int64_t *)indices->data : NULL;
    const int mode = acc_mode_of(op);
    const int group = line_group_for(len, step, lines);
    if (group == LINE_BLOCK) {
        reduce_lines_block_kernel<<<line_blocks(lines), BLOCK>>>(
            g, a->data, (int)a->dtype, len, step, (int)op, mode, out->data,
            (int)out->dtype, idx, lines);
    } else {
        const int shift = group == LINE_WARP ? GROUP_WARP : GROUP_THREAD;
        reduce_lines_kernel<<<grid_for(lines << shift, BLOCK, MAX_GRID),
                              BLOCK>>>(g, a->data, (int)a->dtype, len, step,
                                       (int)op, mode, out->data,
                                       (int)out->dtype, idx, lines, shift);
    }
    FT_CUDA_CHECK_LAUNCH(F);
    return FT_OK;
}
