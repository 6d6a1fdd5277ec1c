"""A tiny greedy-decoding language model whose bf16 tokens are known exactly, for %%amp's token agreement.

Vocabulary 8, one-hot embedding, a linear head with no bias: the next token after ``t`` is
``argmax(W[t])``, ``t + 1`` with a margin of 1, except after 5, where 7 beats 6 by 0.001. bf16 holds
1.001 as 1.0 (its spacing at 1 is 2**-7), so under bf16 autocast the two tie and argmax takes the
first: 6. fp32 and bf16 then agree until a sequence reaches 5, and differ after it.
"""

from __future__ import annotations

SOURCE = """
import torch

class TinyGreedy(torch.nn.Module):
    def __init__(self, vocab=8):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, vocab)
        self.head = torch.nn.Linear(vocab, vocab, bias=False)
        with torch.no_grad():
            self.emb.weight.copy_(torch.eye(vocab))
            w = torch.zeros(vocab, vocab)
            for t in range(vocab):
                w[t, (t + 1) % vocab] = 1.0
            w[5, 6], w[5, 7] = 1.0, 1.001
            self.head.weight.copy_(w.T)

    def forward(self, ids):
        return self.head(self.emb(ids))

    @torch.no_grad()
    def generate(self, ids, max_new_tokens=6, eos_token_id=None):
        # Hugging Face style: the prompt, then one greedy token per step, as one LongTensor; stops when
        # every sequence has just made eos_token_id
        for _ in range(max_new_tokens):
            ids = torch.cat([ids, self(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
            if eos_token_id is not None and bool((ids[:, -1] == eos_token_id).all()):
                break
        return ids

model = TinyGreedy()
ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
"""


def next_token(t: int, bf16: bool) -> int:
    """The model's greedy choice after ``t``, worked out by hand."""
    return (6 if bf16 else 7) if t == 5 else (t + 1) % 8


def decode(prompt: list[int], new: int, bf16: bool, eos: int | None = None) -> list[int]:
    seq = list(prompt)
    for _ in range(new):
        seq.append(next_token(seq[-1], bf16))
        if seq[-1] == eos:
            break
    return seq
