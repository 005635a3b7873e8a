#!/usr/bin/env bash
# regression/fuzz/run.sh TARGET SECONDS [BUILD_DIR] — builds a libFuzzer target with clang++
# (CMakeLists.txt here) and runs it for SECONDS on its seed corpus with its dictionary:
#   deck_fuzzer     the example and regression decks; the deck's group and key names from
#                   src/deck/schema.def
#   weights_fuzzer  weights files and checkpoints of a small model, written by the target
#                   itself (weights_fuzzer --write-seeds DIR: the C++ writers' files and copies
#                   in HDF5's earliest format); HDF5's block signatures, the names ptrain's
#                   files use, and a few integer patterns. An input running over 20 s is a
#                   finding (a hang). Inputs on which libhdf5 crashes by itself are skipped
#                   (weights_fuzzer.cpp says why); the first 20 are kept in BUILD_DIR/hdf5_crashes/.
#   index_fuzzer    Megatron index images (the data file's size, then the .idx) of every dtype,
#                   written by the target itself (index_fuzzer --write-seeds DIR); the magic,
#                   the dtype codes and a few integer patterns.
# Exits non-zero on a finding and leaves the input that found it in BUILD_DIR/findings/.
# Skips (exit 0) when clang++ is missing.
set -euo pipefail
target=${1:?usage: run.sh TARGET SECONDS [BUILD_DIR]}
seconds=${2:?usage: run.sh TARGET SECONDS [BUILD_DIR]}
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/../.." && pwd)
build=${3:-$src/build/fuzz}
case "$target" in
  deck_fuzzer | weights_fuzzer | index_fuzzer) ;;
  *) echo "run.sh: unknown target '$target' (deck_fuzzer, weights_fuzzer, index_fuzzer)" >&2; exit 2 ;;
esac
if ! command -v clang++ >/dev/null 2>&1; then
  echo "SKIP: clang++ not found (Debian: apt-get install clang)"; exit 0
fi
mkdir -p "$build/findings"
cmake -S "$here" -B "$build" -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang \
  >"$build/configure.log" 2>&1 || { cat "$build/configure.log"; exit 1; }
cmake --build "$build" --target "$target" -j "${JOBS:-2}" >"$build/build.log" 2>&1 \
  || { cat "$build/build.log"; exit 1; }

corpus=$(mktemp -d)
trap 'rm -rf "$corpus"' EXIT
dict="$build/$target.dict"
flags=()
case "$target" in
  deck_fuzzer)
    n=0
    for f in "$src"/input/*.nml "$src"/regression/cases/*/deck.nml; do cp "$f" "$corpus/seed$((n++)).nml"; done
    seeds="$n seed decks"
    {
      printf '%s\n' '"&"' '"$"' '"/"' '"&end"' '"$end"' '"="' '","' '";"' '"!"' '"*"' '"("' '")"' '":"' \
        '"\x27"' '"\x22"' '"\x0a"' '"\x00"' '".true."' '"F"' '"1.5-3"' '"1d-3"' '"2*"' '"%"'
      sed -n -e 's/^PTRAIN_GROUP_BEGIN(\([a-z_0-9]*\),.*/"\&\1"/p' \
             -e 's/^PTRAIN_KEY(\([a-z_0-9]*\), \([a-z_0-9]*\),.*/"\2"\n"\1%\2="/p' "$src/src/deck/schema.def"
    } >"$dict"
    ;;
  weights_fuzzer)
    export WEIGHTS_FUZZER_HDF5_CRASHES="${WEIGHTS_FUZZER_HDF5_CRASHES:-$build/hdf5_crashes}"
    # LeakSanitizer's scan of dynamic TLS (Open MPI's and HDF5's libraries have some) reads a
    # bogus range on this glibc and crashes its tracer at exit ("Tracer caught signal 11",
    # "DTLS 8 at 0x000000000c60-..." with LSAN_OPTIONS=verbosity=1), also for the code of
    # d79e677; without TLS as a root, leak checking stays on (an object only TLS holds would
    # be reported, not hidden).
    export LSAN_OPTIONS="use_tls=0${LSAN_OPTIONS:+:$LSAN_OPTIONS}"
    "$build/$target" --write-seeds "$corpus" >"$build/seeds.log" 2>&1 \
      || { cat "$build/seeds.log"; exit 1; }
    seeds="$(ls "$corpus" | wc -l) seed files"
    {
      printf '%s\n' '"\x89HDF\x0d\x0a\x1a\x0a"' '"OHDR"' '"OCHK"' '"TREE"' '"HEAP"' '"SNOD"' \
        '"GCOL"' '"FRHP"' '"FHDB"' '"FHIB"' '"FSHD"' '"FSSE"' '"BTHD"' '"BTIN"' '"BTLF"' \
        '"SMTB"' '"SMLI"' '"EAHD"' '"EAIB"' '"EADB"' '"FAHD"' '"FADB"' \
        '"format_version"' '"checksum_algorithm"' '"checksum"' '"deck"' '"model"' '"optim"' \
        '"state"' '"step"' '"consumed_samples"' '"optimizer_t"' '"seed"' '"lr"' '"1"' '"2"' \
        '"wte.weight"' '"wpe.weight"' '"ln_f.bias"' '"h.0.attn.qkv.weight"' '"h.0.mlp.fc.bias"' \
        '"\x00\x00\x00\x00\x00\x00\x00\x00"' '"\xff\xff\xff\xff\xff\xff\xff\xff"' \
        '"\xff\xff\xff\x7f"' '"\x00\x00\x00\x80"' '"\x01\x00\x00\x00"' '"\x10\x00\x00\x00"'
    } >"$dict"
    flags+=(-timeout=20)
    ;;
  index_fuzzer)
    "$build/$target" --write-seeds "$corpus" >"$build/seeds.log" 2>&1 \
      || { cat "$build/seeds.log"; exit 1; }
    seeds="$(ls "$corpus" | wc -l) seed files"
    printf '%s\n' '"MMIDIDX\x00\x00"' '"\x01\x00\x00\x00\x00\x00\x00\x00"' '"\x01"' '"\x02"' '"\x03"' \
      '"\x04"' '"\x05"' '"\x06"' '"\x07"' '"\x08"' '"\x00\x00\x00\x00\x00\x00\x00\x00"' \
      '"\xff\xff\xff\xff\xff\xff\xff\xff"' '"\xff\xff\xff\x7f"' '"\x00\x00\x00\x80"' >"$dict"
    ;;
esac
echo "fuzzing $target for ${seconds}s on $seeds"
run() {
  "$build/$target" -max_total_time="$seconds" -dict="$dict" -artifact_prefix="$build/findings/" \
    -print_final_stats=1 "${flags[@]}" "$corpus"
}
if [ "$target" = weights_fuzzer ]; then
  # ASan warns of each absurd allocation a damaged file makes libhdf5 ask for (malloc returns
  # NULL, HDF5 reports an error): not a finding, and thousands of lines. (pipefail: the
  # fuzzer's exit code is the pipeline's.)
  run 2>&1 | grep --line-buffered -v '^==[0-9]*==WARNING: AddressSanitizer failed to allocate 0x'
else
  run
fi
