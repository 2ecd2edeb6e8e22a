"""The training loop, `fit`, in modules of one idea each:

* `_fit`: `fit` itself, the run's outline: its arguments, the epochs, evaluation,
  checkpoints, Ctrl-C and crashes;
* `_epochs`: an epoch of array data in chunks of steps on the device (or one call per
  batch), or of a loader's batches; `_dispatches`: several epochs in one dispatch when the
  host needs nothing in between, and the next dispatch launched ahead; `_chunks`: the jitted
  programs that run them;
* `_record`: the host's side of a chunk: its rows into the history, the monitor's alerts,
  the report of a non-finite step;
* `options`: what `fit` is told besides its data, one value each (`Checkpointing`,
  `Progress`, `FitOptions`); `placement`: where the data and the state live (what `fit`
  trains on, a `funcgrad.Batches` or a loader, comes through `funcgrad.train.batching`);
* `history`: what a run records and returns (`History`, `FitResult`, `NonFiniteReport`,
  `format_epoch`); `evaluate`: the per-epoch evaluation; `resume`: checkpoints and resume;
  `_checks`: the checks of what `fit` is given.

`funcgrad.train.fit` (and `funcgrad.fit`, its old path) re-exports these names.
"""
from funcgrad.train.loop._fit import fit as fit
from funcgrad.train.loop._record import MAX_LOGGED_ALERTS as MAX_LOGGED_ALERTS
from funcgrad.train.loop.evaluate import EVAL_PREFIX as EVAL_PREFIX
from funcgrad.train.loop.history import FitResult as FitResult
from funcgrad.train.loop.history import History as History
from funcgrad.train.loop.history import NonFiniteReport as NonFiniteReport
from funcgrad.train.loop.history import format_epoch as format_epoch
from funcgrad.train.loop.options import Checkpointing as Checkpointing
from funcgrad.train.loop.options import FitOptions as FitOptions
from funcgrad.train.loop.options import Progress as Progress
