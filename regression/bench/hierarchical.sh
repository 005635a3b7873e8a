#!/usr/bin/env bash
# Two-level against flat data-parallel reduction on 2 simulated nodes x 2 ranks (network
# namespaces, regression/nodes/netns.sh), each node's link shaped to RATE (default 100mbit,
# 12.5 MB/s, so that the link bounds the reduction: on a 2-core machine at 400mbit the four
# spinning ranks bound it instead, and the two ran alike in exposed time), dp 4:
# ZeRO 0 (all-reduce buckets behind the backward) and ZeRO 1 (reduce-scatter, all-gather),
# each as one flat ring (backend%comm = 'mpi') and in two levels ('auto'), in alternating
# order, ROUNDS times. Per run: the step time and the exposed dense-grad time per step (means
# over the steps after the first), and the bytes the nodes sent over their links per step
# (the bridge ports' counters, less those of a one-step run of the same kind: start-up),
# against the formula: flat, N crossing ring links each carrying the flat bytes of a rank;
# two levels, D ranks each sending (N-1)/(D-1) of theirs across. Prints the medians and the
# flat / two-level ratio of exposed time (the target is 1.3 or more), with the spread. Then
# hybrid sharding (parallel%zero_scope = 'node': ZeRO 1 shards inside each node, replicated
# across; its parameter gather stays inside the node) against ZeRO 1 over all 4 ranks, both
# in two levels: exposed time summed over the dense-grad group and its levels' rows.
#   regression/bench/hierarchical.sh [build/ptrain] [steps (5)] [rounds (2)]
#   RATE=400mbit N_LAYER=4 D_MODEL=512 VOCAB=8192 regression/bench/hierarchical.sh
#   ONLY='ZeRO 1 shards' regression/bench/hierarchical.sh   (one comparison: 'ZeRO 0', 'ZeRO 1')
# Needs root (ip netns, tc); GPT-2-small-like shapes, narrowed to run in minutes on 2 cores.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
ptrain=${1:-$here/build/ptrain}
steps=${2:-5}
rounds=${3:-2}
nodes=$here/regression/nodes/netns.sh
RATE=${RATE:-100mbit} N_LAYER=${N_LAYER:-4} D_MODEL=${D_MODEL:-512} N_HEAD=${N_HEAD:-8}
VOCAB=${VOCAB:-8192} SEQ_LEN=${SEQ_LEN:-128}
[ "$(id -u)" = 0 ] || { echo "hierarchical.sh: needs root (network namespaces)"; exit 2; }
tmp=$(mktemp -d)
trap '"$nodes" down >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
"$nodes" up 2 "$RATE" >/dev/null
shape=(--set model%n_layer="$N_LAYER" --set model%d_model="$D_MODEL" --set model%n_head="$N_HEAD"
       --set model%vocab="$VOCAB" --set model%seq_len="$SEQ_LEN" --set model%dtype="'fp32'"
       --set train%global_batch=8 --set train%micro_batch=2 --set parallel%dp=4
       --set run%eval_every=0 --set run%log_every=1000 --set data%val_fraction=0
       --set backend%blas_threads=1 --set backend%peak_gflops=100)
link_bytes() { cat /sys/class/net/ptrnv0/statistics/rx_bytes /sys/class/net/ptrnv1/statistics/rx_bytes | awk '{s += $1} END {printf "%.0f\n", s}'; }

# run NAME STEPS SETTINGS...: one run over the two nodes; prints "step_s exposed_s bytes
# flat_rank_bytes" (exposed: the dense-grad group's and its node levels' rows)
run() {
  local name=$1 n=$2 before after
  shift 2
  before=$(link_bytes)
  timeout 900 "$nodes" run 2 -np 4 "$ptrain" "$here/input/tiny.nml" "${shape[@]}" \
    --set run%steps="$n" "$@" --set run%out_dir="'$tmp/$name'" >"$tmp/$name.log" 2>&1 ||
    { echo "hierarchical.sh: $name failed:" >&2; tail -5 "$tmp/$name.log" >&2; exit 1; }
  after=$(link_bytes)
  awk -F, -v link=$((after - before)) 'NR == 1 { for (i = 1; i <= NF; i++) c[$i] = i; next }
    NR > 2 { t += $c["t_step"]; b = $c["bytes_dense_grad"]; k++
             for (g in c) if (g ~ /^exposed_dense_grad(_intra|_inter)?_s$/) e += $c[g] }
    END { if (k == 0) { t = 0; e = 0; k = 1; b = 0 } printf "%.4f %.4f %d %.0f\n", t / k, e / k, link, b }' \
    "$tmp/$name/log.csv"
}

# compare TITLE A_LABEL "A_SETTINGS" B_LABEL "B_SETTINGS": ROUNDS rounds of both, alternating,
# each less a one-step run's start-up traffic (weights, the probe, the connections); the link
# formula is two levels' D(N-1)/(D-1) of a rank's dense-grad bytes, or N of them for 'mpi'.
compare() {
  local title=$1 a=$2 b=$4 tag=${1// /_} key
  [ -z "${ONLY:-}" ] || [ "$ONLY" = "$title" ] || return 0
  local -A sets=([$a]=$3 [$b]=$5) start
  for key in "$a" "$b"; do
    read -r _ _ start[$key] _ < <(run "${tag}_${key}_1" 1 ${sets[$key]})
  done
  : >"$tmp/$title.rows"
  for ((r = 1; r <= rounds; r++)); do
    local order=("$a" "$b")
    ((r % 2 == 0)) && order=("$b" "$a")
    for key in "${order[@]}"; do
      read -r t e link flat < <(run "${tag}_${key}_$r" "$steps" ${sets[$key]})
      echo "$key $t $e $(((link - ${start[$key]}) / (steps - 1))) $flat ${sets[$key]}" >>"$tmp/$title.rows"
    done
  done
  /usr/bin/python3 - "$tmp/$title.rows" "$title" "$a" "$b" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
title, a, b = sys.argv[2:5]
D, N = 4, 2
def pick(key, i):
    return [float(r[i]) for r in rows if r[0] == key]
print(f"\n{title}:{' ' * max(1, 20 - len(title))}step s   exposed dp s/step   link MB/step   formula MB/step")
for key in (a, b):
    t, e, link, flat = (pick(key, i) for i in (1, 2, 3, 4))
    flat_ring = any("backend%comm='mpi'" in " ".join(r[5:]) for r in rows if r[0] == key)
    formula = statistics.median(flat) * (N if flat_ring else D * (N - 1) / (D - 1))
    print(f"  {key:<18} {statistics.median(t):7.3f}   {statistics.median(e):8.3f} "
          f"({min(e):.3f}-{max(e):.3f})   {statistics.median(link) / 1e6:9.1f}      {formula / 1e6:9.1f}")
ratios = [x / y for x, y in zip(pick(a, 2), pick(b, 2)) if y > 0]
print(f"  {a} / {b}, exposed dp time: median {statistics.median(ratios):.2f} "
      f"(rounds {' '.join(f'{x:.2f}' for x in ratios)}); step time "
      f"{statistics.median(pick(a, 1)) / statistics.median(pick(b, 1)):.2f}")
PY
}

echo "two-level vs flat dp reduction, hybrid vs global ZeRO 1: 2 nodes x 2 ranks, links at $RATE," \
  "dp 4, $N_LAYER layers, d_model $D_MODEL, vocab $VOCAB, T $SEQ_LEN, B 8 (micro 2), fp32;" \
  "$steps steps x $rounds rounds"
for zero in 0 1; do
  compare "ZeRO $zero" "flat-ring" "--set parallel%zero=$zero --set backend%comm='mpi'" \
    "two-levels" "--set parallel%zero=$zero --set backend%comm='auto'"
done
compare "ZeRO 1 shards" "global" "--set parallel%zero=1" \
  "node" "--set parallel%zero=1 --set parallel%zero_scope='node'"
