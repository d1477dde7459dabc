"""The Megatron-core trainer backend (`training.backend: megatron`): tensor-parallel GPTModel for Llama policies.

- cpu_shim: lets megatron-core's GPTModel run where CUDA is absent (tests, CI).
- convert: Hugging Face Llama <-> Megatron state dicts and configs, per tensor-parallel rank.
- model: parallel setup, response log-probs (the torch trainer's contract), gathering weights back to HF.
- checkpoint: per-rank sharded checkpoints of model, optimizer and RNG, reshardable across TP sizes.
"""
