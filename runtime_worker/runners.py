"""Model runners: a Python entrypoint whose source travels with the job, and ONNX models run
with onnxruntime (the CUDA execution provider when a GPU is usable, the CPU otherwise)."""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from runtime_worker.job import emit, inputs, load_artifact, save_artifact


def run_entrypoint(spec: dict[str, Any]) -> Any:
    entrypoint = spec["entrypoint"]
    if entrypoint["kind"] == "python":
        return run_python(entrypoint, spec.get("params") or {})
    if entrypoint["kind"] == "onnx":
        return run_onnx(entrypoint, spec.get("params") or {})
    raise ValueError(f"unknown entrypoint kind {entrypoint['kind']!r}")


def run_python(entrypoint: dict[str, Any], params: dict[str, Any]) -> Any:
    source_dir = Path(os.getcwd()) / "src"
    for relative, text in (entrypoint.get("source") or {}).items():
        target = (source_dir / relative).resolve()
        if source_dir.resolve() not in target.parents:
            raise ValueError(f"source path {relative!r} leaves the job directory")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    sys.path.insert(0, str(source_dir))
    module = importlib.import_module(entrypoint["module"])
    function = getattr(module, entrypoint["function"])
    return function(**params)


def run_onnx(entrypoint: dict[str, Any], params: dict[str, Any]) -> Any:
    import numpy as np
    import onnxruntime as ort

    available = ort.get_available_providers()
    providers = ["CUDAExecutionProvider"] if "CUDAExecutionProvider" in available else []
    providers.append("CPUExecutionProvider")
    model_path = load_artifact(entrypoint["model"])
    session = ort.InferenceSession(str(model_path), providers=providers)
    emit({"runner": "onnx", "providers": session.get_providers()})
    named = inputs()
    if "tensors" not in named:
        raise ValueError("an ONNX job needs an input named 'tensors': an .npz of model inputs")
    with np.load(load_artifact(named["tensors"])) as feed:
        arrays = {name: feed[name] for name in feed.files}
    wanted = params.get("outputs")
    outputs = session.run(wanted, arrays)
    names = wanted or [o.name for o in session.get_outputs()]
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "outputs.npz"
        np.savez(path, **dict(zip(names, outputs, strict=True)))
        save_artifact(path, name="outputs")
    return {
        "outputs": {name: list(array.shape) for name, array in zip(names, outputs, strict=True)},
        "provider": session.get_providers()[0],
    }
