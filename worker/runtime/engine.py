"""The one onnxruntime session of a process, shared by every inference thread (`run` is thread-safe).

Providers: CUDA first when it is available, else CPU. onnxruntime-gpu silently falls back to CPU
when CUDA libraries are missing, so the providers that are really active are read back from
`session.get_providers()`, logged and stored with the run; `require_gpu` turns a fallback into an error.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import numpy as np
import onnxruntime as ort

from worker.config import EngineConfig
from worker.errors import ModelError, ProviderError
from worker.host.cores import usable_cores
from worker.runtime.gpu import conflicting_builds, cuda_libraries_missing, cuda_missing, installed_onnxruntime_builds
from worker.runtime.model_output import ModelOutput, Paired
from worker.models.card import ModelCard

log = logging.getLogger(__name__)


# on a GPU, batches up to this size (cards with a dynamic batch): a small model's batch-1 run leaves most of
# the device idle. A starting point, not yet measured on a GPU (docs/gpu.md)
GPU_MAX_BATCH = 8


# intra-op threads per `run` call, on CPU and GPU alike: see default_threads
DEFAULT_INTRA_OP_THREADS = 1


def default_threads(cores: int | None = None, on_gpu: bool = False) -> tuple[int, int]:
    """(decode_workers, infer_workers) that do not oversubscribe the cores.

    On CPU, several single-threaded `run` calls in parallel beat one multi-threaded call
    (onnxruntime's intra-op pool flips between a fast and a slow state on small machines), so one inference
    thread per core, each run on DEFAULT_INTRA_OP_THREADS. On a GPU the model does not run on the cores: two
    inference threads (one gathers and uploads a batch while the other's runs), and the cores, but
    one for the finish and database threads, decode (up to 8).
    """
    n = cores or usable_cores()
    if on_gpu:
        return max(1, min(n - 1, 8)), 2
    return max(1, min(n, 4)), max(1, n)


def default_max_batch(on_gpu: bool) -> int:
    """`pipeline.max_batch: 0`: batch-1 runs on CPU (batches gained nothing there: docs/performance.md), batches on a GPU."""
    return GPU_MAX_BATCH if on_gpu else 1


# a sizes input's element type -> the numpy type it is given
_SIZE_TYPES: dict[str, type] = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
                                 "tensor(float16)": np.float16}


def _joined(outs: list[np.ndarray], names: list[str]) -> np.ndarray:
    """Outputs (N, K, d) or (N, K) joined along the last axis into (N, K, sum of d) float32: boxes (N, K, 4),
    scores (N, K) and labels (N, K) make (N, K, 6)."""
    parts = [(o[..., None] if o.ndim == 2 else o).astype(np.float32) for o in outs]
    if any(p.ndim != 3 or p.shape[:2] != parts[0].shape[:2] for p in parts):
        shapes = ", ".join(f"'{nm}' {list(o.shape)}" for nm, o in zip(names, outs))
        raise ModelError(f"outputs {shapes} cannot be joined: each must be (N, K) or (N, K, d) with the same N and K")
    return np.concatenate(parts, axis=-1)


# the model input's element type -> what the NCHW float32 batch is cast to (None: fed as it is)
_INPUT_TYPES: dict[str, type | None] = {"tensor(float)": None, "tensor(float16)": np.float16,
                                        "tensor(uint8)": np.uint8}


def wanted_providers(cfg: EngineConfig) -> list[str | tuple[str, dict[str, str]]]:
    """The providers (with their options) a session is asked for: what is active is read back from it."""
    cpu: list[str | tuple[str, dict[str, str]]] = ["CPUExecutionProvider"]
    if cfg.providers == "cpu":
        return cpu
    available = tuple(ort.get_available_providers())
    if (missing := cuda_missing(available)) is not None:
        if cfg.providers == "cuda" or cfg.require_gpu:
            raise ProviderError(f"CUDA requested but not available here ({missing}; onnxruntime's providers: "
                                f"{', '.join(available)})")
        if "CUDAExecutionProvider" in available:  # a GPU build on a machine without a GPU: said once, in one line
            _say_once(f"CUDA not available here ({missing}): running on CPU")
        return cpu
    cuda = {
        "device_id": str(cfg.device_id),
        "arena_extend_strategy": cfg.arena_extend_strategy,
        "cudnn_conv_algo_search": cfg.cudnn_conv_algo_search,
    }
    if cfg.gpu_mem_limit_mb:
        cuda["gpu_mem_limit"] = str(cfg.gpu_mem_limit_mb * 1024 * 1024)
    return [("CUDAExecutionProvider", cuda), *cpu]


@functools.cache  # once per process, however many sessions it makes (the bench makes several)
def _say_once(line: str) -> None:
    log.info(line)


class Engine:
    def __init__(self, onnx_path: Path, cfg: EngineConfig, intra_op_threads: int, input_name: str = "",
                 output_name: str = "", layout: str = "nchw", channels: int = 3, outputs: tuple[str, ...] = (),
                 sizes_input: str = "", unloadable: str = "", masks: str = "") -> None:
        """`layout`: the model input's axis order, nchw or nhwc (TensorFlow exports); `run` takes NCHW
        float32 either way and gives the input the model's layout and element type (float, float16, uint8).
        `channels`: what the card's preprocessing makes, 1 (gray) or 3 (check_input holds the model to it).
        `outputs`: several outputs that `run` joins along their last axis (a card's `postprocess.outputs`),
        instead of `output_name`'s one. `sizes_input`: a second input given each image's (width, height),
        the network input's (a card's `input.sizes`). `unloadable`: said after onnxruntime's words when it
        cannot load the file (how to mend it). `masks`: an instance segmenter's prototype masks, which `run`
        gives with the rows as a `Paired` (a card's `postprocess.masks`)."""
        if (warning := conflicting_builds(installed_onnxruntime_builds())) is not None:
            log.warning(warning)
        self.device_id = cfg.device_id
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = intra_op_threads
        opts.inter_op_num_threads = 1
        # decode threads and spinning intra-op threads fight for the same cores
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.log_severity_level = 3
        opts.enable_cpu_mem_arena = cfg.cpu_mem_arena
        wanted = wanted_providers(cfg)
        try:
            self.session = ort.InferenceSession(str(onnx_path), sess_options=opts, providers=wanted)
        except Exception as e:
            raise ModelError(f"{onnx_path}: onnxruntime cannot load it: {e}{unloadable}") from None
        self.providers: list[str] = self.session.get_providers()
        # what the exporter wrote of the model (Ultralytics: task, kpt_shape, end2end, names), read once
        self.metadata: dict[str, str] = dict(self.session.get_modelmeta().custom_metadata_map)
        log.info("onnxruntime %s, active providers: %s", ort.__version__, ", ".join(self.providers))
        if "CUDAExecutionProvider" not in self.providers and len(wanted) > 1:  # asked for, and it did not start
            why = cuda_libraries_missing() or "see onnxruntime's message above"
            if cfg.require_gpu:
                raise ProviderError(f"engine.require_gpu is set but CUDA is not active ({why}; active: "
                                    f"{', '.join(self.providers)})")
            _say_once(f"CUDA did not start ({why}): running on CPU")
        elif cfg.require_gpu and "CUDAExecutionProvider" not in self.providers:
            raise ProviderError(f"engine.require_gpu is set but CUDA is not active (active: {', '.join(self.providers)})")
        inputs = self.session.get_inputs()
        model_outputs = self.session.get_outputs()
        names = [i.name for i in inputs]
        self.input_name = input_name or (names[0] if names[0] != sizes_input else names[-1])
        # what each run fetches: the output (or outputs joined into one), then any prototype masks
        self.output_names = [*(list(outputs) or [output_name or model_outputs[0].name]), *([masks] if masks else [])]
        self.masks = masks
        for name in (self.input_name, *([sizes_input] if sizes_input else [])):
            if name not in names:
                raise ModelError(f"{onnx_path}: no input named '{name}' (has {names})")
        for name in self.output_names:
            if name not in {o.name for o in model_outputs}:
                raise ModelError(f"{onnx_path}: no output named '{name}' (has {[o.name for o in model_outputs]})")
        # what a card that contradicts its model may be told about (an instance segmenter's mask prototypes)
        self.other_outputs: tuple[tuple[str, tuple[int | str, ...]], ...] = tuple(
            (o.name, tuple(o.shape)) for o in model_outputs if o.name not in self.output_names)
        if set(names) - {self.input_name, sizes_input}:  # onnxruntime would refuse every run for the inputs left out
            listed = ", ".join(f"'{i.name}' {list(i.shape)}" for i in inputs)
            hint = " (one that takes image sizes, as RT-DETR's orig_target_sizes: name it in input.sizes)" \
                if len(names) == 2 and not sizes_input else ""
            raise ModelError(f"{onnx_path}: the model has {len(inputs)} inputs ({listed}); the worker feeds the "
                             f"image tensor and, when the card names it, an input of image sizes{hint}")
        self.sizes_input = sizes_input  # "" when the model takes the image alone
        self._sizes_type: type = np.int64  # what the sizes input is given, as the model declares it
        if sizes_input:
            spec = next(i for i in inputs if i.name == sizes_input)
            fixed_width = spec.shape[-1] if len(spec.shape) == 2 and isinstance(spec.shape[-1], int) else None
            if spec.type not in _SIZE_TYPES or len(spec.shape) != 2 or fixed_width not in (None, 2):
                raise ModelError(f"{onnx_path}: input '{sizes_input}' (the card's input.sizes) is {spec.type} "
                                 f"{list(spec.shape)}; the worker gives image sizes as (N, 2) width and height, "
                                 f"{', '.join(_SIZE_TYPES)}")
            self._sizes_type = _SIZE_TYPES[spec.type]
        model_input = next(i for i in inputs if i.name == self.input_name)
        self.input_shape, self.layout, self.channels = model_input.shape, layout, channels
        first = self.input_shape[0] if self.input_shape else None
        self.static_batch: int | None = first if isinstance(first, int) else None  # a batch fixed at export
        if model_input.type not in _INPUT_TYPES:
            raise ModelError(f"{onnx_path}: input '{self.input_name}' is {model_input.type}; the worker feeds "
                             f"{', '.join(_INPUT_TYPES)}")
        self._input_type = _INPUT_TYPES[model_input.type]

    @classmethod
    def for_card(cls, onnx_path: Path, cfg: EngineConfig, intra_op_threads: int, card: ModelCard) -> "Engine":
        """The engine as a model card describes its model's inputs and outputs."""
        # a file `models pull` built (whole, or not at all) that cannot be loaded was damaged since (a failing
        # disk, an edit): building it again mends it
        built_from = card.source.package if card.source is not None else card.tflite_path()
        rebuild = "" if built_from is None else (f" (built from {built_from}: delete {onnx_path} and "
                                                 f"`worker models pull {card.name}` builds it again)")
        return cls(onnx_path, cfg, intra_op_threads, card.input.name, card.postprocess.output, card.input.layout,
                   card.preprocess.channels, card.postprocess.outputs, card.input.sizes, rebuild,
                   card.postprocess.masks)

    @property
    def dynamic_hw(self) -> bool:
        """The model takes inputs of any height and width (exported with dynamic axes)."""
        shape = self.input_shape
        if len(shape) != 4:
            return False
        hw = (shape[2], shape[3]) if self.layout == "nchw" else (shape[1], shape[2])
        return not all(isinstance(d, int) and d > 0 for d in hw)

    @property
    def on_gpu(self) -> bool:
        return "CUDAExecutionProvider" in self.providers

    def check_input(self, size_hw: tuple[int, int], name: str, rect: bool = False) -> None:
        """Fail at start, not on the first image, when the card's input size, layout or colour (the
        engine's `channels`) contradicts the model, or a rect letterbox meets a model of fixed size."""
        shape, channels = self.input_shape, self.channels
        if len(shape) != 4:
            raise ModelError(f"model '{name}': input '{self.input_name}' has rank {len(shape)}, expected "
                             f"{self.layout.upper()}")
        have, h, w = (shape[1], shape[2], shape[3]) if self.layout == "nchw" else (shape[3], shape[1], shape[2])
        if isinstance(have, int) and have != channels:
            other = "nhwc" if self.layout == "nchw" else "nchw"
            if shape[3 if other == "nhwc" else 1] == channels:
                hint = f" (it looks {other.upper()}: set input.layout: {other} in the card)"
            elif have in (1, 3):
                hint = (" (a one-channel model: set preprocess.color: gray in the card)" if have == 1 else
                        " (a colour model: set preprocess.color: rgb or bgr in the card)")
            else:
                hint = ""
            raise ModelError(f"model '{name}': input '{self.input_name}' {list(shape)} has {have} channels "
                             f"where the card's layout {self.layout} puts them, not {channels}{hint}")
        for dim, want, what in ((h, size_hw[0], "height"), (w, size_hw[1], "width")):
            if isinstance(dim, int) and dim != want:
                raise ModelError(f"model '{name}': card says input {what} {want}, the ONNX file says {dim}")
        if rect and isinstance(h, int) and isinstance(w, int):
            raise ModelError(f"model '{name}': preprocess.rect gives each image an input of its own aspect, but "
                             f"input '{self.input_name}' {list(shape)} takes {h}x{w} only: leave rect out (or "
                             f"export the model with dynamic height and width)")

    def run(self, batch: np.ndarray) -> ModelOutput:
        """(N, C, H, W) float32 -> the selected output, (N, ...) (float32 where the model gives float16);
        with several outputs, them joined along their last axis as float32, an (N, K) one as one column;
        with prototype masks (`masks`), that and them as a Paired."""
        return self.outputs(self.session.run(self.output_names, self.feeds(batch)), len(batch))

    def feeds(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        """(N, C, H, W) float32 -> what a session of this model takes: the batch in the model's layout and
        element type, and the sizes input where the card names one (for `run`, and for the bench's
        sessions of the same model). A model exported with a fixed batch (say 4) gets the N images and
        zeros after them: a lone image in watch mode would otherwise fail."""
        fixed = self.static_batch
        if fixed is not None and len(batch) < fixed:
            batch = np.concatenate([batch, np.zeros((fixed - len(batch), *batch.shape[1:]), batch.dtype)])
        feeds: dict[str, np.ndarray] = {}
        if self.sizes_input:  # the network input's (width, height) for every image: boxes in its pixels
            feeds[self.sizes_input] = np.tile(np.array([batch.shape[3], batch.shape[2]], self._sizes_type),
                                              (len(batch), 1))
        if self.layout == "nhwc":
            batch = np.ascontiguousarray(batch.transpose(0, 2, 3, 1))
        if self._input_type is np.uint8:  # raw pixels: the card's mean 0 and std 1 leave them 0-255
            batch = np.clip(np.rint(batch), 0, 255).astype(np.uint8)
        elif self._input_type is not None:
            batch = batch.astype(self._input_type)
        feeds[self.input_name] = batch
        return feeds

    def outputs(self, outs: list[np.ndarray], n: int) -> ModelOutput:
        """A session's outputs (`output_names`, in order) -> the first n images' result, as `run` gives it."""
        outs = [out[:n] for out in outs]
        if self.masks:
            *rows, protos = outs
            if protos.ndim != 4:
                raise ModelError(f"output '{self.masks}' {list(protos.shape)} (the card's postprocess.masks) is not "
                                 f"prototype masks, (N, M, h, w)")
            return Paired(self._one(rows), protos.astype(np.float32, copy=False))
        return self._one(outs)

    def _one(self, outs: list[np.ndarray]) -> np.ndarray:
        if len(outs) == 1:
            return outs[0].astype(np.float32) if outs[0].dtype == np.float16 else outs[0]
        return _joined(outs, self.output_names)

    def warm_up(self, batch_size: int, size_hw: tuple[int, int]) -> None:
        """One run at the largest batch before intake starts, so the first image sees no cold start."""
        self.run(np.zeros((batch_size, self.channels, *size_hw), dtype=np.float32))
