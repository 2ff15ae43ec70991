"""Every MiniCPM-V generation in the catalog, end to end through the real llama.cpp.

Each generation's tiny synthetic preset (gguf_mcv/synthetic.py: its text architecture,
tokenizer kind and projector) is loaded under its catalog name, so the catalog's
template family and minicpmv_version check apply. Random weights: the tests count
tokens, encoder calls and cache hits, never read the words.

The oracle runs the same rendered prompt through libmtmd's own helper
(``mtmd_tokenize`` + ``mtmd_helper_eval_chunks``) and llama.cpp's greedy sampler in a
context of its own, and compares the tokens with our engine's greedy answer.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import gguf_mcv
from gguf_mcv import generations as registry
from gguf_mcv.errors import IncompatibleProjectorError
from gguf_mcv.model import Model
from gguf_mcv.models.catalog import lookup
from gguf_mcv.options import GenerationOptions, Sampling
from gguf_mcv.prompt import plaintext
from gguf_mcv.testing import synthetic
from gguf_mcv.vision.embed_cache import EmbeddingCache

llama_cpp = pytest.importorskip("llama_cpp")
mtmd = pytest.importorskip("llama_cpp.mtmd_cpp")

#: synthetic generation -> catalog name
CATALOG_NAMES = {key: g.catalog_names[0] for key, g in registry.GENERATIONS.items()
                 if g.catalog_names and g.synthetic_tiny is not None}
#: qwen35: recurrent (gated delta net) layers + attention layers
HYBRID = {key for key, g in registry.GENERATIONS.items() if g.text_arch == "qwen35"}

#: generations whose follow-up re-evaluates more than the new turn, and why
REWIND_GAPS = {
    "2.5": ("the Llama-3 template trims every message ('| trim') and this random model's answer starts with "
            "a space, so the re-rendered answer differs from the generated tokens and is evaluated again"),
    "4.5": ("the Qwen3 template renders an earlier answer without the empty <think></think> block that "
            "its generation prompt held (thinking off), so the cache diverges there and the previous "
            "answer is evaluated again (the image is not)"),
    "4.6": ("as for 4.5 (thinking off), and the hybrid cache goes back to its checkpoint a few dozen "
            "tokens before the end of the previous prompt (the image is not evaluated again)"),
}


def picture(seed: int, size: tuple[int, int]) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)


def short_video(path: Path, frames: int = 8) -> Path:
    """A 2-second, 4 fps video of a moving square (MJPG in AVI: OpenCV writes it everywhere)."""
    import cv2

    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 4.0, (320, 240))
    for i in range(frames):
        frame = np.full((240, 320, 3), 30, dtype=np.uint8)
        frame[100:140, 20 + 15 * i:60 + 15 * i] = (0, 0, 255)
        writer.write(frame)
    writer.release()
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, synthetic.SyntheticModel]:
    root = tmp_path_factory.mktemp("generations")
    return {g: synthetic.build(root / g, synthetic.PRESETS[g], ["Q4_K_M"]) for g in CATALOG_NAMES}


@pytest.fixture(scope="module", params=sorted(CATALOG_NAMES))
def generation(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(generation: str, built: dict[str, synthetic.SyntheticModel]) -> Iterator[Model]:
    files = built[generation]
    with gguf_mcv.load(CATALOG_NAMES[generation], model_path=files.quants["Q4_K_M"], mmproj_path=files.mmproj,
                       n_ctx=4096, n_threads=2, embed_cache=EmbeddingCache()) as loaded:
        yield loaded


def per_slice(generation: str) -> int:
    return synthetic.PRESETS[generation].query_num if generation not in HYBRID else 64


# --- template and thinking -------------------------------------------------------


def test_template_comes_from_the_gguf_and_thinking_follows_the_catalog(model: Model, generation: str) -> None:
    entry = lookup(CATALOG_NAMES[generation])
    assert entry is not None
    assert model.info.template_origin == "gguf"
    assert model.info.can_think == entry.thinking
    assert model.info.thinking_default == entry.thinking_default


def test_thinking_switch_changes_the_prompt(model: Model, generation: str) -> None:
    if not model.info.can_think:
        pytest.skip(f"{generation} has no thinking mode")
    off = model.ask("Why?", thinking=False, max_tokens=1, temperature=0)
    on = model.ask("Why?", thinking=True, max_tokens=1, temperature=0)
    default = model.ask("Why?", max_tokens=1, temperature=0)
    # thinking off: the template closes an empty think block before the answer
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    expected = on if model.info.thinking_default else off
    assert default.usage.prompt_tokens == expected.usage.prompt_tokens


def test_a_prompt_measured_by_segments_is_the_whole_tokenization(model: Model) -> None:
    """The turn builder measures a prompt segment by segment (gguf_mcv/prompt/measure.py): the sum
    equals the engine's tokenization of the whole, for every template and vocabulary here."""
    from gguf_mcv.prompt.measure import PromptMeasure

    turns = model.turns
    wide, low = turns.image(WIDE), turns.image(picture(4, (300, 200)), detail="low")
    conversations = [
        [turns.turn("user", ["hi"])],
        [turns.turn("user", [wide]), turns.turn("assistant", ["x"]), turns.turn("user", ["y"])],
        turns.system("Be brief.") + [
            turns.turn("user", [wide, "What is it?"]), turns.turn("assistant", [" A cat.  "]),
            turns.turn("user", ["and", low, "this one?", " trailing "]),
            turns.turn("assistant", ["<think>x</think>\n\nok"]),
            turns.turn("user", ["<|im_end|> typed <s> markup <|eot_id|>"]),
        ],
    ]
    for conversation in conversations:
        for thinking in ([None, True, False] if model.info.can_think else [None]):
            rendered = turns.render(conversation, thinking)
            with model.engine.tokenize(rendered.text, rendered.images) as whole:
                assert PromptMeasure(model.engine).positions(rendered.text, rendered.images) == whole.n_pos


# --- images ------------------------------------------------------------------------


#: one picture for every image test: 2:1, so full detail is an overview + 2 slices, and the
#: module's embedding cache keeps the encoder work to a few tiny slices per generation
WIDE = picture(3, (896, 448))


def test_low_detail_is_one_slice_and_full_detail_slices(model: Model, generation: str) -> None:
    low = model.ask("Describe the picture.", WIDE, detail="low", max_tokens=2, temperature=0)
    assert low.timings.slices_encoded + low.timings.slices_from_cache == 1
    full = model.ask("Describe the picture.", WIDE, detail="high", max_tokens=2, temperature=0)
    assert full.timings.slices_encoded + full.timings.slices_from_cache == 3  # overview + 2 slices
    assert full.usage.image_tokens > 2 * low.usage.image_tokens
    if generation not in HYBRID:  # 4.6 keeps the overview's aspect ratio: fewer tokens than a square
        assert low.usage.image_tokens == per_slice(generation)
        assert full.usage.image_tokens == 3 * per_slice(generation)


def _follow_up(model: Model) -> None:
    chat = model.chat()
    first = chat.send("Describe the picture.", WIDE, detail="high", max_tokens=4, temperature=0)
    calls = model.engine.encoder_calls
    second = chat.send("And the colours?", max_tokens=4, temperature=0)
    assert model.engine.encoder_calls == calls
    assert second.timings.slices_encoded == second.timings.slices_from_cache == 0
    new_turn = second.usage.prompt_tokens - first.usage.prompt_tokens - first.usage.completion_tokens
    assert second.usage.cached_tokens >= first.usage.prompt_tokens
    assert second.usage.evaluated_tokens <= new_turn + 2  # +2: the answer's end marker retokenized


def with_known_gaps(gaps: dict[str, str]) -> list:
    """Every generation as a parameter; those in ``gaps`` marked xfail(strict) with their reason."""
    return [pytest.param(g, marks=[pytest.mark.xfail(strict=True, reason=gaps[g])] if g in gaps else [])
            for g in sorted(CATALOG_NAMES)]


@pytest.mark.parametrize("generation", with_known_gaps(REWIND_GAPS), indirect=True)
def test_follow_up_evaluates_only_the_new_turn(model: Model) -> None:
    _follow_up(model)


def test_follow_up_never_calls_the_encoder_nor_evaluates_the_image_again(model: Model, generation: str) -> None:
    chat = model.chat()
    first = chat.send("What is it?", WIDE, detail="high", max_tokens=3, temperature=0)
    calls = model.engine.encoder_calls
    again = chat.send("Is it big?", max_tokens=3, temperature=0)
    assert model.engine.encoder_calls == calls and again.timings.slices_encoded == 0
    if generation not in HYBRID:  # the image's positions stay in the KV cache
        assert again.usage.cached_tokens >= first.usage.prompt_tokens - 8 > first.usage.image_tokens


def test_same_image_in_a_new_chat_comes_from_the_embedding_cache(model: Model) -> None:
    model.chat().send("First look.", WIDE, detail="high", max_tokens=2, temperature=0)
    calls = model.engine.encoder_calls
    model.engine.reset()  # nothing left in the KV cache
    reply = model.chat(system="A different system prompt.").send("Again?", WIDE, detail="high", max_tokens=2,
                                                                 temperature=0)
    assert model.engine.encoder_calls == calls
    assert reply.timings.slices_encoded == 0 and reply.timings.slices_from_cache == 3


def test_short_video(model: Model, generation: str, tmp_path: Path) -> None:
    video = short_video(tmp_path / "clip.avi")
    reply = model.ask_video("What moves?", video, max_frames=2, max_tokens=2, temperature=0)
    assert reply.video is not None and reply.video.used == reply.video.encoded == 2  # about 1 fps
    assert reply.usage.image_tokens == 2 * per_slice(generation)  # frames are never sliced


# --- the catalog's generation check --------------------------------------------------


def test_catalog_refuses_another_generations_projector(built: dict[str, synthetic.SyntheticModel]) -> None:
    with pytest.raises(IncompatibleProjectorError):
        gguf_mcv.load("minicpm-v-4.5", model_path=built["4.5"].quants["Q4_K_M"], mmproj_path=built["2.6"].mmproj)
    with pytest.raises(IncompatibleProjectorError):  # a Qwen3 text model under a 2.6 projector
        gguf_mcv.load(model_path=built["4.5"].quants["Q4_K_M"], mmproj_path=built["o-2.6"].mmproj)
    # 4.6 has no minicpmv_version: the catalog's projector type tells a 2.6 pair apart
    with pytest.raises(IncompatibleProjectorError, match="'resampler' projector but this model uses 'minicpmv4_6'"):
        gguf_mcv.load("minicpm-v-4.6", model_path=built["2.6"].quants["Q4_K_M"], mmproj_path=built["2.6"].mmproj)


def test_the_46_projector_names_its_output_width(built: dict[str, synthetic.SyntheticModel]) -> None:
    from gguf_mcv.models.headers import read_projector_header

    header = read_projector_header(built["4.6"].mmproj)
    assert header.projector_type == "minicpmv4_6" and header.n_embd_out == built["4.6"].spec.n_embd


@pytest.mark.parametrize(("text", "projector"), [("2.6", "4.0"), ("4.5", "4.6"), ("4.6", "4.5"), ("2.6", "2.5")])
def test_projector_refuses_another_generations_text_model(
    built: dict[str, synthetic.SyntheticModel], text: str, projector: str
) -> None:
    # same width, no catalog name: only the projector's generation tells them apart
    with pytest.raises(IncompatibleProjectorError, match="text model is"):
        gguf_mcv.load(model_path=built[text].quants["Q4_K_M"], mmproj_path=built[projector].mmproj)


# --- the oracle: libmtmd's own evaluation + llama.cpp greedy ------------------------

ORACLE_TOKENS = 8


#: a prompt as text token ids and ("image", n_tokens) for each image chunk
Layout = list[int | tuple[str, int]]


def _engine_greedy(model: Model, text: str, images: list) -> tuple[Layout, list[int]]:
    engine = model.engine
    engine.reset()
    with engine.tokenize(text, images) as prompt:
        layout: Layout = [u if isinstance(u, int) else ("image", u.n_pos) for u in prompt.units]
        engine.prefill(prompt)
    greedy = Sampling(temperature=0.0, top_p=1.0, top_k=1, repeat_penalty=1.0)
    return layout, list(engine.generate(GenerationOptions(greedy, ORACLE_TOKENS)))


def _libmtmd_greedy(model_path: Path, mmproj: Path, text: str, rgb: np.ndarray,
                    add_special: bool) -> tuple[Layout, list[int]]:
    """Evaluate ``text`` + image with mtmd_helper_eval_chunks in a fresh context; greedy tokens."""
    llm = gguf_mcv.checked_llama(str(model_path), n_ctx=1024, n_batch=512, n_threads=2, verbose=False)
    params = mtmd.mtmd_context_params_default()
    params.use_gpu, params.n_threads, params.print_timings = False, 2, False
    ctx = mtmd.mtmd_init_from_file(str(mmproj).encode(), llm.model, params)
    assert ctx is not None
    height, width = rgb.shape[:2]
    data = np.ascontiguousarray(rgb, dtype=np.uint8).tobytes()
    bitmap = mtmd.mtmd_bitmap_init(width, height, (ctypes.c_uint8 * len(data)).from_buffer_copy(data))
    chunks = mtmd.mtmd_input_chunks_init()
    try:
        raw = text.encode()
        prompt = mtmd.mtmd_input_text(text=raw, text_len=len(raw), add_special=add_special, parse_special=True)
        assert mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(prompt), (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) == 0
        n_past = llama_cpp.llama_pos(0)
        assert mtmd.mtmd_helper_eval_chunks(ctx, llm.ctx, chunks, 0, 0, 512, True, ctypes.byref(n_past)) == 0
        return _layout(chunks), _greedy(llm)
    finally:
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_bitmap_free(bitmap)
        mtmd.mtmd_free(ctx)
        llm.close()


def _layout(chunks: object) -> Layout:
    layout: Layout = []
    for i in range(mtmd.mtmd_input_chunks_size(chunks)):
        chunk = mtmd.mtmd_input_chunks_get(chunks, i)
        if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
            n = ctypes.c_size_t(0)
            ids = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
            layout += [int(ids[k]) for k in range(n.value)]
        else:
            layout.append(("image", int(mtmd.mtmd_input_chunk_get_n_tokens(chunk))))
    return layout


def _greedy(llm) -> list[int]:
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    sampler = llama_cpp.llama_sampler_init_greedy()
    tokens: list[int] = []
    try:
        for _ in range(ORACLE_TOKENS):
            token = int(llama_cpp.llama_sampler_sample(sampler, llm.ctx, -1))
            if llama_cpp.llama_vocab_is_eog(vocab, token):
                break
            tokens.append(token)
            batch = llama_cpp.llama_batch_get_one((llama_cpp.llama_token * 1)(token), 1)
            assert llama_cpp.llama_decode(llm.ctx, batch) == 0
    finally:
        llama_cpp.llama_sampler_free(sampler)
    return tokens


@pytest.mark.parametrize("generation", sorted(CATALOG_NAMES), indirect=True)
def test_oracle_libmtmd_and_engine_give_the_same_greedy_tokens(
    model: Model, generation: str, built: dict[str, synthetic.SyntheticModel]
) -> None:
    turns = model.turns
    parts = turns.user_parts("Describe the picture in a few words.", [picture(6, (448, 448))], detail="low")
    rendered = turns.render(turns.system(None) + [turns.turn("user", parts)], thinking=None)
    our_prompt, ours = _engine_greedy(model, rendered.text, rendered.images)
    text = plaintext.unmark(rendered.text)
    bos = model.engine.llama.detokenize([model.engine.llama.token_bos()], special=True).decode()
    files = built[generation]
    their_prompt, theirs = _libmtmd_greedy(files.quants["Q4_K_M"], files.mmproj, text, rendered.images[0].rgb,
                                           add_special=not text.startswith(bos))
    assert our_prompt == their_prompt  # the same tokens and image chunks, in the same order
    assert len(ours) > 0 and ours == theirs


@pytest.mark.parametrize("generation", sorted(HYBRID), indirect=True)
def test_a_hybrid_follow_up_rewinds_to_a_checkpoint_not_to_the_start(model: Model) -> None:
    """llama.cpp cannot rewind a recurrent cache partly: the engine keeps a checkpoint of the
    recurrent state near the end of each prompt and goes back to it."""
    from gguf_mcv.runtime.sequence import CHECKPOINT_TAIL

    chat = model.chat()
    first = chat.send("Describe the picture.", WIDE, detail="high", max_tokens=4, temperature=0)
    restored = model.engine.restored_checkpoints
    second = chat.send("And the colours?", max_tokens=4, temperature=0)
    new_turn = second.usage.prompt_tokens - first.usage.prompt_tokens - first.usage.completion_tokens
    assert second.usage.cached_tokens >= first.usage.image_tokens  # the image stayed in the cache
    assert second.usage.evaluated_tokens <= new_turn + first.usage.completion_tokens + CHECKPOINT_TAIL
    # either nothing had to be rewound, or a checkpoint served the rewind (not a restart)
    assert second.usage.cached_tokens >= first.usage.prompt_tokens or model.engine.restored_checkpoints > restored


@pytest.mark.parametrize("generation", sorted(HYBRID), indirect=True)
def test_a_hybrid_rewind_with_no_checkpoint_evaluates_the_whole_prompt(model: Model) -> None:
    """A rewind before every checkpoint clears the cache; the prompt must then be evaluated from
    its start (it used to be evaluated from the old common prefix, at position 0: wrong answers)."""
    model.ask("Describe the picture.", WIDE, max_tokens=2, temperature=0, system="Be brief.")
    other = model.ask("Describe the picture.", WIDE, max_tokens=6, temperature=0, system="Be long.")
    held = model.engine.n_past  # positions in the cache: the whole prompt and the answer
    model.engine.reset()
    fresh = model.ask("Describe the picture.", WIDE, max_tokens=6, temperature=0, system="Be long.")
    assert held == model.engine.n_past and str(other) == str(fresh)


#: how close the memory model is to the measured peak, per (generation, backend) (default 5 %)
#: (most under, most over) the measured peak a prediction may be, as fractions of it
PEAK_BOUNDS = {
    # The tiny hybrid's image phase with libmtmd's encoder peaks 9-17 MiB (6-12 %) higher than the
    # 2.6 preset's for the same image, which no term explains yet; at bench size (1.9 GB peak,
    # tools/bench_memory.py style fresh process, detail="low") the same model is within 1 %, and
    # with the ONNX encoder the tiny hybrid is within 1 % too (so the gap is libmtmd's merger). The
    # graph-metadata and recurrent-state terms are measured (memory.GRAPH_NODE_BYTES, memory.recurrent_bytes).
    ("4.6", "llama.cpp"): (0.08, 0.08), ("4.6-thinking", "llama.cpp"): (0.08, 0.08),
    # On an AMD EPYC with AVX-512 (VNNI) the 4.0 preset with libmtmd's encoder peaks 113.5 MiB against
    # 119.4 predicted (+5.1 %, twice); the AVX2 machines it was calibrated on are within 5 %. Over is
    # the planner's safe side, so as for ONNX below: at most 5 % under, at most 8 % over.
    ("4.0", "llama.cpp"): (0.05, 0.08),
}
#: ONNX Runtime's terms (memory.ORT_RUNTIME, onnx_arena_bytes) were measured on an AMD EPYC; on an
#: Intel Xeon (AVX-512, AMX) the same runs peak 8-10 MiB lower: 2.6 int8 152.8 vs 160.7 MiB
#: predicted, 4.6 int8 174.1-174.9 vs 184.8, 4.6 fp32 175.4-176.1 vs 185.0 (+5.1 ... +6.2 %).
#: Over-predicting is the planner's safe side, so the contract is "at most 5 % under, at most 8 %
#: over" on both kinds of machine.
ONNX_PEAK_BOUNDS = (0.05, 0.08)
#: every generation with libmtmd's encoder; the ONNX encoder (both variants) on one preset of
#: each projector layout (the resampler, 4.6's merger), to keep the fresh processes few
PEAK_CASES = [(g, "llama.cpp") for g in sorted(CATALOG_NAMES)] + [
    (g, b) for g in ("2.6", "4.6") for b in ("onnx-int8", "onnx-fp32")]

_PEAK_CHILD = """
import json, sys
import gguf_mcv
from gguf_mcv.resolver import estimate_files
model = gguf_mcv.load(sys.argv[1], model_path=sys.argv[2], mmproj_path=sys.argv[3], n_ctx=4096,
                      vision_backend=sys.argv[5])
assert model.info.vision_backend == sys.argv[5], model.info.vision_backend_reason
reply = model.ask("What is in this picture?", sys.argv[4], max_tokens=4, detail="high")
# VmHWM, not ru_maxrss: ru_maxrss inherits the (big) pytest parent's high-water mark
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({"peak": int(status["VmHWM"].split()[0]) * 1024, "image_tokens": reply.usage.image_tokens}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
@pytest.mark.parametrize(("generation", "backend"), PEAK_CASES)
def test_memory_model_predicts_the_peak(generation: str, backend: str, built, tmp_path: Path) -> None:
    """Within 5 % of the measured peak RSS, except where PEAK_BOUNDS / ONNX_PEAK_BOUNDS say why not."""
    import json
    import subprocess
    import sys

    import PIL.Image

    from gguf_mcv.resolver import estimate_files

    files = built[generation]
    if backend != "llama.cpp":  # converted here (or found in the session's cache), not in the measured child
        pytest.importorskip("onnxruntime")
        from gguf_mcv.runtime.engine import file_identity
        from gguf_mcv.vision import onnx_vision

        onnx_vision.prepare(files.mmproj, file_identity(files.mmproj))
    image = tmp_path / "photo.png"
    PIL.Image.fromarray(picture(7, (896, 672))).save(image)
    out = subprocess.run([sys.executable, "-c", _PEAK_CHILD, CATALOG_NAMES[generation], str(files.quants["Q4_K_M"]),
                          str(files.mmproj), str(image), backend], capture_output=True, text=True, timeout=300,
                         check=True)
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    predicted = estimate_files(files.quants["Q4_K_M"], files.mmproj, n_ctx=4096, vision_backend=backend,
                                      image_tokens=measured["image_tokens"], image_pixels=896 * 672).total
    under, over = PEAK_BOUNDS.get((generation, backend), ONNX_PEAK_BOUNDS if backend != "llama.cpp" else (0.05, 0.05))
    error = predicted / measured["peak"] - 1
    assert -under <= error <= over, (predicted / 2**20, measured["peak"] / 2**20)


def test_regenerate_encodes_nothing_and_evaluates_at_most_the_checkpoint_tail(model: Model, generation: str) -> None:
    from gguf_mcv.runtime.sequence import CHECKPOINT_TAIL

    chat = model.chat()
    first = chat.send("Describe it.", WIDE, detail="high", max_tokens=4, temperature=0)
    again = chat.regenerate(max_tokens=4, temperature=0.9, seed=5)
    assert again.timings.slices_encoded == again.timings.slices_from_cache == 0
    limit = CHECKPOINT_TAIL + 1 if generation in HYBRID else 1  # llama.cpp needs one token for logits
    assert again.usage.evaluated_tokens <= limit
    assert again.usage.prompt_tokens == first.usage.prompt_tokens
    assert len(chat.history) == 2 and chat.history[1]["content"] == str(again)


@pytest.mark.parametrize("generation", ["4.6"], indirect=True)  # 2.6: tests/test_saved_chat.py
def test_a_saved_chat_continues_as_the_unbroken_one(model: Model, tmp_path: Path) -> None:
    """Chat.save / Model.load_chat on the hybrid model (its recurrent state and checkpoints saved
    too): the loaded chat's next answer and its usage are those of the chat that never stopped."""
    chat = model.chat()
    chat.send("What is it?", WIDE, max_tokens=4, temperature=0)
    chat.send("Is it big?", max_tokens=4, temperature=0)
    assert chat.save(tmp_path / "chat") is True
    expected = chat.send("And the colours?", max_tokens=4, temperature=0)
    model.ask("Something else.", max_tokens=2)  # the KV cache now holds another conversation
    calls = model.engine.encoder_calls
    got = model.load_chat(tmp_path / "chat").send("And the colours?", max_tokens=4, temperature=0)
    assert (str(got), got.usage) == (str(expected), expected.usage)
    assert model.engine.encoder_calls == calls and got.timings.slices_from_cache == 0
