"""torchyard: run and watch distributed PyTorch training.

Inside a training process, ``torchyard.log(step, loss=..., **scalars)`` reports metrics.
"""

from torchyard.sdk import flush, log

__all__ = ["flush", "log"]
__version__ = "0.1.0"
