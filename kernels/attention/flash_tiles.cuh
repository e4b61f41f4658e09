/*
 * flash_tiles.cuh - the flash kernels' tile shapes: one table per kernel
 * family and pass, a row per range of head dims, with named fields and the
 * reason for each choice (the measurements are in kernels/README.md), and
 * flash_pick, which runs a launcher instantiated for the row that takes a
 * head dim. Launchers read their template arguments from these rows and
 * nothing else, so a shape is changed here and only here.
 */
#ifndef FT_FLASH_TILES_CUH
#define FT_FLASH_TILES_CUH

/* A row index fixed at compile time. */
template <int I> struct TileRow {
    static constexpr int value = I;
};

#ifndef __CUDACC_RTC__
/* f(TileRow<i>()) for the first row i of table (rows in increasing max_d)
 * with max_d >= d; the last row takes anything above. */
template <int I = 0, typename Row, int N, typename F>
static ft_status flash_pick(const Row (&table)[N], int d, F f)
{
    if constexpr (I + 1 < N) {
        if (d <= table[I].max_d)
            return f(TileRow<I>());
        return flash_pick<I + 1>(table, d, f);
    } else {
        (void)table, (void)d;
        return f(TileRow<I>());
    }
}
#endif

/* mma.sync forward (flash_fwd.cu): D the head dim rounded up, BC keys a
 * block, MT m-tiles of 16 rows a warp. */
struct MmaFwdTile {
    int max_d, D, BC, MT;
    const char *why;
};
static constexpr MmaFwdTile MMA_FWD_TILES[] = {
    {64, 64, 64, 2, "two m-tiles a warp: one left the kernel bound by ldmatrix"},
    {128, 128, 64, 2, "as d <= 64, with 128-wide rows"},
    {256, 256, 32, 1, "O of 16 rows x 256 takes 128 registers a thread: one m-tile, 32-key blocks"},
};

/* mma.sync backward (flash_bwd.cu): BC keys a dK/dV CTA, DSPLIT warps
 * sharing a key slice's head dim. */
struct MmaBwdTile {
    int max_d, D, BC, DSPLIT;
    const char *why;
};
static constexpr MmaBwdTile MMA_BWD_TILES[] = {
    {64, 64, 64, 1, "one warp a 16-key slice, the whole head dim"},
    {128, 128, 64, 1, "as d <= 64"},
    {256, 256, 32, 2, "dK and dV of 256 columns split over two warps a slice"},
};

/* Hopper forward (flash_fwd_sm90.cu): D the width of O and P V, DK the
 * columns Q K^T multiplies, BC keys a block, NWG warpgroups of 64 rows,
 * MINB CTAs an SM, turns: the warpgroups take turns issuing products. */
struct Sm90FwdTile {
    int max_d, D, DK, BC, NWG, MINB;
    bool turns;
    const char *why;
};
static constexpr Sm90FwdTile SM90_FWD_TILES[] = {
    {32, 32, 32, 64, 2, 2, false, "64-key blocks, two CTAs an SM; the ones column sums P"},
    {64, 64, 64, 64, 2, 2, false, "64-key blocks and two CTAs an SM measured best at d <= 64"},
    {96, 128, 96, 128, 2, 1, true, "128-key blocks; turns measured faster at d = 96 and 128"},
    {128, 128, 128, 128, 2, 1, true, "128-key blocks, turns"},
    {192, 256, 192, 64, 2, 1, false, "O takes 128 registers a thread: 64-key blocks; ones column"},
    {256, 256, 256, 64, 2, 1, false, "as d <= 192"},
};

/* Hopper forward, warp-specialised (flash_fwd_ws_kernel in
 * flash_fwd_sm90.cu): 64 query rows a consumer warpgroup, 2 or 3 of them
 * (consumers) and a producer, BC keys a block, STAGES K and V stages,
 * turns_min_keys: the consumers take turns issuing products. It runs when
 * a call has at least min_keys keys (min_keys_causal under the causal
 * mask): below, its longer start and end
 * (one CTA an SM, barriers, the first product with nothing to overlap)
 * weigh more than its faster loop and the wgmma kernel above is faster.
 * BC = 0: the wgmma kernel at any length. Where a block of rows sees up
 * to persist_max_keys keys (a call that long, or a window bounded on both
 * sides) its persistent form (flash_fwd_ws_persistent_kernel, D = 128
 * and two consumers only) takes the call: one CTA an SM walking the
 * tiles, the next tile's copies under this one's end. Measured on the
 * H200, bf16 and f16 (kernels/README.md). */
struct Sm90WsFwdTile {
    int max_d, D, DK, BC, STAGES, consumers; /* consumer warpgroups, 64 rows each */
    int turns_min_keys; /* from a block of rows seeing this many keys (0: never) */
    int min_keys, min_keys_causal, persist_max_keys;
    /* the EXT instantiation's (the variants: more state a thread); 0:
     * the plain row's */
    int ext_BC, ext_consumers, ext_min_keys;
    const char *why;
};
static constexpr Sm90WsFwdTile SM90_WS_FWD_TILES[] = {
    {32, 32, 32, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, "the wgmma kernel (two CTAs an SM) is faster at every length"},
    {64, 64, 64, 128, 2, 3, 0, 2048, 2048, 0, 192, 2, 4096,
     "three consumers (latency-bound with two): 1.02x-1.15x of two with 192-key blocks "
     "(0.97x-1.00x causal at 16384 keys); 128-key blocks (128 registers); from 2048 keys "
     "(1.14x non-causal, 1.00x-1.03x causal over the wgmma kernel; at 1024, 0.85x-0.99x); "
     "with two consumers turns were 0.99x-1.04x. The variants keep two consumers, 192-key "
     "blocks from 4096 keys: with three, 128 registers spill 56-96 bytes there (unmeasured)"},
    {96, 128, 96, 128, 2, 2, 0, 0, 4096, 4096, 0, 0, 0,
     "128-key blocks; causal below 4096 keys: the wgmma kernel; persistent up to 4096 keys "
     "(of the others: 1.14x-1.38x at 1024 keys, 1.07x-1.41x at 2048, 1.01x-1.06x at 4096; "
     "at 16384, 0.66x-1.01x in an earlier tile order)"},
    {128, 128, 128, 128, 2, 2, 8192, 0, 4096, 4096, 0, 0, 0,
     "128-key blocks; causal below 4096 keys: the wgmma kernel; persistent as d <= 96; "
     "turns from 8192 keys (bf16, with the lazy maximum: 1.01x-1.03x plain, 1.06x-1.17x "
     "softcap and ALiBi at 16384 keys; 0.95x-0.99x at 1024 and 4096)"},
    {192, 256, 192, 64, 2, 2, 0, 0, 0, 0, 0, 0, 0, "O takes 128 registers a thread: 64-key blocks; ones column"},
    {256, 256, 256, 64, 2, 2, 0, 0, 0, 0, 0, 0, 0, "as d <= 192"},
};

/* Hopper backward (flash_bwd_sm90.cu): BM queries a dK/dV step, BC keys a
 * dQ step; wide: the two-warpgroup kernels for DK 192 and 256, where dK and
 * dV of 64 rows do not fit one warpgroup's registers. */
struct Sm90BwdTile {
    int max_d, D, DK, BM, BC;
    bool turns, wide;
    const char *why;
};
static constexpr Sm90BwdTile SM90_BWD_TILES[] = {
    {32, 32, 32, 128, 128, false, false, "128-row steps: little work a step at d = 32"},
    {64, 64, 64, 128, 128, true, false, "128-row steps, turns"},
    {96, 128, 96, 64, 64, false, false, "64-row steps: dK and dV of 128 columns fill the registers"},
    {128, 128, 128, 64, 64, false, false, "as d <= 96"},
    {192, 256, 192, 64, 64, false, true, "wide kernels: the warpgroups split S and dP"},
    {256, 256, 256, 64, 64, false, true, "wide kernels"},
};

#endif
