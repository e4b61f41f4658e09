/*
 * mods_mask.cuh - a Lua-written mask evaluated over a whole call on the
 * GPU, once (ft.block_mask on CUDA): how many pairs each block_q x block_k
 * tile keeps, and the band that holds every kept pair (the most a kept
 * key lies left and right of its query's diagonal, bottom-right aligned
 * as a window is). rtc.cu compiles it with the mask's FtUserMod; the
 * attention call then runs the flash kernels with that band as its
 * window, so that they skip the tiles outside it as a window's. Also
 * the inner band: how far left and right of the diagonal every key is
 * kept, on every row (keys past either end count as kept; -1 when some
 * row drops its diagonal key); the kernels leave the mask out of the
 * tiles inside it, as the built-in masks are left out of the tiles they
 * do not cut.
 * cells: [B, H, nqb, nkb] counts, zero on entry; band: {left, right,
 * inner left, inner right}, INT_MIN, INT_MIN, INT_MAX, INT_MAX on entry.
 * One thread a query row.
 */
#ifndef FT_MODS_MASK_CUH
#define FT_MODS_MASK_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>

template <typename UM>
__global__ void ft_block_mask_kernel(int B, int H, int Nq, int Nk, int bq, int bk, int nqb,
                                     int nkb, int *cells, int *band)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int shift = Nk - Nq, none = -2147483647 - 1, all = 2147483647;
    int left = none, right = none, in_left = all, in_right = all;
    if (i < Nq) {
        const typename UM::Ctx uc = UM::prepare(b, h);
        int *row = cells + (((long long)b * H + h) * nqb + i / bq) * nkb;
        int cell = 0, next = bk, count = 0;
        const int d = i + shift; /* the diagonal's key */
        int drop_le = -1, drop_ge = Nk; /* the nearest dropped keys at or left, right of d */
        for (int j = 0; j < Nk; j++) {
            if (j == next) { /* the next tile of keys */
                if (count)
                    atomicAdd(row + cell, count);
                cell++, next += bk, count = 0;
            }
            if (UM::keep(uc, i, j, (float)(i + 1), (float)(j + 1))) {
                count++;
                left = max(left, i + shift - j);
                right = max(right, j - i - shift);
            } else if (j <= d) {
                drop_le = j;
                if (j == d)
                    drop_ge = j;
            } else if (drop_ge == Nk) {
                drop_ge = j;
            }
        }
        if (count)
            atomicAdd(row + cell, count);
        if (drop_le == d && d >= 0 && d < Nk) {
            in_left = in_right = -1; /* its diagonal dropped: no inner band */
        } else {
            in_left = drop_le < 0 ? all : d - drop_le - 1;
            in_right = drop_ge >= Nk ? all : drop_ge - d - 1;
        }
    }
    for (int o = 16; o > 0; o /= 2) {
        left = max(left, __shfl_xor_sync(0xffffffffu, left, o));
        right = max(right, __shfl_xor_sync(0xffffffffu, right, o));
        in_left = min(in_left, __shfl_xor_sync(0xffffffffu, in_left, o));
        in_right = min(in_right, __shfl_xor_sync(0xffffffffu, in_right, o));
    }
    if (threadIdx.x % 32 == 0) {
        if (left != none) {
            atomicMax(band, left);
            atomicMax(band + 1, right);
        }
        atomicMin(band + 2, in_left);
        atomicMin(band + 3, in_right);
    }
}

#endif
