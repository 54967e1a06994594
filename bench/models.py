"""The model files the benches measure: reamer's built-in families (built once into a cache folder) and
``exported:NAME``, a model made by the real exporters (the acceptance suite's builder, cached; building one
needs the test extra: torch, transformers)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from reamer.serve.models import build_model

# The layout-search study's models and options (bench/search_calibration.json holds their profiles).
SEARCH_MODELS: dict[str, dict[str, Any]] = {
    "resnet50": {},
    "bert-base": {"layers": 12, "seq_len": 128},
    "deepspeech2": {},
}
# Every family the peer benches take by name, with the options they build it with.
FAMILIES: dict[str, dict[str, Any]] = {
    "resnet50": {}, "mobilenet_v2": {}, "bert-base": {"layers": 12, "seq_len": 128}, "deepspeech2": {},
}
EXPORTED = "exported:"


def model_file(family: str, options: dict[str, Any], cache_dir: Path) -> Path:
    """Build (once) the ONNX file of a family with these options into cache_dir."""
    tag = "-".join(f"{k}{v}" for k, v in sorted(options.items()))
    path = cache_dir / f"{family}{'-' + tag if tag else ''}.onnx"
    if not path.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.onnx")
        build_model(family, tmp, **options)
        os.replace(tmp, path)
    return path


def exported_model_file(name: str) -> Path:
    """The ONNX file of ``exported:NAME`` (built by the acceptance suite's builder on first use)."""
    from tests.acceptance.exported_models import ensure_models

    return ensure_models() / f"{name[len(EXPORTED):] if name.startswith(EXPORTED) else name}.onnx"


def resolve_model(name: str, model_dir: Path, families: dict[str, dict[str, Any]] | None = None) -> str:
    """A model as the benches take it on their command line: a family (built with its options from `families`,
    FAMILIES by default) or ``exported:NAME``."""
    if name.startswith(EXPORTED):
        return str(exported_model_file(name))
    options = (FAMILIES if families is None else families).get(name, {})
    return str(model_file(name, options, model_dir))
