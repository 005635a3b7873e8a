#!/usr/bin/env bash
# The Lmod modulefile: `make install` of this build into a temporary prefix, then in a clean
# bash with Lmod:
# `module use; module load ptrain; ptrain --version`, PTRAIN_ROOT, help and whatis, unload.
# The built-with module list (@MODULE_DEPS@) loads the modules Lmod can find and only warns
# about the others; empty (Makefile.inc's default MODULE_DEPS) it loads nothing.
# Lmod comes from Makefile.inc's DEBIAN_PACKAGES: without it the test skips, unless it runs as
# root (then it fails).
source "$(dirname "${BASH_SOURCE[0]}")/lib/prologue.sh"
lmod_init=
for f in "${LMOD_PKG:-/usr/share/lmod/lmod}/init/bash" /usr/share/lmod/lmod/init/bash; do
  if [ -r "$f" ]; then lmod_init=$f; break; fi
done
if [ -z "$lmod_init" ]; then
  [ "$(id -u)" = 0 ] && fail "Lmod not found (Debian package lmod)"
  echo "SKIP: modules: Lmod not found (Debian package lmod)"; exit 0
fi
build=$(dirname "$PTRAIN")
[ -f "$build/cmake_install.cmake" ] || fail "$build is not a CMake build folder (PTRAIN=$PTRAIN)"
prefix=$tmp/prefix

# 1. The real install target, on this build folder, with the build's own warning and guard
# settings (the Makefile's defaults would reconfigure it and rebuild every file).
cached() { sed -n "s/^$1:BOOL=//p" "$build/CMakeCache.txt"; }
install() {  # PREFIX [MODULE_DEPS]
  make -s -C "$PTRAIN_SOURCE_DIR" install BUILD_DIR="$build" PREFIX="$1" MODULE_DEPS="${2:-}" \
    WERROR="$(cached PTRAIN_WERROR)" DEVICE_GUARD="$(cached PTRAIN_DEVICE_GUARD)" \
    >"$tmp/install.log" 2>&1 || fail "make install: $(tail -5 "$tmp/install.log")"
}
install "$prefix"
v=$("$PTRAIN" --version | awk '{print $2}')
[ -n "$v" ] || fail "no version from $PTRAIN --version"
for f in bin/ptrain share/ptrain/input/tiny.nml share/ptrain/jobscripts/train.sbatch \
         share/ptrain/postprocess/plot_loss.py; do
  [ -e "$prefix/$f" ] || fail "install lacks $f"
done
# ptrain-tokenize beside ptrain (when the build has it: -DPTRAIN_TOKENIZER=ON, the default).
if [ -x "$(dirname "$PTRAIN")/ptrain-tokenize" ]; then
  "$prefix/bin/ptrain-tokenize" --help | grep -q "usage: ptrain-tokenize" ||
    fail "install lacks a working bin/ptrain-tokenize"
fi

# In a clean environment: only Lmod's own setup, a private HOME (Lmod's cache).
lmod() { env -i HOME="$tmp/home" PATH=/usr/bin:/bin LMOD_PKG="${lmod_init%/init/bash}" \
           bash -c "source '$lmod_init' >/dev/null; $1" 2>&1; }
mkdir -p "$tmp/home"

# 2. Load, run, unload.
out=$(lmod "module use '$prefix/share/modulefiles'
  module load ptrain || exit 1
  echo \"which=\$(command -v ptrain)\"; ptrain --version; echo \"root=\$PTRAIN_ROOT\"
  module whatis ptrain; module help ptrain
  module unload ptrain; echo \"after=\$(command -v ptrain || echo none) root=\${PTRAIN_ROOT:-unset}\"") ||
  fail "module load ptrain: $out"
grep -qx "which=$prefix/bin/ptrain" <<<"$out" || fail "ptrain not from the module: $out"
grep -qx "ptrain $v" <<<"$out" || fail "ptrain --version through the module: $out"
grep -qx "root=$prefix" <<<"$out" || fail "PTRAIN_ROOT: $out"
grep -q "Version: $v" <<<"$out" || fail "whatis: $out"
grep -q "ptrain --help-deck" <<<"$out" || fail "help: $out"
grep -qx "after=none root=unset" <<<"$out" || fail "unload left ptrain behind: $out"
! grep -q "@VERSION@\|@PREFIX@\|@MODULE_DEPS@" "$prefix/share/modulefiles/ptrain/$v.lua" ||
  fail "the installed modulefile still has a @...@ placeholder"
echo "modules: module load ptrain runs ptrain $v from $prefix"

# 3. Built-with modules: one that exists is loaded and unloaded with ptrain; a missing one
#    only warns.
mkdir -p "$tmp/site/ptrain-test-mpi"
printf 'setenv("PTRAIN_TEST_MPI", "loaded")\n' >"$tmp/site/ptrain-test-mpi/1.0.lua"
install "$tmp/deps" "ptrain-test-mpi/1.0 ptrain-test-missing/2.0"
out=$(lmod "module use '$tmp/site'; module use '$tmp/deps/share/modulefiles'
  module load ptrain || exit 1
  echo \"mpi=\${PTRAIN_TEST_MPI:-unset}\"; module -t list
  module unload ptrain; echo \"after=\${PTRAIN_TEST_MPI:-unset}\"") || fail "load with dependencies: $out"
grep -qx "mpi=loaded" <<<"$out" || fail "the available built-with module was not loaded: $out"
grep -q "ptrain-test-missing/2.0, which is not available" <<<"$out" || fail "no warning for a missing module: $out"
grep -qx "after=unset" <<<"$out" || fail "unloading ptrain kept its dependency: $out"
echo "modules: built-with modules load when available, warn when not"
