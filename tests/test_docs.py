"""The documentation: every public name has its API reference entry, every directive names a
real object, every skipped code block says why, and the README's links lead somewhere.

The pages are built by `make docs` (`mkdocs build --strict`, in CI); their Python code blocks
run as tests through Sybil (the repository's conftest.py). These checks read the Markdown, so
they need no build."""
import importlib
import pathlib
import re
import types

import pytest

import funcgrad

ROOT = pathlib.Path(__file__).parent.parent
API = ROOT / "docs" / "api"
SUBPACKAGES = ["check", "debug", "train", "memory", "interop", "micro"]
DIRECTIVE = re.compile(r"^::: (\S+)\s*$", re.MULTILINE)


def _directives() -> dict[str, str]:
    """{identifier: page name} of every ``::: identifier`` in docs/api/*.md."""
    found = {}
    for page in sorted(API.glob("*.md")):
        for identifier in DIRECTIVE.findall(page.read_text(encoding="utf-8")):
            assert identifier not in found, f"{identifier} is documented twice"
            found[identifier] = page.name
    return found


def _resolve(identifier: str):
    """The object a dotted path names, as Python reads ``funcgrad.fit``: attribute by attribute,
    importing a submodule only where there is no such attribute (``funcgrad.fit`` is the
    function, not the module ``import funcgrad.fit`` still finds under its old path)."""
    first, *rest = identifier.split(".")
    obj = importlib.import_module(first)
    for i, name in enumerate(rest):
        try:
            obj = getattr(obj, name)
        except AttributeError:
            obj = importlib.import_module(".".join([first, *rest[:i + 1]]))
    return obj


def test_every_directive_names_an_object():
    missing = []
    for identifier, page in _directives().items():
        try:
            _resolve(identifier)
        except (ImportError, AttributeError):
            missing.append(f"{page}: {identifier}")
    assert not missing, missing


def test_every_public_name_is_in_the_api_reference():
    # By identity: `::: funcgrad.check_grads` and `::: funcgrad.check.grads.check_grads` both
    # document funcgrad.check_grads; a subpackage counts by its own `::: funcgrad.memory`.
    documented = [_resolve(identifier) for identifier in _directives()]
    missing = [name for name in funcgrad.__all__
               if not any(getattr(funcgrad, name) is obj for obj in documented)]
    assert not missing, f"not in docs/api/*.md: {missing}"
    assert len(funcgrad.__all__) > 80  # the list itself was read (funcgrad/__init__.py)


@pytest.mark.parametrize("subpackage", SUBPACKAGES)
def test_each_subpackage_has_its_reference_page(subpackage):
    page = API / f"{subpackage}.md"
    assert page.exists()
    directives = DIRECTIVE.findall(page.read_text(encoding="utf-8"))
    assert f"funcgrad.{subpackage}" in directives  # its docstring opens the page
    assert isinstance(_resolve(f"funcgrad.{subpackage}"), types.ModuleType)
    assert len(directives) > 1


def _markdown_files() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_skipped_code_block_says_why():
    # Sybil's directive: <!-- skip: next "reason" --> or <!-- skip: next if(cond, reason="...") -->.
    unexplained = []
    for path in _markdown_files():
        for line, directive in _skips(path):
            if not re.search(r"""(^next\s+"[^"]{10,}"$)|(reason\s*=\s*"[^"]{10,}")""", directive):
                unexplained.append(f"{path.relative_to(ROOT)}:{line}: {directive}")
    assert not unexplained, unexplained


def _skips(path: pathlib.Path) -> list[tuple[int, str]]:
    text = path.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 1, m.group(1).strip())
            for m in re.finditer(r"<!--\s*skip:(.*?)-->", text, re.DOTALL)]


def test_skips_are_few():
    # Code that cannot run is the exception: one block (Graphviz's `dot`) today.
    assert sum(len(_skips(path)) for path in _markdown_files()) <= 3


def _slug(heading: str) -> str:
    """Python-Markdown's toc anchor of a heading (the one MkDocs writes)."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text))


def test_the_readme_links_lead_to_files_and_headings():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", readme):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = ROOT / path
        if not file.is_file():
            broken.append(target)
        elif anchor and anchor not in {
                _slug(h) for h in re.findall(r"^#+ (.+)$", file.read_text(encoding="utf-8"),
                                             re.MULTILINE)}:
            broken.append(target)
    assert not broken, broken


def test_the_readme_stays_a_front_door():
    # The manual is docs/; the README says what funcgrad is, how to start, and where to read.
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 200
