#!/usr/bin/env bash
# Real text: a byte-level model of tinyshakespeare (when ../shared/data has it) gets below
# 2.0 nats/byte on validation in 500 steps. Apart from cli/train.sh so that CI's portable
# stages (the other MPI, the device guard) do not spend minutes on learning.
source "$(dirname "${BASH_SOURCE[0]}")/lib/prologue.sh"
last_col() { tail -n 1 "$1" | cut -d, -f"$2"; }  # log.csv: 3 = val_loss
text="$PTRAIN_SOURCE_DIR/../shared/data/tinyshakespeare.txt"
if [ -f "$text" ]; then
  "$PTRAIN" "$PTRAIN_SOURCE_DIR/input/shakespeare.nml" --set data%path="'$text'" \
    --set run%out_dir="'$tmp/shk'" --set run%steps=500 --set model%n_layer=2 --set model%seq_len=64 \
    --set train%lr=5e-3 >"$tmp/shk.log" 2>&1 || fail "shakespeare run: $(tail -3 "$tmp/shk.log")"
  val=$(last_col "$tmp/shk/log.csv" 3)
  echo "shakespeare: val loss $val nats/byte"
  awk -v l="$val" 'BEGIN { exit !(l < 2.0) }' || fail "shakespeare val loss $val >= 2.0"
else
  echo "shakespeare: skipped ($text not present)"
fi
echo "text: all checks passed"
