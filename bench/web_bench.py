# SPDX-License-Identifier: Apache-2.0
"""The web page and the API with many streams (issue 24's figures for bench/RESULTS.md).

  - the page in headless Chromium with N streams (default 100), all of them chosen: its first
    render (the "first-render" performance mark: from navigation start until the list and every
    chosen stream's histogram are drawn) and its live updates (the "update" measures: from the
    first event of a tick to the end of its drawing) while every stream gets a batch per round;
  - one stream's record: GET /api/v1/streams/NAME (JSON, one kept-alive connection) against
    the same query through libtally (the Python binding, a binary record, no JSON) and
    `tally query --json` (a process per query), p50 and p90 of each.

usage: python3 bench/web_bench.py BUILD_DIR [STREAMS]   (chromium, chromedriver, selenium)
"""

import http.client
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

SRC = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(SRC, "tests"))
from web_common import Daemon  # noqa: E402

BUILD = sys.argv[1]
STREAMS = int(sys.argv[2]) if len(sys.argv) > 2 else 100
TALLYD = os.path.join(BUILD, "daemon", "tallyd")
TALLY = os.path.join(BUILD, "cli", "tally")


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def page_figures(d, tmp):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1600,1000", "--user-data-dir=" + os.path.join(tmp, "profile")):
        opts.add_argument(arg)
    drv = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    try:
        frag = "&".join("stream=s%03d" % i for i in range(STREAMS))
        drv.get("http://127.0.0.1:%d/#%s" % (d.port, frag))
        WebDriverWait(drv, 300, 0.05).until(lambda x: x.execute_script(
            "return performance.getEntriesByName('first-render').length === 1"))
        first = drv.execute_script(
            "return performance.getEntriesByName('first-render')[0].startTime")
        ttfb = drv.execute_script(
            "return performance.getEntriesByType('navigation')[0].responseStart")
        rounds = 10
        for r in range(rounds):
            for i in range(STREAMS):
                d.hist("s%03d" % i, bytes([(i + r * 7 + k) % 256 for k in range(512)]))
        time.sleep(2)
        updates = drv.execute_script(
            "return performance.getEntriesByName('update').map((e) => e.duration)")
        return first, ttfb, updates
    finally:
        drv.quit()


def api_figures(d, n=400):
    name = "s%03d" % (STREAMS // 2)
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=30)
    http_ms = []
    for _ in range(n):
        t = time.perf_counter()
        conn.request("GET", "/api/v1/streams/" + name)
        r = conn.getresponse()
        r.read()
        http_ms.append((time.perf_counter() - t) * 1e3)
    conn.close()
    env = dict(os.environ, PYTHONPATH=os.path.join(SRC, "client", "python"),
               TALLY_LIBRARY=os.path.join(BUILD, "client", "libtally.so"))
    code = ("import sys, time, tally\n"
            "c = tally.Client(sys.argv[1])\n"
            "xs = []\n"
            "for _ in range(%d):\n"
            "    t = time.perf_counter(); c.query(%r); xs.append((time.perf_counter() - t) * 1e3)\n"
            "print(' '.join('%%.4f' %% x for x in xs))\n" % (n, name))
    out = subprocess.run([sys.executable, "-c", code, d.endpoint], env=env, capture_output=True,
                         text=True, check=True).stdout
    lib_ms = [float(x) for x in out.split()]
    cli_ms = []
    for _ in range(n // 4):
        t = time.perf_counter()
        d.tally("query", "--json", name)
        cli_ms.append((time.perf_counter() - t) * 1e3)
    return http_ms, lib_ms, cli_ms


def main():
    with tempfile.TemporaryDirectory(prefix="tally-web-bench.") as tmp:
        d = Daemon(TALLYD, TALLY, tmp, ["--pub-interval-ms", "1000"])
        try:
            for i in range(STREAMS):
                d.hist("s%03d" % i, bytes([(i + k) % 256 for k in range(4096)]))
            http_ms, lib_ms, cli_ms = api_figures(d)
            first, ttfb, updates = page_figures(d, tmp)
        finally:
            d.stop()
    print("streams: %d (all chosen on the page)" % STREAMS)
    print("page: first render %.0f ms after navigation start (document's first byte %.0f ms)"
          % (first, ttfb))
    print("page: live updates: %d, duration p50 %.1f ms, p90 %.1f ms, max %.1f ms"
          % (len(updates), statistics.median(updates), pct(updates, 0.9), max(updates)))
    for what, xs in (("GET /api/v1/streams/NAME (JSON, kept-alive HTTP)", http_ms),
                     ("libtally query (Python binding, binary record)", lib_ms),
                     ("tally query --json (a process each)", cli_ms)):
        print("%s: n %d, p50 %.3f ms, p90 %.3f ms" % (what, len(xs), statistics.median(xs),
                                                       pct(xs, 0.9)))


main()
