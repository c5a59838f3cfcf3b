"""A small convolutional network with a ResNet stem in torchvision's names (`conv1, bn1, relu,
maxpool`), two 3x3 convolutions and a classifier (`avgpool, fc`), for split modes in pipelines:
with `norm: false` the stem's BatchNorm is an Identity, as a pipeline's micro-batches would give
BatchNorm other statistics than the one-device run (W006)."""
import torch
from torch import nn


class StemNet(nn.Module):
    def __init__(self, width: int = 8, classes: int = 10, norm: bool = True):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width) if norm else nn.Identity()
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, 1, 1)
        self.relu2 = nn.ReLU()
        self.conv3 = nn.Conv2d(2 * width, 2 * width, 3, 2, 1)
        self.relu3 = nn.ReLU()
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.relu3(self.conv3(self.relu2(self.conv2(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))
