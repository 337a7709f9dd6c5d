"""GET /metrics read by a real Prometheus parser (python3-prometheus-client), against a real
tallyd (issue 21: families grouped; issue 24: per-stream histograms).

usage: test_prometheus.py exposition|dashboard TALLYD TALLY SOURCE_DIR

exposition: tallyd with CURVE and a simulated GPU, so that every family is present, fed known
data on u8, u16, i32, rgb and scan-only streams, one more than [metrics] streams. The scrape is
parsed by prometheus_client.parser.text_string_to_metric_families and checked:
  - no family is untyped, no family appears twice (every family is grouped under one HELP and
    TYPE), every family tallyd documents is there with its type;
  - the per-stream counters and the "(other streams)" sum have their exact values; label
    escaping round-trips;
  - `tally stats` (the stats opcode) has the same families, types and per-stream samples.
dashboard: contrib/grafana/tallyd-dashboard.json parses, and every metric its panels and
variables name is a sample name of the exposition; contrib/prometheus/prometheus.yml names
tallyd's scrape path.
"""

import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

TALLYD, TALLY, SRC = sys.argv[2], sys.argv[3], sys.argv[4]

# Every family tallyd exports, with its type, in this test's configuration (CURVE on, one
# simulated GPU, streams with histograms).
FAMILIES = {
    "tallyd_build_info": "gauge",
    "tallyd_requests": "counter",
    "tallyd_request_duration_seconds": "histogram",
    "tallyd_received_bytes": "counter",
    "tallyd_sent_bytes": "counter",
    "tallyd_replies_dropped": "counter",
    "tallyd_backend_fallbacks": "counter",
    "tallyd_read_pauses": "counter",
    "tallyd_state_write_failures": "counter",
    "tallyd_notify_failures": "counter",
    "tallyd_shm_requests": "counter",
    "tallyd_shm_regions": "gauge",
    "tallyd_shm_bytes": "gauge",
    "tallyd_gpu_requests": "counter",
    "tallyd_limited": "counter",
    "tallyd_auth": "counter",
    "tallyd_auth_zap_errors": "counter",
    "tallyd_client_requests": "counter",
    "tallyd_client_limited": "counter",
    "tallyd_peers": "gauge",
    "tallyd_requests_in_flight": "gauge",
    "tallyd_requests_in_flight_limit": "gauge",
    "tallyd_queue_depth": "gauge",
    "tallyd_streams": "gauge",
    "tallyd_backend_info": "gauge",
    "tallyd_device_memory_bytes": "gauge",
    "tallyd_uptime_seconds": "gauge",
    "tallyd_gpus_lost": "gauge",
    "tallyd_draining": "gauge",
    "tallyd_pub_messages": "counter",
    "tallyd_stream_values_total": "counter",  # the parser keys counters without _total
    "tallyd_stream_bytes": "counter",
    "tallyd_stream_requests": "counter",
    "process_cpu_seconds": "counter",
    "process_resident_memory_bytes": "gauge",
    "process_virtual_memory_bytes": "gauge",
    "process_open_fds": "gauge",
    "process_max_fds": "gauge",
    "process_start_time_seconds": "gauge",
}
# The counter tallyd_stream_values_total is the family "tallyd_stream_values" to the parser.
FAMILIES["tallyd_stream_values"] = FAMILIES.pop("tallyd_stream_values_total")

ODD = 'q"\\'  # a stream name that needs escaping in a label value


def fail(msg):
    print("FAIL: " + msg, file=sys.stderr)
    sys.exit(1)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    """tallyd on free loopback ports, with CURVE keys and a simulated GPU."""

    def __init__(self, tmp, extra):
        self.tmp = tmp
        self.endpoint = "tcp://127.0.0.1:%d" % free_port()
        keys = os.path.join(tmp, "keys")
        clients = os.path.join(tmp, "clients")
        os.makedirs(keys)
        os.makedirs(clients)
        for name in ("server", "cam"):
            subprocess.run([TALLY, "keygen", os.path.join(keys, name)], check=True,
                           stdout=subprocess.DEVNULL)
        shutil.copy(os.path.join(keys, "cam.pub"), clients)
        self.cli_keys = ["--server-key", os.path.join(keys, "server.pub"),
                         "--client-key", os.path.join(keys, "cam.key")]
        self.log_path = os.path.join(tmp, "tallyd.log")
        args = [TALLYD, "--bind", self.endpoint, "--metrics", "127.0.0.1:0",
                "--state-dir", os.path.join(tmp, "state"), "--shm", "off",
                "--backend", "cuda", "--test-sim-gpus", "1",
                "--curve-secret-key", os.path.join(keys, "server.key"),
                "--curve-clients-dir", clients] + extra
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        self.port = self.wait_port()

    def wait_port(self):
        mark = re.compile(r"metrics: serving http://127\.0\.0\.1:(\d+)/metrics")
        for _ in range(200):
            if self.proc.poll() is not None:
                break
            with open(self.log_path) as f:
                m = mark.search(f.read())
            if m and self.tally("ping", check=False).returncode == 0:
                return int(m.group(1))
            time.sleep(0.05)
        with open(self.log_path) as f:
            fail("tallyd did not start:\n" + f.read())

    def tally(self, *args, data=None, check=True):
        r = subprocess.run([TALLY, "-e", self.endpoint] + self.cli_keys + list(args),
                           input=data, capture_output=True)
        if check and r.returncode != 0:
            fail("tally %s: exit %d: %s" % (" ".join(args), r.returncode, r.stderr.decode()))
        return r

    def scrape(self):
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % self.port, timeout=10) as r:
            if r.status != 200:
                fail("GET /metrics: %d" % r.status)
            return r.read().decode()

    def stop(self):
        self.proc.terminate()
        rc = self.proc.wait(timeout=20)
        self.log.close()
        if rc != 0:
            with open(self.log_path) as f:
                fail("tallyd exited %d:\n%s" % (rc, f.read()))


def le_bytes(values, width, signed=False):
    return b"".join(v.to_bytes(width, "little", signed=signed) for v in values)


def known_data():
    """The streams and their inputs: (name, hist args or None, bytes, values)."""
    rng = random.Random(21)
    u8 = [min(255, max(0, int(rng.gauss(100, 30)))) for _ in range(10000)]
    u16 = [min(65535, max(0, int(rng.gauss(2048, 600)))) for _ in range(20000)] + [5000] * 50
    i32 = [int(rng.gauss(0, 400)) for _ in range(20000)]
    rgb = []
    for _ in range(3000):
        rgb += [rng.randrange(256), min(255, int(rng.expovariate(1 / 40))), 200]
    return [
        ("cam0", ["--type", "u8"], bytes(u8), u8),
        ("sensor", ["--type", "u16", "--range", "0", "4096"], le_bytes(u16, 2), u16),
        ("temp", ["--type", "i32", "--range", "-1000", "1000"], le_bytes(i32, 4, True), i32),
        ("frame", ["--type", "rgb"], bytes(rgb), rgb),
        (ODD, ["--type", "u8"], bytes([7] * 10), [7] * 10),
        ("line3/pressure", None, le_bytes(list(range(-50, 50)), 4, True), list(range(-50, 50))),
        ("late", ["--type", "u8"], bytes([1, 2, 3]), [1, 2, 3]),  # beyond --metrics-streams
    ]


def feed(d, streams):
    for name, hist, payload, _ in streams:
        if hist is None:
            d.tally("scan", "--stream", name, "--out", os.devnull, data=payload)
        else:
            d.tally("hist", *hist, "--stream", name, "--out", os.devnull, data=payload)


def parse(text, what):
    families = {}
    for fam in text_string_to_metric_families(text):
        if fam.type in ("untyped", "unknown"):
            fail("%s: family %s is %s (samples %s)" % (what, fam.name, fam.type, fam.samples[:2]))
        key = (fam.name, fam.type)
        if key in families:
            fail("%s: family %s (%s) appears twice: not grouped" % (what, fam.name, fam.type))
        families[key] = fam
    return families


def by_name(families):
    out = {}
    for (name, typ), fam in families.items():
        out.setdefault(name, {})[typ] = fam
    return out


def value(families, sample_name, **labels):
    for fam in families.values():
        for s in fam.samples:
            if s.name == sample_name and s.labels == labels:
                return s.value
    fail("no sample %s%s" % (sample_name, labels))


def check_families(families, what):
    names = by_name(families)
    for name, typ in FAMILIES.items():
        if typ not in names.get(name, {}):
            fail("%s: family %s (%s) missing; there: %s" % (what, name, typ, names.get(name)))


def check_stream_counters(families, streams):
    shown = streams[:-1]  # --metrics-streams len - 1: the last is summed
    for name, hist, payload, values in shown:
        elements = len(values) // 3 if hist and "rgb" in hist else len(values)  # pixels
        if value(families, "tallyd_stream_values_total", stream=name) != elements:
            fail("tallyd_stream_values_total{stream=%r}" % name)
        if value(families, "tallyd_stream_bytes_total", stream=name) != len(payload):
            fail("tallyd_stream_bytes_total{stream=%r}" % name)
    late = streams[-1]
    other = "(other streams)"
    if value(families, "tallyd_stream_values_total", stream=other) != len(late[3]):
        fail("the (other streams) sum")
    for fam in families.values():
        for s in fam.samples:
            if s.labels.get("stream") == late[0]:
                fail("stream %r beyond --metrics-streams has its own series %s" % (late[0], s))


def stream_samples(families):
    out = set()
    for fam in families.values():
        for s in fam.samples:
            if s.name.startswith("tallyd_stream_"):
                out.add((s.name, tuple(sorted(s.labels.items())), s.value))
    return out


def check_stats_same(d, scraped):
    stats = parse(d.tally("stats").stdout.decode(), "tally stats")
    if set(stats) != set(scraped):
        fail("tally stats and GET /metrics differ in families: %s"
             % (set(stats) ^ set(scraped)))
    if stream_samples(stats) != stream_samples(scraped):
        fail("tally stats and GET /metrics differ in per-stream samples: %s"
             % (stream_samples(stats) ^ stream_samples(scraped)))


def exposition(tmp):
    streams = known_data()
    d = Daemon(tmp, ["--metrics-streams", str(len(streams) - 1)])
    try:
        feed(d, streams)
        text = d.scrape()
        families = parse(text, "GET /metrics")
        check_families(families, "GET /metrics")
        check_stream_counters(families, streams)
        check_stats_same(d, families)
        print("GET /metrics: %d families, %d samples, all typed and grouped"
              % (len(families), sum(len(f.samples) for f in families.values())))
    finally:
        d.stop()


def main():
    mode = sys.argv[1]
    tmp = tempfile.mkdtemp(prefix="tallyd-prometheus-")
    try:
        if mode == "exposition":
            exposition(tmp)
        else:
            fail("unknown mode " + mode)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("ok")


main()
