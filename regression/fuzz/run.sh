#!/usr/bin/env bash
# regression/fuzz/run.sh TARGET SECONDS [BUILD_DIR] — builds a libFuzzer target with clang++
# (CMakeLists.txt here) and runs it for SECONDS on a seed corpus of the example and
# regression decks, with a dictionary of the deck's group and key names from
# src/deck/schema.def. Exits non-zero on a finding and leaves the input that found it in
# BUILD_DIR/findings/. Skips (exit 0) when clang++ is missing.
set -euo pipefail
target=${1:?usage: run.sh TARGET SECONDS [BUILD_DIR]}
seconds=${2:?usage: run.sh TARGET SECONDS [BUILD_DIR]}
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/../.." && pwd)
build=${3:-$src/build/fuzz}
if ! command -v clang++ >/dev/null 2>&1; then
  echo "SKIP: clang++ not found (Debian: apt-get install clang)"; exit 0
fi
mkdir -p "$build/findings"
cmake -S "$here" -B "$build" -DCMAKE_CXX_COMPILER=clang++ >"$build/configure.log" 2>&1 \
  || { cat "$build/configure.log"; exit 1; }
cmake --build "$build" --target "$target" -j "${JOBS:-2}" >"$build/build.log" 2>&1 \
  || { cat "$build/build.log"; exit 1; }

corpus=$(mktemp -d)
trap 'rm -rf "$corpus"' EXIT
n=0
for f in "$src"/input/*.nml "$src"/regression/cases/*/deck.nml; do cp "$f" "$corpus/seed$((n++)).nml"; done
dict="$build/deck.dict"
{
  printf '%s\n' '"&"' '"$"' '"/"' '"&end"' '"$end"' '"="' '","' '";"' '"!"' '"*"' '"("' '")"' '":"' \
    '"\x27"' '"\x22"' '"\x0a"' '"\x00"' '".true."' '"F"' '"1.5-3"' '"1d-3"' '"2*"' '"%"'
  sed -n -e 's/^PTRAIN_GROUP_BEGIN(\([a-z_0-9]*\),.*/"\&\1"/p' \
         -e 's/^PTRAIN_KEY(\([a-z_0-9]*\), \([a-z_0-9]*\),.*/"\2"\n"\1%\2="/p' "$src/src/deck/schema.def"
} >"$dict"
echo "fuzzing $target for ${seconds}s on $n seed decks"
"$build/$target" -max_total_time="$seconds" -dict="$dict" -artifact_prefix="$build/findings/" \
  -print_final_stats=1 "$corpus"
