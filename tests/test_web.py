"""The chat page at / in headless Chromium: it loads, sends a message, and the streamed reply shows up."""

from __future__ import annotations

import shutil

import pytest

from tests.serving import Server
from tests.tiny import make_tiny_model

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


@pytest.fixture
def browser(tmp_path):
    if not (shutil.which(CHROMIUM) and shutil.which(DRIVER)):
        pytest.skip("chromium and chromedriver are not installed (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1100,700",
                 f"--user-data-dir={tmp_path / 'profile'}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(options=opts, service=Service(DRIVER))
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def test_chat_page_streams_a_reply(browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    model = make_tiny_model(tmp_path / "tiny", "llama", tied=False, heads=4, kv_heads=2)
    server = Server(model, tmp_path / "serve.log")
    try:
        browser.get(server.url + "/")
        wait = WebDriverWait(browser, 60)
        wait.until(ec.text_to_be_present_in_element((By.ID, "model"), "tiny"))
        limit = browser.find_element(By.ID, "max-tokens")
        limit.clear()
        limit.send_keys("40")
        box = browser.find_element(By.ID, "input")
        box.send_keys("Hello from the browser")
        browser.find_element(By.ID, "send").click()
        wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, ".msg.assistant.done")))
        wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, ".msg.stats")))
        user = browser.find_element(By.CSS_SELECTOR, ".msg.user").text
        reply = browser.find_element(By.CSS_SELECTOR, ".msg.assistant").text
        stats = browser.find_element(By.CSS_SELECTOR, ".msg.stats").text
        assert user == "Hello from the browser"
        assert reply.strip(), "the reply is empty"
        assert "generated" in stats and int(stats.split(", ")[1].split()[0]) <= 40
        assert not browser.find_elements(By.CSS_SELECTOR, ".msg.error")
        browser.save_screenshot(str(tmp_path / "chat.png"))
        assert (tmp_path / "chat.png").stat().st_size > 1000
        # a second turn sends the history: the server reuses the cached first turn
        box.send_keys("And again")
        browser.find_element(By.ID, "send").click()
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.stats")) == 2)
        second = browser.find_elements(By.CSS_SELECTOR, ".msg.stats")[1].text
        cached = int(second.split("(")[1].split(" cached")[0])
        assert cached > 0, second
        browser.save_screenshot(str(tmp_path / "chat-2.png"))
    finally:
        assert server.stop() == 0
    assert "Traceback" not in server.log()
