"""The benchmark harness runs end to end at tiny sizes and reports every mode, op and ratio.

No timing thresholds: these tests check that the harness measures what it says (loads are
compared bit for bit inside the IO suite) and that every figure the docs quote is reported.
"""
import importlib
import json
import math
import os

import pytest

from statesnap import cli
from statesnap.bench import SUITES, io, training
from statesnap.bench.common import format_table
from statesnap.demo.gpt import config_for_state_gb

TINY = {"vocab": 128, "d_model": 64, "n_layer": 1, "seq_len": 16, "batch": 2}


def test_io_suite_reports_every_system_op_ratio_and_aim(tmp_path, capsys):
    out_json = tmp_path / "io.json"
    assert cli.main(["bench", "--suite", "io", "--size-gb", "0.02", "--repeat", "1", "--settle-s", "0",
                     "--out", str(tmp_path / "out"), "--json", str(out_json)]) == 0
    result = json.loads(out_json.read_text())
    assert set(result["gb_per_s"]) == set(io.SYSTEMS)
    for system in io.SYSTEMS:
        for op in io.OPS:
            assert result["gb_per_s"][system][op] > 0
            assert len(result["seconds"][system][op]) == 1
    assert set(result["ratios"]) == {"raw", "raw_parallel", "raw_direct", "torch", "dcp"}
    assert all(set(r) == set(io.OPS) for r in result["ratios"].values())
    assert [a["aim"] for a in result["aims"]] == [0.95, 0.9, 0.95, 1.5, 2.0]
    assert result["machine"]["cores"] >= 1
    printed = capsys.readouterr().out
    for word in ("save_durable", "load_cold", "load_warm", "statesnap / peer", "aim", "share of the busy disk"):
        assert word in printed
    assert not any((tmp_path / "out").glob("io-scratch")), "scratch checkpoints must be removed"


def test_io_repeats_rotate_which_system_goes_first(tmp_path, monkeypatch):
    """The disk's speed depends on what ran before, so no system may always follow the same one."""
    order = []

    def record(system, state, target, path, check, settle_s):
        order.append(system)
        return {op: 1.0 for op in io.OPS}

    monkeypatch.setattr(io, "measure_system", record)
    io.run(0.01, repeat=3, out=str(tmp_path), systems=("raw", "torch", "statesnap"), settle_s=0)
    assert order == ["raw", "torch", "statesnap", "torch", "statesnap", "raw", "statesnap", "raw", "torch"]


def test_io_loads_are_checked_bit_for_bit(tmp_path, monkeypatch):
    """A system whose load returns wrong values fails the suite instead of reporting a figure."""
    def broken_load(target, path):
        io.raw_load(target, path)
        io.tensors_of(target)[0].view(-1)[0] += 1
        return target
    monkeypatch.setitem(io.LOAD, "raw", broken_load)
    with pytest.raises(AssertionError, match="raw loaded values that differ"):
        io.run(size_gb=0.01, repeat=1, out=str(tmp_path), systems=("raw",), settle_s=0)


def test_training_suite_reports_every_mode_and_the_sweep(tmp_path, capsys):
    out_json = tmp_path / "training.json"
    assert training.main(["--config", json.dumps(TINY), "--steps", "2", "--warmup", "1", "--runs", "1",
                          "--sweep-gb", "0.02", "--sweep-steps", "2", "--out", str(tmp_path),
                          "--json", str(out_json)]) == 0
    result = json.loads(out_json.read_text())
    summary = result["summary"]
    assert list(summary) == list(training.DEFAULT_MODES)
    assert summary["none"]["overhead"] == 0.0 and summary["none"]["median_stall_s"] == 0.0
    for mode in training.DEFAULT_MODES:
        assert len(summary[mode]["loop_s_runs"]) == 1
        assert summary[mode]["peak_rss_gb"] > 0
        assert math.isfinite(summary[mode]["overhead"])
        if mode != "none":
            assert summary[mode]["median_stall_s"] > 0
    for mode in training.DEFAULT_MODES[1:]:
        assert all(len(r["stalls"]) == 2 for r in result["raw"][mode])
    assert {a["aim"] for a in result["aims"]} == {"<= 0.1", "<= 0.5", "<= 0.03"}
    sweep = result["sweep"]
    assert {(r["mode"], round(r["size_gb"], 3)) for r in sweep} == {
        (m, round(config_for_state_gb(s, batch=1).state_bytes() / 1e9, 3))
        for m in training.SWEEP_MODES for s in (0.02,)}
    assert all(r["median_background_s"] > 0 for r in sweep)
    assert (tmp_path / "training-sweep.png").stat().st_size > 0
    printed = capsys.readouterr().out
    for spec in training.MODES.values():
        assert spec.label in printed
    assert "Stall and background time against state size" in printed


def test_training_summary_takes_medians_of_interleaved_runs():
    def run(loop_s, stalls):
        return {"loop_s": loop_s, "stalls": stalls, "drain_s": 0.5, "peak_rss": 2e9, "background": []}
    summary = training.summarize({
        "none": [run(10.0, []), run(12.0, []), run(11.0, [])],
        "dcp_async": [run(13.2, [1.0, 3.0]), run(99.0, [2.0]), run(12.1, [5.0, 4.0])],
    })
    assert summary["none"]["overhead"] == 0.0
    assert summary["dcp_async"]["loop_s"] == 13.2 and summary["dcp_async"]["median_stall_s"] == 3.0
    assert abs(summary["dcp_async"]["overhead"] - 0.2) < 1e-12
    assert summary["dcp_async"]["peak_rss_gb"] == 2.0


def test_training_suite_checkpoints_every_nth_step_after_two_in_warm_up(tmp_path, monkeypatch):
    seen = []

    def fake_child(module, args, timeout=None):
        seen.append(args)
        values = dict(zip(args[1::2], args[2::2]))  # after "--child"
        steps, every, warmup = int(values["--steps"]), int(values["--every"]), int(values["--warmup"])
        assert warmup >= 2 * every  # two checkpoints' setup before the timed steps
        count = sum(1 for step in range(warmup + 1, warmup + steps + 1) if step % every == 0)
        return {"mode": values["--mode"], "state_bytes": 1, "loop_s": 1.0, "drain_s": 0.0,
                "stalls": [0.001] * count, "background": [0.1] * count, "peak_rss": 1}
    monkeypatch.setattr(training, "run_child", fake_child)
    out = tmp_path / "r.json"
    assert training.main(["--issue13", "--every", "3", "--steps", "9", "--runs", "1", "--modes", "none,statesnap_p1",
                          "--out", str(tmp_path), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["every"] == 3 and result["threads"] == 2 and result["sweep"] == []  # explicit --every wins
    assert result["config"] == training.save_call.ISSUE_GPT.to_dict()
    assert all(len(r["stalls"]) == 3 for r in result["raw"]["statesnap_p1"])
    assert all(dict(zip(a[1::2], a[2::2]))["--warmup"] == "6" for a in seen)
    with pytest.raises(SystemExit):  # fewer timed steps than one checkpoint needs
        training.main(["--every", "10", "--steps", "5", "--modes", "none", "--out", str(tmp_path)])


def test_bench_dispatches_every_suite(monkeypatch):
    called = []
    for name in SUITES:
        module = importlib.import_module(f"statesnap.bench.{name}")
        monkeypatch.setattr(module, "main", lambda argv, name=name: called.append((name, argv)) or 0)
    assert cli.main(["bench", "--suite", "all"]) == 0
    assert called == [(name, []) for name in SUITES]
    called.clear()
    assert cli.main(["bench", "--suite", "training", "--steps", "3"]) == 0
    assert called == [("training", ["--steps", "3"])]


def test_convert_suite_reports_both_parts_and_checks_the_import(tmp_path, capsys):
    out = tmp_path / "result.json"
    assert cli.main(["bench", "--suite", "convert", "--dim", "64", "--layers", "2", "--gb", "0.02", "--repeat", "1",
                     "--out", str(tmp_path), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    ds, st = result["deepspeed"], result["safetensors"]
    assert ds["tensors_checked"] == 4 * 3  # two layers' weight and bias: fp32 master and both moments each
    assert set(ds["summary"]) == {"ds_to_universal", "statesnap"}
    assert set(st["summary"]) == {"read_and_xxh3", "no_copy", "copy"}
    # linked, the import adds only its manifest; copied, it adds the tensors' bytes
    assert st["disk_added_bytes"]["no_copy"] < 1 << 20 <= st["disk_added_bytes"]["copy"]
    assert all(r["seconds"] > 0 and r["peak_rss_bytes"] > 0 for runs in (ds["runs"], st["runs"])
               for rs in runs.values() for r in rs)
    text = capsys.readouterr().out
    assert "ds_to_universal" in text and "copy=False" in text and "x floor" in text
    assert not (tmp_path / "convert").exists()  # scratch removed


def test_format_table_aligns_columns():
    text = format_table(["op", "GB/s"], [["save", 1.234], ["load", float("nan")]])
    lines = text.splitlines()
    assert lines[0] == "| op   | GB/s |"
    assert lines[2] == "| save | 1.23 |" and lines[3] == "| load |    - |"
    assert len({len(line) for line in lines}) == 1


def test_lightning_suite_reports_every_mode_and_checks_the_last_checkpoint(tmp_path, capsys):
    out_json = tmp_path / "lightning.json"
    assert cli.main(["bench", "--suite", "lightning", "--steps", "4", "--every", "2", "--width", "32",
                     "--layers", "2", "--repeat", "1", "--out", str(tmp_path / "out"),
                     "--json", str(out_json)]) == 0
    result = json.loads(out_json.read_text())
    assert set(result["fit_s"]) == {"none", "torch", "async", "statesnap"}
    assert set(result["stall_s"]) == set(result["blocked_s"]) == set(result["overhead_s"]) == \
        {"torch", "async", "statesnap"}
    assert all(value > 0 for value in [*result["stall_s"].values(), *result["blocked_s"].values()])
    printed = capsys.readouterr().out
    assert "StatesnapCheckpointIO" in printed and "aim <= 0.1" in printed
    assert not (tmp_path / "out" / "lightning").exists()  # the scratch checkpoints are gone


def test_trainer_suites_tell_blocked_time_from_the_slowed_next_step():
    from statesnap.bench.trainer_runs import summarize

    none = {"fit_s": 10.0, "steps": {1: 0.1, 2: 0.1, 3: 0.1, 4: 0.1}, "saves": []}
    lazy = {"fit_s": 10.5, "steps": {1: 0.1, 2: 0.3, 3: 0.1, 4: 0.25}, "saves": [(1, 0.01), (3, 0.01)],
            "optimizer_wait_s": 0.04}
    blocking = {"fit_s": 11.0, "steps": none["steps"], "saves": [(1, 0.5), (3, 0.5)]}
    summary = summarize({"none": [none], "lazy": [lazy], "blocking": [blocking]})
    assert summary["blocked_s"] == {"lazy": pytest.approx(0.03), "blocking": pytest.approx(0.5)}
    assert summary["stall_s"] == {"lazy": pytest.approx(0.185), "blocking": pytest.approx(0.5)}
    assert summary["overhead_s"] == {"lazy": pytest.approx(0.5), "blocking": pytest.approx(1.0)}


def test_hf_suite_reports_both_trainers_and_checks_the_last_checkpoint(tmp_path, capsys):
    out_json = tmp_path / "hf.json"
    assert cli.main(["bench", "--suite", "hf", "--steps", "2", "--every", "1", "--hidden", "64", "--layers", "1",
                     "--repeat", "1", "--out", str(tmp_path / "out"), "--json", str(out_json)]) == 0
    result = json.loads(out_json.read_text())
    assert set(result["fit_s"]) == {"none", "hf", "statesnap"}
    assert set(result["stall_s"]) == set(result["blocked_s"]) == set(result["overhead_s"]) == {"hf", "statesnap"}
    assert "StatesnapTrainer" in capsys.readouterr().out
    assert not (tmp_path / "out" / "hf").exists()


def test_bench_scratch_never_takes_a_folder_of_the_users(tmp_path):
    """``--out DIR``: a suite removed ``DIR/<suite>`` before it ran, the user's folder of that
    name included. It removes only what it made: a folder made there after a run (its inode
    may be the old one's) is refused too."""
    from statesnap.bench.common import fresh_dir, remove_scratch

    mine = tmp_path / "convert"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(SystemExit, match="was not made by statesnap bench"):
        fresh_dir(str(mine))
    assert (mine / "notes.txt").read_text() == "keep"
    made = fresh_dir(str(tmp_path / "io-scratch"))
    (tmp_path / "io-scratch" / "left.bin").write_bytes(b"x")  # a killed run's leftovers: removed
    assert fresh_dir(made + "/") == made and os.listdir(made) == []
    remove_scratch(made)
    os.mkdir(made)
    (tmp_path / "io-scratch" / "data.txt").write_text("keep")
    with pytest.raises(SystemExit):
        fresh_dir(made)
    assert (tmp_path / "io-scratch" / "data.txt").read_text() == "keep"

