#!/usr/bin/env bash
# tools/trace_cost.sh - what the flight recorder costs small all_reduce calls.
#
# One build of tests/c's bench_comm, run with the recorder on (CHORUS_TRACE_BUFFER_SIZE=2000,
# the default) and off (0), float32-sum all_reduce of TC_BYTES bytes over shared memory and
# over sockets (CHORUS_SHM_DISABLE=1). Each round runs both settings back to back, their
# order flipping from round to round (ABBA), so that drift of the machine hits both alike.
# Prints per transport the median time per call of each setting and "paired", the median
# of the per-round ratios on/off (the steadier figure on a small shared machine).
#
# TC_BASELINE=DIR compares with another checkout instead (e.g. one from before the recorder
# existed): the "off" runs then use DIR's bench_comm, built into $TC_BUILD-baseline.
#
# Usage: tools/trace_cost.sh [ROUNDS [ITERS]]     (defaults 21 rounds, 2000 calls per run)
# Environment: TC_RANKS (4), TC_TRANSPORTS ("shm socket"), TC_BYTES (8), TC_PIN (1: pin rank r
# to the r-th usable CPU, BENCH_PIN of bench_comm), TC_BUILD (tests/c/build-trace-cost).
# Output ends with one line per transport:
#   RESULT transport=shm ranks=4 bytes=8 on_us=.. off_us=.. paired=.. rounds=..
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/.." && pwd)
rounds=${1:-21}
iters=${2:-2000}
ranks=${TC_RANKS:-4}
transports=${TC_TRANSPORTS:-shm socket}
bytes=${TC_BYTES:-8}
pin=${TC_PIN:-1}
build=${TC_BUILD:-$root/tests/c/build-trace-cost}
log=$(mktemp -d "${TMPDIR:-/tmp}/trace_cost.XXXXXX")
trap 'rm -rf "$log"' EXIT

make -s -C "$root/tests/c" BUILD="$build" bench_comm >"$log/build" 2>&1 || {
  cat "$log/build" >&2
  exit 1
}
off_bin=$build/bench_comm
if [ -n "${TC_BASELINE:-}" ]; then
  off_bin=$build-baseline/bench_comm
  make -s -C "$TC_BASELINE/tests/c" BUILD="$build-baseline" bench_comm >"$log/build" 2>&1 || {
    cat "$log/build" >&2
    exit 1
  }
  echo "off = $TC_BASELINE's bench_comm" >&2
fi

run_one() { # size-of-ring transport
  local shm_off=0 t bin=$build/bench_comm
  [ "$2" = socket ] && shm_off=1
  [ "$1" = 0 ] && bin=$off_bin
  if CHORUS_TRACE_BUFFER_SIZE=$1 CHORUS_SHM_DISABLE=$shm_off BENCH_ITERS=$iters BENCH_PIN=$pin \
      "$bin" "$ranks" "$bytes" "$bytes" >"$log/out" 2>"$log/err"; then
    t=$(awk '$2 == "B" && $4 == "us" { print $3; exit }' "$log/out")
    [ -n "$t" ] && { echo "$t"; return 0; }
  fi
  cat "$log/out" "$log/err" >&2
  return 1
}
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

for ((r = 1; r <= rounds; r++)); do
  for tr in $transports; do
    if ((r % 2)); then order="2000 0"; else order="0 2000"; fi
    for n in $order; do
      t=$(run_one "$n" "$tr") || exit 1
      echo "$t" >>"$log/$tr-$n"
      eval "t_$n=\$t"
    done
    echo "$t_2000 $t_0" | awk '{ print $1 / $2 }' >>"$log/$tr-pair"
    echo "round $r $tr: on $t_2000 us, off $t_0 us" >&2
  done
done
printf '%-9s %5s %10s %10s %7s\n' transport ranks "on (us)" "off (us)" paired
for tr in $transports; do
  on=$(median <"$log/$tr-2000")
  off=$(median <"$log/$tr-0")
  pair=$(median <"$log/$tr-pair")
  printf '%-9s %5s %10.2f %10.2f %7.4f\n' "$tr" "$ranks" "$on" "$off" "$pair"
done
for tr in $transports; do
  echo "RESULT transport=$tr ranks=$ranks bytes=$bytes on_us=$(median <"$log/$tr-2000")" \
    "off_us=$(median <"$log/$tr-0") paired=$(median <"$log/$tr-pair" | awk '{ printf "%.4f", $1 }')" \
    "rounds=$rounds"
done
