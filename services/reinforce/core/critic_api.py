"""What crosses the critic's HTTP boundary: the paths and the JSON bodies (token ids and floats; never pickle).

Shared by the service (which validates every request with these models) and `CriticClient` (which builds them), so
the two cannot drift apart. Importing it pulls in pydantic only, not torch.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, NonNegativeInt, model_validator

VALUES_PATH = "/v1/values"
TRAIN_PATH = "/v1/train"
CHECKPOINT_PATH = "/v1/checkpoint"
RESTORE_PATH = "/v1/restore"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ValuesRequest(_Body):
    """Row i is prompt i followed by response i; every prompt has at least one token."""

    prompt_token_ids: list[list[NonNegativeInt]]
    response_token_ids: list[list[NonNegativeInt]]

    @model_validator(mode="after")
    def _rows_match(self) -> ValuesRequest:
        if len(self.prompt_token_ids) != len(self.response_token_ids):
            raise ValueError(f"{len(self.prompt_token_ids)} prompts but {len(self.response_token_ids)} responses")
        if any(not prompt for prompt in self.prompt_token_ids):
            raise ValueError("every prompt needs at least one token (the state before the first response token)")
        return self


class ValuesResponse(_Body):
    values: list[list[float]] = Field(description="V(s_t) of each response token; as many as the response has.")


class Minibatch(ValuesRequest):
    """One optimizer step: the sequences and, per response token, the return R_t and the rollout's value V_old."""

    returns: list[list[FiniteFloat]]
    old_values: list[list[FiniteFloat]]

    @model_validator(mode="after")
    def _one_float_per_response_token(self) -> Minibatch:
        for name in ("returns", "old_values"):
            rows = getattr(self, name)
            if len(rows) != len(self.response_token_ids):
                raise ValueError(f"{len(rows)} rows of {name} for {len(self.response_token_ids)} responses")
            for i, (row, response) in enumerate(zip(rows, self.response_token_ids, strict=True)):
                if len(row) != len(response):
                    raise ValueError(f"{name}[{i}] has {len(row)} values for {len(response)} response tokens")
        if not any(self.response_token_ids):
            raise ValueError("a minibatch needs at least one response token")
        return self


class TrainRequest(_Body):
    minibatches: list[Minibatch] = Field(min_length=1, description="One AdamW step each, in order.")


class MinibatchResult(_Body):
    critic_loss: float
    grad_norm: float = Field(description="Global gradient norm before clipping.")
    value_clip_fraction: float = Field(description="Fraction of tokens whose clipped value error won the max.")
    tokens: int


class TrainResponse(_Body):
    critic_loss: float = Field(description="Mean of the minibatches' losses.")
    grad_norm: float = Field(description="Mean of the minibatches' gradient norms.")
    minibatches: list[MinibatchResult]
    train_steps: int = Field(description="Optimizer steps since the critic was created, resumes included.")


class CheckpointRequest(_Body):
    step: NonNegativeInt = Field(description="The trainer's step; names the checkpoint folder.")


class CheckpointResponse(_Body):
    step: int
    path: str
    train_steps: int


class ReadyResponse(_Body):
    ready: bool
    train_steps: int
    checkpoint_step: int | None = Field(description="Step of the checkpoint last written or loaded.")
