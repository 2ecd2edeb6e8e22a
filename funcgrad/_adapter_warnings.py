"""The warnings of the model adapters and of the tools that split an equinox module.

Plain classes with no import of funcgrad, flax or equinox, so that `funcgrad._library_objects`
(imported by every analysis tool) can raise them without importing the adapters.
"""


class StaticFieldWarning(UserWarning):
    """A field of an equinox module that equinox treats as static (a Python float such as
    ``self.scale = 0.5``): ``eqx.partition(model, eqx.is_inexact_array)``, ``from_equinox``
    and the analysis tools leave it out, so it is never differentiated and never trains. The
    message names the field and the fix (``jnp.asarray(0.5)`` to train it,
    ``eqx.field(static=True)`` for a setting)."""


class EvalModeWarning(UserWarning):
    """An evaluation call (``m.apply(..., train=False)``) changed the model state: a layer
    that ignores the mode (``BatchNorm(use_running_average=False)`` hard-wired, ``inference=
    False`` passed at the call) updated its statistics or drew from its rng stream."""


class MomentumWarning(UserWarning):
    """A BatchNorm ``momentum`` below 0.5: flax and equinox take momentum as the decay of the
    running average (default 0.99), PyTorch as the weight of the new batch (0.1), so a port
    that keeps PyTorch's value makes running statistics that follow each batch."""
