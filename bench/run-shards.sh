#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench/run-shards.sh BUILD_DIR OUT_DIR — issue 31's tables: tallyd's shards against the plain
# ZeroMQ echo (loadgen --serve-echo) and Redis, small requests, in one run. Writes
# OUT_DIR/shards.md:
#   1. hist u8 64 B, 1 KiB, 4 KiB; 8 and 16 producers x 64 in flight; ipc and tcp; no stream and
#      256 named streams (loadgen --streams 256: spread over the shards); tallyd on SHARDS
#      (default: its default, the cores less the I/O threads and one) beside the echo server
#      with the same ZeroMQ I/O threads (IO_THREADS, default 4, both sides);
#   2. one producer, one in flight, 4 KiB: tallyd's p50 against the echo's, LAT_ROUNDS (default
#      5) rounds of echo then tallyd, interleaved; the summary gives the median of the rounds'
#      p50s (a single round moved by 10-20 us between calls: bench/NOTES.md) and their range;
#   3. scaling: 64 B, 16 producers x 64, ipc, 256 streams, tallyd at 1, 2, 4, 8 and 16 shards
#      (SCALE_SHARDS), with the requests per second each shard answered (loadgen's "per shard"
#      line: an imbalance shows);
#   4. the same load with more ZeroMQ I/O threads on both sides (IO_MORE, default 8) beside
#      `redis-benchmark -t incr,hset -P 64 -c 16` against Debian's redis-server on this host,
#      when both are installed;
#   5. several fronts (issue 31: one ROUTER socket and its thread bound the echo itself): 64 B,
#      16 producers x 64, ipc, 256 streams, IO_MORE I/O threads, tallyd on FRONTS_SHARDS shards
#      (default 4: a front needs 2 or more) with N endpoints, its bind and N-1 fronts (`front`:
#      a socket and a thread each), beside the echo with N endpoints each with a socket and a
#      thread of its own (loadgen --echo-fronts), for N in FRONTS (default "1 2 4"); producer p
#      connects to endpoint p mod N (loadgen --endpoint EP0,EP1,...). SKIP_FRONTS=1 leaves it out.
# tallyd runs --backend auto (small batches on the CPU) with --max-inflight 4096, so that 16 x 64
# requests in flight stay under every connection's fair share (at the default 64 they would be
# answered `busy`). SECONDS_PER_RUN (default 1) sets each row's measured time. About 100 s on the
# 16-core host at the defaults (36 + 21 runs of 1.3 s, Redis's 2 x 2 M commands).
#
# BASE_TALLYD=path (another build's tallyd, e.g. main's) runs beside this one in sections 1-3,
# its rows labelled "base" and interleaved with this build's, so that both meet the same moment of
# the host (an A/B in one run: bench/NOTES.md, "The front's instructions and wake-ups"); the summary then
# gives its ratios too. SKIP_MORE=1 leaves out section 4; ONLY_MORE=1 runs sections 4 and 5 alone
# (another FRONTS_SHARDS, in a minute rather than two).
#
# Then OUT_DIR/shards-summary.md, the issue's tables computed from those rows (tallyd / echo,
# the scaling against 1 shard x N, p50 - echo p50, tallyd / Redis INCR) with each shard's busy
# seconds (tallyd_shard_busy_seconds_total, from `tally stats` after the run: a shard near the
# run's length is saturated, shards well under it leave the bound to the front and ZeroMQ).
set -uo pipefail
# shellcheck source-path=SCRIPTDIR source=bench-env.sh
. "$(dirname "$0")/bench-env.sh"
bench_setup shards 1
IO=${IO_THREADS:-4}
IO_MORE=${IO_MORE:-8}
SCALE=${SCALE_SHARDS:-1 2 4 8 16}
REDIS_N=${REDIS_N:-2000000}
LAT_ROUNDS=${LAT_ROUNDS:-5}

BASE=${BASE_TALLYD:-}
FRONTS=${FRONTS:-1 2 4}
FRONTS_SHARDS=${FRONTS_SHARDS:-4}
TD_EXTRA=() # more tallyd arguments (section 5: its fronts)

# tallyd NAME SHARDS IO [BINARY]: a tallyd (this build's, or BINARY) on ipc and tcp (a random
# port); its pid in TD_PID.
tallyd_up() {
  local name=$1 shards=$2 io=$3 bin=${4:-$TD} port=$((5800 + RANDOM % 100))
  local args=(--backend auto --shm off --log-level warning --max-inflight 4096 --io-threads "$io"
    "${TD_EXTRA[@]}")
  [ "$shards" != default ] && args+=(--shards "$shards")
  [ "$bin" != "$TD" ] && port=$((5900 + RANDOM % 100))
  "$bin" --bind "ipc://$RUN/$name.ipc" --bind "tcp://127.0.0.1:$port" "${args[@]}" \
    2>"$OUT/tallyd-$name.log" &
  TD_PID=$!
  pids+=("$TD_PID")
  TCP_EP=tcp://127.0.0.1:$port
  # Ready when it answers a ping (20 s at most: a CUDA start takes a few seconds).
  for _ in $(seq 1 100); do
    "$TALLY" -e "ipc://$RUN/$name.ipc" -t 200 ping >/dev/null 2>&1 && return 0
    kill -0 "$TD_PID" 2>/dev/null || break
    sleep 0.2
  done
  echo "tallyd $name did not answer a ping (tallyd-$name.log)" >&2
  return 1
}
# busy NAME: each shard's busy seconds and requests answered so far (tally stats), one line.
busy() {
  "$TALLY" -e "ipc://$RUN/$1.ipc" stats 2>/dev/null | awk '
    /^tallyd_shard_busy_seconds_total\{/ { b = b sprintf(" %.2f", $2) }
    /^tallyd_shard_requests_total\{/ { r = r " " $2 }
    END { printf "busy s per shard:%s; requests per shard:%s\n", b, r }'
}
tallyd_down() {
  kill "$TD_PID" 2>/dev/null
  wait "$TD_PID" 2>/dev/null
}
echo_up() { # IO
  "$LG" --echo-io-threads "$1" --echo-reply 2048 --serve-echo "ipc://$RUN/echo.ipc" \
    tcp://127.0.0.1:5799 >/dev/null 2>&1 &
  ECHO_PID=$!
  pids+=("$ECHO_PID")
  sleep 1
}
echo_down() {
  kill "$ECHO_PID" 2>/dev/null
  wait "$ECHO_PID" 2>/dev/null
}
lg() { # label endpoint op size producers window extra...
  local label=$1 ep=$2 op=$3 size=$4 p=$5 w=$6
  shift 6
  # A run that hangs costs 20 s more than its length, not the step's whole time.
  timeout $((${T%.*} + 20)) "$LG" --endpoint "$ep" --op "$op" --size "$size" --producers "$p" \
    --window "$w" --seconds "$T" --label "$label" "$@" 2>>"$OUT/shards.err" ||
    echo "| $label | FAILED |"
}

# Section 4: more I/O threads on both sides, and Redis beside them.
more_and_redis() {
  echo "## 4. $IO_MORE I/O threads on both sides, 64 B, 16 producers x 64, ipc, and Redis"
  echo
  bench_table_header
  echo_up "$IO_MORE"
  lg "echo" "ipc://$RUN/echo.ipc" echo 64 16 64 | grep '^| '
  echo_down
  tallyd_up more "${SHARDS:-default}" "$IO_MORE"
  lg "tallyd" "ipc://$RUN/more.ipc" hist 64 16 64 --streams 256
  busy more
  lg "tallyd, no stream" "ipc://$RUN/more.ipc" hist 64 16 64
  tallyd_down
  echo
  if command -v redis-server >/dev/null && command -v redis-benchmark >/dev/null &&
    redis-server --version >/dev/null 2>&1; then
    redis-server --port 6390 --save "" --appendonly no >"$OUT/redis.log" 2>&1 &
    pids+=($!)
    for _ in $(seq 1 50); do
      redis-cli -p 6390 ping 2>/dev/null | grep -q PONG && break
      sleep 0.1
    done
    echo "redis-benchmark -t incr,hset -P 64 -c 16 -n $REDIS_N (Redis $(redis-server --version |
      sed -n 's/.*v=\([0-9.]*\).*/\1/p'); one thread executes):"
    timeout 60 redis-benchmark -p 6390 -t incr,hset -P 64 -c 16 -n "$REDIS_N" -q 2>&1 |
      tr '\r' '\n' | grep -E "requests per second" | tail -2
    redis-cli -p 6390 shutdown nosave >/dev/null 2>&1
  else
    echo "redis-server or redis-benchmark not installed (or not runnable): no Redis row"
  fi
  echo
}

{
  echo "# Shards against the echo and Redis ($(nproc) cores, $(date -u +%F))"
  echo
  if [ "${ONLY_MORE:-0}" != 1 ]; then
    echo "## 1. hist u8, P producers x 64, tallyd (shards: ${SHARDS:-default}) and the echo," \
      "$IO I/O threads each"
    echo
    bench_table_header
    if [ -n "$BASE" ]; then
      tallyd_up base "${SHARDS:-default}" "$IO" "$BASE"
      BASE_PID=$TD_PID BASE_TCP=$TCP_EP
    fi
    tallyd_up main "${SHARDS:-default}" "$IO"
    echo_up "$IO"
    for tr in ipc tcp; do
      td_ep=ipc://$RUN/main.ipc
      ec_ep=ipc://$RUN/echo.ipc
      base_ep=ipc://$RUN/base.ipc
      [ $tr = tcp ] && td_ep=$TCP_EP && ec_ep=tcp://127.0.0.1:5799 && base_ep=${BASE_TCP:-}
      for size in 64 1024 4096; do
        for p in 8 16; do
          lg "$tr echo" "$ec_ep" echo $size $p 64 | grep '^| '
          lg "$tr tallyd" "$td_ep" hist $size $p 64 | grep '^| '
          [ -n "$BASE" ] && lg "$tr base" "$base_ep" hist $size $p 64 | grep '^| '
          lg "$tr tallyd 256 streams" "$td_ep" hist $size $p 64 --streams 256 | grep '^| '
          [ -n "$BASE" ] && lg "$tr base 256 streams" "$base_ep" hist $size $p 64 --streams 256 |
            grep '^| '
        done
      done
    done
    echo
    echo "## 2. One producer, one in flight, 4 KiB, ipc (p50: tallyd - echo)"
    echo
    bench_table_header
    for ((round = 1; round <= LAT_ROUNDS; round++)); do
      lg "ipc echo" "ipc://$RUN/echo.ipc" echo 4096 1 1
      lg "ipc tallyd" "ipc://$RUN/main.ipc" hist 4096 1 1
      [ -n "$BASE" ] && lg "ipc base" "ipc://$RUN/base.ipc" hist 4096 1 1
    done
    if [ -n "$BASE" ]; then
      kill "$BASE_PID" 2>/dev/null
      wait "$BASE_PID" 2>/dev/null
    fi
    echo_down
    tallyd_down
    echo
    echo "## 3. Scaling: hist u8 64 B, 16 producers x 64, ipc, 256 streams, $IO I/O threads"
    echo
    bench_table_header
    echo_up "$IO"
    lg "echo" "ipc://$RUN/echo.ipc" echo 64 16 64 | grep '^| '
    echo_down
    for n in $SCALE; do
      tallyd_up "s$n" "$n" "$IO"
      lg "$n shards" "ipc://$RUN/s$n.ipc" hist 64 16 64 --streams 256
      busy "s$n"
      tallyd_down
      [ -n "$BASE" ] || continue
      tallyd_up "b$n" "$n" "$IO" "$BASE"
      lg "$n shards base" "ipc://$RUN/b$n.ipc" hist 64 16 64 --streams 256
      busy "b$n"
      tallyd_down
    done
    echo
  fi
  [ "${SKIP_MORE:-0}" = 1 ] && exit 0
  more_and_redis
  [ "${SKIP_FRONTS:-0}" = 1 ] && exit 0
  echo "## 5. Several fronts: 64 B, 16 producers x 64, ipc, 256 streams, $IO_MORE I/O threads," \
    "tallyd on $FRONTS_SHARDS shards; N endpoints each with a socket and a thread, both sides"
  echo
  bench_table_header
  for n in $FRONTS; do
    eps=() tds=() TD_EXTRA=()
    for ((i = 0; i < n; i++)); do
      eps+=("ipc://$RUN/echo-$n-$i.ipc")
      ((i > 0)) && TD_EXTRA+=(--front "ipc://$RUN/fronts$n-$i.ipc") &&
        tds+=("ipc://$RUN/fronts$n-$i.ipc")
    done
    "$LG" --echo-io-threads "$IO_MORE" --echo-reply 2048 --echo-fronts --serve-echo "${eps[@]}" \
      >/dev/null 2>&1 &
    ECHO_PID=$!
    pids+=("$ECHO_PID")
    sleep 1
    lg "echo $n endpoints" "$(IFS=,; echo "${eps[*]}")" echo 64 16 64 | grep '^| '
    echo_down
    if tallyd_up "fronts$n" "$FRONTS_SHARDS" "$IO_MORE"; then
      lg "tallyd $n endpoints" "$(IFS=,; echo "ipc://$RUN/fronts$n.ipc${tds[*]:+,${tds[*]}}")" \
        hist 64 16 64 --streams 256
      busy "fronts$n"
      tallyd_down
    fi
    TD_EXTRA=()
  done
  echo
} 2>&1 | tee "$MD"


# The issue's tables from the rows above (each section's rows by their labels).
awk -v shards="${SHARDS:-default}" -v io="$IO" -v io_more="$IO_MORE" '
function cell(i) { gsub(/^ +| +$/, "", F[i]); return F[i] }
function ratio(a, b) { return (a > 0 && b > 0) ? sprintf("%.2f", a / b) : "-" }
function median(L, n,    i, j, t) { # sorts L[1..n] in place (a few rounds: insertion sort)
  if (n == 0) return ""
  for (i = 2; i <= n; i++) for (j = i; j > 1 && L[j - 1] + 0 > L[j] + 0; j--) {
    t = L[j]; L[j] = L[j - 1]; L[j - 1] = t }
  return (n % 2) ? L[(n + 1) / 2] + 0 : (L[n / 2] + L[n / 2 + 1]) / 2
}
function spread(L, n) { return n ? sprintf("%s-%s", L[1], L[n]) : "-" } # after median()
/^## / { sec = substr($2, 1, 1) + 0; next }
/^\| / && !/^\| run \|/ && !/^\|---/ {
  split($0, F, "|"); label = cell(2); size = cell(4); pw = cell(5); rps = cell(6) + 0
  p50 = cell(8)
  if (sec == 1) {
    split(label, L, " "); tr = L[1]; split(pw, W, " "); key = tr SUBSEP size SUBSEP W[1]
    if (!(key in seen)) { seen[key] = 1; order[++nk] = key }
    if (label ~ /echo$/) echo[key] = rps
    else if (label ~ /base 256 streams$/) base_named[key] = rps
    else if (label ~ /streams$/) named[key] = rps
    else if (label ~ /base$/) { base[key] = rps; hb = 1 }
    else td[key] = rps
  } else if (sec == 2) { # the p50 of every round, one list a kind
    if (label ~ /echo/) le[++ne] = p50; else if (label ~ /base/) lb[++nb] = p50
    else lt[++nt] = p50
  } else if (sec == 3) {
    if (label == "echo") scale_echo = rps
    else if (label ~ /base/) { n = label + 0; bsc[n] = rps; last = "b" n; bper = 1 }
    else { n = label + 0; sc[n] = rps; sorder[++ns] = n; last = n }
  } else if (sec == 5) { # "echo N endpoints", "tallyd N endpoints"
    split(label, L, " "); n = L[2] + 0
    if (!(n in fseen)) { fseen[n] = 1; forder[++nf] = n }
    if (L[1] == "echo") fecho[n] = rps; else ftd[n] = rps
  } else if (sec == 4) {
    if (label == "echo") more_echo = rps
    else if (label ~ /no stream/) more_plain = rps
    else more_td = rps
  }
  next
}
/^per shard/ && sec == 3 { per[last] = $0; sub(/.*req\/s: */, "", per[last]) }
/^busy s per shard/ { b = $0; sub(/^busy s per shard: */, "", b); sub(/;.*/, "", b)
  if (sec == 3) busy[last] = b; else if (sec == 5) fbusy[forder[nf]] = b; else more_busy = b }
/requests per second/ { r = $2 + 0; if ($1 ~ /INCR/) incr = r; else if ($1 ~ /HSET/) hset = r }
END {
  printf "### Shards (issue 31): tallyd against the echo, %s I/O threads each, tallyd shards: %s\n\n", io, shards
  print "| transport | size | P x 64 | echo req/s | tallyd req/s | tallyd / echo | 256 streams req/s | streams / echo |"
  print "|---|---|---|---|---|---|---|---|"
  for (i = 1; i <= nk; i++) {
    split(order[i], K, SUBSEP); k = order[i]
    printf "| %s | %s | %s | %.0f | %.0f | %s | %.0f | %s |\n", K[1], K[2], K[3], echo[k], td[k],
      ratio(td[k], echo[k]), named[k], ratio(named[k], echo[k])
  }
  if (hb) {
    print "\nThe same rows, base (BASE_TALLYD) interleaved with them:\n"
    print "| transport | size | P x 64 | tallyd / echo | base / echo | tallyd / base | streams: tallyd / echo | base / echo | tallyd / base |"
    print "|---|---|---|---|---|---|---|---|---|"
    for (i = 1; i <= nk; i++) {
      split(order[i], K, SUBSEP); k = order[i]
      printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", K[1], K[2], K[3],
        ratio(td[k], echo[k]), ratio(base[k], echo[k]), ratio(td[k], base[k]),
        ratio(named[k], echo[k]), ratio(base_named[k], echo[k]), ratio(named[k], base_named[k])
    }
  }
  p50t = median(lt, nt); p50e = median(le, ne); p50b = median(lb, nb)
  printf "\n4 KiB, one producer, one in flight, ipc, the median of %d rounds: p50 tallyd %s us (rounds %s), echo %s us (%s), difference %s us\n",
    nt, p50t, spread(lt, nt), p50e, spread(le, ne),
    (p50t != "" && p50e != "") ? sprintf("%+.1f", p50t - p50e) : "-"
  if (p50b != "") printf "base: p50 %s us (rounds %s), difference %+.1f us\n", p50b, spread(lb, nb), p50b - p50e
  printf "\n### Scaling: hist u8 64 B, 16 producers x 64, ipc, 256 streams (echo: %.0f req/s)\n\n", scale_echo
  print "| shards | req/s | / 1 shard | / linear | / echo | req/s per shard | busy s per shard | base req/s | base / echo | base busy s per shard |"
  print "|---|---|---|---|---|---|---|---|---|---|"
  for (i = 1; i <= ns; i++) {
    n = sorder[i]
    printf "| %d | %.0f | %s | %s | %s | %s | %s | %s | %s | %s |\n", n, sc[n], ratio(sc[n], sc[1]),
      ratio(sc[n], sc[1] * n), ratio(sc[n], scale_echo), per[n], busy[n],
      bper ? sprintf("%.0f", bsc[n]) : "-", ratio(bsc[n], scale_echo), bper ? busy["b" n] : "-"
  }
  if (nf) {
    printf "\n### Several fronts: 64 B, 16 producers x 64, ipc, 256 streams, %s I/O threads, N endpoints each with a socket and a thread\n\n", io_more
    print "| endpoints | echo req/s | tallyd req/s | tallyd / echo | echo / Redis INCR | tallyd / Redis INCR | tallyd busy s per shard |"
    print "|---|---|---|---|---|---|---|"
    for (i = 1; i <= nf; i++) {
      n = forder[i]
      printf "| %d | %.0f | %.0f | %s | %s | %s | %s |\n", n, fecho[n], ftd[n], ratio(ftd[n], fecho[n]),
        ratio(fecho[n], incr), ratio(ftd[n], incr), fbusy[n]
    }
  }
  if (more_echo == "") exit
  printf "\n### %s I/O threads on both sides, 64 B, 16 producers x 64, ipc\n\n", io_more
  print "| what | req/s | / echo | / Redis INCR |"
  print "|---|---|---|---|"
  printf "| echo | %.0f | 1.00 | %s |\n", more_echo, ratio(more_echo, incr)
  printf "| tallyd, 256 streams | %.0f | %s | %s |\n", more_td, ratio(more_td, more_echo), ratio(more_td, incr)
  printf "| tallyd, no stream | %.0f | %s | %s |\n", more_plain, ratio(more_plain, more_echo), ratio(more_plain, incr)
  if (incr) printf "| Redis INCR -P 64 -c 16 | %.0f | %s | 1.00 |\n", incr, ratio(incr, more_echo)
  if (hset) printf "| Redis HSET -P 64 -c 16 | %.0f | %s | %s |\n", hset, ratio(hset, more_echo), ratio(hset, incr)
  if (more_busy != "") printf "\ntallyd busy s per shard (256 streams run): %s\n", more_busy
}' "$MD" >"$OUT/shards-summary.md"
echo
cat "$OUT/shards-summary.md"
