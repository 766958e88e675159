"""API keys (file/env), the gateway's command line (host default, limits), and its metrics registry."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.drivers.gateway.__main__ import build_parser, context_from_profile, resolve_limits
from services.drivers.gateway.api import ApiError
from services.drivers.gateway.auth import ApiKeyConfigError, ApiKeys, load_api_keys
from services.drivers.gateway.metrics import GatewayMetrics

ROOT = Path(__file__).resolve().parents[4]


def test_keys_from_file_and_env(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# team keys\nsk-alpha-0001\n\n  sk-beta-00002  # laptop\n")
    assert load_api_keys(str(f), "sk-env-000001, sk-env-000002") == {
        "sk-alpha-0001", "sk-beta-00002", "sk-env-000001", "sk-env-000002"}
    assert load_api_keys(None, None) == frozenset()


@pytest.mark.parametrize("content, needle", [("# only a comment\n", "no key"), ("short\n", "at least 8")])
def test_bad_key_files_say_why(tmp_path, content, needle):
    f = tmp_path / "keys"
    f.write_text(content)
    with pytest.raises(ApiKeyConfigError, match=needle):
        load_api_keys(str(f))


def test_missing_key_file_is_one_line(tmp_path):
    with pytest.raises(ApiKeyConfigError, match="cannot read"):
        load_api_keys(str(tmp_path / "nope"))


def _code(keys: ApiKeys, header: str | None) -> str | None:
    try:
        keys.check(header)
    except ApiError as e:
        assert e.status == 401 and e.type == "authentication_error"
        return e.code
    return None


def test_bearer_check():
    keys = ApiKeys({"sk-alpha-0001", "sk-beta-00002"})
    assert keys.enabled
    assert _code(keys, "Bearer sk-beta-00002") is None
    assert _code(keys, "bearer   sk-alpha-0001 ") is None
    assert _code(keys, None) == "missing_api_key"
    assert _code(keys, "Bearer sk-alpha-0002") == "invalid_api_key"
    assert _code(keys, "Basic c2stYWxwaGEtMDAwMQ==") == "invalid_api_key"
    assert _code(keys, "Bearer ") == "invalid_api_key"
    assert _code(ApiKeys(), None) is None  # off


def test_wrong_key_is_not_echoed_in_full():
    try:
        ApiKeys({"sk-alpha-0001"}).check("Bearer sk-secret-guess-1234")
    except ApiError as e:
        assert "sk-secret-guess-1234" not in e.message and "1234" in e.message


def test_host_defaults_to_loopback_and_compose_opens_it():
    assert build_parser().parse_args([]).host == "127.0.0.1"
    compose = (ROOT / "deploy" / "docker-compose.yml").read_text()
    gw = compose[compose.index("\n  gateway:"):]
    gw = gw[: gw.index("\n  # ---")]
    assert '"--host", "0.0.0.0"' in gw


def _limits(argv, monkeypatch, env_keys=None):
    monkeypatch.delenv("EI_PROFILE", raising=False)
    if env_keys is None:
        monkeypatch.delenv("EI_API_KEYS", raising=False)
    else:
        monkeypatch.setenv("EI_API_KEYS", env_keys)
    return resolve_limits(build_parser().parse_args(argv))


def test_limits_from_flags(monkeypatch, tmp_path):
    ctx, body, keys, why = _limits(["--context-length", "4096", "--max-body-mb", "0.5"], monkeypatch)
    assert (ctx, body, keys, why) == (4096, 512 * 1024, frozenset(), "--context-length")
    ctx, body, keys, _ = _limits([], monkeypatch, env_keys="sk-env-000001")
    assert ctx == 262_144 and body == 8 * 1024 * 1024 and keys == {"sk-env-000001"}
    with pytest.raises(SystemExit, match="--max-body-mb"):
        _limits(["--max-body-mb", "0"], monkeypatch)
    with pytest.raises(SystemExit, match="--context-length"):
        _limits(["--context-length", "0"], monkeypatch)
    with pytest.raises(SystemExit, match="cannot read"):
        _limits(["--api-keys-file", str(tmp_path / "none")], monkeypatch)


def test_context_length_from_a_profile(monkeypatch, tmp_path):
    p = tmp_path / "p.toml"
    p.write_text('name = "p"\ncontext_length = 131072\n')
    assert context_from_profile(str(p)) == (131072, "profile p.toml")
    q = tmp_path / "q.toml"
    q.write_text('name = "q"\n[model]\ncontext_length = 8192\n')
    assert context_from_profile(str(q))[0] == 8192
    ctx, _, _, why = _limits(["--profile", "gb300-glm52"], monkeypatch)  # bundled: no context_length yet
    assert ctx in (262_144, context_from_profile("gb300-glm52")[0]) and "profile" in why
    bad = tmp_path / "bad.toml"
    bad.write_text("context_length = -3\n")
    with pytest.raises(SystemExit, match="positive integer"):
        context_from_profile(str(bad))
    with pytest.raises(SystemExit, match="--profile"):
        context_from_profile(str(tmp_path / "missing.toml"))


def test_two_gateways_keep_their_own_registries():
    a, b = GatewayMetrics(lambda: 3, lambda: 1), GatewayMetrics(lambda: 0, lambda: 0)
    a.inc("ei_gateway_errors_total", status="400", code="invalid_value")
    a.inc("ei_gateway_errors_total", status="400", code="unknown_parameter")
    a.inc("ei_gateway_output_tokens_total", 7)
    assert a.get("ei_gateway_errors_total", status="400") == 2
    assert a.get("ei_gateway_errors_total", code="invalid_value") == 1
    assert b.get("ei_gateway_errors_total") == 0
    fams = {f.name: f for f in text_string_to_metric_families(a.exposition().decode())}
    assert fams["ei_gateway_open_branches"].samples[0].value == 3
    assert fams["ei_gateway_output_tokens"].type == "counter"
    labels = {s.labels["endpoint"] for s in fams["ei_gateway_requests"].samples if s.name.endswith("_total")}
    assert labels == {"chat", "completions"}


def test_regression_key_that_is_not_utf8_is_a_401_not_a_500():
    """``x-api-key: \\xff`` (aiohttp: ``"\\udcff"``) raised UnicodeEncodeError in check (a 500)."""
    keys = ApiKeys({"sk-alpha-0001"})
    for header, x_api_key in ((None, "\udcff"), ("Bearer \udcff\udcfe\udcfd", None)):
        with pytest.raises(ApiError) as ei:
            keys.check(header, x_api_key)
        assert (ei.value.status, ei.value.code) == (401, "invalid_api_key")
    keys = ApiKeys({"sk-clé-00001"})  # a UTF-8 key still matches (aiohttp decodes UTF-8)
    keys.check(None, "sk-clé-00001")
