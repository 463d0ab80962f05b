import collections

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exgrpo.experience import (
    SELECTION_METRICS, SELECTION_MODES, ExperienceBuffer, bucket_probabilities, num_experiential, sample_questions,
    select_replays,
)

K = 8


def _traj(*ids):
    return np.array(ids, dtype=np.int32), -0.5 * np.arange(1, len(ids) + 1, dtype=np.float32)


def _group(buffer, qid, correct, step=0, seqs=None):
    seqs = seqs or [_traj(100 * i + 1, 100 * i + 2) for i in range(K)]
    return buffer.update_group(qid, correct, [s[0] for s in seqs], [s[1] for s in seqs], step=step)


# ---------------------------------------------------------------- bucket probabilities
def test_normal_bucket_probabilities_match_hand_computed_values():
    p = bucket_probabilities(range(1, 8), num_generations=8)
    expected = [0.0044, 0.054, 0.242, 0.399, 0.242, 0.054, 0.0044]
    assert [round(p[k], 4) for k in range(1, 8)] == pytest.approx(expected, abs=6e-4)
    assert sum(p.values()) == pytest.approx(1.0)


def test_probabilities_renormalise_over_present_buckets_only():
    p = bucket_probabilities([2, 4], num_generations=8)
    w2, w4 = np.exp(-2.0), 1.0
    assert p == pytest.approx({2: w2 / (w2 + w4), 4: w4 / (w2 + w4)})


@pytest.mark.parametrize("scheme,weights", [
    ("linear", {1: 1 / 8, 4: 4 / 8, 6: 6 / 8}),
    ("sqrt", {1: (1 / 8) ** 0.5, 4: 0.5 ** 0.5, 6: 0.75 ** 0.5}),
    ("linear_clip", {1: 1 / 8, 4: 0.5, 6: 0.5}),
])
def test_other_schemes(scheme, weights):
    total = sum(weights.values())
    assert bucket_probabilities([1, 4, 6], 8, scheme) == pytest.approx({k: w / total for k, w in weights.items()})


def test_uniform_and_unknown_schemes_have_no_bucket_probabilities():
    for scheme in ("gauss", "uniform"):  # uniform is over questions, not buckets
        with pytest.raises(KeyError, match=scheme):
            bucket_probabilities([1], 8, scheme)


def test_num_experiential():
    assert num_experiential(100, 128, 0.5) == 64
    assert num_experiential(10, 128, 0.5) == 10
    assert num_experiential(100, 5, 0.5) == 2
    assert num_experiential(100, 128, 0.0) == 0


# ---------------------------------------------------------------- sampler
def test_sampler_frequencies_match_bucket_probabilities():
    """10^4 seeded single draws: per-bucket frequency within 4 binomial standard errors of p (p < 1e-4 to fail)."""
    buckets = {k: [f"q{k}_{i}" for i in range(5)] for k in range(1, 8)}
    p = bucket_probabilities(buckets, 8)
    rng = np.random.default_rng(0)
    draws = 10_000
    counts = collections.Counter()
    for _ in range(draws):
        (qid,) = sample_questions(buckets, 1, rng)
        counts[int(qid[1])] += 1
    for k in range(1, 8):
        se = np.sqrt(p[k] * (1 - p[k]) / draws)
        assert abs(counts[k] / draws - p[k]) < 4 * se + 1e-9, (k, counts[k] / draws, p[k])


def test_sampler_never_duplicates_and_reassigns_overflow():
    # bucket 4 (p=0.4 of ~) holds only 2 questions: overflow must move to other buckets.
    buckets = {4: ["a", "b"], 1: [f"x{i}" for i in range(50)], 7: [f"y{i}" for i in range(50)]}
    rng = np.random.default_rng(1)
    for _ in range(2000):
        chosen = sample_questions(buckets, 20, rng)
        assert len(chosen) == 20 == len(set(chosen))
    all_ids = [q for ids in buckets.values() for q in ids]
    chosen = sample_questions(buckets, len(all_ids), rng)
    assert sorted(chosen) == sorted(all_ids)


def test_uniform_scheme_is_uniform_over_questions():
    buckets = {1: ["a"], 4: ["b", "c", "d"]}
    rng = np.random.default_rng(2)
    counts = collections.Counter(q for _ in range(8000) for q in sample_questions(buckets, 1, rng, scheme="uniform"))
    for q in "abcd":
        assert abs(counts[q] / 8000 - 0.25) < 0.02


def test_sampler_is_reproducible_under_a_seed():
    buckets = {k: [f"q{k}_{i}" for i in range(30)] for k in range(1, 8)}
    a = sample_questions(buckets, 16, np.random.default_rng(7))
    b = sample_questions(buckets, 16, np.random.default_rng(7))
    assert a == b


# ---------------------------------------------------------------- selection
def test_selection_uses_mean_entropy_even_when_longer():
    # candidate 0: 2 tokens of entropy 1.0 (sum 2.0, mean 1.0); candidate 1: 6 tokens of 0.5 (sum 3.0, mean 0.5)
    values = torch.tensor([[1.0, 1.0, 0, 0, 0, 0], [0.5] * 6])
    mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1] * 6])
    argmin, argmax = SELECTION_MODES["argmin"], SELECTION_MODES["argmax"]
    assert argmin(SELECTION_METRICS["entropy"](values, mask)) == 1
    # the released bug ranks by the sum and would pick the short one
    assert argmin(SELECTION_METRICS["entropy_sum"](values, mask)) == 0
    assert argmax(SELECTION_METRICS["entropy"](values, mask)) == 0


def test_selection_perplexity_and_random():
    logps = torch.tensor([[-0.1, -0.1], [-2.0, -2.0]])
    mask = torch.ones(2, 2)
    scores = SELECTION_METRICS["perplexity"](logps, mask)
    assert scores == pytest.approx(torch.exp(torch.tensor([0.1, 2.0])))
    rng = np.random.default_rng(0)

    def never_scored(pairs, metric):
        raise AssertionError("the random metric scores nothing")

    picks = {select_replays([("q", ["a", "b", "c"])], SELECTION_METRICS["random"], SELECTION_MODES["argmin"], rng,
                            score=never_scored)[0] for _ in range(100)}
    assert picks == {"a", "b", "c"}


# ---------------------------------------------------------------- buffer behaviour
def test_collection_rule_buckets_and_dedup():
    buf = ExperienceBuffer(K)
    correct = [True, True, False, False, False, False, False, False]
    same = _traj(1, 2, 3)
    seqs = [same, same] + [_traj(9, i) for i in range(6)]
    assert buf.update_group("q", correct, [s[0] for s in seqs], [s[1] for s in seqs], step=3) == "collected"
    assert buf.bucket_of("q") == 2
    assert buf.num_trajectories == 1  # dedup by token ids within the group
    # the same trajectory again in a later group is not re-added; a new one is
    seqs2 = [same, _traj(4, 5), same] + [_traj(9, i) for i in range(5)]
    correct2 = [True, True, True, False, False, False, False, False]
    buf.update_group("q", correct2, [s[0] for s in seqs2], [s[1] for s in seqs2], step=4)
    assert buf.bucket_of("q") == 3 and buf.num_trajectories == 2
    stored = buf.trajectories("q")
    assert stored[0].token_ids.tolist() == [1, 2, 3] and stored[0].step == 3
    assert stored[0].logprobs.tolist() == pytest.approx([-0.5, -1.0, -1.5])
    assert stored[1].token_ids.tolist() == [4, 5] and stored[1].step == 4


def test_zero_of_k_keeps_stale_entry_and_retiring_drops_it_for_good():
    buf = ExperienceBuffer(K)
    _group(buf, "q", [True] * 3 + [False] * 5)
    assert _group(buf, "q", [False] * K) == "skipped"
    assert buf.bucket_of("q") == 3 and buf.num_trajectories == 3
    assert _group(buf, "q", [True] * K) == "skipped"  # retiring is the caller's decision, made once
    assert buf.bucket_of("q") == 3 and not buf.is_retired("q")
    buf.retire("q")
    assert "q" not in buf and buf.is_retired("q") and buf.num_trajectories == 0
    assert _group(buf, "q", [True] + [False] * 7) == "ignored"
    assert "q" not in buf


def test_bounds_gate_collection():
    buf = ExperienceBuffer(K, lbound=2, rbound=5)
    assert _group(buf, "a", [True] * 2 + [False] * 6) == "skipped"
    assert _group(buf, "b", [True] * 6 + [False] * 2) == "skipped"
    assert _group(buf, "c", [True] * 5 + [False] * 3) == "collected"
    with pytest.raises(ValueError, match="lbound < rbound"):
        ExperienceBuffer(K, lbound=3, rbound=3)


def test_caps_keep_newest():
    buf = ExperienceBuffer(K, max_trajectories_per_question=2, max_questions=2)
    for step in range(3):
        seqs = [_traj(step, 7)] + [_traj(50, i) for i in range(7)]
        buf.update_group("a", [True] + [False] * 7, [s[0] for s in seqs], [s[1] for s in seqs], step=step)
    assert [t.step for t in buf.trajectories("a")] == [1, 2]
    _group(buf, "b", [True] + [False] * 7, step=5)
    _group(buf, "c", [True] + [False] * 7, step=6)
    assert sorted(buf.questions()) == ["b", "c"]  # "a" was least recently updated


def test_group_size_is_checked():
    with pytest.raises(ValueError, match="has 3 members, expected 8"):
        ExperienceBuffer(K).update_group("q", [True, False, False])


def test_save_load_roundtrip_uses_no_pickle(tmp_path):
    buf = ExperienceBuffer(K)
    for i in range(20):
        _group(buf, f"q{i}", [True] * (1 + i % 7) + [False] * (7 - i % 7), step=i)
    buf.retire("q3")
    path = tmp_path / "buffer.safetensors"
    buf.save(path)
    loaded = ExperienceBuffer.load(path)
    assert loaded.fingerprint() == buf.fingerprint()
    assert loaded.buckets() == buf.buckets() and loaded.retired == buf.retired
    # identical sampling from identical state
    assert sample_questions(loaded.buckets(), 5, np.random.default_rng(3)) == sample_questions(
        buf.buckets(), 5, np.random.default_rng(3))
    assert b"pickle" not in path.read_bytes()[:200] and not list(tmp_path.glob("*.tmp"))


def test_versions_and_use_counts_are_stored_counted_and_saved(tmp_path):
    buf = ExperienceBuffer(K)
    seqs = [_traj(100 * i + 1, 100 * i + 2) for i in range(K)]
    buf.update_group("q", [True, True] + [False] * 6, [s[0] for s in seqs], [s[1] for s in seqs], step=3, version=7)
    buf.record_replay("q", seqs[1][0])
    buf.record_replay("q", seqs[1][0])
    assert [(t.step, t.version, t.uses) for t in buf.trajectories("q")] == [(3, 7, 0), (3, 7, 2)]
    with pytest.raises(KeyError, match="stores no trajectory"):
        buf.record_replay("q", seqs[5][0])
    buf.save(tmp_path / "b.safetensors")
    assert [t.uses for t in ExperienceBuffer.load(tmp_path / "b.safetensors").trajectories("q")] == [0, 2]


def test_a_format_1_buffer_loads_with_versions_unrecorded(tmp_path):
    """Checkpoints written before versions and use counts were recorded still resume."""
    from exgrpo.experience.buffer import read_state, write_state

    buf = ExperienceBuffer(K)
    _group(buf, "q", [True] + [False] * 7, step=2)
    state = buf.state_dict()
    state["meta"]["format_version"] = 1
    state["arrays"] = {k: v for k, v in state["arrays"].items() if k not in ("version", "uses")}
    write_state(state, tmp_path / "old.safetensors")
    old = ExperienceBuffer(K)
    old.load_state_dict(read_state(tmp_path / "old.safetensors"))
    assert [(t.step, t.version, t.uses) for t in old.trajectories("q")] == [(2, -1, 0)]


def test_load_rejects_foreign_file(tmp_path):
    from safetensors.numpy import save_file

    path = tmp_path / "other.safetensors"
    save_file({"x": np.zeros(2, dtype=np.float32)}, str(path))
    with pytest.raises(ValueError, match="not an exgrpo experience buffer"):
        ExperienceBuffer.load(path)


# ---------------------------------------------------------------- buffer properties
_groups = st.lists(
    st.tuples(st.integers(0, 9), st.lists(st.booleans(), min_size=K, max_size=K), st.integers(0, 3)),
    min_size=1, max_size=60,
)


def _apply(groups):
    buf = ExperienceBuffer(K)
    for step, (q, correct, variant) in enumerate(groups):
        seqs = [_traj(q, variant, i % 3 + 1) for i in range(K)]
        buf.update_group(f"q{q}", correct, [s[0] for s in seqs], [s[1] for s in seqs], step=step)
    return buf


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_groups, st.integers(0, 2**32 - 1))
def test_property_retired_never_sampled_and_one_bucket_per_question(groups, seed):
    buf = _apply(groups)
    members = [q for ids in buf.buckets().values() for q in ids]
    assert len(members) == len(set(members)) == len(buf)
    assert not set(members) & buf.retired
    for k, ids in buf.buckets().items():
        assert 1 <= k <= K - 1 and all(buf.bucket_of(q) == k for q in ids)
    chosen = sample_questions(buf.buckets(), 8, np.random.default_rng(seed))
    assert not set(chosen) & buf.retired and len(chosen) == len(set(chosen)) == min(8, len(buf))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(_groups)
def test_property_state_roundtrips_exactly(tmp_path, groups):
    buf = _apply(groups)
    buf.save(tmp_path / "b.safetensors")
    loaded = ExperienceBuffer.load(tmp_path / "b.safetensors")
    assert loaded.fingerprint() == buf.fingerprint()
    assert loaded.bucket_histogram() == buf.bucket_histogram()
    assert loaded.state_dict()["meta"] == buf.state_dict()["meta"]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=40))
def test_property_memory_grows_with_stored_tokens_only(lengths):
    """State size is 8 bytes per stored token plus a fixed per-trajectory overhead, nothing else."""
    buf = ExperienceBuffer(K)
    for i, n in enumerate(lengths):
        ids = np.arange(n, dtype=np.int32) + i * 1000
        buf.update_group(f"q{i}", [True] + [False] * 7, [ids] * K, [np.zeros(n, np.float32)] * K)
    arrays = buf.state_dict()["arrays"]
    tokens = sum(lengths)
    per_traj = sum(a.itemsize for name, a in arrays.items() if name not in ("tokens", "logprobs"))
    assert buf.num_tokens == tokens
    assert sum(a.nbytes for a in arrays.values()) == 8 * tokens + per_traj * len(lengths)


def test_retirement_compacts_storage():
    buf = ExperienceBuffer(K)
    for i in range(10):
        ids = np.arange(100, dtype=np.int32) + i
        buf.update_group(f"q{i}", [True] + [False] * 7, [ids] * K, [np.zeros(100, np.float32)] * K)
    for i in range(8):
        buf.retire(f"q{i}")
    assert buf.num_tokens == 200
    assert buf.state_dict()["arrays"]["tokens"].size == 200
    assert [t.token_ids[0] for q in ("q8", "q9") for t in buf.trajectories(q)] == [8, 9]
