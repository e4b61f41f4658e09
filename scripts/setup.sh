# Sourced by scripts/test, scripts/demo and scripts/ftlua: finds what
# flashtile needs to build and test, installs what is missing (apt-get, when
# run as root on a Debian-like system; otherwise prints the exact command
# and stops), then configures and builds in $FT_BUILD_DIR (default: build/).
#
# Needs: CMake (CMakeLists.txt's minimum, 3.25 for the CUDA backend's 90a),
# a C compiler with the C library's headers, ninja or make, pkg-config, the
# Lua chosen by FT_LUA with its headers, busted runnable under that Lua, and
# CBLAS (cblas.h and libopenblas or libcblas, which is what CMakeLists.txt
# looks for).
#
#   FT_LUA=5.1|5.2|5.3|5.4|luajit   the Lua flashtile is built and tested for
#                                   (default 5.4; given to CMake as -DFT_LUA)
#
# Every check looks for the thing itself, not for a package, so the same
# script works where things came by other means (a GPU machine's own Lua and
# busted in PATH, a CMake from cmake.org); only what is missing is named,
# by its Debian package (the same names on Ubuntu 24.04). Headers and
# libraries are looked for where CMake's find_path and find_library look
# (CMAKE_PREFIX_PATH, the prefixes of PATH's directories, /usr/local, /usr,
# with the multiarch subdirectories), so no compiler is needed to decide
# what is missing: on a bare machine every package is named on the first
# pass. A reference BLAS alone (libblas-dev: a cblas.h but no libopenblas
# or libcblas) is not enough for CMakeLists.txt, and is not taken for CBLAS.
#
# CMake: the version CMakeLists.txt's cmake_minimum_required names (3.18
# today), or 3.25 where the CUDA backend will be built for an
# architecture-specific target such as the default 90a (nvcc found and
# FT_CUDA not OFF), which CMakeLists.txt checks too. The first cmake in PATH
# that is new enough is used (FT_CMAKE, and the ctest beside it). When there
# is none, cmake is among the missing packages and, as root, Debian's cmake
# is installed (3.25 on Debian 12, 3.28 on Ubuntu 24.04) even where an older
# one stays first in PATH. If apt's own cmake is older than needed too
# (Ubuntu 20.04's 3.16; Debian 11's 3.18 or Ubuntu 22.04's 3.22 with CUDA),
# the other packages are installed, cmake is not, and a message says so:
# install a newer CMake (backports, Kitware's apt repository, cmake.org)
# first in PATH and run again.

ft_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
FT_BUILD_DIR=${FT_BUILD_DIR:-$ft_root/build}
# a relative FT_BUILD_DIR is taken from where the command was started
case $FT_BUILD_DIR in /*) ;; *) FT_BUILD_DIR=$PWD/$FT_BUILD_DIR ;; esac
FT_LUA=${FT_LUA:-5.4}
FT_CMAKE_MIN=$(sed -n 's/^cmake_minimum_required(VERSION \([0-9]*\.[0-9]*\).*/\1/p' "$ft_root/CMakeLists.txt" 2>/dev/null)
FT_CMAKE_MIN=${FT_CMAKE_MIN:-3.18}

case $FT_LUA in
  5.1|5.2|5.3|5.4|luajit) ;;
  *) echo "flashtile: FT_LUA=$FT_LUA: expected one of 5.1, 5.2, 5.3, 5.4, luajit" >&2
     return 1 ;;
esac

# ---- where CMake looks ------------------------------------------------------

# The multiarch directory name (x86_64-linux-gnu), as CMake's
# CMAKE_LIBRARY_ARCHITECTURE; from gcc when there is one, else from uname.
ft_multiarch() {
  local c m
  for c in gcc cc; do
    if command -v "$c" >/dev/null 2>&1; then
      m=$("$c" -print-multiarch 2>/dev/null || true)
      if [ -n "$m" ]; then echo "$m"; return 0; fi
    fi
  done
  m=$(uname -m)
  case $m in
    x86_64) echo x86_64-linux-gnu ;;
    aarch64|arm64) echo aarch64-linux-gnu ;;
    armv7*|armv6*) echo arm-linux-gnueabihf ;;
    i?86) echo i386-linux-gnu ;;
    ppc64le) echo powerpc64le-linux-gnu ;;
    *) echo "$m-linux-gnu" ;;
  esac
}

# The install prefixes CMake's find_* commands search, one per line:
# CMAKE_PREFIX_PATH, each PATH directory (its parent for .../bin and
# .../sbin), then /usr/local, /usr and /.
ft_prefixes() {
  local IFS=: d
  for d in ${CMAKE_PREFIX_PATH:-}; do [ -n "$d" ] && echo "$d"; done
  for d in $PATH; do
    case $d in
      "") ;;
      */bin|*/sbin) d=${d%/*}; echo "${d:-/}" ;;
      *) echo "$d" ;;
    esac
  done
  printf '%s\n' /usr/local /usr /
}

# ft_find_header NAME [SUFFIX...]: prints the directory holding NAME, as
# find_path(... NAME PATH_SUFFIXES SUFFIX...) would find it.
ft_find_header() {
  local name=$1 p d s arch
  shift
  arch=$(ft_multiarch)
  while read -r p; do
    p=${p%/}
    for d in "$p/include/$arch" "$p/include"; do
      for s in "" "$@"; do
        if [ -e "$d${s:+/$s}/$name" ]; then echo "$d${s:+/$s}"; return 0; fi
      done
    done
  done <<< "$(ft_prefixes)"
  return 1
}

# ft_find_library NAME...: prints the first lib<NAME>.so or .a found, as
# find_library(... NAMES NAME...) would find it.
ft_find_library() {
  local p d n e arch dirs
  arch=$(ft_multiarch)
  while read -r p; do
    p=${p%/}
    dirs=("$p/lib/$arch" "$p/lib")
    # CMake searches lib64 except on Debian and its derivatives.
    [ -e /etc/debian_version ] || dirs+=("$p/lib64")
    for d in "${dirs[@]}"; do
      for n in "$@"; do
        for e in so a; do
          if [ -e "$d/lib$n.$e" ]; then echo "$d/lib$n.$e"; return 0; fi
        done
      done
    done
  done <<< "$(ft_prefixes)"
  return 1
}

# ---- the checks -------------------------------------------------------------

ft_version_ok() { # ft_version_ok HAVE MIN: is version HAVE >= MIN (major.minor)?
  local a b c d rest
  IFS=. read -r a b rest <<< "$1"
  IFS=. read -r c d rest <<< "$2"
  [[ $a =~ ^[0-9]+$ && $b =~ ^[0-9]+$ ]] || return 1
  [ "$a" -gt "$c" ] || { [ "$a" -eq "$c" ] && [ "$b" -ge "$d" ]; }
}

ft_cmake_version() { # the "3.25.1" of `cmake --version`
  "$1" --version 2>/dev/null | sed -n 's/^cmake version \([0-9][0-9.]*\).*/\1/p'
}

# The CMake version this build needs: FT_CMAKE_MIN, or 3.25 when CMake will
# find nvcc and build for an architecture-specific target (90a).
ft_cmake_needed() {
  local archs cached=""
  if [ "$(echo "${FT_CUDA:-AUTO}" | tr a-z A-Z)" != OFF ] &&
     { [ -n "${CUDACXX:-}" ] || command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; }; then
    [ -f "$FT_BUILD_DIR/CMakeCache.txt" ] &&
      cached=$(sed -n 's/^FT_CUDA_ARCHS:[A-Z]*=//p' "$FT_BUILD_DIR/CMakeCache.txt")
    archs=${FT_CUDA_ARCHS:-${cached:-80;90a}}
    if [[ $archs =~ [0-9]a ]] && ! ft_version_ok "$FT_CMAKE_MIN" 3.25; then
      echo 3.25; return 0
    fi
  fi
  echo "$FT_CMAKE_MIN"
}

# Sets FT_CMAKE (and FT_CTEST) to the first cmake in PATH that is new enough.
ft_find_cmake() {
  local c v need
  need=$(ft_cmake_needed)
  while read -r c; do
    v=$(ft_cmake_version "$c")
    if ft_version_ok "$v" "$need" && [ -x "$(dirname "$c")/ctest" ]; then
      FT_CMAKE=$c
      FT_CTEST=$(dirname "$c")/ctest
      return 0
    fi
  done <<< "$(type -ap cmake)"
  return 1
}

ft_have_compiler() {
  local c
  for c in "${CC:-}" cc gcc clang; do
    [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && return 0
  done
  return 1
}

# The C library's headers: asked of the compiler when there is one, else
# where Debian's libc6-dev puts them.
ft_have_libc_headers() {
  local c
  for c in "${CC:-}" cc gcc clang; do
    if [ -n "$c" ] && command -v "$c" >/dev/null 2>&1; then
      printf '#include <stdio.h>\n' | "$c" -E -x c - >/dev/null 2>&1
      return
    fi
  done
  [ -e /usr/include/stdio.h ]
}

# Sets FT_LUA_BIN to the interpreter of FT_LUA, found under the names
# cmake/lua.cmake looks for (lua5.4, lua-5.4, lua54; luajit), or as a plain
# `lua` of that version.
ft_find_lua() {
  local c names
  if [ "$FT_LUA" = luajit ]; then
    if command -v luajit >/dev/null 2>&1 &&
       [ "$(luajit -e 'io.write(jit and "jit" or "")' 2>/dev/null)" = jit ]; then
      FT_LUA_BIN=$(command -v luajit); return 0
    fi
    return 1
  fi
  for c in "lua$FT_LUA" "lua-$FT_LUA" "lua${FT_LUA/./}" lua; do
    if command -v "$c" >/dev/null 2>&1 &&
       [ "$("$c" -e 'io.write(_VERSION)' 2>/dev/null)" = "Lua $FT_LUA" ]; then
      FT_LUA_BIN=$(command -v "$c"); return 0
    fi
  done
  return 1
}

# Kept for scripts/gpu-check: finds the interpreter of FT_LUA and leaves its
# path in FT_LUA. New code: ft_find_lua and $FT_LUA_BIN.
ft_have_lua54() { ft_find_lua && FT_LUA=$FT_LUA_BIN; }

# Is DIR/lua.h the header of FT_LUA (for LuaJIT: of API 5.1, luajit.h beside it)?
ft_lua_header_is() {
  local dir=$1 num
  num=$(sed -n 's/^#define[[:space:]]*LUA_VERSION_NUM[[:space:]]*\([0-9]*\).*/\1/p' "$dir/lua.h" 2>/dev/null)
  if [ "$FT_LUA" = luajit ]; then
    [ "$num" = 501 ] && [ -e "$dir/luajit.h" ]
  else
    [ "$num" = "${FT_LUA/./0}" ] && [ ! -e "$dir/luajit.h" ]
  fi
}

# Lua's headers, of the version FT_LUA names, where cmake/lua.cmake looks:
# pkg-config's modules, then lua.h (luajit.h) under the usual names, then a
# bare include/lua.h. (The module links no liblua: the interpreter provides
# Lua's symbols.)
ft_have_lua_dev() {
  local v=$FT_LUA c=${FT_LUA/./} m d dir
  local modules=("lua$v" "lua-$v" "lua$c") header=lua.h suffixes=("lua$v" "lua-$v" "lua$c")
  if [ "$v" = luajit ]; then
    modules=(luajit) header=luajit.h suffixes=(luajit-2.1 luajit-2.0 luajit)
  fi
  if command -v pkg-config >/dev/null 2>&1; then
    for m in "${modules[@]}"; do
      pkg-config --exists "$m" 2>/dev/null || continue
      for d in $(pkg-config --cflags-only-I "$m" 2>/dev/null) "-I$(pkg-config --variable=includedir "$m" 2>/dev/null)"; do
        d=${d#-I}
        if [ -n "$d" ] && [ -e "$d/$header" ] && ft_lua_header_is "$d"; then return 0; fi
      done
    done
  fi
  dir=$(ft_find_header "$header" "${suffixes[@]}") && ft_lua_header_is "$dir" && return 0
  dir=$(ft_find_header lua.h) && ft_lua_header_is "$dir"
}

# busted as cmake/specs.cmake runs it: a Lua script (Debian's) runs under the
# chosen interpreter, which must find busted's modules; a shell wrapper (as
# luarocks installs it) runs as it is.
ft_have_busted() {
  local b first
  b=$(command -v busted 2>/dev/null) || return 1
  IFS= read -r first < "$b" || true
  case $first in
    *lua*) ft_find_lua && "$FT_LUA_BIN" -e "require 'busted.runner'" >/dev/null 2>&1 ;;
    *) return 0 ;;
  esac
}

# CBLAS as CMakeLists.txt finds it: cblas.h (also under openblas/) and a
# library named openblas or cblas.
ft_have_cblas() {
  ft_find_header cblas.h openblas >/dev/null && ft_find_library openblas cblas >/dev/null
}

# The Debian packages of FT_LUA's interpreter and of its header and library.
ft_lua_packages() {
  case $FT_LUA in
    5.1) echo lua5.1 liblua5.1-0-dev ;;
    luajit) echo luajit libluajit-5.1-dev ;;
    *) echo "lua$FT_LUA liblua$FT_LUA-dev" ;;
  esac
}

# Every missing package, by its Debian name, in one pass.
ft_missing_packages() {
  local missing=() lua_pkgs
  read -r -a lua_pkgs <<< "$(ft_lua_packages)"
  ft_find_cmake || missing+=(cmake)
  ft_have_compiler || missing+=(gcc)
  ft_have_libc_headers || missing+=(libc6-dev)
  command -v ninja >/dev/null 2>&1 || command -v make >/dev/null 2>&1 || missing+=(ninja-build)
  command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
  ft_find_lua || missing+=("${lua_pkgs[0]}")
  ft_have_lua_dev || missing+=("${lua_pkgs[1]}")
  ft_have_busted || missing+=(lua-busted)
  ft_have_cblas || missing+=(libopenblas-dev)
  echo "${missing[@]}"
}

# The version of cmake apt would install ("" when apt does not know).
ft_apt_cmake_version() {
  command -v apt-cache >/dev/null 2>&1 || return 0
  apt-cache policy cmake 2>/dev/null |
    sed -n 's/^ *Candidate: *\([0-9]*:\)\{0,1\}\([0-9][0-9.]*\).*/\2/p'
}

ft_cmake_too_old_message() { # ft_cmake_too_old_message APT_VERSION
  local c found=""
  while read -r c; do
    if [ -n "$c" ]; then found+=" $c ($(ft_cmake_version "$c"))"; fi
  done <<< "$(type -ap cmake)"
  echo "flashtile: CMake >= $(ft_cmake_needed) is needed;${found:+ found$found;} apt's cmake here is $1." >&2
  echo "  Install a newer CMake (Debian 12 and Ubuntu 24.04 ship one; elsewhere backports," >&2
  echo "  Kitware's apt repository or a release from cmake.org), put it in PATH, and run again." >&2
}

# Sets ft_apt_missing to MISSING, less cmake when apt's cmake is older than
# the minimum (ft_apt_cmake_old is then its version, else empty).
ft_drop_old_apt_cmake() { # ft_drop_old_apt_cmake MISSING
  local v p out=()
  ft_apt_missing=$1
  ft_apt_cmake_old=""
  if [[ " $1 " == *" cmake "* ]]; then
    v=$(ft_apt_cmake_version)
    if [ -n "$v" ] && ! ft_version_ok "$v" "$(ft_cmake_needed)"; then
      ft_apt_cmake_old=$v
      for p in $1; do [ "$p" = cmake ] || out+=("$p"); done
      ft_apt_missing="${out[*]}"
    fi
  fi
}

# On Ubuntu, ninja-build, lua5.x, lua-busted and libopenblas-dev are in universe.
ft_universe_hint() {
  if grep -qs '^ID=ubuntu' /etc/os-release; then
    echo "  (on Ubuntu, several of these are in the universe component: enable it with" >&2
    echo "  'add-apt-repository universe' or in /etc/apt/sources.list.d/, then run again)" >&2
  fi
}

ft_install_missing() {
  local missing errors rc=0
  missing=$(ft_missing_packages)
  [ -z "$missing" ] && return 0
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq || echo "flashtile: apt-get update failed; trying with the package lists there are" >&2
    ft_drop_old_apt_cmake "$missing"
    missing=$ft_apt_missing
    if [ -n "$missing" ]; then
      echo "flashtile: installing $missing"
      # apt's own errors are shown; debconf's note about apt-utils is not.
      errors=$(mktemp)
      # shellcheck disable=SC2086
      apt-get install -y -qq --no-install-recommends $missing >/dev/null 2>"$errors" || rc=$?
      grep -v '^debconf: delaying package configuration' "$errors" >&2 || true
      rm -f "$errors"
      if [ "$rc" != 0 ]; then
        echo "flashtile: apt-get install $missing failed" >&2
        ft_universe_hint
        return 1
      fi
    fi
    missing=$(ft_missing_packages)
    [ -z "$missing" ] && return 0
    if [ "$missing" = cmake ] && [ -n "$ft_apt_cmake_old" ]; then
      ft_cmake_too_old_message "$ft_apt_cmake_old"
      return 1
    fi
    echo "flashtile: still missing after apt-get: $missing" >&2
    return 1
  fi
  echo "flashtile: missing: $missing" >&2
  if command -v apt-get >/dev/null 2>&1; then
    ft_drop_old_apt_cmake "$missing"
    missing=$ft_apt_missing
    [ -z "$missing" ] || echo "install them with:  sudo apt-get install $missing" >&2
    [ -z "$ft_apt_cmake_old" ] || ft_cmake_too_old_message "$ft_apt_cmake_old"
  else
    echo "install them with your package manager (Debian names above), then run again" >&2
  fi
  return 1
}

# ---- configure and build ----------------------------------------------------

ft_build() { # ft_build [extra cmake args...]
  local gen=()
  ft_find_cmake || { echo "flashtile: no cmake >= $(ft_cmake_needed) in PATH" >&2; return 1; }
  command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
  if [ ! -f "$FT_BUILD_DIR/CMakeCache.txt" ]; then
    "$FT_CMAKE" -S "$ft_root" -B "$FT_BUILD_DIR" "${gen[@]}" -DFT_LUA="$FT_LUA" "$@" || return 1
  else
    "$FT_CMAKE" "$FT_BUILD_DIR" -DFT_LUA="$FT_LUA" "$@" >/dev/null || return 1
  fi
  "$FT_CMAKE" --build "$FT_BUILD_DIR" --parallel "$(nproc 2>/dev/null || echo 2)"
}

# The environment that makes `require "flashtile"` load this build.
ft_lua_env() {
  export LUA_PATH="$ft_root/lua/?.lua;$ft_root/lua/?/init.lua;${LUA_PATH:-;}"
  export LUA_CPATH="$FT_BUILD_DIR/?.so;${LUA_CPATH:-;}"
}

# ---- the specs' totals ------------------------------------------------------

# ft_spec_summary LOG [PENDING_FILE]: busted's totals over every spec in a
# ctest log (Testing/Temporary/LastTest.log, which holds every test's output,
# passing or not): one line of sums, then the pending specs grouped by file
# and reason, the specs with failures or errors, and any spec run that
# printed no totals (a crash). Every pending test, with its name, goes to
# PENDING_FILE when given. Returns 1 when any spec failed, errored or crashed.
ft_spec_summary() {
  local log=$1 pending_file=${2:-/dev/null}
  [ -f "$log" ] || { echo "busted: no ctest log at $log"; return 1; }
  awk -v pending_file="$pending_file" '
    function finish() {
      if (test != "" && busted && !totals) { crashed = crashed " " test }
      test = ""; busted = 0; totals = 0; state = 0
    }
    /^[0-9]+\/[0-9]+ Test: / { finish(); test = $3; next }
    test == "" { next }
    /^Command: / { if ($0 ~ /busted/) { busted = 1; runs++ } next }
    /^<end of output>$/ { state = 0; next }
    /^[0-9]+ success(es)? \/ [0-9]+ failures? \/ [0-9]+ errors? \/ [0-9]+ pending : / {
      totals = 1
      s += $1; f += $4; e += $7; p += $10
      if ($4 + $7 > 0) bad = bad sprintf("  %s: %d failures, %d errors\n", test, $4, $7)
      next
    }
    /^Pending / { state = 1; next }
    state == 1 { name = $0; state = 2; next }
    state == 2 {
      reason = $0
      sub(/^[^ ]*:[0-9]+: /, "", reason)
      if (reason == "") reason = "(no reason given)"
      key = test SUBSEP reason
      if (!(key in count)) order[++groups] = key
      count[key]++
      printf "%s: %s: %s\n", test, name, reason > pending_file
      state = 0
      next
    }
    END {
      finish()
      if (runs == 0) { print "busted: no spec ran"; exit 0 }
      printf "busted, %d spec runs: %d successes / %d failures / %d errors / %d pending\n", runs, s, f, e, p
      for (i = 1; i <= groups; i++) {
        split(order[i], kr, SUBSEP)
        printf "  pending %4d  %-22s %s\n", count[order[i]], kr[1], kr[2]
      }
      if (bad != "") printf "specs with failures or errors:\n%s", bad
      if (crashed != "") printf "spec runs without busted totals (crashed?):%s\n", crashed
      exit (f + e > 0 || crashed != "") ? 1 : 0
    }' "$log"
}
