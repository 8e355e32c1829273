"""A torch model that imports torch lazily: importing this file stays cheap (no torch)."""

import numpy as np


def _build_module():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).eval()


class Model:
    def load(self, model_dir: str, device: str) -> None:
        import torch

        torch.set_num_threads(1)
        self.torch = torch
        self.device = torch.device(device)
        self.module = _build_module().to(self.device)

    def predict(self, inputs: dict) -> dict:
        with self.torch.inference_mode():
            x = self.torch.from_numpy(inputs["features"]).to(self.device)
            logits = self.module(x)
        return {"logits": logits.cpu().numpy().astype(np.float32)}

    def export_module(self):
        """Hook for `snoozectl convert torch`: the module and example inputs."""
        return _build_module(), {"features": np.zeros((2, 8), dtype=np.float32)}
