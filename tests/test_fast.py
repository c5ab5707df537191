"""The batch-1 chain (nanograph/fast/) against HF transformers and HF + PEFT on the same weights.

The chain replaces the textbook decoder stack and LM head for steps of up to 16 tokens. On CUDA
the engine installs it itself; on the CPU these tests install it by hand and its Triton kernels
run in Triton's interpreter (conftest.py), so CI checks the chain's arithmetic: the deferred
norms, SiLU(gate) * up inside the product, the residual stream written by the GEMV, both the
CUDA-core GEMV (1-2 rows) and the tensor-core kernel (3-16 rows), and with LoRA each product's
delta and the folds that carry the next product's h. Decode batches shrink from 3 rows to 1 as
requests finish; a 20-token prompt's prefill runs the textbook forward (above 16 tokens).
"""
import pytest
import torch

from conftest import hf_greedy
from nanograph import LLM, SamplingParams
from test_engine import random_prompts
from test_lora import peft_greedy

pytestmark = pytest.mark.triton

LENGTHS = [5, 20, 9]
MAX_TOKENS = [6, 3, 4]  # batches of 3, 2 and 1 decode rows


def chained_llm(path: str, **kwargs) -> LLM:
    """A float32 LLM whose model runs the chain (installed here without CUDA)."""
    from nanograph.fast.chain import FastDecodeChain, FastDecoderModel
    llm = LLM(path, kvcache_block_size=16, dtype="float32", **kwargs)
    if not isinstance(llm.runner.model.model, FastDecoderModel):
        FastDecodeChain().install(llm.runner.model)
    return llm


def greedy(max_tokens: list[int]) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_the_chain_matches_hf(tiny_model, family, monkeypatch):
    from nanograph.fast import chain
    products = []  # (rows, tensor cores) of each product the chain ran

    def counted_gemv(x, *args, tensor_cores=False, **kwargs):
        products.append((x.shape[0], tensor_cores))
        return gemv(x, *args, tensor_cores=tensor_cores, **kwargs)
    gemv = chain.gemv
    monkeypatch.setattr(chain, "gemv", counted_gemv)
    path = tiny_model(family)
    prompts = random_prompts(LENGTHS, seed=21)
    with chained_llm(path) as llm:
        outs = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    expected = [hf_greedy(path, [p], n)[0] for p, n in zip(prompts, MAX_TOKENS)]
    assert [o["token_ids"] for o in outs] == expected
    # 3 rows on tensor cores, 1 and 2 on CUDA cores (this model's widest input is <= 4096)
    assert {(3, True), (2, False), (1, False)} <= set(products)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_the_chain_with_adapters_matches_peft(tiny_model, adapters, family):
    """Adapters of ranks 8 and 16 beside a base-model row: each product's delta in the GEMV, the
    folds (o -> gate/up, down -> the next QKV) and the first layer's QKV without one."""
    path, reqs = tiny_model(family), adapters(family)
    prompts = random_prompts(LENGTHS, seed=22)
    loras = [reqs["all16"], None, reqs["qv8"]]
    with chained_llm(path, enable_lora=True, max_loras=2, max_lora_rank=16) as llm:
        assert llm.lora.runner_extension.folds  # one rank, no bias: the folds are there
        outs = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False, lora_request=loras)
    expected = [peft_greedy(path, r, p, n) for r, p, n in zip(loras, prompts, MAX_TOKENS)]
    assert [o["token_ids"] for o in outs] == expected
