"""The chat page at / in headless Chromium (Debian's chromium, driven by Playwright): a
streamed reply, the tokens/s readout, the stop button aborting the request, the note on a
reply cut at max tokens, and the new-chat button."""

import json
import os
import shutil
import warnings

import pytest
from server_process import API_KEY, wait_metric

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def page(server):
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing in CI; .ci/run installs it (apt-get install chromium)")
        warnings.warn("SKIPPING the chat-page browser test: no chromium on this machine "
                      "(apt-get install chromium)")
        pytest.skip("no chromium: install it with `apt-get install chromium`")
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"])
        page = browser.new_page()
        page.goto(server.url + "/")
        page.fill("#api-key", API_KEY)
        page.dispatch_event("#api-key", "change")
        page.wait_for_function("document.getElementById('model').textContent === 'smol'")
        yield page
        browser.close()


def wait_reply(page, condition: str) -> None:
    """Until the latest assistant message meets `condition` (a JS expression on it; a note
    may follow it, so not `:last-of-type`)."""
    page.wait_for_function(
        f"[...document.querySelectorAll('.msg.assistant')].pop().{condition}", timeout=60_000)


def test_streams_a_reply(page):
    assert page.input_value("#temperature") == "0.7"   # not the server's 1.0
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "48")
    page.fill("#prompt", "What is the capital of France?")
    with page.expect_request("**/v1/chat/completions") as sent:
        page.click("#send")
    body = json.loads(sent.value.post_data)
    assert body["temperature"] == 0 and body["max_tokens"] == 48
    reply = page.locator(".msg.assistant").last
    wait_reply(page, "dataset.state === 'done'")
    assert "Paris" in reply.inner_text()
    assert page.inner_text("#speed").endswith("tok/s") and page.inner_text("#speed")[0].isdigit()
    assert page.locator(".msg.user").last.inner_text() == "What is the capital of France?"


def test_stop_button_aborts(page, server):
    page.fill("#max-tokens", "3000")
    page.fill("#prompt", "Count from one to one thousand, one number per line.")
    page.click("#send")
    wait_reply(page, "textContent.length > 20")
    assert page.is_enabled("#stop") and not page.is_enabled("#send")
    page.click("#stop")
    wait_reply(page, "dataset.state === 'stopped'")
    assert page.is_enabled("#send")
    wait_metric(server.url, "vllm:num_requests_running", lambda v: v == 0)


def test_cut_reply_is_marked_and_new_chat_forgets(page):
    page.fill("#max-tokens", "4")
    page.fill("#prompt", "Tell me a long story about a dragon.")
    page.click("#send")
    wait_reply(page, "dataset.state === 'done'")
    assert page.locator(".msg.assistant").last.get_attribute("data-finish") == "length"
    assert "max tokens" in page.locator(".msg.note").last.inner_text()
    page.click("#new-chat")
    assert page.locator("#log > *").count() == 0
    page.fill("#prompt", "Hello")
    with page.expect_request("**/v1/chat/completions") as sent:
        page.click("#send")
    assert json.loads(sent.value.post_data)["messages"] == [{"role": "user", "content": "Hello"}]
    wait_reply(page, "dataset.state === 'done'")


def test_a_failed_turn_is_left_out(page):
    """A refused request (a 400 here) leaves its turn out of the conversation sent next
    (it had been kept, with an empty reply, so every later message failed the same way)
    and gives its text back to edit; settings the fields refuse are not sent; Enter that
    confirms an input method's word does not send."""
    page.click("#new-chat")
    refusal = {"error": {"message": "too long", "type": "invalid_request_error",
                         "param": "messages", "code": None}}
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=400, content_type="application/json", body=json.dumps(refusal)))
    page.fill("#prompt", "First")
    page.click("#send")
    page.wait_for_selector(".msg.error")
    assert "too long" in page.locator(".msg.error").last.inner_text()
    assert page.input_value("#prompt") == "First" and page.locator(".msg.assistant").count() == 0
    page.unroute("**/v1/chat/completions")
    page.fill("#max-tokens", "1.5")
    page.click("#send")
    assert "whole number" in page.locator(".msg.error").last.inner_text()
    page.fill("#max-tokens", "4")
    page.fill("#prompt", "Hello")
    page.dispatch_event("#prompt", "keydown", {"key": "Enter", "isComposing": True})
    assert page.input_value("#prompt") == "Hello"
    with page.expect_request("**/v1/chat/completions") as sent:
        page.press("#prompt", "Enter")
    assert json.loads(sent.value.post_data)["messages"] == [{"role": "user", "content": "Hello"}]
    wait_reply(page, "dataset.state === 'done'")
