"""The Tinker training API (`python -m reinforce.training_api`): the `tinker` SDK (PyPI tinker==0.38.0, the `api`
extra) drives it unmodified. docs/training-api.md says what this version supports and what it refuses.

main.py starts it, server.py is its HTTP API, wire.py the SDK's protobuf read and written, store.py the futures in
Redis, worker.py the thread that applies requests (in seq_id order, recovering after a restart), live.py each
model's live snapshot, tenants.py the base model with each model's LoRA adapter and AdamW, losses.py the losses,
checkpoint.py the tinker:// checkpoints, sampling.py the sampler snapshots and `asample`.
"""
