"""`akunu serve` split across the ranks of `mlx.launch`: rank 0 serves HTTP, the other ranks follow it.

Rank 0's worker runs one job at a time and, before each, sends the job's generation inputs to the others
(`distributed.agree`); every rank then runs the same `runtime.stream`, so the sharded passes' all-sums
pair up. A job stops early only at a pass all ranks agree on (`distributed.stop_when`), and at shutdown
rank 0 sends "no more jobs". Each rank's prompt-cache pool sees the same jobs, so it picks the same slots.
"""

from __future__ import annotations

import dataclasses
import os
import threading

from akunu import distributed
from akunu.cli.server.worker import Job, PromptCachePool
from akunu.drafters.specs import DraftLengthPolicy
from akunu.errors import AkunuError
from akunu.generate import GenerationConfig, SpecConfig
from akunu.sampling import SamplingParams


def job_message(job: Job) -> dict:
    """What a follower needs to run the job's generation as rank 0 does (the grammar goes as its text)."""
    return {"prompt_ids": list(job.prompt_ids), "config": dataclasses.asdict(job.config)}


def job_from(message: dict) -> Job:
    """The job a follower runs for rank 0's message: its output goes nowhere."""
    fields = dict(message["config"])
    spec = {**fields["spec"], "draft_length": DraftLengthPolicy(fields["spec"]["draft_length"])}
    fields.update(sampling=SamplingParams(**fields["sampling"]), spec=SpecConfig(**spec), stop=tuple(fields["stop"]))
    return Job(list(message["prompt_ids"]), GenerationConfig(**fields), emit=lambda event: None)


def seeded(config: GenerationConfig) -> GenerationConfig:
    """The config with a seed every rank draws from: the request's, or one rank 0 picks now."""
    if config.sampling.seed is not None:
        return config
    seed = int.from_bytes(os.urandom(4), "little") >> 1
    return dataclasses.replace(config, sampling=dataclasses.replace(config.sampling, seed=seed))


class Lead:
    """Rank 0's side: each job is sent to the followers before it runs, and stops only where they stop too."""

    def __init__(self) -> None:
        self.stopping = threading.Event()  # the server is shutting down: the running job stops at its next pass

    def start(self, job: Job) -> Job:
        """Send the job to the followers; the job as this rank runs it, which its client's leaving never stops
        between two passes (only the pass agreement does, on every rank at once)."""
        shared = dataclasses.replace(job, config=seeded(job.config), cancelled=threading.Event())
        try:
            distributed.agree(job_message(shared))
        except distributed.RankError as error:
            self.lost(error)
        distributed.stop_when(lambda: job.cancelled.is_set() or self.stopping.is_set())
        return shared

    def dismiss(self) -> None:
        """Tell the followers there are no more jobs (they wait for the next one with no time limit)."""
        distributed.stop_when(None)
        try:
            distributed.agree(None)
        except distributed.RankError as error:
            self.lost(error)

    @staticmethod
    def lost(error: distributed.RankError) -> None:
        """A rank is gone: no pass can run any more, so the server ends with the one line naming it."""
        distributed.say(f"error: {error}")
        os._exit(1)


def follow(startup, run, cache_slots: int) -> None:
    """A follower's life: load as rank 0's worker does (the same collectives, in the same order), then run
    each job rank 0 sends, its output discarded, until rank 0 sends None."""
    from akunu.prompt_cache import kv_bytes_per_position

    loaded, costs = startup()
    pool = PromptCachePool(loaded.model, cache_slots)
    kv_bytes_per_position(loaded.model)  # rank 0's worker measures it with a pass
    while (message := distributed.agree(None, wait=True)) is not None:
        job = job_from(message)
        cache = pool.checkout(job.prompt_ids)
        distributed.stop_when(lambda: False)
        _run_one(run, loaded, job, cache, costs)


def _run_one(run, loaded, job: Job, cache, costs) -> None:
    try:
        for _ in run(loaded, job, cache, costs):
            pass
    except distributed.Stopped:  # rank 0's client left, at this same pass
        pass
    except distributed.RankError:
        raise
    except AkunuError:  # the request's fault: rank 0 answers its client with it
        pass
    except Exception:  # noqa: BLE001  (rank 0 fails the same way and resets the same cache)
        cache.reset()
