"""sglite.frontend: the structured-generation DSL (SGLang-compatible) — no torch here.

    import sglite
    @sglite.function
    def qa(s, question):
        s += sglite.user(question)
        s += sglite.assistant(sglite.gen("answer", max_tokens=32))
    sglite.set_default_backend(sglite.Engine())
    state = qa.run(question="What is 2+2?", temperature=0)
    print(state["answer"])

Modules: ir (expressions), api (builders), function (@function: run/run_batch/trace/bind),
state (ProgramState, fork groups), executor (per-stream worker), interpreter (run one
program), tracer (request graph), compiler (graph passes: role checks, prefix hoisting),
choices (select methods), chat_template, backend (Backend, EngineBackend), runtime_endpoint
(HTTP), runtime (Runtime: a server in a child process), openai_backend (OpenAI-compatible
servers), global_config (SGLang's process-wide settings), sglang_alias (``import sglang``
→ sglite), testing (FakeBackend).
"""
from .api import (assistant, assistant_begin, assistant_end, flush_cache, gen, gen_int, gen_string,
                  get_server_info, select, set_default_backend, system, system_begin, system_end, user,
                  user_begin, user_end)
from .backend import Backend, EngineBackend
from .chat_template import ChatTemplate
from .choices import (ChoicesDecision, greedy_token_selection, token_length_normalized,
                      unconditional_likelihood_normalized)
from .function import Function, function
from .global_config import GlobalConfig, global_config
from .ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR
from .openai_backend import OpenAI
from .runtime import Runtime
from .runtime_endpoint import RuntimeEndpoint
from .state import ProgramState, ProgramStateGroup

__all__ = [
    "function", "Function", "gen", "gen_int", "gen_string", "select", "system", "user", "assistant",
    "system_begin", "system_end", "user_begin", "user_end", "assistant_begin", "assistant_end",
    "set_default_backend", "flush_cache", "get_server_info", "Backend", "EngineBackend", "RuntimeEndpoint",
    "ChatTemplate", "ChoicesDecision", "token_length_normalized", "greedy_token_selection",
    "unconditional_likelihood_normalized", "ProgramState", "ProgramStateGroup",
    "REGEX_INT", "REGEX_FLOAT", "REGEX_BOOL", "REGEX_STR", "global_config", "GlobalConfig", "Runtime", "OpenAI",
]
