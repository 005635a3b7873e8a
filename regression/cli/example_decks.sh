#!/usr/bin/env bash
# The example decks in input/: every one plans on the world size its &parallel group asks for
# (dp*tp*pp*cp*ep, 1 where unset; GPU decks too, whatever this build has), and the
# CPU pipeline deck trains a few steps on its 8 ranks with the loss falling and the bubble in
# its log.csv.
source "$(dirname "${BASH_SOURCE[0]}")/lib/prologue.sh"
value() {  # value DECK KEY: the integer after 'KEY =' in the deck, 1 when unset
  awk -v k="$2" '{ sub(/!.*/, "") } $1 == k && $2 == "=" { v = $3 + 0 } END { print (v > 0 ? v : 1) }' "$1"
}
n=0
for deck in "$PTRAIN_SOURCE_DIR"/input/*.nml; do
  world=1
  for k in dp tp pp cp ep; do world=$((world * $(value "$deck" $k))); done
  out=$("$PTRAIN" --plan "$deck" --world "$world" --ranks-per-node 8 2>"$tmp/err") \
    || fail "$deck does not plan on $world ranks: $(cat "$tmp/err")"
  grep -q "on $world ranks" <<<"$out" || fail "$deck: plan header: $out"
  grep -q "per-rank memory" <<<"$out" || fail "$deck: no memory in the plan"
  if [ "$(value "$deck" pp)" -gt 1 ]; then
    grep -q "^pipeline bubble: [0-9.]*%" <<<"$out" || fail "$deck: no pipeline bubble in the plan: $out"
  fi
  n=$((n + 1))
done
out=$("$PTRAIN" --plan "$PTRAIN_SOURCE_DIR/input/gpt-13b-8gpu.nml" --world 8 --ranks-per-node 8)
grep -q "parameters: 12,853,626,880 " <<<"$out" || fail "13B parameter count: $out"
grep -q "pipeline bubble: 3.0% " <<<"$out" || fail "13B bubble (1/33): $out"
out=$("$PTRAIN" --plan "$PTRAIN_SOURCE_DIR/input/pipeline-8rank.nml" --world 8 --ranks-per-node 8)
grep -q "pipeline bubble: 20.0% " <<<"$out" || fail "pipeline-8rank bubble (1/5): $out"

# The 3D pipeline deck trains (tp 2 x pp 2 x dp 2, ZeRO 2) on 8 ranks.
timeout 240 "$MPIEXEC" $MPIEXEC_PREFLAGS -np 8 "$PTRAIN" "$PTRAIN_SOURCE_DIR/input/pipeline-8rank.nml" \
  --set run%steps=6 --set run%eval_every=0 --set backend%peak_gflops=100 \
  --set run%out_dir="'$tmp/p8'" >"$tmp/p8.log" 2>&1 || fail "pipeline-8rank: $(tail -5 "$tmp/p8.log")"
[ "$(wc -l <"$tmp/p8/log.csv")" = 7 ] || fail "pipeline-8rank log.csv rows: $(cat "$tmp/p8/log.csv")"
awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) c[$i] = i; next }
         NR == 2 { first = $c["loss"] } { last = $c["loss"] }
         END { exit !(last < first - 0.1) }' "$tmp/p8/log.csv" || fail "pipeline-8rank: the loss did not fall: $(cut -d, -f1,2 "$tmp/p8/log.csv")"
for c in bytes_pp exposed_pp_s bytes_tp bytes_dense_grad bytes_embed; do
  tr , '\n' <<<"$(head -n 1 "$tmp/p8/log.csv")" | grep -qx "$c" || fail "pipeline-8rank: no $c column"
done
echo "example_decks: $n decks plan; pipeline-8rank trains on 8 ranks"
