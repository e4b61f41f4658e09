/*
 * mods_cuda.c - a modification's graph (mods.c) as CUDA source: the
 * struct FtUserMod that the flash kernels take as their UM template
 * argument when a call has mods (kernels/attention/rtc.cu compiles them
 * with NVRTC). score(b, h, i, j, x, &dx) gives the new scaled score and
 * its derivative in x (forward mode, as the interpreter carries it);
 * keep(b, h, i, j) the mask. Indices arrive 0-based and the graph sees
 * them 1-based, as in Lua.
 *
 * Each node becomes one local, an int where its value is an integer for
 * sure (indices, integral constants, +, -, *, % of those, comparisons,
 * reads of integer tensors) and a float otherwise; the CPU interpreter
 * works in doubles, so results agree to float rounding. The captured
 * tensors are read through ft_mod_args, a __constant__ table of pointers,
 * strides and shapes filled before each launch; an index is clamped to
 * the tensor (the CPU reads the nearest element too) and, when the source
 * is made for debugging, sets ft_mod_fault.
 */
#include "internal.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct strbuf {
    char *s;
    size_t n, cap;
    int failed;
} strbuf;

static void put(strbuf *b, const char *fmt, ...)
{
    if (b->failed)
        return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        const int k = vsnprintf(b->s + b->n, b->cap - b->n, fmt, ap);
        va_end(ap);
        if (k < 0) {
            b->failed = 1;
            return;
        }
        if ((size_t)k < b->cap - b->n) {
            b->n += (size_t)k;
            return;
        }
        const size_t cap = b->cap * 2 + (size_t)k + 256;
        char *s = realloc(b->s, cap);
        if (!s) {
            b->failed = 1;
            return;
        }
        b->s = s, b->cap = cap;
    }
}

/* T_EXACT, a flag on an int node: a float computes its value exactly
 * (positions, indices, small constants and their sums, differences,
 * negations, absolute values, minima and maxima, below 2^24 as the
 * built-in ALiBi's positions), so a score that takes it as a float gets
 * it from f%d (FP32 arithmetic from the kernels' float positions) instead
 * of converting v%d, one conversion a score at the special-function
 * unit's rate. */
enum { T_INT, T_FLOAT, T_EXACT = 2 };

/* The type of each node (T_INT or T_FLOAT), from its operands'. */
static void node_types(int n, const ft_mod_node *nodes, const ft_tensor *const *tensors,
                       unsigned char *ty)
{
    for (int k = 0; k < n; k++) {
        const ft_mod_node *x = &nodes[k];
        int t = T_FLOAT;
        switch (x->op) {
        case FT_MOD_B: case FT_MOD_H: case FT_MOD_I: case FT_MOD_J:
        case FT_MOD_EQ: case FT_MOD_NE: case FT_MOD_LT: case FT_MOD_LE: case FT_MOD_GT:
        case FT_MOD_GE: case FT_MOD_AND: case FT_MOD_OR: case FT_MOD_NOT:
            t = T_INT;
            break;
        case FT_MOD_CONST:
            t = x->value == floor(x->value) && fabs(x->value) < 2147483647.0 ? T_INT : T_FLOAT;
            break;
        case FT_MOD_ADD: case FT_MOD_SUB: case FT_MOD_MUL: case FT_MOD_MOD: case FT_MOD_MIN:
        case FT_MOD_MAX:
            t = ty[x->a] != T_FLOAT && ty[x->b] != T_FLOAT ? T_INT : T_FLOAT;
            break;
        case FT_MOD_NEG: case FT_MOD_ABS: case FT_MOD_FLOOR:
            t = ty[x->a];
            break;
        case FT_MOD_WHERE:
            t = ty[x->b] != T_FLOAT && ty[x->c] != T_FLOAT ? T_INT : T_FLOAT;
            break;
        case FT_MOD_READ:
            t = ft_dtype_is_float(tensors[x->a]->dtype) ? T_FLOAT : T_INT;
            break;
        default:
            t = T_FLOAT; /* s, /, ^, exp, log, sqrt, tanh, sigmoid */
            break;
        }
        ty[k] = (unsigned char)t;
    }
    for (int k = 0; k < n; k++) { /* then the flag */
        const ft_mod_node *x = &nodes[k];
#define EX(q) ((ty[q] & T_EXACT) != 0)
        int e = 0;
        switch (x->op) {
        case FT_MOD_B: case FT_MOD_H: case FT_MOD_I: case FT_MOD_J:
            e = 1;
            break;
        case FT_MOD_CONST:
            e = ty[k] == T_INT && fabs(x->value) < 16777216.0;
            break;
        case FT_MOD_ADD: case FT_MOD_SUB: case FT_MOD_MIN: case FT_MOD_MAX:
            e = ty[k] == T_INT && EX(x->a) && EX(x->b);
            break;
        case FT_MOD_NEG: case FT_MOD_ABS: case FT_MOD_FLOOR:
            e = ty[k] == T_INT && EX(x->a);
            break;
        case FT_MOD_WHERE:
            e = ty[k] == T_INT && EX(x->b) && EX(x->c);
            break;
        default:
            break;
        }
#undef EX
        if (e)
            ty[k] |= T_EXACT;
    }
}

/* Marks the nodes root depends on. */
static void mark_needed(int root, const ft_mod_node *nodes, const int32_t *indices,
                        unsigned char *need)
{
    need[root] = 1;
    for (int k = root; k >= 0; k--) {
        if (!need[k])
            continue;
        const ft_mod_node *x = &nodes[k];
        switch (x->op) {
        case FT_MOD_S: case FT_MOD_B: case FT_MOD_H: case FT_MOD_I: case FT_MOD_J:
        case FT_MOD_CONST:
            break;
        case FT_MOD_READ:
            for (int d = 0; d < x->c; d++)
                need[indices[x->b + d]] = 1;
            break;
        case FT_MOD_NEG: case FT_MOD_NOT: case FT_MOD_ABS: case FT_MOD_EXP: case FT_MOD_LOG:
        case FT_MOD_SQRT: case FT_MOD_TANH: case FT_MOD_SIGMOID: case FT_MOD_FLOOR:
            need[x->a] = 1;
            break;
        case FT_MOD_WHERE:
            need[x->a] = need[x->b] = need[x->c] = 1;
            break;
        default:
            need[x->a] = need[x->b] = 1;
            break;
        }
    }
}

/* Node k's value as a float expression. */
static void fval(strbuf *b, const unsigned char *ty, int k)
{
    put(b, ty[k] == T_FLOAT ? "v%d" : ty[k] & T_EXACT ? "f%d" : "(float)v%d", k);
}

/* An exact int node's float twin f%d, after its v%d: from the float
 * positions fi_, fj_ (1-based, as i and j in Lua) and the twins of its
 * operands; what comes from the Ctx (or b, h) converted once (the compiler
 * hoists it out of the tile's loop). */
static void emit_exact(strbuf *b, int k, const ft_mod_node *nodes, int from_ctx)
{
    const ft_mod_node *x = &nodes[k];
    put(b, "        const float f%d = ", k);
    if (from_ctx) {
        put(b, "(float)v%d;\n", k);
        return;
    }
    switch (x->op) {
    case FT_MOD_I: put(b, "fi_"); break; /* 1-based already */
    case FT_MOD_J: put(b, "fj_"); break;
    case FT_MOD_CONST: put(b, "%d.f", (int)x->value); break;
    case FT_MOD_ADD: put(b, "f%d + f%d", x->a, x->b); break;
    case FT_MOD_SUB: put(b, "f%d - f%d", x->a, x->b); break;
    case FT_MOD_MIN: put(b, "fminf(f%d, f%d)", x->a, x->b); break;
    case FT_MOD_MAX: put(b, "fmaxf(f%d, f%d)", x->a, x->b); break;
    case FT_MOD_NEG: put(b, "-f%d", x->a); break;
    case FT_MOD_ABS: put(b, "fabsf(f%d)", x->a); break;
    case FT_MOD_FLOOR: put(b, "f%d", x->a); break;
    case FT_MOD_WHERE: put(b, "v%d != 0 ? f%d : f%d", x->a, x->b, x->c); break;
    default: put(b, "(float)v%d", k); break; /* b, h */
    }
    put(b, ";\n");
}

static const char *load_expr(ft_dtype dt)
{
    switch (dt) {
    case FT_F64: return "(float)__ldg((const double *)t.data + off)";
    case FT_F32: return "__ldg((const float *)t.data + off)";
    case FT_F16: return "__half2float(((const __half *)t.data)[off])";
    case FT_BF16: return "__bfloat162float(((const __nv_bfloat16 *)t.data)[off])";
    case FT_I32: return "__ldg((const int *)t.data + off)";
    default: return "(int)__ldg((const long long *)t.data + off)";
    }
}

/* Which nodes depend on node seed (seed < 0: on s). */
static void depends_on(int seed, int n, const ft_mod_node *nodes, const int32_t *indices,
                       unsigned char *dep)
{
    for (int k = 0; k < n; k++) {
        const ft_mod_node *x = &nodes[k];
        int d = seed < 0 ? x->op == FT_MOD_S : k == seed;
        if (x->op == FT_MOD_READ) {
            for (int q = 0; q < x->c; q++)
                d |= dep[indices[x->b + q]];
        } else if (x->op != FT_MOD_CONST && x->op > FT_MOD_J) {
            d |= dep[x->a];
            if (x->op != FT_MOD_NEG && x->op != FT_MOD_NOT &&
                !(x->op >= FT_MOD_ABS && x->op <= FT_MOD_SIGMOID) && x->op != FT_MOD_FLOOR)
                d |= dep[x->b];
            if (x->op == FT_MOD_WHERE)
                d |= dep[x->c];
        }
        dep[k] = (unsigned char)d;
    }
}

enum { EMIT_VALUES = 1, EMIT_DERIVS = 2 };

/* Node k's value: const float or int v%d. */
static void emit_value(strbuf *b, int k, const ft_mod_node *nodes, const int32_t *indices,
                       const unsigned char *ty, int fast)
{
    const char *ex = fast ? "__expf" : "expf", *th = fast ? "ft_tanh_fast" : "tanhf";
    const ft_mod_node *x = &nodes[k];
    const int a = x->a, c2 = x->b, c3 = x->c;
    const int f = ty[k] == T_FLOAT;
    put(b, "        const %s v%d = ", f ? "float" : "int", k);
    switch (x->op) {
    case FT_MOD_S: put(b, "s"); break;
    case FT_MOD_B: put(b, "b_ + 1"); break;
    case FT_MOD_H: put(b, "h_ + 1"); break;
    case FT_MOD_I: put(b, "i_ + 1"); break;
    case FT_MOD_J: put(b, "j_ + 1"); break;
    case FT_MOD_CONST:
        if (f)
            put(b, "%.9gf", x->value);
        else
            put(b, "%d", (int)x->value);
        break;
    case FT_MOD_ADD: case FT_MOD_SUB: case FT_MOD_MUL: {
        const char *op = x->op == FT_MOD_ADD ? "+" : x->op == FT_MOD_SUB ? "-" : "*";
        if (f) {
            fval(b, ty, a), put(b, " %s ", op), fval(b, ty, c2);
        } else {
            put(b, "v%d %s v%d", a, op, c2);
        }
        break;
    }
    case FT_MOD_DIV: /* by a constant: times its reciprocal, rounded once */
        if (nodes[c2].op == FT_MOD_CONST && nodes[c2].value != 0)
            fval(b, ty, a), put(b, " * %.9gf", 1.0 / nodes[c2].value);
        else if (fast)
            put(b, "__fdividef("), fval(b, ty, a), put(b, ", "), fval(b, ty, c2), put(b, ")");
        else
            fval(b, ty, a), put(b, " / "), fval(b, ty, c2);
        break;
    case FT_MOD_MOD:
        if (f) {
            put(b, "ft_fmod_lua("), fval(b, ty, a), put(b, ", "), fval(b, ty, c2), put(b, ")");
        } else {
            put(b, "ft_imod_lua(v%d, v%d)", a, c2);
        }
        break;
    case FT_MOD_POW: put(b, "powf("), fval(b, ty, a), put(b, ", "), fval(b, ty, c2), put(b, ")"); break;
    case FT_MOD_NEG: put(b, "-v%d", a); break;
    case FT_MOD_EQ: case FT_MOD_NE: case FT_MOD_LT: case FT_MOD_LE: case FT_MOD_GT:
    case FT_MOD_GE: {
        static const char *const ops[] = {"==", "!=", "<", "<=", ">", ">="};
        const char *op = ops[x->op - FT_MOD_EQ];
        if (ty[a] != T_FLOAT && ty[c2] != T_FLOAT)
            put(b, "v%d %s v%d", a, op, c2);
        else
            fval(b, ty, a), put(b, " %s ", op), fval(b, ty, c2);
        break;
    }
    case FT_MOD_AND: put(b, "v%d != 0 && v%d != 0", a, c2); break;
    case FT_MOD_OR: put(b, "v%d != 0 || v%d != 0", a, c2); break;
    case FT_MOD_NOT: put(b, "v%d == 0", a); break;
    case FT_MOD_WHERE:
        if (f) {
            put(b, "v%d != 0 ? ", a), fval(b, ty, c2), put(b, " : "), fval(b, ty, c3);
        } else {
            put(b, "v%d != 0 ? v%d : v%d", a, c2, c3);
        }
        break;
    case FT_MOD_ABS: put(b, f ? "fabsf(v%d)" : "abs(v%d)", a); break;
    case FT_MOD_EXP: put(b, "%s(", ex), fval(b, ty, a), put(b, ")"); break;
    case FT_MOD_LOG: put(b, "logf("), fval(b, ty, a), put(b, ")"); break;
    case FT_MOD_SQRT: put(b, "sqrtf("), fval(b, ty, a), put(b, ")"); break;
    case FT_MOD_TANH: put(b, "%s(", th), fval(b, ty, a), put(b, ")"); break;
    case FT_MOD_SIGMOID: put(b, "1.f / (1.f + %s(-", ex), fval(b, ty, a), put(b, "))"); break;
    case FT_MOD_MIN: case FT_MOD_MAX: {
        const char *op = x->op == FT_MOD_MIN ? "<=" : ">=";
        if (f) {
            fval(b, ty, a), put(b, " %s ", op), fval(b, ty, c2), put(b, " ? "), fval(b, ty, a),
                put(b, " : "), fval(b, ty, c2);
        } else {
            put(b, "v%d %s v%d ? v%d : v%d", a, op, c2, a, c2);
        }
        break;
    }
    case FT_MOD_FLOOR: put(b, f ? "floorf(v%d)" : "v%d", a); break;
    case FT_MOD_READ: {
        put(b, "ft_read%d(", k);
        for (int d = 0; d < x->c; d++)
            put(b, "%sv%d", d ? ", " : "", indices[x->b + d]);
        put(b, ")");
        break;
    }
    }
    put(b, ";\n");
}

/* Node k's derivative in node seed (seed < 0: in s), d%d, as mods.c's
 * interpreter carries it; 0 where the node does not depend on the seed
 * (dep). Float nodes only. */
static void emit_deriv(strbuf *b, int k, int seed, const ft_mod_node *nodes,
                       const unsigned char *ty, const unsigned char *dep)
{
    const ft_mod_node *x = &nodes[k];
    const int a = x->a, c2 = x->b, c3 = x->c;
    /* d/d(seed), as mods.c's interpreter, but without the terms of
     * operands that do not depend on the seed: v * 0 is not 0 to the
     * compiler (v may be infinite), so it costs a multiply and an add a
     * score, and is NaN where v is infinite (the interpreter skips a zero
     * derivative's term too) */
    put(b, "        const float d%d = ", k);
#define D(q) (ty[q] == T_FLOAT && dep[q] ? "d" : "0.f*"), q
    /* za, zb: operand a's, b's derivative is 0 (arithmetic nodes only,
     * whose a and b are nodes: a read's are a tensor and an index list) */
    const int arith = x->op == FT_MOD_ADD || x->op == FT_MOD_SUB || x->op == FT_MOD_MUL ||
                      x->op == FT_MOD_DIV || x->op == FT_MOD_MOD;
    const int za = !arith || a < 0 || !(ty[a] == T_FLOAT && dep[a]);
    const int zb = !arith || c2 < 0 || !(ty[c2] == T_FLOAT && dep[c2]);
    if (!dep[k] || (arith && za && zb)) {
        put(b, "0.f");
    } else if (seed < 0 ? x->op == FT_MOD_S : k == seed) {
        put(b, "1.f");
    } else {
        switch (x->op) {
        case FT_MOD_ADD:
        case FT_MOD_SUB:
            if (!za)
                put(b, "d%d", a);
            if (!zb)
                put(b, za ? "%sd%d" : " %s d%d", x->op == FT_MOD_ADD ? (za ? "" : "+") : "-", c2);
            break;
        case FT_MOD_MUL:
            if (!za)
                put(b, "d%d * ", a), fval(b, ty, c2);
            if (!zb)
                put(b, za ? "" : " + "), fval(b, ty, a), put(b, " * d%d", c2);
            break;
        case FT_MOD_DIV:
            if (nodes[c2].op == FT_MOD_CONST && nodes[c2].value != 0)
                put(b, "%s%d * %.9gf", D(a), 1.0 / nodes[c2].value);
            else if (zb)
                put(b, "%s%d / ", D(a)), fval(b, ty, c2);
            else
                put(b, "(%s%d - v%d * d%d) / ", D(a), k, c2), fval(b, ty, c2);
            break;
        case FT_MOD_MOD:
            if (zb)
                put(b, "%s%d", D(a));
            else
                put(b, "%s%d - floorf(", D(a)), fval(b, ty, a), put(b, " / "), fval(b, ty, c2),
                    put(b, ") * d%d", c2);
            break;
        case FT_MOD_POW:
            put(b, "(%s%d != 0.f ? ", D(a)), fval(b, ty, c2), put(b, " * powf("),
                fval(b, ty, a), put(b, ", "), fval(b, ty, c2), put(b, " - 1.f) * %s%d : 0.f)", D(a));
            put(b, " + (%s%d != 0.f ? v%d * logf(", D(c2), k), fval(b, ty, a),
                put(b, ") * %s%d : 0.f)", D(c2));
            break;
        case FT_MOD_NEG: put(b, "-%s%d", D(a)); break;
        case FT_MOD_WHERE: put(b, "v%d != 0 ? %s%d : %s%d", a, D(c2), D(c3)); break;
        case FT_MOD_ABS: put(b, "v%d < 0.f ? -%s%d : %s%d", a, D(a), D(a)); break;
        case FT_MOD_EXP: put(b, "v%d * %s%d", k, D(a)); break;
        case FT_MOD_LOG: put(b, "%s%d / ", D(a)), fval(b, ty, a); break;
        case FT_MOD_SQRT: put(b, "%s%d != 0.f ? %s%d / (2.f * v%d) : 0.f", D(a), D(a), k); break;
        case FT_MOD_TANH: put(b, "(1.f - v%d * v%d) * %s%d", k, k, D(a)); break;
        case FT_MOD_SIGMOID: put(b, "v%d * (1.f - v%d) * %s%d", k, k, D(a)); break;
        case FT_MOD_MIN:
            fval(b, ty, a), put(b, " <= "), fval(b, ty, c2), put(b, " ? %s%d : %s%d", D(a), D(c2));
            break;
        case FT_MOD_MAX:
            fval(b, ty, a), put(b, " >= "), fval(b, ty, c2), put(b, " ? %s%d : %s%d", D(a), D(c2));
            break;
        default: put(b, "0.f"); break;
        }
    }
#undef D
    put(b, ";\n");
}

/* The nodes `need` marks, in order: their values (what & EMIT_VALUES;
 * those ctx marks taken from the Ctx c that prepare made) and the float
 * ones' derivatives in node seed (what & EMIT_DERIVS). */
static void emit_nodes(strbuf *b, int n, const ft_mod_node *nodes, const int32_t *indices,
                       const unsigned char *ty, const unsigned char *need, const unsigned char *dep,
                       const unsigned char *ctx, int what, int seed, int fast)
{
    for (int k = 0; k < n; k++) {
        if (!need[k])
            continue;
        if ((what & EMIT_VALUES) && ctx && ctx[k])
            put(b, "        const %s v%d = c.v%d;\n", ty[k] == T_FLOAT ? "float" : "int", k, k);
        else if (what & EMIT_VALUES)
            emit_value(b, k, nodes, indices, ty, fast);
        if ((what & EMIT_VALUES) && (ty[k] & T_EXACT))
            emit_exact(b, k, nodes, ctx && ctx[k]);
        if ((what & EMIT_DERIVS) && ty[k] == T_FLOAT)
            emit_deriv(b, k, seed, nodes, ty, dep);
    }
}

/* The nodes root needs, in order (need is scratch). */
static void emit_root(strbuf *b, int root, int n, const ft_mod_node *nodes,
                      const int32_t *indices, const unsigned char *ty, unsigned char *need,
                      const unsigned char *dep, const unsigned char *ctx, int what, int fast)
{
    memset(need, 0, (size_t)n);
    mark_needed(root, nodes, indices, need);
    emit_nodes(b, n, nodes, indices, ty, need, dep, ctx, what, -1, fast);
}

/* Which nodes take the same value over a call's (b, h) tile: none of s,
 * i, j reaches them (indices, constants, reads at such indices). */
static void tile_invariant(int n, const ft_mod_node *nodes, const int32_t *indices,
                           unsigned char *inv)
{
    for (int k = 0; k < n; k++) {
        const ft_mod_node *x = &nodes[k];
        int v = 1;
        switch (x->op) {
        case FT_MOD_S: case FT_MOD_I: case FT_MOD_J:
            v = 0;
            break;
        case FT_MOD_B: case FT_MOD_H: case FT_MOD_CONST:
            break;
        case FT_MOD_READ:
            for (int q = 0; q < x->c; q++)
                v &= inv[indices[x->b + q]];
            break;
        default:
            v = inv[x->a];
            if (x->op != FT_MOD_NEG && x->op != FT_MOD_NOT &&
                !(x->op >= FT_MOD_ABS && x->op <= FT_MOD_SIGMOID) && x->op != FT_MOD_FLOOR)
                v &= inv[x->b];
            if (x->op == FT_MOD_WHERE)
                v &= inv[x->c];
            break;
        }
        inv[k] = (unsigned char)v;
    }
}

/* Whether read node k feeds the score with a gradient: a float tensor's
 * read that the (float) score root depends on. dep: scratch. */
static int read_has_grad(int k, int score, int n, const ft_mod_node *nodes, const int32_t *indices,
                         const ft_tensor *const *tensors, const unsigned char *ty,
                         unsigned char *dep)
{
    if (score < 0 || ty[score] != T_FLOAT || nodes[k].op != FT_MOD_READ ||
        !ft_dtype_is_float(tensors[nodes[k].a]->dtype))
        return 0;
    depends_on(k, n, nodes, indices, dep);
    return dep[score];
}

/* The head of read node k's function ft_<what><k>(x0, ...) of return
 * type ret: its tensor t and an offset off from 0. */
static void read_head(strbuf *b, const ft_mod_node *x, const char *ret, const char *what, int k)
{
    put(b, "template <");
    for (int d = 0; d < x->c; d++)
        put(b, "%stypename I%d", d ? ", " : "", d);
    put(b, ">\nstatic __device__ __forceinline__ %s ft_%s%d(", ret, what, k);
    for (int d = 0; d < x->c; d++)
        put(b, "%sI%d x%d", d ? ", " : "", d, d);
    put(b, ")\n{\n    const FlashModTensor &t = ft_mod_args.t[%d];\n    long long off = 0;\n", x->a);
}

ft_status ft_attn_mods_cuda_check_tensors(const char *func, int arg, int ntensors,
                                         const ft_tensor *const *tensors)
{
    if (ntensors > FT_RTC_MAX_TENSORS)
        return ft_fail(FT_ERR_UNSUPPORTED, func, arg,
                       "mods on CUDA read at most %d tensors, these read %d", FT_RTC_MAX_TENSORS,
                       ntensors);
    for (int t = 0; t < ntensors; t++) {
        const ft_tensor *x = tensors[t];
        FT_TRY(ft_check_computable(func, arg, x->dtype, "mods' tensors"));
        if (x->ndim > 4)
            return ft_fail(FT_ERR_UNSUPPORTED, func, arg,
                           "mods on CUDA read tensors of at most 4 dims; tensor %d has %d", t + 1,
                           x->ndim);
        for (int d = 0; d < x->ndim; d++)
            if (x->shape[d] > INT32_MAX)
                return ft_fail(FT_ERR_UNSUPPORTED, func, arg,
                               "mods on CUDA read tensors of sizes below 2^31; tensor %d has "
                               "%lld", t + 1, (long long)x->shape[d]);
    }
    return FT_OK;
}

int ft_attn_mods_cuda_has_score(const ft_attn_mods *m)
{
    const int score = ft_attn_mods_root(m, 0);
    return score >= 0 && ft_attn_mods_graph(m)[score].op != FT_MOD_S;
}

int ft_attn_mods_cuda_has_grad(const ft_attn_mods *m, const ft_tensor *const *tensors)
{
    const int n = ft_attn_mods_nodes_count(m), score = ft_attn_mods_root(m, 0);
    unsigned char *ty = calloc((size_t)n + 1, 1), *dep = calloc((size_t)n + 1, 1);
    int has = 0;
    if (ty && dep) {
        const ft_mod_node *nodes = ft_attn_mods_graph(m);
        const int32_t *indices = ft_attn_mods_index_list(m);
        node_types(n, nodes, tensors, ty);
        for (int k = 0; k < n && !has; k++)
            has = read_has_grad(k, score, n, nodes, indices, tensors, ty, dep);
    }
    free(ty), free(dep);
    return has;
}

/* Whether node k's derivative in s is 1 wherever it is taken: s itself,
 * or s plus or minus what does not depend on s (dep: depends_on(-1)), as
 * ALiBi's s - slope |i - j| or a bias table's s + bias[h][i - j]. The
 * Hopper dK/dV kernel then keeps no derivative between its two steps
 * (FtUserMod::unit_grad, DkdvRows::gmode). */
static int unit_in_s(int k, const ft_mod_node *nodes, const unsigned char *dep)
{
    const ft_mod_node *x = &nodes[k];
    if (!dep[k]) /* nothing without s has a derivative of 1 (and a shared
                  * sub-graph without s is never walked twice) */
        return 0;
    if (x->op == FT_MOD_S)
        return 1;
    if (x->op == FT_MOD_ADD)
        return (unit_in_s(x->a, nodes, dep) && !dep[x->b]) ||
               (!dep[x->a] && unit_in_s(x->b, nodes, dep));
    if (x->op == FT_MOD_SUB)
        return unit_in_s(x->a, nodes, dep) && !dep[x->b];
    return 0;
}

char *ft_attn_mods_cuda_source(const ft_attn_mods *m, const ft_tensor *const *tensors, int fast,
                               int debug, int grads, int call)
{
    const int n = ft_attn_mods_nodes_count(m);
    const ft_mod_node *nodes = ft_attn_mods_graph(m);
    const int32_t *indices = ft_attn_mods_index_list(m);
    const int score = ft_attn_mods_root(m, 0), mask = ft_attn_mods_root(m, 1);
    unsigned char *ty = calloc((size_t)n, 1), *dep = calloc((size_t)n, 1);
    unsigned char *need = calloc((size_t)n, 1), *gdep = calloc((size_t)n, 1);
    unsigned char *ctx = calloc((size_t)n, 1), *gread = calloc((size_t)n, 1);
    strbuf b = {NULL, 0, 0, 0};
    if (!ty || !dep || !need || !gdep || !ctx || !gread)
        b.failed = 1;
    if (!b.failed) {
        node_types(n, nodes, tensors, ty);
        depends_on(-1, n, nodes, indices, dep);
        /* the Ctx: the tile-invariant nodes the roots need but constants,
         * worked out once a tile by prepare (a per-head slope: one read a
         * tile, not one a score) */
        tile_invariant(n, nodes, indices, gdep);
        for (int r = 0; r < 2; r++)
            if (ft_attn_mods_root(m, r) >= 0)
                mark_needed(ft_attn_mods_root(m, r), nodes, indices, need);
        for (int k = 0; k < n; k++)
            ctx[k] = (unsigned char)(need[k] && gdep[k] && nodes[k].op != FT_MOD_CONST);
    }
    put(&b, "/* flashtile: a modification written in Lua (%d nodes) */\n", n);
    put(&b, "#define FT_RTC_MAX_TENSORS %d\n", FT_RTC_MAX_TENSORS);
    put(&b, "struct FlashModTensor\n{\n    const void *data;\n    long long stride[4];\n"
            "    int shape[4];\n    float *grad; /* the backward's f32 gradient, row-major */\n};\n"
            "struct FlashModArgs { FlashModTensor t[FT_RTC_MAX_TENSORS]; };\n"
            "__constant__ FlashModArgs ft_mod_args;\n"
            "__device__ int ft_mod_fault;\n"
            "static __device__ __forceinline__ int ft_imod_lua(int a, int b)\n"
            "{\n    if (b == 0) return 0;\n    const int r = a %% b;\n"
            "    return r != 0 && ((r ^ b) < 0) ? r + b : r;\n}\n"
            "static __device__ __forceinline__ float ft_fmod_lua(float a, float b)\n"
            "{\n    return a - floorf(a / b) * b;\n}\n"
            "static __device__ __forceinline__ float ft_tanh_fast(float x)\n"
            "{\n    float y;\n    asm(\"tanh.approx.f32 %%0, %%1;\" : \"=f\"(y) : \"f\"(x));\n"
            "    return y;\n}\n"
            "/* a 1-based index (as Lua's, rounded down) of dim d of a tensor, 0-based, clamped */\n"
            "static __device__ __forceinline__ long long ft_index(int v, int shape)\n"
            "{\n    int x = v - 1;\n%s    return x < 0 ? 0 : x >= shape ? shape - 1 : x;\n}\n"
            "static __device__ __forceinline__ long long ft_index(float v, int shape)\n"
            "{\n    return ft_index((int)floorf(v), shape);\n}\n",
        debug ? "    if (x < 0 || x >= shape) atomicExch(&ft_mod_fault, 1);\n" : "");
    for (int k = 0; k < n && !b.failed; k++) { /* one reader per read node */
        const ft_mod_node *x = &nodes[k];
        if (x->op != FT_MOD_READ)
            continue;
        read_head(&b, x, ft_dtype_is_float(tensors[x->a]->dtype) ? "float" : "int", "read", k);
        for (int d = 0; d < x->c; d++)
            put(&b, "    off += ft_index(x%d, t.shape[%d]) * t.stride[%d];\n", d, d, d);
        put(&b, "    return %s;\n}\n", load_expr(tensors[x->a]->dtype));
        read_head(&b, x, "long long", "lin", k); /* and where its gradient goes */
        for (int d = 0; d < x->c; d++)
            put(&b, "    off = off * t.shape[%d] + ft_index(x%d, t.shape[%d]);\n", d, d, d);
        put(&b, "    return off;\n}\n");
    }
    int nsites = 0; /* the reads with a gradient (gread): a running sum each */
    for (int k = 0; grads && k < n && !b.failed; k++)
        nsites += gread[k] =
            (unsigned char)read_has_grad(k, score, n, nodes, indices, tensors, ty, gdep);
    const int has_grad = nsites > 0;
    put(&b, "/* g into *p's running sum a, which goes to memory when p moves on */\n"
            "static __device__ __forceinline__ void ft_grad_add(float *&p, float &a, float *q, "
            "float g)\n{\n    if (p == q) {\n        a += g;\n        return;\n    }\n"
            "    if (p)\n        atomicAdd(p, a);\n    p = q, a = g;\n}\n");
    const int unit = !b.failed && score >= 0 && unit_in_s(score, nodes, dep);
    double top = 0;
    const int bounded = ft_attn_mods_score_bound(m, &top);
    put(&b, "struct FtUserMod {\n    static constexpr bool on = true, has_score = %s, has_grad = %s, "
            "unit_grad = %s;\n",
        ft_attn_mods_cuda_has_score(m) ? "true" : "false", has_grad ? "true" : "false",
        unit ? "true" : "false");
    /* the score's top where its range is narrow (ft_attn_mods_score_bound;
     * scaled units, rounded up to a float): FwdRows::um_capped */
    put(&b, "    static constexpr bool has_bound = %s;\n    static constexpr float bound = %.9ef;\n",
        bounded ? "true" : "false", bounded ? (double)nextafterf((float)top, INFINITY) : 0.0);
    /* whether the kernels keep the built-in score variants (mod_acc_with)
     * and dropout's code: a call without them compiles without them (the
     * Lua softcap's dK/dV kernel spilled 72 bytes with both, 4 without) */
    put(&b, "    static constexpr bool builtin_scores = %s, dropout = %s, has_mask = %s, debug = %s;\n",
        call & FT_RTC_BUILTIN_SCORES ? "true" : "false", call & FT_RTC_DROPOUT ? "true" : "false",
        mask >= 0 && !(call & FT_RTC_MASK_IS_BAND) ? "true" : "false", debug ? "true" : "false");
    put(&b, "    struct Ctx {\n");
    for (int k = 0; k < n && !b.failed; k++)
        if (ctx[k])
            put(&b, "        %s v%d;\n", ty[k] == T_FLOAT ? "float" : "int", k);
    put(&b, "        int unused_;\n    };\n"
            "    static __device__ __forceinline__ Ctx prepare(int b_, int h_)\n    {\n"
            "        (void)b_, (void)h_;\n        Ctx c;\n        c.unused_ = 0;\n");
    if (!b.failed && n > 0) {
        memset(need, 0, (size_t)n);
        for (int k = 0; k < n; k++)
            if (ctx[k])
                mark_needed(k, nodes, indices, need);
        emit_nodes(&b, n, nodes, indices, ty, need, dep, NULL, EMIT_VALUES, -1, fast);
        for (int k = 0; k < n; k++)
            if (ctx[k])
                put(&b, "        c.v%d = v%d;\n", k, k);
    }
    put(&b, "        return c;\n    }\n");
    put(&b, "    struct GradState {\n        float *p[%d];\n        float a[%d];\n    };\n",
        nsites > 0 ? nsites : 1, nsites > 0 ? nsites : 1);
    put(&b, "    static __device__ __forceinline__ void grad_flush(GradState &st)\n    {\n"
            "        for (int k = 0; k < %d; k++)\n            if (st.p[k])\n"
            "                atomicAdd(st.p[k], st.a[k]);\n    }\n", nsites);
    put(&b, "    static __device__ __forceinline__ float score(const Ctx &c, int i_, int j_, "
            "float fi_, float fj_, float s, float *ds)\n    {\n"
            "        (void)c, (void)i_, (void)j_, (void)fi_, (void)fj_;\n");
    if (score >= 0 && !b.failed) {
        emit_root(&b, score, n, nodes, indices, ty, need, dep, ctx, EMIT_VALUES | EMIT_DERIVS,
                  fast);
        if (ty[score] == T_FLOAT)
            put(&b, "        *ds = d%d;\n        return v%d;\n", score, score);
        else
            put(&b, "        *ds = 0.f;\n        return (float)v%d;\n", score);
    } else {
        put(&b, "        *ds = 1.f;\n        return s;\n");
    }
    put(&b, "    }\n    static __device__ __forceinline__ bool keep(const Ctx &c, int i_, int j_, "
            "float fi_, float fj_)\n    {\n        (void)c, (void)i_, (void)j_, (void)fi_, (void)fj_;\n");
    if (mask >= 0 && !b.failed) {
        emit_root(&b, mask, n, nodes, indices, ty, need, dep, ctx, EMIT_VALUES, fast);
        put(&b, "        return v%d != 0;\n", mask);
    } else {
        put(&b, "        return true;\n");
    }
    /* grad(b, h, i, j, s, g): adds g d score / d(value read) into each
     * float tensor's gradient where a read of it took its value */
    put(&b, "    }\n    static __device__ __forceinline__ void grad(const Ctx &c, int i_, int j_, "
            "float fi_, float fj_, float s, float g, GradState &st)\n    {\n"
            "        (void)c, (void)i_, (void)j_, (void)fi_, (void)fj_, (void)s, (void)g, (void)st;\n");
    if (has_grad && !b.failed) {
        emit_root(&b, score, n, nodes, indices, ty, need, dep, ctx, EMIT_VALUES, fast);
        for (int k = 0, site = 0; k < n && !b.failed; k++) {
            if (!gread[k])
                continue;
            depends_on(k, n, nodes, indices, gdep); /* the derivatives in read k */
            const ft_mod_node *x = &nodes[k];
            put(&b, "        {\n");
            emit_nodes(&b, n, nodes, indices, ty, need, gdep, ctx, EMIT_DERIVS, k, fast);
            put(&b, "        if (d%d != 0.f)\n            ft_grad_add(st.p[%d], st.a[%d], "
                    "ft_mod_args.t[%d].grad + ft_lin%d(", score, site, site, x->a, k);
            for (int d = 0; d < x->c; d++)
                put(&b, "%sv%d", d ? ", " : "", indices[x->b + d]);
            put(&b, "), g * d%d);\n        }\n", score);
            site++;
        }
    }
    put(&b, "    }\n};\n");
    free(ty), free(dep), free(need), free(gdep), free(ctx), free(gread);
    if (b.failed) {
        free(b.s);
        return NULL;
    }
    return b.s;
}

#ifndef FT_HAVE_CUDA
void ft_cuda_mods_stats(ft_rtc_stats *out)
{
    memset(out, 0, sizeof *out);
}

ft_status ft_cuda_mods_compile(const ft_attn_mods *mods, int ntensors,
                               const ft_tensor *const *tensors, ft_dtype dtype, int head_dim,
                               const char *arch, int passes, int use_cache, int *compiled)
{
    (void)mods, (void)ntensors, (void)tensors, (void)dtype, (void)head_dim, (void)arch, (void)passes;
    (void)use_cache;
    if (compiled)
        *compiled = 0;
    return ft_fail(FT_ERR_UNSUPPORTED, "ft_cuda_mods_compile", 0, "this build has no CUDA backend");
}
#endif
