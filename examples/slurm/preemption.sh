# Sourced by the batch scripts in this folder (from the submit directory, the repository root):
# SLURM's pre-termination signal always ends in a checkpoint, the job exits 0, and it requeues
# itself when that checkpoint came before --train-iters. README: "Preemption and requeue on SLURM".
#
#   #SBATCH --signal=B:USR1@300   USR1 to this batch shell (only), 300 s before the time limit
#   #SBATCH --requeue             the job may be requeued (scontrol requeue)
#
# run_preemptible CKPT TRAIN_ITERS srun ... "${IGNORE_USR1[@]}" torchrun|python ...
#   runs the srun step in the background. When USR1 arrives the trap forwards it to srun, which
#   passes it on to the step: SLURM signals every process of a step (proctrack/cgroup or
#   linuxproc), so the training workers get it directly, not through torchrun. Started through
#   IGNORE_USR1, torchrun (and a worker that has not installed its handler yet) ignores USR1:
#   nothing dies of it. Each worker's handler (training/reliability.py Preemption) makes every
#   rank stop at the same iteration boundary, save and exit 0, however long an iteration takes
#   (no launcher grace period is involved: torchrun is never asked to stop its workers). When the
#   step has ended with 0 and `latest` in CKPT is below TRAIN_ITERS, `scontrol requeue` puts the
#   job back in the queue; the next start loads `latest` from CKPT (--load) and logs so.
#   Returns the step's exit status.

# a command prefix: run the rest with SIGUSR1 ignored (inherited across exec)
IGNORE_USR1=(bash -c 'trap "" USR1; exec "$@"' ignore-usr1)

# the last value of flag $1 in the rest of the arguments (--flag V or --flag=V), else empty
last_flag_value() {
    local flag=$1 value="" prev=""
    shift
    for arg in "$@"; do
        if [ "$prev" = "$flag" ]; then value=$arg; fi
        case $arg in "$flag"=*) value=${arg#*=} ;; esac
        prev=$arg
    done
    echo "$value"
}

# (USR1 may come before the step's pid is known: then run_preemptible forwards it once it is)
_forward_usr1() {
    PREEMPTED=1
    echo "batch script: SIGUSR1 (time limit near): forwarding it to the training step" >&2
    if [ -n "${STEP_PID:-}" ]; then
        FORWARDED=1
        kill -USR1 "$STEP_PID" 2>/dev/null || true
    fi
}

run_preemptible() {
    local ckpt=$1 train_iters=$2 rc latest
    shift 2
    PREEMPTED=0 FORWARDED=0 STEP_PID=""
    trap _forward_usr1 USR1
    "$@" &
    STEP_PID=$!
    if [ "$PREEMPTED" = 1 ] && [ "$FORWARDED" = 0 ]; then  # it came before the pid was known
        FORWARDED=1
        kill -USR1 "$STEP_PID" 2>/dev/null || true
    fi
    while kill -0 "$STEP_PID" 2>/dev/null; do  # the trap cuts a wait short: wait again
        wait "$STEP_PID" || true
    done
    rc=0
    wait "$STEP_PID" || rc=$?  # the step's own status (bash keeps it)
    trap - USR1
    if [ "$PREEMPTED" = 1 ] && [ "$rc" = 0 ]; then
        latest=$(cat "$ckpt/latest_checkpointed_iteration.txt" 2>/dev/null || echo 0)
        if [ "$latest" -lt "$train_iters" ]; then
            echo "batch script: preempted with a checkpoint at iteration $latest of" \
                 "$train_iters in $ckpt: requeueing job $SLURM_JOB_ID" >&2
            scontrol requeue "$SLURM_JOB_ID"
        fi
    fi
    return "$rc"
}
