"""Prompt lookup: draft tokens copied from earlier in the sequence itself (n-gram drafts).

Output often repeats what came before: code repeats its names and lines, a summary quotes its
source. So the cheapest guess of what comes next is what followed the last time the same few
tokens appeared. For a sequence (prompt + output) of L tokens, take its last n tokens, for n from
`prompt_lookup_max` down to `prompt_lookup_min`, and find their most recent earlier occurrence,
the one ending at `end` < L (it may overlap the suffix itself). The draft is the
`num_speculative_tokens` (k) tokens that followed it. Near the end of the sequence fewer than k
follow; the copy then runs on into the tokens it has just drafted, as an overlapping copy does
(LZ77's): the tokens from `end` on repeat with period L - end, so

    draft[j] = tokens[end + j % (L - end)]

and every match gives k drafts (`a b a b a b` drafts `a b a b ...`). No match gives none.

`propose_ngram_batched` takes a batch of sequences in a [rows, width] tensor on the device,
with no host round trip, so it can run right after a step's tokens are sampled, on tokens the
host has not seen (overlap scheduling). It scores every candidate end position at once: the
occurrence ending at `end` matches the last n tokens when tokens[end - 1 - i] == tokens[L - 1 -
i] for i < n, so one pass over i = 0, 1, ... max_n - 1, AND-ing the comparisons, has the match
of every n in turn; a longer n that matches anywhere overrides a shorter one. Its oracle, the
same rule on one Python list, short and obvious, is in tests/test_spec.py.
"""
import torch


def propose_ngram_batched(tokens: torch.Tensor, lengths: torch.Tensor,
                          num_speculative_tokens: int, prompt_lookup_min: int,
                          prompt_lookup_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [rows, width] (row r's sequence in its first lengths[r] entries, anything after)
    -> drafts [rows, k] and their number [rows], k or 0 (a row without a match: its drafts are
    meaningless)."""
    rows, width = tokens.shape
    ends = torch.arange(width, device=tokens.device)[None, :]   # candidate ends, [1, width]
    lengths = lengths.long()[:, None]                           # [rows, 1]
    matches = torch.ones(rows, width, dtype=torch.bool, device=tokens.device)
    best_end = torch.full((rows, 1), -1, dtype=torch.long, device=tokens.device)
    for i in range(prompt_lookup_max):
        # tokens[end - 1 - i] at each end (what lies before the start is cut off below)
        before_end = torch.nn.functional.pad(tokens, (i + 1, 0))[:, :width]
        suffix_token = tokens.gather(1, (lengths - 1 - i).clamp(min=0))
        matches &= (before_end == suffix_token) & (ends > i)
        if i + 1 >= prompt_lookup_min:  # n = i + 1: the most recent match ending before L
            end = torch.where(matches & (ends < lengths), ends, -1).amax(dim=1, keepdim=True)
            best_end = torch.where(end >= 0, end, best_end)
    found = best_end >= 0
    period = (lengths - best_end).clamp(min=1)
    steps = torch.arange(num_speculative_tokens, device=tokens.device)[None, :]
    drafts = tokens.gather(1, torch.where(found, best_end + steps % period, 0))
    return drafts, found[:, 0] * num_speculative_tokens
