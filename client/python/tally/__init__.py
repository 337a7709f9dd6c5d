"""tally: the Python binding of libtally, the C client library of tallyd.

NumPy arrays in, NumPy arrays out. Every call goes through libtally (loaded with ctypes), so
the chunking, pipelining, sequence numbers and shared memory are the C library's:

    Client(endpoint, timeout_ms)      one connection (not thread-safe: one per thread)
      .filter(x, gt=0, stable=True)   kept elements, x's dtype (int32 or uint8)
      .scan(x, exclusive, out32)      prefix sums (int64, or int32 wrapping)
      .hist(x, range=(lo, hi))        256 uint64 counts (u8), 258 for int32 (+under, overflow)
      .ping() .info() .stats() .query(s) .reset(s) .delete(s) .streams()
      .push(op, ...)                  a streaming push: write chunks, outputs in order
      .region(size)                   shared memory; .filter_shm/.scan_shm/.hist_shm on it

Every data call takes stream=NAME (state kept by tallyd), chunk_bytes=, window= and shm=True
(large inputs through a shared-memory ring). Failures raise tally.Error with the status name
and the daemon's message.

libtally is found through $TALLY_LIBRARY, else the system's loader (libtally.so.0).
"""

import ctypes
import ctypes.util
import os

import numpy as np

__all__ = ["Client", "Error", "Push", "Region", "library_version"]

# ---- The C library and its types (tally.h, tally_wire.h) ------------------------------------

OP = {"ping": 1, "info": 2, "filter": 3, "scan": 4, "hist": 5, "query": 6, "reset": 7, "delete": 10,
      "streams": 8, "stats": 9}
DTYPE_I32, DTYPE_U8 = 1, 2
PRED = {"gt": 1, "ge": 2, "lt": 3, "le": 4, "eq": 5, "ne": 6, "between": 7}
FLAG_SCAN_EXCLUSIVE, FLAG_SCAN_OUT_I32, FLAG_FILTER_STABLE = 0x01, 0x02, 0x04
E_UNKNOWN_STREAM = 9
SEQ_OFF, SEQ_APPEND, SEQ_RESUME = 0, 1, 2
HIST_BINS = 256


class _Req(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint8), ("opcode", ctypes.c_uint8),
                ("dtype", ctypes.c_uint8), ("flags", ctypes.c_uint8),
                ("request_id", ctypes.c_uint64), ("pred", ctypes.c_uint8),
                ("lo", ctypes.c_int64), ("hi", ctypes.c_int64), ("seq", ctypes.c_uint64),
                ("stream_len", ctypes.c_uint8), ("stream", ctypes.c_char * 65)]


class _Rep(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint8), ("opcode", ctypes.c_uint8),
                ("dtype", ctypes.c_uint8), ("flags", ctypes.c_uint8),
                ("request_id", ctypes.c_uint64), ("status", ctypes.c_uint32),
                ("count", ctypes.c_uint64), ("aux0", ctypes.c_uint64),
                ("aux1", ctypes.c_uint64)]


class _Reply(ctypes.Structure):
    _fields_ = [("rep", _Rep), ("payload", ctypes.POINTER(ctypes.c_uint8)),
                ("len", ctypes.c_size_t), ("error", ctypes.c_char * 256),
                ("msg_", ctypes.c_void_p)]


class _StreamInfo(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in
                ("batches", "elements", "bytes", "filter_seen", "filter_kept")] + [
        ("scan_carry", ctypes.c_int64), ("scan_elements", ctypes.c_uint64),
        ("hist_dtype", ctypes.c_uint8), ("hist_lo", ctypes.c_int64),
        ("hist_hi", ctypes.c_int64)] + [(n, ctypes.c_uint64) for n in
                                        ("hist_underflow", "hist_overflow", "hist_total",
                                         "last_seq")] + [
        ("bins", ctypes.c_uint64 * (4 * HIST_BINS))]


class _RunOpts(ctypes.Structure):
    _fields_ = [("chunk_bytes", ctypes.c_size_t), ("window", ctypes.c_uint),
                ("shm", ctypes.c_int), ("seq", ctypes.c_int), ("seq_base", ctypes.c_uint64),
                ("total_bytes", ctypes.c_uint64)]


class _RunResult(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("chunks", "elements", "count", "seen")] + [
        ("carry", ctypes.c_int64)] + [(n, ctypes.c_uint64) for n in
                                      ("hist_total", "input_chunks", "seq_base", "applied",
                                       "skipped", "last_seq")] + [
        ("applied_known", ctypes.c_bool), ("bytes", ctypes.c_uint64),
        ("applied_bytes", ctypes.c_uint64), ("status", ctypes.c_int),
        ("error", ctypes.c_char * 256)]


class _Buf(ctypes.Structure):
    _fields_ = [("data", ctypes.POINTER(ctypes.c_uint8)), ("len", ctypes.c_size_t),
                ("cap", ctypes.c_size_t)]


_OUTPUT_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)


def _load():
    path = os.environ.get("TALLY_LIBRARY") or ctypes.util.find_library("tally") or "libtally.so.0"
    lib = ctypes.CDLL(path)
    P, S, I, U64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint64
    sigs = {
        "tally_version": (ctypes.c_char_p, []),
        "tally_status_name": (ctypes.c_char_p, [I]),
        "tally_client_new": (I, [ctypes.c_char_p, I, ctypes.POINTER(P)]),
        "tally_client_destroy": (None, [ctypes.POINTER(P)]),
        "tally_client_error": (ctypes.c_char_p, [P]),
        "tally_reply_init": (None, [ctypes.POINTER(_Reply)]),
        "tally_reply_clear": (None, [ctypes.POINTER(_Reply)]),
        "tally_req_set_stream": (I, [ctypes.POINTER(_Req), ctypes.c_char_p]),
        "tally_ping": (I, [P, ctypes.POINTER(ctypes.c_double)]),
        "tally_info": (I, [P, I, ctypes.POINTER(P)]),
        "tally_query": (I, [P, ctypes.c_char_p, ctypes.POINTER(_StreamInfo)]),
        "tally_reset": (I, [P, ctypes.c_char_p]),
        "tally_delete": (I, [P, ctypes.c_char_p]),
        "tally_streams": (I, [P, ctypes.POINTER(ctypes.POINTER(ctypes.c_char_p)),
                              ctypes.POINTER(S)]),
        "tally_strings_free": (None, [ctypes.POINTER(ctypes.c_char_p), S]),
        "tally_run": (I, [P, ctypes.POINTER(_Req), P, S, ctypes.POINTER(_RunOpts),
                          ctypes.POINTER(_Buf), ctypes.POINTER(_RunResult)]),
        "tally_buf_free": (None, [ctypes.POINTER(_Buf)]),
        "tally_push_new": (I, [P, ctypes.POINTER(_Req), ctypes.POINTER(_RunOpts), _OUTPUT_FN,
                               P, ctypes.POINTER(P)]),
        "tally_push_chunk_bytes": (S, [P]),
        "tally_push_write": (I, [P, P, S]),
        "tally_push_finish": (I, [P]),
        "tally_push_result": (ctypes.POINTER(_RunResult), [P]),
        "tally_push_destroy": (None, [ctypes.POINTER(P)]),
        "tally_region_create": (I, [P, S, ctypes.POINTER(P)]),
        "tally_region_data": (P, [P]),
        "tally_region_size": (S, [P]),
        "tally_region_destroy": (None, [ctypes.POINTER(P)]),
        "tally_call_shm": (I, [P, ctypes.POINTER(_Req), P, S, S, P, S, ctypes.POINTER(_Reply)]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    lib.free = ctypes.CDLL(None).free
    lib.free.argtypes = [P]
    return lib


_lib = _load()


def library_version():
    """The version of the libtally that was loaded ("0.1.0")."""
    return _lib.tally_version().decode()


class _Handle:
    """A libtally object held through a pointer: close() destroys it (once: the destroy sets
    the pointer to NULL), and `with` closes it on leaving the block. Subclasses name the
    attribute that holds the pointer (_handle_attr) and the tally_*_destroy to call."""

    _handle_attr = None
    _destroy = None

    def close(self):
        handle = getattr(self, self._handle_attr)
        if handle:
            type(self)._destroy(ctypes.byref(handle))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Error(Exception):
    """A failed call: .status (the number), .name ("unknown_stream", ...), .message."""

    def __init__(self, status, message):
        self.status = status
        self.name = _lib.tally_status_name(status).decode()
        self.message = message
        super().__init__(f"{self.name}: {message}")


# ---- Requests ------------------------------------------------------------------------------


def _dtype_of(x):
    if x.dtype == np.int32:
        return DTYPE_I32
    if x.dtype == np.uint8:
        return DTYPE_U8
    raise TypeError(f"tally takes int32 or uint8 arrays, not {x.dtype}")


def _request(op, dtype, stream=None, flags=0, pred=0, lo=0, hi=0):
    req = _Req(opcode=OP[op], dtype=dtype, flags=flags, pred=pred, lo=lo, hi=hi)
    if stream is not None and _lib.tally_req_set_stream(ctypes.byref(req), stream.encode()):
        raise ValueError(f"invalid stream name {stream!r}: 1-64 printable ASCII bytes, no spaces")
    return req


def _filter_args(gt, ge, lt, le, eq, ne, between):
    given = [(n, v) for n, v in (("gt", gt), ("ge", ge), ("lt", lt), ("le", le), ("eq", eq),
                                  ("ne", ne), ("between", between)) if v is not None]
    if len(given) != 1:
        raise TypeError("give exactly one predicate: gt, ge, lt, le, eq, ne or between=(lo, hi)")
    name, value = given[0]
    lo, hi = (value if name == "between" else (value, 0))
    return PRED[name], int(lo), int(hi)


def _hist_args(x_dtype, range):
    if x_dtype == DTYPE_I32 and range is None:
        raise TypeError("an int32 histogram needs range=(lo, hi)")
    if x_dtype == DTYPE_U8 and range is not None:
        raise TypeError("range applies to int32 histograms only")
    return (0, 0) if range is None else (int(range[0]), int(range[1]))


def _out_dtype(req):
    if req.opcode == OP["scan"]:
        return np.int32 if req.flags & FLAG_SCAN_OUT_I32 else np.int64
    if req.opcode == OP["hist"]:
        return np.uint64
    return np.int32 if req.dtype == DTYPE_I32 else np.uint8


def _result(res):
    names = ("chunks", "elements", "count", "seen", "carry", "hist_total", "input_chunks",
             "seq_base", "applied", "skipped", "last_seq", "applied_known", "bytes",
             "applied_bytes")
    return {n: getattr(res, n) for n in names}


def _opts(chunk_bytes, window, shm, seq, seq_base=0, total_bytes=0):
    return _RunOpts(chunk_bytes=chunk_bytes or 0, window=window or 0, shm=1 if shm else 0,
                    seq=seq, seq_base=seq_base, total_bytes=total_bytes)


class Push(_Handle):
    """A streaming push (tally_push_*): write() chunks of any length, read the output in order.

    Outputs go to `on_output(array)` chunk by chunk when given, else they are collected and
    returned by finish(). `result` holds the counters after finish() (applied, bytes, ...).
    """

    _handle_attr, _destroy = "_push", _lib.tally_push_destroy

    def __init__(self, client, req, opts, on_output=None):
        self._client, self._req, self._on_output = client, req, on_output
        self._parts, self._error = [], None
        self._dtype = _out_dtype(req)
        self._elem = 4 if req.dtype == DTYPE_I32 else 1
        self._cb = _OUTPUT_FN(self._output)  # kept alive as long as the push
        self._push = ctypes.c_void_p()
        st = _lib.tally_push_new(client._c, ctypes.byref(req), ctypes.byref(opts), self._cb,
                                 None, ctypes.byref(self._push))
        client._check(st)
        self.chunk_bytes = _lib.tally_push_chunk_bytes(self._push)
        self.result = None

    def _output(self, arg, data, length):
        try:
            out = np.frombuffer(ctypes.string_at(data, length), dtype=self._dtype)
            if self._on_output:
                self._on_output(out)
            else:
                self._parts.append(out)
            return 0
        except Exception as e:  # noqa: BLE001 - surfaced by finish()
            self._error = e
            return 105  # TALLY_E_IO: stops the push

    def write(self, x):
        """Sends x (int32 or uint8, as the push's dtype) in chunks of chunk_bytes."""
        x = np.ascontiguousarray(x)
        if _dtype_of(x) != self._req.dtype:
            raise TypeError(f"this push takes {'int32' if self._elem == 4 else 'uint8'} arrays")
        raw, step = x.view(np.uint8).reshape(-1), self.chunk_bytes - self.chunk_bytes % self._elem
        for at in range(0, len(raw), step):
            piece = raw[at:at + step]
            st = _lib.tally_push_write(self._push, piece.ctypes.data, len(piece))
            if st:
                self._client._check(st, _lib.tally_push_result(self._push).contents.error)

    def finish(self):
        """Waits for every reply; returns the output (hist: the counts), sets .result."""
        st = _lib.tally_push_finish(self._push)
        res = _lib.tally_push_result(self._push).contents
        self.result = _result(res)
        if self._error:
            raise self._error
        if st:
            raise Error(st, res.error.decode(errors="replace"))
        if not self._parts:
            return np.zeros(0, dtype=self._dtype)
        return np.concatenate(self._parts)

    def __exit__(self, kind, value, tb):
        try:
            if kind is None:
                self.output = self.finish()
        finally:
            self.close()


class Region(_Handle):
    """A shared-memory region registered with tallyd (tally_region_create): write the data
    into array(), then name ranges of it in *_shm calls."""

    _handle_attr, _destroy = "_r", _lib.tally_region_destroy

    def __init__(self, client, size):
        self._client, self._r = client, ctypes.c_void_p()
        client._check(_lib.tally_region_create(client._c, size, ctypes.byref(self._r)))
        self.size = _lib.tally_region_size(self._r)
        base = _lib.tally_region_data(self._r)
        self._bytes = np.ctypeslib.as_array((ctypes.c_uint8 * self.size).from_address(base))

    def array(self, dtype=np.uint8, offset=0, count=None):
        """A NumPy view of the region (no copy) from byte `offset`."""
        itemsize = np.dtype(dtype).itemsize
        count = (self.size - offset) // itemsize if count is None else count
        return self._bytes[offset:offset + count * itemsize].view(dtype)

    def close(self):
        self._bytes = None
        super().close()


class Client(_Handle):
    """One connection to tallyd (a libtally client). Use it from one thread."""

    _handle_attr, _destroy = "_c", _lib.tally_client_destroy

    def __init__(self, endpoint=None, timeout_ms=5000):
        # Kept equal to TALLY_DEFAULT_ENDPOINT (proto/tally_proto.h): no libtally function returns it.
        endpoint = endpoint or os.environ.get("TALLY_ENDPOINT") or "tcp://127.0.0.1:5555"
        self._c = ctypes.c_void_p()
        st = _lib.tally_client_new(endpoint.encode(), timeout_ms, ctypes.byref(self._c))
        if st:
            raise Error(st, f"cannot create a client for {endpoint!r}")
        self.endpoint = endpoint

    def _check(self, status, message=None):
        if status:
            if message is None:
                message = _lib.tally_client_error(self._c)
            raise Error(status, message.decode(errors="replace"))

    # -- small operations --

    def ping(self):
        """Round-trip time in milliseconds."""
        rtt = ctypes.c_double()
        self._check(_lib.tally_ping(self._c, ctypes.byref(rtt)))
        return rtt.value / 1000.0

    def _text(self, op):
        text = ctypes.c_void_p()
        self._check(_lib.tally_info(self._c, OP[op], ctypes.byref(text)))
        try:
            return ctypes.string_at(text).decode()
        finally:
            _lib.free(text)

    def info(self):
        """The daemon's info as a dict (version, backend, max_batch, ...; values are strings)."""
        return dict(line.split("=", 1) for line in self._text("info").splitlines() if "=" in line)

    def stats(self):
        """The daemon's metrics, Prometheus text."""
        return self._text("stats")

    def query(self, stream):
        """A stream's counters (dict) with its running histogram under "bins" (uint64 array)."""
        info = _StreamInfo()
        self._check(_lib.tally_query(self._c, stream.encode(), ctypes.byref(info)))
        out = {n: getattr(info, n) for n, _ in _StreamInfo._fields_ if n != "bins"}
        out["bins"] = np.ctypeslib.as_array(info.bins).copy()
        return out

    def reset(self, stream):
        """Zeroes the stream and keeps it (type, range and last_seq stay)."""
        self._check(_lib.tally_reset(self._c, stream.encode()))

    def delete(self, stream):
        """Removes the stream; a later query gets unknown_stream."""
        self._check(_lib.tally_delete(self._c, stream.encode()))

    def streams(self):
        names, count = ctypes.POINTER(ctypes.c_char_p)(), ctypes.c_size_t()
        self._check(_lib.tally_streams(self._c, ctypes.byref(names), ctypes.byref(count)))
        try:
            return [names[i].decode() for i in range(count.value)]
        finally:
            _lib.tally_strings_free(names, count)

    # -- data operations over whole arrays (tally_run) --

    def _seq(self, stream, seq):
        return SEQ_APPEND if (stream is not None and seq) else SEQ_OFF

    def run(self, req, x, chunk_bytes=0, window=0, shm=False, seq=False):
        """Runs a prepared request over array x; returns (output array, result dict)."""
        x = np.ascontiguousarray(x)
        stream = req.stream.decode() if req.stream_len else None
        opts = _opts(chunk_bytes, window, shm, self._seq(stream, seq))
        out, res = _Buf(), _RunResult()
        st = _lib.tally_run(self._c, ctypes.byref(req), x.ctypes.data if x.size else None,
                            x.nbytes, ctypes.byref(opts), ctypes.byref(out), ctypes.byref(res))
        try:
            if st:
                raise Error(st, res.error.decode(errors="replace"))
            data = ctypes.string_at(out.data, out.len) if out.len else b""
            return np.frombuffer(data, dtype=_out_dtype(req)).copy(), _result(res)
        finally:
            _lib.tally_buf_free(ctypes.byref(out))

    def filter(self, x, gt=None, ge=None, lt=None, le=None, eq=None, ne=None, between=None,
               stable=False, stream=None, **kw):
        """The elements of x (int32 or uint8) that satisfy the one predicate given."""
        pred, lo, hi = _filter_args(gt, ge, lt, le, eq, ne, between)
        req = _request("filter", _dtype_of(x), stream, FLAG_FILTER_STABLE if stable else 0,
                       pred, lo, hi)
        return self.run(req, x, **kw)[0]

    def scan(self, x, exclusive=False, out32=False, stream=None, **kw):
        """Prefix sums of int32 x: int64 (int32 wrapping with out32); a stream carries."""
        flags = (FLAG_SCAN_EXCLUSIVE if exclusive else 0) | (FLAG_SCAN_OUT_I32 if out32 else 0)
        return self.run(_request("scan", _dtype_of(x), stream, flags), x, **kw)[0]

    def hist(self, x, range=None, stream=None, **kw):
        """256 uint64 counts of uint8 x; int32 x over range=(lo, hi): 256 bins, under, over."""
        dtype = _dtype_of(x)
        lo, hi = _hist_args(dtype, range)
        return self.run(_request("hist", dtype, stream, lo=lo, hi=hi), x, **kw)[0]

    # -- streaming --

    def push(self, op, dtype=None, stream=None, on_output=None, chunk_bytes=0, window=0,
             shm=False, seq=True, seq_base=None, **params):
        """A streaming push of op ("filter", "scan", "hist"); params as for the array calls
        (gt=..., stable=..., exclusive=..., out32=..., range=...). dtype: np.int32 or
        np.uint8 (default: uint8 for hist without range, else int32). seq_base resumes."""
        if dtype is None:
            dtype = np.uint8 if op == "hist" and "range" not in params else np.int32
        dt = _dtype_of(np.zeros(0, dtype))
        if op == "filter":
            pred, lo, hi = _filter_args(*(params.pop(k, None) for k in
                                          ("gt", "ge", "lt", "le", "eq", "ne", "between")))
            flags = FLAG_FILTER_STABLE if params.pop("stable", False) else 0
        elif op == "scan":
            pred, lo, hi = 0, 0, 0
            flags = (FLAG_SCAN_EXCLUSIVE if params.pop("exclusive", False) else 0) | (
                FLAG_SCAN_OUT_I32 if params.pop("out32", False) else 0)
        elif op == "hist":
            pred, flags = 0, 0
            lo, hi = _hist_args(dt, params.pop("range", None))
        else:
            raise ValueError(f"push takes filter, scan or hist, not {op!r}")
        if params:
            raise TypeError(f"unexpected arguments for {op}: {', '.join(params)}")
        req = _request(op, dt, stream, flags, pred, lo, hi)
        seq_mode = SEQ_RESUME if seq_base is not None else self._seq(stream, seq)
        opts = _opts(chunk_bytes, window, shm, seq_mode, seq_base or 0)
        return Push(self, req, opts, on_output)

    # -- shared memory --

    def region(self, size):
        """A shared-memory region of size bytes, registered with tallyd (on this host)."""
        return Region(self, size)

    def _call_shm(self, req, region, offset, length, out_region=None, out_offset=0):
        reply = _Reply()
        _lib.tally_reply_init(ctypes.byref(reply))
        st = _lib.tally_call_shm(self._c, ctypes.byref(req), region._r, offset, length,
                                 out_region._r if out_region else None, out_offset,
                                 ctypes.byref(reply))
        try:
            if st:
                raise Error(st, reply.error.decode(errors="replace"))
            rep = {"count": reply.rep.count, "aux0": reply.rep.aux0}
            data = ctypes.string_at(reply.payload, reply.len) if reply.len else b""
            return np.frombuffer(data, dtype=_out_dtype(req)).copy(), rep
        finally:
            _lib.tally_reply_clear(ctypes.byref(reply))

    def hist_shm(self, region, offset, length, dtype=np.uint8, range=None, stream=None):
        """hist of region bytes [offset, offset + length): the counts, read in place."""
        dt = _dtype_of(np.zeros(0, dtype))
        lo, hi = _hist_args(dt, range)
        req = _request("hist", dt, stream, lo=lo, hi=hi)
        return self._call_shm(req, region, offset, length)[0]

    def filter_shm(self, region, offset, length, out_offset, dtype=np.int32, stream=None,
                   stable=False, **pred):
        """filter of a region range, the kept elements written into the same region at
        out_offset; returns a view of them."""
        p, lo, hi = _filter_args(*(pred.get(k) for k in
                                   ("gt", "ge", "lt", "le", "eq", "ne", "between")))
        req = _request("filter", _dtype_of(np.zeros(0, dtype)), stream,
                       FLAG_FILTER_STABLE if stable else 0, p, lo, hi)
        _, rep = self._call_shm(req, region, offset, length, region, out_offset)
        return region.array(dtype, out_offset, rep["count"])

    def scan_shm(self, region, offset, length, out_offset, exclusive=False, stream=None):
        """int64 prefix sums of int32 region data, written into the region at out_offset;
        returns a view of them."""
        req = _request("scan", DTYPE_I32, stream, FLAG_SCAN_EXCLUSIVE if exclusive else 0)
        _, rep = self._call_shm(req, region, offset, length, region, out_offset)
        return region.array(np.int64, out_offset, rep["count"])
