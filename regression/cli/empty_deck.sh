#!/usr/bin/env bash
# A deck that sets no keys (an empty file, or groups without keys) runs with every default,
# and ptrain says so once at startup: "deck FILE sets no keys: every value ... is the
# default (ptrain --help-deck lists them)". A deck that sets a key gets no such warning.
source "$(dirname "${BASH_SOURCE[0]}")/lib/prologue.sh"
cd "$tmp"
warning="sets no keys: every value but the 2 --set override(s) is the default (ptrain --help-deck lists them)"

# run DECK LOG: one rank, one step, into $tmp/out.
run() {
  "$PTRAIN" "$1" --set run%steps=1 --set run%out_dir="'$tmp/out'" >"$2" 2>&1 \
    || fail "$1: $(tail -5 "$2")"
}

: >empty.nml
run empty.nml empty.log
[ "$(grep -c "warning: deck empty.nml $warning" empty.log)" = 1 ] \
  || fail "empty deck: expected the warning once:
$(cat empty.log)"

printf '! only comments and empty groups\n&run\n/\n&model /\n' >groups.nml
run groups.nml groups.log
[ "$(grep -c "warning: deck groups.nml $warning" groups.log)" = 1 ] \
  || fail "deck of empty groups: expected the warning once:
$(cat groups.log)"

printf '&run\n  name = %s\n/\n' "'named'" >named.nml
run named.nml named.log
if grep -q "sets no keys" named.log; then fail "a deck that sets a key got the warning:
$(cat named.log)"; fi
echo "empty_deck: warning once for a deck without keys, none otherwise"
