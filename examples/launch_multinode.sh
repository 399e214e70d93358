#!/usr/bin/env bash
# Launch a Cooper run with torchrun's c10d rendezvous: run this same command on every node (SLURM:
# examples/slurm/cooper.sbatch does it for you). Step by step: docs/deploy.md.
#
#   MASTER_ADDR=node0 NNODES=2 examples/launch_multinode.sh examples/qwen2.5-7b_multinode.yaml [key=value ...]
#
# Environment (defaults in brackets):
#   MASTER_ADDR [127.0.0.1]  host of the rendezvous (any one node; the same on every node)
#   MASTER_PORT [29500]      its port;  NNODES [1];  GPUS_PER_NODE [8];  RDZV_ID [cooper]: one per run
#   PYTHON [python]          the interpreter that has cooper_mcore installed
#   ASSISTANT_URL            an assistant LLM already served elsewhere (OpenAI-compatible): nothing is
#                            started, the run uses it (rm.assistant_url)
#   ASSISTANT_MODEL_PATH     otherwise (colocated): the HF folder this script serves on this node with
#                            SGLang at 127.0.0.1:ASSISTANT_PORT before training, e.g.
#                            /models/Qwen2.5-1.5B-Instruct; unset and no ASSISTANT_URL: the preset's
#                            rm.assistant_url is used as it is
#   ASSISTANT_PORT [30010]  ASSISTANT_TP [1]  ASSISTANT_MEM_FRACTION [0.08]: the colocated server
#                            uses ASSISTANT_TP GPUs per replica and GPUS_PER_NODE/ASSISTANT_TP replicas
#                            (one per GPU group, behind SGLang's data-parallel router), keeping that
#                            share of every GPU's memory for the whole run
#   ASSISTANT_READY_TIMEOUT [900] seconds to wait for it
#   DRY_RUN=1                print the commands instead of running them
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: $0 CONFIG.yaml [key=value ...]" >&2
    exit 2
fi
config=$1
shift

PYTHON=${PYTHON:-python}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
NNODES=${NNODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
RDZV_ID=${RDZV_ID:-cooper}
ASSISTANT_PORT=${ASSISTANT_PORT:-30010}
ASSISTANT_TP=${ASSISTANT_TP:-1}
ASSISTANT_MEM_FRACTION=${ASSISTANT_MEM_FRACTION:-0.08}
ASSISTANT_READY_TIMEOUT=${ASSISTANT_READY_TIMEOUT:-900}
DRY_RUN=${DRY_RUN:-0}

run() {
    if [[ $DRY_RUN == 1 ]]; then
        echo "+ $*"
    else
        "$@"
    fi
}

overrides=()
server_pid=""
stop_server() {
    if [[ -n $server_pid ]]; then
        kill "$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
    fi
}
trap stop_server EXIT

if [[ -n ${ASSISTANT_URL:-} ]]; then
    overrides+=("rm.assistant_url=$ASSISTANT_URL")
elif [[ -n ${ASSISTANT_MODEL_PATH:-} ]]; then
    if (( GPUS_PER_NODE % ASSISTANT_TP != 0 )); then
        echo "ASSISTANT_TP=$ASSISTANT_TP does not divide GPUS_PER_NODE=$GPUS_PER_NODE" >&2
        exit 2
    fi
    assistant_name=$(basename "$ASSISTANT_MODEL_PATH")
    server=("$PYTHON" -m sglang.launch_server --model-path "$ASSISTANT_MODEL_PATH"
            --served-model-name "$assistant_name" --tp-size "$ASSISTANT_TP"
            --dp-size "$((GPUS_PER_NODE / ASSISTANT_TP))" --mem-fraction-static "$ASSISTANT_MEM_FRACTION"
            --host 127.0.0.1 --port "$ASSISTANT_PORT")
    if [[ $DRY_RUN == 1 ]]; then
        echo "+ ${server[*]} &"
    else
        "${server[@]}" &
        server_pid=$!
        "$PYTHON" - "$ASSISTANT_PORT" "$ASSISTANT_READY_TIMEOUT" "$server_pid" <<'EOF'
import os, sys, time, urllib.request
port, timeout, pid = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
deadline = time.time() + timeout
while time.time() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit(f"the assistant's SGLang server (pid {pid}) exited before it was ready")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            if r.status == 200:
                sys.exit(0)
    except OSError:
        pass
    time.sleep(5)
sys.exit(f"the assistant's SGLang server was not ready on port {port} after {timeout:.0f} s")
EOF
    fi
    overrides+=("rm.assistant_url=http://127.0.0.1:$ASSISTANT_PORT" "rm.assistant_model=$assistant_name")
fi

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
run "$PYTHON" -m torch.distributed.run \
    --nnodes="$NNODES" --nproc-per-node="$GPUS_PER_NODE" \
    --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$RDZV_ID" \
    --max-restarts=0 \
    -m cooper_mcore train --config "$config" "${overrides[@]}" "$@"
