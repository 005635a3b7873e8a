#!/usr/bin/env bash
# ptrain --plan: the GPT-2 124M parameter count, login-node planning for a large world,
# and one-line input errors with exit code 2 on every rank without a hang.
source "$(dirname "${BASH_SOURCE[0]}")/lib/prologue.sh"
deck="$PTRAIN_SOURCE_DIR/input/gpt2-124m.nml"

out=$("$PTRAIN" --plan "$deck" --world 1)
grep -q "parameters: 124,439,808 " <<<"$out" || fail "124M count: $out"

out=$("$PTRAIN" --plan "$deck" --world 512 --ranks-per-node 4 --set parallel%tp=4 --set parallel%pp=4 --set train%global_batch=512)
grep -q "on 512 ranks (128 nodes, 4 ranks per node)" <<<"$out" || fail "512-rank plan header: $out"
grep -q "vocab 50257 (padded to 50260" <<<"$out" || fail "vocab padding not reported: $out"
grep -q "pipeline bubble" <<<"$out" || fail "no bubble line"
if grep -q "context parallel" <<<"$out"; then fail "context-parallel line without cp: $out"; fi

# Context parallel: how the sequence is cut, the ring's traffic per layer (forward 1 K/V block
# of 2*4*512*768*4 B = 12 MiB; backward 1 K/V + 2 dK/dV) and per step, the activations saved.
out=$("$PTRAIN" --plan "$deck" --world 2 --set parallel%cp=2)
grep -qF "context parallel: zigzag over 2 ranks, 512 of 1024 positions each (chunks c and 3-c of 4); ring per layer and micro-batch 48.00 MiB sent (forward 12.00 MiB, backward 36.00 MiB), 1.12 GiB per step (2 micro-batches x 12 layers on rank 0); activations " <<<"$out" \
  || fail "cp line: $out"
grep -q "context parallel: .* at cp = 1, .* saved)" <<<"$out" || fail "cp activations: $out"
grep -qE "^  cp +1.12 GiB " <<<"$out" || fail "cp traffic row: $out"
grep -q "workspace includes ring attention's backward buffers, 72.09 MiB" <<<"$out" || fail "ring workspace: $out"
out=$("$PTRAIN" --plan "$deck" --world 4 --set parallel%cp=4 --set parallel%cp_layout=\'contiguous\')
grep -qF "context parallel: contiguous over 4 ranks, 256 of 1024 positions each (chunk c of 4); ring per layer and micro-batch 60.00 MiB sent (forward 18.00 MiB, backward 42.00 MiB)" <<<"$out" \
  || fail "contiguous cp line: $out"

# Mixture of experts (input/moe-tiny.nml at ep = 2): experts per ep rank, capacity, the experts'
# memory on a rank, the all-to-all per MoE layer and micro-batch under uniform routing (rows
# out and back, forward and backward: 4 x 2*8*64 rows x 64 floats x 1/2 leaving, + 16 B of
# counts) and per step; at ep = 1 none; a dense deck has no such line.
moe="$PTRAIN_SOURCE_DIR/input/moe-tiny.nml"
out=$("$PTRAIN" --plan "$moe" --world 2 --ranks-per-node 2 --set parallel%ep=2)
grep -qF "mixture of experts: 8 experts (4 per ep rank), top 2, capacity 1.25 (ceil(1.25*2*N/8) slots per expert for a micro-batch of N tokens: 160 at N = 512), 2 of 2 blocks (moe_every = 1); expert parameters 132,608 per rank: 518.00 KiB, grads 518.00 KiB, optimizer 1.01 MiB; all-to-all per MoE layer and micro-batch 512.02 KiB (forward 256.02 KiB: counts 16 B + rows out and back 2 x 128.00 KiB; backward 256.00 KiB), 1.00 MiB per step (1 micro-batch(es) x 2 MoE layers on rank 0)" <<<"$out" \
  || fail "MoE line: $out"
grep -qE "^  ep +1.00 MiB +m\*L_moe" <<<"$out" || fail "ep traffic row: $out"
out=$("$PTRAIN" --plan "$moe" --world 1 --set model%capacity_factor=0)
grep -qF "8 experts (8 per ep rank), top 2, dropless (capacity_factor = 0), 2 of 2 blocks (moe_every = 1); expert parameters 265,216 per rank: 1.01 MiB" <<<"$out" \
  || fail "one-rank MoE line: $out"
grep -qF "no all-to-all (ep = 1: every expert on every rank)" <<<"$out" || fail "ep = 1 all-to-all: $out"
if "$PTRAIN" --plan "$deck" --world 1 | grep -q "mixture of experts"; then fail "MoE line for a dense deck"; fi

# Will it fit (issue 15): the 13B example on its 8 ranks of 80 GiB fits under every recompute
# level and ZeRO stage; at 32 GiB it does not, and each change the plan advises fits with the
# figure it prints: the recompute x ZeRO table's cell where that is all it changes, and the
# largest shard --plan gives for the deck with the change.
b13="$PTRAIN_SOURCE_DIR/input/gpt-13b-8gpu.nml"
cells() {  # cells PLAN-OUTPUT: "level zero bytes-with-unit verdict" for each table cell
  sed -n '/^largest shard by train%recompute x parallel%zero/,/^$/p' <<<"$1" | awk '
    $1 ~ /^(none|selective|full)$/ { n = 0; for (i = 2; i < NF; i += 3) { v = $i; sub(/^\*/, "", v); print $1, n++, v " " $(i + 1), $(i + 2) } }'
}
out=$("$PTRAIN" --plan "$b13" --world 8 --ranks-per-node 8 --memory 80GiB)
grep -qF "memory per rank: 80.00 GiB (--memory); every shard fits (the largest, rank 0's: " <<<"$out" || fail "13B at 80 GiB: $out"
table=$(cells "$out")
[ "$(wc -l <<<"$table")" = 12 ] || fail "13B: not a 3 x 4 recompute x ZeRO table: $out"
[ "$(grep -c " fits$" <<<"$table")" = 12 ] || fail "13B at 80 GiB: some recompute x ZeRO cell does not fit: $table"
deck_cell=$(grep -oE '\*[0-9.]+ GiB' <<<"$out" | tr -d '*')
grep -qF "every shard fits (the largest, rank 0's: $deck_cell)" <<<"$out" || fail "13B: the deck's cell ($deck_cell) is not the largest shard: $out"
grep -qE "^  0 +0,0,0 .* fits: $deck_cell of 80.00 GiB$" <<<"$out" || fail "13B: rank 0's row: $out"
# Every cell is what --plan gives for the deck with that recompute level and ZeRO stage.
while read -r level zero num unit verdict; do
  size="$num $unit"
  one=$("$PTRAIN" --plan "$b13" --world 8 --ranks-per-node 8 --memory 80GiB \
    --set train%recompute="'$level'" --set parallel%zero="$zero")
  grep -qF "every shard fits (the largest, rank 0's: $size)" <<<"$one" || fail "13B cell $level/zero $zero ($size) differs from its plan"
done < <(awk 'NR % 5 == 1' <<<"$table")  # a sample of the twelve
out=$("$PTRAIN" --plan "$b13" --world 8 --ranks-per-node 8 --memory 32GiB)
grep -qF "rank 0's shard DOES NOT FIT: $deck_cell > 32.00 GiB" <<<"$out" || fail "13B at 32 GiB: $out"
table=$(cells "$out")
grep -q "^none 2 .* over$" <<<"$table" || fail "13B at 32 GiB: the deck's cell fits? $table"
grep -q "^full 3 .* fits$" <<<"$table" || fail "13B at 32 GiB: full recompute with ZeRO 3 does not fit? $table"
advice=$(sed -n '/^changes that make every shard fit, cheapest first/,/^$/p' <<<"$out")
n=$(grep -cE "^  [0-9]+\. --set " <<<"$advice") || fail "13B at 32 GiB: no advice: $out"
while read -r sets; do
  size=$(grep -A1 -F -- "$sets" <<<"$advice" | sed -nE 's/^ +largest shard ([0-9.]+ [KMGT]?i?B); .*/\1/p' | head -1)
  [ -n "$size" ] || fail "13B advice without a figure: $sets"
  awk -v s="${size% *}" -v u="${size#* }" 'BEGIN { exit !(u == "GiB" && s + 0 <= 32) }' || fail "13B advice over 32 GiB: $sets $size"
  eval "args=($sets)"
  one=$("$PTRAIN" --plan "$b13" --world 8 --ranks-per-node 8 --memory 32GiB "${args[@]}")
  grep -qE "every shard fits \(the largest, rank [0-9]+'s: $size\)" <<<"$one" || fail "13B advice '$sets' ($size) differs from its plan: $one"
  if ! grep -qvE "train%recompute|parallel%zero" <<<"$(tr ' ' '\n' <<<"$sets" | grep -v -- --set)"; then
    level=$(sed -nE "s/.*train%recompute='([a-z]+)'.*/\1/p" <<<"$sets"); level=${level:-none}
    zero=$(sed -nE 's/.*parallel%zero=([0-3]).*/\1/p' <<<"$sets"); zero=${zero:-2}
    grep -qF "$level $zero $size fits" <<<"$table" || fail "13B advice '$sets' ($size) is not its table cell: $table"
  fi
done < <(sed -nE 's/^  [0-9]+\. (--set .*)/\1/p' <<<"$advice")
# Without --memory a GPU deck's memory is unknown: the table, no verdict.
out=$("$PTRAIN" --plan "$b13" --world 8 --ranks-per-node 8)
grep -qF "memory per rank: unknown (backend%device = 'cuda': pass the GPU's memory as --memory" <<<"$out" || fail "13B without --memory: $out"
if grep -qE "fits|DOES NOT FIT" <<<"$out"; then fail "13B without --memory: a verdict: $out"; fi

# A tp group wider than a node: a warning, an error with strict_topology.
"$PTRAIN" --plan "$deck" --world 16 --ranks-per-node 2 --set parallel%tp=4 --set train%micro_batch=2 2>"$tmp/err" >/dev/null
grep -q "warning: .*tp" "$tmp/err" || fail "no topology warning: $(cat "$tmp/err")"
set +e
"$PTRAIN" --plan "$deck" --world 16 --ranks-per-node 2 --set parallel%tp=4 --set train%micro_batch=2 \
  --set parallel%strict_topology=.true. >/dev/null 2>"$tmp/err"; rc=$?
set -e
[ "$rc" = 2 ] || fail "strict topology exit $rc"

# Under mpirun: the plan of the real job, then errors on every rank -> exit 2, no hang.
out=$(launch 2 "$PTRAIN" --plan "$deck" --set parallel%tp=2)
grep -q "plan for .* on 2 ranks" <<<"$out" || fail "mpirun plan: $out"

printf '&parallel\n  tpp = 2\n/\n' >"$tmp/bad.nml"
set +e
timeout 60 "$MPIEXEC" $MPIEXEC_PREFLAGS -np 4 "$PTRAIN" --plan "$tmp/bad.nml" >"$tmp/out" 2>"$tmp/err"; rc=$?
set -e
[ "$rc" = 2 ] || fail "bad deck: exit $rc, expected 2: $(cat "$tmp/err")"
grep -q "bad.nml:2:3: unknown key 'tpp' in &parallel (did you mean 'tp'?)" "$tmp/err" || fail "message: $(cat "$tmp/err")"
[ "$(grep -c "unknown key" "$tmp/err")" = 1 ] || fail "message printed more than once"

set +e
timeout 60 "$MPIEXEC" $MPIEXEC_PREFLAGS -np 2 "$PTRAIN" --plan "$tmp/missing.nml" >/dev/null 2>"$tmp/err"; rc=$?
set -e
[ "$rc" = 2 ] || fail "missing deck: exit $rc"
grep -q "missing.nml" "$tmp/err" || fail "missing-file message: $(cat "$tmp/err")"
# Sizes the run could not use (32-bit indexing in the kernels and MPI counts, an empty
# out_dir, beta at 1): refused before any planning, one line with the rule, exit 2.
tiny="$PTRAIN_SOURCE_DIR/input/tiny.nml"
refuse() {  # refuse --set-ARG EXPECTED-MESSAGE-PART
  set +e
  "$PTRAIN" --plan "$tiny" --world 1 --set "$1" >"$tmp/out" 2>"$tmp/err"; rc=$?
  set -e
  [ "$rc" = 2 ] || fail "--set $1: exit $rc, expected 2: $(cat "$tmp/err")"
  [ "$(wc -l <"$tmp/err")" = 1 ] || fail "--set $1: not one line: $(cat "$tmp/err")"
  grep -qF -- "$2" "$tmp/err" || fail "--set $1: expected '$2', got: $(cat "$tmp/err")"
  if grep -q -- "-[0-9]" "$tmp/out"; then fail "--set $1: negative numbers in the plan"; fi
}
refuse model%vocab=2147483648 "model%vocab = 2147483648 exceeds 2147483647"
refuse model%seq_len=1000000000 "activation elements of one micro-batch exceed 2147483647"
refuse model%d_model=65536 "elements of one weight matrix exceed 2147483647"
refuse train%global_batch=4294967296 "tokens per step exceed 2147483647"
refuse data%val_samples=9223372036854775807 "data%val_samples*model%seq_len overflows a 64-bit integer"
refuse run%out_dir= "run%out_dir = '' is empty"
refuse train%beta1=1.0 "train%beta1 = 1.0 is out of range: must be in [0.0, 1.0)"
# The largest model the rules allow still plans with positive sizes.
out=$("$PTRAIN" --plan "$tiny" --world 1 --set model%n_layer=100000 --set model%d_model=16384 \
  --set model%n_head=16 --set train%micro_batch=1 --set train%global_batch=1 --set model%seq_len=1)
grep -q "parameters: 322,143,847,497,728 " <<<"$out" || fail "huge plan: $out"
if grep -q -- " -[0-9]" <<<"$out"; then fail "negative numbers in the huge plan: $out"; fi
refuse model%n_expert=9223372036854775804 "model%n_expert*(the MLP's parameters) overflows a 64-bit integer"
refuse checkpoint%keep=2147483648 "checkpoint%keep = 2147483648 is out of range"

# A deep pipeline answers in seconds, in a few KB (issue 29, defect 7: the schedule's picture
# at pp = 1000 was 54 MB; a plan of 4000 stages took 98 s, then 17 s with every rank's list
# held at once, 2 s with one at a time), and SIGTERM ends a plan at once.
deep=(--plan "$tiny" --world 4000 --set parallel%pp=4000 --set model%n_layer=4000
      --set train%global_batch=4000 --set train%micro_batch=1)
t0=$SECONDS
timeout 60 "$PTRAIN" "${deep[@]}" >"$tmp/deep" 2>&1 || fail "pp = 4000 plan: $(tail -3 "$tmp/deep")"
echo "plan: pp = 4000 in $((SECONDS - t0)) s, $(wc -c <"$tmp/deep") bytes"
[ "$(wc -c <"$tmp/deep")" -lt 100000 ] || fail "pp = 4000 plan: $(wc -c <"$tmp/deep") bytes"
grep -q "not drawn for more than 32 stages" "$tmp/deep" || fail "pp = 4000: the schedule is drawn"
"$PTRAIN" --plan "$tiny" --world 20000 --set parallel%pp=20000 --set model%n_layer=20000 \
  --set train%global_batch=20000 --set train%micro_batch=1 >/dev/null 2>&1 &
pid=$!
sleep 1
kill -TERM "$pid"
rc=0
for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid"; fail "--plan ignored SIGTERM"; fi
wait "$pid" || rc=$?
[ "$rc" = 143 ] || [ "$rc" = 0 ] || fail "--plan after SIGTERM: exit $rc"
echo "plan: all checks passed"
