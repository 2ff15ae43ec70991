"""Header checks refuse bad files and mismatched pairs before llama.cpp sees them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

import gguf_mcv
from gguf_mcv.errors import CorruptModelError, IncompatibleProjectorError, ModelNotFoundError
from gguf_mcv.models.headers import check_pair, read_projector_header, read_text_header
from gguf_mcv.testing import synthetic


@pytest.fixture(scope="module")
def odd_projectors(tmp_path_factory):
    folder = tmp_path_factory.mktemp("odd_mmproj")
    wide = synthetic.write_mmproj(folder / "mmproj-wide.gguf", replace(synthetic.TINY, n_embd=384))
    v25 = synthetic.write_mmproj(folder / "mmproj-v25.gguf",
                                 replace(synthetic.TINY, minicpmv_version=2, query_num=96))
    return {"wide": Path(wide), "v25": Path(v25)}


def test_headers_read_back(tiny) -> None:
    text = read_text_header(tiny.quants["Q4_K_M"])
    assert (text.shape.architecture, text.shape.n_embd, text.shape.n_layers) == ("qwen2", 256, 2)
    assert text.shape.n_head_kv == 2 and text.chat_template
    proj = read_projector_header(tiny.mmproj)
    assert (proj.projector_type, proj.minicpmv_version, proj.n_embd_out) == ("resampler", 3, 256)
    assert proj.shape.image_size == 448 and proj.shape.query_tokens == 64


def test_width_mismatch_is_refused_before_llama_cpp(tiny, odd_projectors) -> None:
    with pytest.raises(IncompatibleProjectorError, match="384-wide .* 256 wide") as info:
        gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=odd_projectors["wide"])
    assert "mmproj-wide.gguf" in str(info.value) and "ggml-model-Q4_K_M.gguf" in str(info.value)


def test_version_mismatch_with_the_catalog_family(tiny, odd_projectors) -> None:
    with pytest.raises(IncompatibleProjectorError, match="MiniCPM-Llama3-V 2.5 but the model is MiniCPM-V 2.6"):
        gguf_mcv.load("minicpm-v-2.6", model_path=tiny.quants["Q4_K_M"],
                      mmproj_path=odd_projectors["v25"])
    text, proj = read_text_header(tiny.quants["Q4_K_M"]), read_projector_header(odd_projectors["v25"])
    with pytest.raises(IncompatibleProjectorError, match="text model is 'llama'.*'qwen2'"):
        check_pair(text, proj)  # no catalog family given: the projector's own generation decides


def test_swapped_files_are_named(tiny) -> None:
    with pytest.raises(IncompatibleProjectorError, match="vision projector"):
        gguf_mcv.load(model_path=tiny.mmproj, mmproj_path=tiny.quants["Q4_K_M"])
    with pytest.raises(IncompatibleProjectorError, match="not a vision projector"):
        gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.quants["Q2_K"])


@pytest.mark.parametrize("fraction", [0.001, 0.3, 0.7, 0.999])
def test_truncated_files_are_refused(tiny, tmp_path: Path, fraction: float) -> None:
    data = Path(tiny.quants["Q4_K_M"]).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(CorruptModelError, match="truncated|damaged"):
        gguf_mcv.load(model_path=cut, mmproj_path=tiny.mmproj)


def test_flipped_header_byte_is_refused(tiny, tmp_path: Path) -> None:
    data = bytearray(Path(tiny.mmproj).read_bytes())
    data[8] ^= 0xFF  # the tensor count
    bad = tmp_path / "flipped.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(CorruptModelError):
        gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=bad)


def test_missing_projector(tiny, tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError):
        gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tmp_path / "none.gguf")


def test_process_survives_every_refusal(tiny_model) -> None:
    assert tiny_model.ask("still alive?", max_tokens=1).usage.completion_tokens == 1
