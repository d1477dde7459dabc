"""The PPO critic service (`python -m reinforce.critic`) and its client.

server.py is the service, value_model.py the value model, api.py the JSON bodies both sides share, client.py the
trainer's `CriticClient`. Importing the package itself loads nothing heavy.
"""
