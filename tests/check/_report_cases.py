"""Calls of the gradient checker recorded before its keywords were split (issue 33, point 4):
each case's function and arguments, the old call's keywords (``OLD``), and the report it gave
(``old_reports.json``, written at commit 3a64a75 by running ``OLD`` through the old
``check_grads(fn, *args, **OLD)`` / ``audit(...)``). test_check_api.py makes the same check
through the new shape and compares the reports."""
import jax
import jax.numpy as jnp

import funcgrad as fg


def make_dense(scale_at=None, factor=1.0):
    """y = x @ w + b with a custom_vjp whose dW is multiplied by `factor` at `scale_at`."""
    @jax.custom_vjp
    def dense(w, b, x):
        return x @ w + b[None, :]

    def bwd(res, g):
        w, x = res
        dw = x.T @ g
        if scale_at is not None:
            dw = dw.at[scale_at].multiply(factor)
        return dw, g.sum(axis=0), g @ w.T

    dense.defvjp(lambda w, b, x: (dense(w, b, x), (w, x)), bwd)
    return dense


def _mlp():
    params = fg.mlp_init(jax.random.key(0), (4, 3, 2), activation="tanh")
    x = jax.random.normal(jax.random.key(1), (5, 4))
    return params, x, jnp.arange(5) % 2


def _loss(params, x, y, dense=None):
    h = jnp.tanh((dense or make_dense())(params[0]["w"], params[0]["b"], x))
    return fg.softmax_cross_entropy(make_dense()(params[1]["w"], params[1]["b"], h), y)


def _wrong_loss(params, x, y):
    return _loss(params, x, y, make_dense((1, 2), 1.5))


def _vector(w, x):
    return jnp.tanh(w * x) + w ** 2


def _cut(p):
    return jnp.sum(jax.lax.stop_gradient(p["a"]) * p["b"]) + jnp.sum(p["b"] ** 2)


def _in_float32(h):
    return jnp.sum(jax.nn.softmax(h.astype(jnp.float32)).astype(h.dtype) * jnp.arange(5.0))


def _cubic(x):
    return jnp.sum(x ** 3 * jnp.arange(1.0, 4.0))


#: name -> (function, arguments, the old call's keywords, the kind of call: "check" or "audit")
CASES = {
    "full_default": (_loss, _mlp, {}, "check"),
    "full_planted": (_wrong_loss, _mlp, {}, "check"),
    "full_vector_settings": (
        _vector, lambda: (jnp.linspace(-1.0, 1.0, 4), jnp.linspace(0.5, 2.0, 4)),
        {"argnums": (0, 1), "seed": 3, "modes": ("rev",), "eps": 1e-5, "rtol": 1e-5,
         "atol": 1e-8}, "check"),
    "full_order_2_fwd": (_cubic, lambda: (jnp.array([0.5, -1.0, 2.0]),),
                         {"order": 2, "modes": ("fwd",)}, "check"),
    "full_stop_gradient_declared": (
        _cut, lambda: ({"a": jnp.array([1.0, 2.0]), "b": jnp.array([3.0, -1.0])},),
        {"allow_stop_gradient": ["p['a']"]}, "check"),
    "full_stop_gradient_failed": (
        _cut, lambda: ({"a": jnp.array([1.0, 2.0]), "b": jnp.array([3.0, -1.0])},),
        {}, "check"),
    "full_as_computed": (_in_float32, lambda: (jnp.linspace(-1.0, 1.0, 5),),
                         {"lift_precision": False, "chunk_size": 3, "progress": False}, "check"),
    "directional_default": (_loss, _mlp, {"mode": "directional"}, "check"),
    "directional_blocks": (_wrong_loss, _mlp,
                           {"mode": "directional", "num_directions": 3, "block_size": 4,
                            "seed": 1, "modes": ("rev",)}, "check"),
    "directional_settings": (
        _vector, lambda: (jnp.linspace(-1.0, 1.0, 4), jnp.linspace(0.5, 2.0, 4)),
        {"mode": "directional", "argnums": (0, 1), "num_directions": 2, "seed": 5,
         "rtol": 1e-4, "atol": 1e-6, "eps": 1e-4, "chunk_size": 2}, "check"),
    "audit_full": (_loss, _mlp, {}, "audit"),
    "audit_blocks": (_wrong_loss, _mlp, {"max_full_elements": 10, "max_evaluations": 400,
                                         "seed": 2}, "audit"),
}
