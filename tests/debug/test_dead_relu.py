"""Dead ReLU units along the feature axis of the layer feeding the ReLU, and normalisation
clamps that are not ReLUs: `explain_grads` and `with_dead_relu` (the monitor's source).

Concept 15/16 (issue 11, point 3)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funcgrad as fg


def _eqx_conv_model(dead_channel=2):
    """equinox Conv2d(3 -> 8, 3x3), channel-first (C, H, W) per example, then jax.nn.relu.

    Inputs lie in [0, 1) and |w| <= 1/sqrt(27) (equinox's uniform init, fan-in 3*3*3), so a
    pre-activation is within bias +- 27/sqrt(27) = bias +- 5.2: a bias of -1000 kills the
    channel for every example and pixel."""
    eqx = pytest.importorskip("equinox")
    conv = eqx.nn.Conv2d(3, 8, 3, key=jax.random.key(0))
    conv = eqx.tree_at(lambda m: m.bias, conv, conv.bias.at[dead_channel].set(-1000.0))
    x = jax.random.uniform(jax.random.key(1), (4, 3, 6, 6))  # NCHW: 4 examples, 6x6 pixels

    def loss_fn(model, x):
        return jnp.mean(jax.nn.relu(jax.vmap(model)(x)) ** 2)
    return conv, x, loss_fn


def _alive_channels(pre: np.ndarray, axis: int) -> np.ndarray:
    """Second method: a channel is alive if any example at any pixel has pre-activation > 0."""
    return np.asarray([np.any(np.take(pre, c, axis=axis) > 0) for c in range(pre.shape[axis])])


def test_channel_first_conv_counts_channels_in_explain_grads():
    conv, x, loss_fn = _eqx_conv_model(dead_channel=2)
    pre = np.asarray(jax.vmap(conv)(x))  # (4, 8, 4, 4): channels on axis 1
    alive = _alive_channels(pre, axis=1)
    assert alive.tolist() == [c != 2 for c in range(8)]  # only channel 2 dead (derived above)
    report = fg.explain_grads(loss_fn, conv, x)
    (site,) = report.relus
    # Before: units were the last axis (4 image columns), "0/4 units dead".
    assert (site.units, site.dead, site.axis, site.note) == (8, 1, 1, "")
    assert "1/8 units dead" in str(report)


def test_channel_first_conv_counts_channels_in_with_dead_relu_and_monitor():
    conv, x, loss_fn = _eqx_conv_model(dead_channel=5)
    loss, dead = jax.jit(fg.with_dead_relu(loss_fn))(conv, x)
    np.testing.assert_allclose(loss, loss_fn(conv, x), rtol=1e-6)
    (mask,) = dead.dead
    assert mask.shape == (8,) and np.flatnonzero(np.asarray(mask)).tolist() == [5]
    assert dead.axes == (1,)
    np.testing.assert_allclose(dead.fraction, [1 / 8])
    # The monitor reads the same masks: one dead channel out of eight.
    eqx = pytest.importorskip("equinox")
    params = eqx.filter(conv, eqx.is_array)
    monitor = fg.GradMonitor(dead_threshold=0.1)
    grads = jax.grad(loss_fn)(conv, x)
    _, metrics = monitor.measure(monitor.init(eqx.filter(grads, eqx.is_array)),
                                 eqx.filter(grads, eqx.is_array), dead_relu=dead)
    np.testing.assert_allclose(metrics.dead_fraction, [1 / 8])
    assert params is not None


def test_flax_nhwc_conv_counts_channels_and_skips_layernorm_clamp():
    nn = pytest.importorskip("flax.linen")

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.LayerNorm()(nn.Conv(8, (3, 3), padding="VALID")(x))  # NHWC
            return jax.nn.relu(h)

    x = jax.random.uniform(jax.random.key(1), (4, 6, 6, 3))
    net = Net()
    variables = net.init(jax.random.key(0), x)
    # LayerNorm's bias set to -1000 on channel 3: after normalising each pixel to mean 0,
    # variance 1 over 8 channels, |normalised| <= sqrt(7) < 1000 (scale 1), so channel 3 is
    # dead for every example and pixel; others may be dead too (counted by NumPy below).
    ln_bias = variables["params"]["LayerNorm_0"]["bias"].at[3].set(-1000.0)
    variables = jax.tree_util.tree_map_with_path(
        lambda p, v: ln_bias if "LayerNorm_0" in jax.tree_util.keystr(p) and
        "bias" in jax.tree_util.keystr(p) else v, variables)

    def loss_fn(v, x):
        return jnp.mean(net.apply(v, x) ** 2)

    alive = _alive_channels(np.asarray(_flax_pre(variables, x)), axis=3)
    assert not alive[3]
    report = fg.explain_grads(loss_fn, variables, x)
    # Before: the LayerNorm's max(0, E[x^2] - E[x]^2) was listed as a second "ReLU".
    (site,) = report.relus
    assert (site.units, site.dead, site.axis) == (8, int((~alive).sum()), 3)
    _, dead = fg.with_dead_relu(loss_fn)(variables, x)
    assert len(dead.dead) == 1
    np.testing.assert_array_equal(dead.dead[0], ~alive)


def _flax_pre(variables, x):
    """The ReLU's input, by running the same layers without the activation."""
    nn = pytest.importorskip("flax.linen")

    class Pre(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.LayerNorm()(nn.Conv(8, (3, 3), padding="VALID")(x))
    return Pre().apply(variables, x)


def test_equinox_layernorm_and_batchnorm_clamps_are_not_relus():
    eqx = pytest.importorskip("equinox")
    key1, key2 = jax.random.split(jax.random.key(0))
    linear = eqx.nn.Linear(5, 6, key=key1)
    norm = eqx.nn.LayerNorm(6)
    bn, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(6, axis_name="batch", mode="batch")
    x = jax.random.normal(key2, (8, 5))

    params, static = eqx.partition((linear, norm, bn), eqx.is_array)

    def loss_fn(params, x):
        linear, norm, bn = eqx.combine(params, static)
        h = jax.vmap(lambda v: norm(linear(v)))(x)
        h, _ = jax.vmap(bn, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(h, state)
        return jnp.mean(jax.nn.relu(h))

    report = fg.explain_grads(loss_fn, params, x)
    # One activation: jax.nn.relu on (8, 6), units the 6 features. The clamps of LayerNorm
    # (on the (8,) per-example variance) and BatchNorm (on the (6,) batch variance) are not.
    (site,) = report.relus
    assert site.units == 6 and site.axis == 1
    _, dead = fg.with_dead_relu(loss_fn)(params, x)
    assert [d.shape for d in dead.dead] == [(6,)]


def test_unknown_feature_axis_falls_back_to_last_axis_and_says_so():
    # q @ k.T: both operands depend on the data, so no weight names the units.
    def loss_fn(w, x):
        q = x @ w
        return jnp.sum(jax.nn.relu(q @ x.T))

    w, x = jnp.ones((3, 3)), -jnp.ones((4, 3))
    (site,) = fg.explain_grads(loss_fn, w, x).relus
    assert site.axis == 1 and site.units == 4 and "last axis" in site.note
    _, dead = fg.with_dead_relu(loss_fn)(w, x)
    assert "last axis" in dead.names[0]


def test_dense_layer_with_weight_first_counts_output_units():
    # h = W x per example (PyTorch's and equinox's (out, in) weight), vmapped over 5 examples:
    # the units are W's 4 rows wherever vmap puts the batch axis. Row 1 has bias -100 and
    # |W x| <= 3 (|W| <= 1, |x| <= 1, 3 inputs), so exactly unit 1 is dead.
    w = jnp.asarray(np.linspace(-1, 1, 12).reshape(4, 3), jnp.float32)
    b = jnp.array([0.5, -100.0, 0.5, 0.5])
    x = jnp.asarray(np.linspace(-1, 1, 15).reshape(5, 3), jnp.float32)

    def loss_fn(p, x):
        return jnp.sum(jax.nn.relu(jax.vmap(lambda v: p["w"] @ v + p["b"])(x)))

    pre = np.asarray(x @ w.T + b[None, :])
    alive = _alive_channels(pre, axis=1)
    (site,) = fg.explain_grads(loss_fn, {"w": w, "b": b}, x).relus
    assert site.units == 4 and site.dead == int((~alive).sum()) == 1


def test_a_relu_of_centred_or_squared_activations_is_still_a_relu():
    # Only a variance (E[x^2] - E[x]^2, a mean of squares, var()) is a clamp; relu(h - mean h)
    # and relu(h^2 - 1) are activations the user wrote: both listed, 4 units each.
    def loss_fn(w, x):
        h = x @ w
        a = jax.nn.relu(h - jnp.mean(h, axis=0, keepdims=True))
        b = jax.nn.relu(h * h - 1.0)
        return jnp.sum(a) + jnp.sum(b)

    w, x = jnp.ones((3, 4)), jnp.ones((5, 3))
    sites = fg.explain_grads(loss_fn, w, x).relus
    assert [(s.units, s.axis) for s in sites] == [(4, 1), (4, 1)]


# --- GroupNorm: the channel axis split into (groups, channels / groups) and merged back ----

def _eqx_groupnorm_model(dead=(0, 3, 5), conv=True):
    """Per example (C=8, H=6, W=6), channel-first: [equinox Conv2d(1 -> 8, 3x3, padding 1) ->]
    GroupNorm(2 groups, 8 channels) -> relu -> mean over pixels -> Linear(8 -> 3).

    GroupNorm standardises each group of 4 channels x 36 pixels = 144 values to mean 0,
    variance 1, so |normalised| <= sqrt(143) < 12 (a standardised value of n numbers is at
    most sqrt(n - 1) in size); with scale 1 and bias -1000 on the channels `dead`, those
    channels are <= 0 at every pixel of every example: dead. W = 6 != 8 channels."""
    eqx = pytest.importorskip("equinox")
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    norm = eqx.nn.GroupNorm(2, 8)
    norm = eqx.tree_at(lambda g: g.bias, norm, norm.bias.at[jnp.array(dead)].set(-1000.0))
    layers = (eqx.nn.Conv2d(1, 8, 3, padding=1, key=k1) if conv else None, norm,
              eqx.nn.Linear(8, 3, key=k2))
    x = jax.random.uniform(k3, (5, 1, 6, 6) if conv else (5, 8, 6, 6))

    def pre(layers, v):  # the ReLU's input, one example
        conv, norm, _ = layers
        return norm(conv(v) if conv is not None else v)

    def loss_fn(layers, x):
        out = jax.vmap(lambda v: layers[2](jax.nn.relu(pre(layers, v)).mean((1, 2))))(x)
        return jnp.mean(out ** 2)
    return layers, x, loss_fn, np.asarray(jax.vmap(lambda v: pre(layers, v))(x))


@pytest.mark.parametrize("conv", [True, False])
def test_equinox_groupnorm_counts_channels(conv):
    # Before: the reshape to (groups, C / groups, H, W) lost the channel axis, and the last
    # axis (W, 6 image columns) was counted: "0/6 units dead", monitor fraction 0. Without the
    # conv, the axis comes from the per-channel scale and bias broadcast along axis 1.
    layers, x, loss_fn, pre = _eqx_groupnorm_model(conv=conv)
    alive = _alive_channels(pre, axis=1)  # (5, 8, 6, 6): channels on axis 1
    assert not alive[[0, 3, 5]].any()     # dead by construction (docstring)
    report = fg.explain_grads(loss_fn, layers, x)
    (site,) = report.relus
    assert (site.units, site.dead, site.axis, site.note) == (8, int((~alive).sum()), 1, "")
    _, dead = jax.jit(fg.with_dead_relu(loss_fn))(layers, x)
    assert dead.axes == (1,)
    np.testing.assert_array_equal(dead.dead[0], ~alive)
    np.testing.assert_allclose(dead.fraction, [np.mean(~alive)])


def _flax_groupnorm(conv=True, dead=(1, 6)):
    nn = pytest.importorskip("flax.linen")

    class Pre(nn.Module):
        @nn.compact
        def __call__(self, x):  # NHWC
            return nn.GroupNorm(num_groups=2)(nn.Conv(8, (3, 3))(x) if conv else x)

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(jax.nn.relu(Pre(name="pre")(x)).mean((1, 2)))

    x = jax.random.uniform(jax.random.key(1), (5, 6, 6, 3 if conv else 8))
    net = Net()
    variables = net.init(jax.random.key(0), x)
    # GroupNorm's bias -1000 on channels `dead`: as for equinox, |normalised| <= sqrt(143)
    # (groups of 4 channels x 36 pixels) with scale 1, so these channels are dead.
    variables = jax.tree_util.tree_map_with_path(
        lambda p, v: v.at[jnp.array(dead)].set(-1000.0)
        if "GroupNorm_0" in jax.tree_util.keystr(p) and "bias" in jax.tree_util.keystr(p)
        else v, variables)
    pre = Pre().apply({"params": variables["params"]["pre"]}, x)

    def loss_fn(v, x):
        return jnp.mean(net.apply(v, x) ** 2)
    return variables, x, loss_fn, np.asarray(pre)


@pytest.mark.parametrize("conv", [True, False])
def test_flax_groupnorm_counts_channels(conv):
    # NHWC: the channels are the last axis, reshaped to (..., groups, C / groups) for the
    # statistics. Without the conv, the feature axis is found from the per-channel scale and
    # bias alone (before: the last-axis fallback and its note).
    variables, x, loss_fn, pre = _flax_groupnorm(conv=conv)
    alive = _alive_channels(pre, axis=3)
    assert not alive[[1, 6]].any()
    (site,) = fg.explain_grads(loss_fn, variables, x).relus
    assert (site.units, site.dead, site.axis, site.note) == (8, int((~alive).sum()), 3, "")
    _, dead = fg.with_dead_relu(loss_fn)(variables, x)
    assert dead.axes == (3,) and "last axis" not in dead.names[0]
    np.testing.assert_array_equal(dead.dead[0], ~alive)


def test_monitor_alerts_on_an_unknown_axis_site_only_when_every_value_is_dead():
    # relu((x @ w) @ x.T): both operands data-dependent, no feature axis; counted along the last
    # axis (4 columns). Rows 0-2 of x are zero, so columns 0-2 of the (4, 4) scores are 0
    # (dead) and column 3 holds s[3, 3] = x3 . (x3 w): +|x3|^2 > 0 for w = I (alive: 3/4 dead
    # along the last axis, which says nothing about units), -|x3|^2 < 0 for w = -I (every value
    # <= 0: dead along any axis).
    def loss_fn(w, x):
        return jnp.sum(jax.nn.relu((x @ w) @ x.T))

    x = jnp.zeros((4, 3)).at[3].set(jnp.array([1.0, 2.0, 3.0]))
    monitor = fg.GradMonitor(dead_threshold=0.5)
    kinds = []
    for w in (jnp.eye(3), -jnp.eye(3)):
        _, dead = fg.with_dead_relu(loss_fn)(w, x)
        grads = jax.grad(loss_fn)(w, x)
        _, metrics = monitor.measure(monitor.init(grads), grads, dead_relu=dead)
        kinds.append([(a.kind, a.value) for a in fg.monitor_alerts(metrics)])
    # Before: 0.75 >= 0.5 raised a dead_relu alert for the w = I scores too.
    assert kinds == [[], [("dead_relu", 1.0)]]


def test_relu_between_a_split_and_the_merge_counts_the_features_over_both_axes():
    # h = W v + b per example, 8 outputs reshaped to (2, 4) and ReLU'd there (as inside a
    # grouped norm): the units are the 8 outputs along axes (1, 2) of the (5, 2, 4) input.
    # |W v| <= 3 (|W| <= 1, |v| <= 1, 3 inputs) and b = -100 on outputs 1 and 6: 2 dead.
    w = jnp.asarray(np.linspace(-1, 1, 24).reshape(8, 3), jnp.float32)
    b = jnp.zeros(8).at[jnp.array([1, 6])].set(-100.0)
    x = jnp.asarray(np.linspace(-1, 1, 15).reshape(5, 3), jnp.float32)

    def loss_fn(p, x):
        h = jax.vmap(lambda v: (p["w"] @ v + p["b"]).reshape(2, 4))(x)
        return jnp.sum(jax.nn.relu(h))

    alive = _alive_channels(np.asarray(x @ w.T + b[None, :]), axis=1)
    report = fg.explain_grads(loss_fn, {"w": w, "b": b}, x)
    (site,) = report.relus
    assert (site.units, site.dead, site.axis, site.note) == (8, int((~alive).sum()), (1, 2), "")
    assert "2/8 units dead" in str(report) and "units along axes (1, 2)" in str(report)
    assert site.dead == 2
    _, dead = fg.with_dead_relu(loss_fn)({"w": w, "b": b}, x)
    assert dead.axes == ((1, 2),)
    np.testing.assert_array_equal(dead.dead[0], ~alive)
