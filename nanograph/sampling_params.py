"""Per-request sampling settings, validated when the request is made."""
from dataclasses import dataclass


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
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
