"""`python async_ranks.py RUN_DIR STEPS [CHECKPOINT]`, alone or under torchrun: test_async's run (s = 1, the tiny
model) with an engine that, like the servers engine, takes snapshots of the weights, so that under torchrun rank 0
alone drives it (FSDP across the ranks, replicas checked every step). With CHECKPOINT it resumes from there."""

import sys

import torch
from test_async import CopyEngine, _config
from test_trainer import _questions, first_char_reward

from exgrpo.models import load_policy
from exgrpo.runtime.distributed import close_distributed, init_distributed
from exgrpo.training.trainer import ExGRPOTrainer


class SnapshotEngine(CopyEngine):
    takes_snapshots = True

    def push_weights(self, version: int, snapshot=None) -> None:
        if snapshot is None:
            return super().push_weights(version)
        held = dict(snapshot)
        with torch.no_grad():
            for name, mine in self.copy.named_parameters():
                mine.copy_(held[name])
        self.weights_version = version
        self.log.append(("push", version))


def main(run_dir: str, steps: str, checkpoint: str | None = None) -> None:
    distributed = init_distributed()
    sharding = "fsdp" if distributed.enabled else "ddp"
    config = _config(staleness=1, steps=int(steps), output_dir=run_dir,
                     train={"sharding": sharding, "check_replicas": True, "save_every": 1, "save_total_limit": 4,
                            "threads": 1})
    model, tokenizer = load_policy("tiny:0")
    trainer = ExGRPOTrainer(model, tokenizer, [first_char_reward], config, _questions(18),
                            engine=SnapshotEngine(model, tokenizer), distributed=distributed)
    try:
        if checkpoint:
            trainer.resume(checkpoint)
        trainer.train()
    finally:
        trainer.close()
        close_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:])
