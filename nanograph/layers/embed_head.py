"""Token embedding and LM head, split over the vocabulary for tensor parallelism.

Rank r owns vocabulary rows [r * part, (r + 1) * part). The embedding looks up the ids it owns,
writes zeros for the rest, and an all-reduce assembles the full vectors. The LM head computes
logits for its own slice; the slices are gathered and concatenated. With tp=1 both are the plain
F.embedding / linear. A tied LM head shares the embedding's weight tensor.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanograph.layers.linear import parameter, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size, dim: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.part = -(-vocab_size // tp_size())
        self.start = tp_rank() * self.part
        # the last part may be padded
        self.weight = parameter(torch.zeros(self.part, dim), self.weight_loader)

    def weight_loader(self, param, loaded, shard_id=None):
        rows = loaded[self.start:self.start + self.part]
        param.data[:rows.shape[0]].copy_(rows)

    def forward(self, ids):
        if tp_size() == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.start) & (ids < self.start + self.part)
        y = F.embedding((ids - self.start) * mine, self.weight) * mine.unsqueeze(-1)
        dist.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    def forward(self, hidden):
        return self.gather(F.linear(hidden, self.weight))

    def gather(self, logits: torch.Tensor):
        """Every rank's slice of the vocabulary, concatenated; the padding cut off."""
        if tp_size() > 1:
            parts = [torch.empty_like(logits) for _ in range(tp_size())]
            dist.all_gather(parts, logits)
            logits = torch.cat(parts, dim=-1)
        return logits[..., :self.vocab_size]
