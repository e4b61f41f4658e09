/*
 * memory.c - tensor storage: allocation, reference counts and the CPU
 * memory statistics (bytes in use and the peak since the last reset).
 *
 * The counters are per process, like the CUDA pool's: memory is a
 * process-wide resource, and every Lua state of a host shares it. CUDA
 * storage comes from device.c, whose pool keeps its own counters.
 */
#define _POSIX_C_SOURCE 200809L /* sysconf */
#include "internal.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define FT_ALIGNMENT 64 /* a cache line; also enough for any SIMD load */

static atomic_llong cpu_in_use;
static atomic_llong cpu_peak;
static atomic_llong all_in_use;                /* CPU and CUDA storage */
static _Thread_local int64_t thread_allocated; /* by this thread, ever */

/* Counted for every device, before the device-specific counters. */
static void count_storage(size_t nbytes)
{
    thread_allocated += (int64_t)nbytes;
    atomic_fetch_add(&all_in_use, (long long)nbytes);
}

int64_t ft_thread_allocated_bytes(void) { return thread_allocated; }

int64_t ft_storage_in_use(void) { return (int64_t)atomic_load(&all_in_use); }

/* The machine's physical memory in bytes (infinite where unknown), asked
 * once: sysconf(_SC_PHYS_PAGES) is a sysinfo system call, which every CPU
 * allocation paid before (about 7% of a small attention call's time). Two
 * threads asking at once both store the same value. */
static double physical_bytes(void)
{
    static _Atomic double known; /* 0: not asked yet */
    double v = atomic_load(&known);
    if (v == 0) {
        long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGESIZE);
        v = pages > 0 && size > 0 ? (double)pages * (double)size : 1e300;
        atomic_store(&known, v);
    }
    return v;
}

static void count_alloc(long long nbytes)
{
    long long now = atomic_fetch_add(&cpu_in_use, nbytes) + nbytes;
    long long peak = atomic_load(&cpu_peak);
    while (now > peak && !atomic_compare_exchange_weak(&cpu_peak, &peak, now))
        ;
}

ft_status ft_storage_new(ft_storage **out, size_t nbytes, ft_device device,
                         const char *func)
{
    *out = NULL;
    ft_storage *s = malloc(sizeof *s);
    if (!s)
        return ft_fail(FT_ERR_NOMEM, func, 0, "out of memory");
    if (device.type == FT_CUDA) { /* counted by the device's pool */
        ft_status st = ft_device_alloc(&s->data, nbytes, device, func);
        if (st != FT_OK) {
            free(s);
            return st;
        }
        count_storage(nbytes);
        atomic_init(&s->refcount, 1);
        s->nbytes = nbytes;
        s->device = device;
        *out = s;
        return FT_OK;
    }
    /* More than the machine's memory is never a real tensor: where the
     * kernel overcommits, malloc would give it and the first walk over it
     * would run until the machine gave out. */
    if ((double)nbytes > physical_bytes()) {
        free(s);
        return ft_fail(FT_ERR_NOMEM, func, 0,
                       "out of memory: %zu bytes is more than this machine's memory (%.0f bytes)",
                       nbytes, physical_bytes());
    }
    /* aligned_alloc wants a multiple of the alignment, and never 0. */
    size_t rounded = (nbytes + FT_ALIGNMENT - 1) / FT_ALIGNMENT * FT_ALIGNMENT;
    if (rounded < nbytes) {
        free(s);
        return ft_fail(FT_ERR_NOMEM, func, 0, "out of memory (%zu bytes)", nbytes);
    }
    s->data = aligned_alloc(FT_ALIGNMENT, rounded ? rounded : FT_ALIGNMENT);
    if (!s->data) {
        free(s);
        return ft_fail(FT_ERR_NOMEM, func, 0,
                       "out of memory allocating %zu bytes on cpu", nbytes);
    }
    atomic_init(&s->refcount, 1);
    s->nbytes = nbytes;
    s->device = device;
    count_alloc((long long)nbytes);
    count_storage(nbytes);
    *out = s;
    return FT_OK;
}

void ft_storage_retain(ft_storage *s) { atomic_fetch_add(&s->refcount, 1); }

void ft_storage_release(ft_storage *s)
{
    if (!s || atomic_fetch_sub(&s->refcount, 1) != 1)
        return;
    atomic_fetch_sub(&all_in_use, (long long)s->nbytes);
    if (s->device.type == FT_CUDA) {
        ft_device_free(s->data, s->device);
    } else {
        atomic_fetch_sub(&cpu_in_use, (long long)s->nbytes);
        free(s->data);
    }
    free(s);
}

ft_status ft_memory_stats_get(ft_device device, ft_memory_stats *out)
{
    if (!out)
        return ft_fail(FT_ERR_ARGUMENT, "ft_memory_stats_get", 0, "result pointer is NULL");
    if (device.type == FT_CUDA)
        return ft_cuda_memory_stats(device.index, out);
    out->in_use = atomic_load(&cpu_in_use);
    out->peak = atomic_load(&cpu_peak);
    out->reserved = out->in_use;
    return FT_OK;
}

ft_status ft_reset_peak_memory(ft_device device)
{
    if (device.type == FT_CUDA)
        return ft_cuda_reset_peak(device.index);
    atomic_store(&cpu_peak, atomic_load(&cpu_in_use));
    return FT_OK;
}
