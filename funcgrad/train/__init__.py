"""Training: the loss contract, the train step and its stages, `fit`, accumulation,
clipping, loss scaling, masks, the monitor, and the built-in data and models."""
from funcgrad.train.step import NONFINITE_POLICIES as NONFINITE_POLICIES
from funcgrad.train.step import OPTIMIZERS as OPTIMIZERS
from funcgrad.train.step import TrainState as TrainState
from funcgrad.train.step import applied_learning_rate as applied_learning_rate
from funcgrad.train.step import init_train_state as init_train_state
from funcgrad.train.step import make_optimizer as make_optimizer
from funcgrad.train.step import make_train_step as make_train_step
from funcgrad.train.step import step_was_skipped as step_was_skipped
