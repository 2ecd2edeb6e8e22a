"""checkpointed_scan: lax.scan's values and gradients, a backward pass keeping fewer carries."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import funcgrad as fg
from funcgrad.memory.scan import _factors


def _rnn_loss(scan, steps, reverse=False):
    """A tanh recurrence with a pytree carry and pytree ys, weighted so every y matters."""
    def loss(params, init, xs):
        def step(carry, x):
            h = jnp.tanh(carry["h"] @ params["w"] + x["u"] * carry["s"][:, None])
            s = carry["s"] * 0.9 + jnp.mean(h, axis=1)
            return {"h": h, "s": s}, {"hsum": jnp.sum(h), "s": s}

        carry, ys = scan(step, init, xs, reverse=reverse)
        weights = jnp.arange(1, steps + 1, dtype=ys["hsum"].dtype)
        return (jnp.sum(carry["h"] ** 2) + jnp.sum(carry["s"]) + jnp.sum(weights * ys["hsum"])
                + jnp.sum(weights[:, None] * ys["s"]))
    return loss


def _inputs(steps, dtype):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w": 0.5 * jax.random.normal(k1, (4, 4), dtype)}
    init = {"h": jax.random.normal(k2, (2, 4), dtype), "s": jnp.ones((2,), dtype)}
    xs = {"u": jax.random.normal(k3, (steps, 2, 4), dtype)}
    return params, init, xs


def _checkpointed(levels):
    return lambda f, init, xs, reverse: fg.checkpointed_scan(f, init, xs, levels=levels,
                                                             reverse=reverse)


def _plain(f, init, xs, reverse):
    return lax.scan(f, init, xs, reverse=reverse)


def _rel_err(a, b):
    return max(float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y)))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# T = 16 = 4 * 4 (exact); 17 (prime: factors 5, 4; 4 full segments of 4, then 1 step);
# 31 (prime; levels=3: factors 4, 3, 3: 3 segments of 9, then 4 steps as 1 segment of 3 + 1).
@pytest.mark.parametrize("steps,levels,reverse", [
    (16, 2, False), (17, 2, True), (31, 3, False), (31, "log", True),
], ids=["T16-levels2", "T17-levels2-reverse", "T31-levels3", "T31-log-reverse"])
def test_grads_and_values_equal_lax_scan_float64(steps, levels, reverse):
    # The second method is lax.scan itself. Each step runs the same operations in the same
    # order; only the sums accumulating the weight's cotangent over steps are associated
    # differently (per segment, then over segments), so float64 agrees to ~1e-15: 1e-12.
    # The forward values (final carry, every y in the order of xs) are the same operations
    # in the same order: equal exactly.
    def both(params, init, xs):
        grads = [jax.value_and_grad(_rnn_loss(scan, steps, reverse), argnums=(0, 1, 2))(
            params, init, xs) for scan in (_plain, _checkpointed(levels))]
        values = [scan(lambda c, x: (c * 0.5 + x["u"][0], c.sum()), init["h"][0], xs, reverse)
                  for scan in (_plain, _checkpointed(levels))]
        return grads, values

    with jax.enable_x64(True):
        (ref, got), ((c_ref, y_ref), (c_got, y_got)) = jax.jit(both)(
            *_inputs(steps, jnp.float64))
        assert _rel_err(got, ref) < 1e-12
        assert y_got.shape == (steps,)
        np.testing.assert_array_equal(np.asarray(y_got), np.asarray(y_ref))
        np.testing.assert_array_equal(np.asarray(c_got), np.asarray(c_ref))


def test_grads_equal_lax_scan_float32_within_1e6():
    # The target on a float32 recurrence (T = 53, prime; factors 8, 7): the same
    # operations per step, the weight's cotangent summed over 53 steps in another association:
    # float32 rounding of ~53 terms, ~53 * 6e-8 ~ 3e-6 of the largest term at worst, far less
    # relative to the sum in practice; the bound is 1e-6 relative.
    def both(params, init, xs):
        return [jax.grad(_rnn_loss(scan, 53), argnums=(0, 1, 2))(params, init, xs)
                for scan in (_plain, _checkpointed(2))]

    ref, got = jax.jit(both)(*_inputs(53, jnp.float32))
    assert _rel_err(got, ref) < 1e-6


def test_length_without_xs_and_levels_1():
    # carry_{t+1} = carry_t * w + 1, carry_0 = 0, 5 steps: carry_5 = 1 + w + ... + w^4; at
    # w = 2 that is 31, and d/dw = 1 + 2w + 3w^2 + 4w^3 = 1 + 4 + 12 + 32 = 49.
    def final(w, levels):
        carry, ys = fg.checkpointed_scan(lambda c, _: (c * w + 1.0, c), jnp.float32(0.0),
                                         length=5, levels=levels)
        return carry, ys

    for levels in (1, 2, "log"):
        (carry, ys) = final(2.0, levels)
        grad = jax.grad(lambda w, levels=levels: final(w, levels)[0])(2.0)
        assert (float(carry), float(grad)) == (31.0, 49.0)
        np.testing.assert_array_equal(np.asarray(ys), [0.0, 1.0, 3.0, 7.0, 15.0])


@pytest.mark.parametrize("steps,levels,expected", [
    (10000, 2, (100, 100)),      # 100**2 = 10000 exactly
    (17, 2, (5, 4)),             # 5**2 = 25 >= 17, then ceil(17 / 5) = 4 <= 4**1
    (1000, 3, (10, 10, 10)),
    (10, 4, (2, 2, 2, 2)),       # 2**4 = 16 >= 10; ceil(10/2) = 5 <= 2**3, ...
    (3, 5, (2, 2)),              # more levels than 3 steps need: factors of 1 dropped
])
def test_segment_factors(steps, levels, expected):
    assert _factors(steps, levels) == expected
    assert math.prod(expected) >= steps


def _carries_kept(steps, levels, batch=8, width=32):
    """Compiled temp + output bytes of jit(grad(loss)) over the bytes of one carry (compile only,
    nothing runs). temp + output, not temp alone: XLA:CPU places temporaries inside the
    not-yet-live output buffers."""
    def loss(w, h0):
        step = lambda h, _: (jnp.tanh(h @ w), None)  # noqa: E731
        if levels == 1:
            h, _ = lax.scan(step, h0, None, length=steps)
        else:
            h, _ = fg.checkpointed_scan(step, h0, length=steps, levels=levels)
        return jnp.sum(h)
    args = (jax.ShapeDtypeStruct((width, width), jnp.float32),
            jax.ShapeDtypeStruct((batch, width), jnp.float32))
    m = jax.jit(jax.grad(loss)).lower(*args).compile().memory_analysis()
    return (m.temp_size_in_bytes + m.output_size_in_bytes) / (batch * width * 4)


def test_compiled_memory_grows_like_sqrt_and_log_not_like_t():
    # From T = 64 to T = 256 (192 more steps), plain lax.scan's backward pass keeps r carries'
    # worth of residuals per step (r = 3 for h -> tanh(h @ w): the input h, tanh's output and
    # 1 - tanh**2), so it grows by 192 * r carries; measured, not assumed:
    plain = _carries_kept(256, 1) - _carries_kept(64, 1)
    r = plain / 192
    assert r >= 1
    # levels=2: factors (8, 8) -> (16, 16). The outer scan keeps k_1 carries and one inner
    # segment's k_2 steps keep r carries each: growth (16 - 8) * (1 + r) carries; 25% margin
    # for XLA's loop bookkeeping.
    sqrt_growth = _carries_kept(256, 2) - _carries_kept(64, 2)
    assert sqrt_growth <= 1.25 * (16 - 8) * (1 + r)
    # levels="log": 6 -> 8 levels of segments of 2. Each level keeps its 2 stored carries plus
    # the loop state of its forward re-run and its backward loop (carry and cotangent, in and
    # out: 4 carries more, each possibly double-buffered): at most 2 + 8 = 10 carries a level.
    log_growth = _carries_kept(256, "log") - _carries_kept(64, "log")
    assert log_growth <= (8 - 6) * 10
    # Both far below the plain scan's growth (~576 carries here).
    assert max(sqrt_growth, log_growth) < plain / 10


def _step(c, x):
    return c + x, None


@pytest.mark.parametrize("levels,error,match", [
    (0, ValueError, "levels=0; expected an int >= 1"),
    (-2, ValueError, "levels=-2"),
    ("sqrt", TypeError, "levels='sqrt'; expected an int >= 1 or the string 'log'"),
    (2.0, TypeError, "levels=2.0 of type float"),
    (True, TypeError, "levels=True of type bool"),
], ids=["zero", "negative", "unknown-string", "float", "bool"])
def test_bad_levels(levels, error, match):
    with pytest.raises(error, match=match):
        fg.checkpointed_scan(_step, jnp.zeros(2), jnp.ones((8, 2)), levels=levels)


def test_bad_lengths():
    with pytest.raises(ValueError, match="neither xs nor length given.*Pass length=T"):
        fg.checkpointed_scan(_step, jnp.zeros(2))
    with pytest.raises(ValueError, match=r"length=5, but the leaves of xs have a leading axis "
                                         r"of 8\. Drop length, or pass length=8"):
        fg.checkpointed_scan(_step, jnp.zeros(2), jnp.ones((8, 2)), length=5)
    with pytest.raises(ValueError, match=r"disagree on the number of steps.*xs\['a'\] has 8, "
                                         r"xs\['b'\] has 7"):
        fg.checkpointed_scan(lambda c, x: (c + x["a"] + x["b"], None), jnp.zeros(2),
                             {"a": jnp.ones((8, 2)), "b": jnp.ones((7, 2))})
    with pytest.raises(ValueError, match=r"length=2.5; expected a Python int >= 0"):
        fg.checkpointed_scan(_step, jnp.zeros(2), length=2.5)


def test_bad_carry_from_f():
    init = {"h": jnp.zeros((2, 3)), "n": jnp.zeros((), jnp.int32)}
    xs = jnp.ones((8, 2, 3))
    with pytest.raises(ValueError, match=r"carry\['h'\] of shape \(3,\), but init's is "
                                         r"\(2, 3\)"):
        fg.checkpointed_scan(lambda c, x: ({"h": c["h"][0] + x[0], "n": c["n"]}, None),
                             init, xs)
    with pytest.raises(TypeError, match=r"carry\['n'\] of dtype float32, but init's is int32.*"
                                        r"astype\(int32\)"):
        fg.checkpointed_scan(lambda c, x: ({"h": c["h"] + x, "n": c["n"] + 0.5}, None),
                             init, xs)
    with pytest.raises(TypeError, match="carry of structure .* but init has structure"):
        fg.checkpointed_scan(lambda c, x: (c["h"] + x, None), init, xs)
    with pytest.raises(TypeError, match=r"expected a pair \(new_carry, y\)"):
        fg.checkpointed_scan(lambda c, x: c, init, xs)
