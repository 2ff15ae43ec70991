"""gguf_mcv: run MiniCPM-V vision-language models (GGUF, llama.cpp) on small machines.

    import gguf_mcv
    model = gguf_mcv.load("minicpm-v-2.6")          # picks the quant that fits this machine
    print(model.ask("What is in this picture?", "photo.jpg"))
"""

import logging as _logging
import sys as _sys
import types as _types
from importlib import import_module as _import_module
from importlib import metadata as _metadata
from typing import TYPE_CHECKING as _TYPE_CHECKING

from .errors import (
    AnswerCancelled,
    BatchInputError,
    CatalogError,
    ClusterError,
    ConfigError,
    ContextOverflowError,
    CorruptModelError,
    DownloadError,
    EngineError,
    GgufMcvError,
    HubAuthError,
    IncompatibleProjectorError,
    MediaError,
    ModelBusyError,
    ModelClosedError,
    ModelFileChangedError,
    ModelNotFoundError,
    NativeKernelError,
    NoQuantFitsError,
    NotEnoughDiskError,
    OfflineError,
    OutputBusyError,
    OutputError,
    SavedChatError,
    ServerWorkerError,
    SourceError,
    SourceLostError,
)

# The public names below are imported when first used, not with the package: the package's own
# child processes (the native check, the ONNX conversion, the speed probe) import one module of it
# and would otherwise pay for all of it (about 0.9 s each).
if _TYPE_CHECKING:
    from .chat import Chat
    from .chat_handler import MiniCPMVChatHandler
    from .hardware import Hardware, probe
    from .jobs import batch
    from .loader import checked_llama, load
    from .model import Model, ModelInfo
    from .options import Sampling, SamplingKeywords
    from .planning.planner import Plan
    from .prompt.messages import MediaPolicy
    from .prompt.turns import Turn, VideoOptions
    from .reply import Progress, Reply, Timings, Usage, VideoStats
    from .resolver import ModelFiles, plan, pull
    from .runtime.generation import Stream
    from .units import format_size, parse_size
    from .vision.embed_cache import EmbeddingCache
    from .vision.media import Image, load_image
    from .vision.video import Frame, Frames, sample_frames
    from .watch import Observation, watch

#: each lazily imported public name -> the module (relative to this package) that defines it
_LAZY = {
    "Chat": ".chat",
    "MiniCPMVChatHandler": ".chat_handler",
    "Hardware": ".hardware",
    "probe": ".hardware",
    "batch": ".jobs",
    "checked_llama": ".loader",
    "load": ".loader",
    "Model": ".model",
    "ModelInfo": ".model",
    "Sampling": ".options",
    "SamplingKeywords": ".options",
    "Plan": ".planning.planner",
    "MediaPolicy": ".prompt.messages",
    "Turn": ".prompt.turns",
    "VideoOptions": ".prompt.turns",
    "Progress": ".reply",
    "Reply": ".reply",
    "Timings": ".reply",
    "Usage": ".reply",
    "VideoStats": ".reply",
    "ModelFiles": ".resolver",
    "plan": ".resolver",
    "pull": ".resolver",
    "Stream": ".runtime.generation",
    "format_size": ".units",
    "parse_size": ".units",
    "EmbeddingCache": ".vision.embed_cache",
    "Image": ".vision.media",
    "load_image": ".vision.media",
    "Frame": ".vision.video",
    "Frames": ".vision.video",
    "sample_frames": ".vision.video",
    "Observation": ".watch",
    "watch": ".watch",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    found = _import_module(module, __name__)
    # `batch` is a module of its own (gguf_mcv.jobs.batch), the rest names in their modules
    value = getattr(found, name) if hasattr(found, name) else _import_module(f"{module}.{name}", __name__)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


class _Package(_types.ModuleType):
    """This package's module type: ``gguf_mcv.watch`` stays the function when the subpackage of
    the same name is first imported (the import system then binds the subpackage as an attribute
    of its parent, which would hide the function)."""

    @property
    def watch(self) -> object:
        from .watch import watch

        return watch

    @watch.setter
    def watch(self, value: object) -> None:
        pass  # the subpackage stays reachable as sys.modules["gguf_mcv.watch"] and by import


try:
    __version__ = _metadata.version("gguf-mcv")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

_sys.modules[__name__].__class__ = _Package

# a library stays quiet unless the application configures logging
_logging.getLogger(__name__).addHandler(_logging.NullHandler())

__all__ = [
    "AnswerCancelled", "CatalogError", "Chat", "ConfigError", "ContextOverflowError", "CorruptModelError",
    "DownloadError", "EmbeddingCache", "EngineError", "Frame", "Frames", "GgufMcvError", "Hardware",
    "HubAuthError", "Image", "IncompatibleProjectorError", "MediaError", "MediaPolicy",
    "MiniCPMVChatHandler", "Model", "ModelBusyError", "ModelClosedError", "ModelFiles", "ModelInfo",
    "ModelNotFoundError", "NoQuantFitsError", "NotEnoughDiskError", "OfflineError", "Plan", "Progress",
    "Reply", "Sampling", "SavedChatError", "Stream", "Timings", "Turn", "Usage", "VideoOptions", "VideoStats", "load",
    "format_size", "load_image", "parse_size", "plan", "probe", "pull", "sample_frames",
]
__all__ += ["ModelFileChangedError", "NativeKernelError", "checked_llama"]  # native faults, files changed under a model
__all__ += ["BatchInputError", "ClusterError", "OutputBusyError", "OutputError", "batch"]  # batch jobs
__all__ += ["ServerWorkerError"]  # the served model's worker process
__all__ += ["SamplingKeywords"]  # the sampling keywords of every question, for typed wrappers
__all__ += ["Observation", "SourceError", "SourceLostError", "watch"]  # watching a camera or stream
