# SPDX-License-Identifier: Apache-2.0
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
  - `tally stats` (the stats opcode) has the same families, types and per-stream samples;
  - each stream's histogram (tallyd_stream_values_bucket/_sum/_count, per channel for rgb): 16
    buckets (+ underflow, + +Inf), each counting exactly the values <= le, _sum by docs/service.md's
    rule, and PromQL's histogram_quantile of p50/p90/p99 within one bucket of `tally query`'s.
dashboard: contrib/grafana/tallyd-dashboard.json parses, and every metric its panels and
variables name is a sample name of the exposition; contrib/prometheus/prometheus.yml names
tallyd's scrape path.
"""

import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from web_common import fail, free_port  # noqa: E402

TALLYD, TALLY, SRC = sys.argv[2], sys.argv[3], sys.argv[4]

# Every family tallyd exports, with its type, in this test's configuration (CURVE on, one
# simulated GPU, streams with histograms); other families may come, typed and whole too.
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
    "tallyd_gpu_regions": "gauge",
    "tallyd_gpu_region_bytes": "gauge",
    "tallyd_gpu_region_requests": "counter",
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
    "tallyd_stream_bytes": "counter",
    "tallyd_stream_requests": "counter",
    "tallyd_stream_values": "histogram",
    "process_cpu_seconds": "counter",
    "process_resident_memory_bytes": "gauge",
    "process_virtual_memory_bytes": "gauge",
    "process_open_fds": "gauge",
    "process_max_fds": "gauge",
    "process_start_time_seconds": "gauge",
}

# The parser names a counter family without _total: tallyd_stream_values_total is the counter
# "tallyd_stream_values", beside the histogram of that name.
FAMILIES = sorted(FAMILIES.items()) + [("tallyd_stream_values", "counter")]

ODD = 'q"\\'  # a stream name that needs escaping in a label value


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
    heads = [" ".join(line.split()[:3]) for line in text.splitlines() if line.startswith("# ")]
    twice = sorted({h for h in heads if heads.count(h) > 1})
    if twice:
        fail("%s: lines given twice (the text format allows one HELP and one TYPE per family): %s"
             % (what, twice))
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
    for name, typ in FAMILIES:
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


def edge(lo, hi, b):
    """The lower edge of bin b over [lo, hi) (PROTOCOL.md; tally_hist_edge_at)."""
    return lo + (b * (hi - lo) + 255) // 256


def histograms(families):
    """{(stream, channel or None): {"buckets": [(le, count)...], "sum": x, "count": n}}"""
    out = {}
    fam = families.get(("tallyd_stream_values", "histogram"))
    if fam is None:
        fail("no tallyd_stream_values histogram family")
    for smp in fam.samples:
        key = (smp.labels["stream"], smp.labels.get("channel"))
        h = out.setdefault(key, {"buckets": []})
        if smp.name.endswith("_bucket"):
            h["buckets"].append((float(smp.labels["le"]), smp.value))
        else:
            h[smp.name.rsplit("_", 1)[1]] = smp.value
    return out


def promql_quantile(q, buckets):
    """histogram_quantile as Prometheus computes it (promql/quantile.go, bucketQuantile):
    linear interpolation inside the bucket holding rank q x count; the first bucket starts at 0
    unless its upper bound is <= 0; in +Inf the answer is the last finite bound."""
    rank = q * buckets[-1][1]
    b = next(i for i, (_, c) in enumerate(buckets) if c >= rank)
    if b == len(buckets) - 1:
        return buckets[-2][0]
    if b == 0 and buckets[0][0] <= 0:
        return buckets[0][0]
    start, end, count = 0.0, buckets[b][0], buckets[b][1]
    if b > 0:
        start = buckets[b - 1][0]
        count -= buckets[b - 1][1]
        rank -= buckets[b - 1][1]
    return start + (end - start) * (rank / count)


def bucket_index(buckets, v):
    return next(i for i, (le, _) in enumerate(buckets) if v <= le)


def expected_sum(values, lo, hi, ranged):
    """_sum's rule (docs/service.md, "Metrics"): in-range values at the centre of their bin's
    integers, underflow at lo - 1, overflow at hi; exact for u8 and colour channels."""
    if not ranged:
        return sum(values)
    total = 0.0
    for v in values:
        if v < lo:
            total += lo - 1
        elif v >= hi:
            total += hi
        else:
            b = (v - lo) * 256 // (hi - lo)
            total += (edge(lo, hi, b) + edge(lo, hi, b + 1) - 1) / 2
    return total


def tally_quantiles(d, name, channel):
    q = json.loads(d.tally("query", "--json", name).stdout)
    if channel is not None:
        q = next(c for c in q["channels"] if c["channel"] == channel)
    out = {}
    for key, v in q["quantiles"].items():
        out[float(key[1:]) / 100] = v["value"] if isinstance(v, dict) else v
    return out


def check_histogram(d, name, channel, values, hist, h, buckets_setting):
    ranged = hist[1] in ("u16", "i32")
    lo, hi = (int(hist[3]), int(hist[4])) if ranged else (0, 256)
    bk = h["buckets"]
    what = "tallyd_stream_values{stream=%r,channel=%r}" % (name, channel)
    les = [le for le, _ in bk]
    if les != sorted(set(les)) or les[-1] != float("inf"):
        fail("%s: le not increasing up to +Inf: %s" % (what, les))
    least = {"u16": 0, "i32": -2**31}.get(hist[1], 0)
    underflow_bucket = ranged and lo > least
    if len(bk) != buckets_setting + 1 + underflow_bucket:
        fail("%s: %d buckets, want %d folded + +Inf%s"
             % (what, len(bk), buckets_setting, " + underflow" if underflow_bucket else ""))
    for le, count in bk:
        want = sum(1 for v in values if v <= le)
        if count != want:
            fail("%s: bucket le=%g holds %d, want %d values <= le" % (what, le, count, want))
    if h["count"] != len(values) or abs(h["sum"] - expected_sum(values, lo, hi, ranged)) > 1e-6:
        fail("%s: _count %d _sum %r, want %d and %r"
             % (what, h["count"], h["sum"], len(values), expected_sum(values, lo, hi, ranged)))
    for q, v in tally_quantiles(d, name, channel).items():
        est = promql_quantile(q, bk)
        if abs(bucket_index(bk, est) - bucket_index(bk, v)) > 1:
            fail("%s: histogram_quantile(%g) = %g, tally query says %d: more than one bucket "
                 "apart (buckets %s)" % (what, q, est, v, bk))
        print("%-40s q%-5g tally query %6d  histogram_quantile %9.2f" % (what, q, v, est))


def check_histograms(d, families, streams, buckets_setting):
    hs = histograms(families)
    seen = 0
    for name, hist, _, values in streams[:-1]:
        if hist is None:
            if any(k[0] == name for k in hs):
                fail("stream %r has no histogram but histogram series" % name)
            continue
        channels = ["r", "g", "b"] if hist[1] == "rgb" else [None]
        for c, channel in enumerate(channels):
            vals = values[c::3] if channel else values
            check_histogram(d, name, channel, vals, hist, hs[(name, channel)], buckets_setting)
            seen += 1
    if seen != len(hs):
        fail("histograms for streams the test did not expect: %s" % sorted(hs))


def exposition(tmp):
    streams = known_data()
    d = Daemon(tmp, ["--metrics-streams", str(len(streams) - 1)])
    try:
        feed(d, streams)
        text = d.scrape()
        families = parse(text, "GET /metrics")
        check_families(families, "GET /metrics")
        check_stream_counters(families, streams)
        check_stats_same(d, families)  # before the queries below, which count as requests
        check_histograms(d, families, streams, 16)
        print("GET /metrics: %d families, %d samples, all typed and grouped"
              % (len(families), sum(len(f.samples) for f in families.values())))
    finally:
        d.stop()


def promql_of(dashboard):
    """(where, expression) for every query of the panels (rows' included) and variables."""
    out = []
    panels = list(dashboard["panels"])
    while panels:
        p = panels.pop(0)
        panels += p.get("panels", [])
        for t in p.get("targets", []):
            out.append(("panel %r" % p.get("title"), t["expr"]))
    for v in dashboard["templating"]["list"]:
        if v.get("type") == "query":
            q = v["query"]
            out.append(("variable %r" % v["name"], q["query"] if isinstance(q, dict) else q))
    return out


def check_dashboard(sample_names):
    path = os.path.join(SRC, "contrib", "grafana", "tallyd-dashboard.json")
    with open(path) as f:
        dashboard = json.load(f)
    ids = [p["id"] for p in dashboard["panels"]]
    if len(ids) != len(set(ids)) or not ids:
        fail("%s: panel ids missing or repeated: %s" % (path, ids))
    named = set()
    for where, expr in promql_of(dashboard):
        metrics = set(re.findall(r"\b(?:tallyd|process)_[a-zA-Z0-9_]+\b", expr))
        if not metrics:
            fail("%s: %s queries no tallyd metric: %s" % (path, where, expr))
        unknown = metrics - sample_names
        if unknown:
            fail("%s: %s names %s, which tallyd does not export" % (path, where, sorted(unknown)))
        named |= metrics
    for panel in dashboard["panels"]:
        if not panel.get("targets"):
            fail("%s: panel %r has no query" % (path, panel.get("title")))
    # What the dashboard is for: request rates, latency, bytes, in flight, streams' quantiles.
    for want in ("tallyd_requests_total", "tallyd_request_duration_seconds_bucket",
                 "tallyd_received_bytes_total", "tallyd_sent_bytes_total",
                 "tallyd_requests_in_flight", "tallyd_stream_values_bucket"):
        if want not in named:
            fail("%s: no panel shows %s" % (path, want))
    stream_panels = [e for _, e in promql_of(dashboard)
                     if "histogram_quantile" in e and "tallyd_stream_values_bucket" in e
                     and "$stream" in e]
    if not stream_panels:
        fail("%s: no histogram_quantile panel over tallyd_stream_values_bucket{stream=~$stream}"
             % path)
    if "stream" not in [v["name"] for v in dashboard["templating"]["list"]]:
        fail("%s: no stream variable" % path)
    print("%s: %d panels, %d metrics named, all exported" % (path, len(ids), len(named)))


def check_scrape_example():
    import yaml  # python3-yaml

    path = os.path.join(SRC, "contrib", "prometheus", "prometheus.yml")
    with open(path) as f:
        text = f.read()
    job = next(j for j in yaml.safe_load(text)["scrape_configs"] if j["job_name"] == "tallyd")
    if job.get("metrics_path", "/metrics") != "/metrics" or "# basic_auth:" not in text:
        fail("%s: the tallyd job scrapes %r; basic auth not shown" % (path, job.get("metrics_path")))
    target = job["static_configs"][0]["targets"][0]
    if target != "127.0.0.1:9464":  # the documented example address
        fail("%s: target %s" % (path, target))


def dashboard(tmp):
    streams = known_data()
    d = Daemon(tmp, [])
    try:
        feed(d, streams)
        text = d.scrape()
    finally:
        d.stop()
    families = parse(text, "GET /metrics")
    names = {smp.name for fam in families.values() for smp in fam.samples}
    check_dashboard(names)
    check_scrape_example()


def main():
    mode = sys.argv[1]
    tmp = tempfile.mkdtemp(prefix="tallyd-prometheus-")
    try:
        if mode == "exposition":
            exposition(tmp)
        elif mode == "dashboard":
            dashboard(tmp)
        else:
            fail("unknown mode " + mode)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("ok")


main()
