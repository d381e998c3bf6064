"""``StatesnapTrainer``: a real ``transformers.Trainer`` on a tiny LlamaForCausalLM built from a
config (``tests/integrations/hf_train.py``) checkpoints every 3 steps, is SIGKILLed at step 6
with that checkpoint in flight, resumes with ``resume_from_checkpoint=True``, and logs the same
losses and ends with the same parameters as a run never killed, bit for bit, which is also the
stock Trainer's run. The final model exports as ``save_pretrained`` does."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import statesnap as ss
from statesnap.integrations.transformers import STORE_DIR, pointer_target

SCRIPT = os.path.join(os.path.dirname(__file__), "integrations", "hf_train.py")


def _run(out, *args, killed=False):
    env = {**os.environ, "PYTHONPATH": os.path.dirname(SCRIPT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, SCRIPT, str(out), *args], env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == (-9 if killed else 0), done.stderr[-3000:]


def _read(out, name):
    with open(out / name) as f:
        return {int(k): v for k, v in json.load(f).items()}


def _assert_same_parameters(a, b):
    first, second = torch.load(a / "final.pt"), torch.load(b / "final.pt")
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name


def test_killed_trainer_resumes_bit_exact_and_keeps_what_save_total_limit_says(tmp_path):
    ours, stock, killed = tmp_path / "ours", tmp_path / "stock", tmp_path / "killed"
    _run(ours)
    _run(stock, "--trainer", "hf")
    assert _read(ours, "losses.json") == _read(stock, "losses.json")  # the snapshots change nothing
    _assert_same_parameters(ours, stock)

    _run(killed, "--kill-at", "6", killed=True)
    _run(killed, "--resume")
    expected, resumed = _read(ours, "losses.json"), _read(killed, "losses-resumed.json")
    assert min(resumed) in (4, 7) and max(resumed) == max(expected)  # from step 3 or 6
    assert resumed == {step: expected[step] for step in resumed}
    _assert_same_parameters(ours, killed)

    for out in (ours, killed):  # save_total_limit=2: two checkpoint-N, each naming a stored step
        run = out / "run"
        pointers = sorted(n for n in os.listdir(run) if n.startswith("checkpoint-"))
        assert pointers == ["checkpoint-10", "checkpoint-9"]
        targets = {os.path.basename(pointer_target(str(run / n))) for n in pointers}
        assert targets == {n for n in os.listdir(run / STORE_DIR) if n.startswith("step-")} == {"step-9", "step-10"}
        assert (run / "checkpoint-10" / "trainer_state.json").exists()
        assert not [n for n in os.listdir(run) if ".tmp-" in n]


def test_export_pretrained_loads_with_from_pretrained(tmp_path):
    from transformers import LlamaForCausalLM, TrainingArguments

    from statesnap.integrations.transformers import StatesnapTrainer, export_pretrained

    hf_train = _hf_train()

    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=2, save_steps=2, report_to=[],
                             use_cpu=True, per_device_train_batch_size=4, disable_tqdm=True)
    trainer = StatesnapTrainer(model=hf_train.model(), args=args, train_dataset=hf_train.Tokens(),
                               statesnap_settings={"host_memory_gb": 0.05})
    trainer.train()
    export_pretrained(trainer, str(tmp_path / "run" / "checkpoint-2"), str(tmp_path / "export"))
    assert {"config.json", "model.safetensors"} <= set(os.listdir(tmp_path / "export"))
    exported = LlamaForCausalLM.from_pretrained(tmp_path / "export")
    tokens = hf_train.Tokens().ids[:2]
    with torch.no_grad():
        assert torch.equal(exported(tokens).logits, trainer.model(tokens).logits)
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(exported.state_dict()[name], value), name

    # A model of another shape is refused, not exported half loaded (or not at all) from the
    # checkpoint; so is one of fewer layers, which loaded the layers it had. The advice is one the
    # Trainer's user can follow: it has no strict=False.
    config = trainer.model.config.to_dict()
    for change, problem in (({"hidden_size": 64}, "shape/dtype mismatch"),
                            ({"num_hidden_layers": 1}, r"unexpected in checkpoint \(9\): model.model.layers.1\.")):
        model = LlamaForCausalLM(type(trainer.model.config).from_dict({**config, **change}))
        other = StatesnapTrainer(model=model, args=args, train_dataset=hf_train.Tokens(),
                                 statesnap_settings={"host_memory_gb": 0.05})
        with pytest.raises(ss.StateMismatchError, match=problem) as caught:
            export_pretrained(other, str(tmp_path / "run" / "checkpoint-2"), str(tmp_path / "export-other"))
        assert "into the model it was saved from" in str(caught.value)
        assert "Pass strict=False" not in str(caught.value)
        with pytest.raises(ss.StateMismatchError, match=problem):
            other._load_from_checkpoint(str(tmp_path / "run" / "checkpoint-2"))  # the model's part of a resume
    assert not os.path.exists(tmp_path / "export-other")


def test_an_unreadable_pointer_keeps_every_step_no_readable_pointer_names(tmp_path, caplog):
    """A restarted StatesnapTrainer deletes the stored steps no checkpoint-N names (committed just
    before a crash) unless a checkpoint-N's pointer cannot be read: its step must not go."""
    from statesnap.integrations.pointers import pointer_bytes
    from statesnap.integrations.transformers import POINTER_FORMAT, POINTER_NAME, _unnamed_steps

    for step in (1, 2, 3):
        os.makedirs(tmp_path / STORE_DIR / f"step-{step}")
    os.makedirs(tmp_path / "checkpoint-1")
    (tmp_path / "checkpoint-1" / POINTER_NAME).write_bytes(pointer_bytes(POINTER_FORMAT, f"{STORE_DIR}/step-1"))
    assert _unnamed_steps(str(tmp_path)) == [2, 3]
    os.makedirs(tmp_path / "checkpoint-2")
    (tmp_path / "checkpoint-2" / POINTER_NAME).write_bytes(pointer_bytes(POINTER_FORMAT, f"{STORE_DIR}/step-2")[:-5])
    with caplog.at_level("WARNING", logger="statesnap"):
        assert _unnamed_steps(str(tmp_path)) == []
    assert "checkpoint-2/statesnap.json cannot be read" in caplog.text


def test_a_damaged_pointer_is_named_when_resuming(tmp_path):
    from statesnap.integrations.transformers import POINTER_NAME

    os.makedirs(tmp_path / "checkpoint-2")
    (tmp_path / "checkpoint-2" / POINTER_NAME).write_bytes(b'{"format": "statesnap-hf')
    with pytest.raises(ss.CheckpointError, match=f"checkpoint-2/{POINTER_NAME} is damaged"):
        pointer_target(str(tmp_path / "checkpoint-2"))
    assert pointer_target(str(tmp_path / "elsewhere")) is None  # a directory the stock Trainer wrote


@pytest.mark.parametrize("damage, says", [
    ("fifo", "is a FIFO"), ("device", "is a character device"), ("directory", "cannot be read"),
    ("nested", "is damaged"), ("huge", "larger than any statesnap pointer")])
def test_a_pointer_that_is_no_small_file_is_refused_not_waited_on_or_read_forever(tmp_path, damage, says):
    """A FIFO where a checkpoint-N's pointer was made the Trainer wait forever (at resume, and at
    every commit, which reads every pointer); a link to a device was read to its end (/dev/zero:
    until memory ran out); JSON nested 100,000 deep raised a RecursionError and a directory an
    IsADirectoryError; a file of any size was read whole. Each is now a damaged pointer named by
    its path, and the steps no readable pointer names are kept."""
    from statesnap.integrations.pointers import pointer_bytes
    from statesnap.integrations.transformers import POINTER_FORMAT, POINTER_NAME, _unnamed_steps

    os.makedirs(tmp_path / STORE_DIR / "step-1")
    pointer = tmp_path / "checkpoint-1" / POINTER_NAME
    os.makedirs(pointer.parent)
    if damage == "fifo":
        os.mkfifo(pointer)
    elif damage == "device":
        os.symlink("/dev/null", pointer)  # (/dev/zero, read whole, would take all memory)
    elif damage == "directory":
        os.mkdir(pointer)
    elif damage == "nested":
        pointer.write_bytes(b'{"format":' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    else:
        pointer.write_bytes(pointer_bytes(POINTER_FORMAT, f"{STORE_DIR}/step-1") + b" " * (2 << 20))
    with pytest.raises(ss.CheckpointError, match=f"checkpoint-1/{POINTER_NAME}.*{says}"):
        pointer_target(str(tmp_path / "checkpoint-1"))
    assert _unnamed_steps(str(tmp_path)) == []


def _hf_train():
    sys.path.insert(0, os.path.dirname(SCRIPT))
    try:
        import hf_train
    finally:
        sys.path.pop(0)
    return hf_train


@pytest.mark.parametrize("kind", ["best model at end", "best model at end, the last", "save_only_model resume"])
def test_trainer_options_behave_as_the_stock_trainers(tmp_path, kind):
    """``load_best_model_at_end`` ends with the best checkpoint's model, which rotation keeps,
    also when the best is the last checkpoint, still in flight when training ends (that used to
    raise FileNotFoundError with ``save_total_limit=1``), and a ``save_only_model`` run resumes
    with a fresh optimizer: as the stock Trainer does."""
    from transformers import Trainer, TrainingArguments

    from statesnap.integrations.transformers import StatesnapTrainer

    hf_train = _hf_train()
    finals, kept = {}, {}
    for cls in (Trainer, StatesnapTrainer):
        out = tmp_path / cls.__name__
        common = dict(output_dir=str(out), save_steps=2, report_to=[], use_cpu=True, per_device_train_batch_size=4,
                      disable_tqdm=True, learning_rate=1e-2, seed=0)
        extra = {"statesnap_settings": {"host_memory_gb": 0.05}} if cls is StatesnapTrainer else {}
        if kind.startswith("best model at end"):  # highest eval loss: the first evaluation's; lowest: the last
            first = kind == "best model at end"
            args = TrainingArguments(max_steps=6, eval_steps=2, eval_strategy="steps", save_total_limit=1,
                                     load_best_model_at_end=True, metric_for_best_model="loss",
                                     greater_is_better=first, **common)
            trainer = cls(model=hf_train.model(), args=args, train_dataset=hf_train.Tokens(),
                          eval_dataset=hf_train.Tokens(n=8), **extra)
            trainer.train()
            assert trainer.state.best_model_checkpoint == str(out / ("checkpoint-2" if first else "checkpoint-6"))
        else:
            first = TrainingArguments(max_steps=2, save_only_model=True, **common)
            cls(model=hf_train.model(), args=first, train_dataset=hf_train.Tokens(), **extra).train()
            args = TrainingArguments(max_steps=4, save_only_model=True, **common)
            trainer = cls(model=hf_train.model(), args=args, train_dataset=hf_train.Tokens(), **extra)
            trainer.train(resume_from_checkpoint=True)
        finals[cls] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        kept[cls] = sorted(n for n in os.listdir(out) if n.startswith("checkpoint-"))
    assert kept[Trainer] == kept[StatesnapTrainer]
    for name, value in finals[Trainer].items():
        assert torch.equal(finals[StatesnapTrainer][name], value), name


def test_a_checkpoint_directory_that_cannot_be_made_is_raised(tmp_path, monkeypatch):
    """Making ``checkpoint-N`` after the commit (the disk full) failed only in a log line, and
    the next commit deleted the step no ``checkpoint-N`` named: now a later save (the first
    after that commit) or the end of ``train`` raises it, and the step stays stored."""
    import errno

    from transformers import TrainingArguments

    from statesnap.integrations import transformers as integration

    hf_train = _hf_train()
    real = integration._make_pointer_dir

    def full_disk_at_step_4(final, step, trainer_state):
        if step == 4:
            raise OSError(errno.ENOSPC, "No space left on device", final)
        real(final, step, trainer_state)
    monkeypatch.setattr(integration, "_make_pointer_dir", full_disk_at_step_4)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=8, save_steps=2, report_to=[], use_cpu=True,
                             per_device_train_batch_size=4, disable_tqdm=True, seed=0)
    trainer = integration.StatesnapTrainer(model=hf_train.model(), args=args, train_dataset=hf_train.Tokens(),
                                           statesnap_settings={"host_memory_gb": 0.05})
    with pytest.raises(ss.CheckpointError, match="checkpoint-4 could not be made .*No space left.*free space there"):
        trainer.train()
    made = sorted(n for n in os.listdir(tmp_path) if n.startswith("checkpoint-"))
    assert "checkpoint-2" in made and "checkpoint-4" not in made  # (step 6 may have been saved before 4 committed)
    assert "step-4" in os.listdir(tmp_path / "statesnap")


def test_a_second_job_on_the_output_directory_is_refused_before_its_first_step(tmp_path):
    """A second StatesnapTrainer on a directory another one trains in was refused only at its first
    save, after up to save_steps steps of training: now at once, and the first trains on unharmed."""
    from transformers import TrainerCallback, TrainingArguments

    from statesnap.integrations.transformers import StatesnapTrainer
    from statesnap.storage.lock import RootBusyError

    hf_train = _hf_train()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, save_steps=2, report_to=[], use_cpu=True,
                             per_device_train_batch_size=4, disable_tqdm=True, seed=0)
    second = StatesnapTrainer(model=hf_train.model(), args=args, train_dataset=hf_train.Tokens(),
                              statesnap_settings={"host_memory_gb": 0.05})
    refused = []

    class StartTheSecond(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:  # the first job's store is claimed, nothing saved yet
                with pytest.raises(RootBusyError, match="another Checkpointer in this process"):
                    second.train()
                refused.append(second.state.global_step)

    first = StatesnapTrainer(model=hf_train.model(), args=args, train_dataset=hf_train.Tokens(),
                             callbacks=[StartTheSecond()], statesnap_settings={"host_memory_gb": 0.05})
    first.train()
    assert refused == [0]
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("checkpoint-")) == ["checkpoint-2", "checkpoint-4"]
    assert {"step-2", "step-4"} <= set(os.listdir(tmp_path / STORE_DIR))


def test_a_pointer_to_a_step_that_is_gone_is_named_with_the_step(tmp_path):
    """``checkpoint-2/statesnap.json`` naming a deleted ``statesnap/step-2`` said only 'no checkpoint
    at .../statesnap/step-2'; the pointer that led there is named too."""
    from transformers import TrainingArguments

    from statesnap.integrations.transformers import POINTER_NAME, StatesnapTrainer

    hf_train = _hf_train()

    def trainer(steps):
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=steps, save_steps=2, report_to=[],
                                 use_cpu=True, per_device_train_batch_size=4, disable_tqdm=True, seed=0)
        return StatesnapTrainer(model=hf_train.model(), args=args, train_dataset=hf_train.Tokens(),
                                statesnap_settings={"host_memory_gb": 0.05})
    trainer(2).train()
    shutil.rmtree(tmp_path / STORE_DIR / "step-2")
    with pytest.raises(ss.CheckpointError, match=f"checkpoint-2/{POINTER_NAME} names .*/{STORE_DIR}/step-2, which "
                                                 "is not there"):
        trainer(4).train(resume_from_checkpoint=True)


def test_the_gradient_scaler_is_saved_and_restored_as_the_stock_trainers(tmp_path):
    """fp16 on a GPU gives the Trainer's accelerator a GradScaler, whose loss scale grows and backs
    off at overflows; the stock Trainer saves it (``scaler.pt``) and restores it on resume. A
    StatesnapTrainer saved no scaler: its resumed run started again from the initial scale, and
    skipped other steps at overflows than the run it continued. (A CPU GradScaler stands in for
    fp16's, growing at every step, so that this runs without a GPU.) A checkpoint of a run without
    a scaler resumes with the scaler as it is, and one with a scaler resumes in a run without one."""
    from transformers import Trainer, TrainingArguments

    from statesnap.integrations.transformers import StatesnapTrainer

    hf_train = _hf_train()

    def trainer(cls, out, steps, scaler=True):
        args = TrainingArguments(output_dir=str(tmp_path / out), max_steps=steps, save_steps=2, report_to=[],
                                 use_cpu=True, per_device_train_batch_size=4, disable_tqdm=True, learning_rate=1e-2,
                                 seed=0)
        extra = {"statesnap_settings": {"host_memory_gb": 0.05}} if cls is StatesnapTrainer else {}
        made = cls(model=hf_train.model(), args=args, train_dataset=hf_train.Tokens(), **extra)
        if scaler:  # set before train() prepares the optimizer, which steps through it
            made.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 120, growth_interval=1)
        return made

    resumed = {}
    for cls in (Trainer, StatesnapTrainer):
        first = trainer(cls, cls.__name__, 2)
        first.train()
        assert first.accelerator.scaler.get_scale() != 2.0 ** 120
        resumed[cls] = trainer(cls, cls.__name__, 4)
        resumed[cls].train(resume_from_checkpoint=True)
    assert resumed[StatesnapTrainer].accelerator.scaler.state_dict() == resumed[Trainer].accelerator.scaler.state_dict()
    for name, value in resumed[Trainer].model.state_dict().items():
        assert torch.equal(resumed[StatesnapTrainer].model.state_dict()[name], value), name

    without = trainer(StatesnapTrainer, "without", 2, scaler=False)
    without.train()
    fresh = trainer(StatesnapTrainer, "without", 4)
    fresh.train(resume_from_checkpoint=True)  # the scaler stays as it is, as the stock Trainer's does
    assert fresh.state.global_step == 4
    no_scaler = trainer(StatesnapTrainer, StatesnapTrainer.__name__, 6, scaler=False)
    no_scaler.train(resume_from_checkpoint=True)  # its scaler is left, the rest restored
    assert no_scaler.state.global_step == 6


def _train_and_resume_on_ranks(rank, world_size, root):
    from transformers import TrainingArguments

    from statesnap.integrations.transformers import StatesnapTrainer

    hf_train = _hf_train()

    def trainer(out, steps):
        args = TrainingArguments(output_dir=os.path.join(root, out), max_steps=steps, save_steps=2, report_to=[],
                                 use_cpu=True, per_device_train_batch_size=4, disable_tqdm=True, seed=0,
                                 ddp_backend="gloo")
        return StatesnapTrainer(model=hf_train.model(), args=args, train_dataset=hf_train.Tokens(),
                                statesnap_settings={"host_memory_gb": 0.05})
    whole = trainer("whole", 4)
    whole.train()
    resumed = trainer("whole", 4)  # (its step 4 is saved again)
    resumed.train(resume_from_checkpoint=os.path.join(root, "whole", "checkpoint-2"))
    return ({k: v.clone() for k, v in whole.model.state_dict().items()},
            {k: v.clone() for k, v in resumed.model.state_dict().items()})


def test_a_ddp_run_commits_its_checkpoints_and_resumes_bit_exact(tmp_path):
    """On 2 ranks no checkpoint was ever committed: the TrainerState stored with each step differs
    between the ranks (``is_world_process_zero``, ...), and a plain value that ranks hold under
    one name is compared and refused when it differs. The main process's state is stored now (the
    stock Trainer writes the main process's ``trainer_state.json``), and a resume from step 2 ends
    as the run never stopped did, on both ranks."""
    sys.path.insert(0, os.path.dirname(__file__))
    try:
        from dist_utils import run_ranks
    finally:
        sys.path.pop(0)
    results = run_ranks(2, _train_and_resume_on_ranks, str(tmp_path))
    for whole, resumed in results:
        for name, value in whole.items():
            assert torch.equal(resumed[name], value), name
    assert sorted(n for n in os.listdir(tmp_path / "whole") if n.startswith("checkpoint-")) == \
        ["checkpoint-2", "checkpoint-4"]
