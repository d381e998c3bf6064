"""What a failed strict load advises: the option that does what the caller most likely meant."""
import pytest
import torch
import torch.nn as nn

import statesnap as ss


def saved_training(path):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    ss.save({"model": model, "optim": optim}, path)
    return model


def test_loading_the_model_alone_from_a_model_and_optimizer_checkpoint_advises_partial(tmp_path):
    """``ss.load({"model": model}, path)`` of a model + optimizer checkpoint advised only
    ``strict=False``, which also skips model tensors that do not match; ``partial=True`` is the
    option that loads a part and still checks it (README, Quick start)."""
    saved_training(tmp_path / "c")
    target = nn.Linear(4, 2)
    with pytest.raises(ss.StateMismatchError, match=r"Pass partial=True .*\(model\), or strict=False") as caught:
        ss.load({"model": target}, tmp_path / "c")
    assert caught.value.missing == [] and caught.value.mismatched == []
    ss.load({"model": target}, tmp_path / "c", partial=True)


def test_a_mismatch_under_the_states_own_keys_still_advises_strict_false(tmp_path):
    """partial=True would refuse these too: a model of another size, a key the checkpoint lacks."""
    saved_training(tmp_path / "c")
    for state in ({"model": nn.Linear(4, 3)}, {"net": nn.Linear(4, 2)}):
        with pytest.raises(ss.StateMismatchError) as caught:
            ss.load(state, tmp_path / "c")
        assert "partial=True" not in str(caught.value) and "Pass strict=False" in str(caught.value)
