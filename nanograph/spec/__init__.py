"""Speculative decoding, an extension (docs/walkthrough.md, "Speculative decoding").

Decode computes one token per sequence per step, and at small batches the step's time is reading
the weights, whatever the number of tokens. So guess k tokens cheaply, compute them all in one
step, keep the guesses the target agrees with: each step then emits 1 to k + 1 tokens. What it
adds, and where it plugs in:
- ngram.py: the drafts, prompt lookup (copying what followed the last occurrence of the
  sequence's last few tokens);
- drafter.py: drafts for each step's decode rows, the rule that turns them off where they
  cannot pay, the acceptance counters;
- draft_model.py: the other drafts, `{"model": path}`'s: a smaller model's greedy guesses, run
  as a second engine with its own weights, KV cache and graphs;
- scheduler.py: the scheduler that puts the drafts into steps and cuts the rejected ones;
- verify.py: the runner extension: the verify steps' graphs and sampling rows, and why keeping
  the drafts that plain sampling would have produced keeps the target's distribution.
`Speculation` bundles them as llm.py installs them.
"""
from nanograph.spec.draft_model import DraftModelDrafter
from nanograph.spec.drafter import NgramDrafter, SpeculativeConfig
from nanograph.spec.scheduler import SpeculativeScheduler
from nanograph.spec.verify import VerifyGraphs


class Speculation:
    """The pieces llm.py installs: `scheduler` in place of the base one, `runner_extension` in the
    runner.
    The config is checked here, before the target's weights are loaded (ValueError naming the
    key); a draft model is built here too, by `build_engine` (llm.py's `LLM`), before the target
    sizes its KV cache (draft_model.py)."""

    def __init__(self, config, build_engine):
        self.config = SpeculativeConfig.parse(config.speculative_config, config.kvcache_block_size)
        max_batch = min(self.config.disable_by_batch_size, config.max_num_seqs)
        if self.config.model is None:
            self.drafter = NgramDrafter(self.config)
        else:
            self.drafter = DraftModelDrafter(self.config, config, build_engine, max_batch)
        self.runner_extension = VerifyGraphs(self.config.num_speculative_tokens, max_batch,
                                             capture=config.attention_backend == "triton")

    def scheduler(self, *args, **kwargs) -> SpeculativeScheduler:
        """The scheduler, built as the base one (engine/scheduler.py) is."""
        return SpeculativeScheduler(*args, drafter=self.drafter, **kwargs)

    def close(self):
        self.drafter.close()

    def stats(self, graphs) -> dict:
        return self.drafter.stats() | self.runner_extension.stats(graphs)
