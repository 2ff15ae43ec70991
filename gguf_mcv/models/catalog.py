"""The model catalog: which MiniCPM-V models exist, where their files are, and their numbers.

The bundled ``models.toml`` is read at call time, the user's catalog is merged over it,
and every entry is validated; a bad entry raises :class:`~gguf_mcv.errors.CatalogError`
naming the file, the entry and the field.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
import sys
from dataclasses import MISSING, dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Iterable, Iterator, TypeVar, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, create_model

from .. import environment
from ..errors import CatalogError, ConfigError, ModelNotFoundError
from ..generations import chat_templates
from ..options import Sampling
from .quants import classify_gguf, normalize_quant, sort_by_quality
from .shapes import TextShape, VisionShape

#: Chat-template families the generations use (each rendered by gguf_mcv.prompt.templates.FAMILIES).
CHAT_TEMPLATES: tuple[str, ...] = chat_templates()
SCHEMA_VERSION = 1

_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_M = TypeVar("_M", bound="BaseModel")


@dataclass(frozen=True)
class QuantFile:
    """One GGUF file in the model's Hub repository."""

    file: str
    size: int  #: bytes; see ``exact``
    exact: bool = False  #: True when ``size`` is the file's own byte count, not an estimate


@dataclass(frozen=True)
class CatalogEntry:
    """One model: its Hub repository, files, prompt family and numbers."""

    name: str
    display_name: str
    repo: str
    aliases: tuple[str, ...]
    base_llm: str
    rank: int  #: higher = more capable; ``model="auto"`` prefers it
    chat_template: str
    projector_type: str
    minicpmv_version: int | None
    thinking: bool
    thinking_default: bool
    n_ctx: int
    default_quant: str
    arch: TextShape
    vision: VisionShape
    sampling: Sampling
    mmproj: QuantFile
    quants: dict[str, QuantFile]  #: canonical quant name -> file, worst to best quality
    source: str = field(default="", compare=False)  #: the catalog file that last defined it

    def __hash__(self) -> int:  # quants is a dict, so hash on identity fields
        return hash((self.name, self.repo))

    @property
    def template(self) -> str:
        """The chat-template family (same as ``chat_template``)."""
        return self.chat_template

    def quant_file(self, quant: str) -> QuantFile:
        """The file of ``quant``; ConfigError listing the available quants if absent."""
        q = normalize_quant(quant)
        if q not in self.quants:
            raise ConfigError(
                f"{self.display_name} has no {q} file; available: {', '.join(self.quants)}."
            )
        return self.quants[q]


class Catalog:
    """All known models, looked up by name, alias (case-insensitive) or Hub repo id."""

    def __init__(self, entries: Iterable[CatalogEntry]) -> None:
        self._entries = sorted(entries, key=lambda e: (-e.rank, e.name))
        self._index = {_key(k): e for e in self._entries for k in (e.name, *e.aliases)}

    def find(self, name: str) -> CatalogEntry | None:
        """The entry for a name, alias or repo id, or None."""
        return self._index.get(_key(name)) or self.by_repo(name)

    def get(self, name: str) -> CatalogEntry:
        """The entry for a name, alias or repo id; ModelNotFoundError suggesting close names."""
        entry = self.find(name)
        if entry is None:
            raise ModelNotFoundError(self._not_found(name))
        return entry

    def by_repo(self, repo_id: str) -> CatalogEntry | None:
        """The (highest-ranked) entry whose Hub repository is ``repo_id``, any case."""
        wanted = _key(repo_id).removeprefix("https://huggingface.co/").strip("/")
        return next((e for e in self._entries if e.repo.lower() == wanted), None)

    def entries(self) -> list[CatalogEntry]:
        """Every entry, most capable (highest rank) first."""
        return list(self._entries)

    def names(self) -> list[str]:
        """Every model name, most capable first."""
        return [e.name for e in self._entries]

    def __iter__(self) -> Iterator[CatalogEntry]:
        return iter(self._entries)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.find(name) is not None

    def __len__(self) -> int:
        return len(self._entries)

    def _not_found(self, name: str) -> str:
        close = difflib.get_close_matches(_key(name), list(self._index), n=6, cutoff=0.6)
        names = list(dict.fromkeys(self._index[k].name for k in close))
        hint = f" Did you mean: {', '.join(names)}?" if names else ""
        return (f"Unknown model {name!r}.{hint} Known models: {', '.join(self.names())}. "
                "Add your own in a user catalog ($GGUF_MCV_CATALOG).")


def lookup(name: str | None) -> CatalogEntry | None:
    """The catalog entry for a model name, alias or repo id; None when the catalog has none."""
    return load_catalog().find(name) if name else None


def bundled_catalog_path() -> Path:
    """The ``models.toml`` that ships with gguf_mcv."""
    packaged = resources.files("gguf_mcv") / "models.toml"
    if packaged.is_file():
        return Path(str(packaged))
    # From a source checkout the file is not in the package folder: pyproject's
    # force-include copies the repo-root models.toml into the wheel only.
    return Path(__file__).resolve().parents[2] / "models.toml"


def load_catalog(user_path: str | os.PathLike | None = None) -> Catalog:
    """The bundled catalog merged with the user's (``user_path``, else ``$GGUF_MCV_CATALOG``,
    else ``~/.config/gguf_mcv/models.toml`` when it exists)."""
    bundled = bundled_catalog_path()
    explicit = user_path is not None or bool(os.environ.get(environment.ENV_CATALOG))
    wanted = Path(user_path) if user_path is not None else environment.user_catalog_path()
    user: Path | None = wanted
    if not wanted.is_file():
        if explicit:
            raise CatalogError(f"{wanted}: user catalog not found.")
        user = None
    return _load(bundled, _stamp(bundled), user, _stamp(user) if user else None)


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_mtime_ns, st.st_size


@functools.lru_cache(maxsize=8)
def _load(bundled: Path, _b: tuple, user: Path | None, _u: tuple | None) -> Catalog:
    # The stamps are only cache keys: an edited file has a new one and is read again.
    raw = {_key(k): (k, t) for k, t in _models(_read_toml(bundled), bundled).items()}
    built = {k: _build(name, table, bundled) for k, (name, table) in raw.items()}
    if user is not None:
        for name, table in _models(_read_toml(user), user).items():
            base_name, base = raw.get(_key(name), (name, {}))
            built[_key(name)] = _build(base_name, _merge(base, table), user)
    entries = sorted(built.values(), key=lambda e: e.source == str(user))
    _check_unique(entries)
    return Catalog(entries)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CatalogError(f"{path}: cannot read the catalog: {exc}") from exc
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:  # its message carries the line and column
        raise CatalogError(f"{path}: TOML syntax error: {exc}") from exc


def _models(doc: dict[str, Any], path: Path) -> dict[str, dict[str, Any]]:
    unknown = set(doc) - {"schema_version", "models"}
    if unknown:
        raise CatalogError(f"{path}: unknown top-level key(s) {sorted(unknown)}; "
                           "expected schema_version and [models.<name>] tables.")
    if doc.get("schema_version", SCHEMA_VERSION) != SCHEMA_VERSION:
        raise CatalogError(f"{path}: schema_version {doc['schema_version']!r} is not "
                           f"supported (this gguf_mcv reads {SCHEMA_VERSION}).")
    models = doc.get("models", {})
    if not isinstance(models, dict):
        raise CatalogError(f"{path}: 'models' must be a table of [models.<name>] tables.")
    for name, table in models.items():
        if not isinstance(table, dict):
            raise CatalogError(f"{path}: model {name!r}: must be a [models.{name!r}] table.")
    return models


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``: tables merge key by key, anything else replaces."""
    base, over = _canon_quants(base), _canon_quants(over)
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _canon_quants(table: dict[str, Any]) -> dict[str, Any]:
    quants = table.get("quants")
    if not isinstance(quants, dict):
        return table
    return {**table, "quants": {_canon_or_same(q): v for q, v in quants.items()}}


def _canon_or_same(quant: str) -> str:
    try:
        return normalize_quant(quant)
    except ConfigError:
        return quant  # left for the validator to report with file, entry and field


def _key(name: str) -> str:
    return str(name).strip().lower()


class _Where:
    """Builds the CatalogError that names the file, the entry and the field."""

    def __init__(self, path: Path, model: str) -> None:
        self.path, self.model = path, model

    def fail(self, fld: str, problem: str) -> CatalogError:
        return CatalogError(f"{self.path}: model {self.model!r}, field {fld!r}: {problem.rstrip('.')}. "
                            f"Fix it there (the header of {bundled_catalog_path()} lists the fields).")


_TOML = ConfigDict(extra="forbid", strict=True, str_strip_whitespace=True, str_min_length=1)


def _table(cls: type, *, omit: Iterable[str] = (), required: Iterable[str] = (),
           toml_names: dict[str, str] | None = None, positive: bool = False) -> type[BaseModel]:
    """The pydantic model of the TOML table that describes a ``cls`` (a dataclass): its fields,
    types and defaults, less ``omit``, with ``required`` ones required, the keys the file
    spells differently in ``toml_names`` and, with ``positive``, every integer above 0."""
    hints, names = get_type_hints(cls), toml_names or {}
    spec: dict[str, Any] = {}
    for f in fields(cls):
        if f.name in omit:
            continue
        kind = hints[f.name]
        if positive and kind in (int, int | None):
            kind = Annotated[kind, Field(gt=0)]
        default = ... if f.name in required or f.default is MISSING else f.default
        spec[f.name] = (kind, Field(default, alias=names.get(f.name)))
    return create_model(f"{cls.__name__}Table", __config__=_TOML, **spec)


# The catalog's tables: what the file may say of each type (the rest is derived or measured).
_ARCH = _table(TextShape, omit=("n_ff", "n_merges"), required=("architecture", "n_ctx_train"),
               toml_names={"architecture": "llm_arch"}, positive=True)
_VISION = _table(VisionShape, omit=("heads", "ff", "projector"), positive=True,
                 required=("width", "blocks", "patch_size", "image_size", "query_tokens"))
_SAMPLING = _table(Sampling, omit=("min_p", "seed"),
                   required=("temperature", "top_p", "top_k", "repeat_penalty"))
_FILE = _table(QuantFile, positive=True)


def _hub_repo(repo: str) -> str:
    if not _REPO.match(repo):
        raise ValueError(f"must be a Hub repository id like 'owner/name', got {repo!r}")
    return repo


def _template(family: str) -> str:
    if family not in CHAT_TEMPLATES:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(CHAT_TEMPLATES)}")
    return family


class _Entry(BaseModel):
    """One ``[models."<name>"]`` table as the file spells it; the nested tables are checked
    against their own models (_ARCH, ...) so that an error names its full field."""

    model_config = _TOML

    display_name: str
    repo: Annotated[str, AfterValidator(_hub_repo)]
    aliases: list[str] = []
    base_llm: str
    rank: int = Field(ge=0)  #: higher = more capable
    chat_template: Annotated[str, AfterValidator(_template)]
    projector_type: str
    minicpmv_version: int | None = None
    thinking: bool = False
    thinking_default: bool = False
    n_ctx: int | None = None  #: None: environment.DEFAULT_N_CTX
    default_quant: str | None = None  #: None: environment.DEFAULT_QUANT
    arch: dict[str, Any]
    vision: dict[str, Any]
    sampling: dict[str, Any]
    mmproj: dict[str, Any]
    quants: dict[str, Any]


_KINDS = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
          "string_type": "a string", "list_type": "a list of strings", "dict_type": "a table",
          "model_type": "a table", "string_too_short": "a string that is not empty"}


def _validate(w: _Where, model: type[_M], table: Any, prefix: str = "") -> _M:
    """``table`` validated by ``model``; its first error as the CatalogError naming the field."""
    try:
        return model.model_validate(table)
    except ValidationError as exc:
        err = min(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")  # a typo's own name first
        fld = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
        kind, given = err["type"], err.get("input")
        if kind == "missing":
            raise w.fail(fld, "missing") from None
        if kind == "extra_forbidden":
            known = ", ".join(f.alias or name for name, f in model.model_fields.items())
            raise w.fail(fld, f"unknown field (expected one of: {known})") from None
        if kind == "value_error":
            raise w.fail(fld, str(err["ctx"]["error"])) from None
        problem = f"must be {_KINDS[kind]}" if kind in _KINDS else \
            err["msg"].replace("Input should be", "must be")
        raise w.fail(fld, f"{problem}, got {given!r}") from None


def _build(name: str, table: dict[str, Any], path: Path) -> CatalogEntry:
    w = _Where(path, name)
    top = _validate(w, _Entry, table)
    _check_top(w, top)
    quants = _quants(w, top.quants)
    arch = _arch(w, top.arch)
    n_ctx = top.n_ctx if top.n_ctx is not None else environment.DEFAULT_N_CTX
    if not 0 < n_ctx <= arch.n_ctx_train:
        raise w.fail("n_ctx", f"must be 1 to n_ctx_train ({arch.n_ctx_train}), got {n_ctx}")
    vision = VisionShape(**_validate(w, _VISION, top.vision, "vision").model_dump(),
                         projector=top.projector_type)
    return CatalogEntry(
        name=name, display_name=top.display_name, repo=top.repo, aliases=tuple(top.aliases),
        base_llm=top.base_llm, rank=top.rank, chat_template=top.chat_template,
        projector_type=top.projector_type, minicpmv_version=top.minicpmv_version,
        thinking=top.thinking, thinking_default=top.thinking_default, n_ctx=n_ctx,
        default_quant=_default_quant(w, top.default_quant, quants), arch=arch, vision=vision,
        sampling=_sampling(w, top.sampling), mmproj=_file(w, "mmproj", top.mmproj),
        quants=quants, source=str(path),
    )


def _check_top(w: _Where, top: _Entry) -> None:
    if top.projector_type == "resampler" and top.minicpmv_version is None:
        raise w.fail("minicpmv_version", "missing (required for projector_type 'resampler')")
    if top.thinking_default and not top.thinking:
        raise w.fail("thinking_default", "cannot be true when thinking is false")


def _arch(w: _Where, table: dict[str, Any]) -> TextShape:
    v = _validate(w, _ARCH, table, "arch").model_dump()
    if v["n_kv_layers"] is None:
        v["n_kv_layers"] = v["n_layers"]
    if v["n_kv_layers"] > v["n_layers"]:
        raise w.fail("arch.n_kv_layers", f"cannot exceed n_layers ({v['n_layers']})")
    if v["n_head"] % v["n_head_kv"]:
        raise w.fail("arch.n_head_kv", f"must divide n_head ({v['n_head']}), got {v['n_head_kv']}")
    return TextShape(**v)


def _sampling(w: _Where, table: dict[str, Any]) -> Sampling:
    v = _validate(w, _SAMPLING, table, "sampling").model_dump()
    try:
        return Sampling(**v)  # its own range checks
    except ConfigError as exc:
        name = next((k for k in v if str(exc).startswith(k)), "")
        raise w.fail(f"sampling.{name}", str(exc)) from None


def _file(w: _Where, fld: str, table: Any) -> QuantFile:
    qf = QuantFile(**_validate(w, _FILE, table, fld).model_dump())
    if not qf.file.lower().endswith(".gguf"):
        raise w.fail(fld + ".file", f"must name a .gguf file, got {qf.file!r}")
    return qf


def _quants(w: _Where, table: dict[str, Any]) -> dict[str, QuantFile]:
    if not table:
        raise w.fail("quants", "lists no files")
    out: dict[str, QuantFile] = {}
    for label, spec in table.items():
        try:
            quant = normalize_quant(label)
        except ConfigError as exc:
            raise w.fail(f"quants.{label}", str(exc)) from None
        if quant in out:
            raise w.fail(f"quants.{label}", f"{quant} is listed twice")
        out[quant] = _file(w, f"quants.{label}", spec)
        kind = classify_gguf(out[quant].file)
        named = kind.quant if kind is not None else None
        if named not in (None, quant):
            raise w.fail(f"quants.{label}.file",
                         f"{out[quant].file!r} is named as {named}, not {quant}")
    return {q: out[q] for q in sort_by_quality(list(out))}


def _default_quant(w: _Where, given: str | None, quants: dict[str, QuantFile]) -> str:
    try:
        quant = normalize_quant(given or environment.DEFAULT_QUANT)
    except ConfigError as exc:
        raise w.fail("default_quant", str(exc)) from None
    if quant not in quants:
        reason = "" if given else f" (required because {quant} is not listed)"
        raise w.fail("default_quant",
                     f"{quant} is not in quants{reason}; listed: {', '.join(quants)}")
    return quant


def _check_unique(entries: list[CatalogEntry]) -> None:
    """Names and aliases must be unique case-insensitively across the whole catalog."""
    owner: dict[str, str] = {}
    for e in entries:
        for i, label in enumerate((e.name, *e.aliases)):
            k = _key(label)
            if owner.get(k, e.name) != e.name:
                w = _Where(Path(e.source), e.name)
                fld = "aliases" if i else "name"
                raise w.fail(fld, f"{label!r} is already used by model {owner[k]!r}")
            owner[k] = e.name
