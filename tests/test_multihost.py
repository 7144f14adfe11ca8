"""Two simulated hosts on this machine (tests/simhosts.py: a network and a UTS namespace each,
joined by a veth pair), 2 ranks on each, launched with `torchrun --nnodes=2 --nproc-per-node=2`
per host with the rendezvous over the veth network. One job checks:

- every collective and point-to-point op is correct on 2 hosts x 2 ranks (tests/workers/
  multihost.py computes every expected value itself);
- Chorus sees two hosts: each rank's CHORUS_DEBUG=INFO log says `via shm` for the peer on its
  own simulated host and `via socket` for the two on the other one, under the simulated
  host names;
- the sockets between hosts use the veth's IPv6 address (CHORUS_SOCKET_FAMILY=AF_INET6, the
  interface chosen by a prefix on host a and by an exclusion on host b, NCCL_SOCKET_IFNAME),
  striped over 4 TCP connections per channel (the default between hosts);
- performance, one rank per host, 256 MiB (MH_PERF_BYTES), measured interleaved in one job
  (median of 3 rounds each): all_reduce busbw against a plain TCP connection between the
  same namespaces, one way (and, printed for comparison, both ways at once). The test holds
  busbw to issue 7's bar, at least 80% of the one-way rate, and measures up to 3 times: the
  machine's other jobs take CPU from one measurement or the other (on this 2-core machine the
  default, a ring over 4 TCP connections per peer, measured 1.03-1.15 of the one-way rate on
  an idle machine; docs/PERFORMANCE.md, "Multi-host TCP").

Skipped, saying why, only where network namespaces cannot be created (not root, no `ip`)."""
import glob
import json
import os
import re
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import simhosts  # noqa: E402

WORKER = os.path.join(HERE, "workers", "multihost.py")
PERF_BYTES = int(os.environ.get("MH_PERF_BYTES", str(256 << 20)))
BAR_ONE_WAY = 0.80  # issue 7: all_reduce busbw / plain single-stream TCP, one way


@pytest.fixture(scope="module")
def hosts():
    why = simhosts.missing_capability()
    if why:
        pytest.skip(why)
    h = simhosts.SimHosts()
    try:
        h.setup()
    except simhosts.NamespacesUnavailable as e:
        h.teardown()
        pytest.skip(f"network namespaces cannot be created here: {e}")
    except BaseException:
        h.teardown()
        raise
    yield h
    h.teardown()


def host_env(hosts, outdir, h, extra=None):
    env = {
        "MH_OUT": outdir,
        "CHORUS_DEBUG": "INFO",
        "CHORUS_DEBUG_SUBSYS": "INIT,NET",
        "CHORUS_DEBUG_FILE": os.path.join(outdir, "%h.%p.log"),
        "CHORUS_SOCKET_FAMILY": "AF_INET6",
        "MH_PEER_ADDR": hosts.ipv6["b"],
        # host a: a prefix; host b: everything but loopback, through the NCCL name
        "CHORUS_SOCKET_IFNAME": simhosts.PREFIX + "v" if h == "a" else None,
        "NCCL_SOCKET_IFNAME": "^lo" if h == "b" else None,
    }
    env.update(extra or {})
    return {k: v for k, v in env.items() if v is not None}


def run_job(hosts, outdir, nproc, extra=None):
    codes = simhosts.run_torchrun_job(
        hosts, WORKER, nproc, outdir, host_env(hosts, outdir, "a", extra),
        host_env(hosts, outdir, "b", extra), timeout=300)
    if codes != {"a": 0, "b": 0}:
        tails = []
        for f in sorted(glob.glob(os.path.join(outdir, "*.log"))):
            with open(f, errors="replace") as fh:
                tails.append(f"--- {os.path.basename(f)}\n" + fh.read()[-3000:])
        pytest.fail(f"torchrun exit codes {codes}\n" + "\n".join(tails))
    results = {}
    for f in glob.glob(os.path.join(outdir, "rank*.json")):
        with open(f) as fh:
            r = json.load(fh)
        results[r["rank"]] = r
    return results


def rank_logs(outdir):
    """{rank: log text} from the CHORUS_DEBUG_FILE logs (lines 'host:pid:rank chorus ...')."""
    logs = {}
    for f in glob.glob(os.path.join(outdir, "simhost-*.log")):
        with open(f, errors="replace") as fh:
            text = fh.read()
        m = re.search(r"^[^:\s]+:\d+:(\d+) chorus", text, re.M)
        if m:
            logs.setdefault(int(m.group(1)), "")
            logs[int(m.group(1))] += text
    return logs


def test_multihost_every_collective_shm_inside_tcp_between(hosts):
    with tempfile.TemporaryDirectory(prefix="chorus-mh-") as outdir:
        os.chmod(outdir, 0o777)
        results = run_job(hosts, outdir, 2, {"MH_PERF_BYTES": "0"})
        assert sorted(results) == [0, 1, 2, 3], f"rank results: {sorted(results)}"
        host_of = {r: results[r]["host"] for r in results}
        assert host_of[0] == host_of[1] == hosts.hostname["a"], host_of
        assert host_of[2] == host_of[3] == hosts.hostname["b"], host_of
        failed = {(r, name): err for r in results for name, err in results[r]["checks"].items() if err}
        assert not failed, "\n".join(f"rank {r} {name}: {err}" for (r, name), err in failed.items())
        names = set(results[0]["checks"])
        assert names == {"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter",
                         "alltoall", "send_recv", "gather_scatter", "barrier"}, names

        logs = rank_logs(outdir)
        assert sorted(logs) == [0, 1, 2, 3], f"logs found for ranks {sorted(logs)}"
        for r, text in logs.items():
            mine = r // 2
            for p in range(4):
                if p == r:
                    continue
                want = "shm" if p // 2 == mine else "socket"
                host = hosts.hostname["a" if p < 2 else "b"]
                pat = rf"INIT peer {p} \({re.escape(host)}\) via (\w+)"
                m = re.search(pat, text)
                assert m, f"rank {r}: no '{pat}' in its log:\n{text[-2000:]}"
                assert m.group(1) == want, f"rank {r} reaches rank {p} via {m.group(1)}, not {want}"
            # IPv6 on the veth, chosen by IFNAME, striped over 2 connections between hosts
            me_h = "a" if mine == 0 else "b"
            adv = re.search(r"socket: listening on port \d+, advertising (\S+) \(interface (\S+)\)", text)
            assert adv, f"rank {r}: no 'advertising' line"
            assert adv.group(1).startswith(f"[{hosts.ipv6[me_h]}]:"), adv.group(0)
            assert adv.group(2) == hosts.ifname[me_h], adv.group(0)
            for p in (range(2, 4) if mine == 0 else range(0, 2)):
                assert re.search(rf"socket: peer {p} \(\S+ on \S+\): 4 TCP connections per channel, "
                                 r"striped in \d+-byte chunks", text), \
                    f"rank {r}: no striping line for peer {p}"


def test_multihost_allreduce_busbw_vs_plain_tcp(hosts):
    """One rank per host (see the module docstring)."""
    attempts = []
    for attempt in range(3):
        with tempfile.TemporaryDirectory(prefix="chorus-mhperf-") as outdir:
            os.chmod(outdir, 0o777)
            results = run_job(hosts, outdir, 1, {
                "MH_PERF_BYTES": str(PERF_BYTES), "MH_PERF_ROUNDS": "3", "MH_CHECKS": "0",
                "CHORUS_DEBUG": "WARN",
                # the two simulated hosts share this machine's cores; a waiting rank that
                # spins takes them from the other host's kernel work
                "CHORUS_SPIN_COUNT": "0"})
            perf = results[0]["perf"]
            attempts.append(perf)
            print(f"multihost perf attempt {attempt + 1}: plain TCP {perf['plain_GBps']:.2f} GB/s "
                  f"one way, {perf['bidir_GBps']:.2f} GB/s each way both at once; all_reduce "
                  f"busbw {perf['allreduce_busbw_GBps']:.2f} GB/s = {perf['ratio']:.2f} x one-way, "
                  f"{perf['ratio_bidir']:.2f} x both-ways")
            if perf["ratio"] >= BAR_ONE_WAY:
                return
    pytest.fail("all_reduce busbw below %.0f%% of plain TCP one way in %d attempts: %s" % (
        BAR_ONE_WAY * 100, len(attempts),
        [{k: round(a[k], 2) for k in ("allreduce_busbw_GBps", "bidir_GBps", "plain_GBps")}
         for a in attempts]))
