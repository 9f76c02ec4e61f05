"""One typed config tree for rlpipe: a YAML recipe plus `section.key=value` overrides.

Each section is a dataclass in the module of its name (`rollout.max_tokens` is defined, and checked, in
rlpipe/config/rollout.py); tree.py joins them into `Config` and holds the checks that read two sections; loading.py
reads recipes and overrides, coerce.py types their values, help.py lists every key for `rlpipe train --help`, and
errors.py has ConfigError, whose message is always one line that names the key.
"""

from rlpipe.config.algo import AlgoConfig
from rlpipe.config.data import (
    RENDERING_ARGUMENTS,
    DataConfig,
    FileSource,
    HumanEvalSource,
    PromptSource,
    ReasoningGymSource,
    VerifiersSource,
)
from rlpipe.config.eval import EvalConfig
from rlpipe.config.errors import ConfigError, error_line, first_line, one_line, report_line
from rlpipe.config.help import describe, help_text
from rlpipe.config.learner import LearnerConfig
from rlpipe.config.loading import default_recipe, find_recipe, load_config, load_yaml, recipes_dir
from rlpipe.config.metrics import TRACKERS, MetricsConfig
from rlpipe.config.model import KernelsConfig, ModelConfig
from rlpipe.config.placement import PlacementConfig, RolePlacement
from rlpipe.config.ray import RayConfig
from rlpipe.config.reward import RewardConfig, RewardFunctionConfig
from rlpipe.config.rollout import ENGINE_PLATFORMS, MAX_TEMPERATURE, EnginePlatform, RolloutConfig, torchtpu_refusal
from rlpipe.config.run import RunConfig
from rlpipe.config.scorer import ScorerConfig
from rlpipe.config.sync import SyncConfig
from rlpipe.config.train import TrainConfig
from rlpipe.config.tree import Config

__all__ = [
    "ENGINE_PLATFORMS", "MAX_TEMPERATURE", "RENDERING_ARGUMENTS", "TRACKERS",
    "AlgoConfig", "Config", "ConfigError", "DataConfig", "EnginePlatform", "EvalConfig", "FileSource",
    "HumanEvalSource", "KernelsConfig",
    "LearnerConfig", "MetricsConfig", "ModelConfig", "PromptSource", "ReasoningGymSource", "VerifiersSource",
    "PlacementConfig", "RayConfig", "RewardConfig", "RewardFunctionConfig", "RolePlacement", "RolloutConfig",
    "RunConfig", "ScorerConfig", "SyncConfig", "TrainConfig",
    "default_recipe", "describe", "error_line", "find_recipe", "first_line", "help_text", "load_config", "load_yaml",
    "one_line", "recipes_dir", "report_line",
    "torchtpu_refusal",
]
