#!/usr/bin/env bash
# Write faults on one rank of two in the middle of an HDF5 write (issue 29, defect 1), for a
# checkpoint and for final.h5: each run ends in bounded time (no hang), with one line naming
# the rank, the file and what went wrong, and the checkpoint, `latest` and final.h5 already
# there stay as they were, with no temporary file left.
#  1. rank 1 under `ulimit -f` (SIGXFSZ ignored), below the file's size: refused before step 1
#     from the deck's estimate of the file (exit 2; issue 29, defect 8), every rank alike;
#  2. a checkpoint's writes fail with EIO on rank 0 (lib/fail_writes.c, preloaded), in the
#     data and at the end of the file, where the failing write is HDF5's metadata flush inside
#     the close: the ranks part ways inside HDF5 and the I/O watchdog ends the job after
#     run%hang_timeout, with one line (final.h5 goes through the same code);
#  3. the EIO faults of a checkpoint written in the background (checkpoint%async): the I/O
#     watchdog ends the job the same way while the steps go on.
source "$(dirname "${BASH_SOURCE[0]}")/lib/prologue.sh"
: "${PTRAIN_FAIL_WRITES_LIB:?}"
deck="$PTRAIN_SOURCE_DIR/input/tiny.nml"
hang=5
common=(--set model%d_model=64 --set train%micro_batch=8 --set run%eval_every=0
        --set run%hang_timeout=$hang --set run%out_dir="'$tmp/out'")
cat >"$tmp/limited.sh" <<'EOF'
#!/usr/bin/env bash
trap '' XFSZ
ulimit -f 300
exec "$@"
EOF
chmod +x "$tmp/limited.sh"

# run NAME RANK0_WRAPPER RANK1_WRAPPER [--set ...]: 2 ranks, each under its wrapper ("" for
# none); sets $rc and $took, fails on a hang.
run() {
  local name=$1 w0=$2 w1=$3 t0=$SECONDS
  shift 3
  rc=0
  timeout 120 "$MPIEXEC" $MPIEXEC_PREFLAGS -np 1 $w0 "$PTRAIN" "$deck" "${common[@]}" "$@" : \
    -np 1 $w1 "$PTRAIN" "$deck" "${common[@]}" "$@" >"$tmp/$name.log" 2>&1 || rc=$?
  took=$((SECONDS - t0))
  [ "$rc" != 124 ] || fail "$name: still running after 120 s (hung): $(tail -3 "$tmp/$name.log")"
}
# one_line NAME PATTERN: the run failed and its log has exactly one line matching PATTERN
one_line() {
  [ "$rc" != 0 ] || fail "$1: exit 0 despite the write fault"
  local n
  n=$(grep -c -- "$2" "$tmp/$1.log" || true)
  [ "$n" = 1 ] || fail "$1: $n lines match '$2', expected one: $(grep -m3 -i 'error\|progress' "$tmp/$1.log")"
  echo "io_faults: $1 (exit $rc after ${took}s): $(grep -m1 -- "$2" "$tmp/$1.log" | cut -c1-240)"
}
# intact: the step-2 checkpoint, `latest` and final.h5 are as they were; no temporary file
intact() {
  [ "$(cat "$tmp/out/checkpoints/latest")" = ckpt_00000002.h5 ] || fail "$1: latest changed"
  cmp -s "$tmp/out/checkpoints/ckpt_00000002.h5" "$tmp/good.h5" || fail "$1: the step-2 checkpoint changed"
  cmp -s "$tmp/out/final.h5" "$tmp/good_final.h5" || fail "$1: final.h5 changed"
  local left
  left=$(find "$tmp/out" -name '*.tmp' | head -3)
  [ -z "$left" ] || fail "$1: temporary files left: $left"
}

# The good state: a checkpoint at step 2, and final.h5.
run good "" "" --set run%steps=2 --set checkpoint%every=2 --set checkpoint%save_final=.true.
[ "$rc" = 0 ] || fail "good run: $(tail -3 "$tmp/good.log")"
cp "$tmp/out/checkpoints/ckpt_00000002.h5" "$tmp/good.h5"
cp "$tmp/out/final.h5" "$tmp/good_final.h5"
restart=(--set run%steps=4 --set checkpoint%every=4 --set checkpoint%restart="'latest'")
final=(--set run%steps=2 --set checkpoint%every=0 --set checkpoint%save_final=.true.)

# 1. The file size limit.
run limit_ckpt "" "$tmp/limited.sh" "${restart[@]}"
one_line limit_ckpt "checkpoint%every: a checkpoint in .* cannot be written: rank 1's file size limit (ulimit -f)"
[ "$rc" = 2 ] && ! grep -q "^step" "$tmp/limit_ckpt.log" || fail "limit_ckpt: exit $rc, not 2 before step 1"
intact limit_ckpt
run limit_final "" "$tmp/limited.sh" "${final[@]}"
one_line limit_final "checkpoint%save_final: .*final.h5 .* rank 1's file size limit (ulimit -f)"
[ "$rc" = 2 ] && ! grep -q "^step" "$tmp/limit_final.log" || fail "limit_final: exit $rc, not 2 before step 1"
intact limit_final

# 2. and 3. EIO on rank 0 (Open MPI's collective writes go through it), early and at the close:
# a run that fails nothing counts the bytes rank 0 writes to the file (the last ones are the
# metadata HDF5 flushes at the close).
eio() { echo "env LD_PRELOAD=$PTRAIN_FAIL_WRITES_LIB PTRAIN_FAIL_WRITES_MATCH=.h5.tmp PTRAIN_FAIL_WRITES_AFTER=$1"; }
written() {  # written NAME [--set ...]: bytes rank 0 writes to *.h5.tmp in that run
  run "$1" "$(eio 1000000000000) PTRAIN_FAIL_WRITES_REPORT=1" "" "${@:2}"
  [ "$rc" = 0 ] || fail "$1: $(tail -3 "$tmp/$1.log")"
  sed -n 's/^fail_writes: \([0-9]*\) bytes$/\1/p' "$tmp/$1.log" | head -1
}
size=$(written count_ckpt "${restart[@]}" --set checkpoint%dir="'$tmp/count'")
[ -n "$size" ] && [ "$size" -gt 100000 ] || fail "the injector counted ${size:-no} bytes"
run eio_data_ckpt "$(eio 200000)" "" "${restart[@]}"
one_line eio_data_ckpt "ckpt_00000004.h5.*write"
intact eio_data_ckpt
run eio_close_ckpt "$(eio $((size - 1000)))" "" "${restart[@]}"
one_line eio_close_ckpt "no progress for $hang s (run%hang_timeout)"
[ "$took" -le $((hang + 30)) ] || fail "eio_close_ckpt: took ${took}s with run%hang_timeout = $hang"
intact eio_close_ckpt

# 3. In the background.
async=(--set checkpoint%async=.true.)
run eio_data_async "$(eio 200000)" "" "${restart[@]}" "${async[@]}"
one_line eio_data_async "ckpt_00000004.h5.*write"
intact eio_data_async
run eio_close_async "$(eio $((size - 1000)))" "" "${restart[@]}" "${async[@]}"
one_line eio_close_async "no progress for $hang s (run%hang_timeout)"
[ "$took" -le $((hang + 30)) ] || fail "eio_close_async: took ${took}s with run%hang_timeout = $hang"
intact eio_close_async
echo "io_faults: ok"
