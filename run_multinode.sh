#!/usr/bin/env bash
# Launch one minigrpo stage (sft.py, grpo.py or eval.py) on several nodes: one torchrun per node, all meeting at a
# c10d rendezvous hosted on the first node. Everything after the script name is passed to the script unchanged.
#
#   SLURM: edit the #SBATCH lines below, then submit from the repo root with your Python environment active:
#     sbatch run_multinode.sh grpo.py --init runs/sft/model --prompts_per_step 64 --out_dir runs/grpo
#   Plain hosts: run the same line on every host; NODE_RANK=0 on MASTER_ADDR's host (it hosts the rendezvous):
#     host0$ NNODES=2 NODE_RANK=0 MASTER_ADDR=host0 ./run_multinode.sh grpo.py --init runs/sft/model
#     host1$ NNODES=2 NODE_RANK=1 MASTER_ADDR=host0 ./run_multinode.sh grpo.py --init runs/sft/model
#
# Knobs (environment variables; default in brackets):
#   NNODES          [SLURM: nodes of the allocation; else 1]  nodes taking part
#   NODE_RANK       [SLURM: not needed; else 0 if NNODES=1]    0 on MASTER_ADDR's host, 1..NNODES-1 on the others
#   MASTER_ADDR     [SLURM: first node of the allocation; else 127.0.0.1 if NNODES=1]  the rendezvous host
#   MASTER_PORT     [29500; SLURM: 20000 + job id % 20000]    its TCP port; must be reachable from every node
#   NPROC_PER_NODE  [gpu: one worker per visible GPU]        workers per node (give a number on CPU-only hosts)
#   RDZV_ID         [SLURM job id; else minigrpo]            rendezvous id, the same on every node of one run
#   RDZV_TIMEOUT    [900]  seconds the nodes wait for each other at the start before failing
#   DIST_TIMEOUT    [600]  seconds before a collective that some rank never joins fails (the scripts' --dist_timeout;
#                          a --dist_timeout among your flags wins). Raise it if one step's generation takes longer.
#   MAX_RESTARTS    [3]    times torchrun restarts all workers (on every node) after one fails. sft.py and grpo.py
#                          resume from the newest checkpoint in --out_dir by themselves (--resume auto), so a
#                          restarted run continues, bitwise as if never interrupted; it loses the steps since the
#                          last checkpoint (--save_every). A config error is retried too (it fails K+1 times, fast).
#   LOG_DIR         [unset] also keep each rank's stdout/stderr in files under this directory (torchrun --log-dir)
#
# Console lines are prefixed with the node and the global rank: "[node1 rank9]: ..." (under SLURM: "1: [rank9]: ...",
# the node index from srun --label). Only global rank 0 prints progress; any rank prints its own errors.
#
# Assumptions: every node sees the repo, the model, the data and --out_dir at the same paths (a shared filesystem).
# Global rank 0 writes metrics, config.json, samples and a checkpoint's HF model files; every rank writes its own
# shard of a checkpoint's training state into --out_dir, reads --init / --model and, on resume, its shard of the
# checkpoint (checkpoint.py). Global ranks are assigned by
# the rendezvous (nodes sorted by host name), so global rank 0 need not be on NODE_RANK 0. For gsm8k/math, pass
# --data_path to a local file: hub downloads from every rank at once are slow and race in a shared cache.
#
# When a rank crashes or stops answering, the other ranks fail within DIST_TIMEOUT; torchrun then restarts the workers
# of every node from the last checkpoint, up to MAX_RESTARTS times, and after that the nodes exit. Under SLURM,
# srun --kill-on-bad-exit then ends the remaining nodes; on plain hosts, a node whose own rank is stuck outside any
# collective (so nothing times out there) stays up until you stop it (Ctrl-C). A node that is gone for good (the
# host died) is not replaced: the others wait RDZV_TIMEOUT for it at the restart, then fail; resubmit the job and
# it continues from the last checkpoint.
#
# Batch size does not change with the node count: --prompts_per_step (grpo.py), --global_batch (sft.py) are global
# and split over NNODES x NPROC_PER_NODE ranks (they must divide evenly). 2 nodes x 8 GPUs with --prompts_per_step 64
# give each rank 4 prompts x --group_size completions per step.
#
# Debugging (documented here, not set; export them before launching):
#   NCCL_DEBUG=INFO [NCCL_DEBUG_SUBSYS=INIT,NET]  NCCL's setup log: network interfaces, transport (IB or socket)
#   NCCL_SOCKET_IFNAME=eth0 (or ^lo,docker)        the interface NCCL uses between nodes; a wrong guess hangs at start
#   GLOO_SOCKET_IFNAME=eth0                        the same for gloo (CPU runs)
#   NCCL_IB_DISABLE=1                              rule InfiniBand out
#   TORCH_DISTRIBUTED_DEBUG=DETAIL                 checks every collective matches across ranks and names a rank that
#                                                  does not answer (slow: debugging only)
#   TORCH_NCCL_ASYNC_ERROR_HANDLING=1              torchrun's default: a timed-out NCCL collective ends the process
#   LOGLEVEL=INFO                                  torchrun's own rendezvous and restart log
#
# SLURM header: sbatch reads these lines (edit them or override on the command line: sbatch --nodes=4 ...).
#SBATCH --job-name=minigrpo
#SBATCH --nodes=2                 # nodes
#SBATCH --ntasks-per-node=1       # one torchrun per node: keep 1 (torchrun starts the per-GPU workers)
#SBATCH --gpus-per-node=8         # GPUs per node = workers per node
#SBATCH --cpus-per-task=32        # CPU cores per node (tokenization, rewards, data)
#SBATCH --time=04:00:00           # wall-clock limit
#SBATCH --output=%x-%j.out        # the job's log, in the submit directory
# Add what your cluster needs, e.g. --partition=..., --account=..., --exclusive, --mem=0.

set -euo pipefail

if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then
  sed -n '2,9p' "$0" >&2  # the usage lines of the header
  exit 2
fi
SCRIPT=$1
shift
if [[ ! -f $SCRIPT ]]; then
  echo "run_multinode.sh: no script $SCRIPT in $PWD (run it from the repo root: sft.py, grpo.py or eval.py)" >&2
  exit 2
fi

if ! command -v torchrun >/dev/null; then
  echo "run_multinode.sh: torchrun not found on PATH: activate the Python environment that has torch" >&2
  exit 2
fi

# Every number from the environment is checked as a plain decimal before any arithmetic reads it: bash arithmetic
# evaluates what it is given, so NNODES='a[$(cmd)]' in $((...)) or [[ -gt ]] would run cmd.
need_int() {  # NAME VALUE MIN [MAX]
  local ok=0
  if [[ $2 =~ ^(0|[1-9][0-9]{0,8})$ ]]; then  # only now may arithmetic see it
    ok=1
    (( $2 >= $3 )) || ok=0
    [[ -z ${4:-} ]] || (( $2 <= $4 )) || ok=0
  fi
  if (( ! ok )); then
    local range=">= $3"
    [[ -z ${4:-} ]] || range="from $3 to $4"
    echo "run_multinode.sh: error: $1='$2' must be an integer $range" >&2
    exit 2
  fi
}

export PYTHONUNBUFFERED=1  # workers' output reaches the console line by line, not when a buffer fills
MAX_RESTARTS=${MAX_RESTARTS:-3}
# A fresh rendezvous store for every restart: with torchrun's default (one store shared by all restarts) a restarted
# group can read the dead group's addresses and hang in init_process_group (pytorch/pytorch#135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
RDZV_TIMEOUT=${RDZV_TIMEOUT:-900}
DIST_TIMEOUT=${DIST_TIMEOUT:-600}
NPROC_PER_NODE=${NPROC_PER_NODE:-gpu}
need_int MAX_RESTARTS "$MAX_RESTARTS" 0
need_int RDZV_TIMEOUT "$RDZV_TIMEOUT" 1
if [[ ! $DIST_TIMEOUT =~ ^[0-9]+(\.[0-9]+)?$ ]]; then
  echo "run_multinode.sh: error: DIST_TIMEOUT='$DIST_TIMEOUT' must be a number of seconds" >&2
  exit 2
fi
if [[ ! $NPROC_PER_NODE =~ ^(gpu|cpu|auto)$ ]]; then
  need_int NPROC_PER_NODE "$NPROC_PER_NODE" 1
fi
[[ -z ${MASTER_PORT:-} ]] || need_int MASTER_PORT "$MASTER_PORT" 1 65535

if [[ -n ${SLURM_JOB_ID:-} ]]; then
  # Under sbatch/salloc this runs once, on the first node; srun below starts one torchrun on every node. torchrun
  # finds out by itself whether its node is MASTER_ADDR (it compares host names), so all nodes get the same command.
  need_int SLURM_JOB_ID "$SLURM_JOB_ID" 0
  NNODES=${NNODES:-${SLURM_JOB_NUM_NODES:-}}
  need_int NNODES "$NNODES" 1
  mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")  # (not `| head -1`: SIGPIPE + pipefail)
  if [[ ${#HOSTS[@]} -eq 0 ]]; then
    echo "run_multinode.sh: scontrol show hostnames '$SLURM_JOB_NODELIST' listed no hosts" >&2
    exit 2
  fi
  MASTER_ADDR=${MASTER_ADDR:-${HOSTS[0]}}
  MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}  # two jobs sharing a node don't collide
  RDZV_ID=${RDZV_ID:-$SLURM_JOB_ID}
  RDZV_CONF="join_timeout=$RDZV_TIMEOUT"
  export TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="[rank\${rank}]:"  # torchrun fills in the global rank
  # --kill-on-bad-exit: when one node's torchrun fails, stop the others instead of letting them wait.
  # srun no longer inherits --cpus-per-task from sbatch (Slurm >= 22.05), so it is passed on.
  LAUNCH=(srun --nodes="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 --label
          ${SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"})
  WHERE="SLURM job $SLURM_JOB_ID, $NNODES node(s)"
else
  NNODES=${NNODES:-1}
  need_int NNODES "$NNODES" 1
  [[ -z ${NODE_RANK:-} ]] || need_int NODE_RANK "$NODE_RANK" 0 "$((NNODES - 1))"
  if [[ $NNODES -gt 1 && ( -z ${NODE_RANK:-} || -z ${MASTER_ADDR:-} ) ]]; then
    echo "run_multinode.sh: NNODES=$NNODES needs NODE_RANK (0 on MASTER_ADDR's host, 1..$((NNODES - 1)) on the" \
         "others) and MASTER_ADDR (the host of NODE_RANK 0), e.g." >&2
    echo "  NNODES=$NNODES NODE_RANK=0 MASTER_ADDR=host0 ./run_multinode.sh $SCRIPT ..." >&2
    exit 2
  fi
  NODE_RANK=${NODE_RANK:-0}
  MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
  MASTER_PORT=${MASTER_PORT:-29500}
  RDZV_ID=${RDZV_ID:-minigrpo}
  # NODE_RANK 0 hosts the rendezvous store; saying so (rather than letting torchrun match host names) also works when
  # MASTER_ADDR is an alias or an address the host does not know as its own.
  RDZV_CONF="join_timeout=$RDZV_TIMEOUT,is_host=$([[ $NODE_RANK == 0 ]] && echo 1 || echo 0)"
  export TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="[node$NODE_RANK rank\${rank}]:"
  LAUNCH=()
  WHERE="node $NODE_RANK of $NNODES ($(hostname))"
fi

CMD=(torchrun
  --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE"
  --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$RDZV_ID" --rdzv-conf="$RDZV_CONF"
  --max-restarts="$MAX_RESTARTS"
  --tee=3  # copy every worker's stdout+stderr to the console with the prefix above (torchrun adds it only when teeing)
  ${LOG_DIR:+--log-dir="$LOG_DIR"}
  "$SCRIPT" --dist_timeout="$DIST_TIMEOUT" "$@")

echo "run_multinode.sh: $WHERE; rendezvous $RDZV_ID at $MASTER_ADDR:$MASTER_PORT (join timeout ${RDZV_TIMEOUT}s)," \
     "collective timeout ${DIST_TIMEOUT}s" >&2
echo "run_multinode.sh: $(printf '%q ' "${LAUNCH[@]}" "${CMD[@]}")" >&2  # the exact command, quoted to copy

rc=0
"${LAUNCH[@]}" "${CMD[@]}" || rc=$?
if [[ $rc -ne 0 ]]; then
  cat >&2 <<EOF
run_multinode.sh: $WHERE failed (exit code $rc). What the log above usually means:
  RendezvousTimeoutError: not all $NNODES nodes reached $MASTER_ADDR:$MASTER_PORT within ${RDZV_TIMEOUT}s. Did every
    node start (same RDZV_ID=$RDZV_ID, NNODES)? Can each node reach that address and port (firewall, wrong interface)?
  RendezvousConnectionError / "connection to the C10d store": the rendezvous host (NODE_RANK 0) went away,
    usually because a rank there failed first: look for the first traceback.
  "Timed out waiting ...ms" (gloo) or "Watchdog caught collective operation timeout" (NCCL): a rank did not join a
    collective within ${DIST_TIMEOUT}s. The traceback names the collective this rank was in; the rank that stopped
    (crashed, hung, out of memory) is the one whose log does not end in this timeout.
EOF
fi
exit "$rc"
