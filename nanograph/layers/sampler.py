"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, in one batched pass.

Sampling uses the "exponential race": for probabilities p and independent E_i ~ Exp(1),
argmax_i p_i / E_i is distributed exactly as p. It needs no cumulative sums and no host sync,
and it makes seeding simple: a seeded request draws its own row of noise from its own
generator, so its tokens do not depend on what it is batched with. Rows without a seed share
one draw from the global generator. Greedy rows (temperature 0) take the argmax of the logits.
Since p_i = exp(l_i / T) / Z, the winner is also argmax_i (l_i / T - log E_i): no softmax, and
on CUDA the whole race is one compiled kernel after the noise (each kernel costs a few
microseconds at a 150k vocabulary, and the sampler runs outside the decode graph every step).

top-k / top-p need the logits sorted, which is the only expensive part at a 150k vocabulary, so
it runs only when some request in the batch asks for it.
"""
from dataclasses import dataclass

import torch

from nanograph.utils.compile import cuda_compiled


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


@cuda_compiled
def race(logits: torch.Tensor, temperatures: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    scores = logits.float() / temperatures.clamp(min=1e-5)[:, None] - noise.log()
    return torch.where(temperatures == 0, logits.argmax(dim=-1), scores.argmax(dim=-1))


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [B, V] -> token ids [B]."""
    if batch.all_greedy:
        return logits.argmax(dim=-1)
    if batch.top_ks is not None:  # what top-k / top-p of the tempered distribution leave out can't win
        tempered = logits.float() / batch.temperatures.clamp(min=1e-5)[:, None]
        out = top_k_top_p_filter(tempered, batch.top_ks, batch.top_ps).isinf()
        logits = logits.float().masked_fill(out, float("-inf"))
    noise = torch.empty(logits.shape, device=logits.device).exponential_()
    for row, gen in enumerate(batch.generators):
        if gen is not None:
            noise[row].exponential_(generator=gen)
    return race(logits, batch.temperatures, noise)
