"""The environment service: episodes of tools (a sandboxed Python, a calculator, user tools) for multi-turn
rollouts. The API: server.py and reinforce/core/environment_api.py; tools: tools.py; the sandbox: sandbox.py."""
