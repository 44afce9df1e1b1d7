#!/usr/bin/env python3
"""Splits the timed steps of a CUPTI trace (scripts/gpu/cupti_trace.c's output) into GPU busy time
by op class and the GPU's idle gaps, and says what the host was doing in the largest gaps.

    python3 scripts/gpu/timeline.py trace.txt [--steps N] [--top 15]

Steps: a training step ends with its optimizer (a run of vime_adamw* kernels); the last N steps
(default: all but the first two) are the intervals between consecutive optimizer ends. For each:
  wall    the interval
  busy    the union of kernel, memcpy and memset intervals in it
  idle    wall - busy: the GPU had nothing to run (launch gaps, host syncs, host work)
Classes come from scripts/gpu/kernel_classes.py. With driver API records (CUPTI_TRACE_API=1)
the largest gaps list the API calls that were running on the host while the GPU waited, and the
"launch-bound" line counts kernels that started within 3 us of their launch call's return after
the GPU had been idle (the host, not the GPU, set their start).
"""
import os
import re
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_classes import CLASSES, short  # noqa: E402

OPT = re.compile(r"vime_adamw")


def classify(name):
    for cls, pat in CLASSES:
        if pat.search(name):
            return cls
    return "other"


def main():
    path = sys.argv[1]
    top = int(sys.argv[sys.argv.index("--top") + 1]) if "--top" in sys.argv else 15
    want = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else None
    ops, apis = [], []  # (start, end, kind, name, corr)
    for line in open(path, errors="replace"):
        p = line.rstrip("\n").split(" ", 5)
        if p[0] == "K" and len(p) == 6:
            ops.append((int(p[1]), int(p[2]), "K", p[5], int(p[4])))
        elif p[0] in ("C", "S") and len(p) >= 6:
            ops.append((int(p[1]), int(p[2]), p[0], ("memcpy " if p[0] == "C" else "memset ") + p[5], int(p[4])))
        elif p[0] == "A" and len(p) >= 5:
            apis.append((int(p[1]), int(p[2]), int(p[3]), p[4]))
    if not ops:
        sys.exit(f"{path}: no kernel records")
    ops.sort()
    apis.sort()
    api_by_corr = {a[2]: a for a in apis}
    # Optimizer run ends: the last adamw kernel before a non-adamw kernel.
    ends = []
    for i, o in enumerate(ops):
        if o[2] == "K" and OPT.search(o[3]):
            nxt = next((x for x in ops[i + 1:] if x[2] == "K"), None)
            if nxt is None or not OPT.search(nxt[3]):
                ends.append(o[1])
    if len(ends) < 2:
        sys.exit(f"{path}: {len(ends)} optimizer steps found, need at least 2")
    n = want or max(1, len(ends) - 2)
    n = min(n, len(ends) - 1)
    bounds = list(zip(ends[-n - 1:-1], ends[-n:]))
    print(f"{path}: {len(ops)} GPU ops, {len(apis)} API records, {len(ends)} optimizer steps; "
          f"the last {n} steps")
    tot = defaultdict(float)
    cls_t = defaultdict(float)
    cls_n = defaultdict(int)
    ker_t = defaultdict(float)
    ker_n = defaultdict(int)
    gaps = []  # (gap ns, prev op, next op)
    launch_bound = 0
    kernels_in = 0
    for a, b in bounds:
        inside = [o for o in ops if o[0] >= a and o[0] < b]
        busy, cur_end, prev = 0, a, None
        for o in inside:
            s, e = o[0], min(o[1], b)
            if s > cur_end:
                gaps.append((s - cur_end, prev, o))
                api = api_by_corr.get(o[4])
                if api and s - api[1] < 3000:
                    launch_bound += 1
            busy += max(0, e - max(s, cur_end))
            cur_end = max(cur_end, e)
            prev = o
            name = short(o[3]) if o[2] == "K" else o[3].split(" ")[0]
            c = classify(o[3]) if o[2] == "K" else o[3].split(" ")[0]
            cls_t[c] += e - s
            cls_n[c] += 1
            ker_t[name] += e - s
            ker_n[name] += 1
            kernels_in += o[2] == "K"
        tot["wall"] += b - a
        tot["busy"] += busy
    ms = lambda ns: ns / n / 1e6  # noqa: E731  per step, in ms
    wall, busy = ms(tot["wall"]), ms(tot["busy"])
    print(f"per step: wall {wall:.2f} ms, GPU busy {busy:.2f} ms, idle {wall - busy:.2f} ms "
          f"({100 * (wall - busy) / wall:.1f} %), {kernels_in / n:.0f} kernels")
    print("busy time by class (ms per step, ops per step):")
    for c, t in sorted(cls_t.items(), key=lambda x: -x[1]):
        print(f"  {c:18s} {ms(t):9.2f} ms  {cls_n[c] / n:7.0f}")
    sizes = [g[0] for g in gaps]
    for lo, hi in [(0, 2000), (2000, 10000), (10000, 100000), (100000, 10**12)]:
        sel = [x for x in sizes if lo <= x < hi]
        print(f"  gaps {lo / 1000:g}-{hi / 1000:g} us: {len(sel) / n:.0f} per step, {ms(sum(sel)):.2f} ms")
    if apis:
        print(f"  kernels started within 3 us of their launch's return after an idle GPU "
              f"(launch-bound): {launch_bound / n:.0f} per step")
    print(f"top {top} kernels (ms per step, count per step):")
    for k, t in sorted(ker_t.items(), key=lambda x: -x[1])[:top]:
        print(f"  {ms(t):8.2f} {ker_n[k] / n:6.0f}  {k}")
    print(f"top {top} gaps (us; the op before, the op after; host API calls running in the gap):")
    for g, p, o in sorted(gaps, key=lambda x: -x[0])[:top]:
        pn = short(p[3]) if p else "(step start)"
        line = f"  {g / 1000:9.1f}  after {pn[:50]}  before {short(o[3])[:50]}"
        if apis:
            lo, hi = (p[1] if p else o[0] - g), o[0]
            busy_api = defaultdict(int)
            for s, e, _, nm in apis:
                if e > lo and s < hi:
                    busy_api[nm] += min(e, hi) - max(s, lo)
            tops = sorted(busy_api.items(), key=lambda x: -x[1])[:3]
            line += "  | " + ", ".join(f"{nm} {t / 1000:.0f}" for nm, t in tops)
        print(line)
    if apis:
        a0, b0 = bounds[0][0], bounds[-1][1]
        per = defaultdict(lambda: [0, 0])
        for s, e, _, nm in apis:
            if s >= a0 and s < b0:
                per[nm][0] += 1
                per[nm][1] += e - s
        print("host API calls per step (count, ms):")
        for nm, (c, t) in sorted(per.items(), key=lambda x: -x[1][1])[:12]:
            print(f"  {nm:36s} {c / n:7.0f} {ms(t):8.2f}")


if __name__ == "__main__":
    main()
