#!/usr/bin/env bash
# input/moe-tiny.nml, the example mixture-of-experts deck, through the driver:
#  - on one rank it learns the synthetic process: final loss and validation loss within 10%
#    of the entropy floor the log prints;
#  - log.csv has the MoE columns on every step with sane values (aux loss > 0, dropped share
#    in [0, 1), least loaded expert <= the mean <= most loaded), and the log line has them;
#  - at ep = 2 (dropless) the measured all-to-all bytes per step are near what --plan gives
#    for uniform routing (routing is never exactly uniform: within 15%).
source "$(dirname "${BASH_SOURCE[0]}")/lib/prologue.sh"
deck="$PTRAIN_SOURCE_DIR/input/moe-tiny.nml"
column() {  # column CSV NAME: the values of column NAME, one a line
  awk -F, -v n="$2" 'NR == 1 { for (i = 1; i <= NF; ++i) if ($i == n) c = i; next } c { print $c }' "$1"
}

timeout 240 "$PTRAIN" "$deck" --set run%out_dir="'$tmp/one'" --set backend%blas_threads=1 \
  >"$tmp/one.log" 2>&1 || fail "moe-tiny run: $(tail -5 "$tmp/one.log")"
floor=$(sed -n 's/.*entropy floor of the synthetic process = \([0-9.]*\).*/\1/p' "$tmp/one.log")
[ -n "$floor" ] || fail "no entropy floor in the log"
loss=$(column "$tmp/one/log.csv" loss | tail -n 1)
val=$(column "$tmp/one/log.csv" val_loss | tail -n 1)
echo "moe-tiny: final loss $loss, val $val, floor $floor"
awk -v l="$loss" -v f="$floor" 'BEGIN { exit !(l < 1.10 * f) }' || fail "loss $loss not within 10% of $floor"
awk -v l="$val" -v f="$floor" 'BEGIN { exit !(l < 1.10 * f) }' || fail "val $val not within 10% of $floor"
[ "$(wc -l <"$tmp/one/log.csv")" = 301 ] || fail "log.csv should have a header and 300 rows"

# The MoE statistics, every step.
for c in aux_loss moe_dropped moe_load_min moe_load_max; do
  [ "$(column "$tmp/one/log.csv" $c | grep -c .)" = 300 ] || fail "log.csv: no $c on every step: $(head -n 1 "$tmp/one/log.csv")"
done
paste -d' ' <(column "$tmp/one/log.csv" aux_loss) <(column "$tmp/one/log.csv" moe_dropped) \
  <(column "$tmp/one/log.csv" moe_load_min) <(column "$tmp/one/log.csv" moe_load_max) |
  awk '!($1 > 0 && $2 >= 0 && $2 < 1 && $3 <= 1 && 1 <= $4) { print "step " NR ": aux " $1 ", dropped " $2 ", load " $3 "-" $4; bad = 1 }
       END { exit bad }' || fail "MoE statistics out of range"
grep -qE "^step +300/300 .*\| moe aux [0-9.]+, dropped [0-9.]+%, expert load [0-9.]+-[0-9.]+ of mean" "$tmp/one.log" \
  || fail "no MoE statistics in the log line: $(grep '^step' "$tmp/one.log" | tail -n 1)"

# ep = 2, dropless: bytes_ep per step against the plan's uniform-routing figure, 2 MoE layers x
# (4 all-to-allv of 2*8*64 rows x 64 floats, half of them leaving + 4 int32 counts) = 1.00 MiB.
plan=$("$PTRAIN" --plan "$deck" --world 2 --ranks-per-node 2 --set parallel%ep=2)
grep -qE "^  ep +1.00 MiB " <<<"$plan" || fail "plan: ep traffic: $(grep -E '^  ep ' <<<"$plan")"
timeout 120 "$MPIEXEC" $MPIEXEC_PREFLAGS -np 2 "$PTRAIN" "$deck" --set parallel%ep=2 \
  --set model%capacity_factor=0 --set run%steps=10 --set run%eval_every=0 \
  --set backend%blas_threads=1 --set backend%peak_gflops=100 --set run%out_dir="'$tmp/ep2'" \
  >"$tmp/ep2.log" 2>&1 || fail "ep 2 run: $(tail -5 "$tmp/ep2.log")"
uniform=$((2 * (4 * 2 * 8 * 64 * 64 * 4 / 2 + 4 * 4)))
column "$tmp/ep2/log.csv" bytes_ep | awk -v u="$uniform" '{ s += $1; n++ }
  END { r = s / n / u; printf "moe-tiny ep 2: %.0f bytes per step measured, %d uniform (ratio %.3f)\n", s / n, u, r
        exit !(n == 10 && r > 0.85 && r < 1.15) }' || fail "bytes_ep far from the plan's $uniform"
echo "moe_tiny: all checks passed"
