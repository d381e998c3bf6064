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
import logging
import os
import threading
import weakref
from typing import Callable

log = logging.getLogger("statesnap")

# id(owner) -> (the owner, weakly; its finish; the process that registered it), in the order made.
# One hook walks it: a hook of each owner's own stayed registered after the owner was
# closed and dropped, a closure apiece for the life of the program (a process that makes a
# Checkpointer per evaluation, or per test, kept them all).
_owners: dict[int, tuple[weakref.ref, Callable[[object], None], int]] = {}
_hooked = False  # (a forked child inherits the hook with the rest of its parent's memory)


def finish_at_exit(owner: object, finish: Callable[[object], None]) -> None:
    """Call ``finish(owner)`` when the program ends, if ``owner`` is still alive then (it is held
    weakly: a closed, dropped owner costs nothing), in this process only: a forked child (a
    DataLoader worker) inherits the hook and a copy of the owner without its threads, and must
    neither wait for work it cannot finish nor release what the parent holds."""
    global _hooked
    key = id(owner)
    # (the entry goes when the owner dies, before its id can be another's)
    _owners[key] = (weakref.ref(owner, lambda _, key=key: _owners.pop(key, None)), finish, os.getpid())
    if not _hooked:
        register = getattr(threading, "_register_atexit", atexit.register)
        try:
            register(_finish_all)
        except RuntimeError:  # the interpreter is ending already: nothing would run it
            return
        _hooked = True


def _finish_all() -> None:
    """Finish this process's live owners, the last made first (a Lightning plugin's Checkpointer,
    made after it, before the plugin). One owner's failure is logged and the others still run."""
    for ref, finish, pid in reversed(list(_owners.values())):
        alive = ref()
        if alive is not None and pid == os.getpid():
            try:
                finish(alive)
            except Exception:
                log.exception("statesnap: finishing %r as the program ended failed", alive)
