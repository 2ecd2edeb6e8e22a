"""The train step as a value built from pieces (issue 33): what each piece declares, that a
former keyword names its piece, and the errors at the user's line. The numbers of the steps
the pieces build are the other files' (test_train, test_precision, test_accumulate, ...)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import funcgrad as fg
from funcgrad.train.step import _MOVED_KEYWORDS


def _loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"]) ** 2)


def _per_example(params, batch):
    return (batch["x"] @ params["w"]) ** 2


PARAMS = {"w": jnp.ones((3,))}
BATCH = {"x": jnp.arange(12.0).reshape(4, 3) / 10}


@pytest.mark.parametrize("name", sorted(_MOVED_KEYWORDS))
def test_every_former_keyword_names_its_piece(name):
    piece = _MOVED_KEYWORDS[name].split(": ")[1].split("(")[0]  # e.g. funcgrad.accumulate
    with pytest.raises(TypeError, match=rf"{name}= is no longer a keyword; .*{piece}\("):
        fg.make_train_step(_loss, optax.sgd(0.1), **{name: True})
    with pytest.raises(TypeError, match="unexpected keyword argument 'clip'"):
        fg.make_train_step(_loss, optax.sgd(0.1), clip=1.0)


def test_the_step_declares_its_pieces_as_fields():
    scale = fg.dynamic_loss_scale()
    loss = fg.accumulate(fg.mixed_precision(fg.Loss(_per_example), jnp.bfloat16,
                                            loss_scale=scale), 2, tail="drop")
    step = fg.make_train_step(loss, optax.chain(fg.clip_by_global_norm(1.0), optax.sgd(0.1)))
    assert (step.compute_dtype, step.loss_scale, step.accumulate, step.tail) == (
        jnp.bfloat16, scale, 2, "drop")
    assert (step.mesh, step.data_axis, step.shard_opt_state, step.detect_anomaly) == (
        None, None, False, False)
    assert step.clips and step.monitor is None and step.nonfinite == "skip" and step.jit
    assert repr(step) == ("TrainStep(Loss(_per_example, no flags (the plain form), "
                          "mixed_precision(bfloat16, loss_scale), accumulate(2, tail='drop')), "
                          "optimizer=chain)")
    # The pieces commute: the same declaration either way round.
    other = fg.mixed_precision(fg.accumulate(_per_example, 2, tail="drop"), jnp.bfloat16,
                               loss_scale=scale)
    assert (other.precision, other.accumulation) == (loss.precision, loss.accumulation)
    # Wrappers return new values; the step they wrap is unchanged.
    located = fg.detect_anomaly(step)
    assert located.detect_anomaly and not step.detect_anomaly
    parallel = fg.data_parallel(fg.make_train_step(_loss, optax.sgd(0.1)), fg.data_mesh())
    assert parallel.mesh is not None and parallel.data_axis == "data"


def test_init_makes_the_state_its_pieces_need():
    # The step knows its loss scale and monitor: the state it makes has both (the monitor's in
    # the optimizer state), and a call equals the same step on a state built by hand from the
    # same pieces.
    scale = fg.dynamic_loss_scale()
    tx = optax.chain(fg.grad_monitor(), optax.adam(1e-2))
    step = fg.make_train_step(fg.mixed_precision(_loss, jnp.bfloat16, loss_scale=scale), tx)
    state = step.init(PARAMS)
    assert state.loss_scale is not None and state.key is None
    assert isinstance(fg.recorded(state.opt_state)["monitor_state"], fg.MonitorState)
    by_hand = fg.TrainState(PARAMS, tx.init(PARAMS), jnp.zeros((), jnp.int32),
                            loss_scale=scale.init())
    a, b = step(state, BATCH)[0], step(by_hand, BATCH)[0]
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(x, y)
    keyed = fg.make_train_step(fg.Loss(lambda p, b, *, key: _loss(p, b), takes_key=True), tx)
    np.testing.assert_array_equal(jax.random.key_data(keyed.init(PARAMS).key),
                                  jax.random.key_data(jax.random.key(0)))  # seed 0 by default


def test_init_errors_name_step_init_and_the_fix():
    step = fg.make_train_step(_loss, optax.sgd(0.1))
    with pytest.raises(ValueError, match="the loss takes no key.*takes_key=True"):
        step.init(PARAMS, seed=0)
    with pytest.raises(ValueError, match="not declared with has_state=True"):
        step.init(PARAMS, model_state={"mean": jnp.zeros(3)})
    keyed = fg.make_train_step(fg.Loss(lambda p, b, *, key: _loss(p, b), takes_key=True),
                               optax.sgd(0.1))
    with pytest.raises(ValueError, match="TrainStep.init: give seed= or key=, not both"):
        keyed.init(PARAMS, seed=0, key=jax.random.key(0))
    with pytest.raises(TypeError, match="TrainStep.init: seed must be an int"):
        keyed.init(PARAMS, seed="0")
    with pytest.raises(TypeError, match=r"from step\.init\(params\)"):
        step([PARAMS], BATCH)


def test_a_step_is_not_a_loss_and_mixed_precision_is_half():
    step = fg.make_train_step(_loss, optax.sgd(0.1))
    for make in (lambda: fg.mixed_precision(step, jnp.bfloat16), lambda: fg.accumulate(step, 2),
                 lambda: fg.make_train_step(step, optax.sgd(0.1)), lambda: fg.Loss(step)):
        with pytest.raises(TypeError, match="a TrainStep was given where a loss is expected"):
            make()
    with pytest.raises(TypeError, match="compute_dtype is None"):
        fg.mixed_precision(_loss, None)
    with pytest.raises(ValueError, match="float64 is wider than the float32 params"):
        fg.mixed_precision(_loss, jnp.float64)
    with pytest.raises(TypeError, match="expected a TrainStep"):
        fg.detect_anomaly(_loss)
