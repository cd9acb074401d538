"""`akunu serve`'s chat page at `/`: served under a strict CSP, off with --no-ui, fed by the stream's `akunu.drafted`
extension; and in headless Chromium: a conversation with the real default model (drafts and statistics, stop, edit
and resend, a reload, screenshots light and dark at desktop and phone widths), and with a scripted model behind
--api-key (the key prompt, a wrong key, an answer full of HTML that runs nothing, a context overflow, settings)."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import pytest

from tests.browser import (
    HOSTILE,
    by_css,
    color_distance,
    emulate,
    final_stats,
    fresh_page,
    last_message,
    launch,
    luminance,
    missing_browser,
    png_size,
    record_answers,
    recorded,
    screenshot,
    scripted_page_model,
    severe_logs,
    wait,
)
from tests.serve_fixtures import raw_request, start

KEY = "sk-page-test"
UI = Path(__file__).resolve().parent.parent / "cli" / "server" / "ui"
FAST = ("--draft-length", "fixed", "--draft-tokens", "8", "--disk-cache-size", "0")  # no cost curve to measure
REPEAT = "Repeat this text twice:\nthe quick brown fox jumps over the lazy dog, and the lazy dog sleeps on."
STATS = re.compile(r"^\d+ tokens · [\d.]+ tok/s · [\d.]+ tokens/pass · (\d+ of \d+ drafted tokens accepted|no drafts)")


@contextlib.contextmanager
def serving_scripted(home: Path, *args: str):
    """`akunu serve ARGS` over a scripted model (tests/browser.py's page_script)."""
    import akunu.models

    loaded = scripted_page_model()
    with pytest.MonkeyPatch.context() as patch, contextlib.ExitStack() as stack:
        with pytest.MonkeyPatch.context() as loading:  # only while it starts: the real server loads in this module too
            loading.setenv("AKUNU_HOME", str(home))
            loading.setattr(akunu.models, "load_model", lambda spec, **kwargs: loaded)
            loading.setattr(akunu.models, "load_tokenizer", lambda spec, **kwargs: loaded.tokenizer)
            server = start(stack, patch, *args, *FAST)
        yield server


@pytest.fixture(scope="module")
def scripted_server(tmp_path_factory):
    with serving_scripted(tmp_path_factory.mktemp("akunu-home"), "--api-key", KEY) as server:
        yield server


@pytest.fixture(scope="module")
def real_server(model_home):
    """`akunu serve` with the default model (smollm2-135m)."""
    with pytest.MonkeyPatch.context() as patch, contextlib.ExitStack() as stack:
        with pytest.MonkeyPatch.context() as loading:
            loading.setenv("AKUNU_HOME", str(model_home))
            server = start(stack, patch, *FAST)
        yield server


@pytest.fixture(scope="module")
def browser():
    if reason := missing_browser():
        pytest.skip(reason)
    driver = launch()
    yield driver
    driver.quit()


# --- the server's side, no browser needed ---


def test_the_page_loads_without_the_key_under_a_strict_csp_and_the_api_still_needs_it(scripted_server):
    status, headers, body = raw_request(scripted_server.base_url, "GET", "/")
    assert status == 200 and headers["content-type"].startswith("text/html") and b'src="/ui/app.js"' in body
    assert (
        "script-src 'self'" in headers["content-security-policy"]
        and "unsafe-inline" not in headers["content-security-policy"]
    )
    for name in ("app.js", "api.js", "markdown.js", "store.js", "style.css"):
        status, headers, _ = raw_request(scripted_server.base_url, "GET", f"/ui/{name}")
        assert status == 200 and headers["x-content-type-options"] == "nosniff", name
    assert raw_request(scripted_server.base_url, "GET", "/v1/models")[0] == 401
    assert raw_request(scripted_server.base_url, "GET", "/ui/../v1/models")[0] == 401


def test_no_ui_leaves_only_the_api(tmp_path):
    with serving_scripted(tmp_path, "--no-ui") as server:
        assert raw_request(server.base_url, "GET", "/")[0] == 404
        assert raw_request(server.base_url, "GET", "/ui/app.js")[0] == 404
        assert raw_request(server.base_url, "GET", "/v1/models")[0] == 200


def streamed(server, body: dict) -> list[dict]:
    headers = {"Authorization": f"Bearer {KEY}"}
    status, _, raw = raw_request(server.base_url, "POST", "/v1/chat/completions", {**body, "stream": True}, headers)
    assert status == 200
    events = [line.removeprefix("data: ") for line in raw.decode().split("\n\n") if line.startswith("data: {")]
    return [json.loads(event) for event in events]


def test_the_stream_marks_text_from_accepted_drafts_and_speculative_false_drafts_nothing(scripted_server):
    text = "the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the lazy dog"
    chunks = streamed(scripted_server, {"messages": [{"role": "user", "content": f"repeat: {text}"}]})
    pieces = [(c["choices"][0]["delta"].get("content", ""), c.get("akunu", {})) for c in chunks if c["choices"]]
    assert "".join(piece for piece, _ in pieces) == text
    stats = chunks[-1]["akunu"]
    drafted = [piece for piece, extension in pieces if extension.get("drafted") is True]
    # one character a token here; an accepted draft of the end token brings no text
    assert stats["accepted"] > 10 and stats["accepted"] - 1 <= len(drafted) <= stats["accepted"]
    plain = streamed(
        scripted_server, {"messages": [{"role": "user", "content": f"repeat: {text}"}], "speculative": False}
    )
    assert not any(c.get("akunu", {}).get("drafted") for c in plain) and plain[-1]["akunu"]["drafted"] == 0


def test_the_page_files_are_package_data():
    tomllib = pytest.importorskip("tomllib")
    patterns = tomllib.loads((UI.parents[2] / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = patterns["akunu.cli.server"]
    assert all(any(path.relative_to(UI.parent).match(p) for p in shipped) for path in UI.iterdir())


# --- the page in Chromium, with the real default model ---


def send(driver, text: str) -> None:
    """Type `text` into the message box (a newline as Shift+Enter) and press Enter."""
    from selenium.webdriver.common.keys import Keys

    box = by_css(driver, "#prompt")[0]
    for i, line in enumerate(text.split("\n")):
        if i:
            box.send_keys(Keys.SHIFT, Keys.ENTER)  # the modifier is released at the end of each call
        box.send_keys(line)
    box.send_keys(Keys.ENTER)


@pytest.mark.real_model
def test_an_answer_streams_with_highlighted_drafts_and_statistics_and_comes_back_after_a_reload(real_server, browser):
    fresh_page(browser, real_server.base_url, settings={"maxTokens": 40})
    record_answers(browser)
    send(browser, REPEAT)
    stats = final_stats(browser)
    assert STATS.match(stats), stats
    seen = recorded(browser)
    assert len(seen["bodies"]) > 2 and any(s.startswith("false ") for s in seen["stats"])  # streamed, live numbers
    assert by_css(browser, ".message.user .body")[0].text == REPEAT  # Shift+Enter made a new line
    answer = by_css(browser, ".message.assistant .body")[0].text
    drafts = [span.text for span in by_css(browser, ".message.assistant .draft")]
    assert "quick brown fox" in answer and drafts and all(d in answer for d in drafts)
    accepted = int(re.search(r"(\d+) of \d+ drafted", stats).group(1))
    assert accepted > 0
    check_screenshots(browser, "conversation")
    browser.refresh()
    item = wait(browser, lambda d: by_css(d, "#conversations .open"))[0]
    assert item.text.startswith("Repeat this text twice")
    item.click()
    assert by_css(browser, ".message.assistant .body")[0].text == answer
    assert [s.text for s in by_css(browser, ".message.assistant .draft")] == drafts
    assert by_css(browser, ".message.assistant .stats")[0].text == stats
    assert severe_logs(browser) == []


def check_screenshots(driver, name: str) -> None:
    """Light and dark at desktop and phone widths, each checked against the DOM: colors follow the scheme, drafts
    stand out, the phone's page neither scrolls sideways nor shows the conversation list."""
    for dark in (False, True):
        for size in ("desktop", "phone"):
            emulate(driver, dark=dark, size=size)
            page = driver.execute_script("""
                const box = (s) => document.querySelector(s).getBoundingClientRect();
                const color = (s, p) => getComputedStyle(document.querySelector(s))[p];
                return {width: innerWidth, scroll: document.documentElement.scrollWidth, body: color('body', 'backgroundColor'),
                        draft: color('.draft', 'backgroundColor'), sidebarRight: box('#sidebar').right,
                        composerBottom: box('#composer').bottom, statsRight: box('.stats').right, height: innerHeight};
            """)
            path = screenshot(driver, f"{name}-{'dark' if dark else 'light'}-{size}")
            assert png_size(path) == (page["width"], page["height"])
            assert (luminance(page["body"]) < 0.2) if dark else (luminance(page["body"]) > 0.9)
            assert color_distance(page["draft"], page["body"]) > 0.2  # the highlight shows
            assert page["scroll"] <= page["width"] and page["statsRight"] <= page["width"]
            assert page["composerBottom"] <= page["height"]
            assert (page["sidebarRight"] <= 0) if size == "phone" else (page["sidebarRight"] >= 200)
    emulate(driver, dark=False, size="desktop")


@pytest.mark.real_model
def test_escape_stops_an_answer_and_the_server_stops_with_it(real_server, browser):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    fresh_page(browser, real_server.base_url, settings={"maxTokens": 200})
    send(browser, "Count from 1 to 200, separated by commas.")
    wait(browser, lambda d: len(by_css(d, ".message.assistant .body")[0].text) > 3)
    ActionChains(browser).send_keys(Keys.ESCAPE).perform()
    wait(browser, lambda d: by_css(d, "#stop")[0].get_attribute("hidden") is not None)
    stats = by_css(browser, ".message.assistant .stats")[0].text
    assert stats.endswith("· stopped") and int(stats.split()[0]) < 200
    real_server.wait_idle(10)  # the server cancelled the generation when the page hung up
    assert by_css(browser, "#send")[0].is_displayed()


@pytest.mark.real_model
def test_the_last_message_is_edited_and_resent(real_server, browser):
    from selenium.webdriver.common.keys import Keys

    fresh_page(browser, real_server.base_url, settings={"maxTokens": 12})
    send(browser, "Name a color.")
    final_stats(browser)
    by_css(browser, ".message.user .edit")[0].click()
    editor = by_css(browser, ".message.user .editor")[0]
    editor.clear()
    editor.send_keys("Name a fruit.", Keys.ENTER)
    final_stats(browser)
    assert [m.text for m in by_css(browser, ".message.user .body")] == ["Name a fruit."]
    assert len(by_css(browser, ".message.assistant")) == 1
    assert by_css(browser, ".message.user .edit")  # the new last message can be edited again


# --- the page in Chromium, with a scripted model behind --api-key ---


def test_the_page_asks_for_the_key_refuses_a_wrong_one_and_then_converses(scripted_server, browser):
    fresh_page(browser, scripted_server.base_url)
    dialog = wait(browser, lambda d: [e for e in by_css(d, "#key-dialog") if e.is_displayed()])[0]
    assert not by_css(browser, "#key-error")[0].is_displayed()
    by_css(browser, "#key-input")[0].send_keys("sk-wrong\n")
    wait(browser, lambda d: by_css(d, "#key-error")[0].is_displayed())
    assert "401" in by_css(browser, "#key-error")[0].text and dialog.is_displayed()
    assert last_message(browser)[0] == "message error" and "401" in last_message(browser)[1]
    by_css(browser, "#key-input")[0].send_keys(KEY + "\n")
    wait(browser, lambda d: by_css(d, "#model-name")[0].get_attribute("value") == "smollm2-135m")
    assert not dialog.is_displayed() and KEY not in browser.current_url
    send(browser, "hello")
    assert STATS.match(final_stats(browser))
    assert by_css(browser, ".message.assistant .body")[0].text == "Hello there."
    browser.execute_script("sessionStorage.setItem('akunu.apiKey', 'sk-changed')")
    send(browser, "hello again")
    wait(browser, lambda d: last_message(d)[0] == "message error" and dialog.is_displayed())
    assert "401" in last_message(browser)[1]
    assert [m.text for m in by_css(browser, ".message.user .body")] == ["hello", "hello again"]  # nothing lost
    assert severe_logs(browser, allowed=("401",)) == []


def test_html_and_script_in_an_answer_are_shown_as_text_and_run_nothing(scripted_server, browser):
    fresh_page(browser, scripted_server.base_url, key=KEY)
    send(browser, "show me html <img src=x onerror=\"window.__pwned='user'\">")
    final_stats(browser)
    assert browser.execute_script("return window.__pwned") is None
    messages = by_css(browser, "#messages")[0]
    assert not messages.find_elements("css selector", "script, img, iframe, [onerror]")
    answer = by_css(browser, ".message.assistant .body")[0]
    assert "<script>window.__pwned = 'script'</script>" in answer.text and "onerror=" in answer.text
    assert [a.get_attribute("href") for a in answer.find_elements("css selector", "a")] == ["https://example.org/"]
    assert answer.find_elements("css selector", "strong")[0].text == "bold"
    assert "[link](javascript:" in answer.text  # a javascript: link stays text
    code = answer.find_elements("css selector", ".code-block code")[0]
    assert code.text == HOSTILE.split("```python\n")[1].removesuffix("\n```\n")
    assert code.find_elements("css selector", ".tok-string") and code.find_elements("css selector", ".tok-comment")
    screenshot(browser, "hostile-answer")
    answer.find_elements("css selector", ".copy")[0].click()
    wait(browser, lambda d: by_css(d, ".copy")[0].text == "Copied")
    assert severe_logs(browser) == []


def test_a_context_overflow_is_a_line_and_an_edit_goes_on(scripted_server, browser):
    from selenium.webdriver.common.keys import Keys

    fresh_page(browser, scripted_server.base_url, key=KEY)
    browser.execute_script("document.getElementById('prompt').value = 'x'.repeat(5000)")
    by_css(browser, "#send")[0].click()
    wait(browser, lambda d: last_message(d)[0] == "message error")
    assert "context" in last_message(browser)[1]
    assert [m.get_attribute("class") for m in by_css(browser, ".message")] == ["message user", "message error"]
    by_css(browser, ".message.user .edit")[0].click()
    editor = by_css(browser, ".message.user .editor")[0]
    editor.clear()
    editor.send_keys("hello", Keys.ENTER)
    final_stats(browser)
    assert [m.get_attribute("class") for m in by_css(browser, ".message")] == ["message user", "message assistant"]


def test_settings_reach_the_request_and_stay(scripted_server, browser):
    fresh_page(browser, scripted_server.base_url, key=KEY)
    by_css(browser, "#open-settings")[0].click()
    wait(browser, lambda d: by_css(d, "#setting-model option"))
    assert by_css(browser, "#setting-model")[0].get_attribute("value") == "smollm2-135m"
    by_css(browser, "#setting-max-tokens")[0].send_keys("5")
    by_css(browser, "#setting-speculative")[0].click()
    by_css(browser, "#settings-form button[type='submit']")[0].click()
    send(browser, "repeat: abcdefghij abcdefghij")
    stats = final_stats(browser)
    assert by_css(browser, ".message.assistant .body")[0].text == "abcde"
    assert stats.startswith("5 tokens") and "no drafts" in stats and "max tokens reached" in stats
    saved = json.loads(browser.execute_script("return localStorage.getItem('akunu.settings')"))
    assert saved["maxTokens"] == "5" and saved["speculative"] is False


def test_a_body_too_large_and_a_server_gone_are_lines_and_the_conversation_stays(tmp_path, browser):
    with serving_scripted(tmp_path, "--max-body", "2K") as server:
        fresh_page(browser, server.base_url)
        wait(browser, lambda d: by_css(d, "#model-name")[0].get_attribute("value") == "smollm2-135m")
        browser.execute_script("document.getElementById('prompt').value = 'y'.repeat(3000)")
        by_css(browser, "#send")[0].click()
        wait(browser, lambda d: last_message(d)[0] == "message error")
        assert last_message(browser)[1].startswith("413 · ")
    send(browser, "anyone there?")
    wait(browser, lambda d: "did not answer" in last_message(d)[1])
    kinds = [m.get_attribute("class") for m in by_css(browser, ".message")]
    assert kinds == ["message user", "message error", "message user", "message error"]
    assert by_css(browser, "#send")[0].is_displayed()  # ready for the next try


def test_the_model_picker_lists_the_servers_models_and_shows_one_loading(tmp_path, browser):
    import threading

    from selenium.webdriver.support.select import Select

    import akunu.models

    loaded, gate = scripted_page_model(), threading.Event()

    def load_model(spec, **kwargs):
        if spec.endswith("coder.gguf"):
            gate.wait(30)  # the second model loads only when the test lets it
        return loaded

    (tmp_path / "coder.gguf").write_bytes(b"GGUF")
    with pytest.MonkeyPatch.context() as patch, contextlib.ExitStack() as stack:
        patch.setenv("AKUNU_HOME", str(tmp_path / "home"))
        patch.setattr(akunu.models, "load_model", load_model)
        server = start(stack, patch, "-m", "smollm2-135m", "-m", str(tmp_path / "coder.gguf"), *FAST)
        fresh_page(browser, server.base_url)
        read = "return [...document.querySelectorAll('#model-name option')].map((o) => o.textContent)"
        options = lambda d: d.execute_script(read)  # noqa: E731  (the picker's options are remade as it refreshes)
        wait(browser, lambda d: options(d) == ["smollm2-135m", "coder · not loaded"])
        Select(by_css(browser, "#model-name")[0]).select_by_value("coder")
        send(browser, "hello")
        wait(browser, lambda d: "coder · loading…" in options(d))
        gate.set()
        assert final_stats(browser) and by_css(browser, ".message.assistant .body")[0].text == "Hello there."
        wait(browser, lambda d: options(d) == ["smollm2-135m", "coder"])
        assert json.loads(browser.execute_script("return localStorage.getItem('akunu.settings')"))["model"] == "coder"
