"""Headless Chromium for the UI tests and docs/screenshots.py: the Debian packages' browser
and driver (``/usr/bin/chromium``, ``/usr/bin/chromedriver``), driven by Selenium with
Selenium Manager kept offline, explicit waits, page text and atomic PNG screenshots."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

REQUIRE_ENV = "GRPO_REQUIRE_BROWSER"
WINDOW = (1600, 1000)


def find_browser() -> tuple[str | None, str | None]:
    """Paths of the Chromium binary and its chromedriver (None where missing)."""
    chrome = next(
        (p for n in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(n))),
        None,
    )
    driver = shutil.which("chromedriver") or (
        "/usr/bin/chromedriver" if Path("/usr/bin/chromedriver").exists() else None
    )
    return chrome, driver


def missing_browser() -> str | None:
    """Why no browser test can run here (None when Chromium and chromedriver are installed)."""
    import importlib.util

    chrome, driver = find_browser()
    missing = [n for n, p in (("chromium", chrome), ("chromedriver", driver)) if p is None]
    if missing:
        return (
            f"{' and '.join(missing)} not found on PATH: install the Debian packages "
            "(apt-get install chromium chromium-driver), as .ci/run does"
        )
    if importlib.util.find_spec("selenium") is None:
        return 'selenium is not installed: pip install -e ".[dev]"'
    return None


@contextmanager
def chromium(profile_dir: str | Path | None = None, window=WINDOW) -> Iterator[Browser]:
    """A headless Chromium whose pages get ``window`` (width, height) pixels, with a fresh
    profile (``profile_dir``, else a temporary folder removed afterwards): nothing remembered
    from an earlier session (MLflow keeps UI state in localStorage)."""
    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager: never download a driver
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chrome, driver_path = find_browser()
    if chrome is None or driver_path is None:
        raise RuntimeError(missing_browser())
    tmp = None
    if profile_dir is None:
        profile_dir = tmp = tempfile.mkdtemp(prefix="grpo-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = chrome
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-extensions",
        "--hide-scrollbars",
        f"--window-size={window[0]},{window[1]}",
        f"--user-data-dir={profile_dir}",
        "--lang=en-US",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        driver.set_page_load_timeout(60)
        # the page gets ``window`` (the browser's own frame would take ~140 px of its height)
        inner = driver.execute_script("return [window.innerWidth, window.innerHeight]")
        if list(inner) != list(window):
            size = driver.get_window_size()
            driver.set_window_size(
                size["width"] + window[0] - inner[0], size["height"] + window[1] - inner[1]
            )
        yield Browser(driver)
    finally:
        driver.quit()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


class Browser:
    """A thin layer over a Selenium driver: open, wait for what a person would see, read."""

    def __init__(self, driver):
        self.driver = driver

    # -- navigation and reading -------------------------------------------------------------
    def open(self, url: str) -> None:
        self.driver.get(url)

    @property
    def url(self) -> str:
        return self.driver.current_url

    def text(self) -> str:
        """The visible text of the page (what a person reads), "" while there is no body."""
        try:
            return self.driver.execute_script("return document.body ? document.body.innerText : ''")
        except Exception:
            return ""

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    def find(self, css: str) -> list:
        from selenium.webdriver.common.by import By

        return self.driver.find_elements(By.CSS_SELECTOR, css)

    # -- waiting ----------------------------------------------------------------------------
    def wait(self, until: Callable[[Browser], object], timeout: float = 30, what: str = ""):
        """Poll ``until(self)`` (WebDriverWait) until it returns something truthy; that value.
        TimeoutError names ``what`` and ends with the page's URL and the start of its text."""
        from selenium.common.exceptions import TimeoutException, WebDriverException
        from selenium.webdriver.support.ui import WebDriverWait

        try:
            return WebDriverWait(
                self.driver, timeout, poll_frequency=0.25, ignored_exceptions=(WebDriverException,)
            ).until(lambda _d: until(self))
        except TimeoutException:
            raise TimeoutError(
                f"waited {timeout:.0f}s for {what or until}; at {self.url}:\n{self.text()[:1500]}"
            ) from None

    def wait_text(self, *texts: str, timeout: float = 30) -> str:
        """Wait until every one of ``texts`` is in the visible text; the text."""
        return self.wait(
            lambda b: (t := b.text()) and all(s in t for s in texts) and t,
            timeout,
            what=f"text {texts!r}",
        )

    def wait_css(self, css: str, timeout: float = 30) -> list:
        """Wait until ``css`` matches at least one displayed element; the displayed ones."""
        return self.wait(
            lambda b: [e for e in b.find(css) if e.is_displayed()], timeout, what=f"element {css}"
        )

    def wait_quiet(self, timeout: float = 20, quiet: float = 1.0) -> None:
        """Wait until the page's text stops changing for ``quiet`` seconds (charts and tables
        drawn): the state to screenshot. Not an assertion: returns at ``timeout`` regardless."""
        deadline = time.monotonic() + timeout
        last, since = None, time.monotonic()
        while time.monotonic() < deadline:
            now = self.text()
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet:
                return
            time.sleep(0.2)

    def click(self, css: str, text: str, timeout: float = 30) -> None:
        """Click the displayed ``css`` element whose visible text is ``text`` once there is
        one (a re-render between finding and clicking is retried)."""
        from selenium.common.exceptions import WebDriverException

        def clicked(b):
            for e in b.find(css):
                try:
                    if e.is_displayed() and e.text.strip() == text:
                        e.click()
                        return True
                except WebDriverException:  # stale: the page re-rendered, look again
                    return False
            return False

        self.wait(clicked, timeout, what=f"a {css} {text!r} to click")

    # -- evidence ---------------------------------------------------------------------------
    def screenshot(self, path: str | Path) -> Path:
        """The page as the window shows it, a PNG at ``path``: written to a temporary name
        first and renamed, so no half-written file is ever there."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        png = self.driver.get_screenshot_as_png()
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(png)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp's file is private; an image is not
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    def evidence(self, folder: str | Path, name: str) -> str:
        """Screenshot + page text + URL into ``folder``; a line naming them, for a failure."""
        folder = Path(folder)
        png = self.screenshot(folder / f"{name}.png")
        txt = folder / f"{name}.txt"
        txt.write_text(f"{self.url}\n\n{self.text()}")
        return f"(screenshot {png}, page text {txt})"
