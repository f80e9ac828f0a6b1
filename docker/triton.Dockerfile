# syntax=docker/dockerfile:1
# Triton Inference Server with the `ascend` backend (manifests/triton: image kserve-ascend-triton:0.1.0),
# on the kserve-ascend image (docker/kserve.Dockerfile: CANN, Python 3.11, the core, onnxruntime-cann):
#   docker build -f docker/kserve.Dockerfile -t kserve-ascend:0.1.0 .
#   docker build -f docker/triton.Dockerfile -t kserve-ascend-triton:0.1.0 .
# Triton is 2.51 from the nvidia-pytriton wheel, the server `make test` runs: it carries the
# python backend and its stub for Python 3.11 (NVIDIA's Triton images bring neither CANN nor this Python).
ARG KSERVE_ASCEND_IMAGE=kserve-ascend:0.1.0
FROM ${KSERVE_ASCEND_IMAGE}

# The stub links libpython3.11.so, which the CANN image keeps outside the linker's path.
# pytriton beside the `ascend` extra keeps `pip check` clean (its tritonclient is the core's).
RUN pip install --no-cache-dir "nvidia-pytriton==0.7.0" \
 && pip check \
 && python -c "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))" > /etc/ld.so.conf.d/python.conf \
 && ldconfig

WORKDIR /opt/kserve-ascend
COPY triton_backend/ascend/model.py ./triton_backend/ascend/model.py
COPY tools/run_triton.py ./tools/run_triton.py

EXPOSE 8000 8001 8002
# Assembles the backend directory (python backend + ascend) and execs tritonserver:
# its own flags (--model-repository, --http-port, ...), then tritonserver's after `--`.
ENTRYPOINT ["python", "/opt/kserve-ascend/tools/run_triton.py"]
