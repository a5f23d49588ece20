"""What a run trains (``workload``): a built-in model and its params, or the user's own script."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from torchyard.spec.base import MAX_DATA_ELEMENTS, MAX_PARAMETERS, MAX_STEPS, _Strict


class MlpParams(_Strict):
    input_dim: int = Field(32, ge=1, le=65536)
    hidden: int = Field(128, ge=1, le=65536)
    layers: int = Field(3, ge=1, le=64, description="hidden layers")
    classes: int = Field(10, ge=2, le=65536)
    samples: int = Field(
        8192,
        ge=1,
        le=10_000_000,
        description=f"synthetic data set size; samples × input_dim ≤ {MAX_DATA_ELEMENTS:,} (1 GiB of fp32)",
    )

    @model_validator(mode="after")
    def _fits_in_memory(self) -> MlpParams:
        if self.samples * self.input_dim > MAX_DATA_ELEMENTS:
            raise ValueError(
                f"workload.params.samples × input_dim ({self.samples} × {self.input_dim}) must be at most "
                f"{MAX_DATA_ELEMENTS:,} (a 1 GiB data set on every rank)"
            )
        if self.parameters > MAX_PARAMETERS:
            raise ValueError(
                f"workload.params: the model has {self.parameters:,} parameters (input_dim × hidden + "
                f"(layers − 1) × hidden² + hidden × classes), more than {MAX_PARAMETERS:,}"
            )
        return self

    @property
    def parameters(self) -> int:
        return self.input_dim * self.hidden + (self.layers - 1) * self.hidden**2 + self.hidden * self.classes


class CharLMParams(_Strict):
    d_model: int = Field(64, ge=8, le=4096)
    n_layers: int = Field(2, ge=1, le=48)
    n_heads: int = Field(4, ge=1, le=64)
    seq_len: int = Field(64, ge=8, le=4096)
    corpus_bytes: int = Field(
        2_000_000, ge=10_000, le=2**26, description="bytes of stdlib source to train on (at most 64 MiB)"
    )

    @model_validator(mode="after")
    def _heads_divide_width(self) -> CharLMParams:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.parameters > MAX_PARAMETERS:
            raise ValueError(
                f"workload.params: the model has about {self.parameters:,} parameters (12 × d_model² × n_layers), "
                f"more than {MAX_PARAMETERS:,}"
            )
        return self

    @property
    def parameters(self) -> int:
        return 12 * self.d_model**2 * self.n_layers


class MlpConfig(_Strict):
    kind: Literal["builtin"] = "builtin"
    name: Literal["mlp"]
    params: MlpParams = MlpParams()


class CharLMConfig(_Strict):
    kind: Literal["builtin"] = "builtin"
    name: Literal["charlm"]
    params: CharLMParams = CharLMParams()


class FailParams(_Strict):
    at_step: int = Field(1, ge=1, le=MAX_STEPS, description="the step at which it fails")
    rank: int | None = Field(None, ge=0, le=2**16, description="only this rank fails (default: every rank)")
    times: int = Field(0, ge=0, le=1000, description="fail only in the first N starts of the ranks (0: every start)")
    hang: bool = Field(False, description="hang (stop stepping) instead of raising")
    hang_in: Literal["python", "data_loading", "skip_collective", "other_collective"] = Field(
        "python",
        description="where a hang happens: waiting in Python at the step; sleeping while loading the step's batch; "
        "past an all_reduce the other ranks wait in (skip_collective) or in a broadcast where they all_reduce "
        "(other_collective): the last two need `rank`",
    )

    slow_s: float = Field(
        0,
        ge=0,
        le=60,
        description="> 0: instead of raising, the rank (or every rank) is this many seconds slower per step from "
        "at_step on, in `slow_in` (a straggler, or a run that slows down)",
    )
    slow_in: Literal["data_loading", "compute", "throttled"] = Field(
        "data_loading",
        description="where a slow step spends its extra time: loading the batch (data_time_s) or between loading "
        "and the backward's collectives (compute_time_s); or `throttled`: the rank may use 5 % of a CPU and is "
        "stopped whenever it is over, as a container at its CPU quota is (any slow_s > 0; how much slower depends "
        "on the step)",
    )

    @model_validator(mode="after")
    def _one_rank_leaves_the_others(self) -> FailParams:
        if self.hang and self.slow_s:
            raise ValueError(
                f"workload.params.hang and workload.params.slow_s ({self.slow_s:g}) exclude each other: a rank "
                "either hangs or runs slowly"
            )
        if self.hang and self.hang_in.endswith("_collective") and self.rank is None:
            raise ValueError(
                f"workload.params.hang_in ({self.hang_in!r}) needs workload.params.rank: the rank that breaks "
                "away from the collective the others make"
            )
        return self


FAIL_MLP = MlpParams(hidden=16, layers=1, samples=1024)  # the fail workload's model and data


class FailConfig(_Strict):
    """Raises (or hangs, or slows down) at the given step: shows how a failing, hung or straggling
    run looks, how torch elastic restarts a crashed rank, how the watchdog finds a stall, how a
    straggler is named and a slowdown raises an alert (and tests them)."""

    kind: Literal["builtin"] = "builtin"
    name: Literal["fail"]
    params: FailParams = FailParams()


BUNDLE_ID = r"^[0-9a-f]{64}$"


class ScriptConfig(_Strict):
    """The user's own code: an uploaded bundle (``POST /api/v1/bundles``) whose ``entry`` script
    runs as ``torchrun`` would run it, with ``args``. The script does its own parallelism (the
    strategy must stay the default); step time, throughput and DDP communication are measured
    without it changing a line, and whatever it logs with ``torchyard.log`` is kept too."""

    kind: Literal["script"] = "script"
    name: Literal["script"] = "script"
    bundle: str = Field(..., pattern=BUNDLE_ID, description="the bundle's id (its sha256), from POST /api/v1/bundles")
    entry: str = Field(..., min_length=1, max_length=1000, description="the script to run, a path inside the bundle")
    args: list[Annotated[str, Field(max_length=10_000)]] = Field(
        default_factory=list, max_length=1000, description="its command-line arguments"
    )

    @model_validator(mode="after")
    def _entry_inside_bundle(self) -> ScriptConfig:
        parts = self.entry.replace("\\", "/").split("/")
        if self.entry.startswith("/") or ".." in parts or not self.entry.endswith(".py"):
            raise ValueError(f"workload.entry ({self.entry!r}) must be a relative path to a .py file inside the bundle")
        return self


WorkloadConfig = Annotated[MlpConfig | CharLMConfig | FailConfig | ScriptConfig, Field(discriminator="name")]
