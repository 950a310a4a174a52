"""How long a model call on a batch of a given size will take, learnt from recent calls.

The scheduler asks this before it flushes a window: a batch whose earliest deadline is at ``D`` must
start by ``D - estimate_ms(size) - safety_margin_ms``. The model is linear, ``t = a + b * size``
(a fixed cost per call plus a cost per item), fitted by weighted least squares over the last
``window`` observations with weights that halve every ``halflife`` observations, so the fit follows
a model that gets slower (a hotter GPU, a longer prompt mix) within a few dozen batches.

A prior (``prior_fixed_ms + prior_per_item_ms * size``) enters as a ridge penalty,
``prior_weight * ((a - prior_fixed_ms)**2 + (b - prior_per_item_ms)**2)``: before the first call
the estimate is the prior; with data at only one size the prior settles how the measured time
splits between fixed and per-item cost; with a spread of sizes the data dominate. The fitted slope
is never negative, and neither is an estimate.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pipeline.exceptions import SettingsError


@dataclass(frozen=True)
class _Fit:
    fixed_ms: float
    per_item_ms: float


class BatchTimeEstimator:
    """Learns milliseconds per model call as a function of batch size. Not thread-safe.

    ``observe`` is called after each model call (through ``Scheduler.record_batch``);
    ``estimate_ms`` is called whenever the scheduler computes when the current window must flush.
    """

    def __init__(
        self,
        *,
        window: int = 64,
        halflife: float = 16.0,
        prior_fixed_ms: float = 10.0,
        prior_per_item_ms: float = 2.5,
        prior_weight: float = 0.25,
    ) -> None:
        if window < 1:
            raise SettingsError(f"estimator window must be at least 1 observation, got {window}")
        if halflife <= 0:
            raise SettingsError(f"estimator halflife must be > 0 observations, got {halflife}")
        if prior_fixed_ms < 0 or prior_per_item_ms < 0:
            raise SettingsError(
                f"estimator prior must not be negative: prior_fixed_ms={prior_fixed_ms}, "
                f"prior_per_item_ms={prior_per_item_ms}"
            )
        if prior_weight <= 0:
            raise SettingsError(f"estimator prior_weight must be > 0, got {prior_weight}")
        self.window = window
        self.halflife = halflife
        self.prior_fixed_ms = prior_fixed_ms
        self.prior_per_item_ms = prior_per_item_ms
        self.prior_weight = prior_weight
        self._obs: deque[tuple[int, float]] = deque(maxlen=window)
        self._fit: _Fit | None = None

    @property
    def observations(self) -> int:
        """How many observations the current fit uses (at most ``window``)."""
        return len(self._obs)

    def observe(self, size: int, seconds: float) -> None:
        """Record one model call on ``size`` items that took ``seconds``. Called after each call."""
        if size < 1:
            raise ValueError(f"batch size must be at least 1, got {size}")
        if seconds < 0:
            raise ValueError(f"batch time must not be negative, got {seconds} s")
        self._obs.append((size, seconds * 1000.0))
        self._fit = None

    def estimate_ms(self, size: int) -> float:
        """Expected milliseconds for one model call on ``size`` items (>= 0)."""
        fit = self._fit if self._fit is not None else self._refit()
        return max(0.0, fit.fixed_ms + fit.per_item_ms * max(0, size))

    @property
    def fixed_ms(self) -> float:
        """The fitted fixed cost per call, in milliseconds."""
        return (self._fit or self._refit()).fixed_ms

    @property
    def per_item_ms(self) -> float:
        """The fitted cost per item, in milliseconds."""
        return (self._fit or self._refit()).per_item_ms

    def _refit(self) -> _Fit:
        lam = self.prior_weight
        a0, b0 = self.prior_fixed_ms, self.prior_per_item_ms
        w_sum = sx = sy = sxx = sxy = 0.0
        for age, (size, ms) in enumerate(reversed(self._obs)):
            w = 0.5 ** (age / self.halflife)
            w_sum += w
            sx += w * size
            sy += w * ms
            sxx += w * size * size
            sxy += w * size * ms
        # normal equations of  sum w (y - a - b x)^2 + lam (a - a0)^2 + lam (b - b0)^2
        m11, m12, m22 = w_sum + lam, sx, sxx + lam
        r1, r2 = sy + lam * a0, sxy + lam * b0
        det = m11 * m22 - m12 * m12  # > 0: lam > 0 makes the matrix positive definite
        fixed = (r1 * m22 - m12 * r2) / det
        per_item = (m11 * r2 - m12 * r1) / det
        if per_item < 0.0:
            per_item = 0.0
            fixed = r1 / m11
        if fixed < 0.0:
            fixed = 0.0
            per_item = max(0.0, r2 / m22)
        self._fit = _Fit(fixed_ms=fixed, per_item_ms=per_item)
        return self._fit
