"""A tiny reverse-mode autodiff engine on NumPy arrays, written to be read in one sitting.

Concept 24 (article B §3, B §1, A §1.1-1.3): the forward pass records a graph; each node keeps
its parents, its operation's name and a backward rule closing over the residuals it needs;
`Tensor.backward` walks the graph in reverse topological order (an explicit stack, so depth is
not limited by Python's recursion limit), multiplies each cotangent by the local derivative and
sums the cotangents of a value used more than once (fan-out). PyTorch's habits are kept on
purpose: ``.grad`` accumulates across ``backward()`` calls (hence `Tensor.zero_grad`), only
leaves keep ``.grad`` unless `Tensor.retain_grad` is called, `no_grad` and `Tensor.detach` cut
the graph, and the saved residuals are freed after a backward pass unless ``retain_graph=True``.
`funcgrad` itself is functional (``jax.grad``); this package is its glass box, checked against
``jax.grad`` in ``tests/test_micro.py``. The engine is ``funcgrad/micro/_engine.py`` (under 400
lines, NumPy only); `check_grad` and `to_dot`, which use it, are ``funcgrad/micro/_tools.py``.
"""
from funcgrad.micro._engine import Tensor as Tensor
from funcgrad.micro._engine import add as add
from funcgrad.micro._engine import div as div
from funcgrad.micro._engine import exp as exp
from funcgrad.micro._engine import getitem as getitem
from funcgrad.micro._engine import log as log
from funcgrad.micro._engine import log_softmax as log_softmax
from funcgrad.micro._engine import matmul as matmul
from funcgrad.micro._engine import max as max
from funcgrad.micro._engine import mean as mean
from funcgrad.micro._engine import mul as mul
from funcgrad.micro._engine import neg as neg
from funcgrad.micro._engine import no_grad as no_grad
from funcgrad.micro._engine import pow as pow
from funcgrad.micro._engine import relu as relu
from funcgrad.micro._engine import reshape as reshape
from funcgrad.micro._engine import sigmoid as sigmoid
from funcgrad.micro._engine import softmax_cross_entropy as softmax_cross_entropy
from funcgrad.micro._engine import sub as sub
from funcgrad.micro._engine import sum as sum
from funcgrad.micro._engine import tanh as tanh
from funcgrad.micro._engine import tensor as tensor
from funcgrad.micro._engine import transpose as transpose
from funcgrad.micro._tools import check_grad as check_grad
from funcgrad.micro._tools import to_dot as to_dot
