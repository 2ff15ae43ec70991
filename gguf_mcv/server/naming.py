"""The names a request may use for the served model (catalog names, aliases, Ollama tags)."""

from __future__ import annotations

from pathlib import Path

from ..errors import GgufMcvError
from ..model import Model
from ..models.catalog import CatalogEntry, lookup
from ..models.quants import is_known_quant


def model_names(model: Model, model_name: str | None) -> tuple[str, frozenset[str]]:
    """The served name, and every name (normalised) a request may use for it."""
    info = model.info
    entry = _catalog_entry(info.name, info.repo)
    served = model_name or (entry.name if entry is not None else info.name)
    names = {served, info.name, Path(info.model_path).stem, Path(info.model_path).name}
    if info.repo:
        names.add(info.repo)
    if entry is not None:
        names.update({entry.name, entry.display_name, entry.repo, *entry.aliases})
    # an Ollama-style alias ("minicpm-v:8b") also answers to its bare name, as in Ollama
    names.update(n.partition(":")[0] for n in list(names) if ":" in n and "/" not in n)
    return served, frozenset(normal_name(n) for n in names)


def _catalog_entry(name: str, repo: str | None) -> CatalogEntry | None:
    try:
        return lookup(repo) or lookup(name)
    except (GgufMcvError, OSError):  # a broken user catalog must not stop the server
        return None


def normal_name(name: str) -> str:
    """Case-folded, without an Ollama tag (``:latest``, ``:q4_k_m``…)."""
    name = name.strip().casefold()
    base, sep, tag = name.rpartition(":")
    if sep and "/" not in tag:
        if tag == "latest" or is_known_quant(tag):
            return base
    return name
