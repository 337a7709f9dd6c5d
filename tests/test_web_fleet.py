# SPDX-License-Identifier: Apache-2.0
"""A fleet worker's web page and JSON API show the whole fleet (docs/web.md "A fleet"), against
a real 3-server NATS JetStream cluster (nats-server, started here) and two tallyd workers:

  - GET /api/v1/streams of either worker lists every stream of the fleet, each with the member
    that owns it ("member"): the worker's own in full, the other's by name; "fleet" says every
    partition was covered and both members answered, and counts both ("members": 2) from the
    first list asked after the second joined (before it owns anything) and once both own
    partitions; valid against web/schema/api.json;
  - GET /api/v1/streams/NAME of a stream the other worker owns is its owner's record, equal to
    `tally --nats query --json NAME` and to the owner's own answer; with last= too; an unknown
    stream is 404 from its owner;
  - a member that does not answer (SIGSTOP) makes the list partial ("partial": true, the
    partitions covered, one member of two answered), and a stream it owns 504, not passed off as
    whole or missing; `tally --nats streams` says the same on stderr and exits 1;
  - the page of one worker (headless Chromium) shows a stream the other owns: its card's counts
    equal the owner's record, its row and card carry the owner's member id, and it follows a
    new batch;
  - with the other member stopped, questions beyond the 32 that may wait are refused `503`
    `busy`; an owner's answer that does not decode (a rogue responder on tally.q.<k>) is `502`
    `bad_reply`, one shorter than a reply header too; questions still waiting when the worker
    stops each get a whole `503` `shutdown` response (none closed without one), and the
    fleet's late answers find no job (exit 0);
  - `tally --nats watch` (in tmux) subscribes to the owners' publications on tally.watch.<k>:
    with an interval of an hour only a publication can bring a new batch's count to its screen;
    with a worker that publishes nothing (--pub-interval-ms 0) it says so and queries each
    interval instead, and the new count shows.

usage: test_web_fleet.py TALLYD TALLY SOURCE_DIR
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nats_cluster  # noqa: E402
from nats_cluster import Cluster, nats_server, until  # noqa: E402
from web_common import Daemon, fail, quote, schema_checker  # noqa: E402

TALLYD, TALLY, SRC = sys.argv[1], sys.argv[2], sys.argv[3]
PARTITIONS = 8
STREAMS = ["s%02d" % i for i in range(12)]
MEMBERS = ["wa", "wb"]

check = schema_checker(SRC)


def member_listed(cluster, member):
    """Whether member's heartbeat is in TALLY_MEMBERS now: a JetStream direct get of its key's
    last message, over plain NATS (the reply: a message, or the status 404)."""
    port = int(cluster.urls.split(",")[0].rsplit(":", 1)[1])
    body = nats_cluster.request(port, "$JS.API.DIRECT.GET.KV_TALLY_MEMBERS.$KV.TALLY_MEMBERS.%s"
                                % member, headers=True, timeout_s=10)
    return body is not None and not body.startswith(b"NATS/1.0 4")


def tally_nats(cluster, *args, data=None, check=True):
    r = subprocess.run([TALLY, "--nats", cluster.urls] + list(args), input=data,
                       capture_output=True, timeout=60)
    if check and r.returncode != 0:
        fail("tally --nats %s: exit %d: %s" % (" ".join(args), r.returncode, r.stderr.decode()))
    return r


def worker(tmp, cluster, member, pub_ms=200):
    return Daemon(TALLYD, TALLY, tmp, name=member, extra=[
        "--nats-servers", cluster.urls, "--nats-partitions", str(PARTITIONS),
        "--nats-replicas", "3", "--nats-member-id", member, "--nats-lease-ttl-ms", "15000",
        "--nats-checkpoint-interval-ms", "200", "--pub-interval-ms", str(pub_ms),
        "--metrics-max-connections-per-address", "64"])


def owned(d):
    status, _, body = d.request("GET", "/metrics")
    for line in body.decode().splitlines():
        if line.startswith("tallyd_nats_partitions_owned "):
            return int(float(line.split()[1]))
    return -1


# A bound for the CLI's answers that a working fleet never reaches (its default, 5 s, a worker
# kept from answering by a loaded 2-core box can): a query returns at its answer, a `streams`
# list once every partition is covered.
PATIENT = ("--timeout", "30000")


def queried(cluster, name):
    r = tally_nats(cluster, *PATIENT, "query", "--json", name, check=False)
    return json.loads(r.stdout) if r.returncode == 0 else None


def the_list(d):
    """d's list of the fleet's streams. A 504 (no member answered within the gather's 2 s: on a
    loaded 2-core box a worker's thread can be kept from answering longer) is asked again, for
    up to a minute."""
    deadline = time.monotonic() + 60
    while True:
        status, _, body = d.request("GET", "/api/v1/streams")
        if status != 504 or time.monotonic() > deadline:
            break
    if status != 200:
        fail("GET /api/v1/streams of %s: %d: %s" % (d.name, status, body[:300]))
    doc = json.loads(body)
    check(doc, "streams", "GET /api/v1/streams of %s" % d.name)
    return doc


def whole(d, what):
    """The first list of d's that is whole (every member answered within the gather's 2 s,
    which a loaded 2-core box can keep one from): the list looked at, since the next may be
    partial again."""
    def is_whole():
        doc = the_list(d)
        return doc if doc["fleet"]["partial"] is False else None
    return until(is_whole, what)


def answering_again(d):
    """Each stream's owner, from d's first whole list once wb continued."""
    return {e["stream"]: e["member"] for e in whole(d, "wb answers again")["streams"]}


def whole_list(ws, totals):
    """Both workers list every stream, each with its owner; the owner's entries in full."""
    for d in ws:
        doc = whole(d, "a whole list of %s's" % d.name)
        fleet = doc.get("fleet")
        if fleet != {"member": d.name, "partitions": PARTITIONS, "covered": PARTITIONS,
                     "answered": 2, "members": 2, "partial": False}:
            fail("%s's list: fleet %r" % (d.name, fleet))
        names = [e["stream"] for e in doc["streams"]]
        if names != sorted(STREAMS):
            fail("%s lists %r, expected %r" % (d.name, names, sorted(STREAMS)))
        for e in doc["streams"]:
            if e["member"] not in MEMBERS:
                fail("%s: %r has no owner" % (d.name, e))
            if e["member"] == d.name and e.get("values") != totals[e["stream"]]:
                fail("%s's own %r: values %r, expected %d" % (d.name, e["stream"],
                                                             e.get("values"), totals[e["stream"]]))
            if e["member"] != d.name and set(e) != {"stream", "member"}:
                fail("%s: another member's entry %r holds more than its name" % (d.name, e))
    return {e["stream"]: e["member"] for e in whole(ws[0], "a whole list of wa's")["streams"]}


def remote_records(ws, cluster, owner):
    for d in ws:
        other = [n for n in STREAMS if owner[n] != d.name]
        if not other:
            fail("%s owns every stream: no stream of the other to ask" % d.name)
        for name in other:
            got = d.get_json("/api/v1/streams/" + quote(name))
            check(got, None, "GET /api/v1/streams/%s of %s" % (name, d.name))
            owners = [w for w in ws if w.name == owner[name]][0]
            theirs = owners.get_json("/api/v1/streams/" + quote(name))
            if got != theirs:
                fail("%s's record of %s differs from its owner's:\n%r\n%r" %
                     (d.name, name, got, theirs))
            asked = queried(cluster, name)
            if got != asked:
                fail("%s's record of %s differs from tally --nats query --json:\n%r\n%r" %
                     (d.name, name, got, asked))
        # Asked of the owner a moment apart, the two windows of the last 10 s may fall on either
        # side of the batch's time: asked again until both are of the same moment.
        def same_window():
            windowed = d.get_json("/api/v1/streams/%s?last=10s&quantiles=0.5" % quote(other[0]))
            check(windowed, None, "a window of another member's stream")
            if "window" not in windowed:
                fail("%s: the window of %s: %r" % (d.name, other[0], windowed))
            return windowed["count"] == got_count(owner, ws, other[0])
        until(same_window, "%s's window of %s equal to its owner's" % (d.name, other[0]), 60)
        missing = "nosuch-" + d.name
        err = d.get_json("/api/v1/streams/" + missing, want=404)
        if err["error"] != "unknown_stream":
            fail("an unknown stream asked of the fleet: %r" % err)


def got_count(owner, ws, name):
    d = [w for w in ws if w.name == owner[name]][0]
    return d.get_json("/api/v1/streams/%s?last=10s" % quote(name))["count"]


def partial(ws, cluster, owner):
    """wb stopped: wa's list is partial, and wb's streams 504."""
    wa, wb = ws
    os.kill(wb.proc.pid, signal.SIGSTOP)
    try:
        began = time.monotonic()
        doc = the_list(wa)
        took = time.monotonic() - began
        mine = owned(wa)
        fleet = doc["fleet"]
        # "members": wb's membership key stays until it expires (2), then 1
        if dict(fleet, members=0) != {"member": "wa", "partitions": PARTITIONS, "covered": mine,
                                      "answered": 1, "members": 0, "partial": True} or \
                fleet["members"] not in (1, 2):
            fail("a list with wb stopped: fleet %r (wa owns %d)" % (fleet, mine))
        if sorted(e["stream"] for e in doc["streams"]) != sorted(
                n for n in STREAMS if owner[n] == "wa"):
            fail("a list with wb stopped lists %r" % doc["streams"])
        if took > 10:
            fail("the partial list took %.1f s" % took)
        theirs = [n for n in STREAMS if owner[n] == "wb"][0]
        err = wa.get_json("/api/v1/streams/" + quote(theirs), want=504)
        if err["error"] != "timeout":
            fail("a stream of a stopped member: %r" % err)
        r = tally_nats(cluster, "--timeout", "3000", "streams", check=False)
        text = r.stderr.decode()
        if r.returncode != 1 or "partial" not in text or \
                "for %d partition(s)" % (PARTITIONS - mine) not in text:
            fail("tally --nats streams with a member stopped: exit %d, %r" % (r.returncode, text))
        listed = sorted(r.stdout.decode().split())
        if listed != sorted(n for n in STREAMS if owner[n] == "wa"):
            fail("tally --nats streams with a member stopped printed %r" % listed)
    finally:
        os.kill(wb.proc.pid, signal.SIGCONT)


class Rogue(threading.Thread):
    """A NATS client (the plain text protocol) answering every tally.q.<k> question with
    `payload`: not an owner, for the answers a worker must refuse to pass on."""

    def __init__(self, cluster, payload):
        super().__init__(daemon=True)
        host, port = cluster.urls.split(",")[0].rsplit("/", 1)[1].split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.file = self.sock.makefile("rb")
        self.payload, self.answered = payload, 0
        self.file.readline()  # INFO
        self.sock.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\n'
                          b"SUB tally.q.> 1\r\nPING\r\n")
        while self.file.readline().strip() != b"PONG":
            pass
        self.start()

    def run(self):
        try:
            while True:
                line = self.file.readline()
                if not line:
                    return
                if line.startswith(b"PING"):
                    self.sock.sendall(b"PONG\r\n")
                elif line.startswith(b"MSG "):
                    parts = line.split()
                    self.file.read(int(parts[-1]) + 2)
                    if len(parts) == 5:  # MSG subject sid reply size
                        self.sock.sendall(b"PUB %s %d\r\n%s\r\n" % (
                            parts[3], len(self.payload), self.payload))
                        self.answered += 1
        except OSError:
            return

    def stop(self):
        """Gone from NATS (and its subscription with it) before this returns."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # a close alone waits for the file's reader
        except OSError:
            pass
        self.join(10)
        self.file.close()
        self.sock.close()


def flood(d, name, count, bodies=None):
    """count GETs of stream name's record at once, each on its own connection; returns the
    list of (status, error) filled in as they end, and their threads (each decoded body also
    into `bodies` when given)."""
    got = []

    def one():
        try:
            status, _, body = d.request("GET", "/api/v1/streams/" + quote(name), timeout=120)
            doc = json.loads(body)
            if bodies is not None:
                bodies.append((status, doc))
            got.append((status, doc.get("error")))
        except Exception as e:  # noqa: BLE001 - recorded, judged by the caller
            got.append((0, repr(e)))
    threads = [threading.Thread(target=one, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    return got, threads


def refusals(ws, cluster, theirs):
    """wb stopped: more than 32 questions at once, then answers that are not replies."""
    wa, wb = ws
    os.kill(wb.proc.pid, signal.SIGSTOP)
    rogue = None
    try:
        got, threads = flood(wa, theirs, 48)
        until(lambda: (503, "busy") in got, "a 503 busy with 48 questions waiting", 60)
        # The rest are answered by a responder whose answers do not decode (the one being asked
        # when it subscribed may time out first).
        rogue = Rogue(cluster, b"\0" * 64)
        for t in threads:
            t.join(120)
        kinds = set(got)
        if len(got) != 48 or not kinds <= {(503, "busy"), (502, "bad_reply"), (504, "timeout")} \
                or (502, "bad_reply") not in kinds:
            fail("48 questions at once with wb stopped: %r" % sorted(got))
        rogue.payload = b"short"
        err = wa.get_json("/api/v1/streams/" + quote(theirs), want=502)
        if err["error"] != "bad_reply" or "not a reply" not in err["message"]:
            fail("an answer shorter than a reply header: %r" % err)
    finally:
        if rogue:
            rogue.stop()
        os.kill(wb.proc.pid, signal.SIGCONT)


def stop_while_asking(ws, theirs):
    """wb stopped, wa's questions queued to the full: wa stops; every question waiting gets a
    whole `503` `shutdown` response before libmicrohttpd stops (docs/web.md), none is closed
    without one, the fleet's answers coming after find no job; wa exits 0 (under ASan: no
    leak)."""
    wa, wb = ws
    os.kill(wb.proc.pid, signal.SIGSTOP)
    try:
        bodies = []
        got, threads = flood(wa, theirs, 40, bodies)
        until(lambda: (503, "busy") in got, "a 503 busy with 40 questions waiting", 60)
        wa.stop(want_rc=0)
        for t in threads:
            t.join(60)
        # Each ends: refused busy, or (one at a time, 2 s each, while the stop comes) timed
        # out, or answered shutdown; none hangs, none gets a record, none is closed without a
        # response. Most of the 32 that may wait are still waiting at the stop.
        shutdown = [doc for status, doc in bodies if doc.get("error") == "shutdown"]
        if len(got) != 40 or (503, "busy") not in got or \
                not set(got) <= {(503, "busy"), (503, "shutdown"), (504, "timeout")} or \
                len(shutdown) < 16 or got.count((503, "shutdown")) != len(shutdown) or \
                any(doc != {"error": "shutdown", "message": "tallyd is shutting down"}
                    for doc in shutdown):
            fail("questions waiting when wa stopped: %r" % sorted(got))
    finally:
        os.kill(wb.proc.pid, signal.SIGCONT)


class Watch:
    """`tally --nats watch --interval INTERVAL --ascii NAME` in a tmux session of its own, once
    it shows NAME's count (self.want); None from start() without tmux."""

    @classmethod
    def start(cls, tmp, cluster, tag, interval, name):
        if not shutil.which("tmux"):
            print("no tmux: tally watch --nats (%s) not checked" % tag)
            return None
        return cls(tmp, cluster, tag, interval, name)

    def __init__(self, tmp, cluster, tag, interval, name):
        self.tmux = ["tmux", "-L", "tally-web-fleet-%s-%d" % (tag, os.getpid())]
        self.want = until(lambda: queried(cluster, name), "a query of %s" % name)["count"]
        cmd = "%s --nats %s watch --interval %s --ascii %s" % (TALLY, cluster.urls, interval, name)
        subprocess.run(self.tmux + ["new-session", "-d", "-s", "w", "-x", "120", "-y", "40", cmd],
                       check=True, cwd=tmp)
        try:
            until(lambda: "%s  u8  count %d " % (name, self.want) in self.screen(),
                  "watch shows %s" % name, 60)
        except BaseException:
            self.close()
            raise

    def screen(self):
        return subprocess.run(self.tmux + ["capture-pane", "-p", "-t", "w"], capture_output=True,
                              text=True).stdout

    def close(self):
        subprocess.run(self.tmux + ["kill-server"], capture_output=True)


def watch_subscribed(tmp, cluster, name):
    """tally --nats watch --interval 1h: only the fleet's publications can redraw it."""
    w = Watch.start(tmp, cluster, "sub", "1h", name)
    if not w:
        return
    try:
        if "sub tally.watch.<k>" not in w.screen():
            fail("watch --nats did not subscribe:\n" + w.screen())
        # The subscription may take a moment: push until a publication shows.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            tally_nats(cluster, "hist", "--stream", name, "--out", os.devnull, data=b"\x05" * 3)
            w.want += 3
            t = time.monotonic()
            while time.monotonic() < t + 3 and "count %d " % w.want not in w.screen():
                time.sleep(0.1)
            if "count %d " % w.want in w.screen():
                return
        fail("no publication reached tally --nats watch; the screen:\n" + w.screen())
    finally:
        w.close()


def watch_polled(tmp, cluster, wc, name):
    """A fleet whose only worker publishes nothing (--pub-interval-ms 0): tally --nats watch
    says so and queries each interval, so a new batch's count reaches its screen; the worker's
    event streams tick at 1000 ms (the list's interval_ms)."""
    if the_list(wc)["interval_ms"] != 1000:
        fail("interval_ms of a worker publishing nothing: %r" % the_list(wc)["interval_ms"])
    w = Watch.start(tmp, cluster, "poll", "0.5", name)
    if not w:
        return
    try:
        says = "the fleet publishes nothing (pub_interval_ms 0): querying every interval"
        if says not in w.screen() or "sub tally.watch.<k>" in w.screen():
            fail("watch --nats with a fleet publishing nothing:\n" + w.screen())
        tally_nats(cluster, "hist", "--stream", name, "--out", os.devnull, data=b"\x05" * 3)
        until(lambda: "count %d " % (w.want + 3) in w.screen(), "watch queried the new count", 30)
    finally:
        w.close()


def page(tmp, ws, cluster, owner):
    """wa's page shows a stream wb owns."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait
    wa = ws[0]
    name = [n for n in STREAMS if owner[n] == "wb"][0]  # as the list says now
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--user-data-dir=" + os.path.join(tmp, "profile")):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    try:
        drv.get("http://127.0.0.1:%d/#stream=%s" % (wa.port, quote(name)))

        def card():
            return drv.execute_script("""
                const card = [...document.querySelectorAll('article.card')]
                    .find((c) => c.dataset.stream === arguments[0]);
                const row = [...document.querySelectorAll('tr')]
                    .find((r) => r.dataset.stream === arguments[0]);
                if (!card || !row || !card.querySelector('.channel')) return null;
                return {member: card.dataset.member, row: row.dataset.member,
                        rows: document.querySelectorAll('tbody tr').length,
                        count: +card.querySelector('.channel').dataset.count};""", name)

        def shows(count):
            def pred(d):
                c = card()
                return c if c and c["count"] == count else None
            try:
                return WebDriverWait(drv, 60, poll_frequency=0.2).until(pred)
            except Exception:
                fail("wa's page did not show %s with count %d: %r" % (name, count, card()))

        want = until(lambda: queried(cluster, name), "a query of %s" % name)["count"]
        c = shows(want)
        if c["member"] != "wb" or c["row"] != "wb" or c["rows"] != len(STREAMS):
            fail("wa's page: %r" % c)
        tally_nats(cluster, "hist", "--stream", name, "--out", os.devnull, data=bytes(range(7)))
        until(lambda: queried(cluster, name)["count"] == want + 7, "the new batch applied")
        shows(want + 7)
        bad = [e for e in drv.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
        if bad:
            fail("console errors: %r" % bad)
    finally:
        drv.quit()


def run(tmp):
    cluster = Cluster(tmp)
    ws = []
    try:
        for m in MEMBERS:
            ws.append(worker(tmp, cluster, m))
            ws[-1].name = m
            if m == MEMBERS[0]:
                until(lambda: owned(ws[0]) == PARTITIONS, "wa owns every partition")
        # wb has joined (its heartbeat is in TALLY_MEMBERS) and owns nothing yet. wa, owning
        # every partition, could answer a list alone; it counts wb (Tally-Members read when
        # asked; at wa's last heartbeat, up to 5 s ago, it saw itself alone).
        until(lambda: member_listed(cluster, "wb"), "wb in TALLY_MEMBERS", 30)
        fleet = the_list(ws[0])["fleet"]
        if fleet["members"] != 2:
            fail("wa's list right after wb joined: fleet %r" % fleet)
        until(lambda: owned(ws[0]) + owned(ws[1]) == PARTITIONS and owned(ws[0]) > 0 and
              owned(ws[1]) > 0, "both workers own partitions, all of them")
        # The next streams answer of each counts both members (read when asked, not at the
        # last heartbeat, PROTOCOL.md §13), whatever else is still settling.
        for d in ws:
            fleet = the_list(d)["fleet"]
            if fleet["members"] != 2:
                fail("%s's first list with both workers owning: fleet %r" % (d.name, fleet))
        totals = {}
        for i, name in enumerate(STREAMS):
            data = bytes((i * 7 + j) % 256 for j in range(100 + i))
            tally_nats(cluster, "hist", "--stream", name, "--out", os.devnull, data=data)
            totals[name] = len(data)
        for name in STREAMS:
            until(lambda: (queried(cluster, name) or {}).get("count") == totals[name],
                  "%s applied" % name)
        # Both lists whole before they are looked at (a loaded box may still be settling)
        until(lambda: all(the_list(d)["fleet"]["covered"] == PARTITIONS for d in ws),
              "both workers' lists covering every partition")
        owner = whole_list(ws, totals)
        r = tally_nats(cluster, *PATIENT, "streams")
        if sorted(r.stdout.decode().split()) != sorted(STREAMS) or r.stderr:
            fail("tally --nats streams: %r %r" % (r.stdout, r.stderr))
        remote_records(ws, cluster, owner)
        partial(ws, cluster, owner)
        owner = answering_again(ws[0])
        refusals(ws, cluster, [n for n in STREAMS if owner[n] == "wb"][0])
        owner = answering_again(ws[0])
        watch_subscribed(tmp, cluster, STREAMS[0])
        if os.environ.get("TALLY_WEB_FLEET_BROWSER", "1") == "1":
            page(tmp, ws, cluster, owner)
        theirs = [n for n in STREAMS if owner[n] == "wb"][0]
        stop_while_asking(ws, theirs)
        ws[1].stop(want_rc=0)  # a clean stop: leaves the fleet, exit 0 (nothing for ASan)
        ws.append(worker(tmp, cluster, "wc", pub_ms=0))
        ws[-1].name = "wc"
        until(lambda: owned(ws[2]) == PARTITIONS, "wc owns every partition")
        watch_polled(tmp, cluster, ws[2], STREAMS[0])
        ws[2].stop(want_rc=0)
    except BaseException:  # a failure (fail() exits): each worker's last words, for CI's log
        for d in ws:
            print("---- the end of %s's log:\n%s" % (d.name, d.log_text()[-4000:]),
                  file=sys.stderr)
        raise
    finally:
        for d in ws:
            d.stop(want_rc=None)
        cluster.stop()


def main():
    if not nats_server():
        print("no nats-server: skipping")
        sys.exit(77)
    with tempfile.TemporaryDirectory(prefix="tally-web-fleet-") as tmp:
        run(tmp)
    print("ok")


if __name__ == "__main__":
    main()
