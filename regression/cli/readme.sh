#!/usr/bin/env bash
# The README's deck reference is exactly what `ptrain --help-deck` prints (both come from
# src/deck/schema.def). Regenerate it with the block shown on failure.
source "$(dirname "${BASH_SOURCE[0]}")/lib/prologue.sh"
readme="$PTRAIN_SOURCE_DIR/README"
got=$(sed -n '/^<!-- deck reference/,/^<!-- end of deck reference/p' "$readme" | sed '1d;$d')
want=$("$PTRAIN" --help-deck)
if [ "$got" != "$want" ]; then
  echo "FAIL: README's deck reference is out of date; replace the block between the markers with"
  echo "the output of: build/ptrain --help-deck"
  diff <(echo "$want") <(echo "$got") | head -20
  exit 1
fi
echo "readme: deck reference is current"
