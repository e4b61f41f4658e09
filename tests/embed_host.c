/*
 * embed_host.c - a C program that embeds Lua with flashtile the way a host
 * application does, and runs two Lua states on two threads at the same
 * time. Built two ways (cmake/specs.cmake):
 *
 *   embed_host_static LUA_DIR
 *       The binding is linked into the program (the static library
 *       flashtile_lua_static, made of lua/lflashtile.c) and registered as
 *       "flashtile.core" with luaL_requiref (package.preload in Lua 5.1
 *       and LuaJIT); Lua comes from its shared library. LUA_DIR holds
 *       flashtile/init.lua and the other Lua files (the repository's lua/).
 *
 *   embed_host_dynamic LUA_DIR CPATH_DIR      (FT_EMBED_DYNAMIC)
 *       Lua is linked statically and the program exports its symbols
 *       (-Wl,-E); the binding is loaded from CPATH_DIR/flashtile/core.so by
 *       `require`, as the `lua` interpreter loads it. core.so does not link
 *       liblua: without -Wl,-E it would find no lua_* symbols to bind to.
 *
 * Each thread owns one lua_State (a state is never used by two threads at
 * once; two states on two threads need no lock). The checks:
 *   - attention forward and backward (causal, GQA, f64): the tiled path
 *     against the naive one, and known values (keys all zero: every output
 *     row is the mean of V, LSE = log Nk, dV rows the mean of dOut, dQ = 0);
 *   - a few tensor ops (matmul, softmax) against what they must give;
 *   - where a GPU is present, the same attention (f32 and f16) and a matmul
 *     through the CUDA backend against the CPU's results;
 *   - each state's random generator is its own: the same seed gives, on
 *     either thread and while the other thread draws numbers, exactly the
 *     results a state gave alone on the main thread;
 *   - a Lua error from a bad argument in one state (raised up to the host)
 *     carries that state's own message, leaves the state usable, and does
 *     not disturb the other state's results;
 *   - once every state is closed, no tensor memory is left, on the CPU or
 *     on CUDA (the memory counters are process-wide).
 * Prints one line per failure, and "embed_host: OK" at the end on success.
 */
#define _POSIX_C_SOURCE 200809L /* pthread_barrier_t */
#include <lauxlib.h>
#include <lua.h>
#include <lualib.h>

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#ifndef FT_EMBED_DYNAMIC
/* The binding's entry point, linked in from lua/lflashtile.c. */
int luaopen_flashtile_core(lua_State *L);
#endif

#define NRESULTS 8
#ifndef ITERATIONS
#define ITERATIONS 12 /* per thread; -DITERATIONS=n for a longer run */
#endif

/* Run with the seed as its argument; checks what it can by itself and
 * returns NRESULTS numbers that depend on every result. */
static const char WORK[] =
    "local seed = ...\n"
    "local ft = require 'flashtile'\n"
    "ft.manual_seed(seed)\n"
    "local function check(ok, what) if not ok then error(what, 2) end end\n"
    "-- causal GQA attention in f64: FlashAttention's tiled path against the naive one\n"
    "local q = ft.randn({2, 20, 4, 16}, {dtype = 'f64'})\n"
    "local k = ft.randn({2, 20, 2, 16}, {dtype = 'f64'})\n"
    "local v = ft.randn({2, 20, 2, 16}, {dtype = 'f64'})\n"
    "local dout = ft.randn({2, 20, 4, 16}, {dtype = 'f64'})\n"
    "local tiled = {causal = true, impl = 'tiled', block_q = 8, block_k = 8}\n"
    "local naive = {causal = true, impl = 'naive'}\n"
    "local out, lse = ft.attention(q, k, v, tiled)\n"
    "local dq, dk, dv = ft.attention_backward(dout, q, k, v, out, lse, tiled)\n"
    "local out2, lse2 = ft.attention(q, k, v, naive)\n"
    "local dq2, dk2, dv2 = ft.attention_backward(dout, q, k, v, out2, lse2, naive)\n"
    "local pairs_ = {{'out', out, out2}, {'lse', lse, lse2}, {'dq', dq, dq2},\n"
    "                {'dk', dk, dk2}, {'dv', dv, dv2}}\n"
    "for _, p in ipairs(pairs_) do\n"
    "  local d = ft.max_abs_diff(p[2], p[3])\n"
    "  check(d < 1e-10, ('tiled and naive %s differ by %g'):format(p[1], d))\n"
    "end\n"
    "-- keys all zero: each query weighs the 20 keys alike\n"
    "local kz = ft.zeros({2, 20, 4, 16}, {dtype = 'f64'})\n"
    "local v4 = ft.randn({2, 20, 4, 16}, {dtype = 'f64'})\n"
    "local o, l = ft.attention(q, kz, v4)\n"
    "local gq, gk, gv = ft.attention_backward(dout, q, kz, v4, o, l)\n"
    "local mean_v, mean_dout = v4:mean(2), dout:mean(2)\n"
    "for i = 1, 20 do\n"
    "  check(ft.max_abs_diff(o:select(2, i), mean_v) < 1e-12, 'output row ' .. i .. ' is not the mean of V')\n"
    "  check(ft.max_abs_diff(gv:select(2, i), mean_dout) < 1e-12, 'dV row ' .. i .. ' is not the mean of dOut')\n"
    "end\n"
    "check((l - math.log(20)):abs():max() < 1e-12, 'LSE is not log(20)')\n"
    "check(gq:abs():max() == 0, 'dQ is not 0')\n"
    "-- tensor ops\n"
    "local a = ft.randn({16, 16}, {dtype = 'f64'})\n"
    "local sym = ft.matmul(a, a:transpose())\n"
    "check(ft.max_abs_diff(sym, sym:transpose()) < 1e-12, 'A A^T is not symmetric')\n"
    "check((a:softmax(2):sum(2) - 1):abs():max() < 1e-12, 'softmax rows do not sum to 1')\n"
    "local function sq(t) return (t * t):sum() end\n"
    "-- on a GPU, the same attention through the CUDA kernels, and a cuBLAS product\n"
    "local gpu = 0\n"
    "if ft.cuda.is_available() then\n"
    "  local fq, fk, fv = q:float():cuda(), k:float():cuda(), v:float():cuda()\n"
    "  local co, cl = ft.attention(fq, fk, fv, {causal = true})\n"
    "  local cdq, cdk, cdv = ft.attention_backward(dout:float():cuda(), fq, fk, fv, co, cl, {causal = true})\n"
    "  local ho = ft.attention(q:half():cuda(), k:half():cuda(), v:half():cuda(), {causal = true})\n"
    "  local cm = ft.matmul(a:float():cuda(), a:float():cuda():transpose())\n"
    "  local host = {co:cpu():double(), cdq:cpu():double(), cdk:cpu():double(), cdv:cpu():double(),\n"
    "                ho:cpu():double(), cm:cpu():double()}\n"
    "  local want = {out, dq, dk, dv, out, sym}\n"
    "  local tol = {1e-4, 1e-3, 1e-3, 1e-3, 1e-2, 1e-3}\n"
    "  for i = 1, #host do\n"
    "    local d = ft.max_abs_diff(host[i], want[i])\n"
    "    check(d < tol[i], ('CUDA result %d differs from the CPU by %g'):format(i, d))\n"
    "    gpu = gpu + sq(host[i])\n"
    "  end\n"
    "end\n"
    "return sq(out), lse:sum(), sq(dq), sq(dk), sq(dv), sq(sym), ft.rand({5}):sum(), gpu\n";

/* Each thread's mistake, and words its error message must contain (the
 * function, the argument, and this mistake's own numbers). */
static const struct {
    const char *code, *words[3];
} MISTAKES[2] = {
    {"local ft = require 'flashtile'\n"
     "return ft.zeros({2, 3}):view(5, 3)\n",
     {"bad argument #1 to 'view'", "{5, 3} has 15 elements", "{2, 3} has 6"}},
    {"local ft = require 'flashtile'\n"
     "local x = ft.zeros({1, 4, 2, 8})\n"
     "return ft.attention(x, x, ft.zeros({1, 4, 2, 6}))\n",
     {"bad argument #3 to 'attention'", "{1, 4, 2, 6}", "{1, 4, 2, 8}"}},
};

static const char *lua_dir, *cpath_dir;

/* A new state with the standard libraries and flashtile reachable by
 * `require "flashtile"`; NULL (and a message) on failure. */
static lua_State *new_state(void)
{
    lua_State *L = luaL_newstate();
    if (!L) {
        fprintf(stderr, "embed_host: luaL_newstate failed\n");
        return NULL;
    }
    luaL_openlibs(L);
#ifndef FT_EMBED_DYNAMIC
    /* flashtile.core is in this program: register it under its name. */
#if LUA_VERSION_NUM >= 502
    luaL_requiref(L, "flashtile.core", luaopen_flashtile_core, 0);
    lua_pop(L, 1);
#else
    lua_getglobal(L, "package");
    lua_getfield(L, -1, "preload");
    lua_pushcfunction(L, luaopen_flashtile_core);
    lua_setfield(L, -2, "flashtile.core");
    lua_pop(L, 2);
#endif
#endif
    /* The Lua half (flashtile/init.lua, ...), and for the dynamic host the
     * C half (flashtile/core.so). */
    lua_getglobal(L, "package");
    lua_pushfstring(L, "%s/?.lua;%s/?/init.lua", lua_dir, lua_dir);
    lua_setfield(L, -2, "path");
    if (cpath_dir) {
        lua_pushfstring(L, "%s/?.so", cpath_dir);
        lua_setfield(L, -2, "cpath");
    }
    lua_pop(L, 1);
    return L;
}

/* Runs code with the integer argument arg (unless arg < 0), leaving nres
 * results on the stack. Returns 0, or the Lua error status with the
 * message copied into err (and nothing left on the stack). */
static int run(lua_State *L, const char *code, int arg, int nres, char *err, size_t errsize)
{
    int st = luaL_loadstring(L, code);
    if (st == 0) {
        int nargs = 0;
        if (arg >= 0) {
            lua_pushinteger(L, arg);
            nargs = 1;
        }
        st = lua_pcall(L, nargs, nres, 0);
    }
    if (st != 0) {
        const char *msg = lua_tostring(L, -1);
        snprintf(err, errsize, "%s", msg ? msg : "(an error object that is not a string)");
        lua_pop(L, 1);
    }
    return st;
}

/* The WORK results of a state on its own, for seeds 1 and 2. */
static double reference[2][NRESULTS];

/* Runs WORK with seed in L; 0 and the results in res, or -1. */
static int work(lua_State *L, const char *who, int seed, double res[NRESULTS])
{
    char err[512];
    if (run(L, WORK, seed, NRESULTS, err, sizeof err) != 0) {
        fprintf(stderr, "embed_host: %s, seed %d: %s\n", who, seed, err);
        return -1;
    }
    for (int i = 0; i < NRESULTS; i++)
        res[i] = lua_tonumber(L, i - NRESULTS);
    lua_pop(L, NRESULTS);
    return 0;
}

typedef struct job {
    int id;                     /* 0 or 1 */
    pthread_barrier_t *start;
    int failures;
    int runs, errors_seen;
} job;

static void *thread_main(void *arg)
{
    job *j = arg;
    char who[32], err[512];
    snprintf(who, sizeof who, "thread %d", j->id);
    lua_State *L = new_state();
    pthread_barrier_wait(j->start); /* both states exist: go together */
    if (!L) {
        j->failures++;
        return NULL;
    }
    for (int it = 0; it < ITERATIONS; it++) {
        /* The two threads work on different seeds at any moment. */
        int seed = 1 + (it + j->id) % 2;
        double res[NRESULTS];
        if (work(L, who, seed, res) != 0) {
            j->failures++;
            continue;
        }
        j->runs++;
        if (memcmp(res, reference[seed - 1], sizeof res) != 0) {
            fprintf(stderr, "embed_host: %s, seed %d: results differ from the same "
                    "seed's run alone (first: %.17g against %.17g)\n",
                    who, seed, res[0], reference[seed - 1][0]);
            j->failures++;
        }
        /* This thread's mistake: an error up to the host, with its own message. */
        if (run(L, MISTAKES[j->id].code, -1, 0, err, sizeof err) == 0) {
            fprintf(stderr, "embed_host: %s: a bad argument raised no error\n", who);
            j->failures++;
        } else {
            j->errors_seen++;
            for (int w = 0; w < 3; w++)
                if (!strstr(err, MISTAKES[j->id].words[w])) {
                    fprintf(stderr, "embed_host: %s: error message \"%s\" lacks \"%s\"\n",
                            who, err, MISTAKES[j->id].words[w]);
                    j->failures++;
                }
        }
        if (it % 4 == 3)
            lua_gc(L, LUA_GCCOLLECT, 0);
    }
    lua_close(L);
    return NULL;
}

int main(int argc, char **argv)
{
#ifdef FT_EMBED_DYNAMIC
    if (argc != 3) {
        fprintf(stderr, "usage: %s LUA_DIR CPATH_DIR\n", argv[0]);
        return 2;
    }
    cpath_dir = argv[2];
#else
    if (argc != 2) {
        fprintf(stderr, "usage: %s LUA_DIR\n", argv[0]);
        return 2;
    }
#endif
    lua_dir = argv[1];
    int failures = 0, gpu = 0;
    char err[512];

    /* The reference results: each seed in a state of its own, alone. */
    for (int s = 0; s < 2; s++) {
        lua_State *L = new_state();
        if (!L || work(L, "main thread", s + 1, reference[s]) != 0)
            return 1;
        lua_close(L);
    }

    /* Two states on two threads at once. */
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, 2);
    job jobs[2] = {{0, &start, 0, 0, 0}, {1, &start, 0, 0, 0}};
    pthread_t threads[2];
    for (int t = 0; t < 2; t++)
        if (pthread_create(&threads[t], NULL, thread_main, &jobs[t]) != 0) {
            fprintf(stderr, "embed_host: pthread_create failed\n");
            return 1;
        }
    for (int t = 0; t < 2; t++) {
        pthread_join(threads[t], NULL);
        failures += jobs[t].failures;
    }
    pthread_barrier_destroy(&start);

    /* Every state is closed: no tensor is alive in the process. */
    lua_State *L = new_state();
    if (!L)
        return 1;
    static const char ALIVE[] =
        "local ft = require 'flashtile'\n"
        "local cuda = ft.cuda.is_available()\n"
        "return ft.memory_stats().in_use, cuda and ft.memory_stats('cuda').in_use or 0, cuda\n";
    if (run(L, ALIVE, -1, 3, err, sizeof err) != 0) {
        fprintf(stderr, "embed_host: memory_stats: %s\n", err);
        failures++;
    } else {
        if (lua_tonumber(L, -3) != 0 || lua_tonumber(L, -2) != 0) {
            fprintf(stderr, "embed_host: tensors alive after every state closed: "
                    "%.0f bytes on the CPU, %.0f on CUDA\n", lua_tonumber(L, -3), lua_tonumber(L, -2));
            failures++;
        }
        gpu = lua_toboolean(L, -1);
        lua_pop(L, 3);
    }
    lua_close(L);

    if (failures) {
        fprintf(stderr, "embed_host: %d failure(s)\n", failures);
        return 1;
    }
    printf("embed_host: OK (%s; %s; 2 threads x %d runs and %d caught errors; %s)\n",
           LUA_VERSION,
#ifdef FT_EMBED_DYNAMIC
           "flashtile/core.so loaded by require",
#else
           "binding linked in",
#endif
           ITERATIONS, jobs[0].errors_seen,
           gpu ? "CUDA checked too" : "no GPU: CPU only");
    return 0;
}
