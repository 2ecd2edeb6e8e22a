"""The Python code blocks of README.md and docs/ run as tests; Sybil finds and evaluates them.

Each Markdown file is one test that runs its ```python blocks in order, in one namespace, as a
reader would paste them: a page's later blocks use the names of its earlier ones. (Sybil's own
pytest items are one per block; pytest-xdist's worksteal scheduler, `make test`, would send
blocks of one page to different processes, where the names they build on do not exist.) The
failing block is named by file and line.

In the Markdown, a block that cannot run is preceded by ``<!-- skip: next "why not" -->``
(tests/test_docs.py requires the reason), and names a fragment needs but does not define come
from an ``<!-- invisible-code-block: python -->`` before it (the reader does not see it). Blocks
run in a new temporary directory, so what they write (checkpoints, plots) goes there, with JAX's
default settings as a reader runs them (``x @ w + b`` promotes the bias's rank, which
tests/conftest.py makes an error for funcgrad's own code); warnings are errors (pyproject).
"""
import os
import pathlib
import shutil
import tempfile
import unittest

import pytest
from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

MARKDOWN = Sybil(parsers=[PythonCodeBlockParser(), SkipParser()],
                 patterns=["README.md", "docs/*.md", "docs/*/*.md"])


class MarkdownFile(pytest.File):
    def collect(self):
        if any(True for _ in MARKDOWN.parse(self.path).examples()):  # pages with Python only
            yield CodeBlocks.from_parent(self, name="code blocks")


class CodeBlocks(pytest.Item):
    """Every Python block of one Markdown file, run in order; skipped blocks are recorded in
    ``user_properties`` as ``("skipped", [(line, reason), ...])``."""

    def runtest(self) -> None:
        document = MARKDOWN.parse(self.path)
        skipped = []
        here, work = os.getcwd(), tempfile.mkdtemp(prefix="funcgrad-docs-")
        os.chdir(work)
        try:
            for example in document.examples():
                try:
                    example.evaluate()
                except unittest.SkipTest as skip:
                    skipped.append((example.line, str(skip)))
                except BaseException as error:
                    error.add_note(f"in the code block of {self.path.name} at line "
                                   f"{example.line}")
                    raise
        finally:
            os.chdir(here)
            shutil.rmtree(work, ignore_errors=True)
        self.user_properties.append(("skipped", skipped))

    def repr_failure(self, excinfo, style=None):
        # The block's frame is the whole Markdown file; the long style would print all of it.
        return super().repr_failure(excinfo, style="short")

    def _traceback_filter(self, excinfo):
        # From the block's own line on: pytest's and this runner's frames say nothing.
        traceback = excinfo.traceback
        for i, entry in enumerate(traceback):
            if entry.path == self.path:
                return traceback[i:]
        return traceback

    def reportinfo(self):
        return self.path, 0, f"{self.path.name}: Python code blocks"


def pytest_collect_file(file_path: pathlib.Path, parent):
    if MARKDOWN.should_parse(file_path):
        return MarkdownFile.from_parent(parent, path=file_path)
    return None
