"""Speculative decoding, an extension (docs/walkthrough.md, "Speculative decoding").

Decode computes one token per sequence per step, and at small batches the step's time is reading
the weights, whatever the number of tokens. So guess k tokens cheaply, compute them all in one
step, keep the guesses the target agrees with: each step then emits 1 to k + 1 tokens. What it
adds, and where it plugs in:
- ngram.py: the drafts, prompt lookup (copying what followed the last occurrence of the
  sequence's last few tokens);
- drafter.py: drafts for each step's decode rows, the rule that turns them off where they
  cannot pay, the acceptance counters;
- scheduler.py: the scheduler that puts the drafts into steps and cuts the rejected ones;
- verify.py: the runner extension: the verify steps' graphs and sampling rows, and why keeping
  the drafts that plain sampling would have produced keeps the target's distribution.
`Speculation` bundles them as llm.py installs them.
"""
from nanograph.spec.drafter import NgramDrafter, SpeculativeConfig
from nanograph.spec.scheduler import SpeculativeScheduler
from nanograph.spec.verify import VerifyGraphs


class Speculation:
    """The pieces llm.py installs: `scheduler` in place of the base one, `runner_extension` in the
    runner.
    The config is checked here, before any weight is loaded (ValueError naming the key)."""

    def __init__(self, config):
        self.config = SpeculativeConfig.parse(config.speculative_config, config.kvcache_block_size)
        self.drafter = NgramDrafter(self.config)
        max_batch = min(self.config.disable_by_batch_size, config.max_num_seqs)
        self.runner_extension = VerifyGraphs(self.config.num_speculative_tokens, max_batch,
                                             capture=config.attention_backend == "triton")

    def scheduler(self, *args, **kwargs) -> SpeculativeScheduler:
        """The scheduler, built as the base one (engine/scheduler.py) is."""
        return SpeculativeScheduler(*args, drafter=self.drafter, **kwargs)

    def stats(self, graphs) -> dict:
        return self.drafter.stats() | self.runner_extension.stats(graphs)
