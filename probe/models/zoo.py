"""Small models shipped for examples and tests."""

from torch import nn
from torch.nn import functional as F


class LeNet(nn.Module):
    """The LeNet of the classic hook tutorial: 1x32x32 input, functional ReLU and pooling."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), (2, 2))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = x.view(x.size()[0], -1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class MLP(nn.Module):
    """`depth` hidden Linear layers of `width` units, each followed by a ReLU, and a Linear
    readout, on flattened inputs of `input_shape`: the model of mup's coordinate check (layers
    `hidden.0`, `hidden.1`, ..., `readout`)."""

    def __init__(self, width: int = 128, depth: int = 3, num_classes: int = 10,
                 input_shape=(3, 8, 8)):  # fmt: skip
        super().__init__()
        features = 1
        for size in input_shape:
            features *= int(size)
        self.hidden = nn.ModuleList(
            nn.Linear(features if i == 0 else width, width) for i in range(depth)
        )
        self.readout = nn.Linear(width if depth else features, num_classes)

    def forward(self, x):
        x = x.reshape(len(x), -1)
        for layer in self.hidden:
            x = F.relu(layer(x))
        return self.readout(x)
