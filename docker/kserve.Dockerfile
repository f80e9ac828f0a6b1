# syntax=docker/dockerfile:1
# The kserve-ascend KServe runtime image (manifests/base: image kserve-ascend:0.1.0).
#   docker build -f docker/kserve.Dockerfile -t kserve-ascend:0.1.0 .
#   docker build -f docker/kserve.Dockerfile --build-arg CANN_IMAGE=quay.io/ascend/cann:8.2.rc1-310p-ubuntu22.04-py3.11 -t kserve-ascend:0.1.0-310p .
# The base is Ascend's CANN container image (github.com/Ascend/cann-container-image, also
# ascendai/cann on Docker Hub and on AscendHub), tagged <cann>-<chip>-<os>-<python>: CANN
# toolkit with pyACL, Python 3.11, and the toolkit's environment set by ENV. Pick the chip of
# your NPUs; the NPU driver comes from the host (Ascend Docker Runtime, with Ascend's device plugin).
ARG CANN_IMAGE=quay.io/ascend/cann:8.2.rc1-910b-ubuntu22.04-py3.11
FROM ${CANN_IMAGE}

WORKDIR /opt/kserve-ascend
COPY pyproject.toml README.md ./
COPY kserve_ascend ./kserve_ascend
# onnxruntime-cann (the CANN execution provider) and onnxruntime install the same `onnxruntime`
# package: the CPU build is removed before the CANN build goes in (pyproject.toml's `ascend` extra).
RUN pip install --no-cache-dir . \
 && pip uninstall --yes onnxruntime \
 && pip install --no-cache-dir "onnxruntime-cann>=1.18"

# REST, gRPC, Prometheus (the ServingRuntime moves metrics to 8082, off Knative's queue-proxy ports).
EXPOSE 8080 8081 9090
ENTRYPOINT ["kserve-ascend"]
