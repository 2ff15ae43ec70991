"""gguf_mcv: run MiniCPM-V vision-language models (GGUF, llama.cpp) on small machines.

    import gguf_mcv
    model = gguf_mcv.load("minicpm-v-2.6")          # picks the quant that fits this machine
    print(model.ask("What is in this picture?", "photo.jpg"))
"""

from .chat_handler import MiniCPMVChatHandler
import logging as _logging

from .embed_cache import EmbeddingCache
from .errors import (
    CatalogError,
    ConfigError,
    ContextOverflowError,
    CorruptModelError,
    DownloadError,
    EngineError,
    GgufMcvError,
    HubAuthError,
    IncompatibleProjectorError,
    MediaError,
    ModelNotFoundError,
    NoQuantFitsError,
    NotEnoughDiskError,
    OfflineError,
)
from .generation import Stream
from .hardware import Hardware, parse_size, probe
from .hub import ModelFiles, pull
from .loader import load
from .media import Image, load_image
from .model import Chat, Model, VideoOptions
from .planner import Plan, plan
from .reply import Reply, Timings, Usage, VideoStats
from .video import Frame, Frames, sample_frames

__version__ = "0.1.0"

# a library stays quiet unless the application configures logging
_logging.getLogger(__name__).addHandler(_logging.NullHandler())

__all__ = [
    "CatalogError", "Chat", "ConfigError", "ContextOverflowError", "CorruptModelError",
    "DownloadError", "EmbeddingCache", "EngineError", "GgufMcvError", "Hardware", "HubAuthError",
    "Image", "IncompatibleProjectorError", "MediaError", "MiniCPMVChatHandler", "Model", "ModelNotFoundError",
    "NoQuantFitsError", "NotEnoughDiskError", "OfflineError", "Plan", "Reply", "Stream", "Timings", "Usage",
    "Frame", "Frames", "ModelFiles", "VideoOptions", "VideoStats", "load", "load_image", "parse_size", "probe",
    "plan", "pull", "sample_frames",
]
