#!/usr/bin/env bash
# Benchmark (issue 30): pipeline stages balanced by the cost model (parallel%pp_layers = -1)
# against the even split, on a deck with a heavy head (8 layers, d_model 256, vocab 50304: the
# tied LM head and the loss outweigh a few layers), at pp 2 and pp 4, 8 micro-batches. In
# each of ROUNDS rounds (default 3) both splits run back to back; the table gives the median
# and range over the rounds of the mean step time (steps after the first) and the measured
# bubble, and the balanced split's speed-up over the even one. Without a machine file the
# split is priced at the cpu node class's defaults; MACHINE=file.nml (ptrain --calibrate)
# prices it at this machine's rates.
#   regression/bench/balance.sh [build/ptrain] [steps]
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
ptrain=${1:-$here/build/ptrain}
steps=${2:-5}
rounds=${ROUNDS:-3}
source "$here/regression/bench/launcher.sh"
bench_launcher "$ptrain"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
deck=$here/input/tiny.nml
model=(--set model%n_layer=8 --set model%d_model=256 --set model%n_head=8 --set model%vocab=50304
       --set model%seq_len=128 --set train%global_batch=16 --set train%micro_batch=2
       --set run%eval_every=0 --set run%log_every=1000 --set data%val_fraction=0.1
       --set run%steps="$steps")
machine=()
[ -n "${MACHINE:-}" ] && machine=(--machine "$MACHINE")

run() {  # run NAME PP LAYERS: "step_s bubble" means over the steps after the first
  local name=$1 pp=$2 layers=$3
  "${mpirun[@]}" -np "$pp" "$ptrain" "$deck" "${model[@]}" "${machine[@]}" --set parallel%pp="$pp" \
    --set parallel%pp_layers="$layers" --set run%out_dir="'$tmp/$name'" >"$tmp/$name.log" 2>&1 ||
    { echo "run $name failed: $(tail -3 "$tmp/$name.log")" >&2; exit 1; }
  awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) { if ($i == "t_step") t = i; if ($i == "bubble") b = i }; next }
           NR > 2 { s += $t; u += $b; n++ } END { printf "%.4f %.4f", s / n, u / n }' "$tmp/$name/log.csv"
}

rows=$tmp/rows
: >"$rows"
for pp in 2 4; do
  split=$("$ptrain" --plan "$deck" "${model[@]}" "${machine[@]}" --set parallel%pp="$pp" --set parallel%pp_layers=-1 \
    --world "$pp" --ranks-per-node "$pp" | sed -n 's/^parallel%pp_layers = -1: the layers split \([0-9, ]*\) over.*/\1/p')
  echo "== pp $pp: even against the balanced split ($split), $rounds rounds"
  for r in $(seq "$rounds"); do
    even=$(run "even$pp.$r" "$pp" 0)
    bal=$(run "bal$pp.$r" "$pp" -1)
    echo "$pp|$split|$r|$even|$bal" >>"$rows"
    echo "  round $r: even $even, balanced $bal (step s, bubble)"
  done
done

/usr/bin/python3 - "$rows" <<'EOF'
import statistics, sys
rows = [l.rstrip("\n").split("|") for l in open(sys.argv[1])]
print(f"{'pp':>3s} {'split':>12s} {'even step s':>18s} {'even bubble':>18s} {'balanced step s':>18s} "
      f"{'balanced bubble':>18s} {'speed-up':>16s}")
def cell(v, pct=False):
    m, lo, hi = statistics.median(v), min(v), max(v)
    return f"{100*m:5.1f}% [{100*lo:.0f}-{100*hi:.0f}]" if pct else f"{m:.3f} [{lo:.3f}-{hi:.3f}]"
for pp in sorted({r[0] for r in rows}):
    rs = [r for r in rows if r[0] == pp]
    es = [float(r[3].split()[0]) for r in rs]; eb = [float(r[3].split()[1]) for r in rs]
    bs = [float(r[4].split()[0]) for r in rs]; bb = [float(r[4].split()[1]) for r in rs]
    up = [e / b for e, b in zip(es, bs)]  # within each round
    print(f"{pp:>3s} {rs[0][1]:>12s} {cell(es):>18s} {cell(eb, True):>18s} {cell(bs):>18s} "
          f"{cell(bb, True):>18s} {statistics.median(up):6.2f}x [{min(up):.2f}-{max(up):.2f}]")
EOF
