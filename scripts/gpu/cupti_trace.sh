#!/usr/bin/env bash
# Builds scripts/gpu/cupti_trace.c into gpu-carry/cupti/ (libvime_cupti_trace.so and the
# libcupti.so.13 it links, found by rpath $ORIGIN), here, with the headers and library of the
# nvidia-cuda-cupti wheel that matches the device's CUDA 13.0 (downloaded once into
# ~/.cache/vime-cupti), and the CUDA headers of ../shared/gpu/cuda-toolchain.sh.
#   scripts/gpu/cupti_trace.sh        (then carry gpu-carry; timeline.sh uses it)
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEEL_DIR=${WHEEL_DIR:-$HOME/.cache/vime-cupti}
mkdir -p "$WHEEL_DIR" gpu-carry/cupti
if [ ! -f "$WHEEL_DIR/nvidia/cu13/include/cupti.h" ]; then
  pip download --no-deps nvidia-cuda-cupti==13.0.85 -d "$WHEEL_DIR"
  (cd "$WHEEL_DIR" && unzip -q -o nvidia_cuda_cupti-13.0.85-*.whl)
fi
CUPTI=$WHEEL_DIR/nvidia/cu13
source ../shared/gpu/cuda-toolchain.sh >/dev/null
CUDA_INC=$(dirname "$(command -v nvcc)")/../include
cp "$CUPTI/lib/libcupti.so.13" gpu-carry/cupti/
gcc -O2 -shared -fPIC -I"$CUPTI/include" -I"$CUDA_INC" scripts/gpu/cupti_trace.c \
  -o gpu-carry/cupti/libvime_cupti_trace.so -L gpu-carry/cupti -l:libcupti.so.13 -Wl,-rpath,'$ORIGIN'
ls -la gpu-carry/cupti
