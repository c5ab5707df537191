"""Token sampling: greedy, temperature, top-k, top-p and per-request seeds, inside the decode graph.

Sampling uses the "exponential race": for probabilities p and independent E_i ~ Exp(1),
argmax_i p_i / E_i is distributed exactly as p. Since p_i = exp(l_i / T) / Z, the winner is
argmax_i (l_i / T - log E_i): no softmax, no cumulative sums, no host sync. Greedy rows
(temperature 0) take the argmax of the logits.

The noise is not drawn from a random generator: it is computed, E = -log U with U from an
integer hash of (the request's seed, the index of the token being sampled, the token id). So:
- sampling is a pure function of tensors, with no generator state to advance. It is captured
  in the decode graph with the rest of the step (cuda_graph.py), hash and race compiled
  together by torch.compile;
- a request's tokens depend on its seed and nothing else: not on its batch, not on whether its
  prompt was cut into chunks, not on a recompute after preemption. Requests without a seed get
  one made of `LLM(seed=...)` and their id (engine/sequence.py), so a run repeats;
- with tensor parallelism every rank samples the same tokens from the same all-gathered logits,
  so the ranks never exchange them (tp.py).
The hash is Chris Wellons' "lowbias32", a 32-bit integer mixer, applied to the (seed, index)
pair and then per token id. Its top 24 bits make U = (bits + 0.5) / 2**24, strictly inside (0, 1),
so every -log U is finite and positive.

top-k / top-p need the logits sorted, the only expensive part at a 150k vocabulary, so they run
outside the graph, only for a batch in which some request asks for them: the race is then run
again on the logits they leave.
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F

from nanograph.utils.compile import cuda_compiled

MASK32 = 0xFFFFFFFF
VOCAB_CHUNK = 1024


def mix32(x):
    """lowbias32 on int64 tensors holding 32-bit values; both constants are < 2**31, so no product
    overflows 64 bits."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & MASK32
    return x ^ (x >> 15)


@cuda_compiled
def sample_softmax(logits, temperatures, seeds, lengths):
    """logits [B, V]; per row its temperature (0 = greedy), seed and length (the index of the token
    being sampled) -> token ids [B]."""
    # one stream per (seed, index)
    key = mix32(mix32(seeds.long() & MASK32) ^ lengths.long())[:, None]
    token = torch.arange(logits.shape[-1], device=logits.device)
    # adding the key again: rows whose keys differ only in low bits do not share their noise
    bits = mix32((mix32(key ^ token) + key) & MASK32)
    uniform = ((bits >> 8).float() + 0.5) / 2**24
    tempered = logits.float() / temperatures.clamp(min=1e-5)[:, None] \
        - torch.log(-torch.log(uniform))
    return chunked_argmax(torch.where((temperatures == 0)[:, None], logits.float(), tempered))


def chunked_argmax(scores):
    """argmax over the vocabulary in two stages: within chunks of VOCAB_CHUNK, all in parallel,
    then over the chunks' maxima. One reduction per row would run on one thread block per row: at
    batch 1, a 150k-long reduction on one of the GPU's 132 multiprocessors. Ties go to the first
    index."""
    b, v = scores.shape
    num_chunks = -(-v // VOCAB_CHUNK)
    chunks = F.pad(scores, (0, -v % VOCAB_CHUNK),
                   value=float("-inf")).view(b, num_chunks, VOCAB_CHUNK)
    best, index = chunks.max(dim=-1)                 # [B, chunks]
    chunk = best.argmax(dim=-1, keepdim=True)        # the first chunk holding the row's maximum
    return (chunk * VOCAB_CHUNK + index.gather(-1, chunk))[:, 0]


def top_k_top_p_filter(logits, top_ks, top_ps):
    """Set to -inf every logit outside the row's top-k, then outside its top-p nucleus."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)
    # k < 1: off
    sorted_logits.masked_fill_((rank[None, :] >= top_ks[:, None]) & (top_ks[:, None] > 0),
                               float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # drop a token when the more likely ones already reach top_p (the first is always kept)
    sorted_logits.masked_fill_(probs.cumsum(dim=-1) - probs >= top_ps[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(logits, temperatures, seeds, lengths,
           top: tuple | None = None, banned: tuple | None = None):
    """sample_softmax after the masks: `banned` (rows, token ids) pairs (min_tokens), then the
    top-k / top-p filter when `top` = (top_ks, top_ps) is given (top_k < 1 = off, top_p 1 = off)."""
    if banned is not None:
        logits = logits.float().index_put(banned, torch.tensor(float("-inf"), device=logits.device))
    if top is not None:  # what top-k / top-p of the tempered distribution leave out can't win
        tempered = logits.float() / temperatures.clamp(min=1e-5)[:, None]
        left_out = top_k_top_p_filter(tempered, *top).isinf()
        logits = logits.float().masked_fill(left_out, float("-inf"))
    return sample_softmax(logits, temperatures, seeds, lengths)


class Logprobs(NamedTuple):
    """Rows' log-probabilities (`top_logprobs`)."""
    sampled: torch.Tensor      # [rows] each row's token's
    top_values: torch.Tensor   # [rows, N] the N most likely tokens'
    top_ids: torch.Tensor      # [rows, N] and their ids


def top_logprobs(logits, tokens, n: int) -> Logprobs:
    """From the raw logits (before temperature and the filters, as vLLM reports them): each row's
    log-probability of its token (the sampled one, or a prompt's), and its n most likely
    tokens' with their ids."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return Logprobs(logprobs.gather(-1, tokens[:, None])[:, 0], *logprobs.topk(n, dim=-1))
