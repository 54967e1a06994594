"""Can a backend serve this model's inputs and outputs, and run its operators? The checks a deploy makes
before it accepts a model, each refusal with the exact fix.

The Open Inference Protocol carries tensors only: an input or output that is a sequence, a map or an
optional (skl2onnx's default classifier output is a sequence of maps, made by ZipMap) has no v2 datatype,
nor does an element type outside the v2 table (bfloat16, complex, float8, int4). String (BYTES) tensors are
served with ONNX Runtime; OpenVINO is refused for them. An operator from a custom domain runs only where a
custom-op library provides it: onnxruntime-extensions (registered automatically when installed) or a
library the agent config lists (`inference.custom_op_libraries`).

Reads the graph with the onnx package (no runtime, external weights left unread); the runtime's own refusals
are mapped to the same problems by `reamer.serve.backends`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable

# Operator domains ONNX Runtime's CPU provider implements itself; an op of any other domain needs a custom-op
# library (a model's local functions excepted).
BUILTIN_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml", "com.microsoft", "com.microsoft.nchwc",
                             "com.ms.internal.nhwc", "ai.onnx.training", "ai.onnx.preview.training",
                             "com.microsoft.experimental"})
EXTENSIONS_DOMAIN = "ai.onnx.contrib"  # onnxruntime-extensions' operators
# Custom-op libraries ONNX Runtime sessions load besides onnxruntime-extensions' (reamer.serve.backends): paths
# separated by ":". The agent sets it from its config's inference.custom_op_libraries, so its jobs, deploy checks
# and searches inherit it; local commands read the caller's own environment.
CUSTOM_OP_LIBRARIES_ENV = "REAMER_CUSTOM_OP_LIBRARIES"

ZIPMAP_FIX = ("convert the classifier without ZipMap, so that the probabilities come as one FP32 tensor "
              "[batch, classes]: skl2onnx.to_onnx(model, X, options={id(model): {'zipmap': False}}) "
              "(convert_sklearn takes the same options; onnxmltools converters take zipmap=False)")
TENSORS_ONLY_FIX = ("export the model so that every input and output is a tensor (a sequence: SequenceAt or "
                    "ConcatFromSequence at the end of the graph; a map: its keys and its values as two tensors)")
ELEMENT_FIX = ("cast it in the graph (a Cast node) to one of BOOL, UINT8..UINT64, INT8..INT64, FP16, FP32, FP64 or "
               "STRING (BYTES)")
OPENVINO_STRINGS_FIX = "deploy it with ONNX Runtime (--backend onnxruntime), which serves BYTES tensors"
LOCALE_FIX = ("install that locale on this host (e.g. locale-gen en_US.UTF-8), or convert the model with a locale "
              "this host has: for skl2onnx text vectorizers options={id(vectorizer): {'locale': 'C.UTF-8'}}")


def extensions_library() -> str | None:
    """The custom-op library of onnxruntime-extensions when that package is installed. Found without importing
    the package (its import pulls in converters and takes seconds)."""
    import importlib.machinery
    import importlib.util

    try:
        spec = importlib.util.find_spec("onnxruntime_extensions")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(folder, "_extensions_pydll" + suffix)
            if os.path.isfile(path):
                return path
    return None


def custom_op_libraries() -> list[str]:
    """Every custom-op library an ONNX Runtime session here registers, in order."""
    found = [extensions_library()]
    found += [p for p in os.environ.get(CUSTOM_OP_LIBRARIES_ENV, "").split(os.pathsep) if p]
    return [p for i, p in enumerate(found) if p and p not in found[:i]]


def custom_op_fix(domains: Iterable[str]) -> str:
    """What to do when no loaded library provides a custom domain's operators."""
    domains = sorted(set(domains))
    lib = ("add the path of the shared library that implements them to the agent config's "
           "inference.custom_op_libraries (root's config; local commands read REAMER_CUSTOM_OP_LIBRARIES)")
    if EXTENSIONS_DOMAIN in domains:
        return (f"install onnxruntime-extensions into reamer's environment (pip install onnxruntime-extensions), "
                f"whose library reamer registers by itself; for other libraries {lib}; deploy with "
                "--backend onnxruntime (OpenVINO cannot run them)")
    return f"{lib}; deploy with --backend onnxruntime (OpenVINO cannot run them)"


@dataclass(frozen=True)
class ModelProblem:
    """Why a backend cannot serve a model, and the exact fix."""

    message: str
    fix: str


def describe_type(type_proto: Any) -> str:
    """An ONNX TypeProto in ONNX Runtime's words: tensor(float), seq(map(int64,tensor(float))), ..."""
    from onnx import TensorProto

    which = type_proto.WhichOneof("value")
    if which in ("tensor_type", "sparse_tensor_type"):
        elem = getattr(type_proto, which).elem_type
        name = TensorProto.DataType.Name(elem).lower() if elem in TensorProto.DataType.values() else str(elem)
        return f"{'sparse_' if which == 'sparse_tensor_type' else ''}tensor({name})"
    if which == "sequence_type":
        return f"seq({describe_type(type_proto.sequence_type.elem_type)})"
    if which == "map_type":
        key = TensorProto.DataType.Name(type_proto.map_type.key_type).lower()
        return f"map({key},{describe_type(type_proto.map_type.value_type)})"
    if which == "optional_type":
        return f"optional({describe_type(type_proto.optional_type.elem_type)})"
    return "an undefined type"


def not_a_tensor(kind: str, name: str, type_text: str, made_by_zipmap: bool) -> ModelProblem:
    """The problem of an input or output (`kind`) whose type (`type_text`, ORT's words) is not a tensor."""
    what = ("a sequence of maps (skl2onnx's ZipMap output)" if made_by_zipmap or type_text.startswith("seq(map(")
            else "a sequence" if type_text.startswith("seq(") else "a map" if type_text.startswith("map(")
            else "an optional" if type_text.startswith("optional(") else f"of type {type_text}")
    fix = ZIPMAP_FIX if made_by_zipmap or type_text.startswith("seq(map(") else TENSORS_ONLY_FIX
    return ModelProblem(f"{kind} {name!r} is {what}, {type_text}: the v2 protocol (REST and gRPC) carries tensors "
                        "only, so no client could receive it", fix)


def element_problem(kind: str, name: str, type_text: str) -> ModelProblem:
    return ModelProblem(f"{kind} {name!r} is {type_text}, whose element type has no KServe v2 datatype reamer "
                        "serves", ELEMENT_FIX)


def openvino_strings_problem(kind: str, name: str) -> ModelProblem:
    return ModelProblem(f"{kind} {name!r} is a string (BYTES) tensor, which reamer serves with ONNX Runtime only "
                        "(OpenVINO's ONNX reader converts few string operators, and OpenVINO 2026.4 corrupts its "
                        "heap when a graph passes a string tensor through)", OPENVINO_STRINGS_FIX)


def _onnx_model(model_path: str) -> Any:
    import onnx

    return onnx.load(model_path, load_external_data=False)


def _nodes(graph: Any) -> Iterable[Any]:
    """Every node of `graph`, those of its subgraphs (If, Loop, Scan bodies) included."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.HasField("g"):
                yield from _nodes(attr.g)
            for sub in attr.graphs:
                yield from _nodes(sub)


def custom_domains(model: Any) -> dict[str, list[str]]:
    """The custom operator domains a model uses, each with its op types (its local functions excepted)."""
    local = {(f.domain, f.name) for f in model.functions}
    found: dict[str, list[str]] = {}
    nodes = list(_nodes(model.graph)) + [n for f in model.functions for n in f.node]
    for node in nodes:
        if node.domain in BUILTIN_DOMAINS or (node.domain, node.op_type) in local:
            continue
        ops = found.setdefault(node.domain, [])
        if node.op_type not in ops:
            ops.append(node.op_type)
    return found


def graph_problem(model_path: str | os.PathLike, backend: str | None) -> ModelProblem | None:
    """None when `backend` ("onnxruntime" | "openvino"; None: whichever, so only what no backend serves) can
    serve every input and output of the ONNX file `model_path` and, for OpenVINO, has its operators; else the
    problem and the fix. Other files (OpenVINO IR) are left to the runtime: None."""
    from onnx import TensorProto

    from reamer.serve.protocol.tensors import UnsupportedDatatype, onnx_to_v2

    path = os.fspath(model_path)
    if not path.endswith(".onnx"):
        return None
    try:
        model = _onnx_model(path)
    except Exception:  # noqa: BLE001 - an unreadable file: the runtime names its problem
        return None
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    weights = {t.name for t in graph.initializer}
    ports = [("input", vi) for vi in graph.input if vi.name not in weights] + [("output", vi) for vi in graph.output]
    strings = []
    for kind, vi in ports:
        which = vi.type.WhichOneof("value")
        text = describe_type(vi.type)
        if which != "tensor_type":
            node = producer.get(vi.name)
            return not_a_tensor(kind, vi.name, text, node is not None and node.op_type == "ZipMap")
        try:
            onnx_to_v2(vi.type.tensor_type.elem_type)
        except UnsupportedDatatype:
            return element_problem(kind, vi.name, text)
        if vi.type.tensor_type.elem_type == TensorProto.STRING:
            strings.append((kind, vi.name))
    domains = custom_domains(model)
    if backend != "openvino":
        return _no_library_problem(domains)
    if domains:
        ops = "; ".join(f"{d}: {', '.join(ops)}" for d, ops in sorted(domains.items()))
        return ModelProblem(f"the model uses custom operators ({ops}), which OpenVINO cannot run",
                            custom_op_fix(domains))
    return openvino_strings_problem(*strings[0]) if strings else None


def _no_library_problem(domains: dict[str, list[str]]) -> ModelProblem | None:
    """Custom operators that no library here could provide: none is loaded but onnxruntime-extensions', and they
    are not its domain. (With other libraries loaded, only opening the model tells: `unregistered_op_problem`.)"""
    libraries = custom_op_libraries()
    extensions = extensions_library()
    unprovided = {d: ops for d, ops in domains.items()
                  if not (d == EXTENSIONS_DOMAIN and extensions is not None)}
    if not unprovided or any(lib != extensions for lib in libraries):
        return None
    ops = "; ".join(f"{d}: {', '.join(o)}" for d, o in sorted(unprovided.items()))
    return ModelProblem(f"the model uses custom operators ({ops}) that no loaded custom-op library provides "
                        f"(loaded: {', '.join(libraries) or 'none'})", custom_op_fix(unprovided))


def unregistered_op_problem(runtime_text: str, model_path: str | os.PathLike,
                            libraries: Iterable[str]) -> ModelProblem | None:
    """ONNX Runtime's refusal to load a model, as the custom-op problem when the model uses operators of a
    custom domain that none of `libraries` (the ones loaded) provides; None for any other refusal."""
    markers = ("is not a registered function/op", "No opset import for domain", "Could not find an implementation",
               "is not a registered")
    if not any(m in runtime_text for m in markers):
        return None
    try:
        domains = custom_domains(_onnx_model(os.fspath(model_path)))
    except Exception:  # noqa: BLE001
        return None
    if not domains:
        return None
    loaded = ", ".join(libraries) or "none"
    ops = "; ".join(f"{d}: {', '.join(ops)}" for d, ops in sorted(domains.items()))
    first = " ".join(runtime_text.split())[:300]
    return ModelProblem(f"the model uses custom operators ({ops}) that no loaded custom-op library provides "
                        f"(loaded: {loaded}); ONNX Runtime says: {first}", custom_op_fix(domains))


def locale_problem(runtime_text: str) -> ModelProblem | None:
    """ONNX Runtime's StringNormalizer refusing a locale this host lacks (skl2onnx text pipelines ask for
    en_US.UTF-8 by default)."""
    if "Failed to construct locale" not in runtime_text:
        return None
    first = " ".join(runtime_text.split())[:300]
    return ModelProblem(f"the model's string normalizer asks for a locale this host does not have: {first}",
                        LOCALE_FIX)
