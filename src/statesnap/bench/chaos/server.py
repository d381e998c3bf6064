"""The fork server of the chaos suite (``python -m statesnap.bench.chaos.server``); see
:mod:`.processes`. Importing the package has imported torch, statesnap and every scenario module,
so a forked child starts with all of them."""
from __future__ import annotations

import ctypes
import importlib
import json
import os
import signal
import sys
import time
import traceback

_PR_SET_PDEATHSIG = 1


def _child(request: dict) -> int:
    """In the forked child: run the function, write its result; the exit code says if it raised."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    try:
        module, function = request["target"].split(":")
        result = getattr(importlib.import_module(module), function)(request["spec"])
        with open(request["result"] + ".tmp", "w") as f:
            json.dump(result, f, default=str)
        os.replace(request["result"] + ".tmp", request["result"])
        return 0
    except BaseException:  # noqa: BLE001 (the log carries it to the bench)
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _status(code: int) -> int:
    return -os.WTERMSIG(code) if os.WIFSIGNALED(code) else os.WEXITSTATUS(code)


def _wait(pid: int, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while True:
        done, code = os.waitpid(pid, os.WNOHANG)
        if done:
            return _status(code)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.005)


def serve() -> int:
    """The server loop; returns in the parent when the bench hangs up, in a child when it is done."""
    children: set[int] = set()

    def reply(**answer) -> None:
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()  # before any fork: a child must not inherit unwritten replies

    reply(ready=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "fork":
            pid = os.fork()
            if pid == 0:
                code = _child(request)
                if not request["shutdown"]:
                    os._exit(code)
                return code
            children.add(pid)
            reply(pid=pid)
        elif request["op"] == "wait":
            status = _wait(request["pid"], request["timeout"])
            if status is not None:
                children.discard(request["pid"])
            reply(status=status)
        elif request["op"] == "kill":
            try:
                os.kill(request["pid"], request["signal"])
            except ProcessLookupError:
                pass
            reply(done=True)
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(serve())
