"""Whether drafts pay on this engine, measured on the wall clock: the switch-off rule's last part.

The problem. A verify step gives a row 1 + its accepted drafts at the price of more than a plain
step: k + 1 tokens a row through the weights, the drafts' own cost (a draft model's steps), and
overlap scheduling lost around it (it is collected before the next step is scheduled, so that
step's host work no longer hides behind the GPU). That price depends on the model's size, the
GPU and the host: on a large model a verify costs little more than a plain step, on a small one
whose steps are as short as the host's work several, and a draft model as costly as its target
many. No fixed batch limit or acceptance threshold holds for all of them.

The idea. The scheduler's `update` comes once a step, in step order, so the time between two
updates is one step's share of the wall clock, whatever overlapped what. Running means of it:
- `plain`: a plain decode step's, between two others (the step after it is plain too, so the
  interval holds no drafting for a verify scheduled next);
- `verify`: a verify step's whole price. After a verify, its own interval. Amid plain steps, the
  time from the update of the second step before it to the update of the step after it, less
  two plain steps: that span holds its drafts (computed while the step before it ran), itself,
  and the overlap lost by the step after it (a verify is collected before the next step is
  scheduled, so that step's host work no longer hides behind the GPU);
- `tokens`: what a drafting row gets from a verify, 1 + its accepted drafts.
Drafts pay while tokens x plain >= verify: a verify then gives its rows at least the tokens a
second that plain steps would. While they do not, a verify still goes out once the time since
the last one reaches PROBE_EVERY verify prices (at most about 1 / PROBE_EVERY of the time on
probes), to follow the text and the acceptance as they change. Until `plain` is measured (three
plain decode steps in a row, once) nothing drafts; until `verify` and `tokens` are, drafts are
assumed to pay. A limit: while every step drafts, `plain` is not measured again and keeps the
value it had when drafting started.
"""
import time
from dataclasses import dataclass, field

PROBE_EVERY = 16
WEIGHT = 0.25  # of a new sample in a running mean
clock = time.perf_counter  # (the tests set their own)


def running_mean(mean: float, sample: float) -> float:
    """`mean` moved towards `sample`; the first sample where `mean` is 0.0 (none yet)."""
    return mean + WEIGHT * (sample - mean) if mean else sample


@dataclass
class Payoff:
    plain: float = 0.0   # the running means above (seconds, tokens); 0.0 until measured
    verify: float = 0.0
    tokens: float = 0.0
    last_verify: float = 0.0     # when a verify was last updated
    recent: list[tuple[str, float]] = field(default_factory=list)  # (kind, when): the last four

    def tick(self, kind: str):
        """The scheduler updated a step of `kind` ('decode', 'verify', 'mixed', 'prefill')."""
        self.recent = [*self.recent[-3:], (kind, clock())]
        kinds, times = zip(*self.recent)
        if kinds[-3:] == ("decode",) * 3:
            self.plain = running_mean(self.plain, times[-2] - times[-3])
        if kinds[-2:] == ("verify",) * 2:
            self.verify = running_mean(self.verify, times[-1] - times[-2])
        # (`plain` is measured here: nothing drafts before it is)
        if kinds == ("decode", "decode", "verify", "decode"):
            self.verify = running_mean(self.verify, times[-1] - times[-4] - 2 * self.plain)
        if kind == "verify":
            self.last_verify = times[-1]

    def allows(self) -> bool:
        """Whether a step may draft now (see above)."""
        if not self.plain:
            return False
        if not self.verify or not self.tokens or self.tokens * self.plain >= self.verify:
            return True
        return clock() - self.last_verify >= PROBE_EVERY * self.verify
