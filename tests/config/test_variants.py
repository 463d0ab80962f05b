"""Each string-chosen variant is a registry keyed by exactly its schema Literal's values, and an unknown value is
refused when the config is loaded (before any registry is consulted)."""

from typing import get_args

import pytest

from exgrpo.config import ConfigError, load_config
from exgrpo.config import schema
from exgrpo.experience.policies import REPLAY_POLICIES
from exgrpo.experience.sampler import QUESTION_DRAWS
from exgrpo.experience.selection import SELECTION_METRICS, SELECTION_MODES
from exgrpo.learner.objective import ADVANTAGE_SCALES, AGGREGATIONS
from exgrpo.rollout import ENGINES, ENGINE_SETTINGS
from exgrpo.training.generation import ZERO_VARIANCE_RULES

VARIANTS = [  # (config key, its Literal, the registry that implements it)
    ("rollout.zero_variance", schema.ZeroVariance, ZERO_VARIANCE_RULES),
    ("objective.scale_rewards", schema.ScaleRewards, ADVANTAGE_SCALES),
    ("objective.aggregation", schema.Aggregation, AGGREGATIONS),
    ("experience.bucket_scheme", schema.BucketScheme, QUESTION_DRAWS),
    ("experience.selection_metric", schema.SelectionMetric, SELECTION_METRICS),
    ("experience.selection_mode", schema.SelectionMode, SELECTION_MODES),
    ("experience.replay_policy", schema.ReplayPolicyName, REPLAY_POLICIES),
    ("rollout.engine", schema.EngineName, ENGINES),
]


@pytest.mark.parametrize("key,literal,registry", VARIANTS, ids=[key for key, _, _ in VARIANTS])
def test_registry_keys_are_the_schema_values(key, literal, registry):
    assert list(registry) == list(get_args(literal))


def test_every_engine_is_set_up_from_the_config():
    assert list(ENGINE_SETTINGS) == list(ENGINES)


@pytest.mark.parametrize("key", [key for key, _, _ in VARIANTS])
def test_an_unknown_variant_is_refused_at_load(key):
    with pytest.raises(ConfigError, match=f"{key}: 'nonesuch' is not allowed; expected one of"):
        load_config(None, [f"{key}=nonesuch"])
