#!/usr/bin/env bash
# Launch a Cooper run with torchrun's c10d rendezvous: run this same command on every node (SLURM:
# examples/slurm/cooper.sbatch does it for you). Step by step: docs/deploy.md.
#
#   MASTER_ADDR=node0 NNODES=2 examples/launch_multinode.sh examples/qwen2.5-7b_multinode.yaml [key=value ...]
#
# After the config come dotted overrides and `cooper train`'s own flags (--out DIR, --resume auto, --overwrite).
# Exit code: the training processes' (75 preempted, 69 a node lost or never joined, 2 a config or input error,
# docs/reliability.md), or 2 when a check below stops the launch.
#
# Environment (defaults in brackets):
#   MASTER_ADDR [127.0.0.1]  host of the rendezvous (any one node; the same on every node)
#   MASTER_PORT [29500]      its port;  NNODES [1];  GPUS_PER_NODE [8];  RDZV_ID [cooper]: one per run
#   RDZV_TIMEOUT [ASSISTANT_READY_TIMEOUT + 600] seconds torchrun's rendezvous waits for the other nodes
#                            (join_timeout and the c10d store's read_timeout: nodes whose assistant is
#                            ready first wait for the slowest)
#   PYTHON [python]          the interpreter that has cooper_mcore installed
#   GPU_MEMORY_GIB           memory of one GPU [what torch reports for GPU 0]
#   ASSISTANT_URL            an assistant LLM already served elsewhere (OpenAI-compatible): nothing is
#                            started, the run uses it (rm.assistant_url)
#   ASSISTANT_MODEL_PATH     otherwise (colocated): the HF folder this script serves on this node with
#                            SGLang at 127.0.0.1:ASSISTANT_PORT before training, e.g.
#                            /models/Qwen2.5-7B-Instruct; neither set: the preset's rm.assistant_url is
#                            used as it is and must already answer
#   ASSISTANT_PORT [30010]   ASSISTANT_TP [the preset's parallel.tp]: the colocated server uses
#                            ASSISTANT_TP GPUs per replica and GPUS_PER_NODE/ASSISTANT_TP replicas (one
#                            per GPU group, behind SGLang's data-parallel router)
#   ASSISTANT_MEM_FRACTION   its --mem-fraction-static [derived from the model's size and the GPU
#                            memory by cooper_mcore.planner.plan: weights + a 65,536-token KV cache]; a given
#                            value that leaves no KV cache is refused before anything starts
#   ASSISTANT_READY_TIMEOUT [900] seconds to wait for it
#   ASSISTANT_CHECK [1]      0: do not ask the assistant endpoint once before training
#   DRY_RUN=1                print the commands instead of running them (the checks still run)
#
# Signals: SIGUSR1 (sent by cooper.sbatch ahead of the time limit) is forwarded to the training
# processes only (torchrun would die of it); SIGTERM/SIGINT to torchrun, which passes them on
# (under SLURM every process of the step gets SIGTERM itself, so it is not forwarded twice).
# shellcheck disable=SC2329  # (shellcheck 0.11 counts functions run only by `trap` as never invoked)
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
ASSISTANT_READY_TIMEOUT=${ASSISTANT_READY_TIMEOUT:-900}
RDZV_TIMEOUT=${RDZV_TIMEOUT:-$((ASSISTANT_READY_TIMEOUT + 600))}
ASSISTANT_CHECK=${ASSISTANT_CHECK:-1}
DRY_RUN=${DRY_RUN:-0}
# the colocated server's prefill chunk and concurrency, which bound its workspace (cooper_mcore.planner.plan)
ASSISTANT_CHUNKED_PREFILL=2048
ASSISTANT_MAX_RUNNING=64

overrides=()
if [[ -n ${ASSISTANT_URL:-} ]]; then
    overrides+=("rm.assistant_url=$ASSISTANT_URL")
    colocated=""
elif [[ -n ${ASSISTANT_MODEL_PATH:-} ]]; then
    if [[ -n ${ASSISTANT_TP:-} ]] && (( GPUS_PER_NODE % ASSISTANT_TP != 0 )); then
        echo "ASSISTANT_TP=$ASSISTANT_TP does not divide GPUS_PER_NODE=$GPUS_PER_NODE" >&2
        exit 2
    fi
    colocated=$ASSISTANT_MODEL_PATH
    assistant_name=$(basename "$colocated")
    overrides+=("rm.assistant_url=http://127.0.0.1:$ASSISTANT_PORT" "rm.assistant_model=$assistant_name")
else
    colocated=""
fi

# 1. before anything starts: the config, the colocated assistant's settings, the planner's verdict.
# Prints needs_assistant, url, model, api_key_env, tp, mem_fraction, one a line; exits 2 with the reason.
settings=$("$PYTHON" - "$config" "$NNODES" "$GPUS_PER_NODE" "${GPU_MEMORY_GIB:-}" "$colocated" \
    "${ASSISTANT_TP:-}" "${ASSISTANT_MEM_FRACTION:-}" "${overrides[@]}" "$@" <<'EOF'
import sys

config, nodes, gpus, gib, model_path, tp, fraction, *args = sys.argv[1:]
# cooper train's own flags (--resume auto, --out DIR, --overwrite) go to the trainer as they are; the check
# reads the dotted overrides (key=value), so a flag's value is the next word when that is not one
overrides, i = [], 0
while i < len(args):
    if args[i].startswith("--"):
        value = "=" not in args[i] and i + 1 < len(args) and "=" not in args[i + 1] and not args[i + 1].startswith("--")
        i += 2 if value else 1
    else:
        overrides.append(args[i])
        i += 1
if not gib:
    import torch
    if torch.cuda.is_available():
        gib = str(torch.cuda.mem_get_info(0)[1] / 2**30)
from cooper_mcore.planner.report import launch_check
try:
    c = launch_check(config, overrides, int(nodes), int(gpus), float(gib) if gib else None, model_path,
                     int(tp) if tp else None, float(fraction) if fraction else None)
except (ValueError, FileNotFoundError) as e:
    sys.exit(f"launch_multinode.sh: {e}")
for line in c.messages:
    print(f"launch_multinode.sh: {line}", file=sys.stderr)
print("\n".join(map(str, (int(c.needs_assistant), c.url, c.model, c.api_key_env, c.tp, c.mem_fraction))))
EOF
) || exit 2
mapfile -t fields <<< "$settings"
needs_assistant=${fields[0]} assistant_url=${fields[1]} assistant_model=${fields[2]} api_key_env=${fields[3]}
assistant_tp=${fields[4]} mem_fraction=${fields[5]}

# asks the assistant endpoint once (GET /v1/models or a 1-token chat completion); exits 2 naming it
check_assistant() {
    [[ $ASSISTANT_CHECK == 1 && $needs_assistant == 1 ]] || return 0
    "$PYTHON" - "$assistant_url" "$assistant_model" "$api_key_env" "$1" <<'EOF' || exit 2
import sys

from cooper_mcore.llm_client import check_endpoint

url, model, key_env, hint = sys.argv[1:]
try:
    how = check_endpoint(url, model, api_key_env=key_env or None, timeout_s=10, hint=hint)
except ValueError as e:
    sys.exit(f"launch_multinode.sh: {e}")
print(f"launch_multinode.sh: assistant {model!r} answers at {url} ({how})", file=sys.stderr)
EOF
}

server_pid=""
torchrun_pid=""
stop_server() {
    if [[ -n $server_pid ]]; then
        kill "$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
    fi
}
trap stop_server EXIT

# 2. the assistant: started here (colocated), or checked where it is
if [[ -n $colocated ]]; then
    server=("$PYTHON" -m sglang.launch_server --model-path "$colocated"
            --served-model-name "$assistant_name" --tp-size "$assistant_tp"
            --dp-size "$((GPUS_PER_NODE / assistant_tp))" --mem-fraction-static "$mem_fraction"
            --chunked-prefill-size "$ASSISTANT_CHUNKED_PREFILL" --max-running-requests "$ASSISTANT_MAX_RUNNING"
            --host 127.0.0.1 --port "$ASSISTANT_PORT")
    if [[ $DRY_RUN == 1 ]]; then
        echo "+ ${server[*]} &"
    else
        "${server[@]}" &
        server_pid=$!
        "$PYTHON" - "$ASSISTANT_PORT" "$ASSISTANT_READY_TIMEOUT" "$server_pid" <<'EOF' || exit 2
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
        check_assistant "The server this script started answers /health but not the OpenAI API."
    fi
elif [[ -n ${ASSISTANT_URL:-} ]]; then
    check_assistant "Start the assistant server there, fix ASSISTANT_URL, or set ASSISTANT_CHECK=0 to skip this check."
else
    check_assistant "Nothing serves it: set ASSISTANT_MODEL_PATH=/models/$assistant_model for this script to start \
it on every node, ASSISTANT_URL=http://HOST:PORT for a separate server, or override rm.negatives=policy."
fi

# 3. training: torchrun's agent, whose failures are one line each and whose exit code is the ranks'
# (cooper_mcore/torchrun.py): 75 preempted, 69 a node lost or never joined the rendezvous, 2 a config refusal
cmd=("$PYTHON" -m cooper_mcore.torchrun
     --nnodes="$NNODES" --nproc-per-node="$GPUS_PER_NODE"
     --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$RDZV_ID"
     --rdzv-conf="join_timeout=$RDZV_TIMEOUT,read_timeout=$RDZV_TIMEOUT"
     --max-restarts=0
     -m cooper_mcore train --config "$config" "${overrides[@]}" "$@")
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
if [[ $DRY_RUN == 1 ]]; then
    echo "+ ${cmd[*]}"
    exit 0
fi

# the training processes: torchrun's children (it starts each with Popen, in a session of its own)
workers() {
    local stat line fields
    for stat in /proc/[0-9]*/stat; do
        { line=$(<"$stat"); } 2>/dev/null || continue  # (a process that ended meanwhile)
        read -r -a fields <<< "${line##*) }"  # after "pid (comm) ": state ppid ...
        if [[ ${fields[1]} == "$1" ]]; then
            echo "${line%% *}"
        fi
    done
}
forward_usr1() {
    local pids
    pids=$(workers "$torchrun_pid")
    echo "launch_multinode.sh: SIGUSR1: forwarded to the training processes ${pids//$'\n'/ }" >&2
    if [[ -n $pids ]]; then
        # shellcheck disable=SC2086  # one pid per word
        kill -USR1 $pids 2>/dev/null || true
    fi
}
forward_stop() {
    if [[ -z ${SLURM_STEP_ID:-} && -n $torchrun_pid ]]; then
        kill -"$1" "$torchrun_pid" 2>/dev/null || true
    fi
}
trap forward_usr1 USR1
trap 'forward_stop TERM' TERM
trap 'forward_stop INT' INT

"${cmd[@]}" &
torchrun_pid=$!
status=0
wait "$torchrun_pid" || status=$?
while kill -0 "$torchrun_pid" 2>/dev/null; do  # a trapped signal interrupted the wait
    status=0
    wait "$torchrun_pid" || status=$?
done
exit "$status"
