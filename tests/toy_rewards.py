"""A reward a random tiny model earns about a quarter of the time, for end-to-end runs through the CLI."""


def first_char_is_lowercase(prompts, completions, completion_ids, **columns):
    return [1.0 if c[:1].islower() else 0.0 for c in completions]
