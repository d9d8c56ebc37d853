#!/usr/bin/env bash
# torchrun with the settings that make restarts and signals reliable (gloo included).
#
# One node, 2 ranks, one restart after a failure:
#   uv run launchers/torchrun.sh [overrides...]
# Several nodes: run on every node with the same RUN_ID and node 0's address:
#   NNODES=2 NPROC=4 RDZV_ENDPOINT=node0:29500 RUN_ID=exp42 uv run launchers/torchrun.sh ...
#
# Settings (environment): NPROC (ranks per node, default 2), NNODES (default 1; MIN:MAX, e.g.
# 1:2, for an elastic job that restarts on the nodes left after one is lost),
# MAX_RESTARTS (default 1), RDZV_ENDPOINT and RUN_ID (needed when NNODES > 1), LOCAL_ADDR
# (this node's reachable address), RDZV_HOST=1 on the node at RDZV_ENDPOINT, RDZV_CONF (more
# c10d settings, e.g. last_call_timeout=5,keep_alive_interval=1: docs/launchers.md).
# The run dir is outputs/torchrun/<RUN_ID>; every restart resumes from its newest checkpoint.
set -euo pipefail

# A restarted round gets its own store: sharing the rendezvous store made gloo reconnects fail
# ("Gloo connectFullMesh failed ... Connection refused") in 5 of 6 restarts; 12 of 12 were clean.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

args=(
  --nproc-per-node="${NPROC:-2}"
  --max-restarts="${MAX_RESTARTS:-1}"
  # Without this torchrun dies on SIGUSR1/SIGUSR2 and leaves its workers running; with it,
  # the ranks get the signal, save a checkpoint at the same step and exit with code 75.
  --signals-to-handle=SIGTERM,SIGINT,SIGUSR1,SIGUSR2
)
if [[ "${NNODES:-1}" == *:* && "${MAX_RESTARTS:-1}" == 0 ]]; then
  echo "error: NNODES=$NNODES is an elastic range, which restarts on the nodes left after" \
       "one is lost: set MAX_RESTARTS>=1 (or a fixed NNODES)" >&2
  exit 2
fi
if [[ "${NNODES:-1}" == 1 ]]; then
  args+=(--standalone)
else
  : "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=<node 0 host>:<port> on every node}"
  : "${RUN_ID:?set the same RUN_ID on every node (it names the run dir)}"
  args+=(--nnodes="$NNODES" --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT"
         --rdzv-id="$RUN_ID")
  # This node's address as the other nodes reach it (default: its hostname).
  if [[ -n "${LOCAL_ADDR:-}" ]]; then args+=(--local-addr="$LOCAL_ADDR"); fi
  # The node at RDZV_ENDPOINT hosts the rendezvous; torchrun guesses it from the hostname, which
  # fails when RDZV_ENDPOINT is an address the hostname does not resolve to.
  conf="${RDZV_CONF:-}"
  if [[ "${RDZV_HOST:-0}" == 1 ]]; then conf="is_host=true${conf:+,$conf}"; fi
  if [[ -n "$conf" ]]; then args+=(--rdzv-conf="$conf"); fi
fi
# `python -m` puts the working dir ahead of everything installed, in torchrun and in each rank:
# a project's own `random` would be what they import. torchrun runs with -P, which leaves it
# off, and its ranks are the `train` script, which appends it last (framework/cli.py).
export PYTHONUNBUFFERED=1  # (what torchrun's `-u` gives a Python rank)
exec python -P -m torch.distributed.run "${args[@]}" --no-python train "$@"
