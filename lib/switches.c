/*
 * switches.c - the kernel switches: names under which flashtile takes
 * another kernel than its default, for comparison. FT_NO_WGMMA (the
 * mma.sync kernels on Hopper), FT_NO_WS (the wgmma kernels, not the
 * warp-specialised ones), FT_WS (the warp-specialised forward that is not
 * persistent, at any length), FT_PERSIST (the persistent forward at any
 * length: f16 and bf16 at head dims 65 to 128, and fp8; a causal walk
 * then takes the tiles in order of length), FT_NO_PERSIST
 * (never it), FT_NO_DECODE
 * (no decoding kernels), FT_LAZY_RESCALE and FT_NO_LAZY_RESCALE (the Hopper forward keeps a
 * row's running maximum until a block raises it by more than 2^8,
 * rescaling O only then: at every head dim, or at none; by default at
 * head dims 65 to 128), FT_TURNS and FT_NO_TURNS (the consumer
 * warpgroups of the d 128 warp-specialised forward take turns issuing
 * their products: at any length, or never; by default from 8192 keys),
 * FT_NO_CAP_MAX (a bf16 softcap's rows, and those of a bf16 Lua-written
 * score whose range is narrow, keep a running maximum, as other calls do,
 * instead of taking the score's top as their maximum), FT_NO_DECODE_WS
 * (the decoding kernel whose four warps copy and compute in turn, not the
 * one with four more warps that only copy), FT_NO_FP8_MMA (fp8_e4m3
 * attention through the bf16 kernels on converted inputs, not the fp8
 * tensor-core kernel);
 * kernels/README.md says what each kernel is.
 *
 * A switch is on when ft_set_switch turned it on, off when it turned it
 * off, and otherwise (at the start, or after on = -1) as the environment
 * variable of the same name says: on when set to anything but "" or "0".
 * Turning one from a program lets a benchmark time both kernels in one
 * process, one after the other (scripts/bench.lua --impl flash+NAME,flash):
 * separate runs of the same kernel on the H200 differed by up to 10%.
 *
 * Check: spec/switches_spec.lua; the GPU specs under each switch are
 * ctest's *_mma, *_nows, *_ws and *_persist.
 */
#include "internal.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

static const char *const names[] = {"FT_NO_WGMMA",     "FT_NO_WS",           "FT_WS",
                                    "FT_PERSIST",      "FT_NO_PERSIST",      "FT_NO_DECODE",
                                    "FT_LAZY_RESCALE", "FT_NO_LAZY_RESCALE", "FT_TURNS",
                                    "FT_NO_TURNS",     "FT_NO_CAP_MAX",   "FT_NO_DECODE_WS",
                                    "FT_NO_FP8_MMA"};
enum { NSWITCHES = sizeof names / sizeof names[0] };
static atomic_int state[NSWITCHES]; /* 0: the environment's; 1: on; 2: off */

static int find(const char *name)
{
    for (int i = 0; name && i < NSWITCHES; i++)
        if (strcmp(name, names[i]) == 0)
            return i;
    return -1;
}

int ft_switch(const char *name)
{
    const int i = find(name);
    if (i < 0)
        return -1;
    const int s = atomic_load(&state[i]);
    if (s)
        return s == 1;
    const char *v = getenv(name);
    return v && *v && strcmp(v, "0") != 0;
}

ft_status ft_set_switch(const char *name, int on)
{
    static const char func[] = "ft_set_switch";
    const int i = find(name);
    if (i < 0) {
        char all[256] = "";
        size_t used = 0;
        for (int k = 0; k < NSWITCHES && used < sizeof all; k++) {
            const int w = snprintf(all + used, sizeof all - used, "%s%s", k ? ", " : "", names[k]);
            used += w > 0 ? (size_t)w : 0;
        }
        return ft_fail(FT_ERR_ARGUMENT, func, 1, "'%s' is not a switch (%s)",
                       name ? name : "(null)", all);
    }
    if (on < -1 || on > 1)
        return ft_fail(FT_ERR_ARGUMENT, func, 2,
                       "on %d: must be 1 (on), 0 (off) or -1 (as the environment says)", on);
    atomic_store(&state[i], on == 1 ? 1 : on == 0 ? 2 : 0);
    return FT_OK;
}

const char *ft_switch_name(int i)
{
    return i >= 0 && i < NSWITCHES ? names[i] : NULL;
}
