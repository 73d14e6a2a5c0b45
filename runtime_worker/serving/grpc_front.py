"""The gRPC front: the Open Inference Protocol's gRPC API (KServe v2,
`inference.GRPCInferenceService`) on a second port, so that standard clients such as
`tritonclient.grpc` work unchanged: ServerLive, ServerReady, ModelReady, ServerMetadata,
ModelMetadata and ModelInfer, with tensors as `raw_input_contents` / `raw_output_contents` (what
tritonclient sends) or as typed `contents`.

It only decodes and encodes: messages into `_oip.InferRequest`s for the one `DataPlane` the HTTP
front also calls, its arrays into raw output contents, and its `ServingError`s into the gRPC
status each carries (INVALID_ARGUMENT, NOT_FOUND, UNAVAILABLE for a full queue or a model still
loading). It runs a `grpc.aio` server on the event loop it is started on (the HTTP front's).

Memory is bounded as the HTTP front bounds it: gRPC refuses a message over `max_message_bytes`
with RESOURCE_EXHAUSTED before it is parsed, and an infer request holds what parsing and decoding
it may take against the server's byte budget (shared with the HTTP front) before it is parsed;
one that does not fit is refused at once (UNAVAILABLE). It never logs request data.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import grpc
import grpc.aio
import numpy as np
from google.protobuf.message import DecodeError

from runtime_worker._oip import _DATATYPE_OF, _NUMPY, MODEL_VERSION, InferRequest, ServingError
from runtime_worker.serving._proto import grpc_predict_v2_pb2 as pb
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


@dataclass
class GrpcFront:
    """A started gRPC front: its bound port; `stop` ends it."""

    server: grpc.aio.Server
    port: int

    async def stop(self, grace: float | None) -> None:
        """Refuse new calls, let those running finish for up to `grace` seconds, end."""
        await self.server.stop(grace)


async def start(
    dataplane: DataPlane,
    host: str,
    port: int,
    *,
    max_message_bytes: int,
    budget: Budget | None = None,
) -> GrpcFront:
    """Serve `dataplane` over gRPC on host:port (0: any free port) on the running event loop.
    Raises OSError when the port cannot be bound."""
    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", -1),
        # One server per port: a second process on the same port is an error, not a silent
        # sharer of its calls.
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.aio.server(options=options)
    # Registered (not generic) handlers: gRPC's core matches the method, no Python per call.
    handlers = _Servicer(dataplane, budget or _Unbounded()).handlers()
    server.add_registered_method_handlers(SERVICE, handlers)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpc says only that it failed to bind
        raise OSError(f"cannot listen for gRPC on {address}") from exc
    await server.start()
    return GrpcFront(server, bound)


_Handler = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]]


class _Servicer:
    def __init__(self, dataplane: DataPlane, budget: Budget) -> None:
        self.dataplane, self.budget = dataplane, budget

    def handlers(self) -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
        def unary(
            method: _Handler, request: Any, response: Any, raw: bool = False
        ) -> grpc.RpcMethodHandler[Any, Any]:
            return grpc.unary_unary_rpc_method_handler(
                method,
                request_deserializer=None if raw else request.FromString,
                response_serializer=response.SerializeToString,
            )

        return {
            "ServerLive": unary(self.server_live, pb.ServerLiveRequest, pb.ServerLiveResponse),
            "ServerReady": unary(self.server_ready, pb.ServerReadyRequest, pb.ServerReadyResponse),
            "ModelReady": unary(self.model_ready, pb.ModelReadyRequest, pb.ModelReadyResponse),
            "ServerMetadata": unary(
                self.server_metadata, pb.ServerMetadataRequest, pb.ServerMetadataResponse
            ),
            "ModelMetadata": unary(
                self.model_metadata, pb.ModelMetadataRequest, pb.ModelMetadataResponse
            ),
            # Kept as bytes until the budget holds what parsing it takes.
            "ModelInfer": unary(
                self.model_infer, pb.ModelInferRequest, pb.ModelInferResponse, raw=True
            ),
        }

    async def server_live(
        self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self.dataplane.live())

    async def server_ready(
        self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.dataplane.ready())

    async def model_ready(
        self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ModelReadyResponse:
        try:
            ready = self.dataplane.model_ready(request.name, request.version or None)
        except ServingError as exc:
            await _abort(context, exc)
        return pb.ModelReadyResponse(ready=ready)

    async def server_metadata(
        self, request: pb.ServerMetadataRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(**self.dataplane.server_metadata())

    async def model_metadata(
        self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ModelMetadataResponse:
        try:
            metadata = self.dataplane.model_metadata(request.name, request.version or None)
        except ServingError as exc:
            await _abort(context, exc)
        return pb.ModelMetadataResponse(**metadata)

    async def model_infer(
        self, message: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ModelInferResponse:
        started, cost = time.perf_counter_ns(), 0
        try:
            cost = _cost(message)
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
                    self.dataplane.request_failed(started)
                raise
            arrays = await self.dataplane.infer(
                request.model_name, request.model_version or None, decoded
            )
            return _encode(request, decoded, arrays)
        except ServingError as exc:
            await _abort(context, exc)
        except Exception as exc:  # a bug: answered, and logged without the request's data
            log.error("internal error on ModelInfer: %s", type(exc).__name__)
            await _abort(context, ServingError(500, f"internal error ({type(exc).__name__})"))
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
    shape = list(tensor.shape)
    datatype = tensor.datatype

    def refused(problem: str) -> ServingError:
        return ServingError(400, f"input {tensor.name!r}: {problem}")

    if any(dim < 0 for dim in shape):
        raise refused(f"shape {shape} has a negative size")
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
        return np.frombuffer(raw, dtype=dtype).reshape(shape)
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
    return array.reshape(shape)


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


def _cost(message: bytes) -> int:
    """What holding, parsing and decoding `message` may take: the call itself, the message and
    its raw tensors twice, the bytes of its input tensors (typed contents) `_TYPED_EXPANSION`
    times. Read from the top-level fields of the wire format, without parsing the message."""
    view, position, typed = memoryview(message), 0, 0

    def varint() -> int:
        nonlocal position
        value, shift = 0, 0
        while True:
            if position >= len(view) or shift > 63:
                raise ServingError(400, "the message is not a ModelInferRequest")
            byte = view[position]
            position += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value
            shift += 7

    while position < len(view):
        tag = varint()
        kind = tag & 7
        if kind == 0:
            varint()
        elif kind == 1:
            position += 8
        elif kind == 5:
            position += 4
        elif kind == 2:
            length = varint()
            if tag >> 3 == 5:  # an input tensor, with its typed contents
                typed += length
            position += length
        else:
            raise ServingError(400, "the message is not a ModelInferRequest")
    return _CALL_BYTES + 2 * len(message) + _TYPED_EXPANSION * typed


async def _abort(context: grpc.aio.ServicerContext[Any, Any], error: ServingError) -> NoReturn:
    await context.abort(grpc.StatusCode[error.grpc_code], error.message)
    raise AssertionError("abort returned")  # pragma: no cover - abort always raises
