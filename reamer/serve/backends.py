"""Inference backends (ONNX Runtime, OpenVINO) behind one small interface.

Thread counts are always explicit: the runtimes size their pools from the machine, not from the
process's cpuset or cgroup quota. ONNX Runtime spinning is off (cores may be shared), and OpenVINO's
own thread pinning is off (reamer pins the process). The runtimes are imported only when a backend is
opened, so a worker can set its CPU affinity first.

Precision: "f32" (the default) computes as the model file says, so OpenVINO's answers match ONNX
Runtime's; "bf16" lets OpenVINO compute in bfloat16 where the CPU supports it (its own default on such
CPUs). OpenVINO falls back to f32 silently where the CPU has no bf16, so a backend reports the precision
it actually runs (`Backend.precision`), read back from the compiled model, never the one asked for.
ONNX Runtime's CPU provider has no bf16 path: it always computes in f32.

String (BYTES) tensors are numpy object arrays of str, served with ONNX Runtime (OpenVINO is refused for them,
see reamer.serve.model_types). ONNX Runtime sessions register onnxruntime-extensions' custom-op library when
that package is installed, and the libraries named in REAMER_CUSTOM_OP_LIBRARIES (the agent sets it from
inference.custom_op_libraries).
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from reamer.host.errors import ReamerError
from reamer.plan.layout import BACKENDS  # the one list of backends
from reamer.serve.model_types import CUSTOM_OP_LIBRARIES_ENV, custom_op_libraries, extensions_library
from reamer.serve.spec import DEFAULT_PRECISION, PRECISION_FIX, PRECISIONS
from reamer.serve.protocol.tensors import (BadBytesTensor, TensorInfo, UnsupportedDatatype, as_text_array, numpy_to_v2,
                                  ort_type_to_v2, v2_to_numpy)

__all__ = ["BACKENDS", "CUSTOM_OP_LIBRARIES_ENV", "DEFAULT_PRECISION", "PRECISIONS", "Backend", "BackendError",
           "TensorInfo", "UnservableModel", "check_precision", "compute_precision", "custom_op_libraries",
           "effective_precision", "extensions_library", "open_backend", "sample_inputs"]

class BackendError(ReamerError):
    """A backend cannot be opened, or a request does not fit the model."""


class UnservableModel(BackendError):
    """A model the backend opens but cannot serve as it is (an input or output that is not a tensor, a custom
    operator no loaded library provides, ...): its fix is exact, and another backend is no answer."""


def check_precision(value: object) -> str:
    """`value` if it is a precision reamer knows ("f32" | "bf16"), else a BackendError naming the fix."""
    if value not in PRECISIONS:
        raise BackendError(f"unknown precision {value!r}: reamer knows {', '.join(PRECISIONS)}", PRECISION_FIX)
    return str(value)


def compute_precision(kind: str, precision: str) -> str:
    """The precision `kind` is asked to compute in for a job at `precision`: ONNX Runtime has only f32."""
    return check_precision(precision) if kind == "openvino" else DEFAULT_PRECISION


def effective_precision(kind: str, precision: str) -> str:
    """What `kind` computes in on this host when a job asks for `precision`, without loading a model: OpenVINO's
    CPU plugin resolves the hint as it does for a compiled model (f32 where the CPU has no native bf16)."""
    if compute_precision(kind, precision) == DEFAULT_PRECISION:
        return DEFAULT_PRECISION
    import openvino as ov
    import openvino.properties.hint as hints

    core = ov.Core()
    core.set_property("CPU", {hints.inference_precision(): ov.Type.bf16})
    return _precision_name(core.get_property("CPU", hints.inference_precision()))


class Backend(ABC):
    """One loaded model, ready to run batches on this process's CPUs."""

    kind: str
    model_path: str
    threads: int
    streams: int = 1
    precision: str = DEFAULT_PRECISION  # the precision it computes in (effective, not the one asked for)
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch: every model input by name; returns every output by name."""
        return self._run(self._check_inputs(inputs))

    @abstractmethod
    def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> "Backend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _expected(self) -> str:
        return "; ".join(f"{t.name}: {t.datatype} {t.shape}" for t in self.inputs)

    def _check_inputs(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = {t.name for t in self.inputs}
        given = set(inputs)
        if given != names:
            missing, extra = sorted(names - given), sorted(given - names)
            problem = ", ".join(p for p in (f"missing {missing}" if missing else "",
                                            f"unexpected {extra}" if extra else "") if p)
            raise BackendError(f"model {os.path.basename(self.model_path)}: wrong input names ({problem})",
                               f"send exactly these inputs — {self._expected()}")
        checked: dict[str, np.ndarray] = {}
        batch: int | None = None
        for info in self.inputs:
            arr = np.asarray(inputs[info.name])
            ok_rank = arr.ndim == len(info.shape)
            ok_dims = ok_rank and all(want in (-1, got) for want, got in zip(info.shape, arr.shape))
            if not ok_dims:
                raise BackendError(
                    f"model {os.path.basename(self.model_path)}: input {info.name!r} has shape {list(arr.shape)}, "
                    f"expected {info.shape} (-1 = any size)",
                    f"send inputs with these shapes — {self._expected()}")
            if arr.ndim and info.shape[0] == -1:
                if batch is not None and arr.shape[0] != batch:
                    raise BackendError(
                        f"inputs disagree on the batch size ({batch} vs {arr.shape[0]} for {info.name!r})",
                        "give every input the same first (batch) dimension")
                batch = arr.shape[0]
            want = v2_to_numpy(info.datatype)
            if info.datatype == "BYTES":  # the runtime takes str: bytes decoded, numpy 'U'/'S' arrays converted
                try:
                    checked[info.name] = as_text_array(arr, f"input {info.name!r}")
                except BadBytesTensor as exc:
                    raise BackendError(exc.message, exc.fix) from None
                continue
            if arr.dtype != want:
                if not np.can_cast(arr.dtype, want, casting="same_kind") and not (
                        arr.dtype.kind in "iub" and want.kind in "iuf"):
                    raise BackendError(
                        f"input {info.name!r} has dtype {arr.dtype}, expected {info.datatype}",
                        f"send {info.name!r} as {info.datatype}")
                arr = arr.astype(want)
            checked[info.name] = np.ascontiguousarray(arr)
        return checked


class OnnxRuntimeBackend(Backend):
    kind = "onnxruntime"

    def __init__(self, model_path: str, threads: int) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
        opts.log_severity_level = 3  # errors only: shape-merge warnings are noise here
        libraries = custom_op_libraries()
        for library in libraries:
            try:
                opts.register_custom_ops_library(library)
            except Exception as exc:  # noqa: BLE001 - ORT's own Fail type
                raise BackendError(f"ONNX Runtime cannot load the custom-op library {library}: {exc}",
                                   "fix or remove that path in the agent config's inference.custom_op_libraries "
                                   f"(or {CUSTOM_OP_LIBRARIES_ENV}), or reinstall onnxruntime-extensions") from None
        try:
            self._session = ort.InferenceSession(model_path, sess_options=opts, providers=["CPUExecutionProvider"])
        except Exception as exc:  # ORT raises its own exception types (Fail, InvalidGraph, ...)
            from reamer.serve.model_types import locale_problem, unregistered_op_problem

            text = str(exc)
            problem = unregistered_op_problem(text, model_path, libraries) or locale_problem(text)
            if problem is not None:
                raise UnservableModel(problem.message, problem.fix) from None
            raise BackendError(f"ONNX Runtime cannot load {model_path}: {exc}",
                               "check that the file is a valid ONNX model (reamer models build NAME --out FILE)") from None
        self.model_path, self.threads = model_path, threads
        self.inputs = [_ort_info("input", i) for i in self._session.get_inputs()]
        self.outputs = [_ort_info("output", o) for o in self._session.get_outputs()]
        self._output_names = [o.name for o in self.outputs]

    def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        values = self._session.run(self._output_names, inputs)
        return dict(zip(self._output_names, values))

    def close(self) -> None:
        self._session = None  # type: ignore[assignment]


class _OvCompiled:
    """One compiled form of the model and its infer requests (one per stream)."""

    def __init__(self, core: Any, model: Any, config: dict, streams: int) -> None:
        import openvino as ov

        self.compiled = core.compile_model(model, "CPU", config)
        self.requests = [self.compiled.create_infer_request() for _ in range(streams)]
        self._tensor = ov.Tensor

    def _feed(self, request: Any, arrays: list[np.ndarray]) -> None:
        # OpenVINO reads writable numeric inputs where they are (views of the worker's shared memory, alive until
        # the run returns) instead of copying them, and infer() without arguments skips its Python-side
        # conversion; it refuses to share a read-only array (a small tensor unpickled from the pipe): that is copied
        for i, arr in enumerate(arrays):
            shared = arr.dtype.kind in "biuf" and arr.flags.writeable
            request.set_input_tensor(i, self._tensor(arr, shared_memory=shared))

    def run(self, arrays: list[np.ndarray], outputs: int) -> list[np.ndarray]:
        rows = arrays[0].shape[0] if arrays and arrays[0].ndim else 1
        if len(self.requests) == 1 or rows < 2:
            request = self.requests[0]
            self._feed(request, arrays)
            request.infer()
            # the request reuses its output buffers: copy before the next batch overwrites them
            return [np.array(request.get_output_tensor(i).data) for i in range(outputs)]
        # the batch's rows split evenly among the streams, run at once (start_async releases the GIL)
        bounds = np.linspace(0, rows, min(len(self.requests), rows) + 1).astype(int)
        used = self.requests[:len(bounds) - 1]
        for request, low, high in zip(used, bounds[:-1], bounds[1:]):
            self._feed(request, [a[low:high] for a in arrays])
            request.start_async()
        parts: list[list[np.ndarray]] = []
        for request in used:
            request.wait()
            parts.append([np.array(request.get_output_tensor(i).data) for i in range(outputs)])
        return [np.concatenate([p[i] for p in parts]) for i in range(outputs)]


class OpenVinoBackend(Backend):
    """`static_batch`: compile for batches of exactly that many rows (OpenVINO runs a static shape faster: 7 % for
    MobileNetV2 at batch 1 on this machine) and compile the dynamic-batch form only if a batch of another size
    comes; None compiles the dynamic form at once (batches of any size, as an instance with max_batch > 1 gets)."""

    kind = "openvino"

    def __init__(self, model_path: str, threads: int, streams: int = 1,
                 precision: str = DEFAULT_PRECISION, static_batch: int | None = None) -> None:
        import openvino as ov
        import openvino.properties as props
        import openvino.properties.hint as hints

        core = ov.Core()
        try:
            model = core.read_model(model_path)
        except Exception as exc:
            raise BackendError(f"OpenVINO cannot read {model_path}: {exc}",
                               "check that the file is a valid ONNX or OpenVINO IR model") from None
        # make the batch axis dynamic where the file fixed it, so batches of any size run
        batched = _batch_shapes(model, None)
        if batched:
            model.reshape(batched)
        # compiling may add fused-node names to a port; the read model keeps the file's names, in order
        self.inputs = [_ov_info(p.get_any_name(), p) for p in model.inputs]
        self.outputs = [_ov_info(p.get_any_name(), p) for p in model.outputs]
        for kind, infos in (("input", self.inputs), ("output", self.outputs)):
            for info in infos:
                if info.datatype == "BYTES":
                    from reamer.serve.model_types import openvino_strings_problem

                    problem = openvino_strings_problem(kind, info.name)
                    raise UnservableModel(problem.message, problem.fix)
        self._config = {
            props.inference_num_threads(): threads,
            props.hint.enable_cpu_pinning(): False,
            hints.inference_precision(): ov.Type.bf16 if precision == "bf16" else ov.Type.f32,
            props.num_streams(): streams,
            hints.performance_mode(): hints.PerformanceMode.LATENCY if streams == 1
            else hints.PerformanceMode.THROUGHPUT,
        }
        self._core = core
        self.static_batch = static_batch if batched and len(batched) == len(model.inputs) else None
        self.model_path, self.threads, self.streams = model_path, threads, streams
        if self.static_batch is not None:
            model.reshape(_batch_shapes(model, self.static_batch))
        self._main = self._compile(model)  # the read model is not kept: its weights would stay in memory
        self._dynamic: _OvCompiled | None = None if self.static_batch is not None else self._main
        # OpenVINO keeps f32 where the CPU has no native bf16: report what the compiled model runs
        self.precision = _precision_name(self._main.compiled.get_property(hints.inference_precision()))

    def _compile(self, model: Any) -> _OvCompiled:
        try:
            return _OvCompiled(self._core, model, self._config, self.streams)
        except Exception as exc:
            raise BackendError(f"OpenVINO cannot compile {self.model_path} for CPU: {exc}",
                               "try the onnxruntime backend (--backend onnxruntime)") from None

    def property(self, name: str) -> Any:
        """A compiled-model property (e.g. "INFERENCE_NUM_THREADS"), to check what OpenVINO applied."""
        return self._main.compiled.get_property(name)

    def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        arrays = [inputs[info.name] for info in self.inputs]
        form = self._main
        if self.static_batch is not None and arrays[0].shape[0] != self.static_batch:
            if self._dynamic is None:  # the first batch of another size: read and compile the dynamic form
                model = self._core.read_model(self.model_path)
                model.reshape(_batch_shapes(model, None))
                self._dynamic = self._compile(model)
            form = self._dynamic
        return dict(zip((info.name for info in self.outputs), form.run(arrays, len(self.outputs))))

    def close(self) -> None:
        self._main = self._dynamic = None


def _batch_shapes(model: Any, batch: int | None) -> dict[str, Any]:
    """Each input of static rank with its first (batch) axis set to `batch` rows, or to any number (None)."""
    import openvino as ov

    return {p.get_any_name(): ov.PartialShape([ov.Dimension() if batch is None else batch,
                                               *list(p.get_partial_shape())[1:]])
            for p in model.inputs if p.get_partial_shape().rank.is_static and len(p.get_partial_shape()) > 0}


def _precision_name(element_type: Any) -> str:
    import openvino as ov

    names = {ov.Type.f32: "f32", ov.Type.bf16: "bf16", ov.Type.f16: "f16"}
    return names.get(element_type, str(element_type))


def _ort_info(kind: str, port: Any) -> TensorInfo:
    """An ONNX Runtime input or output as a TensorInfo; UnservableModel when it has no v2 datatype."""
    from reamer.serve.model_types import element_problem, not_a_tensor

    try:
        return TensorInfo(port.name, ort_type_to_v2(port.type), _dims(port.shape))
    except UnsupportedDatatype:
        problem = (element_problem(kind, port.name, port.type) if port.type.startswith("tensor(")
                   else not_a_tensor(kind, port.name, port.type, False))
        raise UnservableModel(problem.message, problem.fix) from None


def _dims(shape: list) -> list[int]:
    return [d if isinstance(d, int) and d >= 0 else -1 for d in shape]


def _ov_info(name: str, port: Any) -> TensorInfo:
    ps = port.get_partial_shape()
    dims = [d.get_length() if d.is_static else -1 for d in ps] if ps.rank.is_static else []
    try:
        datatype = numpy_to_v2(port.get_element_type().to_dtype())
    except (UnsupportedDatatype, RuntimeError, TypeError):  # an element type numpy or v2 has no name for
        from reamer.serve.model_types import element_problem

        problem = element_problem("tensor", name, str(port.get_element_type()))
        raise UnservableModel(problem.message, problem.fix) from None
    return TensorInfo(name, datatype, dims)


def open_backend(kind: str, model_path: str | os.PathLike, threads: int, streams: int = 1,
                 precision: str = DEFAULT_PRECISION, static_batch: int | None = None) -> Backend:
    """Load `model_path` with backend `kind` ("onnxruntime" | "openvino") using exactly `threads` threads;
    OpenVINO may split them among `streams` parallel streams (each batch is split among them), at
    `precision` "bf16", compute in bfloat16 where the CPU supports it (see `Backend.precision`), and with
    `static_batch`, compile for that batch size first (OpenVinoBackend); ONNX Runtime gains nothing from it."""
    check_precision(precision)
    if kind not in BACKENDS:
        raise BackendError(f"unknown backend {kind!r}", f"choose one of: {', '.join(BACKENDS)}")
    if not isinstance(threads, int) or threads < 1:
        raise BackendError(f"threads must be a positive integer, got {threads!r}",
                           "pass the number of cores the instance owns")
    if not isinstance(streams, int) or not 1 <= streams <= threads:
        raise BackendError(f"streams must be between 1 and the instance's {threads} thread(s), got {streams!r}",
                           "give each stream at least one thread")
    if streams > 1 and kind != "openvino":
        raise BackendError(f"{kind} runs one stream per instance, {streams} were asked for",
                           "use the openvino backend for streams, or more instances instead")
    path = os.fspath(model_path)
    if not os.path.isfile(path):
        raise BackendError(f"model file {path} does not exist", "build one with `reamer models build NAME --out FILE`")
    if kind == "onnxruntime":
        return OnnxRuntimeBackend(path, threads)
    return OpenVinoBackend(path, threads, streams, precision, static_batch)


def sample_inputs(backend: Backend, batch: int, rng: np.random.Generator | None = None,
                  dims: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """One batch of sample inputs by reamer.serve.samples' rule (zeros for integer and boolean inputs,
    N(0,1) for floats). `dims[input name]` sizes that input's dynamic axes other than the batch."""
    from reamer.serve.samples import SampleSpec, sample_batch

    shapes = {}
    for info in backend.inputs:
        if dims and info.name in dims:
            rest = info.shape[1:] if info.shape[:1] == [-1] else info.shape
            shapes[info.name] = tuple(d if d >= 0 else int(dims[info.name]) for d in rest)
    return sample_batch(backend.inputs, batch, SampleSpec(shapes=shapes), rng)
