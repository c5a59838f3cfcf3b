"""A stack of stock `nn.TransformerEncoderLayer`s for placer's example specs.

An input projection, the encoder layers (a ModuleList, so each is a layer a
spec can place: `layers.0` ..), a mean over the sequence in `forward` (work
owned by no placed layer) and a classification head. No dropout, so a placed
run can match a one-device run. `forward` checks the input's rank, which
torch.fx cannot trace, so placer measures this model with forward hooks.
"""
from torch import nn


class Encoder(nn.Module):
    def __init__(self, d_in: int = 32, d_model: int = 64, nhead: int = 4, dim_feedforward: int = 128,
                 n_layers: int = 4, n_classes: int = 10):
        super().__init__()
        self.inp = nn.Linear(d_in, d_model)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout=0.0, batch_first=True)
            for _ in range(n_layers))
        self.head = nn.Linear(d_model, n_classes)

    def forward(self, x):
        if x.dim() != 3:  # a check on a shape: torch.fx cannot trace it, forward hooks can
            raise ValueError(f"Encoder expects [batch, seq, features], got {list(x.shape)}")
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(dim=1))
