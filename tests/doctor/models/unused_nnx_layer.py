"""Fault: an nnx model with a residual branch ('skip') that is built but never called in
__call__, so its Linear's kernel and bias are dead weight."""
from flax import nnx

import funcgrad as fg
from funcgrad.interop import from_nnx


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(64, 48, rngs=rngs)
        self.skip = nnx.Linear(64, 48, rngs=rngs)
        self.fc2 = nnx.Linear(48, 10, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.fc1(x))
        return self.fc2(h)


_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10

model = from_nnx(Net(nnx.Rngs(0)))


def objective(logits, batch):
    return fg.softmax_cross_entropy(logits, batch["y"])


EXPECT = {"fault": "unused_param", "checks": {"grad_flow"}, "place": "skip"}
