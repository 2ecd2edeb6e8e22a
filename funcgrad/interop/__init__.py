"""Models from flax (linen, nnx) and equinox as funcgrad's pieces: params, model state, a loss.

Each adapter splits the library's object into the trainable params (named by the library's own
paths), the model state (BatchNorm statistics, rng counters) and a pure ``apply``, and gives a
`funcgrad.Loss` under the train step's contract; ``rebuild`` turns them back into the
library's object bit for bit. flax and equinox are imported only when an adapter is called
(``pip install 'funcgrad[flax]'`` / ``'funcgrad[equinox]'``).

Warnings: `StaticFieldWarning` (an equinox field equinox treats as static, which never trains),
`EvalModeWarning` (an evaluation call that changed the model state), `MomentumWarning` (a
BatchNorm momentum in PyTorch's meaning).
"""
from funcgrad._adapter_warnings import EvalModeWarning as EvalModeWarning
from funcgrad._adapter_warnings import MomentumWarning as MomentumWarning
from funcgrad._adapter_warnings import StaticFieldWarning as StaticFieldWarning
from funcgrad.interop._model import Model as Model
from funcgrad.interop.equinox import from_equinox as from_equinox
from funcgrad.interop.linen import from_linen as from_linen
from funcgrad.interop.nnx import from_nnx as from_nnx

__all__ = ["EvalModeWarning", "Model", "MomentumWarning", "StaticFieldWarning", "from_equinox",
           "from_linen", "from_nnx"]
