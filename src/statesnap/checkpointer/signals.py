"""Signal handlers held back while ``save()`` plans and queues a snapshot.

Python runs a signal handler on the main thread between two bytecodes, wherever that thread is,
so also inside ``save()``. A preemption handler that saves and closes (on SIGTERM, or Lightning's
SIGUSR1 before a requeue) then ran in the middle of the save it had interrupted: a snapshot
counted in flight but not yet queued made ``close()`` wait for ever, and caches of the planning
were left half updated under the handler's own save. While ``save()`` plans and queues, the
Python handlers of the signals a job is told to stop or checkpoint by are swapped for one that
notes the signal; once the snapshot is queued (microseconds to milliseconds later), each noted
signal goes to its handler. The waits of ``save()`` (back-pressure, the copies it waits for) are
not covered: a handler runs there as anywhere, and Ctrl-C stops them at once.
"""
from __future__ import annotations

import contextlib
import signal
import threading

# The signals schedulers and users stop or checkpoint jobs by (SLURM: SIGTERM, SIGUSR1/2 ahead of
# the end, SIGCONT; torchrun forwards SIGTERM, SIGINT, SIGHUP, SIGQUIT). Looking each one up
# costs about 0.3 us; all 60 would cost 20 us per save.
_HELD = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT",
                                                 "SIGALRM", "SIGCONT", "SIGXCPU") if hasattr(signal, name))


@contextlib.contextmanager
def handlers_held():
    """Within the block, the Python handlers of ``_HELD`` signals are noted, not run; they run
    after it, in the order the signals came. Only on the main thread (only it runs handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {signum: handler for signum in _HELD if callable(handler := signal.getsignal(signum))}
    noted: list[int] = []
    for signum in held:
        signal.signal(signum, lambda signum, _frame: noted.append(signum))
    try:
        yield
    finally:
        for signum, handler in held.items():
            signal.signal(signum, handler)
        for signum in noted:
            held[signum](signum, None)
