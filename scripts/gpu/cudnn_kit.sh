#!/usr/bin/env bash
# A newer cuDNN for the GPU machine (issue 21): its torch wheel ships cuDNN 9.19, whose SDPA
# engines vime's attention runs on; PyPI has later releases. The GPU machine has no network, so
# this script packs four of its libraries (libcudnn, graph, heuristic, runtime-compiled engines:
# about 280 MB) into xz parts small enough for the device tool, and unpacks them there. That these
# four are all vime's SDPA graphs need is a guess from the libraries' strings (the runtime-compiled
# one names the sm90 SDPA engines; the precompiled one names none); if cuDNN reports a missing
# sub-library, add it to LIBS (libcudnn_engines_precompiled / _tensor_ir: ~250 MB each).
#
#   here:  scripts/gpu/cudnn_kit.sh build            # -> gpu-carry/cudnn/part.NN, LIBS.sha256
#   there: scripts/gpu/cudnn_kit.sh part NN          # one call a part, the machine kept warm
#          scripts/gpu/cudnn_kit.sh install          # joins, unpacks into $DEST, checks sha256s
#          export LD_LIBRARY_PATH=$DEST:$LD_LIBRARY_PATH   # after sourcing device-env.sh
#
# Status (2026-12-05): `build` was run here (three parts of 26 MB, 76 MB packed). `part` and
# `install`, and any timing of cuDNN 9.28 against 9.19, were NOT run: no GPU machine could be
# started that session. The question it is for: is 9.28's SDPA backward faster than 9.19's
# (58 ms of a 4B step on the H200, 21 ms of a 0.6B step on the H100)? vime-train prints the
# loaded cuDNN's version (bench-step's `cuDNN <version> attention:` line), which shows whether
# the kit's libraries were the ones loaded.
#
# Settings: VERSION (default 9.28.1.4), DEST (default /tmp/cudnn-$VERSION), KIT (default
# gpu-carry/cudnn), PARTS (default 3: ~26 MB each, beside a ~21 MB checkout and a binary).
# The wheel is checked against PyPI's sha256 (WHEEL_SHA256 for another VERSION); each library
# against LIBS.sha256 after unpacking. Ends with `CUDNN KIT: ...`; exit status 0 on success.
set -euo pipefail
VERSION=${VERSION:-9.28.1.4}
KIT=${KIT:-gpu-carry/cudnn}
DEST=${DEST:-/tmp/cudnn-$VERSION}
PARTS=${PARTS:-3}
STAGE=/tmp/cudnn-kit-parts
LIBS="libcudnn.so.9 libcudnn_graph.so.9 libcudnn_heuristic.so.9 libcudnn_engines_runtime_compiled.so.9"
declare -A PYPI_SHA256=(
  [9.28.1.4]=a54f205b1db1f2895d99f398754db1369816f0569dd459731f925635cf7b65ec
)
source "$(dirname "$0")/kit_parts.sh"
cmd=${1:?usage: cudnn_kit.sh build | part NN | install}
case "$cmd" in
build)
  want=${WHEEL_SHA256:-${PYPI_SHA256[$VERSION]:-}}
  [ -n "$want" ] || { echo "CUDNN KIT: no sha256 known for $VERSION (set WHEEL_SHA256)"; exit 1; }
  work=$(mktemp -d /tmp/cudnn-kit.XXXXXX)
  trap 'rm -rf "$work"' EXIT
  python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_27_x86_64 \
    --python-version 3.12 -d "$work" "nvidia-cudnn-cu13==$VERSION"
  whl=$(ls "$work"/nvidia_cudnn_cu13-*.whl)
  echo "$want  $whl" | sha256sum --quiet -c || { echo "CUDNN KIT: $whl differs from PyPI's sha256"; exit 1; }
  mkdir -p "$work/lib"
  for l in $LIBS; do unzip -q -j -o "$whl" "nvidia/cudnn/lib/$l" -d "$work/lib"; done
  mkdir -p "$KIT"
  rm -f "$KIT"/part.*
  (cd "$work/lib" && sha256sum $LIBS) > "$KIT/LIBS.sha256"
  echo "$VERSION" > "$KIT/VERSION"
  # -T1: the same bytes on every build (xz's threaded mode splits blocks by thread count).
  tar --sort=name --mtime='2026-01-01 00:00Z' --owner=0 --group=0 --numeric-owner -C "$work/lib" -cf - $LIBS |
    xz -9 -T1 > "$work/kit.tar.xz"
  split -n "$PARTS" -d "$work/kit.tar.xz" "$KIT/part."
  (cd "$KIT" && sha256sum part.* > PARTS.sha256)
  echo "CUDNN KIT: cuDNN $VERSION in $PARTS parts under $KIT ($(du -h "$work/kit.tar.xz" | cut -f1))"
  ;;
part)
  kit_part_stage "$KIT" "$STAGE" "${2:?usage: cudnn_kit.sh part NN}" "CUDNN KIT"
  ;;
install)
  # Parts may be staged in earlier calls or carried in this one.
  kit=$(cd "$KIT" && pwd)
  kit_parts_check "$kit" "$STAGE" "CUDNN KIT" || exit 1
  rm -rf "$DEST" && mkdir -p "$DEST"
  cat "$STAGE"/part.* | xz -dc | tar xf - -C "$DEST"
  (cd "$DEST" && sha256sum --quiet -c "$kit/LIBS.sha256") || { echo "CUDNN KIT: a library differs"; exit 1; }
  echo "CUDNN KIT: cuDNN $(cat "$kit/VERSION") in $DEST"
  ;;
*)
  echo "usage: cudnn_kit.sh build | part NN | install"
  exit 2
  ;;
esac
