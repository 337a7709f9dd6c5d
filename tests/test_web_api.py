# SPDX-License-Identifier: Apache-2.0
"""tallyd's HTTP JSON API (docs/web.md), against real tallyds:

  - every document is valid against web/schema/ (python3-jsonschema), and so is `tally query
    --json`'s output: a stream's record from the API equals the CLI's, for u8, i32, u16, rgb8,
    rgba8, a stream without a histogram, and names that need escaping in a URL ('/', '%', '?',
    '#', '+', and a name that is itself "%2F");
  - last= gives the window of `tally query --last`; quantiles= the nearest-rank quantiles;
  - every error status: 400 (bad parameter, bad name, bad window), 401 and 403 (the token
    rules: read-only without api_token_file, Bearer token for resets and deletes, basic auth
    for reads with auth_file), 404 (unknown stream, unknown path), 405, 503 (draining, and the
    event-stream bound);
  - resets and deletes through the request path (tallyd_requests_total counts them);
  - Server-Sent Events: the first events, an update after a batch, a deletion, no request
    deadline once streaming, the bound (max_sse_clients) and a place freed when a client goes,
    and the stream ended at shutdown;
  - the page's files: content types, the Content-Security-Policy, ETags and 304.

usage: test_web_api.py TALLYD TALLY SOURCE_DIR
"""

import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from web_common import (Daemon, Events, fail, free_port, quote, schema_checker,  # noqa: E402
                        write_secret)

TALLYD, TALLY, SRC = sys.argv[1], sys.argv[2], sys.argv[3]
TOKEN = "0123456789abcdef-test-token"
ODD_NAMES = ["a/b", "50%", "q?x=1", "h#1", "sp+c", "%2F", "x/../y", "\"q\\"]

check = schema_checker(SRC)


def le(values, width, signed=False):
    return b"".join(v.to_bytes(width, "little", signed=signed) for v in values)


def nearest_rank(values, q):
    s = sorted(values)
    rank = max(1, -(-round(q * 1e6) * len(s) // 1000000))
    return s[rank - 1]


def expect_error(d, method, path, status, code, headers=None):
    got, hdrs, body = d.request(method, path, headers)
    if got != status:
        fail("%s %s: %d, expected %d: %s" % (method, path, got, status, body[:200]))
    doc = json.loads(body)
    check(doc, "error", "%s %s" % (method, path))
    if doc["error"] != code:
        fail("%s %s: error %r, expected %r" % (method, path, doc["error"], code))
    return hdrs


def known_streams():
    rng = random.Random(24)
    u8 = [min(255, max(0, int(rng.gauss(100, 30)))) for _ in range(5000)]
    i32 = [int(rng.gauss(0, 400)) for _ in range(6000)]
    u16 = [rng.randrange(0, 3000) for _ in range(4000)]
    rgb = bytes(rng.randrange(256) for _ in range(3 * 700))
    rgba = bytes(rng.randrange(200) for _ in range(4 * 500))
    return u8, [("u8", bytes(u8), ["--type", "u8"]),
                ("i32", le(i32, 4, True), ["--type", "i32", "--range", "-1000", "1000"]),
                ("u16", le(u16, 2), ["--type", "u16", "--range", "0", "4096"]),
                ("rgb", rgb, ["--type", "rgb"]), ("rgba", rgba, ["--type", "rgba"])]


def test_records(d):
    u8, streams = known_streams()
    for name, payload, args in streams:
        d.hist(name, payload, *args)
    d.tally("scan", "--stream", "scan-only", "--out", os.devnull, data=le(range(100), 4, True))
    for name in ODD_NAMES:
        d.hist(name, bytes([len(name)] * 10))
    listing = d.get_json("/api/v1/streams")
    check(listing, "streams", "GET /api/v1/streams")
    names = [s["stream"] for s in listing["streams"]]
    want = [s[0] for s in streams] + ["scan-only"] + ODD_NAMES
    if names != want:
        fail("the list names %r, expected %r (creation order)" % (names, want))
    by_name = {s["stream"]: s for s in listing["streams"]}
    if by_name["u8"]["values"] != 5000 or by_name["u8"]["type"] != "u8" or \
            by_name["scan-only"]["type"] is not None or by_name["u8"]["updated_ms"] is None:
        fail("the list's entries: %r" % listing["streams"][:1])
    for name in want:
        api = d.get_json("/api/v1/streams/" + quote(name))
        cli = d.query(name)
        check(api, None, "GET %s" % name)
        check(cli, None, "tally query --json %s" % name)
        if api != cli:
            fail("the API's record of %r differs from tally query --json's" % name)
    # quantiles=: the nearest rank of the raw data (exact for u8), each once, in order
    q = d.get_json("/api/v1/streams/u8?quantiles=0.5,0.999,0.5,0,1")
    check(q, None, "quantiles=")
    expect = {"p50": nearest_rank(u8, 0.5), "p99.9": nearest_rank(u8, 0.999),
              "p0": nearest_rank(u8, 0), "p100": nearest_rank(u8, 1)}
    got = {k: v["value"] for k, v in q["quantiles"].items()}
    if got != expect or list(q["quantiles"]) != ["p50", "p99.9", "p0", "p100"] or \
            [v["q"] for v in q["quantiles"].values()] != [0.5, 0.999, 0, 1]:
        fail("quantiles=: %r, expected %r" % (q["quantiles"], expect))
    # last=: the window of tally query --last (all sent within the minute: the same counts)
    w = d.get_json("/api/v1/streams/i32?last=60s")
    cli = d.query("i32", "--last", "60s")
    check(w, None, "last=60s")
    if "window" not in w or w["count"] != cli["count"] or w["bins"] != cli["bins"]:
        fail("last=60s: %r vs the CLI's %r" % ({k: w.get(k) for k in ("window", "count")},
                                               {k: cli.get(k) for k in ("window", "count")}))
    print("ok: records, list, quantiles, window, odd names (%d streams)" % len(want))


def test_errors(d):
    expect_error(d, "GET", "/api/v1/streams/nope", 404, "unknown_stream")
    expect_error(d, "GET", "/api/v1/nothing", 404, "not_found")
    expect_error(d, "GET", "/api/v1/streams/u8/bins", 404, "not_found")
    expect_error(d, "GET", "/api/v1/streams/" + "x" * 65, 400, "stream_name")
    expect_error(d, "GET", "/api/v1/streams/a%00b", 400, "stream_name")
    expect_error(d, "GET", "/api/v1/streams/a%zz", 400, "stream_name")
    expect_error(d, "GET", "/api/v1/streams/a%20b", 400, "stream_name")
    for query in ("last=abc", "last=-1s", "last=", "quantiles=1.5", "quantiles=a",
                  "quantiles=" + ",".join("0.%03d" % i for i in range(65)), "foo=1", "last"):
        expect_error(d, "GET", "/api/v1/streams/u8?" + query, 400, "bad_parameter")
    expect_error(d, "GET", "/api/v1/streams?last=1s", 400, "bad_parameter")
    expect_error(d, "GET", "/api/v1/streams/u8?last=2h", 400, "bad_window")
    expect_error(d, "GET", "/api/v1/events?last=2h", 400, "bad_window")
    hdrs = expect_error(d, "PUT", "/api/v1/streams/u8", 405, "method_not_allowed")
    if hdrs.get("allow") != "GET, HEAD, DELETE":
        fail("405 without the right Allow: %r" % hdrs.get("allow"))
    expect_error(d, "GET", "/api/v1/streams/u8/reset", 405, "method_not_allowed")
    expect_error(d, "POST", "/api/v1/streams", 405, "method_not_allowed")
    expect_error(d, "GET", "/api/v1/streams/nope/events", 404, "unknown_stream")
    print("ok: 400, 404, 405")


def requests_total(d, op):
    status, _, body = d.request("GET", "/metrics")
    for line in body.decode().splitlines():
        if line.startswith('tallyd_requests_total{op="%s",status="ok"}' % op):
            return int(float(line.split()[-1]))
    return 0


def test_token(d, tmp):
    auth = {"Authorization": "Bearer " + TOKEN}
    hdrs = expect_error(d, "POST", "/api/v1/streams/u8/reset", 401, "unauthorized")
    if not hdrs.get("www-authenticate", "").startswith("Bearer"):
        fail("401 without WWW-Authenticate: Bearer")
    expect_error(d, "POST", "/api/v1/streams/u8/reset", 401, "unauthorized",
                 {"Authorization": "Bearer wrong-" + TOKEN})
    expect_error(d, "DELETE", "/api/v1/streams/u8", 401, "unauthorized",
                 {"Authorization": "Basic " + TOKEN})
    expect_error(d, "POST", "/api/v1/streams/nope/reset", 404, "unknown_stream", auth)
    before = requests_total(d, "reset")
    status, _, body = d.request("POST", "/api/v1/streams/" + quote("a/b") + "/reset", auth)
    doc = json.loads(body)
    check(doc, "done", "reset")
    if status != 200 or doc != {"stream": "a/b", "reset": True}:
        fail("reset: %d %r" % (status, doc))
    if d.query("a/b")["count"] != 0 or requests_total(d, "reset") != before + 1:
        fail("the reset did not go through the request path")
    status, _, body = d.request("DELETE", "/api/v1/streams/" + quote("50%"), auth)
    if status != 200 or json.loads(body) != {"stream": "50%", "deleted": True}:
        fail("delete: %d %r" % (status, body))
    expect_error(d, "GET", "/api/v1/streams/" + quote("50%"), 404, "unknown_stream")
    print("ok: token rules, reset and delete through the request path")


def test_read_only_and_basic(tmp):
    """Without a token the API is read-only (403); with auth_file reads need basic auth (or
    the token), and a token file others may read is refused at start."""
    d = Daemon(TALLYD, TALLY, tmp, name="readonly")
    d.hist("cam", bytes(range(256)))
    expect_error(d, "POST", "/api/v1/streams/cam/reset", 403, "forbidden",
                 {"Authorization": "Bearer " + TOKEN})
    expect_error(d, "DELETE", "/api/v1/streams/cam", 403, "forbidden")
    d.stop()
    auth_file = os.path.join(tmp, "auth")
    write_secret(auth_file, "scraper:s3cret")
    token_file = os.path.join(tmp, "token2")
    write_secret(token_file, TOKEN)
    d = Daemon(TALLYD, TALLY, tmp, ["--metrics-auth-file", auth_file,
                                    "--metrics-api-token-file", token_file], name="basic")
    d.hist("cam", bytes(range(256)))
    hdrs = expect_error(d, "GET", "/api/v1/streams", 401, "unauthorized")
    if not hdrs.get("www-authenticate", "").startswith("Basic"):
        fail("401 without WWW-Authenticate: Basic")
    status, _, _ = d.request("GET", "/", {})
    if status != 401:
        fail("the page without credentials: %d" % status)
    basic = {"Authorization": "Basic c2NyYXBlcjpzM2NyZXQ="}  # scraper:s3cret
    d.get_json("/api/v1/streams", headers=basic)
    d.get_json("/api/v1/streams/cam", headers={"Authorization": "Bearer " + TOKEN})
    expect_error(d, "POST", "/api/v1/streams/cam/reset", 401, "unauthorized", basic)
    d.stop()
    write_secret(token_file, TOKEN, 0o644)
    r = subprocess.run([TALLYD, "--bind", "tcp://127.0.0.1:%d" % free_port(),
                        "--metrics", "127.0.0.1:0",
                        "--shm", "off", "--state-dir", "", "--metrics-api-token-file",
                        token_file], capture_output=True, timeout=30)
    if r.returncode == 0 or b"chmod 600" not in r.stdout + r.stderr:
        fail("a token file of mode 0644 was not refused: %r" % (r.stdout + r.stderr)[-300:])
    print("ok: read-only without a token, basic auth for reads, token file mode")


def test_events(d):
    ev = Events(d.port, "/api/v1/streams/u8/events?quantiles=0.5,0.99")
    if ev.status != 200 or ev.headers.get("content-type") != "text/event-stream":
        fail("events: %d %r" % (ev.status, ev.headers))
    name, data = ev.until(lambda n, _: n == "stream", "the first record")
    first = json.loads(data)
    check(first, None, "a stream event")
    time.sleep(2.5)  # past the 1 s request deadline of this tallyd: still streaming
    d.hist("u8", bytes([9] * 100))
    _, data = ev.until(lambda n, x: n == "stream" and json.loads(x)["count"] == first["count"] +
                       100, "the record after a batch")
    if json.loads(data) != d.get_json("/api/v1/streams/u8?quantiles=0.5,0.99"):
        fail("the event's record differs from GET's")
    ev.close()
    multi = Events(d.port, "/api/v1/events?stream=i32&stream=gone&stream=" + quote("q?x=1"))
    seen = {}
    while len(seen) < 4:
        name, data = multi.next()
        if name is None:
            fail("the event stream ended")
        if name == ":":
            continue
        doc = json.loads(data)
        if name == "streams":
            check(doc, "streams", "a streams event")
            seen["streams"] = True
        elif name == "stream":
            check(doc, None, "a stream event")
            seen[doc["stream"]] = True
        elif name == "deleted":
            check(doc, "deleted_event", "a deleted event")
            seen["deleted:" + doc["stream"]] = True
    if set(seen) != {"streams", "i32", "q?x=1", "deleted:gone"}:
        fail("the first events: %r" % sorted(seen))
    d.tally("delete", "i32")
    multi.until(lambda n, x: n == "deleted" and json.loads(x)["stream"] == "i32",
                "the deletion of i32")
    multi.close()
    # The most the page's events take (docs/web.md): 256 names of 64 bytes, an 18 KiB request
    # line (libmicrohttpd's default 32 KiB per connection refused it, 431); none exists, so each
    # is answered deleted.
    many = ["m%03d" % i + "x" * 60 for i in range(256)]
    deadline = time.monotonic() + 30
    while True:  # the places of the streams closed above free at a tick
        wide = Events(d.port, "/api/v1/events?" + "&".join("stream=" + n for n in many))
        if wide.status != 503 or time.monotonic() > deadline:
            break
        wide.close()
        time.sleep(0.1)
    if wide.status != 200:
        fail("events of 256 streams of 64 bytes: %d" % wide.status)
    gone = set()
    while len(gone) < len(many):
        name, data = wide.next()
        if name is None:
            fail("the event stream of 256 streams ended")
        if name == "deleted":
            gone.add(json.loads(data)["stream"])
    if gone != set(many):
        fail("deleted events for other names: %r" % sorted(gone - set(many)))
    wide.close()
    print("ok: events: first record, update after a batch, past the deadline, deletion")


def open_events(d, path):
    """An event stream, once a place is free: a client that went frees its place at the next
    tick or two (tallyd notices at the next publication interval)."""
    deadline = time.monotonic() + 30
    while True:
        ev = Events(d.port, path)
        if ev.status == 200:
            return ev
        ev.close()
        if time.monotonic() > deadline:
            fail("no place for an event stream: the places of closed ones were not freed")
        time.sleep(0.1)


def test_event_bound(d):
    """max_sse_clients is 3: the fourth gets 503; when a client goes, its place frees."""
    opened = [open_events(d, "/api/v1/streams/u8/events") for _ in range(3)]
    for ev in opened:
        ev.until(lambda n, _: n == "stream", "a first record")
    expect_error(d, "GET", "/api/v1/events", 503, "too_many_event_streams")
    d.get_json("/api/v1/streams")  # the bound is on event streams only
    opened.pop().close()
    opened.append(open_events(d, "/api/v1/events"))
    print("ok: event-stream bound, a place freed when its client goes")
    return opened


def keep_input(d, stop):
    """ZeroMQ pings while tallyd drains, so it stays draining (each is answered `shutdown`)."""
    while not stop.is_set():
        d.tally("ping", check=False)
        time.sleep(0.02)


def draining_once(tmp, attempt):
    """A tallyd kept draining by pings from four threads: /api/v1/ answers 503 `shutdown`.
    False when tallyd finished draining before the check (every ping thread stalled for
    250 ms on a loaded machine): the caller tries again with a new tallyd."""
    token_file = os.path.join(tmp, "token-drain")
    write_secret(token_file, TOKEN)
    d = Daemon(TALLYD, TALLY, tmp, ["--metrics-api-token-file", token_file, "--drain-ms",
                                    "20000"], name="drain%d" % attempt)
    d.hist("u8", bytes(range(256)))
    stop = threading.Event()
    threads = [threading.Thread(target=keep_input, args=(d, stop)) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.2)
        d.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        while d.request("GET", "/healthz")[0] != 503:
            if time.monotonic() > deadline:
                fail("/healthz never said draining")
            time.sleep(0.02)
        expect_error(d, "GET", "/api/v1/streams", 503, "shutdown")
        expect_error(d, "GET", "/api/v1/streams/u8", 503, "shutdown")
        expect_error(d, "GET", "/api/v1/streams/u8/events", 503, "shutdown")
        expect_error(d, "POST", "/api/v1/streams/u8/reset", 503, "shutdown",
                     {"Authorization": "Bearer " + TOKEN})
        return True
    except (ConnectionError, http.client.RemoteDisconnected):
        return False
    finally:
        stop.set()
        for t in threads:
            t.join()
        d.stop(sig_term=False)


def test_draining(tmp):
    for attempt in range(3):
        if draining_once(tmp, attempt):
            print("ok: 503 while draining")
            return
    fail("tallyd stopped draining before the checks, three times")


def test_shutdown(d, open_events):
    d.proc.send_signal(signal.SIGTERM)
    for ev in open_events:  # ended at shutdown
        try:
            while ev.next()[0] is not None:
                pass
        except (OSError, socket.timeout) as e:
            fail("an event stream was not ended at shutdown: %r" % e)
    d.stop(sig_term=False)
    print("ok: event streams ended at shutdown")


def test_assets(d):
    for path, ctype in (("/", "text/html; charset=utf-8"),
                        ("/app.js", "text/javascript; charset=utf-8"),
                        ("/style.css", "text/css; charset=utf-8"),
                        ("/favicon.svg", "image/svg+xml; charset=utf-8")):
        status, hdrs, body = d.request("GET", path)
        csp = hdrs.get("content-security-policy", "")
        if status != 200 or hdrs.get("content-type") != ctype or not body or \
                "default-src 'self'" not in csp or "unsafe" in csp or \
                hdrs.get("x-content-type-options") != "nosniff":
            fail("GET %s: %d %r" % (path, status, hdrs))
        with open(os.path.join(SRC, "web", "index.html" if path == "/" else path[1:]), "rb") as f:
            if f.read() != body:
                fail("GET %s is not web/%s" % (path, path))
        etag = hdrs.get("etag")
        status, hdrs2, body = d.request("GET", path, {"If-None-Match": etag})
        if status != 304 or body or hdrs2.get("etag") != etag:
            fail("GET %s with its ETag: %d" % (path, status))
        if hdrs.get("cache-control") != "no-cache":
            fail("GET %s: Cache-Control %r" % (path, hdrs.get("cache-control")))
    status, _, body = d.request("GET", "/index.html")
    if status != 404:
        fail("GET /index.html: %d" % status)
    print("ok: the page's files, CSP, ETags")


def main():
    with tempfile.TemporaryDirectory(prefix="tally-web-api.") as tmp:
        token_file = os.path.join(tmp, "token")
        write_secret(token_file, TOKEN)
        d = Daemon(TALLYD, TALLY, tmp, ["--metrics-api-token-file", token_file,
                                        "--metrics-max-sse-clients", "3",
                                        "--metrics-request-timeout-ms", "1000",
                                        "--pub-interval-ms", "200"])
        try:
            test_assets(d)
            test_records(d)
            test_errors(d)
            test_token(d, tmp)
            test_events(d)
            opened = test_event_bound(d)
            test_shutdown(d, opened)
        finally:
            if d.proc.poll() is None:
                d.proc.kill()
                d.proc.wait()
        test_read_only_and_basic(tmp)
        test_draining(tmp)
    print("PASS")


main()
