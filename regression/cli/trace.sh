#!/usr/bin/env bash
# run%trace: every rank writes its timeline, and postprocess/plot_schedule.py draws it. The
# same tp 2 run's log.csv has tp columns, and the dense-grad ones scripts rely on.
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
echo "trace: timelines written and drawn"
