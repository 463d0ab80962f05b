"""The parity probe's thresholds per precision pair and the engine correction rule, on every shipped config."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from exgrpo.config import config_changes, engine_correction_cap, load_config
from exgrpo.errors import CheckpointError, TrainingError
from exgrpo.rollout.parity import THRESHOLDS, ParityProbe
from exgrpo.runtime.distributed import Distributed, require_on_every_rank

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_auto_corrects_every_engine_other_than_the_trainers_own_forward(path):
    hf = load_config(path, ["rollout.engine=hf"])
    assert engine_correction_cap(hf) is None  # the hf engine samples with the trainer's own forward
    vllm = load_config(path, ["rollout.engine=vllm"])
    assert engine_correction_cap(vllm) == vllm.objective.tis_cap  # at the trainer's precision too
    off = load_config(path, ["rollout.engine=vllm", "objective.engine_correction=none"])
    assert engine_correction_cap(off) is None


@pytest.mark.parametrize("overrides, threshold", [
    ([], THRESHOLDS[("float32", "float32")]),
    (["rollout.engine_dtype=bfloat16"], THRESHOLDS[("bfloat16", "float32")]),
    (["train.dtype=bf16"], THRESHOLDS[("bfloat16", "bfloat16")]),
    (["rollout.parity_threshold=0.5"], 0.5),
])
def test_the_threshold_is_the_precision_pairs_unless_set(overrides, threshold):
    config = load_config(ROOT / "configs" / "demo.yaml", ["rollout.engine=vllm", *overrides])
    assert ParityProbe.from_config(config, SimpleNamespace(reports_logprobs=True)).threshold == threshold
    assert ParityProbe.from_config(config, SimpleNamespace(reports_logprobs=False)).every == 0  # nothing to compare


def test_the_probe_reports_and_stops_past_its_threshold():
    probe = ParityProbe(every=2, threshold=0.15)
    trainer = torch.zeros(2, 3)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    engine = torch.tensor([[0.05, -0.05, 9.0], [0.2, 9.0, 9.0]])  # masked-out tokens do not count
    assert probe(1, engine, mask, trainer) == {}  # not a probe step
    assert probe(0, engine, mask, trainer) == pytest.approx({"rollout/logp_diff_mean": 0.1,
                                                             "rollout/logp_diff_max": 0.2})
    with pytest.raises(TrainingError, match="step 3: the rollout engine's log-probs differ from the trainer's by 0.2"):
        probe(2, engine * 2, mask, trainer)


def test_sharding_changes_on_resume_are_algorithmic_in_bf16_only():
    fp32 = load_config(ROOT / "configs" / "tiny.yaml").to_dict()
    fsdp = {**fp32, "train": {**fp32["train"], "sharding": "fsdp"}}
    assert config_changes(fp32, fsdp) == ([], ["train.sharding: 'ddp' -> 'fsdp'"])
    bf16 = {**fp32, "train": {**fp32["train"], "dtype": "bf16"}}
    algorithmic, _ = config_changes(bf16, {**bf16, "train": {**bf16["train"], "sharding": "fsdp"}})
    assert algorithmic == ["train.sharding: 'ddp' -> 'fsdp' (in bf16, FSDP and DDP compute differently)"]


def test_a_resume_needs_the_checkpoint_on_every_rank(tmp_path):
    require_on_every_rank(Distributed(), tmp_path)
    with pytest.raises(CheckpointError, match="missing on some ranks: a multi-node run resumes from storage"):
        require_on_every_rank(Distributed(), tmp_path / "elsewhere")
