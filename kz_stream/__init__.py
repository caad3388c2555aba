"""kz_stream: an event-sourced pipeline that trains LLMs to write GPU kernels."""

__version__ = "0.1.0"
