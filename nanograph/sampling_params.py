"""Per-request sampling settings, validated when the request is made.

Each field is checked for its type as well as its range: NaN fails every comparison, so a bare
`temperature < 0` lets it through, and a float count (`max_tokens=2.5`) or a negative stop id
would not fail here but somewhere deep in the engine. Whether the stop ids are inside the
vocabulary is checked at request intake (llm.py), where the vocabulary is known.
"""
import math
from dataclasses import dataclass
from numbers import Integral


def is_int(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)  # True is an int to Python, not a count


@dataclass
class SamplingParams:
    temperature: float = 1.0       # 0 = greedy
    top_p: float = 1.0             # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = -1                # keep the k most likely tokens; -1 = all
    max_tokens: int = 64
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    seed: int | None = None        # own random stream: same output whatever the request is batched with

    def __post_init__(self):
        for name in ("top_k", "max_tokens", "seed"):
            value = getattr(self, name)
            if not is_int(value) and not (name == "seed" and value is None):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if not 0 < self.top_p <= 1:  # also false for NaN
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        ids = self.stop_token_ids
        if ids is not None and not (isinstance(ids, (list, tuple)) and all(is_int(i) and i >= 0 for i in ids)):
            raise ValueError(f"stop_token_ids must be a list of token ids >= 0, got {ids!r}")
