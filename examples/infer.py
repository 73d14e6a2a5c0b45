"""Call the README's model with the standard Open Inference Protocol client, tritonclient, at
the control plane's address with the service's key:

    .venv/bin/python examples/infer.py "$CP" "$KEY"

It sends x = [[1, 2, 3]] as binary tensor data (the client's default) and prints y.
"""

from __future__ import annotations

import sys

import numpy as np
import tritonclient.http as httpclient


def main(url: str, key: str, model: str = "tiny") -> int:
    client = httpclient.InferenceServerClient(url=url.split("://", 1)[-1])  # host:port
    x = np.array([[1, 2, 3]], dtype=np.float32)
    inputs = [httpclient.InferInput("x", list(x.shape), "FP32")]
    inputs[0].set_data_from_numpy(x)
    result = client.infer(model, inputs, headers={"Authorization": f"Bearer {key}"})
    print("y =", result.as_numpy("y").tolist())
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: infer.py <the control plane's URL> <the service's key>")
    sys.exit(main(sys.argv[1], sys.argv[2]))
