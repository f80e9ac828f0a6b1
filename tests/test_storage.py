"""Models downloaded as KServe downloads them: KServe's own storage-initializer code, a real S3 server.

The storage-initializer image's entrypoint calls `Storage.download(source_uri, destination)`
(kserve python/storage-initializer/scripts/initializer-entrypoint). Here that code runs, in its
own process with the environment a pod gives it, against a local S3-compatible server (moto in
server mode) holding the bucket the manifests name; then the server starts on what it downloaded
with the manifest's exact args and answers one inference, compared with ONNX Runtime's own.

- InferenceService: KServe injects the initializer with (storageUri, /mnt/models), /mnt/models
  being an emptyDir it mounts; credentials as KServe's credential builder sets them. The code of
  kserve-storage 0.21 and of kserve 0.15.2 both; the ServingRuntime's args serve the result.
- The Triton Deployment: the code of the storage-initializer image it names (kserve 0.15.2, in
  its own virtualenv: make's stamped .venv/kserve-0.15.2) with its init container's exact args
  and Secret, into its volume; the ConfigMap's config mounted over; Triton with its args.
"""

from __future__ import annotations

import os
import posixpath
import subprocess
import sys
from pathlib import Path

import boto3
import numpy as np
import onnxruntime
import pytest
import yaml

from conftest import REPOSITORY, ROOT, free_port, infer, start, stop_server
from test_manifests import substitute

MANIFESTS = ROOT / "manifests"
RUNTIME = MANIFESTS / "base" / "clusterservingruntime.yaml"
TRITON = MANIFESTS / "triton"
OLD_VENV = ROOT / ".venv" / "kserve-0.15.2"

#: What the bucket holds under a storageUri (the README's tree): a Triton-layout repository.
REPOSITORY_FILES = {"yolov8n/config.pbtxt", "yolov8n/1/model.onnx"}
BUCKET = "models"
ACCESS_KEY, SECRET_KEY = "kserve-ascend-test", "not-a-secret"

#: The initializer code of each version: the import its entrypoint uses, then the call it makes.
KSERVE_STORAGE = (Path(sys.executable), "from kserve_storage import Storage")  # the PyPI package, 0.16+
KSERVE_0_15 = (OLD_VENV / "bin" / "python", "from kserve.storage import Storage")  # inside `kserve` up to 0.15


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def the(path: Path, kind: str) -> dict:
    (obj,) = [doc for doc in documents(path) if doc["kind"] == kind]
    return obj


def inference_services() -> list[dict]:
    """Every InferenceService of manifests/ served by this project's runtime."""
    runtime = the(RUNTIME, "ClusterServingRuntime")["metadata"]["name"]
    return [doc for path in sorted(MANIFESTS.rglob("*.yaml")) for doc in documents(path)
            if isinstance(doc, dict) and doc.get("kind") == "InferenceService"
            and doc["spec"]["predictor"].get("model", {}).get("runtime") == runtime]


STORAGE_URIS = sorted({isvc["spec"]["predictor"]["model"]["storageUri"] for isvc in inference_services()})


def triton_pod() -> dict:
    return the(TRITON / "deployment.yaml", "Deployment")["spec"]["template"]["spec"]


def initializer_image_version() -> str:
    (init,) = triton_pod()["initContainers"]
    repository, _, tag = init["image"].rpartition(":")
    assert repository == "kserve/storage-initializer", init["image"]
    return tag.removeprefix("v")


# --- The S3 server and the bucket ------------------------------------------------------------


def bucket_prefixes() -> set[str]:
    (init,) = triton_pod()["initContainers"]
    uris = {*STORAGE_URIS, init["args"][0]}
    assert all(uri.startswith(f"s3://{BUCKET}/") for uri in uris), uris
    return {uri.removeprefix(f"s3://{BUCKET}/") for uri in uris}


@pytest.fixture(scope="module")
def s3(tmp_path_factory) -> str:
    """moto's S3 server on a free loopback port; the bucket holds the repository under every URI the
    manifests name, and beside each `.../vN/` a later `.../vN0/` (which a URI without its trailing
    slash would fetch too: S3 lists by prefix). Yields the endpoint as host:port."""
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    server = start([str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)], log, port, name="moto", ready="/")
    endpoint = server.http
    client = boto3.client("s3", endpoint_url=f"http://{endpoint}", aws_access_key_id=ACCESS_KEY,
                          aws_secret_access_key=SECRET_KEY, region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    for prefix in bucket_prefixes():
        for name in REPOSITORY_FILES:
            client.upload_file(str(REPOSITORY / name), BUCKET, prefix + name)
        client.put_object(Bucket=BUCKET, Key=prefix.rstrip("/") + "0/yolov8n/1/model.onnx", Body=b"another version")
    yield endpoint
    stop_server(server)


def isolated_env(tmp_path: Path, variables: dict[str, str]) -> dict[str, str]:
    """This process's environment without any AWS setting of the machine, plus `variables`."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("AWS_")}
    env |= {"HOME": str(tmp_path), "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}
    return env | variables


def kserve_s3_env(endpoint: str) -> dict[str, str]:
    """What KServe's credential builder sets on its storage initializer for a service account whose
    Secret holds awsAccessKeyID / awsSecretAccessKey and is annotated serving.kserve.io/s3-endpoint:
    <host:port>, serving.kserve.io/s3-usehttps: "0" (kserve pkg/credentials/s3/s3_secret.go
    BuildSecretEnvs, utils.go BuildS3EnvVars)."""
    return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "S3_USE_HTTPS": "0", "S3_ENDPOINT": endpoint, "AWS_ENDPOINT_URL": f"http://{endpoint}"}


def download(initializer: tuple[Path, str], uri: str, destination: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`Storage.download(uri, destination)` of that initializer code, in its own process."""
    python, import_storage = initializer
    code = f"import sys\n{import_storage}\nStorage.download(sys.argv[1], sys.argv[2])"
    return subprocess.run([str(python), "-c", code, uri, str(destination)], env=env, capture_output=True, text=True, timeout=120)


def files(directory: Path) -> set[str]:
    return {str(path.relative_to(directory)) for path in directory.rglob("*") if path.is_file()}


@pytest.fixture(scope="session")
def old_initializer() -> tuple[Path, str]:
    """kserve 0.15.2's storage code, the code of kserve/storage-initializer:v0.15.2 (make's stamped
    target: a no-op once built)."""
    subprocess.run(["make", "--no-print-directory", "-s", str((OLD_VENV / ".installed").relative_to(ROOT))], cwd=ROOT, check=True)
    return KSERVE_0_15


def test_the_old_initializer_is_the_version_the_triton_deployment_names(old_initializer):
    python, _ = old_initializer
    shown = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('kserve'))"],
                           capture_output=True, text=True, check=True)
    assert shown.stdout.strip() == initializer_image_version()


def test_the_old_initializer_makes_only_the_last_directory_of_its_destination(s3, old_initializer, tmp_path):
    """Why the Deployment downloads into its volume's mount itself: up to KServe 0.18,
    Storage.download creates its destination with os.mkdir."""
    (tmp_path / "models").mkdir()  # the volume's mount exists; the model's directories do not
    uri = f"s3://{BUCKET}/{sorted(bucket_prefixes())[0]}yolov8n/1/"
    env = isolated_env(tmp_path, kserve_s3_env(s3))
    failed = download(old_initializer, uri, tmp_path / "models" / "yolov8n" / "1", env)
    assert failed.returncode != 0
    assert "FileNotFoundError" in failed.stderr
    assert download(KSERVE_STORAGE, uri, tmp_path / "new" / "yolov8n" / "1", env).returncode == 0  # 0.21 makes them


# --- Inference: the result compared with ONNX Runtime's on the same input ------------------------


def expected(images: np.ndarray) -> np.ndarray:
    session = onnxruntime.InferenceSession(str(REPOSITORY / "yolov8n" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    return session.run(["output0"], {"images": images})[0]


def infer_once(server) -> None:
    images = np.random.default_rng(0).random((1, 3, 640, 640), dtype=np.float32)
    answer = infer(server, "yolov8n", {"images": images}, outputs=["output0"])
    np.testing.assert_allclose(answer["output0"], expected(images), rtol=1e-4, atol=1e-4)


# --- InferenceService: storageUri -> /mnt/models -> the runtime's args ---------------------------


@pytest.mark.parametrize("initializer", [KSERVE_STORAGE, KSERVE_0_15], ids=["kserve-storage-0.21", "kserve-0.15.2"])
@pytest.mark.parametrize("uri", STORAGE_URIS)
def test_kserve_downloads_exactly_the_repository_under_the_storage_uri(s3, old_initializer, tmp_path, initializer, uri):
    mount = tmp_path / "mnt" / "models"  # the emptyDir KServe mounts there before the initializer runs
    mount.mkdir(parents=True)
    done = download(initializer, uri, mount, isolated_env(tmp_path, kserve_s3_env(s3)))
    assert done.returncode == 0, done.stderr
    assert files(mount) == REPOSITORY_FILES
    for name in REPOSITORY_FILES:
        assert (mount / name).read_bytes() == (REPOSITORY / name).read_bytes()


@pytest.mark.parametrize("uri", STORAGE_URIS)
def test_the_runtime_serves_what_kserve_downloaded(s3, tmp_path, uri):
    mount = tmp_path / "mnt" / "models"
    mount.mkdir(parents=True)
    done = download(KSERVE_STORAGE, uri, mount, isolated_env(tmp_path, kserve_s3_env(s3)))
    assert done.returncode == 0, done.stderr

    (container,) = the(RUNTIME, "ClusterServingRuntime")["spec"]["containers"]
    assert "--model_dir=/mnt/models" in container["args"]
    ports = {flag: free_port() for flag in ("--http_port", "--grpc_port", "--metrics_port")}
    args = substitute(container["args"], {"--model_dir": str(mount), **{flag: str(port) for flag, port in ports.items()}})
    server = start([str(Path(sys.executable).with_name("kserve-ascend")), *args], tmp_path / "runtime.log", ports["--http_port"],
                   name="kserve-ascend", ready=container["readinessProbe"]["httpGet"]["path"], timeout=120)
    try:
        infer_once(server)
    finally:
        stop_server(server)


# --- The Triton Deployment: its init container, its volumes, its server ---------------------------


class Pod:
    """The Deployment's pod on this machine: each volume a directory, each container path the
    directory of the volume mounted there (the longest mountPath that contains it)."""

    def __init__(self, spec: dict, root: Path):
        self.spec, self.root = spec, root
        for volume in spec["volumes"]:
            assert set(volume) <= {"name", "emptyDir", "configMap"}, volume
            (root / volume["name"]).mkdir(parents=True)

    def path(self, container: dict, path: str) -> Path:
        mounts = [m for m in container["volumeMounts"] if not m.get("subPath")]
        mount = max((m for m in mounts if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")),
                    key=lambda m: len(m["mountPath"]))
        return self.root / mount["name"] / posixpath.relpath(path, mount["mountPath"])

    def mount_config_maps(self, container: dict) -> None:
        """A ConfigMap key mounted by subPath over a file of another volume: that file replaced."""
        config_maps = {v["name"]: v["configMap"]["name"] for v in self.spec["volumes"] if "configMap" in v}
        for mount in container["volumeMounts"]:
            if mount["name"] in config_maps and mount.get("subPath"):
                data = the(TRITON / "configmap.yaml", "ConfigMap")
                assert data["metadata"]["name"] == config_maps[mount["name"]]
                target = self.path(container, mount["mountPath"])
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(data["data"][mount["subPath"]])


def secret_env(container: dict, secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """The container's environment from its envFrom Secrets (and plain env values)."""
    env = {}
    for source in container.get("envFrom", []):
        env |= secrets[source["secretRef"]["name"]]
    return env | {item["name"]: item["value"] for item in container.get("env", [])}


def test_the_triton_deployment_downloads_with_its_initializer_and_serves(s3, old_initializer, tmp_path):
    pod = Pod(triton_pod(), tmp_path / "pod")
    (init,) = pod.spec["initContainers"]
    (server,) = pod.spec["containers"]

    # The v0.15.2 entrypoint takes exactly (source URI, destination) and calls Storage.download.
    source, destination = init["args"]
    (reference,) = [s["secretRef"] for s in init["envFrom"]]
    secrets = {reference["name"]: {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                                   "AWS_ENDPOINT_URL": f"http://{s3}"}}  # the Secret the Deployment's comment creates
    done = download(old_initializer, source, pod.path(init, destination), isolated_env(tmp_path, secret_env(init, secrets)))
    assert done.returncode == 0, done.stderr

    repository = flag_value(server["args"], "--model-repository")
    assert files(pod.path(server, repository)) == REPOSITORY_FILES
    pod.mount_config_maps(server)

    ports = {flag: free_port() for flag in ("--http-port", "--grpc-port", "--metrics-port")}
    args = substitute(server["args"], {"--model-repository": str(pod.path(server, repository)), **{f: str(p) for f, p in ports.items()}})
    command = [sys.executable, str(ROOT / "tools" / "run_triton.py"), f"--backend-directory={tmp_path / 'backends'}", *args]
    triton = start(command, tmp_path / "triton.log", ports["--http-port"], name="triton", ready=server["readinessProbe"]["httpGet"]["path"], timeout=180)
    try:
        infer_once(triton)
    finally:
        stop_server(triton)


def flag_value(args: list[str], flag: str) -> str:
    (value,) = [arg.partition("=")[2] for arg in args if arg.startswith(f"{flag}=")]
    return value
