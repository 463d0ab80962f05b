"""Our backends of vLLM 0.32's weight-transfer interface (`vllm.distributed.weight_transfer`) for CPU learners and
engines (vLLM's own backends, nccl and ipc, need CUDA), and the worker extension that registers them in vLLM's
workers.

* `exgrpo_shm` (the engine in a process of its own, rollout.mode async): the trainer writes the weights as one
  safetensors file in shared memory (/dev/shm, a tmpfs) and sends its path through vLLM's `update_weights`; the
  engine's worker memory-maps it. Only the path crosses vLLM's RPC.
* `exgrpo_gloo` (`vllm serve` servers, rollout.engine servers): vLLM's dense NCCL backend with gloo underneath. One
  process group of the learner's sender (rank 0) and every server worker (rank_offset + its rank within its
  server), formed with vLLM's stateless gloo group; each update broadcasts the parameters one by one from rank 0,
  to every server at once. Both ends are here: `GlooReceiver` in the server's worker, `GlooSender`
  on the learner's ranks (built with `WeightTransferTrainerFactory.trainer_init` on every rank, rank 0 sending).

Both load what arrives with the model's own `load_weights` inside vLLM's layerwise reload, as
`reload_weights(is_checkpoint_format=True)` does (it re-creates the CPU GEMM handles), and remember which
parameters an update did not load (`missing`), so that an incomplete update is refused (a tied `lm_head.weight`
left out makes vLLM warn and keep sampling from the old head).

A worker runs in a process of its own, where a registration made in the learner's process does not exist: the
engine or server is started with `worker_extension_cls` naming `WorkerExtension` below, which the worker imports
by name before it loads the model, and importing this module registers the backends there (and, for the learner's
side of gloo, in the learner).

Importing this module imports vLLM.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine, WeightSource, \
    WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from exgrpo.rollout.serve import SERVER_PID_VARIABLE

SHM_BACKEND = "exgrpo_shm"
GLOO_BACKEND = "exgrpo_gloo"


class _LayerwiseReload(WeightTransferEngine):
    """What both backends' worker ends share: an update runs inside vLLM's layerwise reload, and the parameters it
    did not load are kept in `missing`."""

    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info) -> None:
        self.loaded: set[str] = set()
        self.missing: list[str] = []

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.loaded = set()
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class ends with torch.accelerator.synchronize(), which raises on a CPU-only torch
        self.receive_weights(self.parse_update_info(update_info))

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        expected = {name for name, _ in self.model.named_parameters(remove_duplicate=False)}
        self.missing = sorted(expected - self.loaded)
        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------------- exgrpo_shm
@dataclass
class ShmInit(WeightTransferInitInfo):
    pass  # nothing to rendezvous: every update names its file


@dataclass
class ShmUpdate(WeightTransferUpdateInfo):
    path: str  # a safetensors file of (checkpoint name, tensor) the trainer wrote


class ShmReceiver(_LayerwiseReload):
    """The engine side of exgrpo_shm: loads each update's file into the model."""

    init_info_cls = ShmInit
    update_info_cls = ShmUpdate

    def receive_weights(self, update_info: ShmUpdate) -> None:
        from safetensors import safe_open

        with safe_open(update_info.path, framework="pt", device="cpu") as f, torch.no_grad():
            self.loaded |= set(self.model.load_weights((name, f.get_tensor(name)) for name in f.keys()) or ())


# ---------------------------------------------------------------------------------------------------- exgrpo_gloo
@dataclass
class GlooInit(WeightTransferInitInfo):
    """What a server's workers need to join the learner's group (one per server: `rank_offset` differs)."""

    master_address: str
    master_port: int
    rank_offset: int  # the group rank of this server's worker 0 (the learner's sender is rank 0)
    world_size: int  # the sender and every worker of every server
    timeout_s: float = 300.0


@dataclass
class GlooUpdate(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


def _group(address: str, port: int, rank: int, world_size: int, timeout_s: float, listening=None):
    """vLLM's stateless gloo group; the sender passes the socket its store listens on (`listening`)."""
    from datetime import timedelta

    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    return stateless_init_torch_distributed_process_group(address, port, rank, world_size, backend="gloo",
                                                          listen_socket=listening,
                                                          timeout=timedelta(seconds=timeout_s))


def _broadcast(group, tensor: torch.Tensor) -> None:
    # the group's own broadcast (root = group rank 0): torch.distributed.broadcast would want a global rank
    group.broadcast(tensor, 0).wait()


class GlooReceiver(_LayerwiseReload):
    """The server side of exgrpo_gloo (in vLLM's worker): receives each parameter from the learner's rank 0."""

    init_info_cls = GlooInit
    update_info_cls = GlooUpdate

    def init_transfer_engine(self, init_info: GlooInit) -> None:
        super().init_transfer_engine(init_info)
        p = self.parallel_config
        rank = init_info.rank_offset + p.data_parallel_index * p.world_size + p.rank  # as vLLM's NCCL backend
        self.group = _group(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                            init_info.timeout_s)

    def receive_weights(self, update_info: GlooUpdate) -> None:
        with torch.no_grad():
            for name, dtype, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype))
                _broadcast(self.group, tensor)
                self.loaded |= set(self.model.load_weights([(name, tensor)]) or ())

    def shutdown(self) -> None:
        self.group = None


@dataclass
class GlooSenderInit(TrainerInitInfo):
    """The learner's side of the group. Its sender tells the servers rank_offset 1; a client over several servers
    (`exgrpo.rollout.servers.ServerPool`) adds the workers of the servers before each one."""

    backend: ClassVar[str] = GLOO_BACKEND

    master_address: str
    master_port: int  # 0: a free port
    world_size: int
    timeout_s: float = 300.0


class GlooSender(TrainerWeightTransferEngine[GlooSenderInit]):
    """The learner side: rank 0 forms the group with the servers and broadcasts; the other ranks only iterate the
    source (under FSDP, its gather is a collective every rank joins)."""

    init_info_cls = GlooSenderInit

    @classmethod
    def trainer_init(cls, init_info: GlooSenderInit, *, client, source: WeightSource | None = None):
        if source is None:
            raise ValueError("the gloo weight transfer sends a WeightSource: pass source=")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.group = None
        if engine.is_sender:
            # the sender's store listens on a socket bound here (port 0: a free one, told to the servers): a
            # rendezvous under torchrun would join torchrun's own store instead of serving this group's
            address, info = init_info.master_address, init_info
            listening = socket.create_server((address, info.master_port))
            port = listening.getsockname()[1]
            worker_info = {"master_address": address, "master_port": port, "rank_offset": 1,
                           "world_size": info.world_size, "timeout_s": info.timeout_s}
            # the servers' workers block in their rendezvous until the sender joins: both at once
            engine.group = _alongside(lambda: client.init_weight_transfer_engine(worker_info),
                                      lambda: _group(address, port, 0, info.world_size, info.timeout_s, listening))
        return engine

    def send_weights(self) -> None:
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:
                pass
            return
        update = GlooUpdate([m.name for m in meta], [str(m.dtype).removeprefix("torch.") for m in meta],
                            [list(m.shape) for m in meta])
        self.client.start_weight_update()
        _alongside(lambda: self.client.update_weights(asdict(update)), lambda: self._broadcast_all(meta))
        self.client.finish_weight_update()

    def _broadcast_all(self, meta) -> None:
        with torch.no_grad():
            for (name, tensor), want in zip(self.source, meta, strict=True):
                if name != want.name or tensor.dtype != want.dtype or tuple(tensor.shape) != want.shape:
                    raise ValueError(f"the weight source yielded {name} {tensor.dtype} {tuple(tensor.shape)} where "
                                     f"its metadata declared {want.name} {want.dtype} {want.shape}")
                _broadcast(self.group, tensor.detach().to("cpu").contiguous())  # gloo: host memory

    def shutdown(self) -> None:
        self.group = None


def _alongside(rpc, local):
    """Run `rpc` (a call that blocks until the servers finish their side) on a thread while `local` runs here; an
    error of either is raised, the RPC's first when it failed before the collective could start."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        future = pool.submit(rpc)
        try:
            result = local()
        except BaseException:
            if future.done() and future.exception() is not None:
                raise future.exception() from None
            raise
        future.result()
        return result
    finally:
        pool.shutdown(wait=False)  # never wait on a server stuck in a collective that can no longer complete



# ---------------------------------------------------------------------------------------------------- workers
class WorkerExtension:
    """Mixed into vLLM's worker class (`LLM(worker_extension_cls=...)`): importing it registers the backend in the
    engine's process; its methods are called by name through `collective_rpc` and return plain data."""

    def exgrpo_missing_weights(self) -> list[str]:
        """Engine parameters the last weight update did not load (empty: it loaded every one)."""
        return list(self.weight_transfer_engine.missing)  # set when the transfer engine is initialised

    def exgrpo_model_signature(self) -> dict:
        """What a learner must share with this engine's model before it pushes weights into it."""
        return model_signature(self.model_config.hf_config)

    def exgrpo_exit_with(self, learner: int) -> None:
        """Die with the learner (process `learner`), however it dies, SIGKILL included (`exit_with`)."""
        exit_with(learner)


#: the model config fields a learner's model and an engine's must share for a push to fit
SIGNATURE_FIELDS = ("architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads")


def model_signature(config) -> dict:
    """`SIGNATURE_FIELDS` of a transformers model config (JSON-able)."""
    return {field: getattr(config, field, None) for field in SIGNATURE_FIELDS}


def exit_with(owner: int) -> None:
    """Die with the engine core's parent, process `owner` (the learner, or the `vllm serve` process), however it
    dies, SIGKILL included: vLLM 0.32's engine core has no watch on its parent, so a killed owner would leave it and
    its workers running. A thread here sees the engine core (the owner's child: this process, or its parent) re-
    parented, kills it and leaves; the core's other workers follow it through vLLM's own death pipe."""
    engine_core = os.getpid() if os.getppid() == owner else os.getppid()
    if _parent_of(engine_core) != owner:
        raise RuntimeError(f"the engine core {engine_core} is not a child of process {owner} (or /proc, which the "
                           "watch reads, is missing)")
    threading.Thread(target=_exit_with, args=(owner, engine_core), name="exgrpo-owner-watch", daemon=True).start()


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
    """Both backends in vLLM's worker-side factory and gloo in its trainer-side one, once per process
    (`register_engine` refuses a second registration)."""
    # one "Failed to load weights" per RotaryEmbedding at every push: it has no weights
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
    for backend, engine in ((SHM_BACKEND, ShmReceiver), (GLOO_BACKEND, GlooReceiver)):
        if backend not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(backend, engine)
    if GLOO_BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(GLOO_BACKEND, GlooSender)


def _die_with_the_server() -> None:
    """In an engine process of a server `exgrpo serve` started (the `vllm serve` process whose pid it was given):
    die with the server, as a learner's engine dies with the learner. Elsewhere (the server's own process, a
    learner's engine) nothing."""
    server = int(os.environ.get(SERVER_PID_VARIABLE, os.getpid()))
    if server in (os.getppid(), _parent_of(os.getppid())):
        exit_with(server)


register()
_die_with_the_server()
