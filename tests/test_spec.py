"""Speculative decoding's building blocks: prompt-lookup drafts (the host oracle and the batched
tensor version, also captured in a CUDA graph) and the bench's replay proposer. The engine's use
of them (outputs equal to plain decoding) is tests/test_spec_engine.py."""
import random

import pytest
import torch

from nanograph.spec.ngram import propose_ngram, propose_ngram_batched


# ---- prompt lookup --------------------------------------------------------------------------
def test_ngram_takes_the_longest_suffix_then_its_most_recent_occurrence():
    # [1, 2] occurred once (followed by 9); [2] alone most recently at index 5 (followed by 8)
    tokens = [7, 1, 2, 9, 5, 2, 8, 1, 2]
    assert propose_ngram(tokens, 2, prompt_lookup_min=1, prompt_lookup_max=2) == [9, 5]
    assert propose_ngram(tokens, 2, prompt_lookup_min=1, prompt_lookup_max=1) == [8, 1]
    assert propose_ngram(tokens, 2, prompt_lookup_min=3, prompt_lookup_max=4) == []
    # [2, 9, 2, 9] last occurred ending at 6: the copy runs on into its own drafts, period 2
    assert propose_ngram([5, 2, 9, 2, 9, 2, 9], 5, 2, 4) == [2, 9, 2, 9, 2]
    # vLLM's docstring example, [2, 3] followed by [4, 2, 3] and then the copy repeats
    assert propose_ngram([1, 2, 3, 4, 2, 3], 4, 2, 3) == [4, 2, 3, 4]
    assert propose_ngram([3], 4, 1, 3) == [] and propose_ngram([3, 3], 3, 1, 3) == [3, 3, 3]


def test_batched_ngram_equals_the_host_version_on_random_sequences():
    rng = random.Random(0)
    for trial in range(30):
        rows, width = 16, 40
        alphabet = rng.choice([2, 3, 5, 50])  # small: many matches; 50: few
        low = rng.randint(1, 3)
        high = rng.randint(low, 5)
        k = rng.randint(1, 5)
        seqs = [[rng.randrange(alphabet) for _ in range(rng.randint(1, width))]
                for _ in range(rows)]
        # past each sequence: junk that must not be matched
        tokens = torch.tensor([s + [rng.randrange(alphabet) for _ in range(width - len(s))]
                               for s in seqs])
        drafts, num_drafts = propose_ngram_batched(tokens, torch.tensor([len(s) for s in seqs]),
                                                   k, low, high)
        for row, seq in enumerate(seqs):
            expected = propose_ngram(seq, k, low, high)
            assert num_drafts[row] == len(expected), (trial, seq)
            assert drafts[row, :len(expected)].tolist() == expected, (trial, seq)


# ---- verification ---------------------------------------------------------------------------
def test_replay_proposer_sets_the_acceptance_rate():
    """Drafting a greedy target's own continuation with each token corrupted at rate 0.3, greedy
    verification emits the continuation unchanged, each draft is accepted with probability 0.7,
    and a step with k = 4 emits (1 - 0.7^5) / (1 - 0.7) tokens on average."""
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.spec_proposers import ReplayProposer

    rng = random.Random(6)
    vocab, prompt_len, k, rate = 50, 8, 4, 0.3
    references = [[rng.randrange(vocab) for _ in range(prompt_len + rng.randint(300, 400))]
                  for _ in range(16)]
    proposer = ReplayProposer(references, prompt_len, rate, vocab, seed=1)
    clean, _ = ReplayProposer(references, prompt_len, 0.0, vocab).propose(
        torch.tensor([r[:prompt_len + 5] for r in references]), torch.full((16,), 12), k)
    assert clean.tolist() == [r[12:12 + k] for r in references]
    # a greedy target whose argmax is the reference; rows in reverse order, so the keys matter
    seqs = [r[:prompt_len] for r in reversed(references)]
    width = max(map(len, references)) + k + 1
    steps = emitted = drafted = 0
    while all(len(s) + k + 1 < len(r) for s, r in zip(seqs, reversed(references))):
        tokens = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
        lengths = torch.tensor(list(map(len, seqs)))
        drafts, num_drafts = proposer.propose(tokens, lengths, k)
        targets = torch.tensor([r[len(s):len(s) + k + 1]
                                for s, r in zip(seqs, reversed(references))])
        # greedy verification: the drafts up to the first the target disagrees with, then its token
        for s, row, target in zip(seqs, drafts.tolist(), targets.tolist()):
            accepted = next((j for j in range(k) if row[j] != target[j]), k)
            s += target[:accepted + 1]
            emitted += accepted + 1
        steps += 1
        drafted += num_drafts.sum().item()
    assert all(s == r[:len(s)] for s, r in zip(seqs, reversed(references)))
    assert drafted == 16 * k * steps
    assert abs(emitted / (16 * steps) - (1 - (1 - rate) ** (k + 1)) / rate) < 0.1



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batched_ngram_captures_in_a_cuda_graph():
    """Prompt lookup runs on the device without a host round trip: captured in a CUDA graph,
    whose replay on new inputs equals the eager run, and the eager run equals the CPU's."""
    generator = torch.Generator().manual_seed(7)
    rows, width, k = 64, 512, 4
    history = torch.randint(0, 8, (rows, width), generator=generator)  # repetitive: matches
    lengths = torch.randint(2, width, (rows,), generator=generator)
    on_cpu = propose_ngram_batched(history, lengths, k, 1, 3)
    static = [history.cuda(), lengths.cuda()]
    eager = propose_ngram_batched(*static, k, 1, 3)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(eager, on_cpu))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = propose_ngram_batched(*static, k, 1, 3)
    for tensor in static:  # new sequences and lengths in the same buffers
        tensor.copy_(tensor.roll(1, dims=0))
    graph.replay()
    again = propose_ngram_batched(*static, k, 1, 3)
    assert all(torch.equal(a, b) for a, b in zip(captured, again))
