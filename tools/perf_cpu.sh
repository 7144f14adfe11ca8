#!/usr/bin/env bash
# tools/perf_cpu.sh - the CPU sweeps behind docs/PERFORMANCE.md: chorus against Gloo in one
# job per collective (4 local ranks, float32), over shared memory and over sockets.
# Usage: tools/perf_cpu.sh OUTDIR [PYTHON]   (writes OUTDIR/<name>.txt and .json)
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
bench all_reduce -o all_reduce -b 8 -e 256M -f 2 -n 10 -w 3
bench others -o all_gather,reduce_scatter,broadcast,alltoall -b 8 -e 64M -f 4 -n 10 -w 3
CHORUS_SHM_DISABLE=1 bench socket -o all_reduce,all_gather,reduce_scatter,broadcast,alltoall -b 8 -e 64M -f 4 -n 10 -w 3
