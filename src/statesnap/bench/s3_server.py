"""A real S3 API server on loopback for the S3 bench and tests: moto's server in a child process.

A child process, not a thread of the caller: the server's work (parsing requests, hashing parts,
keeping objects) then runs beside the client's as it would on a real store, instead of taking
turns with it for one interpreter lock, and the caller can kill it outright. It binds port 0 and
reports the port the kernel gave it, so no other process can take that port in between.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

# The child binds, prints its port, and serves until its stdin closes (so it ends with its parent).
_LAUNCH = ("import logging, sys\nfrom moto.server import ThreadedMotoServer\n"
           "logging.getLogger('werkzeug').setLevel(logging.ERROR)\n"
           "server = ThreadedMotoServer('127.0.0.1', 0, verbose=False)\nserver.start()\n"
           "print(server.get_host_and_port()[1], flush=True)\nsys.stdin.read()\n")
# Credentials and region for moto (it accepts any); passed explicitly so no real AWS setting is read.
CREDENTIALS = {"key": "testing", "secret": "testing"}
REGION = "us-east-1"


class MotoServer:
    """``with MotoServer() as server:`` a fresh server; ``server.storage_options()`` for s3fs."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def __enter__(self) -> "MotoServer":
        try:
            import moto.server  # noqa: F401  (a clear error here rather than in the child)
        except ImportError as exc:
            raise RuntimeError("the S3 server needs moto: pip install 'moto[server,s3]'") from exc
        self.proc = subprocess.Popen([sys.executable, "-c", _LAUNCH], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            self.stop()
            raise RuntimeError(f"moto's server did not start (it said {line!r})")
        self.port = int(line)
        return self

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def storage_options(self, **extra) -> dict:
        return {**CREDENTIALS, "endpoint_url": self.endpoint,
                "client_kwargs": {"region_name": REGION}, **extra}

    def create_bucket(self, name: str) -> None:
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=CREDENTIALS["key"],
                     aws_secret_access_key=CREDENTIALS["secret"]).create_bucket(Bucket=name)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout):
                pipe.close()
            self.proc = None

    def __exit__(self, *exc) -> None:
        self.stop()


class ShapedLink:
    """A TCP proxy on loopback whose every connection carries at most ``mb_per_s`` MB/s each way.

    A real object store gives each connection a fraction of its bandwidth (tens of MB/s on S3) and
    serves many at once; moto on loopback gives one connection all of its (small) throughput. So a
    client that keeps several requests in flight gains nothing against moto alone. Behind this
    link, a connection is slower than the server, as against a real store, scaled down to what
    moto can serve: then requests in flight together add up, up to moto's own limit. Pacing is a
    leaky bucket per connection and direction: no credit builds up while a connection is idle."""

    def __init__(self, upstream_port: int, mb_per_s: float, chunk: int = 64 << 10):
        self.upstream_port, self.rate, self.chunk = upstream_port, mb_per_s * 1e6, chunk
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        free_at = time.monotonic()
        try:
            while data := src.recv(self.chunk):
                free_at = max(free_at, time.monotonic()) + len(data) / self.rate
                dst.sendall(data)
                time.sleep(max(0.0, free_at - time.monotonic()))
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self.server.close()
