"""How the learner's weights reach an engine's copy: one push, three transports, one confirmation.

A push (`Push`) sends the learner's `pushed_weights` (LoRA merged; or a snapshot of them) through the transport the
engine chose when it was built, labelled with their version, within a time limit, then confirms it: every target
(the engine, or each server) loaded every parameter and reads back the version. A push that loaded nothing, or
part of the weights, stops the run however small the update.

* `InProcessTransport` (rollout.engine vllm, sync: the engine in this process): the worker's `reload_weights`
  streams the weights into the model's own `load_weights`; what was loaded is read back from the engine's
  parameters and compared exactly (`exgrpo.rollout.weights.engine_differences`).
* `ShmTransport` (rollout.engine vllm, async: the engine in processes of its own): one safetensors file in shared
  memory through vLLM's weight-transfer interface to our `exgrpo_shm` backend in the engine's worker
  (`exgrpo.rollout.weight_transfer`), which reports what it did not load.
* `ServerTransport` (rollout.engine servers, in `exgrpo.rollout.servers`): our `exgrpo_gloo` backend, a broadcast
  to every server at once.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
from typing import Protocol

import torch

from exgrpo.errors import EngineError
from exgrpo.rollout.base import Weights
from exgrpo.rollout.weights import engine_differences, fused_slots, pushed_weights
from exgrpo.runtime.scratch import owned_temp_dir


class WeightTransport(Protocol):
    targets: list[str]
    """What receives the weights, as errors name it (the engine; each server by its URL): the order of the lists
    `unloaded` and `versions` return."""

    def send(self, version: int, snapshot: Weights | None) -> None:
        """Send the learner's weights (or `snapshot`), labelled `version`."""
        ...

    def unloaded(self) -> list[list[str]]:
        """Per target, the parameters the last send did not load."""
        ...

    def versions(self) -> list[str | None]:
        """Per target, the weights version it holds."""
        ...

    def close(self) -> None:
        ...


class Push:
    """Pushes through `transport` and confirms; a send longer than `timeout` seconds is an EngineError (None: the
    transport bounds its own calls)."""

    def __init__(self, transport: WeightTransport, timeout: float | None):
        self.transport, self.timeout = transport, timeout

    def __call__(self, version: int, snapshot: Weights | None = None) -> None:
        if self.timeout is None:  # the transport bounds its own calls
            with torch.no_grad():
                self.transport.send(version, snapshot)
        else:
            self._send_within(version, snapshot)
        self.confirm(version)

    def _send_within(self, version: int, snapshot: Weights | None) -> None:
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        try:
            with torch.no_grad():
                pool.submit(self.transport.send, version, snapshot).result(timeout=self.timeout)
        except concurrent.futures.TimeoutError:
            raise EngineError(f"pushing the weights took longer than rollout.push_timeout = {self.timeout:g} s") \
                from None
        finally:
            pool.shutdown(wait=False)

    def confirm(self, version: int) -> None:
        t = self.transport
        for target, missing in zip(t.targets, t.unloaded()):
            if missing:
                raise EngineError(f"the weight push did not load {len(missing)} parameters of {target} (e.g. "
                                  f"{', '.join(missing[:3])}): it would sample from old weights")
        for target, held in zip(t.targets, t.versions()):
            if held != str(version):
                raise EngineError(f"{target} reports weights version {held!r} after the push of version {version}")

    def close(self) -> None:
        self.transport.close()


class InProcessTransport:
    """Into a vLLM engine running in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`)."""

    targets = ["the vLLM engine"]

    def __init__(self, llm, model, device: torch.device):
        self.llm, self.model, self.device = llm, model, device
        self._slots: dict | None = None

    def send(self, version: int, snapshot: Weights | None) -> None:
        if snapshot is not None:
            raise ValueError("an in-process engine reads the learner's weights itself: no snapshot")
        if self.device.type == "cuda":  # the push runs on a thread of its own, which starts on device 0
            torch.cuda.set_device(self.device)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": pushed_weights(self.model),
                                                          "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()  # keyed by token ids, not weights
        self.llm.update_weight_version(str(version))

    def unloaded(self) -> list[list[str]]:
        """The engine's parameters that differ from the policy's (read back exactly)."""
        engine = self.llm.collective_rpc(_worker_model)[0]
        if self._slots is None:  # the engine's layout never changes: mapped at the first check
            self._slots = fused_slots(engine)
        return [engine_differences(engine, self.model, self._slots)]

    def versions(self) -> list[str | None]:
        return [self.llm.get_weight_version()]

    def close(self) -> None:
        pass


class ShmTransport:
    """Into a vLLM engine running in processes of its own, through vLLM's weight-transfer interface and our
    `exgrpo_shm` backend."""

    targets = ["the vLLM engine"]

    def __init__(self, llm, model):
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self.llm, self.model = llm, model
        self._dir = owned_temp_dir("exgrpo-weights-", "/dev/shm" if os.path.isdir("/dev/shm") else None)
        llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={}))

    def send(self, version: int, snapshot: Weights | None) -> None:
        """The weights as one file in shared memory."""
        from safetensors.torch import save_file
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        if snapshot is not None:  # the engine in its own process serves one learner process, which it reads
            raise ValueError("an engine process of one learner reads the learner's weights itself: no snapshot")
        tensors, seen = {}, set()
        for name, tensor in pushed_weights(self.model):  # tied aliases too: vLLM loads lm_head by name
            tensors[name] = tensor.detach().clone() if tensor.data_ptr() in seen else tensor.detach().contiguous()
            seen.add(tensor.data_ptr())
        path = os.path.join(self._dir, "weights.safetensors")  # safetensors writes a .tmp file beside it first
        try:
            save_file(tensors, path)
            del tensors
            self.llm.start_weight_update()
            self.llm.update_weights(WeightTransferUpdateRequest(update_info={"path": path}))
            self.llm.finish_weight_update()
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self.llm.reset_prefix_cache()
        self.llm.update_weight_version(str(version))

    def unloaded(self) -> list[list[str]]:
        return [self.llm.collective_rpc("exgrpo_missing_weights")[0]]

    def versions(self) -> list[str | None]:
        return [self.llm.get_weight_version()]

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)


def _worker_model(worker):
    """Run inside the engine's worker (`collective_rpc`): its model, in this process."""
    return worker.model_runner.get_model()
