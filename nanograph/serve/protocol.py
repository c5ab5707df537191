"""Request bodies: OpenAI's fields and vLLM's extras, checked by pydantic, then by SamplingParams.

Every field a body may carry is declared, and any other is refused (`extra="forbid"`): a field
nanograph does not implement (tools, response_format, ...) is a 400, never silently ignored.
A few that clients send at their neutral value are declared with that value as their only one
(a penalty of 0, an empty logit_bias, echo false). The fields named as SamplingParams' go to
it unchanged, so its own checks (ranges, types) answer bad values.
"""
from dataclasses import fields
from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from nanograph import SamplingParams

SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)} - {"max_tokens", "logprobs"}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False


class Body(Strict):
    """The fields both endpoints take."""
    model: str | None = None           # None: the served model
    stream: bool = False
    stream_options: StreamOptions = StreamOptions()
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None            # (an end-user id, for the client's own logs)
    # vLLM's extras
    top_k: int = -1
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # not implemented: accepted at their neutral value only
    presence_penalty: Literal[0] = 0
    frequency_penalty: Literal[0] = 0
    logit_bias: dict[str, float] | None = Field(None, max_length=0)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """ValueError for a bad value."""
        if "stream_options" in self.model_fields_set and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        same = self.model_dump(include=SAMPLING_FIELDS)
        return SamplingParams(**same, max_tokens=max_tokens, logprobs=logprobs)


class CompletionRequest(Body):
    prompt: str | list[int]            # one prompt: text or token ids
    max_tokens: int = 16
    logprobs: int | None = None        # the top N per token, and the sampled one
    echo: Literal[False] = False
    suffix: None = None
    best_of: Literal[1] | None = None

    def job(self, max_model_len: int) -> dict:
        """What the engine thread's Job takes from the body."""
        return dict(params=self.sampling_params(self.max_tokens, self.logprobs), prompt=self.prompt)


class Message(Strict):
    role: str
    content: str                       # (text only: a list of content parts is a 400)
    name: str | None = None


class ChatRequest(Body):
    messages: list[Message]
    max_tokens: int | None = Field(  # None: up to the model's length. (Or by OpenAI's newer name)
        None, validation_alias=AliasChoices("max_completion_tokens", "max_tokens"))
    logprobs: bool = False
    top_logprobs: int | None = None    # with logprobs: the top N per token
    chat_template_kwargs: dict | None = None

    def job(self, max_model_len: int) -> dict:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        max_tokens = self.max_tokens if self.max_tokens is not None else max_model_len
        top_logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return dict(params=self.sampling_params(max_tokens, top_logprobs),
                    messages=[message.model_dump(exclude_none=True) for message in self.messages],
                    chat_template_kwargs=self.chat_template_kwargs)
