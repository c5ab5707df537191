"""Bench-only drafts for measuring speculative decoding's mechanics at a set acceptance rate.

With dummy weights no real proposer guesses anything, so the speculative section measures the
machinery with drafts whose quality it sets: a plain greedy run first gives each prompt's
continuation (the reference), and `ReplayProposer` then drafts that continuation with each
draft token replaced, with probability `corruption_rate`, by another token. Greedy
verification emits the reference (speculative greedy equals plain greedy), so a draft is
accepted exactly when it was left alone: each draft token is accepted with probability
1 - corruption_rate, independently (which tokens are corrupted is fixed per reference
position, so a position drafted again in the next step is as good or bad as before), and a step
with k drafts emits (1 - a^(k+1)) / (1 - a) tokens on average at acceptance a.

It has prompt lookup's interface (nanograph/spec/ngram.py: token tensor and lengths in,
drafts and their number out, on the device): a row is matched to its reference by its first
`key_tokens` tokens (its prompt's start, unique among the references).
"""
import torch


class ReplayProposer:
    def __init__(self, references: list[list[int]], key_tokens: int, corruption_rate: float,
                 vocab_size: int, seed: int = 0, device="cpu"):
        """references: each prompt followed by its greedy continuation."""
        width = max(map(len, references))
        padded = torch.tensor([r + [-1] * (width - len(r)) for r in references])
        generator = torch.Generator().manual_seed(seed)
        corrupted = torch.rand(padded.shape, generator=generator) < corruption_rate
        # another token: the reference's plus 1 .. vocab - 1 (mod vocab)
        shift = torch.randint(1, vocab_size, padded.shape, generator=generator)
        drafts = torch.where(corrupted & (padded >= 0), (padded + shift) % vocab_size, padded)
        self.keys = padded[:, :key_tokens].to(device)
        if len(set(map(tuple, self.keys.tolist()))) < len(references) \
                or min(map(len, references)) < key_tokens:
            raise ValueError(f"the references' first {key_tokens} tokens must tell them apart")
        self.drafts = drafts.to(device)                        # [references, width]
        self.lengths = torch.tensor(list(map(len, references)), device=device)

    def propose(self, tokens: torch.Tensor, lengths: torch.Tensor, num_speculative_tokens: int):
        """tokens [rows, width] (row r's sequence in its first lengths[r] entries) -> drafts
        [rows, k] and their number [rows] (0 for a row that continues no reference; fewer than k
        near a reference's end)."""
        key_tokens = self.keys.shape[1]
        same = (tokens[:, None, :key_tokens] == self.keys[None]).all(dim=-1)  # [rows, refs]
        found, which = same.any(dim=1), same.long().argmax(dim=1)
        lengths = lengths.long()
        positions = lengths[:, None] + torch.arange(num_speculative_tokens, device=tokens.device)
        drafts = self.drafts[which[:, None], positions.clamp(max=self.drafts.shape[1] - 1)]
        left = (self.lengths[which] - lengths).clamp(min=0, max=num_speculative_tokens)
        return drafts, torch.where(found, left, 0)
