#!/usr/bin/env bash
# Benchmark (issue 13): a small model on long sequences (S = 4096, d_model 128, 2 heads of 64,
# 2 layers, fp32, one sample a step) as context parallel C = 2 (zigzag, and contiguous for
# the imbalance; one core and one BLAS thread each) against one rank with two BLAS threads
# on the same global batch, measured in this same run. Each configuration runs REPEATS times
# (default 3), alternating, and the table gives the median, min and max of the tokens/s
# ratio to the baseline of the same round, and the exposed cp-communication fraction of the
# step (log.csv column exposed_cp_s: time blocked on the ring).
#   regression/bench/context.sh [build/ptrain] [steps] [repeats]
source "$(dirname "$0")/common.sh"
repeats=${3:-3}
shape=(--set model%seq_len=4096 --set model%d_model=128 --set model%n_head=2
       --set model%n_layer=2 --set model%vocab=256 --set train%global_batch=1
       --set train%micro_batch=1 --set run%steps="$steps" --set run%eval_every=0
       --set run%log_every=1000 --set data%val_fraction=0 --set backend%peak_gflops=100)

# one NAME NP BIND BLAS_THREADS [ptrain options]: prints "tokens/s exposed_cp_fraction".
one() {
  local name=$1 np=$2 bind=$3 threads=$4
  shift 4
  "${mpirun[@]}" --bind-to "$bind" -np "$np" "$ptrain" "$deck" "${shape[@]}" \
    --set backend%blas_threads="$threads" --set run%out_dir="'$tmp/$name'" "$@" \
    >"$tmp/$name.log" 2>&1 || { tail -3 "$tmp/$name.log" >&2; exit 1; }
  if [ "$np" = 1 ]; then
    summarise tokens_per_s "$tmp/$name/log.csv" | awk '{ print $1, 0 }'
  else
    summarise exposed_cp_s "$tmp/$name/log.csv"
  fi
}

declare -A ratios exposed
for ((k = 1; k <= repeats; k++)); do
  read -r base _ < <(one "one$k" 1 none 2)
  for layout in zigzag contiguous; do
    read -r tok frac < <(one "$layout$k" 2 core 1 --set parallel%cp=2 --set parallel%cp_layout="'$layout'")
    ratios[$layout]+="$(awk -v a="$tok" -v b="$base" 'BEGIN { print a / b }') "
    exposed[$layout]+="$frac "
  done
  echo "round $k of $repeats: one rank $base tok/s" >&2
done

stats() {  # values... -> "median min max"
  printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { printf "%.3f %.3f %.3f\n", v[int((NR + 1) / 2)], v[1], v[NR] }'
}
printf '%-34s %22s %26s\n' "S = 4096, $repeats rounds" "tok/s ratio med [min max]" "exposed cp med [min max]"
for layout in zigzag contiguous; do
  read -r m lo hi < <(stats ${ratios[$layout]})
  read -r em elo ehi < <(stats ${exposed[$layout]})
  printf '%-34s %8s [%s %s] %11.1f%% [%.1f%% %.1f%%]\n' "cp 2 $layout, 1 core each" "$m" "$lo" "$hi" \
    "$(awk -v x="$em" 'BEGIN { print 100 * x }')" "$(awk -v x="$elo" 'BEGIN { print 100 * x }')" \
    "$(awk -v x="$ehi" 'BEGIN { print 100 * x }')"
done
echo "baseline: 1 rank x 2 BLAS threads on both cores, measured before each round"
