#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench/thread-cpu.sh PID SECONDS — where a process's CPU time goes, thread by thread, without
# perf (the GPU host has none): samples /proc/PID/task/*/stat (utime + stime, in clock ticks)
# twice, SECONDS apart, and prints each thread's name and share of one core over the interval,
# busiest first, with its voluntary context switches a second (/proc/PID/task/TID/status: how
# often it went to sleep waiting; threads handing work to each other show many with none at a
# core). A thread near 100 % is the bottleneck (tallyd's loop thread is "tallyd", the ZeroMQ I/O
# threads "ZMQbg/IO/N", the lane threads "td-lane..." ).
set -euo pipefail
pid=${1:?pid}
secs=${2:-2}
hz=$(getconf CLK_TCK)
sample() {
  for t in /proc/"$pid"/task/*; do
    [ -r "$t/stat" ] || continue
    # The name sits in parentheses and may hold spaces: cut after the last ')'.
    stat=$(cat "$t/stat" 2>/dev/null) || continue
    name=${stat#*(}
    name=${name%)*}
    rest=${stat##*) }
    set -- $rest
    sw=$(awk '/^voluntary_ctxt_switches/{print $2}' "$t/status" 2>/dev/null) || sw=0
    echo "${t##*/} $((${12} + ${13})) ${sw:-0} ${name// /_}"
  done
}
before=$(sample)
sleep "$secs"
after=$(sample)
join <(echo "$before" | sort) <(echo "$after" | sort) |
  awk -v hz="$hz" -v s="$secs" '{ pct = ($5 - $2) * 100 / hz / s; sw = ($6 - $3) / s
    printf "%6.1f %%  %s (tid %s, %.0f sleeps/s)\n", pct, $4, $1, sw }' |
  sort -rn
