#!/usr/bin/env bash
# tools/fp_cost.sh - what the cross-rank call fingerprint costs small all_reduce calls.
#
# Builds tests/c's bench_comm twice, as shipped and with -DCHORUS_NO_FINGERPRINT (a
# measurement-only switch that compiles the fingerprint out: see csrc/core/msg.c and
# csrc/core/algo/shm_direct.c), then times float32-sum all_reduce of FP_BYTES bytes over
# shared memory (the direct-access algorithms: shm_fp) and over sockets
# (CHORUS_SHM_DISABLE=1: message algorithms, msg_hdr). Each round runs every build once
# per transport and rank count, the order of the two builds flipping from round to round
# (ABBA), so that drift and noise of the machine hit both alike. Per transport and rank
# count it prints the median time per call of each build over the rounds and their ratio
# (with fingerprint / without); "paired" is the median of the per-round ratios, the
# steadier of the two on a shared or small machine (a round's two runs are back to back,
# so slow drift cancels in their ratio).
#
# Usage: tools/fp_cost.sh [ROUNDS [ITERS]]     (defaults 41 rounds, 2000 calls per run)
# Environment:
#   FP_RANKS="4"            rank counts, space separated (e.g. "2 4")
#   FP_TRANSPORTS="shm socket"
#   FP_BYTES=8              message size
#   FP_PIN=1                pin rank r to the r-th usable CPU, round robin (BENCH_PIN of
#                           bench_comm): on a small machine unpinned oversubscribed ranks
#                           land in run-to-run scheduling modes up to 2x apart; 0 = unpinned
#   FP_AA=1                 A/A check: build the second binary without the switch too, so
#                           the ratio shows this machine's noise floor
#   FP_BUILD_ROOT=DIR       where the two builds go (default tests/c: build-fp, build-nofp)
#   CC (the compiler of both builds) and CHORUS_* variables pass through.
# Output ends with one line per transport and rank count, for scripts:
#   RESULT transport=shm ranks=4 bytes=8 with_us=.. without_us=.. ratio=.. paired=.. rounds=..
# Exit status: 0, or 1 when a build or a run failed.
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/.." && pwd)
rounds=${1:-41}
iters=${2:-2000}
ranks_list=${FP_RANKS:-4}
transports=${FP_TRANSPORTS:-shm socket}
bytes=${FP_BYTES:-8}
pin=${FP_PIN:-1}
build_root=${FP_BUILD_ROOT:-$root/tests/c}
on_dir=$build_root/build-fp
off_dir=$build_root/build-nofp
off_flags=-DCHORUS_NO_FINGERPRINT
if [ "${FP_AA:-0}" = 1 ]; then
  off_dir=$build_root/build-fp-aa
  off_flags=
fi
case "$rounds$iters" in *[!0-9]*) echo "usage: tools/fp_cost.sh [ROUNDS [ITERS]]" >&2; exit 2 ;; esac
[ "$rounds" -ge 1 ] && [ "$iters" -ge 1 ] || { echo "ROUNDS and ITERS must be >= 1" >&2; exit 2; }

log=$(mktemp -d "${TMPDIR:-/tmp}/fp_cost.XXXXXX")
trap 'rm -rf "$log"' EXIT

# The two builds in parallel; each make prints nothing unless it fails.
echo "building bench_comm: $on_dir (as shipped), $off_dir (EXTRA_CFLAGS=$off_flags)" >&2
make -s -C "$root/tests/c" ${CC:+CC="$CC"} BUILD="$on_dir" EXTRA_CFLAGS= bench_comm >"$log/build-on" 2>&1 &
p1=$!
make -s -C "$root/tests/c" ${CC:+CC="$CC"} BUILD="$off_dir" EXTRA_CFLAGS="$off_flags" bench_comm >"$log/build-off" 2>&1 &
p2=$!
ok=1
wait $p1 || { echo "build failed ($on_dir):" >&2; cat "$log/build-on" >&2; ok=0; }
wait $p2 || { echo "build failed ($off_dir):" >&2; cat "$log/build-off" >&2; ok=0; }
[ $ok = 1 ] || exit 1

# One run: prints the microseconds per call.
run_one() { # binary transport ranks
  local shm_off=0 t
  [ "$2" = socket ] && shm_off=1
  for attempt in 1 2; do
    if CHORUS_SHM_DISABLE=$shm_off BENCH_ITERS=$iters BENCH_PIN=$pin \
        "$1" "$3" "$bytes" "$bytes" >"$log/out" 2>"$log/err"; then
      t=$(awk '$2 == "B" && $4 == "us" { print $3; exit }' "$log/out")
      if [ -n "$t" ]; then
        echo "$t"
        return 0
      fi
    fi
    echo "run failed (attempt $attempt): $1 $3 $bytes $bytes on $2" >&2
    cat "$log/out" "$log/err" >&2
  done
  return 1
}

median() { sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

echo "$rounds rounds x $iters calls of $bytes-byte all_reduce, ranks: $ranks_list, transports: $transports, pinned: $pin" >&2
for ((r = 1; r <= rounds; r++)); do
  line="round $r:"
  for n in $ranks_list; do
    for tr in $transports; do
      key=$tr-$n
      if ((r % 2)); then order="on off"; else order="off on"; fi
      for b in $order; do
        if [ $b = on ]; then bin=$on_dir/bench_comm; else bin=$off_dir/bench_comm; fi
        t=$(run_one "$bin" "$tr" "$n") || exit 1
        echo "$t" >>"$log/$key-$b"
        eval "t_$b=\$t"
      done
      echo "$t_on $t_off" | awk '{ print $1 / $2 }' >>"$log/$key-pair"
      line="$line  $key $t_on/$t_off"
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
