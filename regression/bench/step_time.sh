#!/usr/bin/env bash
# Step time of two builds of ptrain on the same shapes (GPT-2 124M: vocab 50304, B=4, T=256,
# fp32, AdamW), one rank with two BLAS threads. The builds run alternately (base, new, base,
# new, ...) so both see the same load on a shared machine; each run's step time is the mean of
# log.csv's t_step over the steps after the first. Prints every pair and the ratio new/base
# as min / median / max over the pairs.
#   usage: regression/bench/step_time.sh BASE_PTRAIN NEW_PTRAIN [pairs=5] [steps=4]
# e.g. to compare against an older commit:
#   git worktree add /tmp/base <commit> && cmake -S /tmp/base -B /tmp/base/build \
#     -DCMAKE_BUILD_TYPE=Release -DPTRAIN_ARCH_FLAGS=-march=native -DPTRAIN_BUILD_TESTS=OFF \
#     && cmake --build /tmp/base/build --target ptrain
# (the same flags as `make`, which passes Makefile.inc's ARCH_FLAGS: compare like with like)
#   regression/bench/step_time.sh /tmp/base/build/ptrain build/ptrain
base_ptrain=${1:?usage: step_time.sh BASE_PTRAIN NEW_PTRAIN [pairs] [steps]}
new_ptrain=${2:?usage: step_time.sh BASE_PTRAIN NEW_PTRAIN [pairs] [steps]}
pairs=${3:-5}
set -- "$new_ptrain" "${4:-4}"
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# step_seconds BINARY NAME: mean t_step after the first step of one run.
step_seconds() {
  "${mpirun[@]}" --bind-to none -np 1 "$1" "$deck" "${shape[@]}" --set train%micro_batch=4 \
    --set backend%blas_threads=2 --set backend%peak_gflops=1 --set run%out_dir="'$tmp/$2'" \
    >"$tmp/$2.log" 2>&1 || { cat "$tmp/$2.log" >&2; exit 1; }
  awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
           NR > 2 { s += $col["t_step"]; n++ } END { printf "%.4f\n", s / n }' "$tmp/$2/log.csv"
}

printf '%-6s %12s %12s %8s\n' pair "base s/step" "new s/step" ratio
ratios=()
for ((k = 1; k <= pairs; k++)); do
  b=$(step_seconds "$base_ptrain" "base$k")
  n=$(step_seconds "$new_ptrain" "new$k")
  r=$(awk -v a="$n" -v b="$b" 'BEGIN { printf "%.4f", a / b }')
  ratios+=("$r")
  printf '%-6s %12s %12s %8s\n' "$k" "$b" "$n" "$r"
done
printf '%s\n' "${ratios[@]}" | sort -g | awk '{ r[NR] = $1 }
  END { printf "ratio new/base over %d pairs: min %.4f, median %.4f, max %.4f\n",
        NR, r[1], (NR % 2 ? r[(NR + 1) / 2] : (r[NR / 2] + r[NR / 2 + 1]) / 2), r[NR] }'
