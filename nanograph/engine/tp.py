"""Tensor parallelism: one process per GPU, rank 0 drives, the other ranks follow.

Process layout. Rank 0 lives in the user's process: it holds the scheduler, the block manager
and the sampler, exactly as with one GPU. Ranks 1..N-1 are worker processes started with the
"spawn" method (a forked CUDA context is unusable). Every rank holds one share of the weights and
of the KV cache (its own KV heads) and runs every step's forward; the collectives (two
all-reduces per block, one for the embedding, an all-gather for the LM head) go through
torch.distributed's default group: NCCL on CUDA, gloo on the CPU. As with any "spawn" child, a
worker re-imports the user's main module: scripts that start a tensor-parallel LLM need the
usual `if __name__ == "__main__":` guard.

Cutting the model (Megatron's split, applied from outside as gpt-fast does). Each rank builds
and loads the whole textbook model, then `cut_model` swaps its layers for their shares:
- column-parallel (QKV, gate/up) keep their rows of each part: the rank's query heads and KV
  heads (when there are fewer KV heads than ranks, the one its queries use), its slice of the
  MLP. Attention then runs on the rank's heads alone; no communication;
- row-parallel (O, down) keep their columns, so their product is a partial sum: `reduce`
  all-reduces it, then adds the bias once;
- the embedding and the LM head keep their rows of the vocabulary (split in equal parts, the
  last zero-padded): the embedding looks up the ids it owns, zeros for the rest, all-reduced;
  the head's logits are all-gathered.
Loading whole and then cutting keeps the loader and the layers free of ranks, and checks a
checkpoint exactly as one GPU does. Its cost: the whole model on every GPU while it is cut (an
8B model in bf16: 16 GB, beside its shares, on an 80 GB GPU); the whole weights stay alive until
every share is made, so the shares get fresh memory and the whole weights' memory comes back in
whole blocks, returned to the driver before the KV cache is sized from free memory. A model too
large for one GPU would need its shares cut as it loads instead.

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
run the same kernels: the same KV-cache size (`ShardedRunner` takes the minimum over the ranks)
and the same bucket ladder (every rank computes it from the same config). Decode graphs are
captured on every rank with their NCCL all-reduces inside; a rank replaying bucket 8 while
another replays 16 would deadlock.

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
import copy
import datetime
import os
import signal
import threading
import weakref
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from nanograph.config import Config
from nanograph.engine.model_runner import ModelRunner, RunnerExtension
from nanograph.engine.step import StepInput
from nanograph.layers.linear import Linear

# a collective inside a step (or start-up) waits at most this
STEP_TIMEOUT = datetime.timedelta(minutes=10)
# a worker waits this long for the next step
IDLE_TIMEOUT = datetime.timedelta(days=365)


# ---- the model, cut into this rank's share -----------------------------------------------------
class ColumnParallelLinear(Linear):
    """This rank's rows of each part of a whole layer, cut in whole units (a head: head_dim rows;
    a row of the MLP). Rank r keeps units // ranks of a part's units, from unit r * units // ranks
    on; a part with fewer units than ranks (KV heads) gives each rank one: the one its query
    heads read."""

    def __init__(self, whole: Linear, unit: int):
        nn.Module.__init__(self)
        rank, ranks = dist.get_rank(), dist.get_world_size()
        # (first row in the part, rows kept) of each part
        self.kept = [(rank * (size // unit) // ranks * unit, max(1, size // unit // ranks) * unit)
                     for size in whole.part_sizes]
        self.part_sizes = [rows for _, rows in self.kept]
        # the rows kept, in the whole layer
        kept_rows = torch.cat([torch.arange(part_start + first, part_start + first + rows)
                               for part_start, (first, rows) in zip(whole.part_starts, self.kept)])
        self.weight = nn.Parameter(whole.weight[kept_rows])
        self.bias = None if whole.bias is None else nn.Parameter(whole.bias[kept_rows])

    def shard_rows(self, tensor: torch.Tensor, part: int):
        """This rank's rows of one part's whole tensor (an adapter's B)."""
        first, rows = self.kept[part]
        return tensor[first:first + rows]


class RowParallelLinear(Linear):
    """This rank's columns (input features) of a whole layer: its product is a partial sum."""

    def __init__(self, whole: Linear):
        nn.Module.__init__(self)
        self.part_sizes = whole.part_sizes
        self.weight = nn.Parameter(self.shard_columns(whole.weight).contiguous())
        self.bias = whole.bias  # whole on every rank, added once, after the sum

    def shard_columns(self, tensor: torch.Tensor):
        """This rank's columns of a whole tensor (the weight, or an adapter's A)."""
        return tensor.tensor_split(dist.get_world_size(), dim=1)[dist.get_rank()]

    def forward(self, x):
        return self.reduce(F.linear(x, self.weight))

    def reduce(self, partial: torch.Tensor):
        """The ranks' partial products summed (in place), then the bias."""
        dist.all_reduce(partial)
        return partial if self.bias is None else partial + self.bias


def vocab_share(weight: nn.Parameter) -> nn.Parameter:
    """This rank's rows of the vocabulary: ceil(vocab / ranks) of them, the last rank's padded."""
    rank, ranks = dist.get_rank(), dist.get_world_size()
    part = -(-weight.shape[0] // ranks)
    rows = weight[rank * part:(rank + 1) * part]
    return nn.Parameter(F.pad(rows, (0, 0, 0, part - rows.shape[0])))


class VocabParallelEmbedding(nn.Module):
    def __init__(self, share: nn.Parameter):
        super().__init__()
        self.weight = share
        self.start = dist.get_rank() * share.shape[0]

    def forward(self, ids):
        """The ids this rank owns looked up, zeros for the others, summed over the ranks."""
        mine = (ids >= self.start) & (ids < self.start + self.weight.shape[0])
        embedded = F.embedding((ids - self.start) * mine, self.weight) * mine.unsqueeze(-1)
        dist.all_reduce(embedded)
        return embedded


class VocabParallelLMHead(nn.Module):
    def __init__(self, share: nn.Parameter, vocab_size: int):
        super().__init__()
        self.weight = share
        self.vocab_size = vocab_size

    def forward(self, hidden):
        return self.gather(F.linear(hidden, self.weight))

    def gather(self, logits: torch.Tensor):
        """Every rank's slice of the vocabulary, concatenated; the padding cut off."""
        parts = [torch.empty_like(logits) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, logits)
        return torch.cat(parts, dim=-1)[..., :self.vocab_size]


@torch.no_grad()
def cut_model(model: nn.Module):
    """Swap the loaded model's layers for this rank's shares (see above)."""
    whole_weights = list(model.parameters())  # alive until every share is made (see above)
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        attention.qkv_proj = ColumnParallelLinear(attention.qkv_proj, attention.head_dim)
        q_rows, kv_rows, _ = attention.qkv_proj.part_sizes
        attention.num_heads = q_rows // attention.head_dim
        attention.num_kv_heads = kv_rows // attention.head_dim
        attention.o_proj = RowParallelLinear(attention.o_proj)
        mlp.gate_up_proj = ColumnParallelLinear(mlp.gate_up_proj, 1)
        mlp.down_proj = RowParallelLinear(mlp.down_proj)
    embed, head = model.model.embed_tokens, model.lm_head
    embed_share = vocab_share(embed.weight)
    head_share = embed_share if head.weight is embed.weight else vocab_share(head.weight)
    model.model.embed_tokens = VocabParallelEmbedding(embed_share)
    model.lm_head = VocabParallelLMHead(head_share, head.weight.shape[0])
    del whole_weights


class CutModel(RunnerExtension):
    """Installed first on every rank, so that the other extensions wrap the shares."""

    def install(self, model: nn.Module):
        cut_model(model)


# ---- the processes -----------------------------------------------------------------------------
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
    runner = ShardedRunner(config, rank, extensions)  # the same extensions, installed here
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


class ShardedRunner(ModelRunner):
    """One rank's runner: the rank's GPU, the model cut into its share, the smallest KV cache."""

    def __init__(self, config: Config, rank: int, extensions: list[RunnerExtension] = ()):
        if config.device.startswith("cuda"):
            config = copy.copy(config)
            config.device = f"cuda:{rank}"  # one GPU per rank
        super().__init__(config, [CutModel(), *extensions])

    def count_kv_blocks(self):
        """The ranks share one block table, so the smallest cache wins."""
        blocks = torch.tensor([super().count_kv_blocks()], device=self.device)
        dist.all_reduce(blocks, op=dist.ReduceOp.MIN)
        return int(blocks.item())


class TensorParallelRunner(ShardedRunner):
    """Rank 0: a ShardedRunner whose steps also go to the workers it drives."""

    def __init__(self, config: Config, extensions: list[RunnerExtension] = ()):
        if dist.is_initialized():  # (the workers' group is the default one: one at a time)
            raise RuntimeError("a torch.distributed process group is already open here: close "
                               "the other tensor-parallel LLM first")
        n = config.tensor_parallel_size
        if config.device.startswith("cuda") and torch.cuda.device_count() < n:
            raise ValueError(
                f"tensor_parallel_size={n} but only {torch.cuda.device_count()} GPUs are visible")
        hf = config.hf_config
        if (hf.num_attention_heads % n or hf.intermediate_size % n
                or hf.num_key_value_heads % n and n % hf.num_key_value_heads):
            raise ValueError(
                f"tensor_parallel_size={n} must divide the attention heads "
                f"({hf.num_attention_heads}) and the MLP width ({hf.intermediate_size}), and "
                f"divide or be a multiple of the KV heads ({hf.num_key_value_heads})")
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
