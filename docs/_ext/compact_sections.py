"""A griffe extension: funcgrad's docstrings write their Google-style sections without a blank
line above them (``Args:`` right after the summary paragraph, ``Returns:`` right after the last
argument; see STYLE.md). griffe's Google parser takes a section title only after a blank line,
and would render ``Returns:`` and ``Raises:`` as plain text. This inserts that blank line before
each section title at the docstring's own indentation, before griffe parses it; nothing else
changes, and a title griffe does not know is left as text."""
import re

import griffe

_TITLES = ("Args", "Arguments", "Attributes", "Example", "Examples", "Note", "Notes",
           "Raises", "Returns", "Warns", "Yields")
_TITLE = re.compile(rf"(?:{'|'.join(_TITLES)}):")


class CompactSections(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        docstring = obj.docstring
        if docstring is None or obj.is_alias:
            return
        lines = docstring.value.split("\n")
        out: list[str] = []
        for line in lines:
            if _TITLE.fullmatch(line) and out and out[-1].strip():
                out.append("")
            out.append(line)
        docstring.value = "\n".join(out)
