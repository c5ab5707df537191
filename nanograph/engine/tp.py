"""Tensor parallelism: one process per GPU, rank 0 drives, the other ranks follow.

Process layout. Rank 0 lives in the user's process: it holds the scheduler, the block manager
and the sampler, exactly as with one GPU. Ranks 1..N-1 are worker processes started with the
"spawn" method (a forked CUDA context is unusable). Every rank holds one shard of the weights and
of the KV cache (its own KV heads, see layers/linear.py) and runs every step's forward; the
layers' collectives (two all-reduces per block, one for the embedding, an all-gather for the
LM head) go through torch.distributed's default group: NCCL on CUDA, gloo on the CPU. As with
any "spawn" child, a worker re-imports the user's main module: scripts that start a
tensor-parallel LLM need the usual `if __name__ == "__main__":` guard.

What is sent each step, and how. The rank-0 runner is a `ModelRunner` whose `run` first sends
the step's `StepInput` (plain lists, pickled: step.py) to the workers over a second, gloo-only
process group: the control group. The workers run the same `run` on their shard, sampler
included: the next step's placeholder tokens are resolved on every rank from its own token
table, and since the sampler's noise is a hash of each request's seed and token index
(layers/sampler.py), every rank draws the same ids from the same all-gathered logits: nothing
is exchanged. With overlap scheduling rank 0 sends step N+1 while the GPUs still run step N,
and a worker queues it at once: nothing on either side waits for the GPU. One message
per step keeps the ranks in lockstep by construction, and sending the inputs rather than
sequences keeps the workers free of any scheduler state. The control messages go through gloo,
not NCCL, so a worker waits for the next step on the host, without a GPU kernel, as long as the
engine stays idle.

Same ladder everywhere. A collective matches the calls of all ranks in order, so all ranks must
run the same kernels: the same KV-cache size (ModelRunner takes the minimum over the ranks) and
the same bucket ladder (CudaGraphRunner does too). Decode graphs are captured on every rank with
their NCCL all-reduces inside; a rank replaying bucket 8 while another replays 16 would deadlock.

Start, shutdown, failure. The parent opens a TCPStore on a free port and waits until each worker
has reached it (a worker that crashes while starting is reported, not waited for), then all ranks
join the process groups. `close()` sends None (the workers leave their loop and exit), joins
them, kills any that linger, and destroys the process groups, so a second LLM can start in the
same process; it also runs at interpreter exit if the user forgot it. A worker watches its parent
and exits if the parent dies. Before each step rank 0 checks that every worker is alive, and with
gloo a worker dying mid-step fails rank 0's next collective at once; either way rank 0 raises
"tensor-parallel worker rank r died (exit code c)" and shuts the engine down (after a failed or
interrupted step the ranks can no longer be trusted to be in step). With NCCL a death in the
middle of a step is only seen by NCCL's watchdog, after STEP_TIMEOUT: a bound, not a clean error.
"""
import datetime
import os
import signal
import threading
import weakref
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanograph.config import Config
from nanograph.engine.model_runner import ModelRunner, RunnerExtension
from nanograph.engine.step import StepInput

# a collective inside a step (or start-up) waits at most this
STEP_TIMEOUT = datetime.timedelta(minutes=10)
# a worker waits this long for the next step
IDLE_TIMEOUT = datetime.timedelta(days=365)


def init_distributed(config: Config, rank: int, store: dist.Store):
    """Join the default group (model collectives)."""
    if (cuda := config.device.startswith("cuda")):
        torch.cuda.set_device(rank)
    else:
        # the ranks share the cores: oversubscribed, OpenMP's spinning threads starve
        # the other ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.tensor_parallel_size))
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank,
                            world_size=config.tensor_parallel_size, timeout=STEP_TIMEOUT)


def broadcast_step(step: StepInput | None, group) -> StepInput | None:
    """Rank 0's step to every worker, pickled (None: the workers exit); a worker passes None and
    gets the step."""
    message = [step]
    dist.broadcast_object_list(message, src=0, group=group)
    return message[0]


def worker_main(config: Config, rank: int, port: int, extensions: list[RunnerExtension]):
    # Ctrl-C is for the parent, which then shuts us down
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # orphaned: exit
    threading.Thread(target=lambda: (mp.parent_process().join(), os._exit(1)), daemon=True).start()
    store = dist.TCPStore("127.0.0.1", port, config.tensor_parallel_size,
                          is_master=False, timeout=STEP_TIMEOUT)
    store.add("workers_connected", 1)
    init_distributed(config, rank, store)
    runner = ModelRunner(config, rank, extensions)  # the same extensions, installed here
    # for the per-step control messages
    group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    while (step := broadcast_step(None, group)) is not None:
        runner.run(step)  # samples the same ids as rank 0
    runner.close()  # its graphs hold references on the NCCL communicator: free them before it goes
    dist.destroy_process_group()


def shutdown(procs, group_ref, num_threads):
    """Ask the workers to exit, destroy the process groups with them, reap them. Runs once.

    NCCL tears a communicator down collectively, so rank 0 destroys its groups while the workers
    destroy theirs (they do on receiving None), and only then waits for them; destroying after a
    worker is gone would wait for it forever, so with a rank dead NCCL's groups are aborted."""
    everyone = group_ref[0] is not None and all(p.is_alive() for p in procs)
    if everyone:
        try:
            broadcast_step(None, group_ref[0])
        except Exception:
            everyone = False
    if dist.is_initialized():
        if everyone or dist.get_backend() != "nccl":
            dist.destroy_process_group()
        else:
            dist.distributed_c10d._abort_process_group()
    for p in procs:
        p.join(timeout=10)
        p.kill()  # one that lingers (no-op for one that exited)
        p.join()
    torch.set_num_threads(num_threads)


class TensorParallelRunner(ModelRunner):
    """Rank 0: a ModelRunner for its own shard whose steps also go to the workers it drives."""

    def __init__(self, config: Config, extensions: list[RunnerExtension] = ()):
        n = config.tensor_parallel_size
        if config.device.startswith("cuda") and torch.cuda.device_count() < n:
            raise ValueError(
                f"tensor_parallel_size={n} but only {torch.cuda.device_count()} GPUs are visible")
        self.group_ref = [None]
        store = dist.TCPStore("127.0.0.1", 0, n,
                              is_master=True,
                              wait_for_workers=False,
                              timeout=STEP_TIMEOUT)
        # spawned children inherit os.environ (NCCL settings included)
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=worker_main, args=(config, rank, store.port, extensions),
                                  daemon=True,
                                  name=f"nanograph-tp-rank{rank}") for rank in range(1, n)]
        for p in self.procs:
            p.start()
        self._finalizer = weakref.finalize(self, shutdown, self.procs, self.group_ref,
                                           torch.get_num_threads())
        try:
            while store.add("workers_connected", 0) < n - 1:  # wait for the workers, watching them
                if (dead := self.dead_worker(wait_s=0.05)):
                    raise RuntimeError(dead)
            init_distributed(config, 0, store)
            # every rank builds its runner (and runs its own warm-up forwards) before steps are sent
            super().__init__(config, 0, extensions)
            # as the workers do, in order
            self.group_ref[0] = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        except BaseException as e:
            self.fail(e)

    def dead_worker(self, wait_s=0.0):
        """A message naming the first worker that has exited, waiting up to wait_s for one to."""
        ready = wait([p.sentinel for p in self.procs], timeout=wait_s)
        for rank, p in enumerate(self.procs, 1):
            # its end of the pipe closed as it exited: the exit code follows
            if p.sentinel in ready:
                p.join(timeout=10)
                return f"tensor-parallel worker rank {rank} died (exit code {p.exitcode})"
        return None

    def fail(self, error: BaseException):
        """The ranks may be out of step now: shut everything down, name a dead worker if there is
        one."""
        # a worker's death reaches rank 0 as a failed collective (RuntimeError)
        dead = self.dead_worker(wait_s=1.0)
        for p in self.procs:
            p.kill()
        self.close()
        if dead and isinstance(error, RuntimeError):
            raise RuntimeError(f"{dead}; the engine has been shut down") from error
        raise error

    def launch(self, batch):
        try:
            if (dead := self.dead_worker()):
                raise RuntimeError(dead)
            return super().launch(batch)
        except BaseException as e:
            self.fail(e)

    def run(self, step: StepInput):
        """Every rank runs `step`: send it (once the workers wait for steps), then compute rank 0's
        share."""
        if self.group_ref[0] is not None:
            broadcast_step(step, self.group_ref[0])
        return super().run(step)

    def close(self):
        if getattr(self, "model", None) is not None:
            super().close()
        self._finalizer()
