#!/usr/bin/env bash
# The GPU check: what only a GPU can show about a CUDA build, one line per check; sized for
# under 8 minutes on one H200 (not yet run on one: no GPU has been at hand). Run it on a GPU
# machine from the repository root:
#
#   regression/gpu/check.sh [BIN_DIR] [--no-bench]
#
# BIN_DIR holds the CUDA build's ptrain and its unit tests (test_*): a build folder
# (build-cuda, tests in build-cuda/regression) or a bundle's bin/ (regression/gpu/prepare.sh
# makes one for a machine without MPI, HDF5 or BLAS). Default: the folder of `ptrain` on PATH.
# One GPU is enough: runs of two ranks share it (backend%share_gpus) and their groups go
# through the staged MPI Comm. On a Slurm cluster:
#   srun -N1 -n1 --gpus=1 regression/gpu/check.sh build-cuda
#
# Checks:
#   unit     every CUDA unit test, at the rank counts its first line names (up to 4)
#   layouts  regression cases gpu_layouts (fp32 on grids of 1 and 2 ranks against the CPU fp64
#            reference, relative 1e-5) and gpu_fp32 (against the CPU fp32 reference)
#   bf16     input/tiny.nml in bf16 ends within 2% of the fp32 run's loss
#   share    two ranks on one GPU: refused (exit 2) without backend%share_gpus; with it one
#            line says NCCL needs one GPU per rank and every group uses MPI
#   bench    regression/bench/gpu.sh: GPT-2 124M and 350M in bf16 against PyTorch (--no-bench
#            leaves it out)
# Exit status: the number of failed checks. Logs go to $OUT (the device tool's) or a temp folder.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
bench=1
bin=
for a in "$@"; do
  case $a in
    --no-bench) bench=0 ;;
    *) bin=$a ;;
  esac
done
[ -n "$bin" ] || bin=$(dirname "$(command -v ptrain || echo ./ptrain)")
ptrain=$bin/ptrain
[ -x "$ptrain" ] || { echo "check.sh: no ptrain in $bin"; exit 2; }
tests=$bin
[ -d "$bin/regression" ] && tests=$bin/regression
logs=${OUT:-$(mktemp -d)}/gpu-check
mkdir -p "$logs"
mpirun=(mpirun --oversubscribe)
[ "$(id -u)" = 0 ] && mpirun+=(--allow-run-as-root)
failed=0
t_all=$SECONDS

# report NAME STATUS DETAIL T0: the check's one line
report() {
  printf '%-8s %-4s %s (%d s)\n' "$1" "$2" "$3" $((SECONDS - $4))
  [ "$2" = PASS ] || failed=$((failed + 1))
}

echo "gpu check: $("$ptrain" --version 2>&1) at $ptrain; logs in $logs"
command -v nvidia-smi >/dev/null && nvidia-smi -L | head -4

# --- unit: each test binary at each rank count of its source's first line --------------------
t0=$SECONDS
n=0 bad=()
for exe in "$tests"/test_*; do
  [ -x "$exe" ] || continue
  name=$(basename "$exe")
  src=regression/unit/$name.cpp
  nps=1
  [ -f "$src" ] && nps=$(head -1 "$src" | sed -n 's/.*np=\([0-9,]*\).*/\1/p' | tr , ' ')
  for np in ${nps:-1}; do
    [ "$np" -le 4 ] || continue
    n=$((n + 1))
    if ! timeout 300 "${mpirun[@]}" -np "$np" "$exe" >"$logs/$name.np$np.log" 2>&1; then
      bad+=("$name@np$np")
    fi
  done
done
if [ "$n" = 0 ]; then
  report unit FAIL "no test_* binaries in $tests (build with tests, or prepare.sh)" "$t0"
elif [ ${#bad[@]} = 0 ]; then
  report unit PASS "$n test runs" "$t0"
else
  report unit FAIL "${#bad[@]} of $n failed: ${bad[*]}" "$t0"
fi

# --- layouts: the GPU regression cases ------------------------------------------------------
t0=$SECONDS
# regression/run needs numpy (and h5py for the parameter sums, which it skips without)
python=python3
for p in python3 /usr/bin/python3; do "$p" -c 'import numpy' 2>/dev/null && { python=$p; break; }; done
if ! "$python" -c 'import numpy' 2>/dev/null; then
  report layouts FAIL "no python3 with numpy here: regression/run cannot compare" "$t0"
elif "$python" regression/run --ptrain "$ptrain" gpu_layouts gpu_fp32 >"$logs/layouts.log" 2>&1; then
  report layouts PASS "$(tail -1 "$logs/layouts.log")" "$t0"
else
  report layouts FAIL "$(grep -m3 '^FAIL' "$logs/layouts.log" | tr '\n' ' ')$(tail -1 "$logs/layouts.log")" "$t0"
fi

# --- bf16: tiny.nml in bf16 tracks fp32 within 2% -------------------------------------------
t0=$SECONDS
last_loss() { awk -F, 'NR > 1 { v = $2 } END { print v }' "$1/log.csv"; }
ok=1
for dtype in fp32 bf16; do
  "$ptrain" input/tiny.nml --set "backend%device='cuda'" --set "model%dtype='$dtype'" \
    --set run%out_dir="'$logs/tiny-$dtype'" >"$logs/tiny-$dtype.log" 2>&1 || ok=0
done
if [ "$ok" = 1 ]; then
  l32=$(last_loss "$logs/tiny-fp32") l16=$(last_loss "$logs/tiny-bf16")
  if awk -v a="$l32" -v b="$l16" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 0.02 * a) }'; then
    report bf16 PASS "final loss fp32 $l32, bf16 $l16" "$t0"
  else
    report bf16 FAIL "final loss fp32 $l32, bf16 $l16: more than 2% apart" "$t0"
  fi
else
  report bf16 FAIL "a tiny.nml run failed: $(cat "$logs"/tiny-*.log | tail -n 3 | tr '\n' ' ')" "$t0"
fi

# --- share: two ranks on the one GPU -------------------------------------------------------
# Refused without backend%share_gpus (exit 2, one line); with it, one line says NCCL needs one
# GPU per rank and every group is MPI.
t0=$SECONDS
two=("${mpirun[@]}" -np 2 "$ptrain" input/tiny.nml --set "backend%device='cuda'" --set run%steps=3)
rc=0
timeout 120 "${two[@]}" --set run%out_dir="'$logs/share-no'" >"$logs/share-no.log" 2>&1 || rc=$?
timeout 120 "${two[@]}" --set backend%share_gpus=.true. --set run%out_dir="'$logs/share'" \
  >"$logs/share.log" 2>&1 || rc2=$?
if [ "$rc" != 2 ] || ! grep -q "would share GPU" "$logs/share-no.log"; then
  report share FAIL "without share_gpus: exit $rc, $(tail -n 2 "$logs/share-no.log" | tr '\n' ' ')" "$t0"
elif [ "${rc2:-0}" != 0 ] || ! grep -q "NCCL needs one GPU per rank" "$logs/share.log"; then
  report share FAIL "with share_gpus: exit ${rc2:-0}, $(tail -n 2 "$logs/share.log" | tr '\n' ' ')" "$t0"
else
  report share PASS "$(grep -m1 '^comm:' "$logs/share.log")" "$t0"
fi

# --- bench ----------------------------------------------------------------------------------
if [ "$bench" = 1 ]; then
  t0=$SECONDS
  if regression/bench/gpu.sh "$ptrain" 10 >"$logs/bench.log" 2>&1; then
    report bench PASS "table below" "$t0"
  else
    report bench FAIL "$(tail -n 2 "$logs/bench.log" | tr '\n' ' ')" "$t0"
  fi
  cat "$logs/bench.log"
fi

echo "gpu check: $failed failed, $((SECONDS - t_all)) s"
exit "$failed"
