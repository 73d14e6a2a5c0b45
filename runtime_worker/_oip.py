"""The Open Inference Protocol (KServe v2 / Triton HTTP/REST) as the built-in `onnx` runner
speaks it (runtime_worker.onnx_server): its datatypes and how onnxruntime's and numpy's types map
to them, infer requests (JSON and the binary tensor data extension) decoded into numpy arrays and
checked against the model's tensors, responses encoded, and `ServingError` for what it refuses.

It serves nothing and runs no model: the server hands it bodies, header values and the session's
inputs and outputs, and answers its `ServingError`s (each with the HTTP status the protocol
gives it). JSON is parsed and written with orjson (a tenth of the standard library's time for
a request of numbers; its nesting bound, 1024, refuses deeper JSON as it parses), JSON outputs
straight from their arrays. It must never log request data.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

MODEL_VERSION = "1"
#: The largest size of one dimension of an input (numpy and onnxruntime index with int64; no
#: tensor within the body limits has a larger one unless another is 0).
MAX_DIM = 2**31 - 1

# The protocol's datatypes: onnxruntime's element type and the (little-endian) numpy dtype.
_TYPES = [
    ("BOOL", "bool", "?"),
    ("UINT8", "uint8", "u1"),
    ("UINT16", "uint16", "<u2"),
    ("UINT32", "uint32", "<u4"),
    ("UINT64", "uint64", "<u8"),
    ("INT8", "int8", "i1"),
    ("INT16", "int16", "<i2"),
    ("INT32", "int32", "<i4"),
    ("INT64", "int64", "<i8"),
    ("FP16", "float16", "<f2"),
    ("FP32", "float", "<f4"),
    ("FP64", "double", "<f8"),
]
_DATATYPE_OF_ORT = {ort_type: datatype for datatype, ort_type, _ in _TYPES} | {"bfloat16": "BF16"}
_NUMPY = {datatype: np.dtype(code) for datatype, _, code in _TYPES}
_DATATYPE_OF = {dtype: datatype for datatype, dtype in _NUMPY.items()}
_JSON_KINDS = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}  # JSON value kinds each dtype takes
#: Output types orjson writes from the array itself (others go through Python lists).
_ORJSON_NATIVE = {
    np.dtype(code)
    for code in ("?", "i1", "<i2", "<i4", "<i8", "u1", "<u2", "<u4", "<u8", "<f4", "<f8")
}


#: The gRPC status code (grpc.StatusCode's name) of each HTTP status the server answers with.
_GRPC_CODES = {
    400: "INVALID_ARGUMENT",
    404: "NOT_FOUND",
    411: "INVALID_ARGUMENT",
    413: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
}


class ServingError(Exception):
    """A request refused or failed: answered over HTTP as `{"error": message}` with
    `http_status`, over gRPC with the status code named `grpc_code` (grpc.StatusCode's name).
    The message explains what was wrong and what to do; it never quotes request data."""

    def __init__(self, http_status: int, message: str, grpc_code: str | None = None) -> None:
        super().__init__(message)
        self.http_status, self.message = http_status, message
        self.grpc_code = grpc_code or _GRPC_CODES.get(http_status, "UNKNOWN")

    @property
    def status(self) -> int:
        return self.http_status


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str  # a protocol datatype; BYTES or BF16 for tensors this server cannot carry
    shape: tuple[int, ...]  # -1 for a dynamic dimension

    def describe(self) -> str:
        return f"{self.name} ({self.datatype} {list(self.shape)})"


@dataclass(frozen=True)
class InferRequest:
    id: str | None
    feeds: dict[str, np.ndarray]
    outputs: list[tuple[str, bool]]  # (output name, answered as binary data)


def _object(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ServingError(400, f"{what} must be a JSON object")
    return value


def _expected(specs: Sequence[TensorSpec]) -> str:
    return ", ".join(spec.describe() for spec in specs)


def split_request(body: bytes, header_length: str | None) -> tuple[dict[str, Any], memoryview]:
    """The JSON inference header and the binary tensor data after it (binary extension)."""
    size = len(body)
    if header_length is not None:
        if not (header_length.isascii() and header_length.isdigit()) or int(header_length) > len(
            body
        ):
            raise ServingError(400, f"Inference-Header-Content-Length must be 0..{len(body)}")
        size = int(header_length)
    try:
        header = orjson.loads(memoryview(body)[:size])
    except orjson.JSONDecodeError as exc:
        if "depth limit" in str(exc):  # orjson's own bound (1024), checked as it parses
            raise ServingError(
                400,
                "the inference request's JSON is nested too deeply; a tensor's data may be "
                "nested as deep as its shape, or flat",
            ) from None
        raise ServingError(400, f"the inference request is not valid JSON: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("inputs"), list):
        raise ServingError(400, 'the inference request must be a JSON object with "inputs"')
    return header, memoryview(body)[size:]


def decode_infer_request(
    header: dict[str, Any],
    binary: memoryview,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
) -> InferRequest:
    """Validate an infer request against the model and turn its tensors into arrays."""
    by_name, feeds, offset = {spec.name: spec for spec in inputs}, {}, 0
    for entry in header["inputs"]:
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str) or name not in by_name or name in feeds:
            what = "a duplicate" if name in feeds else "an unknown"
            raise ServingError(400, f"{what} input {name!r}; the model expects {_expected(inputs)}")
        feeds[name], offset = _decode_input(entry, by_name[name], binary, offset)
    if missing := [spec for spec in inputs if spec.name not in feeds]:
        raise ServingError(400, f"missing inputs {_expected(missing)}")
    if offset != len(binary):
        raise ServingError(400, f"{len(binary) - offset} bytes of binary data no input claims")
    request_id = header.get("id")
    return InferRequest(
        None if request_id is None else str(request_id), feeds, _selected_outputs(header, outputs)
    )


def _selected_outputs(
    header: dict[str, Any], outputs: Sequence[TensorSpec]
) -> list[tuple[str, bool]]:
    """The outputs to answer with (all unless some are named) and whether each goes as binary
    data: the output's `binary_data`, else the request's `binary_data_output`, else JSON."""
    parameters = _object(header.get("parameters"), "parameters")
    binary_default = bool(parameters.get("binary_data_output", False))
    if (wanted := header.get("outputs")) is None:
        return [(spec.name, binary_default) for spec in outputs]
    if not isinstance(wanted, list):
        raise ServingError(400, '"outputs" must be a list of {"name": ...} objects')
    known, selected = {spec.name for spec in outputs}, []
    for entry in wanted:
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str) or name not in known:
            raise ServingError(400, f"unknown output {name!r}; the model has {_expected(outputs)}")
        options = _object(entry.get("parameters"), f"output {name!r} parameters")
        if options.get("classification"):
            raise ServingError(400, "the classification extension is not supported")
        selected.append((name, bool(options.get("binary_data", binary_default))))
    return selected


def _decode_input(
    entry: dict[str, Any], spec: TensorSpec, binary: memoryview, offset: int
) -> tuple[np.ndarray, int]:
    def refused(problem: str) -> ServingError:
        expected = f"the model expects {spec.describe()}, -1 meaning any size"
        return ServingError(400, f"input {spec.name!r}: {problem}; {expected}")

    shape, datatype = entry.get("shape"), entry.get("datatype")
    if datatype != spec.datatype:
        raise refused(f"datatype {datatype!r}")
    if not isinstance(shape, list) or not all(type(dim) is int and dim >= 0 for dim in shape):
        raise refused(f"shape {shape!r} is not a list of sizes"[:200])
    if any(dim > MAX_DIM for dim in shape):
        raise refused(f"shape {shape} has a size over {MAX_DIM}"[:200])
    if len(shape) != len(spec.shape) or any(
        e not in (-1, d) for d, e in zip(shape, spec.shape, strict=True)
    ):
        raise refused(f"shape {shape}")
    if (dtype := _NUMPY.get(datatype)) is None:
        raise refused(f"this server does not carry {datatype} tensors")
    count = math.prod(shape)
    if (size := _object(entry.get("parameters"), "parameters").get("binary_data_size")) is not None:
        if type(size) is not int:
            raise refused(f"binary_data_size must be a whole number of bytes, got {size!r}"[:200])
        if size != count * dtype.itemsize or offset + size > len(binary):
            left = len(binary) - offset
            raise refused(
                f"binary_data_size is {size} of {left} bytes left, shape {shape} "
                f"takes {count * dtype.itemsize}"
            )
        array = np.frombuffer(binary[offset : offset + size], dtype=dtype)
        return shaped(array, shape, refused), offset + size
    if "data" not in entry:
        raise refused("neither data nor parameters.binary_data_size")
    try:
        if (parsed := np.asarray(entry["data"])).size and parsed.dtype.kind not in _JSON_KINDS[
            dtype.kind
        ]:
            raise TypeError(f"values that are not {datatype}")
        if dtype.kind == "f" or parsed.dtype == dtype:  # no integer may overflow: convert
            array = parsed.astype(dtype, copy=False)
        else:  # integers: numpy checks each fits while converting
            array = np.asarray(entry["data"], dtype=dtype)
    except (ValueError, TypeError, OverflowError) as exc:
        raise refused(f"data is not a {datatype} tensor ({exc})") from None
    if array.size != count:
        raise refused(f"{array.size} values where shape {shape} takes {count}")
    return shaped(array, shape, refused), offset


def shaped(
    array: np.ndarray, shape: Sequence[int], refused: Callable[[str], ServingError]
) -> np.ndarray:
    """`array` (of `math.prod(shape)` values) in `shape`, or `refused`'s error: numpy refuses a
    shape whose sizes multiply past what it indexes, which a 0 beside huge sizes may do while
    holding no values. Both fronts decode a tensor's shape with it."""
    try:
        return array.reshape(shape)
    except ValueError:
        raise refused(f"shape {list(shape)} is larger than an array may be"[:200]) from None


def encode_infer_response(
    model_name: str, request: InferRequest, arrays: Sequence[np.ndarray]
) -> tuple[bytes, int | None]:
    """The response body, and the JSON header's length when binary tensor data follows it."""
    outputs, chunks = [], []
    for (name, binary), array in zip(request.outputs, arrays, strict=True):
        if (datatype := _DATATYPE_OF.get(array.dtype)) is None:
            raise ServingError(500, f"output {name!r} of type {array.dtype} is not supported")
        output: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if binary:
            chunks.append(np.ascontiguousarray(array, dtype=_NUMPY[datatype]).tobytes())
            output["parameters"] = {"binary_data_size": len(chunks[-1])}
        elif array.dtype in _ORJSON_NATIVE:  # serialised by orjson straight from the array
            output["data"] = np.ascontiguousarray(array).reshape(-1)
        else:
            output["data"] = array.reshape(-1).tolist()
        outputs.append(output)
    answer = {"model_name": model_name, "model_version": MODEL_VERSION, "outputs": outputs}
    if request.id is not None:
        answer["id"] = request.id
    header = orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY)
    return (header + b"".join(chunks), len(header)) if chunks else (header, None)


def tensor_spec(arg: Any) -> TensorSpec:
    """A session input or output as the protocol describes it (BYTES for strings and maps)."""
    datatype = _DATATYPE_OF_ORT.get(str(arg.type).removeprefix("tensor(").removesuffix(")"))
    shape = tuple(dim if isinstance(dim, int) and dim >= 0 else -1 for dim in arg.shape)
    return TensorSpec(arg.name, datatype or "BYTES", shape)
