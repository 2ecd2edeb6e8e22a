"""Fault: frozen layers still updated: the first layer of an MLP is frozen with
optax.masked(set_to_zero) but the chain then adds weight decay (add_decayed_weights) before SGD
with momentum, so the 'frozen' layer decays towards zero."""

import optax

import funcgrad as fg

_d = fg.load_digits(seed=0)
data = {"x": _d.x_train[:512], "y": _d.y_train[:512]}
classes = 10

_mask = [{"w": True, "b": True}, {"w": False, "b": False}, {"w": False, "b": False}]
optimizer = optax.chain(optax.masked(optax.set_to_zero(), _mask),
                        optax.add_decayed_weights(5e-3),
                        optax.sgd(0.05, momentum=0.9))


def init(key):
    return fg.mlp_init(key, (64, 64, 32, 10))


def loss(params, batch):
    return fg.softmax_cross_entropy(fg.mlp_apply(params, batch["x"]), batch["y"])


EXPECT = {"fault": "frozen_updated", "checks": {"semantics"}, "place": "[0]"}
