#!/usr/bin/env bash
# Context parallelism through the driver:
#  - a checkpoint written at cp 4 (zigzag) resumes on one rank, and a one-rank checkpoint
#    resumes at cp 4: the same losses as the uninterrupted one-rank run to 1e-10 (fp64);
#  - log.csv has the cp columns, and the bytes the ring sent per step are what `--plan`
#    says; the log line reports the cp traffic and its exposed time;
#  - run%trace records the ring's waits on the cp group;
#  - a sequence that does not split in 2*cp chunks is refused before step 1 (exit 2).
source "$(dirname "$0")/lib/prologue.sh"
source "$(dirname "$0")/lib/compare.sh"
deck="$PTRAIN_SOURCE_DIR/input/tiny.nml"
common=(--set model%dtype="'fp64'" --set model%vocab=61 --set train%micro_batch=4
        --set run%eval_every=0)
run() {  # run NP OUT [--set ...]
  local np=$1 out=$2; shift 2
  timeout 300 "$MPIEXEC" $MPIEXEC_PREFLAGS -np "$np" "$PTRAIN" "$deck" "${common[@]}" \
    --set run%steps="${STEPS:-12}" --set run%out_dir="'$tmp/$out'" "$@" \
    >"$tmp/$out.log" 2>&1 || fail "$out: $(grep -iE 'error|nml:' "$tmp/$out.log" | head -3)"
}

run 1 ref
STEPS=6 run 1 one --set checkpoint%every=6
STEPS=6 run 4 c4 --set parallel%cp=4 --set checkpoint%every=6
ck() { echo "--set checkpoint%restart='$tmp/$1/checkpoints/ckpt_00000006.h5'"; }
run 1 c4_to_1 $(ck c4)
same_losses c4_to_1
run 4 one_to_c4 $(ck one) --set parallel%cp=4
same_losses one_to_c4

# Traffic: the ring's bytes per step in log.csv, the same every step, equal to the plan's.
sent=$(column c4 bytes_cp 3)
[ -n "$sent" ] && [ "$sent" != 0 ] || fail "no bytes_cp in log.csv: $(head -1 "$tmp/c4/log.csv")"
[ -n "$(column c4 exposed_cp_s 3)" ] || fail "no exposed_cp_s column"
[ "$(column c4 bytes_cp 5)" = "$sent" ] || fail "bytes_cp differs between steps 3 and 5"
grep -qE "\| cp comm [0-9.]+ [KMG]?i?B, [0-9.]+ s exposed" "$tmp/c4.log" || fail "no cp traffic in the log line"
"$PTRAIN" "$deck" "${common[@]}" --set parallel%cp=4 --plan --world 4 >"$tmp/plan.log" 2>&1 ||
  fail "plan: $(tail -3 "$tmp/plan.log")"
# "..., 5.00 MiB per step (...)": the measured bytes in the plan's unit, to its 3 digits.
planned=$(sed -nE 's/^context parallel:.* ([0-9.]+ [KMG]?i?B) per step.*/\1/p' "$tmp/plan.log" | head -1)
measured=$(awk -v b="$sent" -v u="${planned#* }" 'BEGIN {
  f = u == "KiB" ? 1024 : u == "MiB" ? 1048576 : u == "GiB" ? 1073741824 : 1; printf "%.2f %s", b / f, u }')
[ -n "$planned" ] && [ "$planned" = "$measured" ] ||
  fail "the plan's cp traffic per step '$planned' is not the measured $sent bytes: $(grep -i 'context' "$tmp/plan.log")"

# The trace: the ring's waits on the cp group next to attention compute.
STEPS=2 run 2 traced --set parallel%cp=2 --set run%trace=.true.
for r in 0 1; do
  f="$tmp/traced/trace/rank$r.csv"
  grep -q ",comm:cp," "$f" || fail "rank $r: no cp events in the trace"
  grep -q ",attention,compute," "$f" || fail "rank $r: no attention compute in the trace"
done

# 2*cp = 8 does not divide seq_len = 60: one line naming the keys, exit 2, before step 1.
set +e
"$PTRAIN" "$deck" --set parallel%cp=4 --set model%seq_len=60 --plan --world 4 >"$tmp/bad.log" 2>&1; rc=$?
set -e
[ "$rc" = 2 ] || fail "seq_len 60 at cp 4: exit $rc"
grep -q "parallel%cp" "$tmp/bad.log" && grep -q "model%seq_len" "$tmp/bad.log" || fail "message: $(cat "$tmp/bad.log")"
echo "context: all checks passed"
