"""The Python binding against a running tallyd ($TALLY_ENDPOINT), each result checked against
NumPy computing the same thing: filter, scan (stateless and carried by a stream), hist (u8 and
int32 with under/overflow), the stream calls, errors, a streaming push (outputs in order,
bounded chunks, its result), the shared-memory path (regions read and written in place, and
shm=True rings), that the installed package is the one imported, and that its import-time
check of the ctypes structs against the C layouts refuses a mismatch."""

import os
import time
import unittest

import numpy as np

import tally

RNG = np.random.default_rng(20261123)


def ready(endpoint):
    for _ in range(200):
        try:
            with tally.Client(endpoint, 500) as c:
                c.ping()
                return
        except tally.Error:
            time.sleep(0.05)
    raise RuntimeError(f"tallyd does not answer at {endpoint}")


class TallyTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        ready(os.environ["TALLY_ENDPOINT"])
        cls.c = tally.Client(os.environ["TALLY_ENDPOINT"], 10000)

    @classmethod
    def tearDownClass(cls):
        cls.c.close()

    def test_installed_package(self):
        self.assertNotIn(os.sep + "client" + os.sep + "python", tally.__file__)
        self.assertEqual(tally.library_version(), "0.1.0")

    def test_layout_check(self):
        # The import-time check passes the real table and refuses a ctypes struct whose size,
        # field offset or field set differs from the C struct's (tally/_wire.py's LAYOUT).
        size, fields = tally._wire.LAYOUT["tally_req_t"]
        tally._check_layouts([tally._Req], {"tally_req_t": (size, fields)})
        moved = {**fields, "seq": (fields["seq"][0] + 8, 8)}
        fewer = {n: at for n, at in fields.items() if n != "pred"}
        for bad, why in (((size + 8, fields), "sizeof"), ((size, moved), "seq (offset, size)"),
                         ((size, fewer), "pred (offset, size)")):
            with self.assertRaises(ImportError) as e:
                tally._check_layouts([tally._Req], {"tally_req_t": bad})
            self.assertIn("_Req does not match the C tally_req_t: " + why, str(e.exception))
        with self.assertRaises(ImportError):
            tally._check_layouts([tally._Req], {})

    def test_filter(self):
        x = RNG.integers(-1000, 1000, 100001, dtype=np.int32)
        got = self.c.filter(x, gt=0, stable=True, chunk_bytes=4096, window=3)
        np.testing.assert_array_equal(got, x[x > 0])
        self.assertEqual(got.dtype, np.int32)
        got = self.c.filter(x, between=(-5, 5))  # unordered: compare as multisets
        np.testing.assert_array_equal(np.sort(got), np.sort(x[(x >= -5) & (x <= 5)]))
        b = RNG.integers(0, 256, 5000, dtype=np.uint8)
        np.testing.assert_array_equal(self.c.filter(b, eq=7, stable=True), b[b == 7])

    def test_scan(self):
        x = RNG.integers(-(2**31), 2**31 - 1, 70000, dtype=np.int32)
        np.testing.assert_array_equal(self.c.scan(x, chunk_bytes=10000), np.cumsum(x, dtype=np.int64))
        excl = self.c.scan(x, exclusive=True, out32=True)
        self.assertEqual(excl.dtype, np.int32)
        want = (np.cumsum(x, dtype=np.int64) - x).astype(np.int32)
        np.testing.assert_array_equal(excl, want)
        # A stream carries across calls.
        self.c.scan(x[:30000], stream="py-scan")
        rest = self.c.scan(x[30000:], stream="py-scan")
        np.testing.assert_array_equal(rest, np.cumsum(x, dtype=np.int64)[30000:])
        self.assertEqual(self.c.query("py-scan")["scan_carry"], int(np.sum(x, dtype=np.int64)))

    def test_hist(self):
        b = RNG.integers(0, 256, 300000, dtype=np.uint8)
        got = self.c.hist(b, chunk_bytes=65536)
        np.testing.assert_array_equal(got, np.bincount(b, minlength=256))
        self.assertEqual(got.dtype, np.uint64)
        x = RNG.integers(-100, 400, 10000, dtype=np.int32)
        got = self.c.hist(x, range=(0, 256))
        self.assertEqual(len(got), 258)
        inside = x[(x >= 0) & (x < 256)]
        np.testing.assert_array_equal(got[:256], np.bincount(inside, minlength=256))
        self.assertEqual(got[256], np.sum(x < 0))
        self.assertEqual(got[257], np.sum(x >= 256))
        with self.assertRaises(TypeError):
            self.c.hist(x)

    def test_streams_and_errors(self):
        b = np.frombuffer(b"hello", np.uint8)
        self.c.hist(b, stream="py-cam")
        q = self.c.query("py-cam")
        self.assertEqual(q["hist_total"], 5)
        self.assertEqual(q["bins"][ord("l")], 2)
        self.assertIn("py-cam", self.c.streams())
        self.c.reset("py-cam")
        q = self.c.query("py-cam")
        self.assertEqual(q["hist_total"], 0)
        self.assertEqual(int(q["bins"].sum()), 0)
        self.c.delete("py-cam")
        with self.assertRaises(tally.Error) as e:
            self.c.query("py-cam")
        self.assertEqual(e.exception.name, "unknown_stream")
        self.assertIn("py-cam", e.exception.message)
        self.assertGreater(self.c.ping(), 0)
        self.assertEqual(self.c.info()["protocol"], "1")
        self.assertIn("# TYPE", self.c.stats())
        with self.assertRaises(ValueError):
            self.c.scan(np.zeros(3, np.int32), stream="a b")
        with self.assertRaises(TypeError):
            self.c.scan(np.zeros(3, np.float32))

    def test_push(self):
        x = RNG.integers(-50, 50, 250000, dtype=np.int32)
        parts = []
        with self.c.push("scan", stream="py-push", chunk_bytes=40000, window=4,
                         on_output=parts.append) as p:
            for at in range(0, len(x), 33333):  # writes of any length, cut into chunks
                p.write(x[at:at + 33333])
        np.testing.assert_array_equal(np.concatenate(parts), np.cumsum(x, dtype=np.int64))
        self.assertTrue(all(len(part) <= 10000 for part in parts))
        self.assertEqual(p.result["bytes"], x.nbytes)
        self.assertEqual(p.result["applied"], p.result["chunks"])
        self.assertEqual(p.result["last_seq"], p.result["chunks"])  # numbered on a stream
        with self.c.push("filter", gt=0, stable=True) as p:
            p.write(x)
        np.testing.assert_array_equal(p.output, x[x > 0])
        b = RNG.integers(0, 256, 100000, dtype=np.uint8)
        with self.c.push("hist", chunk_bytes=30000) as p:
            p.write(b)
        np.testing.assert_array_equal(p.output, np.bincount(b, minlength=256))

    def test_shared_memory(self):
        with self.c.region(4 << 20) as r:
            b = RNG.integers(0, 256, 1 << 20, dtype=np.uint8)
            r.array(np.uint8, 0, len(b))[:] = b
            np.testing.assert_array_equal(self.c.hist_shm(r, 0, len(b)), np.bincount(b, minlength=256))
            x = RNG.integers(-9, 9, 1000, dtype=np.int32)
            r.array(np.int32, 0, len(x))[:] = x
            sums = self.c.scan_shm(r, 0, x.nbytes, 1 << 20)
            np.testing.assert_array_equal(sums, np.cumsum(x, dtype=np.int64))
            kept = self.c.filter_shm(r, 0, x.nbytes, 2 << 20, gt=0, stable=True)
            np.testing.assert_array_equal(kept, x[x > 0])
        # Over max_batch (16 MiB here): hist_shm sends it in pieces, one answer.
        big = int(self.c.info()["max_batch"]) * 2 + 12345
        with self.c.region(big) as r:
            b = RNG.integers(0, 256, big, dtype=np.uint8)
            r.array(np.uint8, 0, big)[:] = b
            np.testing.assert_array_equal(self.c.hist_shm(r, 0, big, stream="py-big"),
                                          np.bincount(b, minlength=256))
            self.assertEqual(self.c.query("py-big")["batches"], 3)
        x = RNG.integers(-1000, 1000, 300000, dtype=np.int32)
        got = self.c.filter(x, lt=0, stable=True, shm=True, chunk_bytes=65536)
        np.testing.assert_array_equal(got, x[x < 0])


if __name__ == "__main__":
    unittest.main()
