# SPDX-License-Identifier: Apache-2.0
"""Stream records and what an analyst asks of their histograms: the record as a dict with NumPy
bins, and summaries, quantiles and bin edges computed by libtally (tally_hist_summarize,
tally_hist_quantile, tally_hist_edge), so every number is the one `tally query` prints.

A record's histogram is rebuilt into the C tally_stream_info_t and read per channel with
tally_hist_from_info: the rules for ranged types, colour channels and quantile estimates live
in C once (client/tally_hist.c), never here.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any, Dict, List, Optional, Sequence, TypedDict, Union, cast

import numpy as np
import numpy.typing as npt

from . import _lib
from ._lib import Error, lib
from ._wire import E_ARG, HIST_BINS

CHANNEL_NAMES = ("r", "g", "b", "a")


class Window(TypedDict):
    """The time a window query covers, ms since the epoch (PROTOCOL.md §5 "Windows")."""
    start_ms: int
    end_ms: int


class Record(TypedDict):
    """A stream's record (`query`, a publication). bins: (256,) uint64 for one channel, or
    (channels, 256) for rgb8/rgba8; type: "u8", "i32", "u16", "rgb8", "rgba8", or None before
    the stream's first hist; window: None for all time."""
    stream: str
    type: Optional[str]
    batches: int
    elements: int
    bytes: int
    filter_seen: int
    filter_kept: int
    scan_carry: int
    scan_elements: int
    hist_dtype: int
    hist_lo: int
    hist_hi: int
    hist_underflow: int
    hist_overflow: int
    hist_total: int
    last_seq: int
    bins: npt.NDArray[np.uint64]
    window: Optional[Window]


class BinRef(TypedDict):
    """A bin: its number and the integers it holds, [lo, hi)."""
    bin: int
    lo: int
    hi: int


class Summary(TypedDict):
    """One channel's summary, the members of `tally query --json` (its "channels" entry for
    rgb8/rgba8) without the bins: quantiles maps "p50", "p99.9", ... to values (each a Quantile:
    an int with .side, as the CLI's JSON gives {q, value, side})."""
    count: int
    in_range: int
    underflow: int
    overflow: int
    mean: Optional[float]
    min: Optional[BinRef]
    max: Optional[BinRef]
    quantiles: Optional[Dict[str, Quantile]]


class Quantile(int):
    """A quantile's value (an int) with .side: 0 in range; -1 it is an underflow value and the
    value is only the range's lo; +1 an overflow value, the value is hi (tally_hist_quantile)."""
    side: int

    def __new__(cls, value: int, side: int = 0) -> "Quantile":
        q = super().__new__(cls, value)
        q.side = side
        return q

    def __repr__(self) -> str:
        return f"Quantile({int(self)}, side={self.side})"


def dtype_name(dtype: int) -> Optional[str]:
    """"u8", "rgb8", ... for a dtype number; None for none (no histogram)."""
    name = lib.tally_dtype_name(dtype)
    return name.decode() if name and dtype else None


def channels(record: Record) -> int:
    """The record's histograms: 1 (u8, i32, u16), 3 (rgb8), 4 (rgba8), 0 before the first hist."""
    return int(lib.tally_hist_channels(record["hist_dtype"]))


def record_from_info(stream: str, info: _lib.StreamInfo,
                     window: Optional[Window] = None) -> Record:
    """The C record as a Record (the bins copied out)."""
    n = max(1, int(lib.tally_hist_channels(info.hist_dtype)))
    bins = np.ctypeslib.as_array(info.bins)[:n * HIST_BINS].copy()
    record: Dict[str, Any] = {name: getattr(info, name) for name, _ in _lib.STREAM_INFO_SCALARS}
    record.update(stream=stream, type=dtype_name(info.hist_dtype),
                  bins=bins if n == 1 else bins.reshape(n, HIST_BINS), window=window)
    return cast(Record, record)


def _info_from_record(record: Record) -> _lib.StreamInfo:
    fields = cast(Dict[str, Any], record)
    info = _lib.StreamInfo(**{name: fields[name] for name, _ in _lib.STREAM_INFO_SCALARS})
    flat = np.ascontiguousarray(record["bins"], dtype=np.uint64).reshape(-1)
    np.ctypeslib.as_array(info.bins)[:len(flat)] = flat
    return info


def _channel_index(record: Record, channel: Union[int, str]) -> int:
    if isinstance(channel, str):
        if channel not in CHANNEL_NAMES:
            raise ValueError(f"channel {channel!r}: r, g, b or a")
        channel = CHANNEL_NAMES.index(channel)
    n = channels(record)
    if n == 0:
        raise ValueError(f"stream {record['stream']!r} has no histogram yet")
    if not 0 <= channel < n:
        raise ValueError(f"stream {record['stream']!r} ({record['type']}) has channels 0..{n - 1},"
                         f" not {channel}")
    return channel


def _hist(record: Record, channel: Union[int, str]) -> _lib.Hist:
    index = _channel_index(record, channel)
    hist = _lib.Hist()
    st = lib.tally_hist_from_info(ctypes.byref(_info_from_record(record)), index,
                                  ctypes.byref(hist))
    if st:
        raise Error(st, f"stream {record['stream']!r}: its histogram does not decode")
    return hist


def quantile_key(q: float) -> str:
    """The name of quantile q in summaries: 0.5 -> "p50", 0.999 -> "p99.9"."""
    return f"p{q * 100:.6g}"


def _check_q(q: float) -> float:
    q = float(q)
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q}: between 0 and 1")
    return q


def _quantile(hist: _lib.Hist, q: float) -> Quantile:
    out = _lib.QuantileC()
    st = lib.tally_hist_quantile(ctypes.byref(hist), _check_q(q), ctypes.byref(out))
    if st == E_ARG:
        raise ValueError("no quantile of an empty histogram")
    if st:
        raise Error(st, "tally_hist_quantile failed")
    return Quantile(out.value, out.side)


def quantiles(record: Record, qs: Sequence[float], channel: Union[int, str] = 0) -> List[Quantile]:
    """The qs-quantiles (each in [0, 1]) of the record's histogram (channel 0..3 or "r".."a" for
    rgb8/rgba8), estimated from the bins as `tally query` does (tally_hist_quantile: exact for
    u8 and colour channels). ValueError for an empty histogram."""
    hist = _hist(record, channel)
    return [_quantile(hist, q) for q in qs]


def quantile(record: Record, q: float, channel: Union[int, str] = 0) -> Quantile:
    """One quantile (see quantiles)."""
    return quantiles(record, [q], channel)[0]


def edges(record: Record, channel: Union[int, str] = 0) -> npt.NDArray[np.int64]:
    """The 257 integer edges of the 256 bins: bin b holds the integers [edges[b], edges[b+1])
    (tally_hist_edge; u8: 0..256)."""
    hist = _hist(record, channel)
    return np.array([lib.tally_hist_edge(ctypes.byref(hist), b) for b in range(HIST_BINS + 1)],
                    dtype=np.int64)


def _bin_ref(hist: _lib.Hist, b: int) -> Optional[BinRef]:
    if b < 0:
        return None
    return BinRef(bin=b, lo=lib.tally_hist_edge(ctypes.byref(hist), b),
                  hi=lib.tally_hist_edge(ctypes.byref(hist), b + 1))


DEFAULT_QUANTILES = (0.5, 0.9, 0.99)


def summarize(record: Record, channel: Union[int, str] = 0,
              qs: Sequence[float] = DEFAULT_QUANTILES) -> Summary:
    """Count, in-range, underflow, overflow, mean (None when nothing is in range), the lowest
    and highest non-empty bin, and the qs-quantiles (None when empty), as `tally query --json`
    gives them (tally_hist_summarize). A record without a histogram yet summarizes as empty."""
    if channels(record) == 0:
        return Summary(count=0, in_range=0, underflow=0, overflow=0, mean=None, min=None,
                       max=None, quantiles=None)
    hist = _hist(record, channel)
    s = _lib.HistSummary()
    lib.tally_hist_summarize(ctypes.byref(hist), ctypes.byref(s))
    qs = [_check_q(q) for q in qs]
    return Summary(count=s.count, in_range=s.in_range, underflow=s.underflow,
                   overflow=s.overflow, mean=None if math.isnan(s.mean) else s.mean,
                   min=_bin_ref(hist, s.min_bin), max=_bin_ref(hist, s.max_bin),
                   quantiles={quantile_key(q): _quantile(hist, q) for q in qs}
                   if s.count else None)
