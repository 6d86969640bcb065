"""Serving: requests, a scheduler and a step loop over one loaded model (no HTTP here)."""

from engine.serving.engine import ServingEngine, ShuttingDown
from engine.serving.request import Delta, Event, Failed, Finished, Request, Usage
from engine.serving.scheduler import QueueFull
from engine.serving.sequence import PromptTooLong, check_prompt

__all__ = ["Delta", "Event", "Failed", "Finished", "PromptTooLong", "QueueFull", "Request", "ServingEngine",
           "ShuttingDown", "Usage", "check_prompt"]
