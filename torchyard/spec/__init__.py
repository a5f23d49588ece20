"""The run spec: what a user submits. Validated at submit (a bad spec is a 422 that names the
field and the value) and handed unchanged to the ranks, which read it back with the same models.

Its parts: ``base`` (the bounds every number is held to, README's "Limits"), ``workloads`` (what a
run trains), ``strategies`` (how it spreads over the ranks), ``run`` (``RunSpec``: resources, data,
training, and the checks across sections). Import the models from here."""

from torchyard.spec.base import MAX_ACTIVATIONS, MAX_DATA_ELEMENTS, MAX_PARAMETERS, MAX_SECONDS, MAX_STEPS
from torchyard.spec.run import (
    CHECKPOINT_ON_CANCEL_GRACE_S,
    DataConfig,
    ResourcesConfig,
    RunSpec,
    TrainingConfig,
    pipeline_blocks,
)
from torchyard.spec.strategies import (
    AsyncConfig,
    DdpConfig,
    FsdpConfig,
    FsdpTpConfig,
    LocalSgdConfig,
    PipelineConfig,
    StrategyConfig,
    TpConfig,
    ZeroConfig,
    strategy_kinds,
)
from torchyard.spec.workloads import (
    BUNDLE_ID,
    FAIL_MLP,
    CharLMConfig,
    CharLMParams,
    FailConfig,
    FailParams,
    MlpConfig,
    MlpParams,
    ScriptConfig,
    WorkloadConfig,
)

__all__ = [
    "BUNDLE_ID",
    "CHECKPOINT_ON_CANCEL_GRACE_S",
    "FAIL_MLP",
    "MAX_ACTIVATIONS",
    "MAX_DATA_ELEMENTS",
    "MAX_PARAMETERS",
    "MAX_SECONDS",
    "MAX_STEPS",
    "AsyncConfig",
    "CharLMConfig",
    "CharLMParams",
    "DataConfig",
    "DdpConfig",
    "FailConfig",
    "FailParams",
    "FsdpConfig",
    "FsdpTpConfig",
    "LocalSgdConfig",
    "MlpConfig",
    "MlpParams",
    "PipelineConfig",
    "ResourcesConfig",
    "RunSpec",
    "ScriptConfig",
    "StrategyConfig",
    "TpConfig",
    "TrainingConfig",
    "WorkloadConfig",
    "ZeroConfig",
    "pipeline_blocks",
    "strategy_kinds",
]
