"""Write `examples/tiny.onnx`, the README's model: y = relu(x @ W1 + b1) @ W2 + b2, x of shape
(batch, 3) and y of shape (batch, 2), float32. Its weights are small round numbers, so its answer
can be checked by hand: x = [1, 2, 3] gives y = [5.5, 1].

    .venv/bin/python examples/make_model.py   # writes examples/tiny.onnx (it ships too)

Built with the `onnx` package's helpers, as the tests build their models (a dev dependency that
`make run` installs).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
MODEL = HERE / "tiny.onnx"

W1 = np.array([[1, 0, -1, 0.5], [0, 1, 1, -0.5], [1, -1, 0, 0]], dtype=np.float32)
B1 = np.array([0, 0, 0, 1], dtype=np.float32)
W2 = np.array([[1, 0], [1, 1], [0, 2], [2, -2]], dtype=np.float32)
B2 = np.array([0.5, 0], dtype=np.float32)


def expected(x: np.ndarray) -> np.ndarray:
    """What the model answers for `x`, computed with numpy."""
    return np.asarray(np.maximum(x @ W1 + B1, 0) @ W2 + B2, dtype=np.float32)


def model_bytes() -> bytes:
    from onnx import TensorProto, checker, helper, numpy_helper

    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["xw1"]),
            helper.make_node("Add", ["xw1", "b1"], ["h_in"]),
            helper.make_node("Relu", ["h_in"], ["h"]),
            helper.make_node("MatMul", ["h", "w2"], ["hw2"]),
            helper.make_node("Add", ["hw2", "b2"], ["y"]),
        ],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 2])],
        [
            numpy_helper.from_array(W1, "w1"),
            numpy_helper.from_array(B1, "b1"),
            numpy_helper.from_array(W2, "w2"),
            numpy_helper.from_array(B2, "b2"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    checker.check_model(model)
    return bytes(model.SerializeToString())


def main() -> int:
    MODEL.write_bytes(model_bytes())
    print(f"wrote {MODEL}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
