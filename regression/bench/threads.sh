#!/usr/bin/env bash
# Benchmark (issue 16): one rank with 2 threads (backend%threads = 2: the host kernels on
# Kokkos OpenMP and BLAS) on GPT-2 124M shapes (vocab 50304, B=4, T=256, fp32, AdamW),
# against the 2-thread sgemm peak ptrain's --bench probe measures in the same run before the
# steps (and, for comparison, against its probe after them), and
# against PyTorch (regression/bench/gpt2_torch.py on the same resolved deck) at its best
# setting here: OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE, run without and with transparent
# huge pages (PyTorch 1.13 has no switch of its own; glibc's GLIBC_TUNABLES=
# glibc.malloc.hugetlb=1 gives its allocations huge pages, as ptrain's allocator does for its
# own buffers), the faster of the two each round being the baseline. ptrain runs as the job scripts
# start it (OPENBLAS_THREAD_TIMEOUT=4 OMP_WAIT_POLICY=PASSIVE: idle BLAS and OpenMP threads
# sleep instead of spinning on the cores the other side works on), then with OpenMP's
# default wait policy, then with neither. Prints s/step, the share of the sgemm peak, the
# optimizer's share of the step, and PyTorch's time over ptrain's, for each of ROUNDS rounds
# (default 3: a shared machine's speed drifts), then the median and range over the rounds.
#   [ROUNDS=n] regression/bench/threads.sh [build/ptrain] [steps] [--set group%key=value ...]
# Build ptrain against a Kokkos with OpenMP (make KOKKOS_ROOT=... BUILD_DIR=build-k4): with a
# Serial Kokkos only BLAS is threaded (the "threads:" line says which). Extra --set options
# change the shapes for both programs (e.g. a tiny model to check the script runs).
# OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE, if this machine's environment sets them (a
# workaround forcing old AVX2 kernels), are unset for these commands only, as on a user's node.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
shift $(($# < 2 ? $# : 2))
extra=("$@")
# ptrain refuses a key set twice: the extra options replace the shape's settings of their keys.
own=(--set train%micro_batch=4 --set backend%threads=2)
kept=()
for ((i = 0; i < ${#shape[@]}; i += 2)); do
  key=${shape[i + 1]%%=*}
  [[ " ${extra[*]} " == *" $key="* ]] || kept+=("${shape[i]}" "${shape[i + 1]}")
done
for ((i = 0; i < ${#own[@]}; i += 2)); do
  key=${own[i + 1]%%=*}
  [[ " ${extra[*]} " == *" $key="* ]] || kept+=("${own[i]}" "${own[i + 1]}")
done
[ -x "$ptrain" ] || { echo "threads.sh: no executable $ptrain" >&2; exit 1; }
native=(env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE)

# ptrain_run NAME ENV...: one rank, 2 threads, --bench; prints
# "s/step peak% optimizer% peak after%" (after%: against the probe after the steps)
ptrain_run() {
  local name=$1; shift
  "${native[@]}" "$@" "${mpirun[@]}" --bind-to none -np 1 "$ptrain" "$deck" --bench "${kept[@]}" \
    --set run%out_dir="'$tmp/$name'" "${extra[@]}" >"$tmp/$name.log" 2>&1 || { grep -v "^---\|^ \|^$" "$tmp/$name.log" | tail -5 >&2; exit 1; }
  grep -m1 "^threads: " "$tmp/$name.log" >&2
  local step peak share opt
  step=$(awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
                  NR > 2 { s += $col["t_step"]; n++ } END { if (n) printf "%.4f", s / n }' "$tmp/$name/log.csv")
  peak=$(sed -n 's/^peak: sgemm probe (.* = \([0-9.]*\) GFLOP\/s per rank.*/\1/p' "$tmp/$name.log")
  after=$(sed -n 's/^peak: sgemm probe after the steps.* the steps ran at \([0-9.]*\)%$/\1/p' "$tmp/$name.log")
  share=$(sed -n 's/^done: .* = \([0-9.]*\)% of peak.*/\1/p' "$tmp/$name.log")
  opt=$(awk '$1 == "optimizer" && $3 == "s" { print $4 }' "$tmp/$name.log")
  [ -n "$step" ] && [ -n "$peak" ] && [ -n "$share" ] && [ -n "$opt" ] && [ -n "$after" ] ||
    { echo "threads.sh: cannot read $name's results (see its log)" >&2; cat "$tmp/$name.log" >&2; exit 1; }
  echo "$step $share ${opt%\%} $peak $after"
}

rounds=${ROUNDS:-3}
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "threads.sh: ROUNDS=$rounds is not a positive integer" >&2; exit 1; }
printf '%-6s %-36s %9s %16s %12s %10s %12s\n' round run "s/step" "of sgemm peak" "(of after)" \
  optimizer "torch/ptrain"
row() {  # row ROUND LABEL SECONDS SHARE OPT PEAK AFTER_SHARE TORCH_SECONDS
  printf '%-6s %-36s %9.3f %7.1f%% of %-5.0f %11.1f%% %9.1f%% %12.2f\n' "$1" "$2" "$3" "$4" "$6" \
    "$7" "$5" "$(awk -v a="$8" -v b="$3" 'BEGIN { print a / b }')"
}
# torch_run ROUND [ENV...]: gpt2_torch.py on the job run's resolved deck, 2 threads, OMP
# PASSIVE, plus ENV; prints its s/step.
torch_run() {
  local round=$1 out; shift
  out=$("${native[@]}" OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE "$@" /usr/bin/python3 \
    "$here/regression/bench/gpt2_torch.py" "$tmp/job/deck.nml" "$steps") ||
    { echo "threads.sh: gpt2_torch.py failed: $out" >&2; exit 1; }
  [ "$round" = 1 ] && [ $# = 0 ] && echo "$out" | head -1 >&2
  sed -n 's/^torch: \([0-9.]*\) s\/step.*/\1/p' <<<"$out"
}
declare -a r_job r_share r_after r_opt r_ratio r_act r_spin r_torch r_torch_4k r_torch_thp
for ((k = 1; k <= rounds; k++)); do
  read -r t_job share_job opt_job peak_job after_job < <(ptrain_run job OPENBLAS_THREAD_TIMEOUT=4 OMP_WAIT_POLICY=PASSIVE)
  read -r t_act share_act opt_act peak_act after_act < <(ptrain_run active -u OMP_WAIT_POLICY OPENBLAS_THREAD_TIMEOUT=4)
  read -r t_spin share_spin opt_spin peak_spin after_spin < <(ptrain_run spin -u OMP_WAIT_POLICY -u OPENBLAS_THREAD_TIMEOUT)
  t_torch_4k=$(torch_run "$k")
  t_torch_thp=$(torch_run "$k" GLIBC_TUNABLES=glibc.malloc.hugetlb=1)
  t_torch=$(awk -v a="$t_torch_4k" -v b="$t_torch_thp" 'BEGIN { print a < b ? a : b }')
  row "$k" "ptrain, 2 threads (job scripts)" "$t_job" "$share_job" "$opt_job" "$peak_job" "$after_job" "$t_torch"
  row "$k" "  OpenMP threads spin" "$t_act" "$share_act" "$opt_act" "$peak_act" "$after_act" "$t_torch"
  row "$k" "  OpenMP and BLAS threads spin" "$t_spin" "$share_spin" "$opt_spin" "$peak_spin" "$after_spin" "$t_torch"
  printf '%-6s %-36s %9.3f\n' "$k" "PyTorch, 2 threads, OMP PASSIVE" "$t_torch_4k"
  printf '%-6s %-36s %9.3f\n' "$k" "  and huge pages (glibc tunable)" "$t_torch_thp"
  r_job+=("$t_job"); r_share+=("$share_job"); r_after+=("$after_job"); r_opt+=("$opt_job"); r_act+=("$t_act")
  r_spin+=("$t_spin"); r_torch+=("$t_torch")
  r_torch_4k+=("$t_torch_4k"); r_torch_thp+=("$t_torch_thp")
  r_ratio+=("$(awk -v a="$t_torch" -v b="$t_job" 'BEGIN { print a / b }')")
done
# stat FORMAT VALUES...: "median [min max]" in FORMAT (the lower median for an even count)
stat() {
  local f=$1; shift
  printf '%s\n' "$@" | sort -g |
    awk -v f="$f" '{ v[NR] = $1 } END { printf f " [" f " " f "]", v[int((NR + 1) / 2)], v[1], v[NR] }'
}
echo "median [min max] over $rounds round(s), ptrain as the job scripts start it:"
echo "  s/step $(stat %.3f "${r_job[@]}"); of the sgemm peak $(stat %.1f%% "${r_share[@]}")" \
     "(of the probe after the steps $(stat %.1f%% "${r_after[@]}"));" \
     "optimizer $(stat %.1f%% "${r_opt[@]}"); PyTorch/ptrain $(stat %.2f "${r_ratio[@]}")"
echo "  s/step with OpenMP threads spinning $(stat %.3f "${r_act[@]}"), with both spinning" \
     "$(stat %.3f "${r_spin[@]}")"
echo "  PyTorch s/step $(stat %.3f "${r_torch_4k[@]}"), with huge pages" \
     "$(stat %.3f "${r_torch_thp[@]}"), the faster each round $(stat %.3f "${r_torch[@]}")"
echo "(sgemm peak: GFLOP/s of ptrain's 2-thread probe before the steps; target: >= 90% of it," \
     "optimizer < 4% of the step, >= 3x PyTorch)"
