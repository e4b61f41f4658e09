-- flashtile as a rock. In a clone of the repository:
--
--   luarocks make                          (as root: into /usr/local)
--   luarocks make --tree=DIR               (then: eval "$(luarocks path --tree=DIR)")
--   luarocks --lua-version=5.4 make        (for another Lua than luarocks's default)
--
-- CMake builds it (cmake 3.18 or newer, a C compiler, OpenBLAS: Debian's
-- cmake, gcc, libopenblas-dev). The C library is linked into the module
-- (flashtile/core.so needs no libflashtile.so); the CUDA backend is built
-- when nvcc is found, unless FT_CUDA=OFF is in the environment. No tests
-- are built.
rockspec_format = "3.0"
package = "flashtile"
version = "scm-1"
source = {
   url = "git+file://.",
}
description = {
   summary = "Tiled FlashAttention-style attention kernels (CPU and CUDA) with N-d tensors",
   detailed = [[
flashtile is a C library of tiled attention kernels in the manner of
FlashAttention (online softmax in the forward pass, recomputation from the
saved log-sum-exp in the backward pass) for CUDA GPUs and the CPU, with a
Lua module of tensor userdata, layers, optimisers, gradient checks and
timing.
]],
}
dependencies = {
   "lua >= 5.1, < 5.5",
}
build = {
   type = "cmake",
   variables = {
      CMAKE_BUILD_TYPE = "Release",
      CMAKE_INSTALL_PREFIX = "$(PREFIX)",
      -- the Lua luarocks builds for: its headers decide the version
      FT_LUA_INCDIR = "$(LUA_INCDIR)",
      -- the rock's own directories, which luarocks deploys into the tree
      FT_INSTALL_LMOD = "$(LUADIR)",
      FT_INSTALL_CMOD = "$(LIBDIR)",
      FT_MODULE_STATIC = "ON",
      FT_INSTALL_LIBRARY = "OFF",
      FT_BUILD_TESTS = "OFF",
   },
}
