"""The generator service (`python -m reinforce.generator`): prompts from the queue, sampled and scored, back as rollout
groups."""
