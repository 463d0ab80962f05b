"""The learner: the policy forward (shared prompts, chunked head), the objective (pure functions) and the update."""
