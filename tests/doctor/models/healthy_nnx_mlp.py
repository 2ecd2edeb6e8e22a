"""Healthy: a flax nnx MLP with BatchNorm and dropout."""
from flax import nnx

import funcgrad as fg
from funcgrad.interop import from_nnx


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(64, 64, rngs=rngs)
        self.bn1 = nnx.BatchNorm(64, momentum=0.9, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.linear2 = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        return self.linear2(self.dropout(nnx.relu(self.bn1(self.linear1(x)))))


_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10

model = from_nnx(MLP(nnx.Rngs(0, dropout=1)))


def objective(logits, batch):
    return fg.softmax_cross_entropy(logits, batch["y"])


EXPECT = None
