"""The model at run time: the one shared onnxruntime session, what a model gives back, and the GPU it may run on."""
