"""The demo's promise: a training process killed with SIGKILL resumes from the newest committed
checkpoint and continues the loss curve bit for bit, as if it had never been interrupted."""
from statesnap import cli
from statesnap.demo import run_demo, summary
from statesnap.demo.gpt import GPTConfig, batch, build, train_step

TINY = GPTConfig(vocab=64, d_model=64, n_layer=1, seq_len=16, batch=4)


def test_kill_and_resume_continues_the_loss_curve_bit_for_bit(tmp_path):
    result = run_demo(str(tmp_path), steps=12, kill_after=7, persist_every=3, cfg=TINY, echo=False)
    interrupted, resumed, reference = result.interrupted, result.resumed, result.reference
    assert interrupted.killed_after >= 7 and interrupted.digest is None  # really killed mid-run
    # The restart resumed from a persisted step no later than the kill, and trained to the end.
    assert resumed.resumed is not None and resumed.resumed % 3 == 0 and resumed.level == "persistent"
    assert 3 <= resumed.resumed <= interrupted.killed_after
    assert sorted(resumed.losses) == list(range(resumed.resumed + 1, 13))
    assert reference.resumed is None and sorted(reference.losses) == list(range(1, 13))
    # Bit-exact continuation: losses compared as exact float hex strings, state by SHA-256.
    for step, loss in resumed.losses.items():
        assert loss == reference.losses[step], f"step {step}"
    for step, loss in interrupted.losses.items():
        assert loss == reference.losses[step], f"step {step}"
    assert resumed.digest == reference.digest
    assert result.losses_match and result.state_matches and result.ok
    text = summary(result, 3)
    assert "bit for bit: yes" in text and "NO" not in text


def test_training_is_deterministic_and_learns():
    """The demo's comparison is meaningful only if the same steps give the same bits, and a
    falling loss shows the model really trains."""
    runs = []
    for _ in range(2):
        model, optim = build(TINY)
        runs.append([train_step(model, optim, batch(TINY, step)) for step in range(1, 31)])
    assert runs[0] == runs[1]
    assert sum(runs[0][-5:]) < sum(runs[0][:5])


def test_demo_command_succeeds(tmp_path, capsys):
    assert cli.main(["demo", "--steps", "6", "--kill-after", "3", "--persist-every", "2",
                     "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "SIGKILL after step" in out and "resumed from the newest committed checkpoint" in out
    assert out.count("bit for bit: yes") == 2


def test_demo_refuses_settings_and_roots_it_cannot_run_with(tmp_path, capsys):
    """A second demo in one ``--root`` resumed from the first one's checkpoints, so the run to be
    killed never trained, and the summary failed with an IndexError; a ``--persist-every 0`` or a
    file as the root ended in tracebacks. Each is a usage error now (exit 2), before any training."""
    (tmp_path / "root" / "run" / "step-6").mkdir(parents=True)
    (tmp_path / "file").write_text("x")
    for args, words in [(["--root", str(tmp_path / "root")], "already holds an earlier demo's checkpoints (run/)"),
                        (["--persist-every", "0"], "--persist-every must be at least 1"),
                        (["--root", str(tmp_path / "file")], "is not a directory")]:
        try:
            cli.main(["demo", *args])
        except SystemExit as exc:
            assert exc.code == 2, args
        else:
            raise AssertionError(f"demo ran with {args}")
        assert words in capsys.readouterr().err
