"""The doctor takes its data through `fit`'s door (`funcgrad.train.batching.as_source`): array
data is batched as ``fg.Batches(data, batch_size=, seed=, drop_last=True)`` would batch it,
and a `fg.Batches` given as the data is used as it is (its batch size and order).

Second method: the same training check fed a loader of batches built here by hand from the
documented order (``permutation(fold_in(key(seed), epoch), n)`` cut into full runs)."""
import jax
import numpy as np
import optax
import pytest

import funcgrad as fg
from funcgrad.doctor import DoctorOptions, ModelFileError, doctor

from . import _small


def _step_and_state():
    step = fg.make_train_step(_small.loss, optax.adam(1e-3))
    return step, step.init(_small.params())


def _training_losses(data, **kwargs):
    step, state = _step_and_state()
    report = doctor(step, state, data, checks=["training"],
                    options=DoctorOptions(classes=_small.K, steps=8, **kwargs))
    return report.curves["loss"]


def test_the_doctor_batches_arrays_as_fit_does():
    d = _small.data()  # 96 rows: 3 full batches of 32 an epoch (drop_last leaves none out)

    def by_hand(epoch):  # batches of 32 in the documented order, 3 an epoch
        order = np.asarray(jax.random.permutation(
            jax.random.fold_in(jax.random.key(2), epoch), 96))
        return [{k: v[order[i:i + 32]] for k, v in d.items()} for i in (0, 32, 64)]

    arrays = _training_losses(d, batch_size=32, seed=2)
    given = _training_losses(fg.Batches(d, batch_size=32, seed=2), seed=2)
    hand = _training_losses(by_hand, seed=2)
    assert len(arrays) == 8  # 8 steps: 2 epochs and 2 batches of the third
    np.testing.assert_allclose(arrays, hand, rtol=1e-6)
    np.testing.assert_allclose(given, hand, rtol=1e-6)


def test_bad_data_is_a_model_file_error_with_fits_words():
    with pytest.raises(ModelFileError, match=r"data\['y'\] has 9 rows but data\['x'\] has 10"):
        doctor(*_step_and_state(), {"x": np.zeros((10, 8), np.float32),
                                    "y": np.zeros(9, np.int32)})
    with pytest.raises(ModelFileError, match="data must be a pytree of arrays"):
        doctor(*_step_and_state(), {"x": 1.0})
