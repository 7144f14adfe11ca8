#!/usr/bin/env bash
# tools/perf_cpu.sh - the CPU sweeps behind docs/PERFORMANCE.md: chorus against Gloo in one
# job per collective (4 local ranks, float32), over shared memory and over sockets.
# Usage: tools/perf_cpu.sh OUTDIR [PYTHON]   (writes OUTDIR/<name>-<band>.txt and .json)
set -u
out=${1:?usage: tools/perf_cpu.sh OUTDIR [PYTHON]}
py=${2:-python3}
mkdir -p "$out"
export GLOO_SOCKET_IFNAME=lo CHORUS_SOCKET_IFNAME==lo
bench() { # name, then bench arguments
  local name=$1
  shift
  echo "== $name: chorus.bench $*" >&2
  "$py" -m chorus.bench --nproc 4 --compare gloo --json "$out/$name.json" "$@" >"$out/$name.txt" 2>"$out/$name.err"
  echo "   exit $? ($(grep -c . "$out/$name.txt") lines)" >&2
}
# Each sweep runs in three bands of sizes, one job each: up to 64 KB with 100 timed
# iterations (with 10, one late wake-up doubled a row: 32 KB in place took 108.6 us in one
# 16-core run against 40..55 us in the others), to 16 MB with the bench's defaults (20), and
# the largest with 10 (Gloo's 256 MB all-reduce takes about 0.2 s a call there).
bands() { # name, ops, factor, largest, then extra bench arguments
  local name=$1 ops=$2 f=$3 max=$4
  shift 4
  bench "$name-1" -o "$ops" -b 8 -e 64K -f "$f" -n 100 -w 20 "$@"
  bench "$name-2" -o "$ops" -b 128K -e 16M -f "$f" -n 20 -w 5 "$@"
  bench "$name-3" -o "$ops" -b 32M -e "$max" -f "$f" -n 10 -w 3 "$@"
}
bands all_reduce all_reduce 2 256M
bands others all_gather,reduce_scatter,broadcast,alltoall 4 64M
CHORUS_SHM_DISABLE=1 bands socket all_reduce,all_gather,reduce_scatter,broadcast,alltoall 4 64M
