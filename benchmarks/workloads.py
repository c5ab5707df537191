"""The workloads: token-id prompts and per-request output lengths, the same for every engine.

The reference workload is nano-vllm's bench.py's: 256 sequences; `random.seed(0)`, then every
prompt `[randint(0, 10000) for _ in range(randint(100, 1024))]`, then every `max_tokens =
randint(100, 1024)`; temperature 0.6 and EOS ignored, so the work is fixed by the workload:
133,966 output tokens in all. Prompts are token ids, so no tokenizer is involved.
"""
import random
from dataclasses import dataclass, replace

from benchmarks.shapes import SHAPES

REFERENCE_OUTPUT_TOKENS = 133_966


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]
    temperature: float = 0.6
    logprobs: int | None = None  # `--logprobs N`: every sequence asks for its top-N logprobs

    @property
    def num_seqs(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)

    def head(self, n: int) -> "Workload":
        return replace(self, prompts=self.prompts[:n], max_tokens=self.max_tokens[:n])

    def sampling_params(self):
        from nanograph import SamplingParams
        return [SamplingParams(temperature=self.temperature, ignore_eos=True, max_tokens=n,
                               logprobs=self.logprobs)
                for n in self.max_tokens]

    def summary(self) -> dict:
        return {"num_seqs": self.num_seqs, "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens}


def make_workload(num_seqs: int = 256, min_input_len: int = 100, max_input_len: int = 1024,
                  min_output_len: int = 100, max_output_len: int = 1024,
                  max_token_id: int = 10000, seed: int = 0) -> Workload:
    """nano-vllm's bench.py draws, in this order: all prompts, then all output lengths."""
    rng = random.Random(seed)  # same stream as random.seed(seed) + random.randint
    prompts = [[rng.randint(0, max_token_id)
                for _ in range(rng.randint(min_input_len, max_input_len))]
               for _ in range(num_seqs)]
    max_tokens = [rng.randint(min_output_len, max_output_len) for _ in range(num_seqs)]
    return Workload(prompts, max_tokens)


def reference_workload() -> Workload:
    return make_workload()


def quick_workload() -> Workload:
    return make_workload(num_seqs=8, min_input_len=8, max_input_len=32, min_output_len=4,
                         max_output_len=16, max_token_id=SHAPES["tiny"]["vocab_size"] - 1)


def warmup_workload(quick: bool, max_token_id: int) -> Workload:
    """A few sequences of the same kind on another random stream (so no prefix-cache hits on
    the timed prompts): exercises prefill, decode, sampling and the allocator before the clock."""
    if quick:  # the quick workload's shape: on a CPU a new matmul shape costs a first-time setup
        return make_workload(8, 8, 32, 4, 16, max_token_id, seed=1)
    return make_workload(16, 100, 1024, 32, 32, max_token_id, seed=1)
