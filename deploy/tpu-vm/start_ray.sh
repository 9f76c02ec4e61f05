#!/usr/bin/env bash
# Start Ray on one host of a Cloud TPU VM slice, for rlpipe. Run it on every host of both slices (the learner
# slice and the rollout slice), or on the one VM both roles share; the host whose address is HEAD_ADDRESS starts
# the head, the others join it.
#
#   usage: start_ray.sh HEAD_ADDRESS ROLE
#     HEAD_ADDRESS  internal IP of worker 0 of the learner slice (the Ray head; the rlpipe driver runs there)
#     ROLE          learner | rollout | both: the slice this host belongs to ("both": one VM for both roles). The
#                   host advertises one unit of the Ray resource <ROLE>_host for each, which rlpipe's
#                   placement.<role>.resources may ask for.
#
#   e.g. from your workstation (see deploy/README.md, "TPU VM alternative"):
#     gcloud compute tpus tpu-vm ssh rlpipe-learner --zone=$ZONE --worker=all \
#         --command="bash rlpipe/deploy/tpu-vm/start_ray.sh 10.130.0.5 learner"
#     gcloud compute tpus tpu-vm ssh rlpipe-rollout --zone=$ZONE --worker=all \
#         --command="bash rlpipe/deploy/tpu-vm/start_ray.sh 10.130.0.5 rollout"
#
# Over `gcloud ... ssh --command` the shell is not a login shell: no profile runs, so a virtual environment's ray
# is not on PATH. The script looks for ray in $RAY, then ~/rlpipe-venv/bin (the install below), then on PATH.
# Environment: RAY (the ray executable), RAY_PORT (GCS port, default 6379),
# RAY_DASHBOARD_PORT (default 8265), RLPIPE_RAY_HEAD=1|0 (force this host to be / not be the head).
# NOT YET RUN ON TPU HARDWARE from this repository.
set -euo pipefail

if [[ $# -ne 2 || ( "$2" != learner && "$2" != rollout && "$2" != both ) ]]; then
  sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
head_address=$1
role=$2
ray_bin=${RAY:-}
if [[ -z "$ray_bin" && -x "$HOME/rlpipe-venv/bin/ray" ]]; then
  ray_bin=$HOME/rlpipe-venv/bin/ray
fi
ray_bin=${ray_bin:-$(command -v ray || true)}
if [[ -z "$ray_bin" || ! -x "$ray_bin" ]]; then
  echo "start_ray.sh: no ray executable on $(hostname): install rlpipe into ~/rlpipe-venv (the install lines in this script) or set RAY=/path/to/bin/ray" >&2
  exit 2
fi
port=${RAY_PORT:-6379}
dashboard_port=${RAY_DASHBOARD_PORT:-8265}

# Install (once per host, before the first start; the TPU software version must be v2-alpha-tpuv6e,
# v2-alpha-tpuv5-lite or v2-alpha-tpuv5 for v6e, v5e and v5p). rlpipe's tpu extra needs Python 3.12:
#   git clone <this repository> rlpipe && cd rlpipe
#   python3.12 -m venv ~/rlpipe-venv
#   ~/rlpipe-venv/bin/pip install --extra-index-url https://download.pytorch.org/whl/cpu ".[tpu]"

# rlpipe gives each actor the chips it drives (rlpipe/hardware/tpu_env.py), not Ray. The raylet passes its environment on to
# every worker process, so this has to be set before `ray start`.
export RAY_EXPERIMENTAL_NOSET_TPU_VISIBLE_CHIPS=1

if [[ "$role" == both ]]; then
  resources='{"learner_host": 1, "rollout_host": 1}'
else
  resources="{\"${role}_host\": 1}"
fi

is_head=${RLPIPE_RAY_HEAD:-}
if [[ -z "$is_head" ]]; then
  is_head=0
  for address in $(hostname -I); do
    if [[ "$address" == "$head_address" ]]; then
      is_head=1
    fi
  done
fi

if [[ "$is_head" == 1 ]]; then
  echo "start_ray.sh: starting the Ray head on $head_address:$port ($role host)"
  "$ray_bin" start --head --port="$port" \
    --dashboard-host=0.0.0.0 --dashboard-port="$dashboard_port" \
    --resources="$resources"
else
  echo "start_ray.sh: joining the Ray head at $head_address:$port ($role host)"
  "$ray_bin" start --address="$head_address:$port" --resources="$resources"
fi
