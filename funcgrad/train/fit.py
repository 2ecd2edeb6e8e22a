"""`fit` and what it returns, at their original path: the loop itself lives in the package
`funcgrad.train.loop` (one module per idea); these are the same objects."""
from funcgrad.train.loop import EVAL_PREFIX as EVAL_PREFIX
from funcgrad.train.loop import MAX_LOGGED_ALERTS as MAX_LOGGED_ALERTS
from funcgrad.train.loop import Checkpointing as Checkpointing
from funcgrad.train.loop import FitOptions as FitOptions
from funcgrad.train.loop import FitResult as FitResult
from funcgrad.train.loop import History as History
from funcgrad.train.loop import NonFiniteReport as NonFiniteReport
from funcgrad.train.loop import Progress as Progress
from funcgrad.train.loop import fit as fit
from funcgrad.train.loop import format_epoch as format_epoch
