/*
 * copy.cu - ft_cuda_copy and ft_cuda_fill (the CUDA half of lib/tensor.c's
 * ft_copy and ft_fill) on strided tensors of any dtype: a copy converts as
 * the CPU's copy does (the bytes within a dtype, i32 <-> i64 saturated,
 * everything else, fp8 e4m3 included, through double with scalar_ops.h's
 * rounding), so both give the same bits; a fill stores the bytes
 * ft_store_f64 made on the host. Contiguous copies of one dtype are one
 * cudaMemcpyAsync.
 * Check: spec/cuda_ops_spec.lua and spec/gpu_spec.lua (busted, tag gpu)
 * against the CPU. Design: kernels/README.md.
 */
#include <string.h>

#include "common.cuh"

enum copy_mode {
    COPY_RAW, /* same dtype: the element's bytes */
    COPY_INT, /* i32 <-> i64 without the double's 53 bits */
    COPY_CONV /* through double, with ft_elem_store's rounding */
};

/* Operand 0 is dst, operand 1 src. */
__global__ void __launch_bounds__(BLOCK)
copy_kernel(geo g, void *dst, int ddt, const void *src, int sdt, int mode,
            int esize, int64_t n)
{
    const int64_t step = (int64_t)gridDim.x * BLOCK;
    for (int64_t base = (int64_t)blockIdx.x * BLOCK + threadIdx.x; base < n;
         base += step * UNROLL) {
        int64_t off[UNROLL][2];
        const int cnt = unrolled_offsets<2>(g, base, step, n, off);
        if (mode == COPY_RAW) {
            if (esize == 8) {
                uint64_t r[UNROLL];
                gather<uint64_t, 2>(src, off, 1, cnt, r);
                scatter<uint64_t, 2>(dst, off, 0, cnt, r);
            } else if (esize == 4) {
                uint32_t r[UNROLL];
                gather<uint32_t, 2>(src, off, 1, cnt, r);
                scatter<uint32_t, 2>(dst, off, 0, cnt, r);
            } else if (esize == 2) {
                uint16_t r[UNROLL];
                gather<uint16_t, 2>(src, off, 1, cnt, r);
                scatter<uint16_t, 2>(dst, off, 0, cnt, r);
            } else {
                uint8_t r[UNROLL];
                gather<uint8_t, 2>(src, off, 1, cnt, r);
                scatter<uint8_t, 2>(dst, off, 0, cnt, r);
            }
        } else if (mode == COPY_INT) {
            int64_t v[UNROLL];
            if (sdt == FT_I64) {
                gather<int64_t, 2>(src, off, 1, cnt, v);
            } else {
                int32_t r[UNROLL];
                gather<int32_t, 2>(src, off, 1, cnt, r);
#pragma unroll
                for (int u = 0; u < UNROLL; u++)
                    v[u] = r[u];
            }
            if (ddt == FT_I64) {
                scatter<int64_t, 2>(dst, off, 0, cnt, v);
            } else {
                int32_t r[UNROLL];
#pragma unroll
                for (int u = 0; u < UNROLL; u++)
                    r[u] = ft_i64_to_i32(v[u]);
                scatter<int32_t, 2>(dst, off, 0, cnt, r);
            }
        } else {
            double v[UNROLL];
            load_many<2>(src, sdt, off, 1, cnt, v);
            store_many<2>(dst, ddt, off, 0, cnt, v);
        }
    }
}

/* Every element of t gets the low esize bytes of bits. */
__global__ void __launch_bounds__(BLOCK)
fill_kernel(geo g, void *data, int esize, uint64_t bits, int64_t n)
{
    const int64_t step = (int64_t)gridDim.x * BLOCK;
    for (int64_t i = (int64_t)blockIdx.x * BLOCK + threadIdx.x; i < n;
         i += step) {
        int64_t off[1];
        geo_offsets<1>(g, i, off);
        if (esize == 8)
            ((uint64_t *)data)[off[0]] = bits;
        else if (esize == 4)
            ((uint32_t *)data)[off[0]] = (uint32_t)bits;
        else if (esize == 2)
            ((uint16_t *)data)[off[0]] = (uint16_t)bits;
        else
            ((uint8_t *)data)[off[0]] = (uint8_t)bits;
    }
}

ft_status ft_cuda_copy(ft_tensor *dst, const ft_tensor *src)
{
    static const char *const F = "ft_copy";
    FT_TRY(ft_cuda_use_device(dst->device.index, F));
    const int64_t n = ft_numel(dst);
    if (n == 0)
        return FT_OK;
    const int64_t *strides[2] = {dst->stride, src->stride};
    const geo g = geo_make(dst->ndim, dst->shape, 2, strides);
    const size_t esize = ft_dtype_size(dst->dtype);
    if (dst->dtype == src->dtype && g.ndim == 1 && g.stride[0][0] == 1 &&
        g.stride[1][0] == 1) {
        FT_CUDA_TRY(F, cudaMemcpyAsync(dst->data, src->data, (size_t)n * esize,
                                       cudaMemcpyDeviceToDevice, 0));
        return FT_OK;
    }
    int mode = COPY_CONV;
    if (dst->dtype == src->dtype)
        mode = COPY_RAW;
    else if (ft_dtype_is_int(dst->dtype) && ft_dtype_is_int(src->dtype))
        mode = COPY_INT;
    copy_kernel<<<grid_for(n, BLOCK * UNROLL, MAX_GRID), BLOCK>>>(
        g, dst->data, (int)dst->dtype, src->data, (int)src->dtype, mode,
        (int)esize, n);
    FT_CUDA_CHECK_LAUNCH(F);
    return FT_OK;
}

ft_status ft_cuda_fill(ft_tensor *t, double value)
{
    static const char *const F = "ft_fill";
    FT_TRY(ft_cuda_use_device(t->device.index, F));
    const int64_t n = ft_numel(t);
    if (n == 0)
        return FT_OK;
    /* Convert once on the host, exactly as the CPU fill does. */
    unsigned char bytes[8] = {0};
    ft_store_f64(bytes, t->dtype, value);
    uint64_t bits = 0;
    const size_t esize = ft_dtype_size(t->dtype);
    memcpy(&bits, bytes, esize); /* little-endian: the low bytes */
    const int64_t *strides[1] = {t->stride};
    const geo g = geo_make(t->ndim, t->shape, 1, strides);
    fill_kernel<<<grid_for(n, BLOCK, MAX_GRID), BLOCK>>>(g, t->data, (int)esize,
                                                         bits, n);
    FT_CUDA_CHECK_LAUNCH(F);
    return FT_OK;
}
