"""How often to checkpoint: expected waste against the interval, and its optimum (pure functions).

Notation (all times in seconds of wall clock): ``tau`` the compute between two checkpoints
(interval in steps x step time), ``delta`` the time a save holds training (blocking part),
``restart`` R the time from a failure to training again (detection + restart + checkpoint
load; trainlab measures it per attempt, ``restart/*`` and ``goodput/detect_s``), ``mtbf`` M
the mean time between failures of the whole job (failures a Poisson process of rate 1/M).
"Waste" is the fraction of wall time that is not productive training; goodput = 1 - waste.

Models:

- **Young (1974)**, first order (J. W. Young, "A first order approximation to the optimum
  checkpoint interval", CACM 17(9):530-531): each interval costs ``delta``, a failure loses on
  average half an interval plus R, so ``waste ~ delta/tau + (tau/2 + R)/M`` (per unit of
  compute; valid for delta, tau << M) and the optimum is ``tau* = sqrt(2 delta M)``.
- **Daly (2006)** (J. T. Daly, "A higher order estimate of the optimum checkpoint interval for
  restart dumps", FGCS 22(3):303-312): for exponential failures that may also strike during
  saves and restarts, the expected wall time of ``T_s`` seconds of work is
  ``T_w = M e^{R/M} (e^{(tau+delta)/M} - 1) T_s / tau`` (his complete model, Section 3), so
  goodput = ``tau / (M e^{R/M} (e^{(tau+delta)/M} - 1))``; the optimum's higher-order estimate
  (his eq. 37) is ``sqrt(2 delta M)[1 + sqrt(delta/(2M))/3 + delta/(18M)] - delta`` for
  ``delta < 2M``, else ``M``.
- **Asynchronous saves** (CheckFreq, Mohan et al., FAST 2021, Section 4: snapshot then persist;
  PyTorch DCP ``async_save``): only the copy ``delta`` blocks; the write takes ``write_s`` more in
  the background, and a failure while it is in flight finds the previous checkpoint the newest
  durable one, losing a whole interval more. With the save at the start of an interval and
  failures uniform in it, the expected loss per failure is ``tau/2 + write_s`` (for
  ``write_s <= tau``), so ``waste ~ delta/tau + (tau/2 + write_s + R)/M``: the optimum interval
  is Young's with the blocking part only, and the in-flight write costs ``write_s/M``.
- **Two tiers** (Gemini, Wang et al., SOSP 2023: checkpoints in CPU memory, with a persistent
  tier behind; CheckFreq's snapshot): an in-memory snapshot every ``tau_mem`` (blocking
  ``delta_mem``) and a persistent save every ``tau_disk`` (``delta_disk``). A fraction ``q``
  of the failures leaves the memory tier usable (trainlab's ``memory`` policy: in-process faults
  handled by rollback; Gemini: a machine lost while its peer replica survives) and costs
  ``R_mem + tau_mem/2``; the rest go back to the persistent tier: ``R_disk + tau_disk/2``. So
  ``waste ~ delta_mem/tau_mem + delta_disk/tau_disk + q(R_mem + tau_mem/2)/M + (1-q)(R_disk + tau_disk/2)/M``,
  minimised by ``tau_mem* = sqrt(2 delta_mem M / q)`` and ``tau_disk* = sqrt(2 delta_disk M / (1-q))``.
- **Incremental (delta) saves**: a full save every ``full_every`` saves and deltas of
  ``delta_ratio`` of its bytes between; recovery reads the base and the deltas since
  (:func:`incremental_costs` gives the mean blocking time and load time to feed the above).

:mod:`framework.base.cost.failure_sim` simulates the same policies event by event; its tests check
it against :func:`daly_goodput` and the no-failure limit (waste = delta/tau).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _check(**values: float) -> None:
    for name, v in values.items():
        if not (v >= 0 and math.isfinite(v)):
            raise ValueError(f"{name}={v}: must be a finite number >= 0")


def young_interval(delta: float, mtbf: float) -> float:
    """Young's optimum compute time between checkpoints, ``sqrt(2 delta M)`` (seconds; Young 1974).

    Raises:
        ValueError: a negative or non-finite input.
    """
    _check(delta=delta, mtbf=mtbf)
    return math.sqrt(2.0 * delta * mtbf)


def daly_interval(delta: float, mtbf: float) -> float:
    """Daly's higher-order optimum (Daly 2006, eq. 37), seconds of compute between checkpoints.

    ``sqrt(2 delta M)[1 + (1/3) sqrt(delta/(2M)) + (1/9)(delta/(2M))] - delta`` for ``delta < 2M``,
    else ``M``. (Daly's captions, R = 10 min, delta = 5 min: M = 24 h -> 116.7 min.)

    Raises:
        ValueError: a negative or non-finite input.
    """
    _check(delta=delta, mtbf=mtbf)
    if delta >= 2.0 * mtbf:
        return mtbf
    x = delta / (2.0 * mtbf)
    return math.sqrt(2.0 * delta * mtbf) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - delta


def young_waste(tau: float, delta: float, restart: float, mtbf: float, write_s: float = 0.0) -> float:
    """First-order waste fraction ``delta/tau + (tau/2 + write_s + R)/M`` (Young 1974; async: see the module docstring).

    ``write_s``: seconds an asynchronous save stays in flight after its blocking part (0 = sync).
    Without failures (``mtbf = inf``) this is ``delta/tau``.

    Raises:
        ValueError: ``tau <= 0`` or a negative input.
    """
    _check(delta=delta, restart=restart, write_s=write_s)
    if not tau > 0:
        raise ValueError(f"tau={tau}: the interval must be > 0 seconds")
    fail = 0.0 if math.isinf(mtbf) else (tau / 2.0 + write_s + restart) / mtbf
    return delta / tau + fail


def daly_goodput(tau: float, delta: float, restart: float, mtbf: float) -> float:
    """Expected goodput (useful compute / wall time) of periodic synchronous checkpoints under
    exponential failures: ``tau / (M e^{R/M} (e^{(tau+delta)/M} - 1))`` (Daly 2006, Section 3).

    Failures may strike during compute, saves and restarts; a failure loses the whole interval in
    progress (its save included). ``mtbf = inf``: ``tau / (tau + delta)``.

    Raises:
        ValueError: ``tau <= 0`` or a negative input.
    """
    _check(delta=delta, restart=restart)
    if not tau > 0:
        raise ValueError(f"tau={tau}: the interval must be > 0 seconds")
    if math.isinf(mtbf):
        return tau / (tau + delta)
    if not mtbf > 0:
        raise ValueError(f"mtbf={mtbf}: must be > 0 seconds")
    return tau / (mtbf * math.exp(restart / mtbf) * math.expm1((tau + delta) / mtbf))


def optimum_interval(delta: float, restart: float, mtbf: float, *, lo: float = 1e-3, hi: float | None = None) -> float:
    """The interval (seconds) that maximises :func:`daly_goodput` (golden-section search on log tau).

    Raises:
        ValueError: a negative input.
    """
    _check(delta=delta, restart=restart, mtbf=mtbf)
    hi = hi if hi is not None else 10.0 * mtbf
    a, b = math.log(lo), math.log(hi)
    g = (math.sqrt(5.0) - 1.0) / 2.0
    c, d = b - g * (b - a), a + g * (b - a)
    f = lambda x: -daly_goodput(math.exp(x), delta, restart, mtbf)  # noqa: E731
    fc, fd = f(c), f(d)
    for _ in range(200):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return math.exp((a + b) / 2.0)


@dataclass(frozen=True)
class TwoTier:
    """Two checkpoint tiers (see the module docstring); times in seconds, ``mem_fraction`` q in [0, 1].

    Attributes:
        delta_mem, restart_mem: blocking time of an in-memory snapshot; restart from it.
        delta_disk, restart_disk: blocking time of a persistent save; restart from it.
        mem_fraction: fraction of failures after which the memory tier is usable.
    """

    delta_mem: float
    restart_mem: float
    delta_disk: float
    restart_disk: float
    mem_fraction: float

    def waste(self, tau_mem: float, tau_disk: float, mtbf: float) -> float:
        """First-order waste fraction at intervals ``tau_mem`` (memory) and ``tau_disk`` (persistent), seconds.

        Raises:
            ValueError: a non-positive interval.
        """
        if not (tau_mem > 0 and tau_disk > 0):
            raise ValueError(f"tau_mem={tau_mem}, tau_disk={tau_disk}: intervals must be > 0 seconds")
        q = self.mem_fraction
        w = self.delta_mem / tau_mem + self.delta_disk / tau_disk
        if not math.isinf(mtbf):
            w += (q * (self.restart_mem + tau_mem / 2.0) + (1.0 - q) * (self.restart_disk + tau_disk / 2.0)) / mtbf
        return w

    def optimum(self, mtbf: float) -> tuple[float, float]:
        """``(tau_mem*, tau_disk*)`` = ``(sqrt(2 delta_mem M/q), sqrt(2 delta_disk M/(1-q)))`` (inf where a tier takes no failures)."""
        q = self.mem_fraction
        tm = math.sqrt(2.0 * self.delta_mem * mtbf / q) if q > 0 else math.inf
        td = math.sqrt(2.0 * self.delta_disk * mtbf / (1.0 - q)) if q < 1 else math.inf
        return tm, td


def incremental_costs(
    full_bytes: float,
    delta_ratio: float,
    full_every: int,
    write_bw: float,
    read_bw: float,
    *,
    delta_compute_s: float = 0.0,
    fixed_s: float = 0.0,
) -> tuple[float, float, float]:
    """``(mean save seconds, mean load seconds, mean bytes written per save)`` of incremental checkpoints.

    A full save (``full_bytes`` bytes) every ``full_every`` saves and ``full_every - 1`` deltas
    of ``delta_ratio x full_bytes`` between, each costing ``delta_compute_s`` more (XOR and
    compression) and ``fixed_s`` per save (fsync, manifest). A recovery reads the base and the
    deltas since it: ``1 + delta_ratio x j`` full sizes after the j-th delta, ``j`` uniform in
    ``0 .. full_every-1``. Bandwidths in bytes/s. ``full_every = 1``: plain full saves.

    Raises:
        ValueError: ``full_every < 1``, a ratio outside [0, 1] or a non-positive bandwidth.
    """
    if full_every < 1:
        raise ValueError(f"full_every={full_every}: must be >= 1")
    if not 0.0 <= delta_ratio <= 1.0:
        raise ValueError(f"delta_ratio={delta_ratio}: must be in [0, 1]")
    if not (write_bw > 0 and read_bw > 0):
        raise ValueError(f"write_bw={write_bw}, read_bw={read_bw}: must be > 0 bytes/s")
    n_delta = full_every - 1
    bytes_mean = full_bytes * (1.0 + n_delta * delta_ratio) / full_every
    save_s = bytes_mean / write_bw + fixed_s + delta_compute_s * n_delta / full_every
    load_s = full_bytes * (1.0 + delta_ratio * n_delta / 2.0) / read_bw + delta_compute_s * n_delta / 2.0
    return save_s, load_s, bytes_mean
