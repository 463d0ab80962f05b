"""Prompts: a question's chat messages rendered with the tokenizer's chat template, and their token ids."""

from __future__ import annotations

import warnings
from typing import Callable, Sequence

from exgrpo.data.questions import Question
from exgrpo.errors import ConfigError, ExgrpoWarning


def render_prompt(
    tokenizer,
    messages: Sequence[dict],
    *,
    remove_system: bool = False,
    system_prompt: str | None = None,
    think_prefix: str = "",
) -> str:
    """Apply the tokenizer's chat template with a generation prompt and return the prompt text.

    `remove_system` drops system messages (ExGRPO eval); note a template may still inject its own default system
    prompt. `system_prompt` replaces any system messages with this one. `think_prefix` (e.g. "<think>\\n") is appended
    unless the rendered prompt already ends with it (some templates add it themselves).
    """
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(f"tokenizer {name!r} has no chat template; set tokenizer.chat_template first")
    drop_system = remove_system or system_prompt is not None
    msgs = [dict(m) for m in messages if not (drop_system and m["role"] == "system")]
    if system_prompt is not None:
        msgs.insert(0, {"role": "system", "content": system_prompt})
    if not msgs:
        raise ValueError("no messages left to render after removing system messages")
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    if think_prefix and not text.endswith(think_prefix):
        text += think_prefix
    return text


class PromptEncoder:
    """The token ids of each question's rendered prompt (see `render_prompt`), computed once per question id."""

    def __init__(self, tokenizer, *, remove_system: bool = False, system_prompt: str | None = None,
                 think_prefix: str = ""):
        self.tokenizer = tokenizer
        self._options = {"remove_system": remove_system, "system_prompt": system_prompt, "think_prefix": think_prefix}
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def from_config(cls, tokenizer, data) -> "PromptEncoder":
        """With the `data` config section's remove_system, system_prompt and think_prefix."""
        return cls(tokenizer, remove_system=data.remove_system, system_prompt=data.system_prompt,
                   think_prefix=data.think_prefix)

    def __call__(self, question: Question) -> list[int]:
        ids = self._cache.get(question.id)
        if ids is None:
            text = render_prompt(self.tokenizer, question.messages, **self._options)
            ids = self._cache[question.id] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids


def drop_long_prompts(questions: Sequence[Question], prompt_ids: Callable[[Question], list[int]], limit: int,
                      which: str) -> list[Question]:
    """The questions whose prompt is at most `limit` tokens (released: longer ones are dropped), with a warning
    that counts the dropped ones of the `which` set; a ConfigError when that would drop them all."""
    kept = [q for q in questions if len(prompt_ids(q)) <= limit]
    if questions and not kept:
        shortest = min(len(prompt_ids(q)) for q in questions)
        raise ConfigError(f"data.max_prompt_length ({limit}) is below every {which} question's prompt: all "
                          f"{len(questions)} would be dropped (the shortest prompt has {shortest} tokens)")
    if len(kept) < len(questions):
        warnings.warn(ExgrpoWarning(f"dropped {len(questions) - len(kept)} of {len(questions)} {which} questions "
                                    f"whose prompt is longer than data.max_prompt_length = {limit} tokens"),
                      stacklevel=3)
    return kept
