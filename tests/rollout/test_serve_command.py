"""`exgrpo serve`: the `vllm serve` command of a rollout.engine servers run, assembled from its config (the
servers themselves are started in tests/rollout/test_servers.py)."""

import getpass
import importlib.util
import os
import shlex
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import alive, run_cli

from exgrpo.models import smollm2_directory
from exgrpo.rollout.serve import SCRATCH_PREFIX
from exgrpo.runtime.scratch import owned_temp_dir, remove_orphans

SERVERS = ["--config", "configs/demo.yaml", "rollout.engine=servers", "rollout.servers=http://127.0.0.1:8000"]


def test_the_server_command_carries_what_the_run_needs(monkeypatch):
    monkeypatch.chdir(__file__.rsplit("/tests/", 1)[0])
    result = run_cli(["serve", *SERVERS, "rollout.max_model_len=128", "train.dtype=bf16", "--port", "8000",
                      "--print", "--", "--api-key", "secret"])
    assert result.returncode == 0, result.stderr
    env, _, command = result.stdout.strip().partition(" ")
    argv = shlex.split(command)
    assert env == "VLLM_SERVER_DEV_MODE=1" and argv[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model",
                                                            str(smollm2_directory())]
    flags = dict(zip(argv[5::2], argv[6::2]))
    assert flags["--weight-transfer-config"] == '{"backend": "exgrpo_gloo"}'
    assert flags["--worker-extension-cls"] == "exgrpo.rollout.weight_transfer.WorkerExtension"
    assert (flags["--dtype"], flags["--max-model-len"], flags["--port"]) == ("bfloat16", "128", "8000")
    assert "--enable-scale-out" in argv and "--no-enable-chunked-prefill" in argv
    assert "--logprobs-mode" in argv and argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert argv[-2:] == ["--api-key", "secret"]  # after --: vLLM's, as given


def test_serve_on_a_port_in_use_says_so_before_vllm_starts(monkeypatch):
    monkeypatch.chdir(__file__.rsplit("/tests/", 1)[0])
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_cli(["serve", *SERVERS, "rollout.max_model_len=128", "--port", str(port)])
    assert result.returncode == 2, result.stderr
    assert f"exgrpo serve cannot listen on 127.0.0.1:{port}: Address already in use (another server there? pick " \
        "another --port)" in result.stderr and "Traceback" not in result.stderr
    result = run_cli(["serve", *SERVERS, "rollout.max_model_len=128", "--host", "no-such-host.invalid", "--port",
                      str(port)])
    assert result.returncode == 2 and "exgrpo serve --host no-such-host.invalid: not an address of this machine" \
        in result.stderr, result.stderr


def test_a_server_that_stops_leaves_nothing_in_the_temp_dir(tmp_path):
    """`exgrpo serve` runs vLLM with its IPC sockets and vllm_dist_* files in exgrpo-serve-<pid>-*, and removes
    that directory when the server stops. (Here the server stops at once: no vLLM.)"""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: exgrpo serve would start a real server")
    root = __file__.rsplit("/tests/", 1)[0]
    with socket.socket() as probe:  # a port free now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "exgrpo", "serve", *SERVERS, "rollout.max_model_len=128", "--port", str(port)]
    env = {**os.environ, "TMPDIR": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "No module named 'vllm'" in result.stderr, result.stderr[-3000:]
    # nothing but torch's compile cache, shared by every server (in the temp dir unless TORCHINDUCTOR_CACHE_DIR says)
    assert {p.name for p in tmp_path.iterdir()} <= {"torchinductor_" + getpass.getuser()}


#: a stand-in for `vllm serve` (the seam: the server's command line): says its pid and the pid its engine processes
#: would watch, then serves until stopped
FAKE_SERVER = ("import os, sys, time; print(os.getpid(), os.environ['EXGRPO_SERVER_PID'], os.environ['TMPDIR'], "
               "flush=True); time.sleep(120)")


#: a stand-in that counts the SIGINTs it gets (a second would come at once) and exits with their number
COUNTING_SERVER = """
import os, signal, sys, time
got = []
signal.signal(signal.SIGINT, lambda number, frame: got.append(number))
print(os.getpid(), os.environ['EXGRPO_SERVER_PID'], os.environ['TMPDIR'], flush=True)
while not got:
    time.sleep(0.05)
time.sleep(1)
sys.exit(len(got))
"""


def _serve_fake(tmp_path, server: str = FAKE_SERVER) -> tuple[subprocess.Popen, int, str]:
    supervisor = subprocess.Popen(
        [sys.executable, "-c", "import sys; from exgrpo.rollout.serve import run_server; "
         f"sys.exit(run_server([sys.executable, '-c', {server!r}], {{}}))"],
        env={**os.environ, "TMPDIR": str(tmp_path)}, stdout=subprocess.PIPE, text=True, start_new_session=True)
    pid, watched, scratch = supervisor.stdout.readline().split()
    assert pid == watched and scratch.startswith(str(tmp_path / f"exgrpo-serve-{supervisor.pid}-"))
    return supervisor, int(pid), scratch


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_server_is_stopped_with_its_signal_and_its_directory_removed(tmp_path, stop):
    supervisor, server, _ = _serve_fake(tmp_path)
    supervisor.send_signal(stop)
    assert supervisor.wait(timeout=60) == 128 + stop  # the server's own end, passed on
    assert not alive(server) and not list(tmp_path.glob(f"{SCRATCH_PREFIX}*"))


def test_ctrl_c_in_a_terminal_reaches_the_server_once(tmp_path):
    """A terminal's Ctrl-C is SIGINT to its foreground process group: `exgrpo serve` passes it on, and the server,
    in a group of its own, gets it from there alone."""
    supervisor, _, _ = _serve_fake(tmp_path, COUNTING_SERVER)
    os.killpg(supervisor.pid, signal.SIGINT)
    assert supervisor.wait(timeout=60) == 1


def test_a_server_dies_with_a_killed_exgrpo_serve_and_the_next_one_removes_its_directory(tmp_path):
    supervisor, server, scratch = _serve_fake(tmp_path)
    supervisor.kill()
    supervisor.wait(timeout=60)
    deadline = time.monotonic() + 30
    while alive(server) and time.monotonic() < deadline:  # stopped by the parent-death signal
        time.sleep(0.1)
    assert not alive(server) and os.path.isdir(scratch)
    owned_temp_dir(SCRATCH_PREFIX, str(tmp_path))  # what the next `exgrpo serve` does first
    assert not os.path.exists(scratch)
    remove_orphans(SCRATCH_PREFIX, str(tmp_path))


@pytest.mark.parametrize("port", ["-1", "0", "70000", "http"])
def test_serve_refuses_a_port_that_is_no_port_number(port):
    result = run_cli(["serve", *SERVERS, "rollout.max_model_len=128", "--port", port])
    assert result.returncode == 2 and f"argument --port: {port!r} is not a port number (1 to 65535)" in result.stderr


def test_a_server_command_that_cannot_be_assembled_says_why(monkeypatch):
    monkeypatch.chdir(__file__.rsplit("/tests/", 1)[0])
    result = run_cli(["serve", *SERVERS, "--port", "8000", "--print"])
    assert result.returncode == 2 and "set it (prompt + completion tokens)" in result.stderr
    result = run_cli(["serve", "--config", "configs/demo.yaml", "--port", "8000", "--print"])
    assert result.returncode == 2 and "not of rollout.engine hf" in result.stderr
    result = run_cli(["export", "a", "b", "--", "--api-key", "k"])
    assert result.returncode == 2 and "only exgrpo serve takes them" in result.stderr
