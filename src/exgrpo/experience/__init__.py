"""Experience management: the buffer, the bucket sampler, trajectory selection and replay policies. No model code
here."""

from exgrpo.experience.buffer import ExperienceBuffer
from exgrpo.experience.policies import ReplayPolicy, build_replay_policy, replay_policy_from_config
from exgrpo.experience.replay import select_replays
from exgrpo.experience.sampler import bucket_probabilities, num_experiential, sample_questions
from exgrpo.experience.selection import SELECTION_METRICS, SELECTION_MODES

__all__ = [
    "ExperienceBuffer", "ReplayPolicy", "SELECTION_METRICS", "SELECTION_MODES", "build_replay_policy",
    "bucket_probabilities", "num_experiential", "replay_policy_from_config", "sample_questions", "select_replays",
]
