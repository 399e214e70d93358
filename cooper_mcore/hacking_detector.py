"""Reward-hacking detection: the RM reward climbs while rule-verified accuracy falls.

Cooper's motivation (arXiv 2508.05613) is that a policy trained against a *frozen* reward model
learns to exploit it: the RM's reward keeps rising while the accuracy that a rule-based verifier
measures on the same rollouts falls (the paper's static-RM run: reward 0.45 -> 0.93 while
accuracy 0.58 -> 0.50). :class:`RewardHackingDetector` watches those two series and raises an
alarm when they diverge that way; :func:`reward_rule_gap` is the per-step gap the trainer logs
as ``reward_rule_gap``.

Criterion (least-squares trend over a sliding window):
    The detector keeps the last ``window`` (reward, accuracy) pairs. Once the window is full it
    fits a least-squares line to each series against the update index and takes the fitted
    change across the window, ``slope * (n - 1)``. It fires when the fitted reward change is
    ``>= min_reward_rise`` *and* the fitted accuracy change is ``<= -min_acc_drop``.

    The fitted change equals the plain first-to-last difference on a linear trend (so the
    thresholds read as "rose by" / "fell by" over the window), but it uses every point, so a
    single noisy step cannot trigger it. For the default window of 10, noise bounded by ``+-a``
    moves a fitted change by at most ``~2.73 * a`` (the sum of the absolute least-squares
    weights), so bounded noise below ``min_* / 2.73`` can never fire; Gaussian noise of standard
    deviation ``s`` moves it by ``~1.0 * s`` (one standard deviation). A sudden collapse (a step
    change of size ``d``) is fitted as a change of up to ``~1.36 * d`` while it sits mid-window,
    so it is caught within ``window`` steps of the collapse.

Cooldown:
    After firing, the detector stays quiet for ``window`` updates, so one episode produces one
    alarm (a collapse that is still going on a full window later fires again).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Optional

logger = logging.getLogger(__name__)

ACTIONS = ("warn", "stop")


def reward_rule_gap(rm_reward_mean: float, rule_acc: float) -> float:
    """The ``reward_rule_gap`` metric: RM reward mean minus rule-verified accuracy.

    Meaningful when the RM reward is on the accuracy's [0, 1] scale (e.g. a sigmoid of the RM
    score). A gap that grows over training is the signature of reward hacking.

    Args:
        rm_reward_mean: mean reward the reward model gave this step's rollouts.
        rule_acc: fraction of this step's rollouts the rule verifier judged correct.

    Returns:
        ``rm_reward_mean - rule_acc`` as a float (NaN if either input is NaN).
    """
    return float(rm_reward_mean) - float(rule_acc)


def _fitted_change(values: list[float]) -> float:
    """Least-squares slope of ``values`` against 0..n-1, times (n - 1)."""
    n = len(values)
    x_mean = (n - 1) / 2.0
    y_mean = sum(values) / n
    sxx = sum((i - x_mean) ** 2 for i in range(n))
    sxy = sum((i - x_mean) * (y - y_mean) for i, y in enumerate(values))
    return sxy / sxx * (n - 1)


class RewardHackingDetector:
    """Flags steps where the RM reward rises while rule accuracy falls (see the module docstring).

    Example::

        detector = RewardHackingDetector(window=10, action="stop")
        for step in ...:
            msg = detector.update(step, metrics[MetricKey.REWARD_MEAN], metrics[MetricKey.RULE_ACC])
            if detector.should_stop:
                break

    Attributes:
        should_stop: True once the detector has fired with ``action="stop"``.
        fired_steps: steps at which the detector fired.
        last_reward_change: fitted RM-reward change over the last full window (None before).
        last_acc_change: fitted accuracy change over the last full window (None before).
    """

    def __init__(self, window: int = 10, min_reward_rise: float = 0.05, min_acc_drop: float = 0.05,
                 action: str = "warn") -> None:
        """Create a detector.

        Args:
            window: number of most recent steps the trend is fitted on (>= 3).
            min_reward_rise: fitted RM-reward rise over the window needed to fire (> 0).
            min_acc_drop: fitted rule-accuracy fall over the window needed to fire (> 0).
            action: ``"warn"`` (log a warning) or ``"stop"`` (also set :attr:`should_stop`).

        Raises:
            ValueError: on an invalid window, threshold or action.
        """
        if isinstance(window, bool) or not isinstance(window, int) or window < 3:
            raise ValueError(f"window must be an int >= 3, got {window!r}")
        for name, value in (("min_reward_rise", min_reward_rise), ("min_acc_drop", min_acc_drop)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if action not in ACTIONS:
            raise ValueError(f"action must be one of {ACTIONS}, got {action!r}")
        self.window = window
        self.min_reward_rise = float(min_reward_rise)
        self.min_acc_drop = float(min_acc_drop)
        self.action = action
        self.should_stop = False
        self.fired_steps: list[int] = []
        self.last_reward_change: Optional[float] = None
        self.last_acc_change: Optional[float] = None
        self._rewards: deque[float] = deque(maxlen=window)
        self._accs: deque[float] = deque(maxlen=window)
        self._since_fire = window  # updates since the last alarm; starts "cooled down"

    def update(self, step: int, rm_reward_mean: float, rule_acc: float) -> Optional[str]:
        """Add one step's RM reward mean and rule accuracy; return an alarm message if it fires.

        Non-finite inputs (e.g. a NaN accuracy on a step with no verifiable rollouts) are
        skipped: they are not added to the window and never fire.

        Args:
            step: the training step (used in the message).
            rm_reward_mean: mean RM reward of this step's rollouts (``reward/mean``).
            rule_acc: rule-verified accuracy of this step's rollouts (``rule/acc``).

        Returns:
            A human-readable message (also logged as a warning) when the detector fires, else
            None.
        """
        reward, acc = float(rm_reward_mean), float(rule_acc)
        if not (math.isfinite(reward) and math.isfinite(acc)):
            logger.debug("reward-hacking detector: skipping non-finite step %s (%s, %s)", step, reward, acc)
            return None
        self._rewards.append(reward)
        self._accs.append(acc)
        self._since_fire += 1
        if len(self._rewards) < self.window:
            return None
        d_reward = _fitted_change(list(self._rewards))
        d_acc = _fitted_change(list(self._accs))
        self.last_reward_change, self.last_acc_change = d_reward, d_acc
        if d_reward < self.min_reward_rise or d_acc > -self.min_acc_drop or self._since_fire < self.window:
            return None
        self._since_fire = 0
        self.fired_steps.append(step)
        msg = (f"possible reward hacking at step {step}: over the last {self.window} steps the RM reward "
               f"rose by {d_reward:+.3f} (fitted; {self._rewards[0]:.3f} -> {self._rewards[-1]:.3f}) while rule "
               f"accuracy fell by {d_acc:+.3f} ({self._accs[0]:.3f} -> {self._accs[-1]:.3f}); thresholds "
               f"+{self.min_reward_rise:.3f} / -{self.min_acc_drop:.3f}")
        if self.action == "stop":
            self.should_stop = True
            msg += "; stopping (action='stop')"
        logger.warning(msg)
        return msg
