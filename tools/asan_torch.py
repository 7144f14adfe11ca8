"""Multi-rank PyTorch jobs on a Chorus built with AddressSanitizer + UndefinedBehaviorSanitizer.

  python tools/asan_torch.py LIBDIR [--world 4] [--soak N]

LIBDIR holds the sanitized package (tools/asan_torch.sh builds it: CHORUS_SANITIZE=1
setup.py build). Every rank runs with the sanitizer runtimes preloaded (python itself is not
instrumented) and LIBDIR first on its path. Jobs, each on --world ranks:

  checks-shm, checks-socket   tests/workers/run_checks.py: every collective, dtype, op and
                              size class of the correctness suite, every result checked
  soak-shm                    tests/workers/soak.py: N random checked collectives (groups,
                              async)

A job passes when every rank exits 0, no sanitizer
report appears in any rank's output, and every check record is a pass. Leak detection is off
in these jobs: CPython and torch keep their allocations to the end by design, so a leak
report would be theirs; the C unit tests (make asan) check the core for leaks.
Exit status 0 when every job passed.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))

from launch import WORKERS, run_job  # noqa: E402

REPORT_MARKERS = ("ERROR: AddressSanitizer", "runtime error:", "ERROR: LeakSanitizer",
                  "SUMMARY: AddressSanitizer", "SUMMARY: UndefinedBehaviorSanitizer")


def runtime(name):
    path = subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True,
                          text=True, check=True).stdout.strip()
    if not os.path.isabs(path) or not os.path.exists(path):
        sys.exit(f"asan_torch: gcc does not know {name} (got {path!r})")
    return path


def sanitizer_env(libdir):
    return {
        "LD_PRELOAD": f"{runtime('libasan.so')}:{runtime('libubsan.so')}",
        "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode=98:"
                        "strict_string_checks=1:detect_stack_use_after_return=0",
        "UBSAN_OPTIONS": "halt_on_error=1:abort_on_error=0:exitcode=98:print_stacktrace=1",
        "PYTHONPATH": libdir + (os.pathsep + os.environ["PYTHONPATH"]
                                if os.environ.get("PYTHONPATH") else ""),
        # Sanitized code runs several times slower: roomier deadlines than the suite's.
        "CHORUS_TEST_PG_TIMEOUT": "120",
    }


def preflight(libdir, env):
    """The ranks must import the sanitized build, with the runtime loaded: a job that
    silently ran an ordinary build would prove nothing."""
    probe = ("import chorus._C as c, sys; maps = open('/proc/self/maps').read(); "
             "print(c.__file__); print('asan' if 'libasan' in maps else 'no-asan')")
    res = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=300)
    lines = res.stdout.split()
    if res.returncode != 0 or len(lines) != 2:
        sys.exit(f"asan_torch: importing chorus under the sanitizer failed:\n{res.stderr}")
    if not lines[0].startswith(libdir) or lines[1] != "asan":
        sys.exit(f"asan_torch: ranks would run {lines[0]} ({lines[1]}), not the sanitized build")
    nm = subprocess.run(["nm", "-D", lines[0]], capture_output=True, text=True)
    if "__asan_report" not in nm.stdout:
        sys.exit(f"asan_torch: {lines[0]} is not instrumented (no __asan_report symbols)")
    print(f"sanitized build: {lines[0]}", flush=True)


def reports(result):
    found = []
    for r in result.ranks:
        for line in r.output.splitlines():
            if any(m in line for m in REPORT_MARKERS):
                found.append(f"rank {r.rank}: {line.strip()}")
    return found


def check_records(out_dir, world):
    counts, bad = {}, []
    for rank in range(world):
        path = os.path.join(out_dir, f"rank{rank}.jsonl")
        if not os.path.exists(path):
            bad.append(f"rank {rank}: no records")
            continue
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                st = rec["status"]
                counts[st] = counts.get(st, 0) + 1
                if st == "family_done" and rec.get("detail"):
                    bad.append(f"rank {rank}: family {rec['family']} raised")
                elif st in ("fail", "error", "unsupported"):
                    bad.append(f"rank {rank}: {st} {rec.get('family')} {rec.get('detail')}")
    if not counts.get("pass"):
        bad.append("no check passed")
    return counts, bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("libdir")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--soak", type=int, default=1000)
    args = ap.parse_args()
    libdir = os.path.abspath(args.libdir)
    if not os.path.isdir(os.path.join(libdir, "chorus")):
        sys.exit(f"asan_torch: {libdir} holds no chorus package")
    env = sanitizer_env(libdir)
    preflight(libdir, env)
    n = args.world
    failures = 0
    with tempfile.TemporaryDirectory(prefix="chorus-asan-") as tmp:
        jobs = []
        for transport in ("shm", "socket"):
            out = os.path.join(tmp, f"checks-{transport}")
            os.makedirs(out)
            jobs.append((f"checks-{transport}", "run_checks.py", ["--out", out],
                         {"CHORUS_SHM_DISABLE": "1" if transport == "socket" else "0",
                          "CHORUS_BUFFSIZE": "65536", "CHORUS_SHM_SCRATCH": "65536"}, out))
        jobs.append(("soak-shm", "soak.py", [args.soak, args.soak // 4], {}, None))
        for name, script, jargs, jenv, out in jobs:
            res = run_job(f"asan-{name}", os.path.join(WORKERS, script), n, args=jargs,
                          env={**env, **jenv}, timeout=1500, workdir=tmp)
            problems = reports(res)
            if not res.ok:
                problems.append("exit codes " + ",".join(str(r.returncode) for r in res.ranks)
                                + (" (timed out)" if res.timed_out else ""))
            summary = ""
            if out:
                counts, bad = check_records(out, n)
                problems += bad
                summary = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
            elif script == "soak.py":
                okr = sum(f"SOAK_OK {args.soak}" in r.output for r in res.ranks)
                summary = f"SOAK_OK on {okr} of {n} ranks"
                if okr != n:
                    problems.append("soak did not finish on every rank")
            state = "ok" if not problems else "FAILED"
            print(f"{name:14s} {n} ranks, {res.wall_s:6.0f} s: {state}; {summary}", flush=True)
            if problems:
                failures += 1
                for p in problems[:20]:
                    print(f"    {p}")
                print(res.describe(tail_chars=3000))
    print(f"asan_torch: {len(jobs) - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
