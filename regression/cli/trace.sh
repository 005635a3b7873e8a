#!/usr/bin/env bash
# run%trace: every rank writes its timeline, and postprocess/plot_schedule.py draws it. The
# same tp 2 run's log.csv has tp columns, and the dense-grad ones scripts rely on. A pp 2
# run's trace has the pipeline executor's forward/backward events and pp waits, and
# plot_schedule.py draws one step of it and prints each rank's pp-wait fraction; a zb-h1
# run's has weight-gradient (W) events, drawn and counted apart.
source "$(dirname "${BASH_SOURCE[0]}")/lib/prologue.sh"
timeout 120 "$MPIEXEC" $MPIEXEC_PREFLAGS -np 2 "$PTRAIN" "$PTRAIN_SOURCE_DIR/input/tiny.nml" \
  --set run%trace=.true. --set run%steps=3 --set train%micro_batch=4 --set parallel%tp=2 \
  --set run%out_dir="'$tmp/run'" >"$tmp/run.log" 2>&1 || fail "traced run: $(tail -3 "$tmp/run.log")"
header=$(head -n 1 "$tmp/run/log.csv")
for c in bytes_tp exposed_tp_s bytes_dense_grad exposed_dense_grad_s overlap_dense_grad; do
  tr , '\n' <<<"$header" | grep -qx "$c" || fail "no $c column in log.csv: $header"
done
for r in 0 1; do
  f="$tmp/run/trace/rank$r.csv"
  [ -f "$f" ] || fail "no $f"
  grep -q ",compute," "$f" || fail "rank $r: no compute events"
  grep -q ",comm:tp," "$f" || fail "rank $r: no tp communication events"
  grep -q ",comm:dense-grad," "$f" && fail "rank $r: dense-grad events on a tp-only grid"
  awk -F, 'NR > 1 && ($5 < $4) { bad = 1 } END { exit bad }' "$f" || fail "rank $r: an event ends before it begins"
done
/usr/bin/python3 "$PTRAIN_SOURCE_DIR/postprocess/plot_schedule.py" "$tmp/run" -o "$tmp/s.png" >"$tmp/plot.log" \
  || fail "plot_schedule.py: $(cat "$tmp/plot.log")"
head -c 8 "$tmp/s.png" | od -An -tx1 | tr -d ' \n' | grep -q '^89504e470d0a1a0a$' || fail "not a PNG"
[ "$(stat -c %s "$tmp/s.png")" -gt 10000 ] || fail "PNG too small"
grep -q "comm:tp" "$tmp/plot.log" || fail "the summary lacks the tp column: $(cat "$tmp/plot.log")"

# Pipeline: pp 2 (1F1B, m = 4 micro-batches per step).
timeout 120 "$MPIEXEC" $MPIEXEC_PREFLAGS -np 2 "$PTRAIN" "$PTRAIN_SOURCE_DIR/input/tiny.nml" \
  --set run%trace=.true. --set run%steps=3 --set train%micro_batch=4 --set parallel%pp=2 \
  --set backend%peak_gflops=100 --set run%out_dir="'$tmp/pp'" >"$tmp/pp.log" 2>&1 \
  || fail "traced pp run: $(tail -3 "$tmp/pp.log")"
for r in 0 1; do
  f="$tmp/pp/trace/rank$r.csv"
  [ -f "$f" ] || fail "no $f"
  for e in ",F0,forward," ",F3,forward," ",B0,backward," ",B3,backward," ",comm:pp,"; do
    grep -q "$e" "$f" || fail "rank $r: no '$e' events in the pp trace"
  done
  [ "$(grep -c ",B0,backward," "$f")" = 3 ] || fail "rank $r: not one B0 per step: $(grep -c ",B0," "$f")"
done
/usr/bin/python3 "$PTRAIN_SOURCE_DIR/postprocess/plot_schedule.py" "$tmp/pp" -o "$tmp/pp.png" --step 2 \
  >"$tmp/ppplot.log" 2>&1 || fail "plot_schedule.py --step 2: $(cat "$tmp/ppplot.log")"
head -c 8 "$tmp/pp.png" | od -An -tx1 | tr -d ' \n' | grep -q '^89504e470d0a1a0a$' || fail "pp: not a PNG"
[ "$(stat -c %s "$tmp/pp.png")" -gt 10000 ] || fail "pp: PNG too small"
grep -q "^step 2 of 3 in the trace (log.csv step 2)" "$tmp/ppplot.log" || fail "step window: $(cat "$tmp/ppplot.log")"
grep -q "pp wait" "$tmp/ppplot.log" || fail "no pp wait column: $(cat "$tmp/ppplot.log")"
# Per rank: forwards, backwards, the F/B share and the pp-wait share of step 2 (4 F, 4 B).
for r in 0 1; do
  grep -Eq "^ +$r +4 +4 +[0-9.]+% +[0-9.]+%$" "$tmp/ppplot.log" || fail "rank $r pp-wait row: $(cat "$tmp/ppplot.log")"
done
grep -Eq "^pp wait: largest [0-9.]+% \(rank [01]\)" "$tmp/ppplot.log" || fail "no largest pp wait: $(cat "$tmp/ppplot.log")"
# zb-h1: rank 1 splits its backwards (B0.. as backward, W0.. as weight events), rank 0, the
# first stage, runs whole ones.
timeout 120 "$MPIEXEC" $MPIEXEC_PREFLAGS -np 2 "$PTRAIN" "$PTRAIN_SOURCE_DIR/input/tiny.nml" \
  --set run%trace=.true. --set run%steps=3 --set train%micro_batch=4 --set parallel%pp=2 \
  --set parallel%pp_schedule="'zb-h1'" --set run%out_dir="'$tmp/zb'" >"$tmp/zb.log" 2>&1 \
  || fail "traced zb-h1 run: $(tail -3 "$tmp/zb.log")"
[ "$(grep -c ",W0,weight," "$tmp/zb/trace/rank1.csv")" = 3 ] || fail "rank 1: not one W0 per step"
grep -q ",weight," "$tmp/zb/trace/rank0.csv" && fail "rank 0 (the first stage) split a backward"
/usr/bin/python3 "$PTRAIN_SOURCE_DIR/postprocess/plot_schedule.py" "$tmp/zb" -o "$tmp/zb.png" --step 2 \
  >"$tmp/zbplot.log" 2>&1 || fail "plot_schedule.py zb-h1: $(cat "$tmp/zbplot.log")"
grep -Eq "^ +0 +4 +4 +0 +[0-9.]+% +[0-9.]+%$" "$tmp/zbplot.log" || fail "zb-h1 rank 0 row: $(cat "$tmp/zbplot.log")"
grep -Eq "^ +1 +4 +4 +4 +[0-9.]+% +[0-9.]+%$" "$tmp/zbplot.log" || fail "zb-h1 rank 1 row: $(cat "$tmp/zbplot.log")"
if /usr/bin/python3 "$PTRAIN_SOURCE_DIR/postprocess/plot_schedule.py" "$tmp/pp" -o "$tmp/x.png" --step 4 \
  >"$tmp/x.log" 2>&1; then fail "--step 4 of a 3-step trace accepted"; fi
grep -q "the trace has 3 training step(s)" "$tmp/x.log" || fail "--step 4 message: $(cat "$tmp/x.log")"
echo "trace: timelines written and drawn"
