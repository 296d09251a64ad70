"""Bayesian online change-point detection (Adams and MacKay 2007) with Falcon's verification step.

Model. Iteration times are modelled in log space, where a fail-slow is an additive shift whatever the base
iteration time (0.2 s or 4 s), and jitter with a coefficient of variation c is noise of standard deviation
about c. Each segment between change points is i.i.d. Normal with unknown mean and precision under a conjugate
Normal-Gamma prior; the prior mean is the worker's first observation, with weight `prior_kappa`. The hazard is
constant. Run lengths are truncated at `max_run`: the last bucket absorbs every longer run and keeps the
statistics of the most recent `max_run` samples, so memory is bounded and each sample costs O(max_run).

Conventions. Bucket j holds the hypothesis "the current segment has n = j + 1 samples, the newest included",
i.e. run length r = j. A change point before x_t scores x_t under the prior predictive, so a level shift moves
mass onto r = 0 at once. A candidate change is reported when P(r < window) >= threshold (Falcon: 0.9); the
candidate onset is the most probable short run's first sample. A change that never reached the threshold
while short gets a later chance: the most probable run, while one to two windows long (`_candidate_runs`).

Spikes. BOCD is fed the running median of the last three samples (`despike`): a one-iteration spike would
otherwise open a segment of its own whose inflated variance absorbs a real change that follows within a few
iterations. A level shift passes the median one iteration later; the onset is then refined on raw samples.

Verification (Falcon 4.2). BOCD alone also fires on one-iteration spikes and on bursts of jitter. A candidate
is kept only if the level after it differs from the level before it by at least `min_change` (10%). Levels
are medians rather than means: a median of three or more samples is not moved by a single spike, so a spike
at the onset cannot pass verification on its own (a mean would let a 3x spike push three samples 67% up).

`ChangeDetector` is the single-stream API; `BatchDetector` runs many workers in lock-step with the same
arithmetic over a (workers, max_run) array, and reports the same events.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from ..errors import PlannerError
from ._events import ChangeEvent, ChangeKind, check_time

FloatArray = NDArray[np.float64]
OUTLIERS_TOLERATED = 2


@dataclass(frozen=True, slots=True)
class DetectorConfig:
    """Tuning of BOCD + verification. Defaults were chosen on `tracegen` traces (see docs/benchmarks)."""

    hazard: float = 1 / 250
    """Prior probability of a change point before any iteration (1 / expected segment length)."""
    threshold: float = 0.9
    """P(run length < window) that marks a candidate change point (Falcon uses 0.9)."""
    window: int = 8
    """Run lengths below this count as "small"; a change must be confirmed within this many iterations."""
    max_run: int = 32
    """Truncation of the run-length distribution (bounded memory and work per sample)."""
    min_change: float = 0.10
    """Verification: |after / before - 1| below this is jitter, not a fail-slow (Falcon: 10%)."""
    min_after: int = 5
    """Samples of the new level needed before verifying (two outliers among them are tolerated)."""
    min_before: int = 8
    """Samples of the old level needed before verifying (also ignores the first, warm-up iterations)."""
    baseline: int = 32
    """At most this many samples before the onset form the "before" level."""
    verify: bool = True
    """False gives plain BOCD: every candidate is reported (Falcon's Tables 4-5 baseline)."""
    despike: bool = True
    """Feed BOCD the running median of the last three samples, so an isolated spike never opens a segment
    (whose inflated variance would then hide a real change that follows). Verification still sees raw
    samples. Plain BOCD, the baseline, runs without it."""
    prior_kappa: float = 0.01
    """Weight (in samples) of the prior mean, the worker's first log iteration time."""
    prior_alpha: float = 1.0
    """Shape of the Gamma prior on the precision of log iteration times."""
    prior_beta: float = 1e-3
    """Rate of the Gamma prior: prior_beta / prior_alpha = 1e-3 is a jitter of about 3% (log scale); broad
    enough that a segment contaminated by a spike does not out-score a new level."""

    def __post_init__(self) -> None:
        if not 0 < self.hazard < 1:
            raise PlannerError("hazard", f"must be in (0, 1), got {self.hazard}")
        if not 0 < self.threshold < 1:
            raise PlannerError("threshold", f"must be in (0, 1), got {self.threshold}")
        if self.max_run < 2:
            raise PlannerError("max_run", f"must be >= 2, got {self.max_run}")
        if not 1 <= self.window < self.max_run:
            raise PlannerError("window", f"must be in [1, max_run={self.max_run}), got {self.window}")
        if self.min_change < 0:
            raise PlannerError("min_change", f"must be >= 0, got {self.min_change}")
        if not 1 <= self.min_after <= self.window:
            raise PlannerError("min_after", f"must be in [1, window={self.window}], got {self.min_after}")
        if self.min_before < 1 or self.baseline < self.min_before:
            raise PlannerError(
                "baseline", f"need 1 <= min_before ({self.min_before}) <= baseline ({self.baseline})"
            )
        for name in ("prior_kappa", "prior_alpha", "prior_beta"):
            if not getattr(self, name) > 0:
                raise PlannerError(name, f"must be > 0, got {getattr(self, name)}")

    @property
    def history(self) -> int:
        """Raw samples kept per worker: the before-window plus the longest after-window, which is a late
        candidate's (`_candidate_runs`: up to 2 x window - 1 samples), and the newest sample."""
        return self.baseline + 2 * self.window


class _Constants:
    """Per-bucket terms of the Student-t predictive that depend only on the sample count, precomputed."""

    def __init__(self, config: DetectorConfig) -> None:
        counts = np.arange(0, config.max_run + 1, dtype=np.float64)  # samples seen by each bucket's stats
        kappa = config.prior_kappa + counts
        alpha = config.prior_alpha + counts / 2
        # log t-pdf = c - log(beta)/2 - (alpha + 1/2) log1p(q (y - mu)^2 / beta), and the Normal-Gamma update
        # is beta' = beta + q (y - mu)^2, mu' = mu + (y - mu) / (kappa + 1).
        # math.lgamma, not scipy.special.gammaln: once per detector, and scipy.special takes a third of a
        # second to import in every process that can detect (the operator, the CLI).
        log_gamma_ratio = np.array([math.lgamma(a + 0.5) - math.lgamma(a) for a in alpha])
        const = log_gamma_ratio - 0.5 * np.log(2 * np.pi * (kappa + 1) / kappa)
        self.log_c: FloatArray = const[1:]
        self.q: FloatArray = kappa[1:] / (2 * (kappa[1:] + 1))
        self.power: FloatArray = alpha[1:] + 0.5
        self.step: FloatArray = 1 / (kappa[1:] + 1)
        self.prior_log_c = float(const[0])
        self.prior_q = float(kappa[0] / (2 * (kappa[0] + 1)))
        self.prior_power = float(alpha[0] + 0.5)
        self.prior_step = float(1 / (kappa[0] + 1))
        self.log_hazard = math.log(config.hazard)
        self.log_growth = math.log1p(-config.hazard)


def _median3(a: FloatArray, b: FloatArray, c: FloatArray) -> FloatArray:
    """Element-wise median of three arrays without sorting."""
    return np.maximum(np.minimum(a, b), np.minimum(np.maximum(a, b), c))


def _bocd_step(
    y: FloatArray,
    prior_mu: FloatArray,
    mass: FloatArray,
    mu: FloatArray,
    beta: FloatArray,
    k: _Constants,
    prior_beta: float,
) -> None:
    """Advance run-length posteriors by one log observation, in place; leading axes are workers."""
    deviation = y[..., None] - mu
    spread = k.q * deviation * deviation
    log_pred = k.log_c - 0.5 * np.log(beta) - k.power * np.log1p(spread / beta)
    prior_dev = y - prior_mu
    prior_spread = k.prior_q * prior_dev * prior_dev
    log_prior_pred = (
        k.prior_log_c - 0.5 * math.log(prior_beta) - k.prior_power * np.log1p(prior_spread / prior_beta)
    )
    # Scale by the largest predictive before exponentiating: the posterior is normalised below anyway.
    top = np.maximum(log_pred.max(axis=-1), log_prior_pred)
    growth = mass * np.exp(log_pred + (k.log_growth - top[..., None]))
    change = np.exp(log_prior_pred + k.log_hazard - top)
    tail = growth[..., -1].copy()
    mass[..., 1:] = growth[..., :-1]
    mass[..., -1] += tail
    mass[..., 0] = change
    mass /= mass.sum(axis=-1, keepdims=True)
    # Posterior statistics shift one bucket up; the absorbing last bucket takes the window of its neighbour.
    mu[..., 1:] = (mu + deviation * k.step)[..., :-1]
    beta[..., 1:] = (beta + spread)[..., :-1]
    mu[..., 0] = prior_mu + prior_dev * k.prior_step
    beta[..., 0] = prior_beta + prior_spread


def _candidate_runs(mass: FloatArray, config: DetectorConfig) -> NDArray[np.int64]:
    """The run length of each row's candidate segment, or -1 (no candidate): the most probable short run
    when P(run < window) >= threshold (Falcon's rule), else the most probable run when it is between one
    and two windows long. The second is a later chance for a change that BOCD never gave 0.9 while it was
    short: on a noisy host the demo's x4 worker peaked at 0.88 and its new segment then grew past the
    window unreported; verification judges both alike."""
    window = config.window
    short = mass[:, :window]
    runs = np.argmax(mass, axis=1)
    late = (runs >= window) & (runs < 2 * window)
    confident = short.sum(axis=1) >= config.threshold
    return np.where(confident, np.argmax(short, axis=1), np.where(late, runs, -1))


def _verify(
    values: FloatArray, split: int, config: DetectorConfig, *, settled: bool = False
) -> tuple[ChangeKind, float, float, int] | None:
    """Compare the level of values[:split] (before) with values[split:] (after).

    `settled`: values[0] is the onset of a change verified already, so its level needs only the `min_after`
    samples that verified it, not `min_before`. Otherwise a second change within `min_before` samples of the
    first is never reported: the demo's x4 order began 7 steps after a dismissed 1.7x noise report, and the
    worker's agent stayed silent about it.

    Returns (kind, before, after, split) with the split moved back over samples that already sit at the new
    level: BOCD puts the onset after a spike that follows it, and the first slow iterations belong to it.
    """
    min_before = config.min_after if settled else config.min_before
    if split < min_before or len(values) - split < config.min_after:
        return None
    before = float(np.median(values[:split]))
    after_values = np.sort(values[split:])
    # Judge the change without the samples most extreme in its own direction: two spikes cannot fake a
    # slowdown, and two lucky fast iterations cannot fake a recovery.
    keep = max(1, len(after_values) - OUTLIERS_TOLERATED)
    slower = float(np.median(after_values)) > before
    after = float(np.median(after_values[:keep] if slower else after_values[-keep:]))
    # Trimming may flip the side of `before`: then the samples disagree and nothing is verified.
    if after == before or (after > before) != slower:
        return None
    if config.verify and abs(after / before - 1) < config.min_change:
        return None
    midpoint = math.sqrt(before * after)
    floor = max(min_before, split - config.window)
    while split > floor and (values[split - 1] > midpoint) == slower:
        split -= 1
    return (ChangeKind.SLOWDOWN if slower else ChangeKind.RECOVERY), before, after, split


class ChangeDetector:
    """BOCD + verification on one stream of iteration times: `feed(seconds) -> ChangeEvent | None`."""

    def __init__(self, config: DetectorConfig | None = None) -> None:
        self.config = config or DetectorConfig()
        self._k = _Constants(self.config)
        runs = self.config.max_run
        self._mass: FloatArray = np.zeros(runs)
        self._mu: FloatArray = np.zeros(runs)
        self._beta: FloatArray = np.full(runs, self.config.prior_beta)
        self._prior_mu: FloatArray | None = None
        self._history: FloatArray = np.zeros(self.config.history)
        self._count = 0
        self._last_onset = 0

    @property
    def count(self) -> int:
        """Iterations fed so far."""
        return self._count

    def run_length_posterior(self) -> FloatArray:
        """P(run length = r | data) for r = 0 .. max_run - 1 (the last entry covers longer runs)."""
        return self._mass.copy()

    def feed(self, seconds: float) -> ChangeEvent | None:
        value = check_time(seconds)
        t = self._count
        self._history[t % len(self._history)] = value
        self._count += 1
        y = np.array(math.log(value))
        if self.config.despike and t >= 2:
            size = len(self._history)
            older = np.log(self._history[[(t - 2) % size, (t - 1) % size]])
            y = _median3(older[0], older[1], y)
        if self._prior_mu is None:
            self._prior_mu = y.copy()
        _bocd_step(y, self._prior_mu, self._mass, self._mu, self._beta, self._k, self.config.prior_beta)
        onset = t - int(_candidate_runs(self._mass[None, :], self.config)[0])
        if onset > t or onset <= self._last_onset:
            return None
        start = max(self._last_onset, onset - self.config.baseline)
        values = self._history[np.arange(start, t + 1) % len(self._history)]
        settled = 0 < self._last_onset == start
        verdict = _verify(values, onset - start, self.config, settled=settled)
        if verdict is None:
            return None
        kind, before, after, split = verdict
        self._last_onset = onset = start + split
        return ChangeEvent(index=onset, kind=kind, before_s=before, after_s=after, detected_at=t)

    def detect(self, seconds: list[float] | FloatArray) -> list[ChangeEvent]:
        """Feed a whole trace; return its events in order."""
        events = []
        for value in seconds:
            event = self.feed(float(value))
            if event is not None:
                events.append(event)
        return events


class BatchDetector:
    """BOCD + verification for many workers at once: one row per worker, all fed in the same iteration.

    `feed(times)` takes one iteration time per worker and returns (worker, event) pairs; the events are those
    that `ChangeDetector` would report for each worker's stream. Work per call is O(workers x max_run) numpy
    arithmetic; verification runs only for workers whose posterior flags a candidate.
    """

    def __init__(self, workers: int, config: DetectorConfig | None = None) -> None:
        if workers < 1:
            raise PlannerError("workers", f"must be >= 1, got {workers}")
        self.config = config or DetectorConfig()
        self.workers = workers
        self._k = _Constants(self.config)
        shape = (workers, self.config.max_run)
        self._mass: FloatArray = np.zeros(shape)
        self._mu: FloatArray = np.zeros(shape)
        self._beta: FloatArray = np.full(shape, self.config.prior_beta)
        self._prior_mu: FloatArray = np.zeros(workers)
        self._history: FloatArray = np.zeros((workers, self.config.history))
        self._count = 0
        self._last_onset = np.zeros(workers, dtype=np.int64)

    @property
    def count(self) -> int:
        return self._count

    def feed(self, seconds: FloatArray | list[float]) -> list[tuple[int, ChangeEvent]]:
        values = np.asarray(seconds, dtype=np.float64)
        if values.shape != (self.workers,):
            raise PlannerError("times", f"expected {self.workers} iteration times, got shape {values.shape}")
        if not (np.all(np.isfinite(values)) and np.all(values > 0)):
            bad = int(np.flatnonzero(~(np.isfinite(values) & (values > 0)))[0])
            raise PlannerError("times", f"worker {bad}: iteration times must be finite and positive")
        t = self._count
        size = self._history.shape[1]
        self._history[:, t % size] = values
        self._count += 1
        y = np.log(values)
        if self.config.despike and t >= 2:
            older = np.log(self._history[:, [(t - 2) % size, (t - 1) % size]])
            y = _median3(older[:, 0], older[:, 1], y)
        if t == 0:
            self._prior_mu = y.copy()
        _bocd_step(y, self._prior_mu, self._mass, self._mu, self._beta, self._k, self.config.prior_beta)
        onsets = t - _candidate_runs(self._mass, self.config)
        flagged = np.flatnonzero((onsets <= t) & (onsets > self._last_onset))
        events: list[tuple[int, ChangeEvent]] = []
        for worker in flagged.tolist():
            onset = int(onsets[worker])
            last = int(self._last_onset[worker])
            start = max(last, onset - self.config.baseline)
            row = self._history[worker, np.arange(start, t + 1) % size]
            verdict = _verify(row, onset - start, self.config, settled=0 < last == start)
            if verdict is None:
                continue
            kind, before, after, split = verdict
            self._last_onset[worker] = onset = start + split
            events.append((worker, ChangeEvent(onset, kind, before, after, detected_at=t)))
        return events

    def detect(self, matrix: FloatArray) -> list[tuple[int, ChangeEvent]]:
        """Feed a (iterations, workers) matrix row by row; return every (worker, event)."""
        grid = np.asarray(matrix, dtype=np.float64)
        if grid.ndim != 2 or grid.shape[1] != self.workers:
            raise PlannerError("times", f"expected shape (iterations, {self.workers}), got {grid.shape}")
        events: list[tuple[int, ChangeEvent]] = []
        for row in grid:
            events.extend(self.feed(row))
        return events
