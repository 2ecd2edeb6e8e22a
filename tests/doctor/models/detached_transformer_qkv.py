"""Fault: a 2-layer transformer (d=32) on the previous-token task whose second block's qkv
projection weight is detached by stop_gradient."""
import jax
import jax.numpy as jnp
import numpy as np

import funcgrad as fg

VOCAB, LENGTH, D, HEADS = 10, 12, 32, 4
classes = VOCAB

_rng = np.random.default_rng(1)
_x = _rng.integers(0, VOCAB, size=(512, LENGTH)).astype(np.int32)
data = {"x": _x, "y": np.concatenate([_x[:, :1], _x[:, :-1]], axis=1)}


def _dense(key, n_in, n_out):
    return {"w": jax.random.normal(key, (n_in, n_out)) / jnp.sqrt(n_in), "b": jnp.zeros(n_out)}


def init(key):
    k = jax.random.split(key, 11)
    params = {"embed": jax.random.normal(k[0], (VOCAB, D)) * 0.1,
              "pos": jax.random.normal(k[1], (LENGTH, D)) * 0.1, "head": _dense(k[2], D, VOCAB)}
    for i in range(2):
        params[f"block{i}"] = {"qkv": _dense(k[3 + 4 * i], D, 3 * D),
                               "proj": _dense(k[4 + 4 * i], D, D),
                               "up": _dense(k[5 + 4 * i], D, 2 * D),
                               "down": _dense(k[6 + 4 * i], 2 * D, D)}
    return params


def _norm(x):
    return (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)


def _attention(p, x, frozen):
    n, t, _ = x.shape
    w = jax.lax.stop_gradient(p["qkv"]["w"]) if frozen else p["qkv"]["w"]
    q, k, v = jnp.split(x @ w + p["qkv"]["b"], 3, axis=-1)
    split = lambda a: a.reshape(n, t, HEADS, D // HEADS).transpose(0, 2, 1, 3)
    q, k, v = split(q), split(k), split(v)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), q @ k.transpose(0, 1, 3, 2) / 2.83, -1e9)
    out = (jax.nn.softmax(s, -1) @ v).transpose(0, 2, 1, 3).reshape(n, t, D)
    return out @ p["proj"]["w"] + p["proj"]["b"]


def loss(params, batch):
    x = params["embed"][batch["x"]] + params["pos"]
    for i in range(2):
        p = params[f"block{i}"]
        x = x + _attention(p, _norm(x), frozen=(i == 1))
        up = jax.nn.gelu(_norm(x) @ p["up"]["w"] + p["up"]["b"])
        x = x + up @ p["down"]["w"] + p["down"]["b"]
    logits = x @ params["head"]["w"] + params["head"]["b"]
    return fg.softmax_cross_entropy(logits.reshape(-1, VOCAB), batch["y"].reshape(-1))


EXPECT = {"fault": "detached_weight", "checks": {"grad_flow"}, "place": "['block1']['qkv']['w']"}
