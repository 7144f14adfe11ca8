#!/usr/bin/env python3
"""Markdown tables for docs/PERFORMANCE.md from the JSON records that tools/perf_cpu.sh
writes (python -m chorus.bench --compare gloo --json), with each job's single-core memcpy
figure from the header of its output beside the JSON (NAME.txt, as perf_cpu.sh keeps it).

Usage: python3 tools/perf_table.py DIR [NAME ...]   (default names: all_reduce others socket;
NAME.json, or else the bands NAME-*.json of one sweep, merged)

For every collective in a file: one row per size with chorus's and gloo's time (out-of-place
and in-place, microseconds), the speed-up (gloo time / chorus time; with equal bytes this is
also the busbw ratio) and chorus's in-place busbw. Sizes with a speed-up below 1 are marked.
"""
import json
import os
import re
import sys

MEMCPY = re.compile(r"memcpy \(1 core\): ([\d.]+) GB/s")


def human(n):
    for unit, k in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k}{unit}"
    return str(n)


def table(records):
    by = {}
    for r in records:
        if r.get("backend") not in ("chorus", "gloo"):
            continue
        by.setdefault(r["op"], {})[(r["backend"], r["bytes"], bool(r["inplace"]))] = r
    out = []
    for op, rows in by.items():
        sizes = sorted({b for (_, b, _) in rows})
        out.append(f"**{op}**\n")
        out.append("| size | chorus us | gloo us | speed-up | chorus us (in-place) | "
                   "gloo us (in-place) | speed-up (in-place) | chorus busbw GB/s |")
        out.append("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for b in sizes:
            cells = [human(b)]
            for ip in (False, True):
                c, g = rows.get(("chorus", b, ip)), rows.get(("gloo", b, ip))
                if not c or not g or c.get("time_us") is None or g.get("time_us") is None:
                    cells += ["n/a", "n/a", "-"]
                    continue
                x = g["time_us"] / c["time_us"]
                mark = " (slower)" if x < 1 else ""
                cells += [f"{c['time_us']:.1f}", f"{g['time_us']:.1f}", f"{x:.2f}x{mark}"]
            c = rows.get(("chorus", b, True)) or rows.get(("chorus", b, False))
            cells.append(f"{c['busbw_gbps']:.2f}" if c and c.get("busbw_gbps") is not None
                         else "n/a")
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main(argv):
    if not argv:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    d, names = argv[0], argv[1:] or ["all_reduce", "others", "socket"]
    for name in names:
        # NAME.json, or the bands NAME-1.json, NAME-2.json, ... of one sweep
        paths = [os.path.join(d, name + ".json")]
        if not os.path.exists(paths[0]):
            paths = sorted(os.path.join(d, f) for f in os.listdir(d)
                           if f.startswith(name + "-") and f.endswith(".json"))
        if not paths:
            print(f"perf_table: no {name}.json or {name}-*.json in {d}", file=sys.stderr)
            return 1
        records, mems = [], []
        for path in paths:
            with open(path) as f:
                rs = json.load(f)
            records += rs
            txt = path[:-len(".json")] + ".txt"  # the job's stdout: the header has memcpy
            if os.path.exists(txt):
                with open(txt) as f:
                    m = MEMCPY.search(f.read())
                if m:
                    mems.append(f"{float(m.group(1)):.2f}")
        print(f"### {name}\n")
        if mems:
            print(f"memcpy (1 core, one figure per job): {', '.join(mems)} GB/s\n")
        print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
