"""worker: a hot-folder ONNX inference worker."""

__version__ = "0.1.0"
