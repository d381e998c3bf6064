"""A rank that dies or hangs during a blocking save or load: the survivors raise a
``CheckpointError`` that names the operation and the rank, within the timeout, exit normally,
and nothing partial is visible.

Each rank is a separate Python process started from this file (``__main__`` below), so the test
sees real exit codes and stderr, and a rank can kill or stop itself at an exact point."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch


HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 4.0


def _state(rank):
    torch.manual_seed(0)
    return {"w": torch.randn(256, 64), "b": torch.arange(8.0) + rank * 0}


def _die(how):
    os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)


def _rank_main(rank, world, port, scenario, path):
    import torch.distributed as dist

    import importlib

    import statesnap as ss

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)  # the parent holds the port
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    victim = world - 1
    op, how = scenario.split("-")
    if op == "load":
        ss.save(_state(rank), path)  # a good checkpoint first
    if rank == victim and how == "gone":
        os._exit(0)  # lost before the operation: the others set up its collectives without it
    if rank == victim and how == "claim":  # lost after the Checkpointer's own group, before its claim broadcast
        import statesnap.engine.dist as sdist
        sdist.side_group = lambda *args, **kwargs: os._exit(0)
    elif rank == victim:
        module = importlib.import_module(f"statesnap.engine.{op}")  # the package re-exports save/load
        target = (module, "write_rank" if op == "save" else "fill_tensors")
        real = getattr(*target)

        def dying(*args, **kwargs):
            _die(how)
            return real(*args, **kwargs)
        setattr(*target, dying)
    started = time.monotonic()
    try:
        if op == "save":
            ss.save(_state(rank), path, timeout_s=TIMEOUT_S)
        elif op == "ckpt":
            ss.Checkpointer(path, commit_timeout_s=TIMEOUT_S, host_memory_gb=0.05).close()
        else:
            ss.load(_state(rank), path, timeout_s=TIMEOUT_S)
    except ss.CheckpointError as exc:
        from statesnap.storage.lock import _held_here
        print(f"RAISED {type(exc).__name__} after {time.monotonic() - started:.1f}s: {exc}", flush=True)
        print(f"CLAIMS HELD {len(_held_here)}", flush=True)
        return
    print("NO ERROR", flush=True)


def _run(world, scenario, path):
    import torch.distributed as dist

    # the rendezvous store binds a port the kernel picks and keeps it: no other process can take it
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    port = store.port
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), str(r), str(world), str(port), scenario,
                               path], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE)
             for r in range(world)]
    victim = procs[-1]
    outs = []
    try:
        for p in procs[:-1]:
            out, err = p.communicate(timeout=120)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        victim.wait()
    return outs


@pytest.mark.parametrize("scenario", ["save-gone", "load-gone", "ckpt-claim", "ckpt-gone"])
def test_a_rank_gone_before_a_group_is_made_is_a_checkpoint_error(tmp_path, scenario):
    """Making a timed gloo group with a rank already gone: torch raises a raw DistStoreError
    after the timeout; statesnap raises a PeerLostError that says which operation it was setting
    up: ss.save, ss.load, a Checkpointer's construction (its own group, then the claim broadcast,
    after which rank 0 holds no claim)."""
    path = str(tmp_path / "ckpt")
    (code, out, err), = _run(2, scenario, path)
    assert code == 0, f"exited with {code}:\n{out}\n{err}"
    assert out.startswith("RAISED PeerLostError"), f"{out}\n{err}"
    assert "setting up its collectives: another rank did not join within 4 s" in out and path in out, out
    seconds = float(out.split(" after ")[1].split("s:")[0])
    assert seconds < TIMEOUT_S * 3 + 10, out
    assert "CLAIMS HELD 0" in out, out


@pytest.mark.parametrize("scenario", ["save-kill", "save-stop", "load-kill", "load-stop"])
def test_survivors_raise_a_checkpoint_error_naming_the_rank(tmp_path, scenario):
    path = str(tmp_path / "ckpt")
    world = 3 if scenario == "save-kill" else 2
    for rank, (code, out, err) in enumerate(_run(world, scenario, path)):
        assert code == 0, f"rank {rank} exited with {code}:\n{out}\n{err}"
        assert "terminate called" not in err, err
        assert out.startswith("RAISED"), f"rank {rank}: {out}\n{err}"
        assert "PeerLostError" in out or "RemoteFailure" in out, out
        assert path in out, out
        if scenario.endswith("kill"):
            assert f"rank {world - 1} (pid" in out, out  # the vanished rank, by number and pid
        else:
            assert "did not answer" in out or "timed out" in out.lower(), out
            seconds = float(out.split(" after ")[1].split("s:")[0])
            assert seconds < TIMEOUT_S * 3 + 10, out
    if scenario.startswith("save"):
        assert not os.path.exists(path)  # nothing committed
        assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # staging cleaned up
    else:
        import statesnap as ss
        ss.open(path).verify()  # the good checkpoint is untouched


if __name__ == "__main__":
    import torch.distributed as dist

    try:
        _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
    finally:  # as a training script ends: the default group is the script's, not statesnap's
        if dist.is_initialized():
            dist.destroy_process_group()
