#!/bin/bash
# Integration check of examples/slurm/train.sbatch on a one-node Slurm cluster on localhost (not run by CI
# or pytest; as root, on a scratch machine). It submits the sbatch as 1 node x 2 processes, preempts it
# mid-run with `scontrol requeue`, waits for the requeued job to finish, and checks its losses equal those
# of an uninterrupted `paralm train --nproc 2` of the same config, step for step, within 1e-5.
#
# It installs nothing. Before:   apt-get install -y slurm-wlm munge      (Debian 12: Slurm 22.05)
# Run from the repository root:  bash examples/slurm/integration.sh
#
# What it sets up: a private slurm.conf (SLURM_CONF, nothing written to /etc/slurm) for one node, this
# host, 2 CPUs, select/cons_tres; no cgroups, no systemd (containers): proctrack/linuxproc, task/none,
# jobacct_gather/none, daemons started directly in the foreground mode (-D) in the background. munged is
# started if no munge daemon answers (a key is generated if /etc/munge/munge.key is missing). Everything it
# started is stopped on exit.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${WORK:-/tmp/paralm-slurm-it}             # scratch: slurm state and logs, both runs
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
STEPS=${STEPS:-200}                            # long enough to preempt it mid-run (about 12 steps/s on 2 CPUs)
PREEMPT_AT=${PREEMPT_AT:-60}                   # requeue once metrics.jsonl reaches this step
ARGS="--model.n_layer=2 --model.d_model=64 --train.steps=$STEPS --checkpoint.every=20"
CONFIG=configs/tiny.toml
TOL=1e-5

say() { echo "integration: $*"; }
for cmd in slurmctld slurmd sbatch scontrol munged munge; do
  command -v "$cmd" >/dev/null || { say "$cmd not found: apt-get install -y slurm-wlm munge"; exit 2; }
done
[ "$(id -u)" = 0 ] || { say "run as root (it starts slurmd and munged)"; exit 2; }

rm -rf "$WORK"; mkdir -p "$WORK"/{etc,state,spool,log}
NODE=$(hostname -s)
PORT=$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')

# --- slurm.conf: one node, this host -------------------------------------------------------------
cat > "$WORK/etc/slurm.conf" <<CONF
ClusterName=paralm-it
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmctldPort=16817
SlurmdPort=16818
AuthType=auth/munge
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd.pid
SlurmctldLogFile=$WORK/log/slurmctld.log
SlurmdLogFile=$WORK/log/slurmd.log
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=120
MinJobAge=3600
SlurmdTimeout=300
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF=$WORK/etc/slurm.conf
say "slurm.conf at $SLURM_CONF (node $NODE, 2 CPUs)"

# --- daemons ---------------------------------------------------------------------------------------
pids=()
cleanup() {
  local i
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do  # slurmd, slurmctld, then munged (if it started one)
    kill -TERM "${pids[i]}" 2>/dev/null || continue
    for _ in $(seq 100); do kill -0 "${pids[i]}" 2>/dev/null || break; sleep 0.1; done
  done
  say "stopped the daemons it started (${pids[*]:-none})"
}
trap cleanup EXIT

if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  if [ ! -s /etc/munge/munge.key ]; then mungekey --create --keyfile /etc/munge/munge.key; chown munge: /etc/munge/munge.key; fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge; chown munge: /run/munge /var/log/munge /var/lib/munge
  runuser -u munge -- /usr/sbin/munged --force         # daemonizes; --force: tolerate container file modes
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.2; done
  pids+=("$(cat /run/munge/munged.pid)")
fi
munge -n | unmunge >/dev/null && say "munge works"

slurmctld -D -f "$SLURM_CONF" >>"$WORK/log/slurmctld.stdout" 2>&1 & pids+=($!)
sleep 2
slurmd -D -f "$SLURM_CONF" -N "$NODE" >>"$WORK/log/slurmd.stdout" 2>&1 & pids+=($!)
for _ in $(seq 60); do
  state=$(sinfo -h -n "$NODE" -o %T 2>/dev/null || true)
  [ "$state" = idle ] && break; sleep 1
done
say "node $NODE is ${state:-unknown}"; [ "$state" = idle ] || { tail -20 "$WORK"/log/*.log; exit 1; }

# --- the reference: uninterrupted, straight through -----------------------------------------------
cd "$REPO"
say "reference: paralm train --nproc 2 --config $CONFIG $ARGS"
"$PYTHON" -m paralm train --nproc 2 --config "$CONFIG" $ARGS --run.dir="$WORK/ref" >"$WORK/ref.log" 2>&1
tail -n 2 "$WORK/ref.log"

# --- the same run as a Slurm job: 1 node x 2 processes, preempted once ----------------------------
# the sbatch's variables come from the environment (--export=ALL); the options override its #SBATCH lines
job=$(RUN_DIR="$WORK/slurm-run" CONFIG="$CONFIG" NPROC_PER_NODE=2 MAX_RESTARTS=1 RDZV_PORT="$PORT" \
  PYTHON="$PYTHON" PARALM_ARGS="$ARGS" \
  sbatch --parsable --export=ALL --nodes=1 --ntasks-per-node=1 --cpus-per-task=2 --gpus-per-node=0 \
  --time=30:00 --job-name=paralm-it --output="$WORK/job-%j.out" examples/slurm/train.sbatch)
say "submitted job $job"
job_state() { scontrol show job -o "$job" | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p'; }
last_step() {  # the last step in the job's metrics.jsonl, -1 before the first
  "$PYTHON" -c 'import json, sys
try: print(json.loads(open(sys.argv[1]).read().splitlines()[-1])["step"])
except Exception: print(-1)' "$WORK/slurm-run/metrics.jsonl"
}

for _ in $(seq 600); do [ "$(last_step)" -ge "$PREEMPT_AT" ] && break; sleep 0.2; done
step=$(last_step)
[ "$step" -ge "$PREEMPT_AT" ] && [ "$step" -lt $((STEPS - 1)) ] || { say "job not mid-run (step $step, state $(job_state))"; cat "$WORK"/job-*.out; exit 1; }
say "job $job is $(job_state) at step $step: scontrol requeue $job"
scontrol requeue "$job"

for _ in $(seq 600); do
  s=$(job_state); restarts=$(scontrol show job -o "$job" | sed -n 's/.* Restarts=\([0-9]*\).*/\1/p')
  [ "$s" = COMPLETED ] && [ "${restarts:-0}" -ge 1 ] && break
  case "$s" in FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY) say "job $job ended $s"; cat "$WORK/job-$job.out"; exit 1;; esac
  sleep 1
done
say "job $job: $(scontrol show job -o "$job" | grep -o 'JobState=[A-Z]* Reason=[^ ]* .*Restarts=[0-9]*' | sed 's/ Dependency.*Restarts/ Restarts/')"
say "job log ($WORK/job-$job.out), paralm's and sbatch's lines:"
grep -E '^paralm|paralm\.sbatch|saved .*step_|stopped|resuming' "$WORK/job-$job.out" | sed 's/^/  | /'
grep -q 'resuming at step' "$WORK/job-$job.out" || { say "FAIL: the requeued job did not resume"; exit 1; }

# --- compare, every step ---------------------------------------------------------------------------
"$PYTHON" - "$WORK/ref/metrics.jsonl" "$WORK/slurm-run/metrics.jsonl" "$STEPS" "$TOL" <<'PY'
import json, sys
ref_path, run_path, steps, tol = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
def losses(path):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    steps_seen = [r["step"] for r in rows]
    assert len(steps_seen) == len(set(steps_seen)), f"{path}: a step logged twice"
    return {r["step"]: r["loss"] for r in rows}
ref, run = losses(ref_path), losses(run_path)
assert sorted(ref) == sorted(run) == list(range(steps)), f"steps differ: {len(ref)} vs {len(run)} rows"
worst = max(abs(ref[s] - run[s]) for s in ref)
bad = [s for s in ref if abs(ref[s] - run[s]) > tol]
print(f"integration: {steps} steps compared, max |loss difference| {worst:.3g} (tolerance {tol:g}); "
      f"final loss {ref[steps - 1]:.6f} vs {run[steps - 1]:.6f}")
if bad:
    sys.exit(f"integration: FAIL at steps {bad[:10]}")
print("integration: PASS: the preempted and requeued Slurm job equals the uninterrupted run")
PY
