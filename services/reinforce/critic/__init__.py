"""The PPO critic service (`python -m reinforce.critic`); the trainer's client is trainer/critic_client.py, the JSON
bodies both sides share core/critic_api.py.

main.py starts the service, server.py is its HTTP API, critic.py the value model's state and updates (with checks.py,
what is refused before the model), checkpoint.py its checkpoints, config.py how it runs, value_model.py the value
model itself. Importing the package itself loads nothing heavy.
"""
