# Sourced by scripts/test and scripts/demo: finds what flashtile needs to
# build and test, installs what is missing (apt-get, when run as root on a
# Debian-like system; otherwise prints the exact command and stops), then
# configures and builds in $FT_BUILD_DIR (default: build/).
#
# Needs: cmake (>= 3.24), a C compiler, ninja or make, Lua 5.4 with its
# headers, busted, and CBLAS (OpenBLAS).

ft_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
FT_BUILD_DIR=${FT_BUILD_DIR:-$ft_root/build}

ft_have_cmake() {
  command -v cmake >/dev/null 2>&1 || return 1
  local v
  v=$(cmake --version | sed -n 's/^cmake version \([0-9]*\)\.\([0-9]*\).*/\1 \2/p')
  set -- $v
  [ "${1:-0}" -gt 3 ] || { [ "${1:-0}" -eq 3 ] && [ "${2:-0}" -ge 24 ]; }
}

ft_have_lua54() {
  local lua
  for lua in lua5.4 lua; do
    if command -v "$lua" >/dev/null 2>&1 &&
       [ "$("$lua" -e 'io.write(_VERSION)' 2>/dev/null)" = "Lua 5.4" ]; then
      FT_LUA=$(command -v "$lua")
      return 0
    fi
  done
  return 1
}

ft_compiles() { # ft_compiles HEADER [CFLAGS...]: can the C compiler see it?
  local header=$1; shift
  printf '#include <%s>\n' "$header" | cc -E "$@" - >/dev/null 2>&1
}

ft_lua_cflags() {
  pkg-config --cflags lua5.4 2>/dev/null || echo "-I/usr/include/lua5.4"
}

ft_missing_packages() {
  local missing=()
  ft_have_cmake || missing+=(cmake)
  command -v cc >/dev/null 2>&1 || missing+=(gcc libc6-dev)
  command -v ninja >/dev/null 2>&1 || command -v make >/dev/null 2>&1 || missing+=(ninja-build)
  command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
  ft_have_lua54 || missing+=(lua5.4)
  command -v cc >/dev/null 2>&1 && { ft_compiles lua.h $(ft_lua_cflags) || missing+=(liblua5.4-dev); }
  command -v busted >/dev/null 2>&1 || missing+=(lua-busted)
  command -v cc >/dev/null 2>&1 && { ft_compiles cblas.h || missing+=(libopenblas-dev); }
  echo "${missing[@]}"
}

ft_install_missing() {
  local missing
  missing=$(ft_missing_packages)
  [ -z "$missing" ] && return 0
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "flashtile: installing $missing"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq --no-install-recommends $missing >/dev/null ||
      { echo "flashtile: apt-get install failed" >&2; return 1; }
    missing=$(ft_missing_packages)
    [ -z "$missing" ] && return 0
    echo "flashtile: still missing after apt-get: $missing" >&2
    return 1
  fi
  echo "flashtile: missing: $missing" >&2
  if command -v apt-get >/dev/null 2>&1; then
    echo "install them with:  sudo apt-get install $missing" >&2
  else
    echo "install them with your package manager (Debian names above), then run again" >&2
  fi
  return 1
}

ft_build() { # ft_build [extra cmake args...]
  local gen=()
  command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
  if [ ! -f "$FT_BUILD_DIR/CMakeCache.txt" ]; then
    cmake -S "$ft_root" -B "$FT_BUILD_DIR" "${gen[@]}" "$@" || return 1
  else
    cmake "$FT_BUILD_DIR" "$@" >/dev/null || return 1
  fi
  cmake --build "$FT_BUILD_DIR" --parallel "$(nproc 2>/dev/null || echo 2)"
}

# The environment that makes `require "flashtile"` load this build.
ft_lua_env() {
  export LUA_PATH="$ft_root/lua/?.lua;$ft_root/lua/?/init.lua;${LUA_PATH:-;}"
  export LUA_CPATH="$FT_BUILD_DIR/?.so;${LUA_CPATH:-;}"
}
