"""Sample inputs for warm-up, profiling, characterisation, layout search and admission: one rule for all.

The traffic is described the way perf_analyzer takes it:

- shapes (`--shape NAME:DIMS`, API `shapes`): the dims of one input, either all of them (the first is
  the batch dim, as perf_analyzer writes them for a model without Triton's batching) or all but the
  batch dim (as perf_analyzer writes them for a batching model). The batch dim given is not used: each
  measurement sets the batch itself (warm-up runs batch 1, the profiler the batch it measures).
- sample data (`--input-data FILE`, API `input_data`): a `.npz` of named arrays, or perf_analyzer's JSON
  input-data format `{"data": [{"NAME": [..flat values..] or {"content": [..], "shape": [..]}}, ...]}`.
  Each entry (JSON) or row (an `.npz` array with the batch dim) is one sample; batches cycle through them.

Without sample data: zeros for integer and boolean inputs (zero is a valid index into every embedding
table, vocabulary or token-type table), N(0, 1) for floating-point inputs, short random words for BYTES (see
SAMPLE_WORDS). Every dynamic dim other than the batch takes the size given in shapes, or DEFAULT_DYNAMIC_DIM.
Sample data for a BYTES input: strings in the JSON, or a numpy unicode ('<U..') array in the .npz (read
without pickles, so never an object array).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from reamer.errors import ErrorKind
from reamer.host.errors import ReamerError

if TYPE_CHECKING:
    import numpy as np

    from reamer.serve.protocol.tensors import TensorInfo

DEFAULT_DYNAMIC_DIM = 16


class SampleError(ReamerError):
    """Shapes or sample data that do not fit the model (a user's mistake: the API answers 400)."""

    kind = ErrorKind.BAD_INPUT


@dataclass(frozen=True)
class SampleSpec:
    """What the traffic looks like: dims per input (perf_analyzer's --shape) and a sample-data file."""

    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    input_data: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shapes", {str(k): tuple(int(d) for d in v) for k, v in (self.shapes or {}).items()})
        for name, dims in self.shapes.items():
            if not dims or any(d < 1 for d in dims):
                raise SampleError(f"shape of input {name!r} is {list(dims)}: every dim must be a positive integer",
                                  f"give it like --shape {name}:1,128")

    @property
    def is_default(self) -> bool:
        return not self.shapes and not self.input_data

    def to_doc(self) -> dict[str, Any]:
        """JSON-friendly form (what job specs, profile workers and records carry)."""
        return {"shapes": {k: list(v) for k, v in self.shapes.items()}, "input_data": self.input_data}

    @classmethod
    def from_doc(cls, doc: dict[str, Any] | None) -> "SampleSpec":
        doc = doc or {}
        return cls(shapes=doc.get("shapes") or {}, input_data=doc.get("input_data") or None)

    def cache_material(self) -> list | None:
        """What the profile cache key must include: the shapes and the sample data's bytes (None: neither)."""
        if self.is_default:
            return None
        from reamer.serve.measure.profile_cache import file_sha256

        digest = file_sha256(self.input_data) if self.input_data else None
        return [sorted((k, list(v)) for k, v in self.shapes.items()), digest]

    def describe(self) -> str:
        parts = [f"{k}:{','.join(map(str, v))}" for k, v in sorted(self.shapes.items())]
        if self.input_data:
            parts.append(f"data {self.input_data}")
        return " ".join(parts) or "default sample inputs"


def parse_shape_option(text: str) -> tuple[str, tuple[int, ...]]:
    """`NAME:D1,D2,...` (perf_analyzer's --shape) -> (NAME, dims)."""
    name, sep, dims_text = text.rpartition(":")
    fix = "write it as NAME:DIMS, e.g. --shape input_ids:1,128"
    if not sep or not name:
        raise SampleError(f"--shape {text!r} has no input name", fix)
    try:
        dims = tuple(int(d) for d in dims_text.split(","))
    except ValueError:
        raise SampleError(f"--shape {text!r}: the dims {dims_text!r} are not comma-separated integers", fix) from None
    if any(d < 1 for d in dims):
        raise SampleError(f"--shape {text!r}: every dim must be a positive integer", fix)
    return name, dims


def shapes_from_options(options: Iterable[str]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for text in options:
        name, dims = parse_shape_option(text)
        if name in shapes and shapes[name] != dims:
            raise SampleError(f"--shape gives input {name!r} twice ({list(shapes[name])} and {list(dims)})",
                              "give each input's shape once")
        shapes[name] = dims
    return shapes


def shapes_from_doc(doc: Any) -> dict[str, tuple[int, ...]]:
    """The API's `shapes` object (input name -> list of ints), checked."""
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise SampleError("shapes must be an object of input name -> list of dims",
                          'send it like {"input_ids": [1, 128]}')
    shapes = {}
    for name, dims in doc.items():
        if not isinstance(dims, list) or not dims or not all(isinstance(d, int) and not isinstance(d, bool)
                                                             for d in dims):
            raise SampleError(f"shape of input {name!r} is {dims!r}, not a list of integers",
                              f'send it like {{"{name}": [1, 128]}}')
        if any(d < 1 for d in dims):
            raise SampleError(f"shape of input {name!r} is {dims}: every dim must be a positive integer",
                              f'send it like {{"{name}": [1, 128]}}')
        shapes[str(name)] = tuple(dims)
    return shapes


# --------------------------------------------------------------------------- sample data files

def load_input_data(path: str | os.PathLike) -> dict[str, list[Any]]:
    """The samples in `path` per input name: each a numpy array (.npz: an array with or without the batch
    dim; JSON: one entry per sample, flat values or {"content", "shape"})."""
    import numpy as np

    path = Path(path)
    fix = 'give a .npz of named arrays, or perf_analyzer\'s JSON: {"data": [{"NAME": [..]}]}'
    if not path.is_file():
        raise SampleError(f"input data file {path} does not exist", fix)
    if not os.access(path, os.R_OK):
        raise SampleError(f"input data file {path} is not readable by uid {os.geteuid()}",
                          "make it readable by the user the job runs as (chmod o+r, or its group)")
    if path.suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as npz:
                return {name: [npz[name]] for name in npz.files}
        except (OSError, ValueError) as exc:
            raise SampleError(f"input data file {path} is not a readable .npz: {exc}", fix) from None
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SampleError(f"input data file {path} is neither a .npz nor valid JSON: {exc}", fix) from None
    entries = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise SampleError(f"input data file {path} has no \"data\" list of objects", fix)
    samples: dict[str, list[Any]] = {}
    for entry in entries:
        for name, value in entry.items():
            samples.setdefault(name, []).append(value)
    return samples


def npz_declared_bytes(path: str | os.PathLike) -> int:
    """The bytes the arrays of a .npz take once decompressed, from their headers alone (nothing is
    decompressed but the headers): a few KiB of zeros can declare gigabytes. 0 for a file that is not a
    readable .npz (load_input_data names that problem)."""
    import zipfile

    import numpy as np

    total = 0
    try:
        with zipfile.ZipFile(path) as archive:
            for member in archive.infolist():
                if not member.filename.endswith(".npy"):
                    continue
                with archive.open(member) as fh:
                    version = np.lib.format.read_magic(fh)
                    shape, _, dtype = (np.lib.format.read_array_header_1_0(fh) if version == (1, 0)
                                       else np.lib.format.read_array_header_2_0(fh))
                count = 1
                for dim in shape:
                    count *= int(dim)
                total += count * max(1, dtype.itemsize)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError):
        return 0
    return total


def _json_sample(name: str, value: Any, shape: Sequence[int] | None, dtype: "np.dtype") -> "np.ndarray":
    import numpy as np

    if isinstance(value, dict):
        if "b64" in value:
            raise SampleError(f"input data for {name!r} is base64 (b64)", "give its values as a \"content\" list")
        content, given = value.get("content"), value.get("shape")
        shape = given if given is not None else shape
    else:
        content = value
    try:
        arr = np.asarray(content, dtype=dtype if dtype.kind != "O" else object)
    except (TypeError, ValueError) as exc:
        raise SampleError(f"input data for {name!r} is not a list of {dtype} values: {exc}",
                          "give numbers (or strings for BYTES inputs) as a flat list") from None
    if shape is not None:
        try:
            arr = arr.reshape(shape)
        except ValueError:
            raise SampleError(f"input data for {name!r} has {arr.size} values, which do not fill the shape "
                              f"{list(shape)}", f"give {name!r} a matching \"shape\" or --shape") from None
    return arr


# --------------------------------------------------------------------------- the plan per model

@dataclass
class _InputPlan:
    info: "TensorInfo"
    batched: bool  # the model's first axis is dynamic: the batch
    dims: tuple[int, ...]  # one sample's dims (without the batch dim when batched)
    samples: list["np.ndarray"] | None  # one sample each (dims as above), from the sample data


@dataclass
class SamplePlan:
    """Sample inputs for one model: validated once, then any batch size."""

    inputs: list[_InputPlan]
    spec: SampleSpec

    def batch(self, batch: int, rng: "np.random.Generator | None" = None) -> dict[str, "np.ndarray"]:
        import numpy as np

        rng = rng if rng is not None else np.random.default_rng(0)
        feeds = {}
        for p in self.inputs:
            dtype = p.info.numpy_dtype
            if p.samples is not None:
                if p.batched:
                    rows = [p.samples[i % len(p.samples)] for i in range(batch)]
                    feeds[p.info.name] = _as_dtype(np.stack(rows), dtype)
                else:
                    feeds[p.info.name] = _as_dtype(p.samples[0], dtype)
                continue
            shape = ((batch,) if p.batched else ()) + p.dims
            if dtype.kind in "iub":
                feeds[p.info.name] = np.zeros(shape, dtype)
            elif dtype.kind == "f":
                feeds[p.info.name] = rng.standard_normal(shape).astype(dtype)
            else:
                feeds[p.info.name] = sample_words(shape, rng)
        return feeds

    def describe(self, feeds: dict[str, "np.ndarray"]) -> str:
        """One line per input: name, type, shape and where the values came from (for warm-up errors)."""
        lines = []
        for p in self.inputs:
            arr = feeds.get(p.info.name)
            shape = list(arr.shape) if arr is not None else "?"
            source = ("from " + str(self.spec.input_data) if p.samples is not None
                      else "zeros" if p.info.numpy_dtype.kind in "iub"
                      else "random N(0,1)" if p.info.numpy_dtype.kind == "f" else "random words")
            lines.append(f"{p.info.name} {p.info.datatype} {shape} ({source})")
        return "; ".join(lines)


# BYTES inputs without sample data get words drawn from these (text models' traffic is words; an empty string
# would measure a tokenizer or a lookup on nothing).
SAMPLE_WORDS = ("the", "model", "serves", "requests", "on", "idle", "cores", "while", "training", "runs",
                "a", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "good", "bad", "movie", "film",
                "great", "awful", "cat", "data", "batch", "latency", "text", "token", "string", "value")


def sample_words(shape: tuple[int, ...], rng: "np.random.Generator") -> "np.ndarray":
    """A BYTES sample: an object array of str, each one to three words of SAMPLE_WORDS."""
    import numpy as np

    count = int(np.prod(shape, dtype=np.int64))
    picks = rng.integers(0, len(SAMPLE_WORDS), size=(count, 3))
    lengths = rng.integers(1, 4, size=count)
    arr = np.empty(count, dtype=object)
    arr[:] = [" ".join(SAMPLE_WORDS[j] for j in row[:n]) for row, n in zip(picks.tolist(), lengths.tolist())]
    return arr.reshape(shape)


def _as_dtype(arr: "np.ndarray", dtype: "np.dtype") -> "np.ndarray":
    """Sample data as the model's dtype; BYTES as an object array of str (numpy 'U'/'S' data converted)."""
    import numpy as np

    if dtype.kind == "O":
        from reamer.serve.protocol.tensors import BadBytesTensor, as_text_array

        try:
            return as_text_array(arr, "sample data")
        except BadBytesTensor as exc:
            raise SampleError(exc.message, exc.fix) from None
    return np.ascontiguousarray(arr.astype(dtype, copy=False))


def _fix_for(info: "TensorInfo") -> str:
    example = ",".join(str(d if d >= 0 else (1 if i == 0 else 128)) for i, d in enumerate(info.shape)) or "1"
    return f"give it as --shape {info.name}:{example} (model dims {info.shape}, -1 = any size)"


def _resolve_dims(info: "TensorInfo", given: tuple[int, ...] | None) -> tuple[bool, tuple[int, ...]]:
    """(batched, one sample's dims) for `info` from the dims the user gave (None: defaults)."""
    model = list(info.shape)
    batched = bool(model) and model[0] == -1
    rest = model[1:] if batched else model
    if given is None:
        return batched, tuple(d if d >= 0 else DEFAULT_DYNAMIC_DIM for d in rest)
    if len(given) == len(model) and batched:
        given = given[1:]  # the full shape: its first dim is the batch, which each measurement sets
    elif len(given) != len(rest):
        want = f"{len(model)}" + (f" (or {len(rest)} without the batch dim)" if batched else "")
        raise SampleError(f"shape {list(given)} of input {info.name!r} has {len(given)} dims; the model's "
                          f"input has {want}", _fix_for(info))
    for want, got in zip(rest, given):
        if want >= 0 and want != got:
            raise SampleError(f"shape {list(given)} of input {info.name!r} does not match the model's fixed "
                              f"dims {info.shape}", _fix_for(info))
    return batched, tuple(given)


def plan_samples(inputs: Sequence["TensorInfo"], spec: SampleSpec | None = None,
                 model_path: str | os.PathLike | None = None) -> SamplePlan:
    """Check `spec` against the model's inputs and plan its sample batches; SampleError names the input.

    With `model_path` (an ONNX file), an input without a shape of its own takes the sizes given for the
    same named dims of other inputs (`--shape input_ids:1,128` sizes attention_mask's "seq" too)."""
    spec = spec or SampleSpec()
    names = [t.name for t in inputs]
    unknown = sorted(set(spec.shapes) - set(names))
    if unknown:
        raise SampleError(f"--shape names {unknown}, which the model does not have",
                          f"use the model's input names: {', '.join(names)}")
    data = load_input_data(spec.input_data) if spec.input_data else {}
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise SampleError(f"input data {spec.input_data} has {unknown}, which the model does not have",
                          f"name its arrays after the model's inputs: {', '.join(names)}")
    missing = sorted(set(names) - set(data))
    if data and missing:
        raise SampleError(f"input data {spec.input_data} has no values for {missing}",
                          "give every input of the model in the sample data")
    shapes = dict(spec.shapes)
    if shapes and model_path is not None and set(names) - set(shapes) - set(data):
        shapes.update(_shapes_by_dim_name(inputs, shapes, model_path))
    plans = []
    for info in inputs:
        batched, dims = _resolve_dims(info, shapes.get(info.name))
        samples = None
        if info.name in data:
            samples = _data_samples(info, batched, dims if info.name in shapes else None, data[info.name],
                                    str(spec.input_data))
            dims = tuple(samples[0].shape)
        plans.append(_InputPlan(info, batched, dims, samples))
    return SamplePlan(plans, spec)


def _shapes_by_dim_name(inputs: Sequence["TensorInfo"], shapes: dict[str, tuple[int, ...]],
                        model_path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Shapes for the inputs without one, from the sizes given for the same symbolic dims elsewhere."""
    named = _dim_names(model_path)
    sizes: dict[str, int] = {}
    for info in inputs:
        given, dim_names = shapes.get(info.name), named.get(info.name)
        if given is None or dim_names is None:
            continue
        if len(given) == len(dim_names) - 1 and info.shape[:1] == [-1]:
            given = (0, *given)  # written without the batch dim
        if len(given) == len(dim_names):
            sizes.update({n: d for n, d in zip(dim_names[1:], given[1:]) if n})
    derived = {}
    for info in inputs:
        dim_names = named.get(info.name)
        if info.name in shapes or dim_names is None or not info.shape:
            continue
        dims = [d if d >= 0 else sizes.get(n or "", DEFAULT_DYNAMIC_DIM) for d, n in zip(info.shape, dim_names)]
        if any(n in sizes for n in dim_names[1:] if n):
            derived[info.name] = tuple(dims[1:] if info.shape[0] == -1 else dims)
    return derived


def _read_onnx(model_path: str | os.PathLike) -> Any:
    """An ONNX file's graph (onnx.ModelProto), its external weights left unread."""
    import onnx

    return onnx.load(os.fspath(model_path), load_external_data=False)


def _dim_names(model_path: str | os.PathLike) -> dict[str, list[str | None]]:
    """Symbolic dim names (dim_param) of an ONNX file's inputs; {} for other files."""
    if not str(model_path).endswith(".onnx"):
        return {}
    try:
        graph = _read_onnx(model_path).graph
    except Exception:  # noqa: BLE001 - without names, the defaults apply
        return {}
    return {vi.name: [d.dim_param or None for d in vi.type.tensor_type.shape.dim] for vi in graph.input}


def _data_samples(info: "TensorInfo", batched: bool, dims: tuple[int, ...] | None, values: list[Any],
                  source: str) -> list["np.ndarray"]:
    import numpy as np

    dtype = info.numpy_dtype
    rest = info.shape[1:] if batched else info.shape
    if dims is None and all(d >= 0 for d in rest):
        dims = tuple(rest)
    samples: list[np.ndarray] = []
    for value in values:
        if isinstance(value, np.ndarray):  # .npz: with the batch dim (rows are samples) or one sample
            if batched and value.ndim == len(info.shape):
                samples.extend(value[i] for i in range(value.shape[0]))
            else:
                samples.append(value)
        else:
            if dims is None and not (isinstance(value, dict) and value.get("shape") is not None):
                arr = np.asarray(value.get("content") if isinstance(value, dict) else value)
                if arr.ndim != len(rest):
                    raise SampleError(f"input data for {info.name!r} gives no shape and its dims are dynamic",
                                      f"add \"shape\" to its entries or --shape; {_fix_for(info)}")
            samples.append(_json_sample(info.name, value, dims, dtype))
    if not samples:
        raise SampleError(f"input data {source} has no samples for {info.name!r}", "give at least one sample")
    first = samples[0].shape
    for s in samples:
        ok = len(s.shape) == len(rest) and all(w in (-1, g) for w, g in zip(rest, s.shape))
        if not ok or (dims is not None and tuple(s.shape) != tuple(dims)):
            want = list(dims) if dims is not None else rest
            raise SampleError(f"a sample of {info.name!r} in {source} has shape {list(s.shape)}, expected "
                              f"{want} per sample (model dims {info.shape}, the batch dim excluded when -1)",
                              "fix the sample data or the --shape given for this input")
        if s.shape != first:
            raise SampleError(f"the samples of {info.name!r} in {source} differ in shape ({list(first)} and "
                              f"{list(s.shape)})", "give every sample of an input the same shape")
        if dtype.kind != "O" and s.dtype.kind not in "biuf":
            raise SampleError(f"input data for {info.name!r} has {s.dtype} values, the model wants "
                              f"{info.datatype}", f"give {info.name!r} numbers")
        if dtype.kind == "O" and (s.dtype.kind not in "OUS" or (s.dtype.kind == "O" and not all(
                isinstance(x, str) for x in s.reshape(-1).tolist()))):
            raise SampleError(f"input data for {info.name!r} has values that are not strings, the model wants "
                              "BYTES", f"give {info.name!r} strings (a JSON list of strings, or a numpy unicode "
                              "array in the .npz)")
    return samples


def sample_batch(inputs: Sequence["TensorInfo"], batch: int, spec: SampleSpec | None = None,
                 rng: "np.random.Generator | None" = None) -> dict[str, "np.ndarray"]:
    """One batch of sample inputs (see the module doc for the rule)."""
    return plan_samples(inputs, spec).batch(batch, rng)


def model_inputs(model_path: str | os.PathLike) -> list["TensorInfo"]:
    """The inputs of an ONNX file, read with the onnx package (no runtime, no external weights loaded)."""
    from reamer.serve.protocol.tensors import TensorInfo, onnx_to_v2

    try:
        model = _read_onnx(model_path)
    except Exception as exc:  # noqa: BLE001 - protobuf raises its own types
        raise SampleError(f"cannot read the inputs of {model_path}: {exc}", "check that it is an ONNX file") from None
    weights = {t.name for t in model.graph.initializer}
    infos = []
    for vi in model.graph.input:
        if vi.name in weights:
            continue
        tt = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else -1 for d in tt.shape.dim]
        infos.append(TensorInfo(vi.name, onnx_to_v2(tt.elem_type), dims))
    return infos


def check_against_model(model_path: str | os.PathLike, spec: SampleSpec) -> None:
    """Raise SampleError when `spec` does not fit the model's inputs (for the CLI and the API, before a job)."""
    if spec.is_default:
        return
    if not str(model_path).endswith(".onnx"):
        return  # OpenVINO IR and others: the runtime checks at warm-up
    plan_samples(model_inputs(model_path), spec, model_path)


def inputs_feeding_node(model_path: str | os.PathLike, node_name: str) -> list[str]:
    """The graph inputs that reach node `node_name` (for naming the input behind a runtime's error)."""
    try:
        graph = _read_onnx(model_path).graph
    except Exception:  # noqa: BLE001 - only an explanation is lost
        return []
    weights = {t.name for t in graph.initializer}
    inputs = [vi.name for vi in graph.input if vi.name not in weights]
    producer = {out: node for node in graph.node for out in node.output}
    target = next((n for n in graph.node if n.name == node_name), None)
    if target is None:
        return []
    found, seen, todo = set(), set(), list(target.input)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in inputs:
            found.add(name)
        elif name in producer:
            todo.extend(producer[name].input)
    return [n for n in inputs if n in found]


def explain_failure(model_path: str, plan: SamplePlan, feeds: dict[str, "np.ndarray"], exc: BaseException) -> str:
    """A runtime's refusal of sample inputs as one line: which input(s), what was fed, and the runtime's reason."""
    import re

    reason = " ".join(str(exc).split())
    culprits: list[str] = []
    match = re.search(r"Name:'([^']+)'", reason)  # ONNX Runtime names the failing node like this
    if match and str(model_path).endswith(".onnx"):
        culprits = inputs_feeding_node(model_path, match.group(1))
    fed = plan.describe(feeds)
    if culprits:
        return f"the model refused input {', '.join(culprits)} (fed: {fed}): {reason}"
    return f"the model refused the sample inputs (fed: {fed}): {reason}"
