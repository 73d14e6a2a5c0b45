"""A tiny ONNX model the job tests run on a node, in a container or on a GPU: y = relu(x @ w)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper


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
