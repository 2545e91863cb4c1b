from torch import nn


class Drafter(nn.Module):  # as transformers' Gemma 4 assistants: token ids alone do not run it
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.up = nn.Linear(16, 64)

    def forward(self, ids, target_states=None):
        if target_states is None:
            raise ValueError("target_states cannot be None")
        return self.up(self.embed(ids) + target_states)


def build():
    return Drafter()
