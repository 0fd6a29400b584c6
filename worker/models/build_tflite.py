"""Build an ONNX file from a float TensorFlow Lite model (MediaPipe's selfie segmenter and models like it).

The graph is rebuilt operator by operator with every 4-D tensor in NCHW, ONNX's layout for
convolutions, between one Transpose after the input and one before each 4-D output, so the ONNX file
takes and gives the same channels-last tensors, under the same names, as the .tflite file. Tensors of
other ranks keep TFLite's layout; RESHAPE and FULLY_CONNECTED, whose meaning depends on the order of
the elements, see a 4-D input back in NHWC. Float16 weights (DEQUANTIZE of a constant) are widened to
float32 here, as TFLite's CPU kernels do at load time; sparse ones come dense from the reader, and
their DENSIFY is folded the same way. TensorFlow's SAME padding (the extra row and column, when odd, at
the bottom and right) becomes explicit pads.

Supported: the operators listed in `_OPS` (worker/models/tflite_ops.py) and MediaPipe's custom `Convolution2DTransposeBias`, on
float32 activations with static spatial sizes; anything else stops the build naming the operator.
"""

from __future__ import annotations

from pathlib import Path

from worker.errors import ModelError
from worker.models.tflite_file import TfliteModel, read
from worker.models.tflite_ops import TfliteOperators


def build(files: dict[str, Path], dest: Path) -> None:
    """`files["model"]`: the .tflite file; writes the ONNX file to dest."""
    source = files["model"]
    try:
        converter = _Converter(read(source), source.name)
    except (IndexError, KeyError, ValueError, TypeError) as e:  # a graph the reader took but that does not hold together
        raise ModelError(f"{source.name}: cannot convert it: {type(e).__name__}: {e}") from None
    converter.save(dest)


class _Converter(TfliteOperators):
    """A model's graph, its operators converted in order."""

    def __init__(self, model: TfliteModel, source: str) -> None:
        super().__init__(model, source)
        for op in model.operators:
            self._convert(op)
