# SPDX-License-Identifier: Apache-2.0
"""A real 3-server NATS JetStream cluster on loopback for the Python tests (test_web_fleet.py,
test_python.py's fleet client), as tests/lib/nats_cluster.c starts one for the C tests."""
import json
import os
import shutil
import socket
import subprocess
import time
from typing import Any, Callable, List, NoReturn, Optional


def fail(msg: str) -> NoReturn:
    raise AssertionError(msg)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def until(pred: Callable[[], Any], what: str, limit_s: float = 90) -> Any:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.2)
    fail("%s: not within %d s" % (what, limit_s))


def nats_server() -> Optional[str]:
    """The nats-server to run ($TALLY_NATS_SERVER, else the one on PATH), or None."""
    return os.environ.get("TALLY_NATS_SERVER") or shutil.which("nats-server")


class Cluster:
    """Three nats-server processes with JetStream, routed to each other, on free ports.

    A port free a moment ago may be another test's by the time nats-server binds it (ctest -j2;
    docs/testing.md, "Ports and endpoints"): then that node exits, and a connection to its port
    reaches the other process. So each node must be alive and name itself (server_name in its
    INFO) on its port, or the whole start is tried again on fresh ports and fresh stores, as
    tests/lib/nats_cluster.c does."""

    ATTEMPTS = 5

    def __init__(self, tmp: str) -> None:
        self.procs: List["subprocess.Popen[bytes]"] = []
        for attempt in range(self.ATTEMPTS):
            if self._start(tmp, attempt):
                return
            self.stop()
            self.procs = []
        fail("the NATS cluster did not start on fresh ports %d times" % self.ATTEMPTS)

    def _start(self, tmp: str, attempt: int) -> bool:
        server = nats_server()
        if not server:
            fail("no nats-server (apt-get install nats-server)")
        ports = [(free_port(), free_port()) for _ in range(3)]
        # Its own name: a route to a port another test's cluster took meanwhile is refused
        # (cluster names differ) instead of joining the two clusters into one.
        name = "pyfleet-%d-%d" % (os.getpid(), attempt)
        self.urls = ",".join("nats://127.0.0.1:%d" % c for c, _ in ports)
        for i, (client, route) in enumerate(ports):
            conf = os.path.join(tmp, "n%d.conf" % i)
            routes = ", ".join('"nats-route://127.0.0.1:%d"' % r
                               for j, (_, r) in enumerate(ports) if j != i)
            with open(conf, "w") as f:
                f.write('server_name: n%d\nlisten: 127.0.0.1:%d\nmax_payload: 8MB\n'
                        'jetstream {\n  store_dir: "%s/store%d.%d"\n  max_memory_store: 256MB\n}\n'
                        'cluster {\n  name: %s\n  listen: 127.0.0.1:%d\n  routes: [%s]\n}\n'
                        % (i, client, tmp, i, attempt, name, route, routes))
            log = open(os.path.join(tmp, "n%d.log" % i), "w")
            self.procs.append(subprocess.Popen([server, "-c", conf], stdout=log,
                                               stderr=subprocess.STDOUT))
        # Listening as itself, and JetStream answering (the cluster has its meta leader), as
        # tests/lib/nats_cluster.c waits: a worker's start waits 30 s for JetStream, which a
        # cluster starting on a loaded box can take before it elects one.
        for i, (client, _) in enumerate(ports):
            proc = self.procs[i]
            deadline = time.monotonic() + 30
            while server_name(client) != "n%d" % i:
                if proc.poll() is not None or time.monotonic() >= deadline:
                    return False  # its port taken meanwhile, most likely
                time.sleep(0.2)
        for client, _ in ports:
            until(lambda: jetstream_answers(client), "JetStream on port %d" % client, 120)
        return True

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(timeout=30)


def server_name(port: int) -> Optional[str]:
    """The server_name in the INFO line of whatever listens on port (None: nothing, or not a
    nats-server)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
            line = sock.makefile("rb").readline()
        if not line.startswith(b"INFO "):
            return None
        name = json.loads(line[5:]).get("server_name")
        return name if isinstance(name, str) else None
    except (OSError, ValueError):
        return None


def request(port: int, subject: str, headers: bool = False,
            timeout_s: float = 5) -> Optional[bytes]:
    """One request over the plain NATS protocol to the server on port, with an empty payload:
    the reply's body (headers and payload: a direct get's status is in its header line), or
    None when the connection closed first."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        f = sock.makefile("rb")
        f.readline()  # INFO
        sock.sendall(b'CONNECT {"verbose":false,"pedantic":false,"headers":%s}\r\n'
                     b"SUB _INBOX.ask 1\r\nPUB %s _INBOX.ask 0\r\n\r\n"
                     % (b"true" if headers else b"false", subject.encode()))
        while True:
            line = f.readline()
            if not line:
                return None
            if line.startswith(b"PING"):
                sock.sendall(b"PONG\r\n")
            elif line.startswith((b"MSG ", b"HMSG ")):
                body: bytes = f.read(int(line.split()[-1]) + 2)
                return body


def jetstream_answers(port: int) -> bool:
    """Whether the server on port answers a JetStream account-info request without an error
    (before its cluster has a meta leader: "JetStream system temporarily unavailable")."""
    try:
        body = request(port, "$JS.API.INFO")
    except OSError:
        return False
    return body is not None and b'"error"' not in body
