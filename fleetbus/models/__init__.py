"""Models: the ``ChatModel`` seam every agent reasons through, the
OpenAI-compatible adapter (its wire format and text protocol), the offline
model, models served on the bus (``BusChatModel`` and the ``ModelWorker`` that
serves them), model strings and settings (``model_from_string``,
``ModelSettings``, ``ModelEnvironment``), the default model of a fleet, and the ``SpeechModel`` seam
with ``EspeakSpeech``. Never imports ``agents``."""

from typing import TYPE_CHECKING, Any

from fleetbus.models.bus_model import BusChatModel
from fleetbus.models.defaults import default_model, default_model_config, describe_default_model
from fleetbus.models.model import (
    FINISH_TOOL,
    ChatModel,
    ModelConfig,
    ModelError,
    ModelRequest,
    ModelResponse,
    TextDelta,
    ThinkingDelta,
)
from fleetbus.models.model_worker import ModelWorker
from fleetbus.models.offline import OfflineModel
from fleetbus.models.settings import ModelEnvironment, ModelSettings
from fleetbus.models.speech import EspeakSpeech, SpeechError, SpeechModel, speak_to_file
from fleetbus.models.strings import (
    BusModelRef,
    load_model_settings,
    model_config_from_settings,
    model_from_string,
)

if TYPE_CHECKING:
    from fleetbus.models.openai_model import OpenAIChatModel, OpenAIConfig


def __getattr__(name: str) -> Any:
    # The OpenAI adapter imports the openai SDK, slow to import: only when
    # asked for, so a process that never uses it does not pay for it.
    if name in ("OpenAIChatModel", "OpenAIConfig"):
        from fleetbus.models import openai_model

        return getattr(openai_model, name)
    raise AttributeError(f"module 'fleetbus.models' has no attribute {name!r}")


__all__ = [
    "FINISH_TOOL",
    "BusChatModel",
    "BusModelRef",
    "ChatModel",
    "EspeakSpeech",
    "ModelConfig",
    "ModelEnvironment",
    "ModelError",
    "ModelRequest",
    "ModelResponse",
    "ModelSettings",
    "ModelWorker",
    "OfflineModel",
    "OpenAIChatModel",
    "OpenAIConfig",
    "SpeechError",
    "SpeechModel",
    "TextDelta",
    "ThinkingDelta",
    "default_model",
    "default_model_config",
    "describe_default_model",
    "load_model_settings",
    "model_config_from_settings",
    "model_from_string",
    "speak_to_file",
]
