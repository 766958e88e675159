"""NatsPromptStore.put tries again while the bucket has no responder (its leader being elected: a
fresh R3 bucket, a lost server; the compose stack's first request and the one after a NATS
container was killed were 503s) and gives up after ``retry_for_s`` with the error."""

from __future__ import annotations

import pytest
from nats.js.errors import NoStreamResponseError

from services.adapters.bus.nats_prompts import NatsPromptStore
from services.adapters.bus.prompts import encode_tokens, prompt_key


class FlakyJetStream:
    """Answers ``publish`` with no responder ``failures`` times, then acks."""

    def __init__(self, failures: int) -> None:
        self.failures, self.published = failures, []

    async def publish(self, subject, payload, timeout=None):
        if self.failures:
            self.failures -= 1
            raise NoStreamResponseError()
        self.published.append((subject, payload))


class FakeNats:
    max_payload = 1024 * 1024

    def __init__(self, js) -> None:
        self.js = js

    def jetstream(self):
        return self.js


def _store(failures: int, retry_for_s: float) -> tuple[NatsPromptStore, FlakyJetStream]:
    js = FlakyJetStream(failures)
    store = NatsPromptStore(FakeNats(js), "default", replicas=3)
    store._ready = True  # the bucket exists: put alone is under test
    store.retry_for_s = retry_for_s
    return store, js


async def test_a_put_waits_out_a_leader_election():
    store, js = _store(failures=3, retry_for_s=10.0)
    n = await store.put("r1", [1, 2, 3])
    assert js.published == [(store.prefix + prompt_key("r1"), encode_tokens([1, 2, 3]))] and n == len(js.published[0][1])


async def test_a_bucket_that_never_answers_fails_the_put():
    store, js = _store(failures=10**6, retry_for_s=0.3)
    with pytest.raises(NoStreamResponseError):
        await store.put("r1", [1, 2, 3])
    assert js.published == []


async def test_warm_waits_until_the_bucket_takes_a_write():
    """The gateway warms its stores before it listens (compose torch: the first chat's put on a
    bucket just created timed out past its own retry at load ~10, a 503)."""
    store, js = _store(failures=4, retry_for_s=0.0)  # a request's own retry would give up at once
    took = await store.warm(10.0)
    assert took >= 0.0 and len(js.published) == 1 and js.published[0][0] == store.prefix + prompt_key(":warm")


async def test_warm_gives_up_with_the_cause_after_its_bound():
    store, js = _store(failures=10**6, retry_for_s=10.0)
    with pytest.raises(NoStreamResponseError):
        await store.warm(0.3)
    assert js.published == []


async def test_the_twin_is_warm_at_once():
    from services.adapters.bus.prompts import InMemoryPromptStore, PromptStore

    s = InMemoryPromptStore()
    assert isinstance(s, PromptStore) and await s.warm(1.0) == 0.0
