"""Adapter slots: which adapters are on the GPU, and which step may use which.

The LoRA layers (layer.py) hold `max_loras` adapters side by side, the *slots*, so no step may
use more adapters than that. This table is handed to the scheduler (engine/scheduler.py's
`slots`) and keeps it so:
- admission: a waiting sequence whose adapter is not already used by a running one waits while
  `max_loras` adapters are in use;
- each step then gets a slot for every adapter it uses: the one the adapter already has, else a
  free one, else the least recently used slot whose adapter no running sequence needs. The load
  itself runs on the GPU in stream order (the runner's `before_step`), after any step in flight
  that still reads the old adapter.
A step's rank is the smallest rank bucket that holds all its adapters: its graph variant (one
set of decode graphs per bucket; a step with prefill chunks runs on the largest bucket's mixed
graphs, engine/cuda_graph.py). A step without adapters is variant 0, the base model's: no LoRA
work at all.
"""
from collections import OrderedDict
from dataclasses import dataclass, field

from nanograph.lora.adapter import Adapter

RANK_BUCKETS = (8, 16, 32, 64)


def rank_buckets(max_rank) -> list[int]:
    return [bucket for bucket in RANK_BUCKETS if bucket < max_rank] + [max_rank]


@dataclass
class LoRAStep:
    """What a step with adapters carries to the runner (`Batch.extras["lora"]`)."""
    seq_slots: list[int]    # per sequence of the step: its adapter's slot, -1 = the base model
    loads: list[tuple[int, Adapter]] = field(default_factory=list)  # (slot, adapter) to load first


def adapters_of(seqs) -> set[Adapter]:
    return {seq.adapter for seq in seqs if seq.adapter is not None}


class AdapterSlots:
    def __init__(self, max_loras: int, max_rank: int):
        self.max_loras = max_loras
        self.rank_buckets = rank_buckets(max_rank)
        self.slot_of: OrderedDict[Adapter, int] = OrderedDict()  # least recently used first

    def can_admit(self, seq, running) -> bool:
        """Whether `seq` may start beside `running` without needing a slot more than there are."""
        return seq.adapter is None or len(adapters_of([*running, seq])) <= self.max_loras

    def assign(self, batch, running):
        """A slot for each adapter of the step `batch`, its rank bucket as its graph variant."""
        if not (adapters := adapters_of(batch.seqs)):
            return  # the base model's step: variant 0, nothing attached
        loads = []
        for adapter in adapters:
            if adapter not in self.slot_of:
                slot = len(self.slot_of)  # slots are taken in order and only ever change hands
                if slot == self.max_loras:
                    # all taken: admission guarantees one whose adapter no running seq needs
                    in_use = adapters_of([*running, *batch.seqs])
                    slot = self.slot_of.pop(next(a for a in self.slot_of if a not in in_use))
                self.slot_of[adapter] = slot
                loads.append((slot, adapter))
            self.slot_of.move_to_end(adapter)
        largest_rank = max(adapter.rank for adapter in adapters)
        batch.variant = next(bucket for bucket in self.rank_buckets if bucket >= largest_rank)
        seq_slots = [-1 if seq.adapter is None else self.slot_of[seq.adapter]
                     for seq in batch.seqs]
        batch.extras["lora"] = LoRAStep(seq_slots, loads)
