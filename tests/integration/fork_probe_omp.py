"""A preload module that runs an OpenMP parallel region at import (a fork server must refuse to fork after it)."""

import torch

torch.set_num_threads(2)
_ = torch.ones(256, 256) @ torch.ones(256, 256)
