#!/usr/bin/env bash
# Data parallelism through the driver: a 2-rank ZeRO run trains and logs its gradient
# traffic; a rank that fails mid-step ends the job with a message naming it, no hang.
source "$(dirname "${BASH_SOURCE[0]}")/lib/prologue.sh"
deck="$PTRAIN_SOURCE_DIR/input/tiny.nml"
common=(--set train%micro_batch=4 --set run%steps=30 --set run%eval_every=0)

timeout 120 "$MPIEXEC" $MPIEXEC_PREFLAGS -np 2 "$PTRAIN" "$deck" "${common[@]}" \
  --set parallel%zero=2 --set run%out_dir="'$tmp/z2'" >"$tmp/z2.log" 2>&1 || fail "2-rank run: $(tail -5 "$tmp/z2.log")"
grep -q "dense-grad comm .* overlapped" "$tmp/z2.log" || fail "no data-parallel traffic in the log line"
# log.csv has columns for each group with more than one rank, read by name.
header=$(head -n 1 "$tmp/z2/log.csv")
for c in bytes_dense_grad exposed_dense_grad_s overlap_dense_grad; do
  tr , '\n' <<<"$header" | grep -qx "$c" || fail "no $c column in log.csv: $header"
done
bytes=$(awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) if ($i == "bytes_dense_grad") k = i } { v = $k } END { print v }' "$tmp/z2/log.csv")
awk -v b="$bytes" 'BEGIN { exit !(b > 0) }' || fail "bytes_dense_grad column is '$bytes'"
[ "$(wc -l <"$tmp/z2/log.csv")" = 31 ] || fail "log.csv rows"

set +e
timeout 120 "$MPIEXEC" $MPIEXEC_PREFLAGS -np 2 "$PTRAIN" "$deck" "${common[@]}" \
  --set run%debug_fail_rank=1 --set run%out_dir="'$tmp/fail'" >"$tmp/fail.log" 2>&1; rc=$?
set -e
[ "$rc" != 0 ] || fail "a failing rank did not fail the job"
[ "$rc" != 124 ] || fail "the job hung after a rank failed"
grep -q "\[rank 1\] error: run%debug_fail_rank: rank 1 fails on purpose" "$tmp/fail.log" \
  || fail "message does not name the rank: $(tail -5 "$tmp/fail.log")"
echo "data_parallel: all checks passed"
