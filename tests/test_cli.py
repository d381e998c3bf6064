"""The ``statesnap`` command: inspect, verify and diff, through cli.main and a real subprocess."""
import json
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import statesnap as ss
from statesnap.cli import json_text, main
from statesnap.errors import printable
from statesnap.format.manifest import MANIFEST_NAME


def save_training(path, bump: float = 0.0, step: int = 1):
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 6)).sum().backward()
    optim.step()
    with torch.no_grad():
        model.weight[1, 2] += bump
    ss.save({"model": model, "optim": optim, "extra": {"step": step, "bf16": torch.ones(2, 3, dtype=torch.bfloat16)}},
            path)


@pytest.fixture
def ckpt(tmp_path):
    save_training(tmp_path / "a")
    return tmp_path / "a"


def test_inspect_lists_tensors_and_totals(ckpt, capsys):
    assert main(["inspect", str(ckpt), "--files"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert lines["model.weight"][1:] == ["float32", "[4,", "6]", "96", "B", "1"]
    assert lines["extra.bf16"][1] == "bfloat16"
    assert lines["optim.state.weight.exp_avg"][1] == "float32"
    assert lines["extra.step"][1] == "json"
    assert "total: 9 tensors in 9 pieces" in out
    assert "data-" in out and "manifest" in out


def test_inspect_json(ckpt, capsys):
    assert main(["inspect", "--json", str(ckpt)]) == 0
    doc = json.loads(capsys.readouterr().out)
    tensors = {t["name"]: t for t in doc["tensors"]}
    assert tensors["model.weight"] == {"name": "model.weight", "dtype": "float32", "shape": [4, 6], "bytes": 96,
                                       "pieces": 1, "layout": "box", "files": [doc["files"][0]["name"]]}
    assert tensors["extra.bf16"]["bytes"] == 12
    assert {o["name"] for o in doc["objects"]} == {"extra.step", "optim.param_groups"}
    totals = doc["totals"]
    assert totals["tensors"] == len(tensors) == 9
    assert totals["tensor_bytes"] == sum(t["bytes"] for t in tensors.values())
    assert totals["file_bytes"] == sum(f["bytes"] for f in doc["files"]) >= totals["tensor_bytes"]
    assert {f["kind"] for f in doc["files"]} == {"data"} and totals["manifest_sections"] == 0
    assert totals["manifest_bytes"] == (ckpt / MANIFEST_NAME).stat().st_size
    assert doc["format_version"] == 1 and doc["world_size"] == 1


def test_verify_good_and_damaged(ckpt, tmp_path, capsys):
    save_training(tmp_path / "b")
    assert main(["verify", str(ckpt), str(tmp_path / "b")]) == 0
    assert capsys.readouterr().out.count("ok ") == 2

    doc = json.loads((ckpt / MANIFEST_NAME).read_text())
    entry = doc["tensors"]["optim.state.weight.exp_avg"]
    data_file = ckpt / doc["files"][entry["file"][0]]
    raw = bytearray(data_file.read_bytes())
    raw[entry["offset"][0] + 5] ^= 1
    data_file.write_bytes(bytes(raw))
    assert main(["verify", str(ckpt), str(tmp_path / "b")]) == 1
    captured = capsys.readouterr()
    assert "DAMAGED" in captured.err and "optim.state.weight.exp_avg" in captured.err
    assert data_file.name in captured.err
    assert f"ok {tmp_path / 'b'}" in captured.out

    data_file.unlink()
    assert main(["verify", str(ckpt)]) == 1
    assert data_file.name in capsys.readouterr().err


def test_verify_bad_manifest_and_missing_checkpoint(ckpt, tmp_path, capsys):
    (ckpt / MANIFEST_NAME).write_text("{}")
    assert main(["verify", str(ckpt)]) == 1
    assert "not a statesnap manifest" in capsys.readouterr().err
    assert main(["verify", str(tmp_path / "nowhere")]) == 1
    assert main(["inspect", str(tmp_path / "nowhere")]) == 2


def test_verify_of_a_path_with_no_checkpoint_says_unreadable_not_damaged(ckpt, tmp_path, capsys):
    """``statesnap verify`` of a mistyped path printed "DAMAGED <path>: no checkpoint at <path>",
    calling a checkpoint damaged that was never there; damage keeps its word."""
    assert main(["verify", str(tmp_path / "nowhere"), str(ckpt)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"UNREADABLE {tmp_path / 'nowhere'}: no checkpoint at") and "DAMAGED" not in err
    torch.save({"w": torch.ones(2)}, tmp_path / "m.pt")  # no checkpoint either: not damage
    assert main(["verify", str(tmp_path / "m.pt"), str(ckpt / MANIFEST_NAME)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == [f"NOT A CHECKPOINT {tmp_path / 'm.pt'}",
                                                      f"NOT A CHECKPOINT {ckpt / MANIFEST_NAME}"]


def test_diff(ckpt, tmp_path, capsys):
    save_training(tmp_path / "same")
    assert main(["diff", str(ckpt), str(tmp_path / "same")]) == 0
    assert "match" in capsys.readouterr().out

    save_training(tmp_path / "bumped", bump=0.25, step=2)
    assert main(["diff", str(ckpt), str(tmp_path / "bumped")]) == 1
    out = capsys.readouterr().out
    assert "model.weight: max abs diff 0.25" in out
    assert "extra.step: 1 vs 2" in out
    assert "model.bias" not in out and "exp_avg" not in out
    assert main(["diff", "--atol", "0.5", str(ckpt), str(tmp_path / "bumped")]) == 1  # step still differs
    assert "model.weight" not in capsys.readouterr().out


def test_diff_of_a_damaged_pickled_value_cannot_compare(tmp_path, capsys):
    """diff compared a pickled value by the length and checksum the manifest records, so a copy
    whose pickled bytes were damaged (no load can read it) "matched" its good original."""
    state = {"w": torch.ones(4), "cfg": {"c": complex(1, 2)}}
    ss.save(state, tmp_path / "good", allow_pickle=True)
    ss.save(state, tmp_path / "copy", allow_pickle=True)
    entry = json.loads((tmp_path / "copy" / MANIFEST_NAME).read_bytes())
    file, offset, _, _ = entry["objects"]["cfg.c"]["pickle"]
    data = tmp_path / "copy" / entry["files"][file]
    raw = bytearray(data.read_bytes())
    raw[offset + 3] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert main(["diff", str(tmp_path / "good"), str(tmp_path / "copy")]) == 2
    err = capsys.readouterr().err
    assert "object 'cfg.c'" in err and "is damaged" in err


def test_diff_keys_shapes_and_dtypes(tmp_path, capsys):
    ss.save({"a": torch.zeros(3), "b": torch.zeros(2), "c": torch.zeros(2), "only_left": 1}, tmp_path / "l")
    ss.save({"a": torch.zeros(3), "b": torch.zeros(3), "c": torch.zeros(2, dtype=torch.int32),
             "only_right": torch.ones(1)}, tmp_path / "r")
    assert main(["diff", str(tmp_path / "l"), str(tmp_path / "r")]) == 1
    out = capsys.readouterr().out
    assert f"only in {tmp_path / 'l'}: only_left" in out
    assert f"only in {tmp_path / 'r'}: only_right" in out
    assert "b: float32[2] vs float32[3]" in out and "c: float32[2] vs int32[2]" in out
    assert "a:" not in out


def test_diff_reads_large_tensors_in_slabs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("statesnap.tools.DIFF_SLAB_BYTES", 64)
    left = torch.randn(50, 8)
    right = left.clone()
    right[37, 5] -= 3.0
    right[3, 1] = float("nan")
    ss.save({"t": left, "u": left[:, 0].clone()}, tmp_path / "l")
    ss.save({"t": right, "u": left[:, 0].clone()}, tmp_path / "r")
    assert main(["diff", str(tmp_path / "l"), str(tmp_path / "r")]) == 1
    assert "t: max abs diff nan" in capsys.readouterr().out
    right[3, 1] = left[3, 1]
    ss.save({"t": right, "u": left[:, 0].clone()}, tmp_path / "r", overwrite=True)
    assert main(["diff", str(tmp_path / "l"), str(tmp_path / "r")]) == 1
    assert "t: max abs diff 3" in capsys.readouterr().out


def test_diff_is_bit_for_bit_by_default(tmp_path, capsys):
    """Values that float64 cannot tell apart still differ: 64-bit integers one apart, 0.0 and
    -0.0. Without --atol every one is reported; with one, integers are compared exactly."""
    left = {"i": torch.tensor([2**62, 7]), "u": torch.tensor([2**63 + 2], dtype=torch.uint64),
            "z": torch.tensor([0.0, 1.0]), "same": torch.arange(4)}
    right = {"i": torch.tensor([2**62 + 1, 7]), "u": torch.tensor([2**63 + 3], dtype=torch.uint64),
             "z": torch.tensor([-0.0, 1.0]), "same": torch.arange(4)}
    ss.save(left, tmp_path / "l")
    ss.save(right, tmp_path / "r")
    assert main(["diff", str(tmp_path / "l"), str(tmp_path / "r")]) == 1
    out = capsys.readouterr().out
    assert "i: max abs diff 1\n" in out and "u: max abs diff 1\n" in out
    assert "z: max abs diff 0 (the values' bits differ)" in out and "same" not in out
    assert main(["diff", "--atol", "0.5", str(tmp_path / "l"), str(tmp_path / "r")]) == 1
    out = capsys.readouterr().out
    assert "i: max abs diff 1\n" in out and "z:" not in out
    assert main(["diff", "--atol", "1", str(tmp_path / "l"), str(tmp_path / "r")]) == 0


def test_console_command_in_a_subprocess(ckpt):
    run = lambda *args: subprocess.run([sys.executable, "-m", "statesnap.cli", *args],  # noqa: E731
                                       capture_output=True, text=True, timeout=120)
    listed = run("inspect", str(ckpt))
    assert listed.returncode == 0 and "model.weight" in listed.stdout
    assert run("verify", str(ckpt)).returncode == 0
    assert run("diff", str(ckpt), str(ckpt)).returncode == 0
    unknown = run("frobnicate")
    assert unknown.returncode == 2 and "unknown command" in unknown.stderr


def test_verify_diff_and_inspect_json_documents_with_the_same_exit_status(ckpt, tmp_path, capsys):
    save_training(tmp_path / "b", bump=0.25, step=2)
    assert main(["verify", "--json", str(ckpt), str(tmp_path / "b")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [c["ok"] for c in doc["checkpoints"]] == [True, True]
    assert doc["checkpoints"][0]["tensors"] == len(ss.open(ckpt).manifest.tensors)
    assert doc["checkpoints"][0]["bytes_verified"] > 0
    assert main(["verify", "--json", str(tmp_path / "nowhere"), str(ckpt)]) == 1
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert [c["ok"] for c in doc["checkpoints"]] == [False, True] and "nowhere" in doc["checkpoints"][0]["error"]
    assert captured.err == ""

    assert main(["diff", "--json", str(ckpt), str(tmp_path / "b")]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["match"] is False and "extra.step: 1 vs 2" in doc["differences"]
    assert any(d.startswith("model.weight: max abs diff 0.25") for d in doc["differences"])
    assert main(["diff", "--json", str(ckpt), str(ckpt)]) == 0
    assert json.loads(capsys.readouterr().out) == {"left": str(ckpt), "right": str(ckpt), "match": True,
                                                    "differences": []}
    assert main(["diff", "--json", str(ckpt), str(tmp_path / "nowhere")]) == 2
    assert "error" in json.loads(capsys.readouterr().out)
    assert main(["inspect", "--json", str(tmp_path / "nowhere")]) == 2
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"path": str(tmp_path / "nowhere"),
                                        "error": f"no checkpoint at {tmp_path / 'nowhere'}"} and captured.err == ""


def test_bench_json_to_stdout_is_one_document(tmp_path):
    """``--json -``: stdout is the JSON document alone, the report goes to stderr."""
    out = subprocess.run([sys.executable, "-m", "statesnap.cli", "bench", "--suite", "planning", "--layers", "2",
                          "--tp", "2", "--dp", "2", "--reshard-tp", "1", "--reshard-dp", "2", "--sample-ranks", "1",
                          "--dcp-layers", "1", "--json", "-"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout)
    assert isinstance(figures, dict) and figures and all(key in out.stderr for key in figures)


def strict_json(text: str):
    """``text`` parsed as RFC 8259 JSON: Python's own parser also takes NaN and Infinity."""
    def refuse(literal):
        raise ValueError(f"{literal} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_urls_fsspec_cannot_serve_are_one_line_errors(ckpt, capsys):
    url = "nosuchprotocol://b/x"
    error = f"cannot open {url}: ValueError: Protocol not known: nosuchprotocol"
    for argv, status, printed in (
            (["inspect", url], 2, f"statesnap inspect: {error}"),
            (["diff", url, str(ckpt)], 2, f"statesnap diff: {error}"),
            (["verify", url], 1, f"UNREADABLE {url}: {error}"),
            (["export", url, str(ckpt.parent / "x.safetensors")], 2, f"statesnap export: {error}")):
        assert main(argv) == status
        assert capsys.readouterr().err == printed + "\n"
    for argv, status in ((["inspect", "--json", url], 2), (["verify", "--json", url], 1),
                         (["diff", "--json", url, str(ckpt)], 2)):
        assert main(argv) == status
        captured = capsys.readouterr()
        assert error in captured.out and captured.err == ""
        strict_json(captured.out)


@pytest.mark.parametrize("options", ["[1]", '"x"', "1", "null", "not json", '{"a": NaN}', '{"a": 1, "a": 2}'])
def test_storage_options_that_are_not_a_json_object_are_a_usage_error(ckpt, options, capsys):
    for argv in (["inspect", str(ckpt)], ["inspect", "--json", "s3://bucket/ckpt"], ["verify", str(ckpt)],
                 ["diff", str(ckpt), str(ckpt)]):
        with pytest.raises(SystemExit) as exited:
            main([argv[0], "--storage-options", options, *argv[1:]])
        assert exited.value.code == 2
        captured = capsys.readouterr()
        assert "argument --storage-options" in captured.err and captured.out == ""
    assert main(["inspect", "--storage-options", '{"anon": true}', str(ckpt)]) == 0


@pytest.mark.parametrize("atol", ["nan", "-1", "inf", "one"])
def test_diff_refuses_a_tolerance_every_difference_would_pass(tmp_path, atol, capsys):
    """With a NaN or infinite tolerance different checkpoints "matched"."""
    ss.save({"w": torch.zeros(3)}, tmp_path / "l")
    ss.save({"w": torch.ones(3)}, tmp_path / "r")
    for json_args in ([], ["--json"]):
        with pytest.raises(SystemExit) as exited:
            main(["diff", *json_args, "--atol", atol, str(tmp_path / "l"), str(tmp_path / "r")])
        assert exited.value.code == 2 and "argument --atol" in capsys.readouterr().err
    assert main(["diff", "--atol", "0.5", str(tmp_path / "l"), str(tmp_path / "r")]) == 1


def test_json_documents_are_rfc_8259_even_where_the_manifest_is_not(ckpt, capsys):
    """A manifest holding NaN is refused (format/columns.py) and the error is a valid document; a
    non-finite float in a document (a bench figure) is written as a string, never as NaN."""
    raw = (ckpt / MANIFEST_NAME).read_bytes()
    (ckpt / MANIFEST_NAME).write_bytes(raw.replace(b'"meta":{}', b'"meta":{"loss":NaN}'))
    assert main(["inspect", "--json", str(ckpt)]) == 2
    doc = strict_json(capsys.readouterr().out)
    assert "NaN is not a JSON value" in doc["error"]
    assert strict_json(json_text({"figures": [float("nan"), float("inf"), -float("inf"), 0.5]})) == \
        {"figures": ["nan", "inf", "-inf", 0.5]}


def test_names_from_the_manifest_are_printed_escaped(ckpt, tmp_path, capsys):
    """A name holding a newline or a terminal escape sequence would forge lines of the output or
    drive the terminal: inspect, diff and export print it escaped (--json escapes as JSON does)."""
    forged = "model.weight\nok everything verified\x1b[2K\x1b]0;title\x07"
    doc = json.loads((ckpt / MANIFEST_NAME).read_bytes())
    doc.pop("manifest_xxh3")
    doc["tensors"][forged] = doc["tensors"].pop("model.weight")
    doc["objects"][forged + ".step"] = doc["objects"].pop("extra.step")
    (ckpt / MANIFEST_NAME).write_text(json.dumps(doc))
    save_training(tmp_path / "b")
    escaped = "model.weight\\nok everything verified\\x1b[2K\\x1b]0;title\\x07"
    for argv in (["inspect", str(ckpt)], ["diff", str(ckpt), str(tmp_path / "b")],
                 ["export", "--no-progress", str(ckpt), str(tmp_path / "x.safetensors")]):
        main(argv)
        printed = capsys.readouterr().out
        assert escaped in printed and "\x1b" not in printed and "\x07" not in printed
        assert not any(line.startswith("ok everything") for line in printed.splitlines())
    assert main(["inspect", "--json", str(ckpt)]) == 0
    assert forged in {t["name"] for t in json.loads(capsys.readouterr().out)["tensors"]}
    assert printable("naïve ✓ name") == "naïve ✓ name"

    # the Python API's errors too: a traceback or a log line prints them as they are
    for load in (lambda: ss.load({"x": torch.zeros(1)}, ckpt),
                 lambda: ss.open(ckpt).read(forged + ".missing")):
        with pytest.raises(ss.CheckpointError) as caught:
            load()
        message = str(caught.value.args[0])
        assert escaped in message
        assert "\n" not in message and "\x1b" not in message and "\x07" not in message


def _events_file(tmp_path, name: str, text: str):
    (tmp_path / name / "events").mkdir(parents=True)
    (tmp_path / name / "events" / "rank-00000.jsonl").write_text(text)
    return tmp_path / name


EVENT = '{"phase":"save","step":1,"rank":0,"start":0.5,"end":1.0,"nbytes":8,"thread":"MainThread","info":{}}\n'


@pytest.mark.parametrize("text, words", [
    ('{"phase":"save","step":1,"rank":0,"start":0,"end":1}\n', "line 1 is not a checkpoint event: its field 'nbytes' "
                                                               "is missing or not an integer"),
    (EVENT + "[1, 2]\n", r"line 2 is not a checkpoint event \(a JSON object\)"),
    (EVENT.replace('"rank":0', '"rank":"0"'), "line 1 is not a checkpoint event: its field 'rank'"),
    (EVENT.replace("1.0", "NaN"), "its field 'end' is missing or not a finite number"),
    ("garbage{\n", r"hold no events: 1 line\(s\) that are not JSON, the first in .*rank-00000.jsonl, line 1$"),
])
def test_trace_of_malformed_events_files_is_a_one_line_error_naming_file_and_line(tmp_path, text, words, capsys):
    source = _events_file(tmp_path, "root", text)
    assert main(["trace", str(source), "--no-png"]) == 2
    err = capsys.readouterr().err
    assert re.search(f"^statesnap trace: .*{words}", err.strip()) and len(err.strip().splitlines()) == 1
    assert str(source) in err


def test_trace_skips_a_line_cut_short_saying_so(tmp_path, capsys):
    source = _events_file(tmp_path, "root", EVENT + '{"phase":"wri')
    assert main(["trace", str(source), "--no-png"]) == 0
    captured = capsys.readouterr()
    assert "skipped 1 line(s) that are not JSON, the first in" in captured.err and "line 2" in captured.err
    assert "1 events" in captured.out


def test_trace_png_path_it_cannot_write_is_a_one_line_error_and_png_is_added_to_a_bare_name(tmp_path, capsys):
    """``--png`` into a missing directory ended in a FileNotFoundError traceback; a name without
    ``.png`` was written with the suffix matplotlib adds, and reported without it."""
    pytest.importorskip("matplotlib")
    source = _events_file(tmp_path, "root", EVENT)
    out = str(tmp_path / "trace.json")
    assert main(["trace", str(source), "-o", out, "--png", str(tmp_path / "missing" / "t.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(r"statesnap trace: cannot write .*missing/t\.png: No such file or directory", err)
    assert main(["trace", str(source), "-o", out, "--png", str(tmp_path / "timeline")]) == 0
    assert f"wrote {tmp_path / 'timeline.png'}" in capsys.readouterr().out and (tmp_path / "timeline.png").is_file()


def test_no_command_is_a_usage_error(capsys):
    assert main([]) == 2
    captured = capsys.readouterr()
    assert "no command given" in captured.err and "usage: statesnap COMMAND" in captured.err and captured.out == ""
    assert main(["--help"]) == 0
    assert "Exit status" in capsys.readouterr().out


def test_the_manifest_file_is_not_taken_for_its_checkpoint_saying_which_is(ckpt, capsys):
    assert main(["inspect", str(ckpt / MANIFEST_NAME)]) == 2
    assert capsys.readouterr().err == (f"statesnap inspect: {ckpt / MANIFEST_NAME} is a checkpoint's manifest, not the "
                                       f"checkpoint: name its directory, {ckpt}, instead\n")


def test_export_and_convert_exit_as_inspect_does_for_what_they_cannot_read(tmp_path, capsys):
    nowhere = str(tmp_path / "nowhere")
    assert main(["inspect", nowhere]) == 2
    assert main(["export", nowhere, str(tmp_path / "x.safetensors")]) == 2
    assert main(["convert", nowhere, str(tmp_path / "ck")]) == 2
    assert capsys.readouterr().err.count("nowhere") == 3


def test_a_destination_that_exists_names_the_flag_that_replaces_it(ckpt, tmp_path, capsys):
    (tmp_path / "o.safetensors").write_bytes(b"x")
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    assert main(["export", "--to", "safetensors", str(ckpt), str(tmp_path / "o.safetensors")]) == 2
    assert main(["convert", str(tmp_path / "w.pt"), str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert err.count("pass --overwrite to replace it") == 2 and "overwrite=True" not in err


def test_convert_and_export_errors_name_their_flags_not_the_python_arguments(ckpt, tmp_path, capsys):
    """The messages are written for the Python call; the command line names its own flags."""
    torch.save({"w": torch.ones(2), "v": torch.ones(3)}, tmp_path / "w.pt")
    assert main(["convert", str(tmp_path / "w.pt"), str(tmp_path / "ck"), "--no-copy"]) == 2
    assert main(["export", str(ckpt), str(tmp_path / "o.safetensors"), "--max-shard-size", "10B"]) == 2
    err = capsys.readouterr().err
    assert "--no-copy links the source's files" in err and "so it is copied: leave out --no-copy" in err
    assert "--max-shard-size 10 splits" in err and "or leave out --max-shard-size" in err
    assert not any(word in err for word in ("copy=", "max_shard_bytes", "allow_pickle"))
    ss.save({"w": torch.ones(2), "obj": {1, 2}}, tmp_path / "pickled", allow_pickle=True)
    assert main(["export", str(tmp_path / "pickled"), str(tmp_path / "p.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "skipped obj (pickled; pass --allow-pickle if you trust the checkpoint)" in out


def test_a_trainers_pointer_is_not_taken_for_a_checkpoint_and_what_it_names_is_said(tmp_path, capsys):
    """Lightning's ``last.ckpt`` and the Trainer's ``checkpoint-N`` are pointers to a step of
    the store beside them: inspecting one names that step, which inspects as a checkpoint."""
    from statesnap.integrations.pointers import POINTER_NAME, pointer_bytes

    ss.save({"w": torch.ones(2)}, tmp_path / "statesnap" / "step-3")
    (tmp_path / "last.ckpt").write_bytes(pointer_bytes("statesnap-lightning-1", "statesnap/step-3"))
    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / POINTER_NAME).write_bytes(pointer_bytes("statesnap-transformers-1",
                                                                          "statesnap/step-3"))
    named = str(tmp_path / "statesnap" / "step-3")
    assert main(["inspect", str(tmp_path / "last.ckpt")]) == 2
    assert main(["inspect", str(tmp_path / "checkpoint-3")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.endswith(f"the checkpoint it names is {named})") for line in err)
    assert "it is a pointer a trainer's statesnap integration wrote" in err[0]
    assert f"{tmp_path / 'checkpoint-3' / POINTER_NAME} is a pointer" in err[1]
    assert main(["inspect", named]) == 0
    (tmp_path / "other.ckpt").write_bytes(b'{"format": "lightning", "checkpoint": "statesnap/step-3"}')
    with pytest.raises(ss.CheckpointError, match="it is a file, perhaps a torch.save or safetensors one"):
        ss.load({"w": torch.zeros(2)}, tmp_path / "other.ckpt")


def test_a_checkpointer_root_is_not_taken_for_a_checkpoint_and_its_newest_step_is_named(tmp_path, capsys):
    """``statesnap inspect ROOT`` (or ``ss.load(state, ROOT)``) on a Checkpointer's root said only
    "an interrupted save leaves none; load an earlier checkpoint", which sent the user looking for
    damage; the root holds whole checkpoints one level down."""
    for step in (2, 10):
        save_training(tmp_path / "root" / f"step-{step}", step=step)
    assert main(["inspect", str(tmp_path / "root")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'root' / 'step-10'} the newest" in err and "load_latest" in err
    assert "interrupted save" not in err
    with pytest.raises(ss.ManifestError, match="2 step-N checkpoint"):
        ss.load({"extra": {"step": 0}}, tmp_path / "root", partial=True)


def test_convert_help_names_every_source_it_reads(capsys):
    """``statesnap convert --help`` described SRC as torch.save, DCP or safetensors only, though
    ``--from`` offers DeepSpeed, ucp and Megatron sources too: a user with a DeepSpeed run could
    not tell from the help that SRC may be its directory."""
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for source in ("DeepSpeed run", "ds_to_universal", "Megatron"):
        assert source in text


def test_python_dash_m_statesnap_is_the_command():
    """Where the console script is not on PATH (a venv not activated), ``python -m statesnap``."""
    done = subprocess.run([sys.executable, "-m", "statesnap", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "usage: statesnap COMMAND" in done.stdout


def test_only_steps_a_checkpointer_writes_are_named_in_a_roots_advice(tmp_path, capsys):
    """The root's advice parsed ``step-N`` names itself, unlike the Checkpointer: ``step-0100``
    (which ``load_latest`` never restores) was named as the newest, and a directory ``step-²``
    (``isdigit`` but no integer) made the load fail with "invalid literal for int()" instead."""
    for step in (2, 10):
        save_training(tmp_path / "root" / f"step-{step}", step=step)
    save_training(tmp_path / "root" / "step-0100", step=100)
    (tmp_path / "root" / "step-²").mkdir()
    with pytest.raises(ss.ManifestError, match="2 step-N checkpoint") as caught:
        ss.load({"extra": {"step": 0}}, tmp_path / "root", partial=True)
    assert f"{tmp_path / 'root' / 'step-10'} the newest" in str(caught.value)
    assert main(["inspect", str(tmp_path / "root")]) == 2
    assert f"{tmp_path / 'root' / 'step-10'} the newest" in capsys.readouterr().err


def test_output_cut_short_by_its_reader_ends_quietly(tmp_path):
    """``statesnap inspect --json | head``: the pipe closes under the listing, and the command
    stops as ``cat`` would (status 141, SIGPIPE's), without a traceback on stderr."""
    ss.save({"m": {f"t{i}": torch.zeros(2) for i in range(3000)}}, tmp_path / "many")
    reader = subprocess.Popen([sys.executable, "-m", "statesnap", "inspect", "--json", str(tmp_path / "many")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert reader.stdout.read(10) == b'{\n  "path"'
    reader.stdout.close()  # (the listing is far larger than the pipe holds: the next write fails)
    assert reader.wait(timeout=120) == 141
    assert reader.stderr.read() == b""
