"""Secrets in settings (files, repr, connect options) and the admin-token middleware, without processes."""
from __future__ import annotations

import ssl

import pytest
from aiohttp import web
from aiohttp import test_utils  # NOTE: not `import TestClient`: pytest would try to collect it

from shared.runtime.admin_auth import admin_headers, admin_token_from_env
from shared.runtime.config import ConfigError, ModelWorkerConfig, ServiceConfig, load_config, write_secret_file
from shared.runtime.natsconn import client_options, connect_options, redacted_url
from shared.runtime.service import Service, build_admin_app


def test_secrets_stay_out_of_repr_and_str():
    """A config's repr/str (what a log line or traceback shows) never holds a token or password."""
    config = ModelWorkerConfig(nats_token="tok-SECRET", admin_token="adm-SECRET")
    other = ServiceConfig(nats_user="u", nats_password="pw-SECRET")
    for text in (repr(config), str(config), repr(other)):
        assert "SECRET" not in text
    assert "nats_user='u'" in repr(other)


def test_secrets_come_from_files(tmp_path):
    """SMARTGEN_*_FILE fills the secret (one trailing newline dropped), and the file is written mode 0600."""
    token_file = write_secret_file(tmp_path / "token", "abc def\n")
    assert token_file.stat().st_mode & 0o777 == 0o600
    config = load_config(ServiceConfig, [], {"SMARTGEN_NATS_TOKEN_FILE": str(token_file),
                                             "SMARTGEN_ADMIN_TOKEN_FILE": str(token_file)})
    assert config.nats_token == "abc def" and config.admin_token == "abc def"
    assert admin_token_from_env({"SMARTGEN_ADMIN_TOKEN_FILE": str(token_file)}) == "abc def"
    assert admin_token_from_env({}) == ""


@pytest.mark.parametrize("env, message", [
    ({"SMARTGEN_NATS_TOKEN_FILE": "/no/such/file"}, "SMARTGEN_NATS_TOKEN_FILE"),
    ({"SMARTGEN_NATS_TOKEN": "a", "SMARTGEN_NATS_USER": "u", "SMARTGEN_NATS_PASSWORD": "p"}, "not both"),
    ({"SMARTGEN_NATS_USER": "u"}, "SMARTGEN_NATS_PASSWORD"),
    ({"SMARTGEN_NATS_TLS_CERT": "/no/cert.pem"}, "SMARTGEN_NATS_TLS_KEY"),
    ({"SMARTGEN_NATS_TLS_CA": "/no/ca.pem"}, "SMARTGEN_NATS_TLS_CA"),
])
def test_bad_secret_settings_say_what_to_set(env, message):
    """A secret setting that cannot work stops the service with the variable to fix."""
    with pytest.raises(ConfigError, match=message):
        load_config(ServiceConfig, [], env)


@pytest.mark.parametrize("env, message", [
    ({"SMARTGEN_DATAPLANE_TLS_CA": "/etc/hostname"}, "all three of SMARTGEN_DATAPLANE_TLS_CA"),
    ({"SMARTGEN_DATAPLANE_TLS_CA": "/no/ca.pem", "SMARTGEN_DATAPLANE_TLS_CERT": "/no/c.pem",
      "SMARTGEN_DATAPLANE_TLS_KEY": "/no/k.pem"}, "SMARTGEN_DATAPLANE_TLS_CA"),
])
def test_bad_dataplane_tls_settings_say_what_to_set(env, message):
    """Data-plane TLS half set, or set to files that are not there, stops a model worker with what to fix."""
    with pytest.raises(ConfigError, match=message):
        load_config(ModelWorkerConfig, [], env)


def test_token_and_its_file_must_agree(tmp_path):
    """Setting a secret both ways with different values is an error, not a silent pick."""
    path = write_secret_file(tmp_path / "t", "from-file")
    with pytest.raises(ConfigError, match="differ"):
        load_config(ServiceConfig, [], {"SMARTGEN_ADMIN_TOKEN": "other", "SMARTGEN_ADMIN_TOKEN_FILE": str(path)})


def test_connect_options_carry_credentials_and_tls():
    """Token, user/password and TLS settings become nats.connect arguments; none set = just the server."""
    assert connect_options(ServiceConfig()) == {"servers": ["nats://127.0.0.1:4222"]}
    assert connect_options(ServiceConfig(nats_token="t"))["token"] == "t"
    options = connect_options(ServiceConfig(nats_user="u", nats_password="p"))
    assert (options["user"], options["password"]) == ("u", "p") and "token" not in options
    tls = connect_options(ServiceConfig(nats_url="tls://nats.example:4222"))["tls"]
    assert isinstance(tls, ssl.SSLContext) and tls.verify_mode == ssl.CERT_REQUIRED
    assert client_options({"SMARTGEN_NATS_TOKEN": "t"}, server="nats://10.0.0.1:4222") == \
        {"servers": ["nats://10.0.0.1:4222"], "token": "t"}


def test_redacted_url_hides_credentials():
    """A URL with credentials in it is logged without them."""
    assert redacted_url("nats://user:pw@host:4222") == "nats://***@host:4222"
    assert redacted_url("nats://tok@host:4222") == "nats://***@host:4222"
    assert redacted_url("nats://host:4222") == "nats://host:4222"


class AdminProbe(Service):
    """A service with one state-changing admin route and one public route, to probe the middleware."""

    role = "probe"
    public_path_prefixes = ("/v1/",)

    def __init__(self, config: ServiceConfig):
        super().__init__(config)
        self.num_changes = 0

    def admin_routes(self) -> list[web.RouteDef]:
        async def change(_: web.Request) -> web.Response:
            self.num_changes += 1
            return web.json_response({"changed": self.num_changes})

        async def public(_: web.Request) -> web.Response:
            return web.json_response({"ok": True})

        return [web.post("/change", change), web.delete("/change", change), web.post("/v1/public", public)]


async def probe(admin_token: str) -> tuple[AdminProbe, test_utils.TestClient]:
    service = AdminProbe(ServiceConfig(admin_token=admin_token))
    client = test_utils.TestClient(test_utils.TestServer(build_admin_app(service)))
    await client.start_server()
    return service, client


async def test_admin_token_guards_state_changing_routes():
    """POST/DELETE need the bearer token (401 naming SMARTGEN_ADMIN_TOKEN otherwise, handler not run); GET and
    the public prefix need none."""
    service, client = await probe("s3cret")
    try:
        for headers in ({}, admin_headers("wrong"), {"Authorization": "Basic s3cret"}, {"Authorization": "Bearer"}):
            response = await client.post("/change", headers=headers)
            assert response.status == 401 and "SMARTGEN_ADMIN_TOKEN" in (await response.json())["error"]
            assert response.headers["WWW-Authenticate"].startswith("Bearer")
        assert service.num_changes == 0
        assert (await client.post("/change", headers=admin_headers("s3cret"))).status == 200
        assert (await client.delete("/change", headers=admin_headers("s3cret"))).status == 200
        assert service.num_changes == 2
        assert (await client.get("/stats")).status == 200
        assert (await client.post("/v1/public")).status == 200
        assert (await client.post("/stats")).status == 405 and (await client.post("/nowhere")).status == 404
    finally:
        await client.close()


async def test_without_an_admin_token_state_changing_routes_are_off():
    """No admin token configured: even a request with a bearer token gets 403 saying how to turn them on."""
    service, client = await probe("")
    try:
        response = await client.post("/change", headers=admin_headers("anything"))
        assert response.status == 403 and "SMARTGEN_ADMIN_TOKEN" in (await response.json())["error"]
        assert service.num_changes == 0
        assert (await client.get("/health")).status in (200, 503)
    finally:
        await client.close()


def test_a_nats_cluster_a_creds_file_and_a_namespace(tmp_path):
    """Comma-separated URLs become the client's server list (credentials redacted in each for logs); a .creds
    file goes to nats.connect as user_credentials; a namespace moves every subject under smartgen.<ns>. (and back
    with none); and each of them refuses what cannot work with a sentence naming the setting."""
    from schemas import subjects

    creds = tmp_path / "user.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\n…\n")
    config = load_config(ServiceConfig, [], {"SMARTGEN_NATS_URL": "nats://a:4222, nats://b:4222,tls://c:4222",
                                             "SMARTGEN_NATS_CREDS": str(creds), "SMARTGEN_NAMESPACE": "team-a"})
    try:
        options = connect_options(config)
        assert options["servers"] == ["nats://a:4222", "nats://b:4222", "tls://c:4222"]
        assert options["user_credentials"] == str(creds) and isinstance(options["tls"], ssl.SSLContext)
        assert subjects.DISCOVER == "smartgen.team-a.discover"
        assert subjects.worker("decode", "d-1", "open") == "smartgen.team-a.decode.d-1.open"
        assert subjects.HEARTBEATS == "smartgen.team-a.heartbeat.*"
    finally:
        subjects.use_namespace("")
    assert subjects.DISCOVER == "smartgen.discover"
    assert redacted_url("nats://u:pw@a:4222,nats://b:4222") == "nats://***@a:4222,nats://b:4222"
    for env, message in [({"SMARTGEN_NATS_URL": "nats://a:4222,http://b"}, "nats_url 'http://b'"),
                         ({"SMARTGEN_NAMESPACE": "team.a"}, "namespace"),
                         ({"SMARTGEN_NATS_CREDS": "/no/such.creds"}, "SMARTGEN_NATS_CREDS"),
                         ({"SMARTGEN_NATS_CREDS": str(creds), "SMARTGEN_NATS_TOKEN": "t"}, "keep one")]:
        with pytest.raises(ConfigError, match=message):
            load_config(ServiceConfig, [], env)


def test_the_profiles_bucket_follows_the_namespace():
    from services.kvprofile.config import KvProfileConfig

    assert load_config(KvProfileConfig, [], {}).bucket == "smartgen_profiles"
    assert load_config(KvProfileConfig, [], {"SMARTGEN_NAMESPACE": "team-a"}).bucket == "smartgen_team-a_profiles"
    assert load_config(KvProfileConfig, [], {"SMARTGEN_BUCKET": "mine", "SMARTGEN_NAMESPACE": "x"}).bucket == "mine"
    with pytest.raises(ConfigError, match="bucket_replicas"):
        load_config(KvProfileConfig, [], {"SMARTGEN_BUCKET_REPLICAS": "7"})
