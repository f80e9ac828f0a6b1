"""Security on the wire: TLS on both ports, bearer tokens and JWTs, request size limits, model names, logs.

Certificates and keys are made in the test (trustme, cryptography); every check goes
through a real server process with the clients users have (requests, tritonclient).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import os
import subprocess
import sys
import time

import jwt
import numpy as np
import pytest
import requests
import trustme
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from tritonclient.utils import InferenceServerException

from conftest import ROOT, copy_model, start_server, stop_server

SIMPLE_INFER = "/v2/models/simple/infer"


def simple_inputs(client, value: int = 1) -> list:
    data = np.full((1, 16), value, dtype=np.int32)
    inputs = [client.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(data)
    return inputs


def json_infer(value: int = 1, count: int = 16) -> dict:
    tensor = {"shape": [1, 16], "datatype": "INT32", "data": [value] * count}
    return {"inputs": [{"name": "INPUT0", **tensor}, {"name": "INPUT1", **tensor}]}


def grpc_status(call) -> str:
    with pytest.raises(InferenceServerException) as error:
        call()
    return error.value.status()


# ---------------------------------------------------------------- TLS


def write_server_files(ca: trustme.CA, directory) -> tuple:
    """A certificate for 127.0.0.1 and localhost signed by `ca`, written as the server's cert and key files."""
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    certfile, keyfile = directory / "tls.crt", directory / "tls.key"
    for path, pem in ((certfile, b"".join(blob.bytes() for blob in leaf.cert_chain_pems)), (keyfile, leaf.private_key_pem.bytes())):
        staged = path.with_suffix(".new")
        staged.write_bytes(pem)
        os.replace(staged, path)  # as Kubernetes swaps a secret volume: a new file, never a half-written one
    return certfile, keyfile


#: One process, and an engine with two frontends (`--workers 2`): each frontend speaks TLS and checks tokens.
WORKERS = {"params": [1, 2], "ids": ["workers1", "workers2"]}


@pytest.fixture(scope="module", **WORKERS)
def tls_server(tmp_path_factory, request):
    directory = tmp_path_factory.mktemp("tls")
    (directory / "models").mkdir()
    copy_model("simple", directory / "models")
    ca = trustme.CA()
    ca_file = directory / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    certfile, keyfile = write_server_files(ca, directory)
    tls = ("--ssl_certfile", str(certfile), "--ssl_keyfile", str(keyfile))
    server = start_server(
        directory / "models", directory / "server.log", *tls, workers=request.param,
        wait=lambda server: requests.get(f"https://{server.http}/v2/health/ready", verify=ca_file, timeout=1).status_code == 200,
    )  # fmt: skip
    yield server, directory, ca_file
    stop_server(server)


def test_rest_speaks_tls_with_the_given_certificate(tls_server):
    server, _, ca_file = tls_server
    response = requests.post(f"https://{server.http}{SIMPLE_INFER}", json=json_infer(3), verify=ca_file)
    assert response.status_code == 200
    assert response.json()["outputs"][0]["data"] == [6] * 16

    client = httpclient.InferenceServerClient(server.http, ssl=True, ssl_options={"ca_certs": str(ca_file)})
    result = client.infer("simple", simple_inputs(httpclient, 4))
    assert result.as_numpy("OUTPUT0").tolist() == [[8] * 16]


def test_rest_refuses_plain_http_and_unknown_certificates(tls_server):
    server, _, ca_file = tls_server
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://{server.http}/v2/health/live", timeout=5)
    with pytest.raises(requests.exceptions.SSLError):
        requests.get(f"https://{server.http}/v2/health/live", verify=True, timeout=5)  # the system's CAs do not know it
    assert requests.get(f"https://{server.http}/v2/health/live", verify=ca_file).status_code == 200


def test_grpc_speaks_tls_with_the_same_certificate(tls_server):
    server, _, ca_file = tls_server
    client = grpcclient.InferenceServerClient(server.grpc, ssl=True, root_certificates=str(ca_file))
    result = client.infer("simple", simple_inputs(grpcclient, 5))
    assert result.as_numpy("OUTPUT0").tolist() == [[10] * 16]

    plain = grpcclient.InferenceServerClient(server.grpc)
    assert grpc_status(lambda: plain.is_server_live(client_timeout=5)) in ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED")
    assert client.is_server_live()


def test_grpc_serves_a_rotated_certificate_to_new_connections(tls_server):
    server, directory, ca_file = tls_server
    new_ca = trustme.CA()
    new_ca_file = directory / "new-ca.pem"
    new_ca.cert_pem.write_to_path(str(new_ca_file))
    write_server_files(new_ca, directory)

    client = grpcclient.InferenceServerClient(server.grpc, ssl=True, root_certificates=str(new_ca_file))
    assert client.infer("simple", simple_inputs(grpcclient, 1)).as_numpy("OUTPUT0").tolist() == [[2] * 16]
    old = grpcclient.InferenceServerClient(server.grpc, ssl=True, root_certificates=str(ca_file))
    assert grpc_status(lambda: old.is_server_live(client_timeout=5)) in ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED")


def test_half_a_certificate_pair_is_refused_at_start(tmp_path):
    (tmp_path / "tls.crt").write_text("")
    result = subprocess.run(
        [sys.executable, "-m", "kserve_ascend", "--model_dir", str(tmp_path), "--ssl_certfile", str(tmp_path / "tls.crt")],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--ssl_certfile and --ssl_keyfile go together" in result.stderr


# ---------------------------------------------------------------- authentication

ISSUER, AUDIENCE = "https://issuer.example", "kserve-ascend"
STATIC_TOKEN = "static-0c5b6e1d9a7f4e32"
OTHER_TOKEN = "static-second-71aa"
TENSOR_VALUE = 918273645  # distinctive: must never show up in the server's log


def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def public_pem(key) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def claims(**changes) -> dict:
    now = int(time.time())
    return {k: v for k, v in {"sub": "alice", "iss": ISSUER, "aud": AUDIENCE, "iat": now, "exp": now + 3600, **changes}.items() if v is not None}


@pytest.fixture(scope="module", **WORKERS)
def auth_server(tmp_path_factory, request):
    directory = tmp_path_factory.mktemp("auth")
    copy_model("simple", directory)
    key = rsa_key()
    (directory / "jwt.pem").write_bytes(public_pem(key))
    (directory / "tokens").write_text(f"# the gateway's tokens\n{STATIC_TOKEN}\n\n{OTHER_TOKEN}\n")
    server = start_server(
        directory, directory / "server.log",
        "--auth_token_file", str(directory / "tokens"),
        "--auth_jwt_public_key", str(directory / "jwt.pem"),
        "--auth_jwt_issuer", ISSUER, "--auth_jwt_audience", AUDIENCE,
        workers=request.param,
    )  # fmt: skip
    yield server, key
    stop_server(server)


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.parametrize(
    "path",
    ["/v2/health/live", "/v2/health/ready", "/health", "/ready", "/v2/models/simple/ready", "/v2/models/simple/versions/1/ready", "/",
     "/v1/models/simple"],
)
def test_probes_need_no_token(auth_server, path):
    server, _ = auth_server
    assert requests.get(server.url + path).status_code == 200


def test_grpc_probes_need_no_token(auth_server):
    server, _ = auth_server
    client = grpcclient.InferenceServerClient(server.grpc)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("simple")


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/v2"),
        ("GET", "/v2/models/simple"),
        ("GET", "/v2/models/simple/config"),
        ("GET", "/v2/models/stats"),
        ("POST", SIMPLE_INFER),
        ("POST", "/v2/repository/index"),
        ("POST", "/v2/repository/models/simple/load"),
        ("GET", "/v2/systemsharedmemory/status"),
        ("GET", "/v2/models/no_such_model"),  # no answer, not even 404, says what exists
        ("GET", "/v1/models"),
        ("POST", "/v1/models/simple:predict"),
        ("GET", "/metrics"),
    ],
)
def test_everything_else_needs_a_token(auth_server, method, path):
    server, _ = auth_server
    response = requests.request(method, server.url + path, json=json_infer())
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == "Bearer"
    assert "bearer token" in response.json()["error"]
    assert requests.request(method, server.url + path, json=json_infer(), headers=bearer(STATIC_TOKEN)).status_code != 401


@pytest.mark.parametrize("header", [f"Bearer {STATIC_TOKEN}x", f"Basic {STATIC_TOKEN}", "Bearer", "Bearer a.b.c"])
def test_a_wrong_token_is_401_with_invalid_token(auth_server, header):
    server, _ = auth_server
    response = requests.post(server.url + SIMPLE_INFER, json=json_infer(), headers={"Authorization": header})
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == 'Bearer error="invalid_token"'
    assert set(response.json()) == {"error"}


def test_static_tokens_serve_over_rest_and_grpc(auth_server):
    server, _ = auth_server
    for token in (STATIC_TOKEN, OTHER_TOKEN):
        http = httpclient.InferenceServerClient(server.http)
        result = http.infer("simple", simple_inputs(httpclient, 2), headers=bearer(token))
        assert result.as_numpy("OUTPUT0").tolist() == [[4] * 16]
        client = grpcclient.InferenceServerClient(server.grpc)
        result = client.infer("simple", simple_inputs(grpcclient, 2), headers={"authorization": f"Bearer {token}"})
        assert result.as_numpy("OUTPUT1").tolist() == [[0] * 16]
        assert client.get_model_metadata("simple", headers={"authorization": f"Bearer {token}"}).name == "simple"


def test_grpc_without_a_token_is_unauthenticated(auth_server):
    server, _ = auth_server
    client = grpcclient.InferenceServerClient(server.grpc)
    assert grpc_status(lambda: client.infer("simple", simple_inputs(grpcclient))) == "StatusCode.UNAUTHENTICATED"
    assert grpc_status(lambda: client.get_server_metadata()) == "StatusCode.UNAUTHENTICATED"
    assert grpc_status(lambda: client.get_model_repository_index()) == "StatusCode.UNAUTHENTICATED"
    wrong = {"authorization": f"Bearer {STATIC_TOKEN}x"}
    assert grpc_status(lambda: client.load_model("simple", headers=wrong)) == "StatusCode.UNAUTHENTICATED"


def test_grpc_stream_without_a_token_is_unauthenticated(auth_server):
    server, _ = auth_server
    errors = []
    client = grpcclient.InferenceServerClient(server.grpc)
    client.start_stream(callback=lambda result, error: errors.append(error))
    with contextlib.suppress(InferenceServerException):  # the server may have ended the stream already
        client.async_stream_infer("simple", simple_inputs(grpcclient))
    client.stop_stream()  # waits for the stream to end; its error went to the callback
    assert errors and all(e is not None and e.status() == "StatusCode.UNAUTHENTICATED" for e in errors)

    answers = []
    client = grpcclient.InferenceServerClient(server.grpc)
    client.start_stream(callback=lambda result, error: answers.append((result, error)), headers={"authorization": f"Bearer {STATIC_TOKEN}"})
    client.async_stream_infer("simple", simple_inputs(grpcclient, 3))
    client.stop_stream()
    assert [error for _, error in answers] == [None]
    assert answers[0][0].as_numpy("OUTPUT0").tolist() == [[6] * 16]


def test_a_valid_jwt_serves_over_rest_and_grpc(auth_server):
    server, key = auth_server
    token = jwt.encode(claims(), key, algorithm="RS256")
    result = httpclient.InferenceServerClient(server.http).infer("simple", simple_inputs(httpclient), headers=bearer(token))
    assert result.as_numpy("OUTPUT0").tolist() == [[2] * 16]
    client = grpcclient.InferenceServerClient(server.grpc)
    result = client.infer("simple", simple_inputs(grpcclient), headers={"authorization": f"Bearer {token}"})
    assert result.as_numpy("OUTPUT0").tolist() == [[2] * 16]
    for _ in range(3):  # verified once, then remembered until it expires
        assert requests.get(server.url + "/v2", headers=bearer(token)).status_code == 200
    token = jwt.encode(claims(), key, algorithm="PS256")  # any RSA algorithm of the key's type
    assert requests.get(server.url + "/v2", headers=bearer(token)).status_code == 200


def hs256(payload: dict, secret: bytes) -> str:
    """A JWT MACed with `secret`, made by hand: PyJWT refuses to use a public key as an HMAC secret."""

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    signing_input = f"{b64(json.dumps({'alg': 'HS256', 'typ': 'JWT'}).encode())}.{b64(json.dumps(payload).encode())}"
    return f"{signing_input}.{b64(hmac.new(secret, signing_input.encode(), hashlib.sha256).digest())}"


def _forged_tokens(key) -> dict[str, tuple[str, str]]:
    """Tokens that must be refused, each with a part of the reason the server gives."""
    now = int(time.time())
    return {
        "expired": (jwt.encode(claims(exp=now - 10, iat=now - 3600), key, algorithm="RS256"), "expired"),
        "not yet valid": (jwt.encode(claims(nbf=now + 3600), key, algorithm="RS256"), "not yet valid"),
        "without exp": (jwt.encode(claims(exp=None), key, algorithm="RS256"), "exp"),
        "other audience": (jwt.encode(claims(aud="another-service"), key, algorithm="RS256"), "udience"),
        "without audience": (jwt.encode(claims(aud=None), key, algorithm="RS256"), "aud"),
        "other issuer": (jwt.encode(claims(iss="https://evil.example"), key, algorithm="RS256"), "issuer"),
        "other key": (jwt.encode(claims(), rsa_key(), algorithm="RS256"), "Signature verification failed"),
        "alg none": (jwt.encode(claims(), None, algorithm="none"), "alg"),
        # The public key used as an HMAC secret: the classic algorithm confusion.
        "HS256 with the public key": (hs256(claims(), secret=public_pem(key)), "alg"),
        "EC-signed": (jwt.encode(claims(), ec.generate_private_key(ec.SECP256R1()), algorithm="ES256"), "alg"),
    }


def test_forged_or_stale_jwts_are_refused(auth_server):
    server, key = auth_server
    client = grpcclient.InferenceServerClient(server.grpc)
    for case, (token, reason) in _forged_tokens(key).items():
        response = requests.post(server.url + SIMPLE_INFER, json=json_infer(), headers=bearer(token))
        assert response.status_code == 401, case
        assert reason in response.json()["error"], (case, response.json())
        assert response.headers["WWW-Authenticate"] == 'Bearer error="invalid_token"'
        headers = {"authorization": f"Bearer {token}"}
        assert grpc_status(lambda: client.infer("simple", simple_inputs(grpcclient), headers=headers)) == "StatusCode.UNAUTHENTICATED"
    assert requests.post(server.url + SIMPLE_INFER, json=json_infer(), headers=bearer(STATIC_TOKEN)).status_code == 200


def test_neither_tokens_nor_tensor_data_reach_the_log(auth_server):
    server, key = auth_server
    token = jwt.encode(claims(sub="log-check"), key, algorithm="RS256")
    wrong_token = "wrong-token-5e1f0a77d3"
    good, bad = bearer(token), bearer(wrong_token)
    url = server.url + SIMPLE_INFER
    assert requests.post(url, json=json_infer(TENSOR_VALUE), headers=good).status_code == 200
    assert requests.post(url, json=json_infer(TENSOR_VALUE), headers=bad).status_code == 401
    assert requests.post(url, json=json_infer(TENSOR_VALUE, count=15), headers=good).status_code == 400  # wrong count
    out_of_range = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT8", "data": [TENSOR_VALUE] * 16}]}
    assert requests.post(url, json=out_of_range, headers=good).status_code == 400
    assert requests.post(url, data=f'{{"inputs": [{TENSOR_VALUE},'.encode(), headers=good).status_code == 400  # malformed JSON
    client = grpcclient.InferenceServerClient(server.grpc)
    value = np.full((1, 16), TENSOR_VALUE, dtype=np.int32)
    inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32").set_data_from_numpy(value)]
    assert grpc_status(lambda: client.infer("simple", inputs, headers={"authorization": f"Bearer {token}"})) == "StatusCode.INVALID_ARGUMENT"
    assert grpc_status(lambda: client.infer("simple", inputs, headers={"authorization": f"Bearer {wrong_token}"})) == "StatusCode.UNAUTHENTICATED"

    log = server.output()
    assert "POST /v2/models/simple/infer: 401" in log and "missing input" in log  # the failures were logged ...
    for secret in (token, wrong_token, STATIC_TOKEN, str(TENSOR_VALUE)):
        assert secret not in log  # ... without the token or the data


def test_unusable_auth_files_stop_the_server(tmp_path):
    (tmp_path / "tokens").write_text("# no token yet\n\n")
    (tmp_path / "key.pem").write_text("not a key")
    for flags, message in (
        (["--auth_token_file", str(tmp_path / "tokens")], "holds no token"),
        (["--auth_token_file", str(tmp_path / "missing")], "No such file"),
        (["--auth_jwt_public_key", str(tmp_path / "key.pem")], "--auth_jwt_public_key"),
        (["--auth_jwt_audience", AUDIENCE], "need --auth_jwt_public_key"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "kserve_ascend", "--model_dir", str(tmp_path), *flags],
            capture_output=True, text=True, cwd=ROOT, timeout=60,
        )  # fmt: skip
        assert result.returncode != 0 and message in result.stderr, (flags, result.stderr[-2000:])


# ---------------------------------------------------------------- request size and model names


@pytest.fixture(scope="module")
def limited_server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("limited")
    repository = directory / "models"
    repository.mkdir()
    copy_model("simple", repository)
    copy_model("simple", directory, "outside")  # a loadable model next to the repository, not in it
    server = start_server(
        repository, directory / "server.log",
        "--http_max_input_size", "4096", "--grpc_max_receive_message_length", "4096",
        "--model_control_mode", "explicit", "--load_model", "simple",
    )  # fmt: skip
    yield server
    stop_server(server)


def test_a_rest_body_over_the_limit_is_413(limited_server):
    server = limited_server
    url = server.url + SIMPLE_INFER
    assert requests.post(url, json=json_infer(7)).status_code == 200
    big = b'{"inputs": [' + b" " * 8192 + b"]}"
    for body in (big, iter([big[:4000], big[4000:]])):  # with a Content-Length, then chunked
        response = requests.post(url, data=body)
        assert response.status_code == 413
        assert "4096 bytes (--http_max_input_size)" in response.json()["error"]
    response = requests.post(server.url + "/v1/models/simple:predict", data=big)  # KServe's routes too
    assert response.status_code == 413
    assert requests.post(url, json=json_infer(7)).json()["outputs"][0]["data"] == [14] * 16


def test_a_grpc_message_over_the_limit_is_resource_exhausted(limited_server):
    client = grpcclient.InferenceServerClient(limited_server.grpc)
    big = np.zeros((1, 2048), dtype=np.int32)
    inputs = [grpcclient.InferInput(name, [1, 2048], "INT32").set_data_from_numpy(big) for name in ("INPUT0", "INPUT1")]
    assert grpc_status(lambda: client.infer("simple", inputs)) == "StatusCode.RESOURCE_EXHAUSTED"
    assert client.infer("simple", simple_inputs(grpcclient, 1)).as_numpy("OUTPUT0").tolist() == [[2] * 16]


@pytest.mark.parametrize("name", ["%2E%2E", ".hidden", "a%5Cb", "a%00b", "x" * 256])
def test_rest_repository_refuses_names_that_are_not_one_directory(limited_server, name):
    server = limited_server
    for action in ("load", "unload"):
        response = requests.post(f"{server.url}/v2/repository/models/{name}/{action}")
        assert response.status_code == 400
        assert "invalid model name" in response.json()["error"]


def test_rest_cannot_reach_out_of_the_repository(limited_server):
    server = limited_server
    for name in ("..%2Foutside", "%2E%2E%2Foutside", "%2Ftmp"):
        response = requests.post(f"{server.url}/v2/repository/models/{name}/load")
        assert response.status_code in (400, 404), name  # a '/' in a name leaves no route to match
        assert "error" in response.json()
    assert {entry["name"] for entry in requests.post(f"{server.url}/v2/repository/index").json()} == {"simple"}


def test_grpc_repository_refuses_names_that_are_not_one_directory(limited_server):
    client = grpcclient.InferenceServerClient(limited_server.grpc)
    outside = str(limited_server.log.parent / "outside")
    for name in ("../outside", "..", "", ".", outside, "simple/../../outside", "..\\outside"):
        assert grpc_status(lambda: client.load_model(name)) == "StatusCode.INVALID_ARGUMENT", name
        assert grpc_status(lambda: client.unload_model(name)) == "StatusCode.INVALID_ARGUMENT", name
    assert grpc_status(lambda: client.get_model_metadata("../outside")) == "StatusCode.INVALID_ARGUMENT"
    assert [m.name for m in client.get_model_repository_index().models] == ["simple"]
    client.load_model("simple")
    assert client.is_model_ready("simple")


# ---------------------------------------------------------------- the authenticator's key types


def test_jwt_algorithms_follow_the_key_type():
    from kserve_ascend.server.edges.auth import Authenticator, Unauthenticated

    for private, algorithm, other in (
        (ec.generate_private_key(ec.SECP256R1()), "ES256", "RS256"),
        (ec.generate_private_key(ec.SECP384R1()), "ES384", "ES256"),
        (ed25519.Ed25519PrivateKey.generate(), "EdDSA", "ES256"),
        (rsa_key(), "RS512", "ES256"),
    ):
        authenticator = Authenticator(jwt_key=private.public_key())
        authenticator.check(f"Bearer {jwt.encode(claims(aud=None), private, algorithm=algorithm)}")
        foreign = ec.generate_private_key(ec.SECP256R1()) if other.startswith("ES") else rsa_key()
        with pytest.raises(Unauthenticated):
            authenticator.check(f"Bearer {jwt.encode(claims(aud=None), foreign, algorithm=other)}")
