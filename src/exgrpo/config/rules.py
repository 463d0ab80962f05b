"""What a config must satisfy (every value and combination, checked before anything loads), the settings derived
from it (precisions, the engine correction); which changes a resume may make is `exgrpo.config.changes`."""

from __future__ import annotations

import dataclasses
import math

from exgrpo.errors import ConfigError

# Every `cfg` below is an ExGRPOConfig; it is not imported here because the schema validates itself with these rules.

#: Refusals of rollout.mode async that depend on the engine or the launch, not on the config alone: made before the
#: model loads for a run built from its config (training/launch.py), and by the trainer for an engine passed to it.
ASYNC_NEEDS_ITS_OWN_ENGINE = ("rollout.mode async needs an engine with its own copy of the weights (rollout.engine "
                              "vllm or servers): the hf engine samples from the weights the learner is updating")
ASYNC_ACROSS_RANKS_NEEDS_SERVERS = ("rollout.mode async under torchrun needs an engine that rank 0 alone drives "
                                    "(rollout.engine servers; docs/scale.md): the vllm engine in its own process "
                                    "serves one learner process")


def validate(cfg, given: set[str] | None = None) -> None:
    """Every value and every combination, before anything is loaded; the error names the field and what it needs.

    `given`: the dotted fields the user set (a YAML file, overrides), which rules of the form "x applies to y only"
    are judged on; without it, the fields whose value differs from their default."""
    _check_finite(cfg, "")
    given = changed_fields(cfg) if given is None else given
    for ok, message in _rules(cfg, given):
        if not ok:
            raise ConfigError(message)


def changed_fields(cfg) -> set[str]:
    """The dotted fields of `cfg` whose value differs from the default of its section."""
    out = set()
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        default = type(section)()
        for g in dataclasses.fields(section):
            if getattr(section, g.name) != getattr(default, g.name):
                out.add(f"{f.name}.{g.name}")
    return out


def _set_any(given: set[str], *fields: str) -> bool:
    return any(f in given or any(g.startswith(f + ".") for g in given) for f in fields)


_MAY_BE_INFINITE = {"train.skip_grad_norm"}


def _check_finite(node, prefix: str) -> None:
    for f in dataclasses.fields(node):
        value, where = getattr(node, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_finite(value, where + ".")
        elif isinstance(value, float) and not math.isfinite(value):
            if not (value == math.inf and where in _MAY_BE_INFINITE):
                raise ConfigError(f"{where} must be a finite number (got {value})")


def _rules(cfg, given: set[str]):
    """(condition, message) pairs, in field order; the first false one is reported."""
    for section in (_model_and_data_rules, _reward_and_objective_rules, _train_eval_and_logging_rules):
        yield from section(cfg)
    for section in (_rollout_rules, _experience_rules, _guidance_rules):
        yield from section(cfg, given)


def _at_least(where: str, value, low) -> tuple[bool, str]:
    return value >= low, f"{where} must be >= {low} (got {value})"


def _positive(where: str, value) -> tuple[bool, str]:
    return value > 0, f"{where} must be > 0 (got {value})"


def _optional_at_least(where: str, value, low) -> tuple[bool, str]:
    return value is None or value >= low, f"{where} must be null or >= {low} (got {value})"


def _text(where: str, value) -> tuple[bool, str]:
    return bool(value and value.strip()), f"{where} must be a non-empty string"


def _model_and_data_rules(cfg):
    """model.*, data.*"""
    m, d = cfg.model, cfg.data
    lora = m.lora
    yield _text("model.name", m.name)
    if lora is not None:
        yield _at_least("model.lora.r", lora.r, 1)
        yield _positive("model.lora.alpha", lora.alpha)
        yield 0 <= lora.dropout < 1, f"model.lora.dropout must be in [0, 1) (got {lora.dropout})"
        yield _text("model.lora.target_modules", lora.target_modules)
        yield all(lora.modules), \
            (f"model.lora.target_modules must be all-linear or a comma list of module names "
             f"(got {lora.target_modules!r})")
    yield _text("data.train", d.train)
    yield _text("data.split", d.split)
    yield _optional_at_least("data.limit", d.limit, 1)
    yield _at_least("data.holdout", d.holdout, 0)
    yield d.eval is None or bool(d.eval.strip()), "data.eval must be null or a non-empty string"


def _rollout_rules(cfg, given: set[str]):
    """rollout.* (and its interplay with objective and experience)"""
    ro, o, e = cfg.rollout, cfg.objective, cfg.experience
    K = cfg.rollout.num_generations
    yield _at_least("rollout.num_generations", K, 2)
    yield _at_least("rollout.max_completion_length", ro.max_completion_length, 1)
    yield ro.temperature > 0, f"rollout.temperature must be > 0 (got {ro.temperature}; GRPO groups need sampling)"
    yield 0 < ro.top_p <= 1, f"rollout.top_p must be in (0, 1] (got {ro.top_p})"
    yield _at_least("rollout.top_k", ro.top_k, 0)
    yield _at_least("rollout.generation_batch_size", ro.generation_batch_size, 1)
    yield _optional_at_least("rollout.max_model_len", ro.max_model_len, 2)
    yield 0 < ro.gpu_memory_utilization <= 1, \
        f"rollout.gpu_memory_utilization must be in (0, 1] (got {ro.gpu_memory_utilization})"
    yield ro.kv_cache_gb is None or ro.kv_cache_gb > 0, \
        f"rollout.kv_cache_gb must be null or > 0 (got {ro.kv_cache_gb})"
    yield _positive("rollout.push_timeout", ro.push_timeout)
    yield _positive("rollout.generation_timeout", ro.generation_timeout)
    yield from _server_rules(ro, given)
    yield _at_least("rollout.parity_every", ro.parity_every, 0)
    yield ro.parity_threshold is None or ro.parity_threshold > 0, \
        f"rollout.parity_threshold must be null or > 0 (got {ro.parity_threshold})"
    yield from _engine_rules(cfg, given)
    yield _at_least("rollout.max_generation_rounds", ro.max_generation_rounds, 1)
    yield ro.zero_variance != "keep" or not _set_any(given, "rollout.max_generation_rounds"), \
        "rollout.max_generation_rounds applies to rollout.zero_variance backfill or replace_from_buffer only"
    yield ro.zero_variance != "replace_from_buffer" or e.ratio > 0, \
        "rollout.zero_variance replace_from_buffer needs a buffer: experience.ratio must be > 0"
    yield from _async_rules(ro, o, given)


def _engine_rules(cfg, given: set[str]):
    """the engine's interplay with the sampling settings and the objective"""
    ro, o = cfg.rollout, cfg.objective
    yield ro.engine == "hf" or (ro.top_p == 1 and ro.top_k == 0), \
        (f"rollout.engine {ro.engine} reports log-probs renormalised over the top-p/top-k set, which the trainer "
         "does not use: it needs rollout.top_p 1 and rollout.top_k 0")
    yield ro.engine != "hf" or not _set_any(given, "rollout.engine_dtype", "rollout.max_model_len",
                                            "rollout.kv_cache_gb", "objective.engine_correction"), \
        ("rollout.engine_dtype, max_model_len, kv_cache_gb and objective.engine_correction apply to rollout.engine "
         "vllm and servers only")
    yield not (o.engine_correction == "none" and engine_precision(cfg) != compute_precision(cfg)), \
        (f"the {ro.engine} engine samples in {engine_precision(cfg)} but the trainer computes in "
         f"{compute_precision(cfg)}: its log-probs differ, so objective.engine_correction must not be none (use tis "
         "or auto)")
    yield o.tis_cap >= 1, f"objective.tis_cap must be >= 1 (got {o.tis_cap})"


def _async_rules(ro, o, given: set[str]):
    """rollout.mode async and its fields"""
    yield _at_least("rollout.max_staleness", ro.max_staleness, 0)
    yield ro.mode == "async" or not _set_any(given, "rollout.max_staleness"), \
        "rollout.max_staleness applies to rollout.mode async only"
    yield ro.mode == "async" or ro.engine == "servers" or not _set_any(given, "rollout.generation_timeout"), \
        "rollout.generation_timeout applies to rollout.mode async and rollout.engine servers only"
    yield ro.mode == "sync" or ro.zero_variance == "keep", \
        (f"rollout.mode async plans each step's groups before the step runs, so it cannot refill dropped groups: "
         f"rollout.zero_variance must be keep (got {ro.zero_variance})")
    yield ro.mode == "sync" or o.engine_correction != "none", \
        ("rollout.mode async samples from older weights than the learner's: objective.engine_correction must "
         "not be none (auto or tis correct stale tokens by truncated importance sampling)")


def _server_rules(ro, given: set[str]):
    """rollout.engine servers and its fields"""
    yield (ro.engine == "servers") == bool(ro.server_urls), \
        "rollout.servers (the servers' base URLs) goes with rollout.engine servers, and that engine needs it"
    entries = [u.strip() for u in ro.servers.split(",")] if ro.servers.strip() else []
    yield all(entries), f"rollout.servers has an empty entry (a comma too many?): {ro.servers!r}"
    bad = [(u, why) for u in entries if u and (why := _not_a_server_url(u))]
    yield not bad, (f"rollout.servers must be http(s)://host:port URLs, comma separated: {bad[0][0]!r} {bad[0][1]}"
                    if bad else "")
    yield ro.engine == "servers" or not _set_any(given, "rollout.weight_transfer", "rollout.transfer_address",
                                                 "rollout.transfer_port"), \
        "rollout.weight_transfer, transfer_address and transfer_port apply to rollout.engine servers only"
    yield 0 <= ro.transfer_port < 65536, f"rollout.transfer_port must be a port number or 0 (got {ro.transfer_port})"


def _not_a_server_url(url: str) -> str | None:
    """Why `url` is not a server's base URL (http(s)://host:port), or None."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
    except ValueError as e:  # e.g. an unclosed IPv6 bracket: "Invalid IPv6 URL"
        return f"is not a URL ({e})"
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return "does not start with http:// or https://"
    if not parts.hostname:
        return "has no host"
    try:
        port = parts.port
    except ValueError:
        return f"has no valid port ({parts.netloc.rpartition(':')[2]!r} is not a number from 1 to 65535)"
    if port is None or port == 0:
        return "has no port (the one `exgrpo serve --port` was given)"
    if parts.path.strip("/") or parts.query or parts.fragment:
        return "is more than a base URL (no path, query or fragment: the engine adds its own paths)"
    return None


def _reward_and_objective_rules(cfg):
    """reward.*, objective.*"""
    rw, o = cfg.reward, cfg.objective
    yield _at_least("reward.workers", rw.workers, 0)
    yield _positive("reward.timeout", rw.timeout)
    yield rw.min_value < rw.max_value, \
        f"reward.min_value ({rw.min_value}) must be < reward.max_value ({rw.max_value})"
    yield rw.min_value < rw.success_threshold <= rw.max_value, \
        (f"reward.success_threshold ({rw.success_threshold}) must lie in (reward.min_value, reward.max_value] = "
         f"({rw.min_value}, {rw.max_value}]: otherwise every rollout, or none, counts as correct")
    yield rw.function is None or (rw.function.count(":") == 1 and all(rw.function.split(":"))), \
        f"reward.function must look like 'module:name' (got {rw.function!r})"
    yield not rw.think_gate or (rw.grader == "math" and rw.function is None), \
        "reward.think_gate applies to the math grader only (reward.grader: math, no reward.function)"
    yield 0 <= o.epsilon_low < 1, f"objective.epsilon_low must be in [0, 1) (got {o.epsilon_low})"
    yield _at_least("objective.epsilon_high", o.epsilon_high, 0)
    yield _positive("objective.beta", o.beta)
    yield o.normalizer is None or o.normalizer > 0, f"objective.normalizer must be null or > 0 (got {o.normalizer})"
    yield o.normalizer is None or o.aggregation == "sum_constant", \
        f"objective.normalizer is used by aggregation sum_constant only (aggregation is {o.aggregation!r})"
    yield o.loss_scale == "global" or o.aggregation == "sum_constant", \
        (f"objective.loss_scale per_rank is the released scale of aggregation sum_constant (each rank's token sum / "
         f"normalizer, gradients averaged over ranks); with {o.aggregation} it would divide the gradient by the "
         "number of ranks: use loss_scale global")


def _experience_rules(cfg, given: set[str]):
    """experience.*"""
    e = cfg.experience
    K, B = cfg.rollout.num_generations, cfg.train.prompts_per_step
    rbound = K - 1 if e.rbound is None else e.rbound
    yield 0 <= e.ratio <= 1, f"experience.ratio must be in [0, 1] (got {e.ratio})"
    yield e.ratio == 0 or math.floor(B * e.ratio + 1e-9) >= 1, \
        (f"experience.ratio ({e.ratio}) x train.prompts_per_step ({B}) < 1: no batch could hold an experiential "
         "question (use ratio 0 for GRPO)")
    yield 0 <= e.start_threshold < 1, f"experience.start_threshold must be in [0, 1) (got {e.start_threshold})"
    yield _positive("experience.bucket_sigma", e.bucket_sigma)
    yield e.bucket_mean is None or 1 <= e.bucket_mean <= K - 1, \
        f"experience.bucket_mean must be null or in [1, num_generations-1 = {K - 1}] (got {e.bucket_mean})"
    yield e.bucket_scheme == "normal" or not _set_any(given, "experience.bucket_mean", "experience.bucket_sigma"), \
        f"experience.bucket_mean and bucket_sigma apply to bucket_scheme normal only (scheme is {e.bucket_scheme!r})"
    yield 0 <= e.lbound < rbound <= K - 1, \
        (f"experience.lbound ({e.lbound}) < experience.rbound ({rbound}) <= num_generations-1 ({K - 1}) must hold, "
         "with lbound >= 0")
    yield _optional_at_least("experience.max_trajectories_per_question", e.max_trajectories_per_question, 1)
    yield _optional_at_least("experience.max_questions", e.max_questions, 1)
    yield _at_least("experience.selection_batch_size", e.selection_batch_size, 1)
    yield _at_least("experience.retest_every", e.retest_every, 0)
    yield e.replay_policy == "prioritized" or not _set_any(given, "experience.retest_every"), \
        "experience.retest_every applies to experience.replay_policy prioritized only"
    yield e.replay_policy == "exgrpo" or e.ratio > 0, \
        (f"experience.replay_policy {e.replay_policy} does nothing with experience.ratio 0 (plain GRPO): the mixed "
         "phase, where replay policies act, needs experience.ratio > 0")


def _guidance_rules(cfg, given: set[str]):
    """guidance.*"""
    g, K = cfg.guidance, cfg.rollout.num_generations
    yield g.field is None or bool(g.field.strip()), "guidance.field must be null or a column name"
    yield 1 <= g.members <= K - 1, \
        f"guidance.members must be in [1, num_generations - 1 = {K - 1}] (got {g.members})"
    yield _positive("guidance.gamma", g.gamma)
    yield g.field is not None or not _set_any(given, "guidance.members", "guidance.mode", "guidance.gamma"), \
        "guidance.members, mode and gamma apply only with guidance.field set"


def _train_eval_and_logging_rules(cfg):
    """train.*, eval.*, logging.*"""
    m, d, t, ev, lg = cfg.model, cfg.data, cfg.train, cfg.eval, cfg.logging
    B = cfg.train.prompts_per_step
    yield _at_least("train.steps", t.steps, 1)
    yield _at_least("train.prompts_per_step", B, 1)
    yield _at_least("train.mini_batches", t.mini_batches, 1)
    yield B % t.mini_batches == 0, \
        (f"train.prompts_per_step ({B}) must be divisible by train.mini_batches ({t.mini_batches}): each "
         "mini-batch holds whole groups")
    yield _at_least("train.micro_batch_size", t.micro_batch_size, 1)
    yield _optional_at_least("train.max_tokens_per_micro_batch", t.max_tokens_per_micro_batch, 1)
    yield _optional_at_least("train.logprob_chunk_tokens", t.logprob_chunk_tokens, 1)
    yield t.dtype == "fp32" or m.dtype == "float32", \
        f"train.dtype bf16 keeps fp32 master weights: it needs model.dtype float32 (got {m.dtype!r})"
    yield _optional_at_least("data.max_prompt_length", d.max_prompt_length, 1)
    yield 0 < t.learning_rate <= 1, f"train.learning_rate must be in (0, 1] for AdamW (got {t.learning_rate})"
    yield _at_least("train.weight_decay", t.weight_decay, 0)
    yield 0 <= t.adam_beta1 < 1, f"train.adam_beta1 must be in [0, 1) (got {t.adam_beta1})"
    yield 0 <= t.adam_beta2 < 1, f"train.adam_beta2 must be in [0, 1) (got {t.adam_beta2})"
    yield 0 <= t.warmup_steps <= t.steps * t.mini_batches, \
        (f"train.warmup_steps must be in [0, train.steps x train.mini_batches = {t.steps * t.mini_batches}] "
         f"optimizer steps (got {t.warmup_steps})")
    if t.compile:
        yield from _compile_rules(t, cfg.rollout.engine)
    yield _positive("train.max_grad_norm", t.max_grad_norm)
    yield _positive("train.skip_grad_norm", t.skip_grad_norm)
    yield _at_least("train.max_skipped_optimizer_steps", t.max_skipped_optimizer_steps, 0)
    yield 0 <= t.seed < 2**32, f"train.seed must be in [0, 2**32 - 1] (got {t.seed})"
    yield _at_least("train.save_every", t.save_every, 0)
    yield _at_least("train.save_total_limit", t.save_total_limit, 1)
    yield _at_least("train.threads", t.threads, 0)
    yield _at_least("eval.every", ev.every, 0)
    yield _at_least("eval.samples", ev.samples, 1)
    yield _positive("eval.temperature", ev.temperature)
    yield _optional_at_least("eval.max_questions", ev.max_questions, 1)
    yield _text("logging.output_dir", lg.output_dir)
    yield _at_least("logging.sample_every", lg.sample_every, 0)


def _compile_rules(t, engine: str):
    """train.compile's: where compiled layers are tested"""
    yield engine != "hf", ("train.compile needs rollout.engine vllm or servers: the hf engine generates through the "
                           "compiled layers, which recompiles them layer by layer")
    yield not (t.activation_checkpointing or t.sharding == "fsdp"), \
        "train.compile is not tested with train.activation_checkpointing or train.sharding fsdp: turn those off"


def engine_correction_cap(cfg) -> float | None:
    """objective.tis_cap when truncated IS corrects the engine, else None. `auto` corrects whenever the rollouts
    come from an engine other than the trainer's own forward (vllm: other kernels and reduction orders differ from
    the trainer's even at the same precision; async: older weights too); `tis` always; `none` never."""
    mode, r = cfg.objective.engine_correction, cfg.rollout
    other_engine = r.engine != "hf" or r.mode == "async"  # async: another engine, and older weights
    return cfg.objective.tis_cap if mode == "tis" or (mode == "auto" and other_engine) else None


def compute_precision(cfg) -> str:
    """The dtype the trainer's forward passes run in."""
    return "bfloat16" if cfg.train.dtype == "bf16" else cfg.model.dtype


def engine_precision(cfg) -> str:
    """The dtype rollouts are sampled in (the hf engine samples with the trainer's own forward)."""
    r = cfg.rollout
    return r.engine_dtype if r.engine != "hf" and r.engine_dtype != "auto" else compute_precision(cfg)
