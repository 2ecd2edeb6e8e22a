"""The command line's shared flag parsing: the parser class every command uses (one-line
errors, no abbreviations, "did you mean") and the argument types that check a flag's value."""
from __future__ import annotations

import argparse
import math


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (exit status 2), no usage dump,
    and which takes no abbreviations: argparse would read ``--epoch 3`` as ``--epochs 3``
    (a prefix of one flag), so a typo or a flag of another version would silently mean
    another one; here it is an unrecognized argument, with the flag it may have meant."""

    #: The top-level parser's command parsers ("train", "doctor"), whose flags the
    #: suggestion of an unrecognized flag also considers.
    commands: dict[str, argparse.ArgumentParser]

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # noqa: D401 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message}{self._suggestion(message)} "
                     f"(see {self.prog} --help)\n")

    def _suggestion(self, message: str) -> str:
        """"; did you mean --epochs?" for an unrecognized ``--epoch`` (a prefix of one flag, or
        close to one), else ""."""
        prefix = "unrecognized arguments: "
        if not message.startswith(prefix):
            return ""
        import difflib

        parsers = [self, *getattr(self, "commands", {}).values()]
        known = sorted({flag for parser in parsers if parser is not None
                        for action in parser._actions for flag in action.option_strings
                        if flag.startswith("--")})
        meant = []
        for word in message[len(prefix):].split():
            flag = word.split("=", 1)[0]
            if not flag.startswith("--") or flag in known:
                continue
            close = ([k for k in known if k.startswith(flag)]
                     or difflib.get_close_matches(flag, known, n=1, cutoff=0.75))
            if len(close) == 1:
                meant.append((close[0], flag))
        if len(meant) == 1:
            return f"; did you mean {meant[0][0]}?"
        return f"; did you mean {', '.join(f'{k} for {f}' for k, f in meant)}?" if meant else ""


def _checked(kind, ok, expected: str):
    """An argparse type: parse `text` with `kind`, accept it if ok(value), else one clear line."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value
    return parse


def _positive(kind):
    return _checked(kind, lambda v: v > 0 and math.isfinite(v), f"a positive {kind.__name__}")


# Each split needs every one of the 10 classes: at least 10 of the 1,797 digits each.
_fraction = _checked(float, lambda v: 10 <= round(1797 * v) <= 1787,
                     "a number in (0, 1) leaving at least 10 of the 1797 digits in each split "
                     "(0.006 to 0.994)")
_unit_interval = _checked(float, lambda v: 0.0 <= v < 1.0, "a number in [0, 1)")
_seed = _checked(int, lambda v: 0 <= v < 2**32, "an int in [0, 2**32)")

