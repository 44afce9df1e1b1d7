#!/usr/bin/env bash
# Transformer Engine for the GPU machine (issue 21's stretch: a Megatron-Core + TE baseline, the
# stack slime users train with). The machine has torch 2.11.0+cu130 (Python 3.12) and no network;
# TE 2.20.2 is three PyPI packages there: transformer_engine (Python code, 1.2 MB),
# transformer_engine_cu13 (the core library, libtransformer_engine.so: 343 MB, a 276 MB wheel) and
# transformer_engine_torch (the torch extension, source only: 33 C++ files, no CUDA code). This
# script packs the wheels and the source into parts small enough for the device tool, then
# installs them there and builds the extension against the machine's own torch.
#
#   here:  scripts/gpu/te_kit.sh build          # -> gpu-carry/te/part.NN, base.tar, SHA256SUMS
#   there: scripts/gpu/te_kit.sh part NN        # one call a part, the machine kept warm
#          scripts/gpu/te_kit.sh install        # joins, checks, installs into $SITE, builds the
#                                               # extension, smoke-tests (a TE Linear against a
#                                               # matmul, TE attention against torch SDPA)
#          PYTHONPATH=$SITE:$PYTHONPATH python3 scripts/gpu/bench_train_torch.py --system megatron-te ...
#
# The built extension's wheel is kept in $SITE/../te-built/ and copied to $TE_SAVE if set (e.g.
# $OUT), so that it can come back and be carried next time (TE_TORCH_WHEEL=path: install it and
# skip the build).
#
# Status (2026-12-05): the extension builds against torch 2.11.0+cu130's nvidia/* headers plus
# crt/ (here: ~9 min on 2 cores; on the H100 machine: 129 s on 16 cores, a 5.4 MB cp312 wheel).
# On H100 machines `part` x 7 and `install` ran twice: first with the build, which then hit the
# two-pip-calls bug fixed since; then, fixed, with TE_TORCH_WHEEL= that wheel: smoke test passed.
# On an H200 (981a9bb session): `part` x 7 (kit_parts.sh) and `install` with TE_TORCH_WHEEL= in
# 26 s, the smoke test (device-env.sh sourced first) OK on cuDNN 9.19.
# The core wheel is re-zipped uncompressed (same members, CRCs, sizes, modes) before xz, as
# ../shared/gpu/vllm-kit does; its fat binaries are compressed already, so xz gains little
# (253 MB packed, 7 parts of 38 MiB beside a ~21 MB checkout).
# Also packed (the image lacks them; TE's recipe module imports pydantic), in the versions the
# vLLM kit runs there: pydantic 2.14.4, pydantic-core 2.50.5, annotated-types 0.8.0,
# typing-inspection 0.4.5, typing-extensions 4.16.0.
#
# Settings: KIT (default gpu-carry/te), SITE (default /tmp/te-site), PART_MB (default 38),
# MAX_JOBS (default: the machine's cores). Ends with `TE KIT: ...`; exit status 0 on success.
set -euo pipefail
TE_VERSION=2.20.2
KIT=${KIT:-gpu-carry/te}
SITE=${SITE:-/tmp/te-site}
PART_MB=${PART_MB:-38}
STAGE=/tmp/te-kit-parts
# sha256 of the files as pip downloaded them from PyPI (pip checks the index's hash).
declare -A PYPI_SHA256=(
  [transformer_engine-2.20.2-py3-none-any.whl]=7dcfad943a1a55b2612db9a0e43697fe98c70f4c42ec391ba3a0f872f6ce2094
  [transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl]=30063d3699e779cce63617c3458804f7a504ce8279f2749c98313db9daae273e
  [transformer_engine_torch-2.20.2.tar.gz]=4c40ced8a6261649e689076f198d4feaf02277b1ba18931a66eccdaceb33c43e
)
SMALL_WHEELS="pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0"
source "$(dirname "$0")/kit_parts.sh"
cmd=${1:?usage: te_kit.sh build | part NN | install}
case "$cmd" in
build)
  work=$(mktemp -d /tmp/te-kit.XXXXXX)
  trap 'rm -rf "$work"' EXIT
  mkdir -p "$work/dl" "$work/base"
  python3 -m pip download -q --no-deps -d "$work/dl" "transformer_engine==$TE_VERSION" \
    "transformer_engine_cu13==$TE_VERSION" "transformer_engine_torch==$TE_VERSION"
  for f in "${!PYPI_SHA256[@]}"; do
    echo "${PYPI_SHA256[$f]}  $work/dl/$f" | sha256sum --quiet -c ||
      { echo "TE KIT: $f differs from the recorded sha256"; exit 1; }
  done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$work/base" $SMALL_WHEELS
  cp "$work/dl/transformer_engine-$TE_VERSION-py3-none-any.whl" "$work/dl/transformer_engine_torch-$TE_VERSION.tar.gz" "$work/base/"
  # The core wheel, uncompressed, then xz.
  core=transformer_engine_cu13-$TE_VERSION-py3-none-manylinux_2_28_x86_64.whl
  python3 - "$work/dl/$core" "$work/$core" <<'EOF'
import sys, zipfile
src, dst = sys.argv[1:]
zin = zipfile.ZipFile(src)
with zipfile.ZipFile(dst, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zout:
    for info in zin.infolist():
        ni = zipfile.ZipInfo(info.filename, date_time=info.date_time)
        ni.external_attr, ni.create_system = info.external_attr, info.create_system
        with zin.open(info) as r:
            zout.writestr(ni, r.read())
a = [(i.filename, i.CRC, i.file_size, i.external_attr) for i in zin.infolist()]
b = [(i.filename, i.CRC, i.file_size, i.external_attr) for i in zipfile.ZipFile(dst).infolist()]
assert a == b, "repacked wheel differs"
EOF
  mkdir -p "$KIT"
  rm -f "$KIT"/part.* "$KIT"/base.tar
  (cd "$work" && sha256sum "$core") > "$KIT/SHA256SUMS"
  (cd "$work/base" && sha256sum *) >> "$KIT/SHA256SUMS"
  tar --sort=name --mtime='2026-01-01 00:00Z' --owner=0 --group=0 --numeric-owner -C "$work/base" -cf "$KIT/base.tar" .
  xz -6 -T2 -c "$work/$core" > "$work/core.xz"
  split -b "${PART_MB}M" -d "$work/core.xz" "$KIT/part."
  (cd "$KIT" && sha256sum part.* > PARTS.sha256)
  echo "TE KIT: TE $TE_VERSION in $(ls "$KIT"/part.* | wc -l) parts under $KIT ($(du -h "$work/core.xz" | cut -f1) packed core, $(du -h "$KIT/base.tar" | cut -f1) base)"
  ;;
part)
  kit_part_stage "$KIT" "$STAGE" "${2:?usage: te_kit.sh part NN}" "TE KIT"
  ;;
install)
  kit=$(cd "$KIT" && pwd)
  kit_parts_check "$kit" "$STAGE" "TE KIT" || exit 1
  work=/tmp/te-kit-work
  rm -rf "$work" && mkdir -p "$work"
  core=transformer_engine_cu13-$TE_VERSION-py3-none-manylinux_2_28_x86_64.whl
  cat "$STAGE"/part.* | xz -dc > "$work/$core"
  tar xf "$kit/base.tar" -C "$work"
  (cd "$work" && sha256sum --quiet -c "$kit/SHA256SUMS") || { echo "TE KIT: a file differs after unpacking"; exit 1; }
  built=$SITE/../te-built
  mkdir -p "$built"
  if [ -n "${TE_TORCH_WHEEL:-}" ]; then
    cp "$TE_TORCH_WHEEL" "$built/"
  else
    t0=$(date +%s)
    tar xzf "$work/transformer_engine_torch-$TE_VERSION.tar.gz" -C "$work"
    # Headers from the torch venv's nvidia/* packages (cuDNN, NCCL, cuBLAS, the runtime), the
    # same libraries torch runs on; no NCCL EP (MoE only); no download of a prebuilt wheel.
    # The runtime package has no crt/ headers (nvcc's): take them from wherever nvcc's are.
    crt=""
    for d in $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, x, "include") for p in nvidia.__path__ for x in sorted(os.listdir(p))))' 2>/dev/null) \
             ${CUDA_HOME:+$CUDA_HOME/include} /usr/local/cuda/include; do
      [ -f "$d/crt/host_config.h" ] && { crt=$d; break; }
    done
    [ -n "$crt" ] || { echo "TE KIT: no crt/host_config.h (CUDA's compiler headers) found"; exit 1; }
    echo "TE KIT: building transformer_engine_torch (crt headers from $crt)"
    (cd "$work/transformer_engine_torch-$TE_VERSION" &&
      CPLUS_INCLUDE_PATH=$crt${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH} NVTE_BUILD_USE_NVIDIA_WHEELS=1 NVTE_WITH_NCCL_EP=0 NVTE_PYTORCH_FORCE_BUILD=TRUE \
      MAX_JOBS=${MAX_JOBS:-$(nproc)} python3 -m pip wheel -q --no-build-isolation --no-deps --no-index \
        -w "$built" . > "$work/build.log" 2>&1) ||
      { tail -40 "$work/build.log"; echo "TE KIT: building transformer_engine_torch failed ($work/build.log)"; exit 1; }
    echo "TE KIT: transformer_engine_torch built in $(( $(date +%s) - t0 )) s"
  fi
  # One pip call for all: the extension's wheel also installs into transformer_engine/wheel_lib,
  # and a second `--target --upgrade` call would replace the whole transformer_engine folder.
  rm -rf "$SITE" && mkdir -p "$SITE"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    "$work/$core" "$work"/transformer_engine-*.whl "$work"/pydantic*.whl "$work"/annotated_types*.whl \
    "$work"/typing_inspection*.whl "$work"/typing_extensions*.whl "$built"/transformer_engine_torch-*.whl
  [ -n "${TE_SAVE:-}" ] && mkdir -p "$TE_SAVE" && cp "$built"/transformer_engine_torch-*.whl "$TE_SAVE/"
  # Smoke test: a TE Linear and DotProductAttention forward and backward in bf16 on the GPU.
  # Torch's own cuDNN (see bench_train_torch.py: the image's system cuDNN breaks TE's graphs),
  # and its sub-libraries from the same folder (device-env.sh puts torch's nvidia/*/lib first on
  # LD_LIBRARY_PATH, as every benchmark does): without it the smoke test's TE reported cuDNN
  # 9.14 (the system's sub-libraries behind torch's 9.19 libcudnn) although attention ran.
  if [ -f gpu-carry/device-env.sh ]; then source gpu-carry/device-env.sh 2>/dev/null || true; fi
  CUDNN_HOME=${CUDNN_HOME:-$(python3 -c 'import nvidia.cudnn; print(list(nvidia.cudnn.__path__)[0])')} \
  NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=1 PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} python3 - <<'EOF'
import torch, transformer_engine as te_root, transformer_engine.pytorch as te
torch.manual_seed(0)
lin = te.Linear(256, 512, bias=False, params_dtype=torch.bfloat16).cuda()
x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
y = lin(x)
ref = x.float() @ lin.weight.float().t()
err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
y.float().square().sum().backward()
attn = te.DotProductAttention(8, 128, num_gqa_groups=4, attn_mask_type="causal", qkv_format="sbhd")
q = torch.randn(256, 2, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(256, 2, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(256, 2, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
o = attn(q, k, v)
ref_o = torch.nn.functional.scaled_dot_product_attention(
    q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), is_causal=True, enable_gqa=True)
ref_o = ref_o.permute(2, 0, 1, 3).reshape(256, 2, 1024)
aerr = ((o.float() - ref_o.float()).abs().max()).item()
o.float().sum().backward()
ok = err < 2e-2 and aerr < 2e-2 and x.grad is not None and q.grad is not None
print(f"TE SMOKE: transformer_engine {te_root.__version__}, cuDNN {te.get_cudnn_version()}, "
      f"Linear rel err {err:.2e}, DotProductAttention max err {aerr:.2e} vs SDPA: {'OK' if ok else 'FAIL'}")
raise SystemExit(0 if ok else 1)
EOF
  echo "TE KIT: Transformer Engine $TE_VERSION in $SITE"
  ;;
*)
  echo "usage: te_kit.sh build | part NN | install"
  exit 2
  ;;
esac
