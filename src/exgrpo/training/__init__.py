"""Training: the trainer (the loop, its state and the run), the generation stage, group forming and packing,
external guidance, metrics, and the wiring of a config into parts."""
