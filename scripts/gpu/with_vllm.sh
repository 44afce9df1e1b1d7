#!/usr/bin/env bash
# Sourced by the real-vLLM scripts: installs the vLLM kit from the parts carried to /tmp/vkit-parts
# (scripts/gpu/vllm_kit_part.sh), unless /tmp/vsite already has it, and exports what vLLM 0.26
# needs on the GPU machine. Needs gpu-carry/vkit/{PARTS.sha256,install.sh}.
if [ ! -d /tmp/vsite/vllm ]; then
  cp gpu-carry/vkit/PARTS.sha256 /tmp/vkit-parts/ || return 1
  bash gpu-carry/vkit/install.sh /tmp/vkit-parts || return 1
fi
export PYTHONPATH="/tmp/vsite:$PWD/sync/python${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
VKIT_TOKENIZER=/tmp/vkit/assets/qwen3-tokenizer
