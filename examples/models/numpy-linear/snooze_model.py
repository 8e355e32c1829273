"""A numpy model: y = scale * (x @ W + b) with fixed weights. No snoozeml import needed."""

import numpy as np


class Model:
    def __init__(self, scale: float = 1.0):
        self.scale = scale
        self.weights = None

    def load(self, model_dir: str, device: str) -> None:
        # Weights would normally be read from model_dir; these are fixed so answers are checkable.
        self.weights = np.arange(12, dtype=np.float32).reshape(4, 3) / 10.0
        self.bias = np.array([0.5, -0.5, 1.0], dtype=np.float32)

    def predict(self, inputs: dict) -> dict:
        x = inputs["x"]
        return {"y": (self.scale * (x @ self.weights + self.bias)).astype(np.float32)}
