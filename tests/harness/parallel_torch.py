"""A torch model whose ops go parallel with the machine's default thread count (OpenMP regions in its conv and
matmul, numpy's BLAS in a matmul): preforked, each wake is a fresh worker forked from one preloaded parent,
which must not have had a pool running (tests/unit/test_prefork.py,
tests/integration/test_python_backend_runtime.py)."""

PARALLEL_TORCH_MODEL = """import os

import numpy as np
import torch


class Model:
    def load(self, model_dir, device):
        g = torch.Generator().manual_seed(0)
        self.image = torch.rand(1, 8, 96, 96, generator=g)
        self.kernel = torch.rand(16, 8, 5, 5, generator=g)
        self.matrix = torch.rand(384, 384, generator=g)

    def predict(self, inputs):
        x = torch.from_numpy(inputs["x"])
        with torch.inference_mode():
            # both go parallel with the default thread count: OpenMP regions in the conv and the matmul
            conv = torch.nn.functional.conv2d(self.image * x[:, :1, None, None], self.kernel, padding=2)
            square = self.matrix @ (self.matrix * x[:1, 1:])
            y = torch.stack([conv.mean((1, 2, 3)), square.mean().expand(len(x))], 1)
        blas = np.ones((256, 256)) @ np.ones((256, 256))  # numpy's BLAS, in parallel too
        threads = np.full((len(x), 1), torch.get_num_threads(), np.int64)
        return {"y": y.numpy(), "pid": np.full((len(x), 1), os.getpid() + 0 * int(blas[0, 0]), np.int64),
                "threads": threads}
"""
