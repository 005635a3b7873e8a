#!/usr/bin/env bash
# One-rank training through the driver: the loss reaches the synthetic entropy floor, the
# echoed deck parses back, final weights are a real HDF5 file that init_from reads, bad data
# stops before step 1, and a GPU deck is refused in one line. Real text: cli/text.sh.
source "$(dirname "${BASH_SOURCE[0]}")/lib/prologue.sh"
cd "$tmp"
last_col() { tail -n 1 "$1" | cut -d, -f"$2"; }  # log.csv: 2 = loss, 3 = val_loss

# 1. tiny.nml: within 10% of the entropy floor.
"$PTRAIN" "$PTRAIN_SOURCE_DIR/input/tiny.nml" --set run%out_dir="'$tmp/tiny'" \
  --set checkpoint%save_final=.true. >"$tmp/tiny.log" 2>&1 || fail "tiny run: $(tail -5 "$tmp/tiny.log")"
floor=$(sed -n 's/.*entropy floor of the synthetic process = \([0-9.]*\).*/\1/p' "$tmp/tiny.log")
[ -n "$floor" ] || fail "no entropy floor in the log"
loss=$(last_col "$tmp/tiny/log.csv" 2)
val=$(last_col "$tmp/tiny/log.csv" 3)
echo "tiny: final loss $loss, val $val, floor $floor"
awk -v l="$loss" -v f="$floor" 'BEGIN { exit !(l < 1.10 * f) }' || fail "loss $loss not within 10% of $floor"
awk -v l="$val" -v f="$floor" 'BEGIN { exit !(l < 1.10 * f) }' || fail "val $val not within 10% of $floor"
[ "$(wc -l <"$tmp/tiny/log.csv")" = 301 ] || fail "log.csv should have a header and 300 rows"
# One rank: no group is used, but the dense-grad columns are always there (zero).
comm_cols=$(head -n 1 "$tmp/tiny/log.csv" | tr , '\n' | grep -E '^(bytes|exposed|overlap)_' | tr '\n' ' ')
[ "$comm_cols" = "bytes_dense_grad exposed_dense_grad_s overlap_dense_grad " ] || fail "log.csv comm columns: $comm_cols"

# 2. The echoed deck parses back and plans.
"$PTRAIN" --plan "$tmp/tiny/deck.nml" --world 1 >/dev/null || fail "echoed deck does not parse"

# 3. final.h5: global shapes, and init_from reproduces the final validation loss.
if command -v h5dump >/dev/null; then
  h5dump -H "$tmp/tiny/final.h5" | grep -A3 '"wte.weight"' | grep -q "( 64, 64 )" || fail "h5dump wte shape"
fi
"$PTRAIN" "$PTRAIN_SOURCE_DIR/input/tiny.nml" --set run%out_dir="'$tmp/again'" --set run%steps=1 \
  --set train%lr=0 --set train%min_lr=0 --set train%warmup=0 --set model%init_from="'$tmp/tiny/final.h5'" >"$tmp/again.log" 2>&1 \
  || fail "init_from run: $(tail -3 "$tmp/again.log")"
val2=$(last_col "$tmp/again/log.csv" 3)
awk -v a="$val" -v b="$val2" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d < 1e-5) }' \
  || fail "init_from: val loss $val2 differs from the saved model's $val"

# 4. Bad data: a clear error before step 1, exit code 1.
set +e
"$PTRAIN" "$PTRAIN_SOURCE_DIR/input/tiny.nml" --set data%source=bytes --set model%vocab=256 \
  --set data%path="'$tmp/none.txt'" --set run%out_dir="'$tmp/bad'" >"$tmp/bad.log" 2>&1; rc=$?
set -e
[ "$rc" != 0 ] || fail "missing data file accepted"
grep -q "none.txt" "$tmp/bad.log" || fail "message does not name the file: $(tail -3 "$tmp/bad.log")"
grep -q "^step" "$tmp/bad.log" && fail "trained despite missing data"

# 4b. A GPU deck on this (CPU) build: one line saying so, exit code 2, before Kokkos starts.
set +e
"$PTRAIN" "$PTRAIN_SOURCE_DIR/input/tiny.nml" --set backend%device="'cuda'" \
  --set run%out_dir="'$tmp/gpu'" >"$tmp/gpu.log" 2>&1; rc=$?
set -e
[ "$rc" = 2 ] || fail "backend%device='cuda': exit code $rc, not 2: $(tail -3 "$tmp/gpu.log")"
[ "$(grep -c . "$tmp/gpu.log")" = 1 ] && grep -q "built without CUDA" "$tmp/gpu.log" ||
  fail "backend%device='cuda': not one line naming the build: $(cat "$tmp/gpu.log")"

echo "train: all checks passed"
