/*
 * index_ops.cu - ft_index_select and ft_index_add on CUDA (the embedding
 * lookup and its gradient). Tensors are seen as [outer, size, inner] around
 * the indexed dim, contiguous: every tensor and index comes contiguous
 * (lib/index.c makes the copies). Index entries are checked on the device:
 * a bad entry is skipped and reported through a flag, read back after the
 * kernel. Check: spec/index_spec.lua (its gpu cases, against the CPU).
 */
#include "kernels.h"

#include <cuda_runtime.h>
#include <stdint.h>

#define INDEX_THREADS 256

struct Span { /* a contiguous tensor around one dim */
    int64_t outer, size, inner;
};

static Span span_of(const ft_tensor *t, int dim)
{
    Span s = {1, t->shape[dim], 1};
    for (int d = 0; d < dim; d++)
        s.outer *= t->shape[d];
    for (int d = dim + 1; d < t->ndim; d++)
        s.inner *= t->shape[d];
    return s;
}

__device__ __forceinline__ int64_t index_at(const void *index, int is64, int64_t i)
{
    return is64 ? ((const int64_t *)index)[i] : ((const int32_t *)index)[i];
}

/* out [outer, n, inner] = t [outer, size, inner] at rows index[i]; bytes
 * per element es (the copy moves raw elements, any dtype). */
__global__ void index_select_kernel(char *out, const char *t, const void *index, int is64,
                                    Span src, int64_t n, int es, int *bad)
{
    const int64_t total = src.outer * n * src.inner;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < total;
         e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t in = e % src.inner, i = e / src.inner % n, o = e / (src.inner * n);
        const int64_t row = index_at(index, is64, i);
        if (row < 0 || row >= src.size) {
            *bad = 1;
            continue;
        }
        const char *from = t + ((o * src.size + row) * src.inner + in) * es;
        char *to = out + e * es;
        for (int b = 0; b < es; b++)
            to[b] = from[b];
    }
}

template <typename T>
__global__ void index_add_kernel(T *t, const T *src, const void *index, int is64, Span dst,
                                 int64_t n, int *bad)
{
    const int64_t total = dst.outer * n * dst.inner;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < total;
         e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t in = e % dst.inner, i = e / dst.inner % n, o = e / (dst.inner * n);
        const int64_t row = index_at(index, is64, i);
        if (row < 0 || row >= dst.size) {
            *bad = 1;
            continue;
        }
        atomicAdd(t + (o * dst.size + row) * dst.inner + in, src[e]);
    }
}

static int grid_for(int64_t total)
{
    int64_t blocks = (total + INDEX_THREADS - 1) / INDEX_THREADS;
    return (int)(blocks > 65535 ? 65535 : blocks < 1 ? 1 : blocks);
}

/* The device flag, cleared, and after the kernel its verdict. */
static ft_status flag_new(int **flag, const char *func)
{
    FT_CUDA_TRY(func, cudaMallocAsync((void **)flag, sizeof(int), 0));
    FT_CUDA_TRY(func, cudaMemsetAsync(*flag, 0, sizeof(int), 0));
    return FT_OK;
}

static ft_status flag_check(int *flag, int64_t size, const char *func)
{
    int bad = 0;
    cudaError_t e = cudaMemcpy(&bad, flag, sizeof bad, cudaMemcpyDeviceToHost);
    cudaFreeAsync(flag, 0);
    if (e != cudaSuccess)
        return ft_cuda_fail((int)e, func, "cudaMemcpy", __FILE__, __LINE__);
    if (bad)
        return ft_fail(FT_ERR_ARGUMENT, func, 3,
                       "an index entry is out of range for a dim of size %lld",
                       (long long)size);
    return FT_OK;
}

extern "C" ft_status ft_cuda_index_select(ft_tensor *out, const ft_tensor *t, int dim,
                                          const ft_tensor *index)
{
    const char *func = "ft_index_select";
    FT_TRY(ft_cuda_use_device(t->device.index, func));
    int *flag = NULL;
    FT_TRY(flag_new(&flag, func));
    const Span s = span_of(t, dim);
    const int64_t n = index->shape[0];
    index_select_kernel<<<grid_for(s.outer * n * s.inner), INDEX_THREADS>>>(
        (char *)out->data, (const char *)t->data, index->data, index->dtype == FT_I64, s, n,
        (int)ft_dtype_size(t->dtype), flag);
    ft_status st = ft_cuda_check_launch(func, __FILE__, __LINE__);
    ft_status chk = flag_check(flag, s.size, func);
    return st == FT_OK ? chk : st;
}

extern "C" ft_status ft_cuda_index_add(ft_tensor *t, int dim, const ft_tensor *index,
                                       const ft_tensor *src)
{
    const char *func = "ft_index_add";
    FT_TRY(ft_cuda_use_device(t->device.index, func));
    int *flag = NULL;
    FT_TRY(flag_new(&flag, func));
    const Span s = span_of(t, dim);
    const int64_t n = index->shape[0];
    const int grid = grid_for(s.outer * n * s.inner);
    const int is64 = index->dtype == FT_I64;
    if (t->dtype == FT_F64)
        index_add_kernel<double><<<grid, INDEX_THREADS>>>(
            (double *)t->data, (const double *)src->data, index->data, is64, s, n, flag);
    else
        index_add_kernel<float><<<grid, INDEX_THREADS>>>(
            (float *)t->data, (const float *)src->data, index->data, is64, s, n, flag);
    ft_status st = ft_cuda_check_launch(func, __FILE__, __LINE__);
    ft_status chk = flag_check(flag, s.size, func);
    return st == FT_OK ? chk : st;
}
