/*
 * device.c - CUDA devices as the rest of lib/ sees them: discovery, names,
 * synchronisation, events, memory from the stream-ordered pool allocator
 * and its statistics, and CUDA errors as ft_status. In a build without
 * CUDA every entry point says so; the CPU side needs none of this.
 *
 * Memory comes from each device's default memory pool (cudaMallocAsync on
 * the legacy default stream). The pool keeps freed memory for reuse
 * (release threshold: unlimited), and its attributes give the in-use,
 * peak and reserved bytes that ft.memory_stats("cuda") reports.
 */
#include "internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef FT_HAVE_CUDA

ft_status ft_cuda_fail(int err, const char *func, const char *expr,
                       const char *file, int line)
{
    cudaError_t e = (cudaError_t)err;
    const char *base = strrchr(file, '/');
    cudaGetLastError(); /* clear a non-sticky error so the session goes on */
    return ft_fail(e == cudaErrorMemoryAllocation ? FT_ERR_NOMEM : FT_ERR_DEVICE, func, 0,
                   "%s failed: %s (%s, %s:%d)", expr, cudaGetErrorString(e),
                   cudaGetErrorName(e), base ? base + 1 : file, line);
}

ft_status ft_cuda_check_launch(const char *func, const char *file, int line)
{
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess && getenv("FT_CUDA_SYNC"))
        e = cudaDeviceSynchronize();
    if (e != cudaSuccess)
        return ft_cuda_fail((int)e, func, "kernel launch", file, line);
    return FT_OK;
}

int ft_cuda_built(void) { return 1; }

int ft_cuda_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n;
}

static ft_status check_index(const char *func, int arg, int index)
{
    int n = ft_cuda_device_count();
    if (n == 0)
        return ft_fail(FT_ERR_UNSUPPORTED, func, arg,
                       "no CUDA device is available on this machine");
    if (index < 0 || index >= n)
        return ft_fail(FT_ERR_ARGUMENT, func, arg,
                       "CUDA device %d does not exist (%d device%s: 0..%d)", index, n,
                       n == 1 ? "" : "s", n - 1);
    return FT_OK;
}

ft_status ft_cuda_use_device(int index, const char *func)
{
    int current = -1;
    if (cudaGetDevice(&current) == cudaSuccess && current == index)
        return FT_OK;
    FT_CUDA_TRY(func, cudaSetDevice(index));
    return FT_OK;
}

ft_status ft_cuda_device_name(int index, char *buf, size_t size)
{
    FT_TRY(check_index("ft_cuda_device_name", 1, index));
    struct cudaDeviceProp prop;
    FT_CUDA_TRY("ft_cuda_device_name", cudaGetDeviceProperties(&prop, index));
    if (buf && size)
        snprintf(buf, size, "%s", prop.name);
    return FT_OK;
}

ft_status ft_cuda_synchronize(int index)
{
    FT_TRY(check_index("ft_cuda_synchronize", 1, index));
    FT_TRY(ft_cuda_use_device(index, "ft_cuda_synchronize"));
    FT_CUDA_TRY("ft_cuda_synchronize", cudaDeviceSynchronize());
    return FT_OK;
}

ft_status ft_cuda_device_check(const char *func, int arg, int index)
{
    return check_index(func, arg, index);
}

/* The device's default pool, set once to keep freed memory for reuse. */
static ft_status device_pool(int index, cudaMemPool_t *pool, const char *func)
{
    FT_CUDA_TRY(func, cudaDeviceGetDefaultMemPool(pool, index));
    uint64_t keep = UINT64_MAX;
    FT_CUDA_TRY(func, cudaMemPoolSetAttribute(*pool, cudaMemPoolAttrReleaseThreshold, &keep));
    return FT_OK;
}

ft_status ft_device_alloc(void **p, size_t nbytes, ft_device device, const char *func)
{
    *p = NULL;
    FT_TRY(check_index(func, 0, device.index));
    FT_TRY(ft_cuda_use_device(device.index, func));
    cudaMemPool_t pool;
    FT_TRY(device_pool(device.index, &pool, func));
    cudaError_t e = cudaMallocAsync(p, nbytes ? nbytes : 1, 0);
    if (e != cudaSuccess) {
        *p = NULL;
        cudaGetLastError();
        return ft_fail(e == cudaErrorMemoryAllocation ? FT_ERR_NOMEM : FT_ERR_DEVICE, func, 0,
                       "out of memory allocating %zu bytes on cuda:%d (%s)", nbytes,
                       device.index, cudaGetErrorString(e));
    }
    return FT_OK;
}

ft_status ft_device_upload(void *dst, const void *src, size_t nbytes, ft_device device,
                           const char *func)
{
    FT_TRY(ft_cuda_use_device(device.index, func));
    FT_CUDA_TRY(func, cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyHostToDevice, 0));
    return FT_OK;
}

void ft_device_free(void *p, ft_device device)
{
    if (!p)
        return;
    int current = -1;
    cudaGetDevice(&current);
    if (current != device.index)
        cudaSetDevice(device.index);
    cudaFreeAsync(p, 0);
    cudaGetLastError(); /* a free has no one to report to */
}

ft_status ft_cuda_memory_stats(int index, ft_memory_stats *out)
{
    const char *func = "ft_memory_stats_get";
    FT_TRY(check_index(func, 1, index));
    cudaMemPool_t pool;
    FT_TRY(device_pool(index, &pool, func));
    uint64_t used = 0, high = 0, reserved = 0;
    FT_CUDA_TRY(func, cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used));
    FT_CUDA_TRY(func, cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high));
    FT_CUDA_TRY(func, cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved));
    out->in_use = (int64_t)used;
    out->peak = (int64_t)high;
    out->reserved = (int64_t)reserved;
    return FT_OK;
}

ft_status ft_cuda_reset_peak(int index)
{
    const char *func = "ft_reset_peak_memory";
    FT_TRY(check_index(func, 1, index));
    cudaMemPool_t pool;
    FT_TRY(device_pool(index, &pool, func));
    uint64_t zero = 0; /* resets the high-water mark to the current use */
    FT_CUDA_TRY(func, cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero));
    return FT_OK;
}

struct ft_event {
    ft_device device;
    cudaEvent_t event;
};

ft_status ft_event_create(ft_event **out, ft_device device)
{
    if (!out)
        return ft_fail(FT_ERR_ARGUMENT, "ft_event_create", 0, "result pointer is NULL");
    *out = NULL;
    if (device.type != FT_CUDA)
        return ft_fail(FT_ERR_ARGUMENT, "ft_event_create", 1,
                       "events time CUDA work; use a CUDA device");
    FT_TRY(check_index("ft_event_create", 1, device.index));
    FT_TRY(ft_cuda_use_device(device.index, "ft_event_create"));
    ft_event *e = calloc(1, sizeof *e);
    if (!e)
        return ft_fail(FT_ERR_NOMEM, "ft_event_create", 0, "out of memory");
    e->device = device;
    cudaError_t err = cudaEventCreate(&e->event);
    if (err != cudaSuccess) {
        free(e);
        return ft_cuda_fail((int)err, "ft_event_create", "cudaEventCreate", __FILE__, __LINE__);
    }
    *out = e;
    return FT_OK;
}

ft_status ft_event_record(ft_event *e)
{
    if (!e)
        return ft_fail(FT_ERR_ARGUMENT, "ft_event_record", 1, "event expected");
    FT_TRY(ft_cuda_use_device(e->device.index, "ft_event_record"));
    FT_CUDA_TRY("ft_event_record", cudaEventRecord(e->event, 0));
    return FT_OK;
}

ft_status ft_event_elapsed_ms(const ft_event *start, const ft_event *end, double *ms)
{
    if (!start || !end)
        return ft_fail(FT_ERR_ARGUMENT, "ft_event_elapsed_ms", start ? 2 : 1, "event expected");
    if (!ms)
        return ft_fail(FT_ERR_ARGUMENT, "ft_event_elapsed_ms", 0, "result pointer is NULL");
    float t = 0;
    FT_CUDA_TRY("ft_event_elapsed_ms", cudaEventSynchronize(end->event));
    FT_CUDA_TRY("ft_event_elapsed_ms", cudaEventElapsedTime(&t, start->event, end->event));
    *ms = t;
    return FT_OK;
}

void ft_event_free(ft_event *e)
{
    if (!e)
        return;
    cudaEventDestroy(e->event);
    cudaGetLastError();
    free(e);
}

#else /* no CUDA in this build */

static ft_status no_cuda(const char *func)
{
    return ft_fail(FT_ERR_UNSUPPORTED, func, 1, "flashtile was built without CUDA");
}

int ft_cuda_built(void) { return 0; }
int ft_cuda_device_count(void) { return 0; }

ft_status ft_cuda_device_name(int index, char *buf, size_t size)
{
    (void)index;
    if (buf && size)
        buf[0] = '\0';
    return no_cuda("ft_cuda_device_name");
}

ft_status ft_cuda_synchronize(int index)
{
    (void)index;
    return no_cuda("ft_cuda_synchronize");
}

ft_status ft_cuda_device_check(const char *func, int arg, int index)
{
    (void)arg, (void)index;
    return no_cuda(func);
}

ft_status ft_device_alloc(void **p, size_t nbytes, ft_device device, const char *func)
{
    (void)nbytes, (void)device;
    *p = NULL;
    return no_cuda(func);
}

ft_status ft_device_upload(void *dst, const void *src, size_t nbytes, ft_device device,
                           const char *func)
{
    (void)dst, (void)src, (void)nbytes, (void)device;
    return no_cuda(func);
}

void ft_device_free(void *p, ft_device device) { (void)p, (void)device; }

ft_status ft_cuda_memory_stats(int index, ft_memory_stats *out)
{
    (void)index, (void)out;
    return no_cuda("ft_memory_stats_get");
}

ft_status ft_cuda_reset_peak(int index)
{
    (void)index;
    return no_cuda("ft_reset_peak_memory");
}

ft_status ft_event_create(ft_event **out, ft_device device)
{
    (void)device;
    if (out)
        *out = NULL;
    return no_cuda("ft_event_create");
}

ft_status ft_event_record(ft_event *e)
{
    (void)e;
    return no_cuda("ft_event_record");
}

ft_status ft_event_elapsed_ms(const ft_event *start, const ft_event *end, double *ms)
{
    (void)start, (void)end, (void)ms;
    return no_cuda("ft_event_elapsed_ms");
}

void ft_event_free(ft_event *e) { (void)e; }

#endif
