"""The in-process engine's continuous batching: ``generate`` calls from several threads share one decode batch,
rows joining it at the next token (``rollout.inflight_requests`` with ``rollout.engine: hf``; HFEngine's docstring,
"Continuous batching"). Tiny random model, float32; EOS never ends a row (``stop_token_ids=[]``), so lengths are
the requests' own."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from aepo_core.interfaces import GenerationRequest, GenerationResult, SamplingParams
from infra.engines.hf import HFEngine

HOT = SamplingParams(temperature=0.7)


class Passes:
    """The batch size of every forward the model runs, and an event set once ``after`` forwards have run. Each forward
    waits 10 ms first: the tiny model's own (~1 ms) would let a row end before another thread gets to join it."""

    def __init__(self, model: torch.nn.Module, after: int = 0) -> None:
        self.sizes: list[int] = []
        self.widths: list[int] = []  # the attention mask's width: cache + new columns
        self.reached = threading.Event()
        self._after = after
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, _module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.sizes.append(int(ids.shape[0]))
        self.widths.append(int(kwargs["attention_mask"].shape[1]))
        time.sleep(0.01)
        if len(self.sizes) >= self._after:
            self.reached.set()

    def remove(self) -> None:
        self._handle.remove()


@pytest.fixture
def passes(tiny_policy: tuple[Any, Any]) -> Iterator[Callable[[int], Passes]]:
    made: list[Passes] = []

    def make(after: int = 0) -> Passes:
        made.append(Passes(tiny_policy[0], after))
        return made[-1]

    yield make
    for p in made:
        p.remove()


def _engine(tiny_policy: tuple[Any, Any], **kwargs: Any) -> HFEngine:
    model, tok = tiny_policy
    return HFEngine(model, tok, seed=0, stop_token_ids=[], **kwargs)


def _prompt(engine: HFEngine, i: int) -> list[int]:
    texts = ["What is the capital of France?", "Once upon a time", "Search for the tallest building.", "x",
             "Which river is longest?", "Compute 2 + 2 with Python."]
    return engine.apply_chat_template(texts[i % len(texts)]) if i % 2 else engine.encode(texts[i % len(texts)])


def _same(a: GenerationResult, b: GenerationResult) -> None:
    assert a.token_ids == b.token_ids
    assert a.finish_reason == b.finish_reason
    assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
    assert torch.allclose(torch.tensor(a.entropies), torch.tensor(b.entropies), atol=1e-4)


@pytest.mark.parametrize("kv_reuse_mb", [0, 64], ids=["prefill", "kv reuse"])
def test_a_call_joins_the_batch_being_decoded_and_returns_before_it_ends(tiny_policy, passes, kv_reuse_mb) -> None:
    """A long row is decoding; a short request from another thread joins its batch at the next token (a forward of 2
    rows), finishes and returns while the long row goes on. Both rows sample what they sample alone on an engine
    without reuse; with reuse the short row continues an earlier segment, prefills only what is new and joins a batch
    of another cache width. Before continuous batching the second call ran a batch of its own beside the first
    (every forward 1 row)."""
    engine, plain = _engine(tiny_policy, kv_reuse_mb=kv_reuse_mb), _engine(tiny_policy)
    base = _prompt(engine, 1)
    (first,) = engine.generate([GenerationRequest(base, 7, seed=5)], HOT)  # with reuse, its KV is kept
    long_req = GenerationRequest(_prompt(engine, 0), 60, seed=11)
    short_req = GenerationRequest(base + first.token_ids + engine.encode(" then"), 5, seed=12)
    (long_alone,) = plain.generate([long_req], HOT)
    (short_alone,) = plain.generate([short_req], HOT)

    seen = passes(after=10)
    finished: list[str] = []
    results: dict[str, GenerationResult] = {}

    def call(name: str, req: GenerationRequest) -> None:
        (results[name],) = engine.generate([req], HOT)
        finished.append(name)

    long_thread = threading.Thread(target=call, args=("long", long_req))
    long_thread.start()
    assert seen.reached.wait(60)  # the long row is 10 tokens in
    call("short", short_req)
    short_stats = engine.last_stats
    long_thread.join(60)
    assert finished == ["short", "long"]
    assert max(seen.sizes) == 2  # they were decoded together
    assert len(seen.sizes) < 60 + 5  # fewer forwards than the two alone: the short row's steps were shared
    assert (short_stats.reused_tokens > 0) == bool(kv_reuse_mb)
    _same(results["long"], long_alone)
    _same(results["short"], short_alone)


def test_many_callers_share_a_capped_batch_and_each_gets_what_it_samples_alone(tiny_policy, passes) -> None:
    """Eight threads, one request each (lengths 3–24, prompts of different lengths, a stop string on some), under
    ``max_batch_size`` 3: no forward holds more than 3 rows, some hold more than 1, and every result is the one the
    request gets alone."""
    engine = _engine(tiny_policy, max_batch_size=3)
    requests = [GenerationRequest(_prompt(engine, i), 3 + 3 * i, stop=("e",) if i % 3 == 0 else (), seed=40 + i)
                for i in range(8)]
    alone = [engine.generate([req], HOT)[0] for req in requests]
    seen = passes()
    start = threading.Barrier(len(requests))
    results: list[GenerationResult | None] = [None] * len(requests)

    def call(i: int) -> None:
        start.wait()
        (results[i],) = engine.generate([requests[i]], HOT)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert 1 < max(seen.sizes) <= 3
    for got, want in zip(results, alone, strict=True):
        assert got is not None
        _same(got, want)


def test_rows_sampled_otherwise_wait_for_the_batch_and_a_failing_forward_spares_the_others(
        tiny_policy, passes) -> None:
    """A request with another temperature does not join a running batch (one batch samples one way): it runs after,
    alone. And when a shared forward fails, the unfinished rows run again one by one: the healthy row still gets
    what it samples alone."""
    engine = _engine(tiny_policy)
    hot, cold = GenerationRequest(_prompt(engine, 0), 30, seed=1), GenerationRequest(_prompt(engine, 1), 4, seed=2)
    (hot_alone,) = engine.generate([hot], HOT)
    (cold_alone,) = engine.generate([cold], SamplingParams(temperature=0.2))
    seen = passes(after=5)
    results: dict[str, GenerationResult] = {}
    thread = threading.Thread(target=lambda: results.update(hot=engine.generate([hot], HOT)[0]))
    thread.start()
    assert seen.reached.wait(60)
    (results["cold"],) = engine.generate([cold], SamplingParams(temperature=0.2))
    thread.join(60)
    assert max(seen.sizes) == 1
    _same(results["hot"], hot_alone)
    _same(results["cold"], cold_alone)

    other = GenerationRequest(_prompt(engine, 2), 6, seed=3)
    (other_alone,) = engine.generate([other], HOT)
    model = tiny_policy[0]
    original = model.forward

    def fail_batched(*args: Any, **kwargs: Any) -> Any:
        if kwargs["input_ids"].shape[0] > 1:
            raise RuntimeError("a forward of several rows fails")
        return original(*args, **kwargs)

    model.forward = fail_batched
    try:
        got = engine.generate([hot, other], HOT)
    finally:
        del model.forward
    _same(got[0], hot_alone)
    _same(got[1], other_alone)


def test_a_batch_sheds_the_columns_of_rows_that_left(tiny_policy, passes) -> None:
    """A long prompt and a short one in one batch: once the long row has finished, the short row's forwards attend
    over its own columns only (the cache is trimmed to the columns a remaining row uses), so a batch that rows keep
    joining does not stay as wide as its whole life. The short row's samples do not change."""
    engine = _engine(tiny_policy)
    long_prompt = _prompt(engine, 1) * 8
    short = GenerationRequest(engine.encode("x"), 20, seed=8)
    (alone,) = engine.generate([short], HOT)
    seen = passes()
    _, got = engine.generate([GenerationRequest(long_prompt, 3, seed=7), short], HOT)
    assert seen.widths[0] == len(long_prompt)  # the prefill: left padding to the longest prompt
    assert seen.widths[-1] == len(short.prompt_ids) + 19  # the last feed: the short row's prompt and 19 tokens
    _same(got, alone)
