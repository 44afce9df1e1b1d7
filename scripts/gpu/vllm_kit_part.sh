#!/usr/bin/env bash
# Carries one part of the vLLM kit (../shared/gpu/vllm-kit, built into gpu-carry/vkit by its
# build.sh) onto the warm GPU machine: run once per part, back to back (the machine goes cold 30 s
# after a call and /tmp with it):
#
#   run(carry=["gpu-carry/vkit/vkit.part.aa"], command="bash scripts/gpu/vllm_kit_part.sh aa")
#   ... ab ac ad ae af ...
#
# Then a script that needs vLLM (e.g. scripts/gpu/vllm_sync.sh) installs it from /tmp/vkit-parts.
set -euo pipefail
p=${1:?part suffix, e.g. aa}
mkdir -p /tmp/vkit-parts
cp "gpu-carry/vkit/vkit.part.$p" /tmp/vkit-parts/
ls -la /tmp/vkit-parts
