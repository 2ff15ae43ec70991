"""Environment variables and default folders, read at call time.

Code reads these through the functions below, never at import, so tests (and
users) can change the environment after ``import gguf_mcv``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from .errors import ConfigError
from .options import DEFAULT_N_CTX  # noqa: F401  (a default, not a setting: read here by name too)

#: Folder for gguf_mcv's own caches (image embeddings, the self-test model).
ENV_CACHE = "GGUF_MCV_CACHE"
#: A user catalog file that adds to or overrides the bundled ``models.toml``.
ENV_CATALOG = "GGUF_MCV_CATALOG"
#: Root of the file system the hardware probe reads (``/`` unless testing).
ENV_HW_ROOT = "GGUF_MCV_HW_ROOT"

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


#: Seconds one path of the native check may run in its child before it counts as hung.
ENV_NATIVE_TIMEOUT = "GGUF_MCV_NATIVE_TIMEOUT"
DEFAULT_NATIVE_TIMEOUT_S = 60.0
#: The longest limit ``$GGUF_MCV_NATIVE_TIMEOUT`` may set: an hour for a path that takes ~0.1 s.
MAX_NATIVE_TIMEOUT_S = 3600.0


def native_timeout() -> float:
    """``$GGUF_MCV_NATIVE_TIMEOUT`` in seconds (unset or empty: 60); :class:`ConfigError` unless
    it is a number above 0 and at most :data:`MAX_NATIVE_TIMEOUT_S`."""
    raw = os.environ.get(ENV_NATIVE_TIMEOUT, "").strip()
    if not raw:
        return DEFAULT_NATIVE_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_NATIVE_TIMEOUT_S:  # NaN fails this too
        raise ConfigError(f"{ENV_NATIVE_TIMEOUT}={raw!r} is not a number of seconds above 0 and at most "
                          f"{MAX_NATIVE_TIMEOUT_S:g}; set one in that range, or unset it for the default "
                          f"{DEFAULT_NATIVE_TIMEOUT_S:g}.")
    return value
