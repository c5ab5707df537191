"""One completion as the engine sees it: its tokens, how far the KV cache covers them, its blocks.

The central counter is `num_computed_tokens`: tokens [0, num_computed_tokens) have K/V in the
cache (or will have, once the steps already launched have run). A step computes more of them (a
prefill chunk, or 1 in decode); when the cache covers every token, the step's logits give the
next token. Until the host has that token back, `token_ids` ends with a placeholder for it, a
negative number (docs/walkthrough.md, "Placeholders"). Preemption frees the blocks and resets the
counter to 0: the tokens stay, their K/V is recomputed later.

A request for n completions is n sequences. The first computes the prompt; the others wait in
its `forks` until it has (scheduler.py), then start from its blocks in the prefix cache.
"""
from dataclasses import dataclass
from enum import Enum, auto

from nanograph.sampling_params import SamplingParams


class Status(Enum):
    WAITING = auto()    # needs (more) prefill
    RUNNING = auto()    # decoding
    FINISHED = auto()


@dataclass(eq=False)  # compared by identity: sequences are looked up in queues and lists
class Sequence:
    seq_id: int
    token_ids: list[int]        # the prompt (copied here), then the completion
    params: SamplingParams
    block_size: int
    seed: int = 0               # its sampling noise stream (layers/sampler.py), 31 bits
    stop_ids: frozenset[int] = frozenset()  # what ends it: EOS (unless ignore_eos), stop_token_ids
    request_id: int = 0         # the request it is a completion of
    adapter: object = None      # its LoRA adapter (lora/adapter.py), None = the base model
    # where the prefix cache's hash chain starts (block_manager.py): the same tokens under
    # another adapter have other K/V
    cache_salt: int = 0

    def __post_init__(self):
        self.token_ids = list(self.token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_hashed_blocks = 0   # leading blocks already registered in the prefix cache
        self.forks: list[Sequence] = []   # the other completions of its request, not yet started
        self.drafts_from: int | None = None  # where its drafts not yet checked begin (spec/)
        self.finish_reason: str | None = None   # "stop" | "length" | "abort"
        self.stop_reason: int | str | None = None  # the stop id or stop string that ended it
        self.logprobs: list[dict] | None = [] if self.params.logprobs is not None else None
        # prompt_logprobs: entry i for prompt token i, None for the first (nothing predicts it)
        self.prompt_logprobs: list[dict | None] | None = (
            None if self.params.prompt_logprobs is None else [None] * self.num_prompt_tokens)

    def __len__(self):
        return len(self.token_ids)

    @property
    def completion_token_ids(self):
        """The completion's tokens the host has: without drafts not yet checked, nor placeholders
        for tokens still in flight."""
        tokens = self.token_ids[self.num_prompt_tokens:self.drafts_from]
        while tokens and tokens[-1] < 0:
            tokens.pop()
        return tokens

    def truncate(self, length: int):
        """Keep the first `length` tokens (and their logprobs): drafts, or tokens past a stop."""
        if self.logprobs is not None:
            del self.logprobs[max(length - self.num_prompt_tokens, 0):]
        del self.token_ids[length:]
        self.drafts_from = None

    @property
    def num_blocks(self):
        return -(-len(self) // self.block_size)

    def block_tokens(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]
