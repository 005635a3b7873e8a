#!/usr/bin/env bash
# ptrain --plan: the GPT-2 124M parameter count, login-node planning for a large world,
# and one-line input errors with exit code 2 on every rank without a hang.
set -euo pipefail
: "${PTRAIN:?}" "${PTRAIN_SOURCE_DIR:?}" "${MPIEXEC:=mpirun}"
deck="$PTRAIN_SOURCE_DIR/input/gpt2-124m.nml"
fail() { echo "FAIL: $*" >&2; exit 1; }
launch() { "$MPIEXEC" $MPIEXEC_PREFLAGS -np "$@"; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT

out=$("$PTRAIN" --plan "$deck" --world 1)
grep -q "parameters: 124,439,808 " <<<"$out" || fail "124M count: $out"

out=$("$PTRAIN" --plan "$deck" --world 512 --ranks-per-node 4 --set parallel%tp=4 --set parallel%pp=4 --set train%global_batch=512)
grep -q "on 512 ranks (128 nodes, 4 ranks per node)" <<<"$out" || fail "512-rank plan header: $out"
grep -q "vocab 50257 (padded to 50260" <<<"$out" || fail "vocab padding not reported: $out"
grep -q "pipeline bubble" <<<"$out" || fail "no bubble line"

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
echo "plan: all checks passed"
