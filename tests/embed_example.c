/* host.c: two Lua states on two threads, flashtile's binding linked in. */
#include <lauxlib.h>
#include <lua.h>
#include <lualib.h>
#include <pthread.h>
#include <stdio.h>

int luaopen_flashtile_core(lua_State *L); /* lua/lflashtile.c, linked in */

static const char *lua_dir; /* holds flashtile/init.lua and the other Lua files */

static lua_State *new_state(void)
{
    lua_State *L = luaL_newstate();
    if (!L)
        return NULL;
    luaL_openlibs(L);
#if LUA_VERSION_NUM >= 502
    luaL_requiref(L, "flashtile.core", luaopen_flashtile_core, 0);
    lua_pop(L, 1);
#else /* Lua 5.1, LuaJIT */
    lua_getglobal(L, "package");
    lua_getfield(L, -1, "preload");
    lua_pushcfunction(L, luaopen_flashtile_core);
    lua_setfield(L, -2, "flashtile.core");
    lua_pop(L, 2);
#endif
    lua_getglobal(L, "package");
    lua_pushfstring(L, "%s/?.lua;%s/?/init.lua", lua_dir, lua_dir);
    lua_setfield(L, -2, "path");
    lua_pop(L, 1);
    return L;
}

static const char WORK[] =
    "local seed = ...\n"
    "local ft = require 'flashtile'\n"
    "ft.manual_seed(seed)              -- this state's generator only\n"
    "local q = ft.randn({2, 20, 4, 16}, {dtype = 'f64'})\n"
    "local k = ft.randn({2, 20, 2, 16}, {dtype = 'f64'})\n"
    "local v = ft.randn({2, 20, 2, 16}, {dtype = 'f64'})\n"
    "local out, lse = ft.attention(q, k, v, {causal = true})\n"
    "local dq = ft.attention_backward(ft.ones(out.shape, {dtype = 'f64'}), q, k, v, out, lse, {causal = true})\n"
    "return (out * out):sum(), (dq * dq):sum()\n";

static void *thread_main(void *arg) /* one lua_State per thread */
{
    int *seed = arg;
    lua_State *L = new_state();
    if (!L)
        return NULL;
    int st = luaL_loadstring(L, WORK);
    if (st == 0) {
        lua_pushinteger(L, *seed);
        st = lua_pcall(L, 1, 2, 0);
    }
    if (st != 0)
        fprintf(stderr, "seed %d: %s\n", *seed, lua_tostring(L, -1));
    else
        printf("seed %d: %.17g %.17g\n", *seed, lua_tonumber(L, -2), lua_tonumber(L, -1));
    lua_close(L); /* frees this state's tensors */
    return st == 0 ? arg : NULL;
}

int main(int argc, char **argv)
{
    lua_dir = argc > 1 ? argv[1] : "/usr/local/share/lua/5.4";
    int seeds[2] = {1, 2}, failed = 0;
    pthread_t threads[2];
    for (int i = 0; i < 2; i++)
        pthread_create(&threads[i], NULL, thread_main, &seeds[i]);
    for (int i = 0; i < 2; i++) {
        void *ok = NULL;
        pthread_join(threads[i], &ok);
        failed += ok == NULL;
    }
    return failed;
}
