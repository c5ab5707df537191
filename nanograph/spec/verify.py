"""Verify steps on captured graphs: the runner's side of speculative decoding.

A verify step is a prefill-only step in the base path's terms (engine/scheduler.py): each
sequence a chunk of 1 + k tokens (its last token and its drafts) over its cached context, every
token a sampling row. The prefill attention's bottom-right causal rule gives each token the
cache and the tokens before it, so row j's logits are the target's for the token after draft j
(after the last token for j = 0), and the forward's sampler draws each row's token at its own
index: plain sampling's token there. The scheduler's `update` keeps the drafts up to the first
one that differs.

Why that keeps the target's distribution. The standard rule for a draft x drawn from a draft
distribution q (Leviathan et al., Chen et al., 2023) accepts x with probability
min(1, p(x) / q(x)) and at the first rejection draws from normalise(max(p - q, 0)). Prompt
lookup's drafts are deterministic: q is one-hot at x, so x is to be accepted with probability
p(x), and a rejection draws from p without x. The test "does plain sampling at this index give
x?" does exactly that: it does with probability p(x), and when it does not, the token it gives
is distributed as p without x. The sampler's noise is hashed from (the request's seed, the
token's index) (layers/sampler.py), so that token is the very one plain decoding would have
drawn there: the emitted tokens are plain sampling's, token for token, and drafts only change
how many come per step, never which. Greedy rows are the special case whose sample is the
argmax.

A draft model (draft_model.py) drafts greedily, its own argmax at each index: deterministic
drafts too, q one-hot, so the same rule is exact for them and nothing here tells the two
drafters apart. A draft model that sampled its drafts from its own q would need the full rule
(the ratio p(x) / q(x), and the residual (p - q)+ drawn from noise of its own); greedy drafts
keep one rule for both drafters, and an exact one.

So the runner needs nothing new but graphs of those shapes and room for their rows: for each
batch bucket b (powers of two up to the drafter's largest batch) a graph of b chunks of k + 1
tokens, b (k + 1) sampling rows, captured with the others into the same pool. A verify step
runs on the smallest that holds it (cuda_graph.py's `holds`); rows without drafts are 1-token
chunks in it, and the rest is padding. As with the mixed graphs, only the triton backend sizes
its prefill attention on the device, so only there are they captured.
"""
from nanograph.engine.model_runner import RunnerExtension
from nanograph.engine.step import StepShape


def verify_shape(batch: int, num_speculative_tokens: int) -> StepShape:
    tokens = batch * (num_speculative_tokens + 1)
    return StepShape(decodes=0, prefill_tokens=tokens, chunks=batch, rows=tokens,
                     max_chunk=num_speculative_tokens + 1)


class VerifyGraphs(RunnerExtension):
    def __init__(self, num_speculative_tokens: int, max_batch: int, capture: bool):
        self.max_rows = max_batch * (num_speculative_tokens + 1)
        ladder = sorted({b for b in (1 << i for i in range(max_batch.bit_length()))} | {max_batch})
        self.graph_shapes = tuple(verify_shape(b, num_speculative_tokens)
                                  for b in ladder) if capture else ()

    def stats(self, graphs) -> dict:
        """The verify graphs' replays, from the graph runner's counters (None: no graphs)."""
        if graphs is None:
            return {}
        replays = {f"{shape.chunks}x{shape.max_chunk}": graphs.stats.replays[shape]
                   for shape in self.graph_shapes}
        return {"spec_verify_graph_replays": sum(replays.values()),
                "spec_verify_replays_per_bucket": replays}
