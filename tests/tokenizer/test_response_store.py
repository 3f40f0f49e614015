"""The Responses API's store on its own: bounded in count (oldest out first) and in age, with a fake clock."""

from __future__ import annotations

from services.tokenizer.openai.responses_api.store import ResponseStore, StoredResponse


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def entry(n: int) -> StoredResponse:
    return StoredResponse({"id": f"resp_{n}"}, [{"type": "message", "role": "user", "content": str(n)}])


def test_past_the_count_the_oldest_goes_first():
    store = ResponseStore(max_entries=3, max_age=60, clock=Clock())
    for n in range(5):
        assert store.put(f"resp_{n}", entry(n))
    assert [store.get(f"resp_{n}") is not None for n in range(5)] == [False, False, True, True, True]
    assert len(store) == 3
    assert store.delete("resp_3") and not store.delete("resp_3") and store.get("resp_3") is None
    store.put("resp_5", entry(5))
    assert len(store) == 3 and store.get("resp_2").response == {"id": "resp_2"}


def test_an_entry_older_than_the_age_is_gone():
    clock = Clock()
    store = ResponseStore(max_entries=10, max_age=30, clock=clock)
    store.put("resp_a", entry(1))
    clock.now += 20
    store.put("resp_b", entry(2))
    clock.now += 10  # resp_a is exactly 30 s old: still kept
    assert store.get("resp_a") is not None
    clock.now += 0.5
    assert store.get("resp_a") is None and store.get("resp_b") is not None
    clock.now += 20
    assert store.get("resp_b") is None and len(store) == 0


def test_a_store_of_no_entries_keeps_nothing():
    store = ResponseStore(max_entries=0, max_age=30, clock=Clock())
    assert not store.enabled and not store.put("resp_a", entry(1)) and store.get("resp_a") is None
