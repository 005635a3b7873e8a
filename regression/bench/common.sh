# Shared by the parallel benchmarks (sourced): GPT-2 124M shapes (vocab 50304, B=4, T=256,
# fp32, AdamW), the launcher, the one-rank baseline with two BLAS threads, and the table.
# Arguments of the sourcing script: [build/ptrain] [steps].
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
ptrain=${1:-$here/build/ptrain}
steps=${2:-4}
deck=$here/input/gpt2-124m.nml
source "$here/regression/bench/launcher.sh"
bench_launcher "$ptrain"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
shape=(--set model%vocab=50304 --set model%seq_len=256 --set train%global_batch=4
       --set run%steps="$steps" --set run%eval_every=0 --set run%log_every=1000
       --set data%val_fraction=0)

# summarise COLUMN LOG.CSV: mean over the steps after the first of tokens/s and of
# (exposed seconds in the log.csv column named COLUMN) / step seconds. Columns are looked up
# by name in the header: which communication columns there are depends on the grid.
summarise() {
  awk -F, -v name="$1" 'NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; c = col[name]
                                   if (!c) { print "log.csv has no column " name >"/dev/stderr"; exit 1 }
                                   next }
    NR > 2 { tok += $col["tokens_per_s"]; exp_ += $c / $col["t_step"]; n++ }
    END { if (!c) exit 1; if (n == 0) { print "0 0" } else { printf "%.1f %.4f\n", tok / n, exp_ / n } }' "$2"
}

# One rank spanning both cores (no binding), two BLAS threads: sets $base (tokens/s) and
# prints the table header with EXPOSED_LABEL.
baseline() {
  "${mpirun[@]}" --bind-to none -np 1 "$ptrain" "$deck" "${shape[@]}" --set train%micro_batch=4 \
    --set backend%blas_threads=2 --set run%out_dir="'$tmp/one'" >"$tmp/one.log" 2>&1
  read -r base _ < <(summarise exposed_dense_grad_s "$tmp/one/log.csv")
  printf '%-32s %10s %8s %16s\n' "run" "tok/s" "ratio" "$1"
  printf '%-32s %10.1f %8s %16s\n' "1 rank x 2 BLAS threads" "$base" "1.00" "-"
}

# row LABEL COLUMN NAME -- ptrain options: 2 ranks bound to one core each, one BLAS thread;
# COLUMN names the exposed-seconds column of log.csv.
row() {
  local label=$1 column=$2 name=$3 tok frac
  shift 4
  "${mpirun[@]}" --bind-to core -np 2 "$ptrain" "$deck" "${shape[@]}" --set backend%blas_threads=1 \
    --set run%out_dir="'$tmp/$name'" "$@" >"$tmp/$name.log" 2>&1
  read -r tok frac < <(summarise "$column" "$tmp/$name/log.csv")
  printf '%-32s %10.1f %8.2f %15.1f%%\n' "$label" "$tok" \
    "$(awk -v a="$tok" -v b="$base" 'BEGIN{print a/b}')" "$(awk -v f="$frac" 'BEGIN{print 100*f}')"
}
