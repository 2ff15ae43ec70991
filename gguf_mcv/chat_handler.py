"""A drop-in ``chat_handler`` for ``llama_cpp.Llama`` with gguf_mcv's engine inside.

    llm = llama_cpp.Llama(model_path="ggml-model-Q4_K_M.gguf", n_ctx=4096,
                          chat_handler=gguf_mcv.MiniCPMVChatHandler("mmproj-model-f16.gguf"))
    llm.create_chat_completion(messages=[...])   # follow-ups do not re-encode images

Unlike llama-cpp-python's ``MiniCPMv26ChatHandler`` it keeps the KV cache between
calls (each call evaluates only what follows the longest common prefix), feeds
images seen before from the embedding cache, renders the GGUF's own chat
template, and reports usage correctly. ``response_format`` (``{"type": "json_object"}``,
optionally with a ``"schema"``, as llama-cpp-python takes it, or ``{"type": "json_schema",
"json_schema": {"schema": ...}}``) and ``grammar`` (a ``LlamaGrammar``) constrain the answer.
``tools`` and ``tool_choice`` work as in llama-cpp-python's function-calling handlers: the
answer's ``message.tool_calls`` holds the calls, and ``role: "tool"`` messages carry results
back (see :mod:`gguf_mcv.prompt.tool_calls` for how tools are shown to the model).
``vision_backend`` and ``mmproj_precision`` are :func:`gguf_mcv.load`'s; the default backend
is libmtmd (``"llama.cpp"``), as in the handler this one replaces; ``"auto"`` takes ONNX
Runtime int8 on a CPU.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Iterator

from .errors import ConfigError, ModelNotFoundError, NativeKernelError
from .loader import vision_setup
from .models.headers import read_projector_header
from .openai_compat import completion, completion_chunks, tool_call_chunks
from .options import LoadOptions, Sampling, stop_list
from .output.structured import Constraint, constraint, grammar_constraint
from .prompt import tool_calls as tooling
from .prompt.messages import MediaPolicy, convert
from .prompt.templates import choose_template
from .prompt.turns import TurnBuilder
from .runtime import native_check
from .runtime.engine import Engine
from .runtime.generation import AnswerLock, Stream, respond
from .runtime.llama_load import uses_extra_bufts
from .vision.embed_cache import EmbeddingCache

_UNSUPPORTED = {"functions": "use tools", "function_call": "use tool_choice",
                "logits_processor": "use grammar or response_format"}


class MiniCPMVChatHandler:
    """``chat_handler=`` for ``llama_cpp.Llama``: OpenAI-style messages with images, KV reuse."""

    def __init__(
        self,
        clip_model_path: str | os.PathLike,
        *,
        embed_cache: EmbeddingCache | None = None,
        vision_gpu: bool = False,
        template_family: str | None = None,
        allow_remote_media: bool = False,
        verbose: bool = False,
        vision_backend: str = "llama.cpp",
        mmproj_precision: str = "auto",
    ) -> None:
        self.clip_model_path = os.fspath(clip_model_path)
        if not os.path.isfile(self.clip_model_path):
            raise ModelNotFoundError(f"mmproj file {self.clip_model_path} does not exist: check the path.")
        self.embed_cache = embed_cache if embed_cache is not None else EmbeddingCache()
        self.vision_gpu = vision_gpu
        self.template_family = template_family
        self.policy = MediaPolicy(allow_files=True, allow_remote=allow_remote_media)
        self.verbose = verbose
        #: as in :func:`gguf_mcv.load`; "llama.cpp" by default, as the handler this one replaces
        self.options = LoadOptions(vision_backend=vision_backend, mmproj_precision=mmproj_precision,
                                   vision_gpu=vision_gpu)
        self.vision_backend_reason = ""
        self._engine: Engine | None = None
        self._lock = AnswerLock()
        self._setup = threading.Lock()

    def engine_for(self, llama) -> Engine:
        """The engine bound to ``llama`` (made on first use, freed with the ``Llama``)."""
        with self._setup:
            if self._engine is not None and self._engine.llama is llama:
                return self._engine
            if self._engine is not None:
                self._engine.close()
            _refuse_crashing_kernels(llama)
            backend, self.vision_backend_reason, encoder, mmproj = vision_setup(
                self.clip_model_path, vision_backend=self.options.vision_backend,
                mmproj_precision=self.options.mmproj_precision, vision_gpu=self.vision_gpu,
                n_threads=llama.n_threads_batch)
            # the slice size from the real mmproj: an ONNX backend's stand-in has no position table
            engine = Engine(llama, mmproj, vision_on_gpu=self.vision_gpu, embed_cache=self.embed_cache,
                            encoder=encoder, slice_size=read_projector_header(self.clip_model_path).shape.image_size)
            llama._stack.callback(engine.close)
            self._engine = engine
            return engine

    def __call__(self, *, llama, messages: list[dict[str, Any]], stream: bool = False,
                 temperature: float = 0.2, top_p: float = 0.95, top_k: int = 40,
                 min_p: float = 0.05, repeat_penalty: float = 1.0, seed: int | None = None,
                 stop: str | list[str] | None = None, max_tokens: int | None = None,
                 model: str | None = None, response_format: dict[str, Any] | None = None,
                 grammar: Any = None, tools: list[dict[str, Any]] | None = None, tool_choice: Any = None,
                 **kwargs: Any) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """Answer ``messages``; an OpenAI ``chat.completion`` dict, or an iterator of chunks."""
        for name, instead in _UNSUPPORTED.items():
            if kwargs.get(name):
                raise ConfigError(f"{name} is not supported by MiniCPMVChatHandler: {instead}.")
        box = tooling.toolbox(tools, tool_choice)
        shape = _constraint(response_format, grammar)
        if box is not None and shape is not None:
            raise ConfigError("Give tools or a response_format/grammar, not both.")
        messages = tooling.prompt_messages(messages, box)
        if box is not None:
            shape = box.constraint()
        engine = self.engine_for(llama)
        if shape is not None:
            engine.check_grammar(shape.grammar)
        template = choose_template(
            llama.metadata.get("tokenizer.chat_template"), self.template_family,
            bos_token=_text(llama, llama.token_bos()), eos_token=_text(llama, llama.token_eos()),
        )
        builder = TurnBuilder(engine, template, n_ctx=llama.n_ctx(), vision_gpu=self.vision_gpu,
                              allow_remote_media=self.policy.allow_remote, lock=self._lock)
        budget_tokens = max_tokens if max_tokens and max_tokens > 0 else llama.n_ctx()
        messages_in = convert(messages, policy=self.policy,
                              prepare_image=lambda url, detail: builder.image(url, detail=detail))
        turns, _ = builder.conversation(messages_in, max_tokens=budget_tokens)
        rendered = builder.render(turns)
        sampling = Sampling(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                            repeat_penalty=repeat_penalty, seed=seed)
        pieces = Stream(respond(engine, rendered.text, rendered.images, sampling=sampling,
                                max_tokens=budget_tokens, stop=stop_list(stop), lock=self._lock,
                                constraint=shape))
        name = model or os.path.basename(llama.model_path)
        if stream:
            return (tool_call_chunks if box is not None else completion_chunks)(pieces, model=name)
        return completion(pieces.result(), model=name)


def _refuse_crashing_kernels(llama) -> None:
    """A ``Llama`` built by the caller cannot change its buffers: when its extra buffer types'
    kernels crash on this machine (:mod:`gguf_mcv.runtime.native_check`), refuse before the first decode."""
    if not uses_extra_bufts(llama):
        return
    crashed = native_check.crashing_extra_bufts(native_check.weight_types(llama.model_path))
    if crashed:
        raise NativeKernelError(
            f"this Llama was loaded with llama.cpp's extra buffer types, whose kernels crash on this machine "
            f"({crashed}); answering would kill the process. Build it with gguf_mcv.checked_llama("
            f"model_path, ...), which loads without them where they crash. {native_check.rebuild_advice()}")


def _constraint(response_format: dict[str, Any] | None, grammar: Any) -> Constraint | None:
    """The constraint for llama-cpp-python's ``response_format`` or ``grammar`` arguments."""
    if grammar is not None:
        return grammar_constraint(grammar)
    spec = response_format or {}
    if not isinstance(spec, dict):
        raise ConfigError("response_format must be a dict such as {'type': 'json_object'}.")
    kind = spec.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return constraint(spec.get("schema"), None if spec.get("schema") is not None else "json")
    schema = spec["json_schema"].get("schema") if isinstance(spec.get("json_schema"), dict) else None
    if kind == "json_schema" and schema is not None:
        return constraint(schema)
    raise ConfigError(f"response_format must be of type text, json_object or json_schema (with "
                      f"json_schema.schema), not {spec!r:.80}.")


def _text(llama, token: int) -> str:
    return llama.detokenize([token], special=True).decode("utf-8", "replace") if token >= 0 else ""
