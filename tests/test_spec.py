"""Speculative decoding's building blocks: prompt-lookup drafts (host oracle and the batched
tensor version) and verification (greedy exactness, token-for-token equality with plain sampling
for deterministic drafts, the target's distribution for a draft model's drafts)."""
import random

import pytest
import torch

from nanograph.layers.sampler import sample
from nanograph.spec.acceptance import target_probs, verify
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
def plain_token(logits, temperature, seed, index, top=None):
    """Plain sampling's token for one position, alone in its batch."""
    top = None if top is None else tuple(torch.tensor([t]) for t in top)
    return sample(logits[None], torch.tensor([temperature]), torch.tensor([seed]),
                  torch.tensor([index]), top).item()


def expected_verify(logits, drafts, temperatures, seeds, lengths, num_drafts, tops):
    """The oracle for deterministic drafts: walk each row's positions, emitting plain sampling's
    token at each index, until it differs from the draft or the drafts run out."""
    out = []
    for row in range(len(logits)):
        tokens = []
        for j in range(logits.shape[1]):
            token = plain_token(logits[row, j], temperatures[row].item(), seeds[row].item(),
                                lengths[row].item() + j, tops[row])
            tokens.append(token)
            if j == num_drafts[row] or token != drafts[row, j]:
                break
        out.append(tokens)
    return out


def random_batch(rows, k, vocab, generator):
    logits = torch.randn(rows, k + 1, vocab, generator=generator) * 3
    seeds = torch.randint(0, 2**31 - 1, (rows,), generator=generator)
    lengths = torch.randint(1, 1000, (rows,), generator=generator)
    return logits, seeds, lengths


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_greedy_rows_emit_the_argmax_run_whatever_the_drafts(with_draft_probs):
    generator = torch.Generator().manual_seed(1)
    rows, k, vocab = 64, 4, 50
    logits, seeds, lengths = random_batch(rows, k, vocab, generator)
    argmax = logits.argmax(-1)
    # the greedy continuation with each draft wrong with probability 0.3
    wrong = torch.rand(rows, k, generator=generator) < 0.3
    drafts = torch.where(wrong, (argmax[:, :k] + 1) % vocab, argmax[:, :k])
    num_drafts = torch.randint(0, k + 1, (rows,), generator=generator)
    draft_probs = torch.rand(rows, k, vocab, generator=generator).softmax(-1) \
        if with_draft_probs else None
    out = verify(logits, drafts, torch.zeros(rows), seeds, lengths, num_drafts, draft_probs)
    for row in range(rows):
        n = out.num_accepted[row].item()
        matching = 0
        while matching < num_drafts[row] and drafts[row, matching] == argmax[row, matching]:
            matching += 1
        assert n == matching
        assert out.tokens[row, :n + 1].tolist() == argmax[row, :n + 1].tolist()
        assert (out.tokens[row, n + 1:] == -1).all()


def test_deterministic_drafts_emit_plain_sampling_s_tokens():
    """With deterministic drafts the output is plain sampling's, token for token: with
    temperatures, top-k / top-p, greedy rows and short drafts in one batch."""
    generator = torch.Generator().manual_seed(2)
    rows, k, vocab = 48, 3, 40
    logits, seeds, lengths = random_batch(rows, k, vocab, generator)
    temperatures = torch.tensor([0.0, 0.6, 1.0, 1.5] * (rows // 4))
    top_ks = torch.tensor([-1, 5, -1, 10] * (rows // 4))
    top_ps = torch.tensor([1.0, 1.0, 0.8, 0.9] * (rows // 4))
    plain = torch.tensor([[plain_token(logits[r, j], temperatures[r].item(), seeds[r].item(),
                                       lengths[r].item() + j, (top_ks[r], top_ps[r]))
                           for j in range(k + 1)] for r in range(rows)])
    # drafts: plain sampling's tokens, each replaced by another with probability 0.4
    wrong = torch.rand(rows, k, generator=generator) < 0.4
    drafts = torch.where(wrong, (plain[:, :k] + 1) % vocab, plain[:, :k])
    num_drafts = torch.randint(0, k + 1, (rows,), generator=generator)
    out = verify(logits, drafts, temperatures, seeds, lengths, num_drafts,
                 top=(top_ks, top_ps))
    expected = expected_verify(logits, drafts, temperatures, seeds, lengths, num_drafts,
                               list(zip(top_ks.tolist(), top_ps.tolist())))
    assert 0 < out.num_accepted.sum() < num_drafts.sum()  # both outcomes happen
    for row, tokens in enumerate(expected):
        assert out.num_accepted[row] == len(tokens) - 1
        assert out.tokens[row, :len(tokens)].tolist() == tokens
    # a verify forward has plain sampling's tokens at every position already: then only they
    # count (the logits are not read again)
    given = verify(torch.zeros_like(logits), drafts, temperatures, seeds, lengths, num_drafts,
                   plain=plain)
    assert torch.equal(given.tokens, out.tokens)


def test_a_draft_model_equal_to_the_target_has_every_draft_accepted():
    """q == p and drafts sampled with the sampler's own noise: all accepted, and the output
    (drafts + bonus) is plain sampling's."""
    generator = torch.Generator().manual_seed(3)
    rows, k, vocab = 32, 4, 64
    logits, seeds, lengths = random_batch(rows, k, vocab, generator)
    temperatures = torch.full((rows,), 0.9)
    plain = torch.tensor([[plain_token(logits[r, j], 0.9, seeds[r].item(), lengths[r].item() + j)
                           for j in range(k + 1)] for r in range(rows)])
    q = target_probs(logits[:, :k].flatten(0, 1), temperatures.repeat_interleave(k))
    out = verify(logits, plain[:, :k], temperatures, seeds, lengths,
                 draft_probs=q.view(rows, k, vocab))
    assert (out.num_accepted == k).all()
    assert torch.equal(out.tokens, plain)


def test_rows_do_not_depend_on_their_batch():
    generator = torch.Generator().manual_seed(4)
    rows, k, vocab = 16, 3, 30
    logits, seeds, lengths = random_batch(rows, k, vocab, generator)
    drafts = torch.randint(0, vocab, (rows, k), generator=generator)
    q = torch.rand(rows, k, vocab, generator=generator).softmax(-1)
    temperatures = torch.rand(rows, generator=generator) + 0.5
    order = torch.randperm(rows, generator=generator)
    whole = verify(logits, drafts, temperatures, seeds, lengths, draft_probs=q)
    shuffled = verify(logits[order], drafts[order], temperatures[order], seeds[order],
                      lengths[order], draft_probs=q[order])
    assert torch.equal(shuffled.tokens, whole.tokens[order])
    alone = verify(logits[:1], drafts[:1], temperatures[:1], seeds[:1], lengths[:1],
                   draft_probs=q[:1])
    assert torch.equal(alone.tokens, whole.tokens[:1])


def chi_square_p_value(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of `tokens` against `probs` over its support (tokens outside it fail)."""
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    support = probs > 0
    assert counts[~support].sum() == 0
    expected = probs[support].double() * counts.sum()
    statistic = ((counts[support] - expected) ** 2 / expected).sum()
    freedom = torch.tensor(support.sum().item() - 1.0, dtype=torch.double)
    return torch.special.gammaincc(freedom / 2, statistic / 2).item()


@pytest.mark.parametrize("drafter", ["adversarial_q", "adversarial_q_sampler_noise", "one_hot"])
def test_emitted_tokens_follow_the_target_distribution(drafter):
    """Over 20,000 seeds on a 6-token vocabulary, each position's emitted token is distributed as
    p (temperature 0.8, top-k 4), whatever the drafts: a draft model whose q favours what p
    does not (including tokens outside top-k), drawn independently or with the sampler's own
    noise (as a draft model in the engine would), or fixed drafts (one-hot q). The positions are
    context-free (fixed logits), so position j's token, where it is reached, is distributed as
    p_j."""
    trials, k, vocab = 20_000, 2, 6
    generator = torch.Generator().manual_seed(5)
    position_logits = torch.randn(k + 1, vocab, generator=generator)
    temperature, top_k = 0.8, 4
    temperatures = torch.full((k + 1,), temperature)
    p = target_probs(position_logits, temperatures, (torch.full((k + 1,), top_k),
                                                      torch.ones(k + 1)))
    logits = position_logits.expand(trials, k + 1, vocab)
    if drafter == "one_hot":
        draft_probs = None
        # drafts: the second most likely token, then the most likely
        drafts = torch.stack([p[0].argsort(descending=True)[1], p[1].argmax()]).expand(trials, k)
    else:
        # half its mass where p has least (outside top-k too), half as p: half accepted
        q = 0.5 * (-position_logits[:k]).softmax(-1) + 0.5 * p[:k]
        draft_probs = q.expand(trials, k, vocab)
        drafts = torch.stack([torch.multinomial(q[j], trials, replacement=True,
                                                generator=generator) for j in range(k)], 1)
        if drafter == "adversarial_q_sampler_noise":
            drafts = torch.stack([sample(q[j].log().expand(trials, vocab), torch.ones(trials),
                                         torch.arange(trials), torch.full((trials,), 7 + j))
                                  for j in range(k)], 1)
    out = verify(logits, drafts, torch.full((trials,), temperature), torch.arange(trials),
                 torch.full((trials,), 7), draft_probs=draft_probs,
                 top=(torch.full((trials,), top_k), torch.ones(trials)))
    for j in range(k + 1):
        reached = out.num_accepted >= j
        assert reached.sum() > 1000
        assert chi_square_p_value(out.tokens[reached, j], p[j]) > 1e-3, j
    # the acceptance rate is the rule's: sum over x of min(p(x), q(x)) per draft
    first = (out.num_accepted >= 1).double().mean().item()
    expected = p[0][drafts[0, 0]] if draft_probs is None else torch.minimum(p[0], q[0]).sum()
    assert abs(first - expected.item()) < 0.015


# ---- the bench's replay proposer ------------------------------------------------------------
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
        logits = torch.nn.functional.one_hot(targets, vocab).float() * 10
        out = verify(logits, drafts, torch.zeros(16), torch.zeros(16), lengths, num_drafts)
        for s, row in zip(seqs, out.tokens.tolist()):
            s += [t for t in row if t >= 0]
        steps, emitted = steps + 1, emitted + (out.num_accepted + 1).sum().item()
        drafted += num_drafts.sum().item()
    assert all(s == r[:len(s)] for s, r in zip(seqs, reversed(references)))
    assert drafted == 16 * k * steps
    assert abs(emitted / (16 * steps) - (1 - (1 - rate) ** (k + 1)) / rate) < 0.1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_drafting_and_verification_capture_in_a_cuda_graph(with_draft_probs):
    """Prompt lookup and verification run on the device without a host round trip: captured in
    one CUDA graph, whose replay on new inputs equals the eager run, and the eager run equals the
    CPU's on the same inputs."""
    generator = torch.Generator().manual_seed(7)
    rows, width, k, vocab = 64, 512, 4, 1000
    history = torch.randint(0, 8, (rows, width), generator=generator)  # repetitive: matches
    lengths = torch.randint(2, width, (rows,), generator=generator)
    logits, seeds, _ = random_batch(rows, k, vocab, generator)
    temperatures = torch.rand(rows, generator=generator) * (torch.arange(rows) % 3 > 0)
    q = torch.rand(rows, k, vocab, generator=generator).softmax(-1) if with_draft_probs else None

    def step(history, lengths, logits, temperatures, seeds, q):
        drafts, num_drafts = propose_ngram_batched(history, lengths, k, 1, 3)
        return verify(logits, drafts, temperatures, seeds, lengths, num_drafts, q)

    inputs = [history, lengths, logits, temperatures, seeds, q]
    static = [None if t is None else t.cuda() for t in inputs]
    on_cpu = step(*inputs)
    eager = step(*static)  # also the warm-up: torch.compile's kernels outside the capture
    assert torch.equal(eager.tokens.cpu(), on_cpu.tokens)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(*static)
    for tensor in static[:3]:  # new sequences, lengths and logits in the same buffers
        tensor.copy_(tensor.roll(1, dims=0))
    graph.replay()
    again = step(*static)
    assert torch.equal(captured.tokens, again.tokens)
    assert torch.equal(captured.num_accepted, again.num_accepted)
