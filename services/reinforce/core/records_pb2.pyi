from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PromptKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRAIN: _ClassVar[PromptKind]
    VALIDATION: _ClassVar[PromptKind]
TRAIN: PromptKind
VALIDATION: PromptKind

class Prompt(_message.Message):
    __slots__ = ("id", "step", "policy_version", "text", "token_ids", "num_samples", "seed", "kind", "temperature", "answer")
    ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    id: str
    step: int
    policy_version: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_samples: int
    seed: int
    kind: PromptKind
    temperature: float
    answer: str
    def __init__(self, id: _Optional[str] = ..., step: _Optional[int] = ..., policy_version: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_samples: _Optional[int] = ..., seed: _Optional[int] = ..., kind: _Optional[_Union[PromptKind, str]] = ..., temperature: _Optional[float] = ..., answer: _Optional[str] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("token_ids", "logprobs", "reward", "is_end", "text", "loss_mask", "turns", "tool_calls")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    IS_END_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    reward: float
    is_end: bool
    text: str
    loss_mask: _containers.RepeatedScalarFieldContainer[bool]
    turns: int
    tool_calls: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., reward: _Optional[float] = ..., is_end: _Optional[bool] = ..., text: _Optional[str] = ..., loss_mask: _Optional[_Iterable[bool]] = ..., turns: _Optional[int] = ..., tool_calls: _Optional[int] = ...) -> None: ...

class RolloutGroup(_message.Message):
    __slots__ = ("prompt_id", "step", "policy_version", "prompt_text", "prompt_token_ids", "samples", "generator_id", "generate_seconds", "reward_seconds", "kind", "answer")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    step: int
    policy_version: int
    prompt_text: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    generator_id: str
    generate_seconds: float
    reward_seconds: float
    kind: PromptKind
    answer: str
    def __init__(self, prompt_id: _Optional[str] = ..., step: _Optional[int] = ..., policy_version: _Optional[int] = ..., prompt_text: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., generator_id: _Optional[str] = ..., generate_seconds: _Optional[float] = ..., reward_seconds: _Optional[float] = ..., kind: _Optional[_Union[PromptKind, str]] = ..., answer: _Optional[str] = ...) -> None: ...

class WeightVersion(_message.Message):
    __slots__ = ("version", "uri", "sha256", "num_bytes", "published_at", "chunk_bytes", "chunk_sha256")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_AT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SHA256_FIELD_NUMBER: _ClassVar[int]
    version: int
    uri: str
    sha256: str
    num_bytes: int
    published_at: float
    chunk_bytes: int
    chunk_sha256: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, version: _Optional[int] = ..., uri: _Optional[str] = ..., sha256: _Optional[str] = ..., num_bytes: _Optional[int] = ..., published_at: _Optional[float] = ..., chunk_bytes: _Optional[int] = ..., chunk_sha256: _Optional[_Iterable[bytes]] = ...) -> None: ...

class RelayPlan(_message.Message):
    __slots__ = ("version", "sha256", "sources")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    version: int
    sha256: str
    sources: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[int] = ..., sha256: _Optional[str] = ..., sources: _Optional[_Iterable[str]] = ...) -> None: ...
