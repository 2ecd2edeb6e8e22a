"""Optimizer steps through funcgrad's train step equal the update formulas evaluated by hand
(article A §3.2, B §4.2; concept 10). Run in float64 (scoped) so 1e-12 tolerances are honest:
the hand values are exact decimals, and float64 rounding over a few operations is ~1e-16."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funcgrad as fg

TOL = 1e-12


def linear_loss(params, batch):
    return (params["w"] * batch["x"] + params["b"] - batch["y"]) ** 2


def test_three_sgd_steps_match_hand_iteration():
    # Problem: w=1, b=0, x=2, target 10, lr=0.01, L=(w*x+b-10)**2; residual r = w*x+b-10.
    # Step 1: r=-8,   L=64,      gw=2*r*x=-32,   gb=2*r=-16   -> w=1+0.32=1.32,    b=0.16
    # Step 2: r=-7.2, L=51.84,   gw=-28.8,       gb=-14.4     -> w=1.32+0.288=1.608, b=0.304
    # Step 3: r=-6.48,L=41.9904, gw=-25.92,      gb=-12.96    -> w=1.8672,          b=0.4336
    # Check: each step maps r -> r - lr*(gw*x + gb) = r*(1 - 0.01*2*(4+1)) = 0.9*r, so the loss
    # after step k is 64*0.81**k: 51.84, 41.9904, 34.012224.
    expected = [  # (loss computed in the step, w after, b after, loss after)
        (64.0, 1.32, 0.16, 51.84),
        (51.84, 1.608, 0.304, 41.9904),
        (41.9904, 1.8672, 0.4336, 34.012224),
    ]
    with jax.enable_x64(True):
        tx = fg.make_optimizer("sgd", 0.01)
        step = fg.make_train_step(linear_loss, tx)
        state = step.init({"w": jnp.float64(1.0), "b": jnp.float64(0.0)})
        batch = {"x": jnp.float64(2.0), "y": jnp.float64(10.0)}
        for loss_before, w, b, loss_after in expected:
            state, metrics = step(state, batch)
            assert abs(float(metrics["loss"]) - loss_before) < TOL
            assert abs(float(state.params["w"]) - w) < TOL
            assert abs(float(state.params["b"]) - b) < TOL
            assert abs(float(linear_loss(state.params, batch)) - loss_after) < TOL
        assert int(state.step) == 3


def quadratic(params, batch):
    # L = p0**2 + p1**2 / 2  ->  g = (2*p0, p1)
    del batch
    p = params["p"]
    return p[0] ** 2 + 0.5 * p[1] ** 2


def _run(optimizer, steps):
    with jax.enable_x64(True):
        step = fg.make_train_step(quadratic, optimizer)
        state = step.init({"p": jnp.array([1.0, -2.0], jnp.float64)})
        out = []
        for _ in range(steps):
            state, _ = step(state, {})
            out.append(np.asarray(state.params["p"]))
        return out


def test_momentum_steps_match_formula():
    # v = beta*v + g; p -= lr*v with lr=0.1, beta=0.9, p=(1, -2), v=0.
    # Step 1: g=(2, -2);    v=(2, -2);                       p=(1-0.2, -2+0.2)   = (0.8, -1.8)
    # Step 2: g=(1.6, -1.8); v=0.9*(2,-2)+(1.6,-1.8)=(3.4,-3.6);
    #         p=(0.8-0.34, -1.8+0.36) = (0.46, -1.44)
    p1, p2 = _run(fg.make_optimizer("momentum", 0.1, momentum=0.9), 2)
    np.testing.assert_allclose(p1, [0.8, -1.8], rtol=0, atol=TOL)
    np.testing.assert_allclose(p2, [0.46, -1.44], rtol=0, atol=TOL)


def test_adam_steps_match_formula():
    # Adam (Kingma & Ba 2015, Alg. 1) with lr=0.1, b1=0.9, b2=0.999, eps=1e-8 (optax's defaults):
    # m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g**2;  m_hat = m/(1-b1**t);  v_hat = v/(1-b2**t)
    # p -= lr * m_hat / (sqrt(v_hat) + eps)
    # Step 1 (t=1): g=(2,-2); m=(0.2,-0.2); v=(0.004,0.004); m_hat=(2,-2); v_hat=(4,4)
    #   p = (1 - 0.1*2/(2+1e-8), -2 + 0.1*2/(2+1e-8)) ~= (0.9, -1.9)
    # Step 2 (t=2): g=(2*0.9, -1.9)=(1.8,-1.9); m=(0.18+0.18, -0.18-0.19)=(0.36,-0.37)
    #   v=(0.003996+0.00324, 0.003996+0.00361)=(0.007236, 0.007606)
    #   m_hat=m/0.19, v_hat=v/0.001999 (1-0.9**2=0.19, 1-0.999**2=0.001999)
    lr, eps = 0.1, 1e-8
    p1 = (1 - lr * 2 / (2 + eps), -2 + lr * 2 / (2 + eps))
    m = (0.36, -0.37)
    v = (0.007236, 0.007606)
    p2 = tuple(p1[i] - lr * (m[i] / 0.19) / (math.sqrt(v[i] / 0.001999) + eps) for i in range(2))
    got1, got2 = _run(fg.make_optimizer("adam", 0.1), 2)
    # Step 2's gradient uses p1 ~= 0.9 (off by ~5e-10 from the eps term), so p2's hand value
    # carries that ~1e-10 error; everything else is float64 rounding.
    np.testing.assert_allclose(got1, p1, rtol=0, atol=TOL)
    np.testing.assert_allclose(got2, p2, rtol=0, atol=1e-9)
    # decimals by hand
    assert got2[0] == pytest.approx(0.9 - 0.1 * 1.894736842 / 1.902580, abs=1e-6)
