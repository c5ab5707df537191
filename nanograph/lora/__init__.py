"""Multi-LoRA: PEFT adapters served side by side with the base model (an extension).

A chapter a reader of the base path may skip (docs/walkthrough.md, "LoRA"). What it adds, and
where it plugs in:
- adapter.py: `LoRARequest`, and reading and checking a PEFT adapter directory at intake;
- slots.py: the adapter slot table the scheduler is handed (admission, LRU, rank buckets);
- layer.py: `LoRALinear`, the wrapper that adds each row's delta, and adapter loads with folds;
- runner.py: the runner extension that installs the wrappers and binds each step.
`LoRA` bundles them as llm.py installs them.
"""
from nanograph.lora.adapter import Adapter, LoRARequest, read_adapter
from nanograph.lora.runner import LoRARunnerExtension
from nanograph.lora.slots import AdapterSlots


class LoRA:
    """The pieces llm.py hands out: `slots` to the scheduler, `runner_extension` to the runner;
    `adapter` checks a request's adapter at intake (once per adapter)."""

    def __init__(self, hf_config, max_loras: int, max_rank: int):
        self.hf_config, self.max_rank = hf_config, max_rank
        self.slots = AdapterSlots(max_loras, max_rank)
        self.runner_extension = LoRARunnerExtension(max_loras, max_rank)
        self.checked: dict[LoRARequest, Adapter] = {}

    def stats(self, graphs) -> dict:
        """The rank buckets' decode graphs and their replays ("{batch}x{rank}"), from the graph
        runner's counters (None: no graphs)."""
        if graphs is None:
            return {}
        replays = {f"{shape.decodes}x{shape.variant}": count
                   for shape, count in graphs.stats.replays.items()
                   if shape.variant and not shape.prefill_tokens}
        return {"graph_variants": list(self.runner_extension.graph_variants),
                "replays_per_variant": dict(sorted(replays.items()))}

    def adapter(self, name: str, request) -> Adapter:
        """The adapter of a request's `lora_request`; ValueError (naming the request) if bad."""
        if not isinstance(request, LoRARequest):
            raise ValueError(
                f"{name}: lora_request must be a LoRARequest, got {type(request).__name__}")
        if request not in self.checked:
            self.checked[request] = read_adapter(request, self.hf_config, self.max_rank,
                                                 f"{name}: ")
        return self.checked[request]
