#!/usr/bin/env bash
# Checkpoint and restart through the driver (issue 5):
#  - same grid: the restarted run reproduces the uninterrupted one bit for bit;
#  - other grids (2 ranks ZeRO 3 -> 1 rank, 1 rank -> 4 ranks ZeRO 1, tp 2 x dp 2 -> 1 rank
#    and -> dp 4, 1 rank -> tp 4): the same final loss to 1e-10 (fp64);
#  - SIGUSR1: checkpoint and exit 0, then resume;
#  - SIGKILL during a checkpoint write leaves the previous one as `latest`, which restarts;
#  - a corrupted or truncated checkpoint is refused, naming the problem.
set -euo pipefail
: "${PTRAIN:?}" "${PTRAIN_SOURCE_DIR:?}" "${MPIEXEC:=mpirun}"
fail() { echo "FAIL: $*" >&2; exit 1; }
tmp=$(mktemp -d); trap 'pkill -9 -f "$tmp" 2>/dev/null || true; rm -rf "$tmp"' EXIT
deck="$PTRAIN_SOURCE_DIR/input/tiny.nml"
run() {  # run NP OUT [--set ...]
  local np=$1 out=$2; shift 2
  timeout 300 "$MPIEXEC" $MPIEXEC_PREFLAGS -np "$np" "$PTRAIN" "$deck" --set model%dtype="'fp64'" \
    --set run%steps="${STEPS:-24}" --set train%micro_batch="${MB:-4}" --set model%vocab=61 --set run%eval_every=0 \
    --set run%out_dir="'$tmp/$out'" "$@" >"$tmp/$out.log" 2>&1 || fail "$out: $(grep -iE 'error|nml:' "$tmp/$out.log" | head -3)"
}
loss_at() { awk -F, -v s="$2" '$1 == s { v = $2 } END { print v }' "$tmp/$1/log.csv"; }  # the last record of step s
close() {  # close A B: relative difference below 1e-10
  awk -v a="$1" -v b="$2" 'BEGIN { d = (a - b) / b; if (d < 0) d = -d; exit !(d < 1e-10) }'
}

# Reference: 24 uninterrupted steps, and the same with a checkpoint every 8.
run 1 ref
run 1 ck --set checkpoint%every=8 --set checkpoint%keep=2
ls "$tmp/ck/checkpoints" | grep -q ckpt_00000016.h5 || fail "keep=2: step 16 missing"
ls "$tmp/ck/checkpoints" | grep -q ckpt_00000008.h5 && fail "keep=2: step 8 not pruned"
[ "$(cat "$tmp/ck/checkpoints/latest")" = ckpt_00000024.h5 ] || fail "latest"

# Same grid, bit for bit: restart at 16 and compare steps 17..24 to the last digit.
cp -r "$tmp/ck" "$tmp/same"
run 1 same --set checkpoint%restart="'$tmp/ck/checkpoints/ckpt_00000016.h5'"
for s in 17 20 24; do
  [ "$(loss_at same $s)" = "$(loss_at ref $s)" ] || fail "same-grid restart: step $s $(loss_at same $s) != $(loss_at ref $s)"
done
grep -q "restart: .*ckpt_00000016.h5 at step 16" "$tmp/same.log" || fail "restart message"

# Other grids.
want=$(loss_at ref 24)
check_grid() {  # NAME NP SETS... (restarting from the 1-rank checkpoint at 16 unless SRC is set)
  local name=$1 np=$2; shift 2
  run "$np" "$name" --set checkpoint%restart="'${SRC:-$tmp/ck/checkpoints/ckpt_00000016.h5}'" "$@"
  close "$(loss_at "$name" 24)" "$want" || fail "$name: loss $(loss_at "$name" 24) vs $want"
}
MB=2 check_grid to_d4_zero1 4 --set parallel%zero=1
check_grid to_t4 4 --set parallel%tp=4
# Checkpoints written by other grids, restarted on one rank and on dp 4.
STEPS=16 run 2 z3 --set parallel%zero=3 --set checkpoint%every=16
SRC="$tmp/z3/checkpoints/ckpt_00000016.h5" check_grid z3_to_1 1
STEPS=16 MB=2 run 4 t2d2 --set parallel%tp=2 --set parallel%zero=1 --set checkpoint%every=16
SRC="$tmp/t2d2/checkpoints/ckpt_00000016.h5" check_grid t2d2_to_1 1
MB=2 SRC="$tmp/t2d2/checkpoints/ckpt_00000016.h5" check_grid t2d2_to_d4 4 --set parallel%zero=2

# SIGUSR1: finish the step, checkpoint, exit 0; then resume to the same result. Started
# through the launcher (an MPICH singleton can hang reaching for its process manager), the
# signal goes to ptrain itself: the process whose command line starts with $PTRAIN.
timeout 300 "$MPIEXEC" $MPIEXEC_PREFLAGS -np 1 "$PTRAIN" "$deck" --set model%dtype="'fp64'" \
  --set run%steps=100000 --set train%micro_batch=4 --set model%vocab=61 \
  --set run%out_dir="'$tmp/sig'" --set run%log_every=1 >"$tmp/sig.log" 2>&1 &
pid=$!
for _ in $(seq 600); do grep -q "^step *5/" "$tmp/sig.log" 2>/dev/null && break; sleep 0.05; done
rank=$(pgrep -f "^$PTRAIN .*$tmp/sig" | head -1) || fail "SIGUSR1: no ptrain process: $(tail -3 "$tmp/sig.log")"
kill -USR1 "$rank"
set +e; wait $pid; rc=$?; set -e
[ "$rc" = 0 ] || fail "SIGUSR1: exit $rc: $(tail -3 "$tmp/sig.log")"
grep -q "stopped by signal 10 after step" "$tmp/sig.log" || fail "no signal message"
[ -f "$tmp/sig/checkpoints/latest" ] || fail "no checkpoint after SIGUSR1"

# SIGKILL during a checkpoint write: `latest` still names a whole, verified file.
"$PTRAIN" "$deck" --set run%steps=100000 --set model%d_model=384 --set model%n_head=4 \
  --set model%n_layer=4 --set run%out_dir="'$tmp/kill'" --set checkpoint%every=1 \
  --set train%micro_batch=4 --set run%log_every=1 >"$tmp/kill.log" 2>&1 &
pid=$!
killed=no
for _ in $(seq 3000); do  # until a checkpoint exists and the next one is being written
  if [ -f "$tmp/kill/checkpoints/latest" ] && ls "$tmp/kill/checkpoints/".ckpt_*.tmp >/dev/null 2>&1; then
    kill -9 $pid; killed=yes; break
  fi
  sleep 0.01
done
set +e; wait $pid 2>/dev/null; set -e
[ "$killed" = yes ] || fail "never caught a checkpoint write in progress"
latest=$(cat "$tmp/kill/checkpoints/latest")
[ -f "$tmp/kill/checkpoints/$latest" ] || fail "latest names a missing file"
step=$(sed 's/ckpt_0*\([0-9]*\).h5/\1/' <<<"$latest")
"$PTRAIN" "$deck" --set run%steps=$((step + 1)) --set model%d_model=384 --set model%n_head=4 \
  --set model%n_layer=4 --set run%out_dir="'$tmp/kill'" --set train%micro_batch=4 \
  --set checkpoint%restart="'latest'" >"$tmp/kill2.log" 2>&1 || fail "restart after SIGKILL: $(tail -3 "$tmp/kill2.log")"
grep -q "at step $step " "$tmp/kill2.log" || fail "restart after SIGKILL did not resume at $step"

# Refused files: one flipped byte in a tensor's data, a truncated file.
f="$tmp/ck/checkpoints/ckpt_00000024.h5"
cp "$f" "$tmp/bad.h5"
/usr/bin/python3 - "$tmp/bad.h5" <<'PY'
import sys, h5py
path = sys.argv[1]
with h5py.File(path, "r") as h:
    off = h["/model/h.0.mlp.fc.weight"].id.get_offset()
with open(path, "r+b") as f:
    f.seek(off + 3); b = f.read(1); f.seek(off + 3); f.write(bytes([b[0] ^ 0xFF]))
PY
set +e
"$PTRAIN" "$deck" --set model%dtype="'fp64'" --set model%vocab=61 --set run%out_dir="'$tmp/x'" \
  --set checkpoint%restart="'$tmp/bad.h5'" >"$tmp/bad.log" 2>&1; rc=$?
set -e
[ "$rc" != 0 ] || fail "corrupted checkpoint accepted"
grep -q "h.0.mlp.fc.weight checksum mismatch" "$tmp/bad.log" || fail "corruption message: $(tail -2 "$tmp/bad.log")"
head -c 20000 "$f" >"$tmp/short.h5"
set +e
"$PTRAIN" "$deck" --set model%dtype="'fp64'" --set model%vocab=61 --set run%out_dir="'$tmp/x'" \
  --set checkpoint%restart="'$tmp/short.h5'" >"$tmp/short.log" 2>&1; rc=$?
set -e
[ "$rc" != 0 ] || fail "truncated checkpoint accepted"
grep -qi "truncated\|cannot read" "$tmp/short.log" || fail "truncation message: $(tail -2 "$tmp/short.log")"
command -v h5dump >/dev/null && { h5dump -H "$f" >/dev/null || fail "h5dump cannot read a checkpoint"; }
echo "restart: all checks passed"
