#!/usr/bin/env bash
# tools/fp_cost.sh - what the cross-rank call fingerprint costs small all_reduce calls.
#
# Builds tests/c's bench_comm with -DCHORUS_FP_SWITCH, a measurement-only build in which the
# fingerprint can be switched off at run time (FP_OFF in csrc/core/core.h), and times
# float32-sum all_reduce of FP_BYTES bytes over shared memory (the direct-access
# algorithms: shm_fp) and over sockets (CHORUS_SHM_DISABLE=1: message algorithms, msg_hdr).
# Every run interleaves calls with and without the fingerprint (BENCH_FP_AB=FP_BLOCK: on,
# off, off, on, ... in blocks of FP_BLOCK calls, each call timed), so the two share the run's
# rank placement and scheduling, which on a small machine with more ranks than cores move
# the time of a whole run by up to 2x from one run to the next. A run gives the mean time
# per call of each kind and their ratio (with / without); per transport and rank count the
# script prints the median of the runs' means and their ratio, and "paired": the median of
# the per-run ratios, the figure to read (tests/test_fingerprint_cost.py bounds it).
#
# Usage: tools/fp_cost.sh [ROUNDS [ITERS]]     (defaults 100 runs of 2000 calls each)
# Environment:
#   FP_RANKS="4"            rank counts, space separated (e.g. "2 4")
#   FP_TRANSPORTS="shm socket"
#   FP_BYTES=8              message size
#   FP_BLOCK=1              calls per block of one kind
#   FP_PIN=1                pin rank r to the r-th usable CPU, round robin (BENCH_PIN of
#                           bench_comm); 0 = unpinned
#   FP_AA=1                 A/A check: time the shipped build the same way (its "off" calls
#                           keep the fingerprint), so the ratios show the method's noise
#   FP_BUILD_ROOT=DIR       where the builds go (default tests/c: build-fpsw, and build-fp
#                           for FP_AA)
#   CC (the compiler) and CHORUS_* variables pass through.
# Output ends with one line per transport and rank count, for scripts:
#   RESULT transport=shm ranks=4 bytes=8 with_us=.. without_us=.. ratio=.. paired=.. rounds=..
# Exit status: 0, or 1 when the build or a run failed.
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/.." && pwd)
rounds=${1:-100}
iters=${2:-2000}
ranks_list=${FP_RANKS:-4}
transports=${FP_TRANSPORTS:-shm socket}
bytes=${FP_BYTES:-8}
block=${FP_BLOCK:-1}
pin=${FP_PIN:-1}
build_root=${FP_BUILD_ROOT:-$root/tests/c}
dir=$build_root/build-fpsw
flags=-DCHORUS_FP_SWITCH
if [ "${FP_AA:-0}" = 1 ]; then
  dir=$build_root/build-fp
  flags=
fi
case "$rounds$iters$block" in *[!0-9]*) echo "usage: tools/fp_cost.sh [ROUNDS [ITERS]] (FP_BLOCK: a number)" >&2; exit 2 ;; esac
[ "$rounds" -ge 1 ] && [ "$iters" -ge 1 ] && [ "$block" -ge 1 ] ||
  { echo "ROUNDS, ITERS and FP_BLOCK must be >= 1" >&2; exit 2; }

log=$(mktemp -d "${TMPDIR:-/tmp}/fp_cost.XXXXXX")
trap 'rm -rf "$log"' EXIT

echo "building bench_comm: $dir (EXTRA_CFLAGS=$flags)" >&2
if ! make -s -C "$root/tests/c" ${CC:+CC="$CC"} BUILD="$dir" EXTRA_CFLAGS="$flags" bench_comm \
    >"$log/build" 2>&1; then
  echo "build failed ($dir):" >&2
  cat "$log/build" >&2
  exit 1
fi

# One run: prints "on off" (mean microseconds per call of each kind).
run_one() { # transport ranks
  local shm_off=0 t
  [ "$1" = socket ] && shm_off=1
  for attempt in 1 2; do
    if CHORUS_SHM_DISABLE=$shm_off BENCH_ITERS=$iters BENCH_PIN=$pin BENCH_FP_AB=$block \
        "$dir/bench_comm" "$2" "$bytes" "$bytes" >"$log/out" 2>"$log/err"; then
      t=$(awk '$2 == "B" && $3 == "fp" && $4 == "on" { print $5, $8; exit }' "$log/out")
      if [ -n "$t" ]; then
        echo "$t"
        return 0
      fi
    fi
    echo "run failed (attempt $attempt): bench_comm $2 $bytes $bytes on $1" >&2
    cat "$log/out" "$log/err" >&2
  done
  return 1
}

median() { sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

echo "$rounds runs x $iters calls of $bytes-byte all_reduce, fingerprint on/off in blocks of $block; ranks: $ranks_list, transports: $transports, pinned: $pin" >&2
for ((r = 1; r <= rounds; r++)); do
  line="run $r:"
  for n in $ranks_list; do
    for tr in $transports; do
      key=$tr-$n
      t=$(run_one "$tr" "$n") || exit 1
      set -- $t
      echo "$1" >>"$log/$key-on"
      echo "$2" >>"$log/$key-off"
      echo "$1 $2" | awk '{ print $1 / $2 }' >>"$log/$key-pair"
      line="$line  $key $1/$2"
    done
  done
  echo "$line" >&2
done

printf '%-9s %5s %14s %14s %7s %7s\n' transport ranks "with fp (us)" "without (us)" ratio paired
results=
for n in $ranks_list; do
  for tr in $transports; do
    key=$tr-$n
    on=$(median <"$log/$key-on")
    off=$(median <"$log/$key-off")
    pair=$(median <"$log/$key-pair")
    ratio=$(awk -v a="$on" -v b="$off" 'BEGIN { printf "%.4f", a / b }')
    printf '%-9s %5s %14.2f %14.2f %7.4f %7.4f\n' "$tr" "$n" "$on" "$off" "$ratio" "$pair"
    results="${results}RESULT transport=$tr ranks=$n bytes=$bytes with_us=$on without_us=$off ratio=$ratio paired=$(printf '%.4f' "$pair") rounds=$rounds
"
  done
done
printf '%s' "$results"
