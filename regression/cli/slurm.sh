#!/usr/bin/env bash
# The sbatch scripts of jobscripts/ on a real one-node Slurm started here (munged, slurmctld and
# slurmd from files in a temporary folder, on free ports; TOOLCHAIN.md's recipe):
#   - train.sbatch trains on 2 ranks (srun --mpi=pmix), and again through the mpirun fallback
#     when srun offers no PMIx;
#   - the time-limit convention: SIGUSR1 to the batch shell mid-run makes ptrain checkpoint and
#     exit 0, the job is requeued and resumes with checkpoint%restart='latest' to the same end
#     as an uninterrupted run; a non-zero exit after the signal does not requeue (a stub);
#   - train-gpu.sbatch starts one task per GPU (two fake GPUs) with --set backend%device='cuda';
#   - sweep.sbatch runs one deck per array task, and sweep.py collects them; a task stopped
#     by SIGUSR1 is requeued alone and resumes its deck.
# Every daemon started here is stopped by its PID on exit, also on failure or timeout. The Slurm
# and munge packages come from Makefile.inc's DEBIAN_PACKAGES: without them the test skips,
# unless it runs as root (then missing packages are a failure). PTRAIN_TEST_KEEP=1 keeps the
# folder (configuration, daemon logs, job output) for a look after a failure.
set -euo pipefail
: "${PTRAIN:?}" "${PTRAIN_SOURCE_DIR:?}"
export PATH=$PATH:/usr/sbin:/sbin
fail() { echo "FAIL: $*" >&2; exit 1; }
skip_unless_root() {
  if [ "$(id -u)" = 0 ]; then fail "$*"; fi
  echo "SKIP: slurm: $*"; exit 0
}
for t in munged mungekey slurmctld slurmd sbatch scontrol sinfo srun scancel; do
  command -v "$t" >/dev/null 2>&1 || skip_unless_root "$t not found (Debian packages slurm-wlm munge)"
done
[ -x /usr/bin/python3 ] || skip_unless_root "/usr/bin/python3 not found"
src=$PTRAIN_SOURCE_DIR
jobs=$src/jobscripts

# 0. The three scripts share one common part, word for word.
common() { sed -n '/^# ---- common part of the ptrain job scripts/,/^# ---- end of the common part/p' "$1"; }
ref=$(common "$jobs/train.sbatch")
[ "$(wc -l <<<"$ref")" -gt 20 ] || fail "no common part in train.sbatch"
for f in train-gpu.sbatch sweep.sbatch; do
  [ "$(common "$jobs/$f")" = "$ref" ] || fail "the common part of $f differs from train.sbatch's"
done

# 1. A private Slurm.
D=$(mktemp -d /tmp/ptrain-slurm.XXXXXX)
chmod 755 "$D"   # munge's socket folder must be searchable
submitted=()
cleanup() {
  set +e
  if [ ${#submitted[@]} -gt 0 ] && [ -f "$D/slurm.conf" ]; then
    scancel "${submitted[@]}" 2>/dev/null
    for _ in $(seq 50); do
      scontrol show job -o 2>/dev/null | grep -qE "JobState=(RUNNING|COMPLETING)" || break
      sleep 0.2
    done
  fi
  for d in slurmd slurmctld munged; do
    [ -f "$D/$d.pid" ] || continue
    pid=$(cat "$D/$d.pid")
    kill "$pid" 2>/dev/null || continue
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null
  done
  if [ -n "${PTRAIN_TEST_KEEP:-}" ]; then echo "slurm: kept $D"; else rm -rf "$D"; fi
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP   # a ctest timeout also stops the daemons

read -r ctld_port slurmd_port < <(/usr/bin/python3 -c '
import socket
s = [socket.socket() for _ in range(2)]
for x in s: x.bind(("127.0.0.1", 0))
print(*[x.getsockname()[1] for x in s])')
host=$(hostname -s)
node=$(slurmd -C | head -n 1 | sed -e "s/^NodeName=[^ ]*/NodeName=$host NodeAddr=127.0.0.1/" -e 's/ *UpTime=.*//')
export SLURM_CONF=$D/slurm.conf
cat >"$SLURM_CONF" <<EOF
ClusterName=ptraintest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=$(id -un)
SlurmdUser=$(id -un)
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$D/munge.socket,cred_expire=5
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd.pid
SlurmctldLogFile=$D/slurmctld.log
SlurmdLogFile=$D/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
ReturnToService=2
KillWait=5
GresTypes=gpu
$node Gres=gpu:2 State=UNKNOWN
PartitionName=test Nodes=$host Default=YES MaxTime=10 State=UP
EOF
# Two fake GPUs: any character devices do, nothing opens them (task/none confines nothing).
printf 'AutoDetect=off\nNodeName=%s Name=gpu File=/dev/null\nNodeName=%s Name=gpu File=/dev/zero\n' \
  "$host" "$host" >"$D/gres.conf"
mkdir -p "$D/state" "$D/spool"
mungekey -c -k "$D/munge.key"
# As root a daemon that does not start is a failure; as another user Slurm may refuse to run.
no_daemon() { skip_unless_root "$1 did not start as $(id -un): $(tail -n 2 "$D/$1.log" 2>/dev/null)"; }
munged --key-file="$D/munge.key" --socket="$D/munge.socket" --pid-file="$D/munged.pid" \
  --log-file="$D/munged.log" --seed-file="$D/munged.seed" || no_daemon munged
slurmctld -f "$SLURM_CONF" || no_daemon slurmctld
slurmd -f "$SLURM_CONF" || no_daemon slurmd
state=
for _ in $(seq 100); do
  state=$(sinfo -h -o %t 2>/dev/null || true)
  [ "$state" = idle ] && break
  sleep 0.1
done
if [ "$state" != idle ]; then
  msg="node state '$state' after 10 s: $(tail -2 "$D/slurmd.log" "$D/slurmctld.log")"
  if [ "$(id -u)" != 0 ]; then skip_unless_root "Slurm daemons need root here: $msg"; fi
  fail "$msg"
fi
echo "slurm: cluster up in $D (ports $ctld_port, $slurmd_port)"

# Jobs run as this user, from $D; Open MPI as root needs the two variables.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
export PTRAIN PTRAIN_MAX_RESTARTS=3
cd "$D"
submit() {  # submit VAR SBATCH-ARGS...: the job id goes to VAR
  local var=$1 id
  shift
  id=$(sbatch --parsable --time=5 "$@") || fail "sbatch $*"
  submitted+=("$id")
  printf -v "$var" %s "$id"
}
field() { scontrol show job -o "$1" | tr ' ' '\n' | sed -n "s/^$2=//p" | head -n 1; }
finished() {  # finished ID [TASKS]: the job (or all TASKS tasks of the array) in a final state
  local out
  out=$(scontrol show job -o "$1" 2>/dev/null) || return 1   # no answer is no news
  [ "$(grep -c 'JobState=' <<<"$out")" = "${2:-1}" ] || return 1
  ! grep -vqE "JobState=(COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL|DEADLINE|PREEMPTED) " <<<"$out"
}
wait_job() {  # wait_job ID [TASKS]
  for _ in $(seq 450); do finished "$1" "${2:-1}" && return 0; sleep 0.2; done
  fail "job $1 not finished after 90 s: $(scontrol show job -o "$1" | grep -o 'JobState=[A-Z_]*' | sort | uniq -c | tr '\n' ' ')"
}
completed() {  # completed ID OUTFILE: one job in state COMPLETED with exit code 0
  local st; st=$(field "$1" JobState)
  [ "$st" = COMPLETED ] && [ "$(field "$1" ExitCode)" = 0:0 ] ||
    fail "job $1: state $st, exit $(field "$1" ExitCode): $(tail -5 "$2" 2>/dev/null)"
}
rows() { if [ -f "$1" ]; then wc -l <"$1"; else echo 0; fi; }
last() { tail -n 1 "$1" | cut -d, -f"$2"; }

# A stand-in for a ptrain that checkpoints on SIGUSR1: it logs each rank's start (and the GPU
# environment), says when every rank runs, and exits $STUB_USR1_RC on SIGUSR1.
cat >"$D/stub-ptrain" <<'EOF'
#!/bin/bash
[ "$1" = --version ] && { echo "ptrain-stub 0"; exit 0; }
job=${SLURM_ARRAY_JOB_ID:-$SLURM_JOB_ID}${SLURM_ARRAY_TASK_ID:+_$SLURM_ARRAY_TASK_ID}
log=$STUB_DIR/$job.log
echo "start rank=$SLURM_PROCID ntasks=$SLURM_NTASKS restarts=${SLURM_RESTART_COUNT:-0} gpus=${CUDA_VISIBLE_DEVICES:-none} nccl=${NCCL_DEBUG:-} conn=${CUDA_DEVICE_MAX_CONNECTIONS:-} args=$*" >>"$log"
[ -n "${STUB_WAIT:-}" ] || exit 0
case " $* " in *"checkpoint%restart='latest'"*) exit 0 ;; esac
trap 'echo "usr1 rank=$SLURM_PROCID" >>"$log"; exit ${STUB_USR1_RC:-0}' USR1
touch "$STUB_DIR/$job.ready.$SLURM_PROCID"
for _ in $(seq 1200); do sleep 0.05; done
exit 3
EOF
chmod +x "$D/stub-ptrain"
mkdir -p "$D/stub" "$D/fakebin"
# An srun whose `--mpi=list` offers no PMIx, to take the scripts' mpirun fallback.
cat >"$D/fakebin/srun" <<EOF
#!/bin/bash
if [ "\$1" = --mpi=list ]; then echo "MPI plugin types are..."; echo "	none"; exit 0; fi
exec $(command -v srun) "\$@"
EOF
chmod +x "$D/fakebin/srun"

tiny=$src/input/tiny.nml
t0=$SECONDS
# 2. Jobs that run by themselves: training (srun, and mpirun), the GPU script, a sweep array.
stub=ALL,PTRAIN=$D/stub-ptrain,STUB_DIR=$D/stub
submit j_train --ntasks-per-node=2 "$jobs/train.sbatch" "$tiny" --set run%steps=20 \
  --set train%micro_batch=8 --set "run%out_dir='$D/train'"
submit j_mpirun --ntasks-per-node=2 --export="ALL,PATH=$D/fakebin:$PATH" "$jobs/train.sbatch" \
  "$tiny" --set run%steps=20 --set train%micro_batch=8 --set "run%out_dir='$D/train-mpirun'"
submit j_threads --ntasks-per-node=1 --cpus-per-task=2 "$jobs/train.sbatch" "$tiny" --set run%steps=2 \
  --set "run%out_dir='$D/train-threads'"
submit j_gpu --ntasks-per-node=2 --cpus-per-task=1 --export="$stub" "$jobs/train-gpu.sbatch" \
  "$tiny" --set run%steps=20
/usr/bin/python3 "$src/postprocess/sweep.py" generate "$tiny" "$D/sweep" train%lr=1e-3,3e-3 \
  model%dtype=fp32,fp64 --set run%steps=20 --set run%log_every=10 >/dev/null
n_decks=$(ls "$D/sweep/decks" | wc -l)
[ "$n_decks" = 4 ] || fail "sweep.py wrote $n_decks decks, expected 4"
submit j_sweep --array=0-3%2 --ntasks-per-node=1 "$jobs/sweep.sbatch" "$D/sweep"

wait_job "$j_train"
completed "$j_train" "ptrain-$j_train.out"
[ "$(rows "$D/train/log.csv")" = 21 ] || fail "train.sbatch: log.csv has $(rows "$D/train/log.csv") lines, expected 21"
grep -q "ptrain-job: srun --mpi=pmix" "ptrain-$j_train.out" || fail "train.sbatch did not use srun --mpi=pmix: $(grep ptrain-job "ptrain-$j_train.out")"
grep -q "^done: 20 steps" "ptrain-$j_train.out" || fail "train.sbatch output has no summary"
grep -q " on 2 rank(s)" "ptrain-$j_train.out" || fail "train.sbatch did not start 2 ranks: $(head -3 "ptrain-$j_train.out")"
echo "slurm: train.sbatch trained 20 steps on 2 ranks through srun --mpi=pmix (job $j_train)"

wait_job "$j_mpirun"
completed "$j_mpirun" "ptrain-$j_mpirun.out"
grep -q "ptrain-job: mpirun -np 2 --map-by slot:PE=1 --bind-to core" "ptrain-$j_mpirun.out" ||
  fail "no mpirun fallback without PMIx: $(grep ptrain-job "ptrain-$j_mpirun.out")"
[ "$(rows "$D/train-mpirun/log.csv")" = 21 ] || fail "mpirun fallback: log.csv has $(rows "$D/train-mpirun/log.csv") lines"
grep -q " on 2 rank(s)" "ptrain-$j_mpirun.out" || fail "mpirun fallback did not start 2 ranks"
echo "slurm: train.sbatch trained on 2 ranks through the mpirun fallback (job $j_mpirun)"

wait_job "$j_threads"
completed "$j_threads" "ptrain-$j_threads.out"
grep -q "ptrain-job: srun --mpi=pmix --cpus-per-task=2 --cpu-bind=cores" "ptrain-$j_threads.out" ||
  fail "one rank per node: not launched on its 2 cores: $(grep ptrain-job "ptrain-$j_threads.out")"
grep -q "^threads: 2 per rank;" "ptrain-$j_threads.out" ||
  fail "one rank per node: $(grep -m1 '^threads' "ptrain-$j_threads.out" || head -3 "ptrain-$j_threads.out")"
echo "slurm: train.sbatch ran one rank with 2 threads (job $j_threads)"

wait_job "$j_gpu"
completed "$j_gpu" "ptrain-gpu-$j_gpu.out"
glog=$D/stub/$j_gpu.log
[ "$(grep -c '^start ' "$glog")" = 2 ] || fail "train-gpu.sbatch: expected 2 tasks: $(cat "$glog")"
for r in 0 1; do
  line=$(grep "^start rank=$r " "$glog") || fail "train-gpu.sbatch: no rank $r"
  for want in "ntasks=2" "nccl=WARN" "conn=1" "backend%device='cuda'"; do
    [[ "$line" == *"$want"* ]] || fail "train-gpu.sbatch rank $r: no $want in: $line"
  done
  [[ "$line" != *"gpus=none"* ]] || fail "train-gpu.sbatch rank $r sees no GPU: $line"
done
grep -q -- "--gpus-per-task=1 --gpu-bind=closest" "ptrain-gpu-$j_gpu.out" || fail "train-gpu.sbatch launcher flags"
echo "slurm: train-gpu.sbatch started one task per GPU with backend%device='cuda' (job $j_gpu)"

wait_job "$j_sweep" 4
for a in 0 1 2 3; do
  out=sweep-${j_sweep}_$a.out
  [ -f "$out" ] || fail "sweep task $a: no $out"
  [ "$(rows "$D/sweep/runs/$a/log.csv")" = 21 ] || fail "sweep task $a: log.csv has $(rows "$D/sweep/runs/$a/log.csv") lines: $(tail -3 "$out")"
  grep -q "ptrain-job: sweep task $a of array job $j_sweep: $D/sweep/decks/$a.nml" "$out" || fail "sweep task $a ran another deck"
done
/usr/bin/python3 "$src/postprocess/sweep.py" collect "$D/sweep" >/dev/null
[ "$(grep -c ',done,20,' "$D/sweep/results.csv")" = 4 ] || fail "sweep.py collect: $(cat "$D/sweep/results.csv")"
echo "slurm: sweep.sbatch ran 4 decks as array $j_sweep (%2), sweep.py collected them"

# 3. The time-limit convention. With ptrain: SIGUSR1 to the batch shell mid-run (as Slurm's
#    --signal=B:USR1@120 sends it) -> checkpoint, exit 0, requeue, resume from 'latest'; the
#    resumed 2-rank run ends where an uninterrupted 1-rank run does (fp64, 1e-10). With the
#    stub: a sweep task is requeued alone; a non-zero exit after the signal is not requeued.
deck64=$src/regression/cases/tiny_fp64/deck.nml
long=(--set run%steps=400 --set run%eval_every=0 --set backend%peak_gflops=100)
"$PTRAIN" "$deck64" "${long[@]}" --set "run%out_dir='$D/straight'" >straight.log 2>&1 ||
  fail "uninterrupted run: $(tail -3 straight.log)"
submit j_requeue --ntasks-per-node=2 "$jobs/train.sbatch" "$deck64" "${long[@]}" \
  --set "run%out_dir='$D/resumed'"
submit j_array --array=1 --ntasks-per-node=1 --export="$stub,STUB_WAIT=1,STUB_USR1_RC=0" \
  "$jobs/sweep.sbatch" "$D/sweep"
j_array=${j_array}_1
submit j_dies --ntasks-per-node=1 --export="$stub,STUB_WAIT=1,STUB_USR1_RC=1" \
  "$jobs/train.sbatch" "$tiny"
for _ in $(seq 600); do [ "$(rows "$D/resumed/log.csv")" -gt 5 ] && break; sleep 0.05; done
[ "$(rows "$D/resumed/log.csv")" -gt 5 ] || fail "job $j_requeue did not start training: $(tail -3 "ptrain-$j_requeue.out")"
scancel --batch --signal=USR1 "$j_requeue" || fail "scancel --signal=USR1 $j_requeue"
for spec in "$j_array 0" "$j_dies 0"; do
  read -r id ranks <<<"$spec"
  for r in $ranks; do
    for _ in $(seq 300); do [ -f "$D/stub/$id.ready.$r" ] && break; sleep 0.1; done
    [ -f "$D/stub/$id.ready.$r" ] || fail "stub job $id rank $r did not start: $(tail -3 "ptrain-$id.out" 2>/dev/null)"
  done
  scancel --batch --signal=USR1 "$id" || fail "scancel --signal=USR1 $id"
done

wait_job "$j_requeue"
out=ptrain-$j_requeue.out
completed "$j_requeue" "$out"
[ "$(field "$j_requeue" Restarts)" = 1 ] || fail "job $j_requeue restarted $(field "$j_requeue" Restarts) times, expected 1: $(grep -E 'ptrain-job|stopped|restart' "$out")"
grep -q "^stopped by signal 10 after step" "$out" || fail "ptrain did not stop on SIGUSR1: $(grep ptrain-job "$out")"
grep -q "requeueing job $j_requeue" "$out" || fail "no requeue message: $(grep ptrain-job "$out")"
grep -q "ptrain-job: srun .* --set checkpoint%restart='latest'$" "$out" || fail "the requeued job did not resume from 'latest'"
grep -q "^restart: .*ckpt_" "$out" || fail "ptrain did not restore a checkpoint: $(grep -i restart "$out")"
[ "$(rows "$D/resumed/log.csv")" = 401 ] && [ "$(awk -F, 'NR > 1 && $1 != NR - 1' "$D/resumed/log.csv" | wc -l)" = 0 ] ||
  fail "resumed log.csv does not hold steps 1..400 once each: $(cut -d, -f1 "$D/resumed/log.csv" | tr '\n' ' ' | tail -c 300)"
for col in 2 3; do
  a=$(last "$D/resumed/log.csv" $col) b=$(last "$D/straight/log.csv" $col)
  awk -v a="$a" -v b="$b" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 1e-10 * b) }' ||
    fail "resumed run ends at $a (column $col), the uninterrupted one at $b"
done
echo "slurm: SIGUSR1 stopped job $j_requeue at step $(sed -n 's/^stopped by signal 10 after step \([0-9]*\).*/\1/p' "$out"); requeued, it resumed and ended as an uninterrupted run"

wait_job "$j_array"
completed "$j_array" "sweep-$j_array.out"
[ "$(field "$j_array" Restarts)" = 1 ] || fail "array task $j_array restarted $(field "$j_array" Restarts) times: $(cat "sweep-$j_array.out")"
grep -q "restarts=1 .*args=$D/sweep/decks/1.nml --set checkpoint%restart='latest'" "$D/stub/$j_array.log" ||
  fail "array task $j_array did not resume deck 1 from the latest checkpoint: $(cat "$D/stub/$j_array.log")"
echo "slurm: SIGUSR1 + exit 0 requeued sweep task $j_array alone, which resumed its deck"

wait_job "$j_dies"
[ "$(field "$j_dies" Restarts)" = 0 ] || fail "job $j_dies was requeued although ptrain exited 1"
grep -q "ptrain exited 1 after SIGUSR1 (no checkpoint on signal): not requeued" "ptrain-$j_dies.out" ||
  fail "job $j_dies: $(grep ptrain-job "ptrain-$j_dies.out")"
echo "slurm: SIGUSR1 + exit 1 did not requeue (job $j_dies)"
echo "slurm: all checks passed in $((SECONDS - t0)) s of jobs"
