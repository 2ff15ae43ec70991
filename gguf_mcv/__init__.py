"""gguf_mcv: run MiniCPM-V vision-language models (GGUF, llama.cpp) on small machines.

    import gguf_mcv
    model = gguf_mcv.load("minicpm-v-2.6")          # picks the quant that fits this machine
    print(model.ask("What is in this picture?", "photo.jpg"))
"""

import logging as _logging
from importlib import metadata as _metadata

from .chat import Chat
from .chat_handler import MiniCPMVChatHandler
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

try:
    __version__ = _metadata.version("gguf-mcv")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

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
