"""The doctor's checks, one module each; every module has ``check(ctx) -> Finding``."""
