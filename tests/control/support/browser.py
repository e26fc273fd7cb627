"""Headless Chromium (Debian's, driven by Playwright) logged in to a test's Airflow stack as the
login page would leave it: the user's JWT in the ``_token`` cookie."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from control.support.airflow_stack import CHROMIUM, AirflowStack

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


@contextmanager
def logged_in_page(stack: AirflowStack, user: str = "admin", width: int = 1400, height: int = 1800) -> Iterator:
    """A Playwright page whose requests carry ``user``'s login; the browser is closed on exit."""
    from playwright.sync_api import sync_playwright

    token = stack.token if user == "admin" and stack.token else stack.token_for(user)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": width, "height": height})
            context.add_cookies([{"name": "_token", "value": token, "url": stack.base_url}])
            page = context.new_page()
            page.set_default_timeout(90_000)
            yield page
        finally:
            browser.close()
