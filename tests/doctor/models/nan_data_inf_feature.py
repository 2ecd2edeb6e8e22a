"""Fault: non-finite data: a 'log of counts' feature computed as log(0) = -inf for some rows,
in a dict of two inputs."""
import jax
import jax.numpy as jnp
import numpy as np

import funcgrad as fg

_d = fg.load_digits(seed=0)
_counts = (_d.x_train[:512] > 1.5).sum(axis=1).astype(np.float32)
with np.errstate(divide="ignore"):
    _log_counts = np.log(_counts)[:, None]           # -inf where no pixel is above 1.5
data = {"image": _d.x_train[:512], "log_count": _log_counts.astype(np.float32),
        "y": _d.y_train[:512]}
classes = 10


def init(key):
    k1, k2 = jax.random.split(key)
    return {"hidden": {"w": jax.random.normal(k1, (65, 32)) * jnp.sqrt(2 / 65), "b": jnp.zeros(32)},
            "readout": {"w": jax.random.normal(k2, (32, 10)) / jnp.sqrt(32), "b": jnp.zeros(10)}}


def loss(params, batch):
    x = jnp.concatenate([batch["image"], batch["log_count"]], axis=1)
    h = jax.nn.relu(x @ params["hidden"]["w"] + params["hidden"]["b"])
    return fg.softmax_cross_entropy(h @ params["readout"]["w"] + params["readout"]["b"], batch["y"])


EXPECT = {"fault": "nan_data", "checks": {"data", "nonfinite"}, "place": "log_count"}
