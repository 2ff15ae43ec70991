"""gguf_mcv.progress: bars and the status line draw on stderr when asked, and nothing otherwise."""

from __future__ import annotations

from types import SimpleNamespace

from gguf_mcv import progress
from gguf_mcv.cli.watch_status import describe_tick


def test_a_status_line_draws_its_text_and_is_cleared_around_other_output(capsys):
    line = progress.status_line(show=True)
    line.set_description_str("frame 3 · asked")
    with line.external_write_mode():
        print('{"frame": 3}')
    line.close()
    out, err = capsys.readouterr()
    assert out == '{"frame": 3}\n'
    assert "frame 3 · asked" in err


def test_a_status_line_not_shown_draws_nothing(capsys):
    line = progress.status_line(show=False)
    line.set_description_str("frame 3 · asked")
    with line.external_write_mode():
        print("a line")
    line.close()
    out, err = capsys.readouterr()
    assert out == "a line\n" and err == ""


def test_not_a_terminal_means_not_shown(capsys):
    assert progress.shown() is False  # pytest captures stderr: not a terminal
    assert progress.shown(True) is True


def test_a_bar_not_shown_takes_every_call_and_draws_nothing(capsys):
    bar = progress.bar(4, desc="items", unit="item", show=False)
    bar.update(3)
    bar.set_postfix_str("from the cache")
    bar.close()
    assert capsys.readouterr().err == ""


def test_steps_draw_one_bar_per_step_and_close_it_when_done(capsys, monkeypatch):
    monkeypatch.setattr(progress, "shown", lambda show=None: True)
    update = progress.steps("converting")
    update("graph", 1, 2)
    update("graph", 2, 2)
    update("weights", 1, 1)
    err = capsys.readouterr().err
    assert "converting: graph" in err and "converting: weights" in err


def test_the_watch_status_says_what_the_tick_did():
    seen = SimpleNamespace(frame_index=7, changed=0.25, slices_encoded=2, slices_reused=8, asked=False,
                           latency_s=1.5, frames_skipped=3, ticks_skipped=1, reconnects=0)
    text = describe_tick(seen, 4)
    assert "frame 7" in text and "25.0% changed" in text and "unchanged" in text and "4 lines" in text
    assert "\x1b" not in text and "\n" not in text
