"""The LoRA extension in the model runner: wrap the layers, load adapters, bind each step.

Installed by llm.py as one of the runner's extensions (engine/model_runner.py), on every
tensor-parallel rank:
- `install` swaps every linear layer of the decoder layers for a `LoRALinear` around it
  (layer.py), all sharing one `StepAdapters`, and sizes a fold's producer for its consumer;
- `step_fields`: one more field of the static step buffers, each token's adapter slot (-1 in
  padding), so a captured graph reads the slots of the step it replays;
- `graph_variants`: the rank buckets, a set of decode graphs each, and the largest a set of mixed
  graphs too (engine/cuda_graph.py: a mixed step of any rank runs on them);
- `before_step` loads the step's new adapters into their slots (in stream order, so after any
  step in flight that still reads the slot's old adapter) and spreads each sequence's slot
  over its tokens;
- `bind` points the layers at the step's slots and rank bucket (the shape's variant).
"""
from nanograph.engine.model_runner import RunnerExtension
from nanograph.layers.linear import Linear
from nanograph.lora.layer import (PREFILL_ROWS, LoRALinear, StepAdapters, fold_triples,
                                  load_adapter)
from nanograph.lora.slots import rank_buckets


class LoRARunnerExtension(RunnerExtension):
    step_fields = {"lora_slots": ("token", -1)}

    def __init__(self, max_loras: int, max_rank: int):
        self.max_loras, self.max_rank = max_loras, max_rank
        self.graph_variants = tuple(rank_buckets(max_rank))
        self.model = None
        self.folds = []
        self.adapters = StepAdapters()

    def install(self, model):
        self.model = model
        triples = fold_triples(model)
        fold_consumer = {producer: consumer for producer, consumer, _ in triples}
        wrapped = {}
        for parent in list(model.model.layers.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, Linear):
                    wrapped[child] = LoRALinear(child, self.adapters, self.max_loras,
                                                self.max_rank, fold_consumer.get(child))
                    setattr(parent, name, wrapped[child])
        self.folds = [(wrapped[producer], wrapped[consumer], norm)
                      for producer, consumer, norm in triples]

    def before_step(self, step):
        lora_step = step.extras.get("lora")
        if lora_step is None:
            return {}  # no adapters: the field is all padding
        for slot, adapter in lora_step.loads:
            self.load(slot, adapter)
        offsets = step.cu_seqlens_q
        token_slots = [slot for slot, start, end in zip(lora_step.seq_slots, offsets, offsets[1:])
                       for _ in range(end - start)]
        return {"lora_slots": token_slots}

    def load(self, slot: int, adapter):
        """`adapter` into `slot` of every LoRA layer (its weights read from disk now)."""
        load_adapter(self.model, slot, adapter, self.folds)

    def bind(self, inputs, shape):
        self.adapters.slots = inputs["lora_slots"]
        self.adapters.rank = shape.variant
        self.adapters.rows_per_program = PREFILL_ROWS if shape.prefill_tokens else 1
