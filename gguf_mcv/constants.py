"""Environment variables and default folders, read at call time.

Code reads these through the functions below, never at import, so tests (and
users) can change the environment after ``import gguf_mcv``.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Folder for gguf_mcv's own caches (image embeddings, the self-test model).
ENV_CACHE = "GGUF_MCV_CACHE"
#: A user catalog file that adds to or overrides the bundled ``models.toml``.
ENV_CATALOG = "GGUF_MCV_CATALOG"
#: Root of the file system the hardware probe reads (``/`` unless testing).
ENV_HW_ROOT = "GGUF_MCV_HW_ROOT"

DEFAULT_N_CTX = 4096
DEFAULT_QUANT = "Q4_K_M"


def cache_dir() -> Path:
    """gguf_mcv's cache folder: ``$GGUF_MCV_CACHE``, else ``$XDG_CACHE_HOME/gguf_mcv``."""
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "gguf_mcv"


def config_dir() -> Path:
    """gguf_mcv's config folder: ``$XDG_CONFIG_HOME/gguf_mcv`` (``~/.config/gguf_mcv``)."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base).expanduser() / "gguf_mcv"


def user_catalog_path() -> Path:
    """The user catalog file: ``$GGUF_MCV_CATALOG``, else ``<config_dir>/models.toml``."""
    if os.environ.get(ENV_CATALOG):
        return Path(os.environ[ENV_CATALOG]).expanduser()
    return config_dir() / "models.toml"


def hardware_root() -> Path:
    """Root the hardware probe reads ``/proc``, ``/sys`` and ``/etc`` under."""
    return Path(os.environ.get(ENV_HW_ROOT) or "/")


#: Set (to anything but 0/false/no) to skip the speed probe: the speed model then uses
#: :data:`gguf_mcv.planning.speed.DEFAULT_RATES`.
ENV_NO_PROBE = "GGUF_MCV_NO_PROBE"


def no_probe() -> bool:
    """Whether ``$GGUF_MCV_NO_PROBE`` asks for the default speed constants instead of a probe."""
    return os.environ.get(ENV_NO_PROBE, "").strip().lower() not in ("", "0", "false", "no")
