"""Host time of one decode step's bookkeeping, without a model: schedule, build the step, fill the
graph buffers, build the sampling batch, account for the sampled tokens.

    PYTHONPATH=. python tools/host_overhead.py

On the GPU this time adds to every decode step (the loop is synchronous), so it is the part of a
step that a faster kernel cannot remove. The batch is 256 sequences of the reference workload's
prompt lengths, block size 256, as in bench.py.
"""
import random
import time

import torch

from nanograph.engine.block_manager import BlockManager
from nanograph.engine.cuda_graph import DecodeBuffers
from nanograph.engine.model_runner import build_step
from nanograph.engine.scheduler import Scheduler
from nanograph.engine.sequence import Sequence
from nanograph.layers.sampler import SamplingBatch
from nanograph.sampling_params import SamplingParams

if __name__ == "__main__":
    random.seed(0)
    scheduler = Scheduler(BlockManager(3000, 256, True), max_num_seqs=512, max_num_batched_tokens=16384)
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1024)
    for i in range(256):
        prompt = [random.randint(0, 10000) for _ in range(random.randint(100, 1024))]
        scheduler.add(Sequence(i, prompt, params, 256, "cpu"))
    while (scheduled := scheduler.schedule())[1]:  # run the prefills
        scheduler.update(scheduled[0], [1] * len(scheduled[0]), set(), 4096)
    buffers = DecodeBuffers(512, 16, "cpu")
    parts = dict.fromkeys(("schedule", "build", "fill", "sampling", "update"), 0.0)
    steps = 200
    for _ in range(steps):
        t0 = time.perf_counter()
        batch, _ = scheduler.schedule()
        t1 = time.perf_counter()
        step = build_step(batch, False, 256)
        t2 = time.perf_counter()
        buffers.fill(step, 256)
        t3 = time.perf_counter()
        SamplingBatch(torch.tensor([s.params.temperature for s in batch]), False, None, None,
                      [s.generator for s in batch])
        t4 = time.perf_counter()
        scheduler.update(batch, [5] * len(batch), set(), 4096)
        t5 = time.perf_counter()
        for name, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            parts[name] += dt
    print(f"batch {len(batch)}: " + ", ".join(f"{k} {v / steps * 1e6:.0f} us" for k, v in parts.items())
          + f"; total {sum(parts.values()) / steps * 1e6:.0f} us per decode step")
