#!/usr/bin/env bash
# Benchmark (issue 33): ptrain against PyTorch on the same cores in the same run, at every size a
# user starts from: the example decks (tiny, shakespeare, GPT-2 124M shapes) and two sweeps on a
# 4-layer d_model 256 model, one of head size (16, 32, 64, 128 at T = 256) and one of sequence
# length (64 to 4096 at HS = 64, 4096 tokens a step). One rank with every core of this machine
# (backend%threads = nproc), ptrain with --bench; PyTorch is regression/bench/gpt2_torch.py on
# ptrain's resolved deck with as many threads, run without and with glibc huge pages, the faster
# of the two each round (as threads.sh). Both train on synthetic tokens (speed does not depend on
# the text). Each row: tokens/s of both and ptrain/torch; attention's and the other non-GEMM
# kernels' shares of ptrain's step (--bench's table: all but matmul and attention); the attention
# kernels' rate, 12 HS flops per unmasked (query, key) pair (forward 4, backward 8), against the
# sgemm probe ptrain measured in the same run. Then per point the median and range over ROUNDS
# rounds (default 3: a shared machine's speed drifts).
#   [ROUNDS=n] [POINTS="tiny hs32 t4096 ..."] regression/bench/shapes.sh [build/ptrain] [steps=6]
# Run it once per build: the default (Debian's Kokkos, Serial: the kernels on ptrain's own
# OpenMP threads) and a Kokkos 4 OpenMP build (make KOKKOS_ROOT=... BUILD_DIR=build-k4).
# ptrain runs as the job scripts start it (OPENBLAS_THREAD_TIMEOUT=4 OMP_WAIT_POLICY=PASSIVE).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
ptrain=${1:-$here/build/ptrain}
steps=${2:-6}
rounds=${ROUNDS:-3}
[ -x "$ptrain" ] || { echo "shapes.sh: no executable $ptrain" >&2; exit 1; }
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "shapes.sh: ROUNDS=$rounds is not a positive integer" >&2; exit 1; }
/usr/bin/python3 -c 'import torch' 2>/dev/null ||
  { echo "shapes.sh: PyTorch is missing (Debian: python3-torch)" >&2; exit 1; }
source "$here/regression/bench/launcher.sh"
bench_launcher "$ptrain"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
threads=$(nproc)
native=(env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE)

# The points: NAME DECK --set options. sweep: 4 layers of d_model 256.
sweep=(--set model%n_layer=4 --set model%d_model=256 --set model%vocab=256)
declare -A deck opts
deck[tiny]=input/tiny.nml; opts[tiny]=""
deck[shakespeare]=input/shakespeare.nml; opts[shakespeare]="--set data%source='synthetic'"
deck[gpt2]=input/gpt2-124m.nml
opts[gpt2]="--set model%vocab=50304 --set model%seq_len=256 --set train%global_batch=4 --set train%micro_batch=4"
for hs in 16 32 64 128; do
  deck[hs$hs]=input/shakespeare.nml
  opts[hs$hs]="${sweep[*]} --set model%n_head=$((256 / hs)) --set model%seq_len=256 --set train%global_batch=16 --set train%micro_batch=16 --set data%source='synthetic'"
done
for t in 64 256 1024 4096; do
  deck[t$t]=input/shakespeare.nml
  opts[t$t]="${sweep[*]} --set model%n_head=4 --set model%seq_len=$t --set train%global_batch=$((4096 / t)) --set train%micro_batch=$((4096 / t)) --set data%source='synthetic'"
done
points=(${POINTS:-tiny shakespeare gpt2 hs16 hs32 hs64 hs128 t64 t256 t1024 t4096})
for p in "${points[@]}"; do
  [ -n "${deck[$p]:-}" ] || { echo "shapes.sh: no point $p (${!deck[*]})" >&2; exit 1; }
done

# ptrain_run NAME: prints "tok/s attention% other% probe attention_GFLOP/s".
ptrain_run() {
  local p=$1 log=$tmp/$1.log
  # shellcheck disable=SC2086  # opts are words
  "${native[@]}" OPENBLAS_THREAD_TIMEOUT=4 OMP_WAIT_POLICY=PASSIVE "${mpirun[@]}" --bind-to none \
    -np 1 "$ptrain" "$here/${deck[$p]}" --bench ${opts[$p]} --set backend%threads="$threads" \
    --set run%steps="$steps" --set run%eval_every=0 --set run%log_every=1000 \
    --set data%val_fraction=0 --set checkpoint%save_final=.false. \
    --set run%out_dir="'$tmp/$p'" >"$log" 2>&1 ||
    { grep -v "^---\|^ \|^$" "$log" | tail -5 >&2; exit 1; }
  local tok probe
  [ -f "$tmp/threads" ] || { grep -m1 "^threads: " "$log" >"$tmp/threads"; }
  tok=$(sed -n 's/^done: .*; \([0-9.]*\) tok\/s, .*/\1/p' "$log")
  probe=$(sed -n 's/^peak: sgemm probe (.* = \([0-9.]*\) GFLOP\/s per rank.*/\1/p' "$log")
  [ -n "$tok" ] && [ -n "$probe" ] || { echo "shapes.sh: cannot read $p's results" >&2; cat "$log" >&2; exit 1; }
  # Attention flops a step from the resolved deck: 12 HS per unmasked pair, T(T+1)/2 pairs a
  # (sample, head), every layer.
  awk -v tok="$tok" -v probe="$probe" '
    FNR == NR { gsub(/ /, ""); split($0, kv, "="); v[kv[1]] = kv[2]; next }
    $1 == "matmul" && $3 == "s" { mm = $4 + 0 }
    $1 == "attention" && $3 == "s" { at = $4 + 0; at_s = $2 }
    $1 == "other" && $3 == "s" { ot = $4 + 0 }
    END { L = v["n_layer"]; C = v["d_model"]; NH = v["n_head"]; T = v["seq_len"]; B = v["global_batch"]
          fl = 12 * (C / NH) * T * (T + 1) / 2 * B * NH * L
          printf "%s %.1f %.1f %s %.1f\n", tok, at, 100 - mm - at, probe, (at_s > 0 ? fl / at_s / 1e9 : 0) }' \
    <(grep -E "^ +(n_layer|d_model|n_head|seq_len|global_batch) *=" "$tmp/$p/deck.nml" | sed 's/!.*//') \
    <(sed -n '/^bench: time per step/,$p' "$log")
}
# torch_run NAME: the faster of gpt2_torch.py without and with huge pages, tok/s.
torch_run() {
  local best=0 out tok
  for env in "" "GLIBC_TUNABLES=glibc.malloc.hugetlb=1"; do
    # shellcheck disable=SC2086
    out=$("${native[@]}" OMP_NUM_THREADS="$threads" OMP_WAIT_POLICY=PASSIVE $env /usr/bin/python3 \
      "$here/regression/bench/gpt2_torch.py" "$tmp/$1/deck.nml" "$steps") ||
      { echo "shapes.sh: gpt2_torch.py failed on $1: $out" >&2; exit 1; }
    tok=$(sed -n 's/^torch: .* s\/step, \([0-9.]*\) tok\/s.*/\1/p' <<<"$out")
    best=$(awk -v a="$best" -v b="$tok" 'BEGIN { print (b > a ? b : a) }')
  done
  echo "$best"
}

"$ptrain" --version
printf '%-6s %-12s %10s %10s %8s %10s %10s %8s %12s %8s\n' round point "ptrain" "torch" \
  "ratio" "attention" "non-GEMM" "probe" "attn GFLOP/s" "of probe"
declare -A all
for ((k = 1; k <= rounds; k++)); do
  for p in "${points[@]}"; do
    read -r tok att other probe agf < <(ptrain_run "$p")
    ttok=$(torch_run "$p")
    ratio=$(awk -v a="$tok" -v b="$ttok" 'BEGIN { printf "%.2f", a / b }')
    share=$(awk -v a="$agf" -v b="$probe" 'BEGIN { printf "%.1f", 100 * a / b }')
    printf '%-6s %-12s %10.0f %10.0f %8s %9.1f%% %9.1f%% %8.0f %12.1f %7.1f%%\n' "$k" "$p" "$tok" \
      "$ttok" "$ratio" "$att" "$other" "$probe" "$agf" "$share"
    all[$p]+="$ratio $share "
  done
done
# median min max of a list
stats() { tr ' ' '\n' | grep . | sort -g | awk -v f="$1" '{ x[NR] = $1 }
  END { printf f " (" f "-" f ")", (NR % 2 ? x[(NR + 1) / 2] : (x[NR / 2] + x[NR / 2 + 1]) / 2), x[1], x[NR] }'; }
echo
cat "$tmp/threads"
echo "over $rounds round(s): median (min-max)"
printf '%-12s %24s %28s\n' point "ptrain/torch" "attention % of sgemm probe"
for p in "${points[@]}"; do
  read -r -a v <<<"${all[$p]}"
  r=""; s=""
  for ((i = 0; i < ${#v[@]}; i += 2)); do r+="${v[i]} "; s+="${v[i + 1]} "; done
  printf '%-12s %24s %28s\n' "$p" "$(stats %.2f <<<"$r")" "$(stats %.1f <<<"$s")"
done
