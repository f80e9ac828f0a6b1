# syntax=docker/dockerfile:1
# Triton Inference Server with the `ascend` backend (manifests/triton: image kserve-ascend-triton:0.1.0),
# on the kserve-ascend image (docker/kserve.Dockerfile: CANN, Python 3.11, the core, onnxruntime-cann):
#   docker build -f docker/kserve.Dockerfile -t kserve-ascend:0.1.0 .
#   docker build -f docker/triton.Dockerfile -t kserve-ascend-triton:0.1.0 .
# Triton is 2.51 from the nvidia-pytriton wheel, the server `make test` runs: it carries the
# python backend and its stub for Python 3.11 (NVIDIA's Triton images bring neither CANN nor this Python).
ARG KSERVE_ASCEND_IMAGE=kserve-ascend:0.1.0
FROM ${KSERVE_ASCEND_IMAGE}

# The base image runs as HwHiAiUser: installing takes root, then the same user again.
USER root
# The stub links libpython3.11.so, which the CANN image keeps outside the linker's path.
# pytriton goes into kserve-ascend's environment (the `pip` first on PATH), beside the `ascend`
# extra: `pip check` stays clean (its tritonclient is the core's).
RUN pip install --no-cache-dir "nvidia-pytriton==0.7.0" \
 && pip check \
 && python -c "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))" > /etc/ld.so.conf.d/python.conf \
 && ldconfig

WORKDIR /opt/kserve-ascend
COPY triton_backend/ascend/model.py ./triton_backend/ascend/model.py
COPY tools/run_triton.py ./tools/run_triton.py
# Triton laid out as in NVIDIA's images, for whatever runs `tritonserver` itself (Seldon Core 2's
# triton ServerConfig: /opt/tritonserver/bin/tritonserver up to 2.6, `tritonserver` from PATH since
# 2.7): /opt/tritonserver/backends (python + ascend), Triton's default --backend-directory, and
# /opt/tritonserver/bin/tritonserver, which runs the wheel's Triton with the arguments it is given
# and the library path and PATH the python backend's stub needs. Root's, read-only for the user.
# The ascend backend is laid out as `onnxruntime` too, so config-less model.onnx folders serve as on the
# KServe server (docs/triton.md; --no-onnxruntime-as-ascend after --install leaves it out).
RUN python tools/run_triton.py --install /opt/tritonserver
ENV PATH=/opt/tritonserver/bin:${PATH}
# run_triton.py assembles the backends afresh on every start in its default --backend-directory,
# build/triton_backends beside tools/: the one directory the server writes, so the user's.
ARG HWHIAIUSER_UID=1000
ARG HWHIAIUSER_GID=1000
RUN install -d -o ${HWHIAIUSER_UID} -g ${HWHIAIUSER_GID} build/triton_backends
USER ${HWHIAIUSER_UID}:${HWHIAIUSER_GID}

EXPOSE 8000 8001 8002
# Assembles the backend directory (python backend + ascend) and execs tritonserver:
# its own flags (--model-repository, --http-port, ...), then tritonserver's after `--`.
# A container `command` of `tritonserver ...` bypasses it and runs /opt/tritonserver's.
ENTRYPOINT ["python", "/opt/kserve-ascend/tools/run_triton.py"]
