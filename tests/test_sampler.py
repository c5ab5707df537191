"""Sampling: top-k / top-p masks, greedy, the exponential race's distribution over hashed noise, seeds."""
import torch

from conftest import hf_greedy
from nanograph import LLM, SamplingParams
from nanograph.layers.sampler import sample, top_k_top_p_filter


def test_top_k_and_top_p_masks():
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.1, 0.4, 0.2, 0.3], [0.25] * 4]))
    out = top_k_top_p_filter(logits, torch.tensor([2, 4, 4]), torch.tensor([1.0, 0.65, 0.5]))
    kept = torch.isfinite(out)
    assert kept.tolist() == [[False, True, False, True],     # top-2: 0.4, 0.3
                             [False, True, False, True],     # 0.4 + 0.3 reaches 0.65
                             [True, True, False, False]]     # ties: 2 of 4 reach 0.5
    assert torch.equal(out[kept], logits[kept])


def draw(logits, temps, seeds=None, lengths=None, top_ks=None, top_ps=None):
    rows = len(temps)
    seeds = torch.tensor(seeds if seeds is not None else range(rows))
    lengths = torch.tensor(lengths if lengths is not None else [1] * rows)
    top = None if top_ks is None else (top_ks, top_ps)
    return sample(logits, torch.tensor(temps, dtype=torch.float), seeds, lengths, top=top)


def test_sampling_follows_the_distribution_and_greedy_rows_take_argmax():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(20000, 4).clone()
    for seeds, lengths in ((range(20000), [0] * 20000), ([7] * 20000, range(20000))):  # over seeds, over steps
        tokens = draw(logits, [1.0] * 20000, seeds, lengths)
        freq = torch.bincount(tokens, minlength=4).float() / 20000
        assert torch.allclose(freq, probs, atol=0.015)
    hot = draw(logits, [2.0] * 20000)  # temperature 2: p ** (1/2), renormalised
    expected = probs.sqrt() / probs.sqrt().sum()
    assert torch.allclose(torch.bincount(hot, minlength=4).float() / 20000, expected, atol=0.015)
    logits = torch.randn(6, 50)
    mixed = draw(logits, [0, 1, 0, 1, 0, 1])
    assert torch.equal(mixed[::2], logits[::2].argmax(-1))


def test_noise_rows_are_independent_and_uniform_over_the_vocabulary():
    flat = torch.zeros(64, 1000)  # every token equally likely: the winner is the largest noise
    a = draw(flat, [1.0] * 64, seeds=[3] * 64, lengths=range(64))
    b = draw(flat, [1.0] * 64, seeds=[3] * 63 + [4], lengths=range(64))
    assert torch.equal(a[:63], b[:63]) and a[63] != b[63]  # a row's draw depends on its own seed only
    assert len(set(a.tolist())) > 55                       # 64 draws from 1000: few collisions
    counts = torch.bincount(draw(torch.zeros(40000, 10), [1.0] * 40000), minlength=10).float()
    assert (counts / 4000 - 1).abs().max() < 0.06


def test_low_temperature_and_top_k_1_are_greedy():
    logits = torch.randn(8, 100)
    assert torch.equal(draw(logits, [1e-4] * 8), logits.argmax(-1))
    ks, ps = torch.ones(8, dtype=torch.long), torch.ones(8)
    assert torch.equal(draw(logits, [2.0] * 8, top_ks=ks, top_ps=ps), logits.argmax(-1))


def test_top_p_samples_only_inside_the_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, 4).clone()
    tokens = draw(logits, [1.0] * 4000, top_ks=torch.full((4000,), -1), top_ps=torch.full((4000,), 0.7))
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert freq[2:].sum() == 0 and abs(freq[0] - 0.625) < 0.03  # renormalised over {0.5, 0.3}


def test_seeded_request_reproduces_whatever_its_batch(tiny_model):
    path = tiny_model("qwen3")
    llm = LLM(path, kvcache_block_size=16)
    prompt = [5, 9, 31, 77, 120, 3]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0]["token_ids"]
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    crowd = llm.generate([[7, 8, 9], prompt, [100] * 20], [others, seeded, others], use_tqdm=False)
    assert crowd[1]["token_ids"] == alone
    unseeded = [llm.generate([prompt], others, use_tqdm=False)[0]["token_ids"] for _ in range(2)]
    assert unseeded[0] != unseeded[1] or unseeded[0] != alone   # sampling is actually random
    assert alone != hf_greedy(path, [prompt], 16)[0]


def test_unseeded_requests_follow_the_engine_seed(tiny_model):
    path = tiny_model("qwen3")
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 9, 31, 77]] * 2  # the same prompt twice in one batch
    runs = [[o["token_ids"] for o in LLM(path, kvcache_block_size=16, seed=s).generate(prompts, params, use_tqdm=False)]
            for s in (1, 1, 2)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert runs[0][0] != runs[0][1]  # each request has its own noise
