/*
 * dist.c - communicators over NCCL for several GPUs: the two process
 * models, the collectives the layers need, and point-to-point exchanges
 * that can overlap the flash kernels (ring attention, lua/flashtile/dist.lua).
 *
 * Process models.
 *   - One process driving several devices (ft_dist_init_devices):
 *     ncclCommInitAll; local rank i is device devices[i], and every call
 *     takes one tensor per local rank, issued as one NCCL group.
 *   - One process per GPU (ft_dist_init_rank): rank 0 writes NCCL's unique
 *     id into a file (written beside it, then renamed: the others never read
 *     half an id), the others wait for it; then every rank joins through
 *     marker files beside it (join_files), and only once all have joined
 *     through a non-blocking NCCL init, polled. A rank that does not come
 *     within the timeout makes every rank that did fail with an error saying
 *     whom it waited for, instead of hanging, and without an NCCL init to
 *     abandon (scripts/ftrun starts such ranks).
 *
 * Streams. Every local rank has a communication stream of its own
 * (non-blocking, so the legacy default stream, where flashtile's kernels
 * run, does not serialise with it). A call makes that stream wait for the
 * work queued so far on the default stream (an event), issues NCCL there,
 * and, unless it returns a pending exchange, makes the default stream wait
 * for it in turn: seen from the default stream it is ordered like any
 * kernel, yet kernels queued before the wait run beside it. A pending
 * exchange holds the storages of its tensors until ft_pending_wait (or
 * ft_pending_free), so a tensor freed meanwhile is not reused under it.
 *
 * NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0 is set in the
 * environment before the first communicator, whatever it was; on shared
 * machines multicast can take the host's GPUs out of service.
 *
 * Check: spec/dist_spec.lua (tag multigpu for the specs that need two
 * GPUs; the argument checks run anywhere).
 */
#define _GNU_SOURCE /* setenv, nanosleep, clock_gettime */
#include "internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef FT_HAVE_NCCL
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>
#include <pthread.h>
#include <unistd.h>

/* NCCL is opened when the first communicator is made, not linked: a
 * process that never uses flashtile.dist does not load it (nor its
 * threads and its gigabyte of kernels), and a machine without it still
 * loads flashtile. The library CMake found is tried first, then the
 * loader's libnccl.so.2. First flashtile's own library and what it
 * loaded (the C++ runtime among them) join the global scope: under a
 * host that opened flashtile local (the Lua module under lua), NCCL's
 * first call (ncclGetUniqueId) jumped to address 0 on an H200 machine,
 * killing the process, NCCL itself opened global or not; with flashtile
 * global, or linked into the executable, it runs. */
static struct {
    const char *(*GetErrorString)(ncclResult_t);
    const char *(*GetLastError)(ncclComm_t);
    ncclResult_t (*GetUniqueId)(ncclUniqueId *);
    ncclResult_t (*CommInitAll)(ncclComm_t *, int, const int *);
    ncclResult_t (*CommInitRankConfig)(ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *);
    ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t *);
    ncclResult_t (*CommAbort)(ncclComm_t);
    ncclResult_t (*CommDestroy)(ncclComm_t);
    ncclResult_t (*GroupStart)(void);
    ncclResult_t (*GroupEnd)(void);
    ncclResult_t (*AllReduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t,
                              ncclComm_t, cudaStream_t);
    ncclResult_t (*Broadcast)(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t,
                              cudaStream_t);
    ncclResult_t (*AllGather)(const void *, void *, size_t, ncclDataType_t, ncclComm_t,
                              cudaStream_t);
    ncclResult_t (*ReduceScatter)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t,
                                  ncclComm_t, cudaStream_t);
    ncclResult_t (*Send)(const void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*Recv)(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
} N;
static char nccl_error[512];

static void nccl_open(void)
{
    static const char *const names[] = {
#ifdef FT_NCCL_PATH
        FT_NCCL_PATH,
#endif
        "libnccl.so.2", "libnccl.so"};
    void *lib = NULL;
    Dl_info self;
    if (dladdr((void *)nccl_open, &self) && self.dli_fname)
        dlopen(self.dli_fname, RTLD_NOW | RTLD_NOLOAD | RTLD_GLOBAL); /* held for good */
    for (size_t i = 0; !lib && i < sizeof names / sizeof names[0]; i++)
        lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *e = dlerror();
        snprintf(nccl_error, sizeof nccl_error, "NCCL's library could not be loaded (%s)",
                 e ? e : "libnccl.so.2 not found");
        return;
    }
#define FT_NCCL_SYM(f)                                                          \
    if (!nccl_error[0] && !(*(void **)&N.f = dlsym(lib, "nccl" #f)))            \
        snprintf(nccl_error, sizeof nccl_error, "NCCL's library has no nccl%s", #f);
    FT_NCCL_SYM(GetErrorString) FT_NCCL_SYM(GetLastError) FT_NCCL_SYM(GetUniqueId)
    FT_NCCL_SYM(CommInitAll) FT_NCCL_SYM(CommInitRankConfig) FT_NCCL_SYM(CommGetAsyncError)
    FT_NCCL_SYM(CommAbort) FT_NCCL_SYM(CommDestroy) FT_NCCL_SYM(GroupStart)
    FT_NCCL_SYM(GroupEnd) FT_NCCL_SYM(AllReduce) FT_NCCL_SYM(Broadcast) FT_NCCL_SYM(AllGather)
    FT_NCCL_SYM(ReduceScatter) FT_NCCL_SYM(Send) FT_NCCL_SYM(Recv)
#undef FT_NCCL_SYM
}

/* NCCL's functions in N, or an error naming func. */
static ft_status nccl_load(const char *func)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, nccl_open);
    if (nccl_error[0])
        return ft_fail(FT_ERR_UNSUPPORTED, func, 0, "%s", nccl_error);
    return FT_OK;
}

#define FT_DIST_MAX_LOCAL 64

struct ft_comm {
    int world, nlocal;
    int rank[FT_DIST_MAX_LOCAL], device[FT_DIST_MAX_LOCAL];
    ncclComm_t comm[FT_DIST_MAX_LOCAL];
    cudaStream_t stream[FT_DIST_MAX_LOCAL];
    cudaEvent_t ready[FT_DIST_MAX_LOCAL];  /* default stream -> comm stream */
    cudaEvent_t joined[FT_DIST_MAX_LOCAL]; /* comm stream -> default stream */
};

struct ft_pending {
    int nlocal, device[FT_DIST_MAX_LOCAL]; /* copied: the comm may go first */
    cudaEvent_t done[FT_DIST_MAX_LOCAL];   /* comm stream -> default stream */
    ft_storage **held;
    int nheld, waited;
};

int ft_dist_built(void) { return 1; }

static ft_status nccl_fail(ncclResult_t r, ncclComm_t comm, const char *func, const char *call)
{
    const char *last = comm ? N.GetLastError(comm) : NULL;
    return ft_fail(r == ncclInvalidArgument || r == ncclInvalidUsage ? FT_ERR_ARGUMENT
                                                                       : FT_ERR_DEVICE,
                   func, 0, "%s: %s%s%s%s", call, N.GetErrorString(r),
                   last && *last ? " (" : "", last && *last ? last : "",
                   last && *last ? ")" : "");
}

#define NCCL_TRY(func, comm, expr)                                          \
    do {                                                                    \
        ncclResult_t ft_nccl_r_ = (expr);                                   \
        if (ft_nccl_r_ != ncclSuccess && ft_nccl_r_ != ncclInProgress)      \
            return nccl_fail(ft_nccl_r_, (comm), func, #expr);              \
    } while (0)

static void multicast_off(void) { setenv("NCCL_NVLS_ENABLE", "0", 1); }

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Streams and events of local rank i, on its device. */
static ft_status local_setup(ft_comm *c, int i, const char *func)
{
    FT_TRY(ft_cuda_use_device(c->device[i], func));
    FT_CUDA_TRY(func, cudaStreamCreateWithFlags(&c->stream[i], cudaStreamNonBlocking));
    FT_CUDA_TRY(func, cudaEventCreateWithFlags(&c->ready[i], cudaEventDisableTiming));
    FT_CUDA_TRY(func, cudaEventCreateWithFlags(&c->joined[i], cudaEventDisableTiming));
    return FT_OK;
}

void ft_comm_free(ft_comm *c)
{
    if (!c)
        return;
    for (int i = 0; i < c->nlocal; i++) {
        if (c->device[i] >= 0)
            cudaSetDevice(c->device[i]);
        if (c->stream[i])
            cudaStreamSynchronize(c->stream[i]);
        if (c->comm[i])
            N.CommDestroy(c->comm[i]);
        if (c->ready[i])
            cudaEventDestroy(c->ready[i]);
        if (c->joined[i])
            cudaEventDestroy(c->joined[i]);
        if (c->stream[i])
            cudaStreamDestroy(c->stream[i]);
    }
    cudaGetLastError();
    free(c);
}

ft_status ft_dist_init_devices(ft_comm **out, int n, const int *devices)
{
    static const char func[] = "ft_dist_init_devices";
    *out = NULL;
    if (n < 1 || n > FT_DIST_MAX_LOCAL)
        return ft_fail(FT_ERR_ARGUMENT, func, 1, "%d devices: give 1 to %d", n,
                       FT_DIST_MAX_LOCAL);
    for (int i = 0; i < n; i++) {
        FT_TRY(ft_cuda_device_check(func, 1, devices[i]));
        for (int j = 0; j < i; j++)
            if (devices[j] == devices[i])
                return ft_fail(FT_ERR_ARGUMENT, func, 1, "device %d is listed twice",
                               devices[i]);
    }
    FT_TRY(nccl_load(func)); /* once the arguments are good */
    ft_comm *c = calloc(1, sizeof *c);
    if (!c)
        return ft_fail(FT_ERR_NOMEM, func, 0, "out of memory");
    c->world = c->nlocal = n;
    for (int i = 0; i < n; i++) {
        c->rank[i] = i;
        c->device[i] = devices[i];
    }
    multicast_off();
    ft_status st = FT_OK;
    ncclResult_t r = N.CommInitAll(c->comm, n, devices);
    if (r != ncclSuccess) {
        memset(c->comm, 0, sizeof c->comm);
        st = nccl_fail(r, NULL, func, "ncclCommInitAll");
    }
    for (int i = 0; st == FT_OK && i < n; i++)
        st = local_setup(c, i, func);
    if (st != FT_OK) {
        ft_comm_free(c);
        return st;
    }
    *out = c;
    return FT_OK;
}

/* Rank 0: a fresh id into path (through path.<pid>, renamed). */
static ft_status write_bytes(const char *func, const char *path, const void *bytes, size_t n)
{
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.%ld", path, (long)getpid()) >= (int)sizeof tmp)
        return ft_fail(FT_ERR_ARGUMENT, func, 4, "id_file path is too long");
    FILE *f = fopen(tmp, "wb");
    if (!f)
        return ft_fail(FT_ERR_IO, func, 4, "cannot write %s: %s", tmp, strerror(errno));
    const size_t w = fwrite(bytes, 1, n, f);
    if (fclose(f) != 0 || w != n) {
        remove(tmp);
        return ft_fail(FT_ERR_IO, func, 4, "cannot write %s", tmp);
    }
    if (rename(tmp, path) != 0) {
        const int e = errno;
        remove(tmp);
        return ft_fail(FT_ERR_IO, func, 4, "cannot rename %s to %s: %s", tmp, path, strerror(e));
    }
    return FT_OK;
}

static ft_status write_id(const char *func, const char *path, const ncclUniqueId *id)
{
    return write_bytes(func, path, id, sizeof *id);
}

/* Reads exactly n bytes from path (0: absent, shorter or longer). */
static int read_exact(const char *path, void *buf, size_t n)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return 0;
    const size_t r = fread(buf, 1, n, f);
    const int extra = fgetc(f) != EOF;
    fclose(f);
    return r == n && !extra;
}

/* The other ranks: wait until the id is there (or the deadline). */
static ft_status read_id(const char *func, const char *path, ncclUniqueId *id, int rank,
                         double deadline, double timeout_s)
{
    for (;;) {
        if (read_exact(path, id, sizeof *id))
            return FT_OK;
        if (now_s() > deadline)
            return ft_fail(FT_ERR_DEVICE, func, 0,
                           "rank %d: no id from rank 0 in %s after %.0f s (did rank 0 start? "
                           "scripts/ftrun starts every rank)", rank, path, timeout_s);
        sleep_ms(10);
    }
}

/* The marker files of the join beside the id file: <id_file>.joined.<r>
 * (rank r has read the id: the id and a number of this rank's own) and
 * <id_file>.go (rank 0 has seen every rank's marker: the id and the
 * ranks' numbers), so that the files of an earlier run count for nothing,
 * a go file that rank 0 left behind included. */
typedef struct {
    ncclUniqueId id;
    uint64_t nonce;
} JoinMark;

static ft_status marker_path(const char *func, char *buf, size_t n, const char *id_file,
                             int rank)
{
    const int w = rank > 0 ? snprintf(buf, n, "%s.joined.%d", id_file, rank)
                           : snprintf(buf, n, "%s.go", id_file);
    if (w < 0 || (size_t)w >= n)
        return ft_fail(FT_ERR_ARGUMENT, func, 4, "id_file path is too long");
    return FT_OK;
}

static uint64_t join_nonce(void)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    uint64_t x = ((uint64_t)getpid() << 32) ^ (uint64_t)t.tv_sec * 1000000007u ^ (uint64_t)t.tv_nsec;
    x ^= x >> 33, x *= 0xff51afd7ed558ccdULL, x ^= x >> 33; /* mixed */
    return x ? x : 1;
}

/* Every rank's join, through files, before NCCL's: rank 0 waits for the
 * other ranks' markers, then writes the go marker with their numbers; the
 * others write theirs and wait for a go marker that holds their id and
 * number (joining again if the id file changes under them: they had read
 * an earlier run's). A rank that does not come within the timeout makes
 * every rank that did fail with an error, before any of them starts
 * NCCL's init (abandoning an init in progress after a timeout,
 * ncclCommAbort, took the whole process down with it on an H200, rank 0
 * alone). */
static ft_status join_files(const char *func, const char *id_file, ncclUniqueId *id, int rank,
                            int world, double deadline, double timeout_s)
{
    char path[4096], go[4096];
    FT_TRY(marker_path(func, go, sizeof go, id_file, 0));
    const size_t go_bytes = sizeof *id + (size_t)(world - 1) * sizeof(uint64_t);
    unsigned char *buf = malloc(go_bytes);
    if (!buf)
        return ft_fail(FT_ERR_NOMEM, func, 0, "out of memory");
    ft_status st = FT_OK;
    if (rank > 0) {
        JoinMark me;
        me.id = *id, me.nonce = join_nonce();
        st = marker_path(func, path, sizeof path, id_file, rank);
        if (st == FT_OK)
            st = write_bytes(func, path, &me, sizeof me);
        while (st == FT_OK) {
            uint64_t got;
            if (read_exact(go, buf, go_bytes) && memcmp(buf, id, sizeof *id) == 0 &&
                (memcpy(&got, buf + sizeof *id + (size_t)(rank - 1) * sizeof got, sizeof got),
                 got == me.nonce))
                break;
            ncclUniqueId now;
            if (read_exact(id_file, &now, sizeof now) && memcmp(&now, id, sizeof now) != 0) {
                *id = me.id = now; /* a new run's id: join it */
                st = write_bytes(func, path, &me, sizeof me);
                continue;
            }
            if (now_s() > deadline) {
                remove(path);
                st = ft_fail(FT_ERR_DEVICE, func, 0,
                             "rank %d of %d: rank 0 did not see all %d ranks join within %.0f s "
                             "(a rank failed or was not started)", rank, world, world, timeout_s);
                break;
            }
            sleep_ms(10);
        }
        if (st == FT_OK)
            remove(path);
        free(buf);
        return st;
    }
    memcpy(buf, id, sizeof *id);
    for (;;) {
        char missing[160] = "";
        size_t used = 0;
        int nmissing = 0;
        for (int r = 1; r < world && st == FT_OK; r++) {
            JoinMark m;
            st = marker_path(func, path, sizeof path, id_file, r);
            if (st == FT_OK && read_exact(path, &m, sizeof m) &&
                memcmp(&m.id, id, sizeof *id) == 0) {
                memcpy(buf + sizeof *id + (size_t)(r - 1) * sizeof m.nonce, &m.nonce,
                       sizeof m.nonce);
                continue;
            }
            if (nmissing < 8) {
                const int w = snprintf(missing + used, sizeof missing - used, "%s%d",
                                       nmissing ? ", " : "", r);
                if (w > 0 && used + (size_t)w < sizeof missing)
                    used += (size_t)w;
            }
            nmissing++;
        }
        if (st != FT_OK || nmissing == 0)
            break;
        if (now_s() > deadline) {
            st = ft_fail(FT_ERR_DEVICE, func, 0,
                         "rank 0 of %d: the other ranks did not all join within %.0f s (no word "
                         "from rank%s %s%s; a rank failed or was not started)",
                         world, timeout_s, nmissing > 1 ? "s" : "", missing,
                         nmissing > 8 ? ", ..." : "");
            break;
        }
        sleep_ms(10);
    }
    if (st == FT_OK) {
        for (int r = 1; r < world; r++)
            if (marker_path(func, path, sizeof path, id_file, r) == FT_OK)
                remove(path);
        st = write_bytes(func, go, buf, go_bytes);
    }
    free(buf);
    return st;
}

ft_status ft_dist_init_rank(ft_comm **out, int rank, int world, int device, const char *id_file,
                            double timeout_s)
{
    static const char func[] = "ft_dist_init_rank";
    *out = NULL;
    if (world < 1)
        return ft_fail(FT_ERR_ARGUMENT, func, 2, "world_size %d: must be at least 1", world);
    if (rank < 0 || rank >= world)
        return ft_fail(FT_ERR_ARGUMENT, func, 1, "rank %d: must be 0 to %d (world_size %d)",
                       rank, world - 1, world);
    FT_TRY(ft_cuda_device_check(func, 3, device));
    if (!id_file || !*id_file)
        return ft_fail(FT_ERR_ARGUMENT, func, 4, "id_file: a path every rank can read");
    if (!(timeout_s > 0) || timeout_s > 1e6)
        return ft_fail(FT_ERR_ARGUMENT, func, 5, "timeout %g s: must be above 0", timeout_s);
    FT_TRY(nccl_load(func)); /* once the arguments are good */
    const double deadline = now_s() + timeout_s;
    multicast_off();
    FT_TRY(ft_cuda_use_device(device, func));
    ncclUniqueId id;
    char go[4096];
    FT_TRY(marker_path(func, go, sizeof go, id_file, 0));
    if (rank == 0) {
        remove(go); /* an earlier run's */
        NCCL_TRY(func, NULL, N.GetUniqueId(&id));
        FT_TRY(write_id(func, id_file, &id));
    } else {
        FT_TRY(read_id(func, id_file, &id, rank, deadline, timeout_s));
    }
    if (world > 1)
        FT_TRY(join_files(func, id_file, &id, rank, world, deadline, timeout_s));
    const double init_deadline = now_s() + timeout_s; /* every rank has come */
    ft_comm *c = calloc(1, sizeof *c);
    if (!c)
        return ft_fail(FT_ERR_NOMEM, func, 0, "out of memory");
    c->world = world;
    c->nlocal = 1;
    c->rank[0] = rank;
    c->device[0] = device;
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t r = N.CommInitRankConfig(&c->comm[0], world, id, rank, &config);
    ft_status st = FT_OK;
    if (r != ncclSuccess && r != ncclInProgress) {
        st = nccl_fail(r, c->comm[0], func, "ncclCommInitRankConfig");
    } else {
        ncclResult_t state = ncclInProgress;
        while (st == FT_OK) {
            r = N.CommGetAsyncError(c->comm[0], &state);
            if (r != ncclSuccess)
                st = nccl_fail(r, c->comm[0], func, "ncclCommGetAsyncError");
            else if (state == ncclSuccess)
                break;
            else if (state != ncclInProgress)
                st = nccl_fail(state, c->comm[0], func, "ncclCommInitRankConfig");
            else if (now_s() > init_deadline)
                st = ft_fail(FT_ERR_DEVICE, func, 0,
                             "rank %d of %d: NCCL's init did not finish within %.0f s of every "
                             "rank's joining (a rank failed after joining)", rank, world, timeout_s);
            else
                sleep_ms(1);
        }
    }
    if (st != FT_OK && c->comm[0]) {
        N.CommAbort(c->comm[0]);
        c->comm[0] = NULL;
    }
    if (rank == 0 && world > 1)
        remove(go); /* every rank is past it (NCCL's init has seen them all), or failed */
    if (st == FT_OK)
        st = local_setup(c, 0, func);
    if (st != FT_OK) {
        ft_comm_free(c);
        return st;
    }
    *out = c;
    return FT_OK;
}

int ft_comm_world(const ft_comm *c) { return c->world; }
int ft_comm_local(const ft_comm *c) { return c->nlocal; }
int ft_comm_rank(const ft_comm *c, int i) { return i >= 0 && i < c->nlocal ? c->rank[i] : -1; }
int ft_comm_device(const ft_comm *c, int i) { return i >= 0 && i < c->nlocal ? c->device[i] : -1; }

/* ---- checks ---- */

static ft_status nccl_type(const char *func, int arg, ft_dtype dt, int reduce, ncclDataType_t *out)
{
    switch (dt) {
    case FT_F64: *out = ncclFloat64; return FT_OK;
    case FT_F32: *out = ncclFloat32; return FT_OK;
    case FT_F16: *out = ncclFloat16; return FT_OK;
    case FT_BF16: *out = ncclBfloat16; return FT_OK;
    case FT_I32: *out = ncclInt32; return FT_OK;
    case FT_I64: *out = ncclInt64; return FT_OK;
    case FT_FP8_E4M3:
        if (!reduce) {
            *out = ncclUint8;
            return FT_OK;
        }
        return ft_fail(FT_ERR_ARGUMENT, func, arg, "fp8_e4m3 holds data only: a reduction "
                       "needs f64, f32, f16, bf16, i32 or i64 (convert first)");
    default: break;
    }
    return ft_fail(FT_ERR_ARGUMENT, func, arg, "dtype %d is not one flashtile knows", (int)dt);
}

static ft_status nccl_op(const char *func, ft_reduce_op op, ncclRedOp_t *out)
{
    switch (op) {
    case FT_SUM: *out = ncclSum; return FT_OK;
    case FT_MEAN: *out = ncclAvg; return FT_OK;
    case FT_MAX: *out = ncclMax; return FT_OK;
    case FT_MIN: *out = ncclMin; return FT_OK;
    default: break;
    }
    return ft_fail(FT_ERR_ARGUMENT, func, 3, "op: sum, mean, max or min");
}

/* Tensor i of a call: present, contiguous, on local rank i's device. */
static ft_status check_local(const char *func, int arg, const ft_comm *c, const ft_tensor *t,
                             int i, const char *name)
{
    char dev[32];
    if (!t)
        return ft_fail(FT_ERR_ARGUMENT, func, arg, "%s[%d] is missing", name, i + 1);
    FT_TRY(ft_check_tensor(func, arg, t));
    if (t->device.type != FT_CUDA || t->device.index != c->device[i])
        return ft_fail(FT_ERR_ARGUMENT, func, arg, "%s[%d] is on %s, rank %d's device is cuda:%d",
                       name, i + 1, ft_device_name(t->device, dev, sizeof dev), c->rank[i],
                       c->device[i]);
    if (!ft_is_contiguous(t))
        return ft_fail(FT_ERR_ARGUMENT, func, arg, "%s[%d] must be contiguous (t:contiguous())",
                       name, i + 1);
    return FT_OK;
}

static ft_status check_count(const char *func, const ft_comm *c, int n)
{
    if (!c)
        return ft_fail(FT_ERR_ARGUMENT, func, 1, "no communicator");
    if (n != c->nlocal)
        return ft_fail(FT_ERR_ARGUMENT, func, 2, "%d tensors for %d local ranks: one per device "
                       "of this process", n, c->nlocal);
    return FT_OK;
}

/* The comm streams wait for the default streams' work so far. */
static ft_status streams_follow(ft_comm *c, const char *func)
{
    for (int i = 0; i < c->nlocal; i++) {
        FT_TRY(ft_cuda_use_device(c->device[i], func));
        FT_CUDA_TRY(func, cudaEventRecord(c->ready[i], 0));
        FT_CUDA_TRY(func, cudaStreamWaitEvent(c->stream[i], c->ready[i], 0));
    }
    return FT_OK;
}

/* The default streams wait for the comm streams' work so far. */
static ft_status streams_join(ft_comm *c, cudaEvent_t *done, const char *func)
{
    for (int i = 0; i < c->nlocal; i++) {
        FT_TRY(ft_cuda_use_device(c->device[i], func));
        FT_CUDA_TRY(func, cudaEventRecord(done[i], c->stream[i]));
        FT_CUDA_TRY(func, cudaStreamWaitEvent(0, done[i], 0));
    }
    return FT_OK;
}

/* A communicator made non-blocking (ft_dist_init_rank, so that a join can
 * time out) may return from a call before the work is queued: waits until
 * every local communicator says it is (or failed). */
static ft_status settle(ft_comm *c, const char *func, const char *call)
{
    for (int i = 0; i < c->nlocal; i++) {
        ncclResult_t state = ncclInProgress;
        while (state == ncclInProgress) {
            const ncclResult_t r = N.CommGetAsyncError(c->comm[i], &state);
            if (r != ncclSuccess)
                return nccl_fail(r, c->comm[i], func, "ncclCommGetAsyncError");
        }
        if (state != ncclSuccess)
            return nccl_fail(state, c->comm[i], func, call);
    }
    return FT_OK;
}

/* Runs issue(i) for every local rank inside one NCCL group, between the
 * streams' hand-overs. */
typedef ncclResult_t (*issue_fn)(ft_comm *c, int i, void *arg);

static ft_status group(ft_comm *c, const char *func, const char *call, issue_fn issue, void *arg)
{
    FT_TRY(streams_follow(c, func));
    NCCL_TRY(func, NULL, N.GroupStart());
    ncclResult_t bad = ncclSuccess;
    int at = 0;
    for (int i = 0; i < c->nlocal && (bad == ncclSuccess || bad == ncclInProgress); i++) {
        cudaSetDevice(c->device[i]);
        bad = issue(c, i, arg);
        at = i;
    }
    ncclResult_t end = N.GroupEnd();
    if (bad != ncclSuccess && bad != ncclInProgress)
        return nccl_fail(bad, c->comm[at], func, call);
    if (end != ncclSuccess && end != ncclInProgress)
        return nccl_fail(end, c->comm[0], func, call);
    return settle(c, func, call);
}

/* The default streams wait for the call just issued (a wait enqueued at
 * once, so one event per rank serves every call). */
static ft_status finish(ft_comm *c, const char *func) { return streams_join(c, c->joined, func); }

/* ---- collectives ---- */

typedef struct {
    ft_tensor *const *out;
    const ft_tensor *const *in;
    size_t count;
    ncclDataType_t type;
    ncclRedOp_t op;
    int root;
} coll;

static ncclResult_t issue_all_reduce(ft_comm *c, int i, void *arg)
{
    const coll *a = arg;
    return N.AllReduce(a->out[i]->data, a->out[i]->data, a->count, a->type, a->op, c->comm[i],
                         c->stream[i]);
}

static ncclResult_t issue_broadcast(ft_comm *c, int i, void *arg)
{
    const coll *a = arg;
    return N.Broadcast(a->out[i]->data, a->out[i]->data, a->count, a->type, a->root,
                         c->comm[i], c->stream[i]);
}

static ncclResult_t issue_all_gather(ft_comm *c, int i, void *arg)
{
    const coll *a = arg;
    return N.AllGather(a->in[i]->data, a->out[i]->data, a->count, a->type, c->comm[i],
                         c->stream[i]);
}

static ncclResult_t issue_reduce_scatter(ft_comm *c, int i, void *arg)
{
    const coll *a = arg;
    return N.ReduceScatter(a->in[i]->data, a->out[i]->data, a->count, a->type, a->op,
                             c->comm[i], c->stream[i]);
}

/* Every tensor of ts: checked, one dtype and element count. */
static ft_status check_same(const char *func, int arg, const ft_comm *c,
                            const ft_tensor *const *ts, int n, const char *name)
{
    for (int i = 0; i < n; i++) {
        FT_TRY(check_local(func, arg, c, ts[i], i, name));
        if (ts[i]->dtype != ts[0]->dtype || ft_numel(ts[i]) != ft_numel(ts[0]))
            return ft_fail(FT_ERR_ARGUMENT, func, arg, "%s[%d] is %s of %lld elements, %s[1] "
                           "%s of %lld", name, i + 1, ft_dtype_name(ts[i]->dtype),
                           (long long)ft_numel(ts[i]), name, ft_dtype_name(ts[0]->dtype),
                           (long long)ft_numel(ts[0]));
    }
    return FT_OK;
}

ft_status ft_all_reduce(ft_comm *c, ft_tensor *const *ts, int n, ft_reduce_op op)
{
    static const char func[] = "ft_all_reduce";
    FT_TRY(check_count(func, c, n));
    FT_TRY(check_same(func, 2, c, (const ft_tensor *const *)ts, n, "tensors"));
    coll a = {ts, NULL, (size_t)ft_numel(ts[0]), ncclFloat32, ncclSum, 0};
    FT_TRY(nccl_type(func, 2, ts[0]->dtype, 1, &a.type));
    FT_TRY(nccl_op(func, op, &a.op));
    FT_TRY(group(c, func, "ncclAllReduce", issue_all_reduce, &a));
    return finish(c, func);
}

ft_status ft_broadcast(ft_comm *c, ft_tensor *const *ts, int n, int root)
{
    static const char func[] = "ft_broadcast";
    FT_TRY(check_count(func, c, n));
    if (root < 0 || root >= c->world)
        return ft_fail(FT_ERR_ARGUMENT, func, 3, "root %d: ranks are 0 to %d", root,
                       c->world - 1);
    FT_TRY(check_same(func, 2, c, (const ft_tensor *const *)ts, n, "tensors"));
    coll a = {ts, NULL, (size_t)ft_numel(ts[0]), ncclFloat32, ncclSum, root};
    FT_TRY(nccl_type(func, 2, ts[0]->dtype, 0, &a.type));
    FT_TRY(group(c, func, "ncclBroadcast", issue_broadcast, &a));
    return finish(c, func);
}

/* out[i] holds world x numel(in[i]) elements (rank order), in in's dtype. */
static ft_status check_gathered(const char *func, const ft_comm *c, ft_tensor *const *out,
                                const ft_tensor *const *in, int n, int scatter)
{
    FT_TRY(check_same(func, 3, c, in, n, "inputs"));
    FT_TRY(check_same(func, 2, c, (const ft_tensor *const *)out, n, "outputs"));
    const int64_t small = scatter ? ft_numel(out[0]) : ft_numel(in[0]);
    const int64_t big = scatter ? ft_numel(in[0]) : ft_numel(out[0]);
    if (out[0]->dtype != in[0]->dtype || big != small * c->world)
        return ft_fail(FT_ERR_ARGUMENT, func, 2, "%s must be %s with world_size (%d) times the "
                       "elements of %s (%lld), got %s of %lld", scatter ? "inputs" : "outputs",
                       ft_dtype_name(in[0]->dtype), c->world, scatter ? "outputs" : "inputs",
                       (long long)small, ft_dtype_name(out[0]->dtype), (long long)big);
    for (int i = 0; i < n; i++)
        if (ft_same_storage(out[i], in[i]))
            return ft_fail(FT_ERR_ARGUMENT, func, 2, "outputs[%d] shares memory with inputs[%d]",
                           i + 1, i + 1);
    return FT_OK;
}

ft_status ft_all_gather(ft_comm *c, ft_tensor *const *out, const ft_tensor *const *in, int n)
{
    static const char func[] = "ft_all_gather";
    FT_TRY(check_count(func, c, n));
    FT_TRY(check_gathered(func, c, out, in, n, 0));
    coll a = {out, in, (size_t)ft_numel(in[0]), ncclFloat32, ncclSum, 0};
    FT_TRY(nccl_type(func, 3, in[0]->dtype, 0, &a.type));
    FT_TRY(group(c, func, "ncclAllGather", issue_all_gather, &a));
    return finish(c, func);
}

ft_status ft_reduce_scatter(ft_comm *c, ft_tensor *const *out, const ft_tensor *const *in, int n,
                            ft_reduce_op op)
{
    static const char func[] = "ft_reduce_scatter";
    FT_TRY(check_count(func, c, n));
    FT_TRY(check_gathered(func, c, out, in, n, 1));
    coll a = {out, in, (size_t)ft_numel(out[0]), ncclFloat32, ncclSum, 0};
    FT_TRY(nccl_type(func, 3, in[0]->dtype, 1, &a.type));
    FT_TRY(nccl_op(func, op, &a.op));
    FT_TRY(group(c, func, "ncclReduceScatter", issue_reduce_scatter, &a));
    return finish(c, func);
}

/* ---- point to point ---- */

typedef struct {
    const ft_tensor *const *send;
    const int *to;
    ft_tensor *const *recv;
    const int *from;
} p2p;

static ncclResult_t issue_sendrecv(ft_comm *c, int i, void *arg)
{
    const p2p *a = arg;
    ncclDataType_t type = ncclUint8;
    ncclResult_t r = ncclSuccess;
    if (a->send[i]) {
        nccl_type("ft_sendrecv", 2, a->send[i]->dtype, 0, &type);
        r = N.Send(a->send[i]->data, (size_t)ft_numel(a->send[i]), type, a->to[i], c->comm[i],
                     c->stream[i]);
    }
    if (r == ncclSuccess && a->recv[i]) {
        nccl_type("ft_sendrecv", 4, a->recv[i]->dtype, 0, &type);
        r = N.Recv(a->recv[i]->data, (size_t)ft_numel(a->recv[i]), type, a->from[i],
                     c->comm[i], c->stream[i]);
    }
    return r;
}

void ft_pending_free(ft_pending *p)
{
    if (!p)
        return;
    if (!p->waited)
        ft_pending_wait(p); /* the storages go only after the exchange */
    for (int i = 0; i < p->nlocal; i++) {
        if (p->done[i]) {
            cudaSetDevice(p->device[i]);
            cudaEventDestroy(p->done[i]);
        }
    }
    for (int i = 0; i < p->nheld; i++)
        ft_storage_release(p->held[i]);
    free(p->held);
    free(p);
}

ft_status ft_pending_wait(ft_pending *p)
{
    static const char func[] = "ft_pending_wait";
    if (!p)
        return ft_fail(FT_ERR_ARGUMENT, func, 1, "no pending exchange");
    if (p->waited)
        return FT_OK;
    p->waited = 1;
    for (int i = 0; i < p->nlocal; i++) {
        FT_TRY(ft_cuda_use_device(p->device[i], func));
        FT_CUDA_TRY(func, cudaStreamWaitEvent(0, p->done[i], 0));
    }
    return FT_OK;
}

ft_status ft_sendrecv(ft_comm *c, const ft_tensor *const *send, const int *to,
                      ft_tensor *const *recv, const int *from, int n, ft_pending **pending)
{
    static const char func[] = "ft_sendrecv";
    if (pending)
        *pending = NULL;
    FT_TRY(check_count(func, c, n));
    for (int i = 0; i < n; i++) {
        if (send[i]) {
            FT_TRY(check_local(func, 2, c, send[i], i, "send"));
            ncclDataType_t t;
            FT_TRY(nccl_type(func, 2, send[i]->dtype, 0, &t));
            if (to[i] < 0 || to[i] >= c->world || to[i] == c->rank[i])
                return ft_fail(FT_ERR_ARGUMENT, func, 3, "to[%d] = %d: a rank from 0 to %d other "
                               "than %d's own", i + 1, to[i], c->world - 1, c->rank[i]);
        }
        if (recv[i]) {
            FT_TRY(check_local(func, 4, c, recv[i], i, "recv"));
            ncclDataType_t t;
            FT_TRY(nccl_type(func, 4, recv[i]->dtype, 0, &t));
            if (from[i] < 0 || from[i] >= c->world || from[i] == c->rank[i])
                return ft_fail(FT_ERR_ARGUMENT, func, 5, "from[%d] = %d: a rank from 0 to %d "
                               "other than %d's own", i + 1, from[i], c->world - 1, c->rank[i]);
            if (send[i] && ft_same_storage(send[i], recv[i]))
                return ft_fail(FT_ERR_ARGUMENT, func, 4, "recv[%d] shares memory with send[%d]",
                               i + 1, i + 1);
        }
    }
    /* between local ranks (one process, several devices) each send must
     * meet a receive of the same size: NCCL would wait for ever otherwise */
    for (int i = 0; i < n; i++) {
        if (!send[i])
            continue;
        for (int j = 0; j < n; j++) {
            if (c->rank[j] != to[i])
                continue;
            if (!recv[j] || from[j] != c->rank[i] || recv[j]->dtype != send[i]->dtype ||
                ft_numel(recv[j]) != ft_numel(send[i]))
                return ft_fail(FT_ERR_ARGUMENT, func, 4, "send[%d] (rank %d to %d) has no "
                               "matching recv[%d] (from %d, %s, %lld elements)", i + 1,
                               c->rank[i], to[i], j + 1, c->rank[i],
                               ft_dtype_name(send[i]->dtype), (long long)ft_numel(send[i]));
        }
    }
    ft_pending *p = calloc(1, sizeof *p);
    if (!p)
        return ft_fail(FT_ERR_NOMEM, func, 0, "out of memory");
    p->nlocal = c->nlocal;
    memcpy(p->device, c->device, sizeof p->device);
    p->held = calloc((size_t)(2 * n), sizeof *p->held);
    ft_status st = p->held ? FT_OK : ft_fail(FT_ERR_NOMEM, func, 0, "out of memory");
    for (int i = 0; st == FT_OK && i < n; i++) {
        cudaSetDevice(c->device[i]);
        if (cudaEventCreateWithFlags(&p->done[i], cudaEventDisableTiming) != cudaSuccess)
            st = ft_fail(FT_ERR_DEVICE, func, 0, "cudaEventCreate failed");
    }
    p2p a = {send, to, recv, from};
    if (st == FT_OK)
        st = group(c, func, "ncclSend/ncclRecv", issue_sendrecv, &a);
    for (int i = 0; st == FT_OK && i < c->nlocal; i++) {
        cudaSetDevice(c->device[i]);
        if (cudaEventRecord(p->done[i], c->stream[i]) != cudaSuccess)
            st = ft_fail(FT_ERR_DEVICE, func, 0, "cudaEventRecord failed");
    }
    /* the storages stay until the default streams have waited */
    for (int i = 0; st == FT_OK && i < n; i++) {
        if (send[i]) {
            ft_storage_retain(send[i]->storage);
            p->held[p->nheld++] = send[i]->storage;
        }
        if (recv[i]) {
            ft_storage_retain(recv[i]->storage);
            p->held[p->nheld++] = recv[i]->storage;
        }
    }
    if (st != FT_OK || !pending) {
        ft_status w = st == FT_OK ? ft_pending_wait(p) : FT_OK;
        p->waited = 1;
        ft_pending_free(p);
        return st != FT_OK ? st : w;
    }
    *pending = p;
    return FT_OK;
}

#else /* no NCCL */

struct ft_comm {
    int unused;
};
struct ft_pending {
    int unused;
};

int ft_dist_built(void) { return 0; }

static ft_status no_nccl(const char *func)
{
    return ft_fail(FT_ERR_UNSUPPORTED, func, 0,
                   "flashtile was built without NCCL (it needs a CUDA build that finds nccl.h "
                   "and libnccl: the CUDA toolkit's, or Debian's libnccl-dev)");
}

ft_status ft_dist_init_devices(ft_comm **out, int n, const int *devices)
{
    (void)n, (void)devices;
    *out = NULL;
    return no_nccl("ft_dist_init_devices");
}

ft_status ft_dist_init_rank(ft_comm **out, int rank, int world, int device, const char *id_file,
                            double timeout_s)
{
    (void)rank, (void)world, (void)device, (void)id_file, (void)timeout_s;
    *out = NULL;
    return no_nccl("ft_dist_init_rank");
}

void ft_comm_free(ft_comm *c) { (void)c; }
int ft_comm_world(const ft_comm *c) { return (void)c, 0; }
int ft_comm_local(const ft_comm *c) { return (void)c, 0; }
int ft_comm_rank(const ft_comm *c, int i) { return (void)c, (void)i, -1; }
int ft_comm_device(const ft_comm *c, int i) { return (void)c, (void)i, -1; }

ft_status ft_all_reduce(ft_comm *c, ft_tensor *const *ts, int n, ft_reduce_op op)
{
    (void)c, (void)ts, (void)n, (void)op;
    return no_nccl("ft_all_reduce");
}

ft_status ft_broadcast(ft_comm *c, ft_tensor *const *ts, int n, int root)
{
    (void)c, (void)ts, (void)n, (void)root;
    return no_nccl("ft_broadcast");
}

ft_status ft_all_gather(ft_comm *c, ft_tensor *const *out, const ft_tensor *const *in, int n)
{
    (void)c, (void)out, (void)in, (void)n;
    return no_nccl("ft_all_gather");
}

ft_status ft_reduce_scatter(ft_comm *c, ft_tensor *const *out, const ft_tensor *const *in, int n,
                            ft_reduce_op op)
{
    (void)c, (void)out, (void)in, (void)n, (void)op;
    return no_nccl("ft_reduce_scatter");
}

ft_status ft_sendrecv(ft_comm *c, const ft_tensor *const *send, const int *to,
                      ft_tensor *const *recv, const int *from, int n, ft_pending **pending)
{
    (void)c, (void)send, (void)to, (void)recv, (void)from, (void)n;
    if (pending)
        *pending = NULL;
    return no_nccl("ft_sendrecv");
}

ft_status ft_pending_wait(ft_pending *p)
{
    (void)p;
    return no_nccl("ft_pending_wait");
}

void ft_pending_free(ft_pending *p) { (void)p; }

#endif
