#!/usr/bin/env bash
# Benchmark: the precision policy at GPT-2 124M shapes (vocab 50304, B=4, T=256, AdamW), one
# rank with two BLAS threads. Each round runs, back to back on the same machine,
#   before  an earlier ptrain build, fp32 (BEFORE=path; skipped when not given): the step
#           time the precision split must not move;
#   fp32    this build, fp32;
#   bf16    this build, bf16 compute with fp32 masters, moments and gradients;
#   bf16g   this build, bf16 with bf16 gradients (parallel%grad_dtype = 'bf16');
# and prints s/step (the mean of the steps after the first), each run's time over this
# build's fp32 in the same round, and rank 0's peak memory of the categories the policy
# changes (params, grads, activations) from the run's last log line. Then the median and
# range of the ratios over ROUNDS rounds (default 3: a shared machine's speed drifts).
#   [ROUNDS=n] [BEFORE=old/ptrain] regression/bench/precision.sh [build/ptrain] [steps]
# bf16 is not expected to be faster here: with no bf16 instructions the gemm widens
# panels to fp32 for sgemm; what it must show is the memory halved.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
rounds=${ROUNDS:-3}
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "precision.sh: ROUNDS=$rounds is not a positive integer" >&2; exit 1; }
native=(env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OPENBLAS_THREAD_TIMEOUT=4 OMP_WAIT_POLICY=PASSIVE)

# one NAME BINARY [--set ...]: prints "s/step params grads activations" (MiB)
one() {
  local name=$1 bin=$2; shift 2
  "${native[@]}" "${mpirun[@]}" --bind-to none -np 1 "$bin" "$deck" "${shape[@]}" \
    --set train%micro_batch=4 --set backend%blas_threads=2 --set backend%peak_gflops=100 \
    --set run%out_dir="'$tmp/$name'" "$@" >"$tmp/$name.log" 2>&1 ||
    { tail -5 "$tmp/$name.log" >&2; exit 1; }
  local step mem
  step=$(awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
                  NR > 2 { s += $col["t_step"]; n++ } END { if (n) printf "%.3f", s / n }' "$tmp/$name/log.csv")
  mem=$(sed -nE 's/^memory: peak .*each at its own peak: (.*)\); plan total.*/\1/p' "$tmp/$name.log" |
    tr ',' '\n' | awk 'function mib(v, u) { return v * (u == "KiB" ? 1 / 1024 : u == "GiB" ? 1024 : u == "B" ? 1 / 1048576 : 1) }
      { gsub(/[()]/, "") } $1 == "params" || $1 == "grads" || $1 == "activations" { m[$1] = mib($2, $3) }
      END { printf "%.1f %.1f %.1f", m["params"], m["grads"], m["activations"] }')
  [ -n "$step" ] && [ -n "$mem" ] || { echo "precision.sh: cannot read $name's results" >&2; exit 1; }
  echo "$step $mem"
}

runs=(fp32 bf16 bf16g)
[ -n "${BEFORE:-}" ] && runs=(before "${runs[@]}")
printf '%-6s %-7s %8s %9s %12s %11s %16s\n' round run s/step "/fp32" "params MiB" "grads MiB" "activations MiB"
declare -A ratios
for ((r = 1; r <= rounds; r++)); do
  declare -A res=()
  for name in "${runs[@]}"; do
    case $name in
      before) res[$name]=$(one "$name$r" "$BEFORE") ;;
      fp32) res[$name]=$(one "$name$r" "$ptrain") ;;
      bf16) res[$name]=$(one "$name$r" "$ptrain" --set model%dtype="'bf16'") ;;
      bf16g) res[$name]=$(one "$name$r" "$ptrain" --set model%dtype="'bf16'" --set parallel%grad_dtype="'bf16'") ;;
    esac
  done
  read -r base _ <<<"${res[fp32]}"
  for name in "${runs[@]}"; do
    read -r step p g a <<<"${res[$name]}"
    ratio=$(awk -v s="$step" -v b="$base" 'BEGIN { printf "%.3f", s / b }')
    ratios[$name]+="$ratio "
    printf '%-6s %-7s %8s %9s %12s %11s %16s\n' "$r" "$name" "$step" "$ratio" "$p" "$g" "$a"
  done
done
echo "s/step over this build's fp32 in the same round, median [min, max] over $rounds round(s):"
for name in "${runs[@]}"; do
  tr ' ' '\n' <<<"${ratios[$name]}" | grep . | sort -g |
    awk -v n="$name" '{ v[NR] = $1 } END { printf "  %-7s %.3f [%.3f, %.3f]\n", n, v[int((NR + 1) / 2)], v[1], v[NR] }'
done
