/*
 * elementwise.cu - ft_cuda_binary, ft_cuda_binary_scalar and
 * ft_cuda_unary, the CUDA half of lib/ops.c's elementwise ops: strided
 * operands of any dtype, each element loaded as a double, the op applied
 * in double by scalar_ops.h's ft_apply_binop / ft_apply_unop (the CPU's
 * own functions; x^y exact where CUDA's pow may be an ulp off), the result
 * stored with the CPU's rounding. The same bits as the CPU up to the last
 * bit of the device's exp, log, tanh and pow, which the rounding to f32 or
 * narrower almost always hides. Check: spec/cuda_ops_spec.lua (busted, tag
 * gpu) against the CPU. Design: kernels/README.md.
 */
#include "common.cuh"

enum scalar_mode {
    SCALAR_NONE,  /* out = a op b */
    SCALAR_AFTER, /* out = a op s */
    SCALAR_FIRST  /* out = s op a */
};

/* Operands: 0 out, 1 a, 2 b (unused, strides 0, when a scalar is given). */
__global__ void __launch_bounds__(BLOCK)
binary_kernel(geo g, void *out, int odt, const void *a, int adt,
              const void *b, int bdt, int op, double s, int smode, int64_t n)
{
    const int64_t step = (int64_t)gridDim.x * BLOCK;
    for (int64_t base = (int64_t)blockIdx.x * BLOCK + threadIdx.x; base < n;
         base += step * UNROLL) {
        int64_t off[UNROLL][3];
        const int cnt = unrolled_offsets<3>(g, base, step, n, off);
        double x[UNROLL], y[UNROLL];
        load_many<3>(a, adt, off, 1, cnt, x);
        if (smode == SCALAR_NONE)
            load_many<3>(b, bdt, off, 2, cnt, y);
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            if (smode == SCALAR_NONE)
                x[u] = ft_apply_binop(op, x[u], y[u]);
            else if (smode == SCALAR_AFTER)
                x[u] = ft_apply_binop(op, x[u], s);
            else
                x[u] = ft_apply_binop(op, s, x[u]);
        }
        store_many<3>(out, odt, off, 0, cnt, x);
    }
}

/* Operands: 0 out, 1 a. */
__global__ void __launch_bounds__(BLOCK)
unary_kernel(geo g, void *out, int odt, const void *a, int adt, int op,
             int64_t n)
{
    const int64_t step = (int64_t)gridDim.x * BLOCK;
    for (int64_t base = (int64_t)blockIdx.x * BLOCK + threadIdx.x; base < n;
         base += step * UNROLL) {
        int64_t off[UNROLL][2];
        const int cnt = unrolled_offsets<2>(g, base, step, n, off);
        double x[UNROLL];
        load_many<2>(a, adt, off, 1, cnt, x);
#pragma unroll
        for (int u = 0; u < UNROLL; u++)
            x[u] = ft_apply_unop(op, x[u]);
        store_many<2>(out, odt, off, 0, cnt, x);
    }
}

static ft_status binary_launch(const char *F, ft_tensor *out, ft_binop op,
                               const ft_tensor *a, const ft_tensor *b, double s,
                               int smode)
{
    FT_TRY(ft_cuda_use_device(a->device.index, F));
    const int64_t n = ft_numel(a);
    if (n == 0)
        return FT_OK;
    const int64_t *strides[3] = {out->stride, a->stride,
                                 b ? b->stride : out->stride};
    /* A scalar's operand row stays all zeros: geo_make sees two operands. */
    const geo g = geo_make(a->ndim, a->shape, b ? 3 : 2, strides);
    binary_kernel<<<grid_for(n, BLOCK * UNROLL, MAX_GRID), BLOCK>>>(
        g, out->data, (int)out->dtype, a->data, (int)a->dtype,
        b ? b->data : NULL, b ? (int)b->dtype : (int)a->dtype, (int)op, s,
        smode, n);
    FT_CUDA_CHECK_LAUNCH(F);
    return FT_OK;
}

ft_status ft_cuda_binary(ft_tensor *out, ft_binop op, const ft_tensor *a,
                         const ft_tensor *b)
{
    return binary_launch("ft_binary", out, op, a, b, 0.0, SCALAR_NONE);
}

ft_status ft_cuda_binary_scalar(ft_tensor *out, ft_binop op,
                                const ft_tensor *a, double s, int scalar_first)
{
    return binary_launch("ft_binary_scalar", out, op, a, NULL, s,
                         scalar_first ? SCALAR_FIRST : SCALAR_AFTER);
}

ft_status ft_cuda_unary(ft_tensor *out, ft_unop op, const ft_tensor *a)
{
    static const char *const F = "ft_unary";
    FT_TRY(ft_cuda_use_device(a->device.index, F));
    const int64_t n = ft_numel(a);
    if (n == 0)
        return FT_OK;
    const int64_t *strides[2] = {out->stride, a->stride};
    const geo g = geo_make(a->ndim, a->shape, 2, strides);
    unary_kernel<<<grid_for(n, BLOCK * UNROLL, MAX_GRID), BLOCK>>>(
        g, out->data, (int)out->dtype, a->data, (int)a->dtype, (int)op, n);
    FT_CUDA_CHECK_LAUNCH(F);
    return FT_OK;
}
