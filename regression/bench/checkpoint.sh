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

shape=(--set model%vocab=50304 --set model%seq_len=256 --set train%global_batch=4 --set train%micro_batch=2
       --set run%eval_every=0 --set data%val_fraction=0 --set backend%peak_gflops=100)
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
