"""``sglite.lang.ir``: the module path SGLang programs import the dtype regexes from
(``sglang/lang/ir.py``); the definitions live in :mod:`sglite.frontend.ir`.

``REGEX_INT`` = ``[-+]?[0-9]+[ \\n]*``, ``REGEX_FLOAT`` = ``[-+]?[0-9]*\\.?[0-9]+[ \\n]*``,
``REGEX_BOOL`` = ``(True|False)``, ``REGEX_STR`` = a double-quoted run of word characters and
whitespace (no punctuation, as upstream).
"""
from sglite.frontend.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR

__all__ = ["REGEX_INT", "REGEX_FLOAT", "REGEX_BOOL", "REGEX_STR"]
