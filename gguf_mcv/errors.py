"""Every error gguf_mcv raises on purpose.

Each class also inherits the built-in exception a caller would naturally catch
(``MediaError`` is a ``ValueError``, ``ModelNotFoundError`` a ``FileNotFoundError``),
so existing ``except`` clauses keep working. Messages say what happened and what
to do about it.
"""

from __future__ import annotations


class GgufMcvError(Exception):
    """Base class of all gguf_mcv errors."""


class MediaError(GgufMcvError, ValueError):
    """An image or video could not be read, decoded or accepted."""


class ModelNotFoundError(GgufMcvError, FileNotFoundError):
    """A model file, catalog name or Hub repository does not exist."""


class CorruptModelError(GgufMcvError, ValueError):
    """A file is not a GGUF file, or is truncated or damaged."""


class IncompatibleProjectorError(GgufMcvError, ValueError):
    """The vision projector (mmproj) does not belong with the text model."""


class ContextOverflowError(GgufMcvError, ValueError):
    """The prompt (text plus image tokens) does not fit in the context window."""


class NoQuantFitsError(GgufMcvError, MemoryError):
    """No quantization of the model fits in the memory budget."""


class NotEnoughDiskError(GgufMcvError, OSError):
    """There is not enough free disk space for a download."""


class DownloadError(GgufMcvError, OSError):
    """A download failed or produced a file that does not verify."""


class HubAuthError(DownloadError, PermissionError):
    """The Hub refused access (401/403): a gated or private repository."""


class OfflineError(DownloadError, ConnectionError):
    """Files are needed from the Hub but it is offline or unreachable."""


class CatalogError(GgufMcvError, ValueError):
    """A model catalog file has an invalid entry."""


class ConfigError(GgufMcvError, ValueError):
    """An impossible or unsupported combination of settings."""


class EngineError(GgufMcvError, RuntimeError):
    """llama.cpp reported a failure while loading or running a model."""


class NativeKernelError(EngineError):
    """A native CPU kernel (llama.cpp's, ONNX Runtime's) crashes on this machine and no safe
    alternative is left; the message names the kernel and the rebuild that avoids it."""


class ModelFileChangedError(GgufMcvError, RuntimeError):
    """A file the loaded model reads its weights from (the GGUF, the mmproj, the ONNX encoder's
    graph or its data) changed on disk since the load; ``path`` names it. Load the model again."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path


class ServerWorkerError(GgufMcvError, RuntimeError):
    """The server's model worker could not load the model, or died again and again while loading it."""


class ModelClosedError(GgufMcvError, RuntimeError):
    """The model was closed; a question (or a stream read after ``close()``) cannot run."""


class ModelBusyError(GgufMcvError, RuntimeError):
    """This thread started a second answer while its first one is still being streamed."""


class BatchInputError(GgufMcvError, ValueError):
    """A batch job's input is not a folder, glob or CSV/JSONL of items (a bad row is only an error row)."""


class OutputError(GgufMcvError, OSError):
    """A batch job's results file cannot be opened, read back or written."""


class OutputBusyError(OutputError):
    """Another batch job is writing the same results file."""


class ClusterError(GgufMcvError, RuntimeError):
    """A Ray cluster could not be joined, or its job failed as a whole (a bad item is only an error row)."""


class SavedChatError(GgufMcvError, ValueError):
    """A saved conversation cannot be used: damaged, of another model, or not one at all."""


class AnswerCancelled(GgufMcvError, RuntimeError):
    """An answer was cancelled (its stream closed, its client gone) before it ended."""


class SourceError(GgufMcvError, OSError):
    """A watched source (camera, video file, stream) could not be opened, or gave frames that cannot be used."""


class SourceLostError(SourceError, ConnectionError):
    """A watched source stopped delivering frames and did not come back in time (unplugged, stream down)."""
