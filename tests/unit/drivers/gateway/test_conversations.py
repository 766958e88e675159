"""Sessions without headers: the hash chain over a conversation's messages and
the bounded index of prefixes -> branches (pure, exact; a hypothesis property for the rule)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.drivers.gateway.conversations import ConversationIndex, chain, link, message_key
from tests.hyp import examples

SYS = {"role": "system", "content": "You are a coding agent."}
U1 = {"role": "user", "content": "fix the bug"}
A1 = {"role": "assistant", "content": "Looking at it."}
U2 = {"role": "user", "content": "and the test"}


def test_the_chain_names_each_prefix():
    hs = chain([SYS, U1, A1])
    assert len(hs) == 3 and len(set(hs)) == 3 and all(len(h) == 16 for h in hs)
    assert chain([SYS, U1]) == hs[:2]  # a prefix's chain is the chain's prefix
    assert link(hs[1], A1) == hs[2]
    assert chain([U1, SYS])[1] != hs[1]  # order matters


def test_the_same_message_from_either_api_hashes_the_same():
    """OpenAI's string content and Anthropic's text blocks (after anthropic_api.chat_messages),
    with cache_control and surrounding whitespace, are one message."""
    openai = {"role": "assistant", "content": "tok tok "}
    anthropic = {"role": "assistant", "content": [{"type": "text", "text": "tok tok", "cache_control": {"type": "x"}}]}
    assert message_key(openai) == message_key(anthropic)
    assert message_key({"role": "user", "content": "tok tok"}) != message_key({**openai})  # the role counts
    calls = {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    assert message_key(calls) != message_key({**calls, "tool_calls": []})
    assert message_key({"role": "tool", "tool_call_id": "c1", "content": "ok"}) != \
        message_key({"role": "tool", "tool_call_id": "c2", "content": "ok"})


def test_a_request_continues_the_longest_remembered_proper_prefix():
    idx = ConversationIndex(ttl_s=100)
    first = chain([SYS, U1])
    assert idx.find(first, 0.0) is None
    idx.remember(first[-1], "b1", 0.0)  # admitted: its own messages
    idx.remember(link(first[-1], A1), "b1", 1.0)  # answered: plus the reply
    # the next turn sends the reply back and a new message: the reply's prefix (k = 3) matches
    assert idx.find(chain([SYS, U1, A1, U2]), 2.0) == ("b1", 3)
    # a client that rewrote the reply still continues by the request's own prefix (k = 2)
    assert idx.find(chain([SYS, U1, {"role": "assistant", "content": "other"}, U2]), 2.0) == ("b1", 2)
    # the same list again is not a continuation (two identical first requests: two conversations)
    assert idx.find(first, 2.0) is None
    # another conversation, and one that only shares the system prompt, are not either
    assert idx.find(chain([SYS, U2, A1, U1]), 2.0) is None


def test_the_newest_sender_of_a_prefix_wins_and_closed_branches_are_skipped():
    idx = ConversationIndex(ttl_s=None)
    h = chain([U1])
    idx.remember(h[-1], "old", 0.0)
    idx.remember(h[-1], "new", 1.0)
    nxt = chain([U1, A1, U2])
    assert idx.find(nxt, 2.0) == ("new", 1)
    assert idx.find(nxt, 2.0, is_open=lambda b: b != "new") is None  # the branch ended or expired


def test_entries_expire_after_the_ttl_from_their_last_use():
    idx = ConversationIndex(ttl_s=10)
    idx.remember(chain([U1])[-1], "b", 0.0)
    assert idx.find(chain([U1, A1]), 9.0) == ("b", 1)  # a use refreshes the entry ...
    assert idx.find(chain([U1, A1]), 19.0) == ("b", 1)  # ... so it lives 10 s from there
    assert idx.expire(29.5) == 1 and len(idx) == 0
    assert idx.find(chain([U1, A1]), 29.5) is None


def test_the_index_is_bounded_least_recently_used_first():
    idx = ConversationIndex(ttl_s=None, max_entries=3)
    hs = [chain([{"role": "user", "content": str(i)}])[-1] for i in range(4)]
    for i, h in enumerate(hs[:3]):
        idx.remember(h, f"b{i}", float(i))
    assert idx.find([hs[0], link(hs[0], A1)], 3.0) == ("b0", 1)  # b0 used: b1 is now the oldest
    idx.remember(hs[3], "b3", 4.0)
    assert len(idx) == 3
    assert idx.find([hs[1], link(hs[1], A1)], 5.0) is None
    assert idx.find([hs[0], link(hs[0], A1)], 5.0) == ("b0", 1)


texts = st.lists(st.text(alphabet="ab ", min_size=1, max_size=3), min_size=1, max_size=6)


@settings(max_examples=examples(200), deadline=None)
@given(texts, texts)
def test_a_conversation_continues_exactly_when_it_extends_a_remembered_request(first, second):
    """Property: after a request R, a request S continues R's branch iff R's messages are a
    proper prefix of S's (by the messages' keys)."""
    r = [{"role": "user", "content": t} for t in first]
    s = [{"role": "user", "content": t} for t in second]
    idx = ConversationIndex(ttl_s=None)
    idx.remember(chain(r)[-1], "R", 0.0)
    keys = lambda ms: [message_key(m) for m in ms]
    extends = len(s) > len(r) and keys(s[: len(r)]) == keys(r)
    assert (idx.find(chain(s), 1.0) is not None) == extends
