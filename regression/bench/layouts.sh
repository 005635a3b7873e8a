#!/usr/bin/env bash
# Benchmark (issue 30): does the cost model rank layouts the way they run? On 4 ranks, a model
# where the choice matters (8 layers, d_model 256, 8 heads, vocab 8192, seq_len 256, 16
# samples a step), in one run:
#  1. ptrain --calibrate measures this machine for the deck (every rank at once);
#  2. ptrain --plan --search ranks every layout of the 4 ranks by predicted tokens/s and writes
#     the fastest as a deck;
#  3. each layout below, and the search's choice, is priced (--plan --machine) and then run
#     for real (mean step time of the steps after the first, from log.csv), in ROUNDS rounds
#     (default 3) that take the layouts in turn, so that a machine whose speed drifts (a
#     shared VM) slows every layout alike; a layout's measured time is its median;
#  4. the table (with each layout's range over the rounds), the Spearman rank correlation of
#     predicted and measured step times, the median relative error, and the search's choice
#     against the fastest measured.
#   regression/bench/layouts.sh [build/ptrain] [steps]
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
ptrain=${1:-$here/build/ptrain}
steps=${2:-5}
source "$here/regression/bench/launcher.sh"
bench_launcher "$ptrain"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
deck=$here/input/tiny.nml
model=(--set model%n_layer=8 --set model%d_model=256 --set model%n_head=8 --set model%vocab=8192
       --set model%seq_len=256 --set train%global_batch=16
       --set run%eval_every=0 --set run%log_every=1000 --set data%val_fraction=0.1)
world=(--world 4 --ranks-per-node 4)
mb4="--set train%micro_batch=4"

echo "== calibrate (4 ranks)"
"${mpirun[@]}" -np 4 "$ptrain" --calibrate "$deck" "${model[@]}" $mb4 --write-machine "$tmp/machine.nml" \
  --set run%out_dir="'$tmp/cal'" 2>&1 | grep '^calibrate:'

echo "== search"
"$ptrain" --plan "$deck" "${model[@]}" $mb4 "${world[@]}" --machine "$tmp/machine.nml" --search \
  --write-deck "$tmp/best.nml" | sed -n '/^layout search/,$p'

# name|--set options (from the deck above)
layouts=(
  "dp4|$mb4"
  "dp4 zero1|$mb4 --set parallel%zero=1"
  "dp4 zero3|$mb4 --set parallel%zero=3"
  "dp4 mb1|--set train%micro_batch=1"
  "dp4 recompute full|$mb4 --set train%recompute='full'"
  "dp2 tp2 sp|$mb4 --set parallel%tp=2 --set parallel%sequence_parallel=.true."
  "tp4 sp mb16|--set parallel%tp=4 --set parallel%sequence_parallel=.true. --set train%micro_batch=16"
  "tp4 sp mb4|$mb4 --set parallel%tp=4 --set parallel%sequence_parallel=.true."
  "dp2 pp2 1f1b|--set parallel%pp=2 --set train%micro_batch=2"
  "pp4 1f1b mb2|--set parallel%pp=4 --set train%micro_batch=2"
  "pp4 interleaved v2|--set parallel%pp=4 --set parallel%pp_schedule='interleaved' --set parallel%virtual_stages=2 --set train%micro_batch=2"
  "dp2 cp2|$mb4 --set parallel%cp=2"
  "tp2 pp2|--set parallel%tp=2 --set parallel%sequence_parallel=.true. --set parallel%pp=2 --set train%micro_batch=2"
  "dp2 cp2 zero2|$mb4 --set parallel%cp=2 --set parallel%zero=2"
)
predict() {  # predict OPTIONS...: the cost model's step seconds
  "$ptrain" --plan "$@" "${world[@]}" --machine "$tmp/machine.nml" | sed -n 's/^predicted step \([0-9.e+-]*\) s.*/\1/p'
}
measure() {  # measure NAME DECK OPTIONS...: mean step seconds after the first
  local name=$1
  shift
  "${mpirun[@]}" -np 4 "$ptrain" "$@" --set run%steps="$steps" --set run%out_dir="'$tmp/$name'" \
    >"$tmp/$name.log" 2>&1 || { echo "run $name failed: $(tail -3 "$tmp/$name.log")" >&2; exit 1; }
  awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) if ($i == "t_step") c = i; next }
           NR > 2 { s += $c; n++ } END { printf "%.4f", s / n }' "$tmp/$name/log.csv"
}

rounds=${ROUNDS:-3}
echo "== layouts ($steps steps each, the first not counted; $rounds rounds)"
rows="$tmp/rows"
: >"$rows"
for round in $(seq "$rounds"); do
  i=0
  for entry in "${layouts[@]}" "search's choice|BEST"; do
    name=${entry%%|*}
    opts=${entry#*|}
    i=$((i + 1))
    if [ "$opts" = BEST ]; then
      p=$(predict "$tmp/best.nml" --set run%steps="$steps")
      t=$(measure "l$i.$round" "$tmp/best.nml")
    else
      # shellcheck disable=SC2086  # the options are words
      p=$(predict "$deck" "${model[@]}" $opts)
      # shellcheck disable=SC2086
      t=$(measure "l$i.$round" "$deck" "${model[@]}" $opts)
    fi
    echo "$name|$p|$t" >>"$rows"
    printf 'round %d %-22s predicted %8.4f s  measured %8.4f s\n' "$round" "$name" "$p" "$t"
  done
done

/usr/bin/python3 - "$rows" <<'EOF'
import sys
import statistics
runs = [l.rstrip("\n").split("|") for l in open(sys.argv[1])]
names = list(dict.fromkeys(r[0] for r in runs))  # in order
pred = [float(next(r[1] for r in runs if r[0] == n)) for n in names]
every = [[float(r[2]) for r in runs if r[0] == n] for n in names]
meas = [statistics.median(v) for v in every]
rows = names
def ranks(v):
    order = sorted(range(len(v)), key=lambda i: v[i])
    r = [0.0] * len(v)
    i = 0
    while i < len(order):  # ties share their mean rank
        j = i
        while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return r
rp, rm = ranks(pred), ranks(meas)
n = len(rows)
mp, mm = sum(rp) / n, sum(rm) / n
cov = sum((a - mp) * (b - mm) for a, b in zip(rp, rm))
sp = cov / (sum((a - mp) ** 2 for a in rp) * sum((b - mm) ** 2 for b in rm)) ** 0.5
errors = sorted(abs(p - m) / m for p, m in zip(pred, meas))
median = errors[n // 2] if n % 2 else (errors[n // 2 - 1] + errors[n // 2]) / 2
print(f"{'layout':22s} {'predicted s':>12s} {'measured s':>11s} {'range':>15s} {'error':>7s} {'rank p/m':>9s}")
for k in range(n):
    spread = f"{min(every[k]):.3f}-{max(every[k]):.3f}"
    print(f"{names[k]:22s} {pred[k]:12.4f} {meas[k]:11.4f} {spread:>15s} {100 * (pred[k] - meas[k]) / meas[k]:+6.1f}% {rp[k]:4.0f}/{rm[k]:<4.0f}")
best = meas[-1]
fastest = min(meas)
print(f"Spearman rank correlation {sp:.3f} (target >= 0.8); median |error| {100 * median:.1f}% "
      f"(target <= 20%); the search's choice {best:.4f} s against the fastest measured "
      f"{fastest:.4f} s ({names[meas.index(fastest)]}): {best / fastest:.3f} (target <= 1.10)")
EOF
