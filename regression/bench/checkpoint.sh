#!/usr/bin/env bash
# Benchmark (issue 5): write and read a GPT-2 124M checkpoint with AdamW state (fp32:
# params + m + v, about 1.5 GB) from 1 and 2 ranks, against the disk's sequential write
# bandwidth measured by dd in the same run and the same folder.
#   regression/bench/checkpoint.sh [build/ptrain] [folder]
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
ptrain=${1:-$here/build/ptrain}
dir=$(mktemp -d "${2:-${TMPDIR:-/tmp}}/ptrain-ckpt-bench.XXXXXX")
trap 'rm -rf "$dir"' EXIT
source "$here/regression/bench/launcher.sh"
bench_launcher "$ptrain"

dd_out=$(dd if=/dev/zero of="$dir/dd.bin" bs=16M count=96 conv=fdatasync 2>&1 | tail -1)
rm -f "$dir/dd.bin"
disk=$(awk '{ for (i = 1; i <= NF; i++) if ($i ~ /^[0-9.]+$/ && $(i+1) ~ /B\/s/) { v = $i; u = $(i+1) } }
            END { m = (u == "GB/s") ? 1000 : (u == "MB/s") ? 1 : (u == "kB/s") ? 0.001 : 0; print v * m }' <<<"$dd_out")
echo "disk: dd sequential write (1.5 GiB, fdatasync) = $disk MB/s"

base=(--set model%vocab=50304 --set run%eval_every=0 --set data%val_fraction=0 --set backend%peak_gflops=100)
shape=("${base[@]}" --set model%seq_len=256 --set train%global_batch=4 --set train%micro_batch=2)
mbps() {  # the MiB/s figure of a "... = X MiB/s" or "GiB/s" log line, in MB/s
  sed -n "s/.* = \([0-9.]*\) \([KMG]iB\)\/s $1.*/\1 \2/p" "$2" | head -1 |
    awk '{ m = ($2 == "GiB") ? 1073.741824 : ($2 == "MiB") ? 1.048576 : 0.001024; printf "%.0f", $1 * m }'
}
printf '%-8s %14s %14s %10s %10s\n' ranks "write MB/s" "read MB/s" "write/dd" "read/dd"
for np in 1 2; do
  out="$dir/run$np"
  "${mpirun[@]}" -np $np "$ptrain" "$here/input/gpt2-124m.nml" "${shape[@]}" --set parallel%zero=1 \
    --set run%steps=1 --set checkpoint%every=1 --set run%out_dir="'$out'" >"$out.w.log" 2>&1
  "${mpirun[@]}" -np $np "$ptrain" "$here/input/gpt2-124m.nml" "${shape[@]}" --set parallel%zero=1 \
    --set run%steps=1 --set checkpoint%restart="'latest'" --set run%out_dir="'$out'" >"$out.r.log" 2>&1
  w=$(mbps "written" "$out.w.log"); r=$(mbps "read" "$out.r.log")
  printf '%-8s %14s %14s %9.0f%% %9.0f%%\n' $np "$w" "$r" "$(awk -v a="$w" -v d="$disk" 'BEGIN{print 100*a/d}')" \
    "$(awk -v a="$r" -v d="$disk" 'BEGIN{print 100*a/d}')"
  rm -rf "$out"
done

# The step-time cost of a checkpoint (issue 29): the same 16 steps on COST_RANKS ranks (ZeRO 1) without
# a checkpoint, with one after step 6 written in the step (sync), and with it written in the
# background (checkpoint%async) while steps 7-16 run; wall time of the whole run, rounds in
# alternating order. cost = (run - run without) per checkpoint, against the sync cost.
# COST_RANKS (default 2) sets the ranks: a background write needs a core the steps leave free.
rounds=${ROUNDS:-3}
cost_ranks=${COST_RANKS:-2}
cost=(--set train%global_batch=2 --set train%micro_batch=1 --set model%seq_len=128
      --set run%steps=16 --set run%log_every=1000)
timed() {  # timed NAME [--set ...]: seconds of one run
  local name=$1 t0 t1
  shift
  rm -rf "$dir/$name"
  t0=$(date +%s.%N)
  "${mpirun[@]}" -np "$cost_ranks" "$ptrain" "$here/input/gpt2-124m.nml" "${base[@]}" "${cost[@]}" \
    --set parallel%zero=1 --set run%out_dir="'$dir/$name'" "$@" >"$dir/$name.log" 2>&1 ||
    { echo "run $name failed: $(grep -v '^ ' "$dir/$name.log" | tail -3)" >&2; exit 1; }
  t1=$(date +%s.%N)
  awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }'
}
echo
echo "checkpoint step cost: 16 steps, one checkpoint after step 6, $cost_ranks rank(s), ZeRO 1 ($rounds rounds)"
printf '%-6s %10s %10s %10s %12s %12s %8s\n' round "none s" "sync s" "async s" "sync cost" "async cost" "ratio"
for k in $(seq "$rounds"); do
  if [ $((k % 2)) = 1 ]; then
    n=$(timed none --set checkpoint%every=0); s=$(timed sync --set checkpoint%every=6)
    a=$(timed async --set checkpoint%every=6 --set checkpoint%async=.true.)
  else
    a=$(timed async --set checkpoint%every=6 --set checkpoint%async=.true.)
    s=$(timed sync --set checkpoint%every=6); n=$(timed none --set checkpoint%every=0)
  fi
  grep -q "checkpoint: step 6 -> .*in the background" "$dir/async.log" || { echo "async run: no background write"; exit 1; }
  awk -v k="$k" -v n="$n" -v s="$s" -v a="$a" 'BEGIN { printf "%-6s %10.2f %10.2f %10.2f %12.2f %12.2f %8.2f\n",
      k, n, s, a, s - n, a - n, (s - n > 0) ? (a - n) / (s - n) : 0 }'
done
