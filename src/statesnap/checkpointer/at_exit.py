"""Work in flight when the program ends without ``close()``.

A Checkpointer's stages run on daemon threads, which die with the interpreter: a script that
returns (or raises) right after ``ckpt.save(...)`` would lose that checkpoint, and say nothing.
So each Checkpointer asks to be finished when the program ends. It must happen before Python
stops its thread pools (``concurrent.futures`` refuses new work from then on, and a save still
hands work to its pools): ``threading._register_atexit``, CPython's hook for exactly that, which
``concurrent.futures`` itself uses, runs there, last registered first. ``atexit`` hooks run after
it, too late; they are the fallback where the hook is missing.
"""
from __future__ import annotations

import atexit
import os
import threading
import weakref
from typing import Callable


def finish_at_exit(owner: object, finish: Callable[[object], None]) -> None:
    """Call ``finish(owner)`` when the program ends, if ``owner`` is still alive then (it is held
    weakly: a closed, dropped owner costs nothing), in this process only: a forked child (a
    DataLoader worker) inherits the hook and a copy of the owner without its threads, and must
    neither wait for work it cannot finish nor release what the parent holds."""
    ref, pid = weakref.ref(owner), os.getpid()

    def call() -> None:
        alive = ref()
        if alive is not None and os.getpid() == pid:
            finish(alive)
    register = getattr(threading, "_register_atexit", atexit.register)
    try:
        register(call)
    except RuntimeError:  # the interpreter is ending already: nothing would run it
        pass
