"""Issue 38's CLI faults, each driven through the CLI: bounded input, saves that never replace what is not a
file, sampling that stays finite, broken model folders, an unreadable n-gram cache, a first run that says
what it measures, text options, control tokens, messages that tell the truth, a summary that fits."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from rich.cells import cell_len
from rich.console import Console

import akunu.cost_curve
from akunu.cli import display, text_input
from akunu.cli.chat_view import ChatView
from akunu.drafters.ngram_cache import NGramCache, UnreadableCache
from akunu.generate import GenerationResponse
from akunu.stats import GenerationStats
from tests.chat_fixtures import HOSTILE, chatml_tokenizer
from tests.fakes import invoke, make_loaded
from tests.tiny import tiny_llama
from tests.tiny_gguf import write_tiny_gguf

REAL_CACHED_COST_CURVE = akunu.cost_curve.cached  # taken before fake_engine replaces it
CONTEXT = 512  # make_loaded's context: the model's bound is 8 bytes a token
LIMIT = text_input.BYTES_PER_TOKEN * CONTEXT


def assert_one_line(result, code: int, starts: str) -> None:
    assert result.exit_code == code, result.output
    assert result.stderr.startswith(f"error: {starts}") and result.stderr.count("\n") == 1, result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit)


# -- 1: bounded reads -----------------------------------------------------------------------------


def test_a_prompt_file_of_dev_zero_ends_at_once_in_little_memory(tmp_path):
    """Before issue 38's fix this grew by 0.7 GB/s until the OOM killer came; since issue 67 no device is read."""
    probe = (
        "import resource, subprocess, sys\n"
        "done = subprocess.run(sys.argv[1:], capture_output=True, text=True, timeout=120)\n"
        "print(done.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
        "sys.stderr.write(done.stderr)\n"
    )
    command = [sys.executable, "-m", "akunu", "generate", "--max-tokens", "8", "--prompt-file", "/dev/zero"]
    env = {**os.environ, "AKUNU_HOME": str(tmp_path / "home")}
    done = subprocess.run([sys.executable, "-c", probe, *command], capture_output=True, text=True, timeout=150, env=env)
    code, peak_kb = map(int, done.stdout.split())
    assert code == 1
    assert done.stderr.startswith("error: cannot read the prompt file /dev/zero: it is a device, not a regular file")
    assert done.stderr.count("\n") == 1, done.stderr
    assert peak_kb < 200_000  # the interpreter and its imports (about 50 MB), plus at most one bound of text


@pytest.mark.parametrize("where", ["file", "stdin", "system"])
def test_text_past_the_models_bound_is_one_line_saying_how_much(fake_engine, tmp_path, where):
    text = "a" * (LIMIT + 1)
    if where == "file":
        (tmp_path / "p.txt").write_text(text)
        result, source = invoke("generate", "-f", str(tmp_path / "p.txt")), f"the prompt file {tmp_path / 'p.txt'}"
    elif where == "stdin":
        result, source = invoke("generate", "-", input=text), "the prompt on stdin"
    else:
        result, source = invoke("generate", "--system", text, "hi"), "--system"
    message = f"{source} is too long: {LIMIT + 1:,} bytes read, over the limit of {LIMIT:,} bytes (8 per token of the model's context"
    assert_one_line(result, 1, message)
    assert fake_engine.streams == []


def test_text_within_the_bound_is_sent(fake_engine, tmp_path):
    (tmp_path / "p.txt").write_text("a" * 300)
    assert invoke("generate", "--max-tokens", "2", "-f", str(tmp_path / "p.txt")).exit_code == 0


def test_a_chat_line_past_the_bound_ends_the_chat_with_one_line(fake_engine):
    result = invoke("chat", "--max-tokens", "2", input="hi\n" + "a" * (LIMIT + 10))
    assert result.exit_code == 1
    assert result.stderr.startswith(f"error: a line on stdin is too long: {LIMIT + 1:,} bytes read")
    assert len(fake_engine.streams) == 1  # "hi" was answered


def test_a_conversation_file_is_read_with_a_bound(fake_engine, tmp_path, monkeypatch):
    monkeypatch.setattr(text_input, "READ_LIMIT", 100)
    talk = tmp_path / "talk.json"
    talk.write_text(json.dumps([{"role": "user", "content": "x" * 200}]))
    assert_one_line(invoke("chat", "--load", str(talk)), 1, f"the conversation {talk} is too long: 101 bytes read")
    assert fake_engine.loads == []


def unblock_later(fifo: Path, seconds: float = 5.0) -> None:
    """Open the FIFO's writing end after `seconds` and close it, so a reader that opened it (the fault) gets an
    empty file and the test fails instead of hanging."""
    import threading
    import time

    def open_and_close() -> None:
        time.sleep(seconds)
        with open(fifo, "wb"):
            pass

    threading.Thread(target=open_and_close, daemon=True).start()


@pytest.mark.parametrize("kind", ["device", "FIFO", "folder"])
def test_files_named_to_be_read_must_be_regular_files(fake_engine, tmp_path, kind):
    target = _special_targets(tmp_path)[kind]
    name = {"device": "a device", "FIFO": "a FIFO", "folder": "a folder"}[kind]
    reads = {  # what is read: (the command, its exit status: 2 for an option's file)
        "the conversation": (("chat", "--load", str(target)), 1),
        "the prompt file": (("generate", "--prompt-file", str(target)), 1),
        "the JSON schema file": (("generate", "--json-schema", str(target), "hi"), 2),
    }
    for source, (command, code) in reads.items():
        if kind == "FIFO":
            unblock_later(target)
        assert_one_line(invoke(*command), code, f"cannot read {source} {target}: it is {name}, not a regular file")
    assert fake_engine.streams == []
    if kind != "folder":  # a folder is an MLX model's (test_bad_model_files); fake_engine skips the loader
        from akunu.errors import ModelError
        from akunu.models.loader import locate

        with pytest.raises(ModelError, match=f"^{target} is {name}, not a GGUF file or an MLX model folder$"):
            locate(str(target))
    if kind == "FIFO":
        unblock_later(target)
    with pytest.warns(UnreadableCache, match=f"it is {name}, not a regular file"):
        assert len(NGramCache.load(target)) == 0


# -- 2: saving never replaces what is not a regular file --------------------------------------------


def _special_targets(tmp_path: Path) -> dict[str, Path]:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    return {"device": Path("/dev/null"), "FIFO": fifo, "folder": tmp_path}


def _kind_of(path: Path) -> str:
    mode = os.stat(path).st_mode
    if stat.S_ISCHR(mode):
        return "device"
    return "FIFO" if stat.S_ISFIFO(mode) else "folder" if stat.S_ISDIR(mode) else "file"


@pytest.mark.parametrize("kind", ["device", "FIFO", "folder"])
def test_chat_save_to_a_device_fifo_or_folder_is_refused_and_leaves_it(fake_engine, tmp_path, kind):
    target = _special_targets(tmp_path)[kind]
    result = invoke("chat", "--max-tokens", "2", input=f"hi\n/save {target}\n")
    assert result.exit_code == 0, result.output
    name = {"device": "a device", "FIFO": "a FIFO", "folder": "a folder"}[kind]
    assert f"error: cannot save the conversation to {target}: it is {name}, not a regular file" in result.stdout
    assert _kind_of(target) == kind


@pytest.mark.parametrize("kind", ["device", "FIFO", "folder"])
def test_save_and_ngram_cache_options_refuse_what_is_not_a_file_before_loading(fake_engine, tmp_path, kind):
    target = _special_targets(tmp_path)[kind]
    name = {"device": "a device", "FIFO": "a FIFO", "folder": "a folder"}[kind]
    assert_one_line(invoke("chat", "--save", str(target)), 2, f"--save {target}: it is {name}, not a regular file")
    result = invoke("generate", "--ngram-cache", str(target), "hi")
    assert_one_line(result, 2, f"--ngram-cache {target}: it is {name}, not a regular file")
    assert fake_engine.loads == [] and _kind_of(target) == kind


@pytest.mark.skipif(not Path("/proc/version").is_file(), reason="needs Linux's /proc")
def test_chat_save_into_a_folder_that_takes_no_files_names_the_folder(fake_engine):
    result = invoke("chat", "--max-tokens", "2", input="hi\n/save /proc/version\n")
    assert result.exit_code == 0, result.output
    assert "error: cannot save the conversation to /proc/version: the folder /proc takes no new files" in result.stdout


@pytest.mark.parametrize("exists", [True, False], ids=["file", "dangling"])
def test_saving_through_a_symlink_writes_its_target_and_keeps_the_link(fake_engine, tmp_path, exists):
    real, link = tmp_path / "real.json", tmp_path / "link.json"
    if exists:
        real.write_text(json.dumps({"format": "akunu-chat", "version": 1, "messages": []}))
    link.symlink_to(real)
    result = invoke("chat", "--max-tokens", "2", "--save", str(link), input="hi\n")
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert json.loads(real.read_text())["messages"][0] == {"role": "user", "content": "hi"}


def test_save_refuses_to_replace_a_file_that_is_not_a_conversation_unless_forced(fake_engine, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    assert_one_line(
        invoke("chat", "--save", str(notes)),
        2,
        f"--save {notes}: the file exists and is not an akunu conversation; give --force",
    )
    assert fake_engine.loads == [] and notes.read_text() == "my notes\n"
    result = invoke("chat", "--max-tokens", "2", "--save", str(notes), "--force", input="hi\n")
    assert result.exit_code == 0, result.output
    assert json.loads(notes.read_text())["messages"][0] == {"role": "user", "content": "hi"}


def test_slash_save_refuses_a_file_that_is_not_a_conversation_until_forced(fake_engine, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    result = invoke("chat", "--max-tokens", "2", input=f"hi\n/save {notes}\n")
    assert result.exit_code == 0, result.output
    assert f"error: {notes} exists and is not an akunu conversation; /save --force {notes} replaces it" in result.stdout
    assert notes.read_text() == "my notes\n"
    forced = invoke("chat", "--max-tokens", "2", input=f"hi\n/save --force {notes}\n")
    assert f"saved 2 messages to {notes}" in forced.stdout
    assert json.loads(notes.read_text())["format"] == "akunu-chat"


# -- 3: sampling at the edges, through the CLI ------------------------------------------------------


@pytest.mark.parametrize(
    "sampling", [["--temp", "1e-40"], ["--temp", "1", "--top-p", "1e-300"], ["--temp", "1", "--top-p", "0"]]
)
def test_extreme_sampling_gives_the_greedy_answer(fake_engine, sampling):
    assert invoke("generate", "--max-tokens", "6", "--no-spec", "hi").exit_code == 0
    result = invoke("generate", "--max-tokens", "6", "--no-spec", *sampling, "hi")
    assert result.exit_code == 0, result.output
    greedy, sampled = fake_engine.streams
    assert sampled["tokens"] == greedy["tokens"] and len(sampled["tokens"]) == 6
    assert result.stdout.strip()


# -- 4: broken MLX model folders ---------------------------------------------------------------------


LLAMA_CONFIG = {
    "model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64,
    "num_attention_heads": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 64,
}  # fmt: skip


def _broken_folder(tmp_path: Path, fault: str) -> Path:
    import mlx.core as mx

    folder = tmp_path / fault
    folder.mkdir()
    if fault == "random-weights":
        (folder / "config.json").write_text(json.dumps(LLAMA_CONFIG))
        (folder / "model.safetensors").write_bytes(os.urandom(256))
    else:
        (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
        mx.save_safetensors(str(folder / "model.safetensors"), {"x": mx.zeros(1)})
    return folder


FOLDER_FAULTS = {"random-weights": "a weights file is not valid safetensors", "missing-fields": "config.json lacks"}


@pytest.mark.parametrize("fault", FOLDER_FAULTS)
def test_a_broken_mlx_folder_is_one_model_error(isolated_home, tmp_path, fault):
    folder = _broken_folder(tmp_path, fault)
    result = invoke("generate", "--json", "--model", str(folder), "hi")
    assert_one_line(result, 1, f"cannot load the MLX model in {folder}: {FOLDER_FAULTS[fault]}")
    assert json.loads(result.stdout)["error"]["kind"] == "model"


def test_a_broken_draft_model_folder_is_one_model_error_before_the_target_loads(isolated_home, tmp_path):
    folder = _broken_folder(tmp_path, "random-weights")  # and no tokenizer.json, the first thing a draft is checked for
    write_tiny_gguf(tmp_path / "tiny.gguf")
    result = invoke("generate", "--raw", "--model", str(tmp_path / "tiny.gguf"), "--draft", f"model:{folder}", "hi")
    assert result.exit_code == 1, result.output
    assert f"{folder} has no tokenizer.json" in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.output


# -- 5: an unreadable --ngram-cache -----------------------------------------------------------------


@pytest.mark.parametrize("content", [b"", b"\x00garbage"], ids=["empty", "garbage"])
def test_an_unreadable_ngram_cache_is_a_warning_and_the_run_goes_on(fake_engine, tmp_path, content):
    cache = tmp_path / "counts.bin"
    cache.write_bytes(content)
    result = invoke("generate", "--max-tokens", "4", "--ngram-cache", str(cache), "hi")
    assert result.exit_code == 0, result.output
    assert f"warning: --ngram-cache {cache}: cannot read it (" in result.stderr
    assert "this run starts with an empty cache" in result.stderr
    assert len(fake_engine.streams[0]["tokens"]) == 4
    assert cache.stat().st_size > 0  # written afresh with this run's counts


# -- 6: the first run says what it measures, and measures the quick curve ----------------------------


def test_a_first_run_shows_the_pass_cost_progress_and_measures_the_quick_curve(fake_engine, monkeypatch):
    monkeypatch.setattr(akunu.cost_curve, "cached", REAL_CACHED_COST_CURVE)
    timed = []
    real_measure = akunu.cost_curve.measure_passes

    def recording_measure(model, max_width, sweeps, context, widths=None, on_pass=None, trees=True):
        timed.append((context, sweeps, tuple(akunu.cost_curve.timed_widths(max_width, widths))))
        return real_measure(model, max_width, sweeps, context, widths, on_pass, trees)

    monkeypatch.setattr(akunu.cost_curve, "measure_passes", recording_measure)
    first = invoke("generate", "--max-tokens", "3", "--draft-tokens", "10", "hi")
    assert first.exit_code == 0, first.output
    widths = akunu.cost_curve.timed_widths(11, akunu.cost_curve.QUICK_WIDTHS)
    assert widths == [1, 2, 3, 4, 5, 6, 8, 11]
    trees = [width for width in widths if width >= akunu.cost_curve.TREE_FROM]  # a tree timed beside its chain
    total = len(timed) * (akunu.cost_curve.QUICK_SWEEPS + 1) * (len(widths) + len(trees))
    assert all(entry[1:] == (akunu.cost_curve.QUICK_SWEEPS, tuple(widths)) for entry in timed)
    assert f"measuring pass costs for this machine, once: 0/{total}\n" in first.stderr
    assert f"measuring pass costs for this machine, once: {total}/{total}\n" in first.stderr
    curves = fake_engine.streams[0]["costs"]
    assert curves.widths == 11 and curves.at(100)[0] == 1.0
    second = invoke("generate", "--max-tokens", "3", "--draft-tokens", "10", "hi")
    assert second.exit_code == 0 and "measuring" not in second.stderr  # read from disk


def test_the_quick_curve_reads_untimed_widths_off_straight_lines():
    passes = []
    seconds, _ = akunu.cost_curve.measure_passes(tiny_llama(), max_width=9, sweeps=1, context=8, widths=(1, 5, 9),
                                                 on_pass=lambda: passes.append(1), trees=False)  # fmt: skip
    assert len(passes) == 2 * 3 and len(seconds) == 9
    for width in (2, 3, 4):
        assert seconds[width - 1] == pytest.approx(seconds[0] + (width - 1) / 4 * (seconds[4] - seconds[0]))
    assert seconds == sorted(seconds)


# -- 7: every text option gets the prompt's treatment ------------------------------------------------


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["generate", "--system", "be \udcff", "hi"], "--system"),
        (["generate", "--stop", "x\udcff", "hi"], "--stop"),
        (["generate", "--draft", "ngram\udcff", "hi"], "--draft"),
        (["chat", "--system", "\udcff"], "--system"),
        (["chat", "--model", "m\udcff"], "--model"),
        (["models", "pull", "smollm2\udcff"], "NAME"),
    ],
)
def test_invalid_bytes_in_any_text_option_are_one_line(fake_engine, args, option):
    assert_one_line(invoke(*args, input=""), 2, f"{option} is not valid UTF-8 (byte 0xff)")
    assert fake_engine.loads == []


# -- 8: a user's text never becomes control tokens --------------------------------------------------


def test_a_prompt_cannot_write_control_tokens_unless_raw_asks(fake_engine):
    fake_engine.loaded = make_loaded(model=tiny_llama(vocab=258, seed=1))
    fake_engine.loaded.tokenizer = tokenizer = chatml_tokenizer()

    def controls(*args: str) -> int:
        result = invoke("generate", "--max-tokens", "1", "--no-spec", *args)
        assert result.exit_code == 0, result.output
        return sum(1 for i in fake_engine.streams[-1]["prompt"] if i in tokenizer.special_ids)

    assert controls(HOSTILE) == 3  # the template's own: <|im_start|>user, <|im_end|>, <|im_start|>assistant
    assert controls("--parse-special", HOSTILE) == 6
    assert controls("--raw", HOSTILE) == 3  # --raw keeps reading them
    assert controls("--raw", "--no-parse-special", HOSTILE) == 0


# -- 9: messages that tell the truth ----------------------------------------------------------------


def test_an_empty_model_name_is_an_error(fake_engine):
    assert_one_line(
        invoke("generate", "--model", "", "hi"),
        2,
        "Invalid value for '--model' / '-m' (env var: 'AKUNU_MODEL'): is empty",
    )
    assert fake_engine.loads == []


def test_top_p_accepts_what_its_help_says(fake_engine):
    help_text = invoke("generate", "--help", env={"COLUMNS": "200"}).stdout
    assert "0<=x<=1" in help_text.replace(" ", "")
    assert invoke("generate", "--max-tokens", "2", "--top-p", "0", "hi").exit_code == 0
    assert invoke("generate", "--top-p", "1.5", "hi").exit_code == 2


def test_loading_a_conversation_saved_with_another_model_says_so(fake_engine, tmp_path):
    talk = tmp_path / "talk.json"
    talk.write_text(
        json.dumps({"format": "akunu-chat", "model": "qwen-big", "messages": [{"role": "user", "content": "a"}]})
    )
    result = invoke("chat", "--load", str(talk), input="")
    assert result.exit_code == 0, result.output
    assert f"warning: {talk} was saved with the model qwen-big; it goes on with tiny" in result.stdout


# -- 10: the summary line fits the terminal ----------------------------------------------------------


def _stats() -> GenerationStats:
    return GenerationStats(
        prompt_tokens=1520, prefilled_tokens=1200, generated_tokens=187, forward_passes=93, drafted=340,
        accepted=106, prefill_seconds=1.3, decode_seconds=3.87, peak_memory_mb=560.4,
    )  # fmt: skip


@pytest.mark.parametrize("width", [40, 80, 120])
def test_the_summary_line_fits_the_width_dropping_the_least_useful_fields_first(width):
    full = display.summary_line(_stats(), "interrupted")
    fitted = display.summary_line(_stats(), "interrupted", width)
    assert cell_len(full) > 120 and cell_len(fitted) <= width
    fields = fitted.split(" · ")
    assert fields[:2] == ["187 tok", "48.1 tok/s"] and fields[-1] == "interrupted"  # what always stays
    every_form = {form for forms in display._summary_fields(_stats(), "interrupted").values() for form in forms}
    assert set(fields) <= every_form  # whole fields only: none cut short
    if width == 120:  # the prefill's detail goes first; everything else stays
        assert "prefill 1200 tok" in fields and "560 MB" in fields and "2.00 tok/pass" in fields


def test_the_chat_prints_the_summary_within_a_narrow_terminal():
    from io import StringIO

    out = StringIO()
    view = ChatView(Console(file=out, width=40, force_terminal=True, color_system=None, soft_wrap=True))
    stats = _stats()
    responses = iter([GenerationResponse("hello", 5, False, stats, finish_reason="stop")])
    view.stream(type("Stream", (), {"__iter__": lambda self: responses, "close": lambda self: None})())
    last = [line for line in out.getvalue().splitlines() if line.strip()][-1]
    assert last.startswith("187 tok · 48.1 tok/s") and cell_len(last) <= 40
