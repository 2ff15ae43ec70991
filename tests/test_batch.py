"""batch: one line per item with broken files recorded, the cache used, and a killed job resumed exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

from gguf_mcv.errors import ModelClosedError, OutputBusyError
from gguf_mcv.jobs import batch
from gguf_mcv.jobs.batch_output import ResultsFile

GREEDY = {"max_tokens": 3, "temperature": 0.0}


def _png(path: Path, seed: int, size: tuple[int, int] = (40, 56)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    PIL.Image.fromarray(pixels).save(path)
    return path


def _video(path: Path, seed: int) -> Path:
    import cv2

    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 2.0, (64, 48))
    rng = np.random.default_rng(seed)
    for _ in range(4):  # 2 s: two sampled frames, different enough to be kept
        writer.write(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8))
    writer.release()
    return path


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


@pytest.fixture
def mixed(tmp_path: Path) -> Path:
    """Two good images, a good video, a broken image, a broken video and a text file (skipped)."""
    folder = tmp_path / "in"
    _png(folder / "a.png", 101)
    _png(folder / "b.jpg", 102)
    _video(folder / "c.avi", 103)
    (folder / "d.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    (folder / "e.mp4").write_bytes(os.urandom(2048))
    (folder / "readme.txt").write_text("not media")
    return folder


def test_mixed_folder_gives_one_line_per_item_and_records_the_broken(tiny_model, mixed: Path,
                                                                      tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    summary = batch.run(tiny_model, mixed, out, prompts=["What is it?", "Which colours?"], options=GREEDY,
                        progress=False)
    rows = _rows(out)
    assert (summary.total, summary.answered, summary.skipped, summary.failed) == (10, 10, 0, 4)
    assert len(rows) == 10 and len({r["key"] for r in rows}) == 10
    by_name: dict[str, list[dict]] = {}
    for row in rows:
        by_name.setdefault(Path(row["input"]).name, []).append(row)
    assert sorted(by_name) == ["a.png", "b.jpg", "c.avi", "d.png", "e.mp4"]
    for name in ("a.png", "b.jpg", "c.avi"):
        for row in by_name[name]:
            assert row["error"] is None and isinstance(row["answer"], str)
            assert row["usage"]["completion_tokens"] <= 3 and row["timings"]["total_ms"] > 0
    assert by_name["c.avi"][0]["kind"] == "video" and by_name["c.avi"][0]["video"]["used"] >= 1
    for name in ("d.png", "e.mp4"):
        assert [r["error"]["class"] for r in by_name[name]] == ["MediaError", "MediaError"]
        assert all(r["answer"] is None and r["error"]["message"] for r in by_name[name])

    # the second prompt about an image takes its slices from the embedding cache
    first, second = by_name["a.png"]
    assert first["timings"]["slices_encoded"] >= 1
    assert second["timings"]["slices_encoded"] == 0
    # from the embedding cache, or still in the KV cache (the prompts share the image's prefix)
    reused = second["timings"]["slices_from_cache"] == first["timings"]["slices_encoded"] or \
        second["usage"]["cached_tokens"] >= first["usage"]["image_tokens"]
    assert reused and second["usage"]["image_tokens"] == first["usage"]["image_tokens"]

    # a rerun answers nothing and leaves the file as it was
    before = out.read_bytes()
    again = batch.run(tiny_model, mixed, out, prompts=["What is it?", "Which colours?"], options=GREEDY,
                      progress=False)
    assert (again.answered, again.skipped) == (0, 10) and out.read_bytes() == before


def test_rows_with_schema_and_per_row_options(tiny_model, tmp_path: Path) -> None:
    _png(tmp_path / "x.png", 201)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps(r) for r in [
        {"image": "x.png", "prompt": "Is it ok?", "schema": schema, "max_tokens": 24, "id": "r1"},
        {"image": "x.png", "prompt": "Short.", "max_tokens": 2, "temperature": 0},
        {"image": "x.png", "prompt": "Bad option.", "max_tokens": "ten"},
        {"image": "x.png", "prompt": "x" * 20000, "max_tokens": 2},
    ]) + "\n")
    out = tmp_path / "out.jsonl"
    summary = batch.run(tiny_model, rows, out, options={"temperature": 0.0}, progress=False)
    first, short, bad, huge = _rows(out)
    assert summary.answered == 4 and summary.failed == 2
    assert first["id"] == "r1"
    if first["parse_error"] is None:  # random weights: valid JSON unless max_tokens cut it
        assert first["parsed"] == json.loads(first["answer"]) and isinstance(first["parsed"]["ok"], bool)
    else:
        assert first["parsed"] is None and first["finish_reason"] == "length"
    assert short["usage"]["completion_tokens"] <= 2 and "parsed" in short and short["parsed"] is None
    assert bad["error"]["class"] == "ConfigError" and "max_tokens" in bad["error"]["message"]
    assert huge["error"]["class"] == "ContextOverflowError"


def test_closed_model_ends_the_job(tiny, tmp_path: Path) -> None:
    import gguf_mcv

    model = gguf_mcv.load(model_path=tiny.quants["Q2_K"], mmproj_path=tiny.mmproj, n_ctx=1024, n_threads=1)
    model.close()
    _png(tmp_path / "in" / "a.png", 301)
    with pytest.raises(ModelClosedError):
        batch.run(model, tmp_path / "in", tmp_path / "out.jsonl", prompts=["q"], progress=False)
    assert not (tmp_path / "out.jsonl").exists()  # refused before the results file is opened


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "gguf_mcv", "batch", *args]


def test_killed_cli_job_resumes_to_the_same_lines(tiny, tmp_path: Path) -> None:
    folder = tmp_path / "in"
    for i in range(5):
        _png(folder / f"p{i}.png", 400 + i, size=(500, 700))  # several slices each: slow enough to kill
    common = [str(tiny.quants["Q4_K_M"]), "--mmproj", str(tiny.mmproj), str(folder), "--prompt", "What?",
              "--max-tokens", "4", "--temperature", "0", "--threads", "1", "--detail", "high", "--no-progress"]
    whole = tmp_path / "whole.jsonl"
    done = subprocess.run(_cli(*common, "--out", str(whole)), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "5 answered (0 errors)" in done.stderr

    cut = tmp_path / "cut.jsonl"
    job = subprocess.Popen(_cli(*common, "--out", str(cut)), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not cut.exists() or cut.read_bytes().count(b"\n") < 2):
        time.sleep(0.02)
    job.send_signal(signal.SIGKILL)
    job.wait(timeout=30)
    lines_at_kill = cut.read_bytes().count(b"\n")
    assert 2 <= lines_at_kill < 5, "the job was not killed midway"
    with open(cut, "ab") as f:  # as if killed inside a write: a torn last line
        f.write(b'{"key": "torn", "input": "p9.pn')

    resumed = subprocess.run(_cli(*common, "--out", str(cut)), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{5 - lines_at_kill} answered" in resumed.stderr and "cut a torn last line" in resumed.stderr
    cut_rows, whole_rows = _rows(cut), _rows(whole)
    assert len(cut_rows) == 5 and len({r["key"] for r in cut_rows}) == 5  # no item answered twice
    assert _answers(cut_rows) == _answers(whole_rows)


def _answers(rows: list[dict]) -> dict[str, tuple]:
    """What must not depend on how the job was run: by key, the item, answer and error
    (timings and the KV cache's share of the prompt do)."""
    return {r["key"]: (r["input"], r["prompt"], r["answer"], r["parsed"], r["error"], r["finish_reason"],
                       r["usage"] and r["usage"]["completion_tokens"]) for r in rows}


def test_cli_refuses_a_busy_output_and_bad_input(tiny, tmp_path: Path) -> None:
    _png(tmp_path / "in" / "a.png", 501)
    model = [str(tiny.quants["Q2_K"]), "--mmproj", str(tiny.mmproj)]
    out = tmp_path / "out.jsonl"
    with ResultsFile(out):
        busy = subprocess.run(_cli(*model, str(tmp_path / "in"), "--prompt", "q", "--out", str(out)),
                              capture_output=True, text=True, timeout=120)
    assert busy.returncode == 1 and "Another batch job is writing" in busy.stderr
    assert "Traceback" not in busy.stderr
    missing = subprocess.run(_cli(*model, str(tmp_path / "nope"), "--prompt", "q", "--out", str(out)),
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and "does not exist" in missing.stderr
    schema = tmp_path / "s.json"
    schema.write_text("[1, 2]")
    bad_schema = subprocess.run(_cli(*model, str(tmp_path / "in"), "--prompt", "q", "--schema", str(schema),
                                     "--out", str(out)), capture_output=True, text=True, timeout=120)
    assert bad_schema.returncode == 1 and "not an object" in bad_schema.stderr
    assert out.read_bytes() == b""


def test_two_jobs_on_one_output_in_threads(tiny_model, tmp_path: Path) -> None:
    """Two jobs started together on the same file: one writes it, the other is refused whole."""
    import threading

    _png(tmp_path / "in" / "a.png", 601)
    out = tmp_path / "out.jsonl"
    outcomes: list[object] = []
    start = threading.Barrier(2)

    def job() -> None:
        start.wait()
        try:
            outcomes.append(batch.run(tiny_model, tmp_path / "in", out, prompts=["q"], options=GREEDY,
                                      progress=False))
        except OutputBusyError as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=job) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    kinds = sorted(type(o).__name__ for o in outcomes)
    # either one was refused while the other held the file, or they ran one after the other
    assert kinds in (["OutputBusyError", "Summary"], ["Summary", "Summary"])
    assert len(_rows(out)) == 1


def test_progress_bar_and_undecodable_csv_text(tiny_model, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _png(tmp_path / "a.png", 701)
    rows = tmp_path / "rows.csv"
    rows.write_bytes(b"image,prompt\na.png,fine\na.png,bad \xff\xfe bytes\n")
    out = tmp_path / "out.jsonl"
    summary = batch.run(tiny_model, rows, out, options=GREEDY, progress=True)
    assert "2/2" in capsys.readouterr().err  # tqdm's bar: done/total
    good, bad = _rows(out)
    assert good["error"] is None and bad["error"]["class"] == "ConfigError"
    assert summary.failed == 1
    again = batch.run(tiny_model, rows, out, options=GREEDY, progress=False)  # the file reads back
    assert again.skipped == 2 and again.answered == 0


def test_a_rerun_with_another_model_answers_the_items_again(tiny, tiny_model, retuned_mmproj: Path,
                                                            tmp_path: Path) -> None:
    import gguf_mcv

    for i in range(2):
        _png(tmp_path / "in" / f"p{i}.png", 700 + i)
    out = tmp_path / "out.jsonl"

    def run(model) -> batch.Summary:
        return batch.run(model, tmp_path / "in", out, prompts=["q"], options=GREEDY, progress=False)

    assert run(tiny_model).answered == 2
    for quant, mmproj in (("Q2_K", tiny.mmproj), ("Q4_K_M", retuned_mmproj)):  # another text model, projector
        with gguf_mcv.load(model_path=tiny.quants[quant], mmproj_path=mmproj, n_ctx=1024, n_threads=2) as other:
            summary = run(other)
        assert (summary.answered, summary.skipped) == (2, 0)
    again = run(tiny_model)  # the first model's rows are still there
    assert (again.answered, again.skipped) == (0, 2)
    rows = _rows(out)
    assert len(rows) == 6 and len({r["key"] for r in rows}) == 6
def test_a_row_that_is_not_strict_json_is_recorded_as_an_error(tmp_path: Path) -> None:
    items = [batch.Item(f"{n}.png", "image", "p", key=n) for n in ("inf", "deep", "ok")]
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    parsed = {"inf": {"x": float("inf")}, "deep": deep, "ok": {"x": 1.5}}
    out = tmp_path / "r.jsonl"

    def rows(todo):
        for item in todo:
            yield {**batch.base_row(item), "answer": "{}", "parsed": parsed[item.key]}

    summary = batch.write_rows(items, out, rows, progress=False)
    assert (summary.answered, summary.failed) == (3, 2)
    written = {r["key"]: r for r in batch.iter_rows(out)}
    assert written["inf"]["error"]["class"] == "ValueError" and written["inf"]["parsed"] is None
    assert written["deep"]["error"] is not None and written["ok"]["parsed"] == {"x": 1.5}
    assert batch.write_rows(items, out, rows, progress=False).skipped == 3  # a rerun does not ask again


def test_a_rerun_with_another_vision_encoder_or_precision_answers_again(tiny, tmp_path: Path) -> None:
    import gguf_mcv

    for i in range(2):
        _png(tmp_path / "in" / f"p{i}.png", 720 + i)
    out = tmp_path / "out.jsonl"
    files = dict(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, n_ctx=4096, n_threads=2)

    def run(backend: str) -> batch.Summary:
        with gguf_mcv.load(**files, vision_backend=backend) as model:
            assert model.info.vision_backend == backend
            return batch.run(model, tmp_path / "in", out, prompts=["q"], options=GREEDY, progress=False)

    for backend in ("onnx-int8", "onnx-fp32", "llama.cpp"):
        summary = run(backend)
        assert (summary.answered, summary.skipped) == (2, 0), backend
    again = run("onnx-int8")  # the same encoder and precision as the first run: nothing to ask
    assert (again.answered, again.skipped) == (0, 2)
    rows = _rows(out)
    assert len(rows) == 6 and len({r["key"] for r in rows}) == 6


def test_the_answer_identity_names_the_encoder_and_the_defaults_an_answer_depends_on(tiny_model) -> None:
    from gguf_mcv.jobs.batch_input import answer_identity

    settings = json.loads(answer_identity(tiny_model))
    info = tiny_model.info
    assert settings["vision"]["backend"] == info.vision_backend
    if info.vision_backend == "onnx-int8":
        assert settings["vision"]["int8_scope"] == "blocks"  # the 2.6 resampler stays fp32
    assert settings["sampling"]["temperature"] == tiny_model.sampling.temperature
    assert settings["n_ctx"] == info.n_ctx and settings["max_tokens"] > 0 and settings["max_frames"] > 0
    assert len(settings["template"]) == 64
    assert answer_identity(tiny_model) == answer_identity(tiny_model)  # stable: a rerun finds its keys


def test_mapped_and_packed_encoder_weights_give_the_same_answers_and_keys(tiny, tmp_path: Path) -> None:
    """Why the key leaves ``vision_weights`` out: the same weights, read from their file or copied."""
    import gguf_mcv
    from gguf_mcv.jobs.batch_input import answer_identity

    image = _png(tmp_path / "p.png", 731, size=(500, 700))  # several slices
    answers, identities = [], []
    for weights in ("packed", "mapped"):
        with gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, n_ctx=4096, n_threads=2,
                           vision_backend="onnx-int8", vision_weights=weights) as model:
            answers.append(model.ask("q", image, max_tokens=8, temperature=0.0, detail="high"))
            identities.append(answer_identity(model))
    assert str(answers[0]) == str(answers[1]) and answers[0].usage.completion_tokens > 0
    assert identities[0] == identities[1]
