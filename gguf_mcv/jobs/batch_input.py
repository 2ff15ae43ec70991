"""What a batch job answers: a folder, glob or file of images and videos, or CSV/JSONL rows → :class:`Item` values.

Each item is one question about one image or video, with the key that makes a
job resumable: a SHA-256 of the media file's bytes, its kind, the prompt, the
schema and the options (:func:`keyed`), and, once the job knows its model, what of the
model changes an answer: its files, vision encoder and defaults (:func:`answer_identity`,
:func:`for_model`). A row that cannot
be read (bad JSON, wrong-typed or unknown fields, a row too long or nested too deep, a
missing file) is still an item: it carries its ``problem`` and is recorded as an error
row, never the end of the job. Only a source that is not a batch input at all raises
:class:`~gguf_mcv.errors.BatchInputError`. A CSV whose rows run over several lines (a
quoted field with line ends: often a stray quote swallowing the rows after it) is logged
as a warning.
"""

from __future__ import annotations

import csv
import dataclasses
import glob
import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Iterable, Iterator, Sequence

from ..errors import BatchInputError, ConfigError, GgufMcvError, MediaError
from ..models.identity import file_identity
from ..vision.media import local_path, regular_file

if TYPE_CHECKING:
    from ..model import Model

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff",
                            ".ppm", ".pgm", ".pbm", ".jfif", ".heic", ".avif"})
VIDEO_SUFFIXES = frozenset({".mp4", ".avi", ".mkv", ".webm", ".mov", ".m4v", ".mpg", ".mpeg", ".wmv"})
#: A CSV/JSONL row longer than this is refused (as an error row): a mistake, not a question.
MAX_ROW_BYTES = 1024 * 1024
#: A row (or schema) nested deeper than this is refused (as an error row): no question needs it,
#: and deeper data overflows Python's recursion in the JSON codec and the schema compiler.
MAX_NESTING = 64
#: Options a row (or the job) may set for any item, and for one kind only.
COMMON_OPTIONS = frozenset({"max_tokens", "temperature", "top_p", "top_k", "repeat_penalty", "seed",
                            "stop", "system"})
IMAGE_OPTIONS = COMMON_OPTIONS | {"detail", "max_slices"}
VIDEO_OPTIONS = COMMON_OPTIONS | {"max_frames", "fps", "dedupe", "timestamps"}
#: Row fields that are not options.
ROW_FIELDS = frozenset({"image", "video", "prompt", "schema", "id"})
_INT_OPTIONS = frozenset({"max_tokens", "top_k", "seed", "max_slices", "max_frames"})
_FLOAT_OPTIONS = frozenset({"temperature", "top_p", "repeat_penalty", "fps"})
_BOOL_OPTIONS = frozenset({"dedupe", "timestamps"})
_HASH_CHUNK = 1024 * 1024


@dataclass(frozen=True)
class Item:
    """One question about one image or video.

    ``input`` names it as the source did (a path, or ``rows.csv:7`` for a row that
    could not be read); ``problem`` is the error to record instead of answering.
    ``key`` is empty until :func:`keyed` fills it.
    """

    input: str
    kind: str  # "image" or "video"; "" for a row that could not be read
    prompt: str
    path: Path | None = None
    schema: dict[str, Any] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    id: Any = None
    problem: GgufMcvError | None = None
    key: str = ""


def collect(source: str | os.PathLike, *, prompts: Sequence[str] = (), schema: dict[str, Any] | None = None,
            options: dict[str, Any] | None = None) -> list[Item]:
    """The items of ``source``: a folder (searched recursively), a glob, one image or video,
    or a ``.csv`` / ``.jsonl`` file of rows.

    Media files are asked each of ``prompts`` in turn (all prompts about one file before
    the next file, so the embedding cache serves the later ones). Rows bring their own
    ``prompt`` (else each of ``prompts``), ``schema`` (else ``schema``) and options (over
    ``options``). Items come back keyed (:func:`keyed`), in order.
    """
    prompts = [_job_prompt(p) for p in prompts]
    defaults = _job_options(options or {})
    if schema is not None:
        _nested_at_most(schema, "The job's schema")
    path = Path(source)
    if str(source) == "":
        raise BatchInputError("The batch input is empty: name a folder, a glob, or a .csv/.jsonl file.")
    if path.is_dir():
        items = _media_items(_scan(path), prompts, schema, defaults, str(source))
    elif path.suffix.lower() in (".csv", ".jsonl", ".ndjson") and path.exists():
        items = list(_row_items(path, prompts, schema, defaults))
    elif path.exists():
        items = _media_items([path], prompts, schema, defaults, str(source))
    elif glob.has_magic(str(source)):
        items = _media_items([p for p in _glob(str(source)) if _kind(p)], prompts, schema, defaults, str(source))
    else:
        raise BatchInputError(f"Batch input {source} does not exist: name a folder, a glob such as "
                              "'photos/*.jpg', or a .csv/.jsonl file of rows.")
    cache: dict[Path, str] = {}
    return [keyed(item, cache) for item in items]


def keyed(item: Item, digests: dict[Path, str] | None = None) -> Item:
    """``item`` with its ``key``: SHA-256 of the media bytes, kind, prompt, schema and options.

    A file that cannot be read becomes the item's ``problem`` (keyed by its path, so a
    file added later is answered on a rerun). ``digests`` caches file digests by path.
    """
    if item.key:
        return item
    problem, media = item.problem, ""
    if problem is None and item.path is not None:
        try:
            media = digests[item.path] if digests and item.path in digests else file_digest(item.path)
            if digests is not None:
                digests[item.path] = media
        except MediaError as exc:
            problem = exc
    if problem is not None:
        media = "unreadable:" + item.input
    text = json.dumps([media, item.kind, item.prompt, item.schema, item.options, item.id],
                      sort_keys=True, ensure_ascii=False, default=repr)
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    return replace(item, key=digest, problem=problem)


def model_identity(model_path: str | os.PathLike, mmproj_path: str | os.PathLike) -> str:
    """The identity of a text model and its projector for batch keys: both files' SHA-256."""
    return f"{file_identity(model_path)}+{file_identity(mmproj_path)}"


def answer_identity(model: "Model") -> str:
    """Everything about a loaded ``model`` that changes its answers, for batch keys (:func:`for_model`).

    The text model's and the mmproj's SHA-256 (:func:`model_identity`); who encodes images
    (``llama.cpp`` or ``onnx-fp32`` / ``onnx-int8``) from which file — libmtmd's mmproj, a BF16
    copy's SHA-256 when it encodes with one, the converted graph's version for ONNX — and, for
    int8, what the graph quantizes (its scope); whether the encoder runs on a GPU (``detail="auto"``
    cuts 9 slices there, 4 on a CPU); the chat template and the thinking default; the model's
    sampling defaults, which an item's own options override; the context size (a video is thinned to
    fit it); the default ``max_tokens`` and this machine's default video frame cap. Where an ONNX
    encoder keeps its weights (``vision_weights``) is left out: packed and mapped weights are the
    same numbers, so they give the same answers.
    """
    from ..models.headers import read_projector_header
    from ..options import DEFAULT_MAX_TOKENS
    from ..vision.video import default_max_frames

    info, engine = model.info, model.engine
    vision: dict[str, Any] = {"backend": engine.vision_backend, "encoder": engine.mmproj_id,
                              "gpu": info.vision_gpu}
    if engine.vision_backend.startswith("onnx-"):
        from ..vision import onnx_vision  # loaded already: the model runs it

        vision["graph"] = onnx_vision.MANIFEST_VERSION
        if engine.vision_backend == "onnx-int8":
            vision["int8_scope"] = onnx_vision.int8_scope(read_projector_header(info.mmproj_path).projector_type)
    template = model.template
    settings = {
        "files": model_identity(info.model_path, info.mmproj_path),
        "vision": vision,
        "template": hashlib.sha256("\0".join((template.source, template.bos_token, template.eos_token))
                                   .encode("utf-8", "surrogatepass")).hexdigest(),
        "thinking": info.thinking_default if info.can_think else None,
        "sampling": dataclasses.asdict(model.sampling),
        "n_ctx": info.n_ctx,
        "max_tokens": DEFAULT_MAX_TOKENS,
        "max_frames": default_max_frames(),
    }
    return json.dumps(settings, sort_keys=True)


def for_model(items: Iterable[Item], model: str) -> list[Item]:
    """``items`` (keyed first, :func:`keyed`) with keys for answers by ``model``
    (:func:`answer_identity`, or :func:`model_identity` and the load's settings on Ray): the same
    question asked of other model files, or with another vision encoder, is another row."""
    return [replace(k, key=hashlib.sha256(f"{k.key}:{model}".encode()).hexdigest())
            for k in map(keyed, items)]


def file_digest(path: Path) -> str:
    """SHA-256 of a regular file's bytes; :class:`MediaError` if it cannot be read."""
    regular_file(path, "Media")  # a FIFO or a device would block or never end
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
                h.update(chunk)
    except OSError as exc:
        raise MediaError(f"Media file {path} cannot be read ({exc.strerror or exc}).") from None
    return h.hexdigest()


# --- media files ---------------------------------------------------------------------


def _scan(folder: Path) -> list[Path]:
    """Image and video files under ``folder`` (hidden ones skipped), sorted."""
    found = []
    for p in folder.rglob("*"):
        if any(part.startswith(".") for part in p.relative_to(folder).parts):
            continue
        if _kind(p) and not p.is_dir():
            found.append(p)
    return sorted(found)


def _glob(pattern: str) -> list[Path]:
    """The paths ``pattern`` matches (``**``: any depth), sorted, hidden ones skipped.

    pathlib's glob, not :func:`glob.glob`: its ``**`` does not descend into symlinked
    folders, so a link to a folder above it cannot make the search endless.
    """
    parts = Path(pattern).parts
    first = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    root = Path(*parts[:first]) if first else Path()
    try:
        found = [p for p in root.glob(str(Path(*parts[first:])))
                 if not any(part.startswith(".") for part in p.relative_to(root).parts)]
    except (OSError, ValueError) as exc:
        raise BatchInputError(f"Batch input {pattern} cannot be searched ({exc}).") from None
    return sorted(found)


def _kind(path: Path) -> str:
    suffix = path.suffix.lower()
    return "image" if suffix in IMAGE_SUFFIXES else "video" if suffix in VIDEO_SUFFIXES else ""


def _media_items(paths: Iterable[Path], prompts: list[str], schema: dict[str, Any] | None,
                 defaults: dict[str, Any], source: str) -> list[Item]:
    paths = list(paths)
    if not paths:
        raise BatchInputError(f"No image or video files in {source} (looked for "
                              f"{', '.join(sorted(IMAGE_SUFFIXES | VIDEO_SUFFIXES))}).")
    if not prompts:
        raise BatchInputError("Images and videos need a question: give --prompt (several allowed).")
    items = []
    for path in paths:
        kind = _kind(path) or "image"
        for prompt in prompts:
            items.append(Item(str(path), kind, prompt, path.absolute(), schema, _for_kind(defaults, kind)))
    return items


# --- rows ------------------------------------------------------------------------------


def _row_items(path: Path, prompts: list[str], schema: dict[str, Any] | None,
               defaults: dict[str, Any]) -> Iterator[Item]:
    csv_file = path.suffix.lower() == ".csv"
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise BatchInputError(f"Batch input {path} cannot be read ({exc.strerror or exc}).") from None
    with f:
        rows = _csv_rows(f, path) if csv_file else _jsonl_rows(f, path)
        for where, row in rows:
            if isinstance(row, GgufMcvError):
                yield Item(where, "", "", problem=row)
                continue
            try:
                yield from _from_row(row, where, path.parent.absolute(), prompts, schema, defaults, csv_file)
            except GgufMcvError as exc:
                yield Item(where, "", _text_or_empty(row.get("prompt")), problem=exc)


def _jsonl_rows(f: IO[bytes], path: Path) -> Iterator[tuple[str, dict[str, Any] | GgufMcvError]]:
    number = 0
    while True:
        line = f.readline(MAX_ROW_BYTES + 1)
        if not line:
            return
        number += 1
        where = f"{path}:{number}"
        if len(line) > MAX_ROW_BYTES and not line.endswith(b"\n"):
            while (rest := f.readline(_HASH_CHUNK)) and not rest.endswith(b"\n"):
                pass  # skip the rest of the over-long row without holding it
            yield where, ConfigError(f"Row {where} is longer than {MAX_ROW_BYTES} bytes; split it or "
                                     "put the schema in a file.")
            continue
        if not line.strip():
            continue
        try:
            value = _nested_at_most(json.loads(line.decode("utf-8")), f"Row {where}")
        except ConfigError as exc:
            yield where, exc
            continue
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            yield where, ConfigError(f"Row {where} is not valid JSON ({exc}).")
            continue
        if not isinstance(value, dict):
            yield where, ConfigError(f"Row {where} is a JSON {type(value).__name__}; each row must be "
                                     'an object such as {"image": "a.jpg", "prompt": "..."}.')
            continue
        yield where, value


def _csv_rows(f: IO[bytes], path: Path) -> Iterator[tuple[str, dict[str, Any] | GgufMcvError]]:
    import io

    text = io.TextIOWrapper(f, encoding="utf-8-sig", errors="surrogateescape", newline="")
    reader = csv.reader(text)
    try:
        header = next(reader)
    except StopIteration:
        raise BatchInputError(f"Batch input {path} is empty: a CSV needs a header row such as "
                              "'image,prompt'.") from None
    except csv.Error as exc:
        raise BatchInputError(f"Batch input {path} has an unreadable header row ({exc}).") from None
    header = [h.strip() for h in header]
    if not {"image", "video"} & set(header):
        raise BatchInputError(f"Batch input {path} has no 'image' or 'video' column (header: "
                              f"{', '.join(header)[:200]}).")
    unknown = sorted(set(header) - ROW_FIELDS - IMAGE_OPTIONS - VIDEO_OPTIONS)
    if unknown or len(set(header)) != len(header):
        problem = f"unknown column(s) {', '.join(unknown)[:200]}" if unknown else "a column named twice"
        raise BatchInputError(f"Batch input {path} has {problem}; columns may be "
                              f"{', '.join(sorted(ROW_FIELDS | IMAGE_OPTIONS | VIDEO_OPTIONS))}.")
    spans: list[tuple[int, int]] = []  # first and last line of rows that run over several lines
    while True:
        first = reader.line_num + 1
        try:
            cells = next(reader)
        except StopIteration:
            _warn_spans(path, spans)
            return
        except csv.Error as exc:
            yield f"{path}:{reader.line_num}", ConfigError(f"Row {path}:{reader.line_num} is not valid CSV ({exc}).")
            continue
        where = f"{path}:{reader.line_num}"
        if reader.line_num > first:
            spans.append((first, reader.line_num))
        if not any(c.strip() for c in cells):
            continue
        if len(cells) > len(header):
            yield where, ConfigError(f"Row {where} has {len(cells)} cells but the header names {len(header)}.")
            continue
        yield where, {h: c for h, c in zip(header, cells, strict=False) if c.strip() != ""}


def _warn_spans(path: Path, spans: list[tuple[int, int]]) -> None:
    if spans:
        first, last = spans[0]
        log.warning("%s: %d row(s) run over several lines (the first: lines %d-%d), read as one row each. "
                    "If that was not meant, a stray quote (\") swallowed the rows after it: fix the file.",
                    path, len(spans), first, last)


def _nested_at_most(value: Any, what: str) -> Any:
    """``value`` (parsed JSON) unless it is nested deeper than :data:`MAX_NESTING`: ConfigError."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        if children and depth >= MAX_NESTING:
            raise ConfigError(f"{what} is nested more than {MAX_NESTING} levels deep; flatten it.")
        stack.extend((child, depth + 1) for child in children)
    return value


def _from_row(row: dict[str, Any], where: str, base: Path, prompts: list[str],
              schema: dict[str, Any] | None, defaults: dict[str, Any], from_csv: bool) -> list[Item]:
    unknown = sorted(set(row) - ROW_FIELDS - IMAGE_OPTIONS - VIDEO_OPTIONS)
    if unknown:
        raise ConfigError(f"Row {where} has unknown field(s) {', '.join(map(str, unknown))[:200]}; known: "
                          f"{', '.join(sorted(ROW_FIELDS | IMAGE_OPTIONS | VIDEO_OPTIONS))}.")
    kinds = [k for k in ("image", "video") if row.get(k) is not None]
    if len(kinds) != 1:
        raise ConfigError(f"Row {where} must name exactly one of 'image' or 'video'.")
    kind = kinds[0]
    name = row[kind]
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"Row {where}: {kind} must be a file path (a non-empty string), "
                          f"not {type(name).__name__}.")
    media = local_path(name, "Media file")
    if not media.is_absolute():
        media = base / media
    row_options = {k: v for k, v in row.items() if k not in ROW_FIELDS}
    allowed = IMAGE_OPTIONS if kind == "image" else VIDEO_OPTIONS
    wrong = sorted(set(row_options) - allowed)
    if wrong:
        raise ConfigError(f"Row {where}: {', '.join(wrong)} does not apply to a {kind}.")
    if from_csv:
        row_options = {k: _from_cell(k, v) for k, v in row_options.items()}
    options = {**_for_kind(defaults, kind), **row_options}
    row_schema = _row_schema(row.get("schema"), where, base) if "schema" in row else schema
    if "prompt" in row:
        asked = [_row_prompt(row["prompt"], where)]
    elif prompts:
        asked = prompts
    else:
        raise ConfigError(f"Row {where} has no prompt and the job gives none (--prompt).")
    row_id = row.get("id")
    if row_id is not None and (not isinstance(row_id, (str, int, float)) or isinstance(row_id, bool)
                               or (isinstance(row_id, float) and not math.isfinite(row_id))):
        raise ConfigError(f"Row {where}: id must be a string or a finite number, not {row_id!r:.50}.")
    return [Item(name, kind, p, media, row_schema, options, row_id) for p in asked]


def _row_prompt(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"Row {where}: prompt must be a non-empty string, not {type(value).__name__}.")
    return value


def _row_schema(value: Any, where: str, base: Path) -> dict[str, Any]:
    """A row's schema: a JSON object, JSON text, or the path of a .json file."""
    if isinstance(value, str):
        text = value.strip()
        if not text.startswith("{"):
            return load_schema(base / text)
        try:
            value = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise ConfigError(f"Row {where}: schema is not valid JSON ({exc}).") from None
        _nested_at_most(value, f"Row {where}: the schema")
    if not isinstance(value, dict):
        raise ConfigError(f"Row {where}: schema must be a JSON object or a .json file, "
                          f"not {type(value).__name__}.")
    return value


def load_schema(path: str | Path) -> dict[str, Any]:
    """A JSON schema read from a file; :class:`ConfigError` if it is not one."""
    try:
        regular_file(Path(path), "Schema")
        with open(path, "rb") as f:
            data = f.read(MAX_ROW_BYTES + 1)
    except (OSError, MediaError) as exc:
        raise ConfigError(f"Schema file {path} cannot be read ({exc}).") from None
    if len(data) > MAX_ROW_BYTES:
        raise ConfigError(f"Schema file {path} is larger than {MAX_ROW_BYTES} bytes.")
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ConfigError(f"Schema file {path} is not valid JSON ({exc}).") from None
    _nested_at_most(value, f"Schema file {path}")
    if not isinstance(value, dict):
        raise ConfigError(f"Schema file {path} holds a JSON {type(value).__name__}, not an object.")
    return value


def _from_cell(name: str, text: str) -> Any:
    """A CSV cell (text) as the option's type."""
    text = text.strip()
    try:
        if name in _INT_OPTIONS:
            return int(text)
        if name in _FLOAT_OPTIONS:
            return float(text)
    except ValueError:
        kind = "an integer" if name in _INT_OPTIONS else "a number"
        raise ConfigError(f"{name} must be {kind}, not {text[:50]!r}.") from None
    if name in _BOOL_OPTIONS:
        lowered = text.lower()
        if lowered not in ("true", "false", "1", "0", "yes", "no"):
            raise ConfigError(f"{name} must be true or false, not {text[:50]!r}.")
        return lowered in ("true", "1", "yes")
    return text


def _for_kind(options: dict[str, Any], kind: str) -> dict[str, Any]:
    allowed = IMAGE_OPTIONS if kind == "image" else VIDEO_OPTIONS
    return {k: v for k, v in options.items() if k in allowed}


def _job_options(options: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(options) - IMAGE_OPTIONS - VIDEO_OPTIONS)
    if unknown:
        raise ConfigError(f"Unknown batch option(s) {', '.join(map(str, unknown))}; known: "
                          f"{', '.join(sorted(IMAGE_OPTIONS | VIDEO_OPTIONS))}.")
    return {k: v for k, v in options.items() if v is not None}


def _job_prompt(prompt: Any) -> str:
    if not isinstance(prompt, str) or not prompt.strip():
        raise ConfigError(f"A batch prompt must be a non-empty string, not {prompt!r:.50}.")
    return prompt


def _text_or_empty(value: Any) -> str:
    return value if isinstance(value, str) else ""
