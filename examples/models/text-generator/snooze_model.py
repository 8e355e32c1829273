"""A small streaming text generator: a word-level Markov chain trained at load on the text it ships.

``predict`` is a generator, so snoozeml renders the model as a decoupled (streaming) Triton model: each
``yield`` is one response carrying one token, sent to the client as soon as it is made.
"""

from __future__ import annotations

import os
from collections import defaultdict

import numpy as np


class Model:
    def __init__(self, seed: int = 0, order: int = 2) -> None:
        self.seed = seed
        self.order = order
        self.chain: dict[tuple[str, ...], list[str]] = {}
        self.words: list[str] = []

    def load(self, model_dir: str, device: str) -> None:
        with open(os.path.join(model_dir, "corpus.txt"), encoding="utf-8") as f:
            self.words = f.read().split()
        chain: dict[tuple[str, ...], list[str]] = defaultdict(list)
        for n in range(1, self.order + 1):  # shorter contexts too: a prompt of one word still has a follower
            for i in range(len(self.words) - n):
                chain[tuple(w.lower() for w in self.words[i : i + n])].append(self.words[i + n])
        self.chain = dict(chain)

    def _next(self, context: list[str], rng: np.random.Generator) -> str:
        for n in range(min(self.order, len(context)), 0, -1):
            followers = self.chain.get(tuple(w.lower() for w in context[-n:]))
            if followers:
                return followers[int(rng.integers(len(followers)))]
        return self.words[int(rng.integers(len(self.words)))]

    def predict(self, inputs):
        prompt = inputs["prompt"].reshape(-1)[0]
        prompt = prompt.decode("utf-8") if isinstance(prompt, bytes) else str(prompt)
        max_tokens = int(inputs["max_tokens"].reshape(-1)[0])
        rows = inputs["prompt"].shape[0] if inputs["prompt"].ndim > 1 else None
        rng = np.random.default_rng(self.seed)
        context = prompt.split()
        for _ in range(max_tokens):
            word = self._next(context, rng)
            context.append(word)
            token = np.array([(" " + word).encode("utf-8")], dtype=object)
            yield {"token": token.reshape(rows, 1) if rows else token}
