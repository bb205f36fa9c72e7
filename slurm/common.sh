# ---------------------------------------------------------------------------------------------
# Common part of megapo's sbatch templates (slurm/common.sh, pasted in by `megapo launch slurm`).
# Needs: OUTPUT_DIR, CHECKPOINT_SUBDIR, EXIT_CHECKPOINTED, GPUS_PER_NODE. Defines: RUN_LOG,
# NODE_NAMES, HEAD_ADDR, MASTER_PORT, RESUME, SRUN_COMMON, node_addr, step_id, wait_step, finish.
# See slurm/README.md for the signal contract.
# ---------------------------------------------------------------------------------------------
RESTART=${SLURM_RESTART_COUNT:-0}          # unset on the first run, 1, 2, ... after each requeue
RUN_LOG="$OUTPUT_DIR/logs/slurm-$SLURM_JOB_ID/run$RESTART"
mkdir -p "$RUN_LOG"
log() { echo "[megapo $(date -u +%H:%M:%S)] $*"; }

mapfile -t NODE_NAMES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
node_addr() {  # the address Slurm itself reaches a node at (its NodeAddr), else its name
    local addr
    addr=$(scontrol show node "$1" 2>/dev/null | tr ' ' '\n' | sed -n 's/^NodeAddr=//p' | head -n 1)
    echo "${addr:-$1}"
}
HEAD_ADDR=$(node_addr "${NODE_NAMES[0]}")
MASTER_PORT=$((20000 + SLURM_JOB_ID % 10000))   # per job (two jobs on one head node do not clash), below the ephemeral ports

# Resume after a requeue, or when the output dir already holds a checkpoint (a resubmission).
RESUME=()
if [ "$RESTART" -gt 0 ] || [ -n "$(ls -A "$OUTPUT_DIR/$CHECKPOINT_SUBDIR" 2>/dev/null)" ]; then
    RESUME=(--resume)
fi
log "job $SLURM_JOB_ID restart $RESTART on ${NODE_NAMES[*]} (head $HEAD_ADDR:$MASTER_PORT) ${RESUME[*]}"
log "per-node logs in $RUN_LOG"

# One node launcher per node (an srun task). It substitutes the node's rank and writes how its node
# ended to STATUS_PREFIX.node<i>: "signalled RC" (it got SIGTERM: a stop with checkpoint) or
# "exit RC" (the launcher ended by itself) -- torchrun reports a stop by signal as its own failure,
# which hides the trainer's exit code. It does not forward the signal: Slurm signals every process
# of a step itself, and a second SIGTERM would make torchrun give up waiting for the checkpoint.
# A signalled node exits 0, so --kill-on-bad-exit does not kill the nodes that are still saving.
cat > "$RUN_LOG/node.sh" <<'NODE_SH'
#!/bin/bash
# usage: node.sh STATUS_PREFIX COMMAND... ; "@NODE_RANK@" in COMMAND becomes this node's rank
status="$1.node$SLURM_NODEID"; shift
args=()
for a in "$@"; do args+=("${a//@NODE_RANK@/$SLURM_NODEID}"); done
say() { echo "[node $SLURM_NODEID $SLURMD_NODENAME] $(date -u +%H:%M:%S) $*"; }
say "start: ${args[*]}"
signalled=""
trap 'signalled=TERM; say "got SIGTERM"' TERM
"${args[@]}" &
child=$!
while :; do wait "$child"; kill -0 "$child" 2>/dev/null || break; done
wait "$child"; rc=$?
if [ -n "$signalled" ]; then
    say "exit $rc after SIGTERM"
    echo "signalled $rc" > "$status"
    exit 0
fi
say "exit $rc"
echo "exit $rc" > "$status"
exit "$rc"
NODE_SH

# srun options every step gets: one launcher per node owning the whole node.
SRUN_COMMON=(--ntasks-per-node=1 --cpus-per-task="${SLURM_CPUS_ON_NODE:-1}" --kill-on-bad-exit=1)
[ "$GPUS_PER_NODE" -gt 0 ] && SRUN_COMMON+=(--gpus-per-node="$GPUS_PER_NODE")

# Who asks for a stop, and what follows (see slurm/README.md):
#   USR1 to the batch shell (the time-limit warning --signal=B:USR1, or `scancel --batch
#     --signal=USR1`): SIGTERM to the learner step once, then requeue ourselves.
#   SIGTERM to the steps only (`scancel --signal=TERM JOB`): the learner checkpoints; requeue.
#   SIGTERM to the batch shell too (scancel, scontrol requeue, preemption, time limit): Slurm
#     signals the steps itself and decides whether the job comes back; we only wait. (A second
#     SIGTERM would make torchrun stop waiting for the checkpoint, so we never add one.)
STOP_REASON=""
LEARNER_PID=""
on_signal() {
    if [ -n "$STOP_REASON" ]; then log "got SIG$1 again (after SIG$STOP_REASON): ignored"; return 0; fi
    STOP_REASON=$1
    if [ "$1" = TERM ]; then
        log "batch shell got SIGTERM: Slurm is stopping the job; waiting for the learner's checkpoint"
        return 0
    fi
    log "batch shell got SIG$1: asking the learner to checkpoint, then requeueing"
    [ -n "$LEARNER_PID" ] || return 0   # not started yet: the caller sees STOP_REASON
    # SIGTERM to the learner step's processes. (Signalling srun itself would make it tear the
    # step down at once, with no time to checkpoint.)
    local step
    step=$(step_id megapo-learner)
    scancel --signal=TERM "${step:-$SLURM_JOB_ID}"
}
step_id() {  # JOB.STEP of this job's step named $1 (srun --job-name), empty if none
    squeue -h -s -j "$SLURM_JOB_ID" -o '%i %j' | awk -v name="$1" '$2 == name {print $1; exit}'
}
trap 'on_signal USR1' USR1
trap 'on_signal TERM' TERM

wait_step() {  # wait for a background srun, also across trapped signals; returns its status
    local pid=$1
    while :; do wait "$pid"; kill -0 "$pid" 2>/dev/null || break; done
    wait "$pid"
}

# $1: the learner step's status. A node that failed by itself makes the job fail, even when the
# other nodes were then stopped by a signal (--kill-on-bad-exit): a crash is never requeued.
finish() {
    local rc=$1 file how code failed="" signalled=""
    for file in "$RUN_LOG"/status.learner.node*; do
        [ -e "$file" ] || continue
        read -r how code < "$file"
        log "learner $(basename "$file" | sed 's/.*\.//'): $how $code"
        if [ "$how" = signalled ]; then signalled=yes; elif [ "$code" != 0 ]; then failed=$code; fi
    done
    if [ "$STOP_REASON" = TERM ]; then
        log "stopped by Slurm (cancel, requeue or preemption); Slurm decides whether the job returns"
        [ "$rc" -eq 0 ] && rc=$EXIT_CHECKPOINTED
    elif [ -n "$failed" ]; then
        log "a learner node failed (exit $failed): not requeueing"
        [ "$rc" -eq 0 ] && rc=$failed
    elif [ -n "$STOP_REASON" ] || [ -n "$signalled" ]; then
        log "learner checkpointed on request (${STOP_REASON:+SIG}${STOP_REASON:-SIGTERM to the steps}): requeueing"
        scontrol requeue "$SLURM_JOB_ID" && exit 0
        log "requeue refused"
        [ "$rc" -eq 0 ] && rc=$EXIT_CHECKPOINTED
    fi
    log "learner exit $rc"
    exit "$rc"
}
# ------------------------------------------------------------------------- end of common part
