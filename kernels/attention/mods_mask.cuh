/*
 * mods_mask.cuh - a Lua-written mask evaluated over a whole call on the
 * GPU, once (ft.block_mask on CUDA): how many pairs each block_q x block_k
 * tile keeps, and the band that holds every kept pair (the most a kept
 * key lies left and right of its query's diagonal, bottom-right aligned
 * as a window is). rtc.cu compiles it with the mask's FtUserMod; the
 * attention call then runs the flash kernels with that band as its
 * window, so that they skip the tiles outside it as a window's.
 * cells: [B, H, nqb, nkb] counts, zero on entry; band: {left, right},
 * INT_MIN on entry. One thread a query row.
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
    const int shift = Nk - Nq, none = -2147483647 - 1;
    int left = none, right = none;
    if (i < Nq) {
        const typename UM::Ctx uc = UM::prepare(b, h);
        int *row = cells + (((long long)b * H + h) * nqb + i / bq) * nkb;
        int cell = 0, next = bk, count = 0;
        for (int j = 0; j < Nk; j++) {
            if (j == next) { /* the next tile of keys */
                if (count)
                    atomicAdd(row + cell, count);
                cell++, next += bk, count = 0;
            }
            if (UM::keep(uc, i, j)) {
                count++;
                left = max(left, i + shift - j);
                right = max(right, j - i - shift);
            }
        }
        if (count)
            atomicAdd(row + cell, count);
    }
    for (int o = 16; o > 0; o /= 2) {
        left = max(left, __shfl_xor_sync(0xffffffffu, left, o));
        right = max(right, __shfl_xor_sync(0xffffffffu, right, o));
    }
    if (threadIdx.x % 32 == 0 && left != none) {
        atomicMax(band, left);
        atomicMax(band + 1, right);
    }
}

#endif
