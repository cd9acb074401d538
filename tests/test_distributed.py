"""akunu under `mlx.launch -n 2 --backend ring` on localhost: a split model decodes as one process does, plain
and speculative; chat takes rank 0's lines; serve answers as one process does and stops both ranks; rank 0
alone prints; a killed rank ends the job with one line.

Each test is one launched job (two processes), so the module stays within a minute. Greedy outputs are
compared with the near-tie rule: the ranks' all-sum adds partial products in another order than one
process's product, which may round a logit differently (float32 weights here; docs/architecture.md, "Across machines").
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from akunu import backends
from akunu.drafters.specs import DraftLengthPolicy
from akunu.generate import GenerationConfig, SpecConfig, generate
from tests import llama_cpp_tiny
from tests.fakes import FakeTokenizer
from tests.greedy_checks import assert_same_or_near_tie
from tests.tiny_archs import SIZES, tiny_model
from tests.tiny_gguf import write_tiny_gguf

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
JOB = ROOT / "tests" / "distributed_job.py"
PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]
CASES = [
    ["llama", "tensor", True],
    ["qwen3_moe", "tensor", False],
    ["qwen3_5", "tensor", True],
    ["qwen2", "pipeline", False],
]  # dense, MoE, hybrid, pipelined; whether also in exact mode
KILL_BOUND = 20.0  # seconds from killing rank 1 to the job's end


def launch(command: list[str]) -> list[str]:
    """`mlx.launch -n 2 --backend ring` on free local ports, running `command`."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    base = [str(BIN / "mlx.launch"), "-n", "2", "--backend", "ring", "--starting-port", str(port), "--"]
    return base + command


def run_launched(command: list[str], env: dict, timeout: float = 90, stdin: str | None = None):
    return subprocess.run(
        launch(command), env=env, input=stdin, capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


@pytest.fixture(scope="module")
def job_env(tmp_path_factory, model_home) -> dict:
    """The environment of launched jobs: this checkout importable, an AKUNU_HOME of the test's own; skips the
    module where `mlx.launch` cannot start two ranks here."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AKUNU_HOME": str(model_home)}
    env.pop("MLX_RANK", None)
    probe = "import mlx.core as mx; g = mx.distributed.init(); print(f'sum={mx.distributed.all_sum(mx.array([1.0])).item()}')"
    try:
        done = run_launched([sys.executable, "-c", probe], env, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        pytest.skip(f"mlx.launch cannot run two ranks here: {error}")
    if done.returncode != 0 or done.stdout.count("sum=2.0") != 2:  # the ranks' lines may interleave
        pytest.skip(f"mlx.launch cannot run two ranks here: {(done.stderr or done.stdout).strip()[-300:]}")
    return env


def rank_lines(stdout: str) -> dict[int, dict]:
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return {line["rank"]: line for line in lines}


def single_process_decodes(model, tokenizer, prompt, max_tokens):
    ids = {}
    for spec in (False, True):
        config = GenerationConfig(
            max_tokens=max_tokens, spec=SpecConfig(enabled=spec, draft_tokens=4, draft_length=DraftLengthPolicy.fixed)
        )
        ids["spec" if spec else "plain"] = generate(model, tokenizer, prompt, config)[1]
    return ids


def write_tiny_qwen2_gguf(path: Path) -> set[str]:
    """A 2-layer qwen2 GGUF (llama's tensors with q/k/v biases); the names of its tensors."""
    from tests.tiny_gguf import HEAD_DIM, HEADS, KV_HEADS, LAYERS

    rng = np.random.default_rng(1)
    widths = {"attn_q": HEADS * HEAD_DIM, "attn_k": KV_HEADS * HEAD_DIM, "attn_v": KV_HEADS * HEAD_DIM}
    biases = {
        f"blk.{layer}.{stem}.bias": rng.standard_normal(width) * 0.1
        for layer in range(LAYERS)
        for stem, width in widths.items()
    }
    return set(write_tiny_gguf(path, arch="qwen2", extra_f32=biases)) | set(biases)


def test_dense_moe_hybrid_and_pipelined_gguf_models_split_across_two_ranks_decode_as_one_process(job_env, tmp_path):
    gguf, moe = tmp_path / "qwen2.gguf", tmp_path / "qwen3moe.gguf"
    names = write_tiny_qwen2_gguf(gguf)
    llama_cpp_tiny.write(llama_cpp_tiny.ARCHS["qwen3moe"], moe)
    cases = [*CASES, [str(gguf), "pipeline", False], [str(moe), "tensor", False]]
    done = run_launched([sys.executable, str(JOB), "archs", json.dumps(cases), json.dumps(PROMPT), "8"], job_env)
    assert done.returncode == 0, done.stderr[-2000:]
    ranks = rank_lines(done.stdout)
    assert sorted(ranks) == [0, 1]
    _check_pipelined_gguf(gguf, names, [ranks[r][str(gguf)] for r in (0, 1)])
    _check_gguf_split_by_mlx_lm(moe, [ranks[r][str(moe)] for r in (0, 1)])
    for name, how, exact in CASES:
        split = [ranks[r][name] for r in (0, 1)]
        assert split[0]["plain"] == split[1]["plain"] and split[0]["spec"] == split[1]["spec"], name
        if exact:  # exact mode's passes do not depend on the draft: speculative equals plain bit for bit, split too
            assert split[0]["exact-spec"] == split[0]["exact-plain"] == split[1]["exact-spec"], name
        assert split[0]["split"].startswith(f"{how} parallel"), split[0]["split"]
        _check_traffic(name, how, split)
        model = tiny_model(name)
        backends.apply(model)
        alone = single_process_decodes(model, FakeTokenizer(), PROMPT, 8)
        for mode in ("plain", "spec"):
            assert_same_or_near_tie(model, PROMPT, alone["plain"], split[0][mode], why=f"{name} {mode}")


def _check_traffic(name: str, how: str, split: list[dict]) -> None:
    """The counter counts every collective a pass calls, whoever calls it. Tensor parallel: two all-sums per layer
    (attention, then the MLP or the MoE block), and qwen3_5's all-gather of its vocabulary-split logits. Pipeline:
    rank 1 sends its hidden state to rank 0 (one message, received there), then both all-gather it."""
    layers, row = SIZES["num_hidden_layers"], SIZES["hidden_size"] * 4  # float32 activations
    per_pass = 2 if how == "pipeline" else 2 * layers + (name == "qwen3_5")
    for rank in (0, 1):
        (passes, collectives, sent), called = split[rank]["traffic"], split[rank]["called"]
        assert passes > 0 and collectives == per_pass * passes == called["calls"], (name, rank, passes, collectives)
        assert sent == called["bytes"] > 0, (name, rank, sent, called)
        if how == "pipeline":
            assert sent == (1 + rank) * row * called["tokens"], (rank, sent, called)


def _check_gguf_split_by_mlx_lm(moe: Path, split: list[dict]) -> None:
    """A MoE GGUF, read a layer at a time and cut as mlx-lm's qwen3_moe split cuts it, decodes as one process does."""
    from akunu.models import load_model

    assert "mlx-lm's qwen3_moe split" in split[0]["split"], split[0]["split"]
    assert split[0]["plain"] == split[1]["plain"] and split[0]["spec"] == split[1]["spec"]
    loaded = load_model(str(moe), dtype="float32")
    alone = single_process_decodes(loaded.model, loaded.tokenizer, PROMPT, 8)
    for mode in ("plain", "spec"):
        assert_same_or_near_tie(loaded.model, PROMPT, alone["plain"], split[0][mode], why=f"qwen3moe GGUF {mode}")


def _check_pipelined_gguf(gguf: Path, names: set[str], split: list[dict]) -> None:
    """Each rank read its own layer (mlx-lm gives rank 0 the last) and the tensors outside the layers, nothing
    else, and decodes as one process does."""
    from akunu.models import load_model

    for rank, layer in ((0, 1), (1, 0)):
        assert split[rank]["split"].endswith(f"runs layers {layer}-{layer}"), split[rank]["split"]
        own = {name for name in names if not name.startswith("blk.") or name.startswith(f"blk.{layer}.")}
        assert sorted(split[rank]["read"]) == sorted(own)
    assert split[0]["plain"] == split[1]["plain"] and split[0]["spec"] == split[1]["spec"]
    loaded = load_model(str(gguf), dtype="float32")
    alone = single_process_decodes(loaded.model, loaded.tokenizer, PROMPT, 8)
    for mode in ("plain", "spec"):
        assert_same_or_near_tie(loaded.model, PROMPT, alone["plain"], split[0][mode], why=f"qwen2 GGUF {mode}")


@pytest.mark.real_model
def test_the_default_model_split_reads_half_its_layers_per_rank_and_decodes_as_one_process(job_env, catalogue_model):
    from akunu.models import load_model

    prompt = "Repeat exactly: red, green, blue, red, green, blue."
    command = [sys.executable, str(JOB), "model", "smollm2-135m", "float32", prompt, "5"]
    done = run_launched(command, job_env)
    assert done.returncode == 0, done.stderr[-2000:]
    ranks = rank_lines(done.stdout)
    mx.reset_peak_memory()
    loaded = load_model(str(catalogue_model("smollm2-135m")), dtype="float32")
    whole_peak = mx.get_peak_memory()
    ids = loaded.tokenizer.encode(prompt)
    alone = single_process_decodes(loaded.model, loaded.tokenizer, ids, 5)
    for mode in ("plain", "spec"):
        assert ranks[0][mode] == ranks[1][mode]
        assert_same_or_near_tie(loaded.model, ids, alone["plain"], ranks[0][mode], why=mode)
    for rank in (0, 1):  # the embedding is whole on each rank; the 30 layers are split
        assert ranks[rank]["peak_mb"]["mlx_after_load"] * 1e6 < 0.75 * whole_peak, ranks[rank]["peak_mb"]
    passes, collectives, _ = ranks[0]["traffic"]
    assert collectives == 60 * passes  # two all-sums per layer per pass


def test_chat_takes_rank_zeros_lines_for_three_turns_and_rank_one_prints_nothing(job_env, tmp_path):
    model = tmp_path / "tiny.gguf"
    write_tiny_gguf(model)
    command = [str(BIN / "akunu"), "chat", "--model", str(model), "--dtype", "float32", "--max-tokens", "8"]
    done = run_launched([*command, "--check-ranks"], job_env, stdin="one two\nthree four\nfive six\n/exit\n")
    assert done.returncode == 0, done.stderr[-2000:]
    answers = [line for line in (done.stdout + done.stderr).splitlines() if " tok · " in line]
    assert len(answers) == 3, done.stdout + done.stderr  # three turns, each answered once: by rank 0
    # (mlx.launch never closes the ranks' stdin, so the end of input is /exit)
    assert done.stderr.count("tensor parallel over 2 ranks") == 1, done.stderr


def test_generate_json_names_the_ranks_the_split_and_the_traffic_per_token(job_env, tmp_path):
    from tests.tiny_gguf import LAYERS

    model = tmp_path / "tiny.gguf"
    write_tiny_gguf(model)
    command = [str(BIN / "akunu"), "generate", "--json", "--no-spec", "--model", str(model), "--dtype", "float32",
               "--max-tokens", "6", "one two three"]  # fmt: skip
    done = run_launched(command, job_env)
    assert done.returncode == 0, done.stderr[-2000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 1, done.stdout  # rank 0's
    split = results[0]["split"]
    assert (split["ranks"], split["kind"]) == (2, "tensor") and split["how"].startswith("tensor parallel over 2 ranks")
    assert split["per_token"]["round_trips"] == 2 * LAYERS + 1  # a pass a token: two all-sums a layer, the stop check
    assert split["per_token"]["bytes_sent"] > 0


def _rank_one(launcher: subprocess.Popen) -> int | None:
    return _rank_with(launcher, b"MLX_RANK=1")


def _rank_with(launcher: subprocess.Popen, variable: bytes) -> int | None:
    """The pid of the launched process with this MLX_RANK (mlx.launch execs each rank in its own child)."""
    for entry in Path("/proc").iterdir():
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environment = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if parent == launcher.pid and variable in environment:
            return int(entry.name)
    return None


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds rank 1 through /proc")
def test_killing_one_rank_ends_the_other_within_bounded_time_naming_it(job_env, tmp_path):
    model = tmp_path / "tiny.gguf"
    write_tiny_gguf(model)
    command = [str(BIN / "akunu"), "generate", "--model", str(model), "--dtype", "float32", "--no-spec"]
    launcher = subprocess.Popen(
        launch([*command, "--max-tokens", "230", "a story"]), env=job_env, cwd=ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert launcher.stdout.read(1), "rank 0 printed no text"  # decoding has begun on both ranks
        victim = _rank_one(launcher)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = launcher.communicate(timeout=KILL_BOUND)
        assert time.monotonic() - killed < KILL_BOUND
    finally:
        launcher.kill()
    # mlx.launch forwards the ranks' lines beside its own warnings, sometimes in the middle of one
    ours = re.findall(r"error: [^\x1b\n]*", stderr)
    assert len(ours) == 1 and "rank 1" in ours[0], stderr[-2000:]


SERVE_BOUND = 60.0  # seconds for the split server to load, and (separately) to stop


def _rank_zero_pid(launcher: subprocess.Popen) -> int | None:
    return _rank_with(launcher, b"MLX_RANK=0")


def _serve_split(job_env: dict, model: Path, port: int) -> subprocess.Popen:
    command = [str(BIN / "akunu"), "serve", "--model", str(model), "--dtype", "float32", "--port", str(port),
               "--draft-length", "fixed", "--draft-tokens", "4", "--no-ui"]  # fmt: skip
    return subprocess.Popen(launch(command), env=job_env, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)  # fmt: skip


def _wait_until_serving(launcher: subprocess.Popen, port: int) -> None:
    deadline = time.monotonic() + SERVE_BOUND
    while time.monotonic() < deadline and launcher.poll() is None:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    launcher.kill()
    raise AssertionError(f"the split server did not start: {launcher.communicate()[1][-2000:]}")


def _single_process_answer(model: Path, messages: list[dict], max_tokens: int) -> str:
    """Plain greedy decoding of the prompt the server makes of `messages` (the tiny model has no chat template:
    a transcript, ending where the user's next line would start)."""
    from akunu.cli.conversation import PLAIN_USER_PREFIX, Conversation
    from akunu.models import load_model

    loaded = load_model(str(model), dtype="float32")
    config = GenerationConfig(max_tokens=max_tokens, spec=SpecConfig(enabled=False), stop=(PLAIN_USER_PREFIX,))
    return generate(loaded.model, loaded.tokenizer, Conversation(turns=messages).prompt_ids(loaded.tokenizer), config)[
        0
    ]


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds rank 0 through /proc")
def test_serve_split_answers_the_openai_client_as_one_process_and_stopping_rank_zero_ends_both(job_env, tmp_path):
    import openai

    model = tmp_path / "tiny.gguf"
    write_tiny_gguf(model)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    launcher = _serve_split(job_env, model, port)
    try:
        _wait_until_serving(launcher, port)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        ask = [{"role": "user", "content": "one two three four"}]
        answer = client.chat.completions.create(model="tiny", messages=ask, max_tokens=12, temperature=0)
        expected = _single_process_answer(model, ask, 12)
        assert answer.choices[0].message.content == expected  # greedy, split and speculative: one process's text
        # the same prompt again, streamed: both ranks reuse the same cache slot
        streamed = client.chat.completions.create(model="tiny", messages=ask, max_tokens=12, stream=True)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices) == expected
        # a client that leaves mid-answer stops every rank at the same pass: the next answers still agree
        with client.completions.create(model="tiny", prompt="a b c", max_tokens=2000, stream=True) as left:
            next(iter(left))
        sampled = [
            client.chat.completions.create(model="tiny", messages=ask, max_tokens=12, temperature=1, seed=7)
            for _ in range(2)
        ]
        assert sampled[0].choices[0].message.content == sampled[1].choices[0].message.content
        os.kill(_rank_zero_pid(launcher), signal.SIGINT)  # Ctrl-C on rank 0 alone, as on the first of two Macs
        stopped = time.monotonic()
        _, stderr = launcher.communicate(timeout=SERVE_BOUND)
        assert time.monotonic() - stopped < SERVE_BOUND
    finally:
        launcher.kill()
    assert launcher.returncode == 0, stderr[-2000:]
    assert "error" not in stderr and "exited with code" not in stderr, stderr[-2000:]  # rank 1 ended cleanly too


def test_a_serve_job_reaches_the_followers_with_every_generation_setting_and_a_seed():
    import dataclasses

    from akunu.cli.server import ranks
    from akunu.cli.server.worker import Job
    from akunu.sampling import SamplingParams

    config = GenerationConfig(
        max_tokens=7, sampling=SamplingParams(temp=0.7, top_k=5, top_p=0.9, min_p=0.1), stop=("\n\n",), logprobs=2,
        spec=SpecConfig(draft_tokens=4, draft_length=DraftLengthPolicy.fixed, exact=True), grammar='start: "x"',
    )  # fmt: skip
    sent = dataclasses.replace(Job([1, 2, 3], config, emit=print), config=ranks.seeded(config))
    received = ranks.job_from(json.loads(json.dumps(ranks.job_message(sent))))  # as distributed.agree carries it
    assert received.prompt_ids == [1, 2, 3] and received.config == sent.config
    assert sent.config.sampling.seed is not None  # every rank samples from the seed rank 0 picked
