"""A small torch conv net (two convolutions, pooling, a linear head) for the cold-start bench; torch is
imported in load(), so importing this file stays cheap."""

import numpy as np


class Model:
    def load(self, model_dir: str, device: str) -> None:
        import torch

        torch.manual_seed(0)
        self.torch = torch
        self.device = torch.device(device)
        self.module = (
            torch.nn.Sequential(
                torch.nn.Conv2d(3, 16, 3, padding=1),
                torch.nn.ReLU(),
                torch.nn.MaxPool2d(2),
                torch.nn.Conv2d(16, 32, 3, padding=1),
                torch.nn.ReLU(),
                torch.nn.AdaptiveAvgPool2d(1),
                torch.nn.Flatten(),
                torch.nn.Linear(32, 10),
            )
            .eval()
            .to(self.device)
        )

    def predict(self, inputs: dict) -> dict:
        with self.torch.inference_mode():
            x = self.torch.from_numpy(inputs["image"]).to(self.device)
            logits = self.module(x)
        return {"logits": logits.cpu().numpy().astype(np.float32)}
