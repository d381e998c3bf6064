"""A loopback HTTP proxy in front of the moto S3 server that sees, delays, fails or drops requests.

moto has no fault injection, and a server that dies must die at a chosen request, not at a
chosen time. The proxy sits between statesnap and moto and:

* logs every request (method, path, query, headers): which parts were uploaded, which byte
  ranges read, in what order the manifest came;
* ``fail(match, times)``: answers the next ``times`` matching requests with an S3 error (``503
  SlowDown`` by default) instead of passing them on;
* ``hold(match, count)``: keeps matching requests waiting until ``count`` of them are in flight
  at once, which proves they were sent in parallel (a client sending one at a time never gets
  there: the barrier breaks after ``timeout`` and ``broken`` says so);
* ``lose_answers(match, times)``: passes the next ``times`` matching requests on but drops the
  connection instead of returning the answer (a read timeout: the store did the work); it comes
  before ``fail``, so a request can lose its answer and its retry fail;
* ``die_at(match)``: the matching request kills the proxy: that request's connection drops
  without an answer, and every later request or connection is refused, as with a server gone.

moto itself keeps running, so a test can look at what was stored through ``direct`` options.
"""
from __future__ import annotations

import http.client
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

_HOP_HEADERS = {"connection", "transfer-encoding", "keep-alive"}


@dataclass
class Request:
    method: str
    path: str
    query: dict
    headers: dict

    @property
    def is_part(self) -> bool:
        return self.method == "PUT" and "partNumber" in self.query

    @property
    def is_write(self) -> bool:
        return self.method in ("PUT", "POST")


class FaultProxy:
    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.requests: list[Request] = []
        self._failures: list[list] = []  # [match, times left, status, code]
        self._holds: list[list] = []  # [match, barrier, requests it still takes]
        self._lost: list[list] = []  # [match, times left]
        self._die_at = None
        self.broken = False  # a hold's barrier timed out: the requests did not come in parallel
        self.dead = False
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.daemon_threads = True
        self.server.proxy = self
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def fail(self, match, times: int, status: int = 503, code: str = "SlowDown") -> None:
        self._failures.append([match, times, status, code])

    def hold(self, match, count: int = 2, timeout: float = 30.0) -> None:
        self._holds.append([match, threading.Barrier(count, timeout=timeout), count])

    def lose_answers(self, match, times: int) -> None:
        self._lost.append([match, times])

    def die_at(self, match) -> None:
        self._die_at = match

    def _decide(self, request: Request):
        """What to do with ``request``: "drop", (status, code), "lose" (pass it on, drop the
        answer), or None to pass it on."""
        with self._lock:
            self.requests.append(request)
            if self.dead:
                return "drop"
            if self._die_at is not None and self._die_at(request):
                self.dead = True
                threading.Thread(target=self._shut, daemon=True).start()
                return "drop"
            for lost in self._lost:
                if lost[1] > 0 and lost[0](request):
                    lost[1] -= 1
                    return "lose"
            for failure in self._failures:
                if failure[1] > 0 and failure[0](request):
                    failure[1] -= 1
                    return failure[2], failure[3]
            holds = [hold for hold in self._holds if hold[2] > 0 and hold[0](request)]
            for hold in holds:
                hold[2] -= 1  # one round per hold: later requests pass
        for _, barrier, _ in holds:
            try:
                barrier.wait()
            except threading.BrokenBarrierError:
                self.broken = True
        return None

    def _shut(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def close(self) -> None:
        if not self.dead:
            self.dead = True
            self._shut()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _any(self) -> None:
        proxy: FaultProxy = self.server.proxy
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        url = urlsplit(self.path)
        request = Request(self.command, url.path, parse_qs(url.query, keep_blank_values=True), dict(self.headers))
        action = proxy._decide(request)
        if action == "drop":
            self.close_connection = True
            return
        if action not in (None, "lose"):
            status, code = action
            payload = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                       f'<Message>injected by the test proxy</Message><RequestId>proxy</RequestId></Error>').encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)
            return
        upstream = getattr(self, "_upstream", None) or http.client.HTTPConnection("127.0.0.1", proxy.upstream_port)
        self._upstream = upstream
        upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
        for name, value in self.headers.items():
            if name.lower() not in _HOP_HEADERS:
                upstream.putheader(name, value)
        upstream.endheaders(body)
        response = upstream.getresponse()
        payload = response.read()
        if action == "lose":
            self.close_connection = True
            return
        self.send_response(response.status)
        for name, value in response.getheaders():
            if name.lower() not in _HOP_HEADERS and name.lower() != "content-length":
                self.send_header(name, value)
        length = response.getheader("Content-Length") if self.command == "HEAD" else None
        self.send_header("Content-Length", length or str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any
