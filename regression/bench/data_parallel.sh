#!/usr/bin/env bash
# Benchmark (issue 4): GPT-2 124M shapes (vocab 50304, B=4, T=256, fp32, AdamW) trained
# on 2 ranks (D = 2, one core and one BLAS thread each) for every ZeRO stage, against the
# one-rank run with two BLAS threads on the same global batch, measured in this same run.
# Prints tokens/s, the ratio to one rank, and the exposed-communication fraction.
#   regression/bench/data_parallel.sh [build/ptrain] [steps]
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
ptrain=${1:-$here/build/ptrain}
steps=${2:-4}
mpirun=(mpirun --oversubscribe)
[ "$(id -u)" = 0 ] && mpirun+=(--allow-run-as-root)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
shape=(--set model%vocab=50304 --set model%seq_len=256 --set train%global_batch=4
       --set run%steps="$steps" --set run%eval_every=0 --set run%log_every=1000
       --set data%val_fraction=0)
# Mean over the steps after the first of: tokens/s, exposed seconds / step seconds.
summarise() {
  awk -F, 'NR > 2 { tok += $6; exp_ += $16 / $10; n++ }
           END { if (n == 0) { print "0 0" } else { printf "%.1f %.4f\n", tok / n, exp_ / n } }' "$1"
}
# One rank spans both cores (no binding); the two ranks get one core each.
"${mpirun[@]}" --bind-to none -np 1 "$ptrain" "$here/input/gpt2-124m.nml" "${shape[@]}" --set train%micro_batch=4 \
  --set backend%blas_threads=2 --set run%out_dir="'$tmp/one'" >"$tmp/one.log" 2>&1
read -r base _ < <(summarise "$tmp/one/log.csv")
printf '%-26s %10s %8s %16s\n' "run" "tok/s" "ratio" "exposed comm"
printf '%-26s %10.1f %8s %16s\n' "1 rank x 2 BLAS threads" "$base" "1.00" "-"
for z in 0 1 2 3; do
  "${mpirun[@]}" --bind-to core -np 2 "$ptrain" "$here/input/gpt2-124m.nml" "${shape[@]}" --set train%micro_batch=2 \
    --set backend%blas_threads=1 --set parallel%zero=$z --set run%out_dir="'$tmp/z$z'" >"$tmp/z$z.log" 2>&1
  read -r tok frac < <(summarise "$tmp/z$z/log.csv")
  printf '%-26s %10.1f %8.2f %15.1f%%\n' "2 ranks, ZeRO $z" "$tok" "$(awk -v a="$tok" -v b="$base" 'BEGIN{print a/b}')" \
    "$(awk -v f="$frac" 'BEGIN{print 100*f}')"
done
