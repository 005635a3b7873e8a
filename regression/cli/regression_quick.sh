#!/usr/bin/env bash
# The quick regression cases (regression/cases/*, category quick) against their references,
# through regression/run; then that the runner can fail: a reference moved by 10x its tolerance
# and a deck with a learning rate changed by 1e-4 relative both FAIL with a non-zero exit, and
# --regenerate refuses to run under CI. numpy/h5py come from Makefile.inc's DEBIAN_PACKAGES:
# without them the test skips, unless it runs as root (then it fails).
source "$(dirname "${BASH_SOURCE[0]}")/lib/prologue.sh"
py=/usr/bin/python3
if ! "$py" -c 'import numpy, h5py, tomllib' 2>/dev/null; then
  [ "$(id -u)" = 0 ] && fail "$py lacks numpy/h5py/tomllib (python3-numpy python3-h5py, Python >= 3.11)"
  echo "SKIP: regression_quick: $py lacks numpy/h5py/tomllib"; exit 0
fi
run=$PTRAIN_SOURCE_DIR/regression/run

# 1. The quick cases.
set +e
"$run" --category quick | tee "$tmp/quick.out"
rc=${PIPESTATUS[0]}
set -e
[ "$rc" = 0 ] || fail "regression/run --category quick exited $rc"
for c in tiny_fp64 tiny_fp32 bytes_text layouts_fp64; do
  grep -q "^PASS  $c \[reference, 1 rank\] param_sum " "$tmp/quick.out" || fail "case $c did not compare"
done
# The layout case runs its grids, or says why not (today: ptrain trains on one rank only).
grep -qE "^(PASS  layouts_fp64 \[dp2, 2 ranks\] param_sum|SKIP  layouts_fp64 \[dp2, 2 ranks\]: needs multi-rank training)" \
  "$tmp/quick.out" || fail "layouts_fp64 dp2: neither compared nor skipped for multi-rank training"

# 2. The runner fails when it should.
cases=$tmp/cases
mkdir -p "$cases"
cp -r "$PTRAIN_SOURCE_DIR/regression/cases/tiny_fp64" "$cases/moved"
"$py" - "$cases/moved/reference.json" <<'EOF'
import json, sys
path = sys.argv[1]
doc = json.load(open(path))
doc["values"]["loss@10"] += 1e-6          # tolerance: 1e-7 absolute, 1e-8 relative
json.dump(doc, open(path, "w"))
EOF
set +e
"$run" --cases-dir "$cases" moved >"$tmp/moved.out"; rc=$?
set -e
[ "$rc" = 1 ] || fail "a moved reference: exit $rc, expected 1: $(cat "$tmp/moved.out")"
[ "$(grep -c '^FAIL' "$tmp/moved.out")" = 1 ] && grep -q "^FAIL  moved \[reference, 1 rank\] loss@10 " "$tmp/moved.out" ||
  fail "a moved reference: expected one FAIL, on loss@10: $(cat "$tmp/moved.out")"

cp -r "$PTRAIN_SOURCE_DIR/regression/cases/tiny_fp64" "$cases/lr"
sed -i 's/^  lr = 3e-3$/  lr = 3.0003e-3/' "$cases/lr/deck.nml"
grep -q "lr = 3.0003e-3" "$cases/lr/deck.nml" || fail "could not change the learning rate of the copy"
set +e
"$run" --cases-dir "$cases" lr >"$tmp/lr.out"; rc=$?
set -e
[ "$rc" = 1 ] || fail "a changed learning rate: exit $rc, expected 1: $(cat "$tmp/lr.out")"
grep -q "^FAIL  lr \[reference, 1 rank\] param_sum " "$tmp/lr.out" ||
  fail "a changed learning rate did not move param_sum: $(cat "$tmp/lr.out")"
grep -q "^PASS  lr \[reference, 1 rank\] loss@1 " "$tmp/lr.out" ||
  fail "step 1 loss should not depend on the learning rate: $(cat "$tmp/lr.out")"

set +e
CI=true "$run" --cases-dir "$cases" --regenerate moved >"$tmp/ci.out" 2>&1; rc=$?
set -e
[ "$rc" != 0 ] && grep -q "refuses to run in CI" "$tmp/ci.out" || fail "--regenerate under CI: exit $rc: $(cat "$tmp/ci.out")"
echo "regression_quick: all checks passed"
