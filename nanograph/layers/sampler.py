"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, in one batched pass.

Sampling uses the "exponential race": for probabilities p and independent E_i ~ Exp(1),
argmax_i p_i / E_i is distributed exactly as p. It needs no cumulative sums and no host sync,
and it makes seeding simple: a seeded request draws its own row of noise from its own
generator, so its tokens do not depend on what it is batched with. Rows without a seed share
one draw from the global generator. Greedy rows (temperature 0) take the argmax of the logits.

top-k / top-p need the logits sorted, which is the only expensive part at a 150k vocabulary, so
it runs only when some request in the batch asks for it.
"""
from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    temperatures: torch.Tensor          # [B] float, 0 = greedy
    all_greedy: bool                    # known on the host: skips the sampling kernels entirely
    top_ks: torch.Tensor | None         # [B] long, vocab size = off; None when no row uses it
    top_ps: torch.Tensor | None         # [B] float, 1 = off; None when no row uses it
    generators: list[torch.Generator | None]  # per row; None = global RNG


def top_k_top_p_filter(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside the row's top-k, then outside its top-p nucleus."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)
    sorted_logits.masked_fill_(rank[None, :] >= top_ks[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # drop a token when the more likely ones already reach top_p (the first is always kept)
    sorted_logits.masked_fill_(probs.cumsum(dim=-1) - probs >= top_ps[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [B, V] -> token ids [B]."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy
    logits = logits / batch.temperatures.clamp(min=1e-5)[:, None]
    if batch.top_ks is not None:
        logits = top_k_top_p_filter(logits, batch.top_ks, batch.top_ps)
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_()
    for row, gen in enumerate(batch.generators):
        if gen is not None:
            noise[row].exponential_(generator=gen)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(batch.temperatures == 0, greedy, sampled)
