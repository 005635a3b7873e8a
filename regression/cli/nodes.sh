#!/usr/bin/env bash
# Two simulated nodes that are real hosts to MPI (regression/nodes/netns.sh: network namespaces
# with their own host names, Open MPI over TCP on a bridge, the link shaped to 100 Mbit/s), two
# ranks each:
#  1. tp 2 inside each node, dp 2 across: the grid reports 2 nodes with tp intra-node, and the
#     training equals the one-rank fp64 run within 1e-10 (loss, grad norm, validation loss);
#     dp 4 with ZeRO 2 over both nodes: the dense-grad group reduces in two levels (the log
#     says so, and log.csv has the levels' bytes, 2/3 and 1/3 of the flat ring's), trains as
#     one rank does, and its checkpoint (shards owned in the two-level numbering) resumes on
#     one rank with the same losses; the same with hybrid sharding (ZeRO 2 shards inside each
#     node, zero_scope = 'node'): its groups in the log, its shard's bytes across the link,
#     optimizer memory as the plan says, and its checkpoint (one replica writes) on one rank;
#  2. strict_topology refuses tp 4, which would cross the link (exit 2, one line);
#  3. taking one node's link down mid-run ends the job within run%hang_timeout (plus the time
#     to tear down), with the watchdog naming the group and the ranks that have not arrived.
# Skips (one line) where network namespaces cannot be made (not root, no ip netns).
source "$(dirname "${BASH_SOURCE[0]}")/lib/prologue.sh"
nodes=$PTRAIN_SOURCE_DIR/regression/nodes/netns.sh
if [ "$(id -u)" != 0 ] || ! ip netns add ptrnprobe 2>/dev/null; then
  echo "SKIP: nodes: cannot make network namespaces here (needs root and ip netns)"; exit 0
fi
ip netns del ptrnprobe
trap 'pkill -9 -f "$tmp" 2>/dev/null || true; "$nodes" down >/dev/null 2>&1; rm -rf "$tmp"' EXIT
"$nodes" up 2 100mbit || fail "netns.sh up"
deck=$PTRAIN_SOURCE_DIR/regression/cases/layouts_fp64/deck.nml
steps=(--set run%steps=10 --set run%eval_every=5)

# 1. One rank here, then tp 2 x dp 2 over the two nodes.
"$PTRAIN" "$deck" "${steps[@]}" --set run%out_dir="'$tmp/one'" >"$tmp/one.log" 2>&1 ||
  fail "one-rank run: $(tail -3 "$tmp/one.log")"
timeout 300 "$nodes" run 2 -np 4 "$PTRAIN" "$deck" "${steps[@]}" --set parallel%tp=2 \
  --set parallel%dp=2 --set run%out_dir="'$tmp/four'" >"$tmp/four.log" 2>&1 ||
  fail "tp2 x dp2 over 2 nodes: $(tail -5 "$tmp/four.log")"
grep -q "grid: 4 ranks .* 2 nodes, up to 2 ranks per node" "$tmp/four.log" ||
  fail "the grid does not see 2 nodes: $(grep -m1 '^grid:' "$tmp/four.log")"
grep -Eq "^  tp .* yes" "$tmp/four.log" || fail "tp is not intra-node: $(grep -A8 '^  group' "$tmp/four.log")"
same_as_one() {  # RUN WHAT: RUN's losses, norms and validation losses are the one-rank run's
  /usr/bin/python3 - "$tmp/one/log.csv" "$tmp/$1/log.csv" "$2" <<'PY' || fail "$2 differs from 1 rank"
import csv, sys
def steps(p):  # step -> its row
    return {r["step"]: r for r in csv.DictReader(open(p))}
a, b = steps(sys.argv[1]), steps(sys.argv[2])
if not b or not set(b) <= set(a):
    sys.exit(f"steps {sorted(b)} are not among the one-rank run's")
worst = 0.0
for s in b:
    for k in ("loss", "grad_norm", "val_loss"):
        x, y = a[s][k], b[s][k]
        if x == "" and y == "":
            continue
        x, y = float(x), float(y)
        worst = max(worst, abs(x - y) / max(abs(x), 1e-300))
print(f"nodes: {sys.argv[3]} against one rank, steps {min(b, key=int)}-{max(b, key=int)}: "
      f"largest relative difference {worst:.2e}")
sys.exit(worst > 1e-10)
PY
}
same_as_one four "tp2 x dp2 over 2 namespace nodes"

timeout 300 "$nodes" run 2 -np 4 "$PTRAIN" "$deck" "${steps[@]}" --set parallel%dp=4 \
  --set parallel%zero=2 --set checkpoint%every=5 --set run%out_dir="'$tmp/dp4'" >"$tmp/dp4.log" 2>&1 ||
  fail "dp4 ZeRO 2 over 2 nodes: $(tail -5 "$tmp/dp4.log")"
grep -q "^comm: rank 0's groups: dense-grad hierarchical (2 nodes x 2 ranks, mpi)$" "$tmp/dp4.log" ||
  fail "dp4 over 2 nodes does not reduce in two levels: $(grep '^comm:' "$tmp/dp4.log")"
same_as_one dp4 "dp4 ZeRO 2 over 2 namespace nodes, two-level reduction"
/usr/bin/python3 - "$tmp/dp4/log.csv" <<'PY' || fail "the levels' bytes are not 2/3 and 1/3 of the flat ring's"
import csv, sys
for r in list(csv.DictReader(open(sys.argv[1])))[1:]:
    flat, intra, inter = (float(r[k]) for k in ("bytes_dense_grad", "bytes_dense_grad_intra", "bytes_dense_grad_inter"))
    if abs(intra - flat * 2 / 3) > 1e-6 * flat or abs(inter - flat / 3) > 0.01 * flat:
        sys.exit(f"step {r['step']}: flat {flat}, intra {intra}, inter {inter}")
PY
"$PTRAIN" "$deck" "${steps[@]}" --set checkpoint%restart="'$tmp/dp4/checkpoints/ckpt_00000005.h5'" \
  --set run%out_dir="'$tmp/dp4_to_1'" >"$tmp/dp4_to_1.log" 2>&1 || fail "dp4 -> 1 rank: $(tail -3 "$tmp/dp4_to_1.log")"
same_as_one dp4_to_1 "dp4 ZeRO 2 checkpoint at step 5 resumed on one rank"

# Hybrid sharding: ZeRO 2 shards inside each node, replicated across (2 micro-batches a step).
# Each rank all-reduces its shard across the link once a step: rank 0's is half the model,
# 2(N-1)/N of it is N/2 * 8 bytes (fp64); a two-level ZeRO 2 would send that per micro-batch
# and again for the parameter gather.
timeout 300 "$nodes" run 2 -np 4 "$PTRAIN" "$deck" "${steps[@]}" --set parallel%dp=4 \
  --set parallel%zero=2 --set parallel%zero_scope="'node'" --set train%micro_batch=1 \
  --set checkpoint%every=5 --set run%out_dir="'$tmp/hybrid'" >"$tmp/hybrid.log" 2>&1 ||
  fail "dp4 ZeRO 2 node scope over 2 nodes: $(tail -5 "$tmp/hybrid.log")"
grep -q "^comm: rank 0's groups: dense-grad hierarchical (2 nodes x 2 ranks, mpi), dense-grad-intra mpi, dense-grad-inter mpi$" "$tmp/hybrid.log" ||
  fail "hybrid sharding's groups: $(grep '^comm:' "$tmp/hybrid.log")"
same_as_one hybrid "dp4 ZeRO 2, shards inside the node (zero_scope = 'node')"
params=$(sed -n 's/^model: \([0-9]*\) parameters.*/\1/p' "$tmp/hybrid.log")
/usr/bin/python3 - "$tmp/hybrid/log.csv" "$params" <<'PY' || fail "hybrid sharding's inter-node bytes"
import csv, sys
n = int(sys.argv[2])
for r in list(csv.DictReader(open(sys.argv[1])))[1:]:
    inter = float(r["bytes_dense_grad_inter"])
    if inter != (n + 1) // 2 * 8:
        sys.exit(f"step {r['step']}: {inter} bytes across, expected {(n + 1) // 2 * 8}")
print(f"nodes: hybrid sharding sends {(n + 1) // 2 * 8} bytes a step across the link from rank 0")
PY
grep -Eq "^memory: .*optimizer ([0-9.]+ [KMG]?i?B) \(plan \1\)" "$tmp/hybrid.log" ||
  fail "hybrid sharding's optimizer memory is not the plan's: $(grep '^memory:' "$tmp/hybrid.log")"
"$PTRAIN" "$deck" "${steps[@]}" --set checkpoint%restart="'$tmp/hybrid/checkpoints/ckpt_00000005.h5'" \
  --set run%out_dir="'$tmp/hybrid_to_1'" >"$tmp/hybrid_to_1.log" 2>&1 ||
  fail "hybrid -> 1 rank: $(tail -3 "$tmp/hybrid_to_1.log")"
same_as_one hybrid_to_1 "the hybrid checkpoint at step 5 resumed on one rank"

# 2. tp across the link, refused with strict_topology.
rc=0
timeout 120 "$nodes" run 2 -np 4 "$PTRAIN" "$deck" --set parallel%tp=4 --set parallel%dp=1 \
  --set parallel%strict_topology=.true. --set run%out_dir="'$tmp/strict'" >"$tmp/strict.log" 2>&1 || rc=$?
[ "$rc" = 2 ] || fail "tp 4 over 2 nodes with strict_topology: exit $rc, not 2: $(tail -3 "$tmp/strict.log")"
grep -q "tp" "$tmp/strict.log" || fail "the refusal does not name tp: $(cat "$tmp/strict.log")"

# 3. A node's link down mid-run: the watchdog on the other node ends the job.
hang=6
t0=$SECONDS
timeout 240 "$nodes" run 2 -np 4 "$PTRAIN" "$deck" --set run%steps=100000 --set run%eval_every=0 \
  --set parallel%tp=2 --set parallel%dp=2 --set run%hang_timeout=$hang \
  --set run%out_dir="'$tmp/cut'" >"$tmp/cut.log" 2>&1 &
job=$!
for _ in $(seq 60); do grep -q "^step" "$tmp/cut.log" 2>/dev/null && break; sleep 1; done
"$nodes" link ptrn1 down
cut_at=$SECONDS
rc=0
wait "$job" || rc=$?
took=$((SECONDS - cut_at))
[ "$rc" != 0 ] || fail "the run went on after its link went down"
[ "$rc" != 124 ] || fail "the job hung for 240 s after the link went down: $(tail -5 "$tmp/cut.log")"
grep -q "have not arrived\|not arrived" "$tmp/cut.log" ||
  fail "no watchdog report naming the missing ranks: $(tail -8 "$tmp/cut.log")"
echo "nodes: link down after $((cut_at - t0)) s; the job ended $took s later (hang_timeout $hang s):"
grep -m1 "not arrived" "$tmp/cut.log"
echo "nodes: ok"
