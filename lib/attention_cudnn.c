/*
 * attention_cudnn.c - impl "cudnn": cuDNN's fused flash attention, forward
 * and backward, through cuDNN's C backend graph API; the yardstick the
 * flash kernels are timed against (scripts/bench.lua --impl flash,cudnn).
 *
 *   q, out, dout, dq [B, Nq, H, d]    k, v, dk, dv [B, Nk, Hk, d]
 *   lse [B, H, Nq] f32, natural log   (flashtile's layout, strides as given)
 *
 * The graphs are the pattern cuDNN 9's runtime fusion engine runs as one
 * fused attention kernel (its composite SDPA graph), op by op, in cuDNN's
 * [b, h, s, d] order over flashtile's strides; K enters as K^T, the same
 * memory with the last two dims swapped, and V likewise in the backward:
 *
 *   forward   S = scale Q K^T, masked (-inf where key j > i + Nk - Nq),
 *             M = rowmax S, E = exp(S - M), Z = rowsum E,
 *             LSE = M + log Z (cuDNN's "stats"), P = E / Z (q's dtype),
 *             O = P V
 *   backward  D = rowsum(dO * O), P = exp(masked scale Q K^T - LSE),
 *             dV = P^T dO, dS = scale P (dO V^T - D), dK = dS^T Q,
 *             dQ = dS K (an f32 accumulator, then q's dtype)
 *   GQA/MQA   dK and dV per query head, then summed over each group
 *
 * Causal is bottom-right aligned as everywhere in flashtile: the mask
 * keeps key j for query i when i + Nk - Nq >= j (a shifted GEN_INDEX
 * comparison; top-left when Nq == Nk). cuDNN takes that for Nq <= Nk;
 * with Nq > Nk the first Nq - Nk query rows see no key, so they get a zero
 * output, LSE -inf and a zero dQ here, and cuDNN runs on the other Nk rows
 * (where the two alignments agree).
 *
 * A graph and its execution plan are built once for each (pass, device,
 * dtype, sizes, strides, mask, scale) and kept (PLAN_CACHE_SIZE of them,
 * the least recently used replaced first); a later call fills a variant
 * pack and executes. One cuDNN handle per device, on the legacy default
 * stream like all of flashtile's work; workspaces come from flashtile's
 * device allocator for each call. Handles and cached plans are kept for
 * the process, as cuBLAS's handles are (kernels/matmul.cu).
 *
 * FT_CUDNN_DEBUG=1 in the environment prints each step to stderr, a line
 * before each call into cuDNN that matters and flushed at once (the call,
 * the versions of cuDNN, the CUDA it was built for, flashtile's CUDA
 * runtime and the driver, cudnnCreate, the graph, the heuristics' engine
 * count, each plan tried, the workspace, the execution): the one place
 * the library prints, so that a first run on a new GPU or cuDNN can be
 * read, up to the step that failed or never returned. cuDNN's own log,
 * every API call with its arguments, comes with CUDNN_LOGLEVEL_DBG=3
 * CUDNN_LOGDEST_DBG=stderr (2: its warnings and errors only).
 *
 * Limits (attention.c refuses the rest, cuDNN names what it cannot run):
 * f16 and bf16, head_dim a multiple of 8 up to 256, no variant but causal,
 * no varlen; the backward sums dQ with atomics (not deterministic) and
 * does not take seqlen_q = seqlen_k = 1. Inputs that cuDNN cannot read
 * where they lie (data not 16-byte aligned, strides not multiples of 8
 * elements) are copied contiguous first.
 * Check: spec/cuda_cudnn_spec.lua (busted, tag gpu) against the CPU's f64
 * reference, as the flash kernels are checked.
 */
#define _GNU_SOURCE /* dladdr, RTLD_NOLOAD */
#include "internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef FT_HAVE_CUDNN
#include <dlfcn.h>
#include <float.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>

#include <cudnn_graph.h>

#define MAX_DEVICES 64       /* devices 0 .. 63 get a handle */
#define PLAN_CACHE_SIZE 64   /* plans kept; the least recently used goes first */
#define MAX_DESCRIPTORS 192  /* of one graph: tensors, operations, plan */
#define MAX_OPS 64
#define MAX_CONFIGS 32       /* engine configurations tried from one heuristic query */
#define BYTE_ALIGNMENT 16    /* of every tensor's data, as cuDNN's vector loads want */
#define STRIDE_STEP 8        /* 16 bytes of f16/bf16: the strides cuDNN takes */
/* cuDNN versions (as cudnnGetVersion numbers them) that changed the rules */
#define V_BOTTOM_RIGHT_ANY_LENGTH 90600 /* before: bottom-right causal needed lengths % 64 == 0 */
#define V_DQ_ACC_ZEROED 90600           /* before: the dQ accumulator had to come zeroed */
#define V_MASK_NEG_INF 91000            /* before: masked scores were -FLT_MAX, not -inf */

/* The tensors of the variant pack (cuDNN's unique ids); virtual tensors
 * are numbered from UID_VIRTUAL. */
enum {
    UID_Q = 1, UID_K, UID_V, UID_O, UID_STATS, UID_DO, UID_DQ, UID_DK, UID_DV,
    UID_D,       /* backward: rowsum(dO * O), f32 [B, H, Nq, 1] */
    UID_DQ_ACC,  /* backward: dQ's f32 accumulator [B, H, Nq, d] */
    UID_SCALE, UID_ONE, UID_NEG_INF, UID_NK, UID_NQ, /* scalars, by value */
    UID_COUNT,
    UID_VIRTUAL = 100
};

/* The strided tensors a key records, in [b, h, s, d] order. */
enum { T_Q, T_K, T_V, T_O, T_DO, T_DQ, T_DK, T_DV, T_COUNT };

enum { PASS_FORWARD, PASS_BACKWARD };
enum { MASK_NONE, MASK_CAUSAL, MASK_BOTTOM_RIGHT }; /* causal: Nq == Nk */

/* What a plan depends on; zeroed before it is filled, compared bytewise. */
typedef struct plan_key {
    int32_t pass, device, dtype, mask;
    double scale;
    int64_t B, H, Hk, Nq, Nk, d;
    int64_t stride[T_COUNT][4];
} plan_key;

/* One graph under construction, and then in the cache: every descriptor
 * it made (destroyed together), its operations, the non-virtual tensors
 * the variant pack must name. */
typedef struct graph {
    const char *func;
    cudnnBackendDescriptor_t desc[MAX_DESCRIPTORS];
    int ndesc;
    cudnnBackendDescriptor_t op[MAX_OPS];
    int nop;
    int64_t uid[UID_COUNT];
    int nuid;
    int64_t next_virtual;
    cudnnDataType_t io; /* q's dtype */
} graph;

typedef struct plan {
    plan_key key;
    graph g;
    cudnnBackendDescriptor_t exec; /* the execution plan (in g.desc) */
    int64_t workspace;             /* bytes */
    uint64_t used;                 /* the cache's clock when last used */
} plan;

/* Guards the handles, the cache and every use of a handle (a cuDNN
 * handle serves one thread at a time). */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static cudnnHandle_t handles[MAX_DEVICES];
static plan *cache[PLAN_CACHE_SIZE];
static uint64_t cache_clock;

/* ---- errors and the debug trace ---- */

static int debug_on(void)
{
    const char *e = getenv("FT_CUDNN_DEBUG");
    return e && *e && strcmp(e, "0") != 0;
}

static void debug(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void debug(const char *fmt, ...)
{
    if (!debug_on())
        return;
    va_list ap;
    va_start(ap, fmt);
    fputs("flashtile cudnn: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    fflush(stderr); /* each line out before the next call, should that one crash */
    va_end(ap);
}

/* Status categories of cuDNN 9 (the thousands of a status). */
static ft_status status_kind(cudnnStatus_t st)
{
    if (st == CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED ||
        st == CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED)
        return FT_ERR_NOMEM;
    if ((int)st / 1000 == CUDNN_STATUS_NOT_SUPPORTED / 1000)
        return FT_ERR_UNSUPPORTED;
    return FT_ERR_DEVICE;
}

/* "cuDNN: <what> failed: <status> (<cuDNN's last message>)" for func. */
static ft_status cudnn_fail(cudnnStatus_t st, const char *func, const char *what)
{
    char last[512] = "";
    debug("%s failed: %s", what, cudnnGetErrorString(st));
    cudnnGetLastErrorString(last, sizeof last);
    cudaGetLastError(); /* a CUDA error under a cuDNN one: cleared, the cuDNN one reported */
    if (last[0])
        debug("cuDNN's last message: %s", last);
    return ft_fail(status_kind(st), func, 0, "cuDNN: %s failed: %s%s%s%s", what,
                   cudnnGetErrorString(st), last[0] ? " (" : "", last, last[0] ? ")" : "");
}

static ft_status check(cudnnStatus_t st, const char *func, const char *what)
{
    return st == CUDNN_STATUS_SUCCESS ? FT_OK : cudnn_fail(st, func, what);
}

/* ---- descriptors ---- */

static ft_status create(graph *g, cudnnBackendDescriptorType_t type, cudnnBackendDescriptor_t *out,
                        const char *what)
{
    *out = NULL;
    if (g->ndesc == MAX_DESCRIPTORS)
        return ft_fail(FT_ERR_INTERNAL, g->func, 0, "cuDNN graph: more than %d descriptors",
                       MAX_DESCRIPTORS);
    FT_TRY(check(cudnnBackendCreateDescriptor(type, out), g->func, what));
    g->desc[g->ndesc++] = *out;
    return FT_OK;
}

/* cudnnBackendSetAttribute, its failure named after the attribute. */
static ft_status set_attr(graph *g, cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name,
                          cudnnBackendAttributeType_t type, int64_t count, const void *value,
                          const char *what)
{
    return check(cudnnBackendSetAttribute(d, name, type, count, value), g->func, what);
}
#define SET(g, d, name, type, count, value) set_attr(g, d, name, type, count, value, #name)

static ft_status finalize(graph *g, cudnnBackendDescriptor_t d, const char *what)
{
    return check(cudnnBackendFinalize(d), g->func, what);
}

static void graph_destroy(graph *g)
{
    while (g->ndesc > 0)
        cudnnBackendDestroyDescriptor(g->desc[--g->ndesc]);
    g->nop = 0;
}

static const int64_t SCALAR[4] = {1, 1, 1, 1};

/* A tensor [dim] with strides; uid 0 makes a virtual one (an
 * intermediate no pointer names). */
static ft_status tensor(graph *g, cudnnBackendDescriptor_t *t, int64_t uid, cudnnDataType_t type,
                        const int64_t *dim, const int64_t *stride, bool by_value)
{
    const bool is_virtual = uid == 0;
    const int64_t align = BYTE_ALIGNMENT;
    if (is_virtual)
        uid = g->next_virtual++;
    else if (g->nuid == UID_COUNT)
        return ft_fail(FT_ERR_INTERNAL, g->func, 0, "cuDNN graph: more than %d named tensors",
                       UID_COUNT);
    FT_TRY(create(g, CUDNN_BACKEND_TENSOR_DESCRIPTOR, t, "tensor descriptor"));
    FT_TRY(SET(g, *t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type));
    FT_TRY(SET(g, *t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dim));
    FT_TRY(SET(g, *t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, stride));
    FT_TRY(SET(g, *t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid));
    FT_TRY(SET(g, *t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align));
    FT_TRY(SET(g, *t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual));
    if (by_value)
        FT_TRY(SET(g, *t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value));
    FT_TRY(finalize(g, *t, "tensor descriptor"));
    if (!is_virtual)
        g->uid[g->nuid++] = uid;
    return FT_OK;
}

static ft_status virt(graph *g, cudnnBackendDescriptor_t *t, cudnnDataType_t type,
                      const int64_t *dim, const int64_t *stride)
{
    return tensor(g, t, 0, type, dim, stride, false);
}

/* A scalar passed by value at execution (host memory). */
static ft_status scalar(graph *g, cudnnBackendDescriptor_t *t, int64_t uid, cudnnDataType_t type)
{
    return tensor(g, t, uid, type, SCALAR, SCALAR, true);
}

/* An operation of the graph: its descriptor attributes attr[i] = desc[i]
 * (a NULL desc is left unset). */
static ft_status operation(graph *g, cudnnBackendDescriptorType_t type, const char *what, int n,
                           const cudnnBackendAttributeName_t *attr,
                           const cudnnBackendDescriptor_t *desc)
{
    if (g->nop == MAX_OPS)
        return ft_fail(FT_ERR_INTERNAL, g->func, 0, "cuDNN graph: more than %d operations",
                       MAX_OPS);
    cudnnBackendDescriptor_t op;
    FT_TRY(create(g, type, &op, what));
    for (int i = 0; i < n; i++)
        if (desc[i])
            FT_TRY(set_attr(g, op, attr[i], CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &desc[i], what));
    FT_TRY(finalize(g, op, what));
    g->op[g->nop++] = op;
    return FT_OK;
}

/* A finalized matmul or reduction descriptor computing in f32 (its
 * attribute comp), with an operator attribute first when op is set. */
static ft_status f32_descriptor(graph *g, cudnnBackendDescriptorType_t type,
                                cudnnBackendAttributeName_t comp, const cudnnReduceTensorOp_t *op,
                                cudnnBackendDescriptor_t *out, const char *what)
{
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    FT_TRY(create(g, type, out, what));
    if (op)
        FT_TRY(SET(g, *out, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1,
                   op));
    FT_TRY(set_attr(g, *out, comp, CUDNN_TYPE_DATA_TYPE, 1, &f32, what));
    return finalize(g, *out, what);
}

/* y = mode(x[, b][, t]) elementwise (broadcasting size-1 dims), computed
 * in prec; axis: GEN_INDEX's dim, else -1. */
static ft_status pointwise(graph *g, cudnnPointwiseMode_t mode, cudnnDataType_t prec,
                           cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
                           cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y, int64_t axis)
{
    cudnnBackendDescriptor_t pw;
    FT_TRY(create(g, CUDNN_BACKEND_POINTWISE_DESCRIPTOR, &pw, "pointwise descriptor"));
    FT_TRY(SET(g, pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode));
    FT_TRY(SET(g, pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec));
    if (axis >= 0)
        FT_TRY(SET(g, pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis));
    FT_TRY(finalize(g, pw, "pointwise descriptor"));
    const cudnnBackendAttributeName_t attr[5] = {
        CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_ATTR_OPERATION_POINTWISE_XDESC,
        CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_ATTR_OPERATION_POINTWISE_TDESC,
        CUDNN_ATTR_OPERATION_POINTWISE_YDESC};
    const cudnnBackendDescriptor_t desc[5] = {pw, x, b, t, y};
    return operation(g, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, "pointwise operation", 5,
                     attr, desc);
}

/* y = the f32 op-reduction of x over the dims where y has size 1, or over
 * the groups of x's heads that share one of y's. */
static ft_status reduction(graph *g, cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x,
                           cudnnBackendDescriptor_t y)
{
    cudnnBackendDescriptor_t red;
    FT_TRY(f32_descriptor(g, CUDNN_BACKEND_REDUCTION_DESCRIPTOR, CUDNN_ATTR_REDUCTION_COMP_TYPE,
                          &mode, &red, "reduction descriptor"));
    const cudnnBackendAttributeName_t attr[3] = {CUDNN_ATTR_OPERATION_REDUCTION_DESC,
                                                 CUDNN_ATTR_OPERATION_REDUCTION_XDESC,
                                                 CUDNN_ATTR_OPERATION_REDUCTION_YDESC};
    const cudnnBackendDescriptor_t desc[3] = {red, x, y};
    return operation(g, CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, "reduction operation", 3,
                     attr, desc);
}

/* c = a b over the last two dims (batched over the first two, a group of
 * heads sharing b's head under GQA), accumulated in f32. */
static ft_status matmul(graph *g, cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b,
                        cudnnBackendDescriptor_t c)
{
    cudnnBackendDescriptor_t mm;
    FT_TRY(f32_descriptor(g, CUDNN_BACKEND_MATMUL_DESCRIPTOR, CUDNN_ATTR_MATMUL_COMP_TYPE, NULL,
                          &mm, "matmul descriptor"));
    const cudnnBackendAttributeName_t attr[4] = {
        CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_ATTR_OPERATION_MATMUL_BDESC,
        CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_ATTR_OPERATION_MATMUL_DESC};
    const cudnnBackendDescriptor_t desc[4] = {a, b, c, mm};
    return operation(g, CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, "matmul operation", 4, attr,
                     desc);
}

/* y = x seen through y's dims and strides (a transpose, here). */
static ft_status reshape(graph *g, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y)
{
    const cudnnBackendAttributeName_t attr[2] = {CUDNN_ATTR_OPERATION_RESHAPE_XDESC,
                                                 CUDNN_ATTR_OPERATION_RESHAPE_YDESC};
    const cudnnBackendDescriptor_t desc[2] = {x, y};
    return operation(g, CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, "reshape operation", 2, attr,
                     desc);
}

/* ---- the graphs ---- */

/* The shapes the graphs share, from a key: scores [B, H, Nq, Nk] packed,
 * row statistics [B, H, Nq, 1] packed (LSE's own layout), and the
 * transposed scores [B, H, Nk, Nq] over the same memory. */
typedef struct dims {
    int64_t q[4], kt[4], kt_stride[4], k[4], v[4], vt[4], vt_stride[4];
    int64_t kv_full[4]; /* dK, dV per query head, before the sum over a group */
    int64_t s[4], s_stride[4], st[4], st_stride[4], row[4], row_stride[4];
} dims;

static void graph_dims(const plan_key *key, dims *m)
{
    const int64_t B = key->B, H = key->H, Hk = key->Hk, Nq = key->Nq, Nk = key->Nk, d = key->d;
    const int64_t *ks = key->stride[T_K], *vs = key->stride[T_V];
    const int64_t q[4] = {B, H, Nq, d}, k[4] = {B, Hk, Nk, d}, kt[4] = {B, Hk, d, Nk};
    const int64_t kts[4] = {ks[0], ks[1], ks[3], ks[2]}, vts[4] = {vs[0], vs[1], vs[3], vs[2]};
    const int64_t s[4] = {B, H, Nq, Nk}, ss[4] = {H * Nq * Nk, Nq * Nk, Nk, 1};
    const int64_t st[4] = {B, H, Nk, Nq}, sts[4] = {H * Nq * Nk, Nq * Nk, 1, Nk};
    const int64_t row[4] = {B, H, Nq, 1}, rows[4] = {H * Nq, Nq, 1, 1};
    const int64_t full[4] = {B, H, Nk, d};
    memcpy(m->q, q, sizeof q);
    memcpy(m->k, k, sizeof k);
    memcpy(m->v, k, sizeof k);
    memcpy(m->kt, kt, sizeof kt);
    memcpy(m->vt, kt, sizeof kt);
    memcpy(m->kt_stride, kts, sizeof kts);
    memcpy(m->vt_stride, vts, sizeof vts);
    memcpy(m->kv_full, full, sizeof full);
    memcpy(m->s, s, sizeof s);
    memcpy(m->s_stride, ss, sizeof ss);
    memcpy(m->st, st, sizeof st);
    memcpy(m->st_stride, sts, sizeof sts);
    memcpy(m->row, row, sizeof row);
    memcpy(m->row_stride, rows, sizeof rows);
}

/* *y = x with -inf where the causal mask hides the score (x itself
 * without a mask): keep key j for query i when i [+ Nk - Nq] >= j. */
static ft_status causal_mask(graph *g, const plan_key *key, const dims *m,
                             cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t *y)
{
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT, i32 = CUDNN_DATA_INT32,
                          boolean = CUDNN_DATA_BOOLEAN;
    cudnnBackendDescriptor_t row, col, keep, neg_inf;
    *y = x;
    if (key->mask == MASK_NONE)
        return FT_OK;
    FT_TRY(virt(g, &row, i32, m->s, m->s_stride));
    FT_TRY(pointwise(g, CUDNN_POINTWISE_GEN_INDEX, f32, x, NULL, NULL, row, 2));
    FT_TRY(virt(g, &col, i32, m->s, m->s_stride));
    FT_TRY(pointwise(g, CUDNN_POINTWISE_GEN_INDEX, f32, x, NULL, NULL, col, 3));
    if (key->mask == MASK_BOTTOM_RIGHT) { /* the diagonal shifted by Nk - Nq */
        cudnnBackendDescriptor_t nk, nq, plus_nk, shifted;
        FT_TRY(scalar(g, &nk, UID_NK, i32));
        FT_TRY(scalar(g, &nq, UID_NQ, i32));
        FT_TRY(virt(g, &plus_nk, i32, m->s, m->s_stride));
        FT_TRY(pointwise(g, CUDNN_POINTWISE_ADD, i32, row, nk, NULL, plus_nk, -1));
        FT_TRY(virt(g, &shifted, i32, m->s, m->s_stride));
        FT_TRY(pointwise(g, CUDNN_POINTWISE_SUB, i32, plus_nk, nq, NULL, shifted, -1));
        row = shifted;
    }
    FT_TRY(virt(g, &keep, boolean, m->s, m->s_stride));
    FT_TRY(pointwise(g, CUDNN_POINTWISE_CMP_GE, boolean, row, col, NULL, keep, -1));
    FT_TRY(scalar(g, &neg_inf, UID_NEG_INF, f32));
    FT_TRY(virt(g, y, f32, m->s, m->s_stride));
    /* y = keep ? x : -inf */
    return pointwise(g, CUDNN_POINTWISE_BINARY_SELECT, f32, x, neg_inf, keep, *y, -1);
}

static ft_status graph_forward(graph *g, const plan_key *key)
{
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    dims m;
    graph_dims(key, &m);
    cudnnBackendDescriptor_t q, kt, v, o, stats, scale, s, scaled, masked, mx, shifted, e, z, logz,
        p;
    FT_TRY(tensor(g, &q, UID_Q, g->io, m.q, key->stride[T_Q], false));
    FT_TRY(tensor(g, &kt, UID_K, g->io, m.kt, m.kt_stride, false));
    FT_TRY(tensor(g, &v, UID_V, g->io, m.v, key->stride[T_V], false));
    FT_TRY(tensor(g, &o, UID_O, g->io, m.q, key->stride[T_O], false));
    FT_TRY(tensor(g, &stats, UID_STATS, f32, m.row, m.row_stride, false));
    FT_TRY(scalar(g, &scale, UID_SCALE, f32));

    FT_TRY(virt(g, &s, f32, m.s, m.s_stride));
    FT_TRY(matmul(g, q, kt, s));
    FT_TRY(virt(g, &scaled, f32, m.s, m.s_stride));
    FT_TRY(pointwise(g, CUDNN_POINTWISE_MUL, f32, s, scale, NULL, scaled, -1));
    FT_TRY(causal_mask(g, key, &m, scaled, &masked));
    /* softmax, and LSE = M + log Z as the stats */
    FT_TRY(virt(g, &mx, f32, m.row, m.row_stride));
    FT_TRY(reduction(g, CUDNN_REDUCE_TENSOR_MAX, masked, mx));
    FT_TRY(virt(g, &shifted, f32, m.s, m.s_stride));
    FT_TRY(pointwise(g, CUDNN_POINTWISE_SUB, f32, masked, mx, NULL, shifted, -1));
    FT_TRY(virt(g, &e, f32, m.s, m.s_stride));
    FT_TRY(pointwise(g, CUDNN_POINTWISE_EXP, f32, shifted, NULL, NULL, e, -1));
    FT_TRY(virt(g, &z, f32, m.row, m.row_stride));
    FT_TRY(reduction(g, CUDNN_REDUCE_TENSOR_ADD, e, z));
    FT_TRY(virt(g, &logz, f32, m.row, m.row_stride));
    FT_TRY(pointwise(g, CUDNN_POINTWISE_LOG, f32, z, NULL, NULL, logz, -1));
    FT_TRY(pointwise(g, CUDNN_POINTWISE_ADD, f32, mx, logz, NULL, stats, -1));
    /* P in q's dtype, the second matmul's input type */
    FT_TRY(virt(g, &p, g->io, m.s, m.s_stride));
    FT_TRY(pointwise(g, CUDNN_POINTWISE_DIV, f32, e, z, NULL, p, -1));
    return matmul(g, p, v, o);
}

/* dX = a b, or under GQA a b per query head, summed over each group. */
static ft_status matmul_grouped(graph *g, const plan_key *key, const dims *m,
                                cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b,
                                cudnnBackendDescriptor_t dx)
{
    if (key->H == key->Hk)
        return matmul(g, a, b, dx);
    const int64_t full_stride[4] = {key->H * key->Nk * key->d, key->Nk * key->d, key->d, 1};
    cudnnBackendDescriptor_t full;
    FT_TRY(virt(g, &full, g->io, m->kv_full, full_stride));
    FT_TRY(matmul(g, a, b, full));
    return reduction(g, CUDNN_REDUCE_TENSOR_ADD, full, dx);
}

static ft_status graph_backward(graph *g, const plan_key *key)
{
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    dims m;
    graph_dims(key, &m);
    const int64_t B = key->B, H = key->H, Nq = key->Nq, d = key->d;
    const int64_t acc_stride[4] = {H * Nq * d, Nq * d, d, 1};
    const int64_t prod_stride[4] = {H * Nq * d, Nq * d, H * d, 1};
    cudnnBackendDescriptor_t q, kt, vt, o, dout, stats, dq, dk, dv, dsum, dq_acc, scale, one;
    FT_TRY(tensor(g, &q, UID_Q, g->io, m.q, key->stride[T_Q], false));
    FT_TRY(tensor(g, &kt, UID_K, g->io, m.kt, m.kt_stride, false));
    FT_TRY(tensor(g, &vt, UID_V, g->io, m.vt, m.vt_stride, false));
    FT_TRY(tensor(g, &o, UID_O, g->io, m.q, key->stride[T_O], false));
    FT_TRY(tensor(g, &dout, UID_DO, g->io, m.q, key->stride[T_DO], false));
    FT_TRY(tensor(g, &stats, UID_STATS, f32, m.row, m.row_stride, false));
    FT_TRY(tensor(g, &dq, UID_DQ, g->io, m.q, key->stride[T_DQ], false));
    FT_TRY(tensor(g, &dk, UID_DK, g->io, m.k, key->stride[T_DK], false));
    FT_TRY(tensor(g, &dv, UID_DV, g->io, m.v, key->stride[T_DV], false));
    FT_TRY(tensor(g, &dsum, UID_D, f32, m.row, m.row_stride, false));
    FT_TRY(tensor(g, &dq_acc, UID_DQ_ACC, f32, (const int64_t[4]){B, H, Nq, d}, acc_stride,
                  false));
    FT_TRY(scalar(g, &scale, UID_SCALE, f32));
    FT_TRY(scalar(g, &one, UID_ONE, f32));

    /* D = rowsum(dO * O) */
    cudnnBackendDescriptor_t prod, rowsum;
    FT_TRY(virt(g, &prod, f32, m.q, prod_stride));
    FT_TRY(pointwise(g, CUDNN_POINTWISE_MUL, f32, dout, o, NULL, prod, -1));
    FT_TRY(virt(g, &rowsum, f32, m.row, m.row_stride));
    FT_TRY(reduction(g, CUDNN_REDUCE_TENSOR_ADD, prod, rowsum));
    FT_TRY(pointwise(g, CUDNN_POINTWISE_MUL, f32, rowsum, one, NULL, dsum, -1));

    /* P = exp(masked scale Q K^T - LSE); dV = P^T dO */
    cudnnBackendDescriptor_t s, scaled, centred, masked, p, pt;
    FT_TRY(virt(g, &s, f32, m.s, m.s_stride));
    FT_TRY(matmul(g, q, kt, s));
    FT_TRY(virt(g, &scaled, f32, m.s, m.s_stride));
    FT_TRY(pointwise(g, CUDNN_POINTWISE_MUL, f32, s, scale, NULL, scaled, -1));
    FT_TRY(virt(g, &centred, f32, m.s, m.s_stride));
    FT_TRY(pointwise(g, CUDNN_POINTWISE_SUB, f32, scaled, stats, NULL, centred, -1));
    FT_TRY(causal_mask(g, key, &m, centred, &masked));
    FT_TRY(virt(g, &p, f32, m.s, m.s_stride));
    FT_TRY(pointwise(g, CUDNN_POINTWISE_EXP, f32, masked, NULL, NULL, p, -1));
    FT_TRY(virt(g, &pt, g->io, m.st, m.st_stride));
    FT_TRY(reshape(g, p, pt));
    FT_TRY(matmul_grouped(g, key, &m, pt, dout, dv));

    /* dS = scale P (dO V^T - D); dK = dS^T Q */
    cudnnBackendDescriptor_t dp, dp_centred, ds, ds_scaled, dst;
    FT_TRY(virt(g, &dp, f32, m.s, m.s_stride));
    FT_TRY(matmul(g, dout, vt, dp));
    FT_TRY(virt(g, &dp_centred, f32, m.s, m.s_stride));
    FT_TRY(pointwise(g, CUDNN_POINTWISE_SUB, f32, dp, dsum, NULL, dp_centred, -1));
    FT_TRY(virt(g, &ds, f32, m.s, m.s_stride));
    FT_TRY(pointwise(g, CUDNN_POINTWISE_MUL, f32, dp_centred, p, NULL, ds, -1));
    FT_TRY(virt(g, &ds_scaled, f32, m.s, m.s_stride));
    FT_TRY(pointwise(g, CUDNN_POINTWISE_MUL, f32, ds, scale, NULL, ds_scaled, -1));
    FT_TRY(virt(g, &dst, g->io, m.st, m.st_stride));
    FT_TRY(reshape(g, ds_scaled, dst));
    FT_TRY(matmul_grouped(g, key, &m, dst, q, dk));

    /* dQ = dS K, summed in f32, then in q's dtype */
    cudnnBackendDescriptor_t k;
    FT_TRY(virt(g, &k, g->io, m.k, key->stride[T_K]));
    FT_TRY(reshape(g, kt, k));
    FT_TRY(matmul(g, ds_scaled, k, dq_acc));
    return pointwise(g, CUDNN_POINTWISE_IDENTITY, f32, dq_acc, NULL, NULL, dq, -1);
}

/* The operation graph of g, then an execution plan from the first engine
 * configuration cuDNN's heuristics offer that finalizes (mode A, then the
 * fallback list). */
static ft_status build_plan(graph *g, cudnnHandle_t handle, cudnnBackendDescriptor_t *exec,
                            int64_t *workspace)
{
    cudnnBackendDescriptor_t opgraph;
    FT_TRY(create(g, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, &opgraph, "operation graph"));
    FT_TRY(SET(g, opgraph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, g->nop,
               g->op));
    FT_TRY(SET(g, opgraph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle));
    debug("finalizing the operation graph");
    FT_TRY(finalize(g, opgraph, "operation graph"));
    debug("operation graph: %d operations, %d descriptors", g->nop, g->ndesc);

    static const cudnnBackendHeurMode_t modes[2] = {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK};
    static const char *const mode_names[2] = {"A", "fallback"};
    char last[512] = "no engine configuration was offered";
    for (int mi = 0; mi < 2; mi++) {
        cudnnBackendDescriptor_t heur;
        FT_TRY(create(g, CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, &heur, "engine heuristics"));
        FT_TRY(SET(g, heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                   &opgraph));
        FT_TRY(SET(g, heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &modes[mi]));
        debug("heuristics (mode %s): querying", mode_names[mi]);
        cudnnStatus_t st = cudnnBackendFinalize(heur);
        int64_t count = 0;
        if (st == CUDNN_STATUS_SUCCESS)
            st = cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                          CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, NULL);
        if (st != CUDNN_STATUS_SUCCESS) {
            ft_status fs = cudnn_fail(st, g->func, "engine heuristics");
            snprintf(last, sizeof last, "%s", ft_last_error_detail());
            if (mi == 1)
                return fs;
            continue;
        }
        debug("heuristics (mode %s): %lld engine configurations", mode_names[mi], (long long)count);
        if (count > MAX_CONFIGS)
            count = MAX_CONFIGS;
        cudnnBackendDescriptor_t cfg[MAX_CONFIGS];
        int made = 0;
        for (; made < count; made++)
            if (cudnnBackendCreateDescriptor(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, &cfg[made]) !=
                CUDNN_STATUS_SUCCESS)
                break;
        int64_t got = 0;
        st = made > 0 ? cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                 CUDNN_TYPE_BACKEND_DESCRIPTOR, made, &got, cfg)
                      : CUDNN_STATUS_SUCCESS;
        if (st != CUDNN_STATUS_SUCCESS) {
            cudnn_fail(st, g->func, "engine heuristics' results");
            snprintf(last, sizeof last, "%s", ft_last_error_detail());
            got = 0;
        }
        int chosen = -1;
        if (g->ndesc + 2 > MAX_DESCRIPTORS)
            got = 0; /* no room to keep a plan: reported below */
        for (int i = 0; i < got && chosen < 0; i++) {
            debug("configuration %d of %lld: finalizing a plan", i, (long long)got);
            cudnnBackendDescriptor_t pl = NULL;
            st = cudnnBackendCreateDescriptor(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &pl);
            if (st == CUDNN_STATUS_SUCCESS)
                st = cudnnBackendSetAttribute(pl, CUDNN_ATTR_EXECUTION_PLAN_HANDLE,
                                              CUDNN_TYPE_HANDLE, 1, &handle);
            if (st == CUDNN_STATUS_SUCCESS)
                st = cudnnBackendSetAttribute(pl, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                                              CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfg[i]);
            if (st == CUDNN_STATUS_SUCCESS)
                st = cudnnBackendFinalize(pl);
            int64_t ws = 0, n = 0;
            if (st == CUDNN_STATUS_SUCCESS)
                st = cudnnBackendGetAttribute(pl, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                              CUDNN_TYPE_INT64, 1, &n, &ws);
            if (st != CUDNN_STATUS_SUCCESS) {
                char msg[384] = "";
                cudnnGetLastErrorString(msg, sizeof msg);
                snprintf(last, sizeof last, "the last plan tried: %s%s%s",
                         cudnnGetErrorString(st), msg[0] ? ": " : "", msg);
                debug("configuration %d: no plan (%s)", i, last);
                if (pl)
                    cudnnBackendDestroyDescriptor(pl);
                continue;
            }
            chosen = i;
            *exec = pl;
            *workspace = ws;
        }
        for (int i = 0; i < made; i++) /* the chosen one stays with the plan */
            if (i != chosen)
                cudnnBackendDestroyDescriptor(cfg[i]);
        if (chosen >= 0) {
            g->desc[g->ndesc++] = cfg[chosen];
            g->desc[g->ndesc++] = *exec; /* destroyed first: made last */
            debug("plan from configuration %d (mode %s): workspace %lld bytes", chosen,
                  mode_names[mi], (long long)*workspace);
            return FT_OK;
        }
    }
    cudaGetLastError();
    return ft_fail(FT_ERR_UNSUPPORTED, g->func, 0,
                   "cuDNN has no engine for this attention (its fused attention takes sm80 or "
                   "newer, f16/bf16, head_dim a multiple of 8 up to 256, 128 before Hopper); %s",
                   last);
}

/* ---- handles and the plan cache (the lock held) ---- */

/* cuDNN's sub-libraries, which cudnnCreate loads, bind some references in
 * the process's global scope. A host that links flashtile (and so cuDNN)
 * into the program has it all there; Lua loads flashtile's module with
 * RTLD_LOCAL, and there cudnnCreate called address 0 through pthread_once
 * on the H200 (cuDNN 9.14), where a C program linked with cuDNN, or Lua
 * with cuDNN or libstdc++ preloaded, ran the same calls. Promoting cuDNN
 * or libstdc++ alone did not help; opening libflashtile itself again with
 * RTLD_GLOBAL (RTLD_NOLOAD: it is already there) puts it and everything it
 * loaded in the global scope, and then cuDNN runs from Lua. It must come
 * before any call into cuDNN (cudnnGetVersion included), which loads the
 * sub-library and binds its references, once. The handle stays open with
 * the process. */
static void symbols_global_once(void)
{
    Dl_info me;
    if (dladdr((void *)ft_cudnn_version, &me) && me.dli_fname &&
        dlopen(me.dli_fname, RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD))
        debug("%s: symbols made global", me.dli_fname);
}

static void cudnn_symbols_global(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, symbols_global_once);
}

static ft_status device_handle(const char *func, int index, cudnnHandle_t *out)
{
    if (index < 0 || index >= MAX_DEVICES)
        return ft_fail(FT_ERR_UNSUPPORTED, func, 0,
                       "CUDA device %d: cuDNN handles are kept for devices 0..%d only", index,
                       MAX_DEVICES - 1);
    if (!handles[index]) {
        cudnn_symbols_global();
        const size_t runtime = cudnnGetVersion(), cudnn_cuda = cudnnGetCudartVersion();
        int cuda_runtime = 0, driver = 0;
        cudaRuntimeGetVersion(&cuda_runtime);
        cudaDriverGetVersion(&driver);
        debug("cuda:%d has no handle yet: cuDNN %zu (headers %d) built for CUDA %zu; flashtile's "
              "CUDA runtime %d, driver %d; cuDNN's own log: CUDNN_LOGLEVEL_DBG=3 "
              "CUDNN_LOGDEST_DBG=stderr", index, runtime, CUDNN_VERSION, cudnn_cuda, cuda_runtime,
              driver);
        if (runtime / 10000 != CUDNN_MAJOR)
            return ft_fail(FT_ERR_UNSUPPORTED, func, 0,
                           "the cuDNN library loaded is %zu, flashtile was built with cuDNN %d "
                           "headers (another major version)", runtime, CUDNN_VERSION);
        if (cudnn_cuda / 1000 != (size_t)cuda_runtime / 1000)
            debug("cuDNN was built for CUDA %zu.x, flashtile runs CUDA %d.x: another major "
                  "version (CUDNN_ROOT picks a cuDNN for this CUDA)", cudnn_cuda / 1000,
                  cuda_runtime / 1000);
        cudnnHandle_t h = NULL;
        debug("cudnnCreate for cuda:%d", index);
        const cudnnStatus_t cs = cudnnCreate(&h);
        debug("cudnnCreate returned %s, handle %p", cudnnGetErrorString(cs), (void *)h);
        FT_TRY(check(cs, func, "cudnnCreate"));
        debug("cudnnSetStream(handle, legacy default stream)");
        ft_status st = check(cudnnSetStream(h, 0), func, "cudnnSetStream");
        if (st != FT_OK) {
            cudnnDestroy(h);
            return st;
        }
        handles[index] = h;
        debug("handle for cuda:%d ready", index);
    }
    *out = handles[index];
    return FT_OK;
}

static void plan_free(plan *p)
{
    if (!p)
        return;
    graph_destroy(&p->g);
    free(p);
}

static void describe(char *buf, size_t size, const plan_key *key)
{
    static const char *const masks[3] = {"none", "causal", "causal bottom-right"};
    snprintf(buf, size, "%s %s B=%lld H=%lld Hk=%lld Nq=%lld Nk=%lld d=%lld mask=%s scale=%g",
             key->pass == PASS_FORWARD ? "forward" : "backward",
             ft_dtype_name((ft_dtype)key->dtype), (long long)key->B, (long long)key->H,
             (long long)key->Hk, (long long)key->Nq, (long long)key->Nk, (long long)key->d,
             masks[key->mask], key->scale);
}

/* The cached plan for key, or a new one (replacing the least recently
 * used when the cache is full). */
static ft_status find_plan(const char *func, const plan_key *key, cudnnHandle_t handle,
                           plan **out)
{
    char what[256];
    int slot = 0;
    for (int i = 0; i < PLAN_CACHE_SIZE; i++) {
        if (cache[i] && memcmp(&cache[i]->key, key, sizeof *key) == 0) {
            debug("plan found in the cache");
            cache[i]->used = ++cache_clock;
            *out = cache[i];
            return FT_OK;
        }
        if (!cache[i] || (cache[slot] && cache[i]->used < cache[slot]->used))
            slot = i;
    }
    describe(what, sizeof what, key);
    debug("building the %s graph", what);
    plan *p = calloc(1, sizeof *p);
    if (!p)
        return ft_fail(FT_ERR_NOMEM, func, 0, "out of memory for a cuDNN plan");
    p->key = *key;
    p->g.func = func;
    p->g.next_virtual = UID_VIRTUAL;
    p->g.io = key->dtype == FT_BF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
    ft_status st = key->pass == PASS_FORWARD ? graph_forward(&p->g, key)
                                             : graph_backward(&p->g, key);
    if (st == FT_OK) {
        debug("graph made: %d operations, %d descriptors, %d named tensors", p->g.nop, p->g.ndesc,
              p->g.nuid);
        st = build_plan(&p->g, handle, &p->exec, &p->workspace);
    }
    if (st != FT_OK) {
        /* the message names the call */
        char detail[768];
        snprintf(detail, sizeof detail, "%s", ft_last_error_detail());
        const ft_status kind = st;
        plan_free(p);
        return ft_fail(kind, func, 0, "%s (impl 'cudnn', %s)", detail, what);
    }
    plan_free(cache[slot]);
    p->used = ++cache_clock;
    cache[slot] = p;
    *out = p;
    return FT_OK;
}

/* Runs p with the pointers ptr[uid] (device memory; host memory for the
 * scalars) and a workspace from flashtile's allocator. */
static ft_status execute(const char *func, cudnnHandle_t handle, const plan *p,
                         void *const *ptr, ft_device device)
{
    ft_tensor *ws = NULL;
    const int64_t words = (p->workspace + 3) / 4;
    if (p->workspace > 0)
        FT_TRY(ft_empty_named(&ws, 1, &words, FT_F32, device, func));
    void *ws_ptr = ws ? ws->data : NULL;
    void *data[UID_COUNT];
    for (int i = 0; i < p->g.nuid; i++)
        data[i] = ptr[p->g.uid[i]];
    cudnnBackendDescriptor_t pack = NULL;
    cudnnStatus_t st = cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &pack);
    const char *what = "variant pack";
    if (st == CUDNN_STATUS_SUCCESS)
        st = cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64,
                                      p->g.nuid, p->g.uid);
    if (st == CUDNN_STATUS_SUCCESS)
        st = cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
                                      CUDNN_TYPE_VOID_PTR, p->g.nuid, data);
    if (st == CUDNN_STATUS_SUCCESS)
        st = cudnnBackendSetAttribute(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR,
                                      1, &ws_ptr);
    if (st == CUDNN_STATUS_SUCCESS)
        st = cudnnBackendFinalize(pack);
    if (st == CUDNN_STATUS_SUCCESS) {
        what = "cudnnBackendExecute";
        debug("cudnnBackendExecute: %d tensors, workspace %p", p->g.nuid, ws_ptr);
        st = cudnnBackendExecute(handle, p->exec, pack);
        debug("cudnnBackendExecute returned %s", cudnnGetErrorString(st));
    } else {
        debug("the variant pack failed: %s", cudnnGetErrorString(st));
    }
    ft_status fs = st == CUDNN_STATUS_SUCCESS ? FT_OK : cudnn_fail(st, func, what);
    if (pack)
        cudnnBackendDestroyDescriptor(pack);
    ft_tensor_free(ws); /* stream-ordered: after the work queued before it */
    if (fs == FT_OK)
        fs = ft_cuda_check_launch(func, __FILE__, __LINE__);
    return fs;
}

/* ---- the calls ---- */

/* t [B, N, heads, d] as cuDNN's [b, h, s, d] strides. A dim of size 1 gets
 * the largest extent of the others (its stride is never used, and cuDNN
 * reads a layout from the strides). */
static void bhsd_strides(const ft_tensor *t, int64_t out[4])
{
    int64_t st[4], outer = 1;
    for (int i = 0; i < 4; i++)
        if (t->shape[i] > 1 && t->stride[i] * t->shape[i] > outer)
            outer = t->stride[i] * t->shape[i];
    for (int i = 0; i < 4; i++)
        st[i] = t->shape[i] == 1 ? outer : t->stride[i];
    out[0] = st[0], out[1] = st[2], out[2] = st[1], out[3] = st[3];
}

/* Whether cuDNN reads t where it lies: 16-byte aligned data, strides of
 * the dims with more than one element positive multiples of 8 elements
 * (the last one is 1). */
static int readable(const ft_tensor *t)
{
    if ((uintptr_t)t->data % BYTE_ALIGNMENT != 0)
        return 0;
    for (int i = 0; i < t->ndim - 1; i++)
        if (t->shape[i] > 1 && (t->stride[i] <= 0 || t->stride[i] % STRIDE_STEP != 0))
            return 0;
    return 1;
}

/* *use = t, or a contiguous copy of it in *copy (freed by the caller): a
 * new allocation (ft_contiguous would give a contiguous t itself, whose
 * address may be what cuDNN cannot read). */
static ft_status readable_input(const ft_tensor *t, ft_tensor **copy, const ft_tensor **use)
{
    *copy = NULL;
    *use = t;
    if (readable(t))
        return FT_OK;
    FT_TRY(ft_clone(copy, t));
    *use = *copy;
    return FT_OK;
}

/* Rows r0 .. r0 + n - 1 (dim 1) of t [B, N, heads, d] or of an lse
 * [B, H, N] (dim 2): a view on the stack, never freed. */
static ft_tensor rows(const ft_tensor *t, int dim, int64_t r0, int64_t n)
{
    ft_tensor v = *t;
    v.shape[dim] = n;
    v.data = ft_elem_ptr(t, r0 * t->stride[dim]);
    return v;
}

/* The key of a call's tensors; q [B, Nq, H, d] as cuDNN sees it. */
static void make_key(plan_key *key, int pass, const ft_attn_shape *s, int64_t Nq,
                     const ft_tensor *const *t)
{
    memset(key, 0, sizeof *key);
    key->pass = pass;
    key->device = t[T_Q]->device.index;
    key->dtype = (int32_t)s->dtype;
    key->mask = !s->causal ? MASK_NONE : Nq == s->Nk ? MASK_CAUSAL : MASK_BOTTOM_RIGHT;
    key->scale = s->scale;
    key->B = s->B, key->H = s->H, key->Hk = s->Hk, key->Nq = Nq, key->Nk = s->Nk, key->d = s->d;
    for (int i = 0; i < T_COUNT; i++)
        if (t[i])
            bhsd_strides(t[i], key->stride[i]);
}

/* Looks the plan up (or builds it) and runs it, under the lock. */
static ft_status run(const char *func, const plan_key *key, void **ptr, ft_device device)
{
    debug("selecting cuda:%d", device.index);
    FT_TRY(ft_cuda_use_device(device.index, func));
    pthread_mutex_lock(&lock);
    cudnnHandle_t handle = NULL;
    plan *p = NULL;
    ft_status st = device_handle(func, device.index, &handle);
    if (st == FT_OK) {
        debug("looking up the plan");
        st = find_plan(func, key, handle, &p);
    }
    if (st == FT_OK) {
        debug("executing the %s plan (workspace %lld bytes)",
              key->pass == PASS_FORWARD ? "forward" : "backward", (long long)p->workspace);
        st = execute(func, handle, p, ptr, device);
    }
    pthread_mutex_unlock(&lock);
    return st;
}

/* The scalars every graph may read, by value. */
typedef struct scalars {
    float scale, one, neg_inf;
    int32_t nq, nk;
} scalars;

static void fill_scalars(scalars *c, void **ptr, const ft_attn_shape *s, int64_t Nq)
{
    c->scale = (float)s->scale;
    c->one = 1.0f;
    c->neg_inf = ft_cudnn_version() >= V_MASK_NEG_INF ? -INFINITY : -FLT_MAX;
    c->nq = (int32_t)Nq;
    c->nk = (int32_t)s->Nk;
    ptr[UID_SCALE] = &c->scale;
    ptr[UID_ONE] = &c->one;
    ptr[UID_NEG_INF] = &c->neg_inf;
    ptr[UID_NQ] = &c->nq;
    ptr[UID_NK] = &c->nk;
}

/* Causal with Nq > Nk: how many leading query rows see no key. */
static int64_t blind_rows(const ft_attn_shape *s)
{
    return s->causal && s->Nq > s->Nk ? s->Nq - s->Nk : 0;
}

static ft_status check_lengths(const char *func, const ft_attn_shape *s, int64_t Nq)
{
    if (s->causal && Nq != s->Nk && ft_cudnn_version() < V_BOTTOM_RIGHT_ANY_LENGTH &&
        (Nq % 64 != 0 || s->Nk % 64 != 0))
        return ft_fail(FT_ERR_UNSUPPORTED, func, 1,
                       "impl 'cudnn': cuDNN %d takes causal with seqlen_q != seqlen_k only for "
                       "lengths that are multiples of 64 (9.6 and later take any), got %lld and "
                       "%lld", ft_cudnn_version(), (long long)Nq, (long long)s->Nk);
    return FT_OK;
}

int ft_cudnn_version(void)
{
    cudnn_symbols_global();
    return (int)cudnnGetVersion();
}

/* The debug trace's first line of a call. */
static void debug_entry(const char *pass, const ft_attn_shape *s, const ft_tensor *q)
{
    if (!debug_on())
        return;
    debug("%s: %s B=%lld H=%lld Hk=%lld Nq=%lld Nk=%lld d=%lld causal=%d scale=%g, q on %s:%d "
          "at %p, strides %lld %lld %lld %lld", pass, ft_dtype_name(s->dtype), (long long)s->B,
          (long long)s->H, (long long)s->Hk, (long long)s->Nq, (long long)s->Nk, (long long)s->d,
          s->causal, s->scale, q->device.type == FT_CUDA ? "cuda" : "cpu", q->device.index,
          q->data, (long long)q->stride[0], (long long)q->stride[1], (long long)q->stride[2],
          (long long)q->stride[3]);
}

ft_status ft_attention_forward_cudnn(const ft_attn_shape *s, const ft_tensor *q,
                                     const ft_tensor *k, const ft_tensor *v, ft_tensor *out,
                                     ft_tensor *lse)
{
    static const char func[] = "ft_attention_forward";
    debug_entry("forward", s, q);
    if (s->B == 0 || s->H == 0 || s->Nq == 0)
        return FT_OK;
    if (s->Nk == 0) { /* no key at all */
        FT_TRY(ft_fill(out, 0.0));
        return ft_fill(lse, -INFINITY);
    }
    const int64_t skip = blind_rows(s), Nq = s->Nq - skip;
    FT_TRY(check_lengths(func, s, Nq));
    ft_tensor qv = rows(q, 1, skip, Nq), ov = rows(out, 1, skip, Nq);
    ft_tensor *copy[3] = {NULL, NULL, NULL}, *lse_part = NULL;
    const ft_tensor *in[3] = {NULL, NULL, NULL};
    ft_status st = FT_OK;
    if (skip > 0) { /* the blind rows; LSE's other rows are not packed: written after */
        ft_tensor o0 = rows(out, 1, 0, skip), l0 = rows(lse, 2, 0, skip);
        const int64_t shape[3] = {s->B, s->H, Nq};
        st = ft_fill(&o0, 0.0);
        if (st == FT_OK)
            st = ft_fill(&l0, -INFINITY);
        if (st == FT_OK)
            st = ft_empty_named(&lse_part, 3, shape, FT_F32, lse->device, func);
    }
    const ft_tensor *given[3] = {&qv, k, v};
    for (int i = 0; i < 3 && st == FT_OK; i++)
        st = readable_input(given[i], &copy[i], &in[i]);
    if (st == FT_OK) {
        const ft_tensor *t[T_COUNT] = {in[0], in[1], in[2], &ov};
        plan_key key;
        make_key(&key, PASS_FORWARD, s, Nq, t);
        void *ptr[UID_COUNT] = {NULL};
        scalars c;
        fill_scalars(&c, ptr, s, Nq);
        ptr[UID_Q] = in[0]->data, ptr[UID_K] = in[1]->data, ptr[UID_V] = in[2]->data;
        ptr[UID_O] = ov.data;
        ptr[UID_STATS] = lse_part ? lse_part->data : lse->data;
        debug("forward inputs ready (%d copied)", (copy[0] != NULL) + (copy[1] != NULL) +
                                                      (copy[2] != NULL));
        st = run(func, &key, ptr, q->device);
    }
    if (st == FT_OK && lse_part) {
        ft_tensor l1 = rows(lse, 2, skip, Nq);
        st = ft_copy(&l1, lse_part);
    }
    for (int i = 0; i < 3; i++)
        ft_tensor_free(copy[i]);
    ft_tensor_free(lse_part);
    return st;
}

ft_status ft_attention_backward_cudnn(const ft_attn_shape *s, const ft_tensor *dout,
                                      const ft_tensor *q, const ft_tensor *k, const ft_tensor *v,
                                      const ft_tensor *out, const ft_tensor *lse, ft_tensor *dq,
                                      ft_tensor *dk, ft_tensor *dv)
{
    static const char func[] = "ft_attention_backward";
    debug_entry("backward", s, q);
    if (s->B == 0 || s->H == 0 || s->Nq == 0) { /* no query: nothing flows to K and V */
        FT_TRY(ft_fill(dk, 0.0));
        return ft_fill(dv, 0.0);
    }
    if (s->Nk == 0)
        return ft_fill(dq, 0.0);
    const int64_t skip = blind_rows(s), Nq = s->Nq - skip;
    FT_TRY(check_lengths(func, s, Nq));
    if (Nq == 1 && s->Nk == 1)
        return ft_fail(FT_ERR_UNSUPPORTED, func, 2,
                       "impl 'cudnn': cuDNN's fused attention backward does not take "
                       "seqlen_q = seqlen_k = 1%s (impl 'flash' does)",
                       skip ? " (the rows that see a key, under causal)" : "");
    ft_status st = FT_OK;
    if (skip > 0) {
        ft_tensor g0 = rows(dq, 1, 0, skip);
        st = ft_fill(&g0, 0.0);
    }
    ft_tensor qv = rows(q, 1, skip, Nq), ov = rows(out, 1, skip, Nq), dov = rows(dout, 1, skip, Nq),
              lv = rows(lse, 2, skip, Nq), dqv = rows(dq, 1, skip, Nq);
    /* inputs as cuDNN reads them; LSE packed [B, H, Nq] */
    ft_tensor *copy[5] = {NULL, NULL, NULL, NULL, NULL}, *lse_c = NULL, *dsum = NULL,
              *dq_acc = NULL;
    const ft_tensor *in[5] = {NULL, NULL, NULL, NULL, NULL};
    const ft_tensor *given[5] = {&qv, k, v, &ov, &dov};
    for (int i = 0; i < 5 && st == FT_OK; i++)
        st = readable_input(given[i], &copy[i], &in[i]);
    if (st == FT_OK && !(ft_is_contiguous(&lv) && (uintptr_t)lv.data % BYTE_ALIGNMENT == 0))
        st = ft_clone(&lse_c, &lv); /* a view of LSE's rows after skip: also off 16 bytes */
    const int64_t row_shape[3] = {s->B, s->H, Nq}, acc_shape[4] = {s->B, s->H, Nq, s->d};
    if (st == FT_OK)
        st = ft_empty_named(&dsum, 3, row_shape, FT_F32, q->device, func);
    if (st == FT_OK)
        st = ft_empty_named(&dq_acc, 4, acc_shape, FT_F32, q->device, func);
    if (st == FT_OK && ft_cudnn_version() < V_DQ_ACC_ZEROED)
        st = ft_fill(dq_acc, 0.0);
    if (st == FT_OK) {
        const ft_tensor *t[T_COUNT] = {in[0], in[1], in[2], in[3], in[4], &dqv, dk, dv};
        plan_key key;
        make_key(&key, PASS_BACKWARD, s, Nq, t);
        void *ptr[UID_COUNT] = {NULL};
        scalars c;
        fill_scalars(&c, ptr, s, Nq);
        ptr[UID_Q] = in[0]->data, ptr[UID_K] = in[1]->data, ptr[UID_V] = in[2]->data;
        ptr[UID_O] = in[3]->data, ptr[UID_DO] = in[4]->data;
        ptr[UID_STATS] = lse_c ? lse_c->data : lv.data;
        ptr[UID_DQ] = dqv.data, ptr[UID_DK] = dk->data, ptr[UID_DV] = dv->data;
        ptr[UID_D] = dsum->data, ptr[UID_DQ_ACC] = dq_acc->data;
        debug("backward inputs ready (%d copied, LSE %s)",
              (copy[0] != NULL) + (copy[1] != NULL) + (copy[2] != NULL) + (copy[3] != NULL) +
                  (copy[4] != NULL),
              lse_c ? "copied" : "as given");
        st = run(func, &key, ptr, q->device);
    }
    for (int i = 0; i < 5; i++)
        ft_tensor_free(copy[i]);
    ft_tensor_free(lse_c);
    ft_tensor_free(dsum);
    ft_tensor_free(dq_acc);
    return st;
}

#else /* no cuDNN in this build: attention.c refuses impl "cudnn" first */

int ft_cudnn_version(void) { return 0; }

static ft_status not_built(const char *func)
{
    return ft_fail(FT_ERR_UNSUPPORTED, func, 0,
                   "impl 'cudnn': flashtile was built without cuDNN (use 'flash')");
}

ft_status ft_attention_forward_cudnn(const ft_attn_shape *s, const ft_tensor *q,
                                     const ft_tensor *k, const ft_tensor *v, ft_tensor *out,
                                     ft_tensor *lse)
{
    (void)s, (void)q, (void)k, (void)v, (void)out, (void)lse;
    return not_built("ft_attention_forward");
}

ft_status ft_attention_backward_cudnn(const ft_attn_shape *s, const ft_tensor *dout,
                                      const ft_tensor *q, const ft_tensor *k, const ft_tensor *v,
                                      const ft_tensor *out, const ft_tensor *lse, ft_tensor *dq,
                                      ft_tensor *dk, ft_tensor *dv)
{
    (void)s, (void)dout, (void)q, (void)k, (void)v, (void)out, (void)lse, (void)dq, (void)dk,
        (void)dv;
    return not_built("ft_attention_backward");
}

#endif
