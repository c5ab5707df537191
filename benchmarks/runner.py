"""The one place bench reaches into the engine: timing a decode step on the model runner itself.

`llm.generate` times everything (scheduling, host bookkeeping, sampling); a decode sweep wants
the step alone, at batch sizes and contexts that no workload would hold steady. So bench builds a
decode step by hand (`decode_step`, the only code here that knows the engine's step type,
nanograph/engine/step.py) and times `runner.run(step)`: the forward, the LM head and sampling,
from a captured graph when one fits the batch, else eagerly. `eager` runs the same engine without
its graphs: exactly the path `enforce_eager=True` takes. The cache content does not matter for
timing, so every sequence sits on consecutive blocks of its own and attends to whatever is there.
"""
from contextlib import contextmanager

import torch

from benchmarks.timing import is_cuda, seconds_per_call

BLOCK_SIZE = 256  # the engine's default kvcache_block_size


def decode_engine_args(sizes: list[int], context_len: int, cuda: bool = True) -> dict:
    """`LLM` arguments for timing decode steps: a graph for exactly each of `sizes` (on CUDA), and
    a KV cache just big enough for the largest batch at context_len."""
    blocks = max(sizes) * -(-context_len // BLOCK_SIZE)
    return dict(num_kvcache_blocks=blocks, kvcache_block_size=BLOCK_SIZE,
                cuda_graph_sizes=sizes if cuda else None)


def decode_step(batch: int, context_len: int, block_size: int, lora_slots: list[int] | None = None,
                lora_rank: int = 0):
    """One decode token per sequence at position context_len - 1, each sequence on its own
    consecutive blocks, sampled at temperature 0.6; with lora_rank, row i on adapter slot
    lora_slots[i] (the step the LoRA slot table makes: nanograph/lora/slots.py)."""
    from nanograph.engine.step import StepInput
    from nanograph.lora.slots import LoRAStep
    blocks = -(-context_len // block_size)
    tables = [list(range(s * blocks, (s + 1) * blocks)) for s in range(batch)]
    pos = context_len - 1
    slots = [t[pos // block_size] * block_size + pos % block_size for t in tables]
    return StepInput(
        num_decodes=batch,
        input_ids=[1] * batch,
        positions=[pos] * batch,
        slot_mapping=slots,
        context_lens=[context_len] * batch,
        block_tables=tables,
        cu_seqlens_q=list(range(batch + 1)),
        sample_indices=list(range(batch)),
        sample_lens=[context_len] * batch,
        temperatures=[0.6] * batch,
        seeds=list(range(batch)),
        variant=lora_rank,
        extras={"lora": LoRAStep(lora_slots)} if lora_rank else {},
    )


def paced_run(runner, step, device: str):
    """A callable that runs `step` on `runner` as the engine's loop does, at most one step ahead
    of the GPU. A run refills one of the runner's two host mirrors of the step inputs
    (engine/step.py, StepBuffers), which the copy of the run before the last may still be
    reading until that run is done (and would read mid-fill: padding, block tables of -1): so
    each call waits for the previous call's run, as the engine collects step N while N + 1 runs."""
    pending = []  # the last run's event

    def run():
        runner.run(step)
        if is_cuda(device):
            pending.append(torch.cuda.current_stream().record_event())
            if len(pending) > 1:
                pending.pop(0).synchronize()
    return run


def time_forward(runner, step, device: str, iters: int) -> float:
    """Seconds per `runner.run(step)` (forward, LM head, sampling), after 3 untimed ones."""
    return seconds_per_call(paced_run(runner, step, device), device, iters, warmup=3)


@contextmanager
def eager(runner):
    """Run the same engine without its graphs: exactly the path enforce_eager=True takes."""
    graphs, runner.graphs = runner.graphs, None
    try:
        yield
    finally:
        runner.graphs = graphs
