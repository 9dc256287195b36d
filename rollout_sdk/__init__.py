"""rollout_sdk: the contract between the `rollout` engine and Python plugins.

Plugin kinds: :class:`Policy` (the model), :class:`GenerationEngine` (a generation backend
such as vLLM), :class:`Reward`, :class:`Environment` (and :class:`MultiAgentEnvironment`),
:class:`DataSource` and :class:`Transform`, :class:`Callback`. Each declares a nested ``Config``
dataclass that is built from its TOML table. :mod:`rollout_sdk.testing` checks a plugin from
plain pytest; :mod:`rollout_sdk.objectives` holds the torch losses policies share.
"""

from rollout_sdk.callback import Callback, RunInfo
from rollout_sdk.config import ConfigError, build_config
from rollout_sdk.data import DataSource, Pipeline, Record, Transform
from rollout_sdk.engine import EngineStep, EngineStepOutput, KvLayout
from rollout_sdk.environment import Environment, StepResult
from rollout_sdk.generation_engine import GenerationEngine
from rollout_sdk.metrics import StepMetrics
from rollout_sdk.multi_agent import AgentTurn, JointStepResult, MultiAgentEnvironment
from rollout_sdk.plugin import Plugin, PluginSpecError, load_plugin, resolve_plugin_class
from rollout_sdk.policy import Policy
from rollout_sdk.reward import Reward, SampleFailure
from rollout_sdk.snapshot import HostTensor, TensorFile
from rollout_sdk.types import (
    DpoObjective,
    FinishReason,
    Generation,
    GenerationRequest,
    GrpoObjective,
    GspoObjective,
    Objective,
    PpoObjective,
    Sample,
    SamplingParams,
    SftObjective,
    Sharding,
    TokenBatch,
    TrainBatch,
)

__version__ = "0.1.0"

__all__ = [
    "AgentTurn",
    "Callback",
    "ConfigError",
    "DataSource",
    "DpoObjective",
    "EngineStep",
    "EngineStepOutput",
    "Environment",
    "FinishReason",
    "Generation",
    "GenerationEngine",
    "GenerationRequest",
    "GrpoObjective",
    "GspoObjective",
    "HostTensor",
    "JointStepResult",
    "KvLayout",
    "MultiAgentEnvironment",
    "Objective",
    "Pipeline",
    "Plugin",
    "PluginSpecError",
    "Policy",
    "PpoObjective",
    "Record",
    "Reward",
    "RunInfo",
    "Sample",
    "SampleFailure",
    "SamplingParams",
    "SftObjective",
    "Sharding",
    "StepMetrics",
    "StepResult",
    "TensorFile",
    "TokenBatch",
    "TrainBatch",
    "Transform",
    "build_config",
    "load_plugin",
    "resolve_plugin_class",
]
