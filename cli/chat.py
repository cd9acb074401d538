"""`akunu chat`: a multi-turn terminal chat that keeps the KV cache across turns."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from akunu.cli import display, harmony, options, runtime, text_input
from akunu.cli.chat_view import ChatView
from akunu.cli.conversation import PLAIN_USER_PREFIX, Conversation, replaceable
from akunu.errors import AkunuError, OptionsError

EXAMPLES = """[bold]Examples[/]
  akunu chat
  akunu chat --system "You are a terse assistant." --temp 0.7
  akunu chat --save talk.json          (saved after every answer)
  akunu chat --load talk.json --save talk.json
  akunu chat --model gemma3-270m --no-spec

[bold]In the chat[/]  /help  /reset  /stats  /spec on|off  /save FILE  /exit   ·   Ctrl-C stops an answer, Ctrl-D quits"""

COMMANDS = {
    "/help": "this list",
    "/reset": "start a new conversation (keeps the system prompt)",
    "/stats": "every statistic of the last answer, and the session's",
    "/spec on|off": "turn speculative decoding on or off",
    "/save FILE": "save the conversation as JSON (/save --force FILE replaces a file that is not one)",
    "/exit": "quit (also /quit, /bye, Ctrl-D)",
}
CONVERSATION_PANEL = "Conversation"


def chat(
    model: options.Model = None,
    dtype: options.Dtype = options.WeightsDtype.auto,
    system: options.System = None,
    max_tokens: Annotated[
        int, typer.Option(min=1, rich_help_panel=options.SAMPLING_PANEL, help="The most tokens per answer.")
    ] = 1024,
    temp: options.Temp = 0.0,
    top_k: options.TopK = 0,
    top_p: options.TopP = 1.0,
    min_p: options.MinP = 0.0,
    seed: options.Seed = None,
    stop: options.Stop = None,
    spec: options.Spec = True,
    draft_tokens: options.DraftTokens = 32,
    exact: options.Exact = False,
    save: Annotated[
        Path | None,
        typer.Option(
            rich_help_panel=CONVERSATION_PANEL, help="Save the conversation to this JSON file after every answer."
        ),
    ] = None,
    load: Annotated[
        Path | None,
        typer.Option(rich_help_panel=CONVERSATION_PANEL, help="Resume the conversation saved in this JSON file."),
    ] = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force", rich_help_panel=CONVERSATION_PANEL, help="Let --save replace a file that is not a conversation."
        ),
    ] = False,
    shard: options.Shard = options.Sharding.auto,
    check_ranks: options.CheckRanks = False,
) -> None:
    """Chat with a model in the terminal; the KV cache carries over, so each turn prefills only what is new.

    A live line under the answer shows tok/s, draft acceptance, tokens per forward pass and memory; a summary follows each answer.
    """
    conversation = Conversation(**runtime.from_leader(lambda: read_files(save, load, force)))
    if system is not None:
        conversation.system = text_input.check_text(system, "--system")
    config = options.generation_config(
        max_tokens=max_tokens, temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, stop=stop, spec=spec,
        draft_tokens=draft_tokens, exact=exact,
    )  # fmt: skip
    loaded = runtime.load(model, dtype, (), shard, check_ranks)
    config.sampling.validate(loaded.tokenizer.vocab_size)
    if system is not None:
        text_input.check_length(system, text_input.text_limit(loaded.context_length), "--system")
    if load:
        conversation.check_continues(loaded.tokenizer, load)
    disk = None
    if (
        save or load
    ) and runtime.alone():  # a conversation kept on disk keeps its KV cache there too (akunu.disk_cache)
        from akunu.disk_cache import open_store

        disk = open_store(loaded.model, loaded.name, loaded.path, loaded.dtype)
    save = save if runtime.leads() else None  # rank 0 owns the files
    session = ChatSession(loaded, config, conversation, ChatView(), save_path=save, disk=disk)
    session.greet(loaded_from=load)
    try:
        session.run()
    finally:
        if disk is not None:
            disk.close()


def read_files(save: Path | None, load: Path | None, force: bool) -> dict:
    """--save checked and --load read (as a dict), on rank 0 alone under mlx.launch: it owns the files."""
    if save is not None:
        options.check_writable_file(save, "--save")
        if not force and not replaceable(save):
            raise OptionsError(
                f"--save {save}: the file exists and is not an akunu conversation; give --force to replace it"
            )
    return dataclasses.asdict(Conversation.load(load) if load else Conversation())


class ChatSession:
    """The conversation, the prompt cache that mirrors it, and the slash commands."""

    def __init__(
        self, loaded, config, conversation: Conversation, view: ChatView, *, save_path: Path | None = None, disk=None
    ):
        """`disk`: the prompt caches on disk (akunu.disk_cache.DiskPromptCache) a resumed conversation starts from."""
        from akunu.prompt_cache import PromptCache

        self.loaded, self.config, self.conversation, self.view = loaded, config, conversation, view
        self.save_path, self.disk = save_path, disk
        self.prompt_cache = PromptCache(loaded.model)
        self.last_stats, self.last_finish = None, None
        self.totals = {"answers": 0, "generated": 0, "prefilled": 0}
        self._costs = None  # akunu.cost_curve.CostCurves once speculation needs them
        self._shift_noted = False
        if not loaded.tokenizer.has_chat_template:  # a plain transcript: stop where the user's turn would begin
            self.config = dataclasses.replace(config, stop=(*config.stop, PLAIN_USER_PREFIX))

    def greet(self, loaded_from: Path | None = None) -> None:
        self.view.say(
            f"[bold]akunu chat[/] · {escape(self.loaded.describe())} · speculative decoding {self._spec_state()}"
        )
        if not self.loaded.tokenizer.has_chat_template:
            self.view.say(
                "[yellow]note:[/] this model has no chat template; the conversation is sent as a plain transcript"
            )
        if loaded_from:
            self.view.dim(f"resumed {len(self.conversation.turns)} messages from {loaded_from}")
            saved_with = self.conversation.model
            if saved_with and saved_with != self.loaded.name:
                self.view.warn(
                    f"{loaded_from} was saved with the model {saved_with}; it goes on with {self.loaded.name}"
                )
        self.view.dim("/help for commands · Ctrl-C stops an answer · Ctrl-D or /exit quits")

    def run(self, read: Callable[[str], str] | None = None) -> None:
        """Read lines until Ctrl-D or /exit; a line from a pipe or a file is read with the context's bound."""
        if runtime.stdin_is_terminal():
            import readline  # noqa: F401  (line editing and history for input())
        runtime.tolerant_stdin()
        if read is None:
            limit = text_input.text_limit(self.loaded.context_length)
            read = input if runtime.stdin_is_terminal() else functools.partial(text_input.read_line, limit=limit)
        read = runtime.leader_reads(read)  # under mlx.launch every rank takes rank 0's lines
        while True:
            try:
                line = read(">>> ")
            except EOFError:
                self.view.say("")
                break
            except KeyboardInterrupt:
                self.view.say("")
                self.view.dim("(Ctrl-D or /exit quits)")
                continue
            if not runtime.stdin_is_terminal():
                self.view.echo(line.encode("utf-8", "replace").decode())  # so the transcript reads like a session
            line = line.strip()
            if not line:
                continue
            try:
                text_input.check_text(line, "that line")
            except AkunuError as error:
                self.view.error(f"{error}; it was not sent")
                continue
            if line.startswith("/"):
                if not self.command(line):
                    break
                continue
            try:
                self.ask(line)
            except KeyboardInterrupt:  # the question was forgotten
                self.view.say("[yellow]⏹ interrupted[/]")

    def ask(self, text: str) -> None:
        """One turn: prefill what the cache lacks, stream the answer, keep it (even a partial one)."""
        first = self.conversation.first
        self.conversation.add("user", text)
        try:
            prompt_ids = self._prompt_ids()
            if self.disk is not None:
                self.disk.restore(self.prompt_cache, prompt_ids)
            responses = runtime.stream(
                self.loaded, prompt_ids, self.config, prompt_cache=self.prompt_cache, costs=self._costs_now()
            )
            responses = runtime.interruptible(responses)  # under mlx.launch, Ctrl-C stops every rank at one pass
            if harmony.writes_harmony(getattr(self.loaded.tokenizer, "chat_template", None)):
                responses = harmony.final_channel(responses)  # the answer, not the markup or the reasoning
            answer = self.view.stream(responses)
        except AkunuError as error:
            self._forget_question(first)
            self.view.error(str(error))
            return
        except KeyboardInterrupt:  # outside the answer's stream, e.g. while measuring pass costs
            self._forget_question(first)
            raise
        if answer.stats is None:  # interrupted before the first token: forget the question
            self._forget_question(first)
            return
        self.conversation.add("assistant", answer.text)
        self.last_stats, self.last_finish = answer.stats, answer.finish_reason
        self.totals["answers"] += 1
        self.totals["generated"] += answer.stats.generated_tokens
        self.totals["prefilled"] += answer.stats.prefilled_tokens
        if self.disk is not None:
            self.disk.save(self.prompt_cache, prompt_ids)
        if self.save_path:
            self._autosave()

    def _prompt_ids(self) -> list[int]:
        """The conversation's prompt; when it outgrows the context, the oldest turns leave the prompt (not the history)."""
        tokenizer, context = self.loaded.tokenizer, self.loaded.context_length
        prompt = self.conversation.prompt_ids(tokenizer)
        if len(prompt) + min(self.config.max_tokens, context // 4) <= context:  # room for an answer
            return prompt
        first = self.conversation.first
        prompt = self.conversation.shift(tokenizer, context // 2)
        if self.conversation.first != first and not self._shift_noted:
            self._shift_noted = True
            self.view.warn(
                "the conversation outgrew the model's context: the oldest turns are left out of the prompt from now on"
                " (the system prompt stays; /save keeps everything; /reset starts afresh)"
            )
        return prompt

    def _forget_question(self, first: int) -> None:
        """The question got no answer: it leaves the history, and the prompt starts where it did before."""
        self.conversation.turns.pop()
        self.conversation.first = first

    def _autosave(self) -> None:
        """A failed save is a warning: the conversation goes on, and the next answer tries again."""
        try:
            self.conversation.save(self.save_path, self.loaded.name)
        except AkunuError as error:
            self.view.warn(f"{error}; the chat goes on (/save FILE saves elsewhere)")

    def command(self, line: str) -> bool:
        """Run a slash command; False means quit."""
        name, _, argument = line.partition(" ")
        argument = argument.strip()
        if name in ("/exit", "/quit", "/bye"):
            return False
        handlers = {
            "/help": self._help,
            "/reset": self._reset,
            "/stats": self._stats,
            "/spec": self._spec,
            "/save": self._save,
        }
        handler = handlers.get(name)
        if handler is None:
            self.view.echo(f"unknown command {name}; /help lists them", style="yellow")
        else:
            handler(argument)
        return True

    def _help(self, _: str) -> None:
        self.view.help(COMMANDS)

    def _reset(self, _: str) -> None:
        self.conversation.clear()
        self._shift_noted = False
        self.prompt_cache.reset()
        self.last_stats = None
        self.view.dim("new conversation" + (" (system prompt kept)" if self.conversation.system else ""))

    def _stats(self, _: str) -> None:
        from akunu import backends

        if self.last_stats is not None:
            self.view.console.print(display.stats_table(self.last_stats, "last answer", self.last_finish))
        self.view.dim(
            f"session: {self.totals['answers']} answers, {self.totals['generated']} tokens generated, "
            f"{self.totals['prefilled']} prefilled; context {len(self.prompt_cache.tokens)}/{self.loaded.context_length} tokens"
        )
        self.view.dim(
            f"{self.loaded.describe()} · BLAS: {backends.describe()['blas']} · speculative decoding {self._spec_state()}"
        )

    def _spec(self, argument: str) -> None:
        if argument not in ("on", "off", ""):
            self.view.say("[yellow]usage:[/] /spec on|off")
            return
        if argument:
            spec = dataclasses.replace(self.config.spec, enabled=argument == "on")
            self.config = dataclasses.replace(self.config, spec=spec)
        self.view.dim(f"speculative decoding {self._spec_state()}")

    def _save(self, argument: str) -> None:
        if not runtime.leads():
            return
        force = argument.split(" ", 1)[0] == "--force"
        argument = argument.removeprefix("--force").strip() if force else argument
        path = Path(argument).expanduser() if argument else self.save_path
        if path is None:
            self.view.say("[yellow]usage:[/] /save FILE")
            return
        if not force and path != self.save_path and not replaceable(path):
            self.view.error(f"{path} exists and is not an akunu conversation; /save --force {path} replaces it")
            return
        try:
            self.conversation.save(path, self.loaded.name)
        except AkunuError as error:
            self.view.error(str(error))
            return
        self.view.dim(f"saved {len(self.conversation.turns)} messages to {path}")

    def _spec_state(self) -> str:
        from akunu.exact import exact_width

        spec = self.config.spec
        exact = f", exact mode (passes of {exact_width(spec.draft_tokens)})" if spec.exact else ""
        if not spec.enabled:
            return "off" + exact
        return f"on (up to {spec.draft_tokens} drafts, {spec.draft_length.value}{exact})"

    def _costs_now(self):
        """The cost curves, measured the first time speculation needs them."""
        if not self.config.spec.enabled:
            return None
        if self._costs is None:
            self._costs = runtime.costs_for(self.loaded, self.config)
        return self._costs
