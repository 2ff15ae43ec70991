"""The everyday API: a loaded :class:`Model` answers questions; :class:`Chat` keeps a conversation.

A ``Model`` owns one llama.cpp context. Calls from several Python threads are
serialised: one question is evaluated at a time, the others wait (a stream holds
the model from its first piece until it ends or is closed). A second answer
started in the thread that is still streaming the first raises
:class:`~gguf_mcv.errors.ModelBusyError` instead of mixing the two.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import llama_log
from .chat import Chat, chat_settings
from .errors import ConfigError, ContextOverflowError, EngineError, ModelClosedError, SavedChatError
from .options import (
    DEFAULT_MAX_TOKENS,
    Sampling,
)
from .prompt.templates import ChatTemplate
from .prompt.turns import Images, Turn, TurnBuilder, VideoOptions, as_image_list
from .questions import Questions
from .runtime import kv_store, memory_store, saved_chat
from .runtime.engine import Engine, file_identity
from .runtime.generation import AnswerLock, SharedAnswerLock
from .runtime.sequence import StateStore
from .runtime.slots import Scheduler
from .vision.media import Image, ImageInput

if TYPE_CHECKING:
    from .planning.planner import Plan

if sys.version_info >= (3, 11):
    pass
else:  # a dependency on 3.10 (pyproject.toml)
    pass

__all__ = ["Chat", "Model", "ModelInfo", "VideoOptions", "DEFAULT_MAX_TOKENS"]



@dataclass(frozen=True)
class ModelInfo:
    """What was loaded: names, files, and the model family's traits."""

    name: str
    model_path: str
    mmproj_path: str
    quant: str | None
    repo: str | None
    template_origin: str
    can_think: bool
    thinking_default: bool
    n_ctx: int
    slice_size: int
    vision_gpu: bool = False
    vision_backend: str = "llama.cpp"  #: "llama.cpp", "onnx-int8" or "onnx-fp32"
    vision_backend_reason: str = ""  #: why that backend (``vision_backend="auto"`` decides)
    parallel: int = 1  #: answers run at once (parallel slots; 1: one after another)
    plan: Plan | None = None  #: the plan this load carried out (:func:`gguf_mcv.plan`'s kind)


class Model(Questions):
    """A loaded MiniCPM-V model. Use :func:`gguf_mcv.load` to make one."""

    def __init__(
        self,
        engine: Engine,
        *,
        info: ModelInfo,
        template: ChatTemplate,
        sampling: Sampling,
        allow_remote_media: bool = False,
        verbose: bool = False,
        scheduler: Scheduler | None = None,
    ) -> None:
        self._engine = engine
        self.info = info
        self.template = template
        self.sampling = sampling
        self.allow_remote_media = allow_remote_media
        self._verbose = verbose
        #: the parallel slots (``load(..., parallel=N)`` with N > 1), else None
        self.scheduler = scheduler
        self._lock = AnswerLock() if scheduler is None else SharedAnswerLock()
        self._identity: dict[str, Any] | None = None
        self._kept_on_disk: kv_store.KVStore | None = None  # keep_chats
        self._kept_in_memory: memory_store.MemoryKVStore | None = None  # keep_chats_in_memory
        #: builds the turns of every question (see :class:`gguf_mcv.prompt.turns.TurnBuilder`)
        self.turns = TurnBuilder(engine, template, n_ctx=info.n_ctx, can_think=info.can_think,
                                 thinking_default=info.thinking_default, vision_gpu=info.vision_gpu,
                                 allow_remote_media=allow_remote_media, name=info.name, lock=self._lock)

    # -- questions ------------------------------------------------------------

    def chat(self, system: str | None = None, thinking: bool | None = None, *,
             overflow: str = "drop_oldest", keep_first: int = 0, context_shift: bool = True) -> Chat:
        """Start a conversation (see :class:`Chat` for ``overflow``, ``keep_first`` and
        ``context_shift``)."""
        return Chat(self, system=system, thinking=thinking, overflow=overflow, keep_first=keep_first,
                    context_shift=context_shift)

    def load_chat(self, path: str | os.PathLike) -> Chat:
        """The conversation :meth:`Chat.save` wrote to ``path``, ready to continue.

        Its KV state is put back into this model's cache, so the next question evaluates
        only its own tokens (a file saved without a state evaluates the conversation again,
        images from the embedding cache when they are there). :class:`SavedChatError` when
        the file is damaged, truncated or not a saved chat (a turn's text holding control
        tokens, or media markers that are not its images', counts as damaged), or was saved
        with another text model, quant, projector or vision backend, or holds more than
        ``n_ctx`` positions.
        """
        engine = self.engine
        saved = saved_chat.read(path, n_vocab=int(engine.llama.n_vocab()), n_ctx=self.info.n_ctx)
        saved_chat.check_model(saved.model, self.identity(), path)
        saved_chat.check_turns(saved.turns, engine.marker, path)
        chat = Chat(self, **chat_settings(saved.settings, path))
        chat._turns = [Turn(role, text, images) for role, text, images in saved.turns]
        if saved.kv is not None and self.scheduler is None:  # slots: the turns are evaluated again
            with self._lock.hold():
                try:
                    self.engine.restore_state(saved.kv)
                except (EngineError, ContextOverflowError) as exc:
                    raise SavedChatError(
                        f"{path}: this model's context cannot take the saved KV state ({exc}). Load the model "
                        "with the n_ctx, KV cache type and flash-attention setting it was saved with."
                    ) from exc
                chat._kv_units = self.engine.units
        return chat

    def keep_chats(self, directory: str | os.PathLike, *, max_bytes: int = kv_store.DEFAULT_MAX_BYTES,
                   min_positions: int = kv_store.MIN_POSITIONS) -> kv_store.KVStore:
        """Keep the KV state of a conversation in ``directory`` when another one is about to
        overwrite it (in a slot, or the single sequence), and restore it when a later prompt
        starts with more of it than the cache holds (see :mod:`gguf_mcv.runtime.kv_store`). The folder
        is capped at ``max_bytes`` (least recently used entries go first); states losing fewer
        than ``min_positions`` positions are not kept; :meth:`keep_idle` keeps what the cache
        holds now (a server calls it as it stops). With :meth:`keep_chats_in_memory` as well,
        RAM is looked in first. Returns the store (its ``counts``); :class:`ConfigError` if the
        folder cannot be used or one is already attached."""
        if self._kept_on_disk is not None:
            raise ConfigError(f"This model already keeps its conversations in {self._kept_on_disk.directory}.")
        engine = self.engine
        store = kv_store.KVStore(directory, self.identity(), n_vocab=int(engine.llama.n_vocab()),
                                 n_ctx=self.info.n_ctx, max_bytes=max_bytes, min_positions=min_positions)
        self._kept_on_disk = store
        self._attach_stores(engine)
        return store

    def keep_chats_in_memory(self, max_bytes: int, *,
                             min_positions: int = memory_store.MIN_POSITIONS) -> memory_store.MemoryKVStore:
        """Keep the KV states of conversations about to be overwritten in RAM, at most
        ``max_bytes`` of them (least recently used go first), and restore one when a later
        prompt starts with more of it than the cache holds, as llama-server's prompt cache
        does (see :mod:`gguf_mcv.runtime.memory_store`). In front of :meth:`keep_chats`'s folder
        where there is one. Returns the store (its ``counts``); :class:`ConfigError` for a bad
        cap or if one is already attached."""
        if self._kept_in_memory is not None:
            raise ConfigError(f"This model already keeps up to {self._kept_in_memory.max_bytes} bytes of "
                              "conversations in memory.")
        store = memory_store.MemoryKVStore(max_bytes, min_positions=min_positions)
        engine = self.engine  # a closed model is refused here, before it holds a store
        self._kept_in_memory = store
        self._attach_stores(engine)
        return store

    @property
    def kept_in_memory(self) -> memory_store.MemoryKVStore | None:
        """The store of :meth:`keep_chats_in_memory`, if one is attached."""
        return self._kept_in_memory

    def _attach_stores(self, engine: Engine) -> None:
        disk, memory = self._kept_on_disk, self._kept_in_memory
        store: StateStore | None = memory if disk is None else disk
        if memory is not None and disk is not None:
            store = memory_store.Tiers(memory, disk)
        engine.kv_store = store
        if self.scheduler is not None:
            self.scheduler.store = store

    def keep_idle(self, timeout: float = 60.0) -> bool:
        """Hand every idle conversation's state to the store of :meth:`keep_chats` and wait until
        it is written (as a server stops); whether that finished within ``timeout`` seconds."""
        store = self._kept_on_disk
        if self.closed or store is None:
            return False
        if self.scheduler is not None:
            done = self.scheduler.keep_idle(timeout)
        else:  # on a thread of its own: an answer still running must not hang the caller (a server stopping)
            worker = threading.Thread(target=self._keep_own_sequence, name="gguf_mcv-keep-idle", daemon=True)
            worker.start()
            worker.join(timeout)
            done = not worker.is_alive()
        return store.flush(timeout) and done

    def _keep_own_sequence(self) -> None:
        try:
            with self._lock.hold():
                self._engine.keep_idle()
        except ModelClosedError:
            pass

    def identity(self) -> dict[str, Any]:
        """What a saved conversation must have been made with: text model file, quant,
        projector and vision backend (and the name, for messages)."""
        if self._identity is None:
            self._identity = {"name": self.info.name, "model": file_identity(self.info.model_path),
                              "quant": self.info.quant}
        engine = self.engine
        return {**self._identity, "projector": engine.mmproj_id, "backend": engine.vision_backend}

    def prepare_image(self, image: ImageInput, *, detail: str = "auto",
                      max_slices: int | None = None) -> Image:
        """Decode ``image`` and size it for the vision encoder (see :func:`slicing.apply_detail`).

        ``detail="high"`` keeps it as it is: libmtmd cuts a large image into up to 9
        448-pixel slices plus an overview (64 tokens each on 2.6-style models).
        ``"low"`` shrinks it to one slice. ``"auto"`` (default) allows 4 slices when
        the vision encoder runs on the CPU, 9 on a GPU. ``max_slices=N`` sets the
        budget directly (the image is scaled down, aspect kept, until it needs at most N).
        """
        return self.turns.image(image, detail=detail, max_slices=max_slices)

    # -- lifecycle ------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        if self._lock.closed:
            raise ModelClosedError("This model has been closed; load it again.")
        return self._engine

    @property
    def closed(self) -> bool:
        return self._lock.closed

    def close(self) -> None:
        """Free the model's native memory; it cannot be used afterwards.

        A stream still being read keeps the model alive until it ends or is closed;
        a stream not started yet raises :class:`~gguf_mcv.errors.ModelClosedError`.
        """
        self._lock.close(self._free)

    def _free(self) -> None:
        engine = self._engine
        llama = engine.llama
        if self.scheduler is not None:
            self.scheduler.close()  # its thread uses the context: stopped first
        if self._kept_on_disk is not None:
            self._kept_on_disk.close()  # writes what is pending
        engine.close()
        llama.close()
        if self._verbose:
            llama_log.verbose_release()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"n_ctx={self.info.n_ctx}"
        return f"<gguf_mcv.Model {self.info.name} {self.info.quant or ''} {state}>"


def as_list(images: Images) -> list[ImageInput]:
    """One image or a sequence of them, as a list (kept for callers of the older name)."""
    return as_image_list(images)

