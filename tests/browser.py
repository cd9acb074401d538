"""The chat page in a real browser: Debian's headless `chromium` driven by Selenium through `chromium-driver`, and
a scripted model whose answers hold HTML. Screenshots go to tests/artifacts/ui/ (ignored by git)."""

from __future__ import annotations

import json
import re
import shutil
import struct
import time
from pathlib import Path

ARTIFACTS = Path(__file__).parent / "artifacts" / "ui"
SIZES = {"desktop": (1280, 800), "phone": (390, 844)}
HOSTILE = (
    "<script>window.__pwned = 'script'</script><img src=x onerror=\"window.__pwned = 'onerror'\">\n"
    "**bold** and a [link](javascript:window.__pwned='link') and [a real one](https://example.org/)\n\n"
    '```python\nprint("<b>hi</b>")  # a comment\n```\n'
)


def missing_browser() -> str | None:
    """Why the browser tests cannot run here, or None."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        return "no Chromium: apt-get install chromium chromium-driver"
    return None


def launch():
    """A headless Chromium with a 1280x800 page and no motion (screenshots never catch a transition)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                     "--disable-extensions", "--lang=en-US", "--window-size=1280,900"):  # fmt: skip
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    driver.set_page_load_timeout(30)
    emulate(driver, dark=False, size="desktop")
    return driver


def emulate(driver, *, dark: bool, size: str) -> None:
    width, height = SIZES[size]
    features = [{"name": "prefers-color-scheme", "value": "dark" if dark else "light"},
                {"name": "prefers-reduced-motion", "value": "reduce"}]  # fmt: skip
    driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": features})
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": size == "phone"},
    )


def fresh_page(driver, base_url: str, *, settings: dict | None = None, key: str | None = None) -> None:
    """The page with empty storage, then the given settings (store.js's names) and API key."""
    driver.get(base_url + "/health")  # same origin, runs no page script that could save over the cleared storage
    driver.execute_script("localStorage.clear(); sessionStorage.clear();")
    if settings:
        driver.execute_script("localStorage.setItem('akunu.settings', arguments[0])", json.dumps(settings))
    if key:
        driver.execute_script("sessionStorage.setItem('akunu.apiKey', arguments[0])", key)
    driver.get(base_url + "/")
    wait(driver, lambda d: d.execute_script("return document.readyState") == "complete")
    driver.get_log("browser")  # drop what the first load logged


def wait(driver, condition, timeout: float = 60):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.02).until(condition)


def by_css(driver, selector: str) -> list:
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def final_stats(driver, timeout: float = 60) -> str:
    """The statistics line of the answer that ends the conversation, once it is done and the server's numbers are in."""
    done = """const all = document.querySelectorAll('#messages .message'), last = all[all.length - 1];
              return Boolean(document.getElementById('stop').hidden && last && last.classList.contains('assistant')
                             && last.querySelector('.stats[data-final="true"]'));"""
    wait(driver, lambda d: d.execute_script(done), timeout)
    return by_css(driver, ".message.assistant .stats")[-1].text


def last_message(driver) -> tuple[str, str]:
    """The class and text of the message that ends the conversation (read at once: a render replaces elements)."""
    return tuple(
        driver.execute_script("""
        const all = document.querySelectorAll('#messages .message'), last = all[all.length - 1];
        return last ? [last.className, last.textContent] : ['', ''];""")
    )


def record_answers(driver) -> None:
    """Keep every text the last answer and its statistics line show, as they change (read by `recorded`)."""
    driver.execute_script("""
        window.__seen = {bodies: [], stats: []};
        new MutationObserver(() => {
          const answers = document.querySelectorAll('.message.assistant');
          const last = answers[answers.length - 1];
          if (!last) return;
          const body = last.querySelector('.body').textContent, stats = last.querySelector('.stats');
          if (window.__seen.bodies.at(-1) !== body) window.__seen.bodies.push(body);
          if (stats) window.__seen.stats.push(stats.dataset.final + ' ' + stats.textContent);
        }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
    """)


def recorded(driver) -> dict:
    return driver.execute_script("return window.__seen")


def screenshot(driver, name: str) -> Path:
    """Save the page as tests/artifacts/ui/NAME.png; return its path."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    time.sleep(0.05)  # a frame for the emulated media to apply
    assert driver.save_screenshot(str(path))
    return path


def png_size(path: Path) -> tuple[int, int]:
    width, height = struct.unpack(">II", path.read_bytes()[16:24])  # the IHDR chunk
    return width, height


def channels(css_color: str) -> tuple[float, float, float]:
    """Red, green and blue from 0 to 1 of a computed `rgb(...)`/`rgba(...)` color."""
    red, green, blue = (float(part) / 255 for part in re.findall(r"[\d.]+", css_color)[:3])
    return red, green, blue


def luminance(css_color: str) -> float:
    """0 (black) to 1 (white)."""
    red, green, blue = channels(css_color)
    return 0.2126 * red + 0.7152 * green + 0.0722 * blue


def color_distance(first: str, second: str) -> float:
    """The largest difference of one channel, 0 to 1."""
    return max(abs(a - b) for a, b in zip(channels(first), channels(second)))


def severe_logs(driver, allowed: tuple[str, ...] = ()) -> list[str]:
    """Console errors (a script the CSP blocked, an exception), less those that hold an `allowed` text."""
    entries = driver.get_log("browser")
    return [e["message"] for e in entries if e["level"] == "SEVERE" and not any(a in e["message"] for a in allowed)]


def last_user_message(conversation: str) -> str:
    """The last user message of a Qwen-template prompt."""
    return conversation.rsplit("<|im_start|>user\n", 1)[-1].split("<|im_end|>")[0]


def page_script(conversation: str) -> str:
    """What the scripted model answers: `repeat: TEXT` gives TEXT, a message naming html gives HOSTILE."""
    message = last_user_message(conversation)
    if message.startswith("repeat: "):
        return message.removeprefix("repeat: ")
    return HOSTILE if "html" in message else "Hello there."


def scripted_page_model():
    """A loaded model (as akunu.models.load_model returns it) that answers by `page_script`, behind Qwen's template."""
    from tests.fakes import make_loaded
    from tests.scripted import CharTokenizer, ScriptedModel
    from tests.tiny import tiny_llama
    from tests.tool_script import QWEN_TEMPLATE, TURN

    tokenizer = CharTokenizer(QWEN_TEMPLATE)
    model = ScriptedModel(tiny_llama(vocab=tokenizer.vocab_size, seed=4), tokenizer, TURN, page_script)
    loaded = make_loaded(model=model, context_length=1024)
    loaded.tokenizer = tokenizer
    return loaded
