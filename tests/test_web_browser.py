# SPDX-License-Identifier: Apache-2.0
"""tallyd's live page in a real browser: headless Chromium driven by Selenium
(python3-selenium, chromium, chromium-driver), against a tallyd fed known data.

  - the page opens with four streams chosen (u8, i32, rgb8: one histogram per channel, and an i32
    stream whose quantiles lie beyond its range); what it shows (each channel's count and
    p50/p90/p99, and the 256 bars' heights from the canvas's data-heights) equals `tally query
    --json`, and each channel's summary says what `tally query` prints, in the same words
    (">= 100", "< 0", "70.90 (in range)"; issue 30, item 6);
  - a batch sent later shows up by itself (Server-Sent Events), and again equals the CLI;
  - the log toggle redraws the bars with log heights, and the window selector ("last 10s",
    with tallyd's window clock moved by a test clock file) shows only the recent batch, as
    `tally query --json --last 10s` does: both change the canvas's pixels;
  - a bookmark tallyd refuses (#stream=cam0&last=5m, longer than its window ring; a name that is
    not a stream name) shows tallyd's message and falls back to a view it takes, and a new
    fragment on the open page takes effect (issue 30, item 5);
  - with 100 streams, a chosen stream's chart is on the first screen, and the list filters by
    name (issue 30, item 6);
  - no console error and no Content-Security-Policy violation, from start to end;
  - screenshots at desktop and phone width (web-desktop.png, web-phone.png, and with the log
    scale and the window web-window.png, web-window-phone.png, in the build folder), and at a
    phone's width nothing is wider than the screen.

Timeouts are generous: Chromium on a loaded 2-core CI box under AddressSanitizer is slow.
usage: test_web_browser.py TALLYD TALLY SOURCE_DIR BUILD_DIR
"""

import json
import math
import os
import random
import shutil
import sys
import tempfile
import time

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from web_common import Daemon, fail, quote  # noqa: E402

TALLYD, TALLY, SRC, BUILD = sys.argv[1:5]
WAIT_S = 120
T0 = 1_800_000_000_000  # the window clock at the first batch, ms since the epoch
ODD = "a/b#c?d%e+f"  # a name the page must escape in its URLs


def browser(tmp):
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1000", "--hide-scrollbars", "--no-first-run",
                "--user-data-dir=" + os.path.join(tmp, "profile")):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    drv.set_page_load_timeout(WAIT_S)
    drv.set_script_timeout(WAIT_S)
    return drv


class Page:
    def __init__(self, drv):
        self.drv = drv
        self.log = []

    def js(self, script, *args):
        return self.drv.execute_script(script, *args)

    def wait(self, script, what, *args):
        try:
            return WebDriverWait(self.drv, WAIT_S, poll_frequency=0.1).until(
                lambda d: d.execute_script(script, *args))
        except Exception:  # selenium's TimeoutException, or the browser gone
            self.console()
            fail("the page did not show %s within %d s" % (what, WAIT_S))

    def console(self, refused=()):
        """Fails on any console error (CSP violations are reported there too) but the
        browser's own line for an event stream that tallyd refused on purpose (400, from a URL
        holding one of the texts in refused). Checked lines are not read again."""
        self.log += self.drv.get_log("browser")
        bad = [e for e in self.log if e["level"] in ("SEVERE", "ERROR") and not (
            "/api/v1/events?" in e["message"] and any(t in e["message"] for t in refused) and
            e["message"].endswith("status of 400 (Bad Request)"))]
        self.log = []
        if bad:
            fail("console errors: " + "; ".join(e["message"] for e in bad))

    def card(self, name):
        """What the card of stream `name` shows: per channel (count, quantiles, heights)."""
        return self.js("""
            const card = [...document.querySelectorAll('article.card')]
                .find((c) => c.dataset.stream === arguments[0]);
            if (!card) return null;
            return {updates: +card.dataset.updates, channels: [...card.querySelectorAll(
                '.channel')].map((c) => ({channel: c.dataset.channel, count: +c.dataset.count,
                p50: c.dataset.p50, p90: c.dataset.p90, p99: c.dataset.p99,
                heights: c.querySelector('canvas').dataset.heights.split(',').map(Number),
                painted: c.querySelector('canvas').width === Math.max(1, Math.round(
                    c.querySelector('canvas').clientWidth * (window.devicePixelRatio || 1))),
                scale: c.querySelector('canvas').dataset.scale,
                window: c.querySelector('canvas').dataset.window}))};""", name)

    def summaries(self, name):
        """What the card of stream `name` says beneath each channel: [{row: text}]."""
        return self.js("""
            const card = [...document.querySelectorAll('article.card')]
                .find((c) => c.dataset.stream === arguments[0]);
            return card ? [...card.querySelectorAll('.channel')].map((c) => Object.fromEntries(
                [...c.querySelectorAll('dd')].map((dd) => [dd.dataset.key, dd.textContent])))
                : null;""", name)

    def pixels(self, name):
        return self.js("""
            const card = [...document.querySelectorAll('article.card')]
                .find((c) => c.dataset.stream === arguments[0]);
            return card.querySelector('canvas').toDataURL();""", name)


def heights(bins, log):
    counts = [b["count"] for b in (bins[1:257] if len(bins) == 258 else bins)]
    top = max(counts)
    if top == 0:
        return [0.0] * len(counts)
    if log:
        return [math.log1p(c) / math.log1p(top) for c in counts]
    return [c / top for c in counts]


def compare(page, name, cli, log=False, window="all"):
    shown = page.card(name)
    channels = cli.get("channels") or [dict(cli, channel="")]
    if shown is None or len(shown["channels"]) != len(channels):
        fail("%s: the card shows %r" % (name, shown))
    for got, want in zip(shown["channels"], channels):
        where = "%s%s" % (name, "/" + want["channel"] if want["channel"] else "")
        if got["count"] != want["count"]:
            fail("%s: count %d shown, tally query says %d" % (where, got["count"], want["count"]))
        for k in ("p50", "p90", "p99"):
            if got[k] != str(want["quantiles"][k]["value"]):
                fail("%s: %s %s shown, tally query says %s" % (where, k, got[k],
                                                                want["quantiles"][k]["value"]))
        expect = heights(want["bins"], log)
        if len(got["heights"]) != 256 or any(abs(a - b) > 1e-4 for a, b in
                                             zip(got["heights"], expect)):
            fail("%s: the bars' heights differ from tally query's bins" % where)
        if got["scale"] != ("log" if log else "linear") or got["window"] != window:
            fail("%s: scale %s, window %s" % (where, got["scale"], got["window"]))
        if not got["painted"]:
            fail("%s: the canvas was not painted at its size" % where)
    return shown


def cli_table(text):
    """`tally query`'s human summary as one {row: cell} per channel. One channel: the cell is
    the rest of the line (">= 100", "70.90 (in range)"); several: the columns of each row."""
    rows = {}
    for line in text.splitlines():
        key, _, rest = line.partition(" ")
        rows[key] = rest.strip()
    if "channel" not in rows:
        return [rows]
    channels = rows["channel"].split()
    return [{k: v.split()[i] for k, v in rows.items() if len(v.split()) == len(channels)}
            for i in range(len(channels))]


def compare_text(page, d, name, *args):
    """Each row the card shows beneath each channel reads as `tally query NAME` prints it."""
    want = cli_table(d.tally("query", *args, name).stdout.decode())
    shown = page.summaries(name)
    if shown is None or len(shown) != len(want):
        fail("%s: the card's summaries are %r, tally query's %r" % (name, shown, want))
    for got, cli in zip(shown, want):
        for row, text in got.items():
            if cli.get(row) != text:
                fail("%s: %s %r shown, tally query prints %r" % (name, row, text, cli.get(row)))
        if not {"count", "mean", "p50", "p90", "p99"} <= set(got):
            fail("%s: the card shows only %s" % (name, sorted(got)))


def screenshots(page, desktop, phone):
    """The page at a desktop's width, then at a phone's (where nothing may be wider than the
    screen), then back."""
    drv = page.drv
    time.sleep(0.5)  # a frame or two after the last change
    drv.save_screenshot(os.path.join(BUILD, desktop))
    drv.set_window_size(390, 844)
    page.wait("return document.documentElement.clientWidth <= 400", "a phone's width")
    time.sleep(0.5)
    wide = page.js("""return document.documentElement.scrollWidth -
        document.documentElement.clientWidth""")
    if wide > 1:
        fail("at a phone's width the page is %d px wider than the screen" % wide)
    drv.save_screenshot(os.path.join(BUILD, phone))
    drv.set_window_size(1280, 1000)
    page.wait("return document.documentElement.clientWidth > 1000", "a desktop's width")


def write_clock(path, ms):
    with open(path + ".tmp", "w") as f:
        f.write("%d\n" % ms)
    os.replace(path + ".tmp", path)


def feed(d):
    rng = random.Random(7)
    u8 = bytes(min(255, max(0, int(rng.gauss(90, 25)))) for _ in range(20000))
    i32 = b"".join(int(rng.gauss(100, 300)).to_bytes(4, "little", signed=True)
                   for _ in range(8000))
    rgb = bytes(v for _ in range(2000) for v in (rng.randrange(256),
                                                 min(255, int(rng.expovariate(1 / 50))), 200))
    d.hist("cam0", u8, "--type", "u8")
    d.hist("temp", i32, "--type", "i32", "--range", "-1000", "1000")
    d.hist("img", rgb, "--type", "rgb")
    d.hist(ODD, bytes(range(0, 256, 3)), "--type", "u8")
    # Over [0, 100): 55 % below, 30 % inside, 15 % above: p50 is "< 0", p90 and p99 ">= 100".
    over = [-5] * 550 + [rng.randrange(100) for _ in range(300)] + [250] * 150
    d.hist("over", b"".join(v.to_bytes(4, "little", signed=True) for v in over), "--type", "i32",
           "--range", "0", "100")


def refused_bookmark(page, d):
    """Bookmarks tallyd refuses: its message shown, a view it takes instead; then a new
    fragment on the open page."""
    drv = page.drv
    status, _, body = d.request("GET", "/api/v1/events?stream=cam0&last=5m")
    if status != 400:
        fail("last=5m with a 60 s window ring: %d, expected 400" % status)
    message = json.loads(body)["message"]
    page.console()
    drv.get("about:blank")
    drv.get("http://127.0.0.1:%d/#stream=cam0&last=5m" % d.port)
    page.wait("""const e = document.getElementById('error'); return !e.classList.contains('hidden')
        && e.textContent === arguments[0] && location.hash === '#stream=cam0' &&
        document.getElementById('status').dataset.state === 'live' &&
        [...document.querySelectorAll('article.card')].some((c) => c.dataset.stream === 'cam0'
        && +c.dataset.updates > 0)""", "tallyd's message and all time instead of last=5m",
              message + " (showing all time instead)")
    drv.save_screenshot(os.path.join(BUILD, "web-refused.png"))
    compare(page, "cam0", d.query("cam0"))
    if page.js("return document.getElementById('empty').classList.contains('hidden')") is not True:
        fail("the page says there are no streams")
    print("ok: a refused bookmark (last=5m) shows %r and all time" % message)

    page.js("location.hash = '#stream=over&stream=cam0&last=10s'")
    page.wait("""const cards = [...document.querySelectorAll('article.card')];
        return cards.map((c) => c.dataset.stream).join() === 'over,cam0' && cards.every((c) =>
        +c.dataset.updates > 0 && c.querySelector('canvas').dataset.window === '10s') &&
        document.getElementById('error').classList.contains('hidden') &&
        document.getElementById('window').value === '10s'""", "the new fragment's view")
    compare(page, "cam0", d.query("cam0", "--last", "10s"), window="10s")
    compare_text(page, d, "cam0", "--last", "10s")
    print("ok: a new fragment on the open page takes effect")

    bad = "x" * 65
    status, _, body = d.request("GET", "/api/v1/events?stream=" + bad)
    message = json.loads(body)["message"]
    page.js("location.hash = '#stream=' + arguments[0]", bad)
    page.wait("""const e = document.getElementById('error'); return e.textContent ===
        arguments[0] && location.hash === '' && document.querySelectorAll('article.card')
        .length === 0 && document.getElementById('status').dataset.state === 'live'""",
              "tallyd's message and no stream instead of a bad name",
              message + " (showing no stream instead)")
    print("ok: a name that is not a stream name: %r" % message)
    page.console(refused=("last=5m", "stream=" + bad))  # the refusals' own lines


def hundred_streams(page, d):
    """100 streams: the chart of the last one chosen is on the first screen; the filter."""
    drv = page.drv
    names = ["s%03d" % i for i in range(100 - len(d.names))]
    for name in names:
        d.hist(name, bytes([len(name)]), "--type", "u8")
    last = names[-1]
    drv.get("about:blank")
    drv.get("http://127.0.0.1:%d/#stream=%s" % (d.port, last))
    page.wait("""return document.querySelectorAll('#streams tbody tr').length === 100 &&
        [...document.querySelectorAll('article.card')].some((c) => c.dataset.stream ===
        arguments[0] && +c.dataset.updates > 0)""", "100 streams and a chart", last)
    where = page.js("""const card = [...document.querySelectorAll('article.card')].find((c) =>
        c.dataset.stream === arguments[0]); const r = card.querySelector('canvas')
        .getBoundingClientRect(); return {top: r.top, bottom: r.bottom, scroll: window.scrollY,
        height: window.innerHeight}""", last)
    if where["scroll"] != 0 or where["top"] < 0 or where["bottom"] > where["height"]:
        fail("with 100 streams the chosen chart is at %.0f-%.0f px of a %d px screen"
             % (where["top"], where["bottom"], where["height"]))
    compare_text(page, d, last)
    print("ok: 100 streams, the chosen chart at %.0f-%.0f px of %d" % (where["top"],
                                                                     where["bottom"],
                                                                     where["height"]))
    drv.find_element(By.ID, "filter").send_keys(names[-1][:3])
    want = [n for n in d.names + names if names[-1][:3] in n.lower()]
    page.wait("""return JSON.stringify([...document.querySelectorAll('#streams tbody tr')]
        .filter((r) => !r.hidden).map((r) => r.dataset.stream)) === arguments[0] &&
        document.getElementById('shown').textContent === arguments[1]""",
              "the filtered list", json.dumps(want, separators=(",", ":")),
              "%d of 100" % len(want))
    drv.save_screenshot(os.path.join(BUILD, "web-100-streams.png"))
    print("ok: the filter by name leaves %d rows" % len(want))


def run(tmp):
    clock = os.path.join(tmp, "clock")
    write_clock(clock, T0)
    d = Daemon(TALLYD, TALLY, tmp, ["--test-clock", clock, "--pub-interval-ms", "250"])
    drv = None
    try:
        feed(d)
        drv = browser(tmp)
        page = Page(drv)
        drv.get("http://127.0.0.1:%d/#stream=cam0&stream=temp&stream=img&stream=%s&stream=over"
                % (d.port, quote(ODD)))
        names = ("cam0", "temp", "img", ODD, "over")
        d.names = list(names)
        page.wait("""return arguments[0].every((n) => [...document.querySelectorAll(
            'article.card')].some((c) => c.dataset.stream === n && +c.dataset.updates > 0))
            && document.querySelectorAll('#streams tbody tr').length === 5""", "five streams",
                  list(names))
        page.wait("return performance.getEntriesByName('first-render').length === 1",
                  "the first-render mark")
        for name in names:
            compare(page, name, d.query(name))
            compare_text(page, d, name)
        rows = page.js("""return [...document.querySelectorAll('#streams tbody tr')]
            .map((r) => [r.dataset.stream, +r.dataset.values])""")
        if rows != [[n, d.query(n)["hist_total"]] for n in names]:
            fail("the list shows %r" % rows)
        print("ok: the page shows what tally query --json says and tally query prints (u8, i32, "
              "rgb8, %r, quantiles beyond the range)" % ODD)

        # A live update: a batch 30 s later (window clock), shown without a reload.
        before = page.card("cam0")["updates"]
        linear = page.pixels("cam0")
        write_clock(clock, T0 + 30000)
        recent = bytes([200 + (i % 40) for i in range(3000)])
        d.hist("cam0", recent, "--type", "u8")
        total = d.query("cam0")["count"]
        page.wait("""const c = [...document.querySelectorAll('article.card')].find((c) =>
            c.dataset.stream === 'cam0'); return c && +c.querySelector('.channel')
            .dataset.count === arguments[0]""", "the batch sent after the page opened", total)
        shown = compare(page, "cam0", d.query("cam0"))
        if shown["updates"] <= before:
            fail("no new event counted for cam0")
        print("ok: a live update after a new batch")
        screenshots(page, "web-desktop.png", "web-phone.png")

        # The log toggle.
        drv.find_element(By.ID, "log").click()
        page.wait("""return [...document.querySelectorAll('canvas')].every((c) =>
            c.dataset.scale === 'log')""", "log heights")
        compare(page, "cam0", d.query("cam0"), log=True)
        logged = page.pixels("cam0")
        if logged == linear:
            fail("the log toggle did not change what is drawn")
        print("ok: the log toggle")

        # The window selector: only the recent batch is in the last 10 s.
        Select(drv.find_element(By.ID, "window")).select_by_value("10s")
        page.wait("""const c = [...document.querySelectorAll('article.card')].find((c) =>
            c.dataset.stream === 'cam0'); return c && c.querySelector('canvas').dataset.window
            === '10s' && +c.querySelector('.channel').dataset.count === arguments[0]""",
                  "the last 10 s", len(recent))
        compare(page, "cam0", d.query("cam0", "--last", "10s"), log=True, window="10s")
        if page.pixels("cam0") == logged:
            fail("the window selector did not change what is drawn")
        print("ok: the window selector")

        screenshots(page, "web-window.png", "web-window-phone.png")
        refused_bookmark(page, d)
        hundred_streams(page, d)
        page.console()
        first = page.js("return performance.getEntriesByName('first-render')[0].startTime")
        print("ok: no console error or CSP violation; screenshots in %s; first render %.0f ms"
              % (BUILD, first))
    finally:
        if drv:
            drv.quit()
        d.stop()


def main():
    with tempfile.TemporaryDirectory(prefix="tally-web-browser.") as tmp:
        run(tmp)
    print("PASS")


main()
