"""Verification: which draft tokens to keep, so that the output is distributed as the target's.

A verify step runs the target over each sequence's last token and its k drafts, giving logits
at k + 1 positions per row: position j's are the target's distribution p_j for the token after
draft j - 1 (position 0's for the token after the last accepted one). Position j samples the
token at index `lengths + j` of its sequence. The rule for a draft x drawn from the draft's
distribution q (Leviathan et al., Chen et al., 2023): accept x with probability
min(1, p(x) / q(x)); at the first rejection emit a token drawn from normalise(max(p - q, 0))
instead and stop; if all k are accepted, emit a bonus token drawn from p_k. Each emitted token
is then distributed exactly as p at its position, so a step emits 1 to k + 1 tokens and the
output is distributed as plain sampling's. Rows may have fewer drafts (`num_drafts`): the positions
past them act as rejections with q = 0, whose residual is p itself.

Noise. Like the engine's sampler (layers/sampler.py), nothing here draws from a generator: all
noise is hashed from (the request's seed, the index of the token), so a seeded request gives the
same tokens whatever its batch, and the maths is a pure function of tensors (capturable). Three
streams per (seed, index), independent of one another:
- the sampler's own race noise. `plain` below is what plain sampling would emit at each index;
  a draft model should sample its drafts with it too (the same seed and index);
- the uniform u of the accept test (u * q(x) < p(x)), hashed with ACCEPT_SALT;
- the race noise of the residual draw, the sampler's race under the seed XOR RESIDUAL_SALT. It
  must not be the drafts' noise: a draft drawn with that noise would make the residual draw
  depend on the draft, and the output would no longer be distributed as p.

Deterministic drafts (prompt lookup, a greedy draft model; `draft_probs=None`) have q = one-hot
at x, so x is accepted with probability p(x), and a rejection draws from p without x. Here the
test is "does plain sampling at this index give x?": it does with probability p(x), and when it
does not, the token it gives is distributed as p without x. So the emitted tokens are exactly
plain sampling's, token for token: drafts only change how many come per step, never which. The
same holds for greedy rows (temperature 0), whose plain sample is the argmax, with any q. With a
draft model that samples with the sampler's noise and q == p, every draft is accepted and the
output again equals plain sampling's.

p is the engine's: logits / temperature, then top-k / top-p (layers/sampler.py). Masks that
depend on the position (min_tokens) are the caller's: set those logits to -inf first.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanograph.layers.sampler import MASK32, mix32, sample, sample_softmax, top_k_top_p_filter

ACCEPT_SALT = 0x2545F491
RESIDUAL_SALT = 0x1B873593


@dataclass
class Verified:
    num_accepted: torch.Tensor  # [rows]: drafts kept, 0..k
    # [rows, k + 1]: the kept drafts, then the corrected or bonus token at num_accepted, -1 after
    tokens: torch.Tensor


def accept_uniforms(seeds: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """u in (0, 1) for each (row's seed [rows], token index [rows, positions])."""
    bits = mix32((mix32((seeds.long()[:, None] ^ ACCEPT_SALT) & MASK32) + indices.long())
                 & MASK32)
    return ((bits >> 8).float() + 0.5) / 2**24


def target_probs(logits, temperatures, top: tuple | None = None):
    """p as the sampler draws from it: logits [tokens, vocab] / temperature, top-k / top-p."""
    tempered = logits.float() / temperatures.clamp(min=1e-5)[:, None]
    if top is not None:
        tempered = top_k_top_p_filter(tempered, *top)
    return tempered.softmax(dim=-1)


def standard_rule(probs, draft_probs, drafts, seeds, indices):
    """p and q [rows, k, vocab], drafts and their token indices [rows, k] -> whether each draft
    passes the test u * q(x) < p(x), and the residual draw at each position, [rows, k] both."""
    rows, k = drafts.shape
    p_draft = probs.gather(-1, drafts[..., None])[..., 0]
    q_draft = draft_probs.gather(-1, drafts[..., None])[..., 0]
    residual = (probs - draft_probs).clamp(min=0)
    # all zero only if p == q up to rounding, where nothing is rejected: p avoids 0 / 0
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, probs)
    residual_seeds = (seeds.long() ^ RESIDUAL_SALT).repeat_interleave(k)
    recovered = sample_softmax(residual.log().flatten(0, 1),
                               torch.ones(rows * k, device=probs.device),
                               residual_seeds,
                               indices.flatten())
    return accept_uniforms(seeds, indices) * q_draft < p_draft, recovered.view(rows, k)


def verify(logits: torch.Tensor, drafts: torch.Tensor, temperatures: torch.Tensor,
           seeds: torch.Tensor, lengths: torch.Tensor, num_drafts: torch.Tensor | None = None,
           draft_probs: torch.Tensor | None = None, top: tuple | None = None,
           plain: torch.Tensor | None = None) -> Verified:
    """logits [rows, k + 1, vocab]; drafts [rows, k]; per row its temperature (0 = greedy), seed,
    length (the index of the token position 0 samples) and number of drafts (default k);
    draft_probs [rows, k, vocab] the distributions the drafts were drawn from, None for
    deterministic drafts; top = (top_ks, top_ps) per row, as the sampler takes them; plain
    [rows, k + 1] plain sampling's tokens where the caller has them already (a verify forward
    that samples every position does)."""
    rows, positions, vocab = logits.shape
    k = positions - 1
    steps = torch.arange(positions, device=logits.device)
    indices = lengths.long()[:, None] + steps                      # [rows, k + 1]

    def per_position(values):  # [rows] -> [rows * (k + 1)]
        return values.repeat_interleave(positions)

    flat_top = None if top is None else tuple(per_position(t) for t in top)
    flat_logits = logits.reshape(rows * positions, vocab)
    if plain is None:
        plain = sample(flat_logits, per_position(temperatures), per_position(seeds),
                       indices.flatten(), flat_top).view(rows, positions)
    # a row with fewer drafts: past them, rejections with q = 0, which emit from p (plain)
    has_draft = steps[:k] < (k if num_drafts is None else num_drafts[:, None])
    accepted = (drafts == plain[:, :k]) & has_draft
    emitted = plain  # what a rejection at j (or the bonus at k) emits
    if draft_probs is not None:
        probs = target_probs(flat_logits, per_position(temperatures), flat_top)
        passed, recovered = standard_rule(probs.view(rows, positions, vocab)[:, :k], draft_probs,
                                          drafts, seeds, indices[:, :k])
        sampling = (temperatures > 0)[:, None] & has_draft
        accepted = torch.where(sampling, passed, accepted)
        emitted = torch.cat([torch.where(sampling, recovered, plain[:, :k]), plain[:, k:]], 1)
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    tokens = torch.where(steps < num_accepted[:, None], F.pad(drafts, (0, 1)), emitted)
    return Verified(num_accepted, tokens.masked_fill(steps > num_accepted[:, None], -1))
