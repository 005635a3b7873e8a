#!/usr/bin/env bash
# Prepares the GPU check for a GPU machine that has CUDA's libraries but no MPI, HDF5 or BLAS:
# builds the CUDA variant with its unit tests here, then bundles ptrain and the tests with
# their runtime (Open MPI, HDF5, OpenBLAS) by the device kit's make-bundle.sh.
#
#   regression/gpu/prepare.sh [KIT]      KIT: the device kit folder (default ../shared/device,
#                                        or PTRAIN_DEVICE_KIT); CUDA_HOME (default /usr/local/cuda)
#
# Leaves build-cuda/ and .devkit/ (git-ignored) and prints the command to run there.
# ARCH_FLAGS is portable x86-64-v2 (the GPU machine's CPU is not this one's).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
kit=${1:-${PTRAIN_DEVICE_KIT:-$root/../shared/device}}
cuda=${CUDA_HOME:-/usr/local/cuda}
deps=${PTRAIN_DEPS:-/opt/ptrain-deps}
for need in "$kit/unpack-kokkos-cuda.sh" "$kit/make-bundle.sh" "$kit/run-on-device.sh" "$cuda/bin/nvcc"; do
  [ -e "$need" ] || { echo "prepare.sh: $need missing (KIT=$kit, CUDA_HOME=$cuda)" >&2; exit 2; }
done
mkdir -p "$deps" 2>/dev/null && [ -w "$deps" ] || deps=$HOME/.cache/ptrain-deps
[ -d "$deps/kokkos-cuda" ] || "$kit/unpack-kokkos-cuda.sh" "$deps"
make build ENABLE_CUDA=ON CUDA_HOME="$cuda" KOKKOS_ROOT="$deps/kokkos-cuda" BUILD_DIR=build-cuda \
  ARCH_FLAGS=-march=x86-64-v2
grep -qx '/.devkit/' .git/info/exclude 2>/dev/null || echo /.devkit/ >>.git/info/exclude
mkdir -p .devkit
cp "$kit/run-on-device.sh" .devkit/
out=$(mktemp -d)/ptrain-bundle
"$kit/make-bundle.sh" "$out" build-cuda/ptrain build-cuda/regression/test_*
cp "$out.tar.gz" .devkit/
echo "prepare.sh: .devkit/ptrain-bundle.tar.gz ($(du -h .devkit/ptrain-bundle.tar.gz | cut -f1)); on the GPU machine:"
echo "  bash .devkit/run-on-device.sh .devkit/ptrain-bundle.tar.gz -- regression/gpu/check.sh"
