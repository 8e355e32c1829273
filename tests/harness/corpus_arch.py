"""Real architectures, hand-built in torch with seeded weights (nothing is downloaded): the corpus of
tests/integration/test_corpus.py. Copied into each custom torch package as ``corpus_arch.py``, so the stub
builds the same module the test runs in-process.

``build(name)`` returns the module in eval mode with the weights ``torch.manual_seed(SEED)`` gives;
``EXAMPLES[name]`` is (input name, shape with batch, dtype) of one request.
"""

from __future__ import annotations

import math

import torch
from torch import nn

SEED = 26


class Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


class ResNet(nn.Module):
    """A residual CNN: stem, two residual stages with a strided transition, global pooling, classifier."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.stage1 = Residual(16)
        self.down = nn.Sequential(nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
        self.stage2 = Residual(32)
        self.head = nn.Linear(32, classes)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.stage2(self.down(self.stage1(self.stem(image))))
        return self.head(x.mean(dim=(2, 3)))


def _separable(cin: int, cout: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cin, 3, stride=stride, padding=1, groups=cin, bias=False),  # depthwise
        nn.BatchNorm2d(cin),
        nn.ReLU6(),
        nn.Conv2d(cin, cout, 1, bias=False),  # pointwise
        nn.BatchNorm2d(cout),
        nn.ReLU6(),
    )


class MobileNet(nn.Module):
    """A mobile CNN: depthwise-separable blocks (MobileNet v1 style), global pooling, classifier."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU6(),
            _separable(16, 32, 1),
            _separable(32, 64, 2),
            _separable(64, 64, 1),
        )
        self.head = nn.Linear(64, classes)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(image).mean(dim=(2, 3)))


class Block(nn.Module):
    """A pre-norm transformer block, attention written out (what both ONNX exporters translate alike)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(w // self.heads), dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, w))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """A small vision transformer: 8x8 patches of a 32x32 image, a class token, learned positions."""

    def __init__(self, classes: int = 10, width: int = 32) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, width, 8, stride=8)
        self.cls = nn.Parameter(torch.randn(1, 1, width) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, 17, width) * 0.02)
        self.blocks = nn.Sequential(Block(width, 4), Block(width, 4))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.patch(image).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.norm(self.blocks(x))[:, 0])


class GRUClassifier(nn.Module):
    """A sequence model: a 2-layer GRU over [batch, time, 8] features, the last step classified."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(8, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 4)

    def forward(self, sequence: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(sequence)
        return self.head(out[:, -1])


class TextEncoder(nn.Module):
    """A transformer encoder over token ids: embeddings + positions, two blocks, mean pooling."""

    def __init__(self, vocab: int = 100, width: int = 32, length: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(1, length, width) * 0.02)
        self.blocks = nn.Sequential(Block(width, 4), Block(width, 4))
        self.head = nn.Linear(width, 3)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.embed(token_ids) + self.pos)
        return self.head(x.mean(dim=1))


class StatefulGRU(nn.Module):
    """A streaming model whose state the client carries: x [1, batch, 16], h [2, batch, 128] (batch not first)."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(16, 128, num_layers=2)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gru(x, h)


class Detector(nn.Module):
    """A YOLO-style two-scale head: stride-16 features upsampled and joined to stride-8 ones. Any image size that
    is a multiple of 16 works; a 1x1 image (a warm-up's -1 taken as 1) does not (the joined maps differ)."""

    def __init__(self, anchors: int = 3, classes: int = 2) -> None:
        super().__init__()
        self.s8 = nn.Sequential(
            nn.Conv2d(3, 8, 3, 2, 1),
            nn.ReLU(),
            nn.Conv2d(8, 16, 3, 2, 1),
            nn.ReLU(),
            nn.Conv2d(16, 16, 3, 2, 1),
            nn.ReLU(),
        )
        self.s16 = nn.Sequential(nn.Conv2d(16, 32, 3, 2, 1), nn.ReLU())
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.head = nn.Conv2d(48, anchors * (5 + classes), 1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        f8 = self.s8(images)
        f16 = self.s16(f8)
        x = torch.cat([f8, self.up(f16)], dim=1)
        out = self.head(x)
        return out.flatten(2).transpose(1, 2)  # [batch, cells, anchors * (5 + classes)]


ARCHITECTURES = {
    "resnet": ResNet,
    "mobilenet": MobileNet,
    "vit": ViT,
    "gru": GRUClassifier,
    "text-encoder": TextEncoder,
    "stateful-gru": StatefulGRU,
    "detector": Detector,
}

# One request per model (batch axis first): name, shape, dtype.
EXAMPLES = {
    "resnet": [("image", (2, 3, 32, 32), "float32")],
    "mobilenet": [("image", (2, 3, 32, 32), "float32")],
    "vit": [("image", (2, 3, 32, 32), "float32")],
    "gru": [("sequence", (2, 12, 8), "float32")],
    "text-encoder": [("token_ids", (2, 16), "int64")],
}
OUTPUTS = {"resnet": "logits", "mobilenet": "logits", "vit": "logits", "gru": "logits", "text-encoder": "logits"}


def build(name: str) -> nn.Module:
    torch.manual_seed(SEED)
    module = ARCHITECTURES[name]()
    if name in ("resnet", "mobilenet"):  # BatchNorm statistics that are not the identity
        for m in module.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    return module.eval()
