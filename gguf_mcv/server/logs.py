"""The served app's logging: uvicorn's configuration plus the ``gguf_mcv`` logger, to stderr.

The library stays quiet (``gguf_mcv`` has only a ``NullHandler``) unless an application
configures logging; :func:`~gguf_mcv.server.serve` (and so ``gguf-mcv serve``) is one,
so that answers that fail, kept chats that cannot be written, damaged cache entries
deleted, show in the server's log.
"""

from __future__ import annotations

import copy
import logging.config
from typing import Any

from ..errors import ConfigError


def log_config(level: str = "info") -> dict[str, Any]:
    """uvicorn's logging configuration (a ``dictConfig`` dict) with ``gguf_mcv``'s records at
    ``level`` and above going to stderr too, or, where the root logger has handlers already
    (the application configured logging), to those; :class:`ConfigError` for an unknown level."""
    from uvicorn.config import LOG_LEVELS, LOGGING_CONFIG  # lazy: the server's extra

    if level.lower() not in LOG_LEVELS:
        raise ConfigError(f"Unknown log level {level!r}: use one of {', '.join(LOG_LEVELS)}.")
    config = copy.deepcopy(LOGGING_CONFIG)
    config["formatters"]["gguf_mcv"] = {"()": "uvicorn.logging.DefaultFormatter",
                                        "fmt": "%(levelprefix)s %(name)s: %(message)s", "use_colors": None}
    config["handlers"]["gguf_mcv"] = {"formatter": "gguf_mcv", "class": "logging.StreamHandler",
                                      "stream": "ext://sys.stderr"}
    if logging.getLogger().handlers:  # the application logs already: gguf_mcv's records go its way
        config["loggers"]["gguf_mcv"] = {"level": LOG_LEVELS[level.lower()]}
    else:
        config["loggers"]["gguf_mcv"] = {"handlers": ["gguf_mcv"], "level": LOG_LEVELS[level.lower()]}
    # llama.cpp's own chatter (tens of lines per load) stays for --verbose; its warnings still show
    config["loggers"]["gguf_mcv.llama_log"] = {"level": max(logging.WARNING, LOG_LEVELS[level.lower()])}
    return config


def configure_logging(level: str = "info") -> dict[str, Any]:
    """Apply :func:`log_config` to this process; the configuration, for uvicorn to apply again."""
    config = log_config(level)
    logging.config.dictConfig(config)
    return config
