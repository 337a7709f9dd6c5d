# SPDX-License-Identifier: Apache-2.0
"""The Python binding (client/python) against a real tallyd that this module starts ($TALLYD,
on ipc:// sockets in a scratch folder: no ports to collide), each result checked against NumPy
computing the same thing or against the `tally` CLI ($TALLY_CLI, `query --json`) reading the
same stream: every dtype (u8, i32, u16, rgb8, rgba8) through arrays, pushes and shared memory;
summaries, quantiles and bin edges; window queries (a test clock file moves tallyd's window
clock); subscriptions; numbered pushes and their resume; CURVE keys; the errors (a clear
ImportError when libtally cannot be loaded); the installed package (py.typed, its version) and
the import-time check of the ctypes structs against the C layouts.

Run by tests/test_python.sh (CTest test_python), which installs the package with pip into a
scratch virtual environment first.
"""

from __future__ import annotations

import ast
import ctypes
import importlib.metadata
import json
import math
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List

import numpy as np
import numpy.typing as npt
import pytest

import tally
from tally import _lib

RNG = np.random.default_rng(20261123)
T0 = 1_800_000_000_000  # the test clock's start, ms since the epoch (a whole interval)
INTERVAL_MS = 1000


class Daemon:
    """A tallyd started for these tests, and the CLI pointed at it."""

    def __init__(self, tallyd: str, extra: List[str], **client_kw: Any):
        self.dir = Path(tempfile.mkdtemp(prefix="tally-py.", dir=os.environ.get("TMPDIR")))
        self.endpoint = f"ipc://{self.dir}/tallyd.sock"
        self.pub = f"ipc://{self.dir}/pub.sock"
        self.clock = self.dir / "clock"
        self.set_clock(T0)
        self.log = open(self.dir / "tallyd.log", "wb")
        self.proc = subprocess.Popen(
            [tallyd, "--bind", self.endpoint, "--backend", "cpu", "--shm-socket",
             str(self.dir / "shm.sock"), "--pub", self.pub, "--pub-interval-ms", "50",
             "--test-clock", str(self.clock), "--window-intervals", "8",
             "--window-interval-ms", str(INTERVAL_MS)] + extra,
            stdout=self.log, stderr=subprocess.STDOUT)
        self.wait_ready(client_kw)

    def set_clock(self, ms: int) -> None:
        tmp = self.clock.with_suffix(".tmp")
        tmp.write_text(f"{ms}\n")
        tmp.replace(self.clock)  # atomic: tallyd never reads half a number

    def wait_ready(self, client_kw: Dict[str, Any]) -> None:
        for _ in range(400):
            if self.proc.poll() is not None:
                break
            try:
                with tally.Client(self.endpoint, 500, **client_kw) as c:
                    c.ping()
                    return
            except tally.Error:
                time.sleep(0.05)
        raise RuntimeError(f"tallyd did not start: {(self.dir / 'tallyd.log').read_text()}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def cli(self, *args: str) -> str:
        out = subprocess.run([os.environ["TALLY_CLI"], "-e", self.endpoint, *args],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    def cli_json(self, *args: str) -> Dict[str, Any]:
        parsed: Dict[str, Any] = json.loads(self.cli("query", "--json", *args))
        return parsed


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    d = Daemon(os.environ["TALLYD"], [])
    yield d
    d.stop()


@pytest.fixture(scope="module")
def c(daemon: Daemon) -> Iterator[tally.Client]:
    with tally.Client(daemon.endpoint, 10000) as client:
        yield client


def cli_bins(entry: Dict[str, Any]) -> List[int]:
    """The counts of `tally query --json`'s bins (u8: 256; i32/u16: underflow, 256, overflow)."""
    return [b["count"] for b in entry["bins"]]


# ---- The package ------------------------------------------------------------------------------


def test_installed_package() -> None:
    # The pip-installed copy is the one imported, typed, at libtally's version.
    assert os.sep + "client" + os.sep + "python" not in tally.__file__
    assert (Path(tally.__file__).parent / "py.typed").is_file()
    assert importlib.metadata.version("tally") == tally.library_version()


def test_not_owner_status() -> None:
    """Direct mode's status (PROTOCOL.md §7, 26): its number from the header, its name from
    libtally, as an Error carries them."""
    assert tally._wire.E_NOT_OWNER == 26
    e = tally.Error(tally._wire.E_NOT_OWNER, "partition 1 is owned by b at tcp://h:5555")
    assert e.status == 26 and e.name == "not_owner"


def test_layout_check() -> None:
    # The import-time check passes the real table and refuses a ctypes struct whose size,
    # field offset or field set differs from the C struct's (tally/_wire.py's LAYOUT).
    size, fields = tally._wire.LAYOUT["tally_req_t"]
    _lib.check_layouts([_lib.Req], {"tally_req_t": (size, fields)})
    moved = {**fields, "seq": (fields["seq"][0] + 8, 8)}
    fewer = {n: at for n, at in fields.items() if n != "pred"}
    for bad, why in (((size + 8, fields), "sizeof"), ((size, moved), "seq (offset, size)"),
                     ((size, fewer), "pred (offset, size)")):
        with pytest.raises(ImportError, match=r"Req does not match the C tally_req_t: " +
                           why.replace("(", r"\(").replace(")", r"\)")):
            _lib.check_layouts([_lib.Req], {"tally_req_t": bad})
    with pytest.raises(ImportError, match="not in tally/_wire.py's LAYOUT"):
        _lib.check_layouts([_lib.Req], {})
    # Every struct the binding mirrors is checked, the new ones included.
    assert {cls._c_name for cls in _lib.STRUCTS} == set(tally._wire.LAYOUT)


def _import_with(library: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, TALLY_LIBRARY=library)
    return subprocess.run([sys.executable, "-c", "import tally"], env=env, capture_output=True,
                          text=True, timeout=60)


def test_import_error_names_the_library(tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere" / "libtally.so.0")
    out = _import_with(missing)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: tally: cannot load libtally"), last
    assert repr(missing) in last and "from $TALLY_LIBRARY" in last
    assert "set TALLY_LIBRARY to the path of libtally.so" in last
    # A library that is not libtally: the functions it lacks are named.
    out = _import_with(np.__file__)  # a file that is not a shared object
    assert "ImportError: tally: cannot load libtally" in out.stderr
    import ctypes.util
    other = ctypes.util.find_library("m") or "libm.so.6"
    out = _import_with(other)
    last = out.stderr.strip().splitlines()[-1]
    assert "is not a libtally this binding can use: it lacks tally_version" in last, last


def test_loads_libtally_by_its_soname(tmp_path: Path) -> None:
    """Without $TALLY_LIBRARY the binding loads libtally.so.0, the SONAME it was generated for,
    as the loader finds it (the libtally0 package), even where the development symlink
    libtally.so names another major version (a newer libtally-dev beside libtally0):
    ctypes.util.find_library("tally") follows that symlink and would load libtally.so.1."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler to build the other major version")
    assert tally._wire.SONAME == "libtally.so.0"
    os.symlink(os.path.realpath(os.environ["TALLY_LIBRARY"]), tmp_path / "libtally.so.0")
    (tmp_path / "other.c").write_text("int tally_other_major(void) { return 1; }\n")
    subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libtally.so.1", "-o",
                    str(tmp_path / "libtally.so.1"), str(tmp_path / "other.c")], check=True)
    os.symlink("libtally.so.1", tmp_path / "libtally.so")
    env = {k: v for k, v in os.environ.items() if k != "TALLY_LIBRARY"}
    env["LD_LIBRARY_PATH"] = str(tmp_path)
    show = ("import tally, tally._lib\n"
            "print(tally._lib.library_path()[0])\n"
            "print(*sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libtally' in l}))")
    out = subprocess.run([sys.executable, "-c", show], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    name, loaded = out.stdout.split("\n")[:2]
    assert name == "libtally.so.0"
    assert loaded == os.path.realpath(os.environ["TALLY_LIBRARY"])


# ---- Data operations ------------------------------------------------------------------------


def test_filter(c: tally.Client) -> None:
    x = RNG.integers(-1000, 1000, 100001, dtype=np.int32)
    got = c.filter(x, gt=0, stable=True, chunk_bytes=4096, window=3)
    np.testing.assert_array_equal(got, x[x > 0])
    assert got.dtype == np.int32
    got = c.filter(x, between=(-5, 5))  # unordered: compare as multisets
    np.testing.assert_array_equal(np.sort(got), np.sort(x[(x >= -5) & (x <= 5)]))
    b = RNG.integers(0, 256, 5000, dtype=np.uint8)
    np.testing.assert_array_equal(c.filter(b, eq=7, stable=True), b[b == 7])
    np.testing.assert_array_equal(c.filter(x[::3], lt=0, stable=True), x[::3][x[::3] < 0])


def test_scan(c: tally.Client) -> None:
    x = RNG.integers(-(2**31), 2**31 - 1, 70000, dtype=np.int32)
    np.testing.assert_array_equal(c.scan(x, chunk_bytes=10000), np.cumsum(x, dtype=np.int64))
    excl = c.scan(x, exclusive=True, out32=True)
    assert excl.dtype == np.int32
    np.testing.assert_array_equal(excl, (np.cumsum(x, dtype=np.int64) - x).astype(np.int32))
    c.scan(x[:30000], stream="py-scan")  # a stream carries across calls
    rest = c.scan(x[30000:], stream="py-scan")
    np.testing.assert_array_equal(rest, np.cumsum(x, dtype=np.int64)[30000:])
    assert c.query("py-scan")["scan_carry"] == int(np.sum(x, dtype=np.int64))


def test_hist_u8_i32(c: tally.Client) -> None:
    b = RNG.integers(0, 256, 300000, dtype=np.uint8)
    got = c.hist(b, chunk_bytes=65536)
    np.testing.assert_array_equal(got, np.bincount(b, minlength=256))
    assert got.dtype == np.uint64 and got.shape == (256,)
    x = RNG.integers(-100, 400, 10000, dtype=np.int32)
    got = c.hist(x, range=(0, 256))
    assert got.shape == (258,)
    np.testing.assert_array_equal(got[:256], np.bincount(x[(x >= 0) & (x < 256)], minlength=256))
    assert got[256] == np.sum(x < 0) and got[257] == np.sum(x >= 256)
    with pytest.raises(TypeError, match="i32 histogram needs range"):
        c.hist(x)


def test_hist_u16_rgb_rgba(c: tally.Client, daemon: Daemon) -> None:
    # u16: 256 bins of 16 values over a 12-bit range, under/overflow as for i32.
    v = RNG.integers(0, 5000, 20000, dtype=np.uint16)
    got = c.hist(v, range=(0, 4096), stream="py-u16")
    inside = v[v < 4096]
    np.testing.assert_array_equal(got[:256], np.bincount(inside // 16, minlength=256))
    assert got[256] == 0 and got[257] == np.sum(v >= 4096)
    q = c.query("py-u16")
    assert q["type"] == "u16" and (q["hist_lo"], q["hist_hi"]) == (0, 4096)
    np.testing.assert_array_equal(q["bins"], got[:256])
    # rgb8: an (H, W, 3) image is rgb8 by its shape; one histogram per channel.
    img = RNG.integers(0, 256, (48, 64, 3), dtype=np.uint8)
    got = c.hist(img, stream="py-rgb")
    assert got.shape == (3, 256)
    for ch in range(3):
        np.testing.assert_array_equal(got[ch], np.bincount(img[..., ch].ravel(), minlength=256))
    q = c.query("py-rgb")
    assert q["type"] == "rgb8" and q["bins"].shape == (3, 256) and tally.channels(q) == 3
    np.testing.assert_array_equal(q["bins"], got)
    cli = daemon.cli_json("py-rgb")
    assert [e["channel"] for e in cli["channels"]] == ["r", "g", "b"]
    for ch in range(3):
        assert cli_bins(cli["channels"][ch]) == q["bins"][ch].tolist()
    # rgba8 from interleaved bytes, named explicitly ("rgba" as the CLI spells it).
    px = RNG.integers(0, 256, 4 * 1000, dtype=np.uint8)
    got = c.hist(px, dtype="rgba", chunk_bytes=4 * 97)
    assert got.shape == (4, 256)
    np.testing.assert_array_equal(got[3], np.bincount(px[3::4], minlength=256))
    # filter takes an image's bytes as u8.
    flat = img.ravel()
    np.testing.assert_array_equal(c.filter(img, gt=250, stable=True), flat[flat > 250])
    with pytest.raises(TypeError, match="u16 histogram needs range"):
        c.hist(v)
    with pytest.raises(TypeError, match="filter takes i32, u8 elements, not u16"):
        c.filter(v, gt=1)
    with pytest.raises(TypeError, match="dtype u16 needs a uint16 array, not uint8"):
        c.hist(px, dtype="u16", range=(0, 10))
    with pytest.raises(TypeError, match="takes NumPy arrays"):
        c.hist([1, 2, 3])  # type: ignore[arg-type]


def test_minmax(c: tally.Client) -> None:
    """minmax against NumPy's min and max, in several chunks, each type; empty and bad types."""
    x = RNG.integers(-2**31, 2**31, 10000, dtype=np.int64).astype(np.int32)
    x[1234], x[9876] = -2**31, 2**31 - 1
    assert c.minmax(x, chunk_bytes=4 * 333) == (-2**31, 2**31 - 1)
    assert c.minmax(np.array([-5, 3, -7, 2], dtype=np.int32)) == (-7, 3)
    b = RNG.integers(3, 200, 5000, dtype=np.uint8)
    assert c.minmax(b, chunk_bytes=777) == (int(b.min()), int(b.max()))
    w = np.array([60000, 7, 65535, 12], dtype=np.uint16)
    assert c.minmax(w) == (7, 65535)
    assert c.minmax(np.array([], dtype=np.int32)) is None
    with pytest.raises(TypeError, match="minmax takes i32, u8, u16 elements, not rgb8"):
        c.minmax(b, dtype="rgb8")


def test_streams_and_errors(c: tally.Client) -> None:
    c.hist(np.frombuffer(b"hello", np.uint8), stream="py-cam")
    q = c.query("py-cam")
    assert q["hist_total"] == 5 and q["bins"][ord("l")] == 2 and q["bins"].shape == (256,)
    assert q["type"] == "u8" and q["stream"] == "py-cam" and q["window"] is None
    assert "py-cam" in c.streams()
    c.reset("py-cam")
    q = c.query("py-cam")
    assert q["hist_total"] == 0 and int(q["bins"].sum()) == 0
    c.delete("py-cam")
    with pytest.raises(tally.Error) as e:
        c.query("py-cam")
    assert e.value.name == "unknown_stream" and "py-cam" in e.value.message
    assert c.ping() > 0
    assert c.info()["protocol"] == "1"
    # libtally's parser: §5's first keys in the daemon's order
    assert list(c.info())[:5] == ["version", "protocol", "backend", "backends", "devices"]
    assert "# TYPE" in c.stats()
    with pytest.raises(ValueError, match="invalid stream name"):
        c.scan(np.zeros(3, np.int32), stream="a b")
    with pytest.raises(TypeError):
        c.scan(np.zeros(3, np.float32))


def test_errors_say_what_the_cli_says(tmp_path: Path) -> None:
    """libtally's diagnosis, as the CLI prints it: an endpoint of another kind when the client is
    made, nothing listening at the first call (at once: transport, not timeout)."""
    def cli_says(endpoint: str) -> str:
        out = subprocess.run([os.environ["TALLY_CLI"], "-e", endpoint, "ping"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode in (2, 3) and out.stderr.startswith("tally: ")
        return out.stderr[len("tally: "):].rstrip("\n")

    with pytest.raises(tally.Error) as e:
        tally.Client("127.0.0.1:15731")
    assert e.value.message == ("invalid endpoint '127.0.0.1:15731': unsupported transport (use "
                               "tcp://HOST:PORT or ipc://PATH)")
    assert e.value.message == cli_says("127.0.0.1:15731")
    with socket.socket() as s:  # a port nothing listens on once it is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for endpoint, why in ((f"tcp://127.0.0.1:{port}", "Connection refused"),
                          (f"ipc://{tmp_path}/none.sock", "No such file or directory")):
        with tally.Client(endpoint, 60000) as c:  # a wait for the timeout would be a minute
            with pytest.raises(tally.Error) as e:
                c.ping()
        assert e.value.name == "transport"
        assert e.value.message == f"cannot connect to {endpoint}: {why} (is tallyd running?)"
        assert e.value.message == cli_says(endpoint)


# ---- Summaries and quantiles ----------------------------------------------------------------


def nearest_rank(values: npt.NDArray[Any], q: float) -> int:
    """The value of rank max(1, ceil(q N)) of the sorted values (tally_hist_quantile's rule)."""
    s = np.sort(values.astype(np.int64))
    return int(s[max(1, math.ceil(round(q * 1e6) * len(s) / 1e6)) - 1])


def assert_summary_matches_cli(summary: tally.Summary, cli: Dict[str, Any]) -> None:
    for key in ("count", "in_range", "underflow", "overflow", "min", "max"):
        assert summary[key] == cli[key], key  # type: ignore[literal-required]
    # The CLI's JSON gives each quantile as {q, value, side}; the binding as a Quantile (an int
    # with .side -1/0/+1).
    sides = {-1: "underflow", 0: "in_range", 1: "overflow"}
    got = summary["quantiles"]
    assert got is not None and set(got) == set(cli["quantiles"])
    for name, q in got.items():
        want = cli["quantiles"][name]
        assert (int(q), sides[q.side]) == (want["value"], want["side"]), name
    if cli["mean"] is None:
        assert summary["mean"] is None
    else:
        assert summary["mean"] == pytest.approx(cli["mean"], rel=1e-9)


def test_summaries_match_the_cli(c: tally.Client, daemon: Daemon) -> None:
    b = RNG.integers(0, 256, 10007, dtype=np.uint8)
    c.hist(b, stream="py-sum-u8")
    x = RNG.normal(500, 300, 20000).astype(np.int32)  # some under and over [0, 1000)
    c.hist(x, range=(0, 1000), stream="py-sum-i32")
    v = RNG.integers(0, 70, 3000, dtype=np.uint16)
    c.hist(v, range=(0, 1000), stream="py-sum-u16")  # narrow data in wide bins
    img = RNG.integers(0, 200, (20, 30, 4), dtype=np.uint8)
    c.hist(img, stream="py-sum-rgba")
    for name in ("py-sum-u8", "py-sum-i32", "py-sum-u16"):
        assert_summary_matches_cli(c.summary(name), daemon.cli_json(name))
    cli = daemon.cli_json("py-sum-rgba")
    for ch, channel in enumerate("rgba"):
        assert_summary_matches_cli(c.summary("py-sum-rgba", channel=channel),
                                   cli["channels"][ch])
        assert c.summary("py-sum-rgba", channel=ch) == c.summary("py-sum-rgba", channel=channel)
    s = c.summary("py-sum-i32")
    assert s["underflow"] == np.sum(x < 0) and s["overflow"] == np.sum(x >= 1000)
    assert s["count"] == len(x) and s["in_range"] == len(x) - s["underflow"] - s["overflow"]
    # A stream without a histogram yet summarizes as empty, as the CLI says.
    c.scan(np.arange(3, dtype=np.int32), stream="py-sum-none")
    s = c.summary("py-sum-none")
    assert s["count"] == 0 and s["mean"] is None and s["quantiles"] is None
    assert daemon.cli_json("py-sum-none")["quantiles"] is None
    with pytest.raises(ValueError, match="no histogram yet"):
        c.quantiles("py-sum-none", [0.5])
    with pytest.raises(ValueError, match="channels 0..0, not 1"):
        c.summary("py-sum-u8", channel=1)


def test_arbitrary_quantiles(c: tally.Client) -> None:
    b = RNG.integers(0, 256, 10007, dtype=np.uint8)
    c.hist(b, stream="py-q-u8")
    qs = [0.0, 0.001, 0.25, 0.5, 0.9, 0.99, 0.999, 0.9999, 1.0]
    got = c.quantiles("py-q-u8", qs)
    # u8: one value per bin, so the estimate is the exact nearest-rank quantile.
    assert [int(v) for v in got] == [nearest_rank(b, q) for q in qs]
    assert all(v.side == 0 for v in got)
    s = c.summary("py-q-u8", quantiles=[0.5, 0.999, 0.9999])
    assert s["quantiles"] == {"p50": nearest_rank(b, 0.5), "p99.9": nearest_rank(b, 0.999),
                              "p99.99": nearest_rank(b, 0.9999)}
    # i32 over wide bins: the estimate is in the same bin as the true quantile; beyond the
    # range it is the edge, with its side.
    x = RNG.integers(-500, 3000, 50000, dtype=np.int32)
    c.hist(x, range=(0, 2560), stream="py-q-i32")
    rec = c.query("py-q-i32")
    e = tally.edges(rec)
    assert e[0] == 0 and e[256] == 2560 and np.all(np.diff(e) == 10)
    for q in (0.2, 0.5, 0.75, 0.8):
        true = nearest_rank(x, q)
        est = tally.quantile(rec, q)
        assert est.side == 0 and (true - 0) // 10 == (est - 0) // 10, (q, true, int(est))
    low, high = tally.quantiles(rec, [0.05, 0.99])
    assert (int(low), low.side) == (0, -1) and (int(high), high.side) == (2560, 1)
    assert repr(high) == "Quantile(2560, side=1)"
    np.testing.assert_array_equal(tally.edges(c.query("py-q-u8")), np.arange(257))
    with pytest.raises(ValueError, match="between 0 and 1"):
        tally.quantile(rec, 1.5)
    c.reset("py-q-u8")
    with pytest.raises(ValueError, match="empty histogram"):
        c.quantiles("py-q-u8", [0.5])


# ---- Windows ---------------------------------------------------------------------------------


def test_window_queries(c: tally.Client, daemon: Daemon) -> None:
    a = RNG.integers(0, 100, 5000, dtype=np.uint8)
    bb = RNG.integers(100, 256, 3000, dtype=np.uint8)
    try:
        daemon.set_clock(T0 + 200)
        c.hist(a, stream="py-win")
        daemon.set_clock(T0 + 3 * INTERVAL_MS + 100)
        c.hist(bb, stream="py-win")
        daemon.set_clock(T0 + 3 * INTERVAL_MS + 500)
        last = c.query("py-win", last_ms=1000)  # the current interval only: batch bb
        np.testing.assert_array_equal(last["bins"], np.bincount(bb, minlength=256))
        assert last["hist_total"] == len(bb)
        assert last["window"] == {"start_ms": T0 + 3 * INTERVAL_MS,
                                  "end_ms": T0 + 3 * INTERVAL_MS + 500}
        assert last["batches"] == 2  # the counters are the stream's, not the window's
        both = c.query("py-win", last_ms=4 * INTERVAL_MS)
        np.testing.assert_array_equal(both["bins"], np.bincount(np.concatenate([a, bb]),
                                                                minlength=256))
        assert both["window"] is not None and both["window"]["start_ms"] == T0
        np.testing.assert_array_equal(c.query("py-win")["bins"], both["bins"])
        # The CLI's window over the same stream at the same clock: the same numbers.
        cli = daemon.cli_json("--last", "1s", "py-win")
        assert cli_bins(cli) == last["bins"].tolist()
        assert cli["window"] == last["window"]
        assert_summary_matches_cli(c.summary("py-win", last_ms=1000), cli)
        assert c.quantiles("py-win", [0.0], last_ms=1000)[0] == int(bb.min())
        with pytest.raises(tally.Error) as e:
            c.query("py-win", last_ms=9 * INTERVAL_MS)  # the ring holds 8 intervals
        assert e.value.status == tally._wire.E_WINDOW and e.value.name == "bad_window"
        with pytest.raises(ValueError, match="last_ms 0"):
            c.query("py-win", last_ms=0)
    finally:
        daemon.set_clock(T0)


# ---- Subscriptions ---------------------------------------------------------------------------


def wait_for(sub: tally.Subscriber, stream: str, kind: str,
             poke: Any = None) -> tally.Publication:
    """The next publication of kind for stream, poking tallyd (a new batch) while none comes:
    the SUB socket connects in the background and misses what was published before."""
    for _ in range(100):
        if poke:
            poke()
        pub = sub.recv(timeout_ms=200)
        while pub is not None:
            if pub.stream == stream and pub.kind == kind:
                return pub
            pub = sub.recv(timeout_ms=0)
    raise AssertionError(f"no {kind} publication of {stream}")


def test_subscriptions(c: tally.Client, daemon: Daemon) -> None:
    assert c.info()["pub"] == daemon.pub
    with c.subscribe("py-sub") as sub:
        assert sub.fileno() >= 0
        x = np.frombuffer(b"subscribe", np.uint8)
        pub = wait_for(sub, "py-sub", "update", lambda: c.hist(x, stream="py-sub"))
        assert pub.interval_ms == 50 and pub.pub_seq >= 1 and pub.time_ms == T0
        assert pub.record is not None
        # The record is the stream's all-time record: once the stream is quiet, the last
        # publication holds what a query gives.
        latest = wait_for(sub, "py-sub", "update", lambda: c.hist(x, stream="py-sub"))
        assert latest.pub_seq > pub.pub_seq and latest.record is not None
        q = c.query("py-sub")
        final, deadline = latest, time.monotonic() + 20
        while final.record is not None and final.record["hist_total"] != q["hist_total"] \
                and time.monotonic() < deadline:
            final = sub.recv(timeout_ms=200) or final
        assert final.record is not None
        np.testing.assert_array_equal(final.record["bins"], q["bins"])
        assert final.record["hist_total"] == q["hist_total"]
        assert tally.summarize(final.record) == c.summary("py-sub")
        c.delete("py-sub")
        gone = wait_for(sub, "py-sub", "deleted")
        assert gone.record is None and gone.pub_seq > final.pub_seq
        assert sub.recv(timeout_ms=0) is None  # nothing else is pending
    # An explicit endpoint and prefix; other streams' publications do not arrive.
    with tally.Subscriber(daemon.pub, "py-only") as sub:
        pub = wait_for(sub, "py-only", "update",
                       lambda: (c.hist(x, stream="py-only"), c.hist(x, stream="py-other")))
        assert pub.stream == "py-only"
        for _ in range(5):
            other = sub.recv(timeout_ms=100)
            assert other is None or other.stream == "py-only"
    # Iteration, and fileno() for select(): readable once a publication may have arrived
    # (edge-triggered: drain with recv(0) before waiting again).
    with tally.Subscriber(daemon.pub, "py-iter") as sub:
        first = wait_for(sub, "py-iter", "update", lambda: c.hist(x, stream="py-iter"))
        while sub.recv(timeout_ms=0) is not None:
            pass
        c.hist(x, stream="py-iter")
        got = next(iter(sub))
        assert got.stream == "py-iter" and got.pub_seq > first.pub_seq
        while sub.recv(timeout_ms=0) is not None:
            pass
        c.hist(x, stream="py-iter")
        deadline, seen = time.monotonic() + 10, None
        while seen is None and time.monotonic() < deadline:
            readable, _, _ = select.select([sub], [], [], deadline - time.monotonic())
            while readable and (arrived := sub.recv(timeout_ms=0)) is not None:
                seen = arrived
        assert seen is not None and seen.stream == "py-iter" and seen.pub_seq > got.pub_seq
    with pytest.raises(tally.Error, match="at most 64 bytes"):
        tally.Subscriber(daemon.pub, "x" * 65)


# ---- Numbered pushes -------------------------------------------------------------------------


def test_numbered_push_and_resume(c: tally.Client) -> None:
    b = RNG.integers(0, 256, 10 * 1000, dtype=np.uint8)
    # A push that stopped after 4 of its 10 chunks (the first 4 chunks sent, numbered).
    c.hist(b[:4000], stream="py-seq", seq=True, chunk_bytes=1000)
    first = c.last_result
    assert first is not None and first["chunks"] == 4 and first["last_seq"] == 4
    base = first["seq_base"]
    assert base == 0  # a new stream: numbered from 1
    # Resuming with its seq base sends only the 6 chunks the stream lacks.
    got = c.hist(b, stream="py-seq", seq_base=base, chunk_bytes=1000)
    res = c.last_result
    assert res is not None and (res["skipped"], res["applied"], res["chunks"]) == (4, 10, 6)
    np.testing.assert_array_equal(got, np.bincount(b[4000:], minlength=256))
    q = c.query("py-seq")
    np.testing.assert_array_equal(q["bins"], np.bincount(b, minlength=256))  # each chunk once
    assert q["last_seq"] == 10 and q["batches"] == 10
    # Resuming again applies nothing twice.
    c.hist(b, stream="py-seq", seq_base=base, chunk_bytes=1000)
    assert c.last_result is not None and c.last_result["skipped"] == 10
    assert c.query("py-seq")["last_seq"] == 10
    # The same with a push: numbered from the stream's last_seq, resumed after a failure.
    with c.push("hist", stream="py-seq", chunk_bytes=1000) as p:
        p.write(b[:3000])
    assert p.result is not None and p.result["seq_base"] == 10 and p.result["last_seq"] == 13
    with c.push("hist", stream="py-seq", chunk_bytes=1000, seq_base=10) as p:
        p.write(b)
    assert p.result is not None and (p.result["skipped"], p.result["last_seq"]) == (3, 20)
    # A failure says what was applied: a u8 stream refuses int32 data (stream_state).
    with pytest.raises(tally.Error) as e:
        c.hist(np.arange(10, dtype=np.int32), range=(0, 10), stream="py-seq", seq=True)
    assert e.value.name == "stream_state" and e.value.result is not None
    assert e.value.result["applied"] == 0 and e.value.result["last_seq"] == 20
    with pytest.raises(ValueError, match="seq_base resumes a numbered push on a stream"):
        c.hist(b, seq_base=3)


def test_push(c: tally.Client) -> None:
    x = RNG.integers(-50, 50, 250000, dtype=np.int32)
    parts: List[npt.NDArray[Any]] = []
    with c.push("scan", stream="py-push", chunk_bytes=40000, window=4,
                on_output=parts.append) as p:
        for at in range(0, len(x), 33333):  # writes of any length, cut into chunks
            p.write(x[at:at + 33333])
            p.flush()  # every output so far handed over
            assert sum(len(part) for part in parts) == min(at + 33333, len(x))
    np.testing.assert_array_equal(np.concatenate(parts), np.cumsum(x, dtype=np.int64))
    assert all(len(part) <= 10000 for part in parts)
    assert p.result is not None and p.result["bytes"] == x.nbytes
    assert p.result["applied"] == p.result["chunks"] == p.result["last_seq"]
    with c.push("filter", gt=0, stable=True) as p:
        p.write(x)
    np.testing.assert_array_equal(p.output, x[x > 0])
    b = RNG.integers(0, 256, 100000, dtype=np.uint8)
    with c.push("hist", chunk_bytes=30000) as p:
        p.write(b)
    np.testing.assert_array_equal(p.output, np.bincount(b, minlength=256))
    img = RNG.integers(0, 256, (10, 10, 3), dtype=np.uint8)
    with c.push("hist", dtype="rgb8", chunk_bytes=31) as p:  # 10 whole pixels a chunk
        p.write(img)
    assert p.output is not None and p.output.shape == (3, 256)
    np.testing.assert_array_equal(p.output[1], np.bincount(img[..., 1].ravel(), minlength=256))
    with c.push("hist", dtype="u16", range=(0, 100)) as p:
        p.write(np.arange(200, dtype=np.uint16))
    assert p.output is not None and p.output[257] == 100
    with pytest.raises(TypeError, match="this push takes uint16 arrays"):
        with c.push("hist", dtype="u16", range=(0, 100)) as p:
            p.write(np.arange(3, dtype=np.int32))


def test_shared_memory(c: tally.Client) -> None:
    with c.region(4 << 20) as r:
        b = RNG.integers(0, 256, 1 << 20, dtype=np.uint8)
        r.array(np.uint8, 0, len(b))[:] = b
        np.testing.assert_array_equal(c.hist_shm(r, 0, len(b)), np.bincount(b, minlength=256))
        rgb = c.hist_shm(r, 0, 3 * 1000, dtype="rgb8")
        np.testing.assert_array_equal(rgb[2], np.bincount(b[2:3000:3], minlength=256))
        v = RNG.integers(0, 1000, 5000, dtype=np.uint16)
        r.array(np.uint16, 0, len(v))[:] = v
        got = c.hist_shm(r, 0, v.nbytes, dtype=np.uint16, range=(0, 512))
        np.testing.assert_array_equal(got[:256], np.bincount(v[v < 512] // 2, minlength=256))
        assert got[257] == np.sum(v >= 512)
        x = RNG.integers(-9, 9, 1000, dtype=np.int32)
        r.array(np.int32, 0, len(x))[:] = x
        sums = c.scan_shm(r, 0, x.nbytes, 1 << 20)
        np.testing.assert_array_equal(sums, np.cumsum(x, dtype=np.int64))
        kept = c.filter_shm(r, 0, x.nbytes, 2 << 20, gt=0, stable=True)
        np.testing.assert_array_equal(kept, x[x > 0])
    # Over max_batch (16 MiB here): hist_shm sends it in pieces, one answer.
    big = int(c.info()["max_batch"]) * 2 + 12345
    with c.region(big) as r:
        b = RNG.integers(0, 256, big, dtype=np.uint8)
        r.array(np.uint8, 0, big)[:] = b
        np.testing.assert_array_equal(c.hist_shm(r, 0, big, stream="py-big"),
                                      np.bincount(b, minlength=256))
        assert c.query("py-big")["batches"] == 3
    x = RNG.integers(-1000, 1000, 300000, dtype=np.int32)
    got = c.filter(x, lt=0, stable=True, shm=True, chunk_bytes=65536)
    np.testing.assert_array_equal(got, x[x < 0])


def test_gpu_region(c: tally.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """GpuRegion against simulated GPUs (TALLY_TEST_SIM_GPU=1: libtally's GPU memory is a sealed
    memfd, which --test-sim-gpus imports as device memory): __cuda_array_interface__ points at
    the region's memory (written through it in place, as cupy.asarray(r) would), hist, filter
    and scan read it by reference, with out= their output lands in an output region; the
    module's CPU-backend tallyd refuses one with the reason."""
    with pytest.raises(tally.Error, match="a GPU is needed"):
        monkeypatch.setenv("TALLY_TEST_SIM_GPU", "1")
        c.gpu_region(1 << 20)
    d = Daemon(os.environ["TALLYD"], ["--backend", "cuda", "--test-sim-gpus", "1"])
    n = 100_000
    x = RNG.integers(-100, 100, n, dtype=np.int32)
    try:
        with tally.Client(d.endpoint, 10000) as g, g.gpu_region(4 * n, "i32") as r, \
                g.gpu_region(8 * n, output=True) as o:
            iface = r.__cuda_array_interface__
            assert iface["shape"] == (n,) and iface["typestr"] == "<i4" and iface["version"] == 3
            assert iface["data"] == (r.ptr, False) and r.ptr != 0
            view = np.ctypeslib.as_array((ctypes.c_int32 * n).from_address(iface["data"][0]))
            view[:] = x  # in place, through the interface's pointer
            np.testing.assert_array_equal(r.to_host(), x)
            hist = g.hist(r, range=(-100, 100), stream="py-gpu")
            np.testing.assert_array_equal(hist[:256], np.bincount((x + 100) * 256 // 200,
                                                                   minlength=256))
            assert g.query("py-gpu")["elements"] == n
            np.testing.assert_array_equal(g.filter(r, gt=0, stable=True), x[x > 0])
            kept = g.filter(r, gt=0, stable=True, out=o)
            assert kept == np.sum(x > 0)
            np.testing.assert_array_equal(o.to_host(0, kept, np.int32), x[x > 0])
            assert g.scan(r, out=o) == n
            np.testing.assert_array_equal(o.to_host(0, n, np.int64), np.cumsum(x, dtype=np.int64))
            y = RNG.integers(0, 256, 4 * n, dtype=np.uint8)
            r.copy_from(y)
            np.testing.assert_array_equal(g.hist(r, dtype="u8"), np.bincount(y, minlength=256))
            stats = g.stats()
            assert 'tallyd_gpu_region_requests_total{device="0",where="owner"} 5' in stats
            assert "tallyd_gpu_regions 2" in stats
    finally:
        d.stop()


# ---- CURVE -----------------------------------------------------------------------------------


def test_curve_keys(tmp_path: Path) -> None:
    server_public = tally.keygen(str(tmp_path / "server"))
    client_public = tally.keygen(str(tmp_path / "cam1"))
    assert len(server_public) == 40 and (tmp_path / "server.pub").is_file()
    assert (tmp_path / "cam1.key").stat().st_mode & 0o077 == 0
    with pytest.raises(tally.Error, match="exist"):
        tally.keygen(str(tmp_path / "cam1"))  # never overwritten
    keys = dict(server_key=str(tmp_path / "server.pub"), client_key=str(tmp_path / "cam1.key"))
    d = Daemon(os.environ["TALLYD"], ["--curve-secret-key", str(tmp_path / "server.key"),
                                      "--curve-clients", f"cam1:{client_public}"], **keys)
    try:
        with tally.Client(d.endpoint, 5000, **keys) as secure:
            assert secure.curve and secure.info()["curve"] == "on"
            np.testing.assert_array_equal(secure.scan(np.ones(4, np.int32)), [1, 2, 3, 4])
            # The PUB socket admits the same clients: cam1's keys hear py-curve, no keys nothing.
            def poke() -> None:
                secure.hist(np.ones(8, np.uint8), stream="py-curve")

            with secure.subscribe("py-curve") as keyed, tally.Subscriber(d.pub, "") as bare:
                assert wait_for(keyed, "py-curve", "update", poke).record is not None
                for _ in range(10):  # 10 more publication intervals of 50 ms, each with news
                    poke()
                    assert bare.recv(timeout_ms=50) is None
        with tally.Client(d.endpoint, 300) as plain:  # no keys: tallyd never answers
            assert not plain.curve
            with pytest.raises(tally.Error) as e:
                plain.ping()
            assert e.value.name == "timeout"
    finally:
        d.stop()
    with pytest.raises(tally.Error, match="CURVE keys"):
        tally.Client("ipc:///nonexistent", 100, server_key="not-a-key")


# ---- The examples of docs/c-and-python.md ----------------------------------------------------


def readme_examples() -> List[str]:
    """The page's Python blocks that follow a "<!-- python: run -->" line."""
    lines = Path(os.environ["TALLY_README"]).read_text().splitlines()
    blocks, at = [], 0
    while at < len(lines):
        if lines[at].strip() == "<!-- python: run -->" and lines[at + 1] == "```python":
            end = lines.index("```", at + 2)
            blocks.append("\n".join(lines[at + 2:end]))
            at = end
        at += 1
    return blocks


def shown_values(code: str) -> Dict[int, str]:
    """The lines of a block whose comment shows the value of the expression on them, exactly as
    Python prints it ("# 1048576", "# array([...], dtype=int32)", "# {'p50': ...}"): by line."""
    shown = {}
    for number, line in enumerate(code.splitlines(), 1):
        if "  # " not in line:
            continue
        comment = line.split("  # ", 1)[1].strip()
        if "..." in comment:  # a sketch of the value, not the value
            continue
        try:
            ast.literal_eval(comment)
        except (ValueError, SyntaxError):
            if not comment.startswith(("array(", "Quantile(", "{", "[", "(")):
                continue  # words about the value
        shown[number] = comment
    return shown


class _ShowValues(ast.NodeTransformer):
    """Wraps each expression statement on a line in `lines` as __shown(LINE, EXPR)."""

    def __init__(self, lines: Dict[int, str]):
        self.lines = lines

    def visit_Expr(self, node: ast.Expr) -> ast.Expr:
        if node.lineno not in self.lines:
            return node
        call = ast.Call(func=ast.Name("__shown", ast.Load()),
                        args=[ast.Constant(node.lineno), node.value], keywords=[])
        return ast.copy_location(ast.Expr(call), node)


def test_fleet_client(tmp_path: Path) -> None:
    """Client.fleet against two tallyd members in direct mode on a real 3-server NATS cluster
    (tests/nats_cluster.py), each with CURVE on and a server key of its own (published as
    curve=): with the client's key pair every stream's hist reaches its owner and each query
    equals NumPy's counts, `streams` lists them all once, subscribe() is refused (the members
    publish on NATS); without keys the binding raises the library's refusal naming a member; a
    fleet URL missing is said."""
    sys.path.insert(0, str(Path(__file__).parent))
    import nats_cluster  # tests/: the cluster the fleet's Python tests share

    if not nats_cluster.nats_server():
        pytest.skip("no nats-server")
    cluster = nats_cluster.Cluster(str(tmp_path))
    members: List[Daemon] = []
    try:
        client_public = tally.keygen(str(tmp_path / "cam"))
        keys = dict(client_key=str(tmp_path / "cam.key"))
        for m in ("py-a", "py-b"):
            tally.keygen(str(tmp_path / m))
            members.append(Daemon(os.environ["TALLYD"], [
                "--nats-servers", cluster.urls, "--nats-replicas", "1", "--nats-partitions", "4",
                "--nats-lease-ttl-ms", "3000", "--nats-member-id", m, "--nats-direct", "local",
                "--curve-secret-key", str(tmp_path / f"{m}.key"),
                "--curve-clients", client_public], server_key=str(tmp_path / f"{m}.pub"), **keys))

        def owned(d: Daemon, m: str) -> int:
            with tally.Client(d.endpoint, 5000, server_key=str(tmp_path / f"{m}.pub"),
                              **keys) as c:
                return int(c.info().get("nats_partitions_owned", "0"))

        nats_cluster.until(lambda: owned(members[0], "py-a") == 2 and
                           owned(members[1], "py-b") == 2, "the partitions split 2 and 2", 60)
        streams = [f"py-fleet/{i}" for i in range(8)]
        data = {s: RNG.integers(0, 256, 1000 + 37 * i, dtype=np.uint8)
                for i, s in enumerate(streams)}
        with tally.Client.fleet(cluster.urls, 10000, **keys) as fleet:
            assert fleet.curve
            for s in streams:
                fleet.hist(data[s], stream=s)
            for s in streams:
                want = np.bincount(data[s], minlength=256)
                np.testing.assert_array_equal(fleet.query(s)["bins"], want)
            assert sorted(n for n in fleet.streams() if n.startswith("py-fleet/")) == streams
            with pytest.raises(tally.Error, match="a fleet client has no PUB socket"):
                fleet.subscribe()
        with tally.Client.fleet(cluster.urls, 10000) as plain:
            assert not plain.curve
            with pytest.raises(tally.Error, match="takes CURVE connections only") as refused:
                plain.hist(data[streams[0]], stream=streams[0])
            assert refused.value.name == "bad_argument" and "member py-" in str(refused.value)
        with pytest.raises(tally.Error, match="no fleet"):
            os.environ.pop("TALLY_FLEET", None)
            tally.Client.fleet()
    finally:
        for d in members:
            d.stop()
        cluster.stop()


def printed(value: Any) -> str:
    """What the page's comment should say: repr, but a NumPy scalar as NumPy 1 prints it."""
    return str(value) if isinstance(value, np.generic) else repr(value)


def test_readme_examples(daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each runs as printed, without an error, against this tallyd (tally.Client() reads
    # $TALLY_ENDPOINT), so the page cannot show a call the binding does not take. A comment that
    # shows a value ("# 1048576", "# {'p50': Quantile(0, side=0), ...}") shows what is printed.
    blocks = readme_examples()
    assert len(blocks) >= 2
    monkeypatch.setenv("TALLY_ENDPOINT", daemon.endpoint)
    checked = 0
    for code in blocks:
        shown = shown_values(code)
        got: Dict[int, str] = {}

        def record(line: int, value: Any) -> Any:
            got[line] = printed(value)
            return value

        tree = ast.fix_missing_locations(_ShowValues(shown).visit(ast.parse(code)))
        exec(compile(tree, os.environ["TALLY_README"], "exec"), {"__shown": record})
        for line, comment in shown.items():
            assert got.get(line) == comment, f"page line {code.splitlines()[line - 1]!r}"
            checked += 1
    assert checked >= 4
    with tally.Client(daemon.endpoint) as c:  # what the first example did
        assert c.query("cam1")["bins"].shape == (3, 256) and c.query("s1")["scan_carry"] == 20
