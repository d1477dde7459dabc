"""A user tool for the environment service's tests (environment.tools: ["environment_tools:Echo"])."""

from __future__ import annotations

from typing import Any, ClassVar

from reinforce.core.environment_api import Observation
from reinforce.environment.tools import Tool, ToolError


class Echo(Tool):
    name = "echo"
    description = "Answers with its text."
    parameters: ClassVar[dict[str, Any]] = {"type": "object", "properties": {"text": {"type": "string"}}}

    async def step(self, arguments: dict[str, Any]) -> Observation:
        if not isinstance(arguments.get("text"), str):
            raise ToolError('error: "text" must be a string')
        return Observation(text=arguments["text"], tool=self.name)
