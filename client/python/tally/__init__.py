# SPDX-License-Identifier: Apache-2.0
"""tally: the Python binding of libtally, the C client library of tallyd.

NumPy arrays in, NumPy arrays out. Every call goes through libtally (loaded with ctypes), so
the chunking, pipelining, sequence numbers, shared memory, subscriptions and histogram
statistics are the C library's, and every number is the one the `tally` CLI prints:

    Client(endpoint, timeout_ms, server_key=, client_key=)   one connection (one per thread)
      .filter(x, gt=0, stable=True)     kept elements, x's dtype (int32 or uint8)
      .scan(x, exclusive, out32)        prefix sums (int64, or int32 wrapping)
      .hist(x, range=(lo, hi))          counts: u8 256; int32, uint16 258 (+under, overflow);
                                        rgb8/rgba8 images (H, W, 3|4): (3|4, 256)
      .query(s, last_ms=)               a stream's record (dict, NumPy bins), all time or a window
      .summary(s, ...) .quantiles(s, qs, ...)   count, mean, quantiles, as `tally query`
      .ping() .info() .stats() .reset(s) .delete(s) .streams()
      .push(op, ...)                    a streaming push: write chunks, outputs in order
      .region(size)                     shared memory; .filter_shm/.scan_shm/.hist_shm on it
      .subscribe(prefix)                tallyd's publications (a Subscriber)
    summarize(record) quantiles(record, qs) quantile(record, q) edges(record)
    Subscriber(endpoint, prefix)        publications of tallyd --pub, each with its record
    keygen(base)                        a CURVE key pair (BASE.key, BASE.pub)

Every data call takes stream=NAME (state kept by tallyd), chunk_bytes=, window=, shm=True
(large inputs through a shared-memory ring), and on a stream seq=True (numbered chunks: none
applied twice) or seq_base=N (resume a numbered push that stopped). Failures raise tally.Error
with the status name, the daemon's message, and for data calls what was applied (.result).

libtally is found through $TALLY_LIBRARY, else the system's loader (libtally.so.0); when it
cannot be loaded, importing tally raises ImportError saying which file it looked for.
"""

from __future__ import annotations

try:
    import numpy as np
except ImportError as e:  # pragma: no cover - depends on the host
    raise ImportError("tally needs NumPy (Debian: apt install python3-numpy; else pip install "
                      "numpy)") from e

import ctypes
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy.typing as npt

from . import _lib
from ._hist import (DEFAULT_QUANTILES, BinRef, Quantile, Record, Summary, Window, channels,
                    edges, quantile, quantiles, record_from_info, summarize)
from ._lib import Error, lib
from ._sub import Publication, Subscriber, load_keys
from ._wire import (DEFAULT_ENDPOINT, DEFAULT_TIMEOUT_MS, DTYPE, E_ARG, E_IO,  # noqa: F401
                    E_UNKNOWN_STREAM, E_WINDOW, FLAG_FILTER_STABLE, FLAG_SCAN_EXCLUSIVE,
                    FLAG_SCAN_OUT_I32, HIST_BINS, OP, OP_DTYPES, PRED, SEQ_APPEND, SEQ_OFF, SEQ_RESUME,
                    WINDOW_MS_MAX)

__all__ = ["BinRef", "Client", "Error", "GpuRegion", "Publication", "Push", "Quantile", "Record",
           "Region",
           "Subscriber", "Summary", "Window", "channels", "edges", "keygen", "library_version",
           "quantile", "quantiles", "query_stale", "summarize"]

# What dtype= takes: tallyd's names (the CLI's too: rgb and rgba), or a NumPy integer type.
DtypeLike = Union[str, type, "np.dtype[Any]"]
Array = npt.NDArray[Any]
OutputFn = Callable[[Array], None]


def library_version() -> str:
    """The version of the libtally that was loaded ("0.1.0")."""
    return str(lib.tally_version().decode())


def keygen(base: str) -> str:
    """Writes a new CURVE key pair, BASE.key (both halves, mode 0600) and BASE.pub, as `tally
    keygen` does; returns the public key (40 characters of Z85). Existing files are kept (Error)."""
    public, msg = ctypes.create_string_buffer(41), ctypes.create_string_buffer(512)
    st = lib.tally_keygen(base.encode(), public, msg, len(msg))
    if st:
        raise Error(st, msg.value.decode(errors="replace"))
    return public.value.decode()


class _Handle:
    """A libtally object held through a pointer: close() destroys it (once: the destroy sets
    the pointer to NULL), and `with` closes it on leaving the block. Subclasses name the
    attribute that holds the pointer (_handle_attr) and the tally_*_destroy to call."""

    _handle_attr = ""
    _destroy: Any = None

    def close(self) -> None:
        handle = getattr(self, self._handle_attr, None)
        if handle:
            type(self)._destroy(ctypes.byref(handle))

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- Element types ---------------------------------------------------------------------------

_NUMPY_TYPE = {"u8": np.uint8, "i32": np.int32, "u16": np.uint16, "rgb8": np.uint8,
               "rgba8": np.uint8}
_OP_DTYPES = OP_DTYPES  # what each operation takes: proto/'s operation table, via _wire.py


def _dtype_name(dtype: DtypeLike) -> str:
    if isinstance(dtype, str):
        name = {"rgb": "rgb8", "rgba": "rgba8"}.get(dtype, dtype)
        if name not in _NUMPY_TYPE:
            raise ValueError(f"dtype {dtype!r}: u8, i32, u16, rgb8 (rgb) or rgba8 (rgba)")
        return name
    np_type = np.dtype(dtype)
    for name in ("u8", "i32", "u16"):
        if np_type == _NUMPY_TYPE[name]:
            return name
    raise TypeError(f"tally takes int32, uint8 or uint16 elements, not {np_type}")


def _infer_dtype(x: Array, op: str) -> str:
    """An array's tallyd type: by its NumPy type, and for hist an (H, W, 3|4) uint8 image is
    rgb8/rgba8 (filter takes its bytes as u8)."""
    if op == "hist" and x.dtype == np.uint8 and x.ndim == 3 and x.shape[-1] in (3, 4):
        return "rgb8" if x.shape[-1] == 3 else "rgba8"
    return _dtype_name(x.dtype)


def _as_input(x: Any, op: str, dtype: Optional[DtypeLike]) -> Tuple[Array, int]:
    """x as a contiguous array and its dtype number, checked against what op takes."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"tally takes NumPy arrays (np.asarray(x, np.int32), ...), not "
                        f"{type(x).__name__}")
    name = _infer_dtype(x, op) if dtype is None else _dtype_name(dtype)
    if name not in _OP_DTYPES[op]:
        raise TypeError(f"{op} takes {', '.join(_OP_DTYPES[op])} elements, not {name}")
    if x.dtype != _NUMPY_TYPE[name]:
        raise TypeError(f"dtype {name} needs a {np.dtype(_NUMPY_TYPE[name])} array, not {x.dtype}")
    return np.ascontiguousarray(x), DTYPE[name]


def _out_dtype(req: _lib.Req) -> Any:
    if req.opcode == OP["scan"]:
        return np.int32 if req.flags & FLAG_SCAN_OUT_I32 else np.int64
    if req.opcode == OP["hist"]:
        return np.uint64
    return _NUMPY_TYPE[str(lib.tally_dtype_name(req.dtype).decode())]


def _shaped(req: _lib.Req, out: Array) -> Array:
    """Colour histograms as (channels, 256); everything else flat."""
    n = int(lib.tally_hist_channels(req.dtype)) if req.opcode == OP["hist"] else 1
    return out.reshape(n, HIST_BINS) if n > 1 and out.size == n * HIST_BINS else out


# ---- Requests --------------------------------------------------------------------------------


def _request(op: str, dtype: int, stream: Optional[str] = None, flags: int = 0, pred: int = 0,
             lo: int = 0, hi: int = 0) -> _lib.Req:
    req = _lib.Req(opcode=OP[op], dtype=dtype, flags=flags, pred=pred, lo=lo, hi=hi)
    if stream is not None and lib.tally_req_set_stream(ctypes.byref(req), stream.encode()):
        raise ValueError(f"invalid stream name {stream!r}: 1-64 printable ASCII bytes, no spaces")
    return req


_PRED_NAMES = ("gt", "ge", "lt", "le", "eq", "ne", "between")


def _filter_args(params: Dict[str, Any]) -> Tuple[int, int, int]:
    given = [(n, params.pop(n)) for n in _PRED_NAMES if params.get(n) is not None]
    for n in _PRED_NAMES:
        params.pop(n, None)
    if len(given) != 1:
        raise TypeError("give exactly one predicate: gt, ge, lt, le, eq, ne or between=(lo, hi)")
    name, value = given[0]
    lo, hi = (value if name == "between" else (value, 0))
    return PRED[name], int(lo), int(hi)


def _hist_args(dtype: int, range: Optional[Tuple[int, int]]) -> Tuple[int, int]:
    ranged = bool(lib.tally_hist_ranged(dtype))
    name = lib.tally_dtype_name(dtype).decode()
    if ranged and range is None:
        raise TypeError(f"a {name} histogram needs range=(lo, hi)")
    if not ranged and range is not None:
        raise TypeError("range applies to int32 and uint16 histograms only")
    return (0, 0) if range is None else (int(range[0]), int(range[1]))


def _op_request(op: str, dtype: int, stream: Optional[str], params: Dict[str, Any]) -> _lib.Req:
    """The request of op with its parameters (consumed from params: predicates and stable for
    filter, exclusive and out32 for scan, range for hist); TypeError for any left over."""
    flags, pred, lo, hi = 0, 0, 0, 0
    if op == "filter":
        pred, lo, hi = _filter_args(params)
        flags = FLAG_FILTER_STABLE if params.pop("stable", False) else 0
    elif op == "scan":
        flags = (FLAG_SCAN_EXCLUSIVE if params.pop("exclusive", False) else 0) | (
            FLAG_SCAN_OUT_I32 if params.pop("out32", False) else 0)
    elif op == "hist":
        lo, hi = _hist_args(dtype, params.pop("range", None))
    elif op != "minmax":  # minmax takes no parameters
        raise ValueError(f"filter, scan, hist or minmax, not {op!r}")
    if params:
        raise TypeError(f"unexpected arguments for {op}: {', '.join(params)}")
    return _request(op, dtype, stream, flags, pred, lo, hi)


def _result(res: _lib.RunResult) -> Dict[str, Any]:
    return {n: getattr(res, n) for n in _lib.RUN_RESULT_NAMES}


def _seq_mode(stream: Optional[str], seq: bool, seq_base: Optional[int]) -> int:
    if seq_base is not None:
        if stream is None:
            raise ValueError("seq_base resumes a numbered push on a stream: give stream=")
        return SEQ_RESUME
    return SEQ_APPEND if (stream is not None and seq) else SEQ_OFF


def _opts(chunk_bytes: int, window: int, shm: bool, seq: int, seq_base: int = 0,
          total_bytes: int = 0) -> _lib.RunOpts:
    return _lib.RunOpts(chunk_bytes=chunk_bytes or 0, window=window or 0, shm=1 if shm else 0,
                        seq=seq, seq_base=seq_base, total_bytes=total_bytes)


class Push(_Handle):
    """A streaming push (tally_push_*): write() arrays of any length, read the output in order.

    Outputs go to `on_output(array)` chunk by chunk when given, else they are collected and
    returned by finish() (`with` puts them in .output). `result` holds the counters after
    finish() (applied, seq_base, last_seq, bytes, ...). On a stream the chunks are numbered
    (none is applied twice); after a failure, Error.result["seq_base"] resumes the push:
    client.push(..., seq_base=that) skips the chunks the stream has and sends the rest.
    """

    _handle_attr, _destroy = "_push", lib.tally_push_destroy

    def __init__(self, client: "Client", req: _lib.Req, opts: _lib.RunOpts,
                 on_output: Optional[OutputFn] = None):
        self._client, self._req, self._on_output = client, req, on_output
        self._parts: List[Array] = []
        self._error: Optional[BaseException] = None
        self._dtype = _out_dtype(req)
        self._np_type = _NUMPY_TYPE[lib.tally_dtype_name(req.dtype).decode()]
        self._elem = int(lib.tally_dtype_size(req.dtype))
        self._cb = _lib.OUTPUT_FN(self._output)  # kept alive as long as the push
        self._push = ctypes.c_void_p()
        st = lib.tally_push_new(client._c, ctypes.byref(req), ctypes.byref(opts), self._cb,
                                None, ctypes.byref(self._push))
        client._check(st)
        self.chunk_bytes: int = lib.tally_push_chunk_bytes(self._push)
        self.result: Optional[Dict[str, Any]] = None
        self.output: Optional[Array] = None

    def _output(self, arg: Any, data: Any, length: int) -> int:
        try:
            out = _shaped(self._req, np.frombuffer(ctypes.string_at(data, length),
                                                   dtype=self._dtype))
            if self._on_output:
                self._on_output(out)
            else:
                self._parts.append(out)
            return 0
        except Exception as e:  # noqa: BLE001 - surfaced by finish()
            self._error = e
            return E_IO  # stops the push

    def _fail(self, st: int) -> None:
        res = lib.tally_push_result(self._push).contents
        msg = res.error.decode(errors="replace") or lib.tally_client_error(
            self._client._c).decode(errors="replace")
        raise Error(st, msg, _result(res))

    def write(self, x: Array) -> None:
        """Sends x (elements of the push's dtype, any length) in chunks of chunk_bytes."""
        if not isinstance(x, np.ndarray) or x.dtype != self._np_type:
            raise TypeError(f"this push takes {np.dtype(self._np_type)} arrays")
        raw = np.ascontiguousarray(x).view(np.uint8).reshape(-1)
        step = self.chunk_bytes - self.chunk_bytes % self._elem
        for at in range(0, len(raw), step):
            piece = raw[at:at + step]
            st = lib.tally_push_write(self._push, piece.ctypes.data, len(piece))
            if st:
                self._fail(st)

    def flush(self) -> None:
        """Waits until every chunk written so far is answered and its output handed over."""
        st = lib.tally_push_flush(self._push)
        if st:
            self._fail(st)

    def finish(self) -> Array:
        """Waits for every reply; returns the output (hist: the counts), sets .result."""
        st = lib.tally_push_finish(self._push)
        res = lib.tally_push_result(self._push).contents
        self.result = _result(res)
        if self._error:
            raise self._error
        if st:
            raise Error(st, res.error.decode(errors="replace"), self.result)
        if not self._parts:
            return np.zeros(0, dtype=self._dtype)
        return np.concatenate(self._parts) if len(self._parts) > 1 else self._parts[0]

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None:
                self.output = self.finish()
        finally:
            self.close()


class Region(_Handle):
    """A shared-memory region registered with tallyd (tally_region_create): write the data
    into array(), then name ranges of it in *_shm calls."""

    _handle_attr, _destroy = "_r", lib.tally_region_destroy

    def __init__(self, client: "Client", size: int):
        self._client, self._r = client, ctypes.c_void_p()
        client._check(lib.tally_region_create(client._c, size, ctypes.byref(self._r)))
        self.size: int = lib.tally_region_size(self._r)
        base = lib.tally_region_data(self._r)
        self._bytes: Optional[npt.NDArray[np.uint8]] = np.ctypeslib.as_array(
            (ctypes.c_uint8 * self.size).from_address(base))

    def array(self, dtype: Any = np.uint8, offset: int = 0, count: Optional[int] = None) -> Array:
        """A NumPy view of the region (no copy) from byte `offset`."""
        if self._bytes is None:
            raise ValueError("the region is closed")
        itemsize = np.dtype(dtype).itemsize
        count = (self.size - offset) // itemsize if count is None else count
        return self._bytes[offset:offset + count * itemsize].view(dtype)

    def close(self) -> None:
        self._bytes = None
        super().close()


class GpuRegion(_Handle):
    """GPU memory registered with tallyd as a device region (PROTOCOL.md §10 "Device memory"):
    `nbytes` bytes on CUDA device `device` (tally_gpu_alloc: exportable, its allocation rounded
    up to the granularity), seen as a 1-D array of `dtype`. It has __cuda_array_interface__, so
    cupy.asarray(r) and torch.as_tensor(r, device="cuda") are views of the same memory (no
    copy): fill them in place, synchronize (the data must be there when the request is sent),
    then client.hist(r), client.filter(r, ...) and client.scan(r) read it on tallyd's GPU by
    reference. output=True registers it as an output region too: filter(x, ..., out=r) and
    scan(x, out=r) have tallyd's GPU write their output into it. copy_from / to_host copy through
    the host without CuPy. Close it (or `with`) before its client."""

    _handle_attr, _destroy = "_r", lib.tally_region_destroy

    def __init__(self, client: "Client", nbytes: int, dtype: DtypeLike = "u8", device: int = 0,
                 output: bool = False):
        self._client, self._r, self._mem = client, ctypes.c_void_p(), ctypes.c_void_p()
        self.dtype_name: str = _dtype_name(dtype)
        self.dtype = np.dtype(_NUMPY_TYPE[self.dtype_name])
        if nbytes <= 0 or nbytes % self.dtype.itemsize:
            raise ValueError(f"nbytes {nbytes}: a positive multiple of {self.dtype.itemsize}")
        self.nbytes, self.device = nbytes, device
        st = lib.tally_gpu_alloc(device, nbytes, ctypes.byref(self._mem))
        if st:
            raise Error(st, f"cannot allocate {nbytes} bytes of GPU memory: "
                            f"{lib.tally_gpu_error().decode(errors='replace')}")
        st = lib.tally_gpu_register(client._c, self._mem, 0x2 if output else 0, None,
                                    ctypes.byref(self._r))
        if st:
            message = lib.tally_client_error(client._c)
            lib.tally_gpu_free(ctypes.byref(self._mem))
            client._check(st, message)
        self.ptr: int = lib.tally_gpu_ptr(self._mem) or 0

    @property
    def shape(self) -> Tuple[int]:
        return (self.nbytes // self.dtype.itemsize,)

    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]:
        """Numba's CUDA Array Interface (version 3): the device pointer, shape and type. No
        stream: the producer synchronizes before it sends a request that reads the data."""
        if not self._r:
            raise ValueError("the GPU region is closed")
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ptr, False),
                "strides": None, "version": 3}

    def copy_from(self, x: Array, offset: int = 0) -> None:
        """Copies host array x into the region at byte `offset` (synchronous)."""
        x = np.ascontiguousarray(x)
        st = lib.tally_gpu_copy_to(self._mem, offset, x.ctypes.data, x.nbytes)
        if st:
            raise Error(st, lib.tally_gpu_error().decode(errors="replace"))

    def to_host(self, offset: int = 0, count: Optional[int] = None,
                dtype: Optional[DtypeLike] = None) -> Array:
        """A host copy of `count` elements (of dtype, default the region's) from byte offset."""
        np_type = self.dtype if dtype is None else np.dtype(dtype)
        count = (self.nbytes - offset) // np_type.itemsize if count is None else count
        out = np.empty(count, dtype=np_type)
        st = lib.tally_gpu_copy_from(self._mem, offset, out.ctypes.data, out.nbytes)
        if st:
            raise Error(st, lib.tally_gpu_error().decode(errors="replace"))
        return out

    def close(self) -> None:
        super().close()  # released in tallyd first (it keeps its own reference until then)
        if self._mem:
            lib.tally_gpu_free(ctypes.byref(self._mem))


AnyRegion = Union[Region, GpuRegion]


def query_stale(stream: str, servers: Optional[str] = None,
                timeout_ms: int = DEFAULT_TIMEOUT_MS, credentials: Optional[str] = None,
                user: Optional[str] = None, tls_ca: Optional[str] = None,
                tls_cert: Optional[str] = None, tls_key: Optional[str] = None
                ) -> Tuple[Record, int]:
    """A stream's record from a fleet (NATS servers, default $TALLY_NATS), as `tally --nats URL
    query --stale-ok`: its partition's owner or a standby's copy answers, whichever comes first,
    also while the partition has no owner (PROTOCOL.md §13 "Answers by request-reply"). Returns
    (record, stale): stale 0 when the owner answered, else the partition's changelog sequence the
    copy had applied (the record may lag the owner's by what was written since)."""
    servers = servers or os.environ.get("TALLY_NATS")
    if not servers:
        raise Error(E_ARG, "no fleet: give servers (nats://HOST:PORT,...) or set $TALLY_NATS")

    def text(v: Optional[str]) -> Optional[bytes]:
        return v.encode() if v else None

    opts = _lib.NatsOpts(servers=servers.encode(), credentials=text(credentials),
                         user=text(user), tls_ca=text(tls_ca), tls_cert=text(tls_cert),
                         tls_key=text(tls_key), timeout_ms=timeout_ms)
    handle, why = ctypes.c_void_p(), ctypes.create_string_buffer(512)
    st = lib.tally_nats_new(ctypes.byref(opts), ctypes.byref(handle), why, len(why))
    if st:
        raise Error(st, why.value.decode(errors="replace"))
    try:
        info, stale = _lib.StreamInfo(), ctypes.c_uint64()
        st = lib.tally_nats_query_stale(handle, stream.encode(), ctypes.byref(info),
                                        ctypes.byref(stale))
        if st:
            raise Error(st, (lib.tally_nats_error(handle) or b"").decode(errors="replace"))
        return record_from_info(stream, info), stale.value
    finally:
        lib.tally_nats_destroy(ctypes.byref(handle))


class Client(_Handle):
    """One connection to tallyd (a libtally client). Use it from one thread.

    endpoint: tcp://HOST:PORT or ipc://PATH (default $TALLY_ENDPOINT, else
    tcp://127.0.0.1:5555). CURVE keys as the CLI finds them: server_key (tallyd's public key or
    its .pub file) and client_key (a key file from keygen), else $TALLY_SERVER_KEY and
    $TALLY_CLIENT_KEY, else ~/.config/tally/tally.conf; none anywhere: a plain connection.
    An endpoint of another kind raises Error at once, saying why; so does the first call while
    nothing listens at the endpoint ("Connection refused (is tallyd running?)"), as the CLI.
    """

    _handle_attr, _destroy = "_c", lib.tally_client_destroy
    _fleet = False  # Client.fleet's: a fleet in direct mode (no PUB socket of its own)

    def __init__(self, endpoint: Optional[str] = None, timeout_ms: int = DEFAULT_TIMEOUT_MS,
                 server_key: Optional[str] = None, client_key: Optional[str] = None):
        endpoint = endpoint or os.environ.get("TALLY_ENDPOINT") or DEFAULT_ENDPOINT
        self._c = ctypes.c_void_p()
        keys, why = load_keys(server_key, client_key), ctypes.create_string_buffer(512)
        self._key_args = (server_key, client_key)  # the subscribers' (subscribe)
        try:
            self.curve = bool(keys.server_public)
            st = lib.tally_client_open(endpoint.encode(), timeout_ms, ctypes.byref(keys),
                                       ctypes.byref(self._c), why, len(why))
        finally:
            ctypes.memset(ctypes.byref(keys), 0, ctypes.sizeof(keys))
        if st:  # libtally's words, as the CLI says them ("invalid endpoint ...: ...")
            raise Error(st, why.value.decode(errors="replace"))
        self.endpoint = endpoint
        self.last_result: Optional[Dict[str, Any]] = None

    @classmethod
    def fleet(cls, servers: Optional[str] = None, timeout_ms: int = DEFAULT_TIMEOUT_MS,
              client_key: Optional[str] = None, server_key: Optional[str] = None,
              credentials: Optional[str] = None, user: Optional[str] = None,
              tls_ca: Optional[str] = None, tls_cert: Optional[str] = None,
              tls_key: Optional[str] = None) -> "Client":
        """A client of a tallyd fleet in direct mode (PROTOCOL.md §13), as `tally --fleet`:
        each request goes over ZeroMQ straight to its stream's owner, found through the fleet's
        NATS servers (comma-separated URLs; default $TALLY_FLEET), not_owner followed, requests
        sent again to a new owner. Members with CURVE on publish their own server keys: give
        this client's key pair (client_key, else $TALLY_CLIENT_KEY, else tally.conf); a
        server_key pins one key that every member must publish. credentials, user and tls_*
        are the NATS connection's (a .creds file, the NATS user, a CA and client certificate).
        Methods are Client's; subscribe() is not (a fleet publishes on NATS)."""
        servers = servers or os.environ.get("TALLY_FLEET")
        if not servers:
            raise Error(E_ARG, "no fleet: give servers (nats://HOST:PORT,...) or set $TALLY_FLEET")
        self = cls.__new__(cls)
        self._c = ctypes.c_void_p()
        self._key_args = (server_key, client_key)
        self._fleet = True

        def text(v: Optional[str]) -> Optional[bytes]:
            return v.encode() if v else None

        opts = _lib.NatsOpts(servers=servers.encode(), credentials=text(credentials),
                             user=text(user), tls_ca=text(tls_ca), tls_cert=text(tls_cert),
                             tls_key=text(tls_key), timeout_ms=timeout_ms)
        keys, why = load_keys(server_key, client_key, fleet=True), ctypes.create_string_buffer(512)
        try:
            self.curve = bool(keys.client_secret)
            st = lib.tally_client_new_fleet_curve(ctypes.byref(opts), ctypes.byref(keys),
                                                  ctypes.byref(self._c), why, len(why))
        finally:
            ctypes.memset(ctypes.byref(keys), 0, ctypes.sizeof(keys))
        if st:
            raise Error(st, why.value.decode(errors="replace"))
        self.endpoint = servers
        self.last_result = None
        return self

    def _check(self, status: int, message: Optional[bytes] = None) -> None:
        if status:
            if message is None:
                message = lib.tally_client_error(self._c)
            raise Error(status, (message or b"").decode(errors="replace"))

    # -- small operations --

    def ping(self) -> float:
        """Round-trip time in milliseconds."""
        rtt = ctypes.c_double()
        self._check(lib.tally_ping(self._c, ctypes.byref(rtt)))
        return rtt.value / 1000.0

    def _text(self, op: str) -> str:
        text = ctypes.c_void_p()
        self._check(lib.tally_info(self._c, OP[op], ctypes.byref(text)))
        try:
            return ctypes.string_at(text).decode()
        finally:
            _lib.free(text)

    def info(self) -> Dict[str, str]:
        """The daemon's info as a dict in the daemon's order (version, backend, max_batch, ...;
        values are strings; keys this binding does not know are kept), parsed by libtally's
        tally_info_fetch: Error reply for text that is not key=value lines."""
        parsed = ctypes.c_void_p()
        self._check(lib.tally_info_fetch(self._c, ctypes.byref(parsed)))
        try:
            return {lib.tally_info_key(parsed, i).decode(): lib.tally_info_value(parsed, i).decode()
                    for i in range(lib.tally_info_count(parsed))}
        finally:
            lib.tally_info_destroy(ctypes.byref(parsed))

    def stats(self) -> str:
        """The daemon's metrics, Prometheus text."""
        return self._text("stats")

    def query(self, stream: str, last_ms: Optional[int] = None) -> Record:
        """A stream's record: its counters, and its histogram under "bins" ((256,) uint64, or
        (channels, 256) for rgb8/rgba8). With last_ms, the histogram fields count only the last
        last_ms milliseconds (rounded up to whole intervals; record["window"] says the span);
        Error bad_window when tallyd keeps less (info's window_intervals x window_interval_ms)."""
        info = _lib.StreamInfo()
        if last_ms is None:
            self._check(lib.tally_query(self._c, stream.encode(), ctypes.byref(info)))
            return record_from_info(stream, info)
        if not 1 <= last_ms <= WINDOW_MS_MAX:
            raise ValueError(f"last_ms {last_ms}: 1 .. {WINDOW_MS_MAX}")
        start, end = ctypes.c_uint64(), ctypes.c_uint64()
        self._check(lib.tally_query_window(self._c, stream.encode(), last_ms, ctypes.byref(info),
                                           ctypes.byref(start), ctypes.byref(end)))
        return record_from_info(stream, info, Window(start_ms=start.value, end_ms=end.value))

    def summary(self, stream: str, last_ms: Optional[int] = None, channel: Union[int, str] = 0,
                quantiles: Sequence[float] = DEFAULT_QUANTILES) -> Summary:
        """summarize(query(stream, last_ms), channel, quantiles): count, mean, min, max and
        quantiles ("p50", "p99.9", ...) of the stream's histogram, as `tally query --json`."""
        return summarize(self.query(stream, last_ms), channel, quantiles)

    def quantiles(self, stream: str, qs: Sequence[float], last_ms: Optional[int] = None,
                  channel: Union[int, str] = 0) -> List[Quantile]:
        """The qs-quantiles of the stream's histogram (all time, or the last last_ms)."""
        return quantiles(self.query(stream, last_ms), qs, channel)

    def reset(self, stream: str) -> None:
        """Zeroes the stream and keeps it (type, range and last_seq stay)."""
        self._check(lib.tally_reset(self._c, stream.encode()))

    def delete(self, stream: str) -> None:
        """Removes the stream; a later query gets unknown_stream."""
        self._check(lib.tally_delete(self._c, stream.encode()))

    def streams(self) -> List[str]:
        """The daemon's stream names."""
        names, count = ctypes.POINTER(ctypes.c_char_p)(), ctypes.c_size_t()
        self._check(lib.tally_streams(self._c, ctypes.byref(names), ctypes.byref(count)))
        try:
            return [names[i].decode() for i in range(count.value)]
        finally:
            lib.tally_strings_free(names, count)

    def subscribe(self, *prefixes: str) -> Subscriber:
        """A Subscriber on the PUB endpoint tallyd reports in info (tallyd --pub), subscribed to
        prefixes ("" for every stream; none given: every stream), with this client's CURVE
        keys (tallyd's PUB socket admits the clients its request endpoint admits). A fleet
        client (Client.fleet) has none to subscribe to: its members publish on NATS (`tally
        --fleet URL watch`)."""
        if self._fleet:
            raise Error(E_ARG, "a fleet client has no PUB socket to subscribe to: the members "
                        "publish on NATS (tally.watch.<k>; `tally --fleet URL watch`)")
        endpoint = self.info().get("pub", "")
        if not endpoint:
            raise Error(E_ARG, "tallyd publishes nothing: start it with --pub ENDPOINT")
        return Subscriber(endpoint, *(prefixes or ("",)), server_key=self._key_args[0],
                          client_key=self._key_args[1])

    # -- data operations over whole arrays (tally_run) --

    def run(self, req: _lib.Req, x: Array, chunk_bytes: int = 0, window: int = 0,
            shm: bool = False, seq: bool = False,
            seq_base: Optional[int] = None) -> Tuple[Array, Dict[str, Any]]:
        """Runs a prepared request over array x; returns (output array, result dict)."""
        x = np.ascontiguousarray(x)
        stream = req.stream.decode() if req.stream_len else None
        opts = _opts(chunk_bytes, window, shm, _seq_mode(stream, seq, seq_base), seq_base or 0)
        out, res = _lib.Buf(), _lib.RunResult()
        st = lib.tally_run(self._c, ctypes.byref(req), x.ctypes.data if x.size else None,
                           x.nbytes, ctypes.byref(opts), ctypes.byref(out), ctypes.byref(res))
        try:
            self.last_result = _result(res)
            if st:
                raise Error(st, res.error.decode(errors="replace"), self.last_result)
            data = ctypes.string_at(out.data, out.len) if out.len else b""
            return _shaped(req, np.frombuffer(data, dtype=_out_dtype(req)).copy()), \
                self.last_result
        finally:
            lib.tally_buf_free(ctypes.byref(out))

    def filter(self, x: Union[Array, GpuRegion], gt: Optional[int] = None,
               ge: Optional[int] = None, lt: Optional[int] = None, le: Optional[int] = None,
               eq: Optional[int] = None, ne: Optional[int] = None,
               between: Optional[Tuple[int, int]] = None,
               stable: bool = False, stream: Optional[str] = None, **kw: Any) -> Any:
        """The elements of x (int32 or uint8) that satisfy the one predicate given. x may be a
        GpuRegion (read on tallyd's GPU by reference); with out=GpuRegion (registered with
        output=True) the kept elements are written there and their number is returned."""
        params = dict(gt=gt, ge=ge, lt=lt, le=le, eq=eq, ne=ne, between=between, stable=stable)
        if isinstance(x, GpuRegion):
            return self._by_reference("filter", x, stream, params, kw)
        x, dtype = _as_input(x, "filter", None)
        return self.run(_op_request("filter", dtype, stream, params), x, **kw)[0]

    def scan(self, x: Union[Array, GpuRegion], exclusive: bool = False, out32: bool = False,
             stream: Optional[str] = None, **kw: Any) -> Any:
        """Prefix sums of int32 x: int64 (int32 wrapping with out32); a stream carries. x may be
        a GpuRegion, and out=GpuRegion receives the sums (their number is returned), as for
        filter."""
        params = dict(exclusive=exclusive, out32=out32)
        if isinstance(x, GpuRegion):
            return self._by_reference("scan", x, stream, params, kw)
        x, dtype = _as_input(x, "scan", None)
        return self.run(_op_request("scan", dtype, stream, params), x, **kw)[0]

    def hist(self, x: Union[Array, GpuRegion], range: Optional[Tuple[int, int]] = None,
             stream: Optional[str] = None, dtype: Optional[DtypeLike] = None,
             **kw: Any) -> Array:
        """The histogram of x: uint8 256 counts; int32 and uint16 over range=(lo, hi) 258 (256
        bins, underflow, overflow); an (H, W, 3|4) uint8 image, or dtype="rgb8"/"rgba8" with
        interleaved bytes, (3|4, 256) counts per channel. uint64 counts. x may be a GpuRegion:
        its nbytes, of its dtype (or dtype=), read on tallyd's GPU by reference."""
        if isinstance(x, GpuRegion):
            counts: Array = self._by_reference("hist", x, stream, dict(range=range),
                                               dict(kw, dtype=dtype))
            return counts
        x, dt = _as_input(x, "hist", dtype)
        return self.run(_op_request("hist", dt, stream, dict(range=range)), x, **kw)[0]

    def minmax(self, x: Array, dtype: Optional[DtypeLike] = None,
               **kw: Any) -> Optional[Tuple[int, int]]:
        """The smallest and largest element of x (int32, uint8 or uint16) as (min, max); None
        for an empty x. No stream: tallyd keeps nothing of it."""
        x, dt = _as_input(x, "minmax", dtype)
        out = self.run(_op_request("minmax", dt, None, {}), x, **kw)[0]
        return (int(out[0]), int(out[1])) if out.size else None

    def _by_reference(self, op: str, r: GpuRegion, stream: Optional[str],
                      params: Dict[str, Any], kw: Dict[str, Any]) -> Any:
        """op over GpuRegion r's nbytes by device reference (tally_call_shm); kw: dtype (hist),
        offset, length (bytes), out (a GpuRegion for filter and scan) and out_offset."""
        name = _dtype_name(kw.get("dtype") or r.dtype_name)
        if name not in _OP_DTYPES[op]:
            raise TypeError(f"{op} takes {', '.join(_OP_DTYPES[op])} elements, not {name}")
        out: Optional[GpuRegion] = kw.get("out")
        offset = int(kw.get("offset", 0))
        length = int(kw.get("length", r.nbytes - offset))
        req = _op_request(op, DTYPE[name], stream, params)
        result, rep = self._call_shm(req, r, offset, length, out, int(kw.get("out_offset", 0)))
        return rep["count"] if out is not None else result

    def gpu_region(self, nbytes: int, dtype: DtypeLike = "u8", device: int = 0,
                   output: bool = False) -> GpuRegion:
        """nbytes of GPU memory on CUDA device `device`, registered with tallyd as a device
        region (see GpuRegion); output=True lets filter and scan write into it."""
        return GpuRegion(self, nbytes, dtype, device, output)

    # -- streaming --

    def push(self, op: str, dtype: Optional[DtypeLike] = None, stream: Optional[str] = None,
             on_output: Optional[OutputFn] = None, chunk_bytes: int = 0, window: int = 0,
             shm: bool = False, seq: bool = True, seq_base: Optional[int] = None,
             **params: Any) -> Push:
        """A streaming push of op ("filter", "scan", "hist", "minmax"); params as for the array calls
        (gt=..., stable=..., exclusive=..., out32=..., range=...). dtype: "u8", "i32", "u16",
        "rgb8", "rgba8" or a NumPy type (default: u8 for hist without range, else i32). On a
        stream the chunks are numbered (seq=False: not); seq_base resumes a push that stopped."""
        if dtype is None:
            dtype = "u8" if op == "hist" and "range" not in params else "i32"
        name = _dtype_name(dtype)
        if op in _OP_DTYPES and name not in _OP_DTYPES[op]:
            raise TypeError(f"{op} takes {', '.join(_OP_DTYPES[op])} elements, not {name}")
        req = _op_request(op, DTYPE[name], stream, params)
        opts = _opts(chunk_bytes, window, shm, _seq_mode(stream, seq, seq_base), seq_base or 0)
        return Push(self, req, opts, on_output)

    # -- shared memory --

    def region(self, size: int) -> Region:
        """A shared-memory region of size bytes, registered with tallyd (on this host)."""
        return Region(self, size)

    def _call_shm(self, req: _lib.Req, region: AnyRegion, offset: int, length: int,
                  out_region: Optional[AnyRegion] = None,
                  out_offset: int = 0) -> Tuple[Array, Dict[str, int]]:
        reply = _lib.Reply()
        lib.tally_reply_init(ctypes.byref(reply))
        st = lib.tally_call_shm(self._c, ctypes.byref(req), region._r, offset, length,
                                out_region._r if out_region else None, out_offset,
                                ctypes.byref(reply))
        try:
            if st:
                raise Error(st, reply.error.decode(errors="replace"))
            rep = {"count": reply.rep.count, "aux0": reply.rep.aux0}
            data = ctypes.string_at(reply.payload, reply.len) if reply.len else b""
            return _shaped(req, np.frombuffer(data, dtype=_out_dtype(req)).copy()), rep
        finally:
            lib.tally_reply_clear(ctypes.byref(reply))

    def hist_shm(self, region: Region, offset: int, length: int, dtype: DtypeLike = "u8",
                 range: Optional[Tuple[int, int]] = None, stream: Optional[str] = None) -> Array:
        """hist of region bytes [offset, offset + length) of dtype (as hist), read in place. Over
        the daemon's max_batch it is sent in pieces of at most max_batch (one batch each on a
        stream) and their counts summed."""
        req = _op_request("hist", DTYPE[_dtype_name(dtype)], stream, dict(range=range))
        return self._call_shm(req, region, offset, length)[0]

    def filter_shm(self, region: Region, offset: int, length: int, out_offset: int,
                   dtype: DtypeLike = "i32", stream: Optional[str] = None, stable: bool = False,
                   **pred: Any) -> Array:
        """filter of a region range, the kept elements written into the same region at
        out_offset; returns a view of them."""
        name = _dtype_name(dtype)
        req = _op_request("filter", DTYPE[name], stream, dict(pred, stable=stable))
        _, rep = self._call_shm(req, region, offset, length, region, out_offset)
        return region.array(_NUMPY_TYPE[name], out_offset, rep["count"])

    def scan_shm(self, region: Region, offset: int, length: int, out_offset: int,
                 exclusive: bool = False, stream: Optional[str] = None) -> Array:
        """int64 prefix sums of int32 region data, written into the region at out_offset;
        returns a view of them."""
        req = _op_request("scan", DTYPE["i32"], stream, dict(exclusive=exclusive))
        _, rep = self._call_shm(req, region, offset, length, region, out_offset)
        return region.array(np.int64, out_offset, rep["count"])
