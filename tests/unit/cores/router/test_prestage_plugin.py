"""``+prestage`` on a router's plug-in name (services/adapters/plugins.py ``PARTS``): the live
router service (``evolving up --router evolving+prestage``) runs the prestaging variant, records
the canonical name in its run_config entry, and ``evolving verify`` rebuilds the same class from
it; a router without a variant, or an unknown part, is refused by name."""

from __future__ import annotations

import pytest

from services.adapters.plugins import ROUTER_GROUP, PluginNotFound, canonical, load_router
from services.adapters.recipes import CORES
from services.cores.router.cache_aware import CacheAwareRouter
from services.cores.router.least_ttft import LeastTtftRouter
from services.cores.router.prestage import PrestageCacheAwareRouter, PrestageLeastTtftRouter, with_prestage
from services.drivers.services import SERVICES
from tests.unit.cores.router.test_prestage import feed, orders, turn


def test_the_part_names_the_prestaging_variant_and_it_orders():
    assert load_router("evolving+prestage") is PrestageLeastTtftRouter
    assert load_router("least_ttft+prestage") is PrestageLeastTtftRouter
    assert load_router("cache_aware+prestage") is PrestageCacheAwareRouter
    assert load_router("evolving") is LeastTtftRouter and load_router("cache_aware") is CacheAwareRouter
    (o,) = orders(feed(load_router("evolving+prestage")(), turn()))
    assert (o.src_node, o.dst_node) == ("d00", "p00")
    assert with_prestage(PrestageLeastTtftRouter) is PrestageLeastTtftRouter


def test_the_service_records_the_canonical_name_and_verify_rebuilds_it():
    assert canonical(ROUTER_GROUP, "least_ttft+prestage") == "evolving+prestage"
    conf = SERVICES["router"].configure({"router": "least_ttft+prestage", "router_arg": [], "shadow": None})
    assert conf.entry == {"plugin": "evolving+prestage", "kwargs": {}}
    router = CORES["router"].build(conf.entry)
    assert type(router) is PrestageLeastTtftRouter and router.name == "evolving"


@pytest.mark.parametrize(("name", "why"), [("sticky+prestage", "no prestaging variant"),
                                           ("evolving+nope", "no part 'nope'"),
                                           ("nope+prestage", "no evolving.routers plug-in named 'nope'")])
def test_names_without_a_variant_are_refused(name, why):
    with pytest.raises(PluginNotFound, match=why):
        load_router(name)
