"""On a bus: a shadow router's decisions land under ei.<p>.shadow.<name>.> and the router in
charge decides exactly as it does with no shadow running."""

from __future__ import annotations

import msgspec

from events.catalog import RouteDecided
from services.adapters.bus import InMemoryBus
from services.cores.router.cache_aware import CacheAwareRouter
from services.cores.router.least_ttft import LeastTtftRouter
from services.drivers.bench import scenario as s


def inputs():
    evs = s.register(3, 2) + [s.branch("hot", 0.0)] + s.store("p00", s.blocks(1, 100), 0.5)
    evs += [s.submit(f"r{i}", "hot", s.blocks(1, 100) + s.blocks(1_000 * (i + 1), 5), 1.0 + i * 0.01)
            for i in range(5)]
    return evs


async def drive(bus, routers):
    """Publish the inputs, then fold the stream in order into every router; each router's
    outputs go back to the stream (a shadow's under its shadow subject)."""
    for ev in inputs():
        await bus.publish(ev)
    seen = 0
    async with bus.consumer(None, start_seq=1) as c:
        async for d in c:
            seen = d.seq
            for r in routers:
                for o in r.apply(d.event):
                    await bus.publish(o, shadow=r.name if r.shadow else None)
            if seen == await bus.last_seq():
                break
    subjects = [subj for subj, _, _ in bus._log]
    return subjects


async def test_shadow_decisions_land_on_shadow_subject_and_change_nothing():
    alone_bus, both_bus = InMemoryBus(), InMemoryBus()
    alone = LeastTtftRouter()
    await drive(alone_bus, [alone])
    acting, shadow = LeastTtftRouter(), CacheAwareRouter(name="ca", shadow=True)
    subjects = await drive(both_bus, [acting, shadow])
    shadow_subjects = [x for x in subjects if ".shadow." in x]
    assert shadow_subjects == ["ei.default.shadow.ca.routedecided"] * 5
    assert subjects.count("ei.default.route") == 5
    # the stream outside the shadow subjects is byte-equal to the run without a shadow
    own = [(subj, data) for subj, data, _ in both_bus._log if ".shadow." not in subj]
    assert own == [(subj, data) for subj, data, _ in alone_bus._log]
    assert acting.snapshot() == alone.snapshot()
    decided = [msgspec.msgpack.decode(d, type=RouteDecided) for subj, d, _ in both_bus._log
               if subj == "ei.default.shadow.ca.routedecided"]
    assert all(d.shadow and d.policy == "ca" for d in decided)
