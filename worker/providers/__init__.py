"""LLM providers: the protocol, an OpenAI-compatible client and an offline echo."""

from worker.providers.base import (
    GenerationSettings,
    LLMProvider,
    LLMResponse,
    ProviderError,
    ToolCallRequest,
)
from worker.providers.echo import EchoProvider
from worker.providers.openai_provider import OpenAIProvider

__all__ = [
    "EchoProvider",
    "GenerationSettings",
    "LLMProvider",
    "LLMResponse",
    "OpenAIProvider",
    "ProviderError",
    "ToolCallRequest",
]
