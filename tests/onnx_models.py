"""A tiny ONNX model the job tests run on a node, in a container or on a GPU: y = relu(x @ w)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def relu_matmul(weights: np.ndarray) -> bytes:
    """The serialised model y = relu(x @ weights), x of shape (batch, rows of `weights`)."""
    rows, columns = weights.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Relu", ["xw"], ["y"])],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, rows])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, columns])],
        [helper.make_tensor("w", TensorProto.FLOAT, [rows, columns], weights.flatten().tolist())],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model.SerializeToString()


def mlp(sizes: tuple[int, ...] = (256, 256, 10), seed: int = 0) -> bytes:
    """The serialised MLP x -> relu(x @ w1 + b1) -> ... -> x @ wn + bn (no relu after the last
    layer), x of shape (batch, sizes[0]); FP32 weights drawn from `seed`."""
    rng = np.random.default_rng(seed)
    nodes, initializers, current = [], [], "x"
    layers = list(zip(sizes, sizes[1:], strict=False))
    for index, (rows, columns) in enumerate(layers):
        weights = (rng.standard_normal((rows, columns)) / np.sqrt(rows)).astype(np.float32)
        bias = (rng.standard_normal(columns) * 0.1).astype(np.float32)
        initializers += [
            numpy_helper.from_array(weights, f"w{index}"),
            numpy_helper.from_array(bias, f"b{index}"),
        ]
        last = index == len(layers) - 1
        output = "y" if last else f"h{index}"
        gemm = f"g{index}" if not last else output
        nodes.append(helper.make_node("MatMul", [current, f"w{index}"], [f"m{index}"]))
        nodes.append(helper.make_node("Add", [f"m{index}", f"b{index}"], [gemm]))
        if not last:
            nodes.append(helper.make_node("Relu", [gemm], [output]))
        current = output
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, sizes[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, sizes[-1]])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model.SerializeToString()
