"""What users expect of a library: a quick import that loads heavy modules only when used, a
``--help`` that needs no torch, and names that stay what DESIGN.md promises."""
import subprocess
import sys

HEAVY = ("torch", "matplotlib", "torch.distributed.checkpoint", "safetensors", "statesnap.convert")


def loaded_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"import sys\n{code}\nprint(' '.join(sys.modules))"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_import_statesnap_loads_no_heavy_module():
    assert not loaded_after("import statesnap").intersection(HEAVY)


def test_help_needs_no_torch():
    code = "from statesnap import cli\nimport contextlib, io\nwith contextlib.redirect_stdout(io.StringIO()):\n" \
           "    assert cli.main(['--help']) == 0"
    assert not loaded_after(code).intersection(HEAVY)


def test_public_names_resolve_and_convert_stays_the_function_after_its_subpackage_is_imported():
    code = ("from statesnap.convert import megatron\nimport statesnap as ss\nfrom statesnap.convert.api import convert\n"
            "assert ss.convert is convert and callable(ss.export)\n"
            "for name in ss.__all__:\n    assert getattr(ss, name) is not None, name\n"
            "from statesnap import Checkpointer, CheckpointError, open, save, load, CommitRecord\n"
            "assert issubclass(ss.ReshardError, CheckpointError) and 'save' in dir(ss)")
    loaded_after(code)


def test_blocking_save_and_load_show_a_bar_when_asked_and_stay_quiet_otherwise(tmp_path, capsys, monkeypatch):
    import torch

    import statesnap as ss
    from statesnap import progress

    state = {"w": torch.arange(300_000, dtype=torch.float32)}
    ss.save(state, tmp_path / "quiet")  # not a terminal: nothing
    ss.load({"w": torch.empty(300_000)}, tmp_path / "quiet")
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: True, raising=False)
    ss.save(state, tmp_path / "short")  # a terminal, but done before the bar's delay: nothing
    assert capsys.readouterr().err == ""
    ss.save(state, tmp_path / "shown", progress=True)
    target = {"w": torch.empty(300_000)}
    ss.load(target, tmp_path / "shown", progress=True)
    err = capsys.readouterr().err
    assert "save -> shown" in err and "load <- shown" in err and "1.14M" in err  # 1.2 MB = 1.14 MiB, both ways
    assert torch.equal(target["w"], state["w"])
