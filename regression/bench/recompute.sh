#!/usr/bin/env bash
# Benchmark (issue 15): GPT-2 124M shapes (vocab 50304, B = 4, T = 256, fp32, AdamW) on one
# rank with two BLAS threads, train%recompute = none, selective and full, alternating in
# rounds (REPEATS, default 3) so that the machine's noise falls on all three alike. Prints
# the median [min max] of each mode's step time relative to none in the same round, and the
# peak memory of each (the log's peak over all categories, and the activations category
# with --plan's prediction beside it).
#   regression/bench/recompute.sh [build/ptrain] [steps] [repeats]
source "$(dirname "$0")/common.sh"
repeats=${3:-3}

one() {  # one NAME MODE: prints "seconds_per_step peak_bytes activation_peak_bytes"
  local name=$1 mode=$2
  "${mpirun[@]}" --bind-to none -np 1 "$ptrain" "$deck" "${shape[@]}" --set train%micro_batch=4 \
    --set backend%blas_threads=2 --set train%recompute="'$mode'" --set run%out_dir="'$tmp/$name'" \
    >"$tmp/$name.log" 2>&1 || { tail -3 "$tmp/$name.log" >&2; exit 1; }
  local act
  # "779.00 MiB/plan 779.00 MiB": the measured peak and --plan's prediction beside it.
  act=$(sed -nE 's/.*activations ([0-9.]+) ([KMG]?i?B) \(plan ([0-9.]+) ([KMG]?i?B)\).*/\1_\2\/plan_\3_\4/p' \
    "$tmp/$name.log" | tail -1)
  awk -F, -v act="$act" 'NR == 1 { for (i = 1; i <= NF; i++) c[$i] = i; next }
    NR > 2 { t += $c["t_step"]; n++; m = $c["peak_mem_bytes"] }
    END { printf "%.4f %.0f %s\n", t / n, m, act }' "$tmp/$name/log.csv"
}

declare -A ratio peak act
for ((k = 1; k <= repeats; k++)); do
  read -r base base_peak base_act < <(one "none$k" none)
  peak[none]=$base_peak act[none]=$base_act
  for mode in selective full; do
    read -r t p a < <(one "$mode$k" $mode)
    ratio[$mode]+="$(awk -v a="$t" -v b="$base" 'BEGIN { print a / b }') "
    peak[$mode]=$p act[$mode]=$a
  done
  echo "round $k of $repeats: none $base s/step" >&2
done
stats() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { printf "%.3f %.3f %.3f\n", v[int((NR + 1) / 2)], v[1], v[NR] }'; }
printf '%-12s %28s %14s %30s\n' "recompute" "step time / none: med [min max]" "peak memory" "peak activations / plan"
printf '%-12s %28s %14s %30s\n' none "1" "$(awk -v b="${peak[none]}" 'BEGIN { printf "%.0f MiB", b / 1048576 }')" "${act[none]}"
for mode in selective full; do
  read -r m lo hi < <(stats ${ratio[$mode]})
  printf '%-12s %28s %14s %30s\n' "$mode" "$m [$lo $hi]" \
    "$(awk -v b="${peak[$mode]}" 'BEGIN { printf "%.0f MiB", b / 1048576 }')" "${act[$mode]}"
done
