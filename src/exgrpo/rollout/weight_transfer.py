"""A CPU weight-transfer backend for vLLM 0.32's RL interface (`vllm.distributed.weight_transfer`), used when the
vLLM engine runs in a process of its own (`rollout.mode: async`). vLLM's own backends (nccl, ipc, ...) need CUDA.

Transport: the trainer writes the weights as one safetensors file in shared memory (/dev/shm, a tmpfs) and sends
its path through vLLM's `update_weights`; the engine's worker memory-maps the file and streams it into the model's
own `load_weights` inside vLLM's layerwise reload, as `reload_weights(is_checkpoint_format=True)` does (it re-creates
the CPU GEMM handles). Only the path crosses vLLM's RPC.

The engine's worker runs in a spawned process, where a registration made in the trainer's process does not
exist: the engine is built with `worker_extension_cls` naming `WorkerExtension` below, which the worker imports
by name before it loads the model, and importing this module registers the backend there.

Importing this module imports vLLM: only `exgrpo.rollout.vllm` and vLLM's worker import it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, \
    WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

BACKEND = "exgrpo_shm"


@dataclass
class SharedFileInit(WeightTransferInitInfo):
    pass  # nothing to rendezvous: every update names its file


@dataclass
class SharedFileUpdate(WeightTransferUpdateInfo):
    path: str  # a safetensors file of (checkpoint name, tensor) the trainer wrote


class SharedFileTransfer(WeightTransferEngine[SharedFileInit, SharedFileUpdate]):
    """The engine side (in vLLM's worker process): loads each update's file into the model and remembers which
    parameters were loaded, so that an incomplete update is refused (a tied `lm_head.weight` left out makes vLLM
    warn and keep sampling from the old head)."""

    init_info_cls = SharedFileInit
    update_info_cls = SharedFileUpdate
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: SharedFileInit) -> None:
        self.loaded: set[str] = set()
        self.missing: list[str] = []

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.loaded = set()
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class ends with torch.accelerator.synchronize(), which raises on a CPU-only torch
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: SharedFileUpdate) -> None:
        from safetensors import safe_open

        with safe_open(update_info.path, framework="pt", device="cpu") as f, torch.no_grad():
            self.loaded |= set(self.model.load_weights((name, f.get_tensor(name)) for name in f.keys()) or ())

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        expected = {name for name, _ in self.model.named_parameters(remove_duplicate=False)}
        self.missing = sorted(expected - self.loaded)
        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        pass


class WorkerExtension:
    """Mixed into vLLM's worker class (`LLM(worker_extension_cls=...)`): importing it registers the backend in the
    engine's process; its methods are called by name through `collective_rpc` and return plain data."""

    def exgrpo_missing_weights(self) -> list[str]:
        """Engine parameters the last weight update did not load (empty: it loaded every one)."""
        return list(getattr(self.weight_transfer_engine, "missing", []))

    def exgrpo_exit_with(self, learner: int) -> None:
        """Die with the learner (process `learner`), however it dies, SIGKILL included: vLLM 0.32's engine core has
        no watch on its parent, so a killed learner would leave it and this worker running. A thread here sees the
        engine core (the learner's child) re-parented, kills it and leaves; the core's other workers follow it
        through vLLM's own death pipe."""
        engine_core = os.getpid() if os.getppid() == learner else os.getppid()
        if _parent_of(engine_core) != learner:
            raise RuntimeError(f"the engine core {engine_core} is not a child of the learner {learner} (or /proc, "
                               "which the watch reads, is missing)")
        threading.Thread(target=_exit_with, args=(learner, engine_core), name="exgrpo-learner-watch",
                         daemon=True).start()


def _parent_of(pid: int) -> int | None:
    """Process `pid`'s parent from /proc (Linux), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1])  # the name in parentheses may hold spaces
    except (OSError, ValueError, IndexError):
        return None


def _exit_with(learner: int, engine_core: int) -> None:
    while _parent_of(engine_core) == learner:
        time.sleep(0.5)
    if engine_core != os.getpid():
        with contextlib.suppress(ProcessLookupError):  # already gone: a shutdown, not a dead learner
            os.kill(engine_core, signal.SIGKILL)
    os._exit(1)


def register() -> None:
    # one "Failed to load weights" per RotaryEmbedding at every push: it has no weights
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
    if BACKEND not in WeightTransferEngineFactory._registry:  # register_engine refuses a second registration
        WeightTransferEngineFactory.register_engine(BACKEND, SharedFileTransfer)


register()
