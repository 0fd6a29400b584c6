"""Model cards and how their ONNX files are obtained."""
