"""The run spec's bounds and its models' base: every number is finite and bounded (the api runs the
spec on strangers' input; a rank allocates what it says); the bounds here are the one place they
are set, and README's "Limits" quotes them."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

# Step-like counts (steps, every-N-steps, warm-ups). Past this a run would outlive any machine.
MAX_STEPS = 100_000_000
# Built-in workloads' memory, in fp32 elements, estimated from the params before a rank allocates
# it; together they keep a rank within a few GiB (host OOM otherwise takes the node down):
MAX_PARAMETERS = 2**27  # model weights: 512 MiB, about 2 GiB with gradients and optimizer state
MAX_DATA_ELEMENTS = 2**28  # the mlp's synthetic data set: 1 GiB
MAX_ACTIVATIONS = 2**29  # one step's activations kept for backward (global batch, rough): 2 GiB
MAX_SECONDS = 30 * 86_400  # stall_timeout_s, max_duration_s: 30 days


class _Strict(BaseModel):
    # allow_inf_nan=False: NaN/Infinity (Python's json reads them, and 1e400 as inf) are a 422.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
