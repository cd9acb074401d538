"""`akunu generate` through CliRunner, with a tiny random model behind it."""

import json
import re

import pytest

import akunu.generate
from akunu.drafters.specs import DraftLengthPolicy
from akunu.errors import ModelError
from akunu.generate import GenerationConfig, SpecConfig
from akunu.sampling import SamplingParams
from tests.fakes import ANSI, FAKE_COSTS, invoke, make_loaded
from tests.tiny import tiny_llama


def chat_prompt(loaded, text, system=None):
    tokenizer = loaded.tokenizer
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return tokenizer.encode(tokenizer.apply_chat_template(messages))


def test_every_option_reaches_the_engine(fake_engine):
    result = invoke(
        "generate", "hello there", "--model", "tiny-model", "--dtype", "quantized", "--system", "be brief",
        "--max-tokens", "9", "--temp", "0.7", "--top-k", "5", "--top-p", "0.9", "--min-p", "0.05", "--seed", "7",
        "--stop", "zz", "--stop", "a\\nb", "--no-spec", "--draft-tokens", "3",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert [(c["spec"], c["dtype"]) for c in fake_engine.loads] == [("tiny-model", "quantized")]
    (call,) = fake_engine.streams
    assert call["config"] == GenerationConfig(
        max_tokens=9,
        sampling=SamplingParams(temp=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=7),
        spec=SpecConfig(enabled=False, draft_tokens=3),
        stop=("zz", "a\nb"),
    )
    assert call["prompt"] == chat_prompt(fake_engine.loaded, "hello there", system="be brief")
    assert call["context_length"] == 512
    assert call["costs"] is None and fake_engine.cost_curves == []  # no adaptive drafting, nothing measured


def test_defaults_reach_the_engine_with_the_measured_cost_curve(fake_engine):
    result = invoke("generate", "hello")
    assert result.exit_code == 0, result.output
    assert [(c["spec"], c["dtype"]) for c in fake_engine.loads] == [("smollm2-135m", "auto")]
    (call,) = fake_engine.streams
    assert call["config"] == GenerationConfig(max_tokens=256, spec=SpecConfig(enabled=True, draft_tokens=32))
    assert call["costs"] == FAKE_COSTS
    (curve,) = fake_engine.cost_curves
    assert curve["model"] is fake_engine.loaded.model
    assert curve["key"].startswith("tiny-float32-cpu-")  # model, dtype, backend, BLAS
    assert curve["directory"].parts[-2:] == ("akunu-home", "cost_curves")


def test_draft_tokens_reaches_the_engine_with_spec_on(fake_engine):
    assert invoke("generate", "hello", "--draft-tokens", "7", "--spec").exit_code == 0
    assert fake_engine.config.spec == SpecConfig(enabled=True, draft_tokens=7)
    assert fake_engine.cost_curves[0]["max_width"] == 8  # the curve covers a pass of 7 drafts + 1


def test_exact_reaches_the_engine_and_its_speculation_prints_what_its_plain_decoding_prints(fake_engine):
    results = [
        invoke("generate", "hello", "--exact", "--draft-tokens", "3", *flag, "--max-tokens", "24")
        for flag in ([], ["--no-spec"])
    ]
    assert [r.exit_code for r in results] == [0, 0], results[0].output
    spec, plain = (call["config"].spec for call in fake_engine.streams)
    assert spec == SpecConfig(enabled=True, draft_tokens=3, exact=True) and plain == SpecConfig(
        enabled=False, draft_tokens=3, exact=True
    )
    assert results[0].stdout == results[1].stdout
    assert fake_engine.cost_curves == []  # exact mode's passes all cost the same: nothing to measure


@pytest.mark.parametrize("choice", ["adaptive", "entropy", "fixed"])
def test_draft_length_policy_reaches_the_engine(fake_engine, choice):
    assert invoke("generate", "hello", "--draft-length", choice).exit_code == 0
    assert fake_engine.config.spec == SpecConfig(enabled=True, draft_length=DraftLengthPolicy(choice))


def test_text_goes_to_stdout_and_stats_to_stderr(fake_engine):
    text = json_of(invoke("generate", "hello", "--max-tokens", "12", "--json"))["text"]
    result = invoke("generate", "hello", "--max-tokens", "12")
    assert result.exit_code == 0
    assert result.stdout == with_newline(text)
    assert fake_engine.finals[-1].stats.generated_tokens == 12
    (line,) = result.stderr.splitlines()
    assert line.startswith("12 tok · ") and " · prefill " in line and line.endswith(" · length")


def test_json_prints_nothing_else(fake_engine):
    result = invoke("generate", "abc", "--json", "--max-tokens", "3")
    assert result.stderr == ""
    assert result.stdout.count("\n") == 1 and json.loads(result.stdout)["generated_tokens"] == 3


def with_newline(text: str) -> str:
    return text if text.endswith("\n") else text + "\n"


def json_of(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_json_is_one_object_whose_numbers_are_the_engines(fake_engine):
    fake_engine.loaded = make_loaded(model=tiny_llama(vocab=64, seed=3, sharpness=4.0, attention=0.0))
    data = json_of(invoke("generate", "abcabcabcabc", "--max-tokens", "40", "--json"))
    stats = fake_engine.finals[-1].stats
    numbers = stats.to_dict()
    for key in (
        "prompt_tokens generated_tokens prefill_tps decode_tps peak_memory_mb forward_passes drafted accepted"
        " acceptance_rate tokens_per_pass"
    ).split():
        assert data[key] == numbers[key], key
    assert data["finish_reason"] == "length" == stats.finish_reason
    assert data["model"] == "tiny"
    assert data["stats"]["prefill"] == {
        "prompt_tokens": numbers["prompt_tokens"],
        "tokens": numbers["prefilled_tokens"],
        "seconds": numbers["prefill_seconds"],
        "tps": numbers["prefill_tps"],
    }
    assert data["stats"]["decode"]["accepted_lengths"] == numbers["accepted_lengths"]
    assert data["stats"]["decode"]["tokens_per_pass"] == numbers["tokens_per_pass"]
    # the same ids and text as the engine gives when called directly
    loaded = fake_engine.loaded
    config = GenerationConfig(max_tokens=40)
    text, ids, _ = akunu.generate.generate(
        loaded.model, loaded.tokenizer, chat_prompt(loaded, "abcabcabcabc"), config, costs=FAKE_COSTS
    )
    assert (data["text"], data["tokens"]) == (text, ids)
    assert data["generated_tokens"] == len(ids) == 40
    assert data["accepted"] > 0  # the repetitive model made speculation pay, so the counters mean something


def test_raw_sends_the_prompt_verbatim(fake_engine):
    assert invoke("generate", "QuserQhi\nQassistantQ", "--raw").exit_code == 0
    assert fake_engine.streams[-1]["prompt"] == fake_engine.loaded.tokenizer.encode("QuserQhi\nQassistantQ")


def test_a_model_without_chat_template_gets_raw_text_and_one_note(fake_engine):
    fake_engine.loaded = make_loaded(template=False)
    result = invoke("generate", "hello", "--system", "be brief")
    assert result.exit_code == 0
    assert fake_engine.streams[-1]["prompt"] == fake_engine.loaded.tokenizer.encode("be brief\n\nhello")
    assert result.stderr.count("note: this model has no chat template; the prompt is sent as raw text") == 1


@pytest.mark.parametrize("args", [[], ["-"]], ids=["no-argument", "dash"])
def test_prompt_from_stdin(fake_engine, args):
    assert invoke("generate", *args, input="from stdin\n").exit_code == 0
    assert fake_engine.streams[-1]["prompt"] == chat_prompt(fake_engine.loaded, "from stdin\n")


def test_prompt_from_file(fake_engine, tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_text("from a file")
    assert invoke("generate", "--prompt-file", str(path)).exit_code == 0
    assert fake_engine.streams[-1]["prompt"] == chat_prompt(fake_engine.loaded, "from a file")


def test_verbose_tints_accepted_drafts_and_prints_every_statistic(fake_engine):
    fake_engine.loaded = make_loaded(model=tiny_llama(vocab=64, seed=3, sharpness=4.0, attention=0.0))
    plain = json_of(invoke("generate", "abcabcabcabc", "--max-tokens", "40", "--json"))
    result = invoke(
        "generate", "abcabcabcabc", "--max-tokens", "40", "--verbose", env={"FORCE_COLOR": "1", "COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    assert "\x1b[30;42m" in result.stdout  # black on green: accepted draft tokens
    assert ANSI.sub("", result.stdout) == with_newline(plain["text"])
    err = ANSI.sub("", result.stderr)
    assert "speculative decoding on, up to 32 drafts, adaptive" in err
    assert re.search(rf"drafted / accepted\s+{plain['drafted']} / {plain['accepted']}", err)
    assert re.search(rf"forward passes\s+{plain['forward_passes']}\b", err)


def test_ctrl_c_keeps_what_was_generated_and_exits_130(fake_engine, monkeypatch):
    full = json_of(invoke("generate", "hello", "--max-tokens", "20", "--json"))["text"]
    real = akunu.generate.stream_generate

    def interrupted(*args, **kwargs):
        for i, response in enumerate(real(*args, **kwargs)):
            if i == 5:
                raise KeyboardInterrupt
            yield response

    monkeypatch.setattr(akunu.generate, "stream_generate", interrupted)
    result = invoke("generate", "hello", "--max-tokens", "20")
    assert result.exit_code == 130
    assert result.stdout == with_newline(full[:5])
    assert result.stderr.strip().endswith("· interrupted")
    cut = json.loads(invoke("generate", "hello", "--max-tokens", "20", "--json").stdout)
    assert (cut["text"], cut["finish_reason"]) == (full[:5], "interrupted")


def one_error_line(result, code: int, message: str, stdout: str = "") -> None:
    assert result.exit_code == code, result.output
    assert result.stderr == f"error: {message}\n"
    assert result.stdout == stdout


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (
            ["hi", "--json", "--verbose"],
            2,
            "--json and --verbose cannot be combined: --json already carries every statistic",
        ),
        (["hi", "--raw", "--system", "x"], 2, "--system needs the chat template, which --raw turns off"),
        (["hi", "--prompt-file", "p.txt"], 2, "give the prompt as an argument or with --prompt-file, not both"),
        (
            ["--prompt-file", "/nonexistent/p.txt"],
            1,
            "cannot read the prompt file /nonexistent/p.txt: No such file or directory",
        ),
        (["   "], 1, "the prompt is empty"),
        (["hi", "--top-k", "64"], 2, "--top-k must be in [0, 64) (got 64)"),
    ],
)
def test_user_mistakes_are_one_line(fake_engine, args, code, message):
    kind = "options" if code == 2 else "prompt"  # with --json the error is JSON on stdout too
    stdout = json.dumps({"error": {"message": message, "kind": kind}}) + "\n" if "--json" in args else ""
    one_error_line(invoke("generate", *args, input=""), code, message, stdout)


def test_usage_errors_are_one_line(fake_engine):
    result = invoke("generate", "hi", "--temp", "-1")
    assert result.exit_code == 2
    assert result.stderr.startswith("error: Invalid value for '--temp'") and result.stderr.count("\n") == 1
    assert result.stderr.rstrip().endswith("(see 'akunu generate --help')")
    assert invoke("generate", "hi", "--no-such-option").stderr.startswith("error: No such option: --no-such-option")
    assert fake_engine.loads == []


def test_a_prompt_longer_than_the_context_is_one_line(fake_engine):
    fake_engine.loaded = make_loaded(context_length=16)
    one_error_line(invoke("generate", "x" * 40, "--raw"), 1, "the prompt has 40 tokens but the model's context is 16")


def test_unknown_model_name_suggests_close_ones(isolated_home):
    result = invoke("generate", "hi", "--model", "smollm2-13m")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: unknown model 'smollm2-13m'; did you mean smollm2-135m?")
    assert result.stderr.count("\n") == 1


def test_missing_and_corrupt_model_files_are_one_line(isolated_home, tmp_path):
    one_error_line(
        invoke("generate", "hi", "--model", str(tmp_path / "absent.gguf")),
        1,
        f"no such model file: {tmp_path / 'absent.gguf'}",
    )
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + b"\x00" * 50)
    result = invoke("generate", "hi", "--model", str(corrupt))
    assert result.exit_code == 1 and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "Traceback" not in result.output


def test_akunu_debug_shows_the_traceback(isolated_home, tmp_path):
    result = invoke("generate", "hi", "--model", str(tmp_path / "absent.gguf"), env={"AKUNU_DEBUG": "1"})
    assert isinstance(result.exception, ModelError)
    assert result.stderr == ""
