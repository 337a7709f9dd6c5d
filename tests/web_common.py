# SPDX-License-Identifier: Apache-2.0
"""What test_web_api.py, test_web_browser.py and bench/web_bench.py share: a tallyd on free
loopback ports with its HTTP port on, the `tally` CLI against it, HTTP requests, and a reader of
Server-Sent Events."""

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.parse


def fail(msg):
    print("FAIL: " + msg, file=sys.stderr)
    sys.exit(1)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quote(name):
    """A stream name as one path segment: every reserved character escaped (%2F for '/')."""
    return urllib.parse.quote(name, safe="")


def schema_checker(src):
    """check(doc, definition=None, what=""): fails unless doc is valid against
    web/schema/stream.json (definition None) or the definition of web/schema/api.json named
    (python3-jsonschema, imported here: not every user of this file needs it)."""
    import jsonschema
    with open(os.path.join(src, "web", "schema", "stream.json")) as f:
        stream_schema = json.load(f)
    with open(os.path.join(src, "web", "schema", "api.json")) as f:
        api_schema = json.load(f)

    def check(doc, definition=None, what=""):
        schema = stream_schema if definition is None else dict(
            api_schema, **{"$ref": "#/definitions/" + definition})
        try:
            jsonschema.validate(doc, schema, cls=jsonschema.Draft7Validator)
        except jsonschema.ValidationError as e:
            fail("%s does not match %s: %s" % (what, definition or "stream.json", e.message))
    return check


def write_secret(path, text, mode=0o600):
    with open(path, "w") as f:
        f.write(text + "\n")
    os.chmod(path, mode)


class Daemon:
    """tallyd on free loopback ports (ZeroMQ and HTTP), its log in tmp."""

    def __init__(self, tallyd, tally, tmp, extra=(), name="tallyd"):
        self.tally_bin = tally
        self.endpoint = "tcp://127.0.0.1:%d" % free_port()
        self.log_path = os.path.join(tmp, name + ".log")
        args = [tallyd, "--bind", self.endpoint, "--metrics", "127.0.0.1:0", "--shm", "off",
                "--state-dir", ""] + list(extra)
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        self.port = self.wait_port()

    def log_text(self):
        with open(self.log_path) as f:
            return f.read()

    def wait_port(self):
        mark = re.compile(r"metrics: serving http://127\.0\.0\.1:(\d+)/metrics")
        for _ in range(600):
            if self.proc.poll() is not None:
                break
            m = mark.search(self.log_text())
            if m and self.tally("ping", check=False).returncode == 0:
                return int(m.group(1))
            time.sleep(0.05)
        fail("tallyd did not start:\n" + self.log_text())

    def tally(self, *args, data=None, check=True):
        r = subprocess.run([self.tally_bin, "-e", self.endpoint] + list(args), input=data,
                           capture_output=True, timeout=60)
        if check and r.returncode != 0:
            fail("tally %s: exit %d: %s" % (" ".join(args), r.returncode, r.stderr.decode()))
        return r

    def hist(self, name, payload, *args):
        self.tally("hist", *args, "--stream", name, "--out", os.devnull, data=payload)

    def query(self, name, *args):
        return json.loads(self.tally("query", "--json", *args, name).stdout)

    def request(self, method, path, headers=None, timeout=30):
        """(status, headers, body bytes) of one request on a fresh connection."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, headers=headers or {})
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            conn.close()

    def get_json(self, path, want=200, headers=None):
        status, hdrs, body = self.request("GET", path, headers)
        if status != want:
            fail("GET %s: %d, expected %d: %s" % (path, status, want, body[:300]))
        if not hdrs.get("content-type", "").startswith("application/json"):
            fail("GET %s: content type %r" % (path, hdrs.get("content-type")))
        return json.loads(body)

    def stop(self, sig_term=True, want_rc=0):
        if self.proc.poll() is None:
            if sig_term:
                self.proc.terminate()
            rc = self.proc.wait(timeout=60)
        else:
            rc = self.proc.returncode
        self.log.close()
        if want_rc is not None and rc != want_rc:
            fail("tallyd exited %d:\n%s" % (rc, self.log_text()))


class Events:
    """An open event stream (GET ...events): status, headers, then events one at a time."""

    def __init__(self, port, path, timeout=60):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        self.conn.request("GET", path, headers={"Accept": "text/event-stream"})
        self.resp = self.conn.getresponse()
        self.status = self.resp.status
        self.headers = {k.lower(): v for k, v in self.resp.getheaders()}

    def next(self):
        """The next event as (name, data), or (None, None) at the end of the stream; a comment
        (a keepalive) as (":", text); retry lines are skipped."""
        name, data = None, []
        while True:
            line = self.resp.fp.readline()
            if not line:
                return None, None
            line = line.decode().rstrip("\r\n")
            if not line:
                if data:
                    return name or "message", "\n".join(data)
                continue
            if line.startswith(":"):
                return ":", line[1:].strip()
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "event":
                name = value
            elif field == "data":
                data.append(value)

    def until(self, pred, what, limit_s=60):
        """Reads events until pred(name, data) is true; returns that event."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            name, data = self.next()
            if name is None:
                fail("the event stream ended while waiting for " + what)
            if pred(name, data):
                return name, data
        fail("no event within %d s: %s" % (limit_s, what))

    def close(self):
        self.conn.close()
