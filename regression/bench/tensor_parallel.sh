#!/usr/bin/env bash
# Benchmark (issue 6): GPT-2 124M shapes (vocab 50304, B=4, T=256, fp32, AdamW) on 2 ranks
# as tensor parallel T = 2 (one core and one BLAS thread each), with and without sequence
# parallelism, against one rank with two BLAS threads on the same global batch, measured
# in this same run. Prints tokens/s, the ratio, and the exposed tp-communication fraction
# (tp collectives are blocking, so all of their time is exposed).
#   regression/bench/tensor_parallel.sh [build/ptrain] [steps]
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
ptrain=${1:-$here/build/ptrain}
steps=${2:-4}
mpirun=(mpirun --oversubscribe)
[ "$(id -u)" = 0 ] && mpirun+=(--allow-run-as-root)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
shape=(--set model%vocab=50304 --set model%seq_len=256 --set train%global_batch=4
       --set train%micro_batch=4 --set run%steps="$steps" --set run%eval_every=0
       --set run%log_every=1000 --set data%val_fraction=0)
summarise() {  # mean over the steps after the first: tokens/s, exposed tp seconds / step
  awk -F, 'NR > 2 { tok += $6; exp_ += $19 / $10; n++ }
           END { if (n == 0) { print "0 0" } else { printf "%.1f %.4f\n", tok / n, exp_ / n } }' "$1"
}
"${mpirun[@]}" --bind-to none -np 1 "$ptrain" "$here/input/gpt2-124m.nml" "${shape[@]}" \
  --set backend%blas_threads=2 --set run%out_dir="'$tmp/one'" >"$tmp/one.log" 2>&1
read -r base _ < <(summarise "$tmp/one/log.csv")
printf '%-28s %10s %8s %16s\n' "run" "tok/s" "ratio" "exposed tp comm"
printf '%-28s %10.1f %8s %16s\n' "1 rank x 2 BLAS threads" "$base" "1.00" "-"
for sp in .false. .true.; do
  "${mpirun[@]}" --bind-to core -np 2 "$ptrain" "$here/input/gpt2-124m.nml" "${shape[@]}" \
    --set backend%blas_threads=1 --set parallel%tp=2 --set parallel%sequence_parallel=$sp \
    --set run%out_dir="'$tmp/tp$sp'" >"$tmp/tp$sp.log" 2>&1
  read -r tok frac < <(summarise "$tmp/tp$sp/log.csv")
  printf '%-28s %10.1f %8.2f %15.1f%%\n' "tp 2, sequence_parallel $sp" "$tok" \
    "$(awk -v a="$tok" -v b="$base" 'BEGIN{print a/b}')" "$(awk -v f="$frac" 'BEGIN{print 100*f}')"
done
