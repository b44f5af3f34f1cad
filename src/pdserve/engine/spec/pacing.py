"""How many drafts a step may verify, from what verify rows cost on this machine and how often
drafts are accepted, both measured while serving. Pure: step times and counts in, a cap out.

A step of B decodes with k drafts each runs B (1 + k) rows and yields B (1 + a + a^2 + ... + a^k)
tokens on average, where a is the chance that a draft is accepted given the one before it was
(prompt lookup's drafts fail at the first wrong token, so acceptance runs are geometric). The
cap is the k in [0, max_k] with the most tokens per second of step:

    B * sum(a^i, i = 0..k) / T(B * (1 + k))

T(rows) is the running average of measured pure-decode steps (no prompt chunk) with that many
rows. Why measured rather than priced from the weight bytes: on a small model whose weights sit
in cache, each extra row costs compute (SmolLM2-135M on 2 Xeon threads: a 2-row step costs what
a 1-row step does, 5 rows about twice it), so the k that pays depends on the machine, the model
and the batch — and on a GPU-class weight-bound model T hardly grows and the cap stays at max_k.
A row count not measured yet is priced as the nearest measured smaller one (optimistic, so the
first steps try it and measure it); while the cap is 0, every `PROBE_EVERY`th step drafts one
token so a changed machine or text is noticed.
"""

from __future__ import annotations

EMA_WEIGHT = 0.2  # of the newest step time for its row count
ACCEPT_DECAY = 0.98  # per verify step, on the acceptance counts (recent text weighs most)
PROBE_EVERY = 32  # steps at cap 0 between one-draft probes


class DraftPacer:
    def __init__(self, max_k: int) -> None:
        self.max_k = max_k
        self.step_s: dict[int, float] = {}  # rows -> average seconds of a pure-decode step
        self._accepted = 1.0  # decayed accepted drafts (prior: one accepted, no rejection)
        self._rejections = 0.0  # decayed verify steps that ended in a rejected draft
        self._idle = 0  # consecutive steps capped at 0
        self.capped_steps = 0  # steps whose cap was below max_k (visible as spec_paced_steps)

    @property
    def acceptance(self) -> float:
        """Chance a draft is accepted given the previous one was."""
        return self._accepted / (self._accepted + self._rejections)

    def observe_verify(self, drafted: int, accepted: int) -> None:
        self._accepted = self._accepted * ACCEPT_DECAY + accepted
        self._rejections = self._rejections * ACCEPT_DECAY + (1 if accepted < drafted else 0)

    def observe_step(self, rows: int, seconds: float, pure_decode: bool) -> None:
        """A step's measured time; only pure-decode steps (decodes and verify chunks) price
        rows: a prompt chunk's attention and prefill format would be charged to the drafts."""
        if not pure_decode or rows < 1 or seconds <= 0:
            return
        old = self.step_s.get(rows)
        self.step_s[rows] = seconds if old is None else old + EMA_WEIGHT * (seconds - old)

    def price(self, rows: int) -> float | None:
        """Measured seconds of a step of `rows`, else the nearest measured smaller one."""
        if rows in self.step_s:
            return self.step_s[rows]
        below = [r for r in self.step_s if r < rows]
        return self.step_s[max(below)] if below else None

    def cap(self, batch: int) -> int:
        """Drafts per request for a step of `batch` decodes."""
        base = self.price(batch)
        if base is None:  # nothing measured yet: a plain step first
            return 0
        a = self.acceptance
        best_k, best = 0, 1.0 / base
        tokens = 1.0
        for k in range(1, self.max_k + 1):
            tokens += a**k
            t = self.price(batch * (1 + k))
            if t is not None and tokens / t > best * (1 + 1e-9):
                best_k, best = k, tokens / t
        if best_k < self.max_k:
            self.capped_steps += 1
        if best_k == 0:
            self._idle += 1
            if self._idle >= PROBE_EVERY:
                self._idle = 0
                return 1
        else:
            self._idle = 0
        return best_k
