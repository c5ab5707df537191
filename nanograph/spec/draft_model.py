"""Drafts from a draft model: a smaller model with the target's tokenizer, an engine of its own.

Where prompt lookup copies (ngram.py), a draft model predicts: `speculative_config={"model":
path, "num_speculative_tokens": k}` has a small model guess each decoding sequence's next k
tokens, and the target checks them in one verify step, as it checks copied ones (scheduler.py).

The draft model drafts greedily, its argmax at each of the k tokens. A greedy draft is
deterministic (q is one-hot at it), so the standard acceptance rule is the one verify.py already
applies to copied drafts: the output is the target's, token for token, at any temperature, with
one acceptance rule for both drafters.

How it runs. The draft model is a second nanograph engine (an `LLM`, built by the factory llm.py
hands in, so that spec/ does not import llm.py): its own weights, its own KV cache, its own step
graphs on CUDA, prefix caching on. `lookup` adds one greedy request per sequence to draft, the
sequence's known tokens as its prompt and k tokens to generate (k + 1 when its last token is
still in flight: drafter.py), and runs the draft engine until they are done. A round's prompt is
the last round's, the drafts the target accepted and the target's own token after them, so its
full blocks are prefix-cache hits (the last round registered them, its drafts' blocks included):
the draft engine prefills only the last partial block and the new tokens, then runs k - 1 decode
steps. Its blocks are small (DRAFT_BLOCK_SIZE) so that partial block is short. Those k draft
steps run one after the other and before the verify step: a round costs them on top of the
verify.

Both on one GPU. The draft engine is built first, its KV cache sized by count, not by memory:
enough blocks for every sequence that may draft at once (the smaller of `disable_by_batch_size`
and `max_num_seqs`) at `max_model_len`. The target is built after it and sizes its cache from what
the GPU then has free (engine/model_runner.py: `gpu_memory_utilization` of the memory, less what
is in use, the draft's weights, cache and graphs among it, less the target's activation peak).
The two engines take turns, never running at once, and the draft's largest prefill is the
target's (`max_num_batched_tokens`) in a model no larger, so the target's activation reserve
covers it.
"""
from nanograph.sampling_params import SamplingParams
from nanograph.spec.drafter import NgramDrafter, SpeculativeConfig

DRAFT_BLOCK_SIZE = 16


class DraftModelDrafter(NgramDrafter):
    def __init__(self, config: SpeculativeConfig, target, build_engine, max_batch: int):
        """`target`: the target's engine Config; `build_engine(model, **knobs)`: an LLM."""
        super().__init__(config)
        blocks_per_sequence = -(-target.max_model_len // DRAFT_BLOCK_SIZE)
        try:
            self.engine = build_engine(config.model,
                                       device=target.device,
                                       dtype=target.torch_dtype,
                                       max_model_len=target.max_model_len,
                                       max_num_seqs=max_batch,
                                       max_num_batched_tokens=target.max_num_batched_tokens,
                                       kvcache_block_size=DRAFT_BLOCK_SIZE,
                                       num_kvcache_blocks=max_batch * blocks_per_sequence,
                                       enforce_eager=target.enforce_eager)
        except ValueError as error:  # (a path without a model, a damaged checkpoint...)
            raise ValueError(f"speculative_config['model']: {error}") from None
        vocab, target_vocab = self.engine.config.hf_config.vocab_size, target.hf_config.vocab_size
        if vocab != target_vocab:
            self.close()
            raise ValueError(f"speculative_config['model']: the draft model's vocab_size is "
                             f"{vocab}, the target's {target_vocab}: a draft model needs the "
                             "target's tokenizer")
        self.engine.tokenizer = None  # token ids in, token ids out: no text to make

    def lookup(self, histories: list[list[int]], counts: list[int]) -> list[list[int]]:
        """counts[i] greedy drafts after token list histories[i] (fewer near `max_model_len`),
        all from one run of the draft engine."""
        limit = self.engine.config.max_model_len  # (the draft model's may be the shorter)
        drafting = [history for history in histories if len(history) < limit]
        params = [SamplingParams(temperature=0,
                                 max_tokens=min(count, limit - len(history)),
                                 ignore_eos=True)
                  for history, count in zip(histories, counts) if len(history) < limit]
        outputs = iter(self.engine.generate(drafting, params, use_tqdm=False) if drafting else [])
        return [next(outputs)["token_ids"] if len(history) < limit else []
                for history in histories]

    def close(self):
        self.engine.close()
