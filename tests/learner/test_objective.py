import math

import pytest
import torch

from exgrpo.learner.objective import (
    LossSettings, MicroBatch, aggregate, group_advantages, merge_stats, mixed_policy_loss, policy_shaping,
    truncated_importance_weights,
)


def test_group_advantages_mean_centred_and_scaled():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    adv = group_advantages(rewards)
    assert adv.tolist() == [[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0], [-0.25, -0.25, -0.25, 0.75]]
    scaled = group_advantages(rewards, scale="group")
    std = torch.tensor([1.0, 0, 0, 1]).std()
    assert scaled[0, 0].item() == pytest.approx(0.5 / (float(std) + 1e-4))
    assert scaled[1].tolist() == [0, 0, 0, 0]  # zero-variance group gives 0
    with pytest.raises(KeyError, match="batch"):  # the config refuses it at load already
        group_advantages(rewards, scale="batch")


def test_policy_shaping_values():
    assert policy_shaping(torch.tensor([1.0, 0.1, 0.0]), beta=0.1).tolist() == pytest.approx([1 / 1.1, 0.5, 0.0])


def _one_token(logp_value, recorded, adv, replay, settings, old=0.0):
    logp = torch.tensor([[logp_value]], requires_grad=True)
    micro = MicroBatch(torch.tensor([adv]), torch.ones(1, 1), torch.tensor([[replay]]), torch.tensor([[recorded]]))
    loss, stats = mixed_policy_loss(logp, torch.tensor([[old]]), micro, settings)
    loss.backward()
    return loss.item(), logp.grad.item(), stats


def test_replay_gradient_matches_closed_form():
    """d/dlogp of -A f(w) = -A beta w / (w + beta)^2, with w = exp(logp - recorded)."""
    s = LossSettings(normalizer=1.0, entropy_coef=0.0)
    for logp, rec, adv in [(-1.0, -1.5, 0.7), (-0.2, -3.0, -1.3), (-2.0, -0.5, 0.25)]:
        loss, grad, stats = _one_token(logp, rec, adv, True, s)
        w = math.exp(logp - rec)
        assert loss == pytest.approx(-adv * w / (w + 0.1))
        assert grad == pytest.approx(-adv * 0.1 * w / (w + 0.1) ** 2, rel=1e-5)
        assert stats["replay/ratio_mean"] == pytest.approx(w, rel=1e-6)
        assert stats["replay/shaped_weight_mean"] == pytest.approx(w / (w + 0.1), rel=1e-6)


def test_replay_without_shaping_uses_plain_ratio():
    s = LossSettings(normalizer=1.0, entropy_coef=0.0, shaping=False)
    loss, grad, _ = _one_token(-1.0, -1.5, 2.0, True, s)
    w = math.exp(0.5)
    assert loss == pytest.approx(-2.0 * w) and grad == pytest.approx(-2.0 * w, rel=1e-6)


def test_fresh_tokens_clipped_in_warmup_and_unclipped_in_mixed_phase():
    # ratio exp(0.5) = 1.65 > 1.2 with A > 0: clipped loss is constant -> zero gradient
    clipped = LossSettings(normalizer=1.0, entropy_coef=0.0, clip_fresh=True)
    loss, grad, stats = _one_token(0.5, 0.0, 1.0, False, clipped)
    assert loss == pytest.approx(-1.2) and grad == 0.0
    assert stats["clip_ratio/high_mean"] == 1.0 and stats["clip_ratio/region_mean"] == 1.0
    unclipped = LossSettings(normalizer=1.0, entropy_coef=0.0, clip_fresh=False)
    loss, grad, stats = _one_token(0.5, 0.0, 1.0, False, unclipped)
    r = math.exp(0.5)
    assert loss == pytest.approx(-r) and grad == pytest.approx(-r, rel=1e-6)
    assert stats["ratio/mean"] == pytest.approx(r, rel=1e-6)
    # A < 0 and ratio below 1 - eps: clipped at the low side
    loss, grad, stats = _one_token(-0.5, 0.0, -1.0, False, clipped)
    assert loss == pytest.approx(0.8) and grad == 0.0 and stats["clip_ratio/low_mean"] == 1.0


def _batch():
    torch.manual_seed(0)
    values = torch.randn(3, 4)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.float32)
    return values, mask


def test_aggregation_modes_differ_exactly_as_documented():
    values, mask = _batch()
    masked = values * mask
    total = masked.sum()
    s = LossSettings(aggregation="sum_constant", normalizer=16.0)
    assert aggregate(values, mask, s) == pytest.approx(total / 16.0)
    s = LossSettings(aggregation="token_mean")
    assert aggregate(values, mask, s) == pytest.approx(total / 7.0)
    s = LossSettings(aggregation="seq_mean_token_mean")
    per_seq = masked.sum(1) / mask.sum(1)
    assert aggregate(values, mask, s) == pytest.approx(per_seq.mean())
    # each mode weighs a long and a short sequence differently
    results = {a: float(aggregate(values, mask, LossSettings(aggregation=a, normalizer=4.0)))
               for a in ("sum_constant", "token_mean", "seq_mean_token_mean")}
    assert len({round(v, 6) for v in results.values()}) == 3
    with pytest.raises(KeyError, match="mean"):  # the config refuses it at load already
        aggregate(values, mask, LossSettings(aggregation="mean"))


@pytest.mark.parametrize("aggregation", ["sum_constant", "token_mean", "seq_mean_token_mean"])
def test_micro_batches_accumulate_to_the_full_batch_gradient(aggregation):
    torch.manual_seed(1)
    B, T = 6, 5
    logits = torch.randn(B, T, requires_grad=True)
    old = torch.randn(B, T).clamp(max=0) - 0.1
    rec = torch.randn(B, T).clamp(max=0) - 0.1
    adv = torch.randn(B)
    mask = (torch.rand(B, T) > 0.3).float()
    mask[:, 0] = 1
    replay = torch.zeros(B, T, dtype=torch.bool)
    replay[0] = True
    ent = torch.rand(B, T)
    s = LossSettings(aggregation=aggregation, normalizer=10.0, clip_fresh=False)

    def run(rows, totals):
        logp = torch.nn.functional.logsigmoid(logits[rows])
        micro = MicroBatch(adv[rows], mask[rows], replay[rows], rec[rows], **totals)
        loss, _ = mixed_policy_loss(logp, old[rows], micro, s, entropy=ent[rows])
        return loss

    full = run(slice(None), {})
    (g_full,) = torch.autograd.grad(full, logits)
    totals = {"total_tokens": float(mask.sum()), "total_sequences": float(B)}
    acc = run(slice(0, 2), totals) + run(slice(2, 6), totals)
    (g_acc,) = torch.autograd.grad(acc, logits)
    assert torch.allclose(g_full, g_acc, atol=1e-6)
    assert acc.item() == pytest.approx(full.item(), abs=1e-6)


def test_entropy_bonus():
    values, mask = _batch()
    logp = -values.abs()
    entropy = torch.full_like(logp, 2.0)
    micro = MicroBatch(torch.zeros(3), mask, torch.zeros(3, 4, dtype=torch.bool), logp)
    no_bonus, _ = mixed_policy_loss(logp, logp, micro, LossSettings(entropy_coef=0.0))
    bonus, stats = mixed_policy_loss(logp, logp, micro, LossSettings(entropy_coef=0.01), entropy=entropy)
    assert no_bonus.item() == 0.0 and bonus.item() == pytest.approx(-0.02) and stats["entropy"] == pytest.approx(2.0)


def test_merge_stats_equals_stats_of_the_union():
    """Merged micro-batch stats equal the stats of the whole batch, however it is split."""
    torch.manual_seed(2)
    B, T = 6, 5
    logp, old, rec = torch.randn(B, T) * 0.1 - 1, torch.randn(B, T) * 0.1 - 1, torch.randn(B, T) * 0.1 - 1
    adv, mask, ent = torch.randn(B), (torch.rand(B, T) > 0.3).float(), torch.rand(B, T)
    mask[:, 0] = 1
    replay = torch.zeros(B, T, dtype=torch.bool)
    replay[[0, 4]] = True
    s = LossSettings()
    whole = mixed_policy_loss(logp, old, MicroBatch(adv, mask, replay, rec), s, entropy=ent)[1]
    parts = [mixed_policy_loss(logp[r], old[r], MicroBatch(adv[r], mask[r], replay[r], rec[r]), s, entropy=ent[r])[1]
             for r in (slice(0, 1), slice(1, 4), slice(4, 6))]
    merged = merge_stats(parts)
    for key, value in whole.items():
        if key not in ("tokens", "fresh_tokens", "replay_tokens"):
            assert merged[key] == pytest.approx(value, rel=1e-5), key


def test_truncated_importance_weights_against_hand_computed_values():
    """w = min(pi_old / pi_engine, cap) on the engine's tokens, 1 elsewhere; fresh losses are scaled by it, replayed
    ones are not, and the stats report the weights of fresh tokens only."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]])
    engine = torch.tensor([[-1.5, -1.0, -0.5], [-3.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    w = truncated_importance_weights(old, engine, mask, cap=1.5)
    # row 0: exp(0.5) = 1.65 -> 1.5 (capped); exp(-1) = 0.368; exp(0) = 1; row 1: exp(2) -> 1.5, then not engine's
    assert w.flatten().tolist() == pytest.approx([1.5, math.exp(-1.0), 1.0, 1.5, 1.0, 1.0])
    assert not w.requires_grad

    s = LossSettings(normalizer=1.0, entropy_coef=0.0, clip_fresh=False, tis_cap=1.5)
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)  # = old: ratio 1, loss -A per token
    replay = torch.tensor([[False, False, True]])
    micro = MicroBatch(torch.tensor([2.0]), torch.ones(1, 3), replay, torch.zeros(1, 3), engine[:1], mask[:1])
    loss, stats = mixed_policy_loss(logp, old[:1], micro, s)
    shaped_replay = math.exp(-0.5) / (math.exp(-0.5) + 0.1)  # f(w) of the replayed token, recorded log-prob 0
    assert loss.item() == pytest.approx(-2.0 * (1.5 + math.exp(-1.0)) - 2.0 * shaped_replay, rel=1e-6)
    assert stats["tis/weight_mean"] == pytest.approx((1.5 + math.exp(-1.0)) / 2)
    assert stats["tis/weight_min"] == pytest.approx(math.exp(-1.0))
    assert stats["tis/truncated_fraction"] == 0.5  # of the two fresh tokens, one at the cap


@pytest.mark.parametrize("dtype", [torch.float32, torch.long])
def test_a_replay_mask_of_zeros_and_ones_reads_as_the_bool_one(dtype):
    """A MicroBatch's replay_mask given as 0/1 numbers is read as False/True, as mixed_policy_loss read it before
    MicroBatch (torch.where refused it: a RuntimeError)."""
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    logp = old.clone().requires_grad_()
    replay = torch.tensor([[False, True, True]])
    engine, engine_mask = torch.tensor([[-1.5, -1.0, -0.5]]), torch.ones(1, 3, dtype=torch.bool)

    def loss(replay_mask):
        micro = MicroBatch(torch.tensor([1.0]), torch.ones(1, 3), replay_mask, torch.zeros(1, 3), engine, engine_mask)
        return mixed_policy_loss(logp, old, micro, LossSettings(tis_cap=1.5))

    (expected, expected_stats), (got, got_stats) = loss(replay), loss(replay.to(dtype))
    assert got.item() == expected.item() and got_stats == expected_stats
