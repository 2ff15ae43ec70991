"""Options checked once, where they are defined: the library, CLI and APIs refuse alike."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gguf_mcv import ConfigError, MediaError, Sampling
from gguf_mcv.options import LoadOptions, check_text, max_threads, stop_list


@pytest.mark.parametrize("kw,match", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": math.nan}, "finite"),
    ({"top_p": 0}, "top_p"), ({"top_k": 2.5}, "top_k must be an integer"),
    ({"top_k": True}, "top_k must be an integer"), ({"seed": 1.5}, "seed must be an integer"),
    ({"repeat_penalty": "1.1"}, "repeat_penalty must be a number"), ({"min_p": 2}, "min_p"),
])
def test_sampling_refuses_bad_values_naming_them(kw, match) -> None:
    with pytest.raises(ConfigError, match=match):
        Sampling(**kw)


def test_overrides_keep_unset_values_and_refuse_unknown_names() -> None:
    s = Sampling().with_overrides(temperature=0.1, top_p=None)
    assert (s.temperature, s.top_p) == (0.1, Sampling().top_p)
    with pytest.raises(ConfigError, match="temprature"):
        Sampling().with_overrides(temprature=0.1)


def test_stop_strings() -> None:
    assert stop_list("END") == ["END"] and stop_list(None) == [] and stop_list(["a", ""]) == ["a"]
    with pytest.raises(ConfigError, match="stop"):
        stop_list(b"x")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="stop"):
        stop_list([1])  # type: ignore[list-item]


def test_load_options_bound_threads_for_this_machine() -> None:
    assert LoadOptions(n_threads=max_threads()).n_threads == max_threads()
    with pytest.raises(ConfigError, match="n_threads must be between 1 and"):
        LoadOptions(n_threads=100_000)
    with pytest.raises(ConfigError, match="n_ctx must be an integer"):
        LoadOptions(n_ctx=4096.5)  # type: ignore[arg-type]


def test_text_must_be_encodable() -> None:
    with pytest.raises(ConfigError, match="surrogate"):
        check_text("prompt", "bad \ud800 text")


@pytest.mark.parametrize("call,error,match", [
    (lambda m: m.ask("hi", max_tokens="10"), ConfigError, "max_tokens must be an integer"),
    (lambda m: m.ask("hi", seed=1.5), ConfigError, "seed"),
    (lambda m: m.ask("hi", top_k=2.5), ConfigError, "top_k"),
    (lambda m: m.ask("\ud800"), ConfigError, "surrogate"),
    (lambda m: m.ask(42), ConfigError, "prompt must be a string"),
    (lambda m: m.ask("hi", {"url": "x.png"}), MediaError, "image"),
    (lambda m: m.chat_completion("hi"), ConfigError, "messages must be a list"),
    (lambda m: m.chat_completion([{"role": "user", "content": 5}]), ConfigError, "content"),
    (lambda m: m.chat().send("hi", max_tokens=0), ConfigError, "max_tokens"),
])
def test_wrong_python_types_get_errors_that_name_the_argument(tiny_model, call, error, match) -> None:
    """These raised bare TypeError/AttributeError/ctypes.ArgumentError."""
    with pytest.raises(error, match=match):
        call(tiny_model)


def test_images_none_means_no_images(tiny_model) -> None:
    assert tiny_model.ask("hi", None, max_tokens=1).usage.image_tokens == 0


@pytest.mark.parametrize("bad", [0, -2, 65, "4", "many", 1.5, True, None])
def test_parallel_is_a_slot_count_or_auto(bad) -> None:
    with pytest.raises(ConfigError, match="parallel"):
        LoadOptions(parallel=bad)
    assert LoadOptions(parallel="auto").parallel == "auto" and LoadOptions(parallel=64).parallel == 64


@pytest.mark.parametrize("value", [10**400, -(10**400), 2**1024])
def test_an_int_past_floats_range_is_a_config_error_not_an_overflow(value: int) -> None:
    from gguf_mcv.options import check_number

    with pytest.raises(ConfigError, match="x must be a finite number, not an integer of"):
        check_number("x", value)
    with pytest.raises(ConfigError, match="temperature"):
        Sampling(temperature=value)


@given(st.text(max_size=40) | st.from_regex(r"(rtsp|http|udp)://[\w@:\[\]./?#-]{0,30}", fullmatch=True))
@settings(max_examples=300, deadline=None)
def test_any_url_text_is_split_or_refused_with_a_config_error(text: str) -> None:
    """urllib's ValueError (a bad port, an unclosed bracket) never escapes: a ConfigError instead."""
    from gguf_mcv.options import check_url

    try:
        parts = check_url("source", text, host_for=("rtsp", "http"))
    except ConfigError as exc:
        assert "secret" not in str(exc)
        return
    assert parts.port is None or 1 <= parts.port <= 65535
    if parts.scheme.lower() in ("rtsp", "http"):
        assert parts.hostname


@pytest.mark.parametrize("url,match", [
    ("rtsp://cam:99999/live", "Port out of range"), ("rtsp://[::1", "Invalid IPv6"),
    ("http://host:abc/", "Port could not be cast"), ("rtsp://:554/x", "names no host"),
    ("http://h:0/", "port 0"),
])
def test_bad_urls_are_refused_with_the_reason_and_no_password(url: str, match: str) -> None:
    from gguf_mcv.options import check_url

    with pytest.raises(ConfigError, match=match) as info:
        check_url("source", url.replace("://", "://admin:secret@"), host_for=("rtsp", "http"))
    assert "secret" not in str(info.value) and "***@" in str(info.value)
    assert check_url("source", "rtsp://[::1]:8554/live", host_for=("rtsp",)).port == 8554
