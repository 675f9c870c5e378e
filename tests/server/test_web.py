"""The web chat page in headless Chromium: a streamed reply, 20 turns at a 512-token
context (the oldest turns left out, said so, no error), the chat kept across a reload,
and replies rendered as Markdown without letting a reply inject markup."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
webdriver = pytest.importorskip("selenium.webdriver")

from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402
from server_util import running_server  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")

pytestmark = pytest.mark.skipif(
    not (CHROMIUM and DRIVER),
    reason="Debian's chromium and chromium-driver are not installed "
           "(CI installs them: apt-get install chromium chromium-driver)")


@pytest.fixture(scope="module")
def page(shipped_sparse, tmp_path_factory):
    """A browser on a running server (the shipped sparse model, context 512)."""
    profile = tmp_path_factory.mktemp("profile")
    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=900,640", f"--user-data-dir={profile}"):
        opts.add_argument(arg)
    with running_server(shipped_sparse["sparse"], "--parallel", "1", "--ctx", "512") as url:
        driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
        try:
            yield driver, url
        finally:
            driver.quit()


def _open(driver, url, new_chat=True):
    driver.get(url + "/")
    wait = WebDriverWait(driver, 60)
    wait.until(lambda d: "tiny" in d.find_element(By.ID, "model-name").text)
    if new_chat:
        driver.find_element(By.ID, "clear").click()
        assert not driver.find_elements(By.CSS_SELECTOR, ".msg")
    return wait


def _say(driver, wait, text, n_done):
    box = driver.find_element(By.ID, "input")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done='1']"))
               + len(d.find_elements(By.CSS_SELECTOR, ".msg.error")) >= n_done)
    errors = driver.find_elements(By.CSS_SELECTOR, ".msg.error")
    assert not errors, errors[0].text


def test_chat_page_streams_a_reply(page, tmp_path):
    driver, url = page
    wait = _open(driver, url)
    header = driver.find_element(By.ID, "model-name").text
    assert "context 512 tokens" in header and "FFN sparse" in header, header
    _say(driver, wait, "Who made the light?", 1)
    reply = driver.find_element(By.CSS_SELECTOR, ".msg.assistant[data-done='1']")
    text = reply.find_element(By.CSS_SELECTOR, ".text").text
    stats = reply.find_element(By.CSS_SELECTOR, ".stats").text
    assert driver.find_element(By.CSS_SELECTOR, ".msg.user").text == "Who made the light?"
    assert len(text) > 20, text
    assert int(reply.get_attribute("data-chunks")) > 1  # it arrived in pieces
    assert "tokens/s" in stats and "FFN density" in stats, stats
    # a second turn goes through the same slot: its history is cached
    _say(driver, wait, "And what of the darkness?", 2)
    second = driver.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats")[1].text
    assert "cached" in second, second
    shot = tmp_path / "web-chat.png"
    driver.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    out_dir = os.environ.get("POWERINFER_SCREENSHOT_DIR")  # docs/img, by hand
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(out_dir) / "web-chat.png")


def test_twenty_turns_fit_the_context_and_survive_a_reload(page):
    """At 512 tokens and 64-token replies the conversation outgrows the context after a
    few turns: every turn still gets its reply, the oldest turns are left out (greyed,
    with a notice), and a reload shows the same conversation."""
    driver, url = page
    wait = _open(driver, url)
    driver.execute_script("document.getElementById('max-tokens').value = '64';")
    for i in range(20):
        _say(driver, wait, f"Turn {i}: tell me of the waters and the firmament.", i + 1)
    msgs = driver.find_elements(By.CSS_SELECTOR, ".msg")
    assert len(msgs) == 40
    out = driver.find_elements(By.CSS_SELECTOR, ".msg.out")
    assert len(out) >= 10, "the oldest turns were not left out"
    # left out from the oldest on, and the newest turns kept
    classes = [m.get_attribute("class") for m in msgs]
    first_kept = next(i for i, c in enumerate(classes) if "out" not in c)
    assert all("out" in c for c in classes[:first_kept])
    assert all("out" not in c for c in classes[first_kept:])
    assert first_kept <= 36
    notes = driver.find_elements(By.CSS_SELECTOR, ".notice")
    assert notes and "512-token context" in notes[0].text, [n.text for n in notes]
    texts = [m.find_element(By.CSS_SELECTOR, ".text").text for m in msgs]

    wait = _open(driver, url, new_chat=False)   # reload
    again = driver.find_elements(By.CSS_SELECTOR, ".msg")
    assert [m.find_element(By.CSS_SELECTOR, ".text").text for m in again] == texts
    assert len(driver.find_elements(By.CSS_SELECTOR, ".msg.out")) == len(out)
    # and the restored conversation goes on
    _say(driver, wait, "One more turn.", 21)
    assert len(driver.find_elements(By.CSS_SELECTOR, ".msg")) == 42

    driver.find_element(By.ID, "clear").click()   # "New chat" empties it, also after a reload
    _open(driver, url, new_chat=False)
    assert not driver.find_elements(By.CSS_SELECTOR, ".msg")


def test_markdown_renders_without_injection(page):
    """renderMarkdown on hostile and ordinary Markdown: structure from the Markdown,
    everything else as text; no element the Markdown did not ask for, no script URL."""
    driver, url = page
    _open(driver, url)
    src = ("# Title\n\nSome **bold** and *it* and `x<y>` <img src=x onerror=alert(1)>\n"
           "- one\n- [two](https://example.org/a)\n1. first\n2. [bad](javascript:alert(1))\n"
           "> quoted <b>not bold</b>\n\n```python\nprint('<script>')\n```\nafter\n```\nopen fence")
    html = driver.execute_script(
        "const d = document.createElement('div'); renderMarkdown(arguments[0], d);"
        "window.__mdProbe = d; return d.innerHTML;", src)
    tags = driver.execute_script(
        "return [...window.__mdProbe.querySelectorAll('*')].map(e => e.tagName.toLowerCase());")
    assert set(tags) <= {"h3", "p", "strong", "em", "code", "ul", "ol", "li", "a", "blockquote",
                         "pre", "br"}, tags
    assert "img" not in tags and "script" not in tags and "b" not in tags
    assert "&lt;img src=x onerror=alert(1)&gt;" in html
    links = driver.execute_script(
        "return [...window.__mdProbe.querySelectorAll('a')].map(a => [a.href, a.rel, a.textContent]);")
    assert links == [["https://example.org/a", "noopener noreferrer nofollow", "two"]]
    assert "[bad](javascript:alert(1))" in driver.execute_script(
        "return window.__mdProbe.querySelector('ol').textContent;")
    codes = driver.execute_script(
        "return [...window.__mdProbe.querySelectorAll('pre code')].map(c => c.textContent);")
    assert codes == ["print('<script>')", "open fence"]
    assert tags.count("li") == 4 and tags.count("h3") == 1
    assert driver.execute_script("return window.__mdProbe.querySelector('strong').textContent;") == "bold"
