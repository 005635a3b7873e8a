#!/usr/bin/env bash
# A run never prunes checkpoints it did not write (issue 29, defects 2 and 3):
#  1. a fresh run (restart = '') that writes checkpoints into a folder holding another run's is
#     refused (exit 2, one line naming the folder and what is there), the folder untouched; on
#     4 ranks only rank 0, which prints the line, exits non-zero;
#  2. restart = 'latest' with no `latest` in a folder of checkpoints is refused the same way
#     (it used to start from step 0 and prune them), and a `latest` naming a missing file too;
#  3. checkpoint%overwrite = .true. removes the earlier run's checkpoints, then trains afresh;
#  4. checkpoint%keep_best keeps the checkpoint of the lowest validation loss besides the newest;
#  5. a run owns its folders (issue 29, defect 3): while one runs, a second run into its out_dir,
#     or into its checkpoint folder from another out_dir, is refused (exit 2, one line naming
#     the holder), the first goes on and its files stay its own; a lock whose run is over (its
#     process gone on this host, or its heartbeat old) is taken over with one warning, a live
#     one of another host refused; no lock is left after a run ends, stops on a signal, or
#     is refused.
source "$(dirname "${BASH_SOURCE[0]}")/lib/prologue.sh"
deck="$PTRAIN_SOURCE_DIR/input/tiny.nml"
ck="$tmp/out/checkpoints"
common=(--set run%steps=4 --set checkpoint%every=2 --set run%eval_every=0 --set run%out_dir="'$tmp/out'")
run() {  # run NAME [--set ...]: one rank; sets $rc
  local name=$1
  shift
  rc=0
  timeout 120 "$PTRAIN" "$deck" "${common[@]}" "$@" >"$tmp/$name.log" 2>&1 || rc=$?
}
refused() {  # refused NAME PATTERN: exit 2, one line, matching PATTERN; the folder as it was
  [ "$rc" = 2 ] || fail "$1: exit $rc, not 2: $(tail -3 "$tmp/$1.log")"
  [ "$(grep -c -- "$2" "$tmp/$1.log")" = 1 ] || fail "$1: no one line saying '$2': $(tail -3 "$tmp/$1.log")"
  ! grep -q "^step\|^resolved deck" "$tmp/$1.log" || fail "$1: went on after the refusal"
  [ "$(cd "$ck" && ls -A | tr '\n' ' ')" = "$3" ] || fail "$1: the folder changed: $(ls -A "$ck")"
  cmp -s "$ck/ckpt_00000004.h5" "$tmp/kept.h5" || fail "$1: ckpt_00000004.h5 changed"
  [ ! -e "$tmp/out/.ptrain.lock" ] || fail "$1: the refused run left its lock in run%out_dir"
  echo "folders: $1: $(grep -m1 -- "$2" "$tmp/$1.log" | cut -c1-200)"
}

run first
[ "$rc" = 0 ] || fail "first run: $(tail -3 "$tmp/first.log")"
cp "$ck/ckpt_00000004.h5" "$tmp/kept.h5"

# 1. A fresh run into it.
run fresh
refused fresh "holds checkpoints of an earlier run (ckpt_00000004.h5, ckpt_00000002.h5)" \
  "ckpt_00000002.h5 ckpt_00000004.h5 latest "

# The same refusal on 4 ranks: printed once, the launcher exits 2, and only rank 0 exits
# non-zero (issue 29, defect 8: a launcher that sees another rank's non-zero exit first may
# drop rank 0's line).
printf '%s\n' '#!/usr/bin/env bash' 'rc=0' '"$@" || rc=$?' \
  'echo "rank ${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-${SLURM_PROCID:-?}}} exit $rc" >>"${0%/*}/codes"' \
  'exit $rc' >"$tmp/code.sh"
chmod +x "$tmp/code.sh"
rc=0
timeout 120 "$MPIEXEC" $MPIEXEC_PREFLAGS -np 4 "$tmp/code.sh" "$PTRAIN" "$deck" "${common[@]}" \
  --set train%micro_batch=4 >"$tmp/fresh4.log" 2>&1 || rc=$?
refused fresh4 "holds checkpoints of an earlier run" "ckpt_00000002.h5 ckpt_00000004.h5 latest "
# Once rank 0 has exited 2 the launcher may end the others before their wrapper writes its
# line: every line written says exit 0 but rank 0's.
grep -qx "rank 0 exit 2" "$tmp/codes" && ! grep -v "^rank 0 " "$tmp/codes" | grep -qv " exit 0$" ||
  fail "fresh4: the ranks' exit codes are $(sort "$tmp/codes" | tr '\n' ' ')"

# 2. No `latest`, then a dangling one.
mv "$ck/latest" "$tmp/latest"
run no_latest --set checkpoint%restart="'latest'"
refused no_latest "has no \`latest\` pointer but holds ckpt_00000004.h5, ckpt_00000002.h5" \
  "ckpt_00000002.h5 ckpt_00000004.h5 "
echo ckpt_00000009.h5 >"$ck/latest"
run dangling --set checkpoint%restart="'latest'"
refused dangling "points at ckpt_00000009.h5, which does not exist" \
  "ckpt_00000002.h5 ckpt_00000004.h5 latest "

# 3. Overwrite.
run overwrite --set checkpoint%overwrite=.true.
[ "$rc" = 0 ] || fail "overwrite: $(tail -3 "$tmp/overwrite.log")"
grep -q "removed 2 checkpoint(s) of an earlier run" "$tmp/overwrite.log" ||
  fail "overwrite: no line saying what was removed"
[ "$(cat "$ck/latest")" = ckpt_00000004.h5 ] || fail "overwrite: latest is $(cat "$ck/latest")"
# 4. checkpoint%keep_best (defect 5): besides the newest 2, the checkpoint of the lowest
# validation loss stays, however old (the validation loss rises for a while at this lr).
rm -rf "$tmp/out"
best=(--set run%steps=12 --set run%eval_every=1 --set train%lr=0.3 --set train%warmup=20
      --set train%micro_batch=4 --set data%val_samples=16 --set checkpoint%every=1
      --set checkpoint%keep=2)
rc=0
timeout 120 "$PTRAIN" "$deck" "${best[@]}" --set checkpoint%keep_best=.true. --set run%out_dir="'$tmp/out'" \
  >"$tmp/best.log" 2>&1 || rc=$?
[ "$rc" = 0 ] || fail "keep_best: $(tail -3 "$tmp/best.log")"
lowest=$(awk -F, 'NR > 1 { print $1, $3 }' "$tmp/out/log.csv" | sort -k2 -g | head -1 | cut -d' ' -f1)
want=$(printf 'ckpt_%08d.h5\n' "$lowest" 11 12 | sort -u | tr '\n' ' ')
[ "$(cd "$ck" && ls ckpt_* | tr '\n' ' ')" = "$want" ] ||
  fail "keep_best: kept $(ls "$ck"), expected $want (lowest validation loss at step $lowest)"
echo "folders: keep_best kept $want(lowest validation loss at step $lowest)"
# 5. The folder lock.
own="$tmp/own"
lock="$own/.ptrain.lock"
quick=(--set run%eval_every=0 --set backend%peak_gflops=1 --set checkpoint%every=1)
unlocked() {  # unlocked NAME FOLDER...: no lock file left in the folders
  local d
  for d in "${@:2}"; do [ ! -e "$d/.ptrain.lock" ] || fail "$1: $d/.ptrain.lock left behind"; done
}
"$PTRAIN" "$deck" "${quick[@]}" --set run%steps=1000000 --set run%name="'first'" \
  --set run%out_dir="'$own'" >"$tmp/first_own.log" 2>&1 &  # ended below (or by the trap)
first=$!
for _ in $(seq 600); do [ -s "$own/deck.nml" ] && [ -s "$own/checkpoints/latest" ] && break; sleep 0.1; done
[ -e "$lock" ] && [ -e "$own/checkpoints/.ptrain.lock" ] || fail "the first run holds no lock"
grep -q "^host = $(hostname)$" "$lock" && grep -q "^pid = $first$" "$lock" ||
  fail "the lock does not name the first run: $(cat "$lock")"
rc=0
timeout 120 "$PTRAIN" "$deck" "${quick[@]}" --set run%steps=2 --set run%name="'second'" \
  --set run%out_dir="'$own'" >"$tmp/same_out.log" 2>&1 || rc=$?
[ "$rc" = 2 ] || fail "same out_dir: exit $rc, not 2: $(tail -2 "$tmp/same_out.log")"
[ "$(grep -c "^run%out_dir '$own' is in use by another run (host $(hostname), pid $first, .*); if that run has ended, remove $lock$" "$tmp/same_out.log")" = 1 ] ||
  fail "same out_dir: not one line naming the holder: $(tail -2 "$tmp/same_out.log")"
rc=0
timeout 120 "$PTRAIN" "$deck" "${quick[@]}" --set run%steps=2 --set run%out_dir="'$tmp/other'" \
  --set checkpoint%dir="'$own/checkpoints'" >"$tmp/same_ck.log" 2>&1 || rc=$?
[ "$rc" = 2 ] || fail "same checkpoint%dir: exit $rc, not 2: $(tail -2 "$tmp/same_ck.log")"
[ "$(grep -c "^checkpoint%dir '$own/checkpoints' is in use by another run (host $(hostname), pid $first, " "$tmp/same_ck.log")" = 1 ] ||
  fail "same checkpoint%dir: not one line naming the holder: $(tail -2 "$tmp/same_ck.log")"
unlocked same_ck "$tmp/other"
kill -0 "$first" 2>/dev/null || fail "the first run ended: $(tail -3 "$tmp/first_own.log")"
kill -TERM "$first"
rc=0
wait "$first" || rc=$?
[ "$rc" = 0 ] || fail "the first run, stopped by SIGTERM: exit $rc: $(tail -3 "$tmp/first_own.log")"
grep -q "^ *name *= 'first'" "$own/deck.nml" || fail "deck.nml is not the first run's"
! grep -qi "error\|warning" "$tmp/first_own.log" || fail "the first run was disturbed: $(grep -i "error\|warning" "$tmp/first_own.log")"
[ -s "$own/checkpoints/$(cat "$own/checkpoints/latest")" ] || fail "latest names no checkpoint"
unlocked "stopped by a signal" "$own" "$own/checkpoints"
echo "folders: lock: $(grep -m1 "is in use" "$tmp/same_out.log" | cut -c1-200)"

# Stale and live locks of others (out_dir only: checkpoint%every = 0).
stale() {  # stale NAME HOST PID: a lock of that holder, then a 2-step run; sets $rc
  printf 'host = %s\npid = %s\nslurm_job = 991\nstarted = 2026-01-01T00:00:00Z\n' "$2" "$3" >"$lock"
  [ -z "${4:-}" ] || touch -d "$4" "$lock"
  rc=0
  timeout 120 "$PTRAIN" "$deck" --set run%eval_every=0 --set backend%peak_gflops=1 \
    --set run%steps=2 --set run%out_dir="'$own'" >"$tmp/$1.log" 2>&1 || rc=$?
}
rm -rf "$own" && mkdir "$own"
stale dead_pid "$(hostname)" "$(sh -c 'echo $$')"
[ "$rc" = 0 ] || fail "dead_pid: exit $rc: $(tail -2 "$tmp/dead_pid.log")"
[ "$(grep -c "^warning: run%out_dir '$own': took over the lock of a run that has ended (host $(hostname), pid [0-9]*, Slurm job 991, .*): its process is gone$" "$tmp/dead_pid.log")" = 1 ] ||
  fail "dead_pid: no one warning naming the old holder: $(grep -i lock "$tmp/dead_pid.log")"
unlocked "a normal end" "$own"
stale old_heartbeat n12 4242 "-10 minutes"
[ "$rc" = 0 ] || fail "old_heartbeat: exit $rc: $(tail -2 "$tmp/old_heartbeat.log")"
[ "$(grep -c "^warning: run%out_dir '$own': took over the lock .*(host n12, pid 4242, .*): its heartbeat stopped [0-9]* s ago" "$tmp/old_heartbeat.log")" = 1 ] ||
  fail "old_heartbeat: no one warning: $(grep -i lock "$tmp/old_heartbeat.log")"
unlocked old_heartbeat "$own"
stale live_foreign n12 4242
[ "$rc" = 2 ] || fail "live_foreign: exit $rc, not 2: $(tail -2 "$tmp/live_foreign.log")"
[ "$(grep -c "^run%out_dir '$own' is in use by another run (host n12, pid 4242, Slurm job 991, started 2026-01-01T00:00:00Z, lock refreshed [0-9]* s ago); if that run has ended, remove $lock$" "$tmp/live_foreign.log")" = 1 ] ||
  fail "live_foreign: not one line naming the holder: $(tail -2 "$tmp/live_foreign.log")"
grep -q "^host = n12$" "$lock" || fail "live_foreign: the other run's lock was changed"
echo "folders: lock: $(grep -m1 "took over" "$tmp/old_heartbeat.log" | cut -c1-200)"
echo "folders: ok"
