"""Bearer-token authentication, the same for both edges: static tokens and JWTs (OAuth2 access tokens).

Off unless `--auth_token_file` or `--auth_jwt_public_key` is given; then every request
but the health probes (which Kubernetes sends without a token) needs
`Authorization: Bearer <token>` (gRPC: `authorization` metadata), else 401 /
UNAUTHENTICATED. Tokens are never logged, nor echoed in an error.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import re
import time
from pathlib import Path
from typing import Sequence

import grpc
import jwt
import orjson
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
from cryptography.hazmat.primitives.serialization import load_pem_public_key
from grpc import aio
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocketClose

log = logging.getLogger(__name__)

#: Probes, open to anyone: OIP health (and its /health, /ready aliases), model readiness, and KServe's V1
#: liveness and model readiness.
_OPEN_PATHS = re.compile(r"/v2/health/(live|ready)|/health|/ready|/v2/models/[^/]+(/versions/[^/]+)?/ready|/|/v1/models/[^/:]+")
_SERVICE = "/inference.GRPCInferenceService/"
_OPEN_RPCS = frozenset(_SERVICE + rpc for rpc in ("ServerLive", "ServerReady", "ModelReady"))

#: PyJWT's own messages for these name the failed check and never quote the token.
_JWT_REASONS = (
    jwt.ExpiredSignatureError,
    jwt.ImmatureSignatureError,
    jwt.InvalidAudienceError,
    jwt.InvalidIssuerError,
    jwt.MissingRequiredClaimError,
    jwt.InvalidAlgorithmError,
    jwt.InvalidSignatureError,
)
_EC_ALGORITHMS = {"secp256r1": "ES256", "secp384r1": "ES384", "secp521r1": "ES512"}


class Unauthenticated(Exception):
    """No usable bearer token. `challenge` is the `WWW-Authenticate` value (RFC 6750)."""

    def __init__(self, message: str, token_given: bool):
        super().__init__(message)
        self.challenge = 'Bearer error="invalid_token"' if token_given else "Bearer"


class Authenticator:
    """Accepts a bearer token that is one of `tokens`, or a JWT signed by `jwt_key` that has not expired.

    Static tokens are kept as SHA-256 digests and compared in constant time. A JWT must
    carry `exp` and, when they are configured, the expected `iss` and `aud` (PyJWT also
    refuses a token with an `aud` when no audience is configured). The algorithms allowed
    are those of the key's type only, so no token can choose a weaker check. A JWT that
    verified is remembered until it expires: a client sends the same token many times.
    """

    def __init__(
        self,
        tokens: Sequence[str] = (),
        jwt_key=None,
        issuer: str | None = None,
        audience: str | None = None,
        cache_size: int = 1024,
    ):
        self._digests = [_digest(token) for token in tokens]
        self._jwt_key = jwt_key
        self._algorithms = _algorithms(jwt_key) if jwt_key is not None else []
        self._issuer = issuer
        self._audience = audience
        self._expiry = functools.lru_cache(maxsize=cache_size)(self._verify_jwt)

    @classmethod
    def from_files(
        cls, token_file: str | None, jwt_public_key: str | None, issuer: str | None = None, audience: str | None = None
    ) -> Authenticator | None:
        """The authenticator the flags ask for; None when authentication is off. Exits on unusable files."""
        if not token_file and not jwt_public_key:
            if issuer or audience:
                raise SystemExit("kserve-ascend: --auth_jwt_issuer and --auth_jwt_audience need --auth_jwt_public_key")
            return None
        tokens = _read_tokens(Path(token_file)) if token_file else []
        key = _read_public_key(Path(jwt_public_key)) if jwt_public_key else None
        return cls(tokens, key, issuer, audience)

    def check(self, authorization: str | None) -> None:
        """Raises Unauthenticated unless the `Authorization` header value carries an accepted bearer token."""
        if not authorization:
            raise Unauthenticated("this endpoint needs a bearer token: send 'Authorization: Bearer <token>'", False)
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("the Authorization header must be 'Bearer <token>'", True)
        digest = _digest(token)
        if any(hmac.compare_digest(digest, known) for known in self._digests):
            return
        if self._jwt_key is None or token.count(".") != 2:
            raise Unauthenticated("the bearer token is not valid", True)
        if self._expiry(token) <= time.time():
            raise Unauthenticated("Signature has expired", True)

    def _verify_jwt(self, token: str) -> float:
        """The expiry of a JWT whose signature and claims check out (failures are not cached)."""
        try:
            claims = jwt.decode(
                token,
                self._jwt_key,
                algorithms=self._algorithms,
                issuer=self._issuer,
                audience=self._audience,
                options={"require": ["exp"]},
            )
        except _JWT_REASONS as error:
            raise Unauthenticated(str(error), True) from None
        except jwt.PyJWTError:
            raise Unauthenticated("the bearer token is not a valid JWT", True) from None
        return float(claims["exp"])


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _read_tokens(path: Path) -> list[str]:
    """One token a line; blank lines and lines starting with '#' are skipped."""
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise SystemExit(f"kserve-ascend: --auth_token_file {path}: {error.strerror}") from None
    tokens = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not tokens:
        raise SystemExit(f"kserve-ascend: --auth_token_file {path} holds no token")
    return tokens


def _read_public_key(path: Path):
    """A PEM public key, or the key of a PEM certificate."""
    try:
        pem = path.read_bytes()
    except OSError as error:
        raise SystemExit(f"kserve-ascend: --auth_jwt_public_key {path}: {error.strerror}") from None
    try:
        key = x509.load_pem_x509_certificate(pem).public_key() if b"CERTIFICATE-----" in pem else load_pem_public_key(pem)
        _algorithms(key)
    except ValueError as error:
        raise SystemExit(f"kserve-ascend: --auth_jwt_public_key {path}: {error}") from None
    return key


def _algorithms(key) -> list[str]:
    if isinstance(key, rsa.RSAPublicKey):
        return ["RS256", "RS384", "RS512", "PS256", "PS384", "PS512"]
    if isinstance(key, ec.EllipticCurvePublicKey) and key.curve.name in _EC_ALGORITHMS:
        return [_EC_ALGORITHMS[key.curve.name]]
    if isinstance(key, (ed25519.Ed25519PublicKey, ed448.Ed448PublicKey)):
        return ["EdDSA"]
    raise ValueError(f"not an RSA, P-256/384/521 or Ed25519/Ed448 public key: {type(key).__name__}")


class RestAuthentication:
    """ASGI middleware in front of every REST route (OIP, KServe's V1, /metrics, docs) but the probes."""

    def __init__(self, app: ASGIApp, authenticator: Authenticator):
        self.app = app
        self.authenticator = authenticator

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan" and not _OPEN_PATHS.fullmatch(scope["path"]):
            try:
                self.authenticator.check(_header(scope, b"authorization"))
            except Unauthenticated as error:
                log.info("%s %s: 401 %s", scope.get("method", "WEBSOCKET"), scope["path"], error)
                if scope["type"] == "websocket":
                    return await WebSocketClose(1008, "unauthenticated")(scope, receive, send)
                response = Response(
                    orjson.dumps({"error": str(error)}),
                    status_code=401,
                    media_type="application/json",
                    headers={"WWW-Authenticate": error.challenge},
                )
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


def _header(scope: Scope, name: bytes) -> str | None:
    return next((value.decode("latin-1") for key, value in scope["headers"] if key == name), None)


class GrpcAuthentication(aio.ServerInterceptor):
    """Aborts every RPC but ServerLive, ServerReady and ModelReady with UNAUTHENTICATED unless its token is accepted."""

    def __init__(self, authenticator: Authenticator):
        self.authenticator = authenticator

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method in _OPEN_RPCS:
            return handler
        metadata = details.invocation_metadata or ()
        try:
            self.authenticator.check(next((value for key, value in metadata if key == "authorization"), None))
        except Unauthenticated as error:
            log.info("%s: UNAUTHENTICATED %s", details.method.removeprefix(_SERVICE), error)
            return _denial(handler, str(error))
        return handler


def _denial(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that aborts the call."""

    async def deny(request, context: aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(deny, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
