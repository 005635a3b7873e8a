#!/usr/bin/env bash
# Build and install Kokkos 4 (host backends Serial + OpenMP, Release, shared libraries) from a
# source tarball, once: the install is a cache outside the repository, reused while its stamp
# names the same tarball. Prints the install prefix (for Kokkos_ROOT) on the last line.
#   .ci/kokkos4.sh TARBALL PREFIX [JOBS]
# e.g. .ci/kokkos4.sh ../shared/third_party/kokkos-4.6.01.tar.gz /opt/ptrain-deps/kokkos-4.6.01
set -euo pipefail
tarball=$(readlink -f "${1:?tarball}")
prefix=${2:?install prefix}
jobs=${3:-2}
stamp="$prefix/.ptrain-stamp"
want="$(basename "$tarball") $(stat -c %s "$tarball") Serial+OpenMP Release shared"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] &&
   [ -f "$prefix/lib/cmake/Kokkos/KokkosConfig.cmake" -o -f "$prefix/lib64/cmake/Kokkos/KokkosConfig.cmake" ]; then
  echo "kokkos4: cached install in $prefix ($want)" >&2
  echo "$prefix"; exit 0
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/ptrain-kokkos4.XXXXXX")
trap 'rm -rf "$work"' EXIT
echo "kokkos4: building $(basename "$tarball") into $prefix (-j$jobs)" >&2
tar xzf "$tarball" -C "$work"
src=$(find "$work" -mindepth 1 -maxdepth 1 -type d | head -1)
rm -rf "$prefix"
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_STANDARD=17 \
  -DCMAKE_CXX_COMPILER="${CXX:-g++}" -DCMAKE_INSTALL_PREFIX="$prefix" -DBUILD_SHARED_LIBS=ON \
  -DKokkos_ENABLE_SERIAL=ON -DKokkos_ENABLE_OPENMP=ON -DKokkos_ENABLE_TESTS=OFF \
  -DKokkos_ENABLE_EXAMPLES=OFF >"$work/configure.log" 2>&1 || { cat "$work/configure.log" >&2; exit 1; }
cmake --build "$work/build" -j "$jobs" >"$work/build.log" 2>&1 || { tail -50 "$work/build.log" >&2; exit 1; }
cmake --install "$work/build" >/dev/null
echo "$want" >"$stamp"
echo "kokkos4: installed in $prefix" >&2
echo "$prefix"
