# SPDX-License-Identifier: Apache-2.0
"""Subscriptions (PROTOCOL.md §11): a SUB socket on tallyd's PUB endpoint through libtally's
tally_sub_*, each publication handed over as a Publication whose record is the same Record a
query gives (so summarize() and quantiles() work on it).

recv() without a timeout waits in slices of WAIT_SLICE_MS, so Ctrl-C (KeyboardInterrupt)
is seen within a slice even though the wait itself is in C.
"""

from __future__ import annotations

import ctypes
from typing import Iterator, NamedTuple, Optional

from ._hist import Record, record_from_info
from ._lib import CurveKeys, Error, PubMsg, lib
from ._wire import E_REPLY, E_TIMEOUT, PUB_DELETED

WAIT_SLICE_MS = 200


class Publication(NamedTuple):
    """One message: kind "update" (record: the stream's all-time record) or "deleted" (record
    None); pub_seq counts every message of one daemon run (a gap: lost, for a subscriber to
    every stream; not above the last one: tallyd restarted); time_ms when the record was taken
    (window clock); interval_ms tallyd's publication interval."""
    kind: str
    stream: str
    pub_seq: int
    time_ms: int
    interval_ms: int
    record: Optional[Record]


def load_keys(server_key: Optional[str], client_key: Optional[str],
              fleet: bool = False) -> CurveKeys:
    """CURVE keys as the CLI finds them (tally_curve_keys_load): the arguments, else
    $TALLY_SERVER_KEY and $TALLY_CLIENT_KEY, else ~/.config/tally/tally.conf; none anywhere: an
    empty server_public (plain). For a fleet (tally_curve_client_keys_load) the client's pair
    alone turns CURVE on, each member's key its own. Raises Error saying why. The caller wipes
    them after use."""
    keys, why = CurveKeys(), ctypes.create_string_buffer(512)
    load = lib.tally_curve_client_keys_load if fleet else lib.tally_curve_keys_load
    st = load(server_key.encode() if server_key else None,
              client_key.encode() if client_key else None, ctypes.byref(keys), why, len(why))
    if st:
        ctypes.memset(ctypes.byref(keys), 0, ctypes.sizeof(keys))
        raise Error(st, f"CURVE keys: {why.value.decode(errors='replace')}")
    return keys


class Subscriber:
    """A subscription to tallyd's publications (tallyd --pub ENDPOINT). It connects in the
    background and reconnects by itself; nothing arrives until a prefix is subscribed.
    CURVE keys as Client takes them (server_key, client_key, else the environment and
    tally.conf): with CURVE on, tallyd's PUB socket admits only its allowed clients, and a
    subscriber it does not admit receives nothing (PROTOCOL.md §12).

        with tally.Subscriber("tcp://127.0.0.1:5556", "cam") as sub:
            for pub in sub:                 # blocks; Ctrl-C stops it
                print(pub.stream, tally.summarize(pub.record)["quantiles"])
    """

    def __init__(self, endpoint: str, *prefixes: str, server_key: Optional[str] = None,
                 client_key: Optional[str] = None):
        self._sub = ctypes.c_void_p()
        keys = load_keys(server_key, client_key)
        try:
            st = lib.tally_sub_new_curve(endpoint.encode(), ctypes.byref(keys),
                                         ctypes.byref(self._sub))
        finally:
            ctypes.memset(ctypes.byref(keys), 0, ctypes.sizeof(keys))
        if st:
            raise Error(st, f"cannot subscribe to {endpoint!r}")
        self.endpoint = endpoint
        for prefix in prefixes:
            self.subscribe(prefix)

    def subscribe(self, prefix: str = "") -> None:
        """Receive the streams whose names start with prefix ("" for all; "cam0" also matches
        "cam01": compare pub.stream for an exact name). May be called several times."""
        st = lib.tally_sub_subscribe(self._sub, prefix.encode())
        if st:
            raise Error(st, f"cannot subscribe to prefix {prefix!r} (at most 64 bytes)")

    def recv(self, timeout_ms: Optional[int] = None) -> Optional[Publication]:
        """The next publication; None when none came within timeout_ms (0: only what has
        arrived already; None: wait for one). A message that does not decode is skipped."""
        msg = PubMsg()
        while True:
            wait = WAIT_SLICE_MS if timeout_ms is None else min(timeout_ms, WAIT_SLICE_MS)
            st = lib.tally_sub_recv(self._sub, wait, ctypes.byref(msg))
            if st == 0:
                return _publication(msg)
            if st not in (E_TIMEOUT, E_REPLY):  # E_REPLY: a message this binding cannot read
                raise Error(st, "receiving a publication failed")
            if st == E_TIMEOUT and timeout_ms is not None:
                timeout_ms -= wait
                if timeout_ms <= 0:
                    return None

    def __iter__(self) -> Iterator[Publication]:
        while True:
            pub = self.recv()
            if pub is not None:
                yield pub

    def fileno(self) -> int:
        """A descriptor for select/poll (POLLIN). Edge-triggered: once it fires, call
        recv(0) until it returns None before waiting on it again."""
        return int(lib.tally_sub_fd(self._sub))

    def close(self) -> None:
        if self._sub:
            lib.tally_sub_destroy(ctypes.byref(self._sub))

    def __enter__(self) -> "Subscriber":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


def _publication(msg: PubMsg) -> Publication:
    name = msg.stream.decode()
    deleted = msg.pub.kind == PUB_DELETED
    return Publication(kind="deleted" if deleted else "update", stream=name,
                       pub_seq=msg.pub.pub_seq, time_ms=msg.pub.time_ms,
                       interval_ms=msg.pub.interval_ms,
                       record=None if deleted else record_from_info(name, msg.info))
