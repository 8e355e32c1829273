"""Several inputs of different dtypes: FP32 values, an INT64 factor and a BYTES string."""

import numpy as np


class Model:
    def load(self, model_dir: str, device: str) -> None:
        self.greeting = b"hello, "

    def predict(self, inputs: dict) -> dict:
        values = inputs["values"]  # (batch, 4) float32
        factor = inputs["factor"]  # (batch, 1) int64
        text = inputs["text"]  # (batch, 1) object array of bytes
        greet = np.array([[self.greeting + t] for t in text[:, 0]], dtype=object)
        lengths = np.array([[len(t)] for t in text[:, 0]], dtype=np.int64)
        return {"scaled": (values * factor).astype(np.float32), "greeting": greet, "length": lengths}
