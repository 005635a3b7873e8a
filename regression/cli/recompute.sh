#!/usr/bin/env bash
# train%recompute on one rank: selective and full give bit for bit the training of none, in
# the same run of the same binary (fp64; dense and MoE blocks): every logged loss, validation
# loss and gradient norm (printed to the last bit), and every final weight.
source "$(dirname "$0")/lib/prologue.sh"
deck="$PTRAIN_SOURCE_DIR/regression/cases/recompute_fp64/deck.nml"
for mode in none selective full; do
  timeout 120 "$PTRAIN" "$deck" --set train%recompute="'$mode'" --set checkpoint%save_final=.true. --set run%out_dir="'$tmp/$mode'" \
    >"$tmp/$mode.log" 2>&1 || fail "$mode: $(tail -3 "$tmp/$mode.log")"
  cut -d, -f2,3,5 "$tmp/$mode/log.csv" >"$tmp/$mode.csv"
done
for mode in selective full; do
  cmp -s "$tmp/none.csv" "$tmp/$mode.csv" || fail "$mode: losses or norms differ from none: $(diff "$tmp/none.csv" "$tmp/$mode.csv" | head -4)"
  /usr/bin/python3 - "$tmp/none/final.h5" "$tmp/$mode/final.h5" <<'PY' || fail "$mode: final weights differ from none"
import sys, h5py, numpy as np
with h5py.File(sys.argv[1], "r") as a, h5py.File(sys.argv[2], "r") as b:
    names = sorted(a["model"].keys())
    assert names == sorted(b["model"].keys())
    for n in names:
        assert np.array_equal(a["model"][n][()], b["model"][n][()]), n
PY
done
echo "recompute: selective and full are bit-identical to none"
