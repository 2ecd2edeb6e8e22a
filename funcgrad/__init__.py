"""funcgrad: make gradients in JAX easy to see, check and trust.

PyTorch's autograd habits (``.grad``, ``zero_grad``, ``gradcheck``, ...) in functional form on
``jax.grad`` / ``jax.vjp`` / ``jax.jit`` and optax. The public API is re-exported here by name.
"""
from funcgrad.clipping import global_norm as global_norm
from funcgrad.data import Dataset as Dataset
from funcgrad.data import batches as batches
from funcgrad.data import load_digits as load_digits
from funcgrad.manual import two_layer_grads as two_layer_grads
from funcgrad.nn import MLPParams as MLPParams
from funcgrad.nn import accuracy as accuracy
from funcgrad.nn import mean_squared_error as mean_squared_error
from funcgrad.nn import mlp_apply as mlp_apply
from funcgrad.nn import mlp_init as mlp_init
from funcgrad.nn import softmax_cross_entropy as softmax_cross_entropy
from funcgrad.convnet import cnn_apply as cnn_apply
from funcgrad.convnet import cnn_init as cnn_init
from funcgrad.convnet import cnn_loss as cnn_loss
from funcgrad.fit import FitResult as FitResult
from funcgrad.fit import History as History
from funcgrad.fit import NonFiniteReport as NonFiniteReport
from funcgrad.train import TrainState as TrainState
from funcgrad.loss import Loss as Loss
from funcgrad.loss import LossOutput as LossOutput
from funcgrad.loss import as_loss as as_loss
from funcgrad.fit import fit as fit
from funcgrad.train import init_train_state as init_train_state
from funcgrad.train import make_optimizer as make_optimizer
from funcgrad.train import make_train_step as make_train_step
from funcgrad.precision import LossScale as LossScale
from funcgrad.precision import LossScaleState as LossScaleState
from funcgrad.precision import all_finite as all_finite
from funcgrad.precision import cast_floating as cast_floating
from funcgrad.precision import dynamic_loss_scale as dynamic_loss_scale
from funcgrad.precision import scaled_value_and_grad as scaled_value_and_grad
from funcgrad.check import audit as audit
from funcgrad.check import check_grads as check_grads
from funcgrad.check_report import GradCheckReport as GradCheckReport
from funcgrad.check_report import LeafCheck as LeafCheck
from funcgrad.diagnose import GradExplanation as GradExplanation
from funcgrad.diagnose import explain_grads as explain_grads
from funcgrad.graph import Graph as Graph
from funcgrad.graph import trace as trace
from funcgrad.masks import freeze as freeze
from funcgrad.masks import requires_grad as requires_grad
from funcgrad.masks import trainable_mask as trainable_mask
from funcgrad.masks import value_and_grad_trainable as value_and_grad_trainable
from funcgrad.taps import intermediate_grads as intermediate_grads
from funcgrad.vjp import backward as backward
from funcgrad._traced import TracedValueError as TracedValueError
from funcgrad.taps import tap as tap
from funcgrad.accumulate import AccumulatedGrads as AccumulatedGrads
from funcgrad.accumulate import accumulate_grads as accumulate_grads
from funcgrad.accumulate import group_microbatches as group_microbatches
from funcgrad.accumulate import make_accumulating_step as make_accumulating_step
from funcgrad.accumulate import stack_microbatches as stack_microbatches
from funcgrad.accumulate import Microbatches as Microbatches
from funcgrad.coupling import CoupledExamplesWarning as CoupledExamplesWarning
from funcgrad.anomaly import AnomalyReport as AnomalyReport
from funcgrad.anomaly import find_nonfinite as find_nonfinite
from funcgrad.custom import CustomVJP as CustomVJP
from funcgrad.custom import DroppedCotangentWarning as DroppedCotangentWarning
from funcgrad.monitor import Alert as Alert
from funcgrad.monitor import GradMonitor as GradMonitor
from funcgrad.monitor import MonitorMetrics as MonitorMetrics
from funcgrad.monitor import MonitorState as MonitorState
from funcgrad.monitor import grad_monitor as grad_monitor
from funcgrad.monitor import monitor_alerts as monitor_alerts
from funcgrad.monitor import with_dead_relu as with_dead_relu
from funcgrad.custom import custom_vjp as custom_vjp
from funcgrad import interop as interop  # the flax/equinox adapters; imports neither library

__version__ = "0.1.0"
