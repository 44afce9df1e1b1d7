#!/usr/bin/env bash
# cudnn-headers.sh: the two header sets a `--features cudnn` build compiles against, from PyPI:
# cudnn.h (nvidia-cudnn-cu13, the version torch 2.11 ships and the GPU machine runs) and the
# header-only cuDNN frontend (nvidia-cudnn-frontend, MIT). Only headers are kept; nothing links
# against libcudnn (the frontend dlopen's it at run time, from the machine's cuDNN 9).
#
#   source scripts/gpu/cudnn-headers.sh   # downloads once (about 700 MB, unpacked: 4 MB kept)
#   cargo build --release -p vime-trainer --features cudnn
#
# Exports CUDNN_INCLUDE and CUDNN_FRONTEND_INCLUDE. Knobs: CUDNN_HEADERS_DIR (default
# ${XDG_CACHE_HOME:-$HOME/.cache}/vime-cudnn-headers), PYTHON (default python3; needs pip).

_cudnn_headers_main() {
    local dir="${CUDNN_HEADERS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/vime-cudnn-headers}"
    local py="${PYTHON:-python3}"
    local pins=("nvidia-cudnn-cu13==9.19.0.56" "nvidia-cudnn-frontend==1.32.0")
    local stamp="$dir/.pins"
    if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "${pins[*]}" ]; then
        rm -rf "$dir" && mkdir -p "$dir/wheels" || return 1
        echo "cudnn-headers: downloading ${pins[*]}" >&2
        "$py" -m pip download -q --disable-pip-version-check --no-deps -d "$dir/wheels" "${pins[@]}" || {
            echo "cudnn-headers: pip download failed" >&2
            return 1
        }
        local whl
        for whl in "$dir"/wheels/*.whl; do
            "$py" - "$whl" "$dir" <<'PY' || return 1
import sys, zipfile
whl, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    for n in z.namelist():
        # nvidia/cudnn/include/*.h (cuDNN) and include/** (the frontend)
        if n.endswith((".h", ".hpp")) and ("/include/" in n or n.startswith("include/")):
            z.extract(n, dest)
PY
        done
        rm -rf "$dir/wheels"
        printf '%s' "${pins[*]}" > "$stamp"
    fi
    export CUDNN_INCLUDE="$dir/nvidia/cudnn/include"
    export CUDNN_FRONTEND_INCLUDE="$dir/include"
    if [ ! -f "$CUDNN_INCLUDE/cudnn.h" ] || [ ! -f "$CUDNN_FRONTEND_INCLUDE/cudnn_frontend.h" ]; then
        echo "cudnn-headers: headers missing under $dir; remove $stamp and source again" >&2
        return 1
    fi
    echo "cudnn-headers: CUDNN_INCLUDE=$CUDNN_INCLUDE CUDNN_FRONTEND_INCLUDE=$CUDNN_FRONTEND_INCLUDE" >&2
}

_cudnn_headers_main "$@"
_cudnn_headers_rc=$?
unset -f _cudnn_headers_main
return "$_cudnn_headers_rc" 2>/dev/null || exit "$_cudnn_headers_rc"
