#!/usr/bin/env bash
# Mixed precision through the driver (bf16 compute, fp32 masters):
#  - input/tiny.nml in bf16 tracks the fp32 run: the loss at the last step within 2% (and
#    input/shakespeare.nml over its first 40 steps, when ../shared/data has the text);
#  - parallel%grad_dtype = 'bf16' on 2 data-parallel ranks halves bytes_dense_grad in log.csv
#    and keeps the last loss within 1% of the fp32-gradient run; parallel%wire_dtype = 'bf16'
#    (ZeRO 2) moves the reduce-scatter in bf16, the same within 1%;
#  - a bf16 checkpoint holds fp32 masters (ckpt_tool.py verify passes): it resumes as bf16 bit
#    for bit, and as fp32 from the same masters (its final.h5 equals the checkpoint's weights
#    exactly); an fp32 checkpoint resumes as bf16;
#  - the log's MFU is against a bf16 gemm probe.
source "$(dirname "${BASH_SOURCE[0]}")/lib/prologue.sh"
deck="$PTRAIN_SOURCE_DIR/input/tiny.nml"
py=/usr/bin/python3  # Debian's, with h5py and numpy
run() {  # run NP OUT DECK [--set ...]
  local np=$1 out=$2 d=$3; shift 3
  timeout 300 "$MPIEXEC" $MPIEXEC_PREFLAGS -np "$np" "$PTRAIN" "$d" --set run%out_dir="'$tmp/$out'" \
    "$@" >"$tmp/$out.log" 2>&1 || fail "$out: $(tail -5 "$tmp/$out.log")"
}
col() {  # col OUT COLUMN: that column of the last row of OUT/log.csv
  awk -F, -v k="$2" 'NR == 1 { for (i = 1; i <= NF; i++) c[$i] = i; next } { v = $c[k] } END { print v }' \
    "$tmp/$1/log.csv"
}
first_loss() { awk -F, 'NR == 2 { print $2 }' "$tmp/$1/log.csv"; }
within() {  # within A B REL: |A - B| <= REL * |B|
  awk -v a="$1" -v b="$2" -v r="$3" 'BEGIN { d = a - b; if (d < 0) d = -d; if (b < 0) b = -b; exit !(d <= r * b) }'
}

# 1. The example deck in both precisions (300 steps each).
run 1 tiny32 "$deck" --set run%eval_every=0
run 1 tiny16 "$deck" --set run%eval_every=0 --set model%dtype="'bf16'"
l32=$(col tiny32 loss) l16=$(col tiny16 loss)
echo "tiny.nml loss: fp32 $(first_loss tiny32) -> $l32, bf16 $(first_loss tiny16) -> $l16"
within "$l16" "$l32" 0.02 || fail "tiny.nml: bf16 last loss $l16 is not within 2% of fp32's $l32"
grep -q "peak: bf16 gemm probe" "$tmp/tiny16.log" || fail "bf16 run: MFU not against a bf16 gemm probe"
grep -q "peak: sgemm probe" "$tmp/tiny32.log" || fail "fp32 run: MFU not against the sgemm probe"
text="$PTRAIN_SOURCE_DIR/../shared/data/tinyshakespeare.txt"
if [ -f "$text" ]; then
  sk="$PTRAIN_SOURCE_DIR/input/shakespeare.nml"
  common=(--set run%steps=40 --set run%log_every=10 --set run%eval_every=0 --set data%path="'$text'"
    --set checkpoint%save_final=.false.)
  run 1 sk32 "$sk" "${common[@]}"
  run 1 sk16 "$sk" "${common[@]}" --set model%dtype="'bf16'"
  l32=$(col sk32 loss) l16=$(col sk16 loss)
  echo "shakespeare.nml loss at step 40: fp32 $(first_loss sk32) -> $l32, bf16 $(first_loss sk16) -> $l16"
  within "$l16" "$l32" 0.02 || fail "shakespeare.nml: bf16 loss $l16 is not within 2% of fp32's $l32"
else
  echo "shakespeare.nml: skipped ($text is not here)"
fi

# 2. bf16 gradients over 100 steps: half the data-parallel bytes (ZeRO 0: the all-reduce moves
# gradients only), the same training within 1%.
g=(--set model%dtype="'bf16'" --set run%eval_every=0 --set train%micro_batch=8 --set run%steps=100)
run 2 g32 "$deck" "${g[@]}"
run 2 g16 "$deck" "${g[@]}" --set parallel%grad_dtype="'bf16'"
compare_traffic() {  # compare_traffic KEY REF RUN LO HI: RUN's dense-grad bytes in (LO, HI) of
  # REF's, and its last loss within 1% of REF's
  local key=$1 ref=$2 got=$3 lo=$4 hi=$5
  local b_ref b_got l_ref l_got
  b_ref=$(col "$ref" bytes_dense_grad) b_got=$(col "$got" bytes_dense_grad)
  l_ref=$(col "$ref" loss) l_got=$(col "$got" loss)
  echo "$key: bytes_dense_grad per step $b_ref -> $b_got, last loss $l_ref -> $l_got"
  awk -v a="$b_got" -v b="$b_ref" -v lo="$lo" -v hi="$hi" 'BEGIN { exit !(b > 0 && a > lo * b && a < hi * b) }' ||
    fail "$key: bytes_dense_grad $b_got is not within ($lo, $hi) of $b_ref"
  within "$l_got" "$l_ref" 0.01 || fail "$key: last loss $l_got not within 1% of $l_ref"
}
compare_traffic "grad_dtype='bf16'" g32 g16 0.49 0.51

# The bf16 wire (ZeRO 2, m = 1 micro-batch a step): the reduce-scatter moves bf16 instead of
# fp32, the parameter all-gather bf16 either way: (D-1)/D N (2 + 2) bytes against (4 + 2).
run 2 w32 "$deck" "${g[@]}" --set parallel%zero=2
run 2 w16 "$deck" "${g[@]}" --set parallel%zero=2 --set parallel%wire_dtype="'bf16'"
compare_traffic "wire_dtype='bf16' (ZeRO 2)" w32 w16 0.66 0.67

# 3. Checkpoints hold the fp32 masters.
c=(--set run%eval_every=0 --set run%log_every=1 --set backend%peak_gflops=100)
run 1 ref16 "$deck" "${c[@]}" --set model%dtype="'bf16'" --set run%steps=6
run 1 ck16 "$deck" "${c[@]}" --set model%dtype="'bf16'" --set run%steps=3 --set checkpoint%every=3
ck="$tmp/ck16/checkpoints/ckpt_00000003.h5"
"$py" "$PTRAIN_SOURCE_DIR/postprocess/ckpt_tool.py" verify "$ck" >"$tmp/verify.log" 2>&1 ||
  fail "ckpt_tool.py verify: $(cat "$tmp/verify.log")"
run 1 again16 "$deck" "${c[@]}" --set model%dtype="'bf16'" --set run%steps=6 --set checkpoint%restart="'$ck'"
for s in 4 5 6; do
  a=$(awk -F, -v s=$s '$1 == s { print $2 }' "$tmp/again16/log.csv")
  b=$(awk -F, -v s=$s '$1 == s { print $2 }' "$tmp/ref16/log.csv")
  [ -n "$a" ] && [ "$a" = "$b" ] || fail "bf16 restart: step $s loss $a != uninterrupted $b"
done
run 1 as32 "$deck" "${c[@]}" --set model%dtype="'fp32'" --set run%steps=3 --set checkpoint%save_final=.true. \
  --set checkpoint%restart="'$ck'"
"$py" - "$ck" "$tmp/as32/final.h5" <<'EOF' || fail "fp32 resume: final.h5 is not the bf16 checkpoint's masters"
import sys, h5py, numpy as np
with h5py.File(sys.argv[1]) as c, h5py.File(sys.argv[2]) as f:
    dtype = c.attrs["compute_dtype"]
    assert (dtype.decode() if isinstance(dtype, bytes) else dtype) == "bf16", dtype
    names = sorted(c["model"])
    assert names == sorted(f["model"]), "tensor names differ"
    for n in names:
        a, b = c["model"][n][()], f["model"][n][()]
        assert a.dtype == np.float32 and b.dtype == np.float32, (n, a.dtype, b.dtype)
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), n
    # Masters are fp32, not bf16 values widened: their low 16 bits are not all zero.
    low = np.concatenate([c["model"][n][()].ravel().view(np.uint32) & 0xFFFF for n in names])
    assert (low != 0).mean() > 0.5, "the checkpoint's weights look like bf16"
print(f"{len(names)} tensors of the bf16 checkpoint = the fp32 resume's final.h5, bit for bit")
EOF
run 1 ck32 "$deck" "${c[@]}" --set run%steps=3 --set checkpoint%every=3
run 1 from32 "$deck" "${c[@]}" --set model%dtype="'bf16'" --set run%steps=5 \
  --set checkpoint%restart="'$tmp/ck32/checkpoints/ckpt_00000003.h5'"
grep -q "restart: .* at step 3" "$tmp/from32.log" || fail "fp32 checkpoint -> bf16: $(tail -3 "$tmp/from32.log")"
[ "$(awk -F, 'END { print $1 }' "$tmp/from32/log.csv")" = 5 ] || fail "fp32 -> bf16 did not train to step 5"
echo "bf16: example decks track fp32, bf16 gradients halve the traffic, checkpoints keep fp32 masters"
