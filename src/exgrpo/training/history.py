"""What a run's metric lines (metrics.jsonl) say about its phases, for the end of a run, its summary and the
studies' reports."""

from __future__ import annotations

from exgrpo.config import ExGRPOConfig


def mixed_phase_start(history: list[dict]) -> int | None:
    """The first step (1-based) of a run's metric lines that ran in the mixed phase; None if none did."""
    return next((m.get("step", i + 1) for i, m in enumerate(history) if m["phase"] == "mixed"), None)


def idle_settings(config: ExGRPOConfig, history: list[dict]) -> list[str]:
    """What a run's replay settings found nothing to act on, in words, for the end of the run (instead of silence):
    a mixed phase that never started, or one that never replayed. `history` is the run's metric lines."""
    if not history or config.experience.ratio == 0:
        return []
    if mixed_phase_start(history) is None:
        best = max(m["batch/pass_at_1"] for m in history)
        return [f"the mixed phase never started: batch Pass@1 (batch/pass_at_1) reached at most {best:.2f}, never "
                f"above experience.start_threshold {config.experience.start_threshold}, so nothing was replayed and "
                "this run was GRPO"]
    if sum(m["experience/replayed"] for m in history) == 0:
        return ["the mixed phase started but replayed nothing: no question had a stored trajectory in a bucket the "
                "sampler draws from (see exgrpo buffer RUN_DIR)"]
    return []
