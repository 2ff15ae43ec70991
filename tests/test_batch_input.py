"""batch_input: folders, globs and CSV/JSONL rows become keyed items; a bad row is an item with a problem."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

from gguf_mcv.errors import BatchInputError, ConfigError, MediaError
from gguf_mcv.jobs import batch_input
from gguf_mcv.jobs.batch_input import MAX_ROW_BYTES, collect


def _png(path: Path, seed: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    PIL.Image.fromarray(np.random.default_rng(seed).integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(path)
    return path


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    _png(tmp_path / "b.png", 1)
    _png(tmp_path / "a.png", 2)
    _png(tmp_path / "sub" / "c.jpg", 3)
    (tmp_path / "clip.mp4").write_bytes(b"not really a video")
    (tmp_path / "notes.txt").write_text("ignored: not an image or video")
    _png(tmp_path / ".hidden" / "d.png", 4)
    return tmp_path


def test_folder_items_are_file_major_sorted_recursive_and_keyed(folder: Path) -> None:
    items = collect(folder, prompts=["one?", "two?"], options={"max_tokens": 3, "detail": "low"})
    assert [(Path(i.input).relative_to(folder).as_posix(), i.prompt) for i in items] == [
        ("a.png", "one?"), ("a.png", "two?"), ("b.png", "one?"), ("b.png", "two?"),
        ("clip.mp4", "one?"), ("clip.mp4", "two?"), ("sub/c.jpg", "one?"), ("sub/c.jpg", "two?")]
    assert [i.kind for i in items[4:6]] == ["video", "video"]
    assert items[0].options == {"max_tokens": 3, "detail": "low"}
    assert items[4].options == {"max_tokens": 3}  # detail does not apply to a video
    assert len({i.key for i in items}) == 8 and all(len(i.key) == 64 for i in items)
    assert all(i.problem is None and i.path is not None and i.path.is_absolute() for i in items)


def test_key_follows_content_prompt_schema_and_options(tmp_path: Path) -> None:
    a, b = _png(tmp_path / "a.png", 1), tmp_path / "b.png"
    b.write_bytes(a.read_bytes())  # same bytes, another name: same key
    key = {Path(i.input).name: i.key for i in collect(tmp_path, prompts=["q"])}
    assert key["a.png"] == key["b.png"]
    base = collect(a, prompts=["q"])[0].key
    assert collect(a, prompts=["q"])[0].key == base  # stable
    assert collect(a, prompts=["q2"])[0].key != base
    assert collect(a, prompts=["q"], schema={"type": "object"})[0].key != base
    assert collect(a, prompts=["q"], options={"max_tokens": 5})[0].key != base
    _png(a, 9)  # new content under the same name
    assert collect(a, prompts=["q"])[0].key != base


def test_glob_and_job_level_refusals(folder: Path) -> None:
    items = collect(str(folder / "*.png"), prompts=["q"])
    assert sorted(Path(i.input).name for i in items) == ["a.png", "b.png"]
    with pytest.raises(BatchInputError, match="does not exist"):
        collect(folder / "missing", prompts=["q"])
    with pytest.raises(BatchInputError, match="No image or video"):
        collect(str(folder / "*.nothing"), prompts=["q"])
    with pytest.raises(BatchInputError, match="--prompt"):
        collect(folder)
    with pytest.raises(BatchInputError, match="empty"):
        collect("", prompts=["q"])
    with pytest.raises(ConfigError, match="Unknown batch option"):
        collect(folder, prompts=["q"], options={"max_token": 3})
    with pytest.raises(ConfigError, match="prompt"):
        collect(folder, prompts=[""])
    with pytest.raises(ConfigError, match="prompt"):
        collect(folder, prompts=[5])  # type: ignore[list-item]


def _by_input(items) -> dict[str, batch_input.Item]:
    return {i.input: i for i in items}


def test_hostile_jsonl_rows_become_error_items(tmp_path: Path) -> None:
    _png(tmp_path / "ok.png", 1)
    os.mkfifo(tmp_path / "fifo.png")
    lines = [
        json.dumps({"image": "ok.png", "prompt": "good", "max_tokens": 2, "id": 7}),
        "{not json",
        json.dumps(["a", "list"]),
        json.dumps({"image": "ok.png", "prompt": 5}),
        json.dumps({"image": ["ok.png"], "prompt": "p"}),
        json.dumps({"image": "ok.png", "prompt": "p", "colour": "red"}),
        json.dumps({"image": "ok.png", "video": "ok.png", "prompt": "p"}),
        json.dumps({"image": "missing.png", "prompt": "p"}),
        json.dumps({"image": "fifo.png", "prompt": "p"}),
        json.dumps({"image": "ok.png", "prompt": "x" * (MAX_ROW_BYTES + 10)}),
        json.dumps({"image": "ok.png", "prompt": "p", "schema": "[1]"}),
        json.dumps({"image": "ok.png", "prompt": "p", "schema": 3}),
        json.dumps({"video": "ok.png", "prompt": "p", "detail": "low"}),
        json.dumps({"image": "ok.png", "prompt": "p", "id": {"nested": 1}}),
        json.dumps({"image": "ok.png"}),
        '{"image": "ok.png", "prompt": "p", "id": NaN}',
        "",
        json.dumps({"image": "ok.png", "prompt": "last", "max_tokens": "ten"}),
    ]
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(("\n".join(lines) + "\n").encode() + b"\xff\xfe broken utf-8\n")
    items = collect(rows)
    assert len(items) == 18  # one item per non-empty line: every line is accounted for
    good, last = items[0], items[16]
    assert good.problem is None and good.options == {"max_tokens": 2} and good.id == 7
    assert last.problem is None and last.options == {"max_tokens": "ten"}  # the model refuses it later
    problems = [type(i.problem).__name__ for i in items[1:16]] + [type(items[17].problem).__name__]
    assert problems == ["ConfigError"] * 6 + ["MediaError", "MediaError"] + ["ConfigError"] * 8
    assert "does not exist" in str(items[7].problem) and "FIFO" in str(items[8].problem)
    assert "longer than" in str(items[9].problem)
    assert "does not apply to a video" in str(items[12].problem)
    assert "no prompt" in str(items[14].problem)
    assert all(i.key for i in items) and len({i.key for i in items}) == 18
    assert items[2].input == f"{rows}:3"


def test_rows_without_prompt_take_the_job_prompts_and_relative_paths_follow_the_file(tmp_path: Path) -> None:
    _png(tmp_path / "data" / "x.png", 1)
    schema = tmp_path / "data" / "s.json"
    schema.write_text('{"type": "object"}')
    rows = tmp_path / "data" / "rows.jsonl"
    rows.write_text(json.dumps({"image": "x.png", "schema": "s.json"}) + "\n")
    items = collect(rows, prompts=["a", "b"])
    assert [i.prompt for i in items] == ["a", "b"]
    assert items[0].path == tmp_path / "data" / "x.png" and items[0].schema == {"type": "object"}


def test_csv_rows_cells_typed_and_damage_recorded(tmp_path: Path) -> None:
    _png(tmp_path / "a.png", 1)
    rows = tmp_path / "rows.csv"
    rows.write_text(
        "image,prompt,max_tokens,temperature,schema\n"
        'a.png,"two\nlines, with comma",3,0,\n'
        "a.png,p,abc,,\n"
        "a.png,p,3,0,,extra\n"
        "a.png,p,3,hot,\n"
        'a.png,p,3,0,"{""type"": ""object""}"\n'
        ",,,,\n"
    )
    items = collect(rows)
    assert len(items) == 5
    assert items[0].prompt == "two\nlines, with comma" and items[0].options == {"max_tokens": 3, "temperature": 0.0}
    assert [type(i.problem).__name__ for i in items[1:4]] == ["ConfigError"] * 3
    assert "max_tokens must be an integer" in str(items[1].problem)
    assert "cells" in str(items[2].problem)
    assert items[4].schema == {"type": "object"} and items[4].problem is None


def test_csv_oversize_field_is_one_error_row(tmp_path: Path) -> None:
    _png(tmp_path / "a.png", 1)
    rows = tmp_path / "rows.csv"
    rows.write_text("image,prompt\n" + f'a.png,"{"y" * 200_000}"\n' + "a.png,after\n")
    items = collect(rows)
    assert isinstance(items[0].problem, ConfigError) and "CSV" in str(items[0].problem)
    assert items[-1].prompt == "after" and items[-1].problem is None


@pytest.mark.parametrize("header", ["prompt,path\n", "image,prompt,colour\n", "image,image,prompt\n", ""])
def test_csv_that_is_not_a_batch_file_is_refused(tmp_path: Path, header: str) -> None:
    rows = tmp_path / "rows.csv"
    rows.write_text(header + "a.png,p,x\n" if header else "")
    with pytest.raises(BatchInputError):
        collect(rows)


def test_file_digest_refuses_what_is_not_a_file(tmp_path: Path) -> None:
    with pytest.raises(MediaError, match="folder"):
        batch_input.file_digest(tmp_path)
    with pytest.raises(MediaError, match="does not exist"):
        batch_input.file_digest(tmp_path / "nope.png")


def test_missing_file_is_answered_once_it_appears(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"image": "later.png", "prompt": "p"}) + "\n")
    before = collect(rows)[0]
    assert isinstance(before.problem, MediaError)
    _png(tmp_path / "later.png", 1)
    after = collect(rows)[0]
    assert after.problem is None and after.key != before.key


def test_schema_files_checked(tmp_path: Path) -> None:
    bad = tmp_path / "s.json"
    for content, match in [(b"[]", "not an object"), (b"{oops", "not valid JSON"), (b"\xff", "not valid JSON")]:
        bad.write_bytes(content)
        with pytest.raises(ConfigError, match=match):
            batch_input.load_schema(bad)
    with pytest.raises(ConfigError, match="cannot be read"):
        batch_input.load_schema(tmp_path / "none.json")


def test_keys_for_a_model_name_both_of_its_files(tmp_path: Path) -> None:
    files = {}
    for name in ("model", "other-model", "mmproj", "other-mmproj"):
        files[name] = tmp_path / f"{name}.gguf"
        files[name].write_bytes(name.encode() * 1000)
    image = tmp_path / "a.png"
    PIL.Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(image)
    items = collect(image, prompts=["q"])
    models = [batch_input.model_identity(files[m], files[p])
              for m, p in (("model", "mmproj"), ("other-model", "mmproj"), ("model", "other-mmproj"))]
    keys = [batch_input.for_model(items, model)[0].key for model in models]
    assert len(set(keys)) == 3 and items[0].key not in keys
    assert batch_input.for_model(items, models[0])[0].key == keys[0]  # the same model: the same key
    unkeyed = batch_input.Item(str(image), "image", "q", path=image)
    assert batch_input.for_model([unkeyed], models[0])[0].key == keys[0]  # keyed first
def _deep(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


def test_rows_and_schemas_nested_too_deep_are_error_items(tmp_path: Path) -> None:
    _png(tmp_path / "ok.png", 1)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join([
        '{"image": "ok.png", "prompt": "p", "schema": ' + _deep(1100) + "}",  # past Python's recursion limit
        '{"image": "ok.png", "prompt": "p", "schema": ' + _deep(batch_input.MAX_NESTING + 5) + "}",
        json.dumps({"image": "ok.png", "prompt": "p", "schema": _deep(1100)}),  # the schema as JSON text
        json.dumps({"image": "ok.png", "prompt": "after"}),
    ]) + "\n")
    items = collect(rows)
    assert len(items) == 4 and all(i.key for i in items)
    assert [type(i.problem).__name__ for i in items[:3]] == ["ConfigError"] * 3
    assert items[3].problem is None and items[3].prompt == "after"
    table = tmp_path / "rows.csv"
    cell = _deep(1100).replace('"', '""')
    table.write_text(f'image,prompt,schema\nok.png,p,"{cell}"\nok.png,after,\n')
    items = collect(table)
    assert isinstance(items[0].problem, ConfigError) and items[1].problem is None
    schema = tmp_path / "deep.json"
    schema.write_text(_deep(1100))
    with pytest.raises(ConfigError):
        batch_input.load_schema(schema)
    schema.write_text(_deep(batch_input.MAX_NESTING - 1))
    assert batch_input.load_schema(schema)  # deep, but within the limit
    deep: dict = {}
    for _ in range(1100):
        deep = {"a": deep}
    with pytest.raises(ConfigError, match="nested"):  # the job's own schema, given in Python
        collect(rows, schema=deep)


def test_a_stray_quote_swallowing_rows_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _png(tmp_path / "a.png", 1)
    rows = tmp_path / "rows.csv"
    lines = ["image,prompt"] + [f"a.png,question {i}" for i in range(52)]
    lines[2] = 'a.png,"question 1 with a stray quote'
    rows.write_text("\n".join(lines) + "\n")
    with caplog.at_level("WARNING", logger="gguf_mcv.jobs.batch_input"):
        items = collect(rows)
    assert len(items) == 2  # what the CSV module reads: the quote runs to the end of the file
    assert any("stray quote" in r.getMessage() and "lines 3-53" in r.getMessage() for r in caplog.records)
    caplog.clear()
    rows.write_text("image,prompt\n" + "".join(f"a.png,q{i}\n" for i in range(5)))
    with caplog.at_level("WARNING", logger="gguf_mcv.jobs.batch_input"):
        assert len(collect(rows)) == 5
    assert not caplog.records


def test_a_recursive_glob_does_not_follow_symlinked_folders(tmp_path: Path) -> None:
    _png(tmp_path / "top" / "a.png", 1)
    _png(tmp_path / "top" / "sub" / "b.png", 2)
    for name in ("loop1", "loop2"):  # two links back up: a search following them never ends
        (tmp_path / "top" / "sub" / name).symlink_to(tmp_path / "top")
    code = ("import sys; from gguf_mcv.jobs.batch_input import collect\n"
            "print(sorted(i.input for i in collect(sys.argv[1], prompts=['q'])))\n"
            "print(len(collect(sys.argv[2], prompts=['q'])))\n")
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "top" / "**" / "*.png"), str(tmp_path / "top")],
                          capture_output=True, text=True, timeout=30, env=os.environ)
    assert done.returncode == 0, done.stderr
    found, in_folder = done.stdout.splitlines()
    assert found == str(sorted([str(tmp_path / "top" / "a.png"), str(tmp_path / "top" / "sub" / "b.png")]))
    assert in_folder == "2"
