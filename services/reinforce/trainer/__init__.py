"""The trainer service (`python -m reinforce.trainer`): feeds prompts, trains on the rollout groups, publishes
weights."""
