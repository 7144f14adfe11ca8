"""Start N rank processes of a worker script on 127.0.0.1 and collect what they did.

Each rank is a real process (env:// rendezvous through RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT),
in its own session so that a hard timeout can kill it and everything it started. Output goes to
files, not pipes, so a chatty rank can never block on a full pipe.
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(REPO, "tests", "workers")


def backend_under_test():
    """The torch.distributed backend the suite checks (gloo serves to validate the harness)."""
    return os.environ.get("CHORUS_TEST_BACKEND", "chorus")


def free_port():
    # Bind to port 0 on loopback and hand the number to rank 0's TCPStore. The tiny window
    # between close and rebind is acceptable on a test machine.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(world_size, port, extra=None):
    env = dict(os.environ)
    env.update(
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        # 4 ranks share 2 cores: intra-op threads would only fight each other.
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONDONTWRITEBYTECODE="1",
    )
    env.setdefault("CHORUS_TEST_BACKEND", backend_under_test())
    # Tests talk over loopback only, never over the machine's real interfaces.
    env.setdefault("CHORUS_SOCKET_IFNAME", "=lo")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if extra:
        for k, v in extra.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = str(v)
    return env


@dataclass
class RankResult:
    rank: int
    returncode: int
    output: str


@dataclass
class JobResult:
    name: str
    world_size: int
    ranks: list = field(default_factory=list)
    timed_out: bool = False
    wall_s: float = 0.0

    @property
    def ok(self):
        return not self.timed_out and all(r.returncode == 0 for r in self.ranks)

    def describe(self, tail_chars=4000):
        lines = [
            f"job {self.name!r}: world_size={self.world_size} wall={self.wall_s:.1f}s"
            + (" TIMED OUT (killed)" if self.timed_out else "")
        ]
        for r in self.ranks:
            out = r.output
            if len(out) > tail_chars:
                out = "...[cut]...\n" + out[-tail_chars:]
            lines.append(f"--- rank {r.rank} exit code {r.returncode} ---\n{out}")
        return "\n".join(lines)

    def results(self):
        """The JSON of each rank's `RESULT ...` line (what a worker prints for its test to
        judge), by rank; asserts that every rank printed one."""
        out = {}
        for r in self.ranks:
            m = re.search(r"^RESULT (.*)$", r.output, re.M)
            assert m, self.describe()
            out[r.rank] = json.loads(m.group(1))
        return out


def _kill_group(proc, sig):
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


class Job:
    """A running multi-rank job. Use start(); then wait() or kill()."""

    def __init__(self, name, script, world_size, args=(), env=None, workdir=None):
        self.name = name
        self.world_size = world_size
        # a directory made here is removed once the logs are read (CHORUS_TEST_KEEP_LOGS=1
        # keeps it); one the caller names is the caller's
        self.own_workdir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="chorus-test-")
        port = free_port()
        self.procs, self.logs = [], []
        self.t0 = time.monotonic()
        for rank in range(world_size):
            renv = base_env(world_size, port, env)
            renv["RANK"] = str(rank)
            renv["LOCAL_RANK"] = str(rank)
            renv["LOCAL_WORLD_SIZE"] = str(world_size)
            log_path = os.path.join(self.workdir, f"{name}.rank{rank}.log")
            log = open(log_path, "w+b")
            self.logs.append(log)
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, script, *map(str, args)],
                    env=renv,
                    cwd=REPO,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )

    def kill(self, sig=signal.SIGKILL):
        for p in self.procs:
            _kill_group(p, sig)

    def wait(self, timeout, grace_after_failure=30.0):
        """Waits for every rank. A rank that fails leaves the others grace_after_failure
        seconds (they may be blocked on it) before everything is killed."""
        deadline = self.t0 + timeout
        first_failure = None
        timed_out = False
        while True:
            codes = [p.poll() for p in self.procs]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if first_failure is None and any(c not in (None, 0) for c in codes):
                first_failure = now
            if now > deadline or (
                first_failure is not None and now > first_failure + grace_after_failure
            ):
                timed_out = now > deadline
                self.kill()
                for p in self.procs:
                    p.wait()
                break
            time.sleep(0.05)
        result = JobResult(self.name, self.world_size, timed_out=timed_out)
        result.wall_s = time.monotonic() - self.t0
        for rank, (p, log) in enumerate(zip(self.procs, self.logs)):
            # Kill leftovers the rank may have started (its session), then read its log.
            _kill_group(p, signal.SIGKILL)
            log.flush()
            log.seek(0)
            text = log.read().decode("utf-8", "replace")
            log.close()
            result.ranks.append(RankResult(rank, p.returncode, text))
        if self.own_workdir and os.environ.get("CHORUS_TEST_KEEP_LOGS", "0") in ("", "0"):
            shutil.rmtree(self.workdir, ignore_errors=True)
        return result


def run_job(name, script, world_size, args=(), env=None, timeout=300, workdir=None):
    """Runs a worker on world_size ranks and returns a JobResult (never raises on failure:
    callers assert and show result.describe())."""
    job = Job(name, script, world_size, args=args, env=env, workdir=workdir)
    return job.wait(timeout)


def run_reference_job(name, script, world_size, args=(), env=None, timeout=300, workdir=None,
                      attempts=3):
    """Like run_job, for a run of the reference backend (Gloo) whose results Chorus is compared
    with. Gloo's own teardown now and then aborts one rank after the work is done ("terminate
    called without an active exception", SIGABRT; seen in CI on torch 2.13.0): such a run is
    repeated, up to `attempts` times, so the reference's flake does not fail a Chorus test.
    Only deaths by signal are retried; a timeout or a non-zero exit is returned at once."""
    for attempt in range(1, attempts + 1):
        result = run_job(name, script, world_size, args=args, env=env, timeout=timeout,
                         workdir=workdir)
        crashed = [r.rank for r in result.ranks if r.returncode < 0]
        if result.ok or result.timed_out or not crashed or attempt == attempts:
            return result
        sys.stderr.write(f"reference job {name!r}: rank(s) {crashed} died by a signal "
                         f"(attempt {attempt} of {attempts}), running it again\n")
    return result


def chorus_shm_segments():
    """Names in /dev/shm that belong to Chorus (segments carry "chorus" in their name)."""
    try:
        return sorted(n for n in os.listdir("/dev/shm") if "chorus" in n.lower())
    except FileNotFoundError:
        return []
