#!/usr/bin/env bash
# The hang watchdog (issue 11): on 2 ranks, rank 1 stalls at the start of step 1; rank 0,
# waiting in the dense-grad all-reduce, reports within run%hang_timeout which group,
# operation and sequence number it waits on and that rank 1 has not arrived, then the job
# ends non-zero instead of hanging.
source "$(dirname "${BASH_SOURCE[0]}")/lib/prologue.sh"
t0=$(date +%s)
set +e
timeout 60 "$MPIEXEC" $MPIEXEC_PREFLAGS -np 2 "$PTRAIN" "$PTRAIN_SOURCE_DIR/input/tiny.nml" \
  --set train%micro_batch=8 --set run%steps=3 --set run%debug_hang_rank=1 --set run%hang_timeout=3 \
  --set run%out_dir="'$tmp/out'" >"$tmp/log" 2>&1
rc=$?
set -e
took=$(( $(date +%s) - t0 ))
[ "$rc" != 0 ] && [ "$rc" != 124 ] || { tail -5 "$tmp/log"; fail "exit $rc (124: the job hung)"; }
grep -q "hang: waited 3.* for all-reduce #1 on group 'dense-grad'; not arrived: rank 1 (at #0)" "$tmp/log" ||
  { tail -5 "$tmp/log"; fail "no watchdog report naming rank 1"; }
(( took < 30 )) || fail "took $took s"
echo "hang: reported in $took s"
