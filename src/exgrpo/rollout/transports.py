"""How the learner's weights reach a vLLM engine: two transports, one per place the engine runs, chosen once when
the engine is built (`exgrpo.rollout.vllm`). Both send `pushed_weights` (LoRA merged) and confirm what arrived.

* `InProcessReload` (the engine in this process, rollout.mode sync): the worker's `reload_weights` streams the
  weights into the model's own `load_weights`; the engine's weights are then read back and compared exactly.
* `SharedMemoryPush` (the engine in processes of its own, rollout.mode async, CPU): one safetensors file in shared
  memory through vLLM's weight-transfer interface (`start_weight_update`, `update_weights`,
  `finish_weight_update`) to our backend in the engine's worker (`exgrpo.rollout.weight_transfer`); the worker
  reports what it did not load and the engine the version it holds. It also ties the engine's life to the
  learner's (`exgrpo_exit_with`) and watches for the engine's death (`watch_for_engine_death`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time

import torch

from exgrpo.errors import EngineError
from exgrpo.rollout.weights import check_engine_holds, fused_slots, pushed_weights
from exgrpo.runtime.scratch import owned_temp_dir


class InProcessReload:
    """Pushes into an engine running in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`)."""

    def __init__(self, llm, model, device: torch.device):
        self.llm, self.model, self.device = llm, model, device
        self._slots: dict | None = None

    def push(self, version: int) -> None:
        if self.device.type == "cuda":  # the push runs on a thread of its own, which starts on device 0
            torch.cuda.set_device(self.device)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": pushed_weights(self.model),
                                                          "is_checkpoint_format": True})

    def confirm(self, version: int) -> None:
        """The engine must hold exactly the policy's weights (`check_engine_holds`): a push that loaded nothing,
        or part of the weights, stops the run however small the update."""
        engine = self.llm.collective_rpc(_worker_model)[0]
        if self._slots is None:  # the engine's layout never changes: mapped at the first check
            self._slots = fused_slots(engine)
        check_engine_holds(engine, self.model, self._slots)

    def close(self) -> None:
        pass


class SharedMemoryPush:
    """Pushes into an engine running in processes of its own, through vLLM's weight-transfer interface."""

    def __init__(self, llm, model):
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self.llm, self.model = llm, model
        self._dir = owned_temp_dir("exgrpo-weights-", "/dev/shm" if os.path.isdir("/dev/shm") else None)
        llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={}))
        llm.collective_rpc("exgrpo_exit_with", args=(os.getpid(),))
        watch_for_engine_death(llm)

    def push(self, version: int) -> None:
        """The weights as one file in shared memory, labelled with their version."""
        from safetensors.torch import save_file
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        tensors, seen = {}, set()
        for name, tensor in pushed_weights(self.model):  # tied aliases too: vLLM loads lm_head by that name
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
        self.llm.update_weight_version(str(version))

    def confirm(self, version: int) -> None:
        """The engine's worker loaded every parameter and the engine reports `version`."""
        missing = self.llm.collective_rpc("exgrpo_missing_weights")[0]
        if missing:
            raise EngineError(f"the weight push did not load {len(missing)} engine parameters (e.g. "
                              f"{', '.join(missing[:3])}): the engine would sample from old weights")
        if self.llm.get_weight_version() != str(version):
            raise EngineError(f"the vLLM engine reports weights version {self.llm.get_weight_version()!r} after "
                              f"the push of version {version}")

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)


def watch_for_engine_death(llm) -> None:
    """vLLM 0.32's client notices a dead engine process (kill -9, out of memory) but leaves a caller already
    waiting in `generate` or a utility call blocked for good: a watcher thread says so on stderr at once and fails
    those calls instead.

    The one place that reads vLLM's private client state: 0.32's synchronous `LLM` has no public signal that its
    engine process died (AsyncLLM has `errored` and `check_health`; LLM and LLMEngine have neither), so the watcher
    reads the client's `resources.engine_dead` and `_finalizer` and fails its `outputs_queue` and
    `utility_results`. SUPPORTED_VERSIONS pins the version; the killed-engine test exercises every attribute."""
    from vllm.v1.engine.exceptions import EngineDeadError

    core = llm.llm_engine.engine_core

    def watch():
        while not core.resources.engine_dead:
            if not core._finalizer.alive:  # shut down on purpose
                return
            time.sleep(0.2)
        # said at once, whatever the learner is doing; the run stops at its next call on the engine
        os.write(2, b"exgrpo: error: the vLLM engine process died; the run stops at its next call on the engine "
                    b"(the last checkpoint is intact; --resume continues from it)\n")
        core.outputs_queue.put_nowait(EngineDeadError())
        for future in list(core.utility_results.values()):
            if not future.done():
                future.set_exception(EngineDeadError())

    threading.Thread(target=watch, name="exgrpo-vllm-death-watch", daemon=True).start()


def _worker_model(worker):
    """Run inside the engine's worker (`collective_rpc`): its model, in this process."""
    return worker.model_runner.get_model()
