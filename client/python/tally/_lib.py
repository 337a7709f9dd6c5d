# SPDX-License-Identifier: Apache-2.0
"""libtally through ctypes: finding and loading the library, the ctypes mirrors of its C structs
(checked against the compiler's layouts in _wire.LAYOUT at import), every function's signature,
and tally.Error. The rest of the package calls the C library only through `lib` here.

Why ctypes and not a compiled extension: `pip install ./client/python` then needs no compiler
and no Python headers, and one wheel works with any libtally 0.1 on the host. The cost is that
the structs are written twice (C and here); _check_layouts makes a mismatch an ImportError
instead of silent memory corruption, and tests/test_python_wire.sh keeps _wire.py current.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Dict, Iterable, List, Optional, Tuple, Type

from ._wire import ERROR_MESSAGE_MAX, HIST_BINS, HIST_VALUES_MAX, LAYOUT, SONAME, STREAM_NAME_MAX

# ---- The C structs (tally.h, tally_wire.h) ----------------------------------------------------


class _Struct(ctypes.Structure):
    _c_name = ""  # the C struct this mirrors, a key of _wire.LAYOUT


class Req(_Struct):
    _c_name = "tally_req_t"
    _fields_ = [("version", ctypes.c_uint8), ("opcode", ctypes.c_uint8),
                ("dtype", ctypes.c_uint8), ("flags", ctypes.c_uint8),
                ("request_id", ctypes.c_uint64), ("pred", ctypes.c_uint8),
                ("lo", ctypes.c_int64), ("hi", ctypes.c_int64), ("seq", ctypes.c_uint64),
                ("stream_len", ctypes.c_uint8), ("stream", ctypes.c_char * (STREAM_NAME_MAX + 1))]


class Rep(_Struct):
    _c_name = "tally_rep_t"
    _fields_ = [("version", ctypes.c_uint8), ("opcode", ctypes.c_uint8),
                ("dtype", ctypes.c_uint8), ("flags", ctypes.c_uint8),
                ("request_id", ctypes.c_uint64), ("status", ctypes.c_uint32),
                ("count", ctypes.c_uint64), ("aux0", ctypes.c_uint64),
                ("aux1", ctypes.c_uint64)]


class Reply(_Struct):
    _c_name = "tally_reply_t"
    _fields_ = [("rep", Rep), ("payload", ctypes.POINTER(ctypes.c_uint8)),
                ("len", ctypes.c_size_t), ("error", ctypes.c_char * (ERROR_MESSAGE_MAX + 1)),
                ("msg_", ctypes.c_void_p)]


# The scalar fields of a stream record, in C order (the bins follow).
STREAM_INFO_SCALARS: Tuple[Tuple[str, Any], ...] = (
    ("batches", ctypes.c_uint64), ("elements", ctypes.c_uint64), ("bytes", ctypes.c_uint64),
    ("filter_seen", ctypes.c_uint64), ("filter_kept", ctypes.c_uint64),
    ("scan_carry", ctypes.c_int64), ("scan_elements", ctypes.c_uint64),
    ("hist_dtype", ctypes.c_uint8), ("hist_lo", ctypes.c_int64), ("hist_hi", ctypes.c_int64),
    ("hist_underflow", ctypes.c_uint64), ("hist_overflow", ctypes.c_uint64),
    ("hist_total", ctypes.c_uint64), ("last_seq", ctypes.c_uint64))


class StreamInfo(_Struct):
    _c_name = "tally_stream_info_t"
    _fields_ = list(STREAM_INFO_SCALARS) + [("bins", ctypes.c_uint64 * HIST_VALUES_MAX)]


class RunOpts(_Struct):
    _c_name = "tally_run_opts_t"
    _fields_ = [("chunk_bytes", ctypes.c_size_t), ("window", ctypes.c_uint),
                ("shm", ctypes.c_int), ("seq", ctypes.c_int), ("seq_base", ctypes.c_uint64),
                ("total_bytes", ctypes.c_uint64)]


# tally_run_result_t's counters, as tally.Push.result and Error.result give them.
RUN_RESULT_NAMES = ("chunks", "elements", "count", "seen", "carry", "hist_total", "input_chunks",
                    "seq_base", "applied", "skipped", "last_seq", "applied_known", "bytes",
                    "applied_bytes")


class RunResult(_Struct):
    _c_name = "tally_run_result_t"
    _fields_ = [(n, ctypes.c_uint64) for n in ("chunks", "elements", "count", "seen")] + [
        ("carry", ctypes.c_int64)] + [(n, ctypes.c_uint64) for n in
                                      ("hist_total", "input_chunks", "seq_base", "applied",
                                       "skipped", "last_seq")] + [
        ("applied_known", ctypes.c_bool), ("bytes", ctypes.c_uint64),
        ("applied_bytes", ctypes.c_uint64), ("status", ctypes.c_int),
        ("error", ctypes.c_char * (ERROR_MESSAGE_MAX + 1))]


class Buf(_Struct):
    _c_name = "tally_buf_t"
    _fields_ = [("data", ctypes.POINTER(ctypes.c_uint8)), ("len", ctypes.c_size_t),
                ("cap", ctypes.c_size_t)]


class Pub(_Struct):
    _c_name = "tally_pub_t"
    _fields_ = [("kind", ctypes.c_uint8), ("pub_seq", ctypes.c_uint64),
                ("time_ms", ctypes.c_uint64), ("interval_ms", ctypes.c_uint64)]


class PubMsg(_Struct):
    _c_name = "tally_pub_msg_t"
    _fields_ = [("pub", Pub), ("stream", ctypes.c_char * (STREAM_NAME_MAX + 1)),
                ("info", StreamInfo)]


class Hist(_Struct):
    _c_name = "tally_hist_t"
    _fields_ = [("dtype", ctypes.c_int), ("lo", ctypes.c_int64), ("hi", ctypes.c_int64),
                ("bins", ctypes.c_uint64 * HIST_BINS), ("underflow", ctypes.c_uint64),
                ("overflow", ctypes.c_uint64)]


class QuantileC(_Struct):
    _c_name = "tally_quantile_t"
    _fields_ = [("value", ctypes.c_int64), ("side", ctypes.c_int)]


class HistSummary(_Struct):
    _c_name = "tally_hist_summary_t"
    _fields_ = [("count", ctypes.c_uint64), ("in_range", ctypes.c_uint64),
                ("underflow", ctypes.c_uint64), ("overflow", ctypes.c_uint64),
                ("mean", ctypes.c_double), ("min_bin", ctypes.c_int), ("max_bin", ctypes.c_int),
                ("p50", QuantileC), ("p90", QuantileC), ("p99", QuantileC)]


class CurveKeys(_Struct):
    _c_name = "tally_curve_keys_t"
    _fields_ = [("server_public", ctypes.c_char * 41), ("client_public", ctypes.c_char * 41),
                ("client_secret", ctypes.c_char * 41)]


class NatsOpts(_Struct):
    _c_name = "tally_nats_opts_t"
    _fields_ = [("servers", ctypes.c_char_p), ("credentials", ctypes.c_char_p),
                ("nkey", ctypes.c_char_p), ("nkey_seed", ctypes.c_char_p),
                ("tls_ca", ctypes.c_char_p), ("tls_cert", ctypes.c_char_p),
                ("tls_key", ctypes.c_char_p), ("producer_id", ctypes.c_char_p),
                ("timeout_ms", ctypes.c_int), ("partitions", ctypes.c_uint32),
                ("window_bytes", ctypes.c_size_t), ("user", ctypes.c_char_p)]


STRUCTS: Tuple[Type[_Struct], ...] = (Req, Rep, Reply, StreamInfo, RunOpts, RunResult, Buf, Pub,
                                      PubMsg, Hist, QuantileC, HistSummary, CurveKeys, NatsOpts)


def check_layouts(structs: Iterable[Type[_Struct]],
                  layouts: Dict[str, Tuple[int, Dict[str, Tuple[int, int]]]]) -> None:
    """Raises ImportError unless each ctypes struct has the size of its C struct (cls._c_name)
    and the same fields, each at the C offset with the C size (layouts: _wire.LAYOUT). A
    mismatch would make libtally read and write the wrong bytes, silently."""
    for cls in structs:
        if cls._c_name not in layouts:
            raise ImportError(f"tally: {cls._c_name} (ctypes {cls.__name__}) is not in "
                              "tally/_wire.py's LAYOUT: add it to client/python/gen_wire.c")
        size, c_fields = layouts[cls._c_name]
        mine = {n: (getattr(cls, n).offset, getattr(cls, n).size) for n, *_ in cls._fields_}
        diffs = [f"sizeof {ctypes.sizeof(cls)}, C {size}"] if ctypes.sizeof(cls) != size else []
        diffs += [f"{n} (offset, size) {mine.get(n)}, C {c_fields.get(n)}"
                  for n in sorted(mine.keys() | c_fields.keys()) if mine.get(n) != c_fields.get(n)]
        if diffs:
            raise ImportError(f"tally: ctypes {cls.__name__} does not match the C {cls._c_name}: "
                              f"{'; '.join(diffs)}. Fix {cls.__name__} in tally/_lib.py, or "
                              "regenerate tally/_wire.py if the C headers changed "
                              "(tests/test_python_wire.sh prints how)")


check_layouts(STRUCTS, LAYOUT)

# ---- The functions ----------------------------------------------------------------------------

OUTPUT_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)

_P, _S, _I, _U64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint64
_CP, _PP = ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)


def _ptr(cls: Any) -> Any:
    return ctypes.POINTER(cls)


# name -> (return type, argument types), as tally.h and tally_wire.h declare them.
SIGNATURES: Dict[str, Tuple[Any, List[Any]]] = {
    "tally_version": (_CP, []),
    "tally_status_name": (_CP, [_I]),
    "tally_status_text": (_CP, [_I]),
    "tally_dtype_name": (_CP, [_I]),
    "tally_dtype_size": (_S, [_I]),
    "tally_hist_channels": (ctypes.c_uint, [ctypes.c_uint]),
    "tally_hist_values": (_S, [ctypes.c_uint]),
    "tally_hist_ranged": (ctypes.c_bool, [ctypes.c_uint]),
    "tally_client_new": (_I, [_CP, _I, _PP]),
    "tally_client_new_curve": (_I, [_CP, _I, _ptr(CurveKeys), _PP]),
    "tally_client_open": (_I, [_CP, _I, _ptr(CurveKeys), _PP, ctypes.c_char_p, _S]),
    "tally_curve_keys_load": (_I, [_CP, _CP, _ptr(CurveKeys), ctypes.c_char_p, _S]),
    "tally_curve_client_keys_load": (_I, [_CP, _CP, _ptr(CurveKeys), ctypes.c_char_p, _S]),
    "tally_client_new_fleet_curve": (_I, [_ptr(NatsOpts), _ptr(CurveKeys), _PP, ctypes.c_char_p,
                                          _S]),
    "tally_keygen": (_I, [_CP, ctypes.c_char_p, ctypes.c_char_p, _S]),
    "tally_client_destroy": (None, [_PP]),
    "tally_client_error": (_CP, [_P]),
    "tally_reply_init": (None, [_ptr(Reply)]),
    "tally_reply_clear": (None, [_ptr(Reply)]),
    "tally_req_set_stream": (_I, [_ptr(Req), _CP]),
    "tally_ping": (_I, [_P, _ptr(ctypes.c_double)]),
    "tally_info": (_I, [_P, _I, _PP]),
    "tally_info_fetch": (_I, [_P, _PP]),
    "tally_info_destroy": (None, [_PP]),
    "tally_info_count": (_S, [_P]),
    "tally_info_key": (_CP, [_P, _S]),
    "tally_info_value": (_CP, [_P, _S]),
    "tally_query": (_I, [_P, _CP, _ptr(StreamInfo)]),
    "tally_query_window": (_I, [_P, _CP, _U64, _ptr(StreamInfo), _ptr(_U64), _ptr(_U64)]),
    "tally_nats_new": (_I, [_ptr(NatsOpts), _PP, ctypes.c_char_p, _S]),
    "tally_nats_destroy": (None, [_PP]),
    "tally_nats_error": (_CP, [_P]),
    "tally_nats_query_stale": (_I, [_P, _CP, _ptr(StreamInfo), _ptr(_U64)]),
    "tally_reset": (_I, [_P, _CP]),
    "tally_delete": (_I, [_P, _CP]),
    "tally_streams": (_I, [_P, _ptr(_ptr(_CP)), _ptr(_S)]),
    "tally_strings_free": (None, [_ptr(_CP), _S]),
    "tally_run": (_I, [_P, _ptr(Req), _P, _S, _ptr(RunOpts), _ptr(Buf), _ptr(RunResult)]),
    "tally_buf_free": (None, [_ptr(Buf)]),
    "tally_push_new": (_I, [_P, _ptr(Req), _ptr(RunOpts), OUTPUT_FN, _P, _PP]),
    "tally_push_chunk_bytes": (_S, [_P]),
    "tally_push_write": (_I, [_P, _P, _S]),
    "tally_push_flush": (_I, [_P]),
    "tally_push_finish": (_I, [_P]),
    "tally_push_result": (_ptr(RunResult), [_P]),
    "tally_push_destroy": (None, [_PP]),
    "tally_region_create": (_I, [_P, _S, _PP]),
    "tally_region_data": (_P, [_P]),
    "tally_region_size": (_S, [_P]),
    "tally_region_destroy": (None, [_PP]),
    "tally_call_shm": (_I, [_P, _ptr(Req), _P, _S, _S, _P, _S, _ptr(Reply)]),
    "tally_gpu_alloc": (_I, [ctypes.c_int, _S, _PP]),
    "tally_gpu_ptr": (_P, [_P]),
    "tally_gpu_size": (_S, [_P]),
    "tally_gpu_register": (_I, [_P, _P, ctypes.c_uint, _P, _PP]),
    "tally_gpu_copy_to": (_I, [_P, _S, _P, _S]),
    "tally_gpu_copy_from": (_I, [_P, _S, _P, _S]),
    "tally_gpu_free": (None, [_PP]),
    "tally_gpu_error": (ctypes.c_char_p, []),
    "tally_sub_new": (_I, [_CP, _PP]),
    "tally_sub_new_curve": (_I, [_CP, _ptr(CurveKeys), _PP]),
    "tally_sub_destroy": (None, [_PP]),
    "tally_sub_subscribe": (_I, [_P, _CP]),
    "tally_sub_recv": (_I, [_P, _I, _ptr(PubMsg)]),
    "tally_sub_fd": (_I, [_P]),
    "tally_hist_from_info": (_I, [_ptr(StreamInfo), ctypes.c_uint, _ptr(Hist)]),
    "tally_hist_edge": (ctypes.c_int64, [_ptr(Hist), ctypes.c_uint]),
    "tally_hist_quantile": (_I, [_ptr(Hist), ctypes.c_double, _ptr(QuantileC)]),
    "tally_hist_summarize": (None, [_ptr(Hist), _ptr(HistSummary)]),
}

_HOW_TO_POINT = ("Install libtally (cmake --install BUILD, or the distribution's libtally "
                 "package), or set TALLY_LIBRARY to the path of libtally.so, e.g. "
                 "TALLY_LIBRARY=$PWD/build/client/libtally.so")


def library_path() -> Tuple[str, str]:
    """Which libtally to load, and how it was chosen (for messages): $TALLY_LIBRARY, else the
    SONAME this binding was generated for (libtally.so.0), which the system's loader looks up
    (ld.so.cache: the libtally0 package, or `cmake --install` then ldconfig; LD_LIBRARY_PATH).
    By its SONAME, not by ctypes.util.find_library("tally"): that may name another major
    version, whose functions this binding's signatures do not fit."""
    env = os.environ.get("TALLY_LIBRARY")
    if env:
        return env, "from $TALLY_LIBRARY"
    return SONAME, "its SONAME, through the system's loader"


def load(path: Optional[str] = None) -> Any:
    """Loads libtally and sets every signature. Raises ImportError naming the file looked for,
    why it could not be used, and how to point TALLY_LIBRARY at it."""
    how = "given"
    if path is None:
        path, how = library_path()
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise ImportError(f"tally: cannot load libtally, the tallyd client library: looked for "
                          f"{path!r} ({how}): {e}. {_HOW_TO_POINT}", path=path) from e
    missing = [name for name in SIGNATURES if not hasattr(lib, name)]
    if missing:
        raise ImportError(f"tally: {path!r} ({how}) is not a libtally this binding can use: it "
                          f"lacks {', '.join(missing)} (an older libtally, or another library). "
                          f"{_HOW_TO_POINT}", path=path)
    for name, (res, args) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


lib = load()
free = ctypes.CDLL(None).free  # what tally_info's text is released with
free.argtypes, free.restype = [_P], None


class Error(Exception):
    """A failed call: .status (the number), .name ("unknown_stream", ...), .message (the
    daemon's or libtally's explanation), and for array calls and pushes .result (what was
    applied: a push on a stream resumes with seq_base=err.result["seq_base"])."""

    def __init__(self, status: int, message: str, result: Optional[Dict[str, Any]] = None):
        self.status = status
        self.name = lib.tally_status_name(status).decode()
        self.message = message or lib.tally_status_text(status).decode()
        self.result = result
        super().__init__(f"{self.name}: {self.message}")
