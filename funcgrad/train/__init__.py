"""Training: the loss contract, the train step and its stages, `fit`, accumulation,
clipping, loss scaling, masks, the monitor, and the built-in data and models."""
from funcgrad.train.optimizers import OPTIMIZERS as OPTIMIZERS
from funcgrad.train.optimizers import applied_learning_rate as applied_learning_rate
from funcgrad.train.optimizers import make_optimizer as make_optimizer
from funcgrad.train.state import TrainState as TrainState
from funcgrad.train.step import NONFINITE_POLICIES as NONFINITE_POLICIES
from funcgrad.train.step import TrainStep as TrainStep
from funcgrad.train.step import make_train_step as make_train_step
from funcgrad.train.step import step_was_skipped as step_was_skipped
