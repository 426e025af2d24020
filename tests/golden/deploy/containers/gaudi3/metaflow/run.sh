#!/bin/sh
# Run golden's pipeline (prepare → tune → train → report) with Metaflow: gaudi3_scale.deploy.flow.
#   locally:        sh metaflow/run.sh [--tune on --time-budget-min 30] [--steps N]
#   on Kubernetes:  GAUDI3_METAFLOW_KUBERNETES=1 sh metaflow/run.sh --out /mnt/shared/golden-flow
# Kubernetes needs a Metaflow S3/GS/Azure datastore (`metaflow configure kubernetes`), and --out on a volume every
# step's pod mounts (METAFLOW_KUBERNETES_PERSISTENT_VOLUME_CLAIMS='{"claim": "/mnt/shared"}').
# Metaflow needs a user name: USERNAME or METAFLOW_USER.
# gaudi3: the flow's Gaudi steps (habana.ai/gaudi devices, hpu) are not yet validated on Gaudi hardware.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
# This render's choices; GAUDI3_METAFLOW_ACCELERATOR, GAUDI3_METAFLOW_DEVICES and
# METAFLOW_KUBERNETES_CONTAINER_IMAGE in the environment override the first three.
accelerator=gaudi3 devices=8 image=gaudi3-scale-train:0.1.0-gaudi out=runs/golden-flow
export GAUDI3_METAFLOW_ACCELERATOR="${GAUDI3_METAFLOW_ACCELERATOR:-$accelerator}"
export GAUDI3_METAFLOW_DEVICES="${GAUDI3_METAFLOW_DEVICES:-$devices}"
export METAFLOW_KUBERNETES_CONTAINER_IMAGE="${METAFLOW_KUBERNETES_CONTAINER_IMAGE:-$image}"
exec python -m gaudi3_scale.deploy.flow run --config "$here/../docker/run.yaml" --out "$out" \
  --accelerator "$GAUDI3_METAFLOW_ACCELERATOR" "$@"
