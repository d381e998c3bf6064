"""Settings every test process shares, so that values compared bit for bit are computed alike.

Tests compare values computed in the pytest process with values computed in the processes they
start (gloo ranks through ``dist_utils.run_ranks``, demo workers, saving children), and values a
test computed with values a fixture computed earlier in the same process, possibly with other
tests (other modules, under xdist) run in between. Torch splits reductions and matrix products
by its intra-op thread count, whose default is the machine's core count; so every process runs
with one intra-op and one inter-op thread: the pytest process (here, for every xdist worker too),
the ranks (``dist_utils``), and the subprocesses tests start (through the environment they
inherit). A test that changes the thread count cannot leak it into the next one.
"""
import pytest
import torch

from dist_utils import pin_threads

pin_threads()


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: ignored where xdist is not installed
def pytest_xdist_make_scheduler(config, log):
    """Under ``-n`` with the default distribution (``load``), a module's tests stay on one worker:
    its module-scoped fixtures (DeepSpeed, Megatron and UCP producer runs, tens of seconds each)
    are then made once instead of once per worker that runs some of its tests."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadFileScheduling

    return LoadFileScheduling(config, log)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
