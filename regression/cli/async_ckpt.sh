#!/usr/bin/env bash
# checkpoint%async (issue 29, "checkpoints in the background"): a thread of every rank writes
# the checkpoint from a host snapshot while the steps go on. On a slowed file system
# (lib/fail_writes.c delays every write of a checkpoint file) each write spans several steps:
#  1. the weights changed after the snapshot do not reach the file: every dataset of every
#     checkpoint equals the synchronous run's, bit for bit (dp 2 ZeRO 1 fp32; tp 2 bf16, whose
#     snapshot holds fp32 masters and takes tp-replicated tensors from tp rank 0 only);
#  2. kill -9 in the middle of a write leaves `latest` naming the previous, whole checkpoint,
#     from which the run restarts (and the next save removes the orphaned temporary file);
#  3. a stop signal during a write waits for it, writes the stop's checkpoint and exits 0.
source "$(dirname "${BASH_SOURCE[0]}")/lib/prologue.sh"
: "${PTRAIN_FAIL_WRITES_LIB:?}"
deck="$PTRAIN_SOURCE_DIR/input/tiny.nml"
py=/usr/bin/python3  # Debian's, with h5py
common=(--set train%micro_batch=4 --set run%eval_every=0 --set run%log_every=1000)
# slowed MS: the command line prefix that delays each write of a checkpoint file by MS ms
slowed() {
  echo "env LD_PRELOAD=$PTRAIN_FAIL_WRITES_LIB PTRAIN_FAIL_WRITES_MATCH=.h5.tmp" \
    "PTRAIN_FAIL_WRITES_AFTER=1000000000000 PTRAIN_FAIL_WRITES_DELAY_MS=$1"
}

# 1. Async equals sync, dataset by dataset.
same_files() {  # same_files NAME [--set ...]
  local name=$1
  shift
  for mode in sync async; do
    local prefix="" rc=0
    [ "$mode" = async ] && prefix=$(slowed 15)
    timeout 120 "$MPIEXEC" $MPIEXEC_PREFLAGS -np 2 $prefix "$PTRAIN" "$deck" "${common[@]}" "$@" \
      --set run%steps=8 --set checkpoint%every=4 \
      --set checkpoint%async=.$([ "$mode" = async ] && echo true || echo false). \
      --set run%out_dir="'$tmp/$name-$mode'" >"$tmp/$name-$mode.log" 2>&1 || rc=$?
    [ "$rc" = 0 ] || fail "$name $mode: exit $rc: $(tail -3 "$tmp/$name-$mode.log")"
  done
  grep -q "checkpoint: step 4 -> .*in the background during steps 5-" "$tmp/$name-async.log" ||
    fail "$name: the step-4 write did not overlap the next steps: $(grep 'checkpoint:' "$tmp/$name-async.log")"
  "$py" - "$tmp/$name-sync/checkpoints" "$tmp/$name-async/checkpoints" <<'EOF' || fail "$name: async checkpoints differ from sync ones"
import os, sys
import h5py, numpy as np
a_dir, b_dir = sys.argv[1:]
names = sorted(n for n in os.listdir(a_dir) if n.endswith(".h5"))
assert names == sorted(n for n in os.listdir(b_dir) if n.endswith(".h5")), (names, os.listdir(b_dir))
for n in names:
    with h5py.File(os.path.join(a_dir, n)) as a, h5py.File(os.path.join(b_dir, n)) as b:
        paths = []
        a.visititems(lambda p, o: paths.append(p) if isinstance(o, h5py.Dataset) else None)
        assert len(paths) > 10, (n, paths)
        for p in paths:
            x, y = a[p][()], b[p][()]
            if x.dtype != y.dtype or not np.array_equal(x, y) or a[p].attrs["checksum"] != b[p].attrs["checksum"]:
                sys.exit(f"{n}: {p} differs")
    print(f"async_ckpt: {n}: {len(paths)} datasets equal")
EOF
}
same_files dp2 --set parallel%zero=1
same_files tp2 --set parallel%tp=2 --set model%dtype="'bf16'"

# 2. kill -9 while the step-8 checkpoint is written: `latest` still names step 4's, whole.
out="$tmp/kill"
launch 2 $(slowed 15) "$PTRAIN" "$deck" "${common[@]}" --set run%steps=1000 --set checkpoint%every=4 \
  --set checkpoint%async=.true. --set run%out_dir="'$out'" >"$tmp/kill.log" 2>&1 &
for _ in $(seq 600); do
  [ -e "$out/checkpoints/.ckpt_00000008.h5.tmp" ] && break
  sleep 0.1
done
[ -e "$out/checkpoints/.ckpt_00000008.h5.tmp" ] || fail "kill: no step-8 write began: $(tail -3 "$tmp/kill.log")"
pkill -9 -f "run%out_dir='$out'" || true
wait || true
grep -q "checkpoint: step 8 copied" "$tmp/kill.log" || fail "kill: no step-8 snapshot: $(tail -3 "$tmp/kill.log")"
[ "$(cat "$out/checkpoints/latest")" = ckpt_00000004.h5 ] || fail "kill: latest is $(cat "$out/checkpoints/latest")"
[ ! -e "$out/checkpoints/ckpt_00000008.h5" ] || fail "kill: a step-8 checkpoint was published"
"$py" "$PTRAIN_SOURCE_DIR/postprocess/ckpt_tool.py" verify "$out/checkpoints/ckpt_00000004.h5" >/dev/null ||
  fail "kill: the step-4 checkpoint does not verify"
rc=0
launch 2 "$PTRAIN" "$deck" "${common[@]}" --set run%steps=8 --set checkpoint%every=4 \
  --set checkpoint%async=.true. --set checkpoint%restart="'latest'" --set run%out_dir="'$out'" \
  >"$tmp/kill-restart.log" 2>&1 || rc=$?
[ "$rc" = 0 ] || fail "kill: the restart failed: $(grep -m2 -i "error\|in use\|refus" "$tmp/kill-restart.log")"
grep -q "restart: .*ckpt_00000004.h5 at step 4" "$tmp/kill-restart.log" || fail "kill: did not restart from step 4"
[ "$(cat "$out/checkpoints/latest")" = ckpt_00000008.h5 ] || fail "kill: the restart's latest is $(cat "$out/checkpoints/latest")"
[ ! -e "$out/checkpoints/.ckpt_00000008.h5.tmp" ] || fail "kill: the orphaned temporary file is still there"
echo "async_ckpt: kill -9 during the step-8 write: latest = step 4, verified, restarted (${SECONDS}s)"

# 3. SIGTERM while the step-4 checkpoint is written: it is finished, then the stop's own.
out="$tmp/stop"
rc=0
launch 2 $(slowed 15) "$PTRAIN" "$deck" "${common[@]}" --set run%steps=100000 --set checkpoint%every=4 \
  --set checkpoint%async=.true. --set run%out_dir="'$out'" >"$tmp/stop.log" 2>&1 &
pid=$!
for _ in $(seq 600); do
  grep -q "checkpoint: step 4 copied" "$tmp/stop.log" && break
  sleep 0.1
done
rank=$(pgrep -f "^$PTRAIN .*run%out_dir='$out'" | head -1)
[ -n "$rank" ] || fail "stop: no ptrain process: $(tail -3 "$tmp/stop.log")"
kill -TERM "$rank"  # one rank: every rank agrees on it at the step's end
wait "$pid" || rc=$?
[ "$rc" = 0 ] || fail "stop: exit $rc: $(tail -3 "$tmp/stop.log")"
stopped=$(sed -n 's/^stopped by signal [0-9]* after step \([0-9]*\) .*/\1/p' "$tmp/stop.log")
[ -n "$stopped" ] || fail "stop: no stop line: $(tail -3 "$tmp/stop.log")"
grep -q "checkpoint: step 4 -> .*in the background" "$tmp/stop.log" || fail "stop: the step-4 write was not finished"
[ "$(cat "$out/checkpoints/latest")" = "$(printf 'ckpt_%08d.h5' "$stopped")" ] ||
  fail "stop: latest is $(cat "$out/checkpoints/latest"), the run stopped after step $stopped"
echo "async_ckpt: SIGTERM during the step-4 write: it finished, then the step-$stopped checkpoint (${SECONDS}s)"
echo "async_ckpt: ok (${SECONDS}s)"
