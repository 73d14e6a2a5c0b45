"""The built-in model server (WL-5b, issue 26): one ONNX model served over the Open Inference
Protocol, kept in four replaceable parts, as KServe's and Triton's servers are.

- the transports, which only decode and encode: `http` (HTTP/REST on Granian's RSGI interface,
  with the binary tensor data extension) and `grpc_service` (KServe v2 gRPC, carried by the
  native front, `grpc_native`);
- the one data plane both call, `dataplane.DataPlane`: health, metadata, `infer`, and the errors
  (`ServingError`, carrying the HTTP status and the gRPC code of each refusal);
- the scheduler that queues and batches requests, `batcher.Scheduler` (Triton's dynamic batcher's
  semantics), and the per-request timings it feeds to `metrics` (Triton's metric names);
- the model, `model.OnnxModel`: `instances` onnxruntime sessions behind load, warm-up, ready
  and run.

The protocol's encoding (JSON and binary tensors to numpy arrays and back, HTTP-free) is
`runtime_worker._oip`; the entry point is `runtime_worker.onnx_server`. Nothing here may write
request data to a log, read a body over its limit, or decode one before its bytes are counted.
"""
