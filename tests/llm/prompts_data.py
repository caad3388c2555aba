"""Prompts shared by the backend tests."""

from __future__ import annotations

from kz_stream.llm import ChatMessage

CHAT: list[ChatMessage] = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name one prime number."},
]
TEXT = "def add(a, b):"
