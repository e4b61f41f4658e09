/*
 * mods.c - attention modifications as expression graphs (ft_attn_mods):
 * a score function f(s, b, h, i, j) and a mask m(b, h, i, j), traced from
 * Lua (lua/flashtile/mods.lua) into a list of nodes in evaluation order,
 * checked here once, and evaluated by a small interpreter a whole row of a
 * tile at a time (the CPU paths in attention_cpu_impl.h), with the
 * derivative of each node with respect to s carried along (forward-mode:
 * value and d/ds per node), which the backward needs.
 *
 * Indices b, h, i, j are 1-based as in Lua; a read of a captured tensor
 * takes 1-based indices too. A read out of range reads the nearest element
 * and records a fault, which the call reports as an error.
 */
#include "internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct ft_attn_mods {
    int nnodes;
    ft_mod_node *nodes;
    int nindices;
    int32_t *indices;
    int ntensors;
    int score, mask; /* roots, or -1 */
    int nreads;      /* the READ nodes, in order: their derivatives are */
    int32_t *reads;  /* carried when the captured tensors' grads are asked */
};

static const char *const op_names[FT_MOD_OP_COUNT] = {
    "s", "b", "h", "i", "j", "const", "+", "-", "*", "/", "%", "^", "unary -",
    "eq", "ne", "lt", "le", "gt", "ge", "all", "any", "negate", "where", "abs", "exp",
    "log", "sqrt", "tanh", "sigmoid", "min", "max", "floor", "read"};

const char *ft_mod_op_name(int op)
{
    return op >= 0 && op < FT_MOD_OP_COUNT ? op_names[op] : "?";
}

/* How many operand nodes an op takes (READ: its indices, in `indices`). */
static int arity(int op)
{
    switch (op) {
    case FT_MOD_S: case FT_MOD_B: case FT_MOD_H: case FT_MOD_I: case FT_MOD_J:
    case FT_MOD_CONST: case FT_MOD_READ:
        return 0;
    case FT_MOD_NEG: case FT_MOD_NOT: case FT_MOD_ABS: case FT_MOD_EXP: case FT_MOD_LOG:
    case FT_MOD_SQRT: case FT_MOD_TANH: case FT_MOD_SIGMOID: case FT_MOD_FLOOR:
        return 1;
    case FT_MOD_WHERE:
        return 3;
    default:
        return 2;
    }
}

ft_status ft_attn_mods_new(ft_attn_mods **out, int nnodes, const ft_mod_node *nodes,
                           int nindices, const int32_t *indices, int ntensors, int score,
                           int mask)
{
    static const char func[] = "ft_attn_mods_new";
    if (!out)
        return ft_fail(FT_ERR_ARGUMENT, func, 0, "result pointer is NULL");
    *out = NULL;
    if (nnodes < 1 || nnodes > FT_MOD_MAX_NODES || !nodes)
        return ft_fail(FT_ERR_ARGUMENT, func, 2, "a graph has 1 to %d nodes, got %d",
                       FT_MOD_MAX_NODES, nnodes);
    if (nindices < 0 || nindices > FT_MOD_MAX_NODES || (nindices > 0 && !indices))
        return ft_fail(FT_ERR_ARGUMENT, func, 4, "bad index list (%d entries)", nindices);
    if (ntensors < 0 || ntensors > FT_MOD_MAX_TENSORS)
        return ft_fail(FT_ERR_ARGUMENT, func, 6, "a graph reads 0 to %d tensors, got %d",
                       FT_MOD_MAX_TENSORS, ntensors);
    if (score < -1 || score >= nnodes || mask < -1 || mask >= nnodes || (score < 0 && mask < 0))
        return ft_fail(FT_ERR_ARGUMENT, func, 7, "roots %d and %d are not nodes of the graph",
                       score, mask);
    for (int n = 0; n < nnodes; n++) {
        const ft_mod_node *x = &nodes[n];
        if (x->op < 0 || x->op >= FT_MOD_OP_COUNT)
            return ft_fail(FT_ERR_ARGUMENT, func, 2, "node %d: unknown op %d", n, x->op);
        const int32_t ops[3] = {x->a, x->b, x->c};
        for (int k = 0; k < arity(x->op); k++)
            if (ops[k] < 0 || ops[k] >= n)
                return ft_fail(FT_ERR_ARGUMENT, func, 2,
                               "node %d (%s): operand %d is node %d, not an earlier one", n,
                               op_names[x->op], k + 1, ops[k]);
        if (x->op == FT_MOD_CONST && !isfinite(x->value))
            return ft_fail(FT_ERR_ARGUMENT, func, 2, "node %d: constant %g is not finite", n,
                           x->value);
        if (x->op == FT_MOD_READ) {
            if (x->a < 0 || x->a >= ntensors)
                return ft_fail(FT_ERR_ARGUMENT, func, 2, "node %d reads tensor %d of %d", n,
                               x->a + 1, ntensors);
            if (x->c < 1 || x->c > FT_MAX_DIMS || x->b < 0 || x->b > nindices - x->c)
                return ft_fail(FT_ERR_ARGUMENT, func, 2, "node %d: bad indices (%d from %d)", n,
                               x->c, x->b);
            for (int k = 0; k < x->c; k++)
                if (indices[x->b + k] < 0 || indices[x->b + k] >= n)
                    return ft_fail(FT_ERR_ARGUMENT, func, 2,
                                   "node %d (read): index %d is node %d, not an earlier one", n,
                                   k + 1, indices[x->b + k]);
        }
    }
    if (mask >= 0) { /* which nodes depend on s, in one pass (the graph is a DAG) */
        unsigned char *dep = calloc((size_t)nnodes, 1);
        if (!dep)
            return ft_fail(FT_ERR_NOMEM, func, 0, "out of memory");
        for (int n = 0; n < nnodes; n++) {
            const ft_mod_node *x = &nodes[n];
            int d = x->op == FT_MOD_S;
            const int32_t ops[3] = {x->a, x->b, x->c};
            for (int k = 0; k < arity(x->op); k++)
                d |= dep[ops[k]];
            for (int k = 0; x->op == FT_MOD_READ && k < x->c; k++)
                d |= dep[indices[x->b + k]];
            dep[n] = (unsigned char)d;
        }
        const int bad = dep[mask];
        free(dep);
        if (bad)
            return ft_fail(FT_ERR_ARGUMENT, func, 8, "the mask depends on the score s");
    }
    ft_attn_mods *m = calloc(1, sizeof *m);
    if (!m)
        return ft_fail(FT_ERR_NOMEM, func, 0, "out of memory");
    m->nodes = malloc((size_t)nnodes * sizeof *m->nodes);
    m->indices = malloc((size_t)(nindices > 0 ? nindices : 1) * sizeof *m->indices);
    if (!m->nodes || !m->indices) {
        ft_attn_mods_free(m);
        return ft_fail(FT_ERR_NOMEM, func, 0, "out of memory");
    }
    memcpy(m->nodes, nodes, (size_t)nnodes * sizeof *nodes);
    for (int n = 0; n < nnodes; n++)
        m->nreads += nodes[n].op == FT_MOD_READ;
    m->reads = malloc((size_t)(m->nreads > 0 ? m->nreads : 1) * sizeof *m->reads);
    if (!m->reads) {
        ft_attn_mods_free(m);
        return ft_fail(FT_ERR_NOMEM, func, 0, "out of memory");
    }
    for (int n = 0, k = 0; n < nnodes; n++)
        if (nodes[n].op == FT_MOD_READ)
            m->reads[k++] = n;
    if (nindices > 0)
        memcpy(m->indices, indices, (size_t)nindices * sizeof *indices);
    m->nnodes = nnodes, m->nindices = nindices, m->ntensors = ntensors;
    m->score = score, m->mask = mask;
    *out = m;
    return FT_OK;
}

void ft_attn_mods_free(ft_attn_mods *m)
{
    if (!m)
        return;
    free(m->nodes);
    free(m->indices);
    free(m->reads);
    free(m);
}

FT_API int ft_attn_mods_tensors(const ft_attn_mods *m) { return m ? m->ntensors : 0; }
int ft_attn_mods_nodes_count(const ft_attn_mods *m) { return m ? m->nnodes : 0; }

void ft_attn_mods_eval_point(const ft_attn_mods *m, const ft_tensor *const *tensors, int64_t b,
                             int64_t h, int64_t i, int64_t j, double s, double *score,
                             double *dscore, int *keep, double *work, int *fault)
{
    ft_attn_mods_eval_row(m, tensors, b, h, i, j, 1, &s, score, dscore, keep, NULL, NULL, work,
                          fault);
}
int ft_attn_mods_has_score(const ft_attn_mods *m) { return m && m->score >= 0; }

ft_status ft_attn_mods_check_tensors(const ft_attn_mods *m, const char *func, int arg,
                                     int ntensors, const ft_tensor *const *tensors,
                                     ft_device device)
{
    if (ntensors != m->ntensors)
        return ft_fail(FT_ERR_ARGUMENT, func, arg, "mods read %d tensors, %d given",
                       m->ntensors, ntensors);
    for (int t = 0; t < ntensors; t++) {
        FT_TRY(ft_check_tensor(func, arg, tensors[t]));
        FT_TRY(ft_check_computable(func, arg, tensors[t]->dtype, "mods' tensors"));
        if (tensors[t]->device.type != device.type || tensors[t]->device.index != device.index)
            return ft_fail(FT_ERR_ARGUMENT, func, arg,
                           "mods' tensor %d is not on q's device", t + 1);
    }
    for (int n = 0; n < m->nnodes; n++) {
        const ft_mod_node *x = &m->nodes[n];
        if (x->op == FT_MOD_READ && x->c != tensors[x->a]->ndim)
            return ft_fail(FT_ERR_ARGUMENT, func, arg,
                           "mods read tensor %d (%d dims) with %d indices", x->a + 1,
                           tensors[x->a]->ndim, x->c);
    }
    return FT_OK;
}

int ft_attn_mods_reads(const ft_attn_mods *m) { return m ? m->nreads : 0; }

const ft_mod_node *ft_attn_mods_graph(const ft_attn_mods *m) { return m->nodes; }
const int32_t *ft_attn_mods_index_list(const ft_attn_mods *m) { return m->indices; }
int ft_attn_mods_root(const ft_attn_mods *m, int which) { return which ? m->mask : m->score; }

int ft_attn_mods_read_tensor(const ft_attn_mods *m, int k) { return m->nodes[m->reads[k]].a; }

size_t ft_attn_mods_scratch(const ft_attn_mods *m, int64_t width, int with_reads)
{
    if (!m)
        return 0;
    const size_t channels = 1 + (with_reads ? (size_t)m->nreads : 0);
    return (size_t)(1 + channels) * (size_t)m->nnodes * (size_t)width;
}

/* One element of tensor t at 1-based indices idx (rounded down), the
 * nearest one when out of range (and *fault set); *lin: its row-major
 * index (where its gradient goes). */
static double read_at(const ft_tensor *t, const double *idx, int *fault, int64_t *lin)
{
    int64_t off = 0;
    *lin = 0;
    for (int d = 0; d < t->ndim; d++) {
        double x = floor(idx[d]) - 1;
        int64_t k;
        if (!(x >= 0)) { /* below range, or NaN */
            k = 0;
            *fault = 1;
        } else if (x > (double)(t->shape[d] - 1)) {
            k = t->shape[d] - 1;
            *fault = 1;
        } else {
            k = (int64_t)x;
        }
        off += k * t->stride[d];
        *lin = *lin * t->shape[d] + k;
    }
    return ft_load_f64(ft_elem_ptr(t, off), t->dtype);
}

void ft_attn_mods_eval_row(const ft_attn_mods *m, const ft_tensor *const *tensors, int64_t b,
                           int64_t h, int64_t i, int64_t j0, int64_t nc, const double *s,
                           double *score, double *dscore, int *keep, double *dread,
                           int64_t *read_lin, double *scratch, int *fault)
{
    const int N = m->nnodes;
    /* channel 0: d/ds; channel 1 + k: d/d(read k), when dread is asked */
    const int nch = 1 + (dread ? m->nreads : 0);
    const size_t plane = (size_t)N * (size_t)nc;
    double *v = scratch, *dv = scratch + plane; /* v[node][c], dv[ch][node][c] */
    int bad = 0, kread = 0;
    for (int n = 0; n < N; n++) {
        const ft_mod_node *x = &m->nodes[n];
        double *o = v + (size_t)n * nc;
        const double *a = v + (size_t)x->a * nc, *bb = v + (size_t)x->b * nc;
        const double *cc = v + (size_t)x->c * nc;
        for (int64_t c = 0; c < nc; c++) {
            double r = 0;
            switch (x->op) {
            case FT_MOD_S: r = s ? s[c] : 0; break;
            case FT_MOD_B: r = (double)(b + 1); break;
            case FT_MOD_H: r = (double)(h + 1); break;
            case FT_MOD_I: r = (double)(i + 1); break;
            case FT_MOD_J: r = (double)(j0 + c + 1); break;
            case FT_MOD_CONST: r = x->value; break;
            case FT_MOD_ADD: r = a[c] + bb[c]; break;
            case FT_MOD_SUB: r = a[c] - bb[c]; break;
            case FT_MOD_MUL: r = a[c] * bb[c]; break;
            case FT_MOD_DIV: r = a[c] / bb[c]; break;
            case FT_MOD_MOD: r = a[c] - floor(a[c] / bb[c]) * bb[c]; break; /* Lua's */
            case FT_MOD_POW: r = pow(a[c], bb[c]); break;
            case FT_MOD_NEG: r = -a[c]; break;
            case FT_MOD_EQ: r = a[c] == bb[c]; break;
            case FT_MOD_NE: r = a[c] != bb[c]; break;
            case FT_MOD_LT: r = a[c] < bb[c]; break;
            case FT_MOD_LE: r = a[c] <= bb[c]; break;
            case FT_MOD_GT: r = a[c] > bb[c]; break;
            case FT_MOD_GE: r = a[c] >= bb[c]; break;
            case FT_MOD_AND: r = a[c] != 0 && bb[c] != 0; break;
            case FT_MOD_OR: r = a[c] != 0 || bb[c] != 0; break;
            case FT_MOD_NOT: r = a[c] == 0; break;
            case FT_MOD_WHERE: r = a[c] != 0 ? bb[c] : cc[c]; break;
            case FT_MOD_ABS: r = fabs(a[c]); break;
            case FT_MOD_EXP: r = exp(a[c]); break;
            case FT_MOD_LOG: r = log(a[c]); break;
            case FT_MOD_SQRT: r = sqrt(a[c]); break;
            case FT_MOD_TANH: r = tanh(a[c]); break;
            case FT_MOD_SIGMOID: r = 1 / (1 + exp(-a[c])); break;
            case FT_MOD_MIN: r = a[c] <= bb[c] ? a[c] : bb[c]; break;
            case FT_MOD_MAX: r = a[c] >= bb[c] ? a[c] : bb[c]; break;
            case FT_MOD_FLOOR: r = floor(a[c]); break;
            case FT_MOD_READ: {
                double idx[FT_MAX_DIMS];
                int64_t lin;
                for (int k = 0; k < x->c; k++)
                    idx[k] = v[(size_t)m->indices[x->b + k] * nc + c];
                r = read_at(tensors[x->a], idx, &bad, &lin);
                if (read_lin)
                    read_lin[(size_t)kread * nc + c] = lin;
                break;
            }
            }
            o[c] = r;
        }
        /* the derivatives, channel by channel (forward mode) */
        for (int ch = 0; ch < nch; ch++) {
            double *od = dv + ch * plane + (size_t)n * nc;
            const double *ad = dv + ch * plane + (size_t)x->a * nc;
            const double *bd = dv + ch * plane + (size_t)x->b * nc;
            const double *cd = dv + ch * plane + (size_t)x->c * nc;
            for (int64_t c = 0; c < nc; c++) {
                double rd = 0;
                switch (x->op) {
                case FT_MOD_S: rd = ch == 0; break;
                case FT_MOD_READ: rd = ch == 1 + kread; break;
                case FT_MOD_ADD: rd = ad[c] + bd[c]; break;
                case FT_MOD_SUB: rd = ad[c] - bd[c]; break;
                /* a zero derivative's term is left out, not multiplied
                 * (an infinite value times 0, or 0 / 0 where a node
                 * without s is 0, would make it NaN), as the CUDA
                 * source leaves out what does not depend on s */
                case FT_MOD_MUL:
                    rd = (ad[c] != 0 ? ad[c] * bb[c] : 0) + (bd[c] != 0 ? a[c] * bd[c] : 0);
                    break;
                case FT_MOD_DIV:
                    rd = ad[c] == 0 && bd[c] == 0 ? 0
                                                  : (bd[c] != 0 ? ad[c] - o[c] * bd[c] : ad[c]) / bb[c];
                    break;
                case FT_MOD_MOD: rd = bd[c] != 0 ? ad[c] - floor(a[c] / bb[c]) * bd[c] : ad[c]; break;
                case FT_MOD_POW:
                    rd = (ad[c] != 0 ? bb[c] * pow(a[c], bb[c] - 1) * ad[c] : 0) +
                         (bd[c] != 0 ? o[c] * log(a[c]) * bd[c] : 0);
                    break;
                case FT_MOD_NEG: rd = -ad[c]; break;
                case FT_MOD_WHERE: rd = a[c] != 0 ? bd[c] : cd[c]; break;
                case FT_MOD_ABS: rd = a[c] < 0 ? -ad[c] : ad[c]; break;
                case FT_MOD_EXP: rd = ad[c] != 0 ? o[c] * ad[c] : 0; break;
                case FT_MOD_LOG: rd = ad[c] != 0 ? ad[c] / a[c] : 0; break;
                case FT_MOD_SQRT: rd = ad[c] != 0 ? ad[c] / (2 * o[c]) : 0; break;
                case FT_MOD_TANH: rd = (1 - o[c] * o[c]) * ad[c]; break;
                case FT_MOD_SIGMOID: rd = o[c] * (1 - o[c]) * ad[c]; break;
                case FT_MOD_MIN: rd = a[c] <= bb[c] ? ad[c] : bd[c]; break;
                case FT_MOD_MAX: rd = a[c] >= bb[c] ? ad[c] : bd[c]; break;
                default: rd = 0; break; /* constants, indices, comparisons, logic, floor */
                }
                od[c] = rd;
            }
        }
        if (x->op == FT_MOD_READ)
            kread++;
    }
    if (bad)
        __atomic_store_n(fault, 1, __ATOMIC_RELAXED);
    for (int64_t c = 0; c < nc; c++) {
        if (keep)
            keep[c] = m->mask < 0 || v[(size_t)m->mask * nc + c] != 0;
        if (score)
            score[c] = m->score < 0 ? (s ? s[c] : 0) : v[(size_t)m->score * nc + c];
        if (dscore)
            dscore[c] = m->score < 0 ? 1 : dv[(size_t)m->score * nc + c];
    }
    for (int k = 0; dread && k < m->nreads; k++)
        for (int64_t c = 0; c < nc; c++)
            dread[(size_t)k * nc + c] =
                m->score < 0 ? 0 : dv[(1 + (size_t)k) * plane + (size_t)m->score * nc + c];
}

/* ---- block masks: the mask evaluated once per tile ---- */

struct ft_attn_block_mask {
    const ft_attn_mods *mods; /* for the identity check only, never read */
    int64_t B, H, Nq, Nk, bq, bk, nqb, nkb;
    unsigned char *kind; /* [B][H][nqb][nkb]: ft_block_kind */
    ft_device device;    /* where it was made, and where calls may take it */
    int64_t band[4];     /* CUDA: the band of kept pairs (left, right; -1: none kept), and
                          * the inner band where every pair is kept (left, right; -1:
                          * none; INT32_MAX: unbounded) */
};

#ifdef FT_HAVE_CUDA
/* kernels/attention/rtc.cu: the mask over the call on the GPU. */
ft_status flash_rtc_block_mask(const ft_attn_mods *mods, const ft_tensor *const *tensors,
                               int device, const int64_t *size, int *cells, int *band,
                               const char *func);

/* The per-tile counts (into counts, host) and the band, on the GPU. */
static ft_status block_mask_cuda(const char *func, const ft_attn_mods *mods,
                                 const ft_tensor *const *tensors, ft_device dev,
                                 const int64_t *size, int64_t cells, int64_t *counts,
                                 int64_t *band)
{
    ft_tensor *c = NULL, *bd = NULL, *ch = NULL, *bh = NULL;
    const int64_t nb = 4, ncell = cells > 0 ? cells : 1;
    const ft_device cpu = {FT_CPU, 0};
    ft_status st = ft_empty_named(&c, 1, &ncell, FT_I32, dev, func);
    if (st == FT_OK)
        st = ft_empty_named(&bh, 1, &nb, FT_I32, cpu, func);
    if (st == FT_OK) { /* the band from below, the inner band from above */
        int32_t *b = (int32_t *)bh->data;
        b[0] = b[1] = INT32_MIN, b[2] = b[3] = INT32_MAX;
        st = ft_to(&bd, bh, FT_I32, dev);
    }
    ft_tensor_free(bh);
    bh = NULL;
    if (st == FT_OK)
        st = ft_fill(c, 0);
    if (st == FT_OK)
        st = flash_rtc_block_mask(mods, tensors, dev.index, size, (int *)c->data, (int *)bd->data,
                                  func);
    if (st == FT_OK)
        st = ft_to(&ch, c, FT_I32, (ft_device){FT_CPU, 0});
    if (st == FT_OK)
        st = ft_to(&bh, bd, FT_I32, (ft_device){FT_CPU, 0});
    if (st == FT_OK) {
        for (int64_t k = 0; k < cells; k++)
            counts[k] = ((const int32_t *)ch->data)[k];
        const int32_t *b = (const int32_t *)bh->data;
        band[0] = b[0] == INT32_MIN ? -1 : b[0] < 0 ? 0 : b[0];
        band[1] = b[0] == INT32_MIN ? -1 : b[1] < 0 ? 0 : b[1];
        band[2] = b[2] < 0 || b[3] < 0 ? -1 : b[2]; /* INT32_MAX: unbounded */
        band[3] = b[2] < 0 || b[3] < 0 ? -1 : b[3];
    }
    ft_tensor_free(c), ft_tensor_free(bd), ft_tensor_free(ch), ft_tensor_free(bh);
    return st;
}
#endif

/* A tile's kind from how many of its pairs the mask keeps. */
static unsigned char tile_kind(const ft_attn_block_mask *bm, int64_t qb, int64_t kb, int64_t kept)
{
    const int64_t nr = bm->Nq - qb * bm->bq < bm->bq ? bm->Nq - qb * bm->bq : bm->bq;
    const int64_t nc = bm->Nk - kb * bm->bk < bm->bk ? bm->Nk - kb * bm->bk : bm->bk;
    return kept == 0 ? FT_BLOCK_EMPTY : kept == nr * nc ? FT_BLOCK_FULL : FT_BLOCK_PARTIAL;
}

ft_status ft_attn_block_mask_new(ft_attn_block_mask **out, const ft_attn_mods *mods,
                                 int ntensors, const ft_tensor *const *tensors, int64_t B,
                                 int64_t H, int64_t Nq, int64_t Nk, int64_t block_q,
                                 int64_t block_k)
{
    return ft_attn_block_mask_new_on(out, mods, ntensors, tensors, B, H, Nq, Nk, block_q,
                                     block_k, (ft_device){FT_CPU, 0});
}

ft_status ft_attn_block_mask_new_on(ft_attn_block_mask **out, const ft_attn_mods *mods,
                                    int ntensors, const ft_tensor *const *tensors, int64_t B,
                                    int64_t H, int64_t Nq, int64_t Nk, int64_t block_q,
                                    int64_t block_k, ft_device device)
{
    static const char func[] = "ft_attn_block_mask_new";
    if (!out)
        return ft_fail(FT_ERR_ARGUMENT, func, 0, "result pointer is NULL");
    *out = NULL;
    if (!mods)
        return ft_fail(FT_ERR_ARGUMENT, func, 1, "mods expected");
    if (mods->mask < 0)
        return ft_fail(FT_ERR_ARGUMENT, func, 1, "the mods have no mask");
    if (device.type == FT_CUDA) {
#ifdef FT_HAVE_CUDA
        FT_TRY(ft_cuda_use_device(device.index, func));
#else
        return ft_fail(FT_ERR_UNSUPPORTED, func, 10, "this build has no CUDA backend");
#endif
    }
    FT_TRY(ft_attn_mods_check_tensors(mods, func, 3, ntensors, tensors, device));
    const int64_t dims[4] = {B, H, Nq, Nk};
    for (int k = 0; k < 4; k++)
        if (dims[k] < 0 || dims[k] > INT32_MAX)
            return ft_fail(FT_ERR_ARGUMENT, func, 4 + k, "sizes must be 0 to 2^31 - 1, got %lld",
                           (long long)dims[k]);
    if (block_q < 1 || block_q > 4096 || block_k < 1 || block_k > 4096)
        return ft_fail(FT_ERR_ARGUMENT, func, 8, "block sizes must be 1 to 4096");
    int64_t cells, work;
    const int64_t nqb = (Nq + block_q - 1) / block_q, nkb = (Nk + block_k - 1) / block_k;
    const int64_t cdims[4] = {B, H, nqb, nkb}, wdims[4] = {B, H, Nq, Nk};
    if (ft_checked_numel(4, cdims, &cells) != 0 || cells > FT_MAX_ELEMENTS ||
        ft_checked_numel(4, wdims, &work) != 0 || work > FT_MAX_ELEMENTS)
        return ft_fail(FT_ERR_UNSUPPORTED, func, 4, "a block mask of %lld x %lld x %lld x %lld "
                       "is more than flashtile's limit of 2^48", (long long)B, (long long)H,
                       (long long)Nq, (long long)Nk);
    ft_attn_block_mask *bm = calloc(1, sizeof *bm);
    const size_t width = (size_t)(Nk > 0 ? Nk : 1);
    double *scratch = malloc(ft_attn_mods_scratch(mods, (int64_t)width, 0) * sizeof(double));
    int *keep = malloc(width * sizeof *keep);
    int64_t *counts = malloc((size_t)(nkb > 0 ? nkb : 1) * sizeof *counts);
    if (bm)
        bm->kind = malloc((size_t)(cells > 0 ? cells : 1));
    if (!bm || !bm->kind || !scratch || !keep || !counts) {
        free(scratch), free(keep), free(counts);
        ft_attn_block_mask_free(bm);
        return ft_fail(FT_ERR_NOMEM, func, 0, "out of memory");
    }
    bm->mods = mods, bm->B = B, bm->H = H, bm->Nq = Nq, bm->Nk = Nk;
    bm->bq = block_q, bm->bk = block_k, bm->nqb = nqb, bm->nkb = nkb;
    bm->device = device, bm->band[0] = bm->band[1] = bm->band[2] = bm->band[3] = -1;
    int fault = 0;
    if (device.type == FT_CUDA) {
#ifdef FT_HAVE_CUDA
        free(scratch), free(keep), free(counts);
        int64_t *all = malloc((size_t)(cells > 0 ? cells : 1) * sizeof *all);
        const int64_t size[6] = {B, H, Nq, Nk, block_q, block_k};
        ft_status st = all ? block_mask_cuda(func, mods, tensors, device, size, cells, all,
                                             bm->band)
                           : ft_fail(FT_ERR_NOMEM, func, 0, "out of memory");
        for (int64_t c = 0; st == FT_OK && c < cells; c++)
            bm->kind[c] = tile_kind(bm, (c / nkb) % nqb, c % nkb, all[c]);
        free(all);
        if (st != FT_OK) {
            ft_attn_block_mask_free(bm);
            return st;
        }
        *out = bm;
        return FT_OK;
#endif
    }
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t qb = 0; qb < nqb; qb++) {
                const int64_t i0 = qb * block_q, nr = Nq - i0 < block_q ? Nq - i0 : block_q;
                for (int64_t kb = 0; kb < nkb; kb++)
                    counts[kb] = 0;
                for (int64_t i = i0; i < i0 + nr; i++) {
                    ft_attn_mods_eval_row(mods, tensors, b, h, i, 0, Nk, NULL, NULL, NULL, keep,
                                          NULL, NULL, scratch, &fault);
                    for (int64_t j = 0; j < Nk; j++)
                        counts[j / block_k] += keep[j] != 0;
                }
                unsigned char *row = bm->kind + ((b * H + h) * nqb + qb) * nkb;
                for (int64_t kb = 0; kb < nkb; kb++)
                    row[kb] = tile_kind(bm, qb, kb, counts[kb]);
            }
    free(scratch), free(keep), free(counts);
    if (fault) {
        ft_attn_block_mask_free(bm);
        return ft_fail(FT_ERR_ARGUMENT, func, 3,
                       "the mask read a captured tensor out of range (indices are 1-based)");
    }
    *out = bm;
    return FT_OK;
}

void ft_attn_block_mask_free(ft_attn_block_mask *bm)
{
    if (!bm)
        return;
    free(bm->kind);
    free(bm);
}

void ft_attn_block_mask_counts(const ft_attn_block_mask *bm, int64_t *empty, int64_t *partial,
                               int64_t *full)
{
    *empty = *partial = *full = 0;
    const int64_t cells = bm->B * bm->H * bm->nqb * bm->nkb;
    for (int64_t c = 0; c < cells; c++) {
        if (bm->kind[c] == FT_BLOCK_EMPTY)
            ++*empty;
        else if (bm->kind[c] == FT_BLOCK_FULL)
            ++*full;
        else
            ++*partial;
    }
}

ft_status ft_attn_block_mask_check(const ft_attn_block_mask *bm, const ft_attn_mods *mods,
                                   const char *func, int arg, ft_device device, int64_t B,
                                   int64_t H, int64_t Nq, int64_t Nk, int64_t block_q,
                                   int64_t block_k)
{
    if (bm->mods != mods)
        return ft_fail(FT_ERR_ARGUMENT, func, arg, "block_mask was made for other mods");
    if (bm->device.type != device.type || bm->device.index != device.index) {
        char made[32], runs[32];
        const ft_device both[2] = {bm->device, device};
        char *names[2] = {made, runs};
        for (int k = 0; k < 2; k++)
            if (both[k].type == FT_CUDA)
                snprintf(names[k], sizeof made, "cuda:%d", both[k].index);
            else
                snprintf(names[k], sizeof made, "the cpu");
        return ft_fail(FT_ERR_ARGUMENT, func, arg,
                       "block_mask was made for %s, the call runs on %s (ft.block_mask's device "
                       "option)",
                       made, runs);
    }
    if (device.type == FT_CUDA) /* the flash kernels take its band, not its tiles */
        block_q = bm->bq, block_k = bm->bk;
    if (bm->B != B || bm->H != H || bm->Nq != Nq || bm->Nk != Nk || bm->bq != block_q ||
        bm->bk != block_k)
        return ft_fail(FT_ERR_ARGUMENT, func, arg,
                       "block_mask is for %lld x %lld x %lld x %lld in %lld x %lld tiles; this "
                       "call is %lld x %lld x %lld x %lld in %lld x %lld tiles",
                       (long long)bm->B, (long long)bm->H, (long long)bm->Nq, (long long)bm->Nk,
                       (long long)bm->bq, (long long)bm->bk, (long long)B, (long long)H,
                       (long long)Nq, (long long)Nk, (long long)block_q, (long long)block_k);
    return FT_OK;
}

int ft_attn_block_kind(const ft_attn_block_mask *bm, int64_t b, int64_t h, int64_t i0,
                       int64_t i1, int64_t j0, int64_t j1)
{
    /* every tile the rectangle touches: empty or full only if all are */
    int empty = 1, full = 1;
    const unsigned char *plane = bm->kind + (b * bm->H + h) * bm->nqb * bm->nkb;
    for (int64_t qb = i0 / bm->bq; qb <= (i1 - 1) / bm->bq && qb < bm->nqb; qb++)
        for (int64_t kb = j0 / bm->bk; kb <= (j1 - 1) / bm->bk && kb < bm->nkb; kb++) {
            const int k = plane[qb * bm->nkb + kb];
            empty &= k == FT_BLOCK_EMPTY;
            full &= k == FT_BLOCK_FULL;
        }
    return empty ? FT_BLOCK_EMPTY : full ? FT_BLOCK_FULL : FT_BLOCK_PARTIAL;
}

int ft_attn_block_mask_band(const ft_attn_block_mask *bm, int64_t *left, int64_t *right)
{
    if (bm->device.type != FT_CUDA)
        return 0;
    *left = bm->band[0], *right = bm->band[1];
    return 1;
}

int ft_attn_block_mask_inner(const ft_attn_block_mask *bm, int64_t *left, int64_t *right)
{
    if (bm->device.type != FT_CUDA || bm->band[2] < 0)
        return 0;
    *left = bm->band[2], *right = bm->band[3];
    return 1;
}

/* The range [lo, hi] each node's value can take, for any s, i, j, b, h
 * and any value a tensor holds (nodes in order, operands first); an
 * unknown bound is infinite. */
static double nan_to(double x, double inf) { return x != x ? inf : x; }
static void node_bounds(int n, const ft_mod_node *nodes, double *lo, double *hi)
{
    for (int k = 0; k < n; k++) {
        const ft_mod_node *x = &nodes[k];
        double l = -INFINITY, h = INFINITY;
        const double al = x->a >= 0 && x->a < k ? lo[x->a] : -INFINITY;
        const double ah = x->a >= 0 && x->a < k ? hi[x->a] : INFINITY;
        const double bl = x->b >= 0 && x->b < k ? lo[x->b] : -INFINITY;
        const double bh = x->b >= 0 && x->b < k ? hi[x->b] : INFINITY;
        switch (x->op) {
        case FT_MOD_CONST: l = h = x->value; break;
        case FT_MOD_B: case FT_MOD_H: case FT_MOD_I: case FT_MOD_J: l = 0; break;
        case FT_MOD_ADD: l = nan_to(al + bl, -INFINITY), h = nan_to(ah + bh, INFINITY); break;
        case FT_MOD_SUB: l = nan_to(al - bh, -INFINITY), h = nan_to(ah - bl, INFINITY); break;
        case FT_MOD_NEG: l = -ah, h = -al; break;
        case FT_MOD_MUL: {
            const double p[4] = {al * bl, al * bh, ah * bl, ah * bh};
            l = INFINITY, h = -INFINITY;
            for (int q = 0; q < 4; q++) {
                if (p[q] != p[q]) { /* 0 times infinity */
                    l = -INFINITY, h = INFINITY;
                    break;
                }
                l = fmin(l, p[q]), h = fmax(h, p[q]);
            }
            break;
        }
        case FT_MOD_TANH: l = tanh(al), h = tanh(ah); break;
        case FT_MOD_SIGMOID: l = 1 / (1 + exp(-al)), h = 1 / (1 + exp(-ah)); break;
        case FT_MOD_EXP: l = exp(al), h = exp(ah); break;
        case FT_MOD_ABS:
            l = al >= 0 ? al : ah <= 0 ? -ah : 0, h = fmax(fabs(al), fabs(ah));
            break;
        case FT_MOD_MIN: l = fmin(al, bl), h = fmin(ah, bh); break;
        case FT_MOD_MAX: l = fmax(al, bl), h = fmax(ah, bh); break;
        case FT_MOD_WHERE:
            l = fmin(bl, x->c >= 0 && x->c < k ? lo[x->c] : -INFINITY);
            h = fmax(bh, x->c >= 0 && x->c < k ? hi[x->c] : INFINITY);
            break;
        case FT_MOD_EQ: case FT_MOD_NE: case FT_MOD_LT: case FT_MOD_LE: case FT_MOD_GT:
        case FT_MOD_GE: case FT_MOD_AND: case FT_MOD_OR: case FT_MOD_NOT:
            l = 0, h = 1;
            break;
        default: break; /* s, reads, division and the rest: unbounded */
        }
        lo[k] = l, hi[k] = h;
    }
}

/* Whether the score root takes values in a range at most 69 wide (e^-69
 * is about 2^-99.6), and its top in *top: a bf16 forward can take the top
 * as every row's maximum from the start (a Lua softcap's (s / c):tanh()
 * * c has [-c, c]), as the built-in softcap does (FwdRows). */
FT_API int ft_attn_mods_score_bound(const ft_attn_mods *m, double *top)
{
    const int n = ft_attn_mods_nodes_count(m), score = ft_attn_mods_root(m, 0);
    if (score < 0 || n <= 0)
        return 0;
    double *lo = malloc(2 * (size_t)n * sizeof *lo);
    if (!lo)
        return 0;
    node_bounds(n, ft_attn_mods_graph(m), lo, lo + n);
    const double l = lo[score], h = lo[n + score];
    free(lo);
    *top = h;
    return isfinite(l) && isfinite(h) && fabs(h) <= 3.4e38 && h - l <= 69.0; /* a float */
}
