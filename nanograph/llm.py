"""LLM: the user-facing engine. Validates requests, runs the step loop, returns outputs.

`generate` is the whole life of a batch of requests:
  validate every request (nothing runs unless all are valid) -> one Sequence each into the
  scheduler -> loop { scheduler.schedule() -> model_runner.run() -> scheduler.update() } until
  every sequence finished -> outputs in input order.
The loop is synchronous and single-threaded on purpose: each step's inputs depend on the
previous step's sampled tokens, and the CUDA graphs make the GPU side of a step short enough
that the host bookkeeping is what must stay small.
"""
import os
import time
from itertools import count

from tqdm.auto import tqdm
from transformers import AutoTokenizer, GenerationConfig

from nanograph.config import Config
from nanograph.engine.block_manager import BlockManager
from nanograph.engine.model_runner import ModelRunner
from nanograph.engine.scheduler import Scheduler
from nanograph.engine.sequence import Sequence
from nanograph.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, **kwargs):
        self.config = config = Config(model, **kwargs)
        self.tokenizer = None
        if any(os.path.exists(os.path.join(config.model_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
            self.tokenizer = AutoTokenizer.from_pretrained(config.model_dir)
        self.eos_ids = self._eos_ids()
        if config.tensor_parallel_size > 1:
            from nanograph.engine.tp import TensorParallelRunner
            self.runner = TensorParallelRunner(config)
        else:
            self.runner = ModelRunner(config)
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.seq_ids = count()
        self.closed = False

    def _eos_ids(self) -> set[int]:
        ids = self.config.hf_config.eos_token_id
        try:
            gen_ids = GenerationConfig.from_pretrained(self.config.model_dir).eos_token_id
        except OSError:
            gen_ids = None
        found = set()
        for value in (ids, gen_ids, self.tokenizer.eos_token_id if self.tokenizer else None):
            if value is not None:
                found.update(value if isinstance(value, list) else [value])
        return found

    def close(self) -> None:
        """Free the device memory (and with tensor parallelism, the workers) now, not at garbage
        collection: the next LLM sizes its KV cache from the memory it finds free."""
        self.runner.close()
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- request intake ---------------------------------------------------------------------
    def _validate(self, i: int, prompt, params: SamplingParams) -> list[int]:
        cfg = self.config
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"request {i}: text prompt but model {cfg.model!r} has no tokenizer; pass token ids")
            prompt = self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise ValueError(f"request {i}: a prompt must be a str or a list of int token ids")
        if not prompt:
            raise ValueError(f"request {i}: empty prompt")
        vocab = cfg.hf_config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {i}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(prompt) >= cfg.max_model_len:
            raise ValueError(f"request {i}: prompt has {len(prompt)} tokens, max_model_len={cfg.max_model_len} "
                             "leaves no room to generate")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {i}: sampling params must be a SamplingParams, got {type(params).__name__}")
        longest = min(len(prompt) + params.max_tokens, cfg.max_model_len)
        blocks = -(-longest // cfg.kvcache_block_size)
        if blocks > self.runner.num_kv_blocks:
            raise ValueError(f"request {i}: needs up to {blocks} KV blocks ({longest} tokens) but the cache "
                             f"has {self.runner.num_kv_blocks}; it could never run")
        return list(prompt)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[dict]:
        if self.closed:
            raise RuntimeError("this LLM has been closed")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise ValueError("prompts must be a list of prompts (str or list of token ids)")
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        token_lists = [self._validate(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        seqs = [Sequence(next(self.seq_ids), ids, sp, self.config.kvcache_block_size, self.config.device)
                for ids, sp in zip(token_lists, params)]
        for seq in seqs:
            self.scheduler.add(seq)
        bar = tqdm(total=len(seqs), desc="Generating", disable=not use_tqdm, dynamic_ncols=True)
        tokens_per_s = {"prefill": 0.0, "decode": 0.0}
        while self.scheduler.has_work():
            start = time.perf_counter()
            batch, is_prefill = self.scheduler.schedule()
            sampled = self.runner.run(batch, is_prefill)
            finished = self.scheduler.update(batch, sampled, self.eos_ids, self.config.max_model_len)
            kind = "prefill" if is_prefill else "decode"
            tokens_per_s[kind] = sum(s.num_scheduled_tokens for s in batch) / (time.perf_counter() - start)
            bar.set_postfix_str(f"prefill {tokens_per_s['prefill']:.0f} tok/s, decode {tokens_per_s['decode']:.0f} tok/s",
                                refresh=False)
            bar.update(len(finished))
        bar.close()
        return [{"text": self.tokenizer.decode(s.completion_token_ids) if self.tokenizer else None,
                 "token_ids": s.completion_token_ids} for s in seqs]

    def stats(self) -> dict:
        stats = {"prefix_cache_hit_tokens": self.block_manager.cache_hit_tokens,
                 "preemptions": self.scheduler.num_preemptions,
                 "num_kvcache_blocks": self.runner.num_kv_blocks,
                 "attention_backend": self.runner.backend}
        graphs = getattr(self.runner, "graphs", None)
        if graphs is not None:
            stats.update(graphs.stats.as_dict())
        return stats
