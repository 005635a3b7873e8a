#!/usr/bin/env bash
# Reliability of a run that goes wrong, or is given a bad file (issue 11):
#  - a diverging run (lr = 1e6, a checkpoint every step) stops with one line naming the step,
#    the first tensor with a non-finite gradient and its rank, exit 1, no MPI_Abort banner;
#    `latest` is a checkpoint whose weights are all finite, and keep pruned nothing good;
#  - train%nonfinite = 'skip' drops the bad step's update and goes on (log.csv column skipped);
#  - SIGTERM during a long validation pass stops within seconds, with a checkpoint;
#  - SIGUSR1 during set-up is a stop request (checkpoint, exit 0), not a kill;
#  - a restart after a crash leaves one log.csv row per step;
#  - train%spike_factor: a finite loss spike stops the run (or is skipped) like a NaN.
source "$(dirname "${BASH_SOURCE[0]}")/lib/prologue.sh"
deck="$PTRAIN_SOURCE_DIR/input/tiny.nml"
base=(--set model%vocab=61 --set train%micro_batch=4 --set run%log_every=1)
small=("${base[@]}" --set run%eval_every=0)
py=/usr/bin/python3

# 1. Divergence on 2 ranks.
set +e
timeout 120 "$MPIEXEC" $MPIEXEC_PREFLAGS -np 2 "$PTRAIN" "$deck" --set train%micro_batch=8 \
  --set run%steps=40 --set train%lr=1e6 --set checkpoint%every=1 --set checkpoint%keep=2 \
  --set run%out_dir="'$tmp/div'" >"$tmp/div.log" 2>&1
rc=$?
set -e
[ "$rc" = 1 ] || { cat "$tmp/div.log"; fail "diverging run: exit $rc, expected 1"; }
grep -q "MPI_ABORT" "$tmp/div.log" && fail "diverging run: MPI_Abort banner"
[ "$(grep -c "first non-finite gradient is .* on rank [01]" "$tmp/div.log")" = 1 ] ||
  { cat "$tmp/div.log"; fail "diverging run: the message must appear once, naming tensor and rank"; }
latest=$tmp/div/checkpoints/$(cat "$tmp/div/checkpoints/latest")
"$py" - "$latest" <<'PY' || fail "diverging run: latest ($latest) holds non-finite values"
import sys, h5py, numpy as np
with h5py.File(sys.argv[1], "r") as f:
    bad = []
    f.visititems(lambda n, d: bad.append(n) if isinstance(d, h5py.Dataset) and d.dtype.kind == "f" and not np.all(np.isfinite(d[()])) else None)
    sys.exit(1 if bad else 0)
PY
n=$(ls "$tmp/div/checkpoints" | grep -c '^ckpt_.*\.h5$')
stopped=$(grep -o "^step [0-9]*: loss" "$tmp/div.log" | grep -o "[0-9]*")
[ "$n" = "$(( stopped - 1 < 2 ? stopped - 1 : 2 ))" ] || fail "diverging run: $n checkpoints for a stop at step $stopped"

# 2. One NaN gradient at step 3: 'stop' names it, 'skip' drops that update only.
set +e
"$PTRAIN" "$deck" "${small[@]}" --set run%steps=6 --set run%debug_nan_step=3 \
  --set run%out_dir="'$tmp/stop'" >"$tmp/stop.log" 2>&1
rc=$?
set -e
[ "$rc" = 1 ] || fail "nonfinite='stop': exit $rc"
grep -q "step 3: .*first non-finite gradient is wte.weight on rank 0" "$tmp/stop.log" ||
  { cat "$tmp/stop.log"; fail "nonfinite='stop': message"; }
"$PTRAIN" "$deck" "${small[@]}" --set run%steps=6 --set run%debug_nan_step=3 \
  --set train%nonfinite="'skip'" --set run%out_dir="'$tmp/skip'" >"$tmp/skip.log" 2>&1 ||
  fail "nonfinite='skip': $(tail -2 "$tmp/skip.log")"
grep -q "step *3/6 .*SKIPPED" "$tmp/skip.log" || fail "nonfinite='skip': no SKIPPED in the log line"
skipped=$(awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) c[$i] = i; next } { printf "%s", $c["skipped"] }' "$tmp/skip/log.csv")
[ "$skipped" = 001000 ] || fail "log.csv skipped column: $skipped"

# 3. SIGTERM during a long validation pass.
"$PTRAIN" "$deck" "${base[@]}" --set run%steps=3 --set run%eval_every=1 \
  --set data%val_samples=20000000 --set checkpoint%every=100 --set run%out_dir="'$tmp/val'" \
  >"$tmp/val.log" 2>&1 &
pid=$!
for _ in $(seq 600); do grep -q "^data:" "$tmp/val.log" 2>/dev/null && break; sleep 0.05; done
sleep 2
t0=$(date +%s)
kill -TERM "$pid"
wait "$pid" || fail "SIGTERM in validation: exit $? ($(tail -2 "$tmp/val.log"))"
(( $(date +%s) - t0 <= 10 )) || fail "SIGTERM in validation took $(( $(date +%s) - t0 )) s"
grep -q "stopped by signal 15 after step 1" "$tmp/val.log" || fail "SIGTERM: $(tail -2 "$tmp/val.log")"
[ -f "$tmp/val/checkpoints/ckpt_00000001.h5" ] || fail "SIGTERM in validation: no checkpoint"

# 4. SIGUSR1 at once, during MPI and Kokkos set-up.
"$PTRAIN" "$deck" "${small[@]}" --set run%steps=5 --set run%out_dir="'$tmp/early'" >"$tmp/early.log" 2>&1 &
pid=$!
sleep 0.2
kill -USR1 "$pid"
wait "$pid" || fail "SIGUSR1 during set-up: exit $? ($(tail -2 "$tmp/early.log"))"
grep -q "stopped by signal 10 after step 1" "$tmp/early.log" || fail "SIGUSR1 early: $(tail -2 "$tmp/early.log")"

# 5. A run that died after its checkpoint at step 4 (log.csv has rows 1..6), restarted.
"$PTRAIN" "$deck" "${small[@]}" --set run%steps=6 --set checkpoint%every=4 \
  --set run%out_dir="'$tmp/dup'" >"$tmp/dup.log" 2>&1 || fail "dup: first run"
"$PTRAIN" "$deck" "${small[@]}" --set run%steps=8 --set checkpoint%every=4 \
  --set checkpoint%restart="'$tmp/dup/checkpoints/ckpt_00000004.h5'" \
  --set run%out_dir="'$tmp/dup'" >"$tmp/dup2.log" 2>&1 || fail "dup: restart"
[ "$(awk -F, 'NR > 1 { print $1 }' "$tmp/dup/log.csv" | tr '\n' ' ')" = "1 2 3 4 5 6 7 8 " ] ||
  fail "log.csv after restart: steps $(awk -F, 'NR > 1 { print $1 }' "$tmp/dup/log.csv" | tr '\n' ' ')"
# 6. The user's files outside the deck, on 2 ranks: one line naming the file, exit 2, no
#    MPI_Abort banner.
for bad in "model%init_from='$tmp/none.h5'" "checkpoint%restart='$tmp/none.h5'"; do
  set +e
  launch 2 "$PTRAIN" "$deck" --set train%micro_batch=8 --set "$bad" --set run%out_dir="'$tmp/in'" \
    >/dev/null 2>"$tmp/in.err"
  rc=$?
  set -e
  [ "$rc" = 2 ] || fail "$bad: exit $rc, expected 2"
  [ "$(grep -c "none.h5" "$tmp/in.err")" = 1 ] || fail "$bad: $(cat "$tmp/in.err")"
  grep -q "MPI_ABORT" "$tmp/in.err" && fail "$bad: MPI_Abort banner"
done
# 7. A divergence that stays finite (issue 29, defect 5): with train%spike_factor a loss above
# that factor times the recent median stops the run like a non-finite one, before any
# checkpoint holds it ('stop'), or skips the step until max_skips ('skip').
spike=(--set run%steps=40 --set run%eval_every=0 --set train%lr=0.3 --set train%warmup=20
       --set train%micro_batch=4 --set train%spike_factor=1.1)
set +e
"$PTRAIN" "$deck" "${spike[@]}" --set checkpoint%every=1 --set checkpoint%keep=2 \
  --set run%out_dir="'$tmp/spike'" >"$tmp/spike.log" 2>&1; rc=$?
"$PTRAIN" "$deck" "${spike[@]}" --set train%nonfinite="'skip'" --set train%max_skips=3 \
  --set run%out_dir="'$tmp/spike_skip'" >"$tmp/spike_skip.log" 2>&1; rc_skip=$?
set -e
[ "$rc" = 1 ] || fail "spike: exit $rc, expected 1: $(tail -3 "$tmp/spike.log")"
line=$(grep "is above train%spike_factor = 1.1 times the median" "$tmp/spike.log") ||
  fail "spike: no line naming the spike: $(tail -3 "$tmp/spike.log")"
at=$(sed -n 's/^step \([0-9]*\): loss .*/\1/p' <<<"$line")
[ "$(cat "$tmp/spike/checkpoints/latest")" = "$(printf 'ckpt_%08d.h5' $((at - 1)))" ] ||
  fail "spike at step $at: latest is $(cat "$tmp/spike/checkpoints/latest")"
echo "nonfinite: $line"
[ "$rc_skip" = 1 ] || fail "spike, skip: exit $rc_skip, expected 1 after 3 skips"
grep -q "(3 steps skipped in a row). No checkpoint was written from this state; lower train%lr, or raise train%max_skips" \
  "$tmp/spike_skip.log" || fail "spike, skip: $(tail -2 "$tmp/spike_skip.log")"
[ "$(awk -F, 'NR > 1 && $15 == 1' "$tmp/spike_skip/log.csv" | wc -l)" = 3 ] ||
  fail "spike, skip: log.csv does not mark 3 skipped steps"
echo "nonfinite: all checks passed"
