"""LLM providers: the protocol, an OpenAI-compatible client and an offline echo."""

from worker.agent.providers.base import (
    GenerationSettings,
    LLMProvider,
    LLMResponse,
    ProviderError,
    ToolCallRequest,
)
from worker.agent.providers.echo import EchoProvider
from worker.agent.providers.openai_provider import OpenAIProvider

__all__ = [
    "EchoProvider",
    "GenerationSettings",
    "LLMProvider",
    "LLMResponse",
    "OpenAIProvider",
    "ProviderError",
    "ToolCallRequest",
]
