"""`exgrpo serve`: the `vllm serve` command of a rollout.engine servers run, assembled from its config (the
servers themselves are started in tests/rollout/test_servers.py)."""

import shlex
import socket

from conftest import run_cli

from exgrpo.models import smollm2_directory

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


def test_a_server_command_that_cannot_be_assembled_says_why(monkeypatch):
    monkeypatch.chdir(__file__.rsplit("/tests/", 1)[0])
    result = run_cli(["serve", *SERVERS, "--port", "8000", "--print"])
    assert result.returncode == 2 and "set it (prompt + completion tokens)" in result.stderr
    result = run_cli(["serve", "--config", "configs/demo.yaml", "--port", "8000", "--print"])
    assert result.returncode == 2 and "not of rollout.engine hf" in result.stderr
    result = run_cli(["export", "a", "b", "--", "--api-key", "k"])
    assert result.returncode == 2 and "only exgrpo serve takes them" in result.stderr
