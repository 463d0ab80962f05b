"""The fresh-question pool and the three retirement timings (spec §2 (c), §9.9)."""

import pytest
from conftest import make_questions

from exgrpo.data.pool import QuestionPool
from exgrpo.experience import ExperienceBuffer


def _epoch(pool: QuestionPool, batch: int = 6) -> list[str]:
    """The ids the pool gives for the rest of its current epoch, drawn batch by batch."""
    ids, epoch = [], pool.epoch
    while pool.epoch == epoch:
        ids += [q.id for q in pool.draw(batch)]
    return ids


def test_released_timing_keeps_a_retired_question_drawable_until_the_next_epoch():
    buffer = ExperienceBuffer(8)
    pool = QuestionPool(make_questions(40), seed=1, retirement=buffer, at_epoch_boundary=True, batch_size=6)
    first = [q.id for q in pool.draw(6)]
    for qid in first[:3]:
        buffer.retire(qid)
    rest_of_epoch = _epoch(pool)
    assert set(rest_of_epoch) | set(first) == {f"q{i}" for i in range(40)}  # still drawn as fresh in this epoch
    assert pool.remaining == 37 and pool.removed == set(first[:3])  # 40 > 6 + 20: removed at the boundary
    assert not set(first[:3]) & set(_epoch(pool))


def test_released_timing_removes_nothing_once_the_pool_is_no_larger_than_batch_plus_twenty():
    buffer = ExperienceBuffer(8)
    pool = QuestionPool(make_questions(26), seed=1, retirement=buffer, at_epoch_boundary=True, batch_size=6)
    for qid in ["q0", "q1", "q2"]:
        buffer.retire(qid)
    _epoch(pool)
    assert pool.remaining == 26 and {"q0", "q1", "q2"} <= set(_epoch(pool))
    state = pool.state_dict()
    again = QuestionPool(make_questions(26), seed=1, retirement=buffer, at_epoch_boundary=True, batch_size=6)
    again.load_state_dict(state)
    assert [q.id for q in again.draw(6)] == [q.id for q in pool.draw(6)]


def test_immediate_timing_never_draws_a_retired_question_again():
    buffer = ExperienceBuffer(8)
    pool = QuestionPool(make_questions(20), seed=1, retirement=buffer)
    first = [q.id for q in pool.draw(6)]
    buffer.retire(first[-1])
    later = [q.id for _ in range(10) for q in pool.draw(6)]
    assert first[-1] not in later and pool.remaining == 19


@pytest.mark.parametrize("at_epoch_boundary", [False, True])
def test_questions_in_flight_lose_their_turn_unless_nothing_else_fills_the_batch(at_epoch_boundary):
    pool = QuestionPool(make_questions(8), seed=1, retirement=ExperienceBuffer(8),
                        at_epoch_boundary=at_epoch_boundary, batch_size=6)
    in_flight = frozenset(q.id for q in pool.draw(6))
    assert len(pool.draw(6, exclude=in_flight)) == 6  # only 2 others: the ones in flight are drawn too
    assert not {q.id for q in pool.draw(2, exclude=in_flight)} & in_flight
