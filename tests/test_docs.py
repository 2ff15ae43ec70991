"""The docs run: every Python block of README.md and docs/*.md, and every ``gguf-mcv`` line shown.

The blocks are found by Sybil's Markdown lexers (fenced code blocks, and the
``<!-- docs-test: skip (reason) -->`` comment before a block that cannot run here); they are
run by this module rather than by Sybil's pytest plugin because the pages sit outside
``tests/`` (the plugin collects files below its conftest) and need this suite's fixtures:
the local Hub stand-in serving the tiny generated models under the catalog names the docs
use, and one loaded tiny model for blocks that continue an earlier example (``model``,
``chat``). Each page runs in a temporary folder holding the files its blocks name
(``photo.jpg``, ``street.jpg``, ``clip.mp4``, ``photos/``, ...); the blocks of one page share
one namespace, in order.

- ``python`` blocks are executed as written.
- ``bash``/``sh``/``console`` blocks: each ``gguf-mcv`` command is run (``python -m gguf_mcv``);
  a command that does not end by itself (``serve``, ``watch``, ``chat``) or names a remote
  source (``rtsp://``, ``http(s)://``) or a Ray cluster runs as ``gguf-mcv <command> --help``.
  Other lines (``pip install``, ``ray start``, ``python -m pytest``) are not run.
- Unlabelled blocks are output samples: only their ``$ gguf-mcv ...`` lines are run.
- ``text``, ``json`` and other blocks are output samples: not run.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import PIL.Image
import pytest
from sybil import Document, Region
from sybil.parsers.markdown.lexers import DirectiveInHTMLCommentLexer, RawFencedCodeBlockLexer

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: the catalog names the docs load, served by the Hub stand-in with tiny models of their generation
SERVED = {"minicpm-v-2.6": "tiny", "minicpm-v-4.6": "4.6"}
#: subcommands that run until stopped: shown with --help
UNENDING = frozenset({"serve", "watch", "chat"})
REMOTE = re.compile(r"^(rtsp|rtmp|https?)://|^--ray$")
SHELLS = frozenset({"bash", "sh", "shell", "console"})

_FENCE = RawFencedCodeBlockLexer(info_pattern=re.compile(r"(?P<language>[\w+-]*)[^\n]*$\n", re.MULTILINE))
_SKIP = DirectiveInHTMLCommentLexer(directive="docs-test", arguments=r"skip \((?P<reason>[^)]*)\)")


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: where it is, its language and text, and why it is skipped."""

    page: str
    line: int
    language: str
    source: str
    skip: str = ""

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def _regions(document: Document) -> Iterator[Region]:
    for region in _FENCE(document):
        region.parsed = "block"
        yield region
    for region in _SKIP(document):
        region.parsed = "skip"
        yield region


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of the Markdown file ``path``, in order, each with the reason of a
    ``docs-test: skip`` comment right before it."""
    document = Document.parse(str(path), _regions)
    found, reason = [], ""
    page = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    for example in document.examples():
        region = example.region
        if region.parsed == "skip":
            match = re.search(r"skip \((.*)\)", str(region.lexemes["arguments"]))
            reason = match.group(1) if match else "skipped"
            continue
        found.append(Block(page, example.line, str(region.lexemes["language"]), str(region.lexemes["source"]),
                           reason))
        reason = ""
    return found


def commands(block: Block) -> list[list[str]]:
    """The ``gguf-mcv`` commands of a shell or output block, as argument lists (after ``gguf-mcv``),
    with ``--help`` in place of the arguments of one that cannot run here."""
    if block.language not in SHELLS | {""}:
        return []
    found = []
    for line in block.source.replace("\\\n", " ").splitlines():
        line = line.strip()
        if line.startswith("$ "):
            line = line[2:]
        elif block.language in ("", "console"):
            continue  # output, not a command
        for part in line.split("&&"):
            words = shlex.split(part, comments=True)
            if words[:1] == ["gguf-mcv"]:
                found.append(_runnable(words[1:]))
            elif words[:3] == ["python", "-m", "gguf_mcv"]:
                found.append(_runnable(words[3:]))
    return found


def _runnable(args: list[str]) -> list[str]:
    if args and (args[0] in UNENDING or any(REMOTE.search(a) for a in args)):
        return [args[0], "--help"]
    return args


ALL = [block for page in PAGES for block in blocks(page)]
RUN = [b for b in ALL if b.language == "python" or commands(b)]


# --- the folder and the models the blocks use --------------------------------------


def _picture(path: Path, seed: int, size: tuple[int, int] = (180, 240)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    PIL.Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)).save(path)
    return path


def _clip(path: Path) -> Path:
    import cv2

    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 2.0, (96, 64))
    rng = np.random.default_rng(5)
    for _ in range(4):
        writer.write(rng.integers(0, 256, (64, 96, 3), dtype=np.uint8))
    writer.release()
    assert cv2.VideoCapture(str(path)).read()[0], "OpenCV could not write an MP4 here"
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The files the docs' blocks name."""
    root = tmp_path_factory.mktemp("docs")
    for i, name in enumerate(("photo.jpg", "street.jpg", "meter.jpg", "meter2.jpg", "photos/a.jpg",
                              "photos/garden/b.png")):
        _picture(root / name, i)
    _clip(root / "clip.mp4")
    (root / "questions.csv").write_text("image,prompt,max_tokens\nphoto.jpg,What is in it?,8\n"
                                        "street.jpg,Any people?,8\n")
    (root / "answer.schema.json").write_text('{"type": "object", "properties": {"answer": {"type": "string"}},'
                                             ' "required": ["answer"]}')
    return root


@pytest.fixture(scope="module")
def generations(tiny, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from gguf_mcv.testing import synthetic

    return {"tiny": tiny, "4.6": synthetic.build(tmp_path_factory.mktemp("docs_4.6"), synthetic.PRESETS["4.6"],
                                                 ["Q4_K_M"])}


@pytest.fixture
def served(hub, generations: dict[str, Any]):
    """The Hub stand-in with each catalog model the docs name, as the catalog names its files."""
    from gguf_mcv.models.catalog import lookup

    for name, preset in SERVED.items():
        entry = lookup(name)
        assert entry is not None
        built = generations[preset]
        files = {entry.quants[q].file: path for q, path in built.quants.items() if q in entry.quants}
        hub.add_repo(entry.repo, {**files, entry.mmproj.file: built.mmproj})
    return hub


_NAMESPACES: dict[str, dict[str, Any]] = {}


def _namespace(page: str, tiny_model) -> dict[str, Any]:
    if page not in _NAMESPACES:
        _NAMESPACES[page] = {"__name__": f"docs:{page}", "model": tiny_model, "chat": tiny_model.chat(),
                             "__shared__": tiny_model}
    return _NAMESPACES[page]


@pytest.fixture(scope="module", autouse=True)
def _close_the_models_blocks_loaded() -> Iterator[None]:
    yield
    from gguf_mcv.model import Model

    for namespace in _NAMESPACES.values():
        for value in namespace.values():
            if isinstance(value, Model) and value is not namespace["__shared__"]:
                value.close()
    _NAMESPACES.clear()


# --- the blocks ----------------------------------------------------------------------


def run_python(block: Block, namespace: dict[str, Any]) -> None:
    """Execute ``block`` in ``namespace``; its line numbers in a traceback are the page's."""
    code = compile("\n" * block.line + block.source, block.name, "exec")
    exec(code, namespace)  # noqa: S102 - the docs' own examples


def run_command(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gguf_mcv", *args], cwd=cwd, env=os.environ,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("block", RUN, ids=[b.name for b in RUN])
def test_doc_block_runs(block: Block, served, tiny_model, folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if block.skip:
        pytest.skip(block.skip)
    monkeypatch.chdir(folder)
    if block.language == "python":
        run_python(block, _namespace(block.page, tiny_model))
        return
    for args in commands(block):
        done = run_command(args, folder)
        assert done.returncode == 0, f"gguf-mcv {shlex.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}"
        if args[-1:] == ["--help"]:
            assert "usage:" in done.stdout


# --- the extractor itself, and the names the pages give ---------------------------------

#: a dotted name in the package (``gguf_mcv.jobs.batch_input.answer_identity``)
DOTTED = re.compile(r"\bgguf_mcv(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def test_every_module_and_name_the_docs_give_exists() -> None:
    import importlib

    missing = []
    for page in [*PAGES, ROOT / "models.toml"]:
        for dotted in sorted(set(DOTTED.findall(page.read_text()))):
            parts = dotted.split(".")
            for cut in range(len(parts), 0, -1):  # the longest prefix that is a module
                try:
                    found: Any = importlib.import_module(".".join(parts[:cut]))
                except ImportError:
                    continue
                for attribute in parts[cut:]:
                    found = getattr(found, attribute, None)
                break
            if found is None:
                missing.append(f"{page.name}: {dotted}")
    assert not missing


def test_every_import_the_docs_show_works() -> None:
    """Inline ones too (a ``python -c "from gguf_mcv... import ..."`` in a table)."""
    import importlib

    statement = re.compile(r"\bfrom (gguf_mcv[\w.]*) import (\w+(?:, *\w+)*)")
    missing = []
    for page in PAGES:
        for module, names in sorted(set(statement.findall(page.read_text()))):
            try:
                imported = importlib.import_module(module)
            except ImportError:
                missing.append(f"{page.name}: {module}")
                continue
            for name in names.split(","):
                name = name.strip()
                if not hasattr(imported, name):
                    try:
                        importlib.import_module(f"{module}.{name}")
                    except ImportError:
                        missing.append(f"{page.name}: from {module} import {name}")
    assert not missing


def test_every_package_file_the_docs_link_exists() -> None:
    named = re.compile(r"\b(?:gguf_mcv|tools|tests)/[\w/.-]+\.(?:py|html|toml)\b")
    shipped = {"gguf_mcv/models.toml"}  # the wheel's copy of models.toml (pyproject.toml)
    missing = [f"{page.name}: {path}" for page in PAGES for path in sorted(set(named.findall(page.read_text())))
               if path not in shipped and not (ROOT / path).exists()]
    assert not missing



def test_every_fenced_block_is_found() -> None:
    for page in PAGES:
        fences = [line for line in page.read_text().splitlines() if line.lstrip().startswith("```")]
        assert len(blocks(page)) * 2 == len(fences), page


def test_skips_say_why_and_are_few() -> None:
    skipped = [b for b in ALL if b.skip]
    assert all(b.skip.strip() for b in skipped)
    assert len(skipped) <= len(RUN) // 3, [b.name for b in skipped]


def test_a_broken_block_fails_and_a_marked_one_is_skipped(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("Intro.\n\n```python\nfrom gguf_mcv import no_such_module\n```\n\n"
                    "<!-- docs-test: skip (needs a camera) -->\n```python\nraise SystemExit(1)\n```\n\n"
                    "```bash\npip install gguf-mcv && gguf-mcv serve m --port 1 && \\\n"
                    "  gguf-mcv models --json\n```\n\n"
                    "```\n$ gguf-mcv plan m --ram 1GB\nquant  verdict\n```\n\n```json\n{\"a\": 1}\n```\n")
    found = blocks(page)
    assert [(b.language, b.line, b.skip) for b in found] == [
        ("python", 3, ""), ("python", 8, "needs a camera"), ("bash", 12, ""), ("", 17, ""), ("json", 22, "")]
    with pytest.raises(ImportError, match="no_such_module"):
        run_python(found[0], {})
    assert commands(found[2]) == [["serve", "--help"], ["models", "--json"]]
    assert commands(found[3]) == [["plan", "m", "--ram", "1GB"]]
    assert commands(found[4]) == []


def test_the_changelog_is_by_version_newest_first_and_leads_with_the_packages() -> None:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    headings = re.findall(r"^## (\S+) — ", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert headings and headings[0] == version.split(".dev")[0], (headings[:1], version)
    numbers = [tuple(int(x) for x in h.split(".")) for h in headings]
    assert numbers == sorted(numbers, reverse=True) and len(set(numbers)) == len(numbers), headings
