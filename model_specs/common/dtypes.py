"""Parameter dtypes by the names configs and command lines use: the one map of the project."""
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
