#!/usr/bin/env python3
"""Multi-host TCP on one machine: plain single-stream TCP vs Chorus all_reduce between two
simulated hosts (network + UTS namespaces joined by a veth pair, tests/simhosts.py), one rank
per host started by `torchrun --nnodes=2`, measured interleaved in one job
(tests/workers/multihost.py, perf part). Needs root. Prints one line per configuration:

    python3 tools/multihost_bench.py [--bytes 256M] [--rounds 5] [--nsocks -1,1,2,4]
                                     [--family AF_INET|AF_INET6] [--nproc 1]
                                     [--python .venv/bin/python]

--nsocks runs one job per CHORUS_NSOCKS_PERTHREAD value (-1: the default). busbw of a
2-rank all_reduce is its algbw (2(n-1)/n = 1). CHORUS_SPIN_COUNT is 0 unless set: each
simulated host believes it has the machine's cores to itself, but they share them. The namespaces are removed at the end, also
after a failure."""
import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import simhosts  # noqa: E402


def size(text):
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text[:-1] if mult > 1 else text) * mult


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bytes", default="256M")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--nsocks", default="-1")
    ap.add_argument("--family", default="AF_INET", choices=["AF_INET", "AF_INET6"])
    ap.add_argument("--python", default=os.path.join(ROOT, ".venv", "bin", "python"))
    ap.add_argument("--nproc", type=int, default=1,
                    help="ranks per simulated host (> 1: the whole group's all_reduce is "
                         "timed too, in the same rounds)")
    ap.add_argument("--json", help="write the records here")
    a = ap.parse_args()
    why = simhosts.missing_capability()
    if why:
        sys.exit(f"multihost_bench: {why}")
    nbytes = size(a.bytes)
    records = []
    with simhosts.SimHosts() as hosts:
        peer = hosts.ipv6["b"] if a.family == "AF_INET6" else hosts.ipv4["b"]
        for ns in a.nsocks.split(","):
            with tempfile.TemporaryDirectory(prefix="chorus-mhbench-") as out:
                os.chmod(out, 0o777)
                env = {"MH_OUT": out, "MH_CHECKS": "0", "MH_PERF_BYTES": str(nbytes),
                       "MH_PERF_ROUNDS": str(a.rounds), "MH_PEER_ADDR": peer,
                       "CHORUS_SOCKET_FAMILY": a.family, "CHORUS_NSOCKS_PERTHREAD": ns,
                       "CHORUS_SOCKET_IFNAME": simhosts.PREFIX + "v",
                       # both simulated hosts share this machine's cores: a rank that spins
                       # while it waits takes them from the other host's kernel work
                       "CHORUS_SPIN_COUNT": os.environ.get("CHORUS_SPIN_COUNT", "0")}
                codes = simhosts.run_torchrun_job(
                    hosts, os.path.join(ROOT, "tests", "workers", "multihost.py"), a.nproc, out, env,
                    env, timeout=600, python=a.python)
                if codes != {"a": 0, "b": 0}:
                    for h in ("a", "b"):
                        with open(os.path.join(out, f"torchrun-{h}.log"), errors="replace") as f:
                            sys.stderr.write(f.read()[-3000:])
                    sys.exit(f"multihost_bench: torchrun exit codes {codes}")
                with open(os.path.join(out, "rank0.json")) as f:
                    p = json.load(f)["perf"]
            p["nsocks"] = int(ns)
            p["family"] = a.family
            records.append(p)
            print(f"{nbytes >> 20} MiB {a.family} NSOCKS_PERTHREAD={ns:>2}: plain TCP "
                  f"{p['plain_GBps']:.2f} GB/s one way, {p['bidir_GBps']:.2f} GB/s each way "
                  f"both at once; chorus all_reduce busbw {p['allreduce_busbw_GBps']:.2f} GB/s "
                  f"= {p['ratio']:.2f} x one-way, {p['ratio_bidir']:.2f} x both-ways "
                  f"(medians of {a.rounds} interleaved rounds)", flush=True)
            if "world" in p:
                print(f"  whole group, {a.nproc} ranks per host x 2 hosts: all_reduce busbw "
                      f"{p['world_busbw_GBps']:.2f} GB/s = {p['world_ratio']:.2f} x one-way",
                      flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
