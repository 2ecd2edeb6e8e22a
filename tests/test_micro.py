"""funcgrad.micro: hand-derived gradients, jax.grad on random programs, PyTorch's semantics
(accumulation, retain_grad, no_grad, detach, retain_graph) and the errors that teach."""
import math

import _micro_programs as programs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from funcgrad import micro
from funcgrad.micro import Tensor
from funcgrad.micro._engine import _node


def _linear_loss(w, b, x=2.0, target=10.0):
    return (w * x + b - target) ** 2


def test_linear_squared_error_by_hand():
    # y = w*x + b = 1*2 + 0 = 2;  loss = (y - 10)**2 = (-8)**2 = 64
    # dL/dw = 2*(y - 10)*x = 2*(-8)*2 = -32;  dL/db = 2*(y - 10) = -16. Exact in float64.
    w, b = Tensor(1.0, requires_grad=True), Tensor(0.0, requires_grad=True)
    loss = _linear_loss(w, b)
    loss.backward()
    assert (loss.item(), float(w.grad), float(b.grad)) == (64.0, -32.0, -16.0)


def test_second_hand_example_differentiates_the_input_too():
    # y = x*w + b = 2*3 + 1 = 7;  loss = (y - 4)**2 = 9;  dL/dy = 2*(7 - 4) = 6
    # dL/dx = 6*w = 18;  dL/dw = 6*x = 12;  dL/db = 6. Exact in float64.
    x, w, b = (Tensor(v, requires_grad=True) for v in (2.0, 3.0, 1.0))
    loss = (x * w + b - 4.0) ** 2
    loss.backward()
    assert (loss.item(), float(x.grad), float(w.grad), float(b.grad)) == (9.0, 18.0, 12.0, 6.0)


def test_three_sgd_steps_with_zero_grad():
    # lr = 0.01: the residual r = w*x + b - 10 obeys r <- r - lr*(2*r*x*x + 2*r) = 0.9*r, so
    # r = -8, -7.2, -6.48, -5.832: w += 0.01*4*|r|, b += 0.01*2*|r| each step.
    hand = [(1.32, 0.16, 51.84), (1.608, 0.304, 41.9904), (1.8672, 0.4336, 34.012224)]
    w, b = Tensor(1.0, requires_grad=True), Tensor(0.0, requires_grad=True)
    for w_ref, b_ref, loss_ref in hand:
        w.zero_grad(), b.zero_grad()
        _linear_loss(w, b).backward()
        with micro.no_grad():
            w.add_(w.grad, alpha=-0.01)
            b.add_(b.grad, alpha=-0.01)
        # float64 rounding of a few operations on values below 60: 1e-12 is ~100 ulps.
        assert w.item() == pytest.approx(w_ref, abs=1e-12)
        assert b.item() == pytest.approx(b_ref, abs=1e-12)
        assert _linear_loss(w, b).item() == pytest.approx(loss_ref, abs=1e-11)


def test_grad_accumulates_across_backward_calls():
    # Two backward passes add: dL/dw = -32 twice is -64 (PyTorch's behaviour, why zero_grad
    # exists); a second forward pass adds again; zero_grad starts over.
    w, b = Tensor(1.0, requires_grad=True), Tensor(0.0, requires_grad=True)
    loss = _linear_loss(w, b)
    loss.backward(retain_graph=True)
    loss.backward()
    assert (float(w.grad), float(b.grad)) == (-64.0, -32.0)
    _linear_loss(w, b).backward()
    assert float(w.grad) == -96.0
    w.zero_grad()
    _linear_loss(w, b).backward()
    assert float(w.grad) == -32.0


def test_only_leaves_keep_grad_unless_retain_grad():
    # y = w*x + b = 2; dL/dy = 2*(y - 10) = -16 is kept only on the y that asked for it.
    w, b = Tensor(1.0, requires_grad=True), Tensor(0.0, requires_grad=True)
    y = w * 2.0 + b
    ((y - 10.0) ** 2).backward()
    assert y.grad is None and not y.is_leaf and w.is_leaf
    y2 = (w * 2.0 + b).retain_grad()
    ((y2 - 10.0) ** 2).backward()
    assert float(y2.grad) == -16.0


def test_no_grad_records_nothing_and_detach_cuts_the_graph():
    w = Tensor(1.0, requires_grad=True)
    with micro.no_grad():
        y = w * 3.0
    assert not y.requires_grad and y.parents == ()
    with pytest.raises(RuntimeError, match="does not require grad"):
        y.backward()
    # L = detach(w*2) * w: the detached factor is a constant 2, so dL/dw = 2 (not 4 = 2*2*w).
    loss = (w * 2.0).detach() * w
    loss.backward()
    assert float(w.grad) == 2.0
    d = w.detach()
    assert d.data is w.data and d.is_leaf and not d.requires_grad


def test_fan_out_sums_cotangents_whatever_the_order_of_parents():
    # r = b + a with a = 2*b: dr/db = 1 + 2 = 3. The parent `b` is listed before `a`, which
    # itself depends on `b`: a topological order that marks nodes when pushed (not when
    # expanded) processes b before a and loses a's cotangent (it returned 1).
    b = Tensor(2.0, requires_grad=True)
    a = b * 2.0
    (b + a).backward()
    assert float(b.grad) == 3.0


def test_broadcast_operands_are_reduced_back():
    # (a * b).sum() with a (3, 1), b (4,): d/da[i] = sum_j b[j] (shape (3, 1)),
    # d/db[j] = sum_i a[i] (shape (4,)). Exact: small integers.
    a = Tensor([[1.0], [2.0], [3.0]], requires_grad=True)
    b = Tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    (a * b).sum().backward()
    assert a.grad.shape == (3, 1) and a.grad.ravel().tolist() == [10.0] * 3
    assert b.grad.shape == (4,) and b.grad.tolist() == [6.0] * 4


def test_indexing_scatter_adds_and_max_splits_ties():
    # x[[0, 0, 2]].sum() reads x[0] twice: gradient [2, 0, 1].
    x = Tensor([5.0, 6.0, 7.0], requires_grad=True)
    x[np.array([0, 0, 2])].sum().backward()
    assert x.grad.tolist() == [2.0, 0.0, 1.0]
    # max([1, 3, 3]) ties: the cotangent is shared equally, [0, 0.5, 0.5] (as jax.grad).
    y = Tensor([1.0, 3.0, 3.0], requires_grad=True)
    y.max().backward()
    assert y.grad.tolist() == [0.0, 0.5, 0.5]


def test_sigmoid_and_log_softmax_stay_accurate_far_out():
    # sigmoid(-30) = e^-30 / (1 + e^-30), to float64 rounding; sigmoid(-800) underflows to
    # 0 without an overflow warning (warnings are errors here).
    x = Tensor([-30.0, -800.0, 800.0], requires_grad=True)
    s = micro.sigmoid(x)
    assert s.data[0] == pytest.approx(math.exp(-30) / (1 + math.exp(-30)), rel=1e-15)
    assert s.data[1:].tolist() == [0.0, 1.0]
    # log_softmax([1000, 0]) = [-log(1 + e^-1000), -1000 - log(1 + e^-1000)] = [0, -1000].
    assert micro.log_softmax(Tensor([1000.0, 0.0])).data.tolist() == [0.0, -1000.0]


def test_a_100000_deep_chain_has_no_recursion_error():
    # z_N = a**N * z_0 with a = 1 + 1e-5: dz_N/dz_0 = a**N = exp(N log a). Each of the 1e5
    # multiplications rounds once (2**-53 relative): the product is within ~1e-11.
    z0 = Tensor(1.0, requires_grad=True)
    z, a = z0, 1.0 + 1e-5
    for _ in range(100_000):
        z = z * a
    z.backward()
    assert float(z0.grad) == pytest.approx(math.exp(100_000 * math.log(a)), rel=1e-9)


def test_check_grad_passes_on_micro_and_catches_a_wrong_rule():
    rng = np.random.default_rng(0)
    x = Tensor(rng.normal(size=(3, 4)), requires_grad=True, name="x")
    v = Tensor(rng.normal(size=4), requires_grad=True, name="v")

    def fn(x, v):
        return micro.softmax_cross_entropy(x * v + x.max(axis=0), np.array([0, 3, 1])) \
            + micro.tanh(x @ v).sum() + x[np.array([0, 0, 2])].sigmoid().mean()
    assert micro.check_grad(fn, x, v) <= 1.0

    def wrong_sin(t):  # d sin = cos, this rule says sin
        return _node(np.sin(t.data), (t,), "sin", lambda g: (g * np.sin(t.data),))
    with pytest.raises(ValueError, match=r"check_grad: input 0 \(x\) at index \(0, 0\)"):
        micro.check_grad(lambda x: wrong_sin(x).sum(), x)


def test_to_dot_draws_leaves_ops_and_fan_out():
    w = Tensor(1.0, requires_grad=True, name="w")
    h = w * 2.0
    loss = h * h  # h fans out to both operands of mul
    dot = micro.to_dot(loss)
    assert dot.startswith("digraph")
    assert 'n0 [label="w\nf64[]"' in dot and 'fillcolor="#dbeafe"' in dot  # the leaf, blue
    assert "fan-out ×2" in dot and dot.count("->") == 3  # w->h, h->loss twice
    assert dot.count("n1 -> n2") == 2


# Errors that teach.

def test_shapes_that_do_not_broadcast_name_both():
    with pytest.raises(ValueError, match=r"add: shapes \(3,\) and \(4,\) do not broadcast"):
        Tensor(np.ones(3), requires_grad=True) + Tensor(np.ones(4))
    with pytest.raises(ValueError, match=r"matmul: shapes \(2, 3\) and \(2, 3\)"):
        Tensor(np.ones((2, 3))) @ Tensor(np.ones((2, 3)))


def test_backward_on_a_non_scalar_needs_a_cotangent():
    x = Tensor([1.0, 2.0], requires_grad=True)
    y = x * 3.0
    with pytest.raises(ValueError, match=r"shape \(2,\), not a scalar.*cotangent"):
        y.backward()
    with pytest.raises(ValueError, match=r"cotangent has shape \(3,\)"):
        y.backward(np.ones(3))
    y.backward(np.array([1.0, 10.0]))  # the vjp with cotangent [1, 10]: 3 * [1, 10]
    assert x.grad.tolist() == [3.0, 30.0]


def test_backward_twice_through_freed_residuals_explains_retain_graph():
    x = Tensor(2.0, requires_grad=True)
    loss = micro.exp(x) * x
    loss.backward()
    with pytest.raises(RuntimeError, match="retain_graph=True.*micro does the same"):
        loss.backward()
    kept = micro.exp(x) * x
    kept.backward(retain_graph=True)
    kept.backward()  # d/dx (x e^x) = (1 + x) e^x, twice (accumulated) plus the first call's
    assert float(x.grad) == pytest.approx(3 * 3.0 * math.exp(2.0), rel=1e-15)


def test_an_in_place_change_of_a_residual_is_detected():
    x = Tensor([1.0, 2.0], requires_grad=True)
    with pytest.raises(RuntimeError, match="requires grad.*no_grad"):
        x.add_(1.0)
    y = (x * x).sum()  # mul saves x for its rule (d/dx = 2x)
    with micro.no_grad():
        x.add_(1.0)
    with pytest.raises(RuntimeError, match=r"changed in place \(version 1, saved at version 0\)"):
        y.backward()
    # add's rule needs no residual, so changing its input in place is harmless (as PyTorch).
    z = (x + 1.0).sum()
    with micro.no_grad():
        x.add_(1.0)
    z.backward()
    assert x.grad.tolist() == [1.0, 1.0]
    # exp saves its output: changing the output in place is caught too.
    e = micro.exp(Tensor(0.0, requires_grad=True))
    loss = e + 1.0  # add saves nothing, so only exp's saved output can be stale
    with micro.no_grad():
        e.add_(1.0)
    with pytest.raises(RuntimeError, match="node 'exp'"):
        loss.backward()


def test_softmax_cross_entropy_rejects_bad_labels():
    with pytest.raises(ValueError, match="integer labels"):
        micro.softmax_cross_entropy(Tensor(np.zeros((2, 3))), np.array([0.0, 1.0]))


# jax.grad on random programs over every op and broadcast shape (hypothesis). The suite runs
# 150 (about 10 s); benchmarks/micro.py runs 1,000 with the same generator.

@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(programs.programs())
def test_equal_to_jax_grad_on_random_programs(program):
    shapes, steps, seed = program
    xs = programs.inputs(shapes, seed)
    loss_ref, grads_ref = programs.jax_grads(steps, xs)
    if not (np.isfinite(loss_ref) and all(np.isfinite(g).all() for g in grads_ref)):
        return  # rare overflow (exp of a cubed value); micro's float64 overflows the same way
    with np.errstate(over="ignore"):
        loss, grads = programs.micro_grads(steps, xs)
    # Both are float64 and apply the same rules in possibly different summation orders:
    # rounding differences of a few ulps, amplified little over <= 6 steps. 1e-12 relative
    # (to a floor where a gradient cancels to rounding noise: see relative_errors).
    assert abs(loss - loss_ref) <= 1e-12 * max(abs(loss_ref), 1e-3)
    assert [g.shape for g in grads] == [r.shape for r in grads_ref]
    assert max(programs.relative_errors(grads, grads_ref)) <= 1e-12, (steps, shapes)


def test_an_in_place_change_through_a_view_or_detach_is_detected():
    # reshape and detach share the array (as in PyTorch), so they share the version counter:
    # changing the view changes the value mul saved, and backward must refuse.
    x = Tensor([1.0, 2.0], requires_grad=True)
    y = (x * x).sum()
    with micro.no_grad():
        x.reshape((2, 1)).add_(1.0)
    with pytest.raises(RuntimeError, match="changed in place"):
        y.backward()
    x2 = Tensor([1.0, 2.0], requires_grad=True)
    y2 = (x2 * x2).sum()
    x2.detach().add_(1.0)
    with pytest.raises(RuntimeError, match="changed in place"):
        y2.backward()
