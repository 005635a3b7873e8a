#!/usr/bin/env bash
# The cost model (issue 30): ptrain --calibrate writes a machine file that --plan --machine
# reads; --plan without one says it priced the node class's stated defaults; --plan --search
# ranks the layouts of a world (4,096 ranks in seconds) and --write-deck writes the fastest as
# a deck that trains; a run puts its measured step beside the prediction; parallel%pp_layers
# = -1 balances the stages; a bad machine file is one line and exit 2.
source "$(dirname "${BASH_SOURCE[0]}")/lib/prologue.sh"
deck="$PTRAIN_SOURCE_DIR/input/tiny.nml"
mb8=(--set train%micro_batch=8)

# --calibrate on 2 ranks: progress lines, then the machine file.
launch 2 "$PTRAIN" --calibrate "$deck" "${mb8[@]}" --write-machine "$tmp/machine.nml" \
  --set run%out_dir="'$tmp/cal'" >"$tmp/cal.log" 2>&1 || fail "calibrate: $(tail -3 "$tmp/cal.log")"
for line in "calibrate: sgemm at " "calibrate: attention " "calibrate: communication inside a node (2 ranks)" \
  "calibrate: the deck's 3 steps: measured over modelled" "calibrate: wrote $tmp/machine.nml"; do
  grep -qF "$line" "$tmp/cal.log" || fail "calibrate: no '$line': $(head -20 "$tmp/cal.log")"
done
grep -qE "^ +gemm_gflops_fp32 += [0-9.]+$" "$tmp/machine.nml" || fail "no measured sgemm rate: $(cat "$tmp/machine.nml")"
grep -qE "^ +comm_intra_gbs += [0-9.]+, [0-9.]+, [0-9.]+, [0-9.]+$" "$tmp/machine.nml" || fail "no link rates"
grep -qE "^ +name += 'calibrated .*2 rank\(s\), 2 a node" "$tmp/machine.nml" || fail "machine name"

# --plan with it, and without.
out=$("$PTRAIN" --plan "$deck" "${mb8[@]}" --world 2 --machine "$tmp/machine.nml")
grep -q "^machine: calibrated .*from node class 'cpu': comm_inter_gbs, comm_inter_latency_us" <<<"$out" \
  || fail "plan's machine line: $out"
grep -qE "^predicted step [0-9.e-]+ s: forward .* tok/s, MFU .* \| bound: " <<<"$out" || fail "prediction: $out"
grep -qE "^FLOPs per step: model [0-9.e+]+, executed [0-9.e+]+ " <<<"$out" || fail "model and executed FLOPs: $out"
out=$("$PTRAIN" --plan "$deck" --world 1)
grep -qF "machine: node class 'cpu' stated defaults (no &machine rates; ptrain --calibrate measures them)" <<<"$out" \
  || fail "no machine file: $out"

# --search: a deck sized for one rank is searched over 4; the fastest is written and trains.
out=$("$PTRAIN" --plan "$deck" --world 4 --ranks-per-node 4 --machine "$tmp/machine.nml" --search \
  --write-deck "$tmp/best.nml")
grep -qF "the deck's own layout is not one of 4 ranks (" <<<"$out" || fail "own layout: $out"
grep -qE "^layout search: [0-9]+ process grids, [0-9]+ layouts the deck's rules accept, [0-9]+ fit .* priced; [0-9.]+ s$" <<<"$out" \
  || fail "search summary: $out"
first=$(sed -n '/^ *# *step s/{n;p;q}' <<<"$out")
[ -n "$first" ] || fail "no ranked layout: $out"
grep -qF "wrote the fastest layout to $tmp/best.nml" <<<"$out" || fail "write-deck: $out"
# The written deck is the first row's layout: each of its --set values is in the deck.
for set in $(sed 's/.*  //' <<<"$first"); do
  key=${set%%=*} value=${set#*=}
  grep -qE "^ +${key#*%} += $value( |$)" "$tmp/best.nml" || fail "best.nml lacks $set: $(cat "$tmp/best.nml")"
done
launch 4 "$PTRAIN" "$tmp/best.nml" --set run%steps=3 --set run%out_dir="'$tmp/best'" >"$tmp/best.log" 2>&1 \
  || fail "the searched deck does not train: $(tail -3 "$tmp/best.log")"
grep -qE "^cost model: measured step [0-9.]+ s \(forward .*predicted [0-9.]+ s .*: measured [0-9.]+ times the prediction$" "$tmp/best.log" \
  || fail "end-of-run comparison: $(tail -5 "$tmp/best.log")"

# A login node: every layout of 4,096 ranks for GPT-2 124M in seconds.
start=$(date +%s)
out=$(timeout 60 "$PTRAIN" --plan "$PTRAIN_SOURCE_DIR/input/gpt2-124m.nml" --world 4096 --ranks-per-node 4 \
  --search --set train%global_batch=1024) || fail "4096-rank search: exit $?"
[ $(($(date +%s) - start)) -le 20 ] || fail "the 4096-rank search took over 20 s"
grep -qE "^layout search: [0-9]+ process grids, [0-9]{3,} layouts" <<<"$out" || fail "4096-rank search: $out"

# parallel%pp_layers = -1: the split the model balances, said in the plan and in the run.
bal=(--set parallel%pp=2 --set parallel%pp_layers=-1 --set model%n_layer=3 "${mb8[@]}")
out=$("$PTRAIN" --plan "$deck" "${bal[@]}" --world 2)
grep -qE "^parallel%pp_layers = -1: the layers split [0-9]+, [0-9]+ over the pipeline chunks" <<<"$out" || fail "balanced split: $out"
launch 2 "$PTRAIN" "$deck" "${bal[@]}" --set run%steps=2 --set run%out_dir="'$tmp/bal'" >"$tmp/bal.log" 2>&1 \
  || fail "balanced run: $(tail -3 "$tmp/bal.log")"
grep -qF "parallel%pp_layers = -1: the layers split" "$tmp/bal.log" || fail "run's split line"

# A bad machine file: one line naming it, exit 2.
expect_error() {  # expect_error TEXT ARGS...: exit 2 and TEXT in the only line
  local text=$1 rc=0
  shift
  out=$("$PTRAIN" --plan "$deck" --world 1 "$@" 2>&1) || rc=$?
  [ "$rc" = 2 ] || fail "exit $rc, expected 2 for $*: $out"
  [ "$(wc -l <<<"$out")" = 1 ] || fail "not one line for $*: $out"
  grep -qF -- "$text" <<<"$out" || fail "no '$text' for $*: $out"
}
expect_error "--machine $tmp/none.nml: cannot open: No such file or directory" --machine "$tmp/none.nml"
printf '&run\n/\n' >"$tmp/nomachine.nml"
expect_error "$tmp/nomachine.nml: no &machine group" --machine "$tmp/nomachine.nml"
printf '&machine\n  node_class = "tpu"\n/\n' >"$tmp/class.nml"
expect_error "machine%node_class" --machine "$tmp/class.nml"
printf '&machine\n  gemm_gflops_fp32 = -3\n/\n' >"$tmp/negative.nml"
expect_error "gemm_gflops_fp32" --machine "$tmp/negative.nml"
expect_error "--write-deck goes with --plan --search" --write-deck "$tmp/x.nml"
echo "cost: all checks passed"
