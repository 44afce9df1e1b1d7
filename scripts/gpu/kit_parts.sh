# Sourced by the kits that carry one large packed file to the GPU machine in parts, one device
# call a part on a warm machine (scripts/gpu/cudnn_kit.sh, scripts/gpu/te_kit.sh). A kit folder
# KIT holds part.NN and PARTS.sha256; parts collect in a STAGE folder under /tmp.
#
#   kit_part_stage KIT STAGE NN LABEL   copy KIT/part.NN into STAGE (the `part NN` command)
#   kit_parts_check KIT STAGE LABEL     add the parts carried in KIT this call to STAGE (those
#                                       staged already stay), then check all against
#                                       KIT/PARTS.sha256; non-zero status, naming what is
#                                       staged, when one is missing or differs

kit_part_stage() {
  mkdir -p "$2"
  cp "$1/part.$3" "$2/"
  echo "$4: part $3 staged ($(ls "$2" | tr '\n' ' '))"
}

kit_parts_check() {
  local kit=$1 stage=$2 label=$3 p
  mkdir -p "$stage"
  for p in "$kit"/part.*; do
    if [ -f "$p" ] && [ ! -e "$stage/${p##*/}" ]; then cp "$p" "$stage/"; fi
  done
  (cd "$stage" && sha256sum --quiet -c "$(cd "$kit" && pwd)/PARTS.sha256") ||
    { echo "$label: a part is missing or differs (staged: $(ls "$stage" | tr '\n' ' '))"; return 1; }
}
