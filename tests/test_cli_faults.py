"""Issue 16's CLI faults, each driven through CliRunner with the tiny engine: bad input is one line, never a
traceback, and no failure loses the chat's history."""

import errno
import json

import pytest

import akunu.cost_curve
import akunu.files as files_module
from akunu.models.chat_template import ChatTemplate
from tests.fakes import FakeTokenizer, invoke, make_loaded

REAL_CACHED_COST_CURVE = akunu.cost_curve.cached  # taken before fake_engine replaces it
# The fake tokenizer's own format, as a real Jinja template that refuses messages containing "boom" with markup.
BOOBY_TRAPPED_TEMPLATE = (
    "{% for m in messages %}{% if 'boom' in m.content %}{{ raise_exception('[/x] ' ~ m.content) }}{% endif %}"
    "Q{{ m.role }}Q{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}QassistantQ{% endif %}"
)


class TemplateTokenizer(FakeTokenizer):
    """The character tokenizer with its format rendered by a model-file template, in the sandbox."""

    def __init__(self, source: str) -> None:
        super().__init__()
        self.template = ChatTemplate(source)

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True, tools=None) -> str:
        return self.template.render(messages, add_generation_prompt=add_generation_prompt)


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def render(loaded, messages) -> list[int]:
    return loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template(messages))


def answers(calls) -> list[str]:
    return [calls.loaded.tokenizer.decode(stream["tokens"]) for stream in calls.streams]


def assert_one_line(result, code: int, starts: str) -> None:
    assert result.exit_code == code, result.output
    assert result.stderr.startswith(f"error: {starts}") and result.stderr.count("\n") == 1, result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit)


# -- 1: markup in anything that is not ours -------------------------------------------------------


def test_markup_in_user_text_paths_and_commands_is_printed_as_text(fake_engine):
    lines = "What does [/] mean?\n/save /nonexistent/[/x].json\n/[bold]\nnext\n"
    result = invoke("chat", "--max-tokens", "3", input=lines)
    assert result.exit_code == 0, result.output
    assert ">>> What does [/] mean?\n" in result.stdout
    assert "error: cannot save the conversation to /nonexistent/[/x].json: No such file or directory" in result.stdout
    assert "unknown command /[bold]; /help lists them" in result.stdout
    first, _ = answers(fake_engine)
    history = [user("What does [/] mean?"), assistant(first), user("next")]
    assert fake_engine.streams[-1]["prompt"] == render(fake_engine.loaded, history)


def test_a_template_error_with_markup_is_one_line_and_the_chat_goes_on(fake_engine):
    fake_engine.loaded = make_loaded()
    fake_engine.loaded.tokenizer = TemplateTokenizer(BOOBY_TRAPPED_TEMPLATE)
    result = invoke("chat", "--max-tokens", "3", input="hi\nboom [/]\nagain\n")
    assert result.exit_code == 0, result.output
    assert "error: the model's chat template rejected the conversation: [/x] boom [/]\n" in result.stdout
    first, second = answers(fake_engine)
    assert fake_engine.streams[-1]["prompt"] == render(
        fake_engine.loaded, [user("hi"), assistant(first), user("again")]
    )


def test_no_failure_loses_the_chat_history(fake_engine, tmp_path, monkeypatch):
    """A failed autosave, a markup message, a bad /save path and a template error: the last turn has it all."""
    fake_engine.loaded = make_loaded()
    fake_engine.loaded.tokenizer = TemplateTokenizer(BOOBY_TRAPPED_TEMPLATE)
    real_replace, failures = files_module.os.replace, []

    def disk_full_once(source, target):
        if not failures:
            failures.append(target)
            raise OSError(errno.ENOSPC, "No space left on device")
        real_replace(source, target)

    monkeypatch.setattr(files_module.os, "replace", disk_full_once)
    saved = tmp_path / "talk.json"
    lines = ["What does [/] mean?", "/save /nonexistent/x.json", "boom", "[bold]last[/bold]"]
    result = invoke("chat", "--max-tokens", "3", "--save", str(saved), input="\n".join(lines) + "\n")
    assert result.exit_code == 0, result.output
    assert (
        f"warning: cannot save the conversation to {saved}: No space left on device; the chat goes on" in result.stdout
    )
    assert "error: cannot save the conversation to /nonexistent/x.json" in result.stdout
    assert "error: the model's chat template rejected the conversation: [/x] boom" in result.stdout
    first, last = answers(fake_engine)
    history = [user(lines[0]), assistant(first), user(lines[3])]
    assert fake_engine.streams[-1]["prompt"] == render(fake_engine.loaded, history)
    assert json.loads(saved.read_text())["messages"] == [*history, assistant(last)]  # the next save caught up


# -- 3: invalid UTF-8 -----------------------------------------------------------------------------


def test_invalid_utf8_prompt_is_one_line(fake_engine):
    stdin = invoke("generate", "-", input=b"Hi \xff")
    assert_one_line(stdin, 1, "the prompt on stdin is not valid UTF-8 (byte 0xff); convert it to UTF-8 first")
    argument = invoke("generate", "Hi \udcff")  # how Python hands over a stray byte in argv
    assert_one_line(argument, 1, "the prompt is not valid UTF-8 (byte 0xff)")
    assert fake_engine.loads == []


def test_an_invalid_utf8_chat_line_is_refused_and_the_chat_goes_on(fake_engine):
    result = invoke("chat", "--max-tokens", "2", input=b"hi \xff\nhello\n")
    assert result.exit_code == 0, result.output
    assert "error: that line is not valid UTF-8 (byte 0xff); it was not sent" in result.stdout
    (only,) = fake_engine.streams
    assert only["prompt"] == render(fake_engine.loaded, [user("hello")])


# -- 4: --save ------------------------------------------------------------------------------------


def test_an_unwritable_save_path_is_refused_before_the_chat(fake_engine):
    result = invoke("chat", "--save", "/nonexistent/x.json", input="hi\n")
    assert_one_line(result, 2, "--save /nonexistent/x.json: the folder /nonexistent does not exist")
    assert fake_engine.loads == []


# -- 5: --seed ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", ["-1", str(2**64)])
def test_a_seed_outside_uint64_is_one_line(fake_engine, seed):
    assert_one_line(invoke("generate", "--temp", "0.7", "--seed", seed, "hi"), 2, "Invalid value for '--seed'")


def test_the_largest_seed_reaches_the_engine(fake_engine):
    result = invoke("generate", "--temp", "0.7", "--seed", str(2**64 - 1), "--max-tokens", "2", "hi")
    assert result.exit_code == 0, result.output
    assert fake_engine.config.sampling.seed == 2**64 - 1


# -- 7: AKUNU_HOME that cannot hold the cost curve ------------------------------------------------


def test_a_file_valued_home_still_measures_the_cost_curve(fake_engine, tmp_path, monkeypatch):
    home = tmp_path / "home-is-a-file"
    home.write_text("")
    monkeypatch.setenv("AKUNU_HOME", str(home))
    monkeypatch.setattr(akunu.cost_curve, "cached", REAL_CACHED_COST_CURVE)
    result = invoke("generate", "--max-tokens", "3", "--draft-tokens", "2", "hi")
    assert result.exit_code == 0, result.output
    assert f"note: cannot save the cost curve in {home / 'cost_curves'} (Not a directory)" in result.stderr
    curves = fake_engine.streams[0]["costs"]  # measured for this run, at one context
    assert len(curves.seconds) == 1 and curves.widths >= 3 and curves.at(100)[0] == 1.0


# -- 8: --ngram-cache -----------------------------------------------------------------------------


def test_an_ngram_cache_in_a_missing_folder_is_refused_before_generating(fake_engine, tmp_path):
    target = tmp_path / "absent" / "counts.bin"
    result = invoke("generate", "--ngram-cache", str(target), "hi")
    assert_one_line(result, 2, f"--ngram-cache {target}: the folder {target.parent} does not exist")
    assert fake_engine.streams == [] and result.stdout == ""


# -- 12: a full context ---------------------------------------------------------------------------


def test_a_full_context_drops_the_oldest_turns_and_keeps_the_system_prompt(fake_engine, tmp_path):
    fake_engine.loaded = make_loaded(context_length=96)
    saved = tmp_path / "long.json"
    questions = [f"question number {n} please" for n in range(6)]
    args = ["chat", "--system", "sys", "--max-tokens", "4", "--save", str(saved)]
    result = invoke(*args, input="\n".join(questions) + "\n")
    assert result.exit_code == 0, result.output
    assert "error:" not in result.stdout
    assert result.stdout.count("warning: the conversation outgrew the model's context") == 1
    replies = answers(fake_engine)
    assert len(replies) == len(questions)  # every turn answered
    history = [turn for q, a in zip(questions, replies) for turn in (user(q), assistant(a))]
    last = fake_engine.streams[-1]
    assert len(last["prompt"]) + 4 <= 96
    system = [{"role": "system", "content": "sys"}]
    # the prompt is the system prompt and the newest whole exchanges, the oldest left out
    kept = next(
        k for k in range(0, len(history), 2) if last["prompt"] == render(fake_engine.loaded, system + history[k:-1])
    )
    assert kept > 0
    assert json.loads(saved.read_text())["messages"] == history  # the history itself is whole


def test_reset_after_a_context_shift_starts_afresh(fake_engine):
    fake_engine.loaded = make_loaded(context_length=64)
    questions = [f"question number {n}" for n in range(4)]
    result = invoke("chat", "--max-tokens", "4", input="\n".join([*questions, "/reset", "fresh", "again"]) + "\n")
    assert result.exit_code == 0, result.output
    assert "error:" not in result.stdout and "outgrew the model's context" in result.stdout
    fresh = answers(fake_engine)[-2]
    assert fake_engine.streams[-1]["prompt"] == render(
        fake_engine.loaded, [user("fresh"), assistant(fresh), user("again")]
    )


# -- 13: --load -----------------------------------------------------------------------------------


def test_a_history_with_a_non_text_system_prompt_is_refused_at_load(fake_engine, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"system": 5, "messages": []}')
    result = invoke("chat", "--load", str(bad), input="hi\n")
    assert_one_line(result, 1, f'{bad} is not a conversation: its "system" must be text, not int')
    assert fake_engine.loads == []


def test_a_history_the_template_refuses_is_refused_at_load(fake_engine, tmp_path):
    alternating = "{% for m in messages %}{% if (m.role == 'user') != loop.index0 is even %}" + (
        "{{ raise_exception('roles must alternate') }}{% endif %}{{ m.content }}{% endfor %}"
    )
    fake_engine.loaded.tokenizer = TemplateTokenizer(alternating)
    doubled = tmp_path / "doubled.json"
    doubled.write_text(json.dumps([user("one"), user("two")]))
    result = invoke("chat", "--load", str(doubled), input="hi\n")
    message = f"{doubled} cannot go on with this model: the model's chat template rejected the conversation: roles"
    assert_one_line(result, 1, message)
    assert fake_engine.streams == []
    doubled.write_text(json.dumps([user("one"), assistant("two")]))  # the same template takes a proper history
    assert invoke("chat", "--load", str(doubled), "--max-tokens", "2", input="hi\n").exit_code == 0
    assert len(fake_engine.streams) == 1


# -- --json: errors are JSON too ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "code", "kind", "message"),
    [
        (["--json", "   "], 1, "prompt", "the prompt is empty"),
        (["--json", "--seed", "-1", "hi"], 2, "usage", "Invalid value for '--seed'"),
        (["--json", "--no-such-flag", "hi"], 2, "usage", "No such option: --no-such-flag"),
        (["--json", "--model", "/nonexistent/m.gguf", "hi"], 1, "model", "no such model file: /nonexistent/m.gguf"),
    ],
)
def test_generate_json_errors_are_one_json_object_on_stdout(isolated_home, args, code, kind, message):
    result = invoke("generate", *args)
    assert result.exit_code == code
    error = json.loads(result.stdout)["error"]
    assert error["kind"] == kind and error["message"].startswith(message)
    assert result.stderr == f"error: {error['message']}\n"


@pytest.mark.parametrize("where", ["load", "prefill"])
def test_generate_json_interrupted_before_any_token_is_a_json_error(fake_engine, monkeypatch, where):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    def interrupt_stream(*args, **kwargs):
        yield interrupt()

    if where == "load":
        monkeypatch.setattr("akunu.cli.runtime.load", interrupt)
    else:
        monkeypatch.setattr("akunu.generate.stream_generate", interrupt_stream)
    result = invoke("generate", "--json", "hi")
    assert result.exit_code == 130
    assert json.loads(result.stdout) == {"error": {"message": "interrupted", "kind": "interrupted"}}


def test_a_temperature_that_is_not_finite_is_one_line(fake_engine):
    assert_one_line(invoke("generate", "--temp", "inf", "hi"), 2, "Invalid value for '--temp'")
    assert fake_engine.loads == []


def test_bench_json_errors_land_in_the_json_file(isolated_home, tmp_path):
    target = tmp_path / "bench.json"
    result = invoke("bench", "--json", str(target), "--workload", str(tmp_path / "absent.jsonl"))
    assert result.exit_code == 2 and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    error = json.loads(target.read_text())["error"]
    assert error["kind"] == "workload" and result.stderr == f"error: {error['message']}\n"


def test_unexpected_os_errors_are_one_line(fake_engine, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(tmp_path / "x"))

    monkeypatch.setattr("akunu.cli.runtime.load", refuse)
    assert_one_line(invoke("generate", "hi"), 1, f"Not a directory: {tmp_path / 'x'}")
