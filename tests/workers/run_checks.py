"""Rank worker: runs the selected check families on one process group and records every
check in <out>/rank<r>.jsonl (see common.Recorder). Started by tests/launch.py, one process
per rank; the pytest side (tests/conftest.py) reads the records.

usage: run_checks.py --out DIR [--families a,b,...]
"""
import argparse
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch.distributed as dist  # noqa: E402

import families_coll  # noqa: E402
import families_misc  # noqa: E402
from common import Ctx, init_dist  # noqa: E402

ALL_FAMILIES = families_coll.FAMILIES + families_misc.FAMILIES + families_coll.LATE_FAMILIES


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--families", default="all")
    args = ap.parse_args()
    wanted = None if args.families == "all" else set(args.families.split(","))
    if wanted:
        unknown = wanted - {name for name, _, _ in ALL_FAMILIES}
        if unknown:
            sys.exit(f"unknown families: {sorted(unknown)}")

    rank, world = init_dist()
    ctx = Ctx(args.out, rank, world)
    for name, fn, min_world in ALL_FAMILIES:
        if (wanted and name not in wanted) or world < min_world:
            continue
        ctx.family = name
        error = None
        try:
            fn(ctx)
        except Exception:  # noqa: BLE001 - a harness bug must show, not end the job
            error = traceback.format_exc()
            print(f"rank {rank}: family {name} raised:\n{error}", file=sys.stderr, flush=True)
        ctx.family_done(name, error)
    ctx.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
