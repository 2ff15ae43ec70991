"""gguf_mcv.models.catalog: the bundled models.toml, user catalogs merged over it, and validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from gguf_mcv.errors import CatalogError, ConfigError, ModelNotFoundError
from gguf_mcv.models.catalog import CHAT_TEMPLATES, Catalog, bundled_catalog_path, load_catalog
from gguf_mcv.models.quants import QUANT_ORDER, classify_gguf

BUNDLED = {
    "minicpm-llama3-v-2.5", "minicpm-v-2.6", "minicpm-o-2.6", "minicpm-v-4.0",
    "minicpm-v-4.5", "minicpm-v-4.6", "minicpm-v-4.6-thinking",
}

# A complete new entry for user catalogs (a made-up fine-tune).
NEW_MODEL = """
[models."my-minicpm"]
display_name = "My MiniCPM-V fine-tune"
repo = "someone/my-minicpm-gguf"
aliases = ["mine"]
base_llm = "Qwen2-7B"
rank = 10
chat_template = "chatml"
projector_type = "resampler"
minicpmv_version = 3

[models."my-minicpm".arch]
llm_arch = "qwen2"
n_layers = 28
n_embd = 3584
n_head = 28
n_head_kv = 4
head_dim = 128
n_vocab = 151666
n_ctx_train = 32768

[models."my-minicpm".vision]
width = 1152
blocks = 27
patch_size = 14
image_size = 448
query_tokens = 64

[models."my-minicpm".sampling]
temperature = 0.7
top_p = 0.8
top_k = 100
repeat_penalty = 1.05

[models."my-minicpm".mmproj]
file = "mmproj-model-f16.gguf"
size = 1044425152

[models."my-minicpm".quants]
Q4_K_M = { file = "my-Q4_K_M.gguf", size = 4681089344 }
"""


@pytest.fixture(autouse=True)
def no_user_catalog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No $GGUF_MCV_CATALOG and an empty config folder, so only the bundled catalog loads."""
    monkeypatch.delenv("GGUF_MCV_CATALOG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


def user_catalog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> Path:
    path = tmp_path / "user-models.toml"
    path.write_text(text, encoding="utf-8")
    monkeypatch.setenv("GGUF_MCV_CATALOG", str(path))
    return path


def _override(table: str, body: str) -> str:
    return f'[models."minicpm-v-2.6"{table}]\n{body}\n'


# --- the bundled catalog ---


def test_bundled_file_is_found():
    path = bundled_catalog_path()
    assert path.is_file() and path.name == "models.toml"


def test_every_bundled_entry_loads_and_validates():
    catalog = load_catalog()
    assert isinstance(catalog, Catalog)
    assert set(catalog.names()) == BUNDLED and len(catalog) == len(BUNDLED)
    for e in catalog:
        assert e.repo.startswith("openbmb/") and e.source == str(bundled_catalog_path())
        assert e.chat_template in CHAT_TEMPLATES and e.template == e.chat_template
        assert e.default_quant in e.quants
        assert list(e.quants) == [q for q in QUANT_ORDER if q in e.quants]  # worst to best
        for quant, qf in e.quants.items():
            info = classify_gguf(qf.file)
            assert info is not None and not info.is_mmproj and info.quant == quant
            assert qf.size > 0
        assert classify_gguf(e.mmproj.file).is_mmproj
        assert e.sampling.temperature == 0.7 and e.sampling.top_p == 0.8
        assert e.sampling.top_k == 100 and e.sampling.repeat_penalty == 1.05
        assert 0 < e.n_ctx <= e.arch.n_ctx_train
        assert e.arch.n_head % e.arch.n_head_kv == 0
        assert e.vision.width == 1152 and e.vision.blocks == 27 and e.vision.patch_size == 14


def test_bundled_facts():
    c = load_catalog()
    v25, v26, o26 = c.get("minicpm-llama3-v-2.5"), c.get("minicpm-v-2.6"), c.get("minicpm-o-2.6")
    v40, v45, v46 = c.get("minicpm-v-4.0"), c.get("minicpm-v-4.5"), c.get("minicpm-v-4.6")
    think = c.get("minicpm-v-4.6-thinking")
    assert [e.minicpmv_version for e in (v25, v26, o26, v40, v45)] == [2, 3, 4, 5, 6]
    assert v46.minicpmv_version is None and v46.projector_type == "minicpmv4_6"
    assert [e.chat_template for e in (v25, v26, o26, v40, v45, v46)] == \
        ["llama3", "chatml", "chatml", "chatml", "qwen3", "qwen3"]
    assert v25.vision.query_tokens == 96 and v26.vision.query_tokens == 64
    assert (v25.arch.n_layers, v25.arch.n_embd, v25.arch.n_head_kv, v25.arch.n_vocab) == (32, 4096, 8, 128256)
    assert (v26.arch.n_layers, v26.arch.n_embd, v26.arch.n_head, v26.arch.n_head_kv,
            v26.arch.head_dim, v26.arch.n_vocab) == (28, 3584, 28, 4, 128, 151666)
    assert (v45.arch.n_layers, v45.arch.n_embd, v45.arch.n_head, v45.arch.n_head_kv) == (36, 4096, 32, 8)
    assert v46.arch.n_kv_layers == 6 < v46.arch.n_layers == 24
    assert v26.arch.kv_bytes_per_token() == 2 * 28 * 4 * 128 * 2
    assert v45.thinking and not v45.thinking_default
    assert think.thinking and think.thinking_default and v46.thinking and not v46.thinking_default
    assert v26.quants["Q4_K_M"].size == 4_681_089_344 and v26.quants["Q4_K_M"].exact
    assert v26.mmproj.size == 1_044_425_152 and v46.quants["Q4_K_M"].size == 529_101_504


def test_entries_are_sorted_by_rank():
    ranks = [e.rank for e in load_catalog().entries()]
    assert ranks == sorted(ranks, reverse=True)
    assert load_catalog().entries()[0].name == "minicpm-v-4.5"


@pytest.mark.parametrize(("alias", "name"), [
    ("minicpm-v:8b", "minicpm-v-2.6"),
    ("MiniCPM-V-2.6", "minicpm-v-2.6"),
    ("minicpm-v2.6", "minicpm-v-2.6"),
    ("  MINICPM-V-4.5 ", "minicpm-v-4.5"),
    ("minicpm-v-4_5", "minicpm-v-4.5"),
    ("minicpm-v", "minicpm-v-4.6"),
    ("minicpm-v-2.5", "minicpm-llama3-v-2.5"),
    ("minicpm-o", "minicpm-o-2.6"),
    ("minicpm-v4", "minicpm-v-4.0"),
    ("minicpm-v4.6-thinking", "minicpm-v-4.6-thinking"),
    ("openbmb/MiniCPM-V-2_6-gguf", "minicpm-v-2.6"),  # a repo id works too
])
def test_aliases_resolve(alias, name):
    catalog = load_catalog()
    assert catalog.get(alias).name == name
    assert alias in catalog


def test_aliases_are_unique():
    seen: list[str] = []
    for e in load_catalog():
        seen += [k.lower() for k in (e.name, *e.aliases)]
    assert len(seen) == len(set(seen))


def test_by_repo_is_case_insensitive():
    c = load_catalog()
    assert c.by_repo("OPENBMB/minicpm-v-4_5-GGUF").name == "minicpm-v-4.5"
    assert c.by_repo("https://huggingface.co/openbmb/MiniCPM-o-2_6-gguf").name == "minicpm-o-2.6"
    assert c.by_repo("someone/else") is None


def test_unknown_name_suggests_close_ones():
    c = load_catalog()
    assert c.find("minicpm-v-2.7") is None and "minicpm-v-2.7" not in c
    with pytest.raises(ModelNotFoundError) as err:
        c.get("minicpm-v-2.7")
    msg = str(err.value)
    assert "Did you mean" in msg and "minicpm-v-2.6" in msg
    assert isinstance(err.value, FileNotFoundError)


def test_quant_file_lists_available_on_a_miss():
    e = load_catalog().get("minicpm-v-4.6")
    assert e.quant_file("q4_k_m").file == "MiniCPM-V-4_6-Q4_K_M.gguf"
    with pytest.raises(ConfigError, match="available: Q4_0, Q4_K_M, Q8_0, F16"):
        e.quant_file("Q2_K")


def test_entries_are_hashable_and_frozen():
    e = load_catalog().get("minicpm-v-2.6")
    assert {e: 1}[e] == 1
    with pytest.raises(AttributeError):
        e.rank = 1  # type: ignore[misc]


# --- user catalogs ---


def test_user_catalog_adds_a_model_and_overrides_a_field(tmp_path, monkeypatch):
    path = user_catalog(tmp_path, monkeypatch, NEW_MODEL + """
[models."minicpm-v-2.6".sampling]
temperature = 0.2

[models."minicpm-v-2.6".quants]
Q4_K_M = { size = 4681089345 }
""")
    c = load_catalog()
    mine = c.get("MINE")
    assert mine.name == "my-minicpm" and mine.source == str(path)
    assert mine.default_quant == "Q4_K_M" and mine.n_ctx == 4096  # defaults
    v26 = c.get("minicpm-v-2.6")
    assert v26.sampling.temperature == 0.2 and v26.sampling.top_p == 0.8  # one field only
    assert v26.quants["Q4_K_M"].size == 4681089345
    assert v26.quants["Q4_K_M"].file == "ggml-model-Q4_K_M.gguf" and v26.quants["Q4_K_M"].exact
    assert len(v26.quants) == 17 and v26.source == str(path)
    assert c.get("minicpm-v-4.5").source == str(bundled_catalog_path())


def test_user_quant_keys_are_normalized_before_merging(tmp_path, monkeypatch):
    # "q4_k" is llama-quantize's alias of Q4_K_M: it overrides that entry, not a new one.
    user_catalog(tmp_path, monkeypatch, _override(".quants", 'q4_k = { file = "x-Q4_K_M.gguf" }'))
    quants = load_catalog().get("minicpm-v-2.6").quants
    assert quants["Q4_K_M"].file == "x-Q4_K_M.gguf" and quants["Q4_K_M"].size == 4_681_089_344


def test_user_catalog_path_argument_wins(tmp_path, monkeypatch):
    other = tmp_path / "other.toml"
    other.write_text(NEW_MODEL, encoding="utf-8")
    user_catalog(tmp_path, monkeypatch, "")
    assert "my-minicpm" in load_catalog(other)
    assert "my-minicpm" not in load_catalog()


def test_default_user_catalog_in_config_folder(tmp_path):
    folder = tmp_path / "config" / "gguf_mcv"
    folder.mkdir(parents=True)
    (folder / "models.toml").write_text(NEW_MODEL, encoding="utf-8")
    assert "my-minicpm" in load_catalog()


def test_missing_explicit_user_catalog_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("GGUF_MCV_CATALOG", str(tmp_path / "nope.toml"))
    with pytest.raises(CatalogError, match="nope.toml"):
        load_catalog()


def test_catalog_is_cached_until_the_file_changes(tmp_path, monkeypatch):
    path = user_catalog(tmp_path, monkeypatch, NEW_MODEL)
    first = load_catalog()
    assert load_catalog() is first
    path.write_text(NEW_MODEL.replace("rank = 10", "rank = 999"), encoding="utf-8")
    assert load_catalog().get("mine").rank == 999


# (user catalog text, entry, field, words the message must contain)
INVALID = [
    pytest.param(NEW_MODEL.replace('repo = "someone/my-minicpm-gguf"\n', ""),
                 "my-minicpm", "repo", "missing", id="missing-repo"),
    pytest.param(NEW_MODEL.replace('Q4_K_M = { file = "my-Q4_K_M.gguf"', 'Q4_K_Q = { file = "my-Q4_K_Q.gguf"'),
                 "my-minicpm", "quants.Q4_K_Q", "Unknown quantization", id="unknown-quant"),
    pytest.param(_override(".mmproj", "size = -5"),
                 "minicpm-v-2.6", "mmproj.size", "greater than 0", id="negative-size"),
    pytest.param(_override(".quants", 'Q8_0 = { size = 0 }'),
                 "minicpm-v-2.6", "quants.Q8_0.size", "greater than 0", id="zero-quant-size"),
    pytest.param(_override(".sampling", "top_p = 1.5"),
                 "minicpm-v-2.6", "sampling.top_p", "(0.0, 1.0]", id="bad-top-p"),
    pytest.param(_override(".sampling", "temperature = -0.1"),
                 "minicpm-v-2.6", "sampling.temperature", "[0.0, 5.0]", id="bad-temperature"),
    pytest.param(_override(".sampling", 'top_k = "many"'),
                 "minicpm-v-2.6", "sampling.top_k", "an integer", id="bad-top-k-type"),
    pytest.param(NEW_MODEL.replace('aliases = ["mine"]', 'aliases = ["MiniCPM-V:8B"]'),
                 "my-minicpm", "aliases", "already used by model 'minicpm-v-2.6'", id="duplicate-alias"),
    pytest.param(_override("", 'aliases = ["minicpm-v"]'),
                 "minicpm-v-2.6", "aliases", "already used by model 'minicpm-v-4.6'", id="stolen-alias"),
    pytest.param(_override("", 'chat_template = "vicuna"'),
                 "minicpm-v-2.6", "chat_template", "unknown family", id="bad-template"),
    pytest.param(_override("", 'repo = "not a repo"'),
                 "minicpm-v-2.6", "repo", "owner/name", id="bad-repo"),
    pytest.param(_override("", "n_ctx = 100000"),
                 "minicpm-v-2.6", "n_ctx", "n_ctx_train", id="n_ctx-too-big"),
    pytest.param(_override("", "thinking_default = true"),
                 "minicpm-v-2.6", "thinking_default", "thinking is false", id="thinking-default"),
    pytest.param(_override("", 'default_quant = "Q2_K"').replace("2.6", "4.6"),
                 "minicpm-v-4.6", "default_quant", "not in quants", id="default-quant-missing"),
    pytest.param(_override(".arch", "n_head_kv = 5"),
                 "minicpm-v-2.6", "arch.n_head_kv", "must divide", id="bad-kv-heads"),
    pytest.param(_override(".arch", "n_layer = 28"),
                 "minicpm-v-2.6", "arch.n_layer", "unknown field", id="typo-field"),
    pytest.param(_override(".quants", 'Q8_0 = { file = "ggml-model-Q4_0.gguf" }'),
                 "minicpm-v-2.6", "quants.Q8_0.file", "named as Q4_0", id="file-quant-mismatch"),
    # wrong types, at the top and nested (TOML floats are no integers, strings no booleans)
    pytest.param(_override("", 'thinking = "yes"'),
                 "minicpm-v-2.6", "thinking", "true or false", id="wrong-type-top"),
    pytest.param(_override(".arch", "n_layers = 28.5"),
                 "minicpm-v-2.6", "arch.n_layers", "an integer", id="wrong-type-nested"),
    pytest.param(_override("", 'rank = "high"'),
                 "minicpm-v-2.6", "rank", "an integer", id="wrong-type-rank"),
    # missing, nested
    pytest.param(NEW_MODEL.replace("query_tokens = 64\n", ""),
                 "my-minicpm", "vision.query_tokens", "missing", id="missing-nested"),
    pytest.param(NEW_MODEL.replace('llm_arch = "qwen2"\n', ""),
                 "my-minicpm", "arch.llm_arch", "missing", id="missing-llm-arch"),
    # unknown: a typo at the top, a misspelt table, and fields the types have but the file may not set
    pytest.param(_override("", 'colour = "blue"'),
                 "minicpm-v-2.6", "colour", "unknown field", id="unknown-top"),
    pytest.param(NEW_MODEL.replace('"my-minicpm".arch]', '"my-minicpm".archs]'),
                 "my-minicpm", "archs", "unknown field", id="unknown-table"),
    pytest.param(_override(".arch", "n_ff = 18944"),
                 "minicpm-v-2.6", "arch.n_ff", "unknown field", id="unknown-derived"),
    pytest.param(_override(".sampling", "min_p = 0.1"),
                 "minicpm-v-2.6", "sampling.min_p", "unknown field", id="unknown-sampling"),
    # bad nested values
    pytest.param(_override(".quants", "Q8_0 = 3"),
                 "minicpm-v-2.6", "quants.Q8_0", "a table", id="quant-not-a-table"),
    pytest.param(_override("", 'aliases = ["two-six", 3]'),
                 "minicpm-v-2.6", "aliases.1", "a string", id="alias-not-a-string"),
    pytest.param(_override(".arch", 'llm_arch = "  "'),
                 "minicpm-v-2.6", "arch.llm_arch", "not empty", id="blank-string"),
    pytest.param(_override(".vision", "full_blocks = 0"),
                 "minicpm-v-2.6", "vision.full_blocks", "greater than 0", id="zero-optional"),
    pytest.param(_override(".mmproj", 'exact = "yes"'),
                 "minicpm-v-2.6", "mmproj.exact", "true or false", id="bad-exact"),
    pytest.param(_override(".mmproj", 'file = "mmproj.bin"'),
                 "minicpm-v-2.6", "mmproj.file", ".gguf", id="not-gguf"),
]


@pytest.mark.parametrize(("text", "entry", "fld", "words"), INVALID)
def test_invalid_user_entries_name_file_entry_and_field(tmp_path, monkeypatch, text, entry, fld, words):
    path = user_catalog(tmp_path, monkeypatch, text)
    with pytest.raises(CatalogError) as err:
        load_catalog()
    msg = str(err.value)
    assert str(path) in msg and f"model {entry!r}" in msg and f"field {fld!r}" in msg
    assert words in msg
    assert str(bundled_catalog_path()) in msg  # where the fields are described


def test_toml_integers_are_numbers_and_strings_are_trimmed(tmp_path, monkeypatch):
    user_catalog(tmp_path, monkeypatch, _override(".sampling", "temperature = 1") +
                 _override("", 'aliases = ["  two-six  "]'))
    v26 = load_catalog().get("two-six")
    assert v26.sampling.temperature == 1.0 and isinstance(v26.sampling.temperature, float)
    assert v26.aliases == ("two-six",)


def test_hybrid_and_merger_fields_reach_the_shapes(tmp_path, monkeypatch):
    # every field the file may set lands in TextShape / VisionShape under the type's own name
    user_catalog(tmp_path, monkeypatch, NEW_MODEL.replace("n_ctx_train = 32768", (
        "n_ctx_train = 32768\nn_kv_layers = 7\ntied_embeddings = true\nssm_conv_kernel = 4\n"
        "ssm_inner_size = 2048\nssm_state_size = 128\nssm_group_count = 16")).replace(
        "query_tokens = 64", "query_tokens = 64\nfull_blocks = 9"))
    e = load_catalog().get("mine")
    assert (e.arch.architecture, e.arch.n_kv_layers, e.arch.tied_embeddings) == ("qwen2", 7, True)
    assert (e.arch.ssm_conv_kernel, e.arch.ssm_inner_size, e.arch.ssm_state_size,
            e.arch.ssm_group_count) == (4, 2048, 128, 16)
    assert e.arch.n_ff is None and e.arch.n_merges is None  # not catalog fields
    assert e.vision.full_blocks == 9 and e.vision.projector == "resampler" and e.vision.heads == 16


def test_toml_syntax_error_names_file_and_line(tmp_path, monkeypatch):
    path = user_catalog(tmp_path, monkeypatch, '[models."x"]\ndisplay_name = "ok"\nrepo = \n')
    with pytest.raises(CatalogError) as err:
        load_catalog()
    assert str(path) in str(err.value) and "line 3" in str(err.value)


@pytest.mark.parametrize(("text", "words"), [
    ("models = 3", "must be a table"),
    ("schema_version = 2", "schema_version 2"),
    ("colour = 'blue'", "unknown top-level"),
    ('[models]\n"x" = 1', "model 'x'"),
])
def test_malformed_user_file(tmp_path, monkeypatch, text, words):
    path = user_catalog(tmp_path, monkeypatch, text)
    with pytest.raises(CatalogError) as err:
        load_catalog()
    assert str(path) in str(err.value) and words in str(err.value)


def test_the_file_schema_is_pinned():
    """The tables' models are derived from the dataclasses: a field added to TextShape,
    VisionShape, Sampling or QuantFile must be a decision about models.toml (omit it or
    document it in the file's header), not a silent change to the file format."""
    from gguf_mcv.models import catalog

    def keys(model) -> set[str]:
        return {f.alias or name for name, f in model.model_fields.items()}

    assert keys(catalog._ARCH) == {
        "llm_arch", "n_layers", "n_embd", "n_head", "n_head_kv", "head_dim", "n_vocab", "n_ctx_train",
        "n_kv_layers", "ssm_conv_kernel", "ssm_inner_size", "ssm_state_size", "ssm_group_count",
        "tied_embeddings"}
    assert keys(catalog._VISION) == {"width", "blocks", "patch_size", "image_size", "query_tokens",
                                     "full_blocks"}
    assert keys(catalog._SAMPLING) == {"temperature", "top_p", "top_k", "repeat_penalty"}
    assert keys(catalog._FILE) == {"file", "size", "exact"}
