"""kserve-ascend: Ascend NPU model serving for KServe and Triton over Open Inference Protocol v2."""

__version__ = "0.1.0"
