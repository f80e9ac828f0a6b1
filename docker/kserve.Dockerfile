# syntax=docker/dockerfile:1
# The kserve-ascend KServe runtime image (manifests/base: image kserve-ascend:0.1.0).
#   docker build -f docker/kserve.Dockerfile -t kserve-ascend:0.1.0 .
#   docker build -f docker/kserve.Dockerfile --build-arg CANN_IMAGE=quay.io/ascend/cann:8.2.rc1-310p-ubuntu22.04-py3.11 -t kserve-ascend:0.1.0-310p .
# The base is Ascend's CANN container image (github.com/Ascend/cann-container-image, also
# ascendai/cann on Docker Hub and on AscendHub), tagged <cann>-<chip>-<os>-<python>: CANN
# toolkit with pyACL, Python 3.11, and the toolkit's environment set by ENV. Pick the chip of
# your NPUs; the NPU driver comes from the host (Ascend Docker Runtime, with Ascend's device plugin).
# CANN 8.2 is the CANN onnxruntime's CANN EP documentation pairs with the onnxruntime-cann release
# that pyproject.toml's `ascend` extra pins (1.22.1): keep the two in step.
ARG CANN_IMAGE=quay.io/ascend/cann:8.2.rc1-910b-ubuntu22.04-py3.11
FROM ${CANN_IMAGE}

WORKDIR /opt/kserve-ascend
COPY pyproject.toml README.md ./
COPY kserve_ascend ./kserve_ascend
COPY tools/check_ascend_host.py ./tools/check_ascend_host.py
# The `ascend` extra: onnxruntime-cann alone (the CPU onnxruntime owns the same `onnxruntime`
# package and is in the `cpu` extra, not installed here).
RUN pip install --no-cache-dir '.[ascend]' && pip check

# Not root: HwHiAiUser, the NPU driver's running user and group (Ascend's installation guide), with
# the ids of the hosts' HwHiAiUser, which a non-root container must share to open the NPU (Ascend
# MindEdge's container guide: build with --build-arg HWHIAIUSER_UID=$(id -u HwHiAiUser) and
# HWHIAIUSER_GID=$(id -g HwHiAiUser); 1000 as in Ascend's own images, e.g. ascend-device-plugin's).
# Numeric in USER, so that Kubernetes can check runAsNonRoot; manifests/ run as the same ids.
# The installed files stay root's, readable by all; CANN writes its logs and caches under $HOME.
ARG HWHIAIUSER_UID=1000
ARG HWHIAIUSER_GID=1000
RUN groupadd -g ${HWHIAIUSER_GID} HwHiAiUser \
 && useradd -u ${HWHIAIUSER_UID} -g HwHiAiUser -m -d /home/HwHiAiUser -s /usr/sbin/nologin HwHiAiUser
USER ${HWHIAIUSER_UID}:${HWHIAIUSER_GID}

# REST, gRPC and Prometheus as the ServingRuntime runs them (manifests/base: --metrics_port=8082,
# off the 9090/9091 of Knative's queue-proxy in the same pod).
EXPOSE 8080 8081 8082
# Verify a host with this image (CANN, pyACL, an NPU, the CANN EP, one model served):
#   docker run --rm --device ... --entrypoint python kserve-ascend:0.1.0 tools/check_ascend_host.py
ENTRYPOINT ["kserve-ascend"]
