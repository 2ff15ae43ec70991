"""The web page at ``/`` (gguf_mcv/server/page.py + page.html), in a real headless Chromium.

The browser is Debian's ``chromium`` driven through ``chromium-driver`` by Selenium. When
they are not installed (an apt install that failed in CI) the browser test is skipped,
saying why; everything else here needs no browser.
"""

from __future__ import annotations

import base64
import io
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
requests = pytest.importorskip("requests")

from test_server import Running  # noqa: E402  (tests/ is on sys.path)

import gguf_mcv  # noqa: E402  (after the importorskips)
from gguf_mcv import server  # noqa: E402

KEY = "page-key"


@pytest.fixture(scope="module")
def model(tiny) -> Iterator[gguf_mcv.Model]:
    m = gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, n_ctx=4096, n_threads=2)
    yield m
    m.close()


@pytest.fixture(scope="module")
def srv(model) -> Iterator[Running]:
    running = Running(server.build_app(model, api_key=KEY))
    yield running
    running.stop()


def png(seed: int, size: tuple[int, int] = (120, 90)) -> bytes:
    out = io.BytesIO()
    rgb = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    PIL.Image.fromarray(rgb).save(out, format="PNG")
    return out.getvalue()


def write_video(path: Path, frames: int = 30, fps: float = 10.0) -> None:
    import cv2

    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (64, 48))
    for i in range(frames):
        writer.write(np.full((48, 64, 3), (i * 8) % 256, np.uint8))
    writer.release()


# --- without a browser -----------------------------------------------------------------------


def test_browsers_get_the_page_and_other_clients_the_greeting(srv: Running) -> None:
    page = requests.get(srv.url + "/", headers={"Accept": "text/html,application/xhtml+xml"}, timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    assert page.headers["x-content-type-options"] == "nosniff"
    assert "/v1/chat/completions" in page.text
    assert "http://" not in page.text and "https://" not in page.text  # nothing from elsewhere
    plain = requests.get(srv.url + "/", timeout=10)  # what Ollama clients and scripts ask
    assert plain.status_code == 200 and plain.text == "gguf_mcv is running"
    assert requests.head(srv.url + "/", timeout=10).status_code in (200, 405)


def test_the_page_needs_no_key_but_the_api_still_does(srv: Running) -> None:
    assert requests.get(srv.url + "/", headers={"Accept": "text/html"}, timeout=10).status_code == 200
    assert requests.get(srv.url + "/v1/models", timeout=10).status_code == 401


# --- in Chromium -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        pytest.skip("no headless browser: install Debian's chromium and chromium-driver "
                    "(apt-get install chromium chromium-driver) to run the web page's test")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the test extra)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--disable-extensions", "--no-first-run"):
        options.add_argument(arg)
    from selenium.common.exceptions import WebDriverException

    try:  # the driver's path is given, so Selenium Manager never tries to download one
        driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver_path))
    except WebDriverException as exc:  # an installed browser that cannot start here: an install problem
        pytest.skip(f"{chromium} with {driver_path} did not start: {str(exc).splitlines()[0][:200]}")
    driver.set_page_load_timeout(15)
    yield driver
    driver.quit()


def wait(driver: Any, condition, timeout: float = 90.0) -> Any:  # generous: a loaded CI machine
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition(d))


def done_answers(driver: Any) -> list[Any]:
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, ".msg.assistant.done")


def ask(driver: Any, question: str) -> Any:
    """Type ``question``, press Ask, wait for its answer to finish; the answer's element."""
    from selenium.webdriver.common.by import By

    before = len(done_answers(driver))
    box = driver.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(question)
    driver.find_element(By.ID, "send").click()
    return wait(driver, lambda d: len(done_answers(d)) > before and done_answers(d)[-1])


def test_ask_about_a_picture_then_follow_up_in_the_browser(srv: Running, model, browser, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    d = browser
    d.get(srv.url + "/")
    key = d.find_element(By.ID, "key")
    d.execute_script("document.getElementById('settings').open = true")
    key.send_keys(KEY)
    d.find_element(By.ID, "max-tokens").click()  # leaving the field saves the key and names the model
    served = requests.get(srv.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"},
                          timeout=10).json()["data"][0]["id"]
    wait(d, lambda d: d.find_element(By.ID, "model").text == served)

    picture = tmp_path / "photo.png"
    picture.write_bytes(png(7, (700, 500)))  # overview + slices
    d.find_element(By.ID, "file").send_keys(str(picture))
    wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, "#preview img"))
    calls = model.engine.encoder_calls
    first = ask(d, "What is in the picture?")
    assert "failed" not in first.get_attribute("class")
    encoded = model.engine.encoder_calls - calls
    assert encoded > 1  # the picture went to the model, slices and all
    timings = first.find_element(By.CLASS_NAME, "timings").text
    assert "first token" in timings and "image " in timings and "prompt " in timings
    assert d.find_elements(By.CSS_SELECTOR, ".msg.user img")  # the picture shows in the conversation
    assert not d.find_elements(By.CSS_SELECTOR, "#preview img")  # and the picker is ready for another

    follow = ask(d, "And the colours?")  # the page sends the whole conversation again
    assert model.engine.encoder_calls - calls == encoded  # no slice encoded again
    cached = follow.find_element(By.CLASS_NAME, "timings").text
    assert "cached 0" not in cached
    assert len(d.find_elements(By.CSS_SELECTOR, ".msg")) == 4

    # a dropped image (a drag and drop, as the browser delivers it)
    d.execute_script("""
        const bytes = Uint8Array.from(atob(arguments[0]), c => c.charCodeAt(0));
        const data = new DataTransfer();
        data.items.add(new File([bytes], "dropped.png", {type: "image/png"}));
        document.getElementById("drop").dispatchEvent(new DragEvent("drop", {dataTransfer: data, bubbles: true}));
    """, base64.b64encode(png(8)).decode())
    wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, "#preview img"))
    assert "failed" not in ask(d, "And this one?").get_attribute("class")
    assert len(d.find_elements(By.CSS_SELECTOR, ".msg.user img")) == 2

    # something that is no image: refused in the page, nothing sent
    d.execute_script("""
        const data = new DataTransfer();
        data.items.add(new File(["hello"], "notes.txt", {type: "text/plain"}));
        document.getElementById("drop").dispatchEvent(new DragEvent("drop", {dataTransfer: data, bubbles: true}));
    """)
    wait(d, lambda d: "neither an image nor a video" in d.find_element(By.ID, "status").text)

    # a video, picked like a file: its frames go to the model
    clip = tmp_path / "clip.mp4"
    write_video(clip)
    d.find_element(By.ID, "file").send_keys(str(clip))
    wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, "#preview video"))
    calls = model.engine.encoder_calls
    assert "failed" not in ask(d, "What happens?").get_attribute("class")
    assert model.engine.encoder_calls - calls >= 2  # frames, one slice each

    d.find_element(By.ID, "new").click()
    assert d.find_elements(By.CSS_SELECTOR, ".msg") == []

    # a wrong key: the error is shown, the page keeps working
    d.execute_script("document.getElementById('key').value = 'wrong'")
    failed = ask(d, "Hello?")
    assert "failed" in failed.get_attribute("class") and "key" in failed.text.lower()


def test_an_answer_is_shown_as_text_never_as_markup(srv: Running, model, browser, monkeypatch) -> None:
    from selenium.webdriver.common.by import By

    hostile = ['<img src=x onerror="window.pwned=1">', "<script>window.pwned=2</script>", "<b>bold</b>"]

    def pieces():
        yield from hostile
        return gguf_mcv.Reply("".join(hostile), usage=gguf_mcv.Usage(3, 0, 3, 0), finish_reason="stop",
                              timings=gguf_mcv.Timings(0, 0, 0, 0, 0, 0, 0, 3))

    monkeypatch.setattr(model, "chat_completion", lambda *a, **k: gguf_mcv.Stream(pieces()))
    d = browser
    d.get(srv.url + "/")
    d.execute_script(f"document.getElementById('key').value = '{KEY}'")
    answer = ask(d, "Say something nasty")
    assert answer.find_element(By.TAG_NAME, "span").text == "".join(hostile)
    assert not answer.find_elements(By.CSS_SELECTOR, "img, script, b")
    assert d.execute_script("return window.pwned") is None
