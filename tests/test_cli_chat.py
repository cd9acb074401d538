"""`akunu chat` through CliRunner (stdin piped, so no live redraws), with a tiny random model behind it."""

import io
import json
import re

import pytest
from rich.console import Console

import akunu.generate
from akunu.cli import runtime
from akunu.cli.chat_view import ChatView
from akunu.generate import GenerationConfig, SpecConfig
from akunu.sampling import SamplingParams
from tests.fakes import FAKE_COSTS, invoke, make_loaded
from tests.tiny import tiny_llama

REAL_STREAM_GENERATE = akunu.generate.stream_generate  # taken before any test replaces it


def chat(*args, input: str):
    result = invoke("chat", *args, input=input)
    assert result.exit_code == 0, result.output
    return result


def render(loaded, messages) -> list[int]:
    tokenizer = loaded.tokenizer
    return tokenizer.encode(tokenizer.apply_chat_template(messages))


def fresh_answer(loaded, prompt, config) -> list[int]:
    """What the engine generates for `prompt` from an empty cache: the reference for cache reuse."""
    responses = REAL_STREAM_GENERATE(loaded.model, loaded.tokenizer, prompt, config, costs=FAKE_COSTS)
    return [response.token for response in responses if response.token is not None]


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


@pytest.mark.parametrize("spec", ["--spec", "--no-spec"])
def test_the_second_turn_prefills_only_the_new_tokens(fake_engine, spec):
    result = chat(spec, "--max-tokens", "8", input="hello\nhow are you\n/exit\n")
    first, second = fake_engine.streams
    loaded, decode = fake_engine.loaded, fake_engine.loaded.tokenizer.decode
    assert second["prompt_cache"] is first["prompt_cache"]
    assert second["prompt"] == render(loaded, [user("hello"), assistant(decode(first["tokens"])), user("how are you")])
    history = len(first["prompt"]) + len(first["tokens"])
    # the cache holds the first prompt and answer; speculation has not fed the last token yet
    cached = history - 1 if spec == "--spec" else history
    stats1, stats2 = (final.stats for final in fake_engine.finals)
    assert (stats1.prefilled_tokens, stats1.prompt_tokens) == (len(first["prompt"]), len(first["prompt"]))
    assert (stats2.prefilled_tokens, stats2.prompt_tokens) == (len(second["prompt"]) - cached, len(second["prompt"]))
    assert f"prefill {len(first['prompt'])} tok (0 cached, " in result.stdout
    assert f"prefill {stats2.prefilled_tokens} tok ({cached} cached, " in result.stdout
    # reusing the cache changes nothing: the answer is the one an empty cache gives
    assert second["tokens"] == fresh_answer(loaded, second["prompt"], second["config"])


def test_the_session_streams_answers_and_summaries_without_redraws(fake_engine):
    result = chat("--max-tokens", "6", input="hello\n")
    answer = fake_engine.loaded.tokenizer.decode(fake_engine.streams[0]["tokens"])
    assert f">>> hello\n{answer}" in result.stdout
    assert "\x1b[" not in result.stdout  # not a terminal: no colours, no cursor movement
    summary = [line for line in result.stdout.splitlines() if line.startswith("6 tok · ")]
    assert len(summary) == 1 and summary[0].endswith(" · length")
    assert result.stdout.rstrip().endswith(">>>")  # Ctrl-D (end of input) quits cleanly


def test_every_option_reaches_the_engine(fake_engine):
    chat(
        "--model", "tiny-model", "--dtype", "float32", "--system", "be kind", "--max-tokens", "5",
        "--temp", "0.5", "--top-k", "3", "--top-p", "0.8", "--min-p", "0.1", "--seed", "3",
        "--stop", "zz", "--no-spec", "--draft-tokens", "2",
        input="hi\n",
    )  # fmt: skip
    assert [(c["spec"], c["dtype"]) for c in fake_engine.loads] == [("tiny-model", "float32")]
    (call,) = fake_engine.streams
    assert call["config"] == GenerationConfig(
        max_tokens=5,
        sampling=SamplingParams(temp=0.5, top_k=3, top_p=0.8, min_p=0.1, seed=3),
        spec=SpecConfig(enabled=False, draft_tokens=2),
        stop=("zz",),
    )
    assert call["prompt"] == render(fake_engine.loaded, [{"role": "system", "content": "be kind"}, user("hi")])
    assert call["context_length"] == 512 and call["costs"] is None


def test_defaults_reach_the_engine(fake_engine):
    chat(input="hi\n")
    assert [(c["spec"], c["dtype"]) for c in fake_engine.loads] == [("smollm2-135m", "auto")]
    assert fake_engine.config == GenerationConfig(max_tokens=1024)
    assert fake_engine.streams[0]["costs"] == FAKE_COSTS


def test_spec_off_and_on(fake_engine):
    result = chat("--no-spec", "--max-tokens", "3", input="a\n/spec on\nb\n/spec off\nc\n/spec\n/spec maybe\n")
    assert [s["config"].spec.enabled for s in fake_engine.streams] == [False, True, False]
    assert [s["costs"] for s in fake_engine.streams] == [None, FAKE_COSTS, None]
    assert len(fake_engine.cost_curves) == 1  # measured when first needed, then kept
    assert "speculative decoding on (up to 32 drafts, adaptive)" in result.stdout
    assert result.stdout.count("speculative decoding off") == 3  # the greeting, /spec off, /spec
    assert "usage: /spec on|off" in result.stdout


def test_reset_starts_a_new_conversation_with_the_system_prompt(fake_engine):
    result = chat("--system", "sys", "--max-tokens", "4", input="one\n/reset\ntwo\n")
    second = fake_engine.streams[1]
    assert second["prompt"] == render(fake_engine.loaded, [{"role": "system", "content": "sys"}, user("two")])
    assert fake_engine.finals[1].stats.prefilled_tokens == len(second["prompt"])  # nothing reused after /reset
    assert "new conversation (system prompt kept)" in result.stdout


def test_ctrl_c_stops_the_answer_and_keeps_the_session_and_cache_consistent(fake_engine, monkeypatch, tmp_path):
    fake_engine.loaded = make_loaded(model=tiny_llama(vocab=64, seed=3, sharpness=4.0, attention=0.0))
    recording = akunu.generate.stream_generate

    def interrupt_first_answer(*args, **kwargs):
        for i, response in enumerate(recording(*args, **kwargs)):
            if len(fake_engine.streams) == 1 and i == 3:
                raise KeyboardInterrupt
            yield response

    monkeypatch.setattr(akunu.generate, "stream_generate", interrupt_first_answer)
    saved = tmp_path / "talk.json"
    result = chat("--max-tokens", "12", "--save", str(saved), input="abcabcabc\n/stats\nabcabc\n")
    first, second = fake_engine.streams
    partial = fake_engine.loaded.tokenizer.decode(first["tokens"][:3])  # the fourth never reached the screen
    assert "⏹ interrupted" in result.stdout and "· interrupted" in result.stdout
    assert re.search(r"finish\s+interrupted", result.stdout)  # /stats after the interrupt
    assert second["prompt"] == render(fake_engine.loaded, [user("abcabcabc"), assistant(partial), user("abcabc")])
    assert second["tokens"] == fresh_answer(fake_engine.loaded, second["prompt"], second["config"])
    assert fake_engine.finals[-1].stats.prefilled_tokens < len(second["prompt"]) - len(first["prompt"])
    messages = json.loads(saved.read_text())["messages"]
    assert messages[:2] == [user("abcabcabc"), assistant(partial)]


def test_save_and_load_resume_the_conversation(fake_engine, tmp_path):
    saved = tmp_path / "talk.json"
    chat("--system", "sys", "--max-tokens", "4", "--save", str(saved), input="one\ntwo\n")
    decode = fake_engine.loaded.tokenizer.decode
    first, second = (decode(s["tokens"]) for s in fake_engine.streams)
    document = json.loads(saved.read_text())
    assert document == {
        "format": "akunu-chat",
        "version": 1,
        "model": "tiny",
        "system": "sys",
        "messages": [user("one"), assistant(first), user("two"), assistant(second)],
    }
    result = chat("--load", str(saved), "--max-tokens", "4", input="three\n")
    assert "resumed 4 messages from" in result.stdout
    resumed = fake_engine.streams[-1]["prompt"]
    system = {"role": "system", "content": "sys"}
    assert resumed == render(
        fake_engine.loaded, [system, user("one"), assistant(first), user("two"), assistant(second), user("three")]
    )
    chat("--load", str(saved), "--system", "other", "--max-tokens", "2", input="four\n")
    other = {"role": "system", "content": "other"}
    history = [user("one"), assistant(first), user("two"), assistant(second), user("four")]
    assert fake_engine.streams[-1]["prompt"] == render(fake_engine.loaded, [other, *history])


def test_slash_save_writes_the_file(fake_engine, tmp_path):
    target = tmp_path / "later.json"
    result = chat("--max-tokens", "2", input=f"hi\n/save {target}\n/save\n")
    assert json.loads(target.read_text())["messages"][0] == user("hi")
    assert f"saved 2 messages to {target}" in result.stdout
    assert "usage: /save FILE" in result.stdout


def test_a_bad_conversation_file_is_one_line(fake_engine, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"messages": [{"role": "wizard", "content": 3}]}')
    result = invoke("chat", "--load", str(bad), input="")
    assert result.exit_code == 1
    assert result.stderr == f"error: {bad} is not a conversation: expected a list of {{'role', 'content'}} messages\n"
    missing = invoke("chat", "--load", str(tmp_path / "none.json"), input="")
    assert (
        missing.stderr == f"error: cannot read the conversation {tmp_path / 'none.json'}: No such file or directory\n"
    )
    assert fake_engine.loads == []  # the file is checked before the model loads


def test_help_stats_and_unknown_commands(fake_engine):
    result = chat("--max-tokens", "3", input="/stats\nhi\n/stats\n/help\n/nope\n/exit\nnever asked\n")
    out = result.stdout
    assert "session: 0 answers" in out and "session: 1 answers, 3 tokens generated" in out
    assert "last answer" in out and "generated tokens" in out and "drafted / accepted" in out
    for command in ("/help", "/reset", "/stats", "/spec on|off", "/save FILE", "/exit"):
        assert f"  {command}" in out
    assert "unknown command /nope; /help lists them" in out
    assert len(fake_engine.streams) == 1  # nothing after /exit ran


def test_a_model_without_chat_template_gets_a_transcript_that_stops_at_the_next_user_turn(fake_engine):
    fake_engine.loaded = make_loaded(template=False)
    result = chat("--system", "sys", "--max-tokens", "3", input="hi\n")
    (call,) = fake_engine.streams
    assert call["prompt"] == fake_engine.loaded.tokenizer.encode("sys\n\nUser: hi\nAssistant:")
    assert call["config"].stop == ("\nUser:",)
    assert "no chat template" in result.stdout


def test_a_turn_longer_than_the_context_is_an_error_and_the_session_goes_on(fake_engine):
    fake_engine.loaded = make_loaded(context_length=40)
    result = chat("--max-tokens", "2", input=f"{'x' * 60}\nhi\n")
    too_long = len(render(fake_engine.loaded, [user("x" * 60)]))
    assert f"error: the prompt has {too_long} tokens but the model's context is 40\n" in result.stdout
    refused, answered = fake_engine.streams
    assert refused["tokens"] == []
    assert answered["prompt"] == render(fake_engine.loaded, [user("hi")])  # the long turn left the conversation


def test_the_live_view_draws_a_status_line_then_prints_the_answer(fake_engine):
    loaded = fake_engine.loaded
    buffer = io.StringIO()
    view = ChatView(Console(file=buffer, force_terminal=True, width=60, height=8, color_system=None, soft_wrap=True))
    config = GenerationConfig(max_tokens=30)
    answer = view.stream(runtime.stream(loaded, render(loaded, [user("hi")]), config, costs=FAKE_COSTS))
    output = buffer.getvalue()
    assert answer.finish_reason == "length" and answer.stats.generated_tokens == 30
    assert "● " in output and " tok/s" in output  # the live status line was drawn
    assert output.rstrip().splitlines()[-1].startswith("30 tok · ")
    frame = view._frame("word " * 200, answer.stats)
    lines = Console(width=60, file=io.StringIO()).render_lines(frame)
    assert len(lines) <= 8  # only the tail of a long answer is redrawn
