"""An op table for judging gradient checkers, modelled on JAX's own autodiff test specs.

Each `Op` is a function of float arrays with the shapes, input distribution and highest
derivative order that JAX's test suite uses for the same primitive (tests/lax_autodiff_test.py's
grad specs and conv/reduce/dot/gather/... grad tests, tests/lax_numpy_test.py's grad table,
tests/linalg_test.py's gradient checks), rebuilt here in our own code. Nothing in this module
imports funcgrad: the table is the yardstick, not the thing measured.

The input generators mirror JAX's ``jtu.rand_*`` kinds (seeded NumPy, rounded to the dtype
the op computes in):
  default      3 * N(0, 1)                    (jtu.rand_default)
  nonzero      3 * N(0, 1), zeros moved to 1  (jtu.rand_nonzero)
  positive     U(1, 3)                        (jtu.rand_positive)
  small        1e-3 * N(0, 1)                 (jtu.rand_small)
  not_small    3 * N(0, 1) pushed 10 away from 0   (jtu.rand_not_small)
  distinct     a shuffled grid of distinct values (no ties: max, sort, top_k, pooling)
  uniform(a,b) U(a, b)                        (jtu.rand_uniform)

`planted` wraps an op in a ``jax.custom_vjp`` whose backward pass is JAX's own vjp of the op
with the input cotangents multiplied by `scales` (all ones except one element), so one element
of one input's gradient is off by a known relative amount.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import jax.scipy as jsp
import numpy as np
from jax import lax

# --- input generators ---------------------------------------------------------------------

def _default(rng, shape):
    return 3.0 * rng.standard_normal(shape)


def _nonzero(rng, shape):
    x = 3.0 * rng.standard_normal(shape)
    return np.where(x == 0, 1.0, x)


def _positive(rng, shape):
    return rng.uniform(1.0, 3.0, shape)


def _small(rng, shape):
    return 1e-3 * rng.standard_normal(shape)


def _not_small(rng, shape):
    x = 3.0 * rng.standard_normal(shape)
    return x + np.where(x >= 0, 10.0, -10.0)


def _distinct(rng, shape):
    n = int(np.prod(shape))
    return (rng.permutation(n) - n / 2 + rng.uniform(0.1, 0.4, n)).reshape(shape) * 0.7


def _uniform(low, high):
    def draw(rng, shape):
        return rng.uniform(low, high, shape)
    draw.__name__ = f"uniform({low:g},{high:g})"
    return draw


RNGS = {"default": _default, "nonzero": _nonzero, "positive": _positive, "small": _small,
        "not_small": _not_small, "distinct": _distinct}


@dataclasses.dataclass(frozen=True)
class Op:
    """One configuration: ``fn(*inputs)`` -> array, inputs of `shapes` drawn by `rng`.

    Attributes:
      name: a unique label, e.g. "lax.sin" or "conv SAME stride 2".
      fn: a function of float arrays (any dtype: it computes in the dtype it is given).
      shapes: one shape per input.
      rng: the input kind (a key of `RNGS`) or a ``uniform(a,b)`` generator; a tuple gives one
        per input.
      order: the highest derivative order JAX's tests check for this op (1 or 2).
      domain: the op's natural domain, in words.
      source: which JAX test it is modelled on.
      smooth: False for ops whose derivative is zero almost everywhere (floor, sign, round):
        nothing to plant.
    """
    name: str
    fn: Callable
    shapes: tuple[tuple[int, ...], ...]
    rng: object = "default"
    order: int = 2
    domain: str = "all reals"
    source: str = "lax_autodiff"
    smooth: bool = True

    def inputs(self, dtype, seed: int = 0) -> tuple[np.ndarray, ...]:
        """The primal point: NumPy arrays of `shapes`, rounded to `dtype` (seeded by the op's
        name and `seed`, so each op gets the same point whatever else is in the table)."""
        rng = np.random.default_rng([seed, *self.name.encode()])
        kinds = self.rng if isinstance(self.rng, tuple) else (self.rng,) * len(self.shapes)
        out = []
        for shape, kind in zip(self.shapes, kinds):
            draw = RNGS[kind] if isinstance(kind, str) else kind
            out.append(np.asarray(draw(rng, shape)).astype(dtype))
        return tuple(out)

    def rng_name(self) -> str:
        kinds = self.rng if isinstance(self.rng, tuple) else (self.rng,)
        return ",".join(k if isinstance(k, str) else k.__name__ for k in kinds)


# --- the ops that need a few lines ----------------------------------------------------------

def _conv(lhs, rhs, *, strides=(1, 1), padding="VALID", lhs_dilation=None, rhs_dilation=None,
          groups=1):
    return lax.conv_general_dilated(lhs, rhs, strides, padding, lhs_dilation=lhs_dilation,
                                    rhs_dilation=rhs_dilation, feature_group_count=groups)


def _spd(a):
    """A symmetric positive definite matrix built from a square `a` (a @ a.T + n I)."""
    return a @ a.T + a.shape[0] * jnp.eye(a.shape[0], dtype=a.dtype)


def _well_conditioned(a):
    return a + 4.0 * jnp.eye(a.shape[0], dtype=a.dtype)


def _sym(a):
    return (a + a.T) / 2 + jnp.diag(jnp.arange(a.shape[0], dtype=a.dtype) * 3.0)


def _scatter_add(x, y):
    return x.at[jnp.array([0, 2, 2])].add(y)


def _scatter_set(x, y):
    return x.at[jnp.array([1, 3])].set(y)


def _gather(x):
    return x[jnp.array([2, 0, 2, 1]), 1:]


def _select(x, y):
    mask = jnp.array([[True, False, True], [False, False, True]])
    return jnp.where(mask, x, y)


def _scan_cumulative(x):
    def body(c, xi):
        c = jnp.tanh(c * 0.9 + xi)
        return c, c * xi
    return lax.scan(body, jnp.zeros_like(x[0]), x)[1]


def _fori(x):
    return lax.fori_loop(0, 3, lambda i, c: jnp.sin(c) * 1.1 + x, x)


def _cond(x, y):
    return lax.cond(True, lambda a, b: a * jnp.exp(b / 4), lambda a, b: a - b, x, y)


def _reduce_window_sum(x):
    return lax.reduce_window(x, 0.0, lax.add, (2, 2), (1, 1), "VALID")


def _max_pool(x):
    return lax.reduce_window(x, -jnp.inf, lax.max, (2, 2), (2, 1), "SAME")


def _avg_pool(x):
    return lax.reduce_window(x, 0.0, lax.add, (1, 2, 2), (1, 2, 2), "VALID") / 4.0


def _cross_entropy(logits):
    labels = jnp.array([0, 2])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def _layer_norm(x):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) * lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)


def _attention(q, k, v):
    s = q @ k.T / jnp.sqrt(jnp.asarray(q.shape[-1], q.dtype))
    return jax.nn.softmax(s, axis=-1) @ v


def _eigh_values(a):
    return jnp.linalg.eigh(_sym(a))[0]


def _qr_r(a):
    return jnp.abs(jnp.linalg.qr(a)[1])


def _svd_values(a):
    return jnp.linalg.svd(a, compute_uv=False)


def _broadcast(x):
    ramp = jnp.arange(3.0, dtype=x.dtype)[:, None, None]
    return jnp.broadcast_to(x, (3, *x.shape)) * ramp


def _sort_axis0(x):
    return jnp.sort(x, axis=0)


_U = _uniform


# --- the table ------------------------------------------------------------------------------

S = (2, 3)  # the elementwise shape (JAX's grad specs use small shapes: (), (3,), (2, 3))


def _un(name, f, rng="default", order=2, domain="all reals", shape=S, source="lax_autodiff",
        smooth=True):
    return Op(name, f, (shape,), rng, order, domain, source, smooth)


def _bin(name, f, rng="default", order=2, domain="all reals", shapes=(S, S),
         source="lax_autodiff"):
    return Op(name, f, shapes, rng, order, domain, source)


OPS: tuple[Op, ...] = (
    # lax_autodiff_test: LAX_GRAD_OPS, unary
    _un("lax.neg", lax.neg),
    _un("lax.floor", lax.floor, _U(0.1, 0.4), smooth=False, domain="off the integers"),
    _un("lax.ceil", lax.ceil, _U(0.1, 0.4), smooth=False, domain="off the integers"),
    _un("lax.round", lax.round, _U(0.1, 0.4), smooth=False, domain="off the half-integers"),
    _un("lax.sign", lax.sign, "nonzero", smooth=False, domain="x != 0"),
    _un("lax.exp", lax.exp, "small"),
    _un("lax.exp2", lax.exp2, "small"),
    _un("lax.expm1", lax.expm1),
    _un("lax.log", lax.log, "positive", domain="x > 0"),
    _un("lax.log1p", lax.log1p, "positive", domain="x > -1"),
    _un("lax.sinh", lax.sinh),
    _un("lax.cosh", lax.cosh),
    _un("lax.tanh", lax.tanh),
    _un("lax.sin", lax.sin),
    _un("lax.cos", lax.cos),
    _un("lax.tan", lax.tan, _U(-1.3, 1.3), domain="|x| < pi/2"),
    _un("lax.asin", lax.asin, "small", domain="|x| < 1"),
    _un("lax.acos", lax.acos, "small", domain="|x| < 1"),
    _un("lax.atan", lax.atan, "small"),
    _un("lax.asinh", lax.asinh),
    _un("lax.acosh", lax.acosh, "positive", domain="x > 1"),
    _un("lax.atanh", lax.atanh, _U(-0.9, 0.9), domain="|x| < 1"),
    _un("lax.abs", lax.abs, "positive", domain="x != 0"),
    _un("lax.sqrt", lax.sqrt, "positive", domain="x > 0"),
    _un("lax.rsqrt", lax.rsqrt, "positive", domain="x > 0"),
    _un("lax.cbrt", lax.cbrt, "positive", domain="x != 0 (derivative)"),
    _un("lax.logistic", lax.logistic),
    _un("lax.square", lax.square),
    _un("lax.integer_pow 3", lambda x: lax.integer_pow(x, 3)),
    _un("lax.integer_pow -2", lambda x: lax.integer_pow(x, -2), "not_small", domain="x != 0"),
    _un("lax.erf (default)", lax.erf, _U(-2.0, 2.0)),
    _un("lax.erfc", lax.erfc, _U(-2.0, 2.0)),
    _un("lax.erf_inv", lax.erf_inv, _U(-0.9, 0.9), domain="|x| < 1"),
    _un("lax.lgamma", lax.lgamma, "positive", domain="x > 0"),
    _un("lax.digamma", lax.digamma, "positive", domain="x > 0", order=1),
    _un("lax.bessel_i0e", lax.bessel_i0e),
    _un("lax.bessel_i1e", lax.bessel_i1e),
    _un("lax.real (of a real)", lambda x: lax.real(lax.complex(x, 0.5 * x)) * 2.0, order=1),
    # LAX_GRAD_OPS, binary
    _bin("lax.add", lax.add),
    _bin("lax.mul", lax.mul),
    _bin("lax.div", lax.div, ("default", "not_small"), domain="y != 0"),
    _bin("lax.max", lax.max, domain="x != y"),
    _bin("lax.min", lax.min, domain="x != y"),
    _bin("lax.pow", lax.pow, "positive", domain="x > 0"),
    _bin("lax.atan2", lax.atan2, domain="(x, y) != 0"),
    _bin("lax.rem", lax.rem, ("default", "positive"), domain="x/y off the integers"),
    _bin("lax.igamma", lax.igamma, "positive", order=1, domain="a > 0, x > 0"),
    _bin("lax.igammac", lax.igammac, "positive", order=1, domain="a > 0, x > 0"),
    _bin("lax.mul broadcast (1,3)", lax.mul, shapes=((1, 3), S)),
    Op("lax.clamp", lambda lo, x, hi: lax.clamp(lo, x, hi), (S, S, S),
       (_U(-3.0, -1.0), _U(-4.0, 4.0), _U(1.0, 3.0)), 2, "x not at a bound"),
    _bin("lax.select", _select, order=2),
    # lax_numpy_test: the grad table (JAX_GRAD_OPS) and one-to-one ops checked for grads
    _un("jnp.arcsin", jnp.arcsin, _U(-1.0, 1.0), domain="|x| < 1", source="lax_numpy"),
    _un("jnp.arccos", jnp.arccos, _U(-1.0, 1.0), domain="|x| < 1", source="lax_numpy"),
    _un("jnp.arcsinh", jnp.arcsinh, "positive", source="lax_numpy"),
    _un("jnp.arccosh", jnp.arccosh, "positive", domain="x > 1", source="lax_numpy"),
    _un("jnp.arctanh", jnp.arctanh, _U(-0.9, 0.9), domain="|x| < 1", source="lax_numpy"),
    _un("jnp.sinc", jnp.sinc, source="lax_numpy"),
    _un("jnp.log2", jnp.log2, "positive", domain="x > 0", source="lax_numpy"),
    _un("jnp.reciprocal", jnp.reciprocal, "not_small", domain="x != 0", source="lax_numpy"),
    _bin("jnp.logaddexp", jnp.logaddexp, _U(-0.9, 0.9), order=1, source="lax_numpy"),
    _bin("jnp.logaddexp2", jnp.logaddexp2, _U(-0.9, 0.9), order=1, source="lax_numpy"),
    _bin("jnp.hypot", jnp.hypot, "nonzero", source="lax_numpy"),
    _bin("jnp.power", jnp.power, "positive", domain="x > 0", source="lax_numpy"),
    _bin("jnp.fmod", jnp.fmod, ("default", "positive"), domain="x/y off the integers",
         source="lax_numpy"),
    _bin("jnp.copysign", jnp.copysign, ("default", "nonzero"), order=1, source="lax_numpy"),
    _un("jnp.clip", lambda x: jnp.clip(x, -2.0, 2.0), _U(-1.9, 1.9), source="lax_numpy"),
    _un("jsp.special.xlogy", lambda x: jsp.special.xlogy(x, x + 2.0), "positive",
        source="lax_scipy"),
    _un("jsp.special.entr", jsp.special.entr, "positive", source="lax_scipy"),
    _un("jsp.special.ndtr", jsp.special.ndtr, source="lax_scipy"),
    _un("jsp.special.ndtri", jsp.special.ndtri, _U(0.05, 0.95), domain="0 < p < 1",
        source="lax_scipy"),
    _un("jsp.special.log_ndtr", jsp.special.log_ndtr, source="lax_scipy"),
    _un("jsp.special.logit", jsp.special.logit, _U(0.05, 0.95), domain="0 < p < 1",
        source="lax_scipy"),
    # nn activations (checked for grads in nn_test)
    _un("jax.nn.relu", jax.nn.relu, "nonzero", domain="x != 0", source="nn"),
    _un("jax.nn.gelu", jax.nn.gelu, source="nn"),
    _un("jax.nn.softplus", jax.nn.softplus, source="nn"),
    _un("jax.nn.silu", jax.nn.silu, source="nn"),
    _un("jax.nn.elu", jax.nn.elu, "nonzero", domain="x != 0", source="nn"),
    _un("jax.nn.softmax", jax.nn.softmax, source="nn"),
    _un("jax.nn.log_softmax", jax.nn.log_softmax, source="nn"),
    _un("jsp.special.logsumexp", lambda x: jsp.special.logsumexp(x, axis=1), source="nn"),
    _un("cross-entropy", _cross_entropy, source="nn", shape=(2, 4)),
    _un("layer norm", _layer_norm, source="nn", shape=(2, 4)),
    Op("attention", _attention, ((3, 4), (5, 4), (5, 2)), "default", 1, source="nn"),
    # lax_autodiff_test: reductions (testReduceGrad), windows, cumulative
    _un("reduce_sum axis 0", lambda x: x.sum(0), shape=(3, 4)),
    _un("reduce_sum all", jnp.sum, shape=(3, 4)),
    _un("reduce_max axis 1", lambda x: x.max(1), "distinct", domain="no ties", shape=(3, 4)),
    _un("reduce_min all", jnp.min, "distinct", domain="no ties", shape=(3, 4)),
    _un("reduce_prod axis 0", lambda x: x.prod(0), _U(0.5, 1.5), shape=(3, 4)),
    _un("jnp.var", lambda x: jnp.var(x, axis=0), shape=(4, 3), source="lax_numpy"),
    _un("jnp.std", jnp.std, shape=(4, 3), source="lax_numpy"),
    _un("jnp.linalg.norm fro", jnp.linalg.norm, shape=(3, 3), source="linalg"),
    _un("reduce_window sum", _reduce_window_sum, shape=(3, 4), order=1),
    _un("reduce_window max", _max_pool, "distinct", domain="no ties", shape=(4, 3), order=1),
    _un("avg pool", _avg_pool, shape=(2, 4, 4), order=1),
    _un("cumsum", lambda x: jnp.cumsum(x, axis=1), shape=(3, 4)),
    _un("cumprod", lambda x: jnp.cumprod(x, axis=0), _U(0.5, 1.5), shape=(4, 3)),
    _un("cummax", lambda x: lax.cummax(x, axis=0), "distinct", domain="no ties",
        shape=(5, 2), order=1),
    _un("cumlogsumexp", lambda x: lax.cumlogsumexp(x, axis=0), shape=(5, 2)),
    _un("sort", _sort_axis0, "distinct", domain="no ties", shape=(4, 3), order=1),
    _un("top_k 2", lambda x: lax.top_k(x, 2)[0], "distinct", domain="no ties", shape=(3, 5),
        order=1),
    _un("jnp.median", jnp.median, "distinct", domain="no ties", shape=(7,), order=1,
        source="lax_numpy"),
    # lax_autodiff_test: dot_general and conv grads
    _bin("matmul", jnp.matmul, shapes=((2, 3), (3, 4))),
    _bin("dot_general batched", lambda a, b: lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,)))),
         shapes=((2, 3, 4), (2, 4, 2))),
    _bin("einsum ij,jk->ik sum", lambda a, b: jnp.einsum("ij,jk->k", a, b),
         shapes=((3, 2), (2, 3))),
    _bin("cross", jnp.cross, shapes=((2, 3), (2, 3)), source="lax_numpy"),
    _bin("conv VALID", _conv, shapes=((1, 2, 5, 5), (3, 2, 3, 3))),
    _bin("conv SAME stride 2", functools.partial(_conv, strides=(2, 2), padding="SAME"),
         shapes=((1, 2, 5, 5), (2, 2, 3, 3))),
    _bin("conv rhs dilated", functools.partial(_conv, rhs_dilation=(2, 1), padding="SAME"),
         shapes=((2, 1, 5, 4), (2, 1, 2, 2))),
    _bin("conv lhs dilated (transpose)", functools.partial(
        _conv, lhs_dilation=(2, 2), padding=((1, 1), (1, 1))), shapes=((1, 2, 3, 3), (2, 2, 2, 2))),
    _bin("conv grouped", functools.partial(_conv, groups=2), shapes=((1, 4, 4, 4), (4, 2, 2, 2))),
    # lax_autodiff_test: structural ops (transpose, reshape, slice, gather, scatter, pad, ...)
    _un("transpose", lambda x: jnp.transpose(x, (2, 0, 1)), shape=(2, 3, 2)),
    _un("broadcast_in_dim", _broadcast),
    _un("slice strided", lambda x: x[1:, ::2], shape=(3, 5)),
    _un("dynamic_slice", lambda x: lax.dynamic_slice(x, (1, 2), (2, 2)), shape=(3, 5)),
    _bin("dynamic_update_slice", lambda x, u: lax.dynamic_update_slice(x, u, (1, 1)),
         shapes=((3, 4), (2, 2))),
    _un("gather", _gather, shape=(3, 3)),
    _bin("scatter_add", _scatter_add, shapes=((4,), (3,))),
    _bin("scatter set", _scatter_set, shapes=((5,), (2,))),
    _un("pad interior/negative", lambda x: lax.pad(x, jnp.asarray(0.5, x.dtype),
                                                    ((1, -1, 1), (0, 2, 0))),
        shape=(3, 2)),
    _bin("concatenate", lambda a, b: jnp.concatenate([a, b], axis=0), shapes=((2, 3), (1, 3))),
    _un("jnp.roll", lambda x: jnp.roll(x, 2, axis=1), shape=(2, 4), source="lax_numpy"),
    _un("jnp.trace", jnp.trace, shape=(3, 3), source="lax_numpy"),
    # control flow (lax_control_flow_test grad checks)
    _un("scan", _scan_cumulative, shape=(4, 2), source="control_flow"),
    _un("fori_loop", _fori, shape=(3,), source="control_flow"),
    _bin("cond", _cond, source="control_flow"),
    # linalg_test grad checks (well-conditioned inputs)
    _un("det", lambda a: jnp.linalg.det(_well_conditioned(a)), shape=(3, 3), source="linalg"),
    _un("slogdet", lambda a: jnp.linalg.slogdet(_spd(a))[1], shape=(3, 3), source="linalg"),
    _un("inv", lambda a: jnp.linalg.inv(_well_conditioned(a)), shape=(3, 3), source="linalg"),
    _bin("solve", lambda a, b: jnp.linalg.solve(_well_conditioned(a), b),
         shapes=((3, 3), (3, 2)), source="linalg"),
    _un("cholesky", lambda a: jnp.linalg.cholesky(_spd(a)), shape=(3, 3), source="linalg"),
    _un("eigh values", _eigh_values, shape=(3, 3), source="linalg", order=1),
    _un("qr |R|", _qr_r, shape=(4, 3), source="linalg", order=1),
    _un("svd values", _svd_values, shape=(3, 4), source="linalg", order=1),
    _un("expm", lambda a: jsp.linalg.expm(a / 3.0), shape=(3, 3), source="linalg", order=1),
    _bin("triangular solve", lambda a, b: jsp.linalg.solve_triangular(
        jnp.tril(a) + 4.0 * jnp.eye(3, dtype=a.dtype), b, lower=True),
        shapes=((3, 3), (3, 2)), source="linalg"),
)

BY_NAME = {op.name: op for op in OPS}
assert len(BY_NAME) == len(OPS), "op names must be unique"


# --- scalar objective and planted bugs ----------------------------------------------------

def weights(op: Op, dtype) -> np.ndarray:
    """The fixed cotangent w (seeded N(0, 1), in `dtype`) that reduces the op's output to the
    scalar sum(w * op(x)): the checked gradient is then the vjp of w, whatever cotangent a
    checker would draw for a non-scalar output."""
    xs = [jax.ShapeDtypeStruct(s, jnp.float64) for s in op.shapes]
    with jax.enable_x64(True):
        shape = jax.eval_shape(op.fn, *xs).shape
    return np.random.default_rng([1, *op.name.encode()]).standard_normal(shape).astype(dtype)


def objective(op: Op, dtype) -> Callable:
    """``phi(*xs) = sum(w * op(*xs))`` computed in `dtype` (inputs cast to it first): a
    float32 objective rounds like float32 whatever dtype a checker feeds it."""
    w = weights(op, dtype)

    def phi(*xs):
        xs = [jnp.asarray(x).astype(dtype) for x in xs]
        return jnp.sum(jnp.asarray(w) * op.fn(*xs))
    return phi


def planted(op: Op, dtype) -> Callable:
    """``phi(*xs, scales)``: as `objective`, through a ``custom_vjp`` whose backward pass is
    JAX's vjp of the op with input i's cotangent multiplied elementwise by ``scales[i]``.
    All-ones scales give JAX's gradient exactly; `scales` is an ordinary (non-differentiated)
    argument, so a checker compiles one function for every planted variant of an op."""
    w = weights(op, dtype)

    @jax.custom_vjp
    def f(xs, scales):
        return op.fn(*xs)

    def fwd(xs, scales):
        return op.fn(*xs), (xs, scales)

    def bwd(res, g):
        xs, scales = res
        cts = jax.vjp(op.fn, *xs)[1](g)
        return tuple(c * s for c, s in zip(cts, scales)), jax.tree.map(jnp.zeros_like, scales)

    f.defvjp(fwd, bwd)

    def phi(*args):
        *xs, scales = args
        xs = tuple(jnp.asarray(x).astype(dtype) for x in xs)
        scales = tuple(jnp.asarray(s).astype(dtype) for s in scales)
        return jnp.sum(jnp.asarray(w) * f(xs, scales))
    return phi


@dataclasses.dataclass(frozen=True)
class Plant:
    """Where a bug is planted: `arg` (input index) and `index` (element of it), the exact
    float64 gradient there (`grad`) and the objective's value (`value`)."""
    arg: int
    index: tuple[int, ...]
    grad: float
    value: float
    grad_norms: tuple[float, ...]  # L2 norm of each input's exact gradient

    def scales(self, op: Op, delta: float) -> tuple[np.ndarray, ...]:
        out = [np.ones(s) for s in op.shapes]
        out[self.arg][self.index] = 1.0 + delta
        return tuple(out)

    def error(self, delta: float) -> float:
        """The absolute error planted in the gradient: delta * |exact gradient|."""
        return abs(delta * self.grad)


def plant_site(op: Op, xs: tuple[np.ndarray, ...]) -> Plant | None:
    """The input element with the largest |gradient| of the float64 objective at `xs` (the
    dtype-rounded primal), or None when the gradient is zero everywhere."""
    with jax.enable_x64(True):
        phi = objective(op, np.float64)
        x64 = tuple(np.asarray(x, np.float64) for x in xs)
        value = float(phi(*x64))
        grads = [np.asarray(g) for g in jax.grad(phi, argnums=tuple(range(len(xs))))(*x64)]
    best = max(range(len(grads)), key=lambda i: np.max(np.abs(grads[i])))
    g = grads[best]
    flat = int(np.argmax(np.abs(g)))
    if g.flat[flat] == 0:
        return None
    index = tuple(int(i) for i in np.unravel_index(flat, g.shape))
    return Plant(best, index, float(g.flat[flat]), value,
                 tuple(float(np.linalg.norm(x)) for x in grads))
