/*
 * lflashtile.c - the Lua binding of flashtile: tensor userdata and thin
 * wrappers around lib/flashtile.h. It converts Lua values into C arguments
 * (1-based dims and indices into 0-based ones) and failed ft_status codes
 * into Lua errors, nothing more.
 *
 * Rules that keep a REPL session alive:
 *   - a tensor userdata is created empty (t == NULL) with its metatable set
 *     before any C resource is acquired, so an error at any later point
 *     leaves only a userdata for the collector, never a leak;
 *   - errors are raised only here, with "%s" formats, after every C call
 *     has returned;
 *   - module state (the random generator) lives in an upvalue shared by the
 *     module's functions, so each lua_State has its own and luaopen may run
 *     any number of times.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include "flashtile.h"

#include <lauxlib.h>
#include <lua.h>

#include <math.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define TENSOR_MT "flashtile.Tensor"
#define DEFAULT_DTYPE FT_F32
#define DEFAULT_SEED 0x5eedULL

/* ---- the calls that differ between Lua 5.1/LuaJIT, 5.2, 5.3 and 5.4 ----
 *
 * The binding is written against 5.4's API; below 5.4 the missing calls
 * are defined here in terms of the older ones. LuaJIT 2.1 has a few of
 * 5.2's (luaL_testudata and luaL_setmetatable among them), recognised by
 * luaL_newlib being defined. Integers: below 5.3 a Lua
 * number is a double, and an "integer" is a double with an integral value
 * (exactly what lua_tointegerx accepts in 5.3 and 5.4). */

#if LUA_VERSION_NUM < 504
#define lua_newuserdatauv(L, size, nuv) lua_newuserdata((L), (size))
#endif

#if LUA_VERSION_NUM < 503
static int compat_isinteger(lua_State *L, int idx)
{
    if (lua_type(L, idx) != LUA_TNUMBER)
        return 0;
    lua_Number v = lua_tonumber(L, idx);
    return v == floor(v) && v >= -0x1p63 && v < 0x1p63;
}

/* ok may be NULL: 5.2's lua_tointeger(L, i) is lua_tointegerx(L, i, NULL). */
static lua_Integer compat_tointegerx(lua_State *L, int idx, int *ok)
{
    int is = compat_isinteger(L, idx);
    if (ok)
        *ok = is;
    return is ? (lua_Integer)lua_tonumber(L, idx) : 0;
}
#define lua_isinteger(L, idx) compat_isinteger((L), (idx))
#define lua_tointegerx(L, idx, ok) compat_tointegerx((L), (idx), (ok))

static int compat_getfield(lua_State *L, int idx, const char *key)
{
    lua_getfield(L, idx, key);
    return lua_type(L, -1);
}
#define lua_getfield(L, idx, key) compat_getfield((L), (idx), (key))

#if LUA_VERSION_NUM < 502
#define lua_rawlen(L, idx) lua_objlen((L), (idx))
#endif

#if LUA_VERSION_NUM < 502
#define lua_absindex(L, idx) \
    ((idx) > 0 || (idx) <= LUA_REGISTRYINDEX ? (idx) : lua_gettop(L) + (idx) + 1)
#endif

static void lua_seti(lua_State *L, int idx, lua_Integer i)
{
    idx = lua_absindex(L, idx);
    lua_pushinteger(L, i);
    lua_insert(L, -2);
    lua_settable(L, idx);
}
#endif

#if LUA_VERSION_NUM < 502
#ifndef luaL_newlib /* plain 5.1; LuaJIT 2.1 has these */
static void *luaL_testudata(lua_State *L, int idx, const char *tname)
{
    void *p = lua_touserdata(L, idx);
    if (!p || !lua_getmetatable(L, idx))
        return NULL;
    luaL_getmetatable(L, tname);
    int same = lua_rawequal(L, -1, -2);
    lua_pop(L, 2);
    return same ? p : NULL;
}

static void luaL_setmetatable(lua_State *L, const char *tname)
{
    luaL_getmetatable(L, tname);
    lua_setmetatable(L, -2);
}
#endif
#endif

/* luaL_newmetatable sets __name from 5.3 on; the messages above and
 * tostring of a foreign object use it, so it is set in every version. */
static int new_class_metatable(lua_State *L, const char *tname)
{
    int created = luaL_newmetatable(L, tname);
    lua_pushstring(L, tname);
    lua_setfield(L, -2, "__name");
    return created;
}

/* lua_pushfstring's %s (a lua_Integer) exists from 5.3 on: sizes are
 * formatted here instead, into a string left on the stack. */
static const char *istr(lua_State *L, int64_t v)
{
    char buf[24];
    snprintf(buf, sizeof buf, "%lld", (long long)v);
    return lua_pushstring(L, buf), lua_tostring(L, -1);
}
/* ---- the state of the binding in one lua_State ----
 *
 * One userdata in the registry (every coroutine of the state shares it):
 * the random generator, the collector's count of tensor bytes, and the
 * frees deferred while a binding call runs.
 *
 * Deferred frees. A binding function holds raw pointers to its tensors
 * while it runs, and Lua code can run in the middle: a finalizer started
 * by an allocation, a full collection (out of memory, or the tensor-byte
 * count below), on any coroutine. If that code called t:free() the
 * function would go on with a freed tensor. So every binding function is
 * called through a trampoline that counts the calls in progress, and an
 * explicit free (t:free(), __close) while one is in progress takes the
 * tensor away from t at once (later uses of t are errors) but keeps the
 * memory until the last call in progress returns, or raises. A collected
 * tensor (__gc) is unreachable, so no call can be using it: it goes at
 * once. */
typedef struct generator {
    uint64_t seed;
    uint64_t offset; /* Philox counters used so far */
} generator;

typedef struct deferred {
    void (*release)(void *);
    void *p;
} deferred;

typedef struct binding_state {
    generator gen;
    /* memory the collector can see (gc_pressure_step) */
    int64_t last_seen; /* ft_thread_allocated_bytes() at the last look */
    int64_t debt;      /* tensor bytes allocated since the last collection */
    int64_t threshold; /* debt that triggers the next collection */
    /* deferred frees */
    int active; /* binding calls in progress */
    deferred *pending;
    size_t npending, cap;
} binding_state;

static const char state_key = 0; /* its address keys the registry */

static binding_state *get_state(lua_State *L)
{
    lua_pushlightuserdata(L, (void *)&state_key);
    lua_rawget(L, LUA_REGISTRYINDEX);
    binding_state *s = (binding_state *)lua_touserdata(L, -1);
    lua_pop(L, 1);
    return s;
}

static generator *get_generator(lua_State *L) { return &get_state(L)->gen; }

static void flush_deferred(binding_state *s)
{
    while (s->npending > 0) {
        deferred d = s->pending[--s->npending];
        d.release(d.p);
    }
}

static void tensor_release(void *p) { ft_tensor_free(p); }

/* Frees p now, or when the binding calls in progress are over. */
static void release_later(lua_State *L, void (*release)(void *), void *p)
{
    binding_state *s = get_state(L);
    if (!p)
        return;
    if (!s || s->active == 0) {
        release(p);
        return;
    }
    if (s->npending == s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 16;
        deferred *grown = realloc(s->pending, cap * sizeof *grown);
        if (!grown)
            return; /* kept until the process ends: a leak, never a crash */
        s->pending = grown;
        s->cap = cap;
    }
    s->pending[s->npending++] = (deferred){release, p};
}

/* lua_close: what is still deferred goes. */
static int state_gc(lua_State *L)
{
    binding_state *s = lua_touserdata(L, 1);
    flush_deferred(s);
    free(s->pending);
    s->pending = NULL;
    s->cap = 0;
    return 0;
}

#define DEFAULT_GC_MIN ((int64_t)16 << 20)

static void state_init(lua_State *L)
{
    lua_pushlightuserdata(L, (void *)&state_key);
    binding_state *s = lua_newuserdatauv(L, sizeof *s, 0);
    memset(s, 0, sizeof *s);
    s->gen.seed = DEFAULT_SEED;
    s->last_seen = ft_thread_allocated_bytes();
    s->threshold = DEFAULT_GC_MIN;
    lua_createtable(L, 0, 1);
    lua_pushcfunction(L, state_gc);
    lua_setfield(L, -2, "__gc");
    lua_setmetatable(L, -2);
    lua_rawset(L, LUA_REGISTRYINDEX);
}

/* Calls the binding function in upvalue 1 with this call's arguments,
 * counting it as in progress (see above). Errors pass through unchanged. */
static int trampoline(lua_State *L)
{
    binding_state *s = get_state(L);
    int n = lua_gettop(L);
    lua_pushvalue(L, lua_upvalueindex(1));
    lua_insert(L, 1);
    s->active++;
    int status = lua_pcall(L, n, LUA_MULTRET, 0);
    if (--s->active == 0)
        flush_deferred(s);
    if (status != 0)
        return lua_error(L);
    return lua_gettop(L);
}

/* ---- errors ---- */

/* Every function of the binding knows its own name: luaopen records each
 * one in a registry table {[function] = "name"}. Lua's own messages name a
 * function only when the call site does (a pcall(ft.zeros, ...) or a tail
 * call has no name; 5.2 to 5.4 then search package.loaded, 5.1 and LuaJIT
 * print '?'), so the binding raises argument errors itself, the same way
 * in every version. */
static const char names_key = 0; /* its address keys the registry */

/* The name of the running C function; *method is set when it was called
 * as obj:name(...), where Lua's argument 1 is the object. */
static const char *current_name_ex(lua_State *L, int *method)
{
    lua_Debug ar;
    *method = 0;
    if (!lua_getstack(L, 0, &ar))
        return "?";
    lua_getinfo(L, "nf", &ar); /* pushes the function */
    /* Called through the trampoline: the call site's name is its frame's. */
    lua_Debug caller;
    if (lua_getstack(L, 1, &caller)) {
        lua_getinfo(L, "nf", &caller);
        if (lua_tocfunction(L, -1) == trampoline)
            ar = caller;
        lua_pop(L, 1);
    }
    int metamethod = ar.namewhat && strcmp(ar.namewhat, "metamethod") == 0;
    if (ar.namewhat && strcmp(ar.namewhat, "method") == 0)
        *method = 1;
    lua_pushlightuserdata(L, (void *)&names_key);
    lua_rawget(L, LUA_REGISTRYINDEX);
    const char *name = NULL;
    if (lua_istable(L, -1)) {
        lua_pushvalue(L, -2);
        lua_rawget(L, -2);
        name = lua_tostring(L, -1); /* stays on the stack (an error follows) */
        /* A tensor method counts its arguments after self however it was
         * called (LuaJIT does not always see t:m() as a method call). */
        if (name && name[0] == ':') {
            name++;
            if (!metamethod && luaL_testudata(L, 1, TENSOR_MT))
                *method = 1;
        }
    }
    if (!name)
        name = ar.name ? ar.name : "?";
    return name;
}

static const char *current_name(lua_State *L)
{
    int method;
    return current_name_ex(L, &method);
}

/* luaL_argerror's message, with the name from the registry. */
static int arg_error(lua_State *L, int arg, const char *msg)
{
    int method;
    const char *name = current_name_ex(L, &method);
    if (method) {
        arg--;
        if (arg == 0)
            return luaL_error(L, "calling '%s' on bad self (%s)", name, msg);
    }
    return luaL_error(L, "bad argument #%d to '%s' (%s)", arg, name, msg);
}

/* luaL_typeerror's message: "<tname> expected, got <type or __name>". */
static int type_error(lua_State *L, int arg, const char *tname)
{
    const char *got;
    if (luaL_getmetafield(L, arg, "__name") && lua_type(L, -1) == LUA_TSTRING)
        got = lua_tostring(L, -1);
    else if (lua_type(L, arg) == LUA_TLIGHTUSERDATA)
        got = "light userdata";
    else
        got = luaL_typename(L, arg);
    return arg_error(L, arg, lua_pushfstring(L, "%s expected, got %s", tname, got));
}

static void *check_udata(lua_State *L, int arg, const char *tname)
{
    void *p = luaL_testudata(L, arg, tname);
    if (!p)
        type_error(L, arg, tname);
    return p;
}

static const char *check_string(lua_State *L, int arg)
{
    if (!lua_isstring(L, arg))
        type_error(L, arg, "string");
    return lua_tostring(L, arg);
}

static void check_type(lua_State *L, int arg, int type)
{
    if (lua_type(L, arg) != type)
        type_error(L, arg, lua_typename(L, type));
}

static lua_Number opt_number(lua_State *L, int arg, lua_Number def)
{
    if (lua_isnoneornil(L, arg))
        return def;
    if (lua_type(L, arg) != LUA_TNUMBER)
        type_error(L, arg, "number");
    return lua_tonumber(L, arg);
}

static lua_Integer check_integer(lua_State *L, int arg)
{
    int ok = 0;
    lua_Integer v = lua_type(L, arg) == LUA_TNUMBER ? lua_tointegerx(L, arg, &ok) : 0;
    if (!ok) {
        if (lua_type(L, arg) == LUA_TNUMBER)
            arg_error(L, arg, "number has no integer representation");
        type_error(L, arg, "number");
    }
    return v;
}

static lua_Integer opt_integer(lua_State *L, int arg, lua_Integer def)
{
    return lua_isnoneornil(L, arg) ? def : check_integer(L, arg);
}

#define luaL_argerror(L, arg, msg) arg_error((L), (arg), (msg))
#define luaL_typeerror(L, arg, tname) type_error((L), (arg), (tname))
#define luaL_checkudata(L, arg, tname) check_udata((L), (arg), (tname))
#undef luaL_checkstring
#define luaL_checkstring(L, arg) check_string((L), (arg))
#define luaL_checktype(L, arg, type) check_type((L), (arg), (type))
#define luaL_checkinteger(L, arg) check_integer((L), (arg))
#define luaL_optinteger(L, arg, def) opt_integer((L), (arg), (def))
#define luaL_optnumber(L, arg, def) opt_number((L), (arg), (def))

/* luaL_setfuncs for the binding: each function goes into the table at -1
 * wrapped in the trampoline, and its name (prefix .. key, "__add" named
 * "add") is recorded for the messages. */
static void set_funcs(lua_State *L, const luaL_Reg *l, const char *prefix)
{
    int tbl = lua_gettop(L);
    lua_pushlightuserdata(L, (void *)&names_key);
    lua_rawget(L, LUA_REGISTRYINDEX);
    int names = lua_gettop(L);
    for (; l->name; l++) {
        const char *key = strncmp(l->name, "__", 2) == 0 ? l->name + 2 : l->name;
        lua_pushcfunction(L, l->func);
        lua_pushvalue(L, -1);
        lua_pushfstring(L, "%s%s", prefix, key);
        lua_rawset(L, names);
        lua_pushcclosure(L, trampoline, 1);
        lua_setfield(L, tbl, l->name);
    }
    lua_pop(L, 1);
}

/* Raises the last flashtile error. arg_offset maps the C function's input
 * position to the Lua argument position (lua = c + arg_offset); positions
 * that fall outside the Lua call give a message without one. */
static int raise_ft(lua_State *L, int arg_offset)
{
    int arg = ft_last_error_arg();
    if (arg > 0 && arg + arg_offset >= 1 && arg + arg_offset <= lua_gettop(L))
        return luaL_argerror(L, arg + arg_offset, ft_last_error_detail());
    return luaL_error(L, "%s: %s", current_name(L), ft_last_error_detail());
}

/* The one way a C status becomes a Lua error. Calls expr; on out of memory
 * runs a full collection (finalizers may run: see release_later) and calls
 * it once more (expr must have no effect when it fails, which every ft_
 * function promises); any other failure raises the library's message,
 * blaming Lua argument c + arg_offset for the C function's input c
 * (raise_ft). */
/* arg_offset for calls whose C inputs are not Lua arguments: the message
 * then names the function only. */
#define NO_ARG (-1000)

#define CALL(L, arg_offset, expr)                                             \
    do {                                                                     \
        ft_status call_st_ = (expr);                                         \
        if (call_st_ == FT_ERR_NOMEM) {                                      \
            lua_gc((L), LUA_GCCOLLECT, 0);                                   \
            call_st_ = (expr);                                               \
        }                                                                    \
        if (call_st_ != FT_OK)                                               \
            raise_ft((L), (arg_offset));                                     \
    } while (0)

/* ---- memory the collector can see ----
 *
 * Lua's collector knows a tensor userdata as a few bytes; the storage
 * behind it is invisible to it, so a loop making 4 MB tensors would let
 * gigabytes of garbage pile up before a cycle ran. The binding keeps a
 * debt per lua_State: the tensor bytes this thread allocated since the
 * last look (ft_thread_allocated_bytes). Before each new tensor, once the
 * debt passes the larger of DEFAULT_GC_MIN and the bytes alive after the
 * last collection, it runs a full collection. Garbage is then at most
 * about as large as the live tensors (plus DEFAULT_GC_MIN), and the work of
 * the collections is proportional to the bytes allocated. Out of memory,
 * on either device, still runs a full collection and one retry (CALL). */
static void gc_pressure_step(lua_State *L)
{
    binding_state *p = get_state(L);
    if (!p)
        return;
    int64_t now = ft_thread_allocated_bytes();
    /* Another state on this thread may have allocated too; counting its
     * bytes here only makes this state collect sooner. */
    p->debt += now - p->last_seen;
    p->last_seen = now;
    if (p->debt < p->threshold)
        return;
    lua_gc(L, LUA_GCCOLLECT, 0);
    int64_t live = ft_storage_in_use();
    p->debt = 0;
    p->last_seen = ft_thread_allocated_bytes();
    p->threshold = live > DEFAULT_GC_MIN ? live : DEFAULT_GC_MIN;
}

/* ---- tensor userdata ---- */

typedef struct ud_tensor {
    ft_tensor *t;
} ud_tensor;

/* Pushes an empty tensor userdata and returns the slot to fill. */
static ft_tensor **push_slot(lua_State *L)
{
    gc_pressure_step(L);
    ud_tensor *u = lua_newuserdatauv(L, sizeof *u, 0);
    u->t = NULL;
    luaL_setmetatable(L, TENSOR_MT);
    return &u->t;
}

static ft_tensor *check_tensor(lua_State *L, int idx)
{
    ud_tensor *u = luaL_checkudata(L, idx, TENSOR_MT);
    if (!u->t)
        luaL_argerror(L, idx, "tensor has been freed");
    return u->t;
}

static ft_tensor *test_tensor(lua_State *L, int idx)
{
    ud_tensor *u = luaL_testudata(L, idx, TENSOR_MT);
    return u ? u->t : NULL;
}

/* ---- argument helpers ---- */

static int64_t check_size(lua_State *L, int idx, const char *what)
{
    int ok = 0;
    lua_Integer v = lua_type(L, idx) == LUA_TNUMBER ? lua_tointegerx(L, idx, &ok) : 0;
    if (!ok) {
        if (lua_type(L, idx) == LUA_TNUMBER)
            luaL_argerror(L, idx, lua_pushfstring(L, "%s must be an integer, got %s",
                                                  what, lua_tostring(L, idx)));
        luaL_typeerror(L, idx, "integer");
    }
    return (int64_t)v;
}

/* A shape given either as a table {2, 3} at idx, or as integers from idx
 * on (stopping at the first non-number). Returns ndim; *next is the index
 * of the first argument after the shape. */
static int check_shape_ex(lua_State *L, int idx, int64_t *shape, int *next, int allow_infer)
{
    int ndim = 0;
    if (lua_istable(L, idx) && !test_tensor(L, idx)) {
        lua_Integer n = (lua_Integer)lua_rawlen(L, idx);
        if (n > FT_MAX_DIMS)
            luaL_argerror(L, idx, lua_pushfstring(L, "shape has %d dims, at most %d are supported",
                                                  (int)n, FT_MAX_DIMS));
        for (lua_Integer i = 1; i <= n; i++) {
            lua_rawgeti(L, idx, i);
            int ok = 0;
            lua_Integer v = lua_type(L, -1) == LUA_TNUMBER ? lua_tointegerx(L, -1, &ok) : 0;
            if (!ok)
                luaL_argerror(L, idx, lua_pushfstring(L, "size %d of the shape is not an integer (got %s)",
                                                      (int)i, lua_type(L, -1) == LUA_TNUMBER
                                                                  ? lua_tostring(L, -1)
                                                                  : luaL_typename(L, -1)));
            lua_pop(L, 1);
            if (v < 0 && !(allow_infer && v == -1))
                luaL_argerror(L, idx, lua_pushfstring(L, "size %s of dim %d is negative",
                                                      istr(L, v), (int)i));
            shape[ndim++] = (int64_t)v;
        }
        *next = idx + 1;
        return ndim;
    }
    int i = idx;
    while (lua_type(L, i) == LUA_TNUMBER) {
        if (ndim == FT_MAX_DIMS)
            luaL_argerror(L, i, lua_pushfstring(L, "at most %d dims are supported", FT_MAX_DIMS));
        shape[ndim] = check_size(L, i, "size");
        if (shape[ndim] < 0 && !(allow_infer && shape[ndim] == -1))
            luaL_argerror(L, i, lua_pushfstring(L, "size %s of dim %d is negative",
                                                istr(L, shape[ndim]), ndim + 1));
        ndim++;
        i++;
    }
    if (i == idx && !lua_isnoneornil(L, idx) && !lua_istable(L, idx))
        luaL_typeerror(L, idx, "shape (a table of sizes)");
    *next = i;
    return ndim;
}

static int check_shape(lua_State *L, int idx, int64_t *shape, int *next)
{
    return check_shape_ex(L, idx, shape, next, 0);
}

/* A 1-based (or negative, from the end) dim at idx, as a 0-based one. */
/* d (1-based or negative) as a 0-based dim; errors blame argument idx. */
static int check_dim_value(lua_State *L, int idx, lua_Integer d, int ndim)
{
    if (d >= 1 && d <= ndim)
        return (int)(d - 1);
    if (d < 0 && d >= -ndim)
        return (int)(ndim + d);
    if (ndim == 0)
        return luaL_argerror(L, idx, lua_pushfstring(L, "dim %s out of range: the tensor is 0-d",
                                                     istr(L, d)));
    return luaL_argerror(L, idx, lua_pushfstring(L, "dim %s out of range for a %d-d tensor (1..%d or -%d..-1)",
                                                 istr(L, d), ndim, ndim, ndim));
}

static int check_dim(lua_State *L, int idx, int ndim)
{
    return check_dim_value(L, idx, check_size(L, idx, "dim"), ndim);
}

static int opt_dim(lua_State *L, int idx, int ndim, int def)
{
    return lua_isnoneornil(L, idx) ? def : check_dim(L, idx, ndim);
}

/* A 1-based index into a dim of the given size, as a 0-based one. */
static int64_t check_index(lua_State *L, int idx, int64_t size, int dim)
{
    int64_t i = check_size(L, idx, "index");
    if (i < 1 || i > size)
        luaL_argerror(L, idx, lua_pushfstring(L, "index %s out of range for dim %d of size %s",
                                              istr(L, i), dim + 1, istr(L, size)));
    return i - 1;
}

static ft_device check_device(lua_State *L, int idx)
{
    ft_device d;
    if (ft_device_parse(luaL_checkstring(L, idx), &d) != FT_OK)
        luaL_argerror(L, idx, ft_last_error_detail());
    return d;
}

/* ---- options: the one reader of option tables ----
 *
 * An option table is read raw (no metamethod runs) against a list of the
 * names a function takes; a misspelt or unknown name is an error listing
 * them, so that {dtpye = "f64"} does not pass silently. Values are checked
 * by kind and copied out (strings parsed at once); a tensor option is
 * pushed on the stack, so it stays alive for the call whatever Lua code
 * does to the table meanwhile. */
typedef enum { OPT_BOOL, OPT_INT, OPT_NUMBER, OPT_DTYPE, OPT_DEVICE, OPT_IMPL,
               OPT_TENSOR, OPT_MODS, OPT_BLOCK_MASK } opt_kind;

#define BLOCK_MASK_MT "flashtile.BlockMaskData"

typedef struct ud_block_mask {
    ft_attn_block_mask *bm;
} ud_block_mask;

#define MODS_MT "flashtile.AttentionModsGraph"

typedef struct ud_mods {
    ft_attn_mods *m;
} ud_mods;

typedef struct opt_spec {
    const char *name;
    opt_kind kind;
} opt_spec;

typedef struct opt_value {
    int present;
    int boolean;
    int64_t integer;
    double number;
    ft_dtype dtype;
    ft_device device;
    ft_attn_impl impl;
    ft_tensor *tensor;
    const ft_attn_mods *mods; /* OPT_MODS: the graph, and its tensors */
    int mod_ntensors;
    const ft_tensor **mod_tensors;
    const ft_attn_block_mask *block_mask; /* OPT_BLOCK_MASK */
} opt_value;

static const char *const opt_kind_names[] = {"a boolean", "an integer", "a number",
                                             "a dtype name", "a device name",
                                             "an implementation name", "a tensor",
                                             "ft.attention_mods{...}", "ft.block_mask(...)"};

/* The n tensors of the list (a table) at index list, each pushed on the
 * stack so that it stays for the call, as an array of pointers (itself a
 * userdata on the stack); an entry that is not a live tensor is an error
 * at argument arg, its message prefixed by what. */
static const ft_tensor **pin_tensor_list(lua_State *L, int list, int n, int arg,
                                         const char *what)
{
    list = lua_absindex(L, list);
    const ft_tensor **ts = lua_newuserdata(L, sizeof *ts * (size_t)(n > 0 ? n : 1));
    luaL_checkstack(L, n + 4, "too many tensors");
    for (int k = 0; k < n; k++) {
        lua_rawgeti(L, list, k + 1);
        ud_tensor *u = luaL_testudata(L, -1, TENSOR_MT);
        if (!u || !u->t)
            luaL_argerror(L, arg, lua_pushfstring(L, "%s: tensor %d %s", what, k + 1,
                                                  u ? "has been freed" : "is not a tensor"));
        ts[k] = u->t;
    }
    return ts;
}

/* The mods option (a table made by ft.attention_mods: raw fields graph, the
 * compiled graph, and tensors, the tensors it reads): the table, the
 * graph and every tensor are pushed on the stack, so they stay for the
 * call whatever Lua code does meanwhile; the pointers to the tensors live
 * in a userdata pushed there too. */
static void read_mods_option(lua_State *L, int idx, const char *name, opt_value *v)
{
    lua_pushstring(L, name);
    lua_rawget(L, idx);
    const int t = lua_gettop(L);
    lua_pushliteral(L, "graph");
    lua_rawget(L, t);
    ud_mods *g = luaL_testudata(L, -1, MODS_MT);
    if (!g || !g->m)
        luaL_argerror(L, idx, lua_pushfstring(L, "option '%s' must be made by ft.attention_mods",
                                              name));
    lua_pushliteral(L, "tensors");
    lua_rawget(L, t);
    const int tt = lua_gettop(L);
    const int want = ft_attn_mods_tensors(g->m);
    if (lua_type(L, tt) != LUA_TTABLE || (int)lua_rawlen(L, tt) != want)
        luaL_argerror(L, idx, lua_pushfstring(L, "option '%s': its tensors must be a list of %d",
                                              name, want));
    const ft_tensor **ptrs =
        pin_tensor_list(L, tt, want, idx, lua_pushfstring(L, "option '%s'", name));
    v->mods = g->m;
    v->mod_ntensors = want;
    v->mod_tensors = ptrs;
}

/* Reads the options at idx (none or nil: all absent) into out[i] for
 * spec[i] (n entries). Tensor options are left on the stack. */
static void read_options(lua_State *L, int idx, const opt_spec *spec, int n, opt_value *out)
{
    memset(out, 0, sizeof *out * (size_t)n);
    if (lua_isnoneornil(L, idx))
        return;
    luaL_checktype(L, idx, LUA_TTABLE);
    idx = lua_absindex(L, idx);
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        const char *key = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : NULL;
        int i = 0;
        while (i < n && !(key && strcmp(key, spec[i].name) == 0))
            i++;
        if (i == n) {
            luaL_Buffer b;
            luaL_buffinit(L, &b);
            for (int j = 0; j < n; j++) {
                luaL_addstring(&b, spec[j].name);
                luaL_addstring(&b, j + 2 < n ? ", " : j + 1 < n ? " or " : "");
            }
            luaL_pushresult(&b);
            luaL_argerror(L, idx, lua_pushfstring(L, "unknown option '%s' (expected %s)",
                                                  key ? key : luaL_typename(L, -3),
                                                  lua_tostring(L, -1)));
        }
        opt_value *v = &out[i];
        int type = lua_type(L, -1), ok = 0;
        v->present = 1;
        switch (spec[i].kind) {
        case OPT_BOOL:
            ok = type == LUA_TBOOLEAN;
            v->boolean = lua_toboolean(L, -1);
            break;
        case OPT_INT:
            v->integer = (int64_t)lua_tointegerx(L, -1, &ok);
            ok = ok && type == LUA_TNUMBER;
            break;
        case OPT_NUMBER:
            ok = type == LUA_TNUMBER;
            v->number = lua_tonumber(L, -1);
            break;
        case OPT_DTYPE:
        case OPT_DEVICE:
        case OPT_IMPL:
            ok = type == LUA_TSTRING;
            if (ok) {
                const char *s = lua_tostring(L, -1);
                ft_status st = spec[i].kind == OPT_DTYPE    ? ft_dtype_parse(s, &v->dtype)
                               : spec[i].kind == OPT_DEVICE ? ft_device_parse(s, &v->device)
                                                            : ft_attn_impl_parse(s, &v->impl);
                if (st != FT_OK)
                    luaL_argerror(L, idx, lua_pushfstring(L, "option '%s': %s", spec[i].name,
                                                          ft_last_error_detail()));
            }
            break;
        case OPT_TENSOR:
            ok = luaL_testudata(L, -1, TENSOR_MT) != NULL;
            break;
        case OPT_MODS:
        case OPT_BLOCK_MASK:
            ok = type == LUA_TTABLE;
            break;
        }
        if (!ok) {
            const char *tname = luaL_typename(L, -1), *shown = "";
            if (type == LUA_TNUMBER) { /* a copy: lua_tostring converts in place */
                lua_pushvalue(L, -1);
                shown = lua_tostring(L, -1);
            }
            luaL_argerror(L, idx, lua_pushfstring(L, "option '%s' must be %s, got %s%s%s",
                                                  spec[i].name, opt_kind_names[spec[i].kind],
                                                  tname, *shown ? " " : "", shown));
        }
        lua_pop(L, 1);
    }
    for (int i = 0; i < n; i++)
        if (out[i].present && spec[i].kind == OPT_TENSOR) {
            lua_pushstring(L, spec[i].name);
            lua_rawget(L, idx); /* stays on the stack for the call */
            ud_tensor *u = luaL_testudata(L, -1, TENSOR_MT);
            if (!u || !u->t)
                luaL_argerror(L, idx, lua_pushfstring(L, "option '%s': %s", spec[i].name,
                                                      u ? "tensor has been freed"
                                                        : "must be a tensor"));
            out[i].tensor = u->t;
        }
    for (int i = 0; i < n; i++)
        if (out[i].present && spec[i].kind == OPT_MODS)
            read_mods_option(L, idx, spec[i].name, &out[i]);
    for (int i = 0; i < n; i++)
        if (out[i].present && spec[i].kind == OPT_BLOCK_MASK) {
            /* ft.block_mask's table: raw field data, pinned with the table;
             * made for the mods option of the same table */
            lua_pushstring(L, spec[i].name);
            lua_rawget(L, idx);
            lua_pushliteral(L, "data");
            lua_rawget(L, -2);
            ud_block_mask *u = luaL_testudata(L, -1, BLOCK_MASK_MT);
            if (!u || !u->bm)
                luaL_argerror(L, idx, lua_pushfstring(L, "option '%s' must be made by "
                                                         "ft.block_mask", spec[i].name));
            lua_pushliteral(L, "mods");
            lua_rawget(L, -3);
            lua_pushliteral(L, "mods");
            lua_rawget(L, idx);
            if (!lua_rawequal(L, -1, -2))
                luaL_argerror(L, idx, lua_pushfstring(L, "option '%s' was made for other mods "
                                                         "than option 'mods'", spec[i].name));
            lua_pop(L, 2);
            out[i].block_mask = u->bm;
        }
}

typedef struct options {
    ft_dtype dtype;
    ft_device device;
    int has_seed;
    uint64_t seed;
} options;

/* {dtype=, device=, seed=} at idx (absent or nil: defaults). */
static options check_options(lua_State *L, int idx, ft_dtype default_dtype)
{
    static const opt_spec spec[] = {{"dtype", OPT_DTYPE}, {"device", OPT_DEVICE},
                                    {"seed", OPT_INT}};
    opt_value v[3];
    read_options(L, idx, spec, 3, v);
    options o = {default_dtype, {FT_CPU, 0}, 0, 0};
    if (v[0].present)
        o.dtype = v[0].dtype;
    if (v[1].present)
        o.device = v[1].device;
    o.has_seed = v[2].present;
    o.seed = (uint64_t)v[2].integer;
    return o;
}


/* 1 for i32 and i64: neither the floats arithmetic takes nor a storage
 * dtype (fp8_e4m3), whose values are floats too. */
static int is_int_dtype(ft_dtype d)
{
    return !ft_dtype_is_float(d) && !ft_dtype_is_storage_only(d);
}

/* An integer for integer dtypes when v is one that fits, else a float
 * (a sum of i64 values can leave the int64 range). */
static void push_number(lua_State *L, const ft_tensor *t, double v)
{
    if (is_int_dtype(t->dtype) && v >= -0x1p63 && v < 0x1p63 && v == floor(v))
        lua_pushinteger(L, (lua_Integer)v);
    else
        lua_pushnumber(L, v);
}

/* Pushes element at the 0-based index (integers keep their 64 bits). A
 * failed read (a CUDA copy) is an error, not a 0. */
static void push_element(lua_State *L, const ft_tensor *t, const int64_t *index)
{
    if (!is_int_dtype(t->dtype)) {
        double v = 0;
        if (ft_get(t, index, &v) != FT_OK)
            luaL_error(L, "%s", ft_last_error());
        lua_pushnumber(L, v);
    } else {
        int64_t v = 0;
        if (ft_get_int(t, index, &v) != FT_OK)
            luaL_error(L, "%s", ft_last_error());
        lua_pushinteger(L, (lua_Integer)v);
    }
}

/* Stores the Lua number at idx into element index. */
static void store_element(lua_State *L, ft_tensor *t, const int64_t *index, int idx)
{
    if (lua_isinteger(L, idx) && is_int_dtype(t->dtype))
        ft_set_int(t, index, (int64_t)lua_tointeger(L, idx));
    else
        ft_set(t, index, lua_tonumber(L, idx));
}

static double check_value(lua_State *L, int idx)
{
    if (lua_type(L, idx) != LUA_TNUMBER)
        luaL_typeerror(L, idx, "number");
    return lua_tonumber(L, idx);
}

/* ---- creation ---- */

static ft_tensor *new_tensor(lua_State *L, int ndim, const int64_t *shape, options o,
                             int shape_arg)
{
    ft_tensor **slot = push_slot(L);
    CALL(L, shape_arg - 1, ft_empty(slot, ndim, shape, o.dtype, o.device));
    return *slot;
}

static int l_empty(lua_State *L)
{
    int64_t shape[FT_MAX_DIMS];
    int next;
    int ndim = check_shape(L, 1, shape, &next);
    options o = check_options(L, next, DEFAULT_DTYPE);
    new_tensor(L, ndim, shape, o, 1);
    return 1;
}

static int fill_new(lua_State *L, double value)
{
    int64_t shape[FT_MAX_DIMS];
    int next;
    int ndim = check_shape(L, 1, shape, &next);
    options o = check_options(L, next, DEFAULT_DTYPE);
    ft_tensor *t = new_tensor(L, ndim, shape, o, 1);
    CALL(L, 0, ft_fill(t, value));
    return 1;
}

static int l_zeros(lua_State *L) { return fill_new(L, 0.0); }
static int l_ones(lua_State *L) { return fill_new(L, 1.0); }

/* ft.full({2, 3}, value [, opts]) or ft.full(2, 3, value [, opts]). */
static int l_full(lua_State *L)
{
    int64_t shape[FT_MAX_DIMS];
    int next, ndim;
    if (lua_istable(L, 1)) {
        ndim = check_shape(L, 1, shape, &next);
    } else {
        int last = 1; /* the value is the last number of the leading run */
        while (lua_type(L, last + 1) == LUA_TNUMBER)
            last++;
        if (lua_type(L, last) != LUA_TNUMBER)
            luaL_typeerror(L, 1, "shape (a table of sizes)");
        ndim = last - 1;
        if (ndim > FT_MAX_DIMS)
            luaL_argerror(L, 1, lua_pushfstring(L, "at most %d dims are supported", FT_MAX_DIMS));
        for (int d = 0; d < ndim; d++) {
            shape[d] = check_size(L, d + 1, "size");
            if (shape[d] < 0)
                luaL_argerror(L, d + 1, lua_pushfstring(L, "size %s of dim %d is negative",
                                                        istr(L, shape[d]), d + 1));
        }
        next = last;
    }
    double value = check_value(L, next);
    options o = check_options(L, next + 1, DEFAULT_DTYPE);
    ft_tensor *t = new_tensor(L, ndim, shape, o, 1);
    CALL(L, 0, ft_fill(t, value));
    return 1;
}

static int random_new(lua_State *L, int normal)
{
    int64_t shape[FT_MAX_DIMS];
    int next;
    int ndim = check_shape(L, 1, shape, &next);
    options o = check_options(L, next, DEFAULT_DTYPE);
    if (ft_dtype_is_storage_only(o.dtype))
        luaL_argerror(L, next, lua_pushfstring(L, "%s holds data only: draw in f32 and convert "
                                                  "with :to('%s')",
                                               ft_dtype_name(o.dtype), ft_dtype_name(o.dtype)));
    if (!ft_dtype_is_float(o.dtype))
        luaL_argerror(L, next, lua_pushfstring(L, "needs a floating-point dtype, got %s",
                                               ft_dtype_name(o.dtype)));
    ft_tensor *t = new_tensor(L, ndim, shape, o, 1);
    generator *g = get_generator(L);
    uint64_t seed = o.has_seed ? o.seed : g->seed;
    uint64_t offset = o.has_seed ? 0 : g->offset;
    CALL(L, 0, normal ? ft_randn(t, seed, offset) : ft_rand(t, seed, offset));
    if (!o.has_seed)
        g->offset += ft_random_counters(ft_numel(t));
    return 1;
}

static int l_rand(lua_State *L) { return random_new(L, 0); }
static int l_randn(lua_State *L) { return random_new(L, 1); }

static int l_manual_seed(lua_State *L)
{
    generator *g = get_generator(L);
    g->seed = (uint64_t)luaL_checkinteger(L, 1);
    g->offset = 0;
    return 0;
}

/* ft.derive_seed(seed, k): a seed for part k of something seeded with
 * seed (a splitmix64 step, so that seeds 1 and 2 do not share streams
 * between their parts). With 64-bit Lua integers (5.3 on) the full 64-bit
 * value, wrapped to a signed integer; below 5.3 a Lua number holds 53 bits
 * exactly, and the top 53 bits are returned. */
static int l_derive_seed(lua_State *L)
{
    uint64_t seed = (uint64_t)check_size(L, 1, "seed");
    uint64_t k = (uint64_t)check_size(L, 2, "k");
    uint64_t z = seed * 0x9E3779B97F4A7C15ULL + k * 0x632BE59BD9B4E019ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
#if LUA_VERSION_NUM >= 503
    lua_pushinteger(L, (lua_Integer)z);
#else
    lua_pushnumber(L, (lua_Number)(z >> 11));
#endif
    return 1;
}

/* ft.arange(stop), ft.arange(start, stop[, step]) [, opts]: start,
 * start + step, ... up to but excluding stop. */
static int l_arange(lua_State *L)
{
    int nnum = 0;
    while (nnum < 3 && lua_type(L, nnum + 1) == LUA_TNUMBER)
        nnum++;
    if (nnum == 0)
        luaL_typeerror(L, 1, "number");
    double start = 0, stop, step = 1;
    if (nnum == 1) {
        stop = lua_tonumber(L, 1);
    } else {
        start = lua_tonumber(L, 1);
        stop = lua_tonumber(L, 2);
        if (nnum == 3)
            step = lua_tonumber(L, 3);
    }
    if (step == 0 || !isfinite(step) || !isfinite(start) || !isfinite(stop))
        luaL_argerror(L, nnum, "step must be finite and nonzero, bounds finite");
    options o = check_options(L, nnum + 1, DEFAULT_DTYPE);
    int exact = is_int_dtype(o.dtype);
    for (int i = 1; i <= nnum; i++) { /* integral numbers, floats included */
        int ok = 0;
        lua_tointegerx(L, i, &ok);
        exact = exact && ok;
    }
    if (exact) { /* integer dtypes from integer bounds: exact past 2^53 */
        int ok;
        int64_t a = nnum == 1 ? 0 : (int64_t)lua_tointegerx(L, 1, &ok);
        int64_t b = (int64_t)lua_tointegerx(L, nnum == 1 ? 1 : 2, &ok);
        int64_t s = nnum == 3 ? (int64_t)lua_tointegerx(L, 3, &ok) : 1;
        int64_t n = 0;
        CALL(L, 0, ft_arange_count(a, b, s, &n));
        ft_tensor *t = new_tensor(L, 1, &n, o, 0);
        CALL(L, NO_ARG, ft_arange_int(t, a, s));
        return 1;
    }
    double count = ceil((stop - start) / step);
    if (count < 0)
        count = 0;
    if (count > 1e15)
        luaL_argerror(L, 1, "too many elements");
    int64_t n = (int64_t)count;
    ft_tensor *t = new_tensor(L, 1, &n, o, 0);
    for (int64_t i = 0; i < n; i++) {
        double v = start + (double)i * step;
        ft_set(t, &i, v);
    }
    return 1;
}

/* ft.tensor(nested_table or number, opts). */
static void nested_shape(lua_State *L, int idx, int64_t *shape, int *ndim)
{
    *ndim = 0;
    lua_pushvalue(L, idx);
    while (lua_type(L, -1) == LUA_TTABLE) {
        if (*ndim == FT_MAX_DIMS)
            luaL_argerror(L, 1, lua_pushfstring(L, "nested deeper than %d levels", FT_MAX_DIMS));
        lua_Integer n = (lua_Integer)lua_rawlen(L, -1);
        shape[(*ndim)++] = n;
        if (n == 0)
            break;
        lua_rawgeti(L, -1, 1);
        lua_remove(L, -2);
    }
    lua_pop(L, 1);
}

/* Fills t from the table at idx (depth d of the shape); index holds the
 * position built so far. Checks that the table is not ragged. */
static void nested_fill(lua_State *L, int idx, ft_tensor *t, int d, int64_t *index)
{
    if (d == t->ndim) {
        if (lua_type(L, idx) != LUA_TNUMBER) {
            char where[96] = "";
            size_t n = 0;
            for (int k = 0; k < d && n < sizeof where; k++)
                n += (size_t)snprintf(where + n, sizeof where - n, "[%lld]",
                                      (long long)index[k] + 1);
            luaL_argerror(L, 1, lua_pushfstring(L, "element %s is a %s, not a number",
                                                where, luaL_typename(L, idx)));
        }
        store_element(L, t, index, idx);
        return;
    }
    if (lua_type(L, idx) != LUA_TTABLE || (int64_t)lua_rawlen(L, idx) != t->shape[d])
        luaL_argerror(L, 1, lua_pushfstring(L, "ragged nested table: expected %s elements at depth %d",
                                            istr(L, t->shape[d]), d + 1));
    for (int64_t i = 0; i < t->shape[d]; i++) {
        index[d] = i;
        lua_rawgeti(L, idx, (lua_Integer)i + 1);
        nested_fill(L, lua_gettop(L), t, d + 1, index);
        lua_pop(L, 1);
    }
}

static int l_tensor(lua_State *L)
{
    int t1 = lua_type(L, 1);
    if (t1 != LUA_TTABLE && t1 != LUA_TNUMBER)
        luaL_typeerror(L, 1, "nested table of numbers or number");
    options o = check_options(L, 2, DEFAULT_DTYPE);
    int64_t shape[FT_MAX_DIMS];
    int ndim;
    nested_shape(L, 1, shape, &ndim);
    ft_tensor *t = new_tensor(L, ndim, shape, o, 0);
    int64_t index[FT_MAX_DIMS] = {0};
    nested_fill(L, 1, t, 0, index);
    return 1;
}

/* ---- properties ---- */

/* A table of t->ndim sizes from v (t's shape or strides), copied before
 * the table is made: its allocation may run a finalizer that frees t. */
static void push_shape(lua_State *L, const ft_tensor *t, const int64_t *v)
{
    int64_t copy[FT_MAX_DIMS];
    int ndim = t->ndim;
    memcpy(copy, v, sizeof copy[0] * (size_t)ndim);
    lua_createtable(L, ndim, 0);
    for (int d = 0; d < ndim; d++) {
        lua_pushinteger(L, (lua_Integer)copy[d]);
        lua_seti(L, -2, d + 1);
    }
}

static int t_dim(lua_State *L)
{
    lua_pushinteger(L, check_tensor(L, 1)->ndim);
    return 1;
}

static int t_numel(lua_State *L)
{
    lua_pushinteger(L, (lua_Integer)ft_numel(check_tensor(L, 1)));
    return 1;
}

static int t_size(lua_State *L)
{
    ft_tensor *t = check_tensor(L, 1);
    if (lua_isnoneornil(L, 2))
        push_shape(L, t, t->shape);
    else
        lua_pushinteger(L, (lua_Integer)t->shape[check_dim(L, 2, t->ndim)]);
    return 1;
}

static int t_stride(lua_State *L)
{
    ft_tensor *t = check_tensor(L, 1);
    if (lua_isnoneornil(L, 2))
        push_shape(L, t, t->stride);
    else
        lua_pushinteger(L, (lua_Integer)t->stride[check_dim(L, 2, t->ndim)]);
    return 1;
}

static int t_is_contiguous(lua_State *L)
{
    lua_pushboolean(L, ft_is_contiguous(check_tensor(L, 1)));
    return 1;
}

static int t_is_same_storage(lua_State *L)
{
    lua_pushboolean(L, ft_same_storage(check_tensor(L, 1), check_tensor(L, 2)));
    return 1;
}

static int t_len(lua_State *L)
{
    ft_tensor *t = check_tensor(L, 1);
    if (t->ndim == 0)
        return luaL_error(L, "%s", "a 0-d tensor has no length (use t:item())");
    lua_pushinteger(L, (lua_Integer)t->shape[0]);
    return 1;
}

/* ---- views and copies ---- */

static int t_view_or_reshape(lua_State *L, int reshape)
{
    ft_tensor *t = check_tensor(L, 1);
    int64_t shape[FT_MAX_DIMS];
    int next;
    int ndim = check_shape_ex(L, 2, shape, &next, 1); /* one size may be -1 */
    ft_tensor **slot = push_slot(L);
    CALL(L, 0, reshape ? ft_reshape(slot, t, ndim, shape) : ft_view(slot, t, ndim, shape));
    return 1;
}

static int t_view(lua_State *L) { return t_view_or_reshape(L, 0); }
static int t_reshape(lua_State *L) { return t_view_or_reshape(L, 1); }

static int t_transpose(lua_State *L)
{
    ft_tensor *t = check_tensor(L, 1);
    if (lua_isnoneornil(L, 2) && t->ndim < 2)
        luaL_argerror(L, 1, lua_pushfstring(L, "transpose without dims needs a tensor of 2 or more dims, this one is %d-d",
                                            t->ndim));
    if (!lua_isnoneornil(L, 2) && lua_isnoneornil(L, 3))
        luaL_argerror(L, 3, "transpose needs two dims (or none for a 2-d tensor)");
    int d0 = opt_dim(L, 2, t->ndim, 0), d1 = opt_dim(L, 3, t->ndim, 1);
    ft_tensor **slot = push_slot(L);
    CALL(L, 0, ft_transpose(slot, t, d0, d1));
    return 1;
}

static int t_permute(lua_State *L)
{
    ft_tensor *t = check_tensor(L, 1);
    int perm[FT_MAX_DIMS];
    int from_table = lua_istable(L, 2);
    size_t nperm = from_table ? lua_rawlen(L, 2) : (size_t)(lua_gettop(L) - 1);
    int n = nperm > FT_MAX_DIMS ? FT_MAX_DIMS + 1 : (int)nperm;
    if (n != t->ndim)
        luaL_argerror(L, 2, lua_pushfstring(L, "permutation has %d dims, tensor has %d", n, t->ndim));
    int seen[FT_MAX_DIMS] = {0};
    for (int d = 0; d < n; d++) {
        int arg = from_table ? 2 : d + 2;
        if (from_table) {
            lua_rawgeti(L, 2, d + 1);
            int ok = 0;
            lua_Integer v = lua_type(L, -1) == LUA_TNUMBER ? lua_tointegerx(L, -1, &ok) : 0;
            if (!ok)
                luaL_argerror(L, 2, lua_pushfstring(L, "entry %d of the permutation is not an integer",
                                                    d + 1));
            lua_pop(L, 1);
            perm[d] = check_dim_value(L, 2, v, t->ndim);
        } else {
            perm[d] = check_dim(L, arg, t->ndim);
        }
        if (seen[perm[d]]++)
            luaL_argerror(L, arg, lua_pushfstring(L, "dim %d appears twice in the permutation",
                                                  perm[d] + 1));
    }
    ft_tensor **slot = push_slot(L);
    CALL(L, 0, ft_permute(slot, t, perm));
    return 1;
}

static int t_narrow(lua_State *L)
{
    ft_tensor *t = check_tensor(L, 1);
    int d = check_dim(L, 2, t->ndim);
    int64_t start = check_size(L, 3, "start");
    int64_t length = check_size(L, 4, "length");
    if (start < 1 || start > t->shape[d] + 1)
        luaL_argerror(L, 3, lua_pushfstring(L, "start %s out of range for dim %d of size %s",
                                            istr(L, start), d + 1, istr(L, t->shape[d])));
    if (length < 0 || length > t->shape[d] - (start - 1))
        luaL_argerror(L, 4, lua_pushfstring(L, "length %s from start %s exceeds dim %d of size %s",
                                            istr(L, length), istr(L, start), d + 1,
                                            istr(L, t->shape[d])));
    ft_tensor **slot = push_slot(L);
    CALL(L, 0, ft_narrow(slot, t, d, start - 1, length));
    return 1;
}

static int t_select(lua_State *L)
{
    ft_tensor *t = check_tensor(L, 1);
    int d = check_dim(L, 2, t->ndim);
    int64_t index = check_index(L, 3, t->shape[d], d);
    ft_tensor **slot = push_slot(L);
    CALL(L, 0, ft_select(slot, t, d, index));
    return 1;
}

/* t:expand(shape): a broadcast view (stride 0 where a dim repeats). */
static int t_expand(lua_State *L)
{
    ft_tensor *t = check_tensor(L, 1);
    int64_t shape[FT_MAX_DIMS];
    int next;
    int ndim = check_shape_ex(L, 2, shape, &next, 1);
    ft_tensor **slot = push_slot(L);
    CALL(L, 0, ft_expand(slot, t, ndim, shape));
    return 1;
}

/* The 1-based index tensor at idx as a new 0-based one (pushed on the
 * stack): entries of a CPU index are checked here so that the message
 * speaks of 1-based positions. */
static ft_tensor *zero_based_index(lua_State *L, int idx, int64_t size)
{
    ft_tensor *index = check_tensor(L, idx);
    if (index->dtype != FT_I64 && index->dtype != FT_I32)
        luaL_argerror(L, idx, lua_pushfstring(L, "index must be an i64 or i32 tensor, got %s",
                                              ft_dtype_name(index->dtype)));
    if (index->ndim != 1)
        luaL_argerror(L, idx, lua_pushfstring(L, "index must be 1-d, got %d-d", index->ndim));
    ft_tensor **slot = push_slot(L);
    /* C: op = 1, the index = 2. A new contiguous tensor (an index too big to
     * hold fails here, before any walk), checked below. */
    CALL(L, idx - 2, ft_binary_scalar(slot, FT_SUB, index, 1.0, 0));
    ft_tensor *zero = *slot;
    if (zero->device.type == FT_CPU)
        for (int64_t i = 0; i < zero->shape[0]; i++) {
            int64_t v = 0;
            ft_get_int(zero, &i, &v);
            if (v < 0 || v >= size)
                luaL_argerror(L, idx, lua_pushfstring(L, "index[%s] = %s is out of range 1..%s",
                                                      istr(L, i + 1), istr(L, v + 1),
                                                      istr(L, size)));
        }
    return zero;
}

/* t:index_select(dim, index): rows (1-based) of t along dim. */
static int t_index_select(lua_State *L)
{
    ft_tensor *t = check_tensor(L, 1);
    int d = check_dim(L, 2, t->ndim);
    ft_tensor *index = zero_based_index(L, 3, t->shape[d]);
    ft_tensor **slot = push_slot(L);
    CALL(L, 0, ft_index_select(slot, t, d, index));
    return 1;
}

/* t:index_add(dim, index, src): t[.., index[i], ..] += src[.., i, ..]. */
static int t_index_add(lua_State *L)
{
    ft_tensor *t = check_tensor(L, 1);
    int d = check_dim(L, 2, t->ndim);
    const ft_tensor *src = check_tensor(L, 4);
    ft_tensor *index = zero_based_index(L, 3, t->shape[d]);
    CALL(L, 0, ft_index_add(t, d, index, src));
    lua_settop(L, 1);
    return 1;
}

static int t_contiguous(lua_State *L)
{
    ft_tensor *t = check_tensor(L, 1);
    if (ft_is_contiguous(t)) { /* the same object, as torch does */
        lua_settop(L, 1);
        return 1;
    }
    ft_tensor **slot = push_slot(L);
    CALL(L, 0, ft_contiguous(slot, t));
    return 1;
}

static int t_clone(lua_State *L)
{
    ft_tensor *t = check_tensor(L, 1);
    ft_tensor **slot = push_slot(L);
    CALL(L, 0, ft_clone(slot, t));
    return 1;
}

/* Converts t (at 1) to dtype and device; t itself when nothing changes,
 * as torch does. */
static int convert(lua_State *L, ft_tensor *t, ft_dtype dtype, ft_device device)
{
    if (dtype == t->dtype && ft_device_equal(device, t->device)) {
        lua_settop(L, 1);
        return 1;
    }
    ft_tensor **slot = push_slot(L);
    CALL(L, 0, ft_to(slot, t, dtype, device));
    return 1;
}

/* t:cuda([index]): to CUDA device index (default 0). */
static int t_cuda(lua_State *L)
{
    ft_tensor *t = check_tensor(L, 1);
    ft_device device = {FT_CUDA, 0};
    char name[32] = "cuda";
    if (!lua_isnoneornil(L, 2)) {
        int64_t i = check_size(L, 2, "device index");
        if (i < 0 || i > 1 << 20)
            luaL_argerror(L, 2, lua_pushfstring(L, "device index %s out of range", istr(L, i)));
        snprintf(name, sizeof name, "cuda:%d", (int)i);
    }
    if (ft_device_parse(name, &device) != FT_OK)
        luaL_error(L, "cuda: %s", ft_last_error_detail());
    return convert(L, t, t->dtype, device);
}

static int t_cpu(lua_State *L)
{
    ft_tensor *t = check_tensor(L, 1);
    return convert(L, t, t->dtype, (ft_device){FT_CPU, 0});
}

/* t:double(), t:float(), t:half(), t:bf16(), t:int(), t:long() */
static int to_dtype(lua_State *L, ft_dtype dtype)
{
    ft_tensor *t = check_tensor(L, 1);
    return convert(L, t, dtype, t->device);
}
static int t_double(lua_State *L) { return to_dtype(L, FT_F64); }
static int t_float(lua_State *L) { return to_dtype(L, FT_F32); }
static int t_half(lua_State *L) { return to_dtype(L, FT_F16); }
static int t_bf16(lua_State *L) { return to_dtype(L, FT_BF16); }
static int t_int(lua_State *L) { return to_dtype(L, FT_I32); }
static int t_long(lua_State *L) { return to_dtype(L, FT_I64); }

/* t:to("f64"), t:to("cpu"), t:to{dtype=, device=}. Returns t itself when
 * nothing changes, as torch does. */
static int t_to(lua_State *L)
{
    ft_tensor *t = check_tensor(L, 1);
    ft_dtype dtype = t->dtype;
    ft_device device = t->device;
    if (lua_istable(L, 2)) {
        static const opt_spec spec[] = {{"dtype", OPT_DTYPE}, {"device", OPT_DEVICE}};
        opt_value v[2];
        read_options(L, 2, spec, 2, v);
        if (v[0].present)
            dtype = v[0].dtype;
        if (v[1].present)
            device = v[1].device;
    } else {
        const char *name = luaL_checkstring(L, 2);
        if (ft_dtype_parse(name, &dtype) != FT_OK &&
            ft_device_parse(name, &device) != FT_OK) {
            if (strncmp(name, "cuda", 4) == 0) /* a device, not in this build */
                luaL_argerror(L, 2, ft_last_error_detail());
            luaL_argerror(L, 2, lua_pushfstring(L, "unknown dtype or device '%s' (dtypes: f64, f32, f16, bf16, i32, i64, fp8_e4m3; devices: cpu, cuda, cuda:N)", name));
        }
    }
    return convert(L, t, dtype, device);
}

static int t_copy(lua_State *L)
{
    ft_tensor *dst = check_tensor(L, 1);
    ft_tensor *src = check_tensor(L, 2);
    CALL(L, 0, ft_copy(dst, src));
    lua_settop(L, 1);
    return 1;
}

static int t_fill(lua_State *L)
{
    ft_tensor *t = check_tensor(L, 1);
    double v = check_value(L, 2);
    CALL(L, 0, ft_fill(t, v));
    lua_settop(L, 1);
    return 1;
}

/* ---- elements ---- */

static void check_indices(lua_State *L, const ft_tensor *t, int first, int64_t *index)
{
    int given = lua_gettop(L) - first + 1;
    if (given < t->ndim)
        luaL_argerror(L, first + (given > 0 ? given : 0),
                      lua_pushfstring(L, "expected %d indices for a %d-d tensor, got %d",
                                      t->ndim, t->ndim, given));
    for (int d = 0; d < t->ndim; d++)
        index[d] = check_index(L, first + d, t->shape[d], d);
}

static int t_get(lua_State *L)
{
    ft_tensor *t = check_tensor(L, 1);
    int64_t index[FT_MAX_DIMS];
    if (lua_gettop(L) - 1 > t->ndim)
        luaL_argerror(L, t->ndim + 2, lua_pushfstring(L, "expected %d indices for a %d-d tensor, got %d",
                                                     t->ndim, t->ndim, lua_gettop(L) - 1));
    check_indices(L, t, 2, index);
    push_element(L, t, index);
    return 1;
}

/* t:set(i, j, ..., value) -> t */
static int t_set(lua_State *L)
{
    ft_tensor *t = check_tensor(L, 1);
    int top = lua_gettop(L);
    if (top != t->ndim + 2)
        return luaL_error(L, "set: expected %d indices and a value for a %d-d tensor, got %d arguments",
                          t->ndim, t->ndim, top - 1);
    check_value(L, top);
    int64_t index[FT_MAX_DIMS];
    for (int d = 0; d < t->ndim; d++)
        index[d] = check_index(L, 2 + d, t->shape[d], d);
    store_element(L, t, index, top);
    lua_settop(L, 1);
    return 1;
}

static int t_item(lua_State *L)
{
    ft_tensor *t = check_tensor(L, 1);
    if (ft_numel(t) != 1)
        luaL_argerror(L, 1, lua_pushfstring(L, "item needs a tensor with one element, this one has %s",
                                            istr(L, ft_numel(t))));
    int64_t index[FT_MAX_DIMS] = {0};
    push_element(L, t, index);
    return 1;
}

static void totable_rec(lua_State *L, const ft_tensor *t, int d, int64_t *index)
{
    if (d == t->ndim) {
        push_element(L, t, index);
        return;
    }
    luaL_checkstack(L, 2, "tensor too deep");
    lua_createtable(L, (int)(t->shape[d] < 1 << 20 ? t->shape[d] : 0), 0);
    for (int64_t i = 0; i < t->shape[d]; i++) {
        index[d] = i;
        totable_rec(L, t, d + 1, index);
        lua_seti(L, -2, (lua_Integer)i + 1);
    }
}

/* Lua tables take 16 bytes or more a number: a tensor bigger than this
 * (a stride-0 view can be 2^62 elements on 4 bytes) is an error, not an
 * exhausted machine. */
#define TOTABLE_MAX ((int64_t)1 << 27)

static int t_totable(lua_State *L)
{
    ft_tensor *t = check_tensor(L, 1);
    if (ft_numel(t) > TOTABLE_MAX)
        luaL_argerror(L, 1, lua_pushfstring(L, "%s elements are too many for a Lua table (at most %s): narrow the tensor or save it",
                                            istr(L, ft_numel(t)), istr(L, TOTABLE_MAX)));
    int64_t index[FT_MAX_DIMS] = {0};
    totable_rec(L, t, 0, index);
    return 1;
}

/* ---- arithmetic ---- */

static int binary(lua_State *L, ft_binop op)
{
    /* Tensor operands (freed ones raise here), or numbers. */
    int ta = luaL_testudata(L, 1, TENSOR_MT) != NULL;
    int tb = luaL_testudata(L, 2, TENSOR_MT) != NULL;
    ft_tensor *a = ta ? check_tensor(L, 1) : NULL, *b = tb ? check_tensor(L, 2) : NULL;
    ft_tensor **slot;
    /* C: op=1, a=2, b=3 */
    if (a && b) {
        slot = push_slot(L);
        CALL(L, -1, ft_binary(slot, op, a, b));
    } else if (a) {
        double s = check_value(L, 2);
        slot = push_slot(L);
        CALL(L, -1, ft_binary_scalar(slot, op, a, s, 0));
    } else if (b) {
        double s = check_value(L, 1);
        /* the tensor is Lua arg 2 = C input 2 */
        slot = push_slot(L);
        CALL(L, 0, ft_binary_scalar(slot, op, b, s, 1));
    } else {
        check_tensor(L, 1); /* raises: freed tensor or wrong type */
        check_tensor(L, 2);
    }
    return 1;
}

static int t_add(lua_State *L) { return binary(L, FT_ADD); }
static int t_sub(lua_State *L) { return binary(L, FT_SUB); }
static int t_mul(lua_State *L) { return binary(L, FT_MUL); }
static int t_div(lua_State *L) { return binary(L, FT_DIV); }
static int t_pow(lua_State *L) { return binary(L, FT_POW); }
static int t_maximum(lua_State *L) { return binary(L, FT_MAXIMUM); }
static int t_minimum(lua_State *L) { return binary(L, FT_MINIMUM); }

static int unary(lua_State *L, ft_unop op)
{
    ft_tensor *a = check_tensor(L, 1);
    ft_tensor **slot = push_slot(L);
    /* C: op=1, a=2 */
    CALL(L, -1, ft_unary(slot, op, a));
    return 1;
}

static int t_neg(lua_State *L) { return unary(L, FT_NEG); }
static int t_exp(lua_State *L) { return unary(L, FT_EXP); }
static int t_log(lua_State *L) { return unary(L, FT_LOG); }
static int t_abs(lua_State *L) { return unary(L, FT_ABS); }
static int t_sqrt(lua_State *L) { return unary(L, FT_SQRT); }
static int t_tanh(lua_State *L) { return unary(L, FT_TANH); }
static int t_sigmoid(lua_State *L) { return unary(L, FT_SIGMOID); }
static int t_relu(lua_State *L) { return unary(L, FT_RELU); }

/* t:sum() -> number; t:sum(dim[, keepdim]) -> tensor (for max and min
 * also the 1-based positions, an i64 tensor). */
static int reduce(lua_State *L, ft_reduce_op op)
{
    ft_tensor *a = check_tensor(L, 1);
    /* C: op=1, a=2, dim=3 */
    if (lua_isnoneornil(L, 2)) {
        double r = 0;
        CALL(L, -1, ft_reduce_all(op, a, &r));
        if ((op == FT_SUM || op == FT_MAX || op == FT_MIN) && is_int_dtype(a->dtype))
            push_number(L, a, r);
        else
            lua_pushnumber(L, r);
        return 1;
    }
    int dim = check_dim(L, 2, a->ndim);
    int keepdim = lua_toboolean(L, 3);
    int with_index = op == FT_MAX || op == FT_MIN;
    if (with_index && a->shape[dim] == 0)
        luaL_argerror(L, 2, lua_pushfstring(L, "%s along dim %d, which has size 0",
                                            op == FT_MAX ? "max" : "min", dim + 1));
    ft_tensor **values = push_slot(L);
    ft_tensor **positions = with_index ? push_slot(L) : NULL;
    CALL(L, -1, ft_reduce_dim(values, positions, op, a, dim, keepdim));
    if (!with_index)
        return 1;
    /* 0-based positions from C, 1-based for Lua. */
    ft_tensor **one_based = push_slot(L);
    CALL(L, -1, ft_binary_scalar(one_based, FT_ADD, *positions, 1.0, 0));
    ft_tensor_free(*positions); /* the 0-based copy goes now, not at the next GC */
    *positions = NULL;
    lua_remove(L, -2);
    return 2;
}

static int t_sum(lua_State *L) { return reduce(L, FT_SUM); }
static int t_mean(lua_State *L) { return reduce(L, FT_MEAN); }
static int t_max(lua_State *L) { return reduce(L, FT_MAX); }
static int t_min(lua_State *L) { return reduce(L, FT_MIN); }
static int t_norm(lua_State *L) { return reduce(L, FT_NORM); }

static int t_softmax(lua_State *L)
{
    ft_tensor *a = check_tensor(L, 1);
    if (a->ndim == 0)
        luaL_argerror(L, 1, "softmax needs a tensor with at least one dim");
    int dim = opt_dim(L, 2, a->ndim, a->ndim - 1);
    ft_tensor **slot = push_slot(L);
    CALL(L, 0, ft_softmax(slot, a, dim));
    return 1;
}

static int l_matmul(lua_State *L)
{
    ft_tensor *a = check_tensor(L, 1), *b = check_tensor(L, 2);
    ft_tensor **slot = push_slot(L);
    CALL(L, 0, ft_matmul(slot, a, b));
    return 1;
}

static int l_max_abs_diff(lua_State *L)
{
    ft_tensor *a = check_tensor(L, 1), *b = check_tensor(L, 2);
    double r = 0;
    CALL(L, 0, ft_max_abs_diff(a, b, &r));
    lua_pushnumber(L, r);
    return 1;
}

static int l_allclose(lua_State *L)
{
    ft_tensor *a = check_tensor(L, 1), *b = check_tensor(L, 2);
    double rtol = luaL_optnumber(L, 3, 1e-5), atol = luaL_optnumber(L, 4, 1e-8);
    if (!(rtol >= 0))
        luaL_argerror(L, 3, "rtol must be >= 0");
    if (!(atol >= 0))
        luaL_argerror(L, 4, "atol must be >= 0");
    int r = 0;
    CALL(L, 0, ft_allclose(a, b, rtol, atol, &r));
    lua_pushboolean(L, r);
    return 1;
}

/* ---- files ---- */

static int t_save(lua_State *L)
{
    ft_tensor *t = check_tensor(L, 1);
    const char *path = luaL_checkstring(L, 2);
    CALL(L, 0, ft_save_npy(t, path));
    lua_settop(L, 1);
    return 1;
}

static int l_load(lua_State *L)
{
    const char *path = luaL_checkstring(L, 1);
    ft_tensor **slot = push_slot(L);
    CALL(L, 0, ft_load_npy(slot, path));
    return 1;
}

/* ---- safetensors ---- */

#define SAFETENSORS_MT "flashtile.safetensors"

static int safetensors_gc(lua_State *L)
{
    ft_safetensors **h = lua_touserdata(L, 1);
    if (h && *h) {
        ft_safetensors_free(*h);
        *h = NULL;
    }
    return 0;
}

/* Counts the entries of the table at idx; every key must be a string and
 * every value pass check(L, value index, key), which raises otherwise. */
static int count_named(lua_State *L, int idx, void (*check)(lua_State *, int, int, const char *))
{
    int n = 0;
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        if (lua_type(L, -2) != LUA_TSTRING)
            luaL_argerror(L, idx, lua_pushfstring(L, "keys must be strings, got a %s key",
                                                  luaL_typename(L, -2)));
        check(L, lua_gettop(L), idx, lua_tostring(L, -2));
        if (n == INT32_MAX / 2)
            luaL_argerror(L, idx, "too many entries");
        n++;
        lua_pop(L, 1);
    }
    return n;
}

static void check_named_tensor(lua_State *L, int v, int arg, const char *name)
{
    ud_tensor *u = luaL_testudata(L, v, TENSOR_MT);
    if (!u)
        luaL_argerror(L, arg, lua_pushfstring(L, "'%s' is a %s, not a tensor", name,
                                              luaL_typename(L, v)));
    if (!u->t)
        luaL_argerror(L, arg, lua_pushfstring(L, "'%s' has been freed", name));
}

static void check_named_string(lua_State *L, int v, int arg, const char *name)
{
    if (lua_type(L, v) != LUA_TSTRING)
        luaL_argerror(L, arg, lua_pushfstring(L, "metadata '%s' must be a string, got %s", name,
                                              luaL_typename(L, v)));
}

/* ft.save_safetensors(path, {name = tensor, ...} [, {key = "value", ...}]) */
static int l_save_safetensors(lua_State *L)
{
    const char *path = luaL_checkstring(L, 1);
    luaL_checktype(L, 2, LUA_TTABLE);
    int has_meta = !lua_isnoneornil(L, 3);
    if (has_meta)
        luaL_checktype(L, 3, LUA_TTABLE);
    lua_settop(L, 3);
    int n = count_named(L, 2, check_named_tensor);
    int m = has_meta ? count_named(L, 3, check_named_string) : 0;
    /* Scratch arrays in userdata (collected on any error), allocated before
     * the pointers are taken: nothing runs Lua code after that. */
    const char **names = lua_newuserdatauv(L, sizeof *names * (size_t)(n + 1), 0);
    ft_tensor **tensors = lua_newuserdatauv(L, sizeof *tensors * (size_t)(n + 1), 0);
    const char **keys = lua_newuserdatauv(L, sizeof *keys * (size_t)(m + 1), 0);
    const char **values = lua_newuserdatauv(L, sizeof *values * (size_t)(m + 1), 0);
    int i = 0;
    lua_pushnil(L);
    while (lua_next(L, 2) && i < n) {
        names[i] = lua_tostring(L, -2);
        tensors[i++] = ((ud_tensor *)lua_touserdata(L, -1))->t;
        lua_pop(L, 1);
    }
    i = 0;
    if (has_meta) {
        lua_pushnil(L);
        while (lua_next(L, 3) && i < m) {
            keys[i] = lua_tostring(L, -2);
            values[i++] = lua_tostring(L, -1);
            lua_pop(L, 1);
        }
    }
    /* the C inputs are arrays: no Lua position */
    CALL(L, NO_ARG, ft_safetensors_save(path, n, names, tensors, m, keys, values));
    return 0;
}

/* ft.load_safetensors(path) -> {name = tensor, ...}, {key = "value", ...} */
static int l_load_safetensors(lua_State *L)
{
    const char *path = luaL_checkstring(L, 1);
    ft_safetensors **h = lua_newuserdatauv(L, sizeof *h, 0);
    *h = NULL;
    if (new_class_metatable(L, SAFETENSORS_MT)) {
        lua_pushcfunction(L, safetensors_gc);
        lua_setfield(L, -2, "__gc");
    }
    lua_setmetatable(L, -2);
    int handle = lua_gettop(L);
    CALL(L, 0, ft_safetensors_load(path, h));
    int n = ft_safetensors_count(*h), m = ft_safetensors_meta_count(*h);
    lua_createtable(L, 0, n);
    for (int i = 0; i < n; i++) {
        ft_tensor **slot = push_slot(L);
        CALL(L, NO_ARG, ft_safetensors_tensor(*h, i, slot));
        lua_setfield(L, -2, ft_safetensors_name(*h, i));
    }
    lua_createtable(L, 0, m);
    for (int i = 0; i < m; i++) {
        lua_pushstring(L, ft_safetensors_meta_value(*h, i));
        lua_setfield(L, -2, ft_safetensors_meta_key(*h, i));
    }
    lua_pushcfunction(L, safetensors_gc); /* close the file now */
    lua_pushvalue(L, handle);
    lua_call(L, 1, 0);
    return 2;
}

/* ---- memory ---- */

static ft_device opt_device(lua_State *L, int idx)
{
    if (lua_isnoneornil(L, idx))
        return (ft_device){FT_CPU, 0};
    return check_device(L, idx);
}

static int l_memory_stats(lua_State *L)
{
    ft_device dev = opt_device(L, 1);
    ft_memory_stats s;
    CALL(L, 0, ft_memory_stats_get(dev, &s));
    lua_createtable(L, 0, 3);
    lua_pushinteger(L, (lua_Integer)s.in_use);
    lua_setfield(L, -2, "in_use");
    lua_pushinteger(L, (lua_Integer)s.peak);
    lua_setfield(L, -2, "peak");
    if (dev.type != FT_CPU) {
        lua_pushinteger(L, (lua_Integer)s.reserved);
        lua_setfield(L, -2, "reserved");
    }
    return 1;
}

static int l_reset_peak_memory(lua_State *L)
{
    ft_device dev = opt_device(L, 1);
    CALL(L, 0, ft_reset_peak_memory(dev));
    return 0;
}

/* Seconds from a monotonic clock (wall time, unlike os.clock, which adds
 * up the CPU time of every thread). */
static int l_clock(lua_State *L)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    lua_pushnumber(L, (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec);
    return 1;
}

static int l_is_tensor(lua_State *L)
{
    lua_pushboolean(L, luaL_testudata(L, 1, TENSOR_MT) != NULL);
    return 1;
}

/* ---- attention ---- */

/* {causal=, scale=, impl=, ... } at idx into p (see attn_spec); returns
 * whether the backward should give the mods' tensors' gradients (option
 * mod_grads, true unless false). */
static int check_attn_options(lua_State *L, int idx, ft_attn_params *p)
{
    static const opt_spec spec[] = {
        {"causal", OPT_BOOL},        {"scale", OPT_NUMBER},        {"impl", OPT_IMPL},
        {"block_q", OPT_INT},        {"block_k", OPT_INT},         {"deterministic", OPT_BOOL},
        {"window_left", OPT_INT},    {"window_right", OPT_INT},    {"softcap", OPT_NUMBER},
        {"alibi_slopes", OPT_TENSOR}, {"dropout_p", OPT_NUMBER},   {"seed", OPT_INT},
        {"cu_seqlens_q", OPT_TENSOR}, {"cu_seqlens_k", OPT_TENSOR}, {"sink", OPT_TENSOR},
        {"offset", OPT_INT},         {"max_seqlen_q", OPT_INT},    {"max_seqlen_k", OPT_INT},
        {"mods", OPT_MODS},          {"block_mask", OPT_BLOCK_MASK}, {"mod_grads", OPT_BOOL},
        {"cache_seqlens", OPT_TENSOR}, {"k_new", OPT_TENSOR},      {"v_new", OPT_TENSOR},
        {"block_table", OPT_TENSOR}, {"num_splits", OPT_INT},      {"descale_q", OPT_NUMBER},
        {"descale_k", OPT_NUMBER},   {"descale_v", OPT_NUMBER}};
    enum { N = sizeof spec / sizeof spec[0] };
    opt_value v[N];
    read_options(L, idx, spec, N, v);
    ft_attn_params_init(p);
    p->causal = v[0].boolean;
    if (v[1].present) {
        if (v[1].number == 0)
            luaL_argerror(L, idx, "option 'scale' must be nonzero");
        p->scale = v[1].number;
    }
    if (v[2].present)
        p->impl = v[2].impl;
    for (int i = 3; i <= 4; i++)
        if (v[i].present && v[i].integer < 1)
            luaL_argerror(L, idx, lua_pushfstring(L, "option '%s' must be positive", spec[i].name));
    p->block_q = v[3].integer;
    p->block_k = v[4].integer;
    p->deterministic = v[5].boolean;
    p->window_left = v[6].present ? v[6].integer : -1;
    p->window_right = v[7].present ? v[7].integer : -1;
    p->softcap = v[8].number;
    p->alibi_slopes = v[9].tensor;
    p->dropout_p = v[10].number;
    p->dropout_seed = (uint64_t)v[11].integer;
    p->cu_seqlens_q = v[12].tensor;
    p->cu_seqlens_k = v[13].tensor;
    p->sink = v[14].tensor;
    if (v[15].present && (v[15].integer < 0 || v[15].integer >= (lua_Integer)1 << 31))
        luaL_argerror(L, idx, "option 'offset' must be 0 to 2^31 - 1 (a counter of dropout calls)");
    p->dropout_offset = (uint64_t)v[15].integer;
    p->max_seqlen_q = v[16].integer;
    p->max_seqlen_k = v[17].integer;
    p->mods = v[18].mods;
    p->mod_ntensors = v[18].mod_ntensors;
    p->mod_tensors = v[18].mod_tensors;
    p->block_mask = v[19].block_mask;
    p->cache_seqlens = v[21].tensor;
    p->k_new = v[22].tensor;
    p->v_new = v[23].tensor;
    p->block_table = v[24].tensor;
    p->block_table_base = 1; /* page numbers count from 1, as every Lua index */
    if (v[25].present && (v[25].integer < 0 || v[25].integer > 4096))
        luaL_argerror(L, idx, "option 'num_splits' must be 0 (automatic) to 4096");
    p->num_splits = v[25].integer;
    for (int i = 26; i <= 28; i++) /* 0 is "not given" in C: refuse it here */
        if (v[i].present && !(v[i].number > 0 && v[i].number < HUGE_VAL))
            luaL_argerror(L, idx, lua_pushfstring(L, "option '%s' must be a finite positive number",
                                                  spec[i].name));
    p->descale_q = v[26].number;
    p->descale_k = v[27].number;
    p->descale_v = v[28].number;
    return !v[20].present || v[20].boolean;
}

/* data = core.attention_block_mask(graph, tensors, B, H, Nq, Nk, block_q,
 * block_k [, device]): the mask of graph evaluated per tile, on device
 * (default: where its tensors are, else the cpu). */
/* The graph at 1 (not freed) and the list of its tensors at 2; *n their
 * count. */
static const ft_attn_mods *check_graph_args(lua_State *L, int *n)
{
    ud_mods *g = luaL_checkudata(L, 1, MODS_MT);
    if (!g->m)
        luaL_argerror(L, 1, "freed graph");
    luaL_checktype(L, 2, LUA_TTABLE);
    *n = ft_attn_mods_tensors(g->m);
    if ((int)lua_rawlen(L, 2) != *n)
        luaL_argerror(L, 2, "the graph's tensors expected");
    return g->m;
}

static int l_attention_block_mask(lua_State *L)
{
    int n;
    const ft_attn_mods *m = check_graph_args(L, &n);
    int64_t size[6];
    for (int k = 0; k < 6; k++)
        size[k] = (int64_t)luaL_checkinteger(L, 3 + k);
    const ft_tensor **ts = pin_tensor_list(L, 2, n, 2, "block mask");
    /* the device: the 9th argument, else the tensors', else the cpu */
    ft_device dev = {FT_CPU, 0};
    if (!lua_isnoneornil(L, 9))
        dev = check_device(L, 9);
    else if (n > 0)
        dev = ts[0]->device;
    ud_block_mask *u = lua_newuserdata(L, sizeof *u);
    u->bm = NULL;
    luaL_setmetatable(L, BLOCK_MASK_MT);
    CALL(L, NO_ARG, ft_attn_block_mask_new_on(&u->bm, m, n, ts, size[0], size[1], size[2],
                                              size[3], size[4], size[5], dev));
    return 1;
}

/* compiled = core.attention_mods_compile(graph, tensors, dtype, head_dim,
 * arch, passes, use_cache): ft_cuda_mods_compile. */
static int l_attention_mods_compile(lua_State *L)
{
    int n;
    const ft_attn_mods *m = check_graph_args(L, &n);
    ft_dtype dtype;
    if (ft_dtype_parse(luaL_checkstring(L, 3), &dtype) != FT_OK)
        return luaL_argerror(L, 3, lua_pushfstring(L, "unknown dtype '%s'", lua_tostring(L, 3)));
    const lua_Integer d = luaL_checkinteger(L, 4);
    const char *arch = luaL_checkstring(L, 5);
    const int passes = (int)luaL_checkinteger(L, 6);
    const int use_cache = lua_toboolean(L, 7);
    const ft_tensor **ts = pin_tensor_list(L, 2, n, 2, "mods compile");
    int compiled = 0;
    CALL(L, NO_ARG, ft_cuda_mods_compile(m, n, ts, dtype, d < 0 || d > 4096 ? -1 : (int)d,
                                         arch, passes, use_cache, &compiled));
    lua_pushinteger(L, compiled);
    return 1;
}

/* empty, partial, full = core.attention_block_mask_counts(data) */
static int l_attention_block_mask_counts(lua_State *L)
{
    ud_block_mask *u = luaL_checkudata(L, 1, BLOCK_MASK_MT);
    if (!u->bm)
        return luaL_argerror(L, 1, "freed block mask");
    int64_t e, pa, f;
    ft_attn_block_mask_counts(u->bm, &e, &pa, &f);
    lua_pushinteger(L, (lua_Integer)e);
    lua_pushinteger(L, (lua_Integer)pa);
    lua_pushinteger(L, (lua_Integer)f);
    return 3;
}

static int block_mask_gc(lua_State *L)
{
    ud_block_mask *u = luaL_checkudata(L, 1, BLOCK_MASK_MT);
    ft_attn_block_mask_free(u->bm);
    u->bm = NULL;
    return 0;
}

/* graph = core.attention_mods_graph(nodes, indices, ntensors, score, mask):
 * nodes a list of {op, a, b, c, value} (op a number of core.mod_ops; a, b,
 * c 1-based node numbers, or for a read the 1-based tensor, first index,
 * count), indices a list of 1-based node numbers, score and mask 1-based
 * roots or 0 for none. */
static int l_attention_mods_graph(lua_State *L)
{
    luaL_checktype(L, 1, LUA_TTABLE);
    luaL_checktype(L, 2, LUA_TTABLE);
    const lua_Integer ntensors = luaL_checkinteger(L, 3);
    const lua_Integer score = luaL_checkinteger(L, 4), mask = luaL_checkinteger(L, 5);
    const size_t nn = lua_rawlen(L, 1), ni = lua_rawlen(L, 2);
    if (nn < 1 || nn > FT_MOD_MAX_NODES || ni > FT_MOD_MAX_NODES)
        return luaL_argerror(L, 1, "a graph has 1 to 4096 nodes and indices");
    ft_mod_node *nodes = lua_newuserdata(L, nn * sizeof *nodes);
    int32_t *idx = lua_newuserdata(L, (ni > 0 ? ni : 1) * sizeof *idx);
    for (size_t n = 0; n < nn; n++) {
        lua_rawgeti(L, 1, (lua_Integer)n + 1);
        if (lua_type(L, -1) != LUA_TTABLE)
            return luaL_argerror(L, 1, "each node must be a table {op, a, b, c, value}");
        double f[5];
        for (int k = 0; k < 5; k++) {
            lua_rawgeti(L, -1, k + 1);
            f[k] = lua_type(L, -1) == LUA_TNUMBER ? lua_tonumber(L, -1) : 0;
            lua_pop(L, 1);
        }
        lua_pop(L, 1);
        for (int k = 0; k < 4; k++)
            if (!(f[k] >= -1e9 && f[k] <= 1e9))
                return luaL_argerror(L, 1, "node fields out of range");
        const int read = (int)f[0] == FT_MOD_READ;
        nodes[n].op = (int32_t)f[0];
        /* 1-based in Lua, 0-based here (a read's count stays a count) */
        nodes[n].a = (int32_t)f[1] - 1;
        nodes[n].b = (int32_t)f[2] - 1;
        nodes[n].c = read ? (int32_t)f[3] : (int32_t)f[3] - 1;
        nodes[n].value = f[4];
    }
    for (size_t k = 0; k < ni; k++) {
        lua_rawgeti(L, 2, (lua_Integer)k + 1);
        const double x = lua_type(L, -1) == LUA_TNUMBER ? lua_tonumber(L, -1) : 0;
        lua_pop(L, 1);
        idx[k] = x >= 1 && x <= 1e9 ? (int32_t)x - 1 : -1;
    }
    if (ntensors < 0 || ntensors > FT_MOD_MAX_TENSORS || score < 0 || score > (lua_Integer)nn ||
        mask < 0 || mask > (lua_Integer)nn)
        return luaL_argerror(L, 3, "bad tensor count or roots");
    ud_mods *u = lua_newuserdata(L, sizeof *u);
    u->m = NULL;
    luaL_setmetatable(L, MODS_MT);
    CALL(L, NO_ARG, ft_attn_mods_new(&u->m, (int)nn, nodes, (int)ni, idx, (int)ntensors,
                                     (int)score - 1, (int)mask - 1));
    return 1;
}

/* top = core.attention_mods_bound(graph): the top of the score's range
 * where the range is at most 69 wide (ft_attn_mods_score_bound), else nil. */
static int l_attention_mods_bound(lua_State *L)
{
    ud_mods *g = luaL_checkudata(L, 1, MODS_MT);
    if (!g->m)
        return luaL_argerror(L, 1, "freed graph");
    double top = 0;
    if (ft_attn_mods_score_bound(g->m, &top))
        lua_pushnumber(L, top);
    else
        lua_pushnil(L);
    return 1;
}

/* score, dscore, keep, fault = core.attention_mods_eval(graph, tensors, s,
 * b, h, i, j): the graph at one point (b, h, i, j 1-based), for checking a
 * trace against its Lua function; fault when a read was out of range. */
static int l_attention_mods_eval(lua_State *L)
{
    ud_mods *g = luaL_checkudata(L, 1, MODS_MT);
    if (!g->m)
        return luaL_argerror(L, 1, "freed graph");
    luaL_checktype(L, 2, LUA_TTABLE);
    const double sv = luaL_checknumber(L, 3);
    int64_t at[4];
    for (int k = 0; k < 4; k++) {
        const lua_Integer x = luaL_checkinteger(L, 4 + k);
        if (x < 1 || x > ((lua_Integer)1 << 40))
            return luaL_argerror(L, 4 + k, "an index from 1");
        at[k] = (int64_t)x - 1;
    }
    const int n = ft_attn_mods_tensors(g->m);
    if ((int)lua_rawlen(L, 2) != n)
        return luaL_argerror(L, 2, "the graph's tensors expected");
    const ft_tensor **ts = pin_tensor_list(L, 2, n, 2, "mods");
    for (int k = 0; k < n; k++)
        if (ts[k]->device.type != FT_CPU)
            return luaL_argerror(L, 2, "cpu tensors expected");
    double *work = lua_newuserdata(L, sizeof(double) * (2 * (size_t)ft_attn_mods_nodes_count(g->m) + 1));
    double score = 0, dscore = 0;
    int keep = 1, fault = 0;
    ft_attn_mods_eval_point(g->m, ts, at[0], at[1], at[2], at[3], sv, &score, &dscore, &keep,
                            work, &fault);
    lua_pushnumber(L, score);
    lua_pushnumber(L, dscore);
    lua_pushboolean(L, keep);
    lua_pushboolean(L, fault);
    return 4;
}

static int mods_gc(lua_State *L)
{
    ud_mods *u = luaL_checkudata(L, 1, MODS_MT);
    ft_attn_mods_free(u->m);
    u->m = NULL;
    return 0;
}

/* out, lse = ft.attention(q, k, v [, opts]) */
static int l_attention(lua_State *L)
{
    const ft_tensor *q = check_tensor(L, 1), *k = check_tensor(L, 2), *v = check_tensor(L, 3);
    ft_attn_params p;
    check_attn_options(L, 4, &p);
    ft_tensor **out = push_slot(L);
    ft_tensor **lse = push_slot(L);
    CALL(L, 0, ft_attention_forward(out, lse, q, k, v, &p));
    return 2;
}

/* dq, dk, dv [, dsink] [, grads...] = ft.attention_backward(dout, q, k, v,
 * out, lse [, opts]): dsink when opts has a sink, then the gradients of
 * the float tensors the mods read, in the order they were first read. */
static int l_attention_backward(lua_State *L)
{
    const ft_tensor *t[6];
    for (int i = 0; i < 6; i++)
        t[i] = check_tensor(L, i + 1);
    ft_attn_params p;
    const int want_grads = check_attn_options(L, 7, &p);
    ft_tensor **dq = push_slot(L);
    ft_tensor **dk = push_slot(L);
    ft_tensor **dv = push_slot(L);
    if (p.sink)
        p.dsink = push_slot(L);
    /* the gradients of the mods' float tensors, in the order they were read */
    ft_tensor *grads[FT_MOD_MAX_TENSORS] = {NULL};
    ft_tensor **gslot[FT_MOD_MAX_TENSORS] = {NULL};
    int ngrads = 0;
    if (p.mods && want_grads) {
        luaL_checkstack(L, p.mod_ntensors + 2, "too many tensors in mods");
        for (int k = 0; k < p.mod_ntensors; k++)
            if (ft_dtype_is_float(p.mod_tensors[k]->dtype)) {
                gslot[k] = push_slot(L);
                ngrads++;
            }
        p.mod_grads = grads;
    }
    CALL(L, 0, ft_attention_backward(dq, dk, dv, t[0], t[1], t[2], t[3], t[4], t[5], &p));
    for (int k = 0; p.mods && k < p.mod_ntensors; k++)
        if (gslot[k])
            *gslot[k] = grads[k];
    return 3 + (p.sink ? 1 : 0) + ngrads;
}

/* ft.set_num_threads(n): at most n CPU threads for attention (0: no cap);
 * ft.get_num_threads(): how many it uses now. */
static int l_set_num_threads(lua_State *L)
{
    const lua_Integer n = luaL_checkinteger(L, 1);
    if (n < 0 || n > 4096)
        return luaL_argerror(L, 1, "a thread count from 1 to 4096 (0: no cap) expected");
    ft_set_num_threads((int)n);
    return 0;
}

static int l_get_num_threads(lua_State *L)
{
    lua_pushinteger(L, ft_get_num_threads());
    return 1;
}

/* ft.switch(name): whether the kernel switch is on (lib/switches.c);
 * ft.set_switch(name, on): on true, false, or nil (as the environment
 * variable of that name says). ft.switch_names(): their names. */
static int l_switch(lua_State *L)
{
    const char *name = luaL_checkstring(L, 1);
    const int on = ft_switch(name);
    if (on < 0) {
        CALL(L, 0, ft_set_switch(name, -1)); /* names the switches */
    }
    lua_pushboolean(L, on == 1);
    return 1;
}

static int l_set_switch(lua_State *L)
{
    const char *name = luaL_checkstring(L, 1);
    if (!lua_isnoneornil(L, 2))
        luaL_checktype(L, 2, LUA_TBOOLEAN);
    const int on = lua_isnoneornil(L, 2) ? -1 : lua_toboolean(L, 2);
    CALL(L, 0, ft_set_switch(name, on));
    return 0;
}

static int l_switch_names(lua_State *L)
{
    lua_newtable(L);
    for (int i = 0; ft_switch_name(i); i++) {
        lua_pushstring(L, ft_switch_name(i));
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}

/* mask = ft.attention_dropout_mask(B, H, Nq, Nk, {dropout_p =, seed =,
 * offset =, device =}) */
static int l_attention_dropout_mask(lua_State *L)
{
    int64_t size[4];
    for (int i = 0; i < 4; i++)
        size[i] = (int64_t)luaL_checkinteger(L, i + 1);
    static const opt_spec spec[] = {{"dropout_p", OPT_NUMBER}, {"seed", OPT_INT},
                                    {"offset", OPT_INT}, {"device", OPT_DEVICE}};
    opt_value v[4];
    read_options(L, 5, spec, 4, v);
    ft_attn_params p;
    ft_attn_params_init(&p);
    p.dropout_p = v[0].number;
    p.dropout_seed = (uint64_t)v[1].integer;
    if (v[2].present && (v[2].integer < 0 || v[2].integer >= (lua_Integer)1 << 31))
        luaL_argerror(L, 5, "option 'offset' must be 0 to 2^31 - 1 (a counter of dropout calls)");
    p.dropout_offset = (uint64_t)v[2].integer;
    const ft_device dev = v[3].present ? v[3].device : (ft_device){FT_CPU, 0};
    ft_tensor **out = push_slot(L);
    CALL(L, 0, ft_attention_dropout_mask(out, size[0], size[1], size[2], size[3], &p, dev));
    return 1;
}

/* ---- CUDA ---- */

#define EVENT_MT "flashtile.Event"

static int cuda_is_available(lua_State *L)
{
    lua_pushboolean(L, ft_cuda_device_count() > 0);
    return 1;
}

static int cuda_is_built(lua_State *L)
{
    lua_pushboolean(L, ft_cuda_built());
    return 1;
}

/* ft.cuda.cudnn_version(): the cuDNN impl "cudnn" runs on (91400 for
 * 9.14.0), or nil in a build without cuDNN. */
static int cuda_cudnn_version(lua_State *L)
{
    int v = ft_cudnn_version();
    if (v > 0)
        lua_pushinteger(L, v);
    else
        lua_pushnil(L);
    return 1;
}

/* ft.cuda.mods_stats(): what the run-time compiler did for mods on CUDA
 * since the process started: {compiles, disk_loads, memory_hits,
 * compile_s, load_s, last_compile_s, last_load_s}. */
static int cuda_mods_stats(lua_State *L)
{
    ft_rtc_stats s;
    ft_cuda_mods_stats(&s);
    lua_createtable(L, 0, 7);
    lua_pushinteger(L, (lua_Integer)s.compiles);
    lua_setfield(L, -2, "compiles");
    lua_pushinteger(L, (lua_Integer)s.disk_loads);
    lua_setfield(L, -2, "disk_loads");
    lua_pushinteger(L, (lua_Integer)s.memory_hits);
    lua_setfield(L, -2, "memory_hits");
    lua_pushnumber(L, s.compile_s);
    lua_setfield(L, -2, "compile_s");
    lua_pushnumber(L, s.load_s);
    lua_setfield(L, -2, "load_s");
    lua_pushnumber(L, s.last_compile_s);
    lua_setfield(L, -2, "last_compile_s");
    lua_pushnumber(L, s.last_load_s);
    lua_setfield(L, -2, "last_load_s");
    return 1;
}

static int cuda_device_count(lua_State *L)
{
    lua_pushinteger(L, ft_cuda_device_count());
    return 1;
}

/* CUDA devices are numbered from 0 as in "cuda:0", also in Lua. */
static int opt_device_index(lua_State *L, int idx)
{
    lua_Integer i = luaL_optinteger(L, idx, 0);
    if (i < 0 || i > 1 << 20)
        luaL_argerror(L, idx, lua_pushfstring(L, "device index %s out of range", istr(L, i)));
    return (int)i;
}

static int cuda_device_name(lua_State *L)
{
    int index = opt_device_index(L, 1);
    char name[256];
    CALL(L, 0, ft_cuda_device_name(index, name, sizeof name));
    lua_pushstring(L, name);
    return 1;
}

static int cuda_synchronize(lua_State *L)
{
    int index = opt_device_index(L, 1);
    CALL(L, 0, ft_cuda_synchronize(index));
    return 0;
}

/* The handle of a userdata whose one field is a pointer (an event, a
 * communicator, a pending exchange), taken out of it: t:free() and __gc
 * leave NULL behind, so later use is an error, never a crash. */
static void *take_handle(lua_State *L, int idx, const char *mt)
{
    void **slot = mt ? luaL_checkudata(L, idx, mt) : lua_touserdata(L, idx);
    void *p = *slot;
    *slot = NULL;
    return p;
}

typedef struct ud_event {
    ft_event *e;
} ud_event;

static ft_event *check_event(lua_State *L, int idx)
{
    ud_event *u = luaL_checkudata(L, idx, EVENT_MT);
    if (!u->e)
        luaL_argerror(L, idx, "event has been freed");
    return u->e;
}

/* ft.cuda.Event([device]) */
static int cuda_event_new(lua_State *L)
{
    ft_device dev = {FT_CUDA, 0};
    if (!lua_isnoneornil(L, 1)) {
        if (ft_device_parse(luaL_checkstring(L, 1), &dev) != FT_OK)
            luaL_argerror(L, 1, ft_last_error_detail());
    }
    ud_event *u = lua_newuserdatauv(L, sizeof *u, 0);
    u->e = NULL;
    luaL_setmetatable(L, EVENT_MT);
    CALL(L, 0, ft_event_create(&u->e, dev));
    return 1;
}

static int event_record(lua_State *L)
{
    ft_event *e = check_event(L, 1);
    CALL(L, 0, ft_event_record(e));
    lua_settop(L, 1);
    return 1;
}

/* start:elapsed(end) -> milliseconds (waits for end) */
static int event_elapsed(lua_State *L)
{
    ft_event *a = check_event(L, 1), *b = check_event(L, 2);
    double ms = 0;
    CALL(L, 0, ft_event_elapsed_ms(a, b, &ms));
    lua_pushnumber(L, ms);
    return 1;
}

static void event_release(void *e) { ft_event_free(e); }

/* e:free() and __close: now, or after the binding calls in progress. */
static int event_free(lua_State *L)
{
    release_later(L, event_release, take_handle(L, 1, EVENT_MT));
    return 0;
}

static int event_gc(lua_State *L)
{
    ft_event_free(take_handle(L, 1, NULL));
    return 0;
}

static const luaL_Reg event_methods[] = {
    {"record", event_record}, {"elapsed", event_elapsed}, {"free", event_free}, {NULL, NULL}};

static const luaL_Reg event_close[] = {{"__close", event_free}, {NULL, NULL}};

static const luaL_Reg cuda_functions[] = {
    {"is_available", cuda_is_available}, {"is_built", cuda_is_built},
    {"device_count", cuda_device_count}, {"device_name", cuda_device_name},
    {"synchronize", cuda_synchronize},   {"Event", cuda_event_new},
    {"mods_stats", cuda_mods_stats},     {"cudnn_version", cuda_cudnn_version},
    {NULL, NULL}};

/* ---- lifetime ---- */

/* t:free() and __close: the memory goes now (or with the last view of the
 * storage; or once the binding calls in progress are over, see
 * release_later); later use of t is an error, never a crash. */
static int t_free(lua_State *L)
{
    ud_tensor *u = luaL_checkudata(L, 1, TENSOR_MT);
    ft_tensor *t = u->t;
    u->t = NULL;
    release_later(L, tensor_release, t);
    return 0;
}

/* __gc: the tensor is unreachable, so no call is using it. */
static int t_gc(lua_State *L)
{
    ud_tensor *u = lua_touserdata(L, 1);
    ft_tensor_free(u->t);
    u->t = NULL;
    return 0;
}

/* t[i] is t:select(1, i), as in torch7 and PyTorch: a view of row i, or
 * the number at i for a 1-d tensor. Returns the 0-based row; key at 2. */
static int64_t check_row_key(lua_State *L, const ft_tensor *t)
{
    int ok = 0;
    lua_Integer i = lua_tointegerx(L, 2, &ok);
    if (t->ndim == 0)
        luaL_error(L, "%s", "t[i]: a 0-d tensor has no rows (use t:item())");
    if (!ok)
        luaL_error(L, "t[i]: index must be an integer, got %s", lua_tostring(L, 2));
    if (i < 1 || i > t->shape[0])
        luaL_error(L, "t[i]: index %s out of range 1..%s", istr(L, i), istr(L, t->shape[0]));
    return (int64_t)i - 1;
}

/* Pushes row i (0-based) of t as a new view. */
static ft_tensor *push_row(lua_State *L, ft_tensor *t, int64_t i)
{
    ft_tensor **slot = push_slot(L);
    CALL(L, 0, ft_select(slot, t, 0, i));
    return *slot;
}

/* t[i] for a number i (through the trampoline: it allocates). */
static int t_row(lua_State *L)
{
    ft_tensor *t = check_tensor(L, 1);
    int64_t i = check_row_key(L, t);
    if (t->ndim == 1)
        push_element(L, t, &i);
    else
        push_row(L, t, i);
    return 1;
}

/* t.shape, t.dtype, t.device, t[i], then the methods. */
static int t_index(lua_State *L)
{
    ud_tensor *u = luaL_checkudata(L, 1, TENSOR_MT);
    if (lua_type(L, 2) == LUA_TNUMBER) {
        lua_pushvalue(L, lua_upvalueindex(2)); /* t_row, in a trampoline */
        lua_pushvalue(L, 1);
        lua_pushvalue(L, 2);
        lua_call(L, 2, 1);
        return 1;
    }
    if (lua_type(L, 2) == LUA_TSTRING) {
        const char *key = lua_tostring(L, 2);
        if (u->t && strcmp(key, "shape") == 0) {
            push_shape(L, u->t, u->t->shape);
            return 1;
        }
        if (u->t && strcmp(key, "dtype") == 0) {
            lua_pushstring(L, ft_dtype_name(u->t->dtype));
            return 1;
        }
        if (u->t && strcmp(key, "device") == 0) {
            char buf[16];
            lua_pushstring(L, ft_device_name(u->t->device, buf, sizeof buf));
            return 1;
        }
    }
    if (lua_type(L, 2) == LUA_TTABLE && lua_getmetatable(L, 2)) {
        /* a symbolic key (flashtile.mods traces t[expr]): its metatable's
         * __ft_index makes the read; t_index holds no pointer meanwhile */
        lua_pushliteral(L, "__ft_index");
        lua_rawget(L, -2);
        if (lua_isfunction(L, -1)) {
            lua_pushvalue(L, 1);
            lua_pushvalue(L, 2);
            lua_call(L, 2, 1);
            return 1;
        }
        lua_pop(L, 2);
    }
    lua_pushvalue(L, 2);
    lua_rawget(L, lua_upvalueindex(1));
    return 1;
}

/* t[i] = number (the element, or every element of row i) or t[i] = tensor
 * (copied into row i, converting dtypes). Fields are read-only. */
static int t_newindex(lua_State *L)
{
    if (lua_type(L, 2) != LUA_TNUMBER)
        return luaL_error(L, "%s", "tensor fields are read-only (use t:set(...) or t:copy(src))");
    ft_tensor *t = check_tensor(L, 1);
    int64_t i = check_row_key(L, t);
    ft_tensor *src = lua_type(L, 3) == LUA_TNUMBER ? NULL : test_tensor(L, 3);
    if (lua_type(L, 3) != LUA_TNUMBER && !src) {
        if (luaL_testudata(L, 3, TENSOR_MT))
            return luaL_error(L, "%s", "t[i] = v: v has been freed");
        return luaL_error(L, "t[i] = v: v must be a number or a tensor, got %s",
                          luaL_typename(L, 3));
    }
    if (t->ndim == 1 && !src) {
        store_element(L, t, &i, 3);
        return 0;
    }
    ft_tensor *row = push_row(L, t, i);
    if ((src ? ft_copy(row, src) : ft_fill(row, lua_tonumber(L, 3))) != FT_OK)
        return luaL_error(L, "t[i] = v: %s", ft_last_error_detail());
    return 0;
}

static int t_rawstring(lua_State *L)
{
    ud_tensor *u = luaL_checkudata(L, 1, TENSOR_MT);
    if (!u->t) {
        lua_pushliteral(L, "flashtile.Tensor (freed)");
        return 1;
    }
    char shape[160] = "{";
    size_t n = 1;
    for (int d = 0; d < u->t->ndim && n < sizeof shape; d++)
        n += (size_t)snprintf(shape + n, sizeof shape - n, "%s%lld", d ? ", " : "",
                              (long long)u->t->shape[d]);
    char dev[16];
    lua_pushfstring(L, "flashtile.Tensor %s %s %s}", ft_dtype_name(u->t->dtype),
                    ft_device_name(u->t->device, dev, sizeof dev), shape);
    return 1;
}

static const luaL_Reg tensor_methods[] = {
    {"dim", t_dim},         {"numel", t_numel},       {"size", t_size},
    {"stride", t_stride},   {"is_contiguous", t_is_contiguous},
    {"is_same_storage", t_is_same_storage},
    {"cuda", t_cuda},       {"cpu", t_cpu},           {"double", t_double},
    {"float", t_float},     {"half", t_half},         {"bf16", t_bf16},
    {"int", t_int},         {"long", t_long},
    {"to", t_to},           {"view", t_view},         {"reshape", t_reshape},
    {"transpose", t_transpose}, {"permute", t_permute}, {"narrow", t_narrow},
    {"select", t_select},   {"contiguous", t_contiguous}, {"clone", t_clone},
    {"expand", t_expand},   {"index_select", t_index_select}, {"index_add", t_index_add},
    {"copy", t_copy},       {"fill", t_fill},         {"get", t_get},
    {"set", t_set},         {"item", t_item},         {"totable", t_totable},
    {"add", t_add},         {"sub", t_sub},           {"mul", t_mul},
    {"div", t_div},         {"pow", t_pow},           {"maximum", t_maximum},
    {"minimum", t_minimum}, {"neg", t_neg},           {"exp", t_exp},
    {"log", t_log},         {"abs", t_abs},           {"sqrt", t_sqrt},
    {"tanh", t_tanh},       {"sigmoid", t_sigmoid},   {"relu", t_relu},
    {"sum", t_sum},         {"mean", t_mean},         {"max", t_max},
    {"min", t_min},         {"norm", t_norm},         {"softmax", t_softmax},
    {"save", t_save},       {"free", t_free},         {"rawstring", t_rawstring},
    {NULL, NULL}};

static const luaL_Reg tensor_metamethods[] = {
    {"__add", t_add},   {"__sub", t_sub},   {"__mul", t_mul},
    {"__div", t_div},   {"__pow", t_pow},   {"__unm", t_neg},
    {"__len", t_len},   {"__close", t_free},
    {"__newindex", t_newindex}, {"__tostring", t_rawstring},
    {NULL, NULL}};

static const luaL_Reg module_functions[] = {
    {"tensor", l_tensor},       {"empty", l_empty},   {"zeros", l_zeros},
    {"ones", l_ones},           {"full", l_full},     {"rand", l_rand},
    {"randn", l_randn}, {"derive_seed", l_derive_seed},         {"arange", l_arange}, {"manual_seed", l_manual_seed},
    {"matmul", l_matmul},       {"max_abs_diff", l_max_abs_diff},
    {"allclose", l_allclose},   {"load", l_load}, {"save_safetensors", l_save_safetensors},
    {"load_safetensors", l_load_safetensors},     {"memory_stats", l_memory_stats},
    {"reset_peak_memory", l_reset_peak_memory},       {"is_tensor", l_is_tensor},
    {"clock", l_clock},         {"attention", l_attention}, {"attention_backward", l_attention_backward},
    {"attention_dropout_mask", l_attention_dropout_mask},
    {"attention_mods_graph", l_attention_mods_graph},
    {"set_num_threads", l_set_num_threads},
    {"get_num_threads", l_get_num_threads},
    {"switch", l_switch},
    {"set_switch", l_set_switch},
    {"switch_names", l_switch_names},
    {"attention_mods_eval", l_attention_mods_eval},
    {"attention_mods_bound", l_attention_mods_bound},
    {"attention_block_mask", l_attention_block_mask},
    {"attention_mods_compile", l_attention_mods_compile},
    {"attention_block_mask_counts", l_attention_block_mask_counts},
    {NULL, NULL}};

/* ---- ft.dist: communicators over NCCL (lib/dist.c) ----
 *
 * The core takes its arguments in one plain form; lua/flashtile/dist.lua
 * gives them the friendly one (ft.dist.init{...}, a tensor or a list, the
 * environment scripts/ftrun sets). Ranks and devices count from 0. */

#define COMM_MT "flashtile.Comm"
#define PENDING_MT "flashtile.Pending"

typedef struct ud_comm {
    ft_comm *c;
} ud_comm;

typedef struct ud_pending {
    ft_pending *p;
} ud_pending;

static ft_comm *check_comm(lua_State *L, int idx)
{
    ud_comm *u = luaL_checkudata(L, idx, COMM_MT);
    if (!u->c)
        luaL_argerror(L, idx, "communicator has been freed");
    return u->c;
}

static ud_comm *push_comm(lua_State *L)
{
    ud_comm *u = lua_newuserdatauv(L, sizeof *u, 0);
    u->c = NULL;
    luaL_setmetatable(L, COMM_MT);
    return u;
}

static int dist_built(lua_State *L)
{
    lua_pushboolean(L, ft_dist_built());
    return 1;
}

/* core.dist_init_devices({d0, d1, ...}) */
static int dist_init_devices(lua_State *L)
{
    luaL_checktype(L, 1, LUA_TTABLE);
    const int n = (int)lua_rawlen(L, 1);
    int devices[64];
    if (n < 1 || n > 64)
        luaL_argerror(L, 1, "devices: a list of 1 to 64 device numbers");
    for (int i = 0; i < n; i++) {
        lua_rawgeti(L, 1, i + 1);
        int ok = 0;
        const lua_Integer d = lua_tointegerx(L, -1, &ok);
        if (!ok || d < 0 || d > 1 << 20)
            luaL_argerror(L, 1, lua_pushfstring(L, "devices[%d] is not a device number", i + 1));
        devices[i] = (int)d;
        lua_pop(L, 1);
    }
    ud_comm *u = push_comm(L);
    CALL(L, 0, ft_dist_init_devices(&u->c, n, devices));
    return 1;
}

/* core.dist_init_rank(rank, world_size, device, id_file, timeout_s) */
static int dist_init_rank(lua_State *L)
{
    const lua_Integer rank = luaL_checkinteger(L, 1), world = luaL_checkinteger(L, 2);
    const lua_Integer device = luaL_checkinteger(L, 3);
    const char *id_file = luaL_checkstring(L, 4);
    const double timeout = luaL_checknumber(L, 5);
    if (rank < 0 || rank > 1 << 20 || world < 1 || world > 1 << 20 || device < 0 ||
        device > 1 << 20)
        luaL_argerror(L, 1, "rank, world_size or device out of range");
    ud_comm *u = push_comm(L);
    CALL(L, 0, ft_dist_init_rank(&u->c, (int)rank, (int)world, (int)device, id_file, timeout));
    return 1;
}

static int comm_world_size(lua_State *L)
{
    lua_pushinteger(L, ft_comm_world(check_comm(L, 1)));
    return 1;
}

/* c:ranks(), c:devices(): lists over the local ranks */
static int comm_list(lua_State *L, int (*get)(const ft_comm *, int))
{
    ft_comm *c = check_comm(L, 1);
    const int n = ft_comm_local(c);
    lua_createtable(L, n, 0);
    for (int i = 0; i < n; i++) {
        lua_pushinteger(L, get(c, i));
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}
static int comm_ranks(lua_State *L) { return comm_list(L, ft_comm_rank); }
static int comm_devices(lua_State *L) { return comm_list(L, ft_comm_device); }

/* The list at idx: one live tensor per local rank, pinned on the stack. */
static ft_tensor **comm_tensors(lua_State *L, int idx, const ft_comm *c, const char *what)
{
    luaL_checktype(L, idx, LUA_TTABLE);
    const int n = ft_comm_local(c);
    if ((int)lua_rawlen(L, idx) != n)
        luaL_argerror(L, idx, lua_pushfstring(L, "%s: %d tensors for %d local ranks", what,
                                              (int)lua_rawlen(L, idx), n));
    return (ft_tensor **)pin_tensor_list(L, idx, n, idx, what);
}

static ft_reduce_op check_reduce_op(lua_State *L, int idx)
{
    static const char *const names[] = {"sum", "mean", "max", "min", NULL};
    static const ft_reduce_op ops[] = {FT_SUM, FT_MEAN, FT_MAX, FT_MIN};
    return ops[luaL_checkoption(L, idx, "sum", names)];
}

/* c:all_reduce_list(ts, op) */
static int comm_all_reduce(lua_State *L)
{
    ft_comm *c = check_comm(L, 1);
    ft_tensor **ts = comm_tensors(L, 2, c, "tensors");
    const ft_reduce_op op = check_reduce_op(L, 3);
    CALL(L, 0, ft_all_reduce(c, ts, ft_comm_local(c), op));
    return 0;
}

/* c:broadcast_list(ts, root) */
static int comm_broadcast(lua_State *L)
{
    ft_comm *c = check_comm(L, 1);
    ft_tensor **ts = comm_tensors(L, 2, c, "tensors");
    const lua_Integer root = luaL_checkinteger(L, 3);
    if (root < 0 || root >= ft_comm_world(c))
        luaL_argerror(L, 3, lua_pushfstring(L, "root %s: ranks are 0 to %d", istr(L, root),
                                            ft_comm_world(c) - 1));
    CALL(L, 0, ft_broadcast(c, ts, ft_comm_local(c), (int)root));
    return 0;
}

/* c:all_gather_list(ins) / c:reduce_scatter_list(ins, op) -> a list of new
 * tensors: dim 1 of each input times world_size (gather) or divided by it
 * (scatter). */
static int comm_gather_scatter(lua_State *L, int scatter)
{
    ft_comm *c = check_comm(L, 1);
    ft_tensor **in = comm_tensors(L, 2, c, "inputs");
    const ft_reduce_op op = scatter ? check_reduce_op(L, 3) : FT_SUM;
    const int n = ft_comm_local(c), world = ft_comm_world(c);
    ft_tensor **out = lua_newuserdata(L, sizeof *out * (size_t)n);
    const int list = (lua_createtable(L, n, 0), lua_gettop(L));
    for (int i = 0; i < n; i++) {
        int64_t shape[FT_MAX_DIMS];
        const int nd = in[i]->ndim > 0 ? in[i]->ndim : 1;
        for (int k = 0; k < nd; k++)
            shape[k] = in[i]->ndim > 0 ? in[i]->shape[k] : 1;
        if (scatter && shape[0] % world != 0)
            luaL_argerror(L, 2, lua_pushfstring(L, "inputs[%d]: dim 1 (%s) is not a multiple "
                                                "of world_size %d", i + 1, istr(L, shape[0]),
                                                world));
        shape[0] = scatter ? shape[0] / world : shape[0] * world;
        ft_tensor **slot = push_slot(L);
        CALL(L, NO_ARG, ft_empty(slot, nd, shape, in[i]->dtype, in[i]->device));
        out[i] = *slot;
        lua_rawseti(L, list, i + 1);
    }
    if (scatter)
        CALL(L, 0, ft_reduce_scatter(c, out, (const ft_tensor *const *)in, n, op));
    else
        CALL(L, 0, ft_all_gather(c, out, (const ft_tensor *const *)in, n));
    lua_pushvalue(L, list);
    return 1;
}
static int comm_all_gather(lua_State *L) { return comm_gather_scatter(L, 0); }
static int comm_reduce_scatter(lua_State *L) { return comm_gather_scatter(L, 1); }

/* The list at idx for sendrecv: per local rank a tensor or false. */
static ft_tensor **comm_optional_tensors(lua_State *L, int idx, const ft_comm *c,
                                         const char *what)
{
    const int n = ft_comm_local(c);
    ft_tensor **ts = lua_newuserdata(L, sizeof *ts * (size_t)n);
    luaL_checktype(L, idx, LUA_TTABLE);
    for (int i = 0; i < n; i++) {
        lua_rawgeti(L, idx, i + 1);
        if (lua_toboolean(L, -1)) {
            ud_tensor *u = luaL_testudata(L, -1, TENSOR_MT);
            if (!u || !u->t)
                luaL_argerror(L, idx, lua_pushfstring(L, "%s[%d] %s", what, i + 1,
                                                      u ? "has been freed" : "is not a tensor"));
            ts[i] = u->t; /* the list itself (an argument) keeps it */
        } else {
            ts[i] = NULL;
        }
        lua_pop(L, 1);
    }
    return ts;
}

static int *comm_ints(lua_State *L, int idx, const ft_comm *c, const char *what)
{
    const int n = ft_comm_local(c);
    int *v = lua_newuserdata(L, sizeof *v * (size_t)n);
    luaL_checktype(L, idx, LUA_TTABLE);
    for (int i = 0; i < n; i++) {
        lua_rawgeti(L, idx, i + 1);
        int ok = 0;
        const lua_Integer x = lua_tointegerx(L, -1, &ok);
        v[i] = ok && x >= -1 && x < 1 << 20 ? (int)x : -1;
        if (!ok && lua_toboolean(L, -1))
            luaL_argerror(L, idx, lua_pushfstring(L, "%s[%d] is not a rank", what, i + 1));
        lua_pop(L, 1);
    }
    return v;
}

/* c:sendrecv_list(send, to, recv, from, async) -> a Pending when async */
static int comm_sendrecv(lua_State *L)
{
    ft_comm *c = check_comm(L, 1);
    ft_tensor **send = comm_optional_tensors(L, 2, c, "send");
    int *to = comm_ints(L, 3, c, "to");
    ft_tensor **recv = comm_optional_tensors(L, 4, c, "recv");
    int *from = comm_ints(L, 5, c, "from");
    const int async = lua_toboolean(L, 6);
    ud_pending *u = NULL;
    if (async) {
        u = lua_newuserdatauv(L, sizeof *u, 0);
        u->p = NULL;
        luaL_setmetatable(L, PENDING_MT);
    }
    CALL(L, 0, ft_sendrecv(c, (const ft_tensor *const *)send, to, recv, from, ft_comm_local(c),
                           async ? &u->p : NULL));
    return async ? 1 : 0;
}

/* tostring(comm): "flashtile.Comm: ranks {0, 1} of 2 on cuda:0, cuda:1" */
static int comm_tostring(lua_State *L)
{
    ud_comm *u = luaL_checkudata(L, 1, COMM_MT);
    if (!u->c) {
        lua_pushliteral(L, "flashtile.Comm (freed)");
        return 1;
    }
    luaL_Buffer b;
    luaL_buffinit(L, &b);
    luaL_addstring(&b, "flashtile.Comm: rank");
    const int n = ft_comm_local(u->c);
    if (n > 1)
        luaL_addstring(&b, "s");
    for (int i = 0; i < n; i++) {
        lua_pushfstring(L, "%s %d", i ? "," : "", ft_comm_rank(u->c, i));
        luaL_addvalue(&b);
    }
    lua_pushfstring(L, " of %d on", ft_comm_world(u->c));
    luaL_addvalue(&b);
    for (int i = 0; i < n; i++) {
        lua_pushfstring(L, "%s cuda:%d", i ? "," : "", ft_comm_device(u->c, i));
        luaL_addvalue(&b);
    }
    luaL_pushresult(&b);
    return 1;
}

static void comm_release(void *c) { ft_comm_free(c); }

static int comm_free(lua_State *L)
{
    release_later(L, comm_release, take_handle(L, 1, COMM_MT));
    return 0;
}

static int comm_gc(lua_State *L)
{
    ft_comm_free(take_handle(L, 1, NULL));
    return 0;
}

static int pending_wait(lua_State *L)
{
    ud_pending *u = luaL_checkudata(L, 1, PENDING_MT);
    if (u->p)
        CALL(L, 0, ft_pending_wait(u->p));
    return 0;
}

static void pending_release(void *p) { ft_pending_free(p); }

static int pending_free(lua_State *L)
{
    release_later(L, pending_release, take_handle(L, 1, PENDING_MT));
    return 0;
}

static int pending_gc(lua_State *L)
{
    ft_pending_free(take_handle(L, 1, NULL));
    return 0;
}

static const luaL_Reg comm_methods[] = {
    {"world_size", comm_world_size},       {"ranks", comm_ranks},
    {"devices", comm_devices},             {"all_reduce_list", comm_all_reduce},
    {"broadcast_list", comm_broadcast},    {"all_gather_list", comm_all_gather},
    {"reduce_scatter_list", comm_reduce_scatter}, {"sendrecv_list", comm_sendrecv},
    {"free", comm_free},                   {NULL, NULL}};

static const luaL_Reg pending_methods[] = {
    {"wait", pending_wait}, {"free", pending_free}, {NULL, NULL}};

static const luaL_Reg dist_functions[] = {
    {"built", dist_built}, {"init_devices", dist_init_devices},
    {"init_rank", dist_init_rank}, {NULL, NULL}};

/* The metatables of Comm and Pending (methods in __index, __gc, __close)
 * and the core's dist table, left on the stack. */
static void open_dist(lua_State *L)
{
    new_class_metatable(L, COMM_MT);
    lua_newtable(L);
    set_funcs(L, comm_methods, "Comm:");
    lua_setfield(L, -2, "__index");
    lua_pushcfunction(L, comm_gc);
    lua_setfield(L, -2, "__gc");
    lua_pushcfunction(L, comm_tostring);
    lua_setfield(L, -2, "__tostring");
    lua_getfield(L, -1, "__index");
    lua_getfield(L, -1, "free");
    lua_setfield(L, -3, "__close");
    lua_pop(L, 2);
    new_class_metatable(L, PENDING_MT);
    lua_newtable(L);
    set_funcs(L, pending_methods, "Pending:");
    lua_setfield(L, -2, "__index");
    lua_pushcfunction(L, pending_gc);
    lua_setfield(L, -2, "__gc");
    lua_getfield(L, -1, "__index");
    lua_getfield(L, -1, "free");
    lua_setfield(L, -3, "__close");
    lua_pop(L, 2);
    lua_newtable(L);
    set_funcs(L, dist_functions, "dist.");
}

FT_API int luaopen_flashtile_core(lua_State *L)
{
    state_init(L);
    lua_pushlightuserdata(L, (void *)&names_key);
    lua_newtable(L);
    lua_rawset(L, LUA_REGISTRYINDEX);
    /* The metatable lives in this state's registry. __gc and __index are
     * set apart: a collected tensor is freed at once, and __index (every
     * method lookup) is not worth a trampoline (it holds no pointer across
     * Lua code, see t_index). */
    new_class_metatable(L, TENSOR_MT);
    set_funcs(L, tensor_metamethods, "");
    lua_pushcfunction(L, t_gc);
    lua_setfield(L, -2, "__gc");
    lua_newtable(L); /* methods, the upvalue of __index */
    set_funcs(L, tensor_methods, ":");
    lua_pushvalue(L, -1);
    lua_newtable(L);
    set_funcs(L, (const luaL_Reg[]){{"t_row", t_row}, {NULL, NULL}}, "");
    lua_getfield(L, -1, "t_row");
    lua_remove(L, -2);
    lua_pushcclosure(L, t_index, 2);
    lua_setfield(L, -3, "__index");
    /* stack: metatable, methods */

    lua_newtable(L); /* the module */
    set_funcs(L, module_functions, "");
    lua_pushvalue(L, -2);
    lua_setfield(L, -2, "Tensor_methods");
    lua_pushvalue(L, -3);
    lua_setfield(L, -2, "Tensor");
    lua_pushliteral(L, FT_VERSION);
    lua_setfield(L, -2, "version");
    /* ft.dtypes: every dtype's name, in the order of ft_dtype */
    lua_createtable(L, FT_NUM_DTYPES, 0);
    for (int d = 0; d < FT_NUM_DTYPES; d++) {
        lua_pushstring(L, ft_dtype_name((ft_dtype)d));
        lua_rawseti(L, -2, d + 1);
    }
    lua_setfield(L, -2, "dtypes");

    /* the mods graph's metatable, and the op codes for flashtile.mods */
    new_class_metatable(L, MODS_MT);
    lua_pushcfunction(L, mods_gc);
    lua_setfield(L, -2, "__gc");
    lua_pop(L, 1);
    new_class_metatable(L, BLOCK_MASK_MT);
    lua_pushcfunction(L, block_mask_gc);
    lua_setfield(L, -2, "__gc");
    lua_pop(L, 1);
    lua_newtable(L);
    for (int op = 0; op < FT_MOD_OP_COUNT; op++) {
        lua_pushinteger(L, op);
        lua_setfield(L, -2, ft_mod_op_name(op));
    }
    lua_setfield(L, -2, "mod_ops");
    lua_pushinteger(L, FT_MOD_MAX_NODES);
    lua_setfield(L, -2, "mod_max_nodes");

    /* ft.cuda, and the event metatable */
    new_class_metatable(L, EVENT_MT);
    lua_newtable(L);
    set_funcs(L, event_methods, "");
    lua_setfield(L, -2, "__index");
    lua_pushcfunction(L, event_gc);
    lua_setfield(L, -2, "__gc");
    lua_newtable(L);
    set_funcs(L, event_close, "");
    lua_getfield(L, -1, "__close");
    lua_setfield(L, -3, "__close");
    lua_pop(L, 2);
    lua_newtable(L);
    set_funcs(L, cuda_functions, "cuda.");
    lua_setfield(L, -2, "cuda");
    open_dist(L);
    lua_setfield(L, -2, "dist");
    return 1;
}
