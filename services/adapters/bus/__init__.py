"""The bus: the port and its two backends, side by side (docs/bus.md).

- :mod:`.port` - the port: the ``Bus`` and ``Consumer`` protocols every service is typed
  against, ``Delivery``, ``DeadLetter``, ``StreamInfo``, plain-subject ``Message`` s (``listen`` /
  ``request``), the header names (``MSG_ID``, ``DLQ_*``),
  ``subject_matches`` and the decode-or-dead-letter helper both backends share;
- :mod:`.memory` - ``InMemoryBus``, the in-process twin (unit tests, the simulator);
- :mod:`.nats_bus` - ``NatsBus`` and ``StreamSettings``, the bus on NATS JetStream;
- :mod:`.natsserver` - ``EmbeddedNats`` / ``NatsCluster``: the real ``nats-server`` started locally;
- :mod:`.security` - accounts, permissions and credentials of a secured bus;
- :mod:`.prompts` / :mod:`.nats_prompts` - the prompt store: a prompt's token ids by request id,
  gateway -> engine (port, codec and ``InMemoryPromptStore``; ``NatsPromptStore``, a KV bucket);
- :mod:`.tokens` - the token channel from engines to the gateway on core NATS (``NatsTokens``) and
  its in-process twin (``MemoryTokens``).

Both backends pass the same contract tests (``tests/contract/test_bus.py``).

``NatsBus`` and ``StreamSettings`` are resolved on first use (PEP 562): importing the port, the
twin or ``security`` (every CLI's ``--help`` does) then does not load nats-py and aiohttp,
~300 ms measured on the 2-core machine (``evolving --help``: 0.5 s without, 0.8 s with).

Layer 2 (adapter: NATS). May import: ``events``, ``services.adapters.logging``, nats-py.
"""

from services.adapters.bus.memory import InMemoryBus
from services.adapters.bus.port import (
    DLQ_CONSUMER,
    DLQ_REASON,
    DLQ_SEQ,
    DLQ_SUBJECT,
    MSG_ID,
    Bus,
    Connection,
    Consumer,
    ConsumerState,
    DeadLetter,
    Delivery,
    Handler,
    Listener,
    Message,
    NoResponder,
    StreamInfo,
    decode_or_reason,
    subject_matches,
)

__all__ = [
    "DLQ_CONSUMER",
    "DLQ_REASON",
    "DLQ_SEQ",
    "DLQ_SUBJECT",
    "MSG_ID",
    "Bus",
    "Connection",
    "Consumer",
    "ConsumerState",
    "DeadLetter",
    "Delivery",
    "Handler",
    "InMemoryBus",
    "Listener",
    "Message",
    "NatsBus",
    "NoResponder",
    "StreamInfo",
    "StreamSettings",
    "decode_or_reason",
    "subject_matches",
]


def __getattr__(name: str):
    if name in ("NatsBus", "StreamSettings"):
        from services.adapters.bus import nats_bus  # lazy: start-up, nats-py + aiohttp ~300 ms (docstring)

        return getattr(nats_bus, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
