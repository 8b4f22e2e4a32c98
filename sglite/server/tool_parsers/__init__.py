"""Tool-call parsers per model family (``--tool-call-parser``): the formats as data
(:mod:`.formats`), JSON-shaped calls (:mod:`.json_calls`), Python-list calls (:mod:`.pythonic`)."""
from .formats import (DEFAULT_FORMAT, FORMATS, ToolCallFormat, detect_format, get_format,
                      tool_call_parser_names)

__all__ = ["DEFAULT_FORMAT", "FORMATS", "ToolCallFormat", "detect_format", "get_format", "tool_call_parser_names"]
