#!/usr/bin/env bash
# Train on a Cloud TPU VM slice: create it, copy this repo to every worker, install, run on all
# workers at once, stop / delete. Every worker runs the same command; JAX finds the other
# workers by itself (from the metadata server; llm_jax.parallel.distributed asks JAX's own
# check), so no coordinator address is needed here.
#
#   launch/tpu_vm.sh create            # one slice (TPU_NAME, ZONE, ACCELERATOR, VERSION below)
#   launch/tpu_vm.sh setup             # copy the repo, pip install '.[tpu]' on every worker
#   launch/tpu_vm.sh run --config configs/gpt_oss_20b.py --config.mesh.fsdp=4 \
#       --config.mesh.expert=4 --config.mesh.data=-1 --workdir gs://BUCKET/runs/20b
#   launch/tpu_vm.sh stop | delete
#
# Multi-slice (several slices joined over the data-center network): create them as one queued
# resource with --node-count N (gcloud alpha compute tpus queued-resources create ...
# --node-count N --node-prefix NAME), run the same command on every worker of every slice,
# and set the DCN sizes, e.g. --config.mesh.dcn_data=N: the mesh then puts `data` (or whichever
# dcn_* > 1) across slices and fsdp / tensor / expert inside a slice, where the interconnect is
# fast. JAX reads MEGASCALE_* variables that the queued resource sets. Check the step compiles
# and fits first, from any machine: python -m llm_jax.compile --config ... --topology v5p-64 \
#   --num_slices N --dcn data=N --mesh fsdp=4,expert=8
#
# The workdir should be a bucket (gs://...) or a disk every worker sees: Orbax writes each
# process's shards into the same checkpoint. Metrics and logs come from worker 0.
set -euo pipefail

TPU_NAME="${TPU_NAME:-llm-jax}"
ZONE="${ZONE:-us-east5-a}"
ACCELERATOR="${ACCELERATOR:-v5p-32}"
VERSION="${VERSION:-v2-alpha-tpuv5}"   # TPU VM image; v5e / v6e use v2-alpha-tpuv5-lite / v2-alpha-tpuv6e
REPO_DIR="${REPO_DIR:-llm_jax}"        # folder on the workers

here="$(cd "$(dirname "$0")/.." && pwd)"
ssh_all() { gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command "$1"; }

case "${1:-}" in
  create)
    gcloud compute tpus tpu-vm create "$TPU_NAME" --zone "$ZONE" \
      --accelerator-type "$ACCELERATOR" --version "$VERSION" ;;
  setup)
    tar -C "$here" --exclude=.git --exclude=runs --exclude=.venv -czf /tmp/llm_jax.tgz .
    gcloud compute tpus tpu-vm scp /tmp/llm_jax.tgz "$TPU_NAME":/tmp/ --zone "$ZONE" --worker=all
    ssh_all "mkdir -p $REPO_DIR && tar -C $REPO_DIR -xzf /tmp/llm_jax.tgz && cd $REPO_DIR && \
      python3 -m venv .venv && . .venv/bin/activate && pip install -q -e '.[tpu]'" ;;
  run)
    shift
    args="$(printf ' %q' "$@")"
    ssh_all "cd $REPO_DIR && . .venv/bin/activate && python -m llm_jax.train$args" ;;
  stop)
    gcloud compute tpus tpu-vm stop "$TPU_NAME" --zone "$ZONE" ;;
  delete)
    gcloud compute tpus tpu-vm delete "$TPU_NAME" --zone "$ZONE" --quiet ;;
  *)
    sed -n '2,30p' "$0"; exit 2 ;;
esac
