"""funcgrad: make gradients in JAX easy to see, check and trust.

PyTorch's autograd habits (``.grad``, ``zero_grad``, ``gradcheck``, ...) in functional form on
``jax.grad`` / ``jax.vjp`` / ``jax.jit`` and optax. The public API is re-exported here by name.

Names are imported when first used (PEP 562 module ``__getattr__``), so ``import funcgrad``
is instant and ``funcgrad train`` imports only what training needs (not scipy.special, the
checker, the graph or the memory tools): ~0.4 s of a 3 s run. The block below is the one list
of public names: type checkers and IDEs read it as imports, `_lazy_names` reads it with `ast`.
"""
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from funcgrad import doctor as doctor  # the checklist; callable: fg.doctor(step, state, data)
    from funcgrad import interop as interop  # the flax/equinox adapters; imports neither library
    from funcgrad import memory as memory
    from funcgrad import parallel as parallel  # data parallelism: meshes, placement, collectives
    from funcgrad._jax_internals import JaxInternalsError as JaxInternalsError
    from funcgrad._jax_version import TESTED_JAX as TESTED_JAX
    from funcgrad._jax_version import JaxVersionWarning as JaxVersionWarning
    from funcgrad._traced import TracedValueError as TracedValueError
    from funcgrad.check import LiftError as LiftError
    from funcgrad.check.audit import audit as audit
    from funcgrad.check.custom import CustomVJP as CustomVJP
    from funcgrad.check.custom import DroppedCotangentWarning as DroppedCotangentWarning
    from funcgrad.check.custom import custom_vjp as custom_vjp
    from funcgrad.check.directional import check_directional as check_directional
    from funcgrad.check.grads import check_grads as check_grads
    from funcgrad.check.manual import two_layer_grads as two_layer_grads
    from funcgrad.check.options import CheckOptions as CheckOptions
    from funcgrad.check.report import GradCheckReport as GradCheckReport
    from funcgrad.check.report import LeafCheck as LeafCheck
    from funcgrad.debug.anomaly import AnomalyReport as AnomalyReport
    from funcgrad.debug.anomaly import find_nonfinite as find_nonfinite
    from funcgrad.debug.diagnose import GradExplanation as GradExplanation
    from funcgrad.debug.diagnose import explain_grads as explain_grads
    from funcgrad.debug.graph import Graph as Graph
    from funcgrad.debug.graph import trace as trace
    from funcgrad.debug.taps import intermediate_grads as intermediate_grads
    from funcgrad.debug.taps import tap as tap
    from funcgrad.debug.vjp import backward as backward
    from funcgrad.demo.cnn import cnn_apply as cnn_apply
    from funcgrad.demo.cnn import cnn_init as cnn_init
    from funcgrad.demo.cnn import cnn_loss as cnn_loss
    from funcgrad.demo.mlp import MLPParams as MLPParams
    from funcgrad.demo.mlp import accuracy as accuracy
    from funcgrad.demo.mlp import mean_squared_error as mean_squared_error
    from funcgrad.demo.mlp import mlp_apply as mlp_apply
    from funcgrad.demo.mlp import mlp_init as mlp_init
    from funcgrad.demo.mlp import softmax_cross_entropy as softmax_cross_entropy
    from funcgrad.doctor import DoctorOptions as DoctorOptions
    from funcgrad.memory.checkpointing import RematPlan as RematPlan
    from funcgrad.memory.checkpointing import plan_remat as plan_remat
    from funcgrad.memory.checkpointing import remat as remat
    from funcgrad.memory.checkpointing import remat_sequential as remat_sequential
    from funcgrad.memory.report import MemoryReport as MemoryReport
    from funcgrad.memory.report import memory_report as memory_report
    from funcgrad.memory.scan import checkpointed_scan as checkpointed_scan
    from funcgrad.parallel.collectives import Collective as Collective
    from funcgrad.parallel.collectives import CollectiveReport as CollectiveReport
    from funcgrad.parallel.collectives import collectives as collectives
    from funcgrad.parallel.distributed import DistributedInfo as DistributedInfo
    from funcgrad.parallel.distributed import distributed_init as distributed_init
    from funcgrad.parallel.grad import (
        data_parallel_value_and_grad as data_parallel_value_and_grad,
    )
    from funcgrad.parallel.grad import device_key as device_key
    from funcgrad.parallel.placement import data_mesh as data_mesh
    from funcgrad.parallel.placement import process_batch as process_batch
    from funcgrad.parallel.placement import process_rows as process_rows
    from funcgrad.parallel.placement import replicate as replicate
    from funcgrad.parallel.placement import shard_batch as shard_batch
    from funcgrad.parallel.step import data_parallel as data_parallel
    from funcgrad.train.accumulate import AccumulatedGrads as AccumulatedGrads
    from funcgrad.train.accumulate import Microbatches as Microbatches
    from funcgrad.train.accumulate import accumulate_grads as accumulate_grads
    from funcgrad.train.accumulate import group_microbatches as group_microbatches
    from funcgrad.train.accumulate import make_accumulating_step as make_accumulating_step
    from funcgrad.train.accumulate import stack_microbatches as stack_microbatches
    from funcgrad.train.alerts import Alert as Alert
    from funcgrad.train.alerts import monitor_alerts as monitor_alerts
    from funcgrad.train.batching import Batches as Batches
    from funcgrad.train.checkpoint import Restored as Restored
    from funcgrad.train.checkpoint import latest_checkpoint_step as latest_checkpoint_step
    from funcgrad.train.checkpoint import restore_checkpoint as restore_checkpoint
    from funcgrad.train.checkpoint import save_checkpoint as save_checkpoint
    from funcgrad.train.clipping import global_norm as global_norm
    from funcgrad.train.coupling import CoupledExamplesWarning as CoupledExamplesWarning
    from funcgrad.train.data import Dataset as Dataset
    from funcgrad.train.data import load_digits as load_digits
    from funcgrad.train.loop import Checkpointing as Checkpointing
    from funcgrad.train.loop import FitOptions as FitOptions
    from funcgrad.train.loop import FitResult as FitResult
    from funcgrad.train.loop import History as History
    from funcgrad.train.loop import NonFiniteReport as NonFiniteReport
    from funcgrad.train.loop import Progress as Progress
    from funcgrad.train.loop import fit as fit
    from funcgrad.train.loss import Loss as Loss
    from funcgrad.train.loss import LossOutput as LossOutput
    from funcgrad.train.loss import as_loss as as_loss
    from funcgrad.train.masks import requires_grad as requires_grad
    from funcgrad.train.masks import train_only as train_only
    from funcgrad.train.masks import trainable_mask as trainable_mask
    from funcgrad.train.masks import value_and_grad_trainable as value_and_grad_trainable
    from funcgrad.train.microbatches import accumulate as accumulate
    from funcgrad.train.monitor import GradMonitor as GradMonitor
    from funcgrad.train.monitor import MonitorMetrics as MonitorMetrics
    from funcgrad.train.monitor import MonitorState as MonitorState
    from funcgrad.train.monitor import with_dead_relu as with_dead_relu
    from funcgrad.train.optimizers import make_optimizer as make_optimizer
    from funcgrad.train.precision import LossScale as LossScale
    from funcgrad.train.precision import LossScaleState as LossScaleState
    from funcgrad.train.precision import all_finite as all_finite
    from funcgrad.train.precision import cast_floating as cast_floating
    from funcgrad.train.precision import dynamic_loss_scale as dynamic_loss_scale
    from funcgrad.train.precision import mixed_precision as mixed_precision
    from funcgrad.train.precision import scaled_value_and_grad as scaled_value_and_grad
    from funcgrad.train.state import TrainState as TrainState
    from funcgrad.train.step import TrainStep as TrainStep
    from funcgrad.train.step import detect_anomaly as detect_anomaly
    from funcgrad.train.step import make_train_step as make_train_step
    from funcgrad.train.transforms import ClipState as ClipState
    from funcgrad.train.transforms import MonitorTransformation as MonitorTransformation
    from funcgrad.train.transforms import ZeroNonfiniteState as ZeroNonfiniteState
    from funcgrad.train.transforms import clip_by_global_norm as clip_by_global_norm
    from funcgrad.train.transforms import grad_monitor as grad_monitor
    from funcgrad.train.transforms import recorded as recorded
    from funcgrad.train.transforms import zero_nonfinite as zero_nonfinite


def _lazy_names() -> dict[str, str]:
    """{public name: module defining it}, read from the ``if TYPE_CHECKING:`` block above."""
    import ast

    with open(__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    (block,) = [node for node in tree.body if isinstance(node, ast.If)
                and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"]
    names = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module, "the block only re-exports"
        for alias in node.names:
            names[alias.asname or alias.name] = (
                node.module if node.module != "funcgrad" else f"funcgrad.{alias.name}")
    return names


_LAZY = _lazy_names()
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    import importlib

    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'funcgrad' has no attribute {name!r}")
    imported = importlib.import_module(module)
    value = imported if module == f"funcgrad.{name}" else getattr(imported, name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted({*globals(), *__all__})


__version__ = "0.1.0"

# A JAX outside the tested range (funcgrad._jax_version.TESTED_JAX) is named once, here.
from funcgrad._jax_version import warn_if_untested as _warn_if_untested  # noqa: E402

_warn_if_untested()
