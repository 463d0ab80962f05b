"""Reward functions for end-to-end runs through the CLI (`reward.function=toy_rewards:<name>`)."""

import math
import time


def first_char_is_lowercase(prompts, completions, completion_ids, **columns):
    """A reward a random tiny model earns about a quarter of the time."""
    return [1.0 if c[:1].islower() else 0.0 for c in completions]


def always_right(prompts, completions, completion_ids, **columns):
    """Every completion is right: every question retires on its first draw."""
    return [1.0] * len(completions)


def all_but_answer_15(prompts, completions, completion_ids, answer, **columns):
    """Every question is solved at once, except the one whose answer is 15: it never retires."""
    return [0.0 if a == "15" else 1.0 for a in answer]


def infinite(prompts, completions, completion_ids, **columns):
    return [math.inf for _ in completions]


def no_opinion(prompts, completions, completion_ids, **columns):
    return [None for _ in completions]


def wrong_is_worth_two(prompts, completions, completion_ids, **columns):
    """Another scale: 2 for a wrong answer, 3 for a right one, so everything clears a threshold of 1."""
    return [3.0 if c[:1].islower() else 2.0 for c in completions]


def at_most_half(prompts, completions, completion_ids, **columns):
    return [0.5 if c[:1].islower() else 0.0 for c in completions]


def slow_lowercase(prompts, completions, completion_ids, **columns):
    time.sleep(0.5)
    return first_char_is_lowercase(prompts, completions, completion_ids)


def hangs_once(prompts, completions, completion_ids, **columns):
    """The first call ever (marked by the file $TOY_MARKER) hangs for a minute; later calls are instant."""
    import os

    marker = os.environ["TOY_MARKER"]
    if not os.path.exists(marker):
        open(marker, "w").close()
        time.sleep(60)
    return first_char_is_lowercase(prompts, completions, completion_ids)


def raises(prompts, completions, completion_ids, **columns):
    raise ZeroDivisionError("a bug in the reward function")


def returns_a_string(prompts, completions, completion_ids, **columns):
    return "1.0"


def returns_a_scalar(prompts, completions, completion_ids, **columns):
    return 1.0


def returns_two_rewards(prompts, completions, completion_ids, **columns):
    return [1.0, 0.0]


def raises_on_uppercase(prompts, completions, completion_ids, **columns):
    """`first_char_is_lowercase`, except that a completion starting with an upper-case letter is a KeyError."""
    if completions[0][:1].isupper():
        raise KeyError(completions[0][:1])
    return first_char_is_lowercase(prompts, completions, completion_ids)


def hangs(prompts, completions, completion_ids, **columns):
    """Every call hangs (longer than any test's reward.timeout)."""
    time.sleep(600)


def busy_loop(prompts, completions, completion_ids, **columns):
    """Every call spins in pure Python, never returning."""
    while True:
        pass


def exits(prompts, completions, completion_ids, **columns):
    """`sys.exit(0)` in a reward function: a success exit code, from a failure."""
    raise SystemExit(0)


def interrupts(prompts, completions, completion_ids, **columns):
    raise KeyboardInterrupt


def ends_the_process(prompts, completions, completion_ids, **columns):
    import os

    os._exit(0)
