"""Rollouts from `vllm serve` servers (rollout.engine servers) on CPU: two servers on 127.0.0.1, started by the
tests with `exgrpo serve` and stopped by them, the weights pushed over our gloo backend of vLLM's weight-transfer
interface.

Runs in .venv-vllm with the heavy tests (`make test-heavy`; CI runs them after `make test`): each xdist worker
starts its own two servers once, and the last test kills one of them. Skipped where vLLM is not installed.
"""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import requests
from conftest import _shared_memory_of, alive, descendants, kill_the_learner_only, orphaned_semaphores, \
    wait_for_checkpoint

pytest.importorskip("vllm")

from test_vllm import (ENV, ROOT, SAMPLING, _command, _metrics, _parity, _perturb, _requests,  # noqa: E402
                       _same_run, _shared_run)

from exgrpo.models import load_policy  # noqa: E402
from exgrpo.rollout.serve import SCRATCH_PREFIX  # noqa: E402
from exgrpo.rollout.servers import (PUSH_IN_PROGRESS, EngineError, ServerEngine, ServerPool,  # noqa: E402
                                    server_refusal)
from exgrpo.runtime.scratch import remove_orphans  # noqa: E402

pytestmark = pytest.mark.heavy  # two servers take ~90 s to start on 2 cores: CI runs these after `make test`

# what the learner's config says of the servers (`exgrpo serve` reads the same): the in-process runs' settings
SERVED = ["rollout.max_model_len=128", "rollout.generation_batch_size=16"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_up(url: str, process: subprocess.Popen, log, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(requests.RequestException):
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return
        log.seek(0)
        assert process.poll() is None and time.monotonic() < deadline, log.read()[-3000:]
        time.sleep(1)


@pytest.fixture(scope="session")
def servers(tmp_path_factory):
    """Two servers started as the docs start them (`exgrpo serve --config ... --port P`), each a session of its
    own; afterwards every process of theirs is gone. Session-scoped: a worker running this module's tests also
    runs test_vllm's in between, which would tear a module fixture down and start the servers again."""
    ports = [_free_port(), _free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    processes, logs, started = [], [], time.time()
    for port in ports:
        log = open(tmp_path_factory.mktemp("server") / "log", "w+")
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "exgrpo", "serve", "--config", str(ROOT / "configs" / "demo.yaml"),
             "rollout.engine=servers", f"rollout.servers={','.join(urls)}", *SERVED, "--port", str(port)],
            cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        logs.append(log)
    shared: set[str] = set()
    try:
        for url, process, log in zip(urls, processes, logs):
            _wait_until_up(url, process, log)
        # vLLM's message queues, which a server killed with SIGKILL (the last test) cannot unlink
        shared = _shared_memory_of(set().union(*(descendants(p.pid) | {p.pid} for p in processes)))
        yield urls, processes
    finally:
        left = set().union(*(descendants(p.pid) | {p.pid} for p in processes))
        for p in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p, log in zip(processes, logs):
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=60)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            log.close()
        deadline = time.monotonic() + 20
        while any(alive(pid) for pid in left) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in left if alive(pid)], "server processes outlived the servers"
        # and the semaphores of the killed server, which its resource tracker died before unlinking
        for segment in [*shared, *orphaned_semaphores(started)]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(segment)
        remove_orphans(SCRATCH_PREFIX)  # the servers' scratch directories, which the next `exgrpo serve` would sweep


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """test_vllm's 4-step in-process vllm run (trained once per session, whichever module asks first)."""
    return _shared_run(tmp_path_factory, "full")


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    """test_vllm's 4-step async run, s = 1, on the engine in its own process (trained once per session)."""
    return _shared_run(tmp_path_factory, "async", "rollout.mode=async")


def _servers_run(run_dir, urls, *extra, launcher=(sys.executable, "-m")):
    return _command(run_dir, "rollout.engine=servers", f"rollout.servers={','.join(urls)}", *extra,
                    launcher=launcher)


def _train(command) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_servers_sample_like_the_trainer_and_hold_every_push(servers):
    urls, _ = servers
    model, tok = load_policy("smollm2-135m-instruct")
    prompts, seeds = _requests(tok)
    engine = ServerEngine(model, tok, urls, backend="exgrpo_gloo", dtype="float32", transfer_address="127.0.0.1",
                          transfer_port=0, max_concurrency=16, request_timeout=120, push_timeout=120)
    try:
        assert engine.servers.versions() == ["0", "0"]  # pushed when it connected
        worst, _, before = _parity(model, tok, engine, prompts, seeds)
        assert worst <= 1e-4
        _perturb(model)
        stale, _, _ = _parity(model, tok, engine, prompts, seeds)
        assert stale > 1e-2  # the servers hold the old weights until a push
        engine.push_weights(1)
        assert engine.servers.versions() == ["1", "1"] and engine.servers.missing_weights() == [[], []]
        worst, _, after = _parity(model, tok, engine, prompts, seeds)
        assert worst <= 1e-4 and after != before
        # a request's sample depends on its seed only, not on its server or the batch
        assert engine.generate(prompts[::-1], SAMPLING, seeds[::-1]).completion_ids[::-1] == after
    finally:
        engine.close()


def test_a_server_that_cannot_serve_the_run_is_refused_with_the_reason(servers):
    """The refusal reads the server's own configuration: one started without the transfer config, in another
    precision or without processed log-probs is refused by name."""
    urls, _ = servers
    config = requests.get(f"{urls[0]}/server_info?config_format=json", timeout=30).json()["vllm_config"]
    assert server_refusal(config, "exgrpo_gloo", "float32") is None
    assert "computes in float32, the run expects bfloat16" in server_refusal(config, "exgrpo_gloo", "bfloat16")
    without = {**config, "weight_transfer_config": None}
    assert "runs weight transfer None, not 'exgrpo_gloo'" in server_refusal(without, "exgrpo_gloo", "float32")
    raw = {**config, "model_config": {**config["model_config"], "logprobs_mode": "raw_logprobs"}}
    assert "logprobs_mode = 'raw_logprobs'" in server_refusal(raw, "exgrpo_gloo", "float32")
    model, tok = load_policy("tiny")
    with pytest.raises(EngineError, match=f"the vLLM server {urls[0]} computes in float32, the run expects bfloat16"):
        ServerEngine(model, tok, urls, backend="exgrpo_gloo", dtype="bfloat16", transfer_address="127.0.0.1",
                     transfer_port=0)
    # another model is refused before any push, so the servers stay usable (a push of it used to break them)
    with pytest.raises(EngineError, match=f"the vLLM server {urls[0]} serves another model than the learner's"):
        ServerEngine(model, tok, urls, backend="exgrpo_gloo", dtype="float32", transfer_address="127.0.0.1",
                     transfer_port=0)
    # a server a push left half loaded (its label says so until a push completes) is refused, saying to restart it
    pool = ServerPool(urls[1:], timeout=30)
    try:
        pool.label(PUSH_IN_PROGRESS)
        with pytest.raises(EngineError, match=f"the vLLM server {urls[1]} holds half-loaded weights: .* restart it"):
            ServerEngine(*load_policy("smollm2-135m-instruct"), urls, backend="exgrpo_gloo", dtype="float32",
                         transfer_address="127.0.0.1", transfer_port=0)
    finally:
        pool.label("0")  # the label alone was set: its weights are whole
        pool.close()
    with pytest.raises(EngineError, match="the vLLM server http://127.0.0.1:9 did not answer /get_world_size"):
        ServerEngine(model, tok, ["http://127.0.0.1:9"], backend="exgrpo_gloo", dtype="float32",
                     transfer_address="127.0.0.1", transfer_port=0)


@pytest.mark.slow
def test_a_run_on_two_servers_is_the_in_process_run(tmp_path, servers, full_run):
    """Same seeds, same weights, same vLLM kernels: the servers' rollouts are the in-process engine's, so the run
    is the in-process vllm run step for step."""
    urls, _ = servers
    _train(_servers_run(tmp_path / "run", urls, "train.steps=2"))
    metrics = _metrics(tmp_path / "run")
    _same_run(metrics, full_run[1][:2])
    assert all(m["rollout/logp_diff_mean"] < 1e-3 for m in metrics)


@pytest.mark.slow
def test_an_async_run_on_two_servers_is_the_async_run_on_its_own_engine(tmp_path, servers, async_run):
    """rollout.mode async against servers: the worker thread samples step t + 1 from the servers while the learner
    trains on step t, as it does with the engine in its own process (test_vllm's async run)."""
    urls, _ = servers
    _train(_servers_run(tmp_path / "run", urls, "rollout.mode=async", "train.steps=2"))
    metrics = _metrics(tmp_path / "run")
    _same_run(metrics, async_run[1][:2])
    assert [m["async/staleness_max"] for m in metrics] == [0, 1]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_learner_ranks_on_two_servers_match_one_process(tmp_path, servers, mode, request):
    """sync: each rank samples its shard; async: rank 0 samples, pushes a snapshot every rank helped gather, and
    hands the rollouts to the other rank."""
    urls, _ = servers
    one_process = request.getfixturevalue("full_run" if mode == "sync" else "async_run")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m"]
    _train(_servers_run(tmp_path / "fsdp", urls, f"rollout.mode={mode}", "train.steps=2", "train.sharding=fsdp",
                        "train.check_replicas=true", launcher=torchrun))
    metrics = _metrics(tmp_path / "fsdp")
    _same_run(metrics, one_process[1][:2], loss_rel=1e-3, loss_abs=1e-5)
    assert all(m["replicas/count"] == 2 for m in metrics)


@pytest.mark.slow
def test_every_rank_refuses_a_half_loaded_server_at_once_in_one_line(tmp_path, servers):
    """A push interrupted by a killed rank leaves a server labelled half loaded: the next run on two ranks refuses it
    on both ranks in its first line, before any rank waits for the others (rank 1 used to wait out a collective and
    bury rank 0's line under its traceback)."""
    urls, _ = servers
    pool = ServerPool(urls[:1], timeout=30)
    try:
        pool.label(PUSH_IN_PROGRESS)
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m"]
        result = subprocess.run(_servers_run(tmp_path / "run", urls, "train.steps=1", launcher=torchrun), cwd=ROOT,
                                env=ENV, capture_output=True, text=True, timeout=900)
    finally:
        pool.label("0")  # the label alone was set: its weights are whole
        pool.close()
    lines = result.stderr.splitlines()
    said = [line for line in lines if line.startswith(("exgrpo: error:", "Traceback"))]
    refusal = f"exgrpo: error: the vLLM server {urls[0]} holds half-loaded weights"
    assert result.returncode != 0 and said[:2] == [said[0]] * 2 and said[0].startswith(refusal), said


@pytest.mark.slow
def test_a_learner_killed_mid_run_resumes_against_the_same_servers_exactly(tmp_path, servers, full_run):
    """SIGKILL of the learner after step 3's checkpoint: the servers stay up (the next learner forms a new transfer
    group with them and pushes the resumed weights) and the resumed run ends as the in-process run did."""
    urls, _ = servers
    run_dir = tmp_path / "run"
    process = subprocess.Popen(_servers_run(run_dir, urls), cwd=ROOT, env=ENV, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, start_new_session=True)
    wait_for_checkpoint(run_dir, 3, process)
    kill_the_learner_only(process)
    _train(_servers_run(run_dir, urls, "--resume", str(run_dir)))
    _same_run(_metrics(run_dir), full_run[1])


@pytest.mark.slow
def test_a_killed_server_stops_the_run_clearly_with_its_checkpoint_intact(tmp_path, servers):
    """Last in the module: it kills one of the servers."""
    urls, processes = servers
    run_dir = tmp_path / "run"
    process = subprocess.Popen(_servers_run(run_dir, urls, "train.steps=50"), cwd=ROOT, env=ENV, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        wait_for_checkpoint(run_dir, 2, process)
        (server,) = map(int, subprocess.run(["pgrep", "-P", str(processes[1].pid)], capture_output=True,
                                            text=True).stdout.split())  # the vLLM server `exgrpo serve` runs
        engine = descendants(server)  # its engine core, workers and resource tracker
        os.kill(server, signal.SIGKILL)  # the server's own process only, as an OOM killer would
        _, stderr = process.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 2, stderr[-3000:]
    # killed while the learner waited on a generation, or during a push (then named as the server that died)
    assert f"the vLLM server {urls[1]} did not answer" in stderr \
        or f"the vLLM server {urls[1]} stopped answering" in stderr, stderr[-3000:]
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in engine) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert engine and not [pid for pid in engine if alive(pid)], "the killed server's processes outlived it"
    from exgrpo.runtime.checkpoint import latest_intact_checkpoint

    assert latest_intact_checkpoint(run_dir).name >= "step-000002"
