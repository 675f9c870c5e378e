"""The web chat page in headless Chromium: type a message, see a streamed reply."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
webdriver = pytest.importorskip("selenium.webdriver")

from server_util import running_server  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


@pytest.mark.skipif(not (CHROMIUM and DRIVER),
                    reason="Debian's chromium and chromium-driver are not installed "
                           "(CI installs them: apt-get install chromium chromium-driver)")
def test_chat_page_streams_a_reply(shipped_sparse, tmp_path):
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=900,640", f"--user-data-dir={tmp_path / 'profile'}"):
        opts.add_argument(arg)
    with running_server(shipped_sparse["sparse"], "--parallel", "1", "--ctx", "256") as url:
        driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
        try:
            driver.get(url + "/")
            wait = WebDriverWait(driver, 30)
            wait.until(lambda d: "tiny" in d.find_element(By.ID, "model-name").text)
            box = driver.find_element(By.ID, "input")
            box.send_keys("Who made the light?")
            box.send_keys(Keys.ENTER)
            reply = wait.until(lambda d: d.find_element(
                By.CSS_SELECTOR, ".msg.assistant[data-done='1']"))
            text = reply.find_element(By.CSS_SELECTOR, ".text").text
            stats = reply.find_element(By.CSS_SELECTOR, ".stats").text
            assert driver.find_element(By.CSS_SELECTOR, ".msg.user").text == "Who made the light?"
            assert len(text) > 20, text
            assert int(reply.get_attribute("data-chunks")) > 1  # it arrived in pieces
            assert "tokens/s" in stats and "FFN density" in stats, stats
            # a second turn goes through the same slot: its history is cached
            box.send_keys("And what of the darkness?")
            box.send_keys(Keys.ENTER)
            wait.until(lambda d: len(d.find_elements(
                By.CSS_SELECTOR, ".msg.assistant[data-done='1']")) == 2)
            second = driver.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats")[1].text
            assert "cached" in second, second
            shot = tmp_path / "web-chat.png"
            driver.save_screenshot(str(shot))
            assert shot.stat().st_size > 10_000
            out_dir = os.environ.get("POWERINFER_SCREENSHOT_DIR")  # docs/img, by hand
            if out_dir:
                Path(out_dir).mkdir(parents=True, exist_ok=True)
                shutil.copy(shot, Path(out_dir) / "web-chat.png")
        finally:
            driver.quit()
