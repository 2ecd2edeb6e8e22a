"""Healthy: a 2-layer pre-LayerNorm transformer (d=32, 4 heads, causal) on a sequence task:
predict the previous token (y[t] = x[t-1], y[0] = x[0]) over a vocabulary of 10."""
import jax
import jax.numpy as jnp
import numpy as np

import funcgrad as fg

VOCAB, LENGTH, D, HEADS, LAYERS = 10, 12, 32, 4, 2
classes = VOCAB

_rng = np.random.default_rng(0)
_x = _rng.integers(0, VOCAB, size=(1024, LENGTH)).astype(np.int32)
_y = np.concatenate([_x[:, :1], _x[:, :-1]], axis=1)
data = {"x": _x, "y": _y}


def _dense(key, n_in, n_out):
    return {"w": jax.random.normal(key, (n_in, n_out)) / jnp.sqrt(n_in), "b": jnp.zeros(n_out)}


def init(key):
    keys = jax.random.split(key, 3 + 4 * LAYERS)
    params = {"embed": jax.random.normal(keys[0], (VOCAB, D)) * 0.1,
              "pos": jax.random.normal(keys[1], (LENGTH, D)) * 0.1,
              "head": _dense(keys[2], D, VOCAB)}
    for i in range(LAYERS):
        k = keys[3 + 4 * i: 7 + 4 * i]
        params[f"block{i}"] = {
            "ln1": {"scale": jnp.ones(D), "bias": jnp.zeros(D)},
            "qkv": _dense(k[0], D, 3 * D), "proj": _dense(k[1], D, D),
            "ln2": {"scale": jnp.ones(D), "bias": jnp.zeros(D)},
            "mlp_in": _dense(k[2], D, 4 * D), "mlp_out": _dense(k[3], 4 * D, D)}
    return params


def _layer_norm(p, x):
    mean = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def _linear(p, x):
    return x @ p["w"] + p["b"]


def _attention(p, x):
    n, t, _ = x.shape
    q, k, v = jnp.split(_linear(p["qkv"], x), 3, axis=-1)
    heads = lambda a: a.reshape(n, t, HEADS, D // HEADS).transpose(0, 2, 1, 3)
    q, k, v = heads(q), heads(k), heads(v)
    scores = q @ k.transpose(0, 1, 3, 2) / jnp.sqrt(D // HEADS)
    causal = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(causal, scores, -1e9)
    out = jax.nn.softmax(scores, axis=-1) @ v
    return _linear(p["proj"], out.transpose(0, 2, 1, 3).reshape(n, t, D))


def apply(params, tokens):
    x = params["embed"][tokens] + params["pos"]
    for i in range(LAYERS):
        p = params[f"block{i}"]
        x = x + _attention(p, _layer_norm(p["ln1"], x))
        x = x + _linear(p["mlp_out"], jax.nn.gelu(_linear(p["mlp_in"], _layer_norm(p["ln2"], x))))
    return _linear(params["head"], x)


def loss(params, batch):
    logits = apply(params, batch["x"])
    return fg.softmax_cross_entropy(logits.reshape(-1, VOCAB), batch["y"].reshape(-1))


EXPECT = None
