"""What large runs need, checked small: memory-bounded log-probs, token-budget micro-batches, bf16 and activation
checkpointing, the released loss scale, and the audit fixes (generation config, dropout, long prompts)."""

import math

import numpy as np
import pytest
import torch

from exgrpo.config import config_from_dict
from exgrpo.data import PromptEncoder
from exgrpo.runtime.distributed import Distributed
from exgrpo.learner.objective import LossSettings, MicroBatch, mixed_policy_loss
from exgrpo.records import WARMUP
from exgrpo.learner.forward import PACKED, PACKED_SEQUENCE_TOKENS, pack_rows, packs_rows, token_logprobs
from exgrpo.tensors import pack
from exgrpo.rollout import HFEngine, SamplingSettings
from exgrpo.runtime.timing import StageTimer
from exgrpo.training.trainer import ExGRPOTrainer
from exgrpo.learner.learner import Learner, plan_micro_batches
from exgrpo.runtime.sharding import decoder_layers


def _batch(tokenizer, questions, completions):
    encode = PromptEncoder(tokenizer)
    return pack([(encode(q), c, None) for q in questions for c in completions], tokenizer.pad_token_id)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("rows", [torch.arange(12), torch.tensor([0, 6, 1, 7, 2, 8, 3, 9, 4, 10, 5, 11])],
                         ids=["shared prompts", "no neighbours share"])
def test_every_layout_and_head_chunking_gives_the_padded_rows_values_and_gradients(tiny_policy, questions, rows,
                                                                                   attention):
    """The reference runs every row on its own, padded; the KV-cache prompt sharing, the packed layout (a prompt
    then its rows' completions in one sequence, an empty completion among them) and a chunked head must give the
    same log-probs, entropies and gradients."""
    model, tok = tiny_policy
    model.set_attn_implementation(attention)
    assert packs_rows(model)
    batch = _batch(tok, questions(12)[::6], [[5, 6, 7], [8], [9, 10, 11, 12, 13], [], [14, 15], [16] * 9])
    params = [p for p in model.parameters() if p.requires_grad]

    def values(sharing, chunk):
        logp, entropy = token_logprobs(model, batch, 0.7, rows, with_entropy=True, chunk_tokens=chunk,
                                       prompt_sharing=sharing)
        return logp, entropy, torch.autograd.grad(logp.sum() + entropy.sum(), params)

    reference = values("never", None)
    for sharing, chunk in [("auto", None), ("auto", 3), (PACKED, None), (PACKED, 4)]:
        for a, b in zip(reference[:2] + reference[2], (lambda r: r[:2] + r[2])(values(sharing, chunk))):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=lambda m: f"{sharing} {chunk}: {m}")
    assert (reference[0] * (1 - batch.completion_mask[rows])).abs().sum() == 0  # padding holds zeros


@pytest.mark.slow
def test_train_compile_compiles_every_decoder_layer_and_keeps_the_eager_values_and_gradients(tiny_policy, questions):
    model, tok = tiny_policy
    batch = _batch(tok, questions(12)[::6], [[5, 6, 7], [8], [9, 10, 11, 12, 13], [], [14, 15], [16] * 9])
    params = [p for p in model.parameters() if p.requires_grad]

    def values():
        logp, entropy = token_logprobs(model, batch, 0.7, with_entropy=True, prompt_sharing=PACKED)
        return [logp, entropy, *torch.autograd.grad(logp.sum() + entropy.sum(), params)]

    eager, names = values(), [name for name, _ in model.named_parameters()]
    config = config_from_dict({"rollout": {"engine": "vllm"}, "train": {"compile": True}})
    Learner(model, config.train, num_generations=4, temperature=1.0, dist=Distributed(),
            losses={WARMUP: LossSettings()})
    layers = decoder_layers(model)
    assert len(layers) == 2 and all(layer._compiled_call_impl is not None for layer in layers)
    assert [name for name, _ in model.named_parameters()] == names  # checkpoints keep their keys
    for a, b in zip(eager, values()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_packed_layout_holds_each_prompt_once_then_its_rows_completions():
    """Rows 0 and 2 share prompt [7, 8]; row 1 has prompt [9] and an empty completion. Sequence 0 is [7, 8, 1, 2, 3]
    (row 0's completion [1, 2], row 2's [3]); each completion sees the prompt and itself only."""
    batch = pack([([7, 8], [1, 2], None), ([9], [], None), ([7, 8], [3], None)], pad_id=0)
    packed = pack_rows(batch.input_ids, batch.attention_mask, batch.completion_ids, batch.completion_mask)
    assert packed.input_ids.tolist() == [[7, 8, 1, 2, 3], [9, 0, 0, 0, 0]]
    assert packed.position_ids[0].tolist() == [0, 1, 2, 3, 2]  # row 2's completion starts at its own position 2
    assert packed.allowed[0, 0, 4].tolist() == [True, True, False, False, True]  # not row 0's completion
    assert packed.allowed[0, 0, 3].tolist() == [True, True, True, True, False]
    # the states predicting row 0's tokens (the prompt's last, then its own first) and row 2's (the prompt's last)
    assert packed.predictors.tolist() == [1, 2, 1]
    split = pack_rows(batch.input_ids, batch.attention_mask, batch.completion_ids, batch.completion_mask,
                      max_tokens=4)
    assert split.input_ids.tolist() == [[7, 8, 1, 2], [7, 8, 3, 0], [9, 0, 0, 0]]  # the prompt again


def test_packed_rows_longer_than_a_sequence_split_with_their_prompt_repeated(tiny_policy, questions):
    """Four 400-token completions of one prompt do not fit one packed sequence (`PACKED_SEQUENCE_TOKENS`): they
    are split over several, each starting with the prompt, and give the padded layout's values."""
    model, tok = tiny_policy
    assert 2 * 400 < PACKED_SEQUENCE_TOKENS < 4 * 400
    batch = _batch(tok, questions(1), [[5 + i % 7] * 400 for i in range(4)])
    with torch.no_grad():
        reference, _ = token_logprobs(model, batch, 1.0, prompt_sharing="never")
        packed, _ = token_logprobs(model, batch, 1.0, prompt_sharing=PACKED)
    torch.testing.assert_close(packed, reference, atol=1e-6, rtol=1e-5)


def test_micro_batch_plan_respects_the_token_budget():
    prompt = torch.tensor([4, 4, 4, 4, 9, 9])
    completion = torch.tensor([1, 6, 2, 6, 3, 30])
    plan = plan_micro_batches(torch.arange(6), prompt, completion, max_rows=3, max_tokens=30)
    assert sorted(int(r) for m in plan for r in m) == list(range(6))  # every row exactly once
    for m in plan:
        cost = len(m) * (int(prompt[m].max()) + int(completion[m].max()))
        assert cost <= 30 or len(m) == 1  # a row above the budget gets its own micro-batch
    assert [len(m) for m in plan][0] == 1 and plan[0].tolist() == [5]  # longest first: the 39-token row
    assert [m.tolist() for m in plan_micro_batches(torch.arange(6), prompt, completion, 4, None)] == \
        [[0, 1, 2, 3], [4, 5]]


def _update(model, loss: LossSettings, **train):
    """A one-process learner whose warm-up objective is `loss`."""
    config = config_from_dict({"train": {"mini_batches": 1, "micro_batch_size": 64, "learning_rate": 1e-3,
                                         "steps": 2, **train}})
    return Learner(model, config.train, num_generations=4, temperature=1.0, dist=Distributed(),
                   losses={WARMUP: loss})


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_one_process_trains_its_model_as_it_is_whatever_the_sharding(tiny_policy, sharding):
    """train.sharding applies across ranks: a one-process learner neither wraps nor shards, nor scales the loss."""
    model, _ = tiny_policy
    learner = Learner(model, config_from_dict({"train": {"sharding": sharding}}).train, num_generations=4,
                      temperature=1.0, dist=Distributed(), losses={WARMUP: LossSettings()})
    assert learner.train_model is model and learner.replica is model and learner.parallel.loss_multiplier == 1
    assert learner.parallel.backward_passes(0) == 0  # no padding pass: there are no collectives to join


def test_a_learner_without_an_objective_for_a_phase_says_so(tiny_policy, questions):
    model, tok = tiny_policy
    batch = _batch(tok, questions(4)[::4], [[5, 6], [7], [8, 9], [10]])
    with pytest.raises(ValueError, match=r"no objective for the mixed phase \(it was given \['warmup'\]\)"):
        _update(model, LossSettings())(batch, torch.zeros(4), "mixed", np.random.default_rng(0), StageTimer())


def test_token_budget_micro_batches_give_the_one_micro_batch_update(questions):
    from exgrpo.models import load_policy

    outcomes = []
    for budget in (None, 40):
        model, tok = load_policy("tiny:0")
        batch = _batch(tok, questions(12)[::4], [[5, 6, 7], [8], [9, 10, 11, 12, 13, 14], [15, 16]])
        advantages = torch.tensor([0.5, -0.5, 0.25, -0.25] * 3)
        update = _update(model, LossSettings(aggregation="token_mean", entropy_coef=0.01),
                         max_tokens_per_micro_batch=budget)
        result = update(batch, advantages, WARMUP, np.random.default_rng(0), StageTimer())
        outcomes.append((result.stats, [p.detach().clone() for p in model.parameters()]))
    (a, pa), (b, pb) = outcomes
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["grad_norm"] == pytest.approx(b["grad_norm"], 1e-6)
    for x, y in zip(pa, pb):  # AdamW's first step is ~lr*sign(g) = 1e-3: rounding moves a near-zero g's step
        torch.testing.assert_close(x, y, atol=1e-5, rtol=0)  # by 5e-6 on AMD AVX2 cores, a real bug by ~1e-3


def test_entropy_bonus_per_micro_batch_adds_up_the_micro_batch_means():
    """loss_scale per_rank (released): each micro-batch's bonus is over its own tokens, and they are summed."""
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    entropy = torch.tensor([[1.0, 1, 1], [4, 9, 9]])
    adv, replay = torch.zeros(2), torch.zeros(2, 3, dtype=torch.bool)
    settings = LossSettings(entropy_coef=1.0, entropy_per_micro_batch=True)
    micro = [MicroBatch(adv[i:i + 1], mask[i:i + 1], replay[i:i + 1], logp[i:i + 1], total_tokens=4.0)
             for i in range(2)]
    parts = [mixed_policy_loss(logp[i:i + 1], logp[i:i + 1], micro[i], settings, entropy=entropy[i:i + 1])[0]
             for i in range(2)]
    assert sum(parts).item() == pytest.approx(-(1.0 + 4.0))  # mean 1 over 3 tokens, mean 4 over 1 token
    whole = LossSettings(entropy_coef=1.0)
    parts = [mixed_policy_loss(logp[i:i + 1], logp[i:i + 1], micro[i], whole, entropy=entropy[i:i + 1])[0]
             for i in range(2)]
    assert sum(parts).item() == pytest.approx(-7.0 / 4)  # one token mean over the mini-batch's 4 tokens


def test_bf16_with_activation_checkpointing_and_chunking_still_learns(tiny_policy, questions, tmp_path):
    model, tok = tiny_policy
    config = config_from_dict({
        "rollout": {"num_generations": 4, "max_completion_length": 2},
        "train": {"steps": 25, "prompts_per_step": 8, "mini_batches": 1, "micro_batch_size": 32,
                  "learning_rate": 1e-2, "seed": 3, "dtype": "bf16", "activation_checkpointing": True,
                  "logprob_chunk_tokens": 16, "save_every": 0},
        "experience": {"start_threshold": 0.1},
        "logging": {"output_dir": str(tmp_path / "run"), "progress": False, "tensorboard": False},
    })

    def lowercase_first(prompts, completions, completion_ids, answer, **_):
        return [float(c[:1] in "abcdefghijklmnopqrstuvwxyz") for c in completions]

    history = ExGRPOTrainer(model, tok, [lowercase_first], config, questions(24)).train()
    first, last = np.mean([m["reward"] for m in history[:3]]), np.mean([m["reward"] for m in history[-3:]])
    assert first < 0.5 and last > 0.8, (first, last)
    assert model.is_gradient_checkpointing


def test_the_models_generation_config_does_not_change_what_is_sampled(tiny_policy, questions):
    """A repetition penalty in generation_config.json would reshape the distribution before our sampler."""
    model, tok = tiny_policy
    prompts = [PromptEncoder(tok)(q) for q in questions(3)] * 2
    sampling, seeds = SamplingSettings(12), list(range(6))
    plain = HFEngine(model, tok).generate(prompts, sampling, seeds).completion_ids
    model.generation_config.repetition_penalty = 50.0
    model.generation_config.no_repeat_ngram_size = 1
    assert HFEngine(model, tok).generate(prompts, sampling, seeds).completion_ids == plain
    # and the model's own generate would have obeyed them: no token repeated within a completion
    out = model.generate(input_ids=torch.tensor([prompts[0]]), max_new_tokens=12, do_sample=False)
    new = out[0, len(prompts[0]):].tolist()
    assert len(set(new)) == len(new) and plain[0] != new


def test_behaviour_logprobs_come_from_the_sampling_policy_without_dropout(questions):
    """With LoRA dropout and one mini-batch, the recorded behaviour log-probs are still the eval-mode ones."""
    from exgrpo.config import LoraConfig
    from exgrpo.models import load_policy

    model, tok = load_policy("tiny:0", lora=LoraConfig(r=4, alpha=8, dropout=0.5))
    with torch.no_grad():  # lora_B starts at zero, which would make dropout on the adapter invisible
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    batch = _batch(tok, questions(8)[::4], [[5, 6, 7], [8, 9], [10], [11, 12]])
    model.eval()
    with torch.no_grad():
        expected, _ = token_logprobs(model, batch, 1.0)
    model.train()
    result = _update(model, LossSettings())(batch, torch.tensor([0.5, -0.5, 0.25, -0.25] * 2), WARMUP,
                                            np.random.default_rng(0), StageTimer())
    torch.testing.assert_close(result.old_logp, expected, atol=1e-6, rtol=0)
    assert not math.isclose(result.stats["ratio/mean"], 1.0, abs_tol=1e-4)  # training forwards had dropout


def test_long_prompts_are_dropped_with_a_warning(tiny_policy, questions, tmp_path):
    from exgrpo.data import Question

    model, tok = tiny_policy
    long = Question("long", ({"role": "user", "content": "x" * 500},), "1", {})
    config = config_from_dict({"rollout": {"num_generations": 2}, "train": {"prompts_per_step": 2},
                               "data": {"max_prompt_length": 64},
                               "logging": {"output_dir": str(tmp_path / "r"), "progress": False}})
    with pytest.warns(UserWarning, match="dropped 1 of 5 training questions whose prompt is longer than"):
        trainer = ExGRPOTrainer(model, tok, [lambda completions, **_: [0.0] * len(completions)], config,
                                questions(4) + [long])
    assert sorted(trainer.experience.question_pool.questions) == ["q0", "q1", "q2", "q3"]


def test_frozen_lora_base_stored_in_bf16_gives_autocasts_values():
    """bf16 training with LoRA stores the frozen base in bf16 (nothing cast per op): no value changes, and the
    adapter (what the optimizer updates) stays fp32."""
    from exgrpo.config import LoraConfig
    from exgrpo.learner.learner import store_frozen_linear_weights
    from exgrpo.models import apply_lora, load_policy

    model = apply_lora(load_policy("tiny")[0], LoraConfig(r=4, alpha=8))
    ids = torch.randint(0, model.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(ids).logits
        cast = store_frozen_linear_weights(model, torch.bfloat16)
        got = model(ids).logits
    assert cast > 0 and torch.equal(got, want)
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    assert store_frozen_linear_weights(model, torch.bfloat16) == 0


def test_bf16_on_a_cpu_without_amx_is_said_to_be_slower(tiny_policy):
    """Without AMX tiles a CPU multiplies bf16 matrices slower than fp32 ones: the learner says so (and only then)."""
    import warnings

    from exgrpo.errors import ExgrpoWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _update(tiny_policy[0], LossSettings(), dtype="bf16")
        _update(tiny_policy[0], LossSettings(), dtype="fp32")
    said = [str(w.message) for w in caught if issubclass(w.category, ExgrpoWarning)]
    expected = [] if torch.cpu._is_amx_tile_supported() else [
        "train.dtype=bf16 on a CPU without AMX: bf16 matrix products are slower than fp32 ones here, so training runs "
        "slower than with train.dtype=fp32"]
    assert said == expected


def test_bf16_update_logprobs_agree_with_the_fp32_reference(questions):
    """The update's log-probs under train.dtype=bf16 (frozen LoRA base stored in bf16, autocast) stay within 0.05
    nats of the fp32 forward's on every token, and their mean within 0.01 (bf16 keeps 8 bits of mantissa)."""
    from exgrpo.config import LoraConfig
    from exgrpo.models import load_policy

    model, tok = load_policy("tiny:0", lora=LoraConfig(r=4, alpha=8))
    batch = _batch(tok, questions(12)[::4], [[5, 6, 7], [8], [9, 10, 11, 12, 13, 14], [15, 16]])
    with torch.no_grad():
        reference, _ = token_logprobs(model, batch, 1.0)
        learner = _update(model, LossSettings(), dtype="bf16")
        assert {p.dtype for p in model.parameters() if not p.requires_grad} >= {torch.bfloat16}
        logp, _ = learner.logprobs(model, batch, slice(None), with_entropy=False)
    mask = batch.completion_mask.bool()
    difference = (logp.float() - reference)[mask].abs()
    assert difference.max() < 0.05 and difference.mean() < 0.01, (difference.max(), difference.mean())
    assert difference.max() > 0  # bf16 was used
