"""The reward server (`python -m reinforce.reward`): the run's reward function on Triton, and the reward functions."""
