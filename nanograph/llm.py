"""LLM: the user-facing engine. Validates requests, runs the step loop, returns outputs.

`generate` is the whole life of a batch of requests: validate every request (nothing runs
unless all are valid) -> one Sequence each into the scheduler -> the step loop until every
sequence finished -> outputs in input order.

The step loop overlaps the host and the GPU (`overlap_scheduling`, on by default with CUDA).
A step has a host part (schedule, build the inputs, fill the graph buffers, launch) and a GPU
part (copy in, forward, sample, copy the ids out), and then the host reads the ids (collect:
append them, check stops, free finished sequences). Done in order, each side idles while the
other works. Instead the loop launches step N+1 *before* collecting step N:

    host  | sched+launch N | collect N-1 | sched+launch N+1 | collect N | sched+launch N+2 | ...
    GPU   |      ...  step N-1  |           step N            |          step N+1          |

This works because step N+1 needs only one thing from step N that the host does not know in
advance, the token each continuing sequence just sampled, and that stays on the GPU: the
scheduler gives the sequence a placeholder for it, and the forward swaps it in on the device
(engine/step.py). Positions, cache slots, block tables and block allocation depend only on
how many tokens each sequence has, which the host does know. What is *not* overlapped: a step
whose batch cannot be scheduled until the step in flight is collected (its blocks are needed)
launches after that collect, and a prefill is launched like any step (its inputs are known).

The price is a one-step lag on stops that only the token reveals (EOS, stop_token_ids): the
sequence was already scheduled once more when its EOS comes back, so one token is computed and
dropped (`stats()["overlap_discarded_tokens"]`); it never reaches the output. Stops known in
advance (max_tokens, max_model_len) are never late. With `overlap_scheduling=False` the loop is
the same with the look-ahead set to 0: collect right after launch. Both give the same tokens.
On the CPU the "device" is the same cores as the host, so there is nothing to overlap: it is
off there by default.
"""
import contextlib
import os
from collections import deque
from itertools import count

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer, GenerationConfig

from nanograph.config import Config
from nanograph.engine.block_manager import BlockManager
from nanograph.engine.model_runner import InFlight, ModelRunner
from nanograph.engine.scheduler import Scheduler
from nanograph.engine.sequence import Sequence
from nanograph.engine.tp import TensorParallelRunner
from nanograph.layers.lora_slots import rank_buckets
from nanograph.adapter import Adapter, LoRARequest, read_adapter
from nanograph.sampling_params import SamplingParams


class LLM(contextlib.AbstractContextManager):  # `with LLM(...) as llm:` closes it at the end
    def __init__(self, model: str, **kwargs):
        self.config = config = Config(model, **kwargs)
        if torch.distributed.is_initialized():  # layers shard over the default group (layers/linear.py): one at a time
            raise RuntimeError("a torch.distributed process group is already open here: close the other LLM first")
        self.tokenizer = None
        if any(os.path.exists(os.path.join(config.model_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
            self.tokenizer = AutoTokenizer.from_pretrained(config.model_dir)
        self.runner = (TensorParallelRunner if config.tensor_parallel_size > 1 else ModelRunner)(config)
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self._eos_ids(), config.max_model_len, config.max_loras,
                                   tuple(rank_buckets(config.max_lora_rank)))
        self.adapters: dict[LoRARequest, Adapter] = {}
        self.seq_ids = count()

    def _eos_ids(self) -> frozenset[int]:
        """From the model's config, its generation config and its tokenizer, whichever exist."""
        has_generation_config = os.path.exists(os.path.join(self.config.model_dir, "generation_config.json"))
        gen = has_generation_config and GenerationConfig.from_pretrained(self.config.model_dir)
        values = (self.config.hf_config.eos_token_id, gen and gen.eos_token_id,
                  self.tokenizer and self.tokenizer.eos_token_id)
        return frozenset(i for v in values if v is not None for i in (v if isinstance(v, list) else [v]))

    def close(self) -> None:
        """Free the device memory (and with tensor parallelism, the workers) now, not at garbage
        collection: the next LLM sizes its KV cache from the memory it finds free."""
        self.runner.close()

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
        if (bad := [t for t in prompt if not 0 <= t < vocab]):
            raise ValueError(f"request {i}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(prompt) >= cfg.max_model_len:
            raise ValueError(f"request {i}: prompt has {len(prompt)} tokens, max_model_len={cfg.max_model_len} "
                             "leaves no room to generate")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {i}: sampling params must be a SamplingParams, got {type(params).__name__}")
        if any(t >= vocab for t in params.stop_token_ids or ()):
            raise ValueError(f"request {i}: stop_token_ids {params.stop_token_ids} outside the vocabulary [0, {vocab})")
        longest = min(len(prompt) + params.max_tokens, cfg.max_model_len)
        blocks = -(-longest // cfg.kvcache_block_size)
        if blocks > self.runner.num_kv_blocks:
            raise ValueError(f"request {i}: needs up to {blocks} KV blocks ({longest} tokens) but the cache "
                             f"has {self.runner.num_kv_blocks}; it could never run")
        return list(prompt)

    def _adapter(self, i: int, request: LoRARequest | None) -> Adapter | None:
        if request is None:
            return None
        if not self.config.enable_lora:
            raise ValueError(f"request {i}: a lora_request needs LLM(..., enable_lora=True)")
        if not isinstance(request, LoRARequest):
            raise ValueError(f"request {i}: lora_request must be a LoRARequest, got {type(request).__name__}")
        if request not in self.adapters:  # checked once per adapter, read from disk when it gets a slot
            self.adapters[request] = read_adapter(request, self.config.hf_config, self.config.max_lora_rank,
                                                  f"request {i}: ")
        return self.adapters[request]

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | list[LoRARequest | None] | None = None,
                 ) -> list[dict]:
        if self.runner.model is None:  # released by close(), or by a failed tensor-parallel step
            raise RuntimeError("this LLM has been closed")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise ValueError("prompts must be a list of prompts (str or list of token ids)")
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        for name, values in (("sampling params", params), ("lora requests", loras)):
            if len(values) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(values)} {name}")
        token_lists = [self._validate(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        adapters = [self._adapter(i, request) for i, request in enumerate(loras)]
        seqs = [Sequence(next(self.seq_ids), ids, sp, self.config.kvcache_block_size, self.config.seed, adapter)
                for ids, sp, adapter in zip(token_lists, params, adapters)]
        self.scheduler.waiting.extend(seqs)
        try:
            with tqdm(total=len(seqs), desc="Generating", disable=not use_tqdm, dynamic_ncols=True) as bar:
                self._run(bar, lookahead=1 if self.config.overlap_scheduling else 0)
        except BaseException:
            # an interrupt or a failed step: nothing of this call may leak into the next one
            with contextlib.suppress(Exception):  # a broken device must not hide the original error
                torch.cuda.synchronize()  # (without CUDA this raises too: nothing to wait for)
            for seq in seqs:
                self.scheduler.finish(seq)
            raise
        return [{"text": self.tokenizer.decode(s.completion_token_ids) if self.tokenizer else None,
                 "token_ids": s.completion_token_ids} for s in seqs]

    def _run(self, bar, lookahead: int) -> None:
        """The step loop: keep up to `lookahead` launched steps uncollected."""
        in_flight: deque[InFlight] = deque()
        while self.scheduler.waiting or self.scheduler.running or in_flight:
            batch = self.scheduler.schedule()
            if batch is not None:
                in_flight.append(self.runner.launch(batch))
            if len(in_flight) > lookahead or (batch is None and in_flight):
                step = in_flight.popleft()
                bar.update(len(self.scheduler.update(step.batch, self.runner.collect(step))))

    def stats(self) -> dict:
        return {"prefix_cache_hit_tokens": self.block_manager.cache_hit_tokens,
                "preemptions": self.scheduler.num_preemptions,
                "overlap_discarded_tokens": self.scheduler.num_discarded_tokens,
                "num_kvcache_blocks": self.runner.num_kv_blocks,
                "attention_backend": self.config.attention_backend,
                **(self.runner.graphs.stats_dict() if self.runner.graphs is not None else {})}
