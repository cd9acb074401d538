"""Running one generation across the ranks of an MLX distributed group (`mlx.launch`).

Every rank holds part of the model and runs the same passes; the sharded layers' all-sums (tensor parallel), or
the hidden state's hops from rank to rank and its final all-gather (pipeline), are the only traffic a pass makes.
Everything else a rank decides for itself must come out the same on every rank: the token history is the same,
so drafts are (no messages for them); what could differ (a seed, timings, the text a user types) is decided on
rank 0 and sent once with `agree`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from akunu.errors import AkunuError

LAUNCH_VARIABLES = ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")  # set by mlx.launch's backends and by mpirun
CHECK_WIDTH = 64  # draft tokens compared per round by --check-ranks (drafts are at most 33 long)
PASS_TIMEOUT = float(os.environ.get("AKUNU_RANK_TIMEOUT", "120"))  # seconds a collective may block in a pass


class RankError(AkunuError):
    """The ranks disagree, or one of them is gone."""


class Stopped(Exception):
    """Rank 0 asked to stop the generation (its client left, the server stops, Ctrl-C): raised on every rank at the
    start of the same pass, so that no rank is left waiting in a collective the others never join."""


@dataclass
class Traffic:
    """Collective operations and the bytes each rank sends, counted as passes run."""

    passes: int = 0  # model passes (each a forward over one or more tokens)
    collectives: int = 0  # round trips this rank joins: each all-sum, all-gather, send and receive
    bytes: int = 0  # what this rank gives them: its input to each (a receive gives none)

    def add(self, collectives: int, sent: int, *, passes: int = 0) -> None:
        self.passes += passes
        self.collectives += collectives
        self.bytes += sent

    def snapshot(self) -> tuple[int, int]:
        return self.collectives, self.bytes

    def reset(self) -> None:
        self.passes = self.collectives = self.bytes = 0


_group: Any = None
traffic = Traffic()


def launched() -> bool:
    """Whether this process was started by mlx.launch (or mpirun) as one rank of several."""
    return any(name in os.environ for name in LAUNCH_VARIABLES)


def group() -> Any:
    """The distributed group of this run, or None when it runs alone."""
    global _group
    if _group is None and launched():
        joined = mx.distributed.init()
        _group = joined if joined.size() > 1 else False
        if _group:
            _count_collectives()
    return _group or None


def _count_collectives() -> None:
    """From now on every collective adds to `traffic`, whoever calls it (mlx's sharded linears, mlx-lm's MoE
    blocks and pipelines, akunu's kernels and `agree`): one round trip each, with the bytes this rank gives it."""
    for name in ("all_sum", "all_gather", "send", "recv", "recv_like"):
        collective = getattr(mx.distributed, name)
        gives = not name.startswith("recv")  # a receive waits for a message; it sends none

        def counted(x, *args, _collective=collective, _gives=gives, **kwargs):
            traffic.add(1, x.nbytes if _gives else 0)
            return _collective(x, *args, **kwargs)

        setattr(mx.distributed, name, counted)


def rank() -> int:
    return group().rank() if group() else 0


def size() -> int:
    return group().size() if group() else 1


def leads() -> bool:
    """Rank 0, or a run alone: the process that owns the terminal, the HTTP port and the files."""
    return rank() == 0


def agree(value: Any, *, wait: bool = False) -> Any:
    """Rank 0's `value` on every rank (JSON-able; the other ranks' own is ignored): two all-sums.
    `wait`: rank 0 may take its time (a user typing), so no watchdog for it."""
    if not group():
        return value
    payload = json.dumps(value).encode() if leads() else b""
    length = int(_all_sum(mx.array([len(payload)], mx.int32), float("inf") if wait else None).item())
    if not leads():
        payload = b"\0" * length
    data = _all_sum(mx.array(list(payload) or [0], mx.uint8))
    return json.loads(bytes(memoryview(data)[:length]).decode())


def _all_sum(array: mx.array, seconds: float | None = None) -> mx.array:
    with watchdog("agreeing across the ranks", seconds):
        summed = mx.distributed.all_sum(array, group=group(), stream=mx.cpu)
        mx.eval(summed)
    return summed


class RankCheckedDrafter:
    """A drafter whose every draft is compared across the ranks (--check-ranks): one all-gather per round."""

    def __init__(self, drafter: Any) -> None:
        self._drafter = drafter
        self.rounds = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._drafter, name)

    def draft(self, max_tokens: int):
        proposed = self._drafter.draft(max_tokens)
        row = [len(proposed.tokens), *proposed.tokens, *(proposed.parents or [])][:CHECK_WIDTH]
        row += [-1] * (CHECK_WIDTH - len(row))
        with watchdog("comparing drafts"):
            rows = mx.distributed.all_gather(mx.array([row], mx.int32), group=group(), stream=mx.cpu)
            mx.eval(rows)
        self.rounds += 1
        for other, seen in enumerate(rows.tolist()):
            if seen != row:
                raise RankError(
                    f"--check-ranks: in round {self.rounds} rank {other} drafted {_shown(seen)} but rank {rank()} "
                    f"drafted {_shown(row)}; the ranks' histories have diverged"
                )
        return proposed


def _shown(row: Sequence[int]) -> list[int]:
    return list(row[1 : 1 + row[0]])


def count_passes(model: Any) -> None:
    """Make `model` count its passes in `traffic` (its collectives count themselves), and start each pass with
    the stop agreement while `stop_when` asks for one."""
    if getattr(type(model), "_akunu_counted", False):
        return
    model_class = type(model)
    counted = type(model_class.__name__, (model_class,), {"_akunu_counted": True})

    def call(self, inputs, *args, **kwargs):
        go_on_or_stop()
        traffic.add(0, 0, passes=1)
        beat()  # a pass is built only once the one before it is done: the ranks are still answering
        return model_class.__call__(self, inputs, *args, **kwargs)

    counted.__call__ = call
    counted.__module__ = model_class.__module__  # the CPU backend finds the model's mlx-lm module by it
    model.__class__ = counted


_stop_asked: Callable[[], bool] | None = None


def stop_when(asked: Callable[[], bool] | None) -> None:
    """From now on (None: no longer) every pass starts with one all-sum of one int, in which the ranks learn
    whether rank 0's `asked()` says stop; then each raises Stopped there. Every rank must call this alike
    (a follower's `asked` is never called)."""
    global _stop_asked
    _stop_asked = asked


def interruptible(responses: Iterator[Any]) -> Iterator[Any]:
    """`responses`, where Ctrl-C on rank 0 only asks to stop: every rank then stops at the same pass, raising
    KeyboardInterrupt there (the followers ignore their own Ctrl-C, see `join`). On the main thread."""
    pressed = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda number, frame: pressed.set()) if leads() else None
    stop_when(pressed.is_set)
    try:
        yield from responses
    except Stopped:
        raise KeyboardInterrupt from None
    finally:
        stop_when(None)
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def go_on_or_stop() -> None:
    """Before a pass: Stopped on every rank if rank 0 asks to stop (see `stop_when`)."""
    if _stop_asked is None or not group():
        return
    stop = leads() and _stop_asked()
    if _all_sum(mx.array([int(stop)], mx.int32)).item():
        raise Stopped


_deadline: list[tuple[float, str]] = []
_watch_lock = threading.Lock()
_watching = False


class watchdog:
    """While inside, a collective that blocks longer than PASS_TIMEOUT ends the process with one line
    (a rank whose machine went away is not always noticed by the transport)."""

    def __init__(self, what: str, seconds: float | None = None) -> None:
        self.what, self.seconds = what, PASS_TIMEOUT if seconds is None else seconds

    def __enter__(self) -> watchdog:
        if group():
            _start_watching()
            with _watch_lock:
                _deadline.append((time.monotonic() + self.seconds, self.what))
        return self

    def __exit__(self, kind, error, trace) -> None:
        if group():
            with _watch_lock:
                if _deadline:
                    _deadline.pop()
        if lost_peer(error):
            raise RankError(lost_peer_line(self.what)) from None


def lost_peer(error: BaseException | None) -> bool:
    return isinstance(error, RuntimeError) and any(sign in str(error) for sign in ("[ring]", "[jaccl]", "[mpi]"))


def beat() -> None:
    """The ranks answered: the innermost watchdog's time starts again."""
    with _watch_lock:
        if _deadline:
            _deadline[-1] = (time.monotonic() + PASS_TIMEOUT, _deadline[-1][1])


def lost_peer_line(what: str) -> str:
    """The one line for a connection that broke: which rank it must have been, as far as this rank knows."""
    me, ranks = rank(), size()
    others = sorted({(me - 1) % ranks, (me + 1) % ranks} - {me})
    who = f"rank {others[0]}" if len(others) == 1 else f"rank {others[0]} or rank {others[1]}"
    return f"rank {me} lost its connection to {who} while {what}: that rank stopped or its network went away"


def _start_watching() -> None:
    global _watching
    if _watching:
        return
    _watching = True
    threading.Thread(target=_watch, name="akunu-rank-watchdog", daemon=True).start()


def _watch() -> None:
    while True:
        time.sleep(0.5)
        with _watch_lock:
            expired = _deadline and time.monotonic() > _deadline[-1][0]
            what = _deadline[-1][1] if _deadline else ""
        if expired:
            say(f"error: rank {rank()} had no answer from {_others()} for {PASS_TIMEOUT:.0f} s while {what}; ending")
            os._exit(1)


_say: Callable[[str], None] = lambda line: print(line, file=sys.__stderr__, flush=True)  # noqa: E731


def say(line: str) -> None:
    """One line on the terminal whatever the rank (followers' own output is silenced)."""
    _say(line)


def silence_followers() -> None:
    """Rank 0 alone writes to the terminal: the others' stdout and stderr go nowhere, bar `say`. The ring
    backend's own complaints on fd 2 go nowhere on every rank; a lost peer is reported by `lost_peer_line`."""
    global _say
    if not group():
        return
    kept = os.fdopen(os.dup(2), "w", buffering=1)
    _say = lambda line: print(line, file=kept, flush=True)  # noqa: E731
    nowhere = os.open(os.devnull, os.O_WRONLY)
    os.dup2(nowhere, 2)
    if leads():
        sys.stderr = kept
        return
    os.dup2(nowhere, 1)
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    sys.stderr = _ErrorLines(kept, rank())


class _ErrorLines:
    """A follower's stderr: its `error:` lines reach the terminal, naming the rank; the rest goes nowhere."""

    def __init__(self, out: Any, number: int) -> None:
        self.out, self.number, self.pending = out, number, ""

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if line.lstrip().startswith("error:"):
                self.out.write(f"rank {self.number}: {line.strip()}\n")
        return len(text)

    def flush(self) -> None:
        self.out.flush()

    def isatty(self) -> bool:
        return False


def join(*, check_ranks: bool = False) -> None:
    """Join the launch's group if there is one: silence the followers, seed every rank alike, note the options."""
    global checking_ranks
    if group() is None or _joined:
        return
    _mark_joined()
    silence_followers()
    _exit_when_ended()
    if not leads():  # rank 0 decides when to stop: a Ctrl-C that reaches every local rank must not split them
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    mx.random.seed(agree(int.from_bytes(os.urandom(4), "little") if leads() else None))
    checking_ranks = check_ranks


checking_ranks = False
_joined = False


def _mark_joined() -> None:
    global _joined
    _joined = True


def _exit_when_ended() -> None:
    """mlx.launch ends the other ranks (SIGTERM) when one stops. The main thread may then be blocked in a
    collective, where no Python handler runs, so the signal is read from Python's wakeup pipe by a thread."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end)
    signal.signal(signal.SIGTERM, lambda number, frame: None)
    threading.Thread(target=_ended_by_launcher, args=(read_end,), name="akunu-rank-end", daemon=True).start()


_ending: tuple[Callable[[], None], float] | None = None


def end_gracefully(begin: Callable[[], None], within: float) -> None:
    """On SIGTERM (a user's `kill`, or mlx.launch's once another rank ended), call `begin()` to end the work in
    order (a server telling the other ranks to stop) instead of ending at once; the process ends within `within` s."""
    global _ending
    _ending = (begin, within)


def _ended_by_launcher(read_end: int) -> None:
    while os.read(read_end, 1) != bytes([signal.SIGTERM]):
        pass
    if _ending is not None:
        begin, within = _ending
        begin()
        time.sleep(within)  # the main thread ends the process before this, unless a rank is gone
    say(f"error: {_others()} stopped or lost its connection, so mlx.launch ended rank {rank()}")
    os._exit(1)


def _others() -> str:
    """The other rank by number where there is one other, as a line naming who failed can."""
    others = [other for other in range(size()) if other != rank()]
    return f"rank {others[0]}" if len(others) == 1 else "another rank (mlx.launch names it)"


def drafter_for(drafter: Any, config: Any) -> Any:
    """The drafter a distributed generation uses: the engine's default made here when None, so that
    --check-ranks can compare its drafts."""
    if not checking_ranks or not config.spec.enabled:
        return drafter
    if drafter is None:
        from akunu.drafters import DEFAULT_SPEC, make_drafter

        drafter = make_drafter(DEFAULT_SPEC, ngram_order=config.spec.ngram_order, window=config.spec.window)
    return RankCheckedDrafter(drafter)


def guarded(responses: Iterator[Any]) -> Iterator[Any]:
    """A generation's responses, with a watchdog over its passes and a lost rank as one RankError."""
    with watchdog("generating"):
        yield from responses


def leader_reads(read: Callable[[str], str]) -> Callable[[str], str]:
    """`read` on rank 0 (a line the user typed); every rank gets its line, end of input or Ctrl-C."""

    def agreed(prompt: str) -> str:
        message = None
        if leads():
            try:
                message = {"line": read(prompt)}
            except EOFError:
                message = {"end": True}
            except KeyboardInterrupt:
                message = {"interrupt": True}
        message = agree(message, wait=True)
        if "end" in message:
            raise EOFError
        if "interrupt" in message:
            raise KeyboardInterrupt
        return message["line"]

    return agreed


def shared_cost_curves(model: Any, key: str, directory: Path, max_width: int, contexts: Sequence[int], progress=None):
    """The pass costs of this split model: rank 0's saved ones, or measured now by every rank together (each
    timed pass is collective) with rank 0's timings kept. Saved apart from the one-process curves."""
    from akunu import cost_curve

    key = f"{key}-{size()}ranks"
    seconds = agree(_saved_seconds(cost_curve, key, directory, max_width, contexts) if leads() else None)
    if seconds is None:
        measured = cost_curve.measure_curves(
            model, max_width, cost_curve.QUICK_SWEEPS, contexts, widths=cost_curve.QUICK_WIDTHS, progress=progress
        )
        seconds = agree({str(c): s for c, s in measured.seconds.items()} if leads() else None)
    curves = cost_curve.CostCurves({int(c): s for c, s in seconds.items()})
    if leads():
        with contextlib.suppress(OSError):
            cost_curve.save(key, curves, directory)
    return curves


def _saved_seconds(cost_curve: Any, key: str, directory: Path, max_width: int, contexts: Sequence[int]):
    try:
        saved = cost_curve.read_curves(cost_curve.curve_path(key, directory)).seconds
        chosen = {str(c): saved[c] for c in contexts}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return chosen if all(len(curve) >= max_width for curve in chosen.values()) else None
