#!/usr/bin/env bash
# Data at scale through the driver, on Megatron indexed datasets written by an independent
# writer (regression/lib/megatron_indexed.py), fp64:
#  - epochs: 1 rank, dp 2 and pp 2 x cp 2 train on the same samples (losses to 1e-10; the log's
#    epoch column alike), and so do 1 rank and zb-v on pp 2 x cp 2;
#  - a restart mid-epoch on another dp (dp 2 -> dp 4) continues the stream: the losses after it
#    equal the uninterrupted run's (1e-10), and so does a restart from a checkpoint without the
#    data's fields (as written before them), with a warning;
#  - a restart on other data is refused (exit 2, one line) unless data%allow_change;
#  - a blend logs each dataset's validation loss and epoch, the blend's loss their weighted mean;
#  - a malformed index is refused on every rank in one line (exit 2), before step 1.
source "$(dirname "${BASH_SOURCE[0]}")/lib/prologue.sh"
py=/usr/bin/python3
if ! "$py" -c 'import numpy, h5py' 2>/dev/null; then echo "data: skipped (no numpy/h5py)"; exit 0; fi

# Two datasets: documents of random tokens below 64, each ending with 0.
"$py" - "$tmp" <<'EOF'
import random, sys
for name, n_docs, seed in (("a", 60, 1), ("b", 40, 2)):
    r = random.Random(seed)
    with open(f"{sys.argv[1]}/{name}.docs", "w") as f:
        for _ in range(n_docs):
            f.write(" ".join(str(r.randrange(1, 64)) for _ in range(r.randrange(0, 16))) + " 0\n")
EOF
for d in a b; do
  "$py" "$PTRAIN_SOURCE_DIR/regression/lib/megatron_indexed.py" "$tmp/$d.docs" "$tmp/$d" uint16
done

common=(--set model%dtype="'fp64'" --set model%vocab=64 --set model%seq_len=16
  --set model%n_layer=2 --set model%d_model=32 --set model%n_head=2 --set train%global_batch=8
  --set train%micro_batch=2 --set run%log_every=1 --set run%eval_every=4
  --set data%source="'indexed'")
data=(--set data%path="'$tmp/a'")  # what run() reads
run() {  # run NAME NP [--set ...]
  local name=$1 np=$2
  shift 2
  timeout 300 "$MPIEXEC" $MPIEXEC_PREFLAGS -np "$np" "$PTRAIN" "$PTRAIN_SOURCE_DIR/input/tiny.nml" \
    "${common[@]}" "${data[@]}" --set run%steps=8 --set run%out_dir="'$tmp/$name'" "$@" \
    >"$tmp/$name.log" 2>&1 || fail "$name: $(grep -iE 'error|nml:|data:' "$tmp/$name.log" | head -3)"
}
col() {  # col RUN STEP NAME: the last value of column NAME at STEP in RUN's log.csv
  awk -F, -v s="$2" -v c="$3" 'NR == 1 { for (i = 1; i <= NF; i++) if ($i == c) k = i; next }
    $1 == s { v = $k } END { print v }' "$tmp/$1/log.csv"
}
same() {  # same A B STEP...: loss (to 1e-10) and epoch equal at each step
  local a=$1 b=$2 s
  shift 2
  for s in "$@"; do
    awk -v x="$(col "$a" "$s" loss)" -v y="$(col "$b" "$s" loss)" \
      'BEGIN { d = (x - y) / y; if (d < 0) d = -d; exit !(x != "" && d < 1e-10) }' ||
      fail "$b: loss at step $s $(col "$b" "$s" loss), $a has $(col "$a" "$s" loss)"
    [ "$(col "$a" "$s" epoch)" = "$(col "$b" "$s" epoch)" ] ||
      fail "$b: epoch at step $s $(col "$b" "$s" epoch), $a has $(col "$a" "$s" epoch)"
  done
}

# The uninterrupted run on dp 2, checkpointing; the same samples on 1 rank and on pp 2 x cp 2.
run d2 2 --set checkpoint%every=4
grep -m1 "data: indexed" "$tmp/d2.log"
grep -q "| epoch 2 (" "$tmp/d2.log" || fail "the run should reach its second epoch"
run one 1
run p2c2 4 --set parallel%pp=2 --set parallel%cp=2
same d2 one 1 4 5 8
same d2 p2c2 1 4 5 8
echo "data: 1 rank, dp 2 and pp 2 x cp 2 draw the same samples: loss at 8 $(col d2 8 loss), epoch $(col d2 8 epoch)"
# zb-v on pp 2 x cp 2 (its ends, embedding and head, both on stage 0) and 1 rank, on 4 layers
# for the V's 2 x 2 chunks.
(
  common=("${common[@]/model%n_layer=2/model%n_layer=4}")
  run one4 1
  run zbv 4 --set parallel%pp=2 --set parallel%cp=2 --set parallel%pp_schedule="'zb-v'" \
    --set parallel%virtual_stages=2
  same one4 zbv 1 4 5 8
)
echo "data: zb-v on pp 2 x cp 2 draws the same samples as 1 rank (4 layers): loss at 8 $(col zbv 8 loss)"

# Mid-epoch restart on dp 4.
ck="$tmp/d2/checkpoints/ckpt_00000004.h5"
awk -v e="$(col d2 4 epoch)" 'BEGIN { exit !(e > 1 && e != int(e)) }' || fail "step 4 is not mid-epoch"
run d4 4 --set checkpoint%restart="'$ck'"
grep -q "data: going on at sample 32, epoch " "$tmp/d4.log" || fail "position: $(grep 'data:' "$tmp/d4.log")"
same d2 d4 5 6 7 8
echo "data: restarted at step 4 (epoch $(col d2 4 epoch)) on dp 4: steps 5-8 as uninterrupted"
# A checkpoint as written before the data's fields: the sample count alone continues.
cp "$ck" "$tmp/old.h5"
"$py" -c "import h5py, sys; f = h5py.File(sys.argv[1], 'r+'); del f['state/data_fingerprint']; del f['state/dataset_samples']" "$tmp/old.h5"
run old 1 --set checkpoint%restart="'$tmp/old.h5'"
grep -q "written before checkpoints kept the data's fingerprint" "$tmp/old.log" || fail "no warning for the old checkpoint"
same d2 old 5 8

# Other data: refused, then allowed.
rc=0
timeout 120 "$MPIEXEC" $MPIEXEC_PREFLAGS -np 2 "$PTRAIN" "$PTRAIN_SOURCE_DIR/input/tiny.nml" "${common[@]}" \
  --set data%path="'$tmp/b'" --set checkpoint%restart="'$ck'" --set run%out_dir="'$tmp/other'" \
  >"$tmp/other.log" 2>&1 || rc=$?
[ "$rc" = 2 ] || fail "other data: exit $rc, expected 2: $(tail -3 "$tmp/other.log")"
[ "$(grep -c "was written for other data" "$tmp/other.log")" = 1 ] || fail "other data: $(tail -3 "$tmp/other.log")"
! grep -q "^step\|MPI_ABORT" "$tmp/other.log" || fail "other data: went on, or MPI_Abort"
echo "data: $(grep "was written for other data" "$tmp/other.log" | cut -c1-160)..."
data=(--set data%path="'$tmp/b'")
run allowed 1 --set checkpoint%restart="'$ck'" --set data%allow_change=.true.
grep -q "data%allow_change: going on with this run's data at sample 32" "$tmp/allowed.log" || fail "allow_change"

# A blend: each dataset's validation loss and epoch, the blend's loss their weighted mean.
data=(--set data%paths="'$tmp/a', '$tmp/b'" --set data%weights=3,1)
run blend 1
for c in val_loss_1 val_loss_2 epoch_1 epoch_2; do
  [ -n "$(col blend 8 $c)" ] || fail "blend: no $c in log.csv"
done
awk -v v="$(col blend 8 val_loss)" -v a="$(col blend 8 val_loss_1)" -v b="$(col blend 8 val_loss_2)" \
  'BEGIN { w = 0.75 * a + 0.25 * b; d = (v - w) / w; if (d < 0) d = -d; exit !(d < 1e-12) }' ||
  fail "blend: val_loss $(col blend 8 val_loss) is not 0.75 * $(col blend 8 val_loss_1) + 0.25 * $(col blend 8 val_loss_2)"
awk -v a="$(col blend 8 epoch_1)" -v b="$(col blend 8 epoch_2)" 'BEGIN { exit !(a > 0 && b > 0) }' ||
  fail "blend epochs"
grep -m1 "| epochs " "$tmp/blend.log" | sed 's/.*| epochs/data: blend epochs/; s/ | lr.*//'

# A malformed index, on 2 ranks: one line, exit 2, before step 1.
cp "$tmp/a.bin" "$tmp/bad.bin"
head -c 40 "$tmp/a.idx" >"$tmp/bad.idx"
rc=0
timeout 120 "$MPIEXEC" $MPIEXEC_PREFLAGS -np 2 "$PTRAIN" "$PTRAIN_SOURCE_DIR/input/tiny.nml" "${common[@]}" \
  --set data%path="'$tmp/bad'" --set run%out_dir="'$tmp/bad'" >"$tmp/bad.log" 2>&1 || rc=$?
[ "$rc" = 2 ] || fail "bad index: exit $rc: $(tail -3 "$tmp/bad.log")"
[ "$(grep -c "bad.idx' header says" "$tmp/bad.log")" = 1 ] || fail "bad index: $(tail -3 "$tmp/bad.log")"
! grep -q "^step\|MPI_ABORT" "$tmp/bad.log" || fail "bad index: went on, or MPI_Abort"
echo "data: refused: $(grep "bad.idx' header says" "$tmp/bad.log" | cut -c7-160)"
echo "data: all checks passed"
