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
# kserve-ascend in a virtual environment of its own, first on PATH. CANN's image pip-installs
# CANN's Python dependencies with numpy==1.24.0 and protobuf==3.20 (cann/8.2.rc1-910b-ubuntu22.04-py3.11/
# Dockerfile in Ascend/cann-container-image), which kserve 0.21 (numpy>=1.26) and tritonclient 2.73
# (protobuf>=6.30) cannot meet: tests/test_image_python.py shows the conflict and resolves this
# install beside those pins. CANN's own tools keep them (they run the image's python3); this
# environment's numpy and protobuf come first on sys.path in the server. --system-site-packages:
# CANN's operator compiler (te/tbe, on CANN's PYTHONPATH) runs inside the server when the CANN
# execution provider compiles a graph and imports what CANN installed (sympy, decorator, attrs,
# psutil, scipy, ...) from there. The `ascend` extra is onnxruntime-cann alone (the CPU onnxruntime
# owns the same `onnxruntime` package and is in the `cpu` extra, not installed here).
ENV VIRTUAL_ENV=/opt/kserve-ascend/venv
ENV PATH=${VIRTUAL_ENV}/bin:${PATH}
RUN python3 -m venv --system-site-packages ${VIRTUAL_ENV} \
 && pip install --no-cache-dir '.[ascend]' \
 && pip check

# Not root: HwHiAiUser, the NPU driver's running user and group (Ascend's installation guide), with
# the ids of the hosts' HwHiAiUser, which a non-root container must share to open the NPU (Ascend
# MindEdge's container guide: build with --build-arg HWHIAIUSER_UID=$(id -u HwHiAiUser) and
# HWHIAIUSER_GID=$(id -g HwHiAiUser); 1000 as in Ascend's own images, e.g. ascend-device-plugin's).
# The device nodes (/dev/davinci*, davinci_manager, devmm_svm, hisi_hdc) and the driver's libraries
# are the host's HwHiAiUser group's: the group in USER is the process's group, and its only one
# ("the user will have only the specified group membership", Dockerfile reference, USER); the
# server names a node or library it cannot open, with the gid it needs (core/execution/npu_access.py).
# Numeric in USER, so that Kubernetes can check runAsNonRoot; manifests/ run as the same ids.
# The installed files stay root's, readable by all, and the working directory is root's: what the
# server writes goes under $HOME, /home/HwHiAiUser: the CANN execution provider's compiled models
# in ~/.cache/kserve-ascend (core/execution/compile_cache.py; KSERVE_ASCEND_CACHE_DIR moves it), CANN's logs in
# ~/ascend/log. With a read-only root file system, mount a writable volume on /home/HwHiAiUser.
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
