"""Checking gradients: `check_grads`, `audit`, their report, hand-written backprop and
checked custom rules."""
from funcgrad.check._lift_precision import LiftError as LiftError
from funcgrad.check.grads import TOLERANCES as TOLERANCES
from funcgrad.check.grads import audit as audit
from funcgrad.check.grads import check_grads as check_grads
