"""How many tokens to propose each step: expected emitted tokens per second, from measured costs.

A Hub remote-code file (standard library only). Speculation pays only when `E[tokens per step] / cost(step)` beats
`1 / cost(decode)`. On a GPU a verify of k+1 rows costs about one decode; on a CPU it grows with k, and not even
monotonically (float32 on an AMD EPYC with `F.linear`: 1 row 64 ms, 2 rows 101, 3 rows 120, 4 rows 89, 8 rows 109;
with `verify_matmul`'s weight-first products 2 rows cost 50, less than the decode). So the policy measures every row
count (its first run, a warm-up, dropped) and keeps what it measured, per row count, for each target/device/dtype
(forgetting what it measured while a decode step cost much more than it does now: another process held the cores,
and measuring again now and then a size it has long left unchosen),
and per-position acceptance rates for each proposal source (a draft, prompt lookup); each step it proposes the k
(0..block) with the best expected rate, k = 0 being a plain decode step. Where speculation looks hopeless it still
probes now and then (less often each time it fails), because acceptance moves with the text.

With per-slot acceptance estimates a_1..a_k the expected emitted tokens of proposing k are
`1 + sum_{i<=k} prod_{j<=i} a_j` (the target's own token always counts). A draft's own predictions (DSpark's
confidence head) are recalibrated online against the acceptance the target shows. Such a draft must run before its
predictions say whether to verify anything, so drafting is an option: taken while what the choices it made possible
saved on average (the decode time of their expected tokens, less their verify) beats a draft step's cost. Probes of
either kind are spaced so they cost at most `PROBE_BUDGET` of the decode time.

A batch of B rows proposes one k for all of them (the verify is one rectangular forward, so a row proposing fewer
would still pay for the others' columns): the expected tokens are summed over the rows, against what B rows of k + 1
cost, which is measured per B.
"""

import math
import statistics
import threading
import weakref

# Measurements kept per size; the estimate is their median (costs drift slowly, noise is large).
COST_SAMPLES = 8
# A size's estimate made while a decode step cost this much more than it does now is forgotten, and the size measured
# again: the machine got faster (another process let go of the cores). Sizes that look dear go unchosen, so nothing
# else would correct them, and a policy started under load would decode plainly for good. The decode itself is
# measured on every plain step, and its median moves this far only with the load (a longer context makes it dearer).
COST_STALE_RATIO = 1.4
# A size left unchosen keeps the estimate of its last measurements, and one made in a slow moment (a process starting
# on the other core) would keep it unchosen for good: after this many steps of its table without it, it is measured
# again, or later where that step would lose more than PROBE_BUDGET of the decode time between (against the best).
COST_REFRESH_STEPS = 256
# Per-position acceptance: prior rate and its weight in pseudo-observations; old observations decay by this factor
# per update so the rates follow the text of the call at hand.
ACCEPT_PRIOR, ACCEPT_PRIOR_WEIGHT, ACCEPT_DECAY = 0.5, 2.0, 0.97
# The draft's own acceptance predictions (DSpark's confidence head) are recalibrated against what the target accepts:
# per bin of predicted confidence, decayed counts with the prediction itself as the prior. Calibration belongs to the
# draft/target pair more than to the text, so it decays slowly.
CALIBRATION_BINS, CALIBRATION_PRIOR_WEIGHT, CALIBRATION_DECAY = 10, 4.0, 0.995
# Drafted steps whose choices are averaged before a confident draft's value decides whether to draft at all, and
# the decay of that average per drafted step (about ten steps' memory: the value of a look moves with the text).
OPTION_MIN_STEPS, OPTION_DECAY = 4, 0.9
# A proposal must promise this much more (tokens per second) than a plain decode step: estimates of acceptance and
# cost are noisy, and a wrong guess for speculation costs more than a missed chance.
SPECULATION_MARGIN = 0.05
# Steps without a drafted proposal before a forced probe; doubled after each probe (across calls), up to the
# maximum, and back to the start once the policy drafts of its own accord.
PROBE_INTERVAL, PROBE_INTERVAL_MAX = 8, 128
# Whatever the schedule says, probes spaced so that what they cost beyond a decode step stays within this share of
# the decode time between them (a float32 CPU verify of a block costs two decodes: there a probe waits ~100 steps).
PROBE_BUDGET = 0.01
POLICIES = ("auto", "fixed")


class CostTable:
    """Seconds by size (rows verified, or slots drafted): the median of the last few measurements (the least of them
    would be a lucky step's, and sizes differ in how much their cost varies). A size's first measurement pays for
    its warm-up (allocation, kernel choice) and is dropped; until a second one, and for a size never measured, there
    is no estimate (costs are not monotonic in the size, so none is inferred from its neighbours): the policy
    measures it.

    The decode step (one row, in the verify table `decode`: this one unless given) dates each estimate: one made when
    a decode cost more than `COST_STALE_RATIO` times what it costs now is dropped (the size, warm already, is
    measured afresh)."""

    def __init__(self, decode: "CostTable | None" = None):
        self.decode = decode if decode is not None else self
        self.samples: dict[int, list[float]] = {}
        self.seconds: dict[int, float] = {}  # size -> the estimate
        self.decode_then: dict[int, float | None] = {}  # size -> the decode's estimate when the size's was made
        self.steps = 0  # measurements of any size
        self.measured_at: dict[int, int] = {}  # size -> `steps` at its last measurement

    def observe(self, size: int, seconds: float) -> None:
        self.steps += 1
        self.measured_at[size] = self.steps
        if size not in self.samples:
            self.samples[size] = []  # the warm-up measurement
            return
        samples = self.samples[size]
        samples.append(seconds)
        del samples[:-COST_SAMPLES]
        self.seconds[size] = statistics.median(samples)
        self.decode_then[size] = self.decode.seconds.get(1)

    def estimate(self, size: int) -> float | None:
        seconds = self.seconds.get(size)
        then = self.decode_then.get(size)
        if seconds is not None and then is not None:
            now = self.decode.seconds.get(1)
            if now is not None and then > COST_STALE_RATIO * now:
                self.forget(size)
                return None
        return seconds

    def unmeasured_for(self, size: int) -> int:
        """Measurements of other sizes since this one's last."""
        return self.steps - self.measured_at.get(size, self.steps)

    def forget(self, size: int) -> None:
        """Drop a size's estimate so that it is measured again (warm already: its next measurement counts)."""
        self.seconds.pop(size, None)
        self.samples[size].clear()


class AcceptanceRates:
    """Per-position conditional acceptance of one proposal source: of the proposals that reached position j (all
    before it accepted), the share accepted. Decayed, so recent steps count most."""

    def __init__(self, prior: float = ACCEPT_PRIOR):
        self.prior = prior
        self.tries: list[float] = []
        self.accepts: list[float] = []

    def observe(self, proposed: int, accepted: int) -> None:
        """A verified step: `proposed` candidates, the first `accepted` of them accepted."""
        reached = min(proposed, accepted + 1)
        while len(self.tries) < reached:
            self.tries.append(0.0)
            self.accepts.append(0.0)
        for j in range(len(self.tries)):
            self.tries[j] *= ACCEPT_DECAY
            self.accepts[j] *= ACCEPT_DECAY
        for j in range(reached):
            self.tries[j] += 1.0
            self.accepts[j] += 1.0 if j < accepted else 0.0

    def forget(self) -> None:
        """A step where this source had candidates but the policy passed them over: what it learnt fades toward the
        prior, so a source written off early (prompt lookup on prose, say) is tried again when the text changes."""
        self.tries = [t * ACCEPT_DECAY for t in self.tries]
        self.accepts = [a * ACCEPT_DECAY for a in self.accepts]

    def rates(self, count: int) -> list[float]:
        out = []
        for j in range(count):
            tries = self.tries[j] if j < len(self.tries) else 0.0
            accepts = self.accepts[j] if j < len(self.accepts) else 0.0
            # A position never reached borrows the previous one's rate as its prior (acceptance rarely rises).
            prior = out[-1] if out else self.prior
            out.append((accepts + ACCEPT_PRIOR_WEIGHT * prior) / (tries + ACCEPT_PRIOR_WEIGHT))
        return out


class ConfidenceCalibration:
    """Maps a draft's predicted per-slot acceptance to the acceptance this target shows (histogram binning). A head
    trained against one target precision or mix of text is often over-confident on another: on HumanEval the shipped
    DSpark draft predicts 0.49 at the first slot where the float32 target accepts 0.35, which makes marginal
    speculation look like a win."""

    def __init__(self):
        self.tries = [0.0] * CALIBRATION_BINS
        self.accepts = [0.0] * CALIBRATION_BINS

    @staticmethod
    def _bin(confidence: float) -> int:
        return min(max(int(confidence * CALIBRATION_BINS), 0), CALIBRATION_BINS - 1)

    def observe(self, confidences: list[float], accepted: int) -> None:
        """One row of a verified step: the predictions of the slots it proposed, the first `accepted` accepted."""
        self.tries = [t * CALIBRATION_DECAY for t in self.tries]
        self.accepts = [a * CALIBRATION_DECAY for a in self.accepts]
        for j, confidence in enumerate(confidences[: accepted + 1]):  # slots past the first rejection were not tested
            self.tries[self._bin(confidence)] += 1.0
            self.accepts[self._bin(confidence)] += 1.0 if j < accepted else 0.0

    def __call__(self, confidences: list[float]) -> list[float]:
        out = []
        for confidence in confidences:
            b = self._bin(confidence)
            out.append((self.accepts[b] + CALIBRATION_PRIOR_WEIGHT * confidence)
                       / (self.tries[b] + CALIBRATION_PRIOR_WEIGHT))
        return out


class DecayedMean:
    """A mean over recent observations (each older one weighs OPTION_DECAY less), and how many it has seen."""

    def __init__(self):
        self.total, self.weight, self.count = 0.0, 0.0, 0

    def observe(self, value: float) -> None:
        self.total = self.total * OPTION_DECAY + value
        self.weight = self.weight * OPTION_DECAY + 1.0
        self.count += 1

    @property
    def mean(self) -> float:
        return self.total / self.weight if self.weight else 0.0


def expected_tokens(rates: list[float]) -> list[float]:
    """E[emitted] for proposing k = 0..len(rates) tokens with these conditional acceptance rates."""
    out, survive = [1.0], 1.0
    for rate in rates:
        survive *= rate
        out.append(out[-1] + survive)
    return out


class MeasuredCosts:
    """What one target (on one device, in one dtype) and its drafts cost here; shared by the calls of a process."""

    def __init__(self):
        self.verify = CostTable()  # one sequence, by rows: 1 = a plain decode step
        self.batched_verify: dict[int, CostTable] = {}  # a batch of B sequences: B -> by rows per sequence
        self.draft: dict[tuple[str, int], CostTable] = {}  # by source and batch size, by slots drafted
        self.acceptance: dict[str, AcceptanceRates] = {}
        self.calibration = ConfidenceCalibration()
        self.option_gain: dict[str, DecayedMean] = {}  # by source: seconds a confident draft's choice saved
        self.idle_steps = 0  # steps in a row that proposed nothing
        self.probe_interval = PROBE_INTERVAL
        self.lock = threading.Lock()

    def verify_table(self, batch: int = 1) -> CostTable:
        return self.verify if batch == 1 else self.batched_verify.setdefault(batch, CostTable())

    def verify_estimate(self, batch: int, rows: int) -> float | None:
        """Seconds to verify `rows` per sequence for `batch` sequences. A batch size not measured yet (a batched call
        whose rows are finishing) borrows the nearest larger batch's cost, an upper bound, else the nearest smaller's,
        rather than measuring every size from scratch."""
        own = self.verify_table(batch).estimate(rows)
        if own is not None:
            return own
        sizes = sorted({1, *self.batched_verify} - {batch}, key=lambda b: (b < batch, abs(b - batch)))
        for size in sizes:
            seconds = self.verify_table(size).estimate(rows)
            if seconds is not None:
                return seconds
        return None

    def draft_table(self, source: str, batch: int = 1) -> CostTable:
        if (source, batch) not in self.draft:
            self.draft[source, batch] = CostTable(decode=self.verify_table(batch))
        return self.draft[source, batch]

    def rates(self, source: str) -> AcceptanceRates:
        return self.acceptance.setdefault(source, AcceptanceRates())

    def estimates_ms(self, batch: int = 1) -> dict:
        """What the policy weighs now, in milliseconds: verify cost by rows per sequence, and drafting cost by slots
        for each draft source (sizes without an estimate left out), so a report can show why it chose as it did."""
        def table_ms(table: CostTable) -> dict[int, float]:
            return {size: round(1000 * table.seconds[size], 3) for size in sorted(table.seconds)}

        with self.lock:
            return {"verify": table_ms(self.verify_table(batch)),
                    "draft": {source: table_ms(table) for (source, size), table in self.draft.items() if size == batch}}


_measured: dict[tuple, MeasuredCosts] = {}
_measured_lock = threading.Lock()


def measured_costs(key: tuple, owners: tuple = ()) -> MeasuredCosts:
    """The process-wide measurements for `key` (target, device, dtype, draft): later calls start informed. They are
    dropped when any of `owners` (the models the key names by id) is garbage-collected, so an id never aliases."""
    with _measured_lock:
        if key not in _measured:
            _measured[key] = MeasuredCosts()
            for owner in owners:
                weakref.finalize(owner, _measured.pop, key, None)
        return _measured[key]


class LengthPolicy:
    """Chooses each step's proposal length for one generate call, and records why."""

    def __init__(self, costs: MeasuredCosts, max_slots: int, mode: str = "auto", batch: int = 1):
        if mode not in POLICIES:
            raise ValueError(f"`dflash_policy` = {mode!r}; expected one of {POLICIES}.")
        self.costs, self.max_slots, self.mode = costs, max_slots, mode
        self.batch = batch  # sequences verified together (a batched call lowers it as rows finish)
        self._confidence: list[list[float]] | None = None  # the draft's raw predictions for the step being verified

    @property
    def adaptive(self) -> bool:
        return self.mode == "auto"

    def _rate(self, expected: float, seconds: float | None) -> float | None:
        return None if seconds is None or seconds <= 0 else expected / seconds

    def best(self, expected: list[float], draft_seconds, allow_zero: bool,
             refresh: bool = False) -> tuple[int, float, float | None]:
        """(k, expected tokens, estimated seconds) with the best expected rate, of `expected[k]` tokens for proposing
        k; `draft_seconds(k)` is the drafting cost of k slots (0 for prompt lookup). The smallest k whose cost is
        unknown is the answer (measure it): every size is measured before the estimates decide. `refresh` (candidates
        in hand): a proposal size long unchosen may be the answer instead, to be measured again."""
        best, spent = None, {}
        for k in range(0 if allow_zero else 1, len(expected)):
            verify = self.costs.verify_estimate(self.batch, k + 1)
            draft = draft_seconds(k) if k else 0.0
            seconds = spent[k] = None if verify is None or draft is None else verify + draft
            rate = self._rate(expected[k], seconds)
            if rate is None:
                return k, expected[k], None
            if k and allow_zero:
                rate /= 1 + SPECULATION_MARGIN
            if best is None or rate > best[0]:
                best = (rate, k, expected[k], seconds)
        if refresh:  # proposal sizes long unchosen: measured again, now and then
            table, best_rate = self.costs.verify_table(self.batch), best[2] / best[3]
            for k, seconds in spent.items():
                lost = seconds - expected[k] / best_rate  # beyond what the best takes for as many tokens
                if (k and k != best[1] and k + 1 in table.seconds
                        and table.unmeasured_for(k + 1) >= max(COST_REFRESH_STEPS, self.probe_spacing(lost))):
                    table.forget(k + 1)
                    return k, expected[k], None
        return best[1], best[2], best[3]

    def plan_draft(self, source: str) -> tuple[int, bool]:
        """Before drafting: (slots to draft, whether this is a forced probe); 0 slots = a plain decode step."""
        if not self.adaptive:
            return self.max_slots, False
        with self.costs.lock:
            if self.costs.verify_estimate(self.batch, 1) is None:
                return 0, False  # measure a decode step first
            table = self.costs.draft_table(source, self.batch)
            gain = self.costs.option_gain.get(source)
            if gain is not None and gain.count >= OPTION_MIN_STEPS:
                return self._plan_look(gain, table), False
            expected = [self.batch * e for e in expected_tokens(self.costs.rates(source).rates(self.max_slots))]
            k, _, _ = self.best(expected, table.estimate, allow_zero=True)
            if k == 0 and self.costs.idle_steps + 1 >= self.costs.probe_interval:
                k, _, seconds = self.best(expected, table.estimate, allow_zero=False)
                extra = None if seconds is None else seconds - self.costs.verify_estimate(self.batch, 1)
                return (k, True) if self.costs.idle_steps + 1 >= self.probe_spacing(extra) else (0, False)
            return k, False

    def _plan_look(self, gain: DecayedMean, table: CostTable) -> int:
        """Slots to draft for a draft whose head then says what to verify (DSpark): a draft step is a look, worth
        taking while what the looks made possible saved more than a look costs, and otherwise taken now and then
        within the probe budget. The head, not a forced verify, decides what a look proposes."""
        cost = table.estimate(self.max_slots)
        if cost is None or gain.mean >= cost * (1 + SPECULATION_MARGIN):
            return self.max_slots
        if self.costs.idle_steps >= self.probe_spacing(cost):  # steps since the last look, that look included
            self.costs.idle_steps = 0
            return self.max_slots
        return 0

    def probe_spacing(self, extra_seconds: float | None) -> int:
        """Idle steps a probe costing `extra_seconds` beyond a decode step must follow, to stay within
        `PROBE_BUDGET`."""
        decode = self.costs.verify_estimate(self.batch, 1)
        if extra_seconds is None or not decode:
            return 0
        return math.ceil(max(extra_seconds, 0.0) / (PROBE_BUDGET * decode))

    def choose(self, source: str, available: int, confidence: list[list[float]] | list[float] | None) -> tuple:
        """After drafting (or looking up) `available` candidates: (k to verify, expected tokens, estimated seconds of
        the verify). The drafting is paid for by now, so only the verify's cost weighs. `confidence`: the draft's own
        per-slot acceptance predictions (DSpark; one list per row of a batch), else the running rates."""
        self._confidence = None
        if not self.adaptive:
            return available, None, None
        with self.costs.lock:
            if confidence:
                rows = confidence if isinstance(confidence[0], list) else [confidence]
                self._confidence = rows
                per_row = [expected_tokens(self.costs.calibration(row[:available])) for row in rows]
                expected = [sum(row[k] for row in per_row) for k in range(len(per_row[0]))]
            else:
                rates = self.costs.rates(source).rates(available)
                expected = [self.batch * e for e in expected_tokens(rates)]
            choice = self.best(expected, lambda k: 0.0, allow_zero=True, refresh=True)
            if confidence:
                self._observe_option(source, expected[choice[0]], choice[2])
            elif not choice[0]:
                self.costs.rates(source).forget()
            return choice

    def _observe_option(self, source: str, expected: float, seconds: float | None) -> None:
        """What drafting bought this step: the decode time of the tokens the chosen verify is expected to emit, less
        that verify's cost (0 where the choice was a plain decode step)."""
        decode = self.costs.verify_estimate(self.batch, 1)
        if decode is None or seconds is None:
            return
        gain = expected * decode / self.batch - seconds
        self.costs.option_gain.setdefault(source, DecayedMean()).observe(max(gain, 0.0))

    def observe_draft(self, source: str, slots: int, seconds: float) -> None:
        with self.costs.lock:
            self.costs.draft_table(source, self.batch).observe(slots, seconds)

    def record(self, source: str | None, proposed: int, accepted: int | list[int], probe: bool,
               seconds: float) -> None:
        """A verified step (`proposed` candidates, `accepted` of them, or per row of a batch; `seconds` for the verify
        of proposed + 1 rows per sequence): update the cost of that many rows, the source's acceptance and the probing
        schedule."""
        with self.costs.lock:
            self.costs.verify_table(self.batch).observe(proposed + 1, seconds)
            if source is not None and proposed:
                rows = accepted if isinstance(accepted, list) else [accepted]
                for row in rows:
                    self.costs.rates(source).observe(proposed, row)
                if source == "draft" and self._confidence is not None:
                    for predicted, row in zip(self._confidence, rows):
                        self.costs.calibration.observe(predicted[:proposed], row)
            self._confidence = None
            if not self.adaptive:  # a fixed-length call teaches costs and acceptance, not the probing schedule
                return
            if source == "draft" and proposed:
                self.costs.idle_steps = 0
                if probe:
                    self.costs.probe_interval = min(2 * self.costs.probe_interval, PROBE_INTERVAL_MAX)
                else:
                    self.costs.probe_interval = PROBE_INTERVAL
            else:  # a decode step, or a looked-up proposal: nothing learnt about the draft
                self.costs.idle_steps += 1
