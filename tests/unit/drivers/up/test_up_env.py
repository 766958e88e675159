"""``evolving up``'s pure helpers: the children's import path, the start line's fields, the
one-line reason a child gave for not loading its plug-in."""

from __future__ import annotations

import json
import os
import sys

from services.drivers.up.children import REPO, child_env
from services.drivers.up.launch import plugin_failure, start_fields


def test_children_inherit_the_parents_import_path_after_the_repo(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    site = os.path.join(sys.prefix, "lib", "site-packages")
    env = child_env({"PYTHONPATH": os.pathsep.join(["plugins", "/opt/x", ""]), "HOME": "/h"},
                    path=[str(tmp_path), site, "/opt/x", "/opt/y"])
    entries = env["PYTHONPATH"].split(os.pathsep)
    assert entries == [str(REPO), str(tmp_path), "/opt/x", "/opt/y", str(tmp_path / "plugins")]
    assert env["HOME"] == "/h" and env["EI_LOG_FORMAT"] == "json"  # the rest of the environment is kept


def test_children_env_defaults_to_this_process(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "mine"))
    entries = child_env()["PYTHONPATH"].split(os.pathsep)
    assert entries[0] == str(REPO) and str(tmp_path / "mine") in entries
    assert not any(e.startswith(os.path.join(sys.prefix, "")) for e in entries)


def test_start_fields_name_the_gateway_and_every_metrics_port():
    urls = {"nats": "nats://127.0.0.1:4222", "db": "/r/run.duckdb", "logs": "/r/logs",
            "metrics": {"recorder": "http://127.0.0.1:9100/metrics", "router": "http://127.0.0.1:9103/metrics"},
            "gateway": "http://127.0.0.1:8000"}
    f = start_fields(urls)
    assert f["gateway"] == "http://127.0.0.1:8000" and f["metrics"] == "recorder:9100,router:9103"
    assert f["nats"] == "nats://127.0.0.1:4222" and f["db"] == "/r/run.duckdb"
    assert start_fields({"nats": "n", "metrics": {}}) == {"gateway": "-", "metrics": "off", "nats": "n"}


def test_plugin_failure_reads_the_childs_reason(tmp_path):
    log = tmp_path / "shadow.log"
    log.write_text(json.dumps({"event": "service_starting"}) + "\n"
                   + json.dumps({"event": "plugin_load_failed", "error": "cannot load router plug-in 'x': "
                                 "ImportError: no libfoo"}) + "\n"
                   + "evolving serve router: cannot load router plug-in 'x': ImportError: no libfoo\n")
    assert plugin_failure(log) == "cannot load router plug-in 'x': ImportError: no libfoo"
    log.write_text("Traceback (most recent call last):\nKeyError: 'boom'\n\n")
    assert plugin_failure(log) == "KeyError: 'boom'"
    assert plugin_failure(tmp_path / "missing.log") == "no log"
