"""Every planted-fault model file holds the fault its EXPECT names, shown by a second method that
does not use funcgrad.doctor (so the suite is not just labels), and every healthy one trains and
has correct gradients.

For each fault class the check is the most direct evidence of the fault: a detached or unused
leaf's ``jax.grad`` is exactly zero (and the loss does / does not depend on the leaf); a wrong
or dropped custom_vjp fails ``jax.test_util.check_grads`` in float64; NaN or out-of-range
values are in the data; a learning rate diverges where Adam 1e-3 learns; an accumulated
coupled loss's micro-batch mean gradient differs from the full-batch gradient; a frozen leaf's
update does not depend on its gradient yet is not zero; and so on. A healthy model's loss
falls under a few optax steps and its gradients pass ``check_grads`` in float64.
"""
import math
import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.test_util import check_grads

from ._modelfile import load, model_files, module_of, train

CHECKS = {"data", "init_loss", "grad_flow", "fd_audit", "nonfinite", "grad_stats", "training",
          "overfit", "baseline", "semantics", "memory"}
FILES = model_files()


@pytest.fixture(autouse=True)
def _no_implicit_rank_promotion():
    """Overrides tests/conftest.py's fixture of that name: the model files are user code written
    with JAX's default settings (``x @ w + b`` promotes the bias's rank)."""
    with jax.numpy_rank_promotion("allow"):
        yield


def _marks(path: pathlib.Path):
    return [pytest.mark.float16] if "float16" in path.read_text() else []


def _params(files):
    return [pytest.param(p, id=p.stem, marks=_marks(p)) for p in files]


def load_expect(path):
    return module_of(path).EXPECT


FAULTY = [p for p in FILES if not p.stem.startswith("healthy_")]
HEALTHY = [p for p in FILES if p.stem.startswith("healthy_")]


# --- the suite's shape -------------------------------------------------------------------------

def test_the_suite_is_big_enough():
    expects = {p.name: load_expect(p) for p in FILES}
    faulty = {n: e for n, e in expects.items() if e is not None}
    classes = {e["fault"] for e in faulty.values()}
    assert len(faulty) >= 40 and len(classes) >= 12
    assert all(sum(e["fault"] == c for e in faulty.values()) >= 2 for c in classes)
    healthy = [n for n, e in expects.items() if e is None]
    assert len(healthy) >= 12
    assert set(healthy) == {p.name for p in HEALTHY}   # the file name says which it is


@pytest.mark.parametrize("path", _params(FAULTY))
def test_expect_is_well_formed(path):
    e = load_expect(path)
    assert set(e) == {"fault", "checks", "place"}
    assert isinstance(e["fault"], str) and e["fault"]
    assert isinstance(e["checks"], set) and e["checks"] and e["checks"] <= CHECKS
    assert e["place"] is None or (isinstance(e["place"], str) and e["place"])
    line = _place_line(path, e["place"])
    if line is not None:   # 'file.py:LINE' names this file and a line of code
        assert line.strip() and not line.lstrip().startswith("#")


def _place_line(path, place):
    match = re.fullmatch(r"(.+\.py):(\d+)", place or "")
    if not match:
        return None
    assert match[1] == path.name
    return path.read_text().splitlines()[int(match[2]) - 1]


# --- helpers -----------------------------------------------------------------------------------

def _paths(tree):
    return [(jax.tree_util.keystr(k), v) for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _at(tree, place):
    found = [(k, v) for k, v in _paths(tree) if place in k]
    assert found, f"no leaf path contains {place!r}: {[k for k, _ in _paths(tree)]}"
    return found


def _grads(m, batch):
    return jax.jit(jax.grad(m.bound()))(m.params, batch)


def _perturbed(params, place, scale=0.5, seed=0):
    rng = np.random.default_rng(seed)

    def change(path, leaf):
        if place in jax.tree_util.keystr(path):
            return leaf + scale * (1.0 + np.abs(np.asarray(leaf))) * rng.standard_normal(leaf.shape)
        return leaf
    return jax.tree_util.tree_map_with_path(change, params)


def _f64(tree):
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float64)
                        if jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating) else a, tree)


def _grads_correct_in_float64(m, batch) -> bool:
    """jax.test_util.check_grads of the bound loss in float64 (reverse mode, order 1)."""
    with jax.enable_x64(True):
        f = m.bound()
        batch64 = _f64(batch)
        try:
            check_grads(jax.jit(lambda p: f(p, batch64)), (_f64(m.params),), order=1, modes=["rev"],
                        eps=1e-8)   # small: a ReLU kink within eps of the point is rare
        except AssertionError:
            return False
    return True


def _global_norm(tree):
    return float(optax.tree.norm(tree))


# --- each fault class, by a second method ------------------------------------------------------

def _zero_grad_leaf(m, place, batch):
    g = _grads(m, batch)
    for key, leaf in _at(g, place):
        assert np.all(np.asarray(leaf) == 0), f"{key}: gradient not exactly zero"
    others = [v for k, v in _paths(g) if place not in k]
    assert any(np.any(np.asarray(v) != 0) for v in others), "no other leaf gets a gradient"


def _loss_depends_on(m, place, batch):
    f = jax.jit(m.bound())
    return float(f(m.params, batch)) != float(f(_perturbed(m.params, place), batch))


def verify_detached_weight(m, e, batch):
    _zero_grad_leaf(m, e["place"], batch)
    assert _loss_depends_on(m, e["place"], batch)           # used, but cut from the gradient


def verify_unused_param(m, e, batch):
    _zero_grad_leaf(m, e["place"], batch)
    assert not _loss_depends_on(m, e["place"], batch)       # the loss never reads it


def verify_int_cast(m, e, batch):
    _zero_grad_leaf(m, e["place"], batch)
    assert _loss_depends_on(m, e["place"], batch)
    jaxpr = str(jax.make_jaxpr(m.bound())(m.params, batch))
    assert re.search(r"convert_element_type\[[^\]]*new_dtype=int", jaxpr)


def verify_dead_relu(m, e, batch):
    (key, w), *_ = [(k, v) for k, v in _at(_grads(m, batch), e["place"]) if np.ndim(v) == 2]
    dead_units = np.all(np.asarray(w) == 0, axis=0).mean()  # a dead unit's column of w is 0
    assert dead_units >= 0.85, f"{key}: {dead_units:.0%} of units dead"


def verify_exploding_init(m, e, batch):
    value = float(jax.jit(m.bound())(m.params, batch))
    norm = _global_norm(_grads(m, batch))
    assert value > 5 * math.log(10) or norm > 1e3, (value, norm)


def verify_vanishing_sigmoid(m, e, batch):
    g = _grads(m, batch)
    first = math.sqrt(sum(float(jnp.sum(v ** 2)) for _, v in _at(g, e["place"])))
    total = _global_norm(g)
    assert 0 < first < 1e-4 * total, (first, total)


def verify_wrong_custom_vjp(m, e, batch):
    assert not _grads_correct_in_float64(m, jax.tree.map(lambda a: a[:8], batch))
    assert e["place"] in m.path.read_text()                 # the custom_vjp function's name


def verify_dropped_cotangent(m, e, batch):
    _zero_grad_leaf(m, e["place"], batch)
    assert _loss_depends_on(m, e["place"], batch)
    assert not _grads_correct_in_float64(m, jax.tree.map(lambda a: a[:8], batch))
    assert "custom_vjp" in m.path.read_text()


def verify_nan_data(m, e, batch):
    values = np.asarray(m.all_data()[e["place"]], np.float64)
    assert not np.all(np.isfinite(values))
    others = {k: v for k, v in m.all_data().items() if k != e["place"]}
    assert all(np.all(np.isfinite(np.asarray(v, np.float64))) for v in others.values())


def verify_log_softmax_underflow(m, e, batch):
    value = jax.jit(m.bound())(m.params, batch)
    grads = _grads(m, batch)
    finite = np.isfinite(float(value)) and all(np.all(np.isfinite(v)) for v in
                                               jax.tree.leaves(grads))
    assert not finite
    assert "jnp.log(" in _place_line(m.path, e["place"])


def verify_where_nan(m, e, batch):
    assert np.isfinite(float(jax.jit(m.bound())(m.params, batch)))   # the forward value is fine...
    grads = jax.tree.leaves(_grads(m, batch))
    assert any(np.any(np.isnan(v)) for v in grads)          # ...its gradient is not
    assert "jnp.where(" in _place_line(m.path, e["place"])


def verify_lr_too_high(m, e, batch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        losses, _ = train(m, 40)
        good, _ = train(m, 40, optimizer=optax.adam(1e-3))
    tail = np.mean(losses[-10:])
    assert not np.isfinite(tail) or tail > 0.9 * losses[0], (losses[0], tail)
    assert np.mean(good[-10:]) < 0.8 * good[0], (good[0], good[-10:])


def verify_bad_labels(m, e, batch):
    labels = np.asarray(m.all_data()[e["place"]])
    assert m.classes
    assert labels.min() < 0 or labels.max() >= m.classes


def verify_batch_coupled_accum(m, e, batch):
    k = m.step.accumulate
    f = jax.jit(jax.grad(m.bound()))
    full = f(m.params, batch)
    micro = [jax.tree.map(lambda a, i=i: a[i::k], batch) for i in range(k)]
    parts = [f(m.params, mb) for mb in micro]
    accumulated = jax.tree.map(lambda *g: sum(g) / k, *parts)
    diff = _global_norm(jax.tree.map(jnp.subtract, full, accumulated))
    assert diff > 1e-3 * _global_norm(full), diff


def verify_sum_not_mean(m, e, batch):
    value = float(jax.jit(m.bound())(m.params, batch))
    assert value > 3 * math.log(m.classes), value            # a mean would be near log(K)


def verify_clip_before_unscale(m, e, batch):
    module = m.module
    scale = getattr(module, "SCALE", None) or module.LOSS_SCALE
    norm = _global_norm(_grads(m, batch))
    clip = 1.0  # the fg.clip_by_global_norm(1.0) of the step's chain, or of the optimizer's
    assert norm > 100 * clip and norm / scale < 10 * clip, (norm, scale)   # always clipped


def verify_frozen_updated(m, e, batch):
    tx = m.optimizer
    state = tx.init(m.params)
    g = _grads(m, batch)
    other = jax.tree.map(lambda a: a * 3.0 + 1.0, g)
    u1, _ = tx.update(g, state, m.params)
    u2, _ = tx.update(other, state, m.params)
    moved = False
    for (key, a), (_, b) in zip(_at(u1, e["place"]), _at(u2, e["place"])):
        np.testing.assert_array_equal(a, b, err_msg=f"{key}: its update uses its gradient")
        moved |= bool(np.any(np.asarray(a) != 0))   # zero biases do not decay; weights do
    assert moved, f"{e['place']}: no update (frozen indeed)"


def _state_after_calls(m, batch, calls=3):
    """The model state after `calls` calls of the loss, each given the state the last returned."""
    state = m.model_state
    for i in range(calls):
        key = jax.random.key(i) if m.loss.takes_key else None
        state = m.loss(m.params, batch, model_state=state, key=key).model_state
    return state


def verify_bn_stats_frozen(m, e, batch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        after = _state_after_calls(m, batch)
    for (key, a), (_, b) in zip(_at(m.model_state, e["place"]), _at(after, e["place"])):
        np.testing.assert_array_equal(a, b, err_msg=f"{key} moved")


def verify_constant_input(m, e, batch):
    x = np.asarray(m.all_data()[e["place"]])
    assert np.all(x == x[:1])                                # every example the same
    y = np.asarray(m.all_data()["y"])
    assert len(np.unique(y)) > 1                             # while the labels vary


VERIFY = {name[len("verify_"):]: f for name, f in globals().items() if name.startswith("verify_")}


@pytest.mark.parametrize("path", _params(FAULTY))
def test_the_fault_is_there(path):
    m = load(path)
    e = m.expect
    assert e["fault"] in VERIFY, f"no second method for {e['fault']!r}"
    batch = m.batch(64)
    VERIFY[e["fault"]](m, e, batch)


# --- healthy models ----------------------------------------------------------------------------

@pytest.mark.parametrize("path", _params(HEALTHY))
def test_healthy_model_trains_and_has_correct_gradients(path):
    m = load(path)
    assert m.expect is None
    data = m.all_data()
    for leaf in jax.tree.leaves(data):
        assert np.all(np.isfinite(np.asarray(leaf, np.float64)))
    if m.classes:
        labels = np.asarray(data["y"])
        assert labels.min() >= 0 and labels.max() < m.classes
    losses, state = train(m, 40, batch_size=32)
    assert np.mean(losses[-5:]) < 0.9 * losses[0], (losses[0], losses[-5:])
    assert _grads_correct_in_float64(m, m.batch(8))
    if m.model_state is not None and any(
            jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating)
            for a in jax.tree.leaves(m.model_state)):
        moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(m.model_state),
                                                          jax.tree.leaves(state.model_state))]
        assert any(moved)                                   # its running statistics do move
