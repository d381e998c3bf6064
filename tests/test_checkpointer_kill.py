"""SIGKILL during a background flush, then a restart that loads the last committed step."""
import os
import signal
import subprocess
import sys
import textwrap

import torch

import statesnap as ss
from test_checkpointer import assert_state_equals, make_training

CHILD = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, sys.argv[1])
    import statesnap as ss
    from statesnap.storage.local import LocalBackend
    from test_checkpointer import make_training, reference, train_step

    class HangingBackend(LocalBackend):
        '''Writes of step 2 announce themselves, then never finish: the kill lands mid-flush.'''
        def open_write(self, path, durable=False):
            writer = super().open_write(path, durable)
            if "step-2" in path:
                real = writer.pwrite
                def pwrite(offset, views):
                    real(offset, views)
                    print("flushing 2", flush=True)
                    time.sleep(3600)
                writer.pwrite = pwrite
            return writer

    root, ref_path = sys.argv[2], sys.argv[3]
    model, optim = make_training()
    state = {"model": model, "optim": optim}
    ckpt = ss.Checkpointer(root, backend=HangingBackend(), host_memory_gb=0.01)
    train_step(model, optim, 1)
    torch.save(reference(state), ref_path)
    ckpt.save(1, state).wait()
    print("committed 1", flush=True)
    train_step(model, optim, 2)
    ckpt.save(2, state)
    train_step(model, optim, 3)  # training goes on while step 2 flushes
    time.sleep(3600)
""")


def test_restart_after_sigkill_mid_flush_loads_the_last_committed_step(tmp_path):
    root, ref_path = str(tmp_path / "ckpt"), str(tmp_path / "ref.pt")
    tests = os.path.dirname(os.path.abspath(__file__))
    child = subprocess.Popen([sys.executable, "-c", CHILD, tests, root, ref_path],
                             stdout=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in child.stdout:
            lines.append(line.strip())
            if line.startswith("flushing 2"):
                break
        # several writer threads may announce at once, so their lines can run together
        assert lines[0] == "committed 1" and lines[-1].startswith("flushing 2")
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert any(n.startswith(".step-2.tmp-") for n in os.listdir(root))  # the interrupted flush

    model, optim = make_training(seed=3)
    state = {"model": model, "optim": optim}
    ckpt = ss.Checkpointer(root, host_memory_gb=0.01)
    assert ckpt.load_latest(state) == 1 and ckpt.loaded_from == "persistent"
    ckpt.close()
    assert_state_equals(state, torch.load(ref_path))
    assert sorted(os.listdir(root)) == [".statesnap-lock", "events", "step-1"]  # the leftover is cleaned up


ENDS_WITHOUT_CLOSE = textwrap.dedent("""
    import logging, sys, threading, torch
    sys.path.insert(0, sys.argv[1])
    import statesnap as ss
    from statesnap.checkpointer import pipeline
    from test_checkpointer import make_training, reference, train_step

    # The step's writing waits until the program's end has found it in flight (the warning): a
    # flush done before the main thread got there (kept off the CPU on a loaded machine) would
    # leave the end nothing to finish, and the test nothing to see.
    warned = threading.Event()
    def note_the_warning(record):  # (a filter: the warning still goes to stderr)
        if "in flight" in record.getMessage():
            warned.set()
        return True
    logging.getLogger("statesnap").addFilter(note_the_warning)
    real_write = pipeline.Flusher._write
    def held_write(self, *args, **kwargs):
        warned.wait(60)
        return real_write(self, *args, **kwargs)
    pipeline.Flusher._write = held_write

    model, optim = make_training()
    state = {"model": model, "optim": optim}
    ckpt = ss.Checkpointer(sys.argv[2], host_memory_gb=0.01)
    train_step(model, optim, 1)
    torch.save(reference(state), sys.argv[3])
    ckpt.save(1, state)
    if sys.argv[4] == "raises":
        raise RuntimeError("the training loop failed")
""")


def test_a_program_that_ends_without_close_finishes_its_checkpoint(tmp_path):
    """A script that returns, or dies of an exception, right after ``save`` without
    ``close()``: the checkpoint's daemon threads used to die with the interpreter, the step
    never committed and nothing said. The step is finished as the program ends, with a warning."""
    tests = os.path.dirname(__file__)
    for how in ("returns", "raises"):
        root, ref_path = tmp_path / how, tmp_path / f"{how}.pt"
        done = subprocess.run([sys.executable, "-c", ENDS_WITHOUT_CLOSE, tests, str(root), str(ref_path), how],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == (1 if how == "raises" else 0), done.stderr[-3000:]
        assert "in flight and" in done.stderr and "finishing them" in done.stderr
        model, optim = make_training(seed=3)
        state = {"model": model, "optim": optim}
        ss.load(state, root / "step-1")
        assert_state_equals(state, torch.load(ref_path))


def _forked_child() -> None:
    pass


def test_a_forked_child_does_not_finish_the_parent_s_checkpoints(tmp_path):
    """A forked child (a DataLoader worker) inherits the exit hook and a copy of the
    Checkpointer without its threads: it must end at once, not wait ``commit_timeout_s`` for
    work only the parent can finish (nor release what the parent holds)."""
    import multiprocessing

    from test_checkpointer import SlowBackend

    ckpt = ss.Checkpointer(tmp_path, host_memory_gb=0.1, commit_timeout_s=120, backend=SlowBackend(max_sleep=0.5))
    ckpt.save(1, {"w": torch.randn(512, 1024), "x": torch.randn(512, 1024)})
    child = multiprocessing.get_context("fork").Process(target=_forked_child)
    child.start()
    child.join(timeout=60)
    finished = child.exitcode
    if finished is None:
        child.kill()
    ckpt.close()
    assert finished == 0
    assert os.path.isdir(tmp_path / "step-1")


LEASED_ROOT_ENDS = textwrap.dedent("""
    import sys, torch
    import statesnap as ss
    ckpt = ss.Checkpointer(sys.argv[1], host_memory_gb=0.01)
    ckpt.save(1, {"w": torch.arange(1000.)})
""")


def test_a_program_that_ends_without_close_releases_its_object_store_lease(tmp_path):
    """The lease of a root on an object store (here fsspec's ``local://``, leased the same way)
    is released at exit, or a restart is refused until it expires (``lease_s``)."""
    (tmp_path / "root").mkdir()  # (fsspec's local file system makes no folders for a write, as buckets need none)
    root = f"local://{tmp_path}/root"
    done = subprocess.run([sys.executable, "-c", LEASED_ROOT_ENDS, root], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    with ss.Checkpointer(root, host_memory_gb=0.01) as restarted:
        state = {"w": torch.zeros(1000)}
        assert restarted.load_latest(state) == 1 and torch.equal(state["w"], torch.arange(1000.))


MANY_OWNERS = textwrap.dedent("""
    import gc, os, sys, threading
    sys.path.insert(0, sys.argv[1])
    import statesnap as ss
    from statesnap.checkpointer import at_exit

    hooks = len(getattr(threading, "_threading_atexits", []))
    for i in range(20):  # made and closed, one after another, as a sweep or a test run does
        with ss.Checkpointer(os.path.join(sys.argv[2], f"run{i}"), host_memory_gb=0.01):
            pass
    gc.collect()  # (a closed Checkpointer may be held in a cycle until a collection)
    print("hooks added", len(getattr(threading, "_threading_atexits", [])) - hooks, "owners left", len(at_exit._owners))

    class Owner:
        def __init__(self, name):
            self.name = name
            at_exit.finish_at_exit(self, Owner.finish)
        def finish(self):
            print("finished", self.name, flush=True)
            if self.name == "second":
                raise RuntimeError("the second one fails")
    owners = [Owner("first"), Owner("second"), Owner("third")]
""")


def test_closed_checkpointers_leave_nothing_behind_and_one_failing_finish_stops_no_other(tmp_path):
    """Every Checkpointer asks to be finished at the program's end. It used to register a hook of
    its own, kept for the life of the program after it was closed and dropped; and an exception
    in one hook stopped the hooks after it. Now one hook finishes the owners still alive, the
    last made first, and logs a failure and goes on."""
    done = subprocess.run([sys.executable, "-c", MANY_OWNERS, os.path.dirname(__file__), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "hooks added 1 owners left 0"
    assert lines[1:] == ["finished third", "finished second", "finished first"]
    assert "the second one fails" in done.stderr
