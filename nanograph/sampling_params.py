"""Per-request sampling settings, vLLM's names and meanings, validated when the request is made.

Each field is checked for its type as well as its range, a ValueError naming the field: NaN fails
every comparison, so a bare `temperature < 0` lets it through; a float count (`max_tokens=2.5`), a
string (`temperature="0.7"`) or a negative stop id would not fail here but somewhere deep in the
engine; and `ignore_eos="no"` would be true. Whether the stop ids are inside the vocabulary is
checked at request intake (llm.py), where the vocabulary is known.
"""
import math
from dataclasses import dataclass
from numbers import Integral, Real


def is_int(value):
    # True is an int to Python, not a count
    return isinstance(value, Integral) and not isinstance(value, bool)


def is_number(value):
    return isinstance(value, Real) and not isinstance(value, bool)


# each field's type: (the fields, their test, the words for it)
FIELD_TYPES = ((("temperature", "top_p"), is_number, "a number"),
               (("top_k", "n", "min_tokens"), is_int, "an integer"),
               (("max_tokens", "seed", "logprobs", "prompt_logprobs"),
                lambda value: value is None or is_int(value), "an integer or None"),
               (("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"),
                lambda value: isinstance(value, bool), "True or False"))


@dataclass
class SamplingParams:
    temperature: float = 1.0       # 0 = greedy
    top_p: float = 1.0             # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = -1                # keep the k most likely tokens; -1 = all
    max_tokens: int | None = 64    # None: up to the context (max_model_len)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # own random stream: same output whatever the batch (n > 1: seed + i)
    seed: int | None = None
    stop: str | list[str] | None = None   # stop strings: the text is cut where one appears
    include_stop_str_in_output: bool = False
    n: int = 1                     # completions of the prompt; the prompt is computed once
    logprobs: int | None = None    # per token: the sampled token's log-probability and the top N's
    prompt_logprobs: int | None = None  # per prompt token (the first: None): its own and the top N
    min_tokens: int = 0            # EOS and the stop ids are masked until this many tokens
    skip_special_tokens: bool = True

    def __post_init__(self):
        for names, test, kind in FIELD_TYPES:
            for name in names:
                if not test(getattr(self, name)):
                    raise ValueError(f"{name} must be {kind}, got {getattr(self, name)!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if not 0 < self.top_p <= 1:  # also false for NaN
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        for name, low in (("max_tokens", 1), ("n", 1), ("logprobs", 0), ("prompt_logprobs", 0),
                          ("min_tokens", 0)):
            if getattr(self, name) is not None and getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) is above max_tokens ({self.max_tokens})")
        ids = self.stop_token_ids
        if ids is not None and not (isinstance(ids, (list, tuple))
                                    and all(is_int(i) and i >= 0 for i in ids)):
            raise ValueError(f"stop_token_ids must be a list of token ids >= 0, got {ids!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        stop = self.stop
        if stop is not None and not (isinstance(stop, (list, tuple))
                                     and all(isinstance(s, str) and s for s in stop)):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
