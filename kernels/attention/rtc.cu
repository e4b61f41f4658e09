/*
 * rtc.cu - the flash kernels for a call with a modification written in
 * Lua. lib/mods_cuda.c turns the mods' graph into struct FtUserMod; each
 * kernel a call launches is the kernel compiled ahead of time with
 * UM = FtUserMod, named by its template arguments (rtc_name), compiled
 * with NVRTC from the same source files (embedded in the library by
 * rtc_sources.c), loaded with the runtime's library API and kept: in
 * memory for the process, and on disk ($FT_CACHE_DIR, else
 * $XDG_CACHE_HOME/flashtile, else ~/.cache/flashtile) under a hash of the
 * library version, every embedded source, NVRTC's version, the
 * architecture, the kernel's name and the generated source. The captured
 * tensors' pointers, strides and shapes go to the module's __constant__
 * ft_mod_args before each launch (on the default stream, ordered with the
 * kernels). FT_MODS_DEBUG=1 compiles reads that set ft_mod_fault when an
 * index leaves its tensor; the call then fails.
 */
#include "flash_common.cuh"

#include <errno.h>
#include <mutex>
#include <nvrtc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* rtc_sources.c: the kernels' source files, and the headers NVRTC lacks */
extern "C" int ft_rtc_file_count(void);
extern "C" const char *ft_rtc_file_name(int i);
extern "C" const char *ft_rtc_file_text(int i);

struct FlashModTensorHost {
    const void *data;
    long long stride[4];
    int shape[4];
    float *grad;
};
struct FlashModArgsHost {
    FlashModTensorHost t[FT_RTC_MAX_TENSORS];
};

struct FlashRtc {
    char *src; /* struct FtUserMod */
    FlashModArgsHost args;
    int device, debug;
    char arch[24];
    int dry;     /* compile (or find on disk) only: no load, no launch (no GPU needed) */
    int nocache; /* dry: ignore the disk cache, compile */
};

static ft_rtc_stats rtc_stats;

static uint64_t fnv(uint64_t h, const void *data, size_t n)
{
    const unsigned char *p = (const unsigned char *)data;
    for (size_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 1099511628211ull;
    return h;
}
static uint64_t fnv_str(uint64_t h, const char *s) { return fnv(h, s, strlen(s) + 1); }

static double now_s()
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Everything a compiled kernel depends on but the call's mod and name. */
static uint64_t library_hash()
{
    static uint64_t h = 0;
    static std::once_flag once;
    std::call_once(once, [] {
        uint64_t x = fnv_str(14695981039346656037ull, FT_VERSION);
        int major = 0, minor = 0;
        nvrtcVersion(&major, &minor);
        x = fnv(x, &major, sizeof major);
        x = fnv(x, &minor, sizeof minor);
        for (int i = 0; i < ft_rtc_file_count(); i++) {
            x = fnv_str(x, ft_rtc_file_name(i));
            x = fnv_str(x, ft_rtc_file_text(i));
        }
        h = x;
    });
    return h;
}

/* The mods' FtUserMod for kernels of dtype on device, and the table of
 * its tensors. */
static ft_status rtc_new(const ft_attn_mods *mods, const ft_tensor *const *tensors,
                        float *const *grads, int dtype, int call, int device, FlashRtc **out,
                        const char *func)
{
    *out = nullptr;
    const int n = ft_attn_mods_tensors(mods);
    FlashRtc *r = (FlashRtc *)calloc(1, sizeof *r);
    if (!r)
        return ft_fail(FT_ERR_NOMEM, func, 0, "out of memory");
    const char *dbg = getenv("FT_MODS_DEBUG");
    r->debug = dbg && *dbg && strcmp(dbg, "0") != 0;
    r->device = device;
    for (int t = 0; t < n; t++) {
        const ft_tensor *x = tensors[t];
        r->args.t[t].data = x->data;
        for (int d = 0; d < x->ndim; d++) {
            r->args.t[t].stride[d] = x->stride[d];
            r->args.t[t].shape[d] = (int)x->shape[d]; /* lib/ checked: below 2^31 */
        }
        r->args.t[t].grad = grads ? grads[t] : nullptr;
    }
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
        cudaGetLastError();
        free(r);
        return ft_fail(FT_ERR_DEVICE, func, 0, "mods: cannot read CUDA device %d's properties",
                       device);
    }
    snprintf(r->arch, sizeof r->arch, "sm_%d%d%s", prop.major, prop.minor,
             prop.major == 9 && prop.minor == 0 ? "a" : "");
    r->src = ft_attn_mods_cuda_source(mods, tensors, dtype == FT_BF16, r->debug, grads != nullptr,
                                      call);
    if (!r->src) {
        free(r);
        return ft_fail(FT_ERR_NOMEM, func, 0, "out of memory for the mods' CUDA source");
    }
    *out = r;
    return FT_OK;
}

extern "C" ft_status flash_rtc_new(const ft_attn_shape *s, int dtype, int device,
                                   FlashRtc **out, const char *func)
{
    const int call = (s->mod.softcap > 0 || s->alibi ? FT_RTC_BUILTIN_SCORES : 0) |
                     (s->mod.dropout > 0 ? FT_RTC_DROPOUT : 0) |
                     (s->mask_is_band ? FT_RTC_MASK_IS_BAND : 0);
    return rtc_new(s->mods, s->mod_tensors, s->mod_gdev, dtype, call, device, out, func);
}

extern "C" void flash_rtc_free(FlashRtc *r)
{
    if (r)
        free(r->src);
    free(r);
}

/* ---- compiled kernels: in memory, on disk ---- */

struct RtcEntry {
    uint64_t key;
    cudaLibrary_t lib;
    cudaKernel_t kernel;
    char args_name[128], fault_name[128];
};
static std::mutex rtc_lock;
static RtcEntry *rtc_entries;
static int rtc_n, rtc_cap;

static RtcEntry *rtc_find(uint64_t key)
{
    for (int i = 0; i < rtc_n; i++)
        if (rtc_entries[i].key == key)
            return &rtc_entries[i];
    return nullptr;
}

/* The cache directory (made if missing), or "" when there is none. */
static void cache_dir(char *dir, size_t n)
{
    const char *e = getenv("FT_CACHE_DIR"), *x = getenv("XDG_CACHE_HOME"), *h = getenv("HOME");
    if (e && *e)
        snprintf(dir, n, "%s", e);
    else if (x && *x)
        snprintf(dir, n, "%s/flashtile", x);
    else if (h && *h)
        snprintf(dir, n, "%s/.cache/flashtile", h);
    else
        dir[0] = 0;
    if (!dir[0])
        return;
    /* each level, as mkdir -p */
    for (char *p = dir + 1; *p; p++)
        if (*p == '/') {
            *p = 0;
            mkdir(dir, 0755);
            *p = '/';
        }
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        dir[0] = 0;
}

static const char MAGIC[] = "flashtile rtc 1\n";

/* The file's three names and cubin, or false. */
static bool disk_load(const char *path, char names[3][128], char **code, size_t *size)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return false;
    bool ok = false;
    char magic[sizeof MAGIC];
    if (fread(magic, 1, sizeof MAGIC - 1, f) == sizeof MAGIC - 1 &&
        memcmp(magic, MAGIC, sizeof MAGIC - 1) == 0) {
        ok = true;
        for (int k = 0; k < 3 && ok; k++) {
            ok = fgets(names[k], 128, f) != nullptr && strlen(names[k]) > 1;
            if (ok)
                names[k][strlen(names[k]) - 1] = 0;
        }
        long at = ftell(f);
        ok = ok && at > 0 && fseek(f, 0, SEEK_END) == 0;
        long end = ok ? ftell(f) : -1;
        ok = ok && end > at && fseek(f, at, SEEK_SET) == 0;
        if (ok) {
            *size = (size_t)(end - at);
            *code = (char *)malloc(*size);
            ok = *code && fread(*code, 1, *size, f) == *size;
            if (!ok) {
                free(*code);
                *code = nullptr;
            }
        }
    }
    fclose(f);
    return ok;
}

/* Written to a temporary name and renamed, so that a reader never sees half
 * a file; a failure leaves no file and is not an error (the cache is an
 * optimisation). */
static void disk_store(const char *path, char names[3][128], const char *code, size_t size)
{
    char tmp[1200];
    snprintf(tmp, sizeof tmp, "%s.%ld.tmp", path, (long)getpid());
    FILE *f = fopen(tmp, "wb");
    if (!f)
        return;
    bool ok = fwrite(MAGIC, 1, sizeof MAGIC - 1, f) == sizeof MAGIC - 1;
    for (int k = 0; k < 3 && ok; k++)
        ok = fprintf(f, "%s\n", names[k]) > 0;
    ok = ok && fwrite(code, 1, size, f) == size;
    ok = fclose(f) == 0 && ok;
    if (!ok || rename(tmp, path) != 0)
        remove(tmp);
}

/* The CUDA toolkit's include directories for NVRTC (cuda_fp16.h,
 * cuda_bf16.h): $FT_CUDA_INCLUDE_DIR, else where the build found them. */
static int include_options(char opts[4][1100])
{
    const char *e = getenv("FT_CUDA_INCLUDE_DIR");
    const char *list = e && *e ? e : FT_CUDA_INCLUDE_DIRS;
    int n = 0;
    while (*list && n < 4) {
        const char *end = strpbrk(list, ";:");
        const size_t len = end ? (size_t)(end - list) : strlen(list);
        if (len > 0 && len < 1000)
            snprintf(opts[n++], 1100, "-I%.*s", (int)len, list);
        list += len + (end ? 1 : 0);
    }
    return n;
}

/* Compiles `file` with rtc's FtUserMod for kernel `name`: the cubin and
 * the lowered names of the kernel, ft_mod_args and ft_mod_fault. */
static ft_status compile(const FlashRtc *rtc, const char *file, const char *name,
                         char names[3][128], char **code, size_t *size, const char *func)
{
    const size_t len = strlen(rtc->src) + strlen(file) + 64;
    char *text = (char *)malloc(len);
    if (!text)
        return ft_fail(FT_ERR_NOMEM, func, 0, "out of memory");
    snprintf(text, len, "#include \"%s\"\n%s", file, rtc->src);
    const int nh = ft_rtc_file_count();
    const char **hs = (const char **)malloc(sizeof(char *) * (size_t)nh);
    const char **hn = (const char **)malloc(sizeof(char *) * (size_t)nh);
    if (!hs || !hn) {
        free(text), free(hs), free(hn);
        return ft_fail(FT_ERR_NOMEM, func, 0, "out of memory");
    }
    for (int i = 0; i < nh; i++)
        hs[i] = ft_rtc_file_text(i), hn[i] = ft_rtc_file_name(i);
    nvrtcProgram prog;
    nvrtcResult r = nvrtcCreateProgram(&prog, text, "flashtile_mods.cu", nh, hs, hn);
    free(text), free(hs), free(hn);
    if (r != NVRTC_SUCCESS)
        return ft_fail(FT_ERR_DEVICE, func, 0, "mods: NVRTC could not start: %s",
                       nvrtcGetErrorString(r));
    const char *exprs[3] = {name, "&ft_mod_args", "&ft_mod_fault"};
    for (int k = 0; k < 3; k++)
        nvrtcAddNameExpression(prog, exprs[k]);
    char arch[64], inc[4][1100];
    snprintf(arch, sizeof arch, "--gpu-architecture=%s", rtc->arch);
    const char *opts[8] = {arch, "-std=c++17", "-default-device"};
    int no = 3;
    const int ni = include_options(inc);
    for (int i = 0; i < ni; i++)
        opts[no++] = inc[i];
    r = nvrtcCompileProgram(prog, no, opts);
    ft_status st = FT_OK;
    if (r != NVRTC_SUCCESS) {
        size_t n = 0;
        nvrtcGetProgramLogSize(prog, &n);
        char *log = (char *)malloc(n + 1);
        if (log && nvrtcGetProgramLog(prog, log) == NVRTC_SUCCESS)
            log[n] = 0;
        st = ft_fail(FT_ERR_DEVICE, func, 0, "mods: NVRTC failed to compile %s for %s (%s): %.1500s",
                     name, rtc->arch, nvrtcGetErrorString(r), log ? log : "");
        free(log);
    }
    for (int k = 0; k < 3 && st == FT_OK; k++) {
        const char *low = nullptr;
        if (nvrtcGetLoweredName(prog, exprs[k], &low) != NVRTC_SUCCESS || !low ||
            strlen(low) >= 128)
            st = ft_fail(FT_ERR_INTERNAL, func, 0, "mods: no lowered name for %s", exprs[k]);
        else
            snprintf(names[k], 128, "%s", low);
    }
    if (st == FT_OK && (nvrtcGetCUBINSize(prog, size) != NVRTC_SUCCESS || *size == 0))
        st = ft_fail(FT_ERR_INTERNAL, func, 0, "mods: NVRTC gave no cubin for %s", rtc->arch);
    if (st == FT_OK) {
        *code = (char *)malloc(*size);
        if (!*code)
            st = ft_fail(FT_ERR_NOMEM, func, 0, "out of memory");
        else if (nvrtcGetCUBIN(prog, *code) != NVRTC_SUCCESS) {
            free(*code);
            *code = nullptr;
            st = ft_fail(FT_ERR_INTERNAL, func, 0, "mods: NVRTC's cubin could not be read");
        }
    }
    nvrtcDestroyProgram(&prog);
    return st;
}

/* The kernel `name` of `file` for rtc's mod: from memory, disk, or NVRTC. */
static ft_status rtc_kernel(const FlashRtc *rtc, const char *file, const char *name,
                            RtcEntry *out, const char *func)
{
    uint64_t key = fnv_str(library_hash(), rtc->arch);
    key = fnv_str(key, file);
    key = fnv_str(key, name);
    key = fnv_str(key, rtc->src);
    {
        std::lock_guard<std::mutex> g(rtc_lock);
        if (RtcEntry *e = rtc_find(key)) {
            *out = *e;
            rtc_stats.memory_hits++;
            return FT_OK;
        }
    }
    char dir[1024], path[1100], names[3][128];
    cache_dir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/%016llx.cubin", dir, (unsigned long long)key);
    char *code = nullptr;
    size_t size = 0;
    const double t0 = now_s();
    const bool cached = dir[0] && !rtc->nocache && disk_load(path, names, &code, &size);
    if (!cached) {
        FT_TRY(compile(rtc, file, name, names, &code, &size, func));
        if (dir[0])
            disk_store(path, names, code, size);
    }
    if (rtc->dry) {
        free(code);
        const double dt = now_s() - t0;
        std::lock_guard<std::mutex> g(rtc_lock);
        if (!cached)
            rtc_stats.compiles++, rtc_stats.last_compile_s = dt, rtc_stats.compile_s += dt;
        return FT_OK;
    }
    RtcEntry e;
    memset(&e, 0, sizeof e);
    e.key = key;
    cudaError_t ce = cudaLibraryLoadData(&e.lib, code, nullptr, nullptr, 0, nullptr, nullptr, 0);
    free(code);
    const bool loaded = ce == cudaSuccess;
    if (ce == cudaSuccess)
        ce = cudaLibraryGetKernel(&e.kernel, e.lib, names[0]);
    if (ce == cudaSuccess) { /* loads the module onto the device now (CUDA loads lazily), so
                                the time counted is the whole load */
        void *g = nullptr;
        size_t gb = 0;
        cudaFuncAttributes fa;
        ce = cudaLibraryGetGlobal(&g, &gb, e.lib, names[1]);
        if (ce == cudaSuccess)
            ce = cudaFuncGetAttributes(&fa, (const void *)e.kernel);
    }
    if (ce != cudaSuccess) {
        cudaGetLastError();
        if (loaded) /* a library without the kernel or its globals is not kept */
            cudaLibraryUnload(e.lib);
        if (cached) /* a stale or damaged file: compile afresh */
            remove(path);
        return ft_fail(FT_ERR_DEVICE, func, 0, "mods: loading the kernel compiled for %s failed: %s",
                       rtc->arch, cudaGetErrorString(ce));
    }
    snprintf(e.args_name, sizeof e.args_name, "%s", names[1]);
    snprintf(e.fault_name, sizeof e.fault_name, "%s", names[2]);
    const double dt = now_s() - t0;
    std::lock_guard<std::mutex> g(rtc_lock);
    if (cached)
        rtc_stats.disk_loads++, rtc_stats.last_load_s = dt, rtc_stats.load_s += dt;
    else
        rtc_stats.compiles++, rtc_stats.last_compile_s = dt, rtc_stats.compile_s += dt;
    if (RtcEntry *old = rtc_find(key)) { /* another thread was first */
        cudaLibraryUnload(e.lib);
        *out = *old;
        return FT_OK;
    }
    if (rtc_n == rtc_cap) {
        const int cap = rtc_cap ? 2 * rtc_cap : 16;
        RtcEntry *a = (RtcEntry *)realloc(rtc_entries, sizeof *a * (size_t)cap);
        if (!a) {
            cudaLibraryUnload(e.lib);
            return ft_fail(FT_ERR_NOMEM, func, 0, "out of memory");
        }
        rtc_entries = a, rtc_cap = cap;
    }
    rtc_entries[rtc_n++] = e;
    *out = e;
    return FT_OK;
}

/* Launches kernel `name` of `file` compiled for rtc's mod with args. */
static ft_status rtc_launch(FlashRtc *rtc, const char *file, const char *name, dim3 grid,
                            int threads, size_t smem, void **params, const char *func)
{
    RtcEntry e;
    FT_TRY(rtc_kernel(rtc, file, name, &e, func));
    if (rtc->dry)
        return FT_OK;
    void *args = nullptr, *fault = nullptr;
    size_t bytes = 0, fbytes = 0;
    FT_CUDA_TRY(func, cudaLibraryGetGlobal(&args, &bytes, e.lib, e.args_name));
    FT_CUDA_TRY(func, cudaLibraryGetGlobal(&fault, &fbytes, e.lib, e.fault_name));
    if (bytes != sizeof rtc->args)
        return ft_fail(FT_ERR_INTERNAL, func, 0, "mods: ft_mod_args is %zu bytes, not %zu",
                       bytes, sizeof rtc->args);
    FT_CUDA_TRY(func, cudaMemcpyAsync(args, &rtc->args, bytes, cudaMemcpyHostToDevice, 0));
    if (rtc->debug)
        FT_CUDA_TRY(func, cudaMemsetAsync(fault, 0, sizeof(int), 0));
    FT_CUDA_TRY(func, cudaKernelSetAttributeForDevice(
                          e.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem,
                          rtc->device));
    FT_CUDA_TRY(func, cudaLaunchKernel((const void *)e.kernel, grid, dim3(threads), params, smem,
                                       0));
    if (rtc->debug) {
        int f = 0;
        FT_CUDA_TRY(func, cudaMemcpy(&f, fault, sizeof f, cudaMemcpyDeviceToHost));
        if (f)
            return ft_fail(FT_ERR_ARGUMENT, func, 0,
                           "mods: a read of a captured tensor was out of range (indices are "
                           "1-based and must lie within the tensor's shape; FT_MODS_DEBUG)");
    }
    return FT_OK;
}

ft_status flash_rtc_launch(FlashRtc *rtc, const char *file, const char *name, dim3 grid,
                           int threads, size_t smem, const FlashParams &p, const char *func,
                           void *extra)
{
    FlashParams q = p;
    void *params[2] = {&q, extra};
    return rtc_launch(rtc, file, name, grid, threads, smem, params, func);
}

/* ft.block_mask on CUDA (lib/mods.c prepares cells and band on device and
 * reads them back): mods_mask.cuh's kernel for the mods' mask. */
extern "C" ft_status flash_rtc_block_mask(const ft_attn_mods *mods, const ft_tensor *const *tensors,
                                          int device, const int64_t *size, int *cells, int *band,
                                          const char *func)
{
    FlashRtc *rtc;
    FT_TRY(ft_cuda_use_device(device, func));
    FT_TRY(rtc_new(mods, tensors, nullptr, FT_F32, 0, device, &rtc, func));
    int B = (int)size[0], H = (int)size[1], Nq = (int)size[2], Nk = (int)size[3];
    int bq = (int)size[4], bk = (int)size[5];
    int nqb = (Nq + bq - 1) / bq, nkb = (Nk + bk - 1) / bk;
    void *params[10] = {&B, &H, &Nq, &Nk, &bq, &bk, &nqb, &nkb, &cells, &band};
    const int threads = 128;
    const ft_status st = Nq == 0 || B == 0 || H == 0
                             ? FT_OK
                             : rtc_launch(rtc, "mods_mask.cuh", "ft_block_mask_kernel<FtUserMod>",
                                          dim3((Nq + threads - 1) / threads, H, B), threads, 0,
                                          params, func);
    flash_rtc_free(rtc);
    return st;
}

/* ft_cuda_mods_compile: the kernels a call of dtype and head_dim with
 * these mods runs (forward, dK/dV, dQ) compiled for arch, or found in the
 * disk cache; no GPU needed. */
extern "C" ft_status ft_cuda_mods_compile(const ft_attn_mods *mods, int ntensors,
                                          const ft_tensor *const *tensors, ft_dtype dtype,
                                          int head_dim, const char *arch, int passes,
                                          int use_cache, int *compiled)
{
    static const char func[] = "ft_cuda_mods_compile";
    if (!mods)
        return ft_fail(FT_ERR_ARGUMENT, func, 1, "mods expected");
    if (ntensors != ft_attn_mods_tensors(mods) || (ntensors > 0 && !tensors))
        return ft_fail(FT_ERR_ARGUMENT, func, 2, "mods read %d tensors, %d given",
                       ft_attn_mods_tensors(mods), ntensors);
    for (int t = 0; t < ntensors; t++)
        FT_TRY(ft_check_tensor(func, 3, tensors[t]));
    FT_TRY(ft_attn_mods_cuda_check_tensors(func, 3, ntensors, tensors));
    if (dtype != FT_F16 && dtype != FT_BF16)
        return ft_fail(FT_ERR_UNSUPPORTED, func, 4, "mods on CUDA take f16 or bf16, got %s",
                       ft_dtype_name(dtype));
    if (head_dim < 8 || head_dim > 256 || head_dim % 8 != 0)
        return ft_fail(FT_ERR_UNSUPPORTED, func, 5,
                       "the flash kernels take head dims 8 to 256, multiples of 8; got %d",
                       head_dim);
    int major = 0, minor = 0;
    char suffix = 0;
    if (!arch || sscanf(arch, "sm_%1d%1d%c", &major, &minor, &suffix) < 2 ||
        (suffix && suffix != 'a') || major < 8)
        return ft_fail(FT_ERR_ARGUMENT, func, 6,
                       "arch must be sm_XY (8.0 or later, e.g. sm_80, sm_90a), got '%s'",
                       arch ? arch : "(null)");
    const bool wgmma = major == 9 && minor == 0 && suffix == 'a';
    if (passes < 1 || passes > 7 || ((passes & 4) && !(passes & 2)))
        return ft_fail(FT_ERR_ARGUMENT, func, 7,
                       "passes must be 1, 2 or 3, plus 4 for the tensors' gradients with 2; got %d",
                       passes);
    FlashRtc *rtc = (FlashRtc *)calloc(1, sizeof *rtc);
    if (!rtc)
        return ft_fail(FT_ERR_NOMEM, func, 0, "out of memory");
    snprintf(rtc->arch, sizeof rtc->arch, "%s", arch);
    rtc->dry = 1, rtc->nocache = !use_cache;
    if ((passes & 4) && !ft_attn_mods_cuda_has_grad(mods, tensors))
        passes &= 3; /* no gradients: the backward of mod_grads = false */
    rtc->src = ft_attn_mods_cuda_source(mods, tensors, dtype == FT_BF16, 0, (passes & 4) != 0, 0);
    if (!rtc->src) {
        free(rtc);
        return ft_fail(FT_ERR_NOMEM, func, 0, "out of memory");
    }
    FlashParams p;
    memset(&p, 0, sizeof p);
    p.B = p.H = p.Hk = p.Nq = p.Nk = 1;
    p.d = head_dim;
    p.dtype = dtype;
    int64_t before;
    {
        std::lock_guard<std::mutex> g(rtc_lock);
        before = rtc_stats.compiles;
    }
    ft_status st = flash_rtc_dry_run(p, rtc, wgmma, ft_attn_mods_cuda_has_score(mods), passes);
    flash_rtc_free(rtc);
    if (compiled) {
        std::lock_guard<std::mutex> g(rtc_lock);
        *compiled = (int)(rtc_stats.compiles - before);
    }
    return st;
}

extern "C" void ft_cuda_mods_stats(ft_rtc_stats *out)
{
    std::lock_guard<std::mutex> g(rtc_lock);
    *out = rtc_stats;
}
