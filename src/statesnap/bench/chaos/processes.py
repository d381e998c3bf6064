"""Processes for the chaos suite, forked from one server that has imported torch once.

Every trial of the suite runs in a process of its own: a trainer to be killed with SIGKILL, a
gloo rank that kills itself, a damaged checkpoint whose load may hang. Starting each with
``python -m`` would cost seconds of imports per process (4-6 s on the 2-core development
machine), and the suite starts hundreds. So ``python -m statesnap.bench.chaos.server``
imports torch and statesnap once, runs no torch operation (forking after one would copy the
state of thread pools that did), and forks each process from there. A forked process is a real
process: it has its own pid, descriptors and locks, dies of SIGKILL as any other, and when its
function returns it can exit through the normal interpreter shutdown, so exit codes and what
shutdown prints (``terminate called ...``) are those of a process started from scratch (the
gloo ranks do; trials that judge only their result skip the second it takes).

The bench talks to the server in JSON lines on its stdin and stdout (:class:`ForkServer`).
A child's stdout and stderr go to a log file; its function's return value (a JSON object) goes
to a result file. When the bench goes away the server's stdin ends, and it kills its children;
children also get SIGKILL if the server dies (``PR_SET_PDEATHSIG``).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass

SERVER = "statesnap.bench.chaos.server"


@dataclass
class Child:
    """A process the server forked: its pid and where its output and result go."""

    pid: int
    log: str
    result: str

    def log_text(self, tail: int = 4000) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return f.read()[-tail:]
        except OSError:
            return ""

    def read_result(self) -> dict | None:
        try:
            with open(self.result) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None


class ForkServer:
    """The bench's handle on the server: ``start`` forks a child running ``module:function(spec)``,
    ``wait`` reaps it (or times out), ``kill`` signals it. ``run`` does all three for one trial."""

    def __init__(self, workdir: str):
        self.workdir = workdir
        self._count = 0
        self._proc = subprocess.Popen([sys.executable, "-m", SERVER], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, bufsize=1)
        if self._reply() != {"ready": True}:
            raise RuntimeError("the chaos fork server did not start")

    def _reply(self) -> dict:
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the chaos fork server exited ({self._proc.wait()})")
        return json.loads(line)

    def _ask(self, **request) -> dict:
        self._proc.stdin.write(json.dumps(request) + "\n")
        return self._reply()

    def start(self, target: str, spec: dict, name: str = "child", shutdown: bool = False) -> Child:
        """Fork a child running ``target(spec)``. ``shutdown``: when the function returns, the
        child exits through the interpreter's whole shutdown, as a process started from scratch
        does (it takes about a second with torch loaded); else it ends at once (``os._exit``)."""
        self._count += 1
        base = os.path.join(self.workdir, f"{self._count:05d}-{name}")
        child = Child(0, base + ".log", base + ".json")
        child.pid = self._ask(op="fork", target=target, spec=spec, log=child.log, result=child.result,
                              shutdown=shutdown)["pid"]
        return child

    def wait(self, child: Child, timeout: float) -> int | None:
        """The child's exit status (negative: the signal that ended it), or None if it still runs."""
        return self._ask(op="wait", pid=child.pid, timeout=timeout)["status"]

    def kill(self, child: Child, sig: int = signal.SIGKILL) -> None:
        self._ask(op="kill", pid=child.pid, signal=int(sig))

    def reap(self, child: Child) -> int:
        """SIGKILL the child (if it still runs) and return its exit status."""
        self.kill(child)
        return self.wait(child, 60)

    def run(self, target: str, spec: dict, timeout: float,
            name: str = "trial") -> tuple[dict | None, int | None, Child]:
        """Run one trial to its end: (its result, exit status, the child); status None: it ran
        past ``timeout`` and was killed (a hang)."""
        child = self.start(target, spec, name)
        status = self.wait(child, timeout)
        if status is None:
            self.reap(child)
        return child.read_result(), status, child

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.wait()
