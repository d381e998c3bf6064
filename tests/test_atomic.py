"""Atomic commit: a saver killed with SIGKILL at random moments never leaves a partial checkpoint visible.

A child process saves a ~96 MB state over and over; the test kills it after a random (seeded) delay,
then checks that every visible checkpoint directory opens, verifies and holds one consistent state,
and that whatever the kill left behind is hidden (``.<name>.tmp-*``).
"""
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import torch

import statesnap as ss

TENSORS, ELEMENTS = 12, 2 << 20  # 12 x 8 MB of float32
ROUNDS = 4
EXTRA_ROUNDS = 8

CHILD = textwrap.dedent("""
    import os, sys
    import torch
    import statesnap as ss

    root, mode, first = sys.argv[1], sys.argv[2], int(sys.argv[3])
    tensors, elements = int(sys.argv[4]), int(sys.argv[5])
    step = first

    def say(word):
        # One write(2) per line, atomic on a pipe. With PYTHONUNBUFFERED, print() writes "begin",
        # " ", step and "\\n" one by one, and a kill between two of them left half a line.
        os.write(1, f"{word} {step}\\n".encode())

    while True:
        state = {"model": {f"t{i}": torch.full((elements,), float(step)) for i in range(tensors)},
                 "extra": {"step": step}}
        name = f"step-{step}" if mode == "dirs" else "latest"
        say("begin")
        ss.save(state, os.path.join(root, name), overwrite=(mode == "overwrite"))
        say("done")
        step += 1
""")


def run_and_kill(root, mode: str, first: int, delay: float, inside: float | None = None) -> tuple[str, int]:
    """Start the saving child at step ``first`` and kill it ``delay`` seconds after its first save
    began. Return ("begin", N) if the kill landed inside save N, or ("done", N) if save N was the
    last to finish.

    With ``inside`` (a fraction of a save), after ``delay`` wait for the next save to begin and
    kill it at that fraction of the shortest save seen so far: the kill lands inside a save
    unless this process is kept off the CPU for the rest of it. A plain delay lands between two
    saves (building the next state) about half the time."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(root), mode, str(first), str(TENSORS), str(ELEMENTS)],
                            stdout=subprocess.PIPE, text=True)
    lines, times, seen = [], {}, threading.Condition()

    def read():
        for line in proc.stdout:
            if not line.endswith("\n"):  # cut short by the kill (cannot happen with one write per line)
                break
            with seen:
                lines.append(line.split())
                times[tuple(lines[-1])] = time.monotonic()
                seen.notify_all()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        with seen:
            assert seen.wait_for(lambda: lines, timeout=120), "the saving child did not start"
        threading.Event().wait(delay)
        if inside is not None:
            with seen:
                before = len(lines)
                assert seen.wait_for(lambda: any(w == "begin" for w, _ in lines[before:]), timeout=120), \
                    f"the saving child made no progress after {lines[-3:]}"
                saves = [times["done", n] - times["begin", n] for (word, n) in lines
                         if word == "done" and ("begin", n) in times]
            threading.Event().wait(inside * min(saves, default=0.02))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        proc.kill()
        proc.wait()
    reader.join()
    assert proc.returncode == -signal.SIGKILL, f"the child stopped by itself after {lines[-3:]}"
    word, step = lines[-1]  # every line printed before the kill has been read by now
    return word, int(step)


def kill_moments(rng: random.Random, landed_inside):
    """``ROUNDS`` kills at random moments, then, while none has landed inside a save (about one
    run in 16 on a machine where saving and building the next state take as long), up to
    ``EXTRA_ROUNDS`` kills aimed inside one: (delay, inside) for ``run_and_kill``."""
    for round_ in range(ROUNDS + EXTRA_ROUNDS):
        if round_ >= ROUNDS and landed_inside():
            return
        yield (rng.uniform(0.05, 1.5), None) if round_ < ROUNDS else (rng.uniform(0.05, 0.5), rng.uniform(0, 0.75))


def check_whole(path) -> int:
    """Open, verify and read every tensor of the checkpoint at ``path``; return its step."""
    reader = ss.open(path)
    reader.verify()
    step = reader.read("extra.step")
    assert sorted(reader.keys()) == sorted([f"model.t{i}" for i in range(TENSORS)] + ["extra.step"])
    for i in range(TENSORS):
        assert torch.equal(reader.read(f"model.t{i}"), torch.full((ELEMENTS,), float(step)))
    return step


def visible(root) -> list[str]:
    return sorted(name for name in os.listdir(root) if not name.startswith("."))


def hidden_are_staging(root) -> None:
    for name in os.listdir(root):
        if name.startswith("."):
            assert ".tmp-" in name, f"unexpected hidden entry {name}"


def test_kill_during_saves_never_leaves_a_partial_checkpoint(tmp_path):
    rng = random.Random(20261122)
    first, kept, kills_inside_a_save = 0, set(), 0
    for delay, inside in kill_moments(rng, lambda: kills_inside_a_save):
        word, step = run_and_kill(tmp_path, "dirs", first, delay, inside)
        found = {check_whole(tmp_path / name) for name in visible(tmp_path)}
        assert sorted(f"step-{s}" for s in found) == visible(tmp_path)
        assert kept <= found  # the checkpoint kept from the last round is still there and whole
        new = found - kept
        if word == "begin":  # save ``step`` was in flight: it is either whole or absent
            kills_inside_a_save += 1
            assert new in (set(range(first, step)), set(range(first, step + 1)))
        else:
            assert new == set(range(first, step + 1))
        hidden_are_staging(tmp_path)
        first = max(found, default=first - 1) + 1
        kept = {max(found)} if found else set()
        for name in os.listdir(tmp_path):  # keep only the newest checkpoint, to bound the disk used
            if name not in {f"step-{s}" for s in kept}:
                shutil.rmtree(tmp_path / name)
    assert kills_inside_a_save, "no kill landed inside a save; the test checked nothing"


def test_kill_during_overwrite_leaves_old_or_new(tmp_path):
    rng = random.Random(7)
    state = {"model": {f"t{i}": torch.full((ELEMENTS,), -1.0) for i in range(TENSORS)}, "extra": {"step": -1}}
    ss.save(state, tmp_path / "latest")
    previous, kills_inside_a_save = -1, 0
    for round_, (delay, inside) in enumerate(kill_moments(rng, lambda: kills_inside_a_save)):
        first = round_ * 1000
        word, step = run_and_kill(tmp_path, "overwrite", first, delay, inside)
        assert visible(tmp_path) == ["latest"]
        found = check_whole(tmp_path / "latest")
        if word == "begin":  # overwriting with ``step``: the old one or the new one, whole
            kills_inside_a_save += 1
            assert found in (step - 1 if step > first else previous, step)
        else:
            assert found == step
        hidden_are_staging(tmp_path)
        for name in os.listdir(tmp_path):  # what the kills left behind, to bound the disk used
            if name.startswith("."):
                shutil.rmtree(tmp_path / name)
        previous = found
    assert kills_inside_a_save, "no kill landed inside a save; the test checked nothing"
