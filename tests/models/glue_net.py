"""A small convolutional chain whose forward does glue of its own around its layers (scales the
image before the first, averages over H and W after the last, as a classifier's pooling would),
for a `channel` or `spatial` segment as the only one of a module model: the model's forward must
still run that glue on the segment's output."""
from torch import nn


class GlueNet(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1)
        self.relu2 = nn.ReLU()

    def forward(self, x):
        x = self.relu2(self.conv2(self.relu1(self.conv1(2 * x - 1))))
        return x.mean((2, 3))
