"""Simulated hosts on one machine for the multi-host tests and tools: two network namespaces
joined by one veth pair whose ends are created directly inside them (no address, no link of
the test ever exists in the root namespace), each with loopback up and an IPv4 and an IPv6
(unique-local, fd00::/8) address on its veth end. A process runs "on" a host through
`ip netns exec NS unshare --uts`, which also gives it the host's own hostname, so Chorus (whose
host id is hostname + boot id) sees two hosts. /dev/shm stays shared, as between real
processes of one machine; that does not matter to Chorus.

Used by tests/test_multihost.py and tools/multihost_bench.py; `python tests/simhosts.py
--cleanup` removes namespaces a killed run left behind (names start with "chx")."""
import os
import shutil
import subprocess
import sys
import time

PREFIX = "chx"


def _run(argv, check=True):
    r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


class NamespacesUnavailable(RuntimeError):
    """`ip netns add` itself failed: this machine cannot make network namespaces."""


def missing_capability():
    """Why namespaces cannot be made here (a clear skip reason), or None if they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (the test runs as uid %d)" % os.geteuid()
    for tool in ("ip", "unshare"):
        if not shutil.which(tool):
            return f"the '{tool}' command is not installed (iproute2 / util-linux)"
    return None


class SimHosts:
    """Two simulated hosts, a and b. tag keeps names unique per run (interface names are at
    most 15 characters); net picks the third octet of 10.231.net.0/24 and the IPv6 subnet."""

    def __init__(self, tag=None, net=None):
        tag = tag if tag is not None else str(os.getpid() % 100000)
        net = net if net is not None else os.getpid() % 250 + 1
        self.ns = {"a": f"{PREFIX}{tag}a", "b": f"{PREFIX}{tag}b"}
        self.ifname = {"a": f"{PREFIX}v{tag}a", "b": f"{PREFIX}v{tag}b"}
        self.hostname = {"a": f"simhost-{tag}-a", "b": f"simhost-{tag}-b"}
        self.ipv4 = {"a": f"10.231.{net}.1", "b": f"10.231.{net}.2"}
        self.ipv6 = {"a": f"fd00:c405:{net:x}::1", "b": f"fd00:c405:{net:x}::2"}
        self.created = []

    def setup(self):
        """Creates both hosts; raises NamespacesUnavailable if no namespace can be made here,
        RuntimeError (with ip's message) if a later step fails."""
        for h in ("a", "b"):
            try:
                _run(["ip", "netns", "add", self.ns[h]])
            except RuntimeError as e:
                raise NamespacesUnavailable(str(e)) from e
            self.created.append(self.ns[h])
        a, b = self.ns["a"], self.ns["b"]
        # both ends born inside the namespaces
        _run(["ip", "-n", a, "link", "add", self.ifname["a"], "type", "veth", "peer", "name",
              self.ifname["b"], "netns", b])
        for h in ("a", "b"):
            ns, dev = self.ns[h], self.ifname[h]
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "addr", "add", self.ipv4[h] + "/24", "dev", dev])
            _run(["ip", "-n", ns, "-6", "addr", "add", self.ipv6[h] + "/64", "dev", dev, "nodad"])
            _run(["ip", "-n", ns, "link", "set", dev, "up"])
        self._wait_link()
        return self

    def _wait_link(self, timeout=10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            up = all("LOWER_UP" in _run(["ip", "-n", self.ns[h], "link", "show", self.ifname[h]]).stdout
                     for h in ("a", "b"))
            if up:
                return
            time.sleep(0.1)
        raise RuntimeError("the veth pair between %s and %s did not come up" % (self.ns["a"], self.ns["b"]))

    def teardown(self):
        """Deletes the namespaces (the veth ends go with them). Never raises."""
        for ns in reversed(self.created):
            try:
                _run(["ip", "netns", "delete", ns], check=False)
            except Exception as e:  # noqa: BLE001 - teardown must go on
                print(f"simhosts: deleting {ns}: {e}", file=sys.stderr)
        self.created = []

    def argv(self, host, argv):
        """The command line that runs argv on the given host, under its own hostname."""
        return ["ip", "netns", "exec", self.ns[host], "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.hostname[host]] + list(argv)

    def __enter__(self):
        try:
            return self.setup()
        except BaseException:
            self.teardown()
            raise

    def __exit__(self, *exc):
        self.teardown()


def run_torchrun_job(hosts, script, nproc, outdir, env_a, env_b, timeout=300, python=None):
    """Runs `torchrun --nnodes=2 --nproc-per-node=nproc script` on both hosts, node 0 on a
    (rendezvous: static, at a's IPv4 address over the veth). env_a / env_b are added to
    this process's environment for each host. Output of each host's torchrun goes to
    outdir/torchrun-<host>.log. Returns {host: exit code}; a job past timeout is killed
    (its whole process group) and reported as None."""
    python = python or sys.executable
    procs, logs = {}, {}
    port = 29400 + os.getpid() % 500
    for node, h in enumerate(("a", "b")):
        env = dict(os.environ)
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
        for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(k, None)
        env.update(env_a if h == "a" else env_b)
        argv = hosts.argv(h, [python, "-m", "torch.distributed.run", "--nnodes=2",
                              f"--nproc-per-node={nproc}", f"--node-rank={node}",
                              f"--master-addr={hosts.ipv4['a']}", f"--master-port={port}",
                              "--max-restarts=0", script])
        logs[h] = open(os.path.join(outdir, f"torchrun-{h}.log"), "wb")
        procs[h] = subprocess.Popen(argv, env=env, stdout=logs[h], stderr=subprocess.STDOUT,
                                    start_new_session=True)
    deadline = time.monotonic() + timeout
    codes = {}
    try:
        for h, p in procs.items():
            try:
                codes[h] = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[h] = None
    finally:
        for sig, wait in ((15, 10), (9, 30)):  # torchrun passes SIGTERM on to its workers
            for p in procs.values():
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, sig)
                    except ProcessLookupError:
                        pass
            for p in procs.values():
                try:
                    p.wait(timeout=wait)
                except subprocess.TimeoutExpired:
                    pass
        for f in logs.values():
            f.close()
    return codes


def existing():
    r = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.startswith(PREFIX)]


if __name__ == "__main__":
    if sys.argv[1:] == ["--cleanup"]:
        for ns in existing():
            _run(["ip", "netns", "delete", ns], check=False)
            print("deleted", ns)
    else:
        print(__doc__)
