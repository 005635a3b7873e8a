#!/usr/bin/env bash
# Mixture of experts through the driver:
#  - a checkpoint written at ep 4 resumes on one rank, and a one-rank checkpoint resumes at
#    ep 4: the same losses as the uninterrupted one-rank run to 1e-10 (fp64); the file holds
#    the experts at global shape [n_expert, ...];
#  - the same with experts sharded over the expert-grad group by ZeRO (ep 2 x dp 2, ZeRO 3
#    to one rank, one rank to ZeRO 1): parameters and AdamW moments move between shardings;
#  - log.csv has the ep traffic and the MoE columns, per layer too (loads consistent with the
#    batch's token choices); the log prints the per-layer loads;
#  - deck mistakes (ep not dividing n_expert, top_k > n_expert) are refused before step 1
#    with exit code 2.
source "$(dirname "$0")/lib/prologue.sh"
source "$(dirname "$0")/lib/compare.sh"
deck="$PTRAIN_SOURCE_DIR/input/tiny.nml"
common=(--set model%dtype="'fp64'" --set model%vocab=61 --set model%n_layer=2
        --set model%n_expert=4 --set model%top_k=2 --set train%micro_batch=4 --set run%eval_every=0)
run() {  # run NP OUT [--set ...]
  local np=$1 out=$2; shift 2
  timeout 300 "$MPIEXEC" $MPIEXEC_PREFLAGS -np "$np" "$PTRAIN" "$deck" "${common[@]}" \
    --set run%steps="${STEPS:-12}" --set run%out_dir="'$tmp/$out'" "$@" \
    >"$tmp/$out.log" 2>&1 || fail "$out: $(grep -iE 'error|nml:|not implemented' "$tmp/$out.log" | head -3)"
}

run 1 ref
STEPS=6 run 1 one --set checkpoint%every=6
STEPS=6 run 4 e4 --set parallel%ep=4 --set checkpoint%every=6
ck() { echo "--set checkpoint%restart='$tmp/$1/checkpoints/ckpt_00000006.h5'"; }
run 1 e4_to_1 $(ck e4)
same_losses e4_to_1
run 4 one_to_e4 $(ck one) --set parallel%ep=4
same_losses one_to_e4
e2d2=(--set parallel%ep=2 --set parallel%dp=2)
STEPS=6 run 4 e2d2z3 "${e2d2[@]}" --set parallel%zero=3 --set checkpoint%every=6
run 1 z3_to_1 $(ck e2d2z3)
same_losses z3_to_1
run 4 one_to_z1 $(ck one) "${e2d2[@]}" --set parallel%zero=1
same_losses one_to_z1
/usr/bin/python3 - "$tmp/e4/checkpoints/ckpt_00000006.h5" <<'PY' || fail "expert shapes in the checkpoint"
import h5py, sys
with h5py.File(sys.argv[1], "r") as f:
    for name in ("h.0.moe.fc.weight", "h.0.moe.proj.weight", "h.0.moe.router.weight"):
        shape = f["model"][name].shape
        assert shape[0] == 4, f"{name}: {shape}"
PY

# The ep traffic and the MoE statistics, every step.
[ "$(column e4 bytes_ep 3)" != "" ] && [ "$(column e4 bytes_ep 3)" != 0 ] || fail "no ep traffic: $(head -1 "$tmp/e4/log.csv")"
for c in aux_loss moe_dropped moe_load_min moe_load_max exposed_ep_s; do
  [ -n "$(column e4 $c 3)" ] || fail "no $c in log.csv"
done
grep -q "| moe aux " "$tmp/e4.log" || fail "no MoE statistics in the log line"
grep -q "expert loads min/mean/max tokens: h.0 .*, h.1 " "$tmp/e4.log" || fail "no per-layer expert loads in the log"
# Per layer, every step: min <= mean <= max, and the kept choices (mean x 4 experts) are the
# batch's 16 x 64 tokens x top 2 less the dropped share.
/usr/bin/python3 - "$tmp/e4/log.csv" <<'PY' || fail "per-layer expert loads in log.csv"
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
assert rows, "no rows"
for row in rows:
    for l in (0, 1):
        lo, mean, hi, dropped = (float(row[f"moe_h{l}_{x}"]) for x in ("min", "mean", "max", "dropped"))
        assert lo <= mean <= hi, (row["step"], l, lo, mean, hi)
        assert abs(mean * 4 - 16 * 64 * 2 * (1 - dropped)) < 1e-3, (row["step"], l, mean, dropped)
PY

# Refusals, before step 1, exit 2, one line naming the keys.
refused() {  # refused NP PATTERN [--set ...]
  local np=$1 pattern=$2; shift 2
  set +e
  "$PTRAIN" "$deck" "${common[@]}" "$@" --plan --world "$np" >"$tmp/bad.log" 2>&1; local rc=$?
  [ "$rc" = 0 ] && { timeout 120 "$MPIEXEC" $MPIEXEC_PREFLAGS -np "$np" "$PTRAIN" "$deck" "${common[@]}" "$@" \
    --set run%out_dir="'$tmp/bad'" >"$tmp/bad.log" 2>&1; rc=$?; }
  set -e
  [ "$rc" = 2 ] || fail "$*: exit $rc"
  grep -q "$pattern" "$tmp/bad.log" || fail "$*: message: $(head -3 "$tmp/bad.log")"
}
refused 3 "parallel%ep = 3 does not divide model%n_expert = 4" --set parallel%ep=3 --set train%global_batch=24
refused 1 "model%top_k" --set model%top_k=5
echo "moe: all checks passed"
