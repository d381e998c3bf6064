"""statesnap against a real S3 API server (moto's, on loopback), through a proxy that can fail it.

Every test talks to S3 through a fresh :class:`s3_server.FaultProxy` (its request log shows the
parts, ranges and order; it injects 503s and dies on demand); ``direct`` options reach moto
without the proxy, to look at what was stored after the proxy died.
"""
import importlib
import logging
import uuid

import pytest
import s3fs
import torch

import statesnap as ss
from dist_utils import run_ranks
from s3_server import FaultProxy
from statesnap.bench.s3_server import CREDENTIALS, REGION, MotoServer, ShapedLink
from statesnap.cli import main as cli_main
from statesnap.storage import s3_upload
from statesnap.storage.lock import RootBusyError

MiB = 1 << 20
BUCKET = "statesnap-test"
PART = 5 * MiB  # S3's smallest part: a few MiB of tensor make several


@pytest.fixture(scope="module")
def moto():
    with MotoServer() as server:
        server.create_bucket(BUCKET)
        yield server


@pytest.fixture
def proxy(moto):
    proxy = FaultProxy(moto.port)
    yield proxy
    proxy.close()


def options(server, **extra) -> dict:
    """Options for s3fs through ``server`` (the proxy or moto itself): fast retries, 5 MiB parts.
    skip_instance_cache: each test's proxy is a new endpoint, and a cached client keeps its pool."""
    return {**CREDENTIALS, "endpoint_url": server.endpoint, "client_kwargs": {"region_name": REGION},
            "skip_instance_cache": True, "retry_backoff_s": 0.01, "default_block_size": PART, **extra}


def fresh_url(name: str) -> str:
    return f"s3://{BUCKET}/{name}-{uuid.uuid4().hex[:8]}"


def make_state(seed: int, big: int = 3 * 1_500_000) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"big": torch.randn(big, generator=gen),  # 18 MB: four parts of 5 MiB
            "small": torch.randint(0, 1000, (7, 13), generator=gen), "step": seed, "name": f"run-{seed}"}


def zeros_like(state: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()}


def assert_same(loaded: dict, state: dict) -> None:
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key].view(torch.uint8),
                                                                    value.view(torch.uint8)), key
        else:
            assert loaded[key] == value, key


def key_of(url: str) -> str:
    return "/" + url[len("s3://"):]


def test_save_load_multipart_parts_in_parallel_ranged_reads_in_parallel(proxy):
    url, state = fresh_url("one"), make_state(1)
    proxy.hold(lambda r: r.is_part, count=2)  # two parts on the wire at once, or the barrier breaks
    ss.save(state, url, storage_options=options(proxy))
    writes = [r for r in proxy.requests if r.is_write and r.path.startswith(key_of(url))]
    parts = [r for r in writes if r.is_part]
    data = {r.path for r in parts}
    assert len(data) == 1 and sorted(int(r.query["partNumber"][0]) for r in parts) == [1, 2, 3, 4]
    assert not proxy.broken
    completes = [i for i, r in enumerate(writes) if r.method == "POST" and "uploadId" in r.query]
    assert len(completes) == 1
    assert writes[-1].path.endswith("/manifest.json") and writes[-1].method == "PUT"  # the commit marker, last
    assert completes[0] < len(writes) - 1

    before = len(proxy.requests)
    proxy.hold(lambda r: r.method == "GET" and "Range" in r.headers, count=2)
    loaded = zeros_like(state)
    ss.load(loaded, url, storage_options=options(proxy))
    assert_same(loaded, state)
    assert not proxy.broken
    ranges = [r.headers["Range"] for r in proxy.requests[before:] if r.method == "GET" and r.path in data]
    assert len(ranges) > 1 and len(set(ranges)) == len(ranges)  # the file read by ranges, each once


def test_parts_grow_so_that_large_files_stay_within_the_part_limit(proxy, monkeypatch):
    """Parts double every PARTS_PER_SIZE parts (S3 takes at most 10,000 per upload); here every 2."""
    monkeypatch.setattr(s3_upload, "PARTS_PER_SIZE", 2)
    url, state = fresh_url("grow"), make_state(6, big=6 * MiB)  # 24 MiB
    ss.save(state, url, storage_options=options(proxy))
    parts = sorted((int(r.query["partNumber"][0]), int(r.headers["Content-Length"]))
                   for r in proxy.requests if r.is_part)
    sizes = [size for _, size in parts]
    assert sizes[:3] == [PART, PART, 2 * PART] and sum(sizes) >= 24 * MiB and len(sizes) == 4
    loaded = zeros_like(state)
    ss.load(loaded, url, storage_options=options(proxy))
    assert_same(loaded, state)


def test_checkpointer_steps_on_s3_load_latest_and_verify_cli(proxy, moto, monkeypatch, capsys):
    root = fresh_url("run")
    with ss.Checkpointer(root, keep_last=2, storage_options=options(proxy)) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, make_state(step, big=300_000)).wait()
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **moto.storage_options())
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root[len("s3://"):]) if "step-" in p) == ["step-2", "step-3"]
    with ss.Checkpointer(root, storage_options=options(proxy)) as ckpt:
        loaded = zeros_like(make_state(3, big=300_000))
        assert ckpt.load_latest(loaded) == 3
    assert_same(loaded, make_state(3, big=300_000))

    # the command line reaches S3 through boto's environment variables
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto.endpoint)
    assert cli_main(["verify", f"{root}/step-3"]) == 0
    assert "step-3" in capsys.readouterr().out


def test_throttling_and_5xx_are_retried_with_backoff(proxy, caplog):
    url, state = fresh_url("retry"), make_state(2)
    proxy.fail(lambda r: r.is_part, times=2)  # 503 SlowDown
    proxy.fail(lambda r: r.path.endswith("/manifest.json") and r.method == "PUT", times=1, status=500,
               code="InternalError")
    proxy.fail(lambda r: r.method == "GET" and "Range" in r.headers, times=2, code="ServiceUnavailable")
    with caplog.at_level(logging.WARNING, logger="statesnap"):
        ss.save(state, url, storage_options=options(proxy))
        loaded = zeros_like(state)
        ss.load(loaded, url, storage_options=options(proxy))
    assert_same(loaded, state)
    retries = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
    assert sum("upload_part" in m and "SlowDown" in m for m in retries) == 2
    assert sum("manifest.json" in m and "InternalError" in m for m in retries) == 1
    assert sum("reading bytes" in m and "ServiceUnavailable" in m for m in retries) == 2
    manifest_puts = [r for r in proxy.requests if r.path.endswith("/manifest.json") and r.method == "PUT"]
    assert len(manifest_puts) == 2  # the failed one and its retry


def test_retry_waits_leave_the_global_python_rng_alone(proxy):
    """The jitter of a retry's wait was drawn from the global ``random``: every retried request
    consumed the training's Python RNG (its shuffles and augmentations then differed from a run
    whose storage did not throttle), and ranks that seeded ``random`` alike waited alike."""
    import random
    url = fresh_url("rng")
    proxy.fail(lambda r: r.is_write, times=2, code="SlowDown")
    random.seed(5)
    before = random.getstate()
    ss.save({"x": torch.arange(10)}, url, storage_options=options(proxy))
    assert sum(r.method == "PUT" for r in proxy.requests) >= 3  # the two failed writes were retried
    assert random.getstate() == before


def test_processes_forked_from_one_parent_draw_different_retry_waits():
    """The jitter's own generator was not seeded again in a forked child (the global ``random``
    is): ranks forked from one process (multiprocessing's default start on Linux) all drew the
    parent's next waits, so ranks throttled together came back together, what the jitter is for."""
    import os
    import pickle

    from statesnap.storage import retry

    policy, throttled = retry.RetryPolicy(backoff_s=1.0), OSError("SlowDown")
    throttled.response = {"Error": {"Code": "SlowDown"}}
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # (the child writes its waits and leaves at once, whatever happens)
        try:
            os.write(writer, pickle.dumps([policy._wait_after("put", throttled, 3) for _ in range(4)]))
        finally:
            os._exit(0)
    os.close(writer)
    with os.fdopen(reader, "rb") as pipe:
        child = pickle.loads(pipe.read())
    os.waitpid(pid, 0)
    parent = [policy._wait_after("put", throttled, 3) for _ in range(4)]
    assert len(child) == 4 and child != parent


def test_a_completion_whose_answer_was_lost_is_not_failed_by_its_retry(proxy, caplog):
    """The store completed the upload but the answer never came (a read timeout), and the retry
    finds the upload gone (moto answers such a retry as a success, as S3 does for a while; other
    stores say NoSuchUpload): the object, with the ETag of these parts, is taken as completed."""
    url, state = fresh_url("lost"), make_state(5)
    completion = lambda r: r.method == "POST" and "uploadId" in r.query  # noqa: E731
    proxy.lose_answers(completion, times=1)
    proxy.fail(completion, times=1, status=404, code="NoSuchUpload")
    with caplog.at_level(logging.WARNING, logger="statesnap"):
        ss.save(state, url, storage_options=options(proxy))
    assert sum("complete_multipart_upload" in r.getMessage() for r in caplog.records) == 1  # one retry
    loaded = zeros_like(state)
    ss.load(loaded, url, storage_options=options(proxy))
    assert_same(loaded, state)


def test_retries_are_bounded(proxy):
    url = fresh_url("bounded")
    proxy.fail(lambda r: r.is_write, times=1000, code="SlowDown")
    with pytest.raises(ss.CheckpointError, match=r"data-.*SlowDown \(HTTP 503\)"):
        ss.save({"x": torch.arange(10)}, url, storage_options=options(proxy, retries=3))
    puts = [r.path.rsplit("/", 1)[-1][:5] for r in proxy.requests if r.method == "PUT"]
    assert puts == ["data-"] * 3  # the data file's PUT, tried three times


def test_server_dying_mid_upload_fails_cleanly_and_keeps_the_earlier_checkpoint(proxy, moto):
    root = fresh_url("dies")
    first, second = make_state(3), make_state(4)
    ss.save(first, f"{root}/step-1", storage_options=options(proxy))
    proxy.die_at(lambda r: r.is_part and r.path.startswith(key_of(f"{root}/step-2"))
                 and r.query["partNumber"] == ["3"])
    with pytest.raises(ss.CheckpointError) as failure:
        ss.save(second, f"{root}/step-2", storage_options=options(proxy, retries=3))
    assert "data-" in str(failure.value) and "step-2" in str(failure.value)  # names the file
    assert proxy.dead
    direct = options(moto)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **moto.storage_options())
    assert not fs.exists(f"{root}/step-2/manifest.json"[len("s3://"):])  # nothing committed
    with pytest.raises(ss.CheckpointError):
        ss.load(zeros_like(second), f"{root}/step-2", storage_options=direct)
    loaded = zeros_like(first)
    ss.load(loaded, f"{root}/step-1", storage_options=direct)
    assert_same(loaded, first)


def test_storage_outage_during_a_checkpointer_run(proxy, moto):
    """The step written while the store is gone fails (a CheckpointError naming the file, at
    ``wait``), ``close`` returns, and the next job restores the step before it, bit exact; it
    takes over the root, whose lease the dead store kept."""
    root = fresh_url("outage")
    ckpt = ss.Checkpointer(root, storage_options=options(proxy, retries=3))
    ckpt.save(1, make_state(1, big=300_000)).wait()
    proxy.die_at(lambda r: r.method == "PUT" and "/step-2/" in r.path)
    handle = ckpt.save(2, make_state(2, big=300_000))
    with pytest.raises(ss.CheckpointError, match=r"step-2/data-"):
        handle.wait()
    ckpt.close()
    with pytest.raises(RootBusyError):
        ss.Checkpointer(root, storage_options=options(moto))
    with ss.Checkpointer(root, storage_options=options(moto), take_over=True) as ckpt:
        loaded = zeros_like(make_state(1, big=300_000))
        assert ckpt.load_latest(loaded) == 1
    assert_same(loaded, make_state(1, big=300_000))


def test_the_bench_shaped_link_carries_requests_unchanged(moto):
    """bench --suite s3 --link-mb-s sends its requests through this TCP proxy (no timing checked)."""
    link = ShapedLink(moto.port, mb_per_s=1000)
    try:
        url, state = fresh_url("link"), make_state(7, big=300_000)
        ss.save(state, url, storage_options=options(link))
        loaded = zeros_like(state)
        ss.load(loaded, url, storage_options=options(link))
    finally:
        link.close()
    assert_same(loaded, state)


ROWS, COLS = 12, 40_000  # 1.9 MB


def full_value() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) / 7


def save_sharded(rank: int, world: int, url: str, storage_options: dict) -> None:
    """Each rank holds its rows of one DTensor and its columns of another; both go to S3."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {"rows": distribute_tensor(full_value(), mesh, [Shard(0)]),
             "cols": distribute_tensor(full_value().double(), mesh, [Shard(1)])}
    ss.save(state, url, storage_options=storage_options)


def test_resharded_load_straight_from_s3(moto):
    url = fresh_url("resharded")
    run_ranks(2, save_sharded, url, options(moto))
    loaded = {"rows": torch.zeros(ROWS, COLS), "cols": torch.zeros(ROWS, COLS, dtype=torch.float64)}
    ss.load(loaded, url, storage_options=options(moto))
    assert torch.equal(loaded["rows"], full_value()) and torch.equal(loaded["cols"], full_value().double())
    assert torch.equal(ss.open(url, storage_options=options(moto)).read("rows"), full_value())


def after_manifest_put(prefix: str, match):
    """Matches what ``match`` matches once the manifest of a checkpoint under ``prefix`` was PUT."""
    put = []

    def matches(request) -> bool:
        if request.method == "PUT" and request.path.startswith(prefix) and request.path.endswith("/manifest.json"):
            put.append(request)
        return bool(put) and match(request)
    return matches


def lists(url: str):
    """Matches listings of the directory ``url`` (a checkpoint's files, as its commit lists them)."""
    prefix = key_of(url).split("/", 2)[2] + "/"
    return lambda r: r.method == "GET" and r.query.get("delimiter") == ["/"] and r.query.get("prefix") == [prefix]


def test_a_failure_after_the_manifest_put_does_not_abort_the_commit(proxy, moto):
    """On S3 the manifest's PUT is the commit; listing and deleting the replaced checkpoint's
    files come after it. When those failed, the abort deleted the new data files under the new
    manifest: the save raised, and neither the new checkpoint nor the one it replaced loaded."""
    url, first, second = fresh_url("after-put"), make_state(8), make_state(9)
    ss.save(first, url, storage_options=options(proxy))
    proxy.fail(after_manifest_put(key_of(url), lists(url)), times=1000)
    ss.save(second, url, overwrite=True, storage_options=options(proxy, retries=2))
    loaded = zeros_like(second)
    ss.load(loaded, url, storage_options=options(moto))
    assert_same(loaded, second)

    # a Checkpointer's step, and its further copy: committed, and load_latest restores it
    proxy._failures.clear()
    root = fresh_url("after-put-run")
    for where in (root, f"{root}-further"):
        proxy.fail(after_manifest_put(key_of(where), lists(f"{where}/step-1")), times=1000)
    with ss.Checkpointer(root, further_root=f"{root}-further", further_every=1,
                         storage_options=options(proxy, retries=2)) as ckpt:
        ckpt.save(1, make_state(1, big=300_000)).wait()
    proxy._failures.clear()
    for where in (root, f"{root}-further"):
        with ss.Checkpointer(where, storage_options=options(moto)) as ckpt:
            loaded = zeros_like(make_state(1, big=300_000))
            assert ckpt.load_latest(loaded) == 1
        assert_same(loaded, make_state(1, big=300_000))


def test_a_manifest_put_that_landed_but_reported_failure_is_committed(proxy, moto):
    """The manifest's PUT landed but its answer was lost, and its retries met 503s: the save
    aborted, deleting the data files that the manifest now in place names, and neither the new
    checkpoint nor the one it replaced loaded. The manifest read back is this save's: committed."""
    url, first, second = fresh_url("landed"), make_state(12), make_state(13)
    ss.save(first, url, storage_options=options(proxy))
    manifest_put = lambda r: r.method == "PUT" and r.path.endswith("/manifest.json")  # noqa: E731
    proxy.lose_answers(manifest_put, times=1)
    proxy.fail(manifest_put, times=1000)
    ss.save(second, url, overwrite=True, storage_options=options(proxy, retries=3))
    loaded = zeros_like(second)
    ss.load(loaded, url, storage_options=options(moto))
    assert_same(loaded, second)


def test_of_two_saves_to_one_path_without_overwrite_the_second_to_commit_is_refused(proxy, moto, monkeypatch):
    """Both saves find the path free and write their files; the first manifest commits. The
    second's manifest PUT is conditional (If-None-Match), so it fails with CheckpointExistsError
    instead of silently replacing the first checkpoint, and deletes its own files."""
    save_module = importlib.import_module("statesnap.engine.save")
    url, first, second = fresh_url("race"), make_state(14), make_state(15)
    opened = save_module.open_staging

    def meanwhile_another_save_commits(backend, path, overwrite):
        staged = opened(backend, path, overwrite)  # (the path was free: this save goes on)
        monkeypatch.setattr(save_module, "open_staging", opened)
        ss.save(first, url, storage_options=options(moto))
        return staged

    monkeypatch.setattr(save_module, "open_staging", meanwhile_another_save_commits)
    with pytest.raises(ss.CheckpointExistsError, match="another save committed it while this one wrote"):
        ss.save(second, url, storage_options=options(proxy))
    loaded = zeros_like(first)
    ss.load(loaded, url, storage_options=options(moto))
    assert_same(loaded, first)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **moto.storage_options())
    stored = {p.rsplit("/", 1)[-1] for p in fs.ls(url[len("s3://"):], refresh=True)}
    assert stored == {"manifest.json", *ss.open(url, storage_options=options(moto)).manifest.files}


def test_a_store_without_conditional_writes_still_takes_saves_and_checkpointers(proxy, caplog):
    """Some stores speaking S3's API answer a conditional PUT with 501 NotImplemented: a save, and
    a Checkpointer's lease, then look first and write plainly (said once in the log), instead of
    failing every save; a 501 is not retried."""
    conditional = lambda r: r.method == "PUT" and any(k.lower() == "if-none-match" for k in r.headers)  # noqa: E731
    proxy.fail(conditional, times=10**6, status=501, code="NotImplemented")
    url, state = fresh_url("no-conditional"), make_state(17, big=300_000)
    with caplog.at_level(logging.WARNING, logger="statesnap"):
        ss.save(state, url, storage_options=options(proxy))
        with ss.Checkpointer(fresh_url("no-conditional-root"), storage_options=options(proxy)) as ckpt:
            ckpt.save(1, state).wait()
    # one, or one for each of the two file systems where fsspec did not share one: a 501 is not retried
    assert 1 <= sum(map(conditional, proxy.requests)) <= 2
    assert "refuses conditional writes (NotImplemented (HTTP 501)" in caplog.text
    loaded = zeros_like(state)
    ss.load(loaded, url, storage_options=options(proxy))
    assert_same(loaded, state)
    with pytest.raises(ss.CheckpointExistsError):
        ss.save(state, url, storage_options=options(proxy))


def test_a_412_without_its_condition_named_is_still_another_save_first(proxy, moto, monkeypatch):
    """s3fs says FileExistsError only for a 412 that names If-None-Match; a store whose 412 does
    not (s3fs then raises EINVAL) still makes the losing save a CheckpointExistsError."""
    save_module = importlib.import_module("statesnap.engine.save")
    url, opened = fresh_url("bare-412"), save_module.open_staging

    def meanwhile_another_save_commits(backend, path, overwrite):
        staged = opened(backend, path, overwrite)
        monkeypatch.setattr(save_module, "open_staging", opened)
        ss.save(make_state(18, big=300_000), url, storage_options=options(moto))
        return staged

    monkeypatch.setattr(save_module, "open_staging", meanwhile_another_save_commits)
    proxy.fail(lambda r: r.method == "PUT" and r.path.endswith("/manifest.json"), times=1, status=412,
               code="PreconditionFailed")
    with pytest.raises(ss.CheckpointExistsError, match="another save committed it"):
        ss.save(make_state(19, big=300_000), url, storage_options=options(proxy))
    loaded = zeros_like(make_state(18, big=300_000))
    ss.load(loaded, url, storage_options=options(moto))
    assert_same(loaded, make_state(18, big=300_000))


def test_a_conditional_manifest_put_whose_answer_was_lost_is_committed_by_its_retry(proxy, moto):
    """The first PUT landed but its answer was lost; its retry finds the object there (412). The
    manifest read back is this save's own: the save committed, and says so."""
    url, state = fresh_url("lost-answer"), make_state(16)
    manifest_put = lambda r: r.method == "PUT" and r.path.endswith("/manifest.json")  # noqa: E731
    proxy.lose_answers(manifest_put, times=1)
    ss.save(state, url, storage_options=options(proxy, retries=3))
    assert len([r for r in proxy.requests if manifest_put(r)]) == 2
    loaded = zeros_like(state)
    ss.load(loaded, url, storage_options=options(moto))
    assert_same(loaded, state)


def test_a_manifest_put_whose_read_back_fails_too_leaves_its_files(proxy, moto, caplog):
    """The manifest's PUT landed but its answer was lost, its retries met 503s, and reading it
    back failed too: whether the save committed is unknown. The abort deleted the data files,
    and the manifest in place named files that were gone: neither checkpoint loaded. Now the
    save raises the PUT's failure, its files stay, and the checkpoint loads once the store answers."""
    url, first, second = fresh_url("unread"), make_state(14), make_state(15)
    ss.save(first, url, storage_options=options(proxy))
    manifest_put = lambda r: r.method == "PUT" and r.path.endswith("/manifest.json")  # noqa: E731
    manifest_get = lambda r: r.method == "GET" and r.path.endswith("/manifest.json")  # noqa: E731
    proxy.lose_answers(manifest_put, times=1)
    proxy.fail(manifest_put, times=1000)
    proxy.fail(manifest_get, times=1000)
    with caplog.at_level(logging.WARNING, logger="statesnap"), \
            pytest.raises(ss.CheckpointError, match=r"writing s3://.*manifest\.json failed: SlowDown"):
        ss.save(second, url, overwrite=True, storage_options=options(proxy, retries=2))
    assert any("unknown" in r.getMessage() and url in r.getMessage() for r in caplog.records)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **moto.storage_options())
    written = ss.open(url, storage_options=options(moto)).manifest.files
    assert written and all(fs.exists(f"{url}/{name}"[len("s3://"):]) for name in written)
    proxy._failures.clear()  # the store answers again
    loaded = zeros_like(second)
    ss.load(loaded, url, storage_options=options(proxy))
    assert_same(loaded, second)

    # a Checkpointer's copy to the further level: the copy fails, and load_latest restores it there
    root = fresh_url("unread-run")
    further_manifest = lambda r: r.path.startswith(key_of(f"{root}-further/")) and r.path.endswith("/manifest.json")  # noqa: E731
    proxy.lose_answers(lambda r: r.method == "PUT" and further_manifest(r), times=1)
    proxy.fail(lambda r: r.method in ("PUT", "GET") and further_manifest(r), times=1000)
    ckpt = ss.Checkpointer(root, further_root=f"{root}-further", further_every=1,
                           storage_options=options(proxy, retries=2))
    ckpt.save(1, make_state(1, big=300_000)).wait()
    with pytest.raises(ss.CheckpointError, match=r"step 1 was not copied to s3://.*-further/step-1"):
        ckpt.close()
    proxy._failures.clear()
    with ss.Checkpointer(f"{root}-further", storage_options=options(proxy)) as ckpt:
        loaded = zeros_like(make_state(1, big=300_000))
        assert ckpt.load_latest(loaded) == 1
    assert_same(loaded, make_state(1, big=300_000))


def test_a_failing_abort_leaves_the_save_its_checkpoint_error(proxy, moto):
    """The manifest's PUT fails, and so does deleting the data file it would have named: the
    save raised the deletion's bare OSError, not a CheckpointError naming the manifest."""
    url, first = fresh_url("abort-fails"), make_state(10)
    ss.save(first, url, storage_options=options(proxy))
    proxy.fail(lambda r: r.method == "PUT" and r.path.endswith("/manifest.json"), times=1000)
    proxy.fail(lambda r: r.method == "DELETE" or (r.method == "POST" and "delete" in r.query), times=1000)
    with pytest.raises(ss.CheckpointError, match=r"manifest\.json failed: SlowDown"):
        ss.save(make_state(11), url, overwrite=True, storage_options=options(proxy, retries=2))
    loaded = zeros_like(first)
    ss.load(loaded, url, storage_options=options(moto))
    assert_same(loaded, first)


def test_load_latest_raises_when_the_only_level_holding_steps_cannot_be_listed(proxy, moto):
    """A listing that fails every retry left the level out of the restore, and with no other
    level ``load_latest`` returned None, "no checkpoint": ``load_latest(state) or 0`` trained
    from scratch, and its saves then replaced and retired the checkpoints still there."""
    root = fresh_url("unlisted")
    with ss.Checkpointer(root, storage_options=options(moto)) as ckpt:
        ckpt.save(1, make_state(1, big=300_000)).wait()
    with ss.Checkpointer(root, storage_options=options(proxy, retries=2)) as ckpt:
        proxy.fail(lambda r: r.method == "GET" and "list-type" in r.query, times=1000)
        with pytest.raises(ss.CheckpointError, match=r"persistent level at s3://.* could not be listed .*SlowDown"):
            ckpt.load_latest(zeros_like(make_state(1, big=300_000)))
        proxy._failures.clear()
        loaded = zeros_like(make_state(1, big=300_000))
        assert ckpt.load_latest(loaded) == 1
    assert_same(loaded, make_state(1, big=300_000))
