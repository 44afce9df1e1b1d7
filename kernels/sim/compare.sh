#!/usr/bin/env bash
# Checks, without a GPU, that the working tree's kernels/cuda/ops.cu gives the same bits as another
# commit's on the kernels check_ops.cpp runs (under simt.h), and that the simulator passes its own
# self-test. Prints "SIM VERDICT: PASS" or names each output that differs.
#
#   kernels/sim/compare.sh [BASE_REV]     (default: main)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
base=${1:-main}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git -C "$root" show "$base:kernels/cuda/ops.cu" >"$tmp/ops_base.cu"
# -I kernels/cuda: a base ops.cu copied to $tmp still finds the headers it includes (swiglu.cuh).
flags=(-std=c++17 -O1 -ffp-contract=off -I"$here/include" -I"$here" -I"$root/kernels/cuda" -Wno-unknown-pragmas)
g++ "${flags[@]}" "$here/selftest.cpp" -o "$tmp/selftest"
g++ "${flags[@]}" -DOPS_CU="\"$tmp/ops_base.cu\"" "$here/check_ops.cpp" -o "$tmp/base"
g++ "${flags[@]}" -DOPS_CU="\"$root/kernels/cuda/ops.cu\"" "$here/check_ops.cpp" -o "$tmp/head"
"$tmp/selftest"
# Kernels that claim the bits of others in the same file (run where ops.cu has them).
if grep -q "vime_adamw_multi" "$root/kernels/cuda/ops.cu"; then
    g++ "${flags[@]}" "$here/check_adamw_multi.cpp" -o "$tmp/adamw_multi"
    "$tmp/adamw_multi"
fi
if grep -q "vime_widen_add_multi" "$root/kernels/cuda/ops.cu"; then
    g++ "${flags[@]}" "$here/check_widen_add.cpp" -o "$tmp/widen_add"
    "$tmp/widen_add"
fi
if grep -q "vime_gather_rows16" "$root/kernels/cuda/ops.cu"; then
    g++ "${flags[@]}" "$here/check_gather_rows.cpp" -o "$tmp/gather_rows"
    "$tmp/gather_rows"
fi
"$tmp/base" "$tmp/base.bin" 2>"$tmp/base.log"
"$tmp/head" "$tmp/head.bin" 2>"$tmp/head.log"
python3 - "$tmp/base.bin" "$tmp/head.bin" "$tmp/head.log" "$base" <<'PY'
import sys
def records(path):
    data = open(path, "rb").read()
    out, i = [], 0
    while i < len(data):
        j = data.index(b"\n", i)
        name, n = data[i:j].decode().rsplit(" ", 1)
        n = int(n)
        out.append((name, data[j + 1:j + 1 + n]))
        i = j + 1 + n + 1
    return out
a, b = records(sys.argv[1]), records(sys.argv[2])
cases = [l.split(" ", 1)[1].strip() for l in open(sys.argv[3]) if l.startswith("case ")]
bad = []
if len(a) != len(b):
    bad.append(f"{len(a)} outputs against {len(b)}")
case, k = None, 0
for (na, da), (nb, db) in zip(a, b):
    if na != nb or da != db:
        diff = sum(x != y for x, y in zip(da, db)) + abs(len(da) - len(db))
        bad.append(f"output #{k} {na}: {diff} bytes differ")
    k += 1
print(f"{len(cases)} cases, {len(a)} outputs compared against {sys.argv[4]}'s ops.cu")
for m in bad:
    print("  DIFFERS:", m)
print("SIM VERDICT:", "FAIL" if bad else "PASS")
sys.exit(1 if bad else 0)
PY
