"""Random damage to a committed checkpoint, and hostile manifests: every one caught, none loaded
silently, none crashing or hanging the reader.

The checkpoint is as varied as the format allows, so that damage can reach every kind of field:
64 simulated ranks write 64 data files (the engine's own planner and writer, run for each rank
in one process), one tensor in 64 pieces (its manifest columns are packed), one in flat ranges,
replicated tensors of several dtypes (an empty one too), 4 KiB checksum blocks (so pieces have
lists of checksums), plain values, a pickled value and a per-rank value.

Each trial (its own process, killed past :data:`TRIAL_TIMEOUT_S`: a hang) copies the checkpoint,
applies one damage and runs ``ss.open(path).verify()`` and ``ss.load`` into a full state.

**Damage** (bit flips in the bytes of pieces and pickled values, bit flips anywhere in the
manifest, truncation or deletion of a data file or the manifest) must be detected: both raise a
``CheckpointError``. The manifest's checksum of itself covers what no block checksum does.

**Hostile manifests** are what a writer could have meant, checksum and all (re-sealed, as
``docs/format.md`` section 5 says a tool that edits one must): any field at any depth replaced
by an int, a huge or negative int, a float, a string, null, a list, nested garbage, a nesting
bomb, or removed; and data file names that leave the directory (``../``, absolute paths, names
with ``/``), pointing at an intact copy of the file. Only the format's rules (section 8) can
stop them. A name leaving the directory must be refused. Any other edit must be refused or
load as the manifest states it: a plain value, ``meta`` and informative fields may be any JSON.

Outcomes: ``detected``/``refused`` (both raise a ``CheckpointError``), ``harmless`` (neither
raises and everything loads bit for bit as saved: the change touched nothing a reader uses),
``verify only`` (verify raises, the load is right), and for hostile edits ``refused by the load
only`` (verify, which checks bytes against checksums, passes a valid manifest of another
checkpoint, one with a tensor fewer or a plain value it cannot decode, and the load refuses it)
and ``accepted: loads the plain values it states`` are expected. ``verify missed`` (damage that
verify passes and the load trips over), ``silent`` (other values load without an error),
``accepted`` (a path out of the directory was not refused) and ``crash`` (an exception that is
not a ``CheckpointError``) are wrong.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import tempfile

import torch
import xxhash

import statesnap as ss

from ...engine.buffers import host_contiguous
from ...engine.save import (
    commit_or_abort, committed_bytes, encode_objects, open_staging, own_objects, per_rank_names, shared_names,
    write_rank,
)
from ...format.dtypes import dtype_name
from ...format.manifest import MANIFEST_NAME, SELF_CHECKSUM
from ...plan.save_plan import plan_save
from ...state.flatten import flatten_for_save
from ...storage.local import LocalBackend
from .processes import ForkServer
from .report import EXPECTED, WRONG, Tally

BUILD, TRIAL = f"{__name__}:build", f"{__name__}:trial"
WORLD, BLOCK = 64, 4096
TRIAL_TIMEOUT_S = 30
EXTRA = {"step": 7, "name": "run", "lr": 0.1, "tags": ["a", {"b": None, "c": [1.5, True]}], "blob": {1, 2, 3}}


def _values() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"big": torch.randn(4 * WORLD, 24, generator=g),
            "flat": torch.randn(10, 7, generator=g, dtype=torch.float64),
            "w": torch.randn(48, 40, generator=g), "h": torch.randn(33, generator=g).bfloat16(),
            "i": torch.randint(-1000, 1000, (5, 7), generator=g), "m": torch.rand(19, generator=g) > 0.5,
            "e": torch.empty(0, 3)}


def _rank_state(rank: int, values: dict) -> dict:
    """What rank ``rank`` of the simulated job holds: its rows of ``big``, the flat ranges of
    ``flat`` (ranks 0-2 only), every replicated tensor, the plain values, its per-rank value."""
    model = {name: values[name] for name in ("w", "h", "i", "m", "e")}
    model["big"] = ss.Sharded(values["big"][4 * rank:4 * rank + 4], values["big"].shape, (4 * rank, 0))
    bounds = (0, 30, 55, 70)
    if rank < 3:
        flat = values["flat"].view(-1)[bounds[rank]:bounds[rank + 1]]
        model["flat"] = ss.Sharded(flat, values["flat"].shape, flat_offset=bounds[rank])
    return {"model": model, "extra": dict(EXTRA), "rank": ss.PerRank(rank * 11)}


def _save_as_ranks(states: list[dict], path: str) -> None:
    """``ss.save`` of one job whose rank ``r`` holds ``states[r]``, all in this process: the
    engine's steps in the order ``engine.save.save`` runs them, its collectives replaced by lists."""
    flats = [flatten_for_save(state) for state in states]
    encoded = [encode_objects(flat, True) for flat in flats]
    plan = plan_save([[item.meta(dtype_name(item.dtype)) for item in flat.tensors] for flat in flats],
                     [shared_names(flat) for flat in flats])
    backend = LocalBackend()
    staging, token, problem = open_staging(backend, path, False)
    if problem:
        raise RuntimeError(problem)
    outputs = []
    for rank, (flat, (entries, blobs)) in enumerate(zip(flats, encoded)):
        names = per_rank_names(flat)
        entries, blobs = own_objects(entries, blobs, names, rank, plan.object_writers)
        tensors = {i: host_contiguous(flat.tensors[i].local) for i, _ in plan.writes[rank]}
        outputs.append((write_rank(backend, staging, token, rank, plan, tensors, entries, blobs, names, False, 1,
                                   BLOCK), None))
    result = commit_or_abort(backend, path, staging, plan, outputs, len(states), False, False, BLOCK, {"chaos": 1})
    committed_bytes(result, path)


def build(spec: dict) -> dict:
    """Write the checkpoint every trial damages a copy of; check that it reads back whole."""
    values = _values()
    _save_as_ranks([_rank_state(rank, values) for rank in range(WORLD)], spec["path"])
    outcome, label, message = _judge(spec["path"])
    if label != "harmless":
        raise RuntimeError(f"the undamaged checkpoint does not read back: {label} {message}")
    return {"files": len(os.listdir(spec["path"])) - 1}


# --------------------------------------------------------------------------- reading a damaged copy

def _target() -> dict:
    values = _values()
    model = {name: torch.zeros_like(t) for name, t in values.items()}
    return {"model": model, "extra": {k: None for k in EXTRA},
            "rank": ss.PerRank(None, on_resize=lambda saved, rank, world: saved)}


def _differs(state: dict) -> set[str]:
    """The parts of a loaded state that are not what was saved: "tensors", "plain values"."""
    values, differ = _values(), set()
    if not all(torch.equal(state["model"][k].view(torch.uint8), values[k].view(torch.uint8)) for k in values):
        differ.add("tensors")
    # by repr: False == 0 and 1.0 == 1, but a load that turns one into the other is not exact
    if repr(state["extra"]) != repr(EXTRA) or repr(state["rank"].value) != repr([r * 11 for r in range(WORLD)]):
        differ.add("plain values")
    return differ


def _attempt(action) -> BaseException | None:
    try:
        action()
    except Exception as exc:  # noqa: BLE001 (judged by the caller: only CheckpointError is right)
        return exc
    return None


def _judge(path: str, hostile: str = "") -> tuple[str, str, str]:
    """(outcome, label, message) of verifying and loading ``path``. ``hostile``: the damage is
    a manifest a writer could have meant (re-sealed), so the rules of the format alone judge
    it: "values" if it may state other plain values (they load as stated), "refuse" if it must
    be refused (it names files outside the directory)."""
    verify = _attempt(lambda: ss.open(path, allow_pickle=True).verify())
    state = _target()
    load = _attempt(lambda: ss.load(state, path, allow_pickle=True))
    for exc in (verify, load):
        if exc is not None and not isinstance(exc, ss.CheckpointError):
            return WRONG, "crash", f"{type(exc).__name__}: {str(exc)[:300]}"
    if verify is not None and load is not None:
        return EXPECTED, "refused" if hostile else "detected", ""
    if hostile == "refuse":
        return WRONG, "accepted", "a manifest naming files outside its directory was not refused by " + \
            ("verify" if verify is None else "the load")
    if load is not None:  # a valid manifest of another checkpoint (a tensor fewer) is one verify passes
        if hostile:
            return EXPECTED, "refused by the load only", ""
        return WRONG, "verify missed", f"verify passed; the load raised {type(load).__name__}: {str(load)[:300]}"
    differ = _differs(state)
    if not differ:
        return EXPECTED, "harmless" if verify is None else "verify only", ""
    if hostile == "values" and differ == {"plain values"}:
        return EXPECTED, "accepted: loads the plain values it states", ""
    return WRONG, "silent", f"the load returned other {' and '.join(sorted(differ))} without an error"


# --------------------------------------------------------------------------- damages

def _pieces(path: str) -> list[tuple[str, int, int, str]]:
    """(file, offset, nbytes, name) of every stored piece and pickled value with bytes."""
    manifest = ss.open(path).manifest
    out = [(manifest.files[int(e.file[i])], int(e.offset[i]), int(e.nbytes[i]), fqn)
           for fqn, e in manifest.tensors.items() for i in range(e.num_pieces) if int(e.nbytes[i])]
    pending = list(manifest.objects.items())
    while pending:
        fqn, entry = pending.pop()
        pending += [(fqn, e) for e in entry.per_rank]
        if entry.kind == "pickle":
            out.append((manifest.files[entry.value[0]], entry.value[1], entry.value[2], fqn))
    return out


def _flip(file: str, position: int, bit: int) -> None:
    with open(file, "r+b") as f:
        f.seek(position)
        byte = f.read(1)[0]
        f.seek(position)
        f.write(bytes([byte ^ (1 << bit)]))


def _data_files(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if n != MANIFEST_NAME)


def flip_data(path: str, rng: random.Random) -> tuple[str, str]:
    file, offset, nbytes, fqn = rng.choice(_pieces(path))
    position = offset + rng.randrange(nbytes)
    _flip(os.path.join(path, file), position, rng.randrange(8))
    return f"bit flip at byte {position} of {file} ({fqn})", ""


def flip_manifest(path: str, rng: random.Random) -> tuple[str, str]:
    file = os.path.join(path, MANIFEST_NAME)
    position = rng.randrange(os.path.getsize(file))
    _flip(file, position, rng.randrange(8))
    return f"bit flip at byte {position} of the manifest", ""


def truncate(path: str, rng: random.Random) -> tuple[str, str]:
    name = rng.choice([MANIFEST_NAME, *_data_files(path)] if rng.random() < 0.2 else _data_files(path))
    file = os.path.join(path, name)
    size = rng.randrange(os.path.getsize(file))
    os.truncate(file, size)
    return f"{name} truncated to {size} bytes", ""


def delete(path: str, rng: random.Random) -> tuple[str, str]:
    name = rng.choice([MANIFEST_NAME, *_data_files(path)] if rng.random() < 0.2 else _data_files(path))
    os.unlink(os.path.join(path, name))
    return f"{name} deleted", ""


class _Raw:
    """Text put into the manifest as it is, where no Python value serializes to it."""

    def __init__(self, text: str):
        self.text = text


def _hostile(rng: random.Random):
    """A value of the wrong kind, size or sign for wherever it lands."""
    nested = None
    for _ in range(rng.randrange(1, 50)):
        nested = [nested] if rng.random() < 0.5 else {"k": nested}
    return rng.choice([
        0, 1, -1, 3, 2 ** 31, 2 ** 53 + 1, 2 ** 63 - 1, 2 ** 63, 2 ** 64, 2 ** 64 + 1, -2 ** 63 - 1,
        10 ** 30, -10 ** 30,
        0.0, 0.5, -2.5, 1e308, float("inf"), float("nan"), True, False, None, "", "x", "0", "float32", "box", "flat",
        "../x", "/etc/passwd", "x" * 100_000, [], [0], [-1], [2 ** 64], [[0, 0]], [None], ["a", 1], {}, {"a": 1},
        nested, {"packed": "i8", "shape": [2 ** 40], "data": ""},
        {"packed": "u8", "shape": [3], "delta": True, "zlib": True, "data": "eJwDAAAAAAE="},
        {"packed": "f4", "shape": [1], "data": "AAAAAA=="}, {"json": 1, "pickle": [0, 0, 0, 0]},
        {"__ss_tensor": {"dtype": "float32", "shape": [2 ** 40], "data": ""}}, {"__ss_unknown": 1},
        _Raw("[" * 100_000 + "]" * 100_000), _Raw("1e999999"), _Raw("-0"), _Raw('"\\ud800"'),
    ])


def _nodes(value, where=()):
    """The path to every value inside ``value`` (dict keys and list indices)."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield (*where, key)
        yield from _nodes(child, (*where, key))


def _seal(text: str) -> bytes:
    """The manifest as a writer that means it writes it: ending in its checksum of itself
    (docs/format.md section 5), so that only the format's rules can refuse it."""
    body = text.encode()
    return b"%s,\"%s\":%d}" % (body[:-1], SELF_CHECKSUM.encode(), xxhash.xxh3_64_intdigest(body))


def _read_doc(path: str) -> dict:
    with open(os.path.join(path, MANIFEST_NAME)) as f:
        doc = json.load(f)
    doc.pop(SELF_CHECKSUM)
    return doc


def _write_sealed(path: str, text: str) -> None:
    with open(os.path.join(path, MANIFEST_NAME), "wb") as f:
        f.write(_seal(text))


def fuzz(path: str, rng: random.Random) -> tuple[str, str]:
    """Replace (or remove) one value anywhere in the manifest, at any depth, and re-seal it."""
    doc = _read_doc(path)
    where = rng.choice(list(_nodes(doc)))
    parent = doc
    for key in where[:-1]:
        parent = parent[key]
    value, placeholder = _hostile(rng), "__chaos_raw__"
    if rng.random() < 0.1:
        del parent[where[-1]]
        what = "removed"
    else:
        parent[where[-1]] = placeholder if isinstance(value, _Raw) else value
        what = f"set to {(value.text if isinstance(value, _Raw) else json.dumps(value))[:40]}"
    text = json.dumps(doc)
    if isinstance(value, _Raw):
        text = text.replace(json.dumps(placeholder), value.text)
    _write_sealed(path, text)
    # a plain value, the user's meta or an informative field may be any JSON: it loads as stated
    stated = where[0] in ("objects", "meta", "created_unix", "torch_version")
    return f"manifest {'.'.join(map(str, where))[:80]} {what}", "values" if stated else "rules"


def escape(path: str, rng: random.Random) -> tuple[str, str]:
    """Name a data file outside the checkpoint, where an intact copy of it lies; re-seal."""
    doc = _read_doc(path)
    index = rng.randrange(len(doc["files"]))
    name = doc["files"][index]
    outside = os.path.join(os.path.dirname(path), "outside")
    os.makedirs(os.path.join(outside, "sub"), exist_ok=True)
    for copy in (os.path.join(outside, name), os.path.join(outside, "sub", name)):
        shutil.copyfile(os.path.join(path, name), copy)
    doc["files"][index] = rng.choice([
        os.path.join("..", "outside", name), os.path.join(outside, name), f"../outside/sub/../{name}",
        f"./../outside/{name}", f"sub/{name}", f"{name}/", f"{name}\n", f"\\..\\{name}", f"~/{name}", ".", "..", ""])
    _write_sealed(path, json.dumps(doc))
    return f"data file {index} named {doc['files'][index]!r}", "refuse"


# kind -> damage(path, rng) -> (what it did, how hostile: "" for damage, else what _judge allows)
DAMAGES = {"bit flip in data": flip_data, "bit flip in manifest": flip_manifest, "truncation": truncate,
           "deletion": delete, "hostile manifest: any field": fuzz,
           "hostile manifest: path leaving the directory": escape}
SHARES = {"bit flip in data": 0.25, "bit flip in manifest": 0.2, "truncation": 0.1, "deletion": 0.05,
          "hostile manifest: any field": 0.32, "hostile manifest: path leaving the directory": 0.08}


def trial(spec: dict) -> dict:
    torch.set_num_threads(1)
    base = tempfile.mkdtemp(dir=spec["workdir"])
    try:
        path = os.path.join(base, "ckpt")
        shutil.copytree(spec["pristine"], path)
        what, hostile = DAMAGES[spec["kind"]](path, random.Random(spec["seed"]))
        outcome, label, message = _judge(path, hostile)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return {"outcome": outcome, "details": [label], "message": f"{what}: {message}" if message else what}


# --------------------------------------------------------------------------- the bench side

def run(server: ForkServer, workdir: str, rng: random.Random, trials: int) -> list[Tally]:
    pristine = os.path.join(workdir, "damage-pristine")
    result, status, child = server.run(BUILD, {"path": pristine}, 120, "build")
    if status != 0:
        raise RuntimeError(f"building the checkpoint to damage failed: {child.log_text()}")
    tallies = []
    for kind, share in SHARES.items():
        tally = Tally(f"damage: {kind}")
        for _ in range(max(1, round(trials * share))):
            spec = {"pristine": pristine, "workdir": workdir, "kind": kind, "seed": rng.randrange(2 ** 32)}
            tally.add_run(server.run(TRIAL, spec, TRIAL_TIMEOUT_S, "damage"), TRIAL_TIMEOUT_S)
        tallies.append(tally)
    shutil.rmtree(pristine, ignore_errors=True)
    return tallies
