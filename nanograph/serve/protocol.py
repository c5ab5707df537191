"""Request bodies: OpenAI's fields and vLLM's extras, checked by pydantic, then by SamplingParams.

Every field a body may carry is declared, with strict types (`"max_tokens": "5"` is a 400, not
5). A field that would change the answer and is not implemented (tools, response_format, ...)
is refused (`extra="forbid"`), never silently ignored; a few that clients send at their neutral
value are declared with that value as their only one (a penalty of 0, an empty logit_bias). The
fields OpenAI accepts that change nothing here (`store`, `metadata`, `user`, ...) are accepted.
The fields named as SamplingParams' go to it unchanged, so its own checks answer bad values.

`prepare` turns a body into its SamplingParams and its prompts' token ids: the tokenizer and the
chat template run here, in the request's handler (or a worker thread for a large body), never
on the engine thread, and a prompt that does not fit the context is refused before the engine
sees it.
"""
from dataclasses import fields
from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator

from nanograph import SamplingParams
from nanograph.llm import chat_prompt

SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)} - {"max_tokens", "logprobs",
                                                              "prompt_logprobs"}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False   # vLLM's: usage on every chunk


class Body(Strict):
    """The fields both endpoints take."""
    model: str | None = None           # None: the served model
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, le=128)  # (OpenAI's limit)
    temperature: float = 1.0
    top_p: float = 1.0
    stop: str | list[str] | None = None
    seed: int | None = None
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
    # accepted, and change nothing here
    user: str | None = None            # (an end-user id, for the client's own logs)
    store: bool | None = None
    metadata: dict[str, str] | None = None

    def prepare(self, tokenizer, max_model_len: int) -> tuple[SamplingParams, list[list[int]]]:
        """The SamplingParams and the prompts' token ids; ValueError for a bad request."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        prompts = self.prompt_ids(tokenizer)
        longest = max(map(len, prompts))
        room = max_model_len - longest
        max_tokens = room if self.max_tokens is None else self.max_tokens
        if room < 1 or max_tokens > room:  # (OpenAI's words)
            raise ValueError(f"This model's maximum context length is {max_model_len} tokens. "
                             f"However, you requested {longest} tokens in the prompt and "
                             f"max_tokens={self.max_tokens} for the completion")
        same = self.model_dump(include=SAMPLING_FIELDS)
        return SamplingParams(**same, **self.logprobs_params(), max_tokens=max_tokens), prompts


class CompletionRequest(Body):
    # one prompt or several (a choice each): text or token ids
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16        # None: up to the context
    logprobs: int | None = None        # the top N per token, and the sampled one
    echo: bool = False                 # the prompt before the completion (with logprobs: its own)
    suffix: None = None
    best_of: Literal[1] | None = None

    def prompts(self) -> list[str | list[int]]:
        one = isinstance(self.prompt, str) or not self.prompt or isinstance(self.prompt[0], int)
        return [self.prompt] if one else self.prompt

    def prompt_ids(self, tokenizer) -> list[list[int]]:
        if tokenizer is None and any(isinstance(prompt, str) for prompt in self.prompts()):
            raise ValueError("this model has no tokenizer: send prompts as token ids")
        return [tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
                for prompt in self.prompts()]

    def logprobs_params(self) -> dict:
        return {"logprobs": self.logprobs, "prompt_logprobs": self.logprobs if self.echo else None}


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: str
    content: str | list[TextPart] | None   # (None: an assistant's turn of tool calls only)
    name: str | None = None

    @field_validator("content")
    @classmethod
    def text(cls, content):
        """For the chat template, text: the parts joined by newlines (as vLLM does)."""
        if isinstance(content, list):
            return "\n".join(part.text for part in content)
        return content or ""


class ChatRequest(Body):
    messages: list[Message]
    max_tokens: int | None = Field(  # None: up to the context. (Or by OpenAI's newer name)
        None, validation_alias=AliasChoices("max_completion_tokens", "max_tokens"))
    logprobs: bool = False
    top_logprobs: int | None = None    # with logprobs: the top N per token
    chat_template_kwargs: dict | None = None
    parallel_tool_calls: bool | None = None  # (no tools: changes nothing)

    def logprobs_params(self) -> dict:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return {"logprobs": (self.top_logprobs or 0) if self.logprobs else None}

    def prompt_ids(self, tokenizer) -> list[list[int]]:
        if not getattr(tokenizer, "chat_template", None):  # (no tokenizer: None has none)
            raise ValueError("this model has no chat template: use /v1/completions")
        messages = [message.model_dump(exclude_none=True) for message in self.messages]
        return [chat_prompt(tokenizer, messages, self.chat_template_kwargs)]
