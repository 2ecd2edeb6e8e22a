"""``funcgrad.doctor``: the whole gradient-debugging checklist on any model, in one call
(concept 23; the article's checklist B5.3). See the guide page "Doctor".

``doctor`` and ``doctor_file`` are imported when first used (they import JAX), so that the
command line can read `CHECKS` and the model-file layout without importing JAX.
"""
import sys as _sys
import types as _types
from typing import TYPE_CHECKING

from funcgrad.doctor._finding import CHECKS as CHECKS
from funcgrad.doctor._finding import Finding as Finding
from funcgrad.doctor._model_file import EXPECTED_FILE as EXPECTED_FILE
from funcgrad.doctor._model_file import ModelFileError as ModelFileError
from funcgrad.doctor._model_file import load_model_file as load_model_file
from funcgrad.doctor._options import DoctorOptions as DoctorOptions
from funcgrad.doctor._report import DoctorReport as DoctorReport

if TYPE_CHECKING:
    from funcgrad.doctor._doctor import doctor as doctor
    from funcgrad.doctor._doctor import doctor_file as doctor_file

__all__ = ["CHECKS", "DoctorOptions", "DoctorReport", "EXPECTED_FILE", "Finding",
           "ModelFileError", "doctor", "doctor_file", "load_model_file"]


def __getattr__(name: str):
    if name in ("doctor", "doctor_file"):
        from funcgrad.doctor import _doctor

        return getattr(_doctor, name)
    raise AttributeError(f"module 'funcgrad.doctor' has no attribute {name!r}")


class _CallableModule(_types.ModuleType):
    """This package's module type: ``funcgrad.doctor(step, state, data)`` calls `doctor`, so
    ``fg.doctor`` is both the function of the public API and this package (``fg.doctor.CHECKS``,
    ``import funcgrad.doctor``), whichever way it was imported first; ``inspect.signature``
    and ``help`` of it show `doctor`'s."""

    def __call__(self, *args, **kwargs) -> DoctorReport:
        from funcgrad.doctor._doctor import doctor

        return doctor(*args, **kwargs)

    @property
    def __signature__(self):
        import inspect

        from funcgrad.doctor._doctor import doctor

        return inspect.signature(doctor)


_sys.modules[__name__].__class__ = _CallableModule
