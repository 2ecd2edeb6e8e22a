"""Checking gradients: `check_grads` (every element) and `check_directional` (random tangents),
`audit` (one or the other), their options and report, hand-written backprop and checked
custom rules."""
from funcgrad.check._lift_precision import LiftError as LiftError
from funcgrad.check.audit import audit as audit
from funcgrad.check.directional import check_directional as check_directional
from funcgrad.check.grads import check_grads as check_grads
from funcgrad.check.options import TOLERANCES as TOLERANCES
from funcgrad.check.options import CheckOptions as CheckOptions
