"""The calls of the Open Inference Protocol's gRPC API (KServe v2,
`inference.GRPCInferenceService`), so that standard clients such as `tritonclient.grpc` work
unchanged: ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata and ModelInfer,
with tensors as `raw_input_contents` / `raw_output_contents` (what tritonclient sends) or as
typed `contents`.

`GrpcService` only decodes and encodes: messages into `_oip.InferRequest`s for the one
`DataPlane` the HTTP front also calls, its arrays into raw output contents, and its
`ServingError`s into the gRPC status each carries (INVALID_ARGUMENT, NOT_FOUND, UNAVAILABLE for a
full queue or a model still loading). One transport carries its calls: the native gRPC front
(`modelforge-grpc-front`, `grpc_native`), which does HTTP/2 and gRPC's framing and relays each
call's message here.

Memory is bounded as the HTTP front bounds it: the front refuses a message over
`max_message_bytes` with RESOURCE_EXHAUSTED before it is relayed, and an infer request holds what
parsing and decoding it may take against the server's byte budget (shared with the HTTP front)
before it is parsed; one that does not fit is refused at once (UNAVAILABLE). What it takes is
read from the message's top-level fields: all length-delimited, at most as many tensors as the
model has and a few others, so the scan is short whatever the size, and a message breaking
either is refused (INVALID_ARGUMENT) before it is parsed. Since a call's whole message arrives
before the budget sees it, the front runs at most as many calls at once as the budget holds
messages of the largest size (`max_calls`): a call takes its place once its message has arrived
whole (a call still sending holds none), and one more than that is RESOURCE_EXHAUSTED at once.
It never logs request data.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol

import numpy as np
from google.protobuf.message import DecodeError

from runtime_worker._oip import (
    _DATATYPE_OF,
    _NUMPY,
    MODEL_VERSION,
    InferRequest,
    ServingError,
    shaped,
)
from runtime_worker.serving._proto import grpc_predict_v2_pb2 as pb
from runtime_worker.serving.batcher import CallerGone
from runtime_worker.serving.dataplane import DataPlane

log = logging.getLogger("modelforge.onnx_server")

SERVICE = "inference.GRPCInferenceService"

#: The typed `contents` field each datatype travels in (FP16 and BF16 travel only raw), and the
#: numpy type protobuf hands its values as.
_CONTENTS = {
    "BOOL": ("bool_contents", np.dtype("?")),
    "INT8": ("int_contents", np.dtype("<i4")),
    "INT16": ("int_contents", np.dtype("<i4")),
    "INT32": ("int_contents", np.dtype("<i4")),
    "INT64": ("int64_contents", np.dtype("<i8")),
    "UINT8": ("uint_contents", np.dtype("<u4")),
    "UINT16": ("uint_contents", np.dtype("<u4")),
    "UINT32": ("uint_contents", np.dtype("<u4")),
    "UINT64": ("uint64_contents", np.dtype("<u8")),
    "FP32": ("fp32_contents", np.dtype("<f4")),
    "FP64": ("fp64_contents", np.dtype("<f8")),
}
#: Bytes of parsed and decoded values one byte of typed contents may become (a one-byte varint
#: is 8 bytes in protobuf's parsed message, and up to 8 again as a numpy array).
_TYPED_EXPANSION = 16
#: What a call holds whatever its size (gRPC's own state for it, its response): so that the
#: budget also bounds how many calls are in flight (8,192 in the default 512 MiB).
_CALL_BYTES = 64 * 1024
#: The fewest calls the front takes at once whatever the budget: enough that a client with a
#: handful of calls in flight, and another's health checks, are never refused for their number.
MIN_CALLS = 16
#: What parsing one field of the message or of a tensor may take besides its bytes: an empty
#: input tensor (2 bytes on the wire) is about 90 bytes once parsed by upb, then a Python object.
_ENTRY_BYTES = 512
#: ModelInferRequest's fields that repeat (runtime_worker/serving/_proto/grpc_predict_v2.proto);
#: model_name (1), model_version (2) and id (3) are strings. All are length-delimited.
_PARAMETERS, _INPUTS, _OUTPUTS, _RAW = 4, 5, 6, 7
_LENGTH_DELIMITED = 2
#: The most request parameters, and fields besides the tensors and parameters (the strings,
#: repeated, and unknown fields), one message may carry.
_MAX_PARAMETERS = 64
_MAX_OTHER_FIELDS = 16
#: The most fields one tensor may have: name, datatype, contents, its dimensions (unpacked, one
#: field each) and parameters.
_MAX_DIMS = 64
_MAX_TENSOR_FIELDS = 2 * _MAX_DIMS + 8
#: The largest dimension of an input (numpy's and onnxruntime's arrays index with int64, and
#: no tensor within the message limit has a larger one unless another is 0).
_MAX_DIM = 2**31 - 1


class Budget(Protocol):
    """The server's byte budget for requests in flight (the HTTP front's `ByteBudget`)."""

    @property
    def limit(self) -> int: ...

    def reserve(self, size: int) -> bool: ...

    def release(self, size: int) -> None: ...


class _Unbounded:
    limit = 0

    def reserve(self, size: int) -> bool:
        return True

    def release(self, size: int) -> None:
        pass


def host_port(host: str, port: int) -> str:
    """host:port as gRPC and the native front take it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def max_calls(budget_bytes: int, max_message_bytes: int) -> int | None:
    """The most calls the front takes at once: as many messages of the largest size as the byte
    budget holds, and at least `MIN_CALLS` (None, unbounded, without a budget)."""
    if budget_bytes <= 0:
        return None
    return max(MIN_CALLS, budget_bytes // max(max_message_bytes, 1))


#: gRPC's status codes by name, as numbers on the wire (grpc/doc/statuscodes.md).
GRPC_CODE_NUMBERS = {
    name: number
    for number, name in enumerate(
        (
            "OK",
            "CANCELLED",
            "UNKNOWN",
            "INVALID_ARGUMENT",
            "DEADLINE_EXCEEDED",
            "NOT_FOUND",
            "ALREADY_EXISTS",
            "PERMISSION_DENIED",
            "RESOURCE_EXHAUSTED",
            "FAILED_PRECONDITION",
            "ABORTED",
            "OUT_OF_RANGE",
            "UNIMPLEMENTED",
            "INTERNAL",
            "UNAVAILABLE",
            "DATA_LOSS",
            "UNAUTHENTICATED",
        )
    )
}


class GrpcService:
    """The calls of `inference.GRPCInferenceService` on one data plane, carried by the native
    front through `grpc_native.Relay`: `call` takes a request message's bytes and returns the
    response message's, or raises the `ServingError` whose gRPC status ends the call."""

    def __init__(self, dataplane: DataPlane, budget: Budget | None = None) -> None:
        self.dataplane, self.budget = dataplane, budget or _Unbounded()
        self._methods: dict[str, tuple[Callable[[Any], Awaitable[Any]], Any]] = {
            "ServerLive": (self.server_live, pb.ServerLiveRequest),
            "ServerReady": (self.server_ready, pb.ServerReadyRequest),
            "ModelReady": (self.model_ready, pb.ModelReadyRequest),
            "ServerMetadata": (self.server_metadata, pb.ServerMetadataRequest),
            "ModelMetadata": (self.model_metadata, pb.ModelMetadataRequest),
        }

    @property
    def methods(self) -> tuple[str, ...]:
        return (*self._methods, "ModelInfer")

    async def call(
        self, method: str, message: bytes, gone: Callable[[], Awaitable[object]] | None = None
    ) -> bytes:
        """Answer one call of `method` (a name in `methods`) with `message`; `gone`, when the
        transport has one, as `DataPlane.infer` takes it."""
        try:
            if method == "ModelInfer":
                # Kept as bytes until the budget holds what parsing it takes.
                return (await self.model_infer(message, gone)).SerializeToString()
            if (entry := self._methods.get(method)) is None:
                raise ServingError(
                    501,
                    f"no method {method[:80]}; this server has {', '.join(self.methods)}",
                    "UNIMPLEMENTED",
                )
            handler, request_type = entry
            try:
                request = request_type.FromString(message)
            except DecodeError:
                raise ServingError(400, f"the message is not a {request_type.__name__}") from None
            response = await handler(request)
            return bytes(response.SerializeToString())
        except (ServingError, CallerGone):
            raise
        except Exception as exc:  # a bug: answered, and logged without the request's data
            log.error("internal error on %s: %s", method, type(exc).__name__)
            raise ServingError(500, f"internal error ({type(exc).__name__})") from None

    async def server_live(self, request: pb.ServerLiveRequest) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self.dataplane.live())

    async def server_ready(self, request: pb.ServerReadyRequest) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.dataplane.ready())

    async def model_ready(self, request: pb.ModelReadyRequest) -> pb.ModelReadyResponse:
        ready = self.dataplane.model_ready(request.name, request.version or None)
        return pb.ModelReadyResponse(ready=ready)

    async def server_metadata(self, request: pb.ServerMetadataRequest) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(**self.dataplane.server_metadata())

    async def model_metadata(self, request: pb.ModelMetadataRequest) -> pb.ModelMetadataResponse:
        metadata = self.dataplane.model_metadata(request.name, request.version or None)
        return pb.ModelMetadataResponse(**metadata)

    async def model_infer(
        self, message: bytes, gone: Callable[[], Awaitable[object]] | None = None
    ) -> pb.ModelInferResponse:
        cost, dataplane = 0, self.dataplane
        try:
            # The model's tensors bound how many a message may carry (a 503 while it loads).
            served = dataplane.model.name
            inputs, outputs = dataplane.inputs(served), dataplane.outputs(served)
            cost = _cost(message, len(inputs), len(outputs))
            if not self.budget.reserve(cost):
                cost = 0
                raise ServingError(
                    503,
                    f"the server is holding as many request bytes as it may "
                    f"({self.budget.limit}, --max-inflight-bytes); retry later",
                )
            try:
                request = pb.ModelInferRequest.FromString(message)
            except DecodeError:
                raise ServingError(400, "the message is not a ModelInferRequest") from None
            try:
                decoded = self._decode(request)
            except ServingError as exc:
                # Counted as Triton counts a failed request of this model (not one for another
                # model, nor one that came while it was loading).
                if exc.http_status not in (404, 503):
                    self.dataplane.request_failed()
                raise
            arrays = await self.dataplane.infer(
                request.model_name, request.model_version or None, decoded, gone
            )
            return _encode(request, decoded, arrays)
        finally:
            self.budget.release(cost)

    def _decode(self, request: pb.ModelInferRequest) -> InferRequest:
        dataplane, version = self.dataplane, request.model_version or None
        specs = {spec.name: spec for spec in dataplane.inputs(request.model_name, version)}
        raw = request.raw_input_contents
        if raw and len(raw) != len(request.inputs):
            raise ServingError(
                400,
                f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs; give one per "
                "input, in the order of inputs",
            )
        feeds: dict[str, np.ndarray] = {}
        for position, tensor in enumerate(request.inputs):
            spec = specs.get(tensor.name)
            if spec is None or tensor.name in feeds:
                what = "a duplicate" if tensor.name in feeds else "an unknown"
                expected = ", ".join(spec.describe() for spec in specs.values())
                raise ServingError(
                    400, f"{what} input {tensor.name!r}; the model expects {expected}"
                )
            feeds[tensor.name] = _tensor(tensor, raw[position] if raw else None)
        outputs = dataplane.outputs(request.model_name, version)
        known = {spec.name for spec in outputs}
        selected: list[tuple[str, bool]] = []
        for wanted in request.outputs:
            if wanted.name not in known or (wanted.name, True) in selected:
                listed = ", ".join(spec.describe() for spec in outputs)
                raise ServingError(
                    400, f"an unknown or repeated output {wanted.name!r}; the model has {listed}"
                )
            if "classification" in wanted.parameters:
                raise ServingError(400, "the classification extension is not supported")
            selected.append((wanted.name, True))
        if not selected:
            selected = [(spec.name, True) for spec in outputs]
        return InferRequest(request.id or None, feeds, selected)


def _tensor(tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes | None) -> np.ndarray:
    """One input as an array: raw bytes viewed in place, typed contents converted."""
    datatype = tensor.datatype

    def refused(problem: str) -> ServingError:
        return ServingError(400, f"input {tensor.name!r}: {problem}")

    if len(tensor.shape) > _MAX_DIMS:
        raise refused(f"{len(tensor.shape)} dimensions; a tensor has at most {_MAX_DIMS}")
    shape = list(tensor.shape)
    if any(dim < 0 for dim in shape):
        raise refused(f"shape {shape} has a negative size")
    if any(dim > _MAX_DIM for dim in shape):
        raise refused(f"shape {shape} has a size over {_MAX_DIM}")
    if (dtype := _NUMPY.get(datatype)) is None:
        raise refused(f"this server does not carry {datatype or 'untyped'} tensors")
    count = math.prod(shape)
    has_contents = tensor.HasField("contents")
    if raw is not None:
        if has_contents:
            raise refused("give either raw_input_contents or contents, not both")
        if len(raw) != count * dtype.itemsize:
            raise refused(
                f"{len(raw)} bytes of raw_input_contents; shape {shape} of {datatype} takes "
                f"{count * dtype.itemsize}"
            )
        return shaped(np.frombuffer(raw, dtype=dtype), shape, refused)
    if datatype not in _CONTENTS:
        raise refused(f"{datatype} tensors travel only as raw_input_contents")
    field, carried = _CONTENTS[datatype]
    values = getattr(tensor.contents, field)
    if len(values) != count:
        raise refused(f"{len(values)} values in contents.{field}; shape {shape} takes {count}")
    array = np.fromiter(values, dtype=carried, count=count)
    if carried != dtype:  # narrower integers travel as 32-bit ones
        info = np.iinfo(dtype)
        if count and (array.min() < info.min or array.max() > info.max):
            raise refused(f"a value of contents.{field} is out of {datatype}'s range")
        array = array.astype(dtype)
    return shaped(array, shape, refused)


def _encode(
    request: pb.ModelInferRequest, decoded: InferRequest, arrays: list[np.ndarray]
) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(
        model_name=request.model_name, model_version=MODEL_VERSION, id=request.id
    )
    for (name, _), array in zip(decoded.outputs, arrays, strict=True):
        if (datatype := _DATATYPE_OF.get(array.dtype)) is None:
            raise ServingError(500, f"output {name!r} of type {array.dtype} is not supported")
        response.outputs.add(name=name, datatype=datatype, shape=array.shape)
        response.raw_output_contents.append(
            np.ascontiguousarray(array, dtype=_NUMPY[datatype]).tobytes()
        )
    return response


def _cost(message: bytes, inputs: int, outputs: int) -> int:
    """What holding, parsing and decoding `message` may take, for a model of `inputs` inputs and
    `outputs` outputs: the call itself, the message and its raw tensors twice, the bytes of its
    input tensors (typed contents) `_TYPED_EXPANSION` times, and `_ENTRY_BYTES` for each field
    of the message and of its tensors. Read from the wire format without parsing the message:
    every top-level field is length-delimited and their number is capped, so the scan reads a
    few dozen fields whatever the message's size; a message that breaks either is refused."""
    view = memoryview(message)
    caps = {
        _PARAMETERS: (_MAX_PARAMETERS, f"more than {_MAX_PARAMETERS} request parameters"),
        _INPUTS: (inputs, f"more inputs than the model's {inputs}; send each input once"),
        _OUTPUTS: (outputs, f"more requested outputs than the model's {outputs}"),
        _RAW: (inputs, f"more raw_input_contents than the model's {inputs} inputs"),
        0: (_MAX_OTHER_FIELDS, f"more than {_MAX_OTHER_FIELDS} fields besides the tensors"),
    }
    counts = dict.fromkeys(caps, 0)
    entries = typed = 0
    for number, kind, start, end in _fields(view, 0, len(view)):
        if kind != _LENGTH_DELIMITED:
            raise _not_infer_request(
                f"field {number} has wire type {kind}; every field of a ModelInferRequest is "
                "length-delimited"
            )
        key = number if number in caps else 0
        counts[key] += 1
        if counts[key] > caps[key][0]:
            raise ServingError(400, f"the message has {caps[key][1]}")
        entries += 1
        if number == _INPUTS:  # an input tensor, with its typed contents
            typed += end - start
            entries += _tensor_fields(view, start, end, shape=3)
        elif number == _OUTPUTS:
            entries += _tensor_fields(view, start, end, shape=None)
    return _CALL_BYTES + 2 * len(message) + _TYPED_EXPANSION * typed + _ENTRY_BYTES * entries


def _tensor_fields(view: memoryview, start: int, end: int, shape: int | None) -> int:
    """The number of fields of the tensor at view[start:end] (not of its contents), at most
    `_MAX_TENSOR_FIELDS`; only the `shape` field (unpacked dimensions) may be a varint."""
    count = 0
    for number, kind, _, _ in _fields(view, start, end):
        count += 1
        if kind != _LENGTH_DELIMITED and number != shape:
            raise _not_infer_request(f"a tensor's field {number} has wire type {kind}")
        if count > _MAX_TENSOR_FIELDS:
            raise ServingError(
                400,
                f"a tensor of the message has more than {_MAX_TENSOR_FIELDS} fields (its "
                f"dimensions and parameters); a tensor has at most {_MAX_DIMS} dimensions",
            )
    return count


def _fields(view: memoryview, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field number, wire type, start, end of its value) of each field in view[start:end];
    only varint (0) and length-delimited (2) fields: no message of the protocol has others."""
    position = start
    while position < end:
        tag, position = _varint(view, position, end)
        kind = tag & 7
        if kind == _LENGTH_DELIMITED:
            length, position = _varint(view, position, end)
            if length > end - position:
                raise _not_infer_request("a field runs past the end of its message")
            yield tag >> 3, kind, position, position + length
            position += length
        elif kind == 0:
            _, after = _varint(view, position, end)
            yield tag >> 3, kind, position, after
            position = after
        else:
            raise _not_infer_request(f"field {tag >> 3} has wire type {kind}")


def _varint(view: memoryview, position: int, end: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if position >= end or shift > 63:
            raise _not_infer_request("a varint is cut short or too long")
        byte = view[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7


def _not_infer_request(problem: str) -> ServingError:
    return ServingError(
        400,
        f"the message is not a ModelInferRequest ({problem}); send one as "
        "inference.GRPCInferenceService's proto defines it",
    )
