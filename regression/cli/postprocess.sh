#!/usr/bin/env bash
# postprocess/ on real output of short ptrain runs: plot_loss.py and plot_scaling.py write real
# PNGs (signature, size, dimensions); sweep.py generate writes decks ptrain runs with the swept
# values, and sweep.py collect tabulates them (final loss and mean tokens/s checked against
# log.csv with awk; missing and partial runs marked); plot_scaling.py draws exposed-communication
# columns when a log has them. numpy/h5py/matplotlib are Debian packages (Makefile.inc): without
# them the test skips, unless it runs as root (then it fails).
source "$(dirname "${BASH_SOURCE[0]}")/lib/prologue.sh"
py=/usr/bin/python3
if ! "$py" -c 'import numpy, h5py, matplotlib' 2>/dev/null; then
  [ "$(id -u)" = 0 ] && fail "$py lacks numpy/h5py/matplotlib (python3-numpy python3-h5py python3-matplotlib)"
  echo "SKIP: postprocess: $py lacks numpy/h5py/matplotlib"; exit 0
fi
pp=$PTRAIN_SOURCE_DIR/postprocess
tiny=$PTRAIN_SOURCE_DIR/input/tiny.nml
cd "$tmp"
export MPLCONFIGDIR=$tmp/mpl

png() {  # png FILE WIDTH HEIGHT: a PNG of that size in pixels, more than 10 kB
  "$py" - "$@" <<'EOF' || fail "$1 is not the expected PNG"
import struct, sys, os
path, w, h = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
data = open(path, "rb").read()
assert data[:8] == b"\x89PNG\r\n\x1a\n", "no PNG signature"
assert data[12:16] == b"IHDR", "no IHDR chunk"
width, height = struct.unpack(">II", data[16:24])
assert (width, height) == (w, h), f"{width}x{height}, expected {w}x{h}"
assert len(data) > 10000, f"only {len(data)} bytes"
EOF
}
last() { tail -n 1 "$1" | cut -d, -f"$2"; }
close() { awk -v a="$1" -v b="$2" -v t="$3" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= t) }'; }

# Two short runs (a fixed peak for MFU: no sgemm probe at start).
fast=(--set backend%peak_gflops=100)
"$PTRAIN" "$tiny" "${fast[@]}" --set run%steps=30 --set run%eval_every=10 --set "run%out_dir='$tmp/a'" >a.log 2>&1 ||
  fail "run a: $(tail -3 a.log)"
"$PTRAIN" "$tiny" "${fast[@]}" --set run%steps=30 --set run%eval_every=10 --set train%lr=1e-3 --set "run%out_dir='$tmp/b'" >b.log 2>&1 ||
  fail "run b: $(tail -3 b.log)"

# 1. plot_loss.py: one PNG, runs labelled by what differs, final losses as in log.csv.
out=$("$py" "$pp/plot_loss.py" a b/log.csv -o loss.png) || fail "plot_loss.py: $out"
png loss.png 800 500
grep -q "^lr=0.003: 30 steps, final loss $(printf %.4f "$(last a/log.csv 2)"), val loss $(printf %.4f "$(last a/log.csv 3)")" <<<"$out" ||
  fail "plot_loss.py summary of run a: $out"
grep -q "^lr=0.001: 30 steps" <<<"$out" || fail "plot_loss.py label of run b: $out"
echo "postprocess: plot_loss.py wrote loss.png ($(wc -c <loss.png) bytes)"

# 2. sweep.py generate: 2 x 2 decks that ptrain runs with the swept values.
"$py" "$pp/sweep.py" generate "$tiny" sweep train%lr=1e-3,3e-3 train%micro_batch=8,16 \
  --set run%steps=30 --set run%log_every=10 --set backend%peak_gflops=100 --max-parallel 3 >gen.out || fail "sweep.py generate: $(cat gen.out)"
grep -q "sbatch --array=0-3%3 jobscripts/sweep.sbatch $tmp/sweep" gen.out || fail "sbatch line: $(cat gen.out)"
for i in 0 1 2 3; do
  [ -f "sweep/decks/$i.nml" ] || fail "no deck $i"
  "$PTRAIN" "sweep/decks/$i.nml" >"run$i.log" 2>&1 || fail "deck $i: $(tail -3 "run$i.log")"
done
# The last key varies fastest: deck 1 is lr 1e-3 with micro_batch 16, deck 2 lr 3e-3 with 8.
grep -qE "^ *lr *= 0\.001( |$)" sweep/runs/1/deck.nml && grep -qE "^ *micro_batch *= 16( |$)" sweep/runs/1/deck.nml ||
  fail "deck 1 did not set lr 1e-3, micro_batch 16: $(grep -E ' lr | micro_batch ' sweep/runs/1/deck.nml)"
grep -qE "^ *lr *= 0\.003( |$)" sweep/runs/2/deck.nml && grep -qE "^ *micro_batch *= 8( |$)" sweep/runs/2/deck.nml ||
  fail "deck 2 did not set lr 3e-3, micro_batch 8"
grep -qE "^ *steps *= 30( |$)" sweep/runs/3/deck.nml || fail "--set run%steps=30 missing from deck 3"
# Refusals: an existing sweep without --force, a key without a group.
"$py" "$pp/sweep.py" generate "$tiny" sweep train%lr=1 >/dev/null 2>&1 && fail "generate overwrote a sweep without --force"
"$py" "$pp/sweep.py" generate "$tiny" other lr=1,2 >/dev/null 2>&1 && fail "generate accepted key 'lr' without a group"

# 3. sweep.py collect: one row per run, figures as in log.csv.
"$py" "$pp/sweep.py" collect sweep >collect.out || fail "sweep.py collect: $(cat collect.out)"
t=sweep/results.csv
[ "$(head -n 1 $t)" = "index,train%lr,train%micro_batch,status,steps,final_loss,val_loss,tokens_per_s,mfu,peak_mem_bytes,out_dir" ] ||
  fail "results.csv header: $(head -n 1 $t)"
[ "$(grep -c ',done,30,' $t)" = 4 ] || fail "results.csv: $(cat $t)"
for i in 0 1 2 3; do
  row=$(grep "^$i," $t)
  log=sweep/runs/$i/log.csv
  close "$(cut -d, -f6 <<<"$row")" "$(last "$log" 2)" 1e-6 || fail "run $i final loss: $row vs $(tail -n 1 "$log")"
  close "$(cut -d, -f7 <<<"$row")" "$(last "$log" 3)" 1e-6 || fail "run $i val loss: $row"
  mean=$(awk -F, 'NR > 2 { s += $6; n++ } END { printf "%.6f", s / n }' "$log")  # steps 2..30
  close "$(cut -d, -f8 <<<"$row")" "$mean" "$(awk -v m="$mean" 'BEGIN { print 1e-6 * m }')" ||
    fail "run $i mean tokens/s $(cut -d, -f8 <<<"$row"), awk says $mean"
done
rm sweep/runs/3/log.csv
head -n 11 sweep/runs/2/log.csv >part.csv && mv part.csv sweep/runs/2/log.csv
"$py" "$pp/sweep.py" collect sweep -o - >collect2.csv
grep -q "^3,0.003,16,missing," collect2.csv || fail "missing run not marked: $(cat collect2.csv)"
grep -q "^2,0.003,8,partial,10," collect2.csv || fail "partial run not marked: $(cat collect2.csv)"
echo "postprocess: sweep.py generated 4 decks and collected them"

# 4. plot_scaling.py over the sweep (three runs with logs left), without and with exposed-
#    communication columns.
out=$("$py" "$pp/plot_scaling.py" sweep -o scaling.png) || fail "plot_scaling.py: $out"
png scaling.png 600 1000
[ "$(grep -c '^lr=0.00[13] micro_batch=' <<<"$out")" = 3 ] || fail "plot_scaling.py table: $out"
mkdir -p comm
cp a/deck.nml comm/
awk -F, -v OFS=, 'NR == 1 { print $0, "t_comm_dp", "t_bubble"; next } { print $0, 0.002, 0.001 }' a/log.csv >comm/log.csv
out=$("$py" "$pp/plot_scaling.py" a comm -o comm.png) || fail "plot_scaling.py with comm columns: $out"
png comm.png 600 1000
grep -q "t_bubble *t_comm_dp" <<<"$out" || fail "comm columns not in the table: $out"
grep -q "^comm .* 0.001 *0.002$" <<<"$out" || fail "comm column means: $out"
echo "postprocess: plot_scaling.py wrote scaling.png and comm.png"
echo "postprocess: all checks passed"
