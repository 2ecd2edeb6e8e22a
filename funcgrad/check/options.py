"""How a gradient check is made: its step and tolerances, the derivatives it checks, its random
draws, batching, precision and progress (`CheckOptions`), and the step and tolerances each
float dtype gets by default (`TOLERANCES`).

Step size and tolerances come from the floating dtype the function actually computed in.
Central differences have truncation error h²/6·|f'''| and round-off error about u·|f|/h for
unit round-off u, so the best h is near (3u)^(1/3) and the attainable error near u^(2/3)·|f|
(Nocedal & Wright, Numerical Optimization, §8.1).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

#: dtype the function computed in -> (eps, rtol, atol). An element passes when
#: |analytic - numeric| <= atol + rtol * |numeric| + noise, noise being the error bound of that
#: central difference (`funcgrad.check._noise`): the round-off floor 4·u·S/h (S = |f|, or Σ|u_k y_k|
#: for a cotangent-reduced output), or where an element misses it, the round-off and
#: truncation measured around it. atol is a plain absolute tolerance in the derivative's units
#: (not scaled by |f|: a constant added to f must not widen it) for what neither term models:
#: float64: u = 1.1e-16, h = 1e-6 -> round-off ~1e-10·|f|, truncation ~2e-13·|f'''|; atol 1e-7
#:   leaves a 100x margin over both for |f| up to 10 (beyond it the floor grows with |f|).
#: float32: u = 6.0e-8, h = 1e-3 -> round-off ~6e-5·|f|, truncation ~2e-7·|f'''|.
#: float16: u = 4.9e-4, h = 3e-2 -> round-off ~1.6e-2·|f|, truncation ~1.5e-4·|f'''|.
#: bfloat16: u = 3.9e-3, h = 1e-1 -> round-off ~3.9e-2·|f|, truncation ~1.7e-3·|f'''|.
TOLERANCES: dict[str, tuple[float, float, float]] = {
    "float64": (1e-6, 1e-6, 1e-7),
    "float32": (1e-3, 1e-2, 1e-3),
    "float16": (3e-2, 1e-1, 1e-1),
    "bfloat16": (1e-1, 2e-1, 2e-1),
}

_MEANING = {
    "eps": "the finite-difference step, in the units of the differentiated leaves; None picks "
           "one for the dtype (TOLERANCES), e.g. 1e-3 in float32",
    "rtol": "a relative tolerance; None uses TOLERANCES, e.g. 1e-2 in float32",
    "atol": "an absolute tolerance, in the derivative's units; None uses TOLERANCES, e.g. 1e-3 "
            "in float32",
}


@dataclasses.dataclass(frozen=True)
class CheckOptions:
    """The settings of `funcgrad.check_grads` and `funcgrad.check_directional` that most checks
    leave as they are, as one frozen value: each field means the same in both checks.

    Attributes:
      rtol: the relative tolerance, a finite number >= 0; None: `TOLERANCES`' for the dtype
        the function computes in. An element (a tangent, in `check_directional`) passes when
        |analytic - numeric| <= atol + rtol·|numeric| + the estimated error of its central
        difference.
      atol: the absolute tolerance, a finite number >= 0 in the derivative's units (not
        scaled by |f|); None: `TOLERANCES`'.
      eps: the central differences' step, a finite number > 0 in the units of the
        differentiated leaves; None: `TOLERANCES`'.
      modes: the analytic derivatives checked, a non-empty subset of ("rev", "fwd"): "rev"
        (``grad``/``vjp``) and "fwd" (``jvp``). "fwd" is skipped with a note when fn uses a
        ``custom_vjp``. With ``("fwd",)`` alone `check_grads` checks every element's jvp (a
        ``while_loop`` that only forward mode can differentiate).
      order: 1 checks the gradient; 2 checks the gradient of ``<u, gradient>`` (Hessian-vector
        products) against finite differences of the gradient, not the gradient itself: a wrong
        first-order rule can pass order 2, so check order 1 too.
      seed: a non-negative int seeding the random draws: the cotangent u that reduces a
        non-scalar output to uᵀJ, the second-order cotangent, and the random tangents.
      chunk_size: perturbed inputs evaluated per vmapped batch (a positive int; an element's ±
        step in `check_grads`, a tangent's in `check_directional`); None: about 2^20 / n for n
        checked elements (8 MiB of perturbed float64 inputs).
      lift_precision: when fn computes in a float narrower than float64 on the differentiated
        path (a bfloat16 layer, an ``astype(jnp.float32)``), check the same program with those
        casts lifted to float64, custom_jvp/custom_vjp rules included, at float64's step and
        tolerances (``report.lifted_from`` names the dtype). Where lifting cannot reach (a
        bitcast, a host callback), fn is checked as computed, at its dtype's tolerances, and
        ``report.weaker`` says so; False checks fn as computed (without `weaker`: as asked).
      progress: the progress of a long check's forward passes: None prints an estimate on
        stderr and shows a tqdm bar when they are expected to take over 10 s, True shows the
        bar for any check, False never. Only `check_grads` times its 2n passes (it runs two
        chunks first); `check_directional` evaluates its tangents in one call and shows none.
    Raises:
      TypeError: a field of the wrong type (the message names it and what it is).
      ValueError: a field out of its range (a negative rtol, eps <= 0, an unknown mode, an
        order other than 1 or 2, a negative seed, a chunk_size < 1).
    Example:
      >>> options = fg.CheckOptions(rtol=1e-4, modes=("rev",), seed=1)
      >>> fg.check_grads(lambda x: jnp.sum(jnp.sin(x)), jnp.ones(3), options=options).ok
      True
    """
    rtol: float | None = None
    atol: float | None = None
    eps: float | None = None
    modes: tuple[str, ...] = ("rev", "fwd")
    order: int = 1
    seed: int = 0
    chunk_size: int | None = None
    lift_precision: bool = True
    progress: bool | None = None

    def __post_init__(self) -> None:
        for name in ("eps", "rtol", "atol"):
            _check_number(name, getattr(self, name), positive=name == "eps")
        modes = self.modes
        if isinstance(modes, str) or not _is_sequence(modes):
            raise TypeError(f"CheckOptions: modes must be a tuple of 'rev' and/or 'fwd', got "
                            f"{modes!r}.")
        if not modes or not set(modes) <= {"rev", "fwd"}:
            raise ValueError(f"CheckOptions: modes must be a non-empty subset of ('rev', 'fwd'), "
                             f"got {modes!r}.")
        object.__setattr__(self, "modes", tuple(dict.fromkeys(modes)))
        if self.order not in (1, 2) or isinstance(self.order, bool):
            raise ValueError(f"CheckOptions: order must be 1 or 2, got {self.order!r}.")
        seed = self.seed
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"CheckOptions: seed must be a non-negative int (it seeds NumPy's "
                             f"generator), got {seed!r}.")
        chunk = self.chunk_size
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(
                chunk, (int, np.integer)) or chunk < 1):
            raise ValueError(f"CheckOptions: chunk_size must be a positive int or None, got "
                             f"{chunk!r}.")
        if not isinstance(self.lift_precision, (bool, np.bool_)):
            raise TypeError(f"CheckOptions: lift_precision must be True or False, got "
                            f"{self.lift_precision!r}.")
        if self.progress is not None and not isinstance(self.progress, (bool, np.bool_)):
            raise TypeError(f"CheckOptions: progress must be True, False or None, got "
                            f"{self.progress!r}.")

    def tolerances(self, dtype_used: str) -> tuple[float, float, float]:
        """(eps, rtol, atol) for a function computing in `dtype_used`: the fields given, and
        `TOLERANCES`' (float32's for a dtype it does not list) for those left None."""
        d_eps, d_rtol, d_atol = TOLERANCES.get(dtype_used, TOLERANCES["float32"])
        return (d_eps if self.eps is None else float(self.eps),
                d_rtol if self.rtol is None else float(self.rtol),
                d_atol if self.atol is None else float(self.atol))


def _is_sequence(value: Any) -> bool:
    return isinstance(value, (tuple, list))


def _check_number(name: str, value: Any, positive: bool = False) -> None:
    """TypeError unless `value` is None or a real number; ValueError unless it is finite and
    > 0 (`positive`) or >= 0."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"CheckOptions: {name} must be a number or None, got "
                        f"{type(value).__name__} {value!r}.")
    if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
        raise ValueError(f"CheckOptions: {name} must be a finite number "
                         f"{'> 0' if positive else '>= 0'} or None, got {value!r}: it is "
                         f"{_MEANING[name]}.")


def _options_of(who: str, options: CheckOptions | None) -> CheckOptions:
    """`options`, or the defaults for None; TypeError naming `who` for anything else (a dict
    of keywords is the likely mistake)."""
    if options is None:
        return _DEFAULT
    if not isinstance(options, CheckOptions):
        raise TypeError(f"{who}: options must be a funcgrad.CheckOptions or None, got "
                        f"{type(options).__name__} {options!r}; e.g. "
                        f"options=funcgrad.CheckOptions(rtol=1e-4).")
    return options


_DEFAULT = CheckOptions()
